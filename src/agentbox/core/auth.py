"""API keys and tenants: who is calling, and which sandboxes they may touch.

Keys look like `abx_<key_id>_<secret>`; only a SHA-256 of the whole key is stored. A key belongs
to one tenant; admin keys may also manage keys and quotas. On first start with no key at all
and no AGENTBOX_ADMIN_KEY, the server makes a bootstrap admin key readable only by root in
`<data-dir>/admin.key`, so a fresh install works with no set-up.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentbox.config import ADMIN_KEY_FILE
from agentbox.core.errors import Forbidden, InvalidRequest, NotFound, Unauthorized
from agentbox.store.db import Store

ADMIN_TENANT = "admin"
_TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class Caller:
    tenant: str
    key_id: str
    admin: bool
    # What the request says it does this for (the X-Agentbox-Via header: an MCP session and
    # tool, say): recorded in the audit of every action it takes. A label, not a credential.
    via: str | None = None


def require_admin(caller: Caller, what: str) -> Caller:
    """The caller, if its key is an admin key; `what` names what needs one."""
    if not caller.admin:
        raise Forbidden(f"{what} needs an admin API key")
    return caller


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def check_tenant_name(tenant: str) -> str:
    if not _TENANT_RE.fullmatch(tenant):
        raise InvalidRequest(
            f"invalid tenant name {tenant!r}: use 1-64 letters, digits, '.', '_' or '-'"
        )
    return tenant


def create_key(store: Store, tenant: str, admin: bool = False) -> tuple[str, str]:
    """Make a key for `tenant`; returns (key_id, key). The key is shown only this once."""
    check_tenant_name(tenant)
    key_id = secrets.token_hex(6)
    key = f"abx_{key_id}_{secrets.token_urlsafe(32)}"
    store.add_key(key_id, _hash(key), tenant, admin)
    return key_id, key


def create_key_offline(data_dir: Path, tenant: str, admin: bool = False) -> tuple[str, str]:
    """`agentbox keys create`: works on the data dir's database, with or without a server."""
    return create_key(Store.for_data_dir(data_dir), tenant, admin)


def list_keys_offline(data_dir: Path) -> list[dict[str, Any]]:
    """`agentbox keys ls` on the data dir's database."""
    return Store.for_data_dir(data_dir).list_keys()


def revoke_key_offline(data_dir: Path, key_id: str) -> None:
    """`agentbox keys rm` on the data dir's database."""
    if not Store.for_data_dir(data_dir).revoke_key(key_id):
        raise NotFound(f"key {key_id} not found")


class Authenticator:
    def __init__(self, store: Store, env_admin_key: str | None) -> None:
        self.store = store
        self.env_admin_key = env_admin_key or None

    def authenticate(self, key: str | None) -> Caller:
        if not key:
            raise Unauthorized("missing API key: send it in the X-API-Key header")
        if self.env_admin_key and hmac.compare_digest(key.encode(), self.env_admin_key.encode()):
            return Caller(tenant=ADMIN_TENANT, key_id="env-admin", admin=True)
        found = self.store.find_key(_hash(key))
        if found is None:
            raise Unauthorized("invalid or revoked API key")
        key_id, tenant, admin = found
        return Caller(tenant=tenant, key_id=key_id, admin=admin)

    def bootstrap(self, data_dir: Path) -> str | None:
        """Create the bootstrap admin key when nothing else grants access; return it if made."""
        if self.env_admin_key or self.store.count_keys() > 0:
            return None
        _, key = create_key(self.store, ADMIN_TENANT, admin=True)
        path = data_dir / ADMIN_KEY_FILE
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
        return key
