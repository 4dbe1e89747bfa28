"""Why a command ended: the explanation an agent gets."""

from agentbox.core.violations import explain_command_end


def test_timeout_wins() -> None:
    v = explain_command_end({"timed_out": True, "exit_code": -9}, {}, {}, 5)
    assert v and v["code"] == "command_timeout" and "5 s" in v["message"]


def test_oom_from_counters() -> None:
    v = explain_command_end({"exit_code": -9}, {"oom_kill": 1}, {"oom_kill": 2}, 60)
    assert v and v["code"] == "memory_limit" and v["setting"] == "resources.memory_mb"


def test_clean_exit_has_no_violation() -> None:
    assert (
        explain_command_end({"exit_code": 0, "stderr_tail": "Read-only file system"}, {}, {}, 60)
        is None
    )


def test_stderr_hints() -> None:
    for tail, code in [
        ("curl: (6) Could not resolve host: x", "network_disabled"),
        ("cp: No space left on device", "disk_limit"),
        ("touch: cannot touch '/usr/x': Read-only file system", "read_only_path"),
    ]:
        v = explain_command_end({"exit_code": 1, "stderr_tail": tail}, {}, {}, 60)
        assert v and v["code"] == code


def _disk_setting(tail: str, full: list[str] | None = None) -> str:
    end = {"exit_code": 1, "stderr_tail": tail, "full": full}
    v = explain_command_end(end, {}, {}, 60)
    assert v and v["code"] == "disk_limit", v
    return v["setting"]


def test_full_tmp_is_told_from_the_workspace() -> None:
    enospc = "No space left on device"
    # The error line's path decides; /var/tmp's "/tmp" is not a /workspace path.
    assert _disk_setting(f"dd: error writing '/tmp/x': {enospc}") == "resources.tmp_mb"
    assert _disk_setting(f"cp: '/var/tmp/y': {enospc}", ["/workspace"]) == "resources.tmp_mb"
    assert _disk_setting(f"dd: error writing '/workspace/x': {enospc}", ["/tmp"]) == (
        "resources.disk_mb"
    )
    # No path on the line: the mounts the agent found full.
    no_path = f"head: error writing 'standard output': {enospc}"
    assert _disk_setting(no_path, ["/tmp", "/var/tmp"]) == "resources.tmp_mb"
    assert _disk_setting(no_path, ["/workspace", "/tmp"]) == "resources.disk_mb"
    assert _disk_setting(no_path) == "resources.disk_mb"  # an agent from before `full`
    assert _disk_setting("Disk quota exceeded", ["/tmp"]) == "resources.disk_mb"
