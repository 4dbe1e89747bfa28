"""Persistence: tenants, API keys, sandboxes, the audit and egress logs, through SQLAlchemy Core.

SQLite in the data dir is the embedded default; the schema uses only portable types so a
PostgreSQL URL can replace it. Calls are short and synchronous (SQLite in WAL mode answers in
well under a millisecond); callers on the event loop use them directly. The audit and egress
logs are bounded here: every text field by length, the rows by age and count (`trim_logs`,
which core/logs.py runs).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    Column,
    Float,
    Integer,
    MetaData,
    String,
    Table,
    bindparam,
    create_engine,
    delete,
    event,
    func,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy.engine import Engine

from agentbox.core.states import LIVE, SandboxState

metadata = MetaData()

tenants = Table(
    "tenants",
    metadata,
    Column("name", String(128), primary_key=True),
    Column("quota", JSON, nullable=False, default=dict),
    Column("created_at", Float, nullable=False),
    # {"default": policy, "ceiling": policy}: see core/network.py.
    Column("network", JSON, nullable=True),
)

api_keys = Table(
    "api_keys",
    metadata,
    Column("key_id", String(32), primary_key=True),
    Column("key_hash", String(64), nullable=False, unique=True),
    Column("tenant", String(128), nullable=False, index=True),
    Column("admin", Boolean, nullable=False, default=False),
    Column("created_at", Float, nullable=False),
    Column("revoked", Boolean, nullable=False, default=False),
)

sandboxes = Table(
    "sandboxes",
    metadata,
    Column("seq", Integer, primary_key=True, autoincrement=True),
    Column("sandbox_id", String(64), nullable=False, unique=True),
    Column("tenant", String(128), nullable=False, index=True),
    Column("template", String(128), nullable=False),
    Column("runtime", String(32), nullable=False),
    Column("state", String(16), nullable=False, index=True),
    Column("metadata", JSON, nullable=False, default=dict),
    Column("resources", JSON, nullable=False),
    Column("runtime_state", JSON, nullable=True),
    Column("keep_workspace", Boolean, nullable=False, default=False),
    Column("created_at", Float, nullable=False),
    Column("end_at", Float, nullable=False, index=True),
    Column("ended_at", Float, nullable=True),
    Column("end_reason", String(32), nullable=True),
    # The network settings it runs with, its ports' access token, {secret name: placeholder}.
    Column("network", JSON, nullable=True),
    Column("access_token", String(64), nullable=True),
    Column("secrets", JSON, nullable=True),
    # Why it failed, when the failure came after the create answered (a first-use build).
    Column("error", String, nullable=True),
    # While paused: since when, and the seconds of its TTL it had left (end_at is then the end
    # of its retention as a paused sandbox).
    Column("paused_at", Float, nullable=True),
    Column("ttl_left", Float, nullable=True),
    # {"on_timeout": "kill" | "pause", "auto_resume": bool, "timeout": its timeout at create}
    Column("lifecycle", JSON, nullable=True),
    # The environment variables its create asked for (a fork's children get them too), and
    # where its disk came from: {"snapshot": id} or {"fork_of": sandbox id}.
    Column("envs", JSON, nullable=True),
    Column("origin", JSON, nullable=True),
    # The volumes it mounts: [{"volume_id", "path", "read_only"}].
    Column("volumes", JSON, nullable=True),
    # Paused without memory: "parking" from the moment that pause begins, "parked" once only
    # its disk is left (also while it starts again from that disk); None otherwise.
    Column("park", String(8), nullable=True),
)

# Named persistent volumes (core/volumes.py); the image is in the data dir.
volumes = Table(
    "volumes",
    metadata,
    Column("volume_id", String(64), primary_key=True),
    Column("tenant", String(128), nullable=False, index=True),
    Column("name", String(128), nullable=False),
    Column("size_mb", Integer, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("metadata", JSON, nullable=False, default=dict),
)

# Snapshots of sandboxes' disks (core/snapshots.py); the image is in the data dir.
snapshots = Table(
    "snapshots",
    metadata,
    Column("snapshot_id", String(64), primary_key=True),
    Column("tenant", String(128), nullable=False, index=True),
    Column("name", String(128), nullable=True),
    Column("state", String(16), nullable=False),  # creating | ready
    Column("sandbox_id", String(64), nullable=False),  # the sandbox it was taken of
    Column("template", String(128), nullable=False),
    Column("runtime", String(32), nullable=False),
    Column("created_at", Float, nullable=False),
    # What a sandbox started from it needs: the template tree its root layer was made on, the
    # disk's size, the host uids its files have ([uid, uid + span)), the bytes it takes.
    Column("rootfs", String, nullable=True),
    Column("disk_mb", Integer, nullable=False),
    Column("uid", Integer, nullable=False),
    Column("span", Integer, nullable=False),
    Column("used_bytes", Integer, nullable=False, default=0),
    Column("metadata", JSON, nullable=False, default=dict),
)

secrets = Table(
    "secrets",
    metadata,
    Column("tenant", String(128), primary_key=True),
    Column("name", String(64), primary_key=True),
    Column("value", String, nullable=False),  # encrypted by core/secrets.py
    Column("hosts", JSON, nullable=False),
    Column("in_url", Boolean, nullable=False, default=False),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    # The binding's headers (null: the default, Authorization) and the plain-HTTP opt-in.
    Column("headers", JSON, nullable=True),
    Column("allow_plaintext", Boolean, nullable=True),
)

egress_log = Table(
    "egress_log",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("time", Float, nullable=False, index=True),
    Column("tenant", String(128), nullable=True, index=True),
    Column("sandbox_id", String(64), nullable=True, index=True),
    Column("protocol", String(24), nullable=False),
    Column("host", String(255), nullable=False),
    Column("port", Integer, nullable=False),
    Column("method", String(16), nullable=True),
    Column("path", String(512), nullable=True),
    Column("status", Integer, nullable=True),
    Column("bytes_out", Integer, nullable=False, default=0),
    Column("bytes_in", Integer, nullable=False, default=0),
    Column("allowed", Boolean, nullable=False),
    Column("rule", String(255), nullable=True),
    Column("reason", String, nullable=True),
    Column("duration_ms", Float, nullable=True),
    # On a summary row: the refused attempts of this sandbox under this rule, in one sampling
    # window, that were counted rather than written one by one (core/logs.py).
    Column("suppressed", Integer, nullable=True),
)

audit = Table(
    "audit",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("time", Float, nullable=False, index=True),
    Column("tenant", String(128), nullable=True, index=True),
    Column("key_id", String(32), nullable=True),
    Column("action", String(64), nullable=False, index=True),
    Column("sandbox_id", String(64), nullable=True, index=True),
    Column("status", Integer, nullable=True),
    Column("duration_ms", Float, nullable=True),
    Column("detail", JSON, nullable=True),
)

_AUDIT_INSERT = insert(audit)
# Built once, values as parameters: a statement built per call costs SQLAlchemy its cache key
# each time (~80 us of the ~180 of a read; every sandbox route reads its row).
_GET_SANDBOX = select(sandboxes).where(sandboxes.c.sandbox_id == bindparam("b_sandbox_id"))
_SANDBOX_COLUMNS = frozenset(sandboxes.c.keys())
_MOVE_SANDBOX = update(sandboxes).where(
    sandboxes.c.sandbox_id == bindparam("b_sandbox_id"), sandboxes.c.state == bindparam("b_old")
)

# Sorted: the order SQL sees them in must not depend on a set's iteration.
LIVE_STATES = tuple(sorted(s.value for s in LIVE))
# A sandbox's `park` (paused without memory): on its way there, and there.
PARKING, PARKED = "parking", "parked"
# The states whose end_at the reaper keeps: a running sandbox's timeout, a paused one's retention.
_TIMED = (SandboxState.PAUSED.value, SandboxState.RUNNING.value)

def _resource(name: str) -> Any:
    """A sandbox's `resources.<name>` in SQL, `b_<name>` where its row names none."""
    return func.coalesce(sandboxes.c.resources[name].as_integer(), bindparam(f"b_{name}"))


