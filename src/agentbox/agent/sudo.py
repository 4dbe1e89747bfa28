#!/usr/bin/python3 -IS
"""sudo for agentbox sandboxes: asks the sandbox's agent to run a command as root.

Installed as /.agentbox/bin/sudo, ahead of /usr/bin on PATH. A setuid sudo cannot work in
a sandbox (no_new_privs ignores setuid bits), so this hands the command, its environment and
its stdin/stdout/stderr to the agent (see users.py), which runs it as the sandbox's root; the
sandbox's `user` needs no password, as on E2B. Understands the usual options: -u, -i, -s, -E,
-H, -n, -S, -k, -K, -v, -l, -h, -V, VAR=value before the command, and --.
"""

import array
import json
import os
import signal
import socket
import sys
from typing import NoReturn

SOCKET = b"\0agentbox-sudo"
USAGE = """usage: sudo [-EHnSk] [-u user] [VAR=value...] command [args...]
       sudo -i | -s [command]
       sudo -v | -l | -k | -K | -V | -h
Runs a command as the sandbox's root (no password: the sandbox is yours)."""
KNOWN_USERS = {"root": "root", "0": "root", "user": "user", "1000": "user"}


def fail(message: str, code: int = 1) -> NoReturn:
    sys.stderr.write(f"sudo: {message}\n")
    sys.exit(code)


def parse(args: list[str]) -> tuple[str, str | None, list[str], dict]:
    """(user, shell mode "login"/"shell"/None, command, extra env)."""
    user, mode, env = "root", None, {}
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            i += 1
            break
        if not a.startswith("-") or a == "-":
            break
        if a.startswith("--"):
            name, eq, value = a[2:].partition("=")
            if name == "user":
                if not eq:
                    i += 1
                    value = args[i] if i < len(args) else fail("option requires an argument -- u")
                user = value
            elif name in ("login", "shell", "preserve-env", "set-home", "non-interactive",
                          "stdin", "reset-timestamp", "remove-timestamp", "validate", "list",
                          "help", "version"):
                letter = {"login": "i", "shell": "s", "preserve-env": "E", "set-home": "H",
                          "non-interactive": "n", "stdin": "S", "reset-timestamp": "k",
                          "remove-timestamp": "K", "validate": "v", "list": "l",
                          "help": "h", "version": "V"}[name]
                args = [*args[:i], f"-{letter}", *args[i + 1:]]
                continue
            else:
                fail(f"unrecognized option '{a}'\n{USAGE}")
            i += 1
            continue
        j = 1
        while j < len(a):
            c = a[j]
            if c == "u":
                rest = a[j + 1:]
                if not rest:
                    i += 1
                    rest = args[i] if i < len(args) else fail("option requires an argument -- u")
                user = rest
                break
            if c == "i":
                mode = "login"
            elif c == "s":
                mode = "shell"
            elif c in "EHnSPb":
                pass  # the environment is kept, no password is ever asked
            elif c in "kK":
                if len(args) == i + 1:
                    sys.exit(0)
            elif c == "v":
                sys.exit(0)
            elif c == "l":
                print("User may run the following commands on sandbox:")
                print("    (ALL : ALL) NOPASSWD: ALL")
                sys.exit(0)
            elif c == "h":
                print(USAGE)
                sys.exit(0)
            elif c == "V":
                print("Sudo version 1.9 (agentbox: asks the sandbox's agent)")
                sys.exit(0)
            else:
                fail(f"invalid option -- '{c}'\n{USAGE}")
            j += 1
        i += 1
    command = args[i:]
    while command and "=" in command[0] and not command[0].startswith("="):
        name, _, value = command.pop(0).partition("=")
        env[name] = value
    if user.startswith("#"):
        user = user[1:]
    if user not in KNOWN_USERS:
        fail(f"unknown user {user}")
    return KNOWN_USERS[user], mode, command, env


def main() -> int:
    user, mode, command, extra = parse(sys.argv[1:])
    if mode is not None:
        shell = "/bin/bash"
        if mode == "login":
            argv = [shell, "-l"] + (["-c", " ".join(command)] if command else [])
        else:
            argv = [shell] + (["-c", " ".join(command)] if command else [])
    elif not command:
        fail(USAGE)
    else:
        argv = command
    env = dict(os.environ)
    env.update(extra)
    caller = {"uid": str(os.getuid()), "gid": str(os.getgid())}
    name = "root" if user == "root" else "user"
    env.update(
        HOME="/root" if name == "root" else "/workspace",
        USER=name,
        LOGNAME=name,
        SUDO_USER=os.environ.get("USER", "user"),
        SUDO_UID=caller["uid"],
        SUDO_GID=caller["gid"],
        SUDO_COMMAND=" ".join(argv),
    )
    try:
        cwd = os.getcwd()
    except OSError:
        cwd = "/"
    request = json.dumps({"argv": argv, "env": env, "cwd": cwd, "user": user}).encode() + b"\n"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(SOCKET)
    except OSError as e:
        fail(f"the sandbox's root is not available here ({e.strerror}): this sandbox runs "
             "everything as one user")
    fds = array.array("i", [0, 1, 2])
    s.sendmsg([request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds.tobytes())])

    def forward(sig: int, _frame: object) -> None:
        try:
            s.sendall(json.dumps({"signal": sig}).encode() + b"\n")
        except OSError:
            pass

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, forward)
    buf = b""
    while not buf.endswith(b"\n"):
        try:
            data = s.recv(65536)
        except InterruptedError:
            continue
        if not data:
            fail("the sandbox's agent went away")
        buf += data
    reply = json.loads(buf)
    if "error" in reply:
        fail(reply["error"])
    return int(reply["exit"])


if __name__ == "__main__":
    sys.exit(main())
