"""The in-sandbox agent and its wire protocol.

`sandbox_agent.py`, `protocol.py` and `main.py` are copied into nothing: the runtime bind-mounts
this directory read-only into each sandbox and runs `main.py` with the sandbox's own Python. They
use the standard library only. The control plane imports only `protocol`.
"""