_LIVE_OF = (sandboxes.c.tenant == bindparam("b_tenant"), sandboxes.c.state.in_(LIVE_STATES))
# A tenant's live sandboxes that hold memory and descriptors (one paused without memory holds
# only its disk): how many, and pids x nofile summed.
_TENANT_HOLDING = select(
    func.count(), func.coalesce(func.sum(_resource("pids") * _resource("nofile")), 0)
).where(
    *_LIVE_OF,
    or_(
        sandboxes.c.state != SandboxState.PAUSED.value,
        sandboxes.c.park.is_(None),
        sandboxes.c.park != PARKED,
    ),
)
# A tenant's live sandboxes per runtime: how many, and the disk_mb they asked for, summed.
_TENANT_DISK = (
    select(sandboxes.c.runtime, func.count(), func.sum(_resource("disk_mb")))
    .where(*_LIVE_OF)
    .group_by(sandboxes.c.runtime)
)


# The longest value each text field of the two logs stores (characters; docs/API.md, "Audit and
# egress logs"): sandboxes and clients choose these strings, and the disk must not pay for them.
EGRESS_FIELD_LENGTHS = {
    "tenant": 128,
    "sandbox_id": 64,
    "protocol": 24,
    "host": 255,
    "method": 16,
    "path": 512,
    "rule": 255,
    "reason": 1024,
}
AUDIT_FIELD_LENGTHS = {"tenant": 128, "key_id": 32, "action": 64, "sandbox_id": 64}
# An audit row's detail is at most this long as JSON. It is cut value by value, never as text,
# so it stays valid JSON: strings to DETAIL_STRING_CHARS (fewer if that is not enough), lists
# and objects to their first DETAIL_ITEMS entries, nesting to DETAIL_DEPTH levels.
DETAIL_MAX_BYTES = 4096
DETAIL_STRING_CHARS = 1024
DETAIL_ITEMS = 64
DETAIL_DEPTH = 4
_CUT = "…"  # ends a cut string; a cut list or object ends with it as an item / key


