"""The in-sandbox agent: runs commands and file operations on the control plane's behalf.

It runs inside the sandbox as the sandbox's own root (its user namespace's, with the few
capabilities users.py describes), which sandboxed code may also use (`sudo`, `user="root"`), so
it cannot do anything the sandboxed code could not: it is a convenience, not a trust anchor.
Commands and file operations act as `user` unless asked for root. It listens on a Unix socket
it inherits from the runtime (the socket's path lives outside the sandbox), speaks the framed
protocol in `protocol.py`, and owns the state that must outlive a restart of the control plane:
running commands and their buffered output.

Standard library only, and lean on purpose: one of these idles in every sandbox, so modules that
only commands need are imported on first use.
"""

from __future__ import annotations

import _socket  # not `socket`: its enum/selectors imports cost ~5 ms per sandbox start
import ctypes
import errno
import os
import stat
import sys
import threading
import time

import protocol as P
import users

TYPE_CHECKING = False
if TYPE_CHECKING:  # the agent imports subprocess lazily: most sandboxes idle without it
    import queue
    import subprocess
    from typing import IO

WORKSPACE = "/workspace"
DEFAULT_CWD = WORKSPACE  # where commands start: the template's working dir (the agent's cwd)
CHANNEL_DIR = ""  # the host directory its socket is in (--listen-path), if any
# Layers switched off for the security battery's positive controls (runtimes/process/weaken.py);
# empty in every real sandbox.
WEAKENED: frozenset = frozenset()
LEAKED_FD = -1
MAX_PATH = 4096
# Output buffered per command. With a client attached the command waits for it (its pipe
# fills and its writes block: nothing is lost); with none, the oldest is dropped beyond this and
# whoever reads later is told how much and where (a `truncated` event).
OUTPUT_CAP = 4 * 1024 * 1024
# Unread output kept in all, across the sandbox's commands (running and the FINISHED_KEPT last
# finished): past it, the oldest output of the oldest commands goes first. It is held in the
# agent, so in the sandbox's own memory.
SPOOL_BUDGET = 16 * 1024 * 1024
FINISHED_KEPT = 32
LIST_LIMIT = P.LIST_LIMIT
STDERR_TAIL = 4096
KEEPALIVE_S = 15.0
READ_POLL_MS = 500  # how soon a pipe reader left behind by an ended command goes
READERS_BEHIND_S = 5.0  # how long an ended command's output may still be on its way
HANGUP_POLL_S = 0.5  # how soon a running cell notices its client has gone
UPLOAD_PREFIX = ".agentbox-upload-"  # a file being written; renamed into place when whole
TERMINAL_INPUT_S = 2.0  # input to a terminal whose program does not read it waits this long
ENDS_KEPT = 1024  # end events `exec.ended` can still hand out
ENDS_PER_REPLY = 128

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


# ---------------------------------------------------------------- self-confinement


class _PathBeneath(ctypes.Structure):
    """struct landlock_path_beneath_attr"""

    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("fd", ctypes.c_int32)]


def _landlock(writable: list[str]) -> int:
    """Fence the agent and everything it starts: read anywhere visible, write only `writable`.

    The mount setup already makes everything else read-only; Landlock is the second fence in
    case a mount is ever wrong. Returns the ABI used (0 = kernel without Landlock).
    """
    abi = _libc.syscall(444, None, 0, 1)  # landlock_create_ruleset(NULL, 0, VERSION)
    if abi <= 0:
        return 0
    read = (1 << 0) | (1 << 2) | (1 << 3)  # EXECUTE, READ_FILE, READ_DIR
    n_rights = 13 + (abi >= 2) + (abi >= 3) + (abi >= 5)
    handled = (1 << n_rights) - 1
    scoped = 0b11 if abi >= 6 else 0  # abstract unix sockets, signals
    attr = (ctypes.c_uint64 * 3)(handled, 0, scoped)
    size = 8 if abi < 4 else (16 if abi < 6 else 24)
    rfd = _libc.syscall(444, ctypes.byref(attr), size, 0)
    if rfd < 0:
        return 0

    def allow(path: str, rights: int) -> None:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return
        rule = _PathBeneath(rights & handled, fd)
        _libc.syscall(445, rfd, 1, ctypes.byref(rule), 0)  # LANDLOCK_RULE_PATH_BENEATH
        os.close(fd)

    allow("/", read)
    # Device files: read and write (/dev/null, ttys) but nothing that makes or removes entries.
    allow("/dev", read | (1 << 1) | ((1 << 14) if abi >= 3 else 0) | ((1 << 15) if abi >= 5 else 0))
    for path in writable:
        allow(path, handled)
    _libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS (bwrap set it already; required)
    ok = _libc.syscall(446, rfd, 0) == 0  # landlock_restrict_self
    os.close(rfd)
    return abi if ok else 0


# What a writable root leaves intact: the agent's own files, the kernel's views, the devices.
ROOT_KEPT = frozenset({"proc", "dev", "sys", ".agentbox"})


def writable_root_dirs() -> list[str]:
    """The top-level directories of a writable root (the template copy-on-write) that the
    sandbox may write below: all but ROOT_KEPT. Landlock only adds rights, so `/` itself gets
    none: nothing new can be made directly in it."""
    out = []
    for name in os.listdir("/"):
        path = "/" + name
        if name not in ROOT_KEPT and os.path.isdir(path) and not os.path.islink(path):
            out.append(path)
    return out


# ---------------------------------------------------------------- connection helpers


class ConnectionLost(OSError):
    """The client's connection failed (reset, closed, timed out): there is nobody to answer.
    Any other OSError an operation lets out is its own failure, and is answered."""


