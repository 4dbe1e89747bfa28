"""Entry point of the in-sandbox agent: `python3 -E -s -S /.agentbox/main.py --listen-fd N`."""

import sandbox_agent

sandbox_agent.main()
