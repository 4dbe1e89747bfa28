"""The host-side oracle: canaries planted per run, and the judgement of what a probe reached.

Nothing a sandbox prints is trusted on its own. A check is BROKEN when a secret only the host
holds shows up in sandbox output (READ), a host file appears or changes (WRITE), a listener or
the DNS canary is hit (NET), or host state changes in a way no sandbox may cause (ESCAPE).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

# Ports the listeners take on every address of the battery's network namespace.
TCP_PORTS = (80, 443, 53, 8080)
UDP_PORTS = (53, 443, 8080)  # 443: QUIC
CANARY_DOMAIN = "canary.test"
METADATA_NAMES = {"metadata.google.internal": "169.254.169.254"}

# Host knobs whose value must never change during a run.
HOST_KNOBS = (
    "/proc/sys/kernel/core_pattern",
    "/proc/sys/kernel/modprobe",
    "/proc/sys/kernel/hostname",
    "/proc/sys/kernel/panic_on_oom",
    "/proc/sys/fs/suid_dumpable",
    "/proc/sys/kernel/sysrq",
)


@dataclass
class Hit:
    what: str  # "tcp 169.254.169.254:80", "dns x.canary.test", "abstract …", "signal"
    detail: str
    at: float = field(default_factory=time.monotonic)
    data: bytes = b""  # what an expected connection sent (see Oracle.expecting)


def _digest(p: Path) -> str:
    try:
        st = p.lstat()
        body = p.read_bytes() if p.is_file() and not p.is_symlink() else b""
        return f"{st.st_mode:o}:{st.st_size}:{st.st_mtime_ns}:{hashlib.sha256(body).hexdigest()}"
    except OSError as e:
        return f"missing:{e.errno}"


class Oracle:
    def __init__(self) -> None:
        self.nonce = secrets.token_hex(16)
        n = self.nonce
        self.read_secret = f"ABX-CANARY-READ-{n}"
        self.env_secret = f"ABX-CANARY-ENV-{n}"
        # Outside every path a sandbox is given; world-readable and world-writable on purpose,
        # so that only isolation (not file permissions) keeps sandboxes away from them.
        self.canary_dir = Path(f"/var/lib/agentbox-battery-{n[:12]}")
        self.canary_file = self.canary_dir / "secret.txt"
        self.drop_dir = self.canary_dir / "drop"
        # Shown to every sandbox read-only (the operator's --host-path): files only ids the
        # sandbox does not map may read, a host-root 0600 file and a 0700 dir of an id outside
        # every sandbox's range, so that a sandbox root's capabilities are seen to stop there.
        self.foreign_dir = self.canary_dir / "foreign"
        self.foreign_secret = f"ABX-CANARY-FOREIGN-{n}"
        self.hits: list[Hit] = []
        # Listener addresses a check reaches on purpose (its baseline): contact with them is
        # recorded apart, with everything the client sent, and is no break by itself.
        self._expected: frozenset[str] = frozenset()
        self.expected_hits: list[Hit] = []
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._canary_proc: subprocess.Popen | None = None
        self.signal_log = self.canary_dir / "signals.log"
        self.extra_secrets: dict[str, str] = {}
        self._files: dict[str, str] = {}
        self._knobs: dict[str, str] = {}
        self._listings: dict[str, set[str]] = {}
        self._mounts: set[str] = set()

    # ------------------------------------------------------------------ canaries

    def plant(self) -> None:
        self.canary_dir.mkdir(mode=0o755)
        os.chmod(self.canary_dir, 0o755)
        self.canary_file.write_text(self.read_secret + "\n")
        os.chmod(self.canary_file, 0o666)
        self.drop_dir.mkdir()
        os.chmod(self.drop_dir, 0o777)
        self.signal_log.touch()
        self._plant_foreign()
        # A host process the sandbox must neither see, trace nor signal.
        code = (
            f"# abx-canary-proc-{self.nonce}\n"  # early in its cmdline, where `ps` shows it
            "import signal,sys,time\n"
            "def h(*a):\n"
            f"    open({str(self.signal_log)!r},'a').write('SIGUSR1\\n')\n"
            "signal.signal(signal.SIGUSR1,h)\n"
            "while True: time.sleep(3600)\n"
        )
        self._canary_proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.snapshot()

    def _plant_foreign(self) -> None:
        from agentbox.runtimes.uids import POOL

        other = POOL[1] + 1000  # no sandbox's range holds it: "another sandbox's user"
        self.foreign_dir.mkdir(mode=0o755)
        os.chmod(self.foreign_dir, 0o755)
        root_only = self.foreign_dir / "host-root-only.txt"
        root_only.write_text(self.foreign_secret + "\n")
        os.chmod(root_only, 0o600)
        theirs = self.foreign_dir / "other-range"
        theirs.mkdir(mode=0o700)
        (theirs / "secret.txt").write_text(self.foreign_secret + "\n")
        for p in (theirs / "secret.txt", theirs):
            os.chown(p, other, other)
        os.chmod(theirs / "secret.txt", 0o600)
        os.chmod(theirs, 0o700)

    def foreign_files(self) -> list[str]:
        return [
            str(self.foreign_dir / "host-root-only.txt"),
            str(self.foreign_dir / "other-range" / "secret.txt"),
        ]

    def server_options(self) -> list[str]:
        """Operator options every battery server runs with, for the oracle's planted files."""
        return ["--host-path", str(self.foreign_dir)]

    @property
    def canary_pid(self) -> int:
        assert self._canary_proc is not None
        return self._canary_proc.pid

    def server_env(self) -> dict[str, str]:
        """Secrets planted in the server's environment; no sandbox may ever see them."""
        return {"ABX_CANARY_SECRET": self.env_secret, "AWS_SECRET_ACCESS_KEY": self.env_secret}

    def watched_dirs(self) -> list[Path]:
        return [
            Path(p)
            for p in (
                "/",
                "/etc",
                "/usr",
                "/usr/bin",
                "/var/lib",
                "/var/tmp",
                "/tmp",
                "/root",
                "/dev/shm",
            )
        ] + [self.canary_dir, self.drop_dir]

    def snapshot(self) -> None:
        self._files = {
            str(p): _digest(p)
            for p in (self.canary_file, Path("/etc/hostname"), Path("/etc/passwd"))
        }
        self._knobs = {k: _read(k) for k in HOST_KNOBS}
        self._listings = {str(d): _listing(d) for d in self.watched_dirs()}
        self._mounts = _host_mounts()

    # ------------------------------------------------------------------ judgement

    def secrets(self) -> dict[str, str]:
        out = {"canary file": self.read_secret, "server environment": self.env_secret}
        out.update(self.extra_secrets)
        return out

    def leaks(self, text: str) -> list[str]:
        """Which host secrets appear in `text`."""
        return [name for name, s in self.secrets().items() if s and s in text]

    def host_changes(self) -> list[str]:
        """WRITE/ESCAPE evidence since the last snapshot (then re-snapshot)."""
        changes = []
        for path, before in self._files.items():
            after = _digest(Path(path))
            if after != before:
                changes.append(f"WRITE: {path} changed")
        for k, before in self._knobs.items():
            if _read(k) != before:
                changes.append(f"ESCAPE: host {k} changed")
        mine = {str(self.canary_dir), str(self.drop_dir)}
        for d, names in self._listings.items():
            # Elsewhere other programs come and go: only names a probe made (they carry the
            # nonce) count. In the canary dirs every new name does.
            new = {n for n in _listing(Path(d)) - names if d in mine or self.nonce in n}
            if new:
                changes.append(f"WRITE: new entries in host {d}: {', '.join(sorted(new))[:200]}")
        new_mounts = _host_mounts() - self._mounts
        if new_mounts:
            changes.append(f"ESCAPE: new host mounts: {', '.join(sorted(new_mounts))[:200]}")
        if self.signal_log.exists() and self.signal_log.read_text():
            changes.append("ESCAPE: the host canary process received a signal from a sandbox")
            self.signal_log.write_text("")
        self.snapshot()
        return changes

    def take_hits(self) -> list[Hit]:
        with self._lock:
            hits, self.hits = self.hits, []
        return hits

    def _hit(self, what: str, detail: str) -> None:
        with self._lock:
            self.hits.append(Hit(what, detail))

    @contextlib.contextmanager
    def expecting(self, addresses: Iterable[str]) -> Iterator[list[Hit]]:
        """Within the block, TCP contact with `addresses` is legitimate traffic: it goes to the
        yielded list (with the bytes received), not among the hits. Decided when a connection
        is accepted, so one accepted inside the block is never judged as a break later."""
        with self._lock:
            self.expected_hits = []
        self._expected = frozenset(addresses)
        try:
            yield self.expected_hits
        finally:
            self._expected = frozenset()

    # ------------------------------------------------------------------ listeners

    def listen(self) -> None:
        """TCP/UDP listeners on every address of this network namespace, a DNS canary, and an
        abstract Unix socket. Any contact from a sandbox is a NET break."""
        for port in TCP_PORTS:
            for fam, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
                s = socket.socket(fam, socket.SOCK_STREAM)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if fam == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                s.bind((host, port))
                s.listen(64)
                self._serve_tcp(s, port)
        for port in UDP_PORTS:
            for fam, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
                s = socket.socket(fam, socket.SOCK_DGRAM)
                if fam == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                s.bind((host, port))
                self._serve_udp(s, port)
        ab = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        ab.bind("\0" + self.abstract_name)
        ab.listen(16)
        self._serve_tcp(ab, 0)

    @property
    def abstract_name(self) -> str:
        return f"abx-canary-{self.nonce}"

    def _serve_tcp(self, s: socket.socket, port: int) -> None:
        self._socks.append(s)

        def loop() -> None:
            while True:
                try:
                    c, peer = s.accept()
                except OSError:
                    return
                local = c.getsockname()
                label = f"abstract {self.abstract_name}" if port == 0 else f"tcp {local}"
                c.settimeout(0.5)
                if port != 0 and local[0] in self._expected:
                    data = _converse(c, http=port in (80, 8080))
                    with self._lock:
                        self.expected_hits.append(Hit(label, f"from {peer}", data=data))
                    c.close()
                    continue
                data = _receive(c, 512)
                self._hit(label, f"from {peer}: {data[:120]!r}")
                if port == 53 and len(data) > 2:
                    self._hit(f"dns-tcp {_qname(data[2:])}", "DNS over TCP")
                try:
                    if port in (80, 8080):
                        c.sendall(b"HTTP/1.0 200 OK\r\n\r\nABX-CANARY-LISTENER\n")
                    c.close()
                except OSError:
                    pass

        threading.Thread(target=loop, daemon=True).start()

    def _serve_udp(self, s: socket.socket, port: int) -> None:
        self._socks.append(s)

        def loop() -> None:
            while True:
                try:
                    data, peer = s.recvfrom(2048)
                except OSError:
                    return
                if port == 53:
                    name = _qname(data)
                    self._hit(f"dns {name}", f"from {peer}")
                    try:
                        s.sendto(_dns_answer(data, name), peer)
                    except OSError:
                        pass
                else:
                    self._hit(f"udp {s.getsockname()}", f"from {peer}: {data[:120]!r}")

        threading.Thread(target=loop, daemon=True).start()

    # ------------------------------------------------------------------ teardown

    def remove(self) -> None:
        for s in self._socks:
            s.close()
        if self._canary_proc is not None:
            self._canary_proc.kill()
            self._canary_proc.wait()
        shutil.rmtree(self.canary_dir, ignore_errors=True)
        for d in self.watched_dirs():
            for name in _listing(d):
                if self.nonce in name:
                    p = d / name
                    if p.is_dir() and not p.is_symlink():
                        shutil.rmtree(p, ignore_errors=True)
                    else:
                        p.unlink(missing_ok=True)


