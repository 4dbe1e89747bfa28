"""The program a sandbox runs while its agent is forked in from the zygote (agent start `fork`).

bwrap sets a sandbox up (namespaces, mounts, its init, the seccomp filter, the capabilities)
and then runs one command as its first process, which the sandbox lives as long as: today the
agent. To fork the agent instead (docs/design/agent-zygote.md), bwrap runs this: a program
that writes one byte to its stdout (the server learns the sandbox is set up) and then reads
its stdin until the agent, who holds the pipe's only write end, is gone; it then exits, and
bwrap ends the sandbox as it does when the agent exits today.

It is the agent's, not the template's: a static ELF of three system calls, written here, so
that it needs nothing of the template (no shell, no libc) and nothing a tenant changed on a
disk runs before the agent confines itself. It runs after bwrap has loaded the sandbox's
seccomp filter and dropped to the sandbox's capabilities, as every command does.

    write(1, sp, 1); read(0, sp, 1); exit_group(0)

x86_64 only for now: elsewhere the agent is started by exec, as before (`code()` is None).
"""

from __future__ import annotations

import platform
import struct

NAME = "hold"

_X86_64 = bytes.fromhex(
    "b801000000"  # mov eax, 1          write
    "bf01000000"  # mov edi, 1          fd 1
    "4889e6"  # mov rsi, rsp            a byte of the stack (its content does not matter)
    "ba01000000"  # mov edx, 1          one byte
    "0f05"  # syscall
    "31c0"  # xor eax, eax              read (rsi and rdx survive a syscall)
    "31ff"  # xor edi, edi              fd 0
    "0f05"  # syscall                   until a byte or the end of the pipe
    "b8e7000000"  # mov eax, 231        exit_group
    "31ff"  # xor edi, edi              status 0
    "0f05"  # syscall
)
_MACHINES = {"x86_64": (0x3E, _X86_64)}
_BASE = 0x400000
_EHDR = 64
_PHDR = 56


def code(machine: str | None = None) -> bytes | None:
    """The program as an ELF executable for `machine` (this host's by default), or None."""
    found = _MACHINES.get(machine or platform.machine())
    if found is None:
        return None
    e_machine, text = found
    size = _EHDR + _PHDR + len(text)
    entry = _BASE + _EHDR + _PHDR
    ident = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)  # 64-bit, little-endian, SysV
    ehdr = ident + struct.pack(
        "<HHIQQQIHHHHHH",
        2,  # ET_EXEC
        e_machine,
        1,  # EV_CURRENT
        entry,
        _EHDR,  # the program header right after this one
        0,  # no section headers
        0,
        _EHDR,
        _PHDR,
        1,  # one program header
        0,
        0,
        0,
    )
    phdr = struct.pack(
        "<IIQQQQQQ",
        1,  # PT_LOAD
        5,  # PF_R | PF_X
        0,  # the whole file, from its start
        _BASE,
        _BASE,
        size,
        size,
        0x1000,
    )
    return ehdr + phdr + text
