"""Template builds for real: mmdebstrap, overlay layers, the content cache, removal, failure.

One store is shared by the module so the Debian base (~20 s) is built once. Set
AGENTBOX_TEST_TEMPLATE_DIR to keep it between runs (then nothing is deleted at the end).
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentbox.templates import (
    BuildError,
    SpecError,
    TemplateSpec,
    TemplateStore,
    builtin_spec_path,
    load_spec,
)
from agentbox.templates.store import plan

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("mmdebstrap") or not shutil.which("bwrap"),
    reason="template builds need root, mmdebstrap and bubblewrap",
)

TINY = """
name = "tiny"
description = "a test template"
[base]
variant = "apt"
[apt]
packages = ["less"]
[[files]]
dest = "/etc/agentbox-test/hello.txt"
content = "hello from the template\\n"
mode = "0640"
[[files]]
dest = "/usr/local/bin/greet"
content = "#!/bin/sh\\necho greetings\\n"
mode = "0755"
[env]
FOO = "bar"
[run]
workdir = "/workspace"
"""
UNPRIVILEGED = ["setpriv", "--reuid=200123", "--regid=200123", "--clear-groups"]


def sandbox_run(rootfs: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run argv in `rootfs` the way the runtime will: read-only root, unprivileged uid.

    bwrap resolves its bind sources as that uid, and the store may sit below private dirs (the
    pytest tmp dir is 0700), so the rootfs is first bound, in a mount namespace of its own, onto
    a directory that uid can reach."""
    reachable = Path(tempfile.mkdtemp(prefix="agentbox-tpl-", dir="/tmp"))
    reachable.chmod(0o755)
    cmd = [
        "unshare", "--mount", "--propagation", "private", "--",
        "sh", "-c", 'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh",
        str(rootfs), str(reachable),
        *UNPRIVILEGED,
        "bwrap", "--unshare-all", "--unshare-user", "--uid", "1000", "--gid", "1000",
        "--disable-userns", "--cap-drop", "ALL",
        "--ro-bind", str(reachable), "/",
        "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--dir", "/run",
        "--chdir", "/tmp", "--setenv", "HOME", "/tmp", "--", *argv,
    ]  # fmt: skip
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    finally:
        reachable.rmdir()