class Conn:
    def __init__(self, sock: _socket.socket) -> None:
        self.sock = sock
        self.rfile = open(sock.fileno(), "rb", buffering=256 * 1024, closefd=False)
        self.body_done = False  # whether an upload's body has been read to its end

    def _exact(self, n: int) -> bytes:
        try:
            data = self.rfile.read(n)
        except OSError as e:
            raise ConnectionLost(e.errno, e.strerror) from e
        if len(data) != n:
            raise EOFError
        return data

    def recv(self) -> tuple[int, bytes]:
        kind, length = P.HEADER.unpack(self._exact(P.HEADER.size))
        P.check_header(kind, length)
        return kind, self._exact(length) if length else b""

    def send(self, frame: bytes) -> None:
        try:
            self.sock.sendall(frame)
        except OSError as e:
            raise ConnectionLost(e.errno, e.strerror) from e

    def reply(self, obj: dict) -> None:
        self.send(P.encode_json(obj))

    def hung_up(self) -> bool:
        """Whether the client has closed its end (asked of a stream whose client sends
        nothing more)."""
        try:
            return self.sock.recv(1, _socket.MSG_PEEK | _socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True


class OpError(Exception):
    def __init__(self, code: str, message: str, **detail: object) -> None:
        super().__init__(message)
        self.reply = P.error(code, message, **detail)


# ---------------------------------------------------------------- paths


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04

_ERRNO_CODES = {
    errno.ENOENT: ("path_not_found", "no such file or directory"),
    errno.EEXIST: ("path_exists", "the path already exists"),
    errno.ENOTDIR: ("not_a_directory", "a component of the path is not a directory"),
    errno.EISDIR: ("is_a_directory", "the path is a directory"),
    errno.ENOTEMPTY: ("conflict", "the directory is not empty"),
    errno.EBUSY: ("conflict", "the path is in use (a mount point cannot be moved or removed)"),
    errno.EACCES: ("permission_denied", "permission denied"),
    errno.EPERM: ("permission_denied", "operation not permitted"),
    errno.ENAMETOOLONG: ("invalid_path", "path or name too long"),
    errno.EXDEV: ("conflict", "cannot move across filesystems (e.g. /workspace and /tmp)"),
    errno.ENXIO: ("not_a_regular_file", "the path is a device or socket with no reader"),
    errno.ENODEV: ("not_a_regular_file", "the path is a device that cannot be read"),
}
_VIOLATIONS = {
    errno.EROFS: (
        "read_only_path",
        "path",
        "only /workspace and /tmp are writable in the sandbox; write there instead",
    ),
    errno.ENOSPC: (
        "disk_limit",
        "resources.disk_mb",
        "the workspace is full; remove files or create the sandbox with a larger resources.disk_mb",
    ),
    errno.EDQUOT: (
        "disk_limit",
        "resources.disk_mb",
        "the workspace is full; create the sandbox with a larger resources.disk_mb",
    ),
    errno.EFBIG: (
        "file_size_limit",
        "resources.file_size_mb",
        "the file exceeds the per-file size limit; raise resources.file_size_mb",
    ),
}


# The sandbox's tmpfs mounts, sized by resources.tmp_mb (not the workspace's disk_mb).
TMP_MOUNTS = ("/tmp", "/var/tmp", "/dev/shm")
_TMP_FULL = (
    "disk_limit",
    "resources.tmp_mb",
    "/tmp is full (a tmpfs in memory, like /var/tmp and /dev/shm); remove files there, write "
    "large files to /workspace, or create the sandbox with a larger resources.tmp_mb",
)


def under_tmp(path: str) -> bool:
    return any(path == m or path.startswith(m + "/") for m in TMP_MOUNTS)


def full_filesystems(stderr_tail: bytes) -> list[str]:
    """The writable mounts with (almost) no room left, after a command that reported ENOSPC:
    its error line often names no path, so the server tells /tmp from the workspace by this."""
    if b"No space left on device" not in stderr_tail:
        return []
    full = []
    for mount in (WORKSPACE, *TMP_MOUNTS):
        try:
            st = os.statvfs(mount)
        except OSError:
            continue
        size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        if size and free < max(1 << 20, size // 50):
            full.append(mount)
    return full


def os_error(e: OSError, path: str) -> OpError:
    if e.errno in _VIOLATIONS:
        code, setting, message = _VIOLATIONS[e.errno]
        if e.errno == errno.ENOSPC and under_tmp(path):
            code, setting, message = _TMP_FULL
        return OpError(
            "limit_exceeded" if code != "read_only_path" else "read_only_path",
            f"{path}: {message}",
            path=path,
            violation={"code": code, "setting": setting, "message": message},
        )
    if e.errno == errno.ELOOP:
        return _symlink_error(path)
    code, message = _ERRNO_CODES.get(e.errno or 0, ("io_error", os.strerror(e.errno or 0)))
    return OpError(code, f"{path}: {message}", path=path, errno=e.errno)


def _symlink_error(path: str) -> OpError:
    cur = ""
    for part in path.strip("/").split("/"):
        cur += "/" + part
        try:
            if stat.S_ISLNK(os.lstat(cur).st_mode):
                target = os.readlink(cur)
                return OpError(
                    "symlink_refused",
                    f"{cur} is a symbolic link (to {target}); the files API never follows "
                    "symlinks: use the real path",
                    path=path,
                    link=cur,
                    target=target,
                )
        except OSError:
            break
    return OpError("symlink_refused", f"{path}: the path goes through a symbolic link", path=path)


def parse_path(raw: object) -> list[str]:
    """Split a user path into components, refusing every form of trickery up front."""
    if not isinstance(raw, str) or raw == "":
        raise OpError("invalid_path", "path must be a non-empty string")
    if "\x00" in raw:
        raise OpError("invalid_path", "path contains a NUL byte")
    if len(raw.encode("utf-8", "surrogateescape")) > MAX_PATH:
        raise OpError("invalid_path", f"path is longer than {MAX_PATH} bytes")
    full = raw if raw.startswith("/") else f"{WORKSPACE}/{raw}"
    parts = [p for p in full.split("/") if p not in ("", ".")]
    if ".." in parts and "unconfined-paths" not in WEAKENED:
        raise OpError(
            "invalid_path", f"{raw}: '..' is not allowed in paths; use an absolute path", path=raw
        )
    if parts[:2] == ["home", "user"] and _home_is_workspace():
        parts = [p for p in WORKSPACE.split("/") if p] + parts[2:]  # E2B's home: the link's
    return parts


def _home_is_workspace() -> bool:
    """Whether /home/user is the link to the workspace that agents before the /home/user mount
    made (it lives on in disks snapshotted or parked then): the one symlink the files API
    resolves, since no one in the sandbox but its root may change it, and a link that root has
    changed is followed no more. Today the runtime mounts the workspace there (a mount point,
    no link to resolve)."""
    try:
        return os.readlink("/home/user") == WORKSPACE
    except OSError:
        return False


def join(parts: list[str]) -> str:
    return "/" + "/".join(parts)


def open_dir(parts: list[str], flags: int = os.O_PATH) -> int:
    """Open a directory with no symlink anywhere on the way (openat2 RESOLVE_NO_SYMLINKS)."""
    path = join(parts)
    if "unconfined-paths" in WEAKENED:
        try:
            return os.open(path, flags | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise os_error(e, path) from None
    global _OPENAT2
    if _OPENAT2:
        how = _OpenHow(
            flags | os.O_DIRECTORY | os.O_CLOEXEC, 0, _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS
        )
        raw = path.encode("utf-8", "surrogateescape")
        fd = _libc.syscall(437, -100, raw, ctypes.byref(how), ctypes.sizeof(how))
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err != errno.ENOSYS:
            raise os_error(OSError(err, ""), path)
        _OPENAT2 = False  # a kernel without it (gVisor's): the same walk by hand
    return _walk_dirs(parts, flags)


_OPENAT2 = True


def _walk_dirs(parts: list[str], flags: int) -> int:
    """open_dir without openat2: one component at a time from /, none followed if a symlink
    (O_NOFOLLOW with O_DIRECTORY refuses one: ELOOP, as openat2 says)."""
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, name in enumerate(parts):
            last = i == len(parts) - 1
            mode = (flags if last else os.O_PATH) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                nxt = os.open(name, mode, dir_fd=fd)
            except OSError as e:
                err = e.errno
                if err == errno.ENOTDIR:
                    try:
                        if stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                            err = errno.ELOOP
                    except OSError:
                        pass
                raise os_error(OSError(err, e.strerror), join(parts[: i + 1])) from None
            os.close(fd)
            fd = nxt
        if not parts and flags != os.O_PATH:
            nxt = os.open("/", flags | os.O_DIRECTORY | os.O_CLOEXEC)
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def parent_of(parts: list[str], create: bool = False) -> int:
    if not parts:
        raise OpError("invalid_path", "this operation needs a path below /")
    if create:
        make_dirs(parts[:-1])
    return open_dir(parts[:-1])


def make_dirs(parts: list[str]) -> bool:
    """mkdir -p without following symlinks; True when the last directory was created."""
    fd = open_dir([])
    created = False
    try:
        for i, name in enumerate(parts):
            try:
                os.mkdir(name, 0o755, dir_fd=fd)
                created = True
            except FileExistsError:
                created = False
            except OSError as e:
                raise os_error(e, join(parts[: i + 1])) from None
            nxt = open_dir(parts[: i + 1])
            os.close(fd)
            fd = nxt
    finally:
        os.close(fd)
    return created


XATTR_PREFIX = "user.e2b."  # a file's metadata (E2B's X-Metadata-* uploads), as xattrs
MAX_XATTRS = 32  # per file
MAX_XATTR_BYTES = 3072  # names and values together: what an ext4 inode keeps without a block


def metadata_of(name: str, path: str, dir_fd: int | None) -> dict:
    """A regular file's metadata (its user.e2b.* xattrs), {} for none or where unsupported."""
    where = f"/proc/self/fd/{dir_fd}/{name}" if dir_fd is not None else path
    try:
        names = os.listxattr(where, follow_symlinks=False)
        return {
            n[len(XATTR_PREFIX) :]: os.getxattr(where, n, follow_symlinks=False).decode(
                "utf-8", "replace"
            )
            for n in [n for n in names if n.startswith(XATTR_PREFIX)][:MAX_XATTRS]
        }
    except OSError:
        return {}


def set_metadata(fd: int, metadata: object, path: str) -> None:
    """A file's metadata as user.e2b.<key> xattrs, within what a file holds."""
    if metadata is None:
        return
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and k for k, v in metadata.items()
    ):
        raise OpError("invalid_request", "metadata must be an object of strings")
    size = sum(len((XATTR_PREFIX + k).encode()) + len(v.encode()) for k, v in metadata.items())
    if len(metadata) > MAX_XATTRS or size > MAX_XATTR_BYTES:
        raise OpError(
            "invalid_request",
            f"file metadata holds at most {MAX_XATTRS} keys and {MAX_XATTR_BYTES} bytes",
        )
    for key, value in metadata.items():
        try:
            os.setxattr(fd, XATTR_PREFIX + key, value.encode())
        except OSError as e:
            if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
                raise OpError(
                    "unsupported", f"{path}: this filesystem keeps no file metadata", path=path
                ) from None
            raise os_error(e, path) from None


def entry(
    name: str, path: str, st: os.stat_result, dir_fd: int | None, metadata: bool = False
) -> dict:
    """A file's entry; with `metadata`, a regular file's user.e2b.* xattrs too (asked for by
    E2B's surface only: one more syscall per file)."""
    mode = st.st_mode
    if stat.S_ISREG(mode):
        kind = "file"
    elif stat.S_ISDIR(mode):
        kind = "dir"
    elif stat.S_ISLNK(mode):
        kind = "symlink"
    else:
        kind = "other"
    target = None
    if kind == "symlink":
        try:
            target = os.readlink(name, dir_fd=dir_fd) if dir_fd is not None else os.readlink(path)
        except OSError:
            pass
    out = {
        "name": name,
        "path": path,
        "type": kind,
        "size": st.st_size,
        "mode": stat.S_IMODE(mode),
        "permissions": stat.filemode(mode)[1:],
        "modified_time": st.st_mtime,
        "symlink_target": target,
    }
    if metadata and kind == "file":
        found = metadata_of(name, path, dir_fd)
        if found:
            out["metadata"] = found
    return out


def stat_entry(parts: list[str], metadata: bool = False) -> dict:
    if not parts:
        return entry("/", "/", os.stat("/"), None)
    pfd = parent_of(parts)
    try:
        st = os.stat(parts[-1], dir_fd=pfd, follow_symlinks=False)
        return entry(parts[-1], join(parts), st, pfd, metadata)
    except OSError as e:
        raise os_error(e, join(parts)) from None
    finally:
        os.close(pfd)


# ---------------------------------------------------------------- file operations


def op_stat(conn: Conn, req: dict) -> None:
    wanted = req.get("metadata") is True
    conn.reply({"ok": True, "entry": stat_entry(parse_path(req.get("path")), wanted)})


def op_read(conn: Conn, req: dict) -> None:
    parts = parse_path(req.get("path"))
    path = join(parts)
    pfd = parent_of(parts)
    try:
        # O_NONBLOCK: opening a FIFO must not hang the agent; cleared below for regular files.
        nofollow = 0 if "unconfined-paths" in WEAKENED else os.O_NOFOLLOW
        fd = os.open(parts[-1], os.O_RDONLY | nofollow | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=pfd)
    except OSError as e:
        raise os_error(e, path) from None
    finally:
        os.close(pfd)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise OpError("is_a_directory", f"{path} is a directory; list it instead", path=path)
        if not stat.S_ISREG(st.st_mode) and "unconfined-paths" not in WEAKENED:
            raise OpError("not_a_regular_file", f"{path} is not a regular file", path=path)
        os.set_blocking(fd, True)
        conn.reply({"ok": True, "size": st.st_size})
        # The size sent is a promise (it becomes Content-Length): a file that grows while it
        # is read is cut at the size it had when opened.
        left = st.st_size if stat.S_ISREG(st.st_mode) else float("inf")
        while left > 0:
            chunk = os.read(fd, int(min(P.CHUNK, left)))
            if not chunk:
                break
            left -= len(chunk)
            conn.send(P.encode(P.KIND_DATA, chunk))
        conn.send(P.encode(P.KIND_END))
    finally:
        os.close(fd)


def _check_destination(pfd: int, name: str, path: str) -> None:
    """A write replaces a regular file; it never goes through a symlink or over a dir."""
    try:
        st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    except OSError as e:
        raise os_error(e, path) from None
    if stat.S_ISDIR(st.st_mode):
        raise OpError("is_a_directory", f"{path} is a directory", path=path)
    if stat.S_ISLNK(st.st_mode):
        raise _symlink_error(path)


def _receive_into(conn: Conn, fd: int, path: str) -> None:
    """Write the client's D frames to `fd` as they come; nothing is held in memory."""
    failed: OpError | None = None
    while True:
        kind, payload = conn.recv()
        if kind == P.KIND_END:
            conn.body_done = True
            break
        if kind != P.KIND_DATA:
            raise OpError("invalid_request", "expected file data")
        view = memoryview(payload)
        while view and failed is None:
            try:
                n = os.write(fd, view)
            except OSError as e:
                failed = os_error(e, path)
                break
            view = view[n:]
    if failed is not None:
        raise failed


def op_write(conn: Conn, req: dict) -> None:
    try:
        _write(conn, req)
    except OpError:
        # The client is still sending the body: read it to the end first, or the reply
        # would be lost in the client's broken pipe.
        while not conn.body_done:
            kind, _ = conn.recv()
            conn.body_done = kind == P.KIND_END
        raise


def _write(conn: Conn, req: dict) -> None:
    parts = parse_path(req.get("path"))
    path = join(parts)
    if not parts:
        raise OpError("invalid_path", "/ is a directory: give the path of a file", path="/")
    if len(parts[-1].encode("utf-8", "surrogateescape")) > 255:
        raise OpError("invalid_path", f"{path}: a file name may be at most 255 bytes", path=path)
    pfd = parent_of(parts, create=True)
    tmp = f"{UPLOAD_PREFIX}{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}"
    fd = -1
    try:
        _check_destination(pfd, parts[-1], path)
        try:
            fd = os.open(
                tmp,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o644,
                dir_fd=pfd,
            )
        except OSError as e:
            raise os_error(e, path) from None
        _receive_into(conn, fd, path)
        set_metadata(fd, req.get("metadata"), path)
        os.close(fd)
        fd = -1
        # Checked again: the destination may have been swapped while the body arrived.
        # rename() itself never follows a symlink at the destination.
        _check_destination(pfd, parts[-1], path)
        try:
            os.rename(tmp, parts[-1], src_dir_fd=pfd, dst_dir_fd=pfd)
        except OSError as e:
            raise os_error(e, path) from None
        tmp = ""
        st = os.stat(parts[-1], dir_fd=pfd, follow_symlinks=False)
        wanted = req.get("metadata") is not None  # the answer shows what was kept
        conn.reply({"ok": True, "entry": entry(parts[-1], path, st, pfd, wanted)})
    finally:
        if fd >= 0:
            os.close(fd)
        if tmp:
            try:
                os.unlink(tmp, dir_fd=pfd)
            except OSError:
                pass
        os.close(pfd)


def op_list(conn: Conn, req: dict) -> None:
    """Entries under a directory, depth first with each directory's names sorted, so the order
    is that of the entries' paths compared component by component. A page ends at `limit`
    entries (or when the reply frame would grow too big) with `truncated`; the next page is
    asked for with `cursor` = the last path of this one (`next_cursor`)."""
    parts = parse_path(req.get("path"))
    depth = req.get("depth", 1)
    if not isinstance(depth, int) or depth < 1:
        raise OpError("invalid_request", "depth must be an integer >= 1")
    limit = req.get("limit", LIST_LIMIT)
    if not isinstance(limit, int) or not 1 <= limit <= LIST_LIMIT:
        raise OpError("invalid_request", f"limit must be an integer from 1 to {LIST_LIMIT}")
    metadata = req.get("metadata") is True
    after = None
    if req.get("cursor") is not None:
        after = parse_path(req["cursor"])
        if after[: len(parts)] != parts or len(after) == len(parts):
            raise OpError(
                "invalid_request",
                f"cursor must be a path under {join(parts)}: the next_cursor of the page before",
            )
    out: list[dict] = []
    # The reply is one frame (at most P.MAX_JSON bytes): stop well before, and say so.
    budget = P.MAX_JSON // 2
    more = False
    # Depth first, with a stack rather than recursion: a hostile tree may be thousands deep.
    stack = [_listing(parts, 1)]
    try:
        while stack:
            dparts, level, fd, names = stack[-1]
            if not names:
                os.close(fd)
                stack.pop()
                continue
            if len(out) >= limit or budget <= 0:
                more = True
                break
            name = names.pop()
            here = dparts + [name]
            # Up to `after`: skip what the earlier pages listed, without descending into a
            # directory that lies wholly before it.
            seen = after is not None and here <= after
            if seen and after is not None and here != after[: len(here)]:
                continue
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                continue
            if not seen:
                out.append(entry(name, join(here), st, fd, metadata))
                budget -= len(P.dumps(out[-1])) + 2
            if stat.S_ISDIR(st.st_mode) and level < depth:
                try:
                    stack.append(_listing(here, level + 1))
                except OpError:
                    pass  # unreadable subdirectory: list what we can
    finally:
        for frame in stack:
            os.close(frame[2])
    reply: dict = {"ok": True, "entries": out, "truncated": more}
    if more:
        reply["next_cursor"] = out[-1]["path"]
    conn.reply(reply)


# inotify (inotify(7)): what a watch reports, and the word each event is said with.
_IN_MODIFY, _IN_ATTRIB, _IN_MOVED_FROM, _IN_MOVED_TO = 0x2, 0x4, 0x40, 0x80
_IN_CREATE, _IN_DELETE, _IN_DELETE_SELF, _IN_MOVE_SELF = 0x100, 0x200, 0x400, 0x800
_IN_Q_OVERFLOW, _IN_IGNORED, _IN_ONLYDIR, _IN_DONT_FOLLOW = 0x4000, 0x8000, 0x1000000, 0x2000000
_IN_EXCL_UNLINK, _IN_ISDIR = 0x4000000, 0x40000000
_WATCH_MASK = _IN_MODIFY | _IN_ATTRIB | _IN_MOVED_FROM | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE
_WATCH_MASK |= _IN_DELETE_SELF | _IN_ONLYDIR | _IN_DONT_FOLLOW | _IN_EXCL_UNLINK
_WATCH_WORDS = (
    (_IN_CREATE | _IN_MOVED_TO, "create"),
    (_IN_MODIFY, "write"),
    (_IN_DELETE, "remove"),
    (_IN_MOVED_FROM, "rename"),
    (_IN_ATTRIB, "chmod"),
)
MAX_WATCHED_DIRS = 4096  # directories one recursive watch follows


class DirWatch:
    """A directory's changes, by inotify: the directory, or its whole tree (directories made
    later are followed too, up to MAX_WATCHED_DIRS). Names are relative to the directory."""

    def __init__(self, parts: list[str], recursive: bool) -> None:
        self.recursive = recursive
        self.root = join(parts)
        self.dirs: dict[int, str] = {}  # watch descriptor -> path relative to the root
        self.ended = False  # the directory itself is gone: nothing more will come
        self.fd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            err = ctypes.get_errno()
            raise OpError(
                "limit_exceeded", f"no directory watch to be had here ({os.strerror(err)})"
            )
        try:
            top = open_dir(parts, os.O_RDONLY)  # no symlink on the way, as every file op
            try:
                self._add(f"/proc/self/fd/{top}", "", _WATCH_MASK & ~_IN_DONT_FOLLOW)
            finally:
                os.close(top)
            if recursive:
                self._add_tree("")
        except BaseException:
            os.close(self.fd)
            raise

    def _add(self, path: str, rel: str, mask: int = _WATCH_MASK) -> None:
        if len(self.dirs) >= MAX_WATCHED_DIRS:
            raise OpError(
                "limit_exceeded",
                f"{self.root} has more than {MAX_WATCHED_DIRS} directories to watch: watch a "
                "smaller tree, or without recursive",
            )
        wd = _libc.inotify_add_watch(self.fd, path.encode("utf-8", "surrogateescape"), mask)
        if wd < 0:
            err = ctypes.get_errno()
            if not rel:  # the watched directory itself
                raise os_error(OSError(err, os.strerror(err)), self.root)
            if err in (errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.ELOOP):
                return  # a subdirectory that went away or cannot be read: the rest is watched
            raise OpError(  # out of inotify watches, memory: said, never a silent gap
                "limit_exceeded", f"cannot watch {self.root}/{rel}: {os.strerror(err)}"
            )
        self.dirs[wd] = rel

    def _add_tree(self, rel: str, found: list[str] | None = None) -> None:
        """Watch the directories below `rel`; with `found`, note every name there too (what
        a new directory held before its watch was set, reported as created)."""
        stack = [rel]
        while stack:
            here = stack.pop()
            base = self.root.rstrip("/") + ("/" + here if here else "")
            try:
                with os.scandir(base) as it:
                    entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
            except OSError:
                continue
            for name, is_dir in entries:
                sub = f"{here}/{name}" if here else name
                if found is not None and not name.startswith(UPLOAD_PREFIX):
                    found.append(sub)
                if is_dir:
                    self._add(f"{base}/{name}", sub)
                    stack.append(sub)

    def read(self, timeout: float) -> list[dict]:
        """The events of up to `timeout` seconds ([] when none came)."""
        import select
        import struct

        poller = select.poll()  # not select(): the descriptor may be past 1023
        poller.register(self.fd, select.POLLIN)
        if not poller.poll(timeout * 1000):
            return []
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return []
        out, i = [], 0
        while i + 16 <= len(data):
            wd, mask, _cookie, size = struct.unpack_from("iIII", data, i)
            name = data[i + 16 : i + 16 + size].rstrip(b"\0").decode("utf-8", "surrogateescape")
            i += 16 + size
            if mask & _IN_Q_OVERFLOW:
                out.append({"type": "overflow"})
                continue
            if mask & _IN_IGNORED:
                if self.dirs.pop(wd, None) == "":
                    self.ended = True
                    out.append({"type": "overflow", "message": f"{self.root} was removed"})
                continue
            rel = self.dirs.get(wd)
            if rel is None or not name or name.startswith(UPLOAD_PREFIX):
                continue  # the file API's own temporary files: it renames them into place
            path = f"{rel}/{name}" if rel else name
            for bit, word in _WATCH_WORDS:
                if mask & bit:
                    out.append({"type": "fs", "name": path, "op": word})
            if self.recursive and mask & _IN_ISDIR and mask & (_IN_CREATE | _IN_MOVED_TO):
                found: list[str] = []
                try:
                    self._add(f"{self.root.rstrip('/')}/{path}", path)
                    self._add_tree(path, found)
                except OpError as e:
                    out.append({"type": "overflow", "message": str(e)})
                out += [{"type": "fs", "name": name, "op": "create"} for name in found]
        return out

    def close(self) -> None:
        os.close(self.fd)


def op_watch(conn: Conn, req: dict) -> None:
    """A directory's changes, streamed until the client leaves: {"type": "fs", name, op}, a
    keepalive after each silent KEEPALIVE_S, and {"type": "overflow"} where the kernel's queue
    dropped events."""
    watch = DirWatch(parse_path(req.get("path")), req.get("recursive") is True)
    entries = req.get("entries") is True  # each event with what its path is now, if anything
    try:
        conn.reply({"ok": True, "path": watch.root})
        while True:
            events = watch.read(KEEPALIVE_S)
            if not events:
                conn.reply({"type": "keepalive"})  # also notices a client that went away
            for event in events:
                if entries and event.get("type") == "fs" and event.get("op") != "remove":
                    try:
                        path = watch.root.rstrip("/") + "/" + str(event["name"])
                        event = {**event, "entry": stat_entry(parse_path(path), True)}
                    except (OpError, OSError):
                        pass  # gone already (renamed away, removed): the event alone
                conn.reply(event)
            if watch.ended:
                return
    finally:
        watch.close()


def _listing(dparts: list[str], level: int) -> tuple[list[str], int, int, list[str]]:
    """An open directory and its names, last first (they are popped)."""
    fd = open_dir(dparts, os.O_RDONLY)
    try:
        with os.scandir(fd) as it:
            names = sorted((e.name for e in it), reverse=True)
    except OSError as e:
        os.close(fd)
        raise os_error(e, join(dparts)) from None
    return dparts, level, fd, names


def op_mkdir(conn: Conn, req: dict) -> None:
    parts = parse_path(req.get("path"))
    if parts:
        try:
            st = stat_entry(parts)
            if st["type"] == "symlink":
                raise _symlink_error(join(parts))
            if st["type"] != "dir":
                raise OpError(
                    "path_exists", f"{join(parts)} exists and is not a directory", path=join(parts)
                )
            conn.reply({"ok": True, "entry": st, "created": False})
            return
        except OpError as e:
            if e.reply["code"] != "path_not_found":
                raise
    created = make_dirs(parts)
    conn.reply({"ok": True, "entry": stat_entry(parts), "created": created})


def op_remove(conn: Conn, req: dict) -> None:
    parts = parse_path(req.get("path"))
    path = join(parts)
    _check_removable(path)
    pfd = parent_of(parts)
    try:
        try:
            st = os.stat(parts[-1], dir_fd=pfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                remove_tree(pfd, parts[-1], path)
            else:
                os.unlink(parts[-1], dir_fd=pfd)
        except OSError as e:
            raise os_error(e, path) from None
    finally:
        os.close(pfd)
    conn.reply({"ok": True})


def _mount_points() -> set[str]:
    """Where something is mounted, as this process sees it (mountinfo's 5th field)."""
    with open("/proc/self/mountinfo", "rb") as f:
        lines = f.read().splitlines()
    points = set()
    for line in lines:
        fields = line.split(b" ")
        if len(fields) > 4:
            points.add(os.fsdecode(_unescape_octal(fields[4])))
    return points


def _unescape_octal(raw: bytes) -> bytes:
    """A mountinfo field with the kernel's octal escapes (`\\040` for a space) undone."""
    head, *rest = raw.split(b"\\")
    out = [head]
    for part in rest:
        digits = part[:3]
        if len(digits) == 3 and all(c in b"01234567" for c in digits):
            out += [bytes([int(digits, 8)]), part[3:]]
        else:
            out += [b"\\", part]
    return b"".join(out)


def _check_removable(path: str) -> None:
    """Refuse, before anything is removed, a path that is or holds a mount point (the
    workspace, /tmp): the removal would empty it and then fail on the mount itself."""
    roots = _mount_points() | {WORKSPACE, "/tmp", "/dev/shm"}
    inside = sorted(m for m in roots if m == path or m.startswith(path + "/"))
    if inside:
        what = "is a mount point" if inside[0] == path else f"holds the mount point {inside[0]}"
        raise OpError(
            "permission_denied",
            f"{path} {what}, which cannot be removed; nothing was removed (remove the entries "
            "inside it instead)",
            path=path,
            mount_point=inside[0],
        )


def _open_subdir(dir_fd: int, name: str) -> int:
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)


def _identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _empty_but_dirs(fd: int) -> list[str]:
    """Unlink every non-directory in the directory `fd`; its subdirectories' names."""
    with os.scandir(fd) as it:
        found = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
    for name, is_dir in found:
        if not is_dir:
            os.unlink(name, dir_fd=fd)
    return [name for name, is_dir in found if is_dir]


def remove_tree(pfd: int, name: str, path: str) -> None:
    """rm -r of directory `name` in `pfd`: iterative, so any depth works (no recursion, at
    most two fds open, no path longer than a name), and never through a symlink. The walk
    climbs back with "..", checked against the directory it came down from: a tree moved
    away meanwhile stops the removal instead of removing elsewhere."""
    fd = _open_subdir(pfd, name)
    # One frame per directory on the way down: its name, identity, subdirectories left.
    frames = [(name, _identity(fd), _empty_but_dirs(fd))]
    try:
        while True:
            pending = frames[-1][2]
            if pending:
                sub = pending.pop()
                try:
                    child = _open_subdir(fd, sub)
                except FileNotFoundError:
                    continue
                except OSError as e:
                    if e.errno not in (errno.ENOTDIR, errno.ELOOP):
                        raise
                    os.unlink(sub, dir_fd=fd)  # swapped for a file or a symlink meanwhile
                    continue
                os.close(fd)
                fd = child
                frames.append((sub, _identity(fd), _empty_but_dirs(fd)))
                continue
            done = frames.pop()[0]
            if not frames:
                break
            up = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = up
            if _identity(fd) != frames[-1][1]:
                raise OpError(
                    "conflict", f"{path} was moved while it was being removed; retry", path=path
                )
            os.rmdir(done, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=pfd)


def op_rename(conn: Conn, req: dict) -> None:
    src, dst = parse_path(req.get("src")), parse_path(req.get("dst"))
    sfd = parent_of(src)
    try:
        dfd = parent_of(dst, create=True)
        try:
            os.rename(src[-1], dst[-1], src_dir_fd=sfd, dst_dir_fd=dfd)
        except OSError as e:
            raise os_error(e, f"{join(src)} -> {join(dst)}") from None
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)
    conn.reply({"ok": True, "entry": stat_entry(dst)})


# ---------------------------------------------------------------- commands


def resolve_user(req: dict) -> str:
    """Who a request runs as: its `user`, else the sandbox's default (users.py)."""
    try:
        return users.resolve(req.get("user"))
    except users.UserError as e:
        raise OpError(e.code, str(e)) from None


def check_envs(envs: object) -> dict:
    if not isinstance(envs, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v
        for k, v in envs.items()
    ):
        raise OpError("invalid_request", "envs must map names to string values")
    return envs


LOGIN_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "login_path.sh")