def _receive(c: socket.socket, limit: int) -> bytes:
    try:
        return c.recv(limit)
    except OSError:
        return b""


def _converse(c: socket.socket, http: bool, limit: int = 65536) -> bytes:
    """Everything a client sends until it stops or pauses. As an HTTP server it answers every
    request and keeps the connection open, so a second request on it arrives too."""
    data, answered = b"", 0
    while len(data) < limit:
        chunk = _receive(c, limit - len(data))
        if not chunk:
            break
        data += chunk
        while http and answered < data.count(b"\r\n\r\n"):
            answered += 1
            try:
                c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\nABX-CANARY-LISTENER\n")
            except OSError:
                return data
    return data


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        return f"unreadable:{e.errno}"


_KEPT_MOUNT = re.compile(r"sbx_[0-9a-f]{16}\.[0-9a-f]{8}")


def _host_mounts() -> set[str]:
    """Mount points of the host's mount namespace, except where agentbox itself mounts
    workspaces (under its bind roots)."""
    try:
        text = Path("/proc/1/mountinfo").read_text()
    except OSError:
        return set()
    points = {line.split()[4] for line in text.splitlines() if len(line.split()) > 4}
    # Workspaces and volumes of any agentbox data dir on this host (tests run beside the
    # battery): a sandbox's escape would have to mount exactly there to go unseen.
    return {p for p in points if not p.startswith("/run/agentbox/") and not _agentbox_mount(p)}


