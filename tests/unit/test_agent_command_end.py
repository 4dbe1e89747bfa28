"""When the agent says a command ended: after its output, even from a pipe reader the machine
had not run yet; but not later than ~0.2 s for a daemon that keeps its pipe open and idle.
The agent's command code, in this process (as root, the host's bash)."""

from __future__ import annotations

import os
import secrets
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src/agentbox/agent"))
import sandbox_agent as A  # noqa: E402

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the agent's commands run as root here")


def _where(tmp_path: Path) -> dict[str, str]:
    return {"cwd": str(tmp_path), "cmd_id": f"test-end-{secrets.token_hex(8)}"}


def _ended(c: A.Command, timeout: float = 20) -> bytes:
    """The command's stdout as it stood when its end was recorded."""
    with c.cond:
        assert c.cond.wait_for(lambda: c.ended_at is not None, timeout), "no end"
        return b"".join(data for stream, _, data in c.chunks if stream == A.P.STDOUT)


def test_output_a_late_reader_has_not_read_yet_comes_before_the_end(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Both pipe readers start 0.6 s late (a busy machine): the command is long gone by then,
    and its output must still be in what the end reports (it was dropped when the end came
    0.2 s after the exit whatever the readers had done)."""
    original = A.Commands._read

    def late(c: A.Command, stream: int, pipe: object) -> None:
        time.sleep(0.6)
        original(c, stream, pipe)  # type: ignore[arg-type]

    monkeypatch.setattr(A.Commands, "_read", staticmethod(late))
    c = A.Commands().start({"cmd": "printf 'first\\nsecond\\n'", **_where(tmp_path)})
    assert _ended(c) == b"first\nsecond\n"
    assert c.exit_code == 0


def test_an_idle_daemon_holding_the_pipe_does_not_hold_the_end(tmp_path: Path) -> None:
    t0 = time.monotonic()
    c = A.Commands().start({"cmd": "sleep 30 & echo started", **_where(tmp_path)})
    try:
        assert _ended(c) == b"started\n"
        assert time.monotonic() - t0 < 2.0
    finally:
        # Its process group (it leads one), never A.kill_tree: on the host that would also
        # signal any process whose environment names the same command id.
        os.killpg(c.pid, signal.SIGKILL)