def _clipped(values: dict[str, Any], lengths: dict[str, int]) -> dict[str, Any]:
    out = dict(values)
    for name, most in lengths.items():
        value = out.get(name)
        if isinstance(value, str) and len(value) > most:
            out[name] = value[:most]
    return out


def _clip_value(value: Any, chars: int, depth: int) -> Any:
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str):
        return value if len(value) <= chars else value[:chars] + _CUT
    if depth >= DETAIL_DEPTH:
        return _CUT
    if isinstance(value, dict):
        items = list(value.items())
        out = {str(k)[:chars]: _clip_value(v, chars, depth + 1) for k, v in items[:DETAIL_ITEMS]}
        if len(items) > DETAIL_ITEMS:
            out[_CUT] = len(items) - DETAIL_ITEMS
        return out
    if isinstance(value, list | tuple):
        out_list = [_clip_value(v, chars, depth + 1) for v in value[:DETAIL_ITEMS]]
        return out_list + [_CUT] if len(value) > DETAIL_ITEMS else out_list
    return _clip_value(str(value), chars, depth)


def clip_detail(detail: dict[str, Any] | None) -> dict[str, Any] | None:
    """An audit detail as stored: valid JSON of at most DETAIL_MAX_BYTES."""
    if not detail:
        return detail
    chars = DETAIL_STRING_CHARS
    while chars >= 8:
        clipped = _clip_value(detail, chars, 0)
        if len(json.dumps(clipped)) <= DETAIL_MAX_BYTES:
            return clipped  # type: ignore[no-any-return]
        chars //= 4
    return {_CUT: "the detail was too large to keep"}


