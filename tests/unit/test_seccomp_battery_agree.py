"""The seccomp deny-list and the battery's syscall probes state one fact: what the filter blocks
is what the battery attacks. A syscall added to DENIED with no check would ship untested; a check
probing a syscall DENIED does not list would test nothing the filter promises."""

from __future__ import annotations

from agentbox.battery import probes
from agentbox.battery.checks import CHECKS, NOT_DENIED, SYSCALL_PROBES
from agentbox.runtimes.process.seccomp import DENIED

PROBED = {name for names in SYSCALL_PROBES.values() for name in names}


def test_every_denied_syscall_is_probed_by_a_check() -> None:
    assert sorted(DENIED.keys() - PROBED) == []


def test_checks_probe_only_denied_syscalls_or_say_why_not() -> None:
    assert sorted(PROBED - DENIED.keys()) == sorted(NOT_DENIED)
    assert not NOT_DENIED.keys() & DENIED.keys(), "an exception for a syscall DENIED lists"


def test_the_table_names_real_checks_and_every_syscall_check_uses_it() -> None:
    by_id = {c.id: c for c in CHECKS}
    assert SYSCALL_PROBES.keys() <= by_id.keys()
    assert {c.id for c in CHECKS if c.group == "syscalls"} <= SYSCALL_PROBES.keys()
    for cid in SYSCALL_PROBES:
        # The positive control must switch the filter off, or a probe that never reaches the
        # kernel would pass as a working one.
        assert "no-seccomp" in by_id[cid].control, cid


def test_the_probes_own_syscall_numbers_match_the_filters() -> None:
    # probes.py writes the numbers out on purpose (a probe must not inherit the filter's
    # mistakes); two independent copies must then agree.
    assert PROBED <= probes.NR.keys()
    assert {n: probes.NR.get(n) for n in DENIED} == DENIED


def test_every_syscall_called_with_bad_arguments_has_them() -> None:
    # fs-nested-userns calls its syscalls with real namespace flags; all others get bad ones.
    own_arguments = set(SYSCALL_PROBES["fs-nested-userns"])
    missing = [n for n in sorted(PROBED - own_arguments) if probes.BAD_ARGS.get(n) is None]
    assert missing == []