def login_env(env: dict) -> dict:
    """The environment for `bash -l -c`: its login scripts reset PATH, login_path.sh (run
    after them) puts the given one back in front."""
    env = dict(env)
    if "PATH" in env:
        env["AGENTBOX_PATH"] = env["PATH"]
    if "BASH_ENV" in env:
        env["AGENTBOX_BASH_ENV"] = env["BASH_ENV"]
    env["BASH_ENV"] = LOGIN_PATH
    return env


class Command:
    def __init__(self, cmd_id: str, cmd: str, cwd: str, timeout: float, user: str) -> None:
        self.id = cmd_id
        self.cmd = cmd
        self.cwd = cwd
        self.user = user
        self.timeout = timeout
        self.proc: subprocess.Popen = None  # type: ignore[assignment]  # set by start()
        self.pid = 0
        self.pty = -1  # a terminal's master side (its output is stdout), -1 none, -2 closed
        self.pty_lock = threading.Lock()  # input, resizes and the close take turns on it
        self.started_at = time.time()
        self.ended_at: float | None = None
        self.exit_code: int | None = None
        self.timed_out = False
        self.killed = False
        self.chunks: list[tuple[int, int, bytes]] = []  # (stream, offset, data)
        self.first_offset = 0  # offset of chunks[0]
        self.next_offset = 0
        self.buffered = 0
        self.stderr_tail = b""
        self.full: list[str] = []  # mounts found full at its end (see full_filesystems)
        self.cond = threading.Condition()
        self.readers: list[threading.Thread] = []
        # Attached streams -> the offset each has sent up to; pipe readers waiting for them.
        self.attached: dict[object, int] = {}
        self.backlogged = 0
        self.reading_stopped = False  # set once the command has ended and its readers may go
        self.idle_readers: set[int] = set()  # pipe readers blocked on an empty pipe, by stream
        self.first_stream: object | None = None  # a foreground run's own stream
        # The control plane's own commands (readiness checks, a pool member's warm-up): not
        # listed, so whoever gets the sandbox sees only the commands it ran.
        self.hidden = False

    @property
    def running(self) -> bool:
        return self.ended_at is None

    def info(self) -> dict:
        return {
            "cmd_id": self.id,
            "pid": self.pid,
            "cmd": self.cmd,
            "cwd": self.cwd,
            "user": self.user,
            "running": self.running,
            "exit_code": self.exit_code,
            "timed_out": self.timed_out,
            "killed": self.killed,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "stdin": self.pty >= 0
            or (
                self.proc is not None and self.proc.stdin is not None and not self.proc.stdin.closed
            ),
            "pty": self.pty != -1,
        }

    def end_event(self) -> dict:
        code = self.exit_code
        return {
            "type": "end",
            "exit_code": code,
            "timed_out": self.timed_out,
            "killed": self.killed,
            "signal": -code if code is not None and code < 0 else None,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "stderr_tail": self.stderr_tail.decode("utf-8", "replace"),
            "full": self.full,
        }

    def append(self, stream: int, data: bytes) -> None:
        with self.cond:
            if not self.running and self.ended_at and time.time() - self.ended_at > 1:
                return  # late output of a daemon that outlived its command
            # Back-pressure: while a client is attached, the pipe reader (so the command)
            # waits until the slowest attached stream has sent all but OUTPUT_CAP bytes.
            while self.attached and self.next_offset - min(self.attached.values()) >= OUTPUT_CAP:
                self.backlogged += 1
                try:
                    self.cond.wait(KEEPALIVE_S)
                finally:
                    self.backlogged -= 1
            self.chunks.append((stream, self.next_offset, data))
            self.next_offset += len(data)
            self.buffered += len(data)
            if stream == P.STDERR:
                self.stderr_tail = (self.stderr_tail + data)[-STDERR_TAIL:]
            # What every attached stream has sent may go; beyond OUTPUT_CAP, the oldest.
            self._drop_oldest(self.buffered - OUTPUT_CAP, keep_last=True)
            self.cond.notify_all()
        COMMANDS.spooled(len(data))

    def _drop_oldest(self, excess: int, keep_last: bool = False) -> int:
        """Drop at least `excess` bytes of the oldest output no attached stream still needs
        (called with `cond` held); how many went."""
        keep_from = min(self.attached.values()) if self.attached else self.next_offset
        dropped = 0
        while dropped < excess and len(self.chunks) > (1 if keep_last else 0):
            start, old = self.chunks[0][1], self.chunks[0][2]
            if start + len(old) > keep_from:
                break
            self.chunks.pop(0)
            dropped += len(old)
        self.buffered -= dropped
        self.first_offset = self.chunks[0][1] if self.chunks else self.next_offset
        if dropped:
            COMMANDS.spooled(-dropped)
        return dropped

    def drop_for_budget(self, excess: int) -> int:
        with self.cond:
            return self._drop_oldest(excess)

    def attach(self, offset: int) -> object:
        """A stream that will send output from `offset`: the command waits for it."""
        token = object()
        with self.cond:
            self.attached[token] = max(offset, self.first_offset)
        return token

    def sent(self, token: object, offset: int) -> None:
        with self.cond:
            if token in self.attached:
                self.attached[token] = offset
                self.cond.notify_all()

    def detach(self, token: object) -> None:
        with self.cond:
            self.attached.pop(token, None)
            self.cond.notify_all()


