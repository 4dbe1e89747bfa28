"""The process tier reads the sandbox's init pid from bwrap's info fd (runtime._read_info):
woken by the data, and told at once when bwrap exits without writing it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from agentbox.runtimes.base import RuntimeError_
from agentbox.runtimes.process.runtime import ProcessRuntime


def _writer(script: str) -> tuple[int, subprocess.Popen]:
    r, w = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-c", f"import os, time\nfd = {w}\n{script}"], pass_fds=(w,)
    )
    os.close(w)
    return r, proc


def test_the_pid_is_read_from_json_written_in_pieces() -> None:
    r, proc = _writer(
        'os.write(fd, b\'{\\n  "child-pid": \'); time.sleep(0.2); os.write(fd, b"4242\\n}\\n")\n'
        "time.sleep(5)"
    )
    try:
        assert ProcessRuntime._read_info(r, proc) == 4242
    finally:
        proc.kill()
        proc.wait()
        os.close(r)


@pytest.mark.parametrize(
    "script",
    [
        "os._exit(1)",  # bwrap failed before it wrote anything
        "os.write(fd, b'{\"child-pid\"'); os._exit(1)",  # half the JSON, then gone
        "os.close(fd); time.sleep(0.3)",  # the fd closed, the launcher still there
    ],
)
def test_a_launcher_that_gives_no_pid_fails_at_once(script: str) -> None:
    r, proc = _writer(script)
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError_, match="no child pid"):
            ProcessRuntime._read_info(r, proc)
    finally:
        proc.wait()
        os.close(r)
    assert time.monotonic() - t0 < 3
