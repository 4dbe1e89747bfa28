"""E2B's signed file URLs (`sbx.download_url(path)`, `sbx.upload_url(path)`): envd's `/files`
without `X-Access-Token`, authorized by `signature=v1_<sha256 of path:op:user:token[:exp]>` and
an optional `signature_expiration` (Unix seconds).

The SDK builds them on `E2B_SANDBOX_URL` with no sandbox id in them, and they are opened by
plain HTTP clients that send no E2B headers: such a request names its sandbox only by the token
its signature was made with, so the running sandboxes are tried one by one (a hash each). A URL
without an expiry holds until the sandbox's access token is rotated
(`POST /v1/sandboxes/{id}/access-token`) or the sandbox ends.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections.abc import Iterable

from starlette.requests import Request

from agentbox.core.errors import InvalidRequest, Unauthorized
from agentbox.server.e2b.common import EXPIRED, ExpiredSignature, envd_token
from agentbox.server.surfaces import Core
from agentbox.store.db import SandboxRow


def signature(token: str, path: str, op: str, user: str, expiration: int | None) -> str:
    raw = f"{path}:{op}:{user}:{token}" + (f":{expiration}" if expiration is not None else "")
    digest = hashlib.sha256(raw.encode()).digest()
    return "v1_" + base64.b64encode(digest).rstrip(b"=").decode()


def is_signed(request: Request) -> bool:
    return "signature" in request.query_params


def signed_row(core: Core, request: Request, candidates: Iterable[SandboxRow]) -> SandboxRow:
    """The sandbox among `candidates` whose envd token made the request's signature, for the
    operation its method is (GET read, POST write); Unauthorized when none did."""
    q = request.query_params
    given = q.get("signature", "")
    op = {"GET": "read", "POST": "write"}.get(request.method)
    raw_exp = q.get("signature_expiration")
    try:
        expiration = int(raw_exp) if raw_exp is not None else None
    except ValueError:
        raise InvalidRequest("signature_expiration must be a Unix time in seconds") from None
    if op is None or not given.startswith("v1_"):
        raise Unauthorized("invalid signature")
    path, user = q.get("path", ""), q.get("username", "")
    if not path:  # a signature over no path would let a multipart upload name any file
        raise InvalidRequest("a signed file URL must name its path")
    for row in candidates:
        expected = signature(envd_token(core, row), path, op, user, expiration)
        if not core.limits.e2b_envd_tokens:  # the battery's positive control only
            return row
        if hmac.compare_digest(given.encode(), expected.encode()):
            if expiration is not None and expiration < time.time():
                raise ExpiredSignature(EXPIRED)
            return row
    raise Unauthorized("invalid signature")