PIDS_EXHAUSTED = OpError(
    "limit_exceeded",
    "the sandbox is at its process limit, so the command could not start; kill some "
    "processes (or the runaway command) or create the sandbox with a larger resources.pids",
    violation={
        "code": "pids_limit",
        "setting": "resources.pids",
        "message": "the sandbox hit its process limit; run fewer processes at once or raise "
        "resources.pids",
    },
)


class Commands:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_id: dict[str, Command] = {}
        self.seq = 0
        # Every listed command's end, numbered: one `exec.ended` connection watches them all.
        self.ended = threading.Condition(threading.Lock())
        self.ends: list[tuple[int, str, dict]] = []  # (number, cmd_id, end event), oldest first
        self.end_seq = 0
        self.spool = 0  # output bytes buffered by all commands
        self.spool_lock = threading.Lock()
        self.trimming = threading.Lock()

    def spooled(self, delta: int) -> None:
        """Count output buffered (or dropped); past SPOOL_BUDGET, drop the oldest commands'
        oldest output. Never with a command's `cond` held: this takes them one at a time."""
        with self.spool_lock:
            self.spool += delta
            over = self.spool - SPOOL_BUDGET
        if delta <= 0 or over <= 0 or not self.trimming.acquire(blocking=False):
            return  # a trim under way will see this output too
        try:
            with self.lock:
                oldest_first = list(self.by_id.values())
            for c in oldest_first:
                with self.spool_lock:
                    over = self.spool - SPOOL_BUDGET
                if over <= 0:
                    break
                c.drop_for_budget(over)
        finally:
            self.trimming.release()

    def get(self, cmd_id: object) -> Command:
        with self.lock:
            cmd = self.by_id.get(cmd_id) if isinstance(cmd_id, str) else None
        if cmd is None:
            raise OpError("not_found", f"no command {cmd_id!r} in this sandbox")
        return cmd

    def start(self, req: dict, attach: bool = False) -> Command:
        """`attach`: a stream from offset 0 is attached before any output (`first_stream`)."""

        cmd = req.get("cmd")
        if not isinstance(cmd, str) or not cmd.strip():
            raise OpError("invalid_request", "cmd must be a non-empty string")
        cwd = join(parse_path(req.get("cwd") or DEFAULT_CWD))
        if not os.path.isdir(cwd):
            raise OpError("path_not_found", f"working directory {cwd} does not exist", path=cwd)
        envs = check_envs(req.get("envs") or {})
        timeout = req.get("timeout") or 0
        user = resolve_user(req)
        size = pty_size(req.get("pty"))
        with self.lock:
            self.seq += 1
            cmd_id = req.get("cmd_id") or f"c{self.seq}"
        c = Command(cmd_id, cmd, cwd, float(timeout), user)
        c.hidden = req.get("hidden") is True
        c.first_stream = c.attach(0) if attach else None
        env = login_env(users.environment(user, {**os.environ, **envs}))
        env["AGENTBOX_CMD_ID"] = cmd_id  # lets kill() find daemons that left the process tree
        # Where the command is, as its shell should say it: bash keeps an inherited PWD that
        # names the same directory, and /workspace and /home/user (its mount) are one.
        env["PWD"] = cwd
        try:
            master = -1
            with users.spawning_as(user):
                if size is None:
                    c.proc = self._popen(cmd, cwd, env, req.get("stdin"))
                else:
                    c.proc, master = self._popen_pty(cmd, cwd, env, size)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.ENOMEM):
                raise PIDS_EXHAUSTED from None
            # Said, not dropped: an OSError reaching serve_one reads as a lost connection.
            raise os_error(e, cwd) from None
        c.pid = c.proc.pid
        try:
            if size is not None:
                # The reader owns `master` and closes it at the terminal's hang-up; input and
                # resizes use a duplicate, closed when the command ends (no number is closed
                # while another thread may still use it).
                c.pty = os.dup(master)
                t = threading.Thread(target=self._read_terminal, args=(c, master), daemon=True)
                t.start()
                master = -1
                c.readers.append(t)
            else:
                assert c.proc.stdout is not None and c.proc.stderr is not None
                pipes = [(P.STDOUT, c.proc.stdout), (P.STDERR, c.proc.stderr)]
                for stream, pipe in pipes:
                    t = threading.Thread(target=self._read, args=(c, stream, pipe), daemon=True)
                    t.start()
                    c.readers.append(t)
            threading.Thread(target=self._wait, args=(c,), daemon=True).start()
        except RuntimeError:  # no thread for it: the sandbox is at its process limit
            # "Could not start" must leave nothing running: the command may already have
            # forked (a fork bomb fills the pids cgroup before its reader threads exist).
            kill_tree(c)
            c.proc.wait()
            for fd in (master, c.pty):
                if fd >= 0:
                    os.close(fd)
            c.pty = -2
            raise PIDS_EXHAUSTED from None
        with self.lock:
            self.by_id[cmd_id] = c
            self._trim()
        return c

    @staticmethod
    def _popen(cmd: str, cwd: str, env: dict, stdin: object) -> subprocess.Popen:
        import subprocess

        return subprocess.Popen(
            ["/bin/bash", "-l", "-c", cmd],
            cwd=cwd,
            env=env,
            start_new_session=True,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            close_fds=True,
            pass_fds=(LEAKED_FD,) if LEAKED_FD >= 0 else (),
        )

    @staticmethod
    def _popen_pty(
        cmd: str, cwd: str, env: dict, size: tuple[int, int]
    ) -> tuple[subprocess.Popen, int]:
        """The command on a terminal of its own (`size`: cols, rows), which it controls; its
        output, stdout and stderr alike, is read from the returned master side."""
        import fcntl
        import subprocess
        import termios

        master, slave = os.openpty()
        try:
            set_winsize(slave, size)
            proc = subprocess.Popen(
                ["/bin/bash", "-l", "-c", cmd],
                cwd=cwd,
                env=env,
                start_new_session=True,
                stdin=slave,
                stdout=slave,
                stderr=slave,
                close_fds=True,
                pass_fds=(LEAKED_FD,) if LEAKED_FD >= 0 else (),
                # After setsid: the terminal becomes the new session's controlling one.
                preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),  # noqa: PLW1509
            )
        except subprocess.SubprocessError as e:  # the terminal could not be made its own
            os.close(master)
            raise OpError("io_error", f"could not give the command a terminal: {e}") from None
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(slave)
        os.set_blocking(master, False)  # its reader polls; input waits TERMINAL_INPUT_S at most
        return proc, master

    def _trim(self) -> None:
        finished = [c for c in self.by_id.values() if not c.running]
        for c in sorted(finished, key=lambda c: c.ended_at or 0)[:-FINISHED_KEPT]:
            del self.by_id[c.id]
            with self.spool_lock:
                self.spool -= c.buffered

    @staticmethod
    def _read_terminal(c: Command, fd: int) -> None:
        """A terminal's output, until it hangs up (every holder of its slave side gone, EIO);
        then its master side is closed here, by its one reader."""
        import select

        poller = select.poll()
        poller.register(fd, select.POLLIN)
        try:
            while True:
                poller.poll()
                try:
                    data = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                except OSError:
                    break
                if not data:
                    break
                c.append(P.STDOUT, data)
        finally:
            os.close(fd)

    @staticmethod
    def _read(c: Command, stream: int, pipe: IO[bytes]) -> None:
        """A pipe's output until its end, or until the command has ended and `_wait` stops
        waiting (a daemon it left may hold the pipe open for ever); the pipe is closed here,
        by its one reader, never under it."""
        import select

        fd = pipe.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        try:
            while not c.reading_stopped:
                c.idle_readers.add(stream)
                try:
                    if not poller.poll(READ_POLL_MS):
                        continue
                finally:
                    c.idle_readers.discard(stream)
                try:
                    data = os.read(fd, 65536)
                except OSError:
                    break
                if not data:
                    break
                c.append(stream, data)
        finally:
            pipe.close()

    def _wait(self, c: Command) -> None:
        import select

        try:
            pidfd = os.pidfd_open(c.pid)
        except OSError:
            pidfd = -1
        if pidfd >= 0:
            ready, _, _ = select.select([pidfd], [], [], c.timeout if c.timeout > 0 else None)
            os.close(pidfd)
            if not ready:
                c.timed_out = True
                kill_tree(c)
        elif c.timeout > 0:  # no pidfd (gVisor's 2022 kernel): Popen polls the child
            import subprocess

            try:
                c.proc.wait(timeout=c.timeout)
            except subprocess.TimeoutExpired:
                c.timed_out = True
                kill_tree(c)
        code = c.proc.wait()
        # Output still in the pipes belongs to the command; daemons holding the pipes open
        # must not keep the command "running", so wait for the readers only briefly, unless
        # they wait for an attached client to take what they read (its output goes on), or
        # one is not blocked on an empty pipe: it has output of the command's still to read
        # or append (a busy machine had not run it yet), for up to READERS_BEHIND_S.
        exited = time.monotonic()
        for t in c.readers:
            while t.is_alive():
                t.join(0.05)
                waited = time.monotonic() - exited
                if waited > 0.2 and not c.backlogged:
                    alive = sum(r.is_alive() for r in c.readers)
                    behind = c.pty < 0 and len(c.idle_readers) < alive  # pipes only
                    if not behind or waited > READERS_BEHIND_S:
                        break
        c.reading_stopped = True  # pipe readers still blocked close their pipes and go
        if c.pty >= 0:
            with c.pty_lock:  # input and resizes use the fd under it, or find it closed
                fd, c.pty = c.pty, -2
            try:
                os.close(fd)
            except OSError:
                pass
        c.full = full_filesystems(c.stderr_tail) if code else []
        with c.cond:
            c.exit_code = code
            c.ended_at = time.time()
            c.cond.notify_all()
        if not c.hidden:
            with self.ended:
                self.end_seq += 1
                self.ends.append((self.end_seq, c.id, c.end_event()))
                del self.ends[:-ENDS_KEPT]
                self.ended.notify_all()