class Events:
    """A build's log events, in order."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def __call__(self, event: dict[str, Any]) -> None:
        self.events.append(event)

    def steps(self) -> dict[str, dict[str, Any]]:
        return {e["name"]: e for e in self.events if e["type"] == "step"}

    def cached(self) -> dict[str, bool]:
        return {name: e["cached"] for name, e in self.steps().items()}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TemplateStore]:
    override = os.environ.get("AGENTBOX_TEST_TEMPLATE_DIR")
    root = Path(override) if override else tmp_path_factory.mktemp("templates")
    store = TemplateStore(root)
    if override:
        # A kept store: a base-only template keeps the base layer cached across runs; what
        # earlier runs left is cleared so every test starts from the same state.
        store.build(load_spec('name = "test-keep-base"'))
        for info in store.list():
            if info.name != "test-keep-base" and info.name != "code-interpreter":
                store.remove(info.name)
        store.prune()
    yield store
    if not override:
        shutil.rmtree(root, ignore_errors=True)  # rootfs trees are hundreds of MB


@pytest.fixture(scope="module")
def tiny(store: TemplateStore) -> tuple[Any, Events]:
    events = Events()
    info = store.build(load_spec(TINY), events)
    return info, events


def with_tiny(**changes: str) -> str:
    text = TINY
    for old, new in changes.items():
        assert old in text
        text = text.replace(old, new)
    return text


def mounts_under(root: Path) -> list[str]:
    text = Path("/proc/self/mountinfo").read_text()
    return [line for line in text.splitlines() if str(root) in line or "agentbox-build" in line]


# ---------------------------------------------------------------------- builds


def test_build_produces_a_working_rootfs(store: TemplateStore, tiny: tuple[Any, Events]) -> None:
    info, events = tiny
    rootfs = info.rootfs
    assert info.name == "tiny" and info.env == {"FOO": "bar"} and info.workdir == "/workspace"
    assert info.size_bytes > 50_000_000 and rootfs.is_dir()
    assert store.get("tiny") == info and "tiny" in [t.name for t in store.list()]

    steps = [e for e in events.events if e["type"] == "step"]
    assert [e["name"] for e in steps] == ["base", "apt", "pip", "files", "finalize"]
    assert all(e["total"] == 5 for e in steps) and [e["index"] for e in steps] == [0, 1, 2, 3, 4]
    assert events.cached()["apt"] is False and events.cached()["finalize"] is False
    assert events.steps()["pip"].get("skipped") is True
    assert events.events[-1]["type"] == "done" and events.events[-1]["template"]["name"] == "tiny"
    # Output arrives line by line while its step runs, not in one piece at the end.
    i_apt = events.events.index(events.steps()["apt"])
    apt_lines = []
    for e in events.events[i_apt + 1 :]:
        if e["type"] == "step_done":
            break
        apt_lines.append(e["line"])
    assert any("less" in line for line in apt_lines), apt_lines[-10:]

    for path in ("usr/bin/python3", "bin/bash", "etc/passwd", "etc/group", "usr/bin/less"):
        assert (rootfs / path).exists(), path
    for path in ("workspace", ".agentbox", "tmp", "proc", "dev", "run", "var/tmp"):
        assert (rootfs / path).is_dir() and not (rootfs / path).is_symlink(), path
    assert list((rootfs / "dev").iterdir()) == []
    hello = rootfs / "etc/agentbox-test/hello.txt"
    assert hello.read_text() == "hello from the template\n"
    assert stat.S_IMODE(hello.stat().st_mode) == 0o640
    assert stat.S_IMODE((rootfs / "usr/local/bin/greet").stat().st_mode) == 0o755
    assert mounts_under(store.root) == []


def test_rootfs_runs_read_only_as_an_unprivileged_user(tiny: tuple[Any, Events]) -> None:
    info, _ = tiny
    r = sandbox_run(
        info.rootfs, "/bin/bash", "-c",
        "id -u; /usr/bin/python3 -c 'import ssl, sqlite3, json; print(\"py ok\")'; greet; "
        "less --version | head -1; test -r /etc/ssl/certs/ca-certificates.crt && echo ca ok; "
        "cat /etc/agentbox-test/hello.txt || echo unreadable; touch /x 2>&1 || true",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.startswith("1000\n") and "py ok" in out and "greetings" in out, out
    assert "less 590" in out or "less " in out, out
    assert "ca ok" in out and "unreadable" in out  # the file is 0640, root's
    assert "Read-only file system" in out


def test_unchanged_rebuild_is_all_cached(store: TemplateStore, tiny: tuple[Any, Events]) -> None:
    info, _ = tiny
    events = Events()
    again = store.build(load_spec(TINY), events)
    assert set(events.cached().values()) == {True}
    assert not [e for e in events.events if e["type"] == "log"]
    assert again.key == info.key and again.rootfs == info.rootfs


def test_changed_files_step_reuses_base_and_apt(store: TemplateStore) -> None:
    before = store.get("tiny")
    assert before is not None
    events = Events()
    spec = load_spec(with_tiny(**{"hello from the template": "hello again"}))
    info = store.build(spec, events)
    assert events.cached() == {
        "base": True, "apt": True, "pip": True, "files": False, "finalize": False,
    }  # fmt: skip
    assert info.rootfs != before.rootfs
    assert (info.rootfs / "etc/agentbox-test/hello.txt").read_text() == "hello again\n"
    assert info.layers[:2] == before.layers[:2] and info.layers[2] != before.layers[2]
    # The superseded version's own layer and rootfs are gone; the shared ones stay.
    assert not before.rootfs.exists() and not (store.layers / before.layers[2]).exists()
    assert all((store.layers / k).is_dir() for k in info.layers)


def test_env_change_rebuilds_nothing(store: TemplateStore) -> None:
    before = store.get("tiny")
    assert before is not None
    events = Events()
    text = with_tiny(**{"hello from the template": "hello again", 'FOO = "bar"': 'FOO = "baz"'})
    info = store.build(load_spec(text + '\n[start]\ncmd = "sleep 1"\n'), events)
    assert set(events.cached().values()) == {True}
    assert info.rootfs == before.rootfs and info.key != before.key
    assert info.env == {"FOO": "baz"} and info.start_cmd == "sleep 1"
    assert store.get("tiny") == info


def test_concurrent_builds_share_one_layer_build(store: TemplateStore) -> None:
    text = with_tiny(**{"hello from the template": "built once"})
    logs = [Events(), Events()]
    results: list[Any] = [None, None]

    def build(i: int) -> None:
        name = ("tiny-a", "tiny-b")[i]
        results[i] = store.build(
            load_spec(text.replace('name = "tiny"', f'name = "{name}"')), logs[i]
        )

    threads = [threading.Thread(target=build, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(r is not None for r in results)
    assert sorted(e.cached()["files"] for e in logs) == [False, True]
    assert results[0].rootfs == results[1].rootfs
    for name in ("tiny-a", "tiny-b"):
        assert store.remove(name)
    assert not results[0].rootfs.exists()


def test_remove_frees_disk(store: TemplateStore) -> None:
    events = Events()
    other = store.build(
        load_spec(with_tiny(**{'"tiny"': '"tiny-other"', '"less"': '"file"'})), events
    )
    assert events.cached()["base"] is True and events.cached()["apt"] is False
    tiny = store.get("tiny")
    assert tiny is not None and other.layers[0] == tiny.layers[0]
    own = [k for k in other.layers if k not in tiny.layers]
    assert own and all((store.layers / k).is_dir() for k in own)
    used = du(store.root)

    assert store.remove("tiny-other") is True
    assert store.get("tiny-other") is None and store.remove("tiny-other") is False
    assert not other.rootfs.exists() and not any((store.layers / k).exists() for k in own)
    assert (store.layers / other.layers[0]).is_dir()  # the base, still tiny's
    assert used - du(store.root) >= other.size_bytes
    assert sandbox_run(tiny.rootfs, "/usr/bin/python3", "-c", "print(1)").stdout == "1\n"


def test_failing_step_leaves_nothing_behind(store: TemplateStore) -> None:
    text = with_tiny(**{'"tiny"': '"broken"', '"less"': '"less", "agentbox-no-such-package"'})
    spec = load_spec(text)
    failed_key = plan(spec)[1].key
    with pytest.raises(BuildError) as exc:
        store.build(spec, Events())
    msg = str(exc.value)
    assert exc.value.step == "apt" and "step apt failed" in msg
    assert "agentbox-no-such-package" in msg  # apt's own complaint, from the output's tail
    assert not (store.layers / failed_key).exists()
    assert not list(store.layers.glob(".tmp-*")) and not list(store.rootfs_dir.glob(".tmp-*"))
    assert mounts_under(store.root) == []
    assert store.get("broken") is None


KILL_ON_FIRST_APT_LINE = """
import os, signal, sys
from pathlib import Path
from agentbox.templates import TemplateStore, load_spec

