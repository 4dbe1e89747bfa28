"""`sudo apt-get install pkg` and `pip install pkg` through the egress proxy, from an apt
repository and a PyPI-style simple index served here on loopback: what an agent does when
its sandbox's policy allows the mirror. Nothing leaves this machine (the server lets policies
reach 127.0.0.0/8 and names the mirror `mirror.test`)."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import ServerHandle, make_deb, start_server
from test_pip_user import _wheel

from agentbox import Sandbox

pytestmark = pytest.mark.timeout(300)


def _apt_repo(root: Path, debs: list[Path]) -> None:
    """A flat apt repository (`deb [trusted=yes] URL ./`): the packages, their Packages index
    and a Release file listing it (what dpkg-scanpackages and apt-ftparchive would write)."""
    import subprocess

    stanzas = []
    for deb in debs:
        data = deb.read_bytes()
        (root / deb.name).write_bytes(data)
        control = subprocess.run(
            ["dpkg-deb", "-f", str(deb)], check=True, capture_output=True, text=True
        ).stdout.rstrip("\n")
        stanzas.append(
            f"{control}\nFilename: ./{deb.name}\nSize: {len(data)}\n"
            f"MD5sum: {hashlib.md5(data).hexdigest()}\n"
            f"SHA256: {hashlib.sha256(data).hexdigest()}\n"
        )
    packages = "\n".join(stanzas).encode()
    (root / "Packages").write_bytes(packages)
    (root / "Release").write_text(
        "Origin: agentbox-test\nLabel: agentbox-test\nSuite: test\nCodename: test\n"
        f"Date: {time.strftime('%a, %d %b %Y %H:%M:%S UTC', time.gmtime())}\n"
        "Architectures: all amd64 arm64\n"
        f"SHA256:\n {hashlib.sha256(packages).hexdigest()} {len(packages)} Packages\n"
    )


def _simple_index(root: Path, wheels: dict[str, bytes]) -> None:
    """A PEP 503 simple index: /simple/NAME/ links to the wheel with its sha256."""
    for filename, data in wheels.items():
        name = filename.split("-")[0]
        d = root / "simple" / name
        d.mkdir(parents=True)
        (root / "files").mkdir(exist_ok=True)
        (root / "files" / filename).write_bytes(data)
        digest = hashlib.sha256(data).hexdigest()
        (d / "index.html").write_text(
            f'<html><body><a href="../../files/{filename}#sha256={digest}">{filename}</a>'
            "</body></html>\n"
        )


@pytest.fixture(scope="module")
def mirror(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    root = tmp_path_factory.mktemp("mirror")
    (root / "debian").mkdir()
    _apt_repo(root / "debian", [make_deb(tmp_path_factory.mktemp("debs"), "abxmirrored")])
    _simple_index(root / "pypi", dict([_wheel("abxfromindex")]))
    handler = partial(SimpleHTTPRequestHandler, directory=str(root))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, code_template: Path) -> Iterator[ServerHandle]:
    handle = start_server(
        tmp_path_factory.mktemp("mirrors"),
        [
            "--template-dir", str(code_template),
            "--egress-allow-cidr", "127.0.0.0/8",
            "--egress-resolve", "mirror.test=127.0.0.1",
        ],
    )  # fmt: skip
    yield handle
    handle.kill_all_sandboxes()
    handle.stop()


@pytest.fixture
def box(server: ServerHandle, mirror: int) -> Iterator[Sandbox]:
    key = server.make_key(f"mirror-{time.monotonic_ns() % 10**8}")
    s = Sandbox.create(
        template="code-interpreter",
        api_url=server.url,
        api_key=key,
        timeout=300,
        network={"allow_out": [f"mirror.test:{mirror}"]},
        envs={
            "PIP_INDEX_URL": f"http://mirror.test:{mirror}/pypi/simple",
            "PIP_TRUSTED_HOST": "mirror.test",
        },
    )
    yield s
    s.kill()
    s.close()


def test_sudo_apt_get_install_from_an_allowed_mirror(box: Sandbox, mirror: int) -> None:
    r = box.commands.run(
        "sudo rm -f /etc/apt/sources.list /etc/apt/sources.list.d/* && "
        f"echo 'deb [trusted=yes] http://mirror.test:{mirror}/debian ./' "
        "| sudo tee /etc/apt/sources.list.d/mirror.list >/dev/null && "
        "sudo apt-get update 2>&1 | tail -2 && sudo apt-get install -y abxmirrored 2>&1 | tail -1 "
        "&& abxmirrored",
        timeout=180,
    )
    assert r.stdout.rstrip().endswith("abxmirrored works"), r


def test_pip_install_from_an_allowed_index(box: Sandbox) -> None:
    r = box.commands.run("pip install abxfromindex 2>&1 | tail -1 && abxfromindex-cli", timeout=120)
    assert "Successfully installed abxfromindex-1.0" in r.stdout, r
    assert r.stdout.rstrip().endswith("abxfromindex cli ok"), r


def test_the_mirror_is_refused_without_the_rule(server: ServerHandle, mirror: int) -> None:
    key = server.make_key(f"nomirror-{time.monotonic_ns() % 10**8}")
    with Sandbox.create(template="code-interpreter", api_url=server.url, api_key=key) as s:
        r = s.commands.run(
            f"pip download --no-deps -d /tmp/x --index-url http://mirror.test:{mirror}/pypi/simple"
            " --trusted-host mirror.test abxfromindex 2>&1 | tail -3; true",
            timeout=120,
        )
        assert "Saved" not in r.stdout, r