@dataclass
class SandboxRow:
    seq: int
    sandbox_id: str
    tenant: str
    template: str
    runtime: str
    state: str
    metadata: dict[str, str]
    resources: dict[str, Any]
    runtime_state: dict[str, Any] | None
    keep_workspace: bool
    created_at: float
    end_at: float
    ended_at: float | None
    end_reason: str | None
    network: dict[str, Any] | None = None
    access_token: str | None = None
    secrets: dict[str, str] | None = None
    error: str | None = None
    paused_at: float | None = None
    ttl_left: float | None = None
    lifecycle: dict[str, Any] | None = None
    envs: dict[str, str] | None = None
    origin: dict[str, str] | None = None
    volumes: list[dict[str, Any]] | None = None
    park: str | None = None

    @property
    def parked(self) -> bool:
        """Paused without memory (or starting again from that): only its disk is kept."""
        return self.park == PARKED

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES


def _row(r: Any) -> SandboxRow:
    return SandboxRow(**{c: getattr(r, c) for c in SandboxRow.__dataclass_fields__})


@dataclass(frozen=True)
class SnapshotRow:
    snapshot_id: str
    tenant: str
    name: str | None
    state: str
    sandbox_id: str
    template: str
    runtime: str
    created_at: float
    rootfs: str | None
    disk_mb: int
    uid: int
    span: int
    used_bytes: int
    metadata: dict[str, str]


@dataclass(frozen=True)
class VolumeRow:
    volume_id: str
    tenant: str
    name: str
    size_mb: int
    created_at: float
    metadata: dict[str, str]


def _snapshot(r: Any) -> SnapshotRow:
    return SnapshotRow(**{c: getattr(r, c) for c in SnapshotRow.__dataclass_fields__})


