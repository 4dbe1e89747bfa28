"""One host-wide allocator of sandbox uids, shared by every runtime and every server on the host.

A sandbox's processes run as a host uid no other sandbox has, of any tier and any data dir: a
kernel-level escape, a leaked descriptor or a shared /tmp then lands on a uid that owns nothing
else. Servers on one host do not talk to each other, so the allocation lives in the filesystem:
a lease is a symlink `<leases>/<uid>` -> `<owner>/<sandbox_id>`, made with one atomic
`symlink(2)` that fails if the uid is taken. `/run` is a tmpfs: a reboot, which ends every
sandbox, frees every uid.

`owner` names the data dir (its digest): a server releases only its own leases, and finds its
leftovers' leases after a crash (`held`).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

UID_RANGE = (200_000, 265_000)  # [start, end): far from any distribution's uids
LEASES = Path("/run/agentbox/uids")
_TRIES = 1000


class NoFreeUid(Exception):
    pass


class UidLeases:
    def __init__(
        self, owner: str, root: Path = LEASES, uid_range: tuple[int, int] = UID_RANGE
    ) -> None:
        if not owner or "/" in owner:
            raise ValueError(f"a lease owner is one path component, not {owner!r}")
        self.owner = owner
        self.root = root
        self.uid_range = uid_range

    def _dir(self) -> Path:
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        return self.root

    def take(self, sandbox_id: str) -> int:
        """A uid no sandbox on the host holds, leased to `sandbox_id` until `release`."""
        root = self._dir()
        target = f"{self.owner}/{sandbox_id}"
        for _ in range(_TRIES):
            uid = random.randrange(*self.uid_range)
            try:
                os.symlink(target, root / str(uid))
            except FileExistsError:
                continue
            return uid
        raise NoFreeUid(f"no free sandbox uid in {self.uid_range} after {_TRIES} tries")

    def release(self, sandbox_id: str, uid: int | None = None) -> None:
        """Free `sandbox_id`'s lease (found by scanning when its uid is not known); a lease of
        another owner or sandbox is never touched. Idempotent."""
        uids = [uid] if uid is not None else [u for u, s in self.held().items() if s == sandbox_id]
        for u in uids:
            path = self.root / str(u)
            try:
                if os.readlink(path) == f"{self.owner}/{sandbox_id}":
                    path.unlink()
            except (FileNotFoundError, OSError):
                pass

    def held(self) -> dict[int, str]:
        """This owner's leases: uid -> sandbox id."""
        out: dict[int, str] = {}
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return out
        prefix = self.owner + "/"
        for name in names:
            try:
                target = os.readlink(self.root / name)
            except OSError:
                continue
            if target.startswith(prefix) and name.isdigit():
                out[int(name)] = target[len(prefix) :]
        return out