COMMANDS = Commands()


def _proc_table() -> dict[int, tuple[int, int, int]]:
    """pid -> (ppid, pgrp, session) for every process this sandbox can see."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                rest = f.read().rsplit(b")", 1)[1].split()
            table[int(name)] = (int(rest[1]), int(rest[2]), int(rest[3]))
        except (OSError, IndexError, ValueError):
            pass
    return table


def _has_marker(pid: int, marker: bytes) -> bool:
    # The agent (the sandbox's root) lacks CAP_SYS_PTRACE: it reads another uid's environ
    # with that uid's filesystem ids.
    try:
        st = os.stat(f"/proc/{pid}")
        with users.fs_ids(st.st_uid, st.st_gid), open(f"/proc/{pid}/environ", "rb") as f:
            return marker in f.read().split(b"\0")
    except OSError:
        return False


def kill_tree(c: Command, sig: int = 9) -> None:
    """Signal the command and every process it started, including ones that daemonized."""
    marker = f"AGENTBOX_CMD_ID={c.id}".encode()
    me = os.getpid()
    for _ in range(10):
        try:
            # The command leads its own process group (setsid); killing a group is atomic
            # in the kernel, so a fork bomb cannot refill it while the signal goes out.
            os.killpg(c.pid, sig)
        except OSError:
            pass
        table = _proc_table()
        victims = {c.pid} if c.pid in table else set()
        grew = True
        while grew:
            grew = False
            for pid, (ppid, pgrp, sid) in table.items():
                if pid in victims or pid == me or pid == 1:
                    continue
                if ppid in victims or pgrp == c.pid or sid == c.pid:
                    victims.add(pid)
                    grew = True
        for pid in table:
            if pid not in victims and pid not in (me, 1) and _has_marker(pid, marker):
                victims.add(pid)
        if not victims:
            return
        for pid in victims:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        if sig != 9:
            return
        time.sleep(0.005)


def op_exec_start(conn: Conn, req: dict) -> None:
    conn.reply({"ok": True, "command": COMMANDS.start(req).info()})


def op_exec_info(conn: Conn, req: dict) -> None:
    conn.reply({"ok": True, "command": COMMANDS.get(req.get("cmd_id")).info()})


def op_exec_list(conn: Conn, req: dict) -> None:
    with COMMANDS.lock:
        cmds = [c for c in COMMANDS.by_id.values() if not c.hidden]
    conn.reply({"ok": True, "commands": [c.info() for c in cmds]})


def op_exec_events(conn: Conn, req: dict) -> None:
    c = COMMANDS.get(req.get("cmd_id"))
    offset = req.get("offset", 0)
    if not isinstance(offset, int) or offset < 0:
        raise OpError("invalid_request", "offset must be a non-negative integer")
    token = c.attach(offset)
    try:
        conn.reply({"ok": True, "command": c.info()})
        stream_events(conn, c, offset, token)
    finally:
        c.detach(token)


def op_exec_run(conn: Conn, req: dict) -> None:
    """Start a command and stream its events on the same connection (foreground runs)."""
    c = COMMANDS.start(req, attach=True)
    token = c.first_stream
    try:
        conn.reply({"ok": True, "command": c.info()})
        stream_events(conn, c, 0, token)
    finally:
        c.detach(token)


def stream_events(conn: Conn, c: Command, offset: int, token: object) -> None:
    """Send output from `offset` (buffered, then live), then the end event. The command's
    output waits for what this stream has not sent yet (see Command.append)."""
    while True:
        c.sent(token, offset)
        with c.cond:
            if offset < c.first_offset:
                pending: list = [("truncated", offset, c.first_offset - offset)]
                offset = c.first_offset
            else:
                pending = []
            for stream, start, data in c.chunks:
                end = start + len(data)
                if end > offset:
                    pending.append((stream, max(start, offset), data[max(0, offset - start) :]))
                    offset = end
            done = not c.running
            if not pending and not done:
                idle = not c.cond.wait(KEEPALIVE_S)
        if not pending and not done:
            if idle:
                conn.reply({"type": "keepalive"})  # also notices a client that went away
            continue
        for item in pending:
            if item[0] == "truncated":
                conn.reply(
                    {
                        "type": "truncated",
                        "offset": item[1],
                        "dropped": item[2],
                        "command_cap": OUTPUT_CAP,
                        "sandbox_budget": SPOOL_BUDGET,
                    }
                )
            else:
                conn.send(P.encode_output(*item))
        if done and not pending:
            conn.reply(c.end_event())
            return


def op_exec_wait(conn: Conn, req: dict) -> None:
    """Reply with the end event once the command ends (keepalives meanwhile)."""
    c = COMMANDS.get(req.get("cmd_id"))
    while True:
        deadline = time.monotonic() + KEEPALIVE_S
        with c.cond:
            # Output wakes the condition too; only the end or a quiet interval matter here.
            while c.running and time.monotonic() < deadline:
                c.cond.wait(max(0.0, deadline - time.monotonic()))
            running = c.running
        if not running:
            conn.reply(c.end_event())
            return
        conn.reply({"type": "keepalive"})


def op_exec_ended(conn: Conn, req: dict) -> None:
    """The end events of commands that ended after end number `after` (at most ENDS_PER_REPLY),
    as soon as there is one (keepalives meanwhile): the control plane watches every command of
    the sandbox on this one connection. `complete` is false when some were dropped meanwhile."""
    after = req.get("after", 0)
    if not isinstance(after, int) or isinstance(after, bool) or after < 0:
        raise OpError("invalid_request", "after must be a non-negative integer")
    c = COMMANDS
    while True:
        with c.ended:
            if after > c.end_seq:
                after = 0  # a number from before this agent started: all it kept is new
            if c.end_seq <= after:
                c.ended.wait(KEEPALIVE_S)  # any end wakes it; a quiet interval sends a keepalive
            found = [(n, i, e) for n, i, e in c.ends if n > after][:ENDS_PER_REPLY]
        if found:
            ends = [{**e, "cmd_id": i} for _, i, e in found]
            complete = found[0][0] == after + 1
            conn.reply({"ok": True, "ends": ends, "seq": found[-1][0], "complete": complete})
            return
        conn.reply({"type": "keepalive"})


def op_exec_stdin(conn: Conn, req: dict) -> None:
    c = COMMANDS.get(req.get("cmd_id"))
    if c.pty != -1:
        _terminal_input(c, req)
        conn.reply({"ok": True})
        return
    stdin = c.proc.stdin if c.proc else None
    if stdin is None or stdin.closed or not c.running:
        raise OpError("conflict", "this command's stdin is not open (start it with stdin=true)")
    data = req.get("data", "")
    if not isinstance(data, str):
        raise OpError("invalid_request", "data must be a string")
    try:
        if data:
            stdin.write(data.encode())
            stdin.flush()
        if req.get("eof"):
            stdin.close()
    except BrokenPipeError:
        raise OpError("conflict", "the command closed its stdin") from None
    conn.reply({"ok": True})


def _terminal_input(c: Command, req: dict) -> None:
    """Input typed at a command's terminal (end of input is ^D, as a terminal's)."""
    data = req.get("data", "")
    if not isinstance(data, str):
        raise OpError("invalid_request", "data must be a string")
    import select

    raw = data.encode() + (b"\x04" if req.get("eof") else b"")
    deadline = time.monotonic() + TERMINAL_INPUT_S
    with c.pty_lock:
        if c.pty < 0:
            raise OpError("conflict", "this command's terminal is closed")
        view = memoryview(raw)
        while view:
            try:
                view = view[os.write(c.pty, view) :]
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    sent = len(raw) - len(view)
                    raise OpError(
                        "conflict",
                        f"the terminal's input is full ({sent} of {len(raw)} bytes went in): "
                        "the program in it is not reading",
                    ) from None
                poller = select.poll()
                poller.register(c.pty, select.POLLOUT)
                poller.poll(left * 1000)
            except OSError as e:
                raise OpError("conflict", f"the terminal refused input: {e.strerror}") from None


def op_exec_resize(conn: Conn, req: dict) -> None:
    c = COMMANDS.get(req.get("cmd_id"))
    size = pty_size(req.get("pty"))
    if size is None:
        raise OpError("invalid_request", "pty must be {cols, rows}")
    with c.pty_lock:
        if c.pty == -1:
            raise OpError("conflict", "this command has no terminal (start it with a pty)")
        if c.pty < 0:
            raise OpError("conflict", "this command's terminal is closed")
        set_winsize(c.pty, size)
    conn.reply({"ok": True})


def pty_size(value: object) -> tuple[int, int] | None:
    """A terminal's size, {cols, rows}, each 1..4096; None when no terminal is asked for."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise OpError("invalid_request", "pty must be {cols, rows}")
    cols, rows = value.get("cols"), value.get("rows")
    for name, n in (("cols", cols), ("rows", rows)):
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 4096:
            raise OpError("invalid_request", f"pty {name} must be an integer from 1 to 4096")
    return cols, rows  # type: ignore[return-value]