def _agentbox_mount(point: str) -> bool:
    if "/sandboxes/sbx_" in point:
        return True
    # A kept workspace mounted read-only while a test beside the battery reads it.
    kept = point.rsplit("/", 2)
    if len(kept) == 3 and kept[1].startswith("kept-mounts") and _KEPT_MOUNT.fullmatch(kept[2]):
        return True
    parts = point.rsplit("/", 3)
    return (
        len(parts) == 4
        and parts[1] == "volumes"
        and parts[2].startswith("vol_")
        and (parts[3] == "mnt")
    )


def _listing(d: Path) -> set[str]:
    try:
        return set(os.listdir(d))
    except OSError:
        return set()


def _qname(msg: bytes) -> str:
    labels, i = [], 12
    while i < len(msg) and msg[i]:
        n = msg[i]
        labels.append(msg[i + 1 : i + 1 + n].decode("ascii", "replace"))
        i += 1 + n
    return ".".join(labels)


def _dns_answer(query: bytes, name: str) -> bytes:
    """NXDOMAIN for everything but the metadata names (answered like a cloud's resolver)."""
    if len(query) < 12:
        return b""
    qid = query[:2]
    question = query[12:]
    addr = METADATA_NAMES.get(name.lower())
    if addr is None:
        return qid + struct.pack(">HHHHH", 0x8183, 1, 0, 0, 0) + question
    answer = struct.pack(">HHHIH", 0xC00C, 1, 1, 60, 4) + socket.inet_aton(addr)
    return qid + struct.pack(">HHHHH", 0x8180, 1, 1, 0, 0) + question + answer
