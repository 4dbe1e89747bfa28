"""One host-wide allocator of sandbox uid ranges, shared by every runtime and every server on the
host.

Each sandbox gets a block of 65,536 host uids (and the same gids) that no other sandbox has, of
any tier and any data dir: its user namespace can then map its own 0–65535 onto the block, and a
kernel-level escape, a leaked descriptor or a shared /tmp lands on ids that own nothing else.
Blocks come from systemd's range for containers, aligned, far above any distribution's users.

Servers on one host do not talk to each other, so the allocation lives in the filesystem: a
lease is a symlink `<leases>/<base>` -> `<owner>/<sandbox_id>`, made with one atomic
`symlink(2)` that fails if the block is taken. `/run` is a tmpfs: a reboot, which ends every
sandbox, frees every block. `owner` names the data dir (its digest): a server releases only its
own leases, and finds its leftovers' leases after a crash (`held`).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

BLOCK = 65_536
POOL = (0x80000, 0x6FFF0000)  # [start, end): systemd's container uid range, ~28,600 blocks
UID_RANGE = POOL  # every host uid a sandbox of any runtime can run as
LEASES = Path("/run/agentbox/uids")
_TRIES = 1000


class NoFreeUid(Exception):
    pass


class UidLeases:
    def __init__(
        self,
        owner: str,
        root: Path = LEASES,
        pool: tuple[int, int] = POOL,
        block: int = BLOCK,
    ) -> None:
        if not owner or "/" in owner:
            raise ValueError(f"a lease owner is one path component, not {owner!r}")
        if pool[0] % block or pool[1] % block or pool[1] <= pool[0]:
            raise ValueError(f"the pool {pool} is not a whole number of {block}-id blocks")
        self.owner = owner
        self.root = root
        self.pool = pool
        self.block = block

    def _dir(self) -> Path:
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        return self.root

    def take(self, sandbox_id: str) -> int:
        """The first uid of a block no sandbox on the host holds, leased to `sandbox_id` until
        `release`. The block is [base, base + BLOCK)."""
        root = self._dir()
        target = f"{self.owner}/{sandbox_id}"
        blocks = (self.pool[1] - self.pool[0]) // self.block
        for _ in range(_TRIES):
            base = self.pool[0] + random.randrange(blocks) * self.block
            try:
                os.symlink(target, root / str(base))
            except FileExistsError:
                continue
            return base
        raise NoFreeUid(f"no free sandbox uid block in {self.pool} after {_TRIES} tries")

    def release(self, sandbox_id: str, base: int | None = None) -> None:
        """Free `sandbox_id`'s lease (found by scanning when its base is not known); a lease of
        another owner or sandbox is never touched. Idempotent."""
        bases = (
            [base] if base is not None else [b for b, s in self.held().items() if s == sandbox_id]
        )
        for b in bases:
            path = self.root / str(b)
            try:
                if os.readlink(path) == f"{self.owner}/{sandbox_id}":
                    path.unlink()
            except OSError:
                pass

    def held(self) -> dict[int, str]:
        """This owner's leases: block base -> sandbox id."""
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
