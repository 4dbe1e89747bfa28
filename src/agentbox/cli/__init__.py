"""The `agentbox` command line.

`main` is the installed `agentbox` command: `agentbox exec` on the short path of
`agentbox.cli.quick` when that path can take it (the standard library only: a tenth of the full
CLI's start-up), else the full CLI of `agentbox.cli.app`, typer's, for everything.
"""

from __future__ import annotations

import sys


def main() -> None:
    from agentbox.cli import quick

    try:
        status = quick.run(sys.argv[1:])
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        quick.reader_left()
    if status is None:
        from agentbox.cli.app import main as full

        full()
    else:
        sys.exit(status)