def set_winsize(fd: int, size: tuple[int, int]) -> None:
    import fcntl
    import struct
    import termios

    cols, rows = size
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def op_exec_kill(conn: Conn, req: dict) -> None:
    c = COMMANDS.get(req.get("cmd_id"))
    sig = req.get("signal", 9)
    if not isinstance(sig, int) or not 1 <= sig <= 64:
        raise OpError("invalid_request", "signal must be a signal number")
    # Also after the command ended: processes it left behind (`server &`, a fork bomb) are
    # still its own, and killing them is how a sandbox recovers from a runaway command.
    if c.running:
        c.killed = True
    kill_tree(c, sig)
    conn.reply({"ok": True})


def _code_host():  # noqa: ANN202 - the module is imported on first use
    import code_bridge

    return code_bridge


def _code_failed(event: dict) -> OpError:
    code, message = _code_host().failure(event)
    return OpError(code, message)


_CODE_CALLS = frozenset(
    {"create_context", "list_contexts", "restart_context", "remove_context", "warm"}
)


def op_code_call(conn: Conn, req: dict) -> None:
    """A code-interpreter request with one reply: contexts, warm-up."""
    cb = _code_host()
    call = req.get("call")
    if call not in _CODE_CALLS:
        raise OpError("invalid_request", f"unknown code call {call!r}")
    args = {k: v for k, v in req.items() if k not in ("op", "call")}
    try:
        event = cb.HOST_PROCESS.call(call, args)
    except cb.HostGone as e:
        raise OpError("code_host_unavailable", str(e)) from None
    if event.get("event") == "failed":
        raise _code_failed(event)
    conn.reply({"ok": True, **{k: v for k, v in event.items() if k not in ("id", "event")}})


