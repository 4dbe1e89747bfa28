"""The battery's host-mount oracle ignores only the mounts agentbox itself makes (workspaces,
volumes, kept workspaces read while a test beside the battery reads them): an escape that
mounts anywhere else, or even beside or below those, is still seen."""

from __future__ import annotations

import pytest

from agentbox.battery.oracle import _agentbox_mount

KEPT = "sbx_56b2a99e3763c3e1.69097b2d"


@pytest.mark.parametrize(
    "point",
    [
        f"/tmp/pytest-of-root/pytest-21/agentbox0/data-35877/kept-mounts/{KEPT}",
        f"/var/lib/agentbox/kept-mounts-gvisor/{KEPT}",
        "/var/lib/agentbox/sandboxes/sbx_56b2a99e3763c3e1/disk",
        "/var/lib/agentbox/volumes/vol_0123/mnt",
    ],
)
def test_agentbox_own_mounts_are_not_escapes(point: str) -> None:
    assert _agentbox_mount(point)


@pytest.mark.parametrize(
    "point",
    [
        "/tmp/kept-mounts/evil",
        f"/tmp/x/kept-mounts/{KEPT}/deeper",
        f"/tmp/x/kept-mounts/{KEPT}x",
        f"/mnt/{KEPT}",
        "/etc",
        "/var/lib/agentbox/volumes/vol_0123/elsewhere",
    ],
)
def test_other_mounts_still_count(point: str) -> None:
    assert not _agentbox_mount(point)