class Store:
    def __init__(self, url: str) -> None:
        self.engine: Engine = create_engine(url, future=True)
        if url.startswith("sqlite"):

            @event.listens_for(self.engine, "connect")
            def _pragmas(conn: Any, _record: Any) -> None:
                cur = conn.cursor()
                # Pages the log trims free go back to the filesystem (`reclaim`). SQLite takes
                # this only before the first table exists: older data dirs reuse freed pages
                # instead, so their file stops growing but does not shrink.
                cur.execute("PRAGMA auto_vacuum=INCREMENTAL")
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA synchronous=NORMAL")
                cur.execute("PRAGMA busy_timeout=5000")
                cur.close()

        metadata.create_all(self.engine)
        self._add_missing_columns()

    def _add_missing_columns(self) -> None:
        """Bring a data dir made by an older version up to date: new columns are nullable and
        added in place (create_all makes missing tables, never missing columns)."""
        from sqlalchemy import inspect, text

        insp = inspect(self.engine)
        with self.engine.begin() as c:
            for table in metadata.sorted_tables:
                have = {col["name"] for col in insp.get_columns(table.name)}
                for col in table.columns:
                    if col.name not in have and col.nullable:
                        kind = col.type.compile(dialect=self.engine.dialect)
                        c.execute(text(f'ALTER TABLE {table.name} ADD COLUMN "{col.name}" {kind}'))

    @classmethod
    def for_data_dir(cls, data_dir: Path) -> Store:
        # Keys, secrets and sandboxes' records: never readable by others (the server's mode).
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        db = data_dir / "agentbox.db"
        store = cls(f"sqlite:///{db}")
        db.chmod(0o600)
        return store

    # ------------------------------------------------------------------ tenants and keys

    def get_quota(self, tenant: str) -> dict[str, Any]:
        with self.engine.connect() as c:
            row = c.execute(select(tenants.c.quota).where(tenants.c.name == tenant)).first()
        return dict(row.quota) if row else {}

    def set_quota(self, tenant: str, quota: dict[str, Any]) -> None:
        with self.engine.begin() as c:
            exists = c.execute(select(tenants.c.name).where(tenants.c.name == tenant)).first()
            if exists:
                c.execute(update(tenants).where(tenants.c.name == tenant).values(quota=quota))
            else:
                c.execute(insert(tenants).values(name=tenant, quota=quota, created_at=time.time()))

    def add_key(self, key_id: str, key_hash: str, tenant: str, admin: bool) -> None:
        with self.engine.begin() as c:
            c.execute(
                insert(api_keys).values(
                    key_id=key_id,
                    key_hash=key_hash,
                    tenant=tenant,
                    admin=admin,
                    created_at=time.time(),
                    revoked=False,
                )
            )

    def find_key(self, key_hash: str) -> tuple[str, str, bool] | None:
        with self.engine.connect() as c:
            row = c.execute(
                select(api_keys.c.key_id, api_keys.c.tenant, api_keys.c.admin).where(
                    api_keys.c.key_hash == key_hash, api_keys.c.revoked.is_(False)
                )
            ).first()
        return (row.key_id, row.tenant, bool(row.admin)) if row else None

    def list_keys(self) -> list[dict[str, Any]]:
        with self.engine.connect() as c:
            rows = c.execute(
                select(api_keys)
                .where(api_keys.c.revoked.is_(False))
                .order_by(api_keys.c.created_at)
            ).all()
        return [
            {
                "key_id": r.key_id,
                "tenant": r.tenant,
                "admin": bool(r.admin),
                "created_at": r.created_at,
            }
            for r in rows
        ]

    def revoke_key(self, key_id: str) -> bool:
        with self.engine.begin() as c:
            res = c.execute(
                update(api_keys)
                .where(api_keys.c.key_id == key_id, api_keys.c.revoked.is_(False))
                .values(revoked=True)
            )
        return res.rowcount > 0

    def count_keys(self) -> int:
        with self.engine.connect() as c:
            return int(c.execute(select(func.count()).select_from(api_keys)).scalar_one())

    # ------------------------------------------------------------------ sandboxes

    def insert_sandbox(self, **values: Any) -> None:
        with self.engine.begin() as c:
            c.execute(insert(sandboxes).values(**values))

    def update_sandbox(self, sandbox_id: str, **values: Any) -> None:
        """Write fields other than the state (that is `move_sandbox`'s, for core/lifecycle)."""
        if "state" in values:
            raise ValueError("a sandbox's state is written only through SandboxStates.move")
        with self.engine.begin() as c:
            c.execute(
                update(sandboxes).where(sandboxes.c.sandbox_id == sandbox_id).values(**values)
            )

    def move_sandbox(self, sandbox_id: str, old_state: str, **values: Any) -> bool:
        """Write `values` (a new state among them) if the sandbox is still in `old_state`;
        whether it was (compare-and-set: of two racing moves, one wins)."""
        unknown = values.keys() - _SANDBOX_COLUMNS
        if unknown:  # a parameter that names no column would be dropped without a word
            raise ValueError(f"sandboxes has no column {', '.join(sorted(unknown))}")
        with self.engine.begin() as c:
            # The SET clause is the parameters named like columns (`values`).
            result = c.execute(
                _MOVE_SANDBOX, {"b_sandbox_id": sandbox_id, "b_old": old_state, **values}
            )
        return bool(result.rowcount)

    def get_sandbox(self, sandbox_id: str) -> SandboxRow | None:
        with self.engine.connect() as c:
            r = c.execute(_GET_SANDBOX, {"b_sandbox_id": sandbox_id}).first()
        return _row(r) if r else None

    def count_live(self, tenant: str) -> int:
        with self.engine.connect() as c:
            return int(
                c.execute(
                    select(func.count())
                    .select_from(sandboxes)
                    .where(sandboxes.c.tenant == tenant, sandboxes.c.state.in_(LIVE_STATES))
                ).scalar_one()
            )

    def live_sandboxes(self, tenant: str | None = None) -> list[SandboxRow]:
        """Every live sandbox, or a tenant's."""
        q = select(sandboxes).where(sandboxes.c.state.in_(LIVE_STATES))
        if tenant is not None:
            q = q.where(sandboxes.c.tenant == tenant)
        with self.engine.connect() as c:
            rows = c.execute(q).all()
        return [_row(r) for r in rows]

    def tenant_holding(self, tenant: str, pids: int, nofile: int) -> tuple[int, int]:
        """(how many, pids x nofile summed) of the tenant's live sandboxes that hold memory (not
        one paused without it); a row that names no pids or nofile counts at the values given.
        Summed by SQL: a create must not decode every live row of its tenant."""
        with self.engine.connect() as c:
            count, held = c.execute(
                _TENANT_HOLDING, {"b_tenant": tenant, "b_pids": pids, "b_nofile": nofile}
            ).one()
        return int(count), int(held)

    def tenant_disk_mb(self, tenant: str, disk_mb: int) -> dict[str, tuple[int, int]]:
        """Per runtime: (how many, their disk_mb summed) of the tenant's live sandboxes; a row
        that names no disk_mb counts at `disk_mb`."""
        with self.engine.connect() as c:
            rows = c.execute(_TENANT_DISK, {"b_tenant": tenant, "b_disk_mb": disk_mb}).all()
        return {runtime: (int(n), int(mb)) for runtime, n, mb in rows}

    def expired(self, now: float) -> list[SandboxRow]:
        with self.engine.connect() as c:
            rows = c.execute(
                select(sandboxes).where(
                    sandboxes.c.state.in_(_TIMED), sandboxes.c.end_at <= now
                )
            ).all()
        return [_row(r) for r in rows]

    def next_deadline(self) -> float | None:
        with self.engine.connect() as c:
            return c.execute(
                select(func.min(sandboxes.c.end_at)).where(sandboxes.c.state.in_(_TIMED))
            ).scalar_one()

    def list_sandboxes(
        self,
        tenant: str,
        states: Iterable[str] | None,
        before_seq: int | None,
        batch: int,
        ascending: bool = False,
    ) -> list[SandboxRow]:
        """A tenant's sandboxes newest first, those older than `before_seq` (or oldest first,
        those newer than it, when `ascending`)."""
        q = select(sandboxes).where(sandboxes.c.tenant == tenant)
        if states:
            q = q.where(sandboxes.c.state.in_(list(states)))
        seq = sandboxes.c.seq
        if before_seq is not None:
            q = q.where(seq > before_seq if ascending else seq < before_seq)
        q = q.order_by(seq.asc() if ascending else seq.desc()).limit(batch)
        with self.engine.connect() as c:
            return [_row(r) for r in c.execute(q).all()]

    # ------------------------------------------------------------------ tenant network

    # ------------------------------------------------------------------ snapshots

    def insert_snapshot(self, **values: Any) -> None:
        with self.engine.begin() as c:
            c.execute(insert(snapshots).values(**values))

    def update_snapshot(self, snapshot_id: str, **values: Any) -> None:
        with self.engine.begin() as c:
            q = update(snapshots).where(snapshots.c.snapshot_id == snapshot_id)
            c.execute(q.values(**values))

    def get_snapshot(self, snapshot_id: str) -> SnapshotRow | None:
        with self.engine.connect() as c:
            r = c.execute(select(snapshots).where(snapshots.c.snapshot_id == snapshot_id)).first()
        return _snapshot(r) if r else None

    def list_snapshots(self, tenant: str | None = None) -> list[SnapshotRow]:
        """Oldest first; every tenant's when `tenant` is None."""
        q = select(snapshots).order_by(snapshots.c.created_at)
        if tenant is not None:
            q = q.where(snapshots.c.tenant == tenant)
        with self.engine.connect() as c:
            return [_snapshot(r) for r in c.execute(q)]

    def delete_snapshot(self, snapshot_id: str) -> bool:
        with self.engine.begin() as c:
            res = c.execute(delete(snapshots).where(snapshots.c.snapshot_id == snapshot_id))
        return bool(res.rowcount)

    # ------------------------------------------------------------------ volumes

    def insert_volume(self, **values: Any) -> None:
        with self.engine.begin() as c:
            c.execute(insert(volumes).values(**values))

    def list_volumes(self, tenant: str | None = None) -> list[VolumeRow]:
        """Oldest first; every tenant's when `tenant` is None."""
        q = select(volumes).order_by(volumes.c.created_at)
        if tenant is not None:
            q = q.where(volumes.c.tenant == tenant)
        with self.engine.connect() as c:
            return [
                VolumeRow(**{k: getattr(r, k) for k in VolumeRow.__dataclass_fields__})
                for r in c.execute(q)
            ]

    def delete_volume(self, volume_id: str) -> bool:
        with self.engine.begin() as c:
            res = c.execute(delete(volumes).where(volumes.c.volume_id == volume_id))
        return bool(res.rowcount)

    def get_tenant_network(self, tenant: str) -> dict[str, Any]:
        with self.engine.connect() as c:
            row = c.execute(select(tenants.c.network).where(tenants.c.name == tenant)).first()
        return dict(row.network) if row and row.network else {}

    def set_tenant_network(self, tenant: str, network: dict[str, Any]) -> None:
        with self.engine.begin() as c:
            exists = c.execute(select(tenants.c.name).where(tenants.c.name == tenant)).first()
            if exists:
                c.execute(update(tenants).where(tenants.c.name == tenant).values(network=network))
            else:
                c.execute(
                    insert(tenants).values(
                        name=tenant, quota={}, network=network, created_at=time.time()
                    )
                )

    # ------------------------------------------------------------------ secrets

    def put_secret(
        self,
        tenant: str,
        name: str,
        value: str,
        hosts: list[str],
        in_url: bool,
        headers: list[str] | None = None,
        allow_plaintext: bool = False,
    ) -> None:
        now = time.time()
        binding = {
            "value": value,
            "hosts": hosts,
            "in_url": in_url,
            "headers": headers,
            "allow_plaintext": allow_plaintext,
        }
        with self.engine.begin() as c:
            where = (secrets.c.tenant == tenant) & (secrets.c.name == name)
            if c.execute(select(secrets.c.name).where(where)).first():
                c.execute(update(secrets).where(where).values(**binding, updated_at=now))
            else:
                c.execute(
                    insert(secrets).values(
                        tenant=tenant, name=name, **binding, created_at=now, updated_at=now
                    )
                )

    def get_secret(self, tenant: str, name: str) -> dict[str, Any] | None:
        with self.engine.connect() as c:
            r = c.execute(
                select(secrets).where(secrets.c.tenant == tenant, secrets.c.name == name)
            ).first()
        return dict(r._mapping) if r else None

    def list_secrets(self, tenant: str) -> list[dict[str, Any]]:
        with self.engine.connect() as c:
            rows = c.execute(
                select(secrets).where(secrets.c.tenant == tenant).order_by(secrets.c.name)
            ).all()
        return [dict(r._mapping) for r in rows]

    def delete_secret(self, tenant: str, name: str) -> bool:
        with self.engine.begin() as c:
            res = c.execute(
                secrets.delete().where(secrets.c.tenant == tenant, secrets.c.name == name)
            )
        return res.rowcount > 0

    # ------------------------------------------------------------------ egress log

    def add_egress_events(self, events: list[dict[str, Any]]) -> None:
        if events:
            with self.engine.begin() as c:
                c.execute(insert(egress_log), [_clipped(e, EGRESS_FIELD_LENGTHS) for e in events])

    def put_egress_summary(self, row_id: int | None, event: dict[str, Any]) -> int:
        """Write a summary row of counted refusals (row_id None) or update its count and time;
        the row's id."""
        event = _clipped(event, EGRESS_FIELD_LENGTHS)
        with self.engine.begin() as c:
            if row_id is not None:
                values = {"suppressed": event["suppressed"], "time": event["time"]}
                done = c.execute(update(egress_log).where(egress_log.c.id == row_id).values(values))
                if done.rowcount:
                    return row_id
            key = c.execute(insert(egress_log).values(event)).inserted_primary_key
            assert key is not None
            return int(key[0])

    def list_egress(
        self,
        tenant: str | None,
        sandbox_id: str | None,
        host: str | None,
        allowed: bool | None,
        since: float | None,
        limit: int,
    ) -> list[dict[str, Any]]:
        filters = {"tenant": tenant, "sandbox_id": sandbox_id, "host": host, "allowed": allowed}
        return self._newest(egress_log, filters, since, limit)

    def _newest(
        self,
        table: Table,
        equal: dict[str, Any],
        since: float | None,
        limit: int,
        until: float | None = None,
        oldest_first: bool = False,
    ) -> list[dict[str, Any]]:
        """A log table's rows, newest first (or the oldest first): columns equal to the given
        values (None or "" = any), at or after `since`, before `until`."""
        q = select(table)
        for name, value in equal.items():
            if value is not None and value != "":
                q = q.where(table.c[name] == value)
        if since is not None:
            q = q.where(table.c.time >= since)
        if until is not None:
            q = q.where(table.c.time < until)
        q = q.order_by(table.c.id.asc() if oldest_first else table.c.id.desc()).limit(limit)
        with self.engine.connect() as c:
            return [dict(r._mapping) for r in c.execute(q).all()]

    # ------------------------------------------------------------------ audit

    def add_audit(self, **values: Any) -> None:
        values = _clipped(values, AUDIT_FIELD_LENGTHS)
        values["detail"] = clip_detail(values.get("detail"))
        with self.engine.begin() as c:
            # One statement, its values as parameters: compiled once, not per row.
            c.execute(_AUDIT_INSERT, values)

    def list_audit(
        self,
        tenant: str | None,
        sandbox_id: str | None,
        action: str | None,
        since: float | None,
        limit: int,
        until: float | None = None,
        oldest_first: bool = False,
    ) -> list[dict[str, Any]]:
        filters = {"tenant": tenant, "sandbox_id": sandbox_id, "action": action}
        return self._newest(audit, filters, since, limit, until, oldest_first)

    # ------------------------------------------------------------------ log bounds

    def trim_logs(self, before: float, max_rows: int, batch: int = 5000) -> int:
        """Delete the audit and egress log rows older than `before` (unix time) and those
        beyond each log's `max_rows` newest; the number deleted. Oldest first, by id, `batch`
        rows per transaction, so writers never wait long."""
        removed = 0
        for table in (audit, egress_log):
            removed += self._delete_oldest(table, table.c.time < before, batch)
            with self.engine.connect() as c:
                newest = c.execute(select(func.max(table.c.id))).scalar()
            # Ids only grow and only the oldest rows go, so every row has an id within
            # max_rows of the newest: no count(*) (a full scan) needed.
            if newest is not None and max_rows >= 0:
                removed += self._delete_oldest(table, table.c.id <= newest - max_rows, batch)
        if removed:
            self.reclaim()
        return removed

    def _delete_oldest(self, table: Table, condition: Any, batch: int) -> int:
        # No ORDER BY: the condition's own index (time, or the id itself) finds the rows, and
        # a log with nothing to trim costs one index probe, not a scan.
        removed = 0
        while True:
            some = select(table.c.id).where(condition).limit(batch)
            with self.engine.begin() as c:
                n = c.execute(delete(table).where(table.c.id.in_(some))).rowcount
            removed += n
            if n < batch:
                return removed

    def reclaim(self) -> None:
        """Give the pages deleted rows left free back to the filesystem (SQLite)."""
        if self.engine.dialect.name == "sqlite":
            with self.engine.connect() as c:
                # Each step of this pragma frees one page, and sqlite3's execute() takes one
                # step of a statement without columns: executescript runs it to the end.
                raw = c.connection.driver_connection
                assert raw is not None
                raw.executescript("PRAGMA incremental_vacuum;")

    def log_rows(self) -> dict[str, int]:
        """Rows in each log (a full count: for tests and operators, not hot paths)."""
        with self.engine.connect() as c:
            return {
                t.name: int(c.execute(select(func.count()).select_from(t)).scalar_one())
                for t in (audit, egress_log)
            }