def op_code_execute(conn: Conn, req: dict) -> None:
    """Run code in a context and stream its events (stdout, stderr, result, error, ...)."""
    cb = _code_host()
    args = {k: v for k, v in req.items() if k != "op"}
    try:
        rid, q = cb.HOST_PROCESS.request("execute", args)
    except cb.HostGone as e:
        raise OpError("code_host_unavailable", str(e)) from None
    try:
        _code_events(conn, q)
    except BaseException:
        # The client went away (or this failed): the cell is interrupted, as E2B's clients
        # expect of a dropped request, so the context's next cell does not wait behind it.
        cb.HOST_PROCESS.abandon(rid)
        raise


def _code_events(conn: Conn, q: queue.SimpleQueue) -> None:
    import queue

    cb = _code_host()

    first = True
    quiet_since = time.monotonic()
    while True:
        try:
            event = q.get(timeout=HANGUP_POLL_S)
        except queue.Empty:
            if conn.hung_up():
                raise ConnectionLost(errno.EPIPE, "the client closed the stream") from None
            if time.monotonic() - quiet_since >= KEEPALIVE_S:
                conn.reply({"type": "keepalive"})  # also notices a client that went away
                quiet_since = time.monotonic()
            continue
        quiet_since = time.monotonic()
        kind = event.pop("event", None)
        event.pop("id", None)
        if first:
            first = False
            if kind == "failed":  # refused before it ran: an ordinary error reply
                raise _code_failed({"event": kind, **event})
            conn.reply({"ok": True})
        if kind == "accepted":  # queued in its context: the caller has its answer (above)
            continue
        if kind == "failed":
            code, message = cb.failure(event)
            conn.reply({"type": "failed", "code": code, "message": message})
            return
        frame = P.encode_json({"type": kind, **event})
        if len(frame) > P.MAX_JSON:
            frame = P.encode_json(
                {
                    "type": "stderr",
                    "text": f"[agentbox: a {kind} event of {len(frame)} bytes was dropped: "
                    f"events are limited to {P.MAX_JSON} bytes; write large outputs to a file]\n",
                }
            )
        conn.send(frame)
        if kind == "done":
            return


def op_env_set(conn: Conn, req: dict) -> None:
    """New default environment variables for later commands and code (claimed warm sandboxes)."""
    envs = check_envs(req.get("envs"))
    cb = _code_host()
    try:
        cb.HOST_PROCESS.set_env(envs)
    except cb.HostGone as e:
        raise OpError("code_host_unavailable", str(e)) from None
    conn.reply({"ok": True})


def op_ping(conn: Conn, req: dict) -> None:
    conn.reply({"ok": True, "version": P.VERSION, "pid": os.getpid(), "landlock": LANDLOCK_ABI})


def _port(req: dict) -> int:
    port = req.get("port")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise OpError("invalid_request", "port must be a number from 1 to 65535")
    return port


def op_net_connect(conn: Conn, req: dict) -> None:
    """Connect to a port on the sandbox's loopback; once answered, this connection carries that
    stream's bytes (relay.py)."""
    import relay

    port = _port(req)
    try:
        target = relay.connect_loopback(port, float(req.get("timeout") or 10))
    except OSError as e:
        code = "port_not_open" if e.errno == errno.ECONNREFUSED else "upstream_error"
        raise OpError(code, f"127.0.0.1:{port}: {e.strerror or e}", errno=e.errno or 0) from None
    conn.reply({"ok": True})
    relay.RELAYS.pair(_socket.socket(fileno=os.dup(conn.sock.fileno())), target)


def op_net_listen(conn: Conn, req: dict) -> None:
    """Listen on a port of the sandbox's loopback and relay each connection to the Unix socket
    `to` (the egress proxy's, in the channel directory only the sandbox's root may enter)."""
    import relay

    to = req.get("to")
    if not CHANNEL_DIR or not isinstance(to, str) or os.path.dirname(to) != CHANNEL_DIR:
        raise OpError("invalid_request", "to must be a socket in the agent's channel directory")
    relay.RELAYS.listen(_port(req), to)
    conn.reply({"ok": True})