def log(event):
    if event["type"] == "log" and event["step"] == "apt":
        os.kill(os.getpid(), signal.SIGKILL)  # the server dying in the middle of a step

TemplateStore(Path(sys.argv[1])).build(load_spec(sys.stdin.read()), log)
"""


def test_killed_build_leaves_nothing_running_and_rebuilds(store: TemplateStore) -> None:
    text = with_tiny(**{'"tiny"': '"killed"', '"less"': '"bzip2"'})
    r = subprocess.run(
        [sys.executable, "-c", KILL_ON_FIRST_APT_LINE, str(store.root)],
        input=text, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == -signal.SIGKILL, r.stderr
    deadline = time.monotonic() + 10
    while processes_using(store.root) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_using(store.root) == []
    assert mounts_under(store.root) == []
    assert list(store.layers.glob(".tmp-*"))  # the dead step's scratch, until the next build
    events = Events()
    info = store.build(load_spec(text), events)
    assert events.cached()["apt"] is False and (info.rootfs / "usr/bin/bzip2").exists()
    assert not list(store.layers.glob(".tmp-*"))
    assert store.remove("killed")


def processes_using(root: Path) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        # Paths inside the store (a build's mounts and steps), not a server merely configured
        # with the store (`--template-dir ROOT`) when tests share one.
        if f"{root}/" in text:
            found.append(text[:200])
    return found


def test_prune_removes_unreferenced_layers(store: TemplateStore) -> None:
    spec = load_spec(with_tiny(**{'"tiny"': '"pruned"', "hello from the template": "pruned"}))
    info = store.build(spec, Events())
    index = store.index / "pruned.json"
    index.unlink()  # as if the template were forgotten while its layers stayed cached
    assert store.prune() > 0
    assert not info.rootfs.exists() and not (store.layers / info.layers[-1]).exists()
    tiny = store.get("tiny")
    assert tiny is not None and tiny.rootfs.is_dir()
    assert all((store.layers / k).is_dir() for k in tiny.layers)


def du(path: Path) -> int:
    out = subprocess.run(
        ["du", "-s", "--block-size=1", str(path)], capture_output=True, text=True, check=True
    )
    return int(out.stdout.split()[0])


# ---------------------------------------------------------------------- specs


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('name = "x"\nfoo = 1', "unknown key 'foo'"),
        (
            'name = "x"\n[apt]\npackages = []\nrecommends = true',
            "unknown key 'recommends' in [apt]",
        ),
        ('name = "x"\n[[files]]\ndest = "/a"\ncontent = ""\nowner = "me"', "files[0]"),
        ('name = "Bad_Name"', "name:"),
        ('name = "-x"', "name:"),
        ('name = "' + "a" * 64 + '"', "name:"),
        ("description = 'no name'", "name: missing"),
        ('name = "x"\n[apt]\npackages = ["curl wget"]', "apt.packages: 'curl wget'"),
        ('name = "x"\n[apt]\npackages = ["-oDebug::pkgProblemResolver=1"]', "apt.packages"),
        ('name = "x"\n[apt]\npackages = ["curl;rm"]', "apt.packages"),
        ('name = "x"\n[pip]\npackages = ["--index-url=http://evil/"]', "pip.packages"),
        ('name = "x"\n[pip]\npackages = ["numpy @ https://x/y.whl"]', "pip.packages"),
        ('name = "x"\n[base]\nvariant = "fat"', "base.variant: 'fat'"),
        ('name = "x"\n[base]\nmirror = "file:///etc"', "base.mirror"),
        ('name = "x"\n[base]\nsuite = "bookworm main"', "base.suite"),
        ('name = "x"\n[[files]]\ndest = "/proc/x"\ncontent = "a"', "files[0].dest: '/proc/x'"),
        ('name = "x"\n[[files]]\ndest = "/.agentbox/main.py"\ncontent = "a"', "files[0].dest"),
        ('name = "x"\n[[files]]\ndest = "/workspace"\ncontent = "a"', "files[0].dest"),
        ('name = "x"\n[[files]]\ndest = "etc/x"\ncontent = "a"', "absolute"),
        ('name = "x"\n[[files]]\ndest = "/etc/../proc/x"\ncontent = "a"', "normalised"),
        ('name = "x"\n[[files]]\ndest = "/etc/x"\ncontent = "a"\nmode = "4755"', "files[0].mode"),
        ('name = "x"\n[[files]]\ndest = "/etc/x"\nsrc = "x.txt"', "send the file's text"),
        ('name = "x"\n[[files]]\ndest = "/etc/x"', "exactly one of content"),
        ('name = "x"\n[env]\n"1X" = "a"', "env: '1X'"),
        ('name = "x"\n[env]\nX = 1', "env.X: must be a string"),
        ('name = "x"\n[run]\nuser = "admin"', "run.user"),
        ('name = "x"\n[run]\nworkdir = "relative"', "run.workdir"),
        ('name = "x"\n[start]\nready = "true"', "start.cmd: missing"),
        ('name = "x"\n[start]\ncmd = "x"\nready_timeout = 0', "start.ready_timeout"),
        ('name = "x"\n[code]\nwarm = "python"', "code.warm"),
        ('name = "x"\n[code]\nwarm = ["Py thon"]', "code.warm"),
        ("name = ", "not valid TOML"),
        ('name = "x"\nextends = "no-such"', "extends: 'no-such' is not a shipped"),
        ('name = "x"\nextends = "../base"', "extends: '../base'"),
        ('name = "x"\nextends = "base"\n[base]\nsuite = "trixie"', "remove [base]"),
    ],
)
def test_bad_specs_are_refused_with_the_field_named(text: str, needle: str) -> None:
    with pytest.raises(SpecError) as exc:
        load_spec(text)
    assert needle in str(exc.value)


def test_spec_defaults_and_src(tmp_path: Path) -> None:
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "app.ini").write_bytes(b"[app]\nx=1\n")
    text = 'name = "x"\n[[files]]\ndest = "/etc/app.ini"\nsrc = "conf/app.ini"\n'
    spec = load_spec(text, tmp_path)
    assert isinstance(spec, TemplateSpec)
    assert (spec.suite, spec.variant, spec.mirror) == (
        "bookworm", "apt", "http://deb.debian.org/debian",
    )  # fmt: skip
    assert spec.workdir == "/workspace" and spec.user == "user" and spec.warm == ()
    assert spec.files[0].content == b"[app]\nx=1\n" and spec.files[0].mode == 0o644
    with pytest.raises(SpecError, match="outside the spec's directory"):
        load_spec(text.replace("conf/app.ini", "../../etc/shadow"), tmp_path)
    # Reordering packages or adding an empty table is the same template.
    a = load_spec('name = "x"\n[apt]\npackages = ["b", "a"]')
    b = load_spec('name = "x"\n[apt]\npackages = ["a", "b"]\n[pip]\npackages = []')
    assert [s.key for s in plan(a)] == [s.key for s in plan(b)]


def test_shipped_code_interpreter_spec_loads() -> None:
    path = builtin_spec_path("code-interpreter")
    assert (
        path is not None and builtin_spec_path("../x") is None and builtin_spec_path("no") is None
    )
    spec = load_spec(path.read_text(), path.parent)
    assert spec.warm == ("python",) and "nodejs" in spec.apt_packages
    assert spec.env["MPLBACKEND"] == "module://matplotlib_inline.backend_inline"
    # code-interpreter-full extends it: its settings, merged env, its layers first.
    path = builtin_spec_path("code-interpreter-full")
    assert path is not None
    full = load_spec(path.read_text(), path.parent)
    assert full.parent == spec and full.warm == spec.warm and full.workdir == spec.workdir
    assert full.env["MPLBACKEND"] == spec.env["MPLBACKEND"] and full.env["DENO_DIR"]
    assert "r-cran-irkernel" in full.apt_packages and "nodejs" not in full.apt_packages
    parent_steps, steps = plan(spec), plan(full)
    assert [s.key for s in steps[:4]] == [s.key for s in parent_steps[:4]]
    assert [s.name for s in steps] == ["base", "apt", "pip", "files", "apt", "pip", "files",
                                       "finalize"]  # fmt: skip
    # Its own settings win; [base] is the parent's to say.
    child = load_spec('name = "y"\nextends = "code-interpreter"\n[run]\nworkdir = "/srv"\n'
                      '[code]\nwarm = []\n[env]\nIPYTHONDIR = "/srv/ipy"')  # fmt: skip
    assert child.workdir == "/srv" and child.warm == () and child.env["IPYTHONDIR"] == "/srv/ipy"
    assert plan(child)[-1].key == parent_steps[-1].key  # no layer of its own: the same rootfs


# ---------------------------------------------------------------------- the shipped template


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_shipped_code_interpreters_build_and_run(full_template: Path) -> None:
    """code-interpreter and code-interpreter-full as every test server has them (built once per
    machine in the shared store; from nothing in CI): their tools run in them, full's layers are
    code-interpreter's with its own two on top, and building either again is all cached."""
    store = TemplateStore(full_template)
    ci, full = store.get("code-interpreter"), store.get("code-interpreter-full")
    assert ci is not None and full is not None
    assert full.layers[: len(ci.layers)] == ci.layers and len(full.layers) == len(ci.layers) + 2
    r = sandbox_run(
        ci.rootfs, "/usr/bin/python3", "-c",
        "import ipykernel, jupyter_client, numpy, pandas, matplotlib, matplotlib_inline; "
        "import matplotlib.pyplot as plt; plt.plot([1, 2]); print('ok', numpy.__version__)",
    )  # fmt: skip
    assert r.returncode == 0 and r.stdout.startswith("ok "), r.stderr
    r = sandbox_run(ci.rootfs, "python3", "-m", "ipykernel_launcher", "--help")
    assert r.returncode == 0 and "IPython" in r.stdout, r.stderr
    r = sandbox_run(ci.rootfs, "/bin/bash", "-c", "node -e 'console.log(1+1)'; git --version")
    assert r.returncode == 0 and r.stdout.startswith("2\ngit version"), r.stderr
    r = sandbox_run(
        full.rootfs, "/bin/bash", "-c",
        "R --slave -e 'cat(requireNamespace(\"IRkernel\"))'; echo; "
        "DENO_DIR=/tmp/deno deno --version | head -1",
    )  # fmt: skip
    assert r.returncode == 0 and r.stdout.startswith("TRUE\ndeno 2."), r.stdout + r.stderr
    for name in ("code-interpreter", "code-interpreter-full"):
        path = builtin_spec_path(name)
        assert path is not None
        events = Events()
        again = store.build(load_spec(path.read_text(), path.parent), events)
        assert set(events.cached().values()) == {True}, name
        assert again.rootfs == (ci if name == "code-interpreter" else full).rootfs
