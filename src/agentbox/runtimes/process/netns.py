"""Sockets that live in a sandbox's network namespace but belong to the server process.

A sandbox has only loopback. The egress proxy must appear on that loopback, and the ports
gateway must reach servers listening there, without giving the sandbox an interface or a route.
A socket belongs to the network namespace its creator was in at `socket()`: so a worker thread
enters the sandbox's namespace (setns), creates the socket, and returns to the host's. The socket
is then used from the event loop like any other; the sandbox cannot close or take it over.

setns changes only the calling thread, so one dedicated worker does it, and checks after every
switch that it is back in the host namespace: a thread stuck in a sandbox would put the next
socket in the wrong place.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


class NetnsError(Exception):
    """A socket could not be made in the sandbox's network namespace."""


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _thread_netns_inode() -> int:
    return os.stat(f"/proc/self/task/{threading.get_native_id()}/ns/net").st_ino


class NamespaceSockets:
    """Per-sandbox namespace handles, and the one worker that makes sockets inside them."""

    def __init__(self) -> None:
        self._host_fd = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        self._host_ino = os.fstat(self._host_fd).st_ino
        self._fds: dict[str, int] = {}
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="agentbox-netns")

    def open(self, sandbox_id: str, pid: int, still_same: Callable[[], bool]) -> None:
        """Hold the namespace of `pid` (a process of the sandbox) for later sockets.

        `still_same()` is checked after opening: the pid could have been reused by another
        process in between, and only the sandbox's own namespace may be held."""
        fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        if not still_same() or os.fstat(fd).st_ino == self._host_ino:
            os.close(fd)
            raise NetnsError(f"sandbox {sandbox_id} has no network namespace of its own")
        old = self._fds.pop(sandbox_id, None)
        if old is not None:
            os.close(old)
        self._fds[sandbox_id] = fd

    def close(self, sandbox_id: str) -> None:
        fd = self._fds.pop(sandbox_id, None)
        if fd is not None:
            os.close(fd)

    def _make(self, ns_fd: int, family: int, listen_port: int | None) -> socket.socket:
        _setns(ns_fd)
        try:
            # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say so, and
            # with Nagle on, a response written in two parts waits 40 ms for a delayed ACK.
            sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
            try:
                if listen_port is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    sock.bind(("127.0.0.1", listen_port))
                    sock.listen(512)
            except BaseException:
                sock.close()
                raise
        finally:
            try:
                _setns(self._host_fd)
            finally:
                if _thread_netns_inode() != self._host_ino:
                    # Never hand this thread another job: replace the worker.
                    self._worker.shutdown(wait=False)
                    self._worker = ThreadPoolExecutor(1, thread_name_prefix="agentbox-netns")
                    raise NetnsError("could not return to the host network namespace")
        sock.setblocking(False)
        return sock

    async def _in_sandbox(
        self, sandbox_id: str, family: int, listen_port: int | None
    ) -> socket.socket:
        fd = self._fds.get(sandbox_id)
        if fd is None:
            raise NetnsError(f"sandbox {sandbox_id} has no network namespace held")
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._worker, self._make, fd, family, listen_port)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise NetnsError(
                    f"port {listen_port} on the loopback of sandbox {sandbox_id} is taken"
                ) from None
            raise NetnsError(f"sandbox {sandbox_id}: {e}") from None

    async def listen(self, sandbox_id: str, port: int) -> socket.socket:
        return await self._in_sandbox(sandbox_id, socket.AF_INET, port)

    async def connect(self, sandbox_id: str, port: int, timeout: float) -> socket.socket:
        """A connection to `port` on the sandbox's loopback (IPv4, then IPv6)."""
        loop = asyncio.get_running_loop()
        refused: OSError | None = None
        for family, addr in (
            (socket.AF_INET, ("127.0.0.1", port)),
            (socket.AF_INET6, ("::1", port)),
        ):
            sock = await self._in_sandbox(sandbox_id, family, None)
            try:
                await asyncio.wait_for(loop.sock_connect(sock, addr), timeout)
                return sock
            except (ConnectionRefusedError, OSError) as e:
                sock.close()
                if isinstance(e, ConnectionRefusedError) or e.errno in (
                    errno.ECONNREFUSED,
                    errno.EADDRNOTAVAIL,
                    errno.EAFNOSUPPORT,
                ):
                    refused = refused or e
                    continue
                raise
            except BaseException:
                sock.close()
                raise
        raise ConnectionRefusedError(
            errno.ECONNREFUSED, f"nothing listens on port {port}"
        ) from refused

    def shutdown(self) -> None:
        """Close every handle; idempotent (a runtime may be closed twice)."""
        for sid in list(self._fds):
            self.close(sid)
        self._worker.shutdown(wait=False)
        if self._host_fd >= 0:
            os.close(self._host_fd)
            self._host_fd = -1
