"""`python -m agentbox.cli`: the `agentbox` command, as installed."""

from agentbox.cli import main

main()
