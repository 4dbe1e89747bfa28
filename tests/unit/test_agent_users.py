"""The agent's choice of user, without a sandbox: names are checked, a sandbox with one user
(a server without root) refuses the other by name instead of running as the wrong one, and
nothing switches ids when the agent cannot."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from agentbox.agent import users


@pytest.fixture
def one_user() -> Iterator[None]:
    saved = users.DEFAULT, users.CAN_SWITCH
    users.DEFAULT, users.CAN_SWITCH = "user", False
    yield
    users.DEFAULT, users.CAN_SWITCH = saved


def test_names_are_checked(one_user: None) -> None:
    assert users.resolve(None) == users.resolve("") == users.resolve("user") == "user"
    for bad in ("admin", "0", 1000, ["root"]):
        with pytest.raises(users.UserError) as e:
            users.resolve(bad)
        assert e.value.code == "invalid_request" and "user" in str(e.value)


def test_a_sandbox_with_one_user_refuses_the_other(one_user: None) -> None:
    with pytest.raises(users.UserError) as e:
        users.resolve("root")
    assert e.value.code == "unsupported" and "without root" in str(e.value)
    users.DEFAULT = "root"  # a template whose user is root, on a server without root
    assert users.resolve(None) == "root"
    with pytest.raises(users.UserError):
        users.resolve("user")


def test_nothing_switches_when_the_agent_cannot(one_user: None) -> None:
    before = os.getresuid(), os.getresgid(), os.getgroups()
    with users.spawning_as("user"), users.files_as("user"):
        assert (os.getresuid(), os.getresgid(), os.getgroups()) == before
    env = {"HOME": "/x", "USER": "u"}
    assert users.environment("root", env) == env


def test_root_gets_roots_home_where_the_agents_was_inherited(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(users, "CAN_SWITCH", True)
    monkeypatch.setenv("HOME", "/workspace")
    monkeypatch.setenv("USER", "user")
    monkeypatch.setenv("LOGNAME", "user")
    given = {"HOME": "/workspace", "USER": "user", "LOGNAME": "user", "X": "1"}
    env = users.environment("root", given)
    assert env == {"HOME": "/root", "USER": "root", "LOGNAME": "root", "X": "1"}
    # A HOME the caller chose stays.
    assert users.environment("root", {"HOME": "/elsewhere"})["HOME"] == "/elsewhere"
