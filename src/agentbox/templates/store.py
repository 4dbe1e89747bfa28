"""Built templates on disk: the content-addressed layer cache, root filesystems and the index.

A build is five steps: base, apt, pip, files, finalize (a spec that `extends` another has the
parent's base, apt, pip and files steps, then its own apt, pip and files). Each step's key is
sha256(previous key + the step's canonical content), so a step is rebuilt only when it or a
step before it changed, and templates with a common prefix share layers. Metadata (env, run,
start, code) is in no layer key: changing it rebuilds nothing.

Layout under the store's root:

    layers/<key>/           a finished step (the base tree, or an overlay upper dir)
    layers/.tmp-<key>-*/    a step being built; renamed to layers/<key> only when it succeeds
    rootfs/<key>/           a flattened root filesystem, what sandboxes see read-only
    rootfs/<key>.json       its size and layers
    index/<name>.json       one per template: its layers, rootfs and metadata
    cache/apt-archives/     downloaded .debs, shared by every build
    cache/apt-lists/<h>/    apt's package lists, one directory per (mirror, suite)
    cache/pip/              pip's cache (downloads and built wheels)
    locks/                  flock files (see below)
    trash/                  directories being deleted: renamed here first, so a half-deleted
                            layer can never look like a finished one

Locks (fcntl.flock, so they hold across threads and processes and die with their holder):
`name-<name>` serialises builds and removal of one template; `build-<key>` serialises the
building of one layer or rootfs; `use-<key>` is held shared by every build that relies on that
layer or rootfs, and taken exclusively (without waiting) by garbage collection before it
deletes one, so a layer in use by a running build is never collected; `index` guards index
writes and collection; `cache-apt` / `cache-pip` give one build at a time the shared caches.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agentbox.templates import layers
from agentbox.templates.layers import Bind, Output, StepFailed
from agentbox.templates.spec import TemplateSpec, valid_name

BUILDER_VERSION = 1  # part of every key: bump it when a step's recipe changes
# Host tools each step runs (Debian packages: mmdebstrap, bubblewrap, util-linux, coreutils).
_TOOLS = {
    "base": ("mmdebstrap", "setpriv", "unshare"),
    "apt": ("bwrap", "setpriv", "unshare"),
    "pip": ("bwrap", "setpriv", "unshare"),
    "files": ("bwrap", "setpriv", "unshare"),
    "finalize": ("cp", "setpriv", "unshare"),
}
# Every image gets these: the agent runs /usr/bin/python3, commands run in bash, apt must be
# there for the apt step whatever the variant, netbase gives /etc/services and /etc/protocols.
BASE_PACKAGES = ("apt", "bash", "ca-certificates", "netbase", "python3")
PIP_PACKAGE = "python3-pip"  # added to the apt step when the spec has pip packages
VENV_PACKAGE = "python3-venv"  # with it: `python3 -m venv` works in the sandbox

LogFn = Callable[[dict[str, Any]], None]


class BuildError(Exception):
    """A build failed. `step` names the step, `tail` holds its last output lines; the message
    says both."""

    def __init__(self, message: str, *, step: str | None = None, tail: Sequence[str] = ()):
        self.step = step
        self.tail = list(tail)
        if self.tail:
            message += "\nlast output:\n" + "\n".join(self.tail)
        super().__init__(message)


def _step_failed(
    spec: TemplateSpec, step: str, reason: str, tail: Sequence[str] = ()
) -> BuildError:
    return BuildError(f"template {spec.name}: step {step} failed: {reason}", step=step, tail=tail)


@dataclass(frozen=True)
class TemplateInfo:
    """A built template: where its root filesystem is and how sandboxes start in it."""

    name: str
    key: str  # content hash of the whole template (filesystem and metadata)
    rootfs: Path
    env: dict[str, str]
    workdir: str
    user: str
    start_cmd: str | None
    ready_cmd: str | None
    ready_timeout: float
    warm: tuple[str, ...]
    size_bytes: int
    built_at: float
    spec_text: str
    description: str = ""
    layers: tuple[str, ...] = ()  # layer keys, base first

    def summary(self) -> dict[str, Any]:
        """JSON-ready, without the spec text (the `done` event's `template`)."""
        out = asdict(self)
        out.pop("spec_text")
        out["rootfs"] = str(self.rootfs)
        out["warm"] = list(self.warm)
        out["layers"] = list(self.layers)
        return out


@dataclass(frozen=True)
class _Step:
    index: int
    name: str
    key: str
    work: dict[str, Any] | None  # the step's canonical content; None = nothing to do
    own: TemplateSpec  # whose packages or files it installs (a parent's, under `extends`)


def _key(prev: str, content: dict[str, Any]) -> str:
    blob = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(f"{prev}\n{blob}".encode()).hexdigest()


def _apt_packages(spec: TemplateSpec) -> list[str]:
    pkgs = set(spec.apt_packages)
    if spec.pip_packages:
        pkgs.update((PIP_PACKAGE, VENV_PACKAGE))
    return sorted(pkgs)


def _layer_works(spec: TemplateSpec) -> list[tuple[str, dict[str, Any] | None, TemplateSpec]]:
    """The layer steps (all but finalize): a parent's first, under `extends`."""
    v = BUILDER_VERSION
    if spec.parent is not None:
        works = _layer_works(spec.parent)
    else:
        base = {
            "step": "base",
            "v": v,
            "suite": spec.suite,
            "variant": spec.variant,
            "mirror": spec.mirror,
            "include": sorted(BASE_PACKAGES),
        }
        works = [("base", base, spec)]
    apt = _apt_packages(spec)
    works.append(("apt", {"step": "apt", "v": v, "packages": apt} if apt else None, spec))
    pip = sorted(spec.pip_packages)
    works.append(("pip", {"step": "pip", "v": v, "packages": pip} if pip else None, spec))
    files = sorted([f.dest, f.mode, hashlib.sha256(f.content).hexdigest()] for f in spec.files)
    works.append(("files", {"step": "files", "v": v, "files": files} if files else None, spec))
    return works


def plan(spec: TemplateSpec) -> list[_Step]:
    """The build's steps and their keys. A step with nothing to do keeps the previous key, so
    an empty [apt] table and no [apt] table are the same template (and a spec that extends
    another with nothing of its own is that template)."""
    finalize = {
        "step": "finalize",
        "v": BUILDER_VERSION,
        # The mount points it makes are in its key: a new one rebuilds this step alone.
        "mount_points": sorted(layers.MOUNT_POINTS),
        "venv": [layers.VENV, layers.VENV_UID, layers.PIP_SHIM],
        "profile_uid": layers.PROFILE_UID_QUICK,
    }
    steps: list[_Step] = []
    prev = ""
    for i, (name, work, own) in enumerate([*_layer_works(spec), ("finalize", finalize, spec)]):
        key = prev if work is None else _key(prev, work)
        steps.append(_Step(i, name, key, work, own))
        prev = key
    return steps


def _line_emitter(emit: LogFn, step: str) -> Callable[[str], None]:
    return lambda line: emit({"type": "log", "line": line, "step": step})


def _metadata(spec: TemplateSpec) -> dict[str, Any]:
    return {
        "description": spec.description,
        "env": dict(spec.env),
        "workdir": spec.workdir,
        "user": spec.user,
        "start_cmd": spec.start_cmd,
        "ready_cmd": spec.ready_cmd,
        "ready_timeout": spec.ready_timeout,
        "warm": list(spec.warm),
    }


class TemplateStore:
    """Builds templates from specs and keeps them, with their layer cache, under `root`.

    `in_use(rootfs)`, if given, says whether a running sandbox still uses a root filesystem:
    one that is, is kept when its template is removed or rebuilt, until `prune()` finds it
    free. Without it, removal deletes at once (the caller must not remove what runs)."""

    def __init__(self, root: Path, in_use: Callable[[Path], bool] | None = None) -> None:
        self.root = Path(root).absolute()
        self.in_use = in_use
        self.layers = self.root / "layers"
        self.rootfs_dir = self.root / "rootfs"
        self.index = self.root / "index"
        self.cache = self.root / "cache"
        self.locks = self.root / "locks"
        self.trash = self.root / "trash"
        self.root.mkdir(parents=True, exist_ok=True)
        # rootfs/ must be traversable by whoever the runtime runs bwrap as; the rest is root's.
        for d, mode in (
            (self.layers, 0o700),
            (self.rootfs_dir, 0o755),
            (self.index, 0o700),
            (self.cache, 0o700),
            (self.cache / "apt-archives", 0o755),
            (self.cache / "apt-lists", 0o755),
            (self.cache / "pip", 0o755),
            (self.locks, 0o700),
            (self.trash, 0o700),
        ):
            d.mkdir(mode=mode, exist_ok=True)

    # ------------------------------------------------------------------ queries

    def get(self, name: str) -> TemplateInfo | None:
        entry = self._read_entry(name)
        if entry is None:
            return None
        info = self._info(entry)
        return info if info.rootfs.is_dir() else None

    def list(self) -> list[TemplateInfo]:
        out = []
        for path in sorted(self.index.glob("*.json")):
            info = self.get(path.stem)
            if info is not None:
                out.append(info)
        return out

    # ------------------------------------------------------------------ build

    def build(self, spec: TemplateSpec, log: LogFn | None = None) -> TemplateInfo:
        """Build (or find cached) every step of `spec` and record it as template `spec.name`.
        Blocking; raises BuildError naming the failed step. See the module doc for caching."""
        emit: LogFn = log or (lambda _event: None)
        started = time.monotonic()
        steps = plan(spec)
        with self._lock("name", spec.name, fcntl.LOCK_EX), contextlib.ExitStack() as pins:
            lowers: list[str] = []  # layers built so far, topmost first (overlay order)
            for step in steps:
                t0 = time.monotonic()
                out = Output(_line_emitter(emit, step.name))
                if step.work is None:
                    emit(self._step_event(step, len(steps), cached=True, skipped=True))
                    emit({"type": "step_done", "index": step.index, "seconds": 0.0})
                    continue
                final = step.name == "finalize"
                target = self.rootfs_dir / step.key if final else self.layers / step.key
                # Pinned before looking, so collection cannot delete it between look and use.
                pins.enter_context(self._lock("use", step.key, fcntl.LOCK_SH))
                cached = target.is_dir()
                if not cached:
                    with self._lock("build", step.key, fcntl.LOCK_EX):
                        cached = target.is_dir()  # another build may have just made it
                        emit(self._step_event(step, len(steps), cached))
                        if not cached:
                            self._run_step(spec, step, lowers, target, out)
                else:
                    emit(self._step_event(step, len(steps), cached))
                if not final:
                    lowers.insert(0, step.key)
                seconds = round(time.monotonic() - t0, 3)
                emit({"type": "step_done", "index": step.index, "seconds": seconds})
            info = self._record(spec, steps, list(reversed(lowers)))
        # The superseded version (if any) is in the trash; deleting a GB of files takes seconds
        # that the caller need not wait for. Not a daemon: a one-shot process finishes it before
        # exiting (whatever a crash leaves, the next build, removal or prune takes).
        threading.Thread(target=self._empty_trash, name="agentbox-template-trash").start()
        emit(
            {
                "type": "done",
                "template": info.summary(),
                "seconds": round(time.monotonic() - started, 3),
            }
        )
        return info

    @staticmethod
    def _step_event(step: _Step, total: int, cached: bool, skipped: bool = False) -> dict[str, Any]:
        event = {
            "type": "step",
            "index": step.index,
            "total": total,
            "name": step.name,
            "key": step.key,
            "cached": cached,
        }
        if skipped:
            event["skipped"] = True
        return event

    def _run_step(
        self, spec: TemplateSpec, step: _Step, lowers: Sequence[str], target: Path, out: Output
    ) -> None:
        """Build one layer (or the rootfs) into a scratch dir, then rename it into place; on
        any failure the scratch dir is deleted and BuildError raised."""
        if os.geteuid() != 0:
            raise _step_failed(spec, step.name, "template builds must run as root")
        missing = layers.missing_tools(_TOOLS[step.name])
        if missing:
            raise _step_failed(
                spec, step.name,
                f"{', '.join(missing)} not found on this host: apt-get install mmdebstrap "
                "bubblewrap util-linux",
            )  # fmt: skip
        parent = target.parent
        for stale in parent.glob(f".tmp-{step.key}-*"):
            layers.remove_tree(stale)  # left by a build that died: we hold its build lock
        scratch = parent / f".tmp-{step.key}-{secrets.token_hex(4)}"
        scratch.mkdir(mode=0o700)
        try:
            result = self._step_tree(spec, step, lowers, scratch, out)
            os.rename(result, target)
        except StepFailed as e:
            raise _step_failed(spec, step.name, str(e), e.tail) from None
        except OSError as e:
            raise _step_failed(spec, step.name, str(e), out.tail) from None
        finally:
            layers.remove_tree(scratch)

    def _step_tree(
        self, spec: TemplateSpec, step: _Step, lowers: Sequence[str], scratch: Path, out: Output
    ) -> Path:
        archives = self.cache / "apt-archives"
        lists = (
            self.cache
            / "apt-lists"
            / hashlib.sha256(f"{spec.mirror} {spec.suite}".encode()).hexdigest()[:16]
        )
        lists.mkdir(mode=0o755, exist_ok=True)
        apt_binds = [
            Bind(archives, "/var/cache/apt/archives"),
            Bind(lists, "/var/lib/apt/lists"),
        ]
        if step.name == "base":
            tree = scratch / "upper"
            tree.mkdir(mode=0o755)
            with self._cache_lock("apt", out):
                layers.make_base(
                    tree, spec.suite, spec.variant, spec.mirror, sorted(BASE_PACKAGES),
                    archives, lists, out,
                )  # fmt: skip
            tree.chmod(0o755)
            return tree
        if step.name == "apt":
            with self._cache_lock("apt", out):
                return layers.run_in_overlay(
                    self.layers, lowers, scratch, layers.APT_SCRIPT, _apt_packages(step.own),
                    apt_binds, out,
                )  # fmt: skip
        if step.name == "pip":
            with self._cache_lock("pip", out):
                return layers.run_in_overlay(
                    self.layers, lowers, scratch, layers.PIP_SCRIPT, step.own.pip_packages,
                    [Bind(self.cache / "pip", "/tmp/agentbox-pip-cache")], out,
                )  # fmt: skip
        if step.name == "files":
            staging = scratch / "files"
            staging.mkdir(mode=0o755)
            args: list[str] = []
            for i, f in enumerate(step.own.files):
                (staging / str(i)).write_bytes(f.content)
                args += [f.dest, f"{f.mode:04o}"]
            return layers.run_in_overlay(
                self.layers, lowers, scratch, layers.FILES_SCRIPT, args,
                [Bind(staging, "/tmp/agentbox-files", read_only=True)], out,
            )  # fmt: skip
        # finalize
        tree = scratch / "rootfs"
        tree.mkdir(mode=0o755)
        layers.flatten(self.layers, lowers, tree, out)
        meta = {"size_bytes": layers.tree_size(tree), "layers": list(reversed(lowers))}
        self._write_json(self.rootfs_dir / f"{step.key}.json", meta)
        return tree

    @contextlib.contextmanager
    def _cache_lock(self, name: str, out: Output) -> Iterator[None]:
        """One build at a time uses a shared download cache (apt's own locks would make a
        second build fail rather than wait)."""
        path = self.locks / f"cache-{name}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                out.line(f"agentbox: waiting for the {name} cache (another build is using it)")
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _record(
        self, spec: TemplateSpec, steps: Sequence[_Step], layer_keys: Sequence[str]
    ) -> TemplateInfo:
        """Write the index entry; collect what the template's previous version used alone."""
        rootfs_key = steps[-1].key
        meta = self._read_json(self.rootfs_dir / f"{rootfs_key}.json") or {}
        size = meta.get("size_bytes")
        if not isinstance(size, int):
            size = layers.tree_size(self.rootfs_dir / rootfs_key)
        entry = {
            "name": spec.name,
            "key": _key(rootfs_key, _metadata(spec)),
            "rootfs_key": rootfs_key,
            "layers": list(layer_keys),
            "size_bytes": size,
            "built_at": time.time(),
            "spec_text": spec.spec_text,
            **_metadata(spec),
        }
        with self._lock("index", "", fcntl.LOCK_EX):
            old = self._read_entry(spec.name)
            self._write_json(self.index / f"{spec.name}.json", entry)
            if old is not None:
                self._collect(set(old.get("layers", [])), {str(old.get("rootfs_key"))})
        return self._info(entry)

    # ------------------------------------------------------------------ removal

    def remove(self, name: str) -> bool:
        """Forget template `name` and delete its rootfs and the layers no other template uses.
        False if there was no such template."""
        if not valid_name(name):
            return False
        with self._lock("name", name, fcntl.LOCK_EX), self._lock("index", "", fcntl.LOCK_EX):
            entry = self._read_entry(name)
            if entry is None:
                return False
            (self.index / f"{name}.json").unlink()
            self._collect(set(entry.get("layers", [])), {str(entry.get("rootfs_key"))})
        self._empty_trash()
        return True

    def prune(self) -> int:
        """Delete every layer and rootfs no template uses (a failed build's finished steps
        stay cached until now), the scratch of dead builds and the trash. Returns bytes freed.
        The download caches are kept."""
        with self._lock("index", "", fcntl.LOCK_EX):
            layer_refs, rootfs_refs = self._references()
            for d in self.layers.iterdir():
                if not d.name.startswith(".") and d.name not in layer_refs:
                    self._trash_unpinned(d, d.name)
            for d in self.rootfs_dir.iterdir():
                if d.is_dir() and not d.name.startswith(".") and d.name not in rootfs_refs:
                    if self.in_use is None or not self.in_use(d):
                        self._trash_unpinned(d, d.name)
            for parent in (self.layers, self.rootfs_dir):
                for d in parent.glob(".tmp-*"):
                    key = d.name.split("-")[1]
                    with self._try_lock("build", key) as free:
                        if free:  # no build of that key is running: a dead build's scratch
                            os.rename(d, self.trash / d.name)
        freed = sum(layers.tree_size(d) for d in self.trash.iterdir())
        self._empty_trash()
        return freed

    def _collect(self, layer_keys: set[str], rootfs_keys: set[str]) -> None:
        """Move to the trash those of `layer_keys` / `rootfs_keys` that no index entry refers
        to and no build has pinned. Called with the index lock held; the caller empties the
        trash after releasing it."""
        layer_refs, rootfs_refs = self._references()
        for key in layer_keys - layer_refs:
            self._trash_unpinned(self.layers / key, key)
        for key in rootfs_keys - rootfs_refs:
            path = self.rootfs_dir / key
            if self.in_use is not None and path.is_dir() and self.in_use(path):
                continue  # a running sandbox sees it; prune() takes it later
            self._trash_unpinned(path, key)

    def _references(self) -> tuple[set[str], set[str]]:
        layer_refs: set[str] = set()
        rootfs_refs: set[str] = set()
        for path in self.index.glob("*.json"):
            entry = self._read_json(path)
            if entry:
                layer_refs.update(entry.get("layers", []))
                rootfs_refs.add(str(entry.get("rootfs_key")))
        return layer_refs, rootfs_refs

    def _trash_unpinned(self, path: Path, key: str) -> None:
        """Move `path` to the trash unless a build holds it. A rename, so a layer that a crash
        interrupts while it is being deleted can never look like a finished one."""
        if not path.is_dir():
            return
        with self._try_lock("use", key) as free:
            if free:
                os.rename(path, self.trash / f"{key}-{secrets.token_hex(4)}")
                meta = path.parent / f"{key}.json"
                if path.parent == self.rootfs_dir and meta.exists():
                    meta.unlink()

    def _empty_trash(self) -> None:
        for d in self.trash.iterdir():
            layers.remove_tree(d)

    # ------------------------------------------------------------------ helpers

    @contextlib.contextmanager
    def _lock(self, kind: str, name: str, mode: int) -> Iterator[None]:
        path = self.locks / (f"{kind}-{name}.lock" if name else f"{kind}.lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, mode)
            yield
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _try_lock(self, kind: str, name: str) -> Iterator[bool]:
        """Exclusive without waiting: yields whether it was free (and is now ours)."""
        fd = os.open(
            self.locks / f"{kind}-{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
        )
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)

    def _read_entry(self, name: str) -> dict[str, Any] | None:
        if not valid_name(name):
            return None
        return self._read_json(self.index / f"{name}.json")

    @staticmethod
    def _read_json(path: Path) -> dict[str, Any] | None:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    @staticmethod
    def _write_json(path: Path, data: dict[str, Any]) -> None:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def _info(self, entry: dict[str, Any]) -> TemplateInfo:
        return TemplateInfo(
            name=entry["name"],
            key=entry["key"],
            rootfs=self.rootfs_dir / entry["rootfs_key"],
            env=dict(entry.get("env", {})),
            workdir=entry.get("workdir", "/workspace"),
            user=entry.get("user", "user"),
            start_cmd=entry.get("start_cmd"),
            ready_cmd=entry.get("ready_cmd"),
            ready_timeout=float(entry.get("ready_timeout", 30.0)),
            warm=tuple(entry.get("warm", ())),
            size_bytes=int(entry.get("size_bytes", 0)),
            built_at=float(entry.get("built_at", 0.0)),
            spec_text=entry.get("spec_text", ""),
            description=entry.get("description", ""),
            layers=tuple(entry.get("layers", ())),
        )
