"""Isolation tiers run by an OCI runtime binary: `container` (runc) and, later, `gvisor` (runsc).

They share the process tier's host scaffolding (uid blocks, the server-made user namespace,
workspace images, the copy-on-write template root, cgroups, the agent and /etc trees) and
replace only how a sandbox is started, stopped and told alive: an OCI bundle handed to the
runtime binary instead of a bwrap command line. See runtime.py and bundle.py.
"""