OPS = {
    "ping": op_ping,
    "fs.stat": op_stat,
    "fs.read": op_read,
    "fs.write": op_write,
    "fs.list": op_list,
    "fs.mkdir": op_mkdir,
    "fs.remove": op_remove,
    "fs.rename": op_rename,
    "fs.watch": op_watch,
    "exec.start": op_exec_start,
    "exec.run": op_exec_run,
    "exec.info": op_exec_info,
    "exec.list": op_exec_list,
    "exec.events": op_exec_events,
    "exec.wait": op_exec_wait,
    "exec.ended": op_exec_ended,
    "exec.stdin": op_exec_stdin,
    "exec.kill": op_exec_kill,
    "exec.resize": op_exec_resize,
    "code.call": op_code_call,
    "code.execute": op_code_execute,
    "env.set": op_env_set,
    "net.connect": op_net_connect,
    "net.listen": op_net_listen,
}


# The ops that finish at once: the only ones served on the accept loop itself when no thread
# can start (the sandbox is at its process limit). A wait or a stream served there would hold
# the loop until it ended, and nothing else, not even the kill that would end it, got through.
INLINE_OPS = frozenset(
    {"ping", "fs.stat", "fs.list", "fs.mkdir", "fs.remove", "fs.rename"}
    | {"exec.info", "exec.list", "exec.stdin", "exec.kill", "exec.resize", "quiesce"}
)


def serve_one(sock: _socket.socket, inline: bool = False) -> None:
    conn = Conn(sock)
    req: dict = {}
    if CHANNEL is not None:
        CHANNEL.track(sock)
    try:
        kind, payload = conn.recv()
        if kind != P.KIND_JSON:
            raise OpError("invalid_request", "a request starts with a JSON frame")
        req = P.decode_json(payload)
        op = OPS.get(str(req.get("op")))
        if op is None:
            raise OpError("invalid_request", f"unknown op {req.get('op')!r}")
        if inline and req.get("op") not in INLINE_OPS:
            raise PIDS_EXHAUSTED
        if req.get("op", "").startswith("fs."):
            with users.files_as(resolve_user(req)):
                op(conn, req)
        else:
            op(conn, req)
    except OpError as e:
        try:
            conn.reply(e.reply)
        except OSError:
            pass
    except (EOFError, ConnectionLost, P.ProtocolError):
        pass  # the client is gone (or spoke nonsense): nobody to answer
    except OSError as e:  # the operation's own failure, not the connection's: answered
        path = req.get("path") if isinstance(req.get("path"), str) else str(req.get("op"))
        try:
            conn.reply(os_error(e, str(path)).reply)
        except OSError:
            pass
    except Exception as e:  # noqa: BLE001 - one bad request must not take the agent down
        try:
            conn.reply(P.error("agent_error", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
    finally:
        if CHANNEL is not None:
            CHANNEL.untrack(sock)
        try:
            conn.rfile.close()
            sock.close()
        except OSError:
            pass
        _import_ahead_once()


LANDLOCK_ABI = 0


def _arg(name: str) -> str | None:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None


class Channel:
    """The agent's own socket (--listen-path) and the connections it accepted. `quiesce`
    closes all of them (a gVisor checkpoint fails while the sandbox holds a host socket);
    SIGUSR2, sent once the checkpoint is over, binds it again. Commands keep running and
    their output keeps being buffered meanwhile."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.conns: set[_socket.socket] = set()
        self.listener: _socket.socket | None = listen_at(path)
        self.wanted = False  # SIGUSR2 came: bind again

    def track(self, sock: _socket.socket) -> None:
        with self.lock:
            self.conns.add(sock)

    def untrack(self, sock: _socket.socket) -> None:
        with self.lock:
            self.conns.discard(sock)

    def quiesce(self, keep: _socket.socket) -> None:
        """Close the listener and every connection but `keep` (the quiesce request's own,
        which its server closes after the answer), and every relay."""
        import relay

        with self.lock:
            listener, self.listener = self.listener, None
            conns = [c for c in self.conns if c is not keep]
        if listener is not None:
            try:
                listener.shutdown(_socket.SHUT_RDWR)  # wakes the accept loop
            except OSError:
                pass
            listener.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        for c in conns:
            try:
                c.shutdown(_socket.SHUT_RDWR)
            except OSError:
                pass
        relay.RELAYS.close_relays()

    def reopen(self) -> None:
        with self.lock:
            if self.listener is None:
                self.listener = listen_at(self.path)


CHANNEL: Channel | None = None


def op_quiesce(conn: Conn, req: dict) -> None:
    if CHANNEL is None:
        raise OpError("unsupported", "this agent's channel is not its own to close")
    CHANNEL.quiesce(keep=conn.sock)
    conn.reply({"ok": True})


OPS["quiesce"] = op_quiesce


def listen_at(path: str) -> _socket.socket:
    """The control channel as a socket the agent binds itself, in a directory the runtime binds
    in from the host (where a runtime cannot hand over a listening descriptor). Only the
    sandbox's root may connect: 0600, and its directory is the runtime's to keep private."""
    try:
        os.unlink(path)  # a previous agent's
    except FileNotFoundError:
        pass
    listener = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)  # not inheritable
    old = os.umask(0o177)
    try:
        listener.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    listener.listen(128)
    return listener


def _import_ahead() -> None:
    """What the first command imports, imported while the server still finishes the create
    (its records, its answer) and the client sends that command: ~11 ms it does not wait for."""
    import fcntl  # noqa: F401
    import select  # noqa: F401
    import subprocess  # noqa: F401
    import termios  # noqa: F401


_imported_ahead = False


def _import_ahead_once() -> None:
    """Start _import_ahead after the first answer (the runtime's readiness ping), so that it
    does not hold the interpreter lock while that answer is made."""
    global _imported_ahead
    if _imported_ahead:
        return
    _imported_ahead = True
    try:
        threading.Thread(target=_import_ahead, daemon=True).start()
    except RuntimeError:
        pass  # no thread to spare: the first command imports them itself


def _wait_to_accept(
    listener: _socket.socket | None, sudo: _socket.socket, timeout: float | None = None
) -> bool:
    """Until a connection waits on the agent's listener or on the sudo socket (or `timeout`
    seconds pass); serves sudo's. Whether the listener has one (True too where it was closed:
    quiesced, see Channel; the accept that follows says so)."""
    import select

    waiting = select.poll()
    waiting.register(sudo.fileno(), select.POLLIN)
    if listener is not None:
        if listener.fileno() < 0:
            return True
        waiting.register(listener.fileno(), select.POLLIN)
    ready = {fd for fd, _ in waiting.poll(None if timeout is None else timeout * 1000)}
    if sudo.fileno() in ready:
        users.accept_sudo(sudo)
    return listener is not None and listener.fileno() in ready


def main() -> None:
    global LANDLOCK_ABI, WORKSPACE, WEAKENED, LEAKED_FD, DEFAULT_CWD, CHANNEL_DIR, CHANNEL
    WORKSPACE = _arg("--workspace") or WORKSPACE
    DEFAULT_CWD = os.getcwd()
    WEAKENED = frozenset(filter(None, (_arg("--weaken") or "").split(",")))
    users.configure(_arg("--user") or "user")
    LEAKED_FD = int(_arg("--leak-fd") or -1)
    path = _arg("--listen-path")
    listener: _socket.socket | None
    if path is not None:
        CHANNEL = Channel(path)
        listener = CHANNEL.listener
        CHANNEL_DIR = os.path.dirname(path)
        import signal

        def reopen_wanted(_signum: int, _frame: object) -> None:
            assert CHANNEL is not None
            CHANNEL.wanted = True

        signal.signal(signal.SIGUSR2, reopen_wanted)
    else:
        fd = int(sys.argv[sys.argv.index("--listen-fd") + 1])
        os.set_inheritable(fd, False)  # commands must never reach the control channel
        listener = _socket.socket(fileno=fd)
    _libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: sandboxed code cannot read agent memory
    if "no-landlock" not in WEAKENED:
        writable = [WORKSPACE, "/tmp", "/dev/shm"]
        if "--writable-root" in sys.argv:
            writable += writable_root_dirs()
        # Read-write volumes, mounted where the sandbox asked (--writable PATH, repeated).
        writable += [sys.argv[i + 1] for i, a in enumerate(sys.argv[:-1]) if a == "--writable"]
        LANDLOCK_ABI = _landlock(writable)
    # After Landlock: its scope lets sandboxed code reach only sockets made inside its domain.
    sudo = users.serve_sudo()
    threading.stack_size(512 * 1024)
    while True:
        if CHANNEL is not None:
            if CHANNEL.wanted:
                CHANNEL.wanted = False
                CHANNEL.reopen()
            listener = CHANNEL.listener
            if listener is None:  # quiesced: until SIGUSR2
                if sudo is None:
                    time.sleep(0.02)
                else:
                    _wait_to_accept(None, sudo, 0.02)
                continue
        assert listener is not None
        if sudo is not None and not _wait_to_accept(listener, sudo):
            continue
        try:
            conn_fd, _ = listener._accept()  # type: ignore[attr-defined]  # accept4(CLOEXEC)
            sock = _socket.socket(fileno=conn_fd)
        except InterruptedError:
            continue
        except OSError:
            time.sleep(0.01)
            continue
        try:
            threading.Thread(target=serve_one, args=(sock,), daemon=True).start()
        except RuntimeError:
            # At the process limit no thread can start; answer inline rather than die.
            serve_one(sock, inline=True)
