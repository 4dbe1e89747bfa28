"""The egress proxy: everything that leaves a sandbox goes through here.

A sandbox has no route out. The server listens on the sandbox's own loopback (a socket it
creates inside the sandbox's network namespace) and speaks HTTP proxy (CONNECT and plain) and
SOCKS5 there; it decides each destination against the sandbox's policy, the tenant's ceiling
and the operator's deny list, resolves names itself and refuses internal addresses, swaps
secret placeholders for real values on requests to their bound hosts (and scrubs the values out
of what those hosts send back), and records every attempt.
"""
