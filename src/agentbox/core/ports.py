"""Exposed sandbox ports: how a gateway URL names a (sandbox, port) and how its signed URLs work.

Pure helpers, no HTTP: the gateway (`server/gateway.py`) and the SDK (`get_url`) share them, so
a URL the SDK mints is the URL the gateway accepts.

A signed URL carries `abx_exp` (unix seconds) and `abx_sig`, the URL-safe unpadded base64 of
HMAC-SHA256 keyed with the sandbox's access token over `"{sandbox_id}:{port}:{expires}"`.
Rotating the access token therefore revokes every URL. A URL lives at most `MAX_LIFETIME`: one
that leaks (a browser history, a log, a shared screen) stops working on its own.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
import re
from datetime import UTC, datetime

# Signed URL lifetimes, in seconds: when none is asked for, and the most that is accepted.
DEFAULT_LIFETIME = 3600
MAX_LIFETIME = 24 * 3600
# Clock skew allowed between the signing and checking of a URL (servers may differ).
_SKEW = 300

SIG_PARAM = "abx_sig"
EXP_PARAM = "abx_exp"
COOKIE = "abx_port"

# Sandbox ids are `sbx_` + 16 hex; anything of this shape is looked up (and then not found).
_SANDBOX_ID = re.compile(r"[a-z0-9_-]{1,64}")
# A port as written by people: 1-65535 without leading zeros, so each port has one spelling.
_PORT = re.compile(r"[1-9][0-9]{0,4}")
_PORT_PATH = re.compile(r"/v1/sandboxes/([a-z0-9_-]{1,64})/ports/([1-9][0-9]{0,4})(/.*)?", re.S)
_EXPIRES = re.compile(r"[0-9]{1,12}")
_SIG = re.compile(r"[A-Za-z0-9_-]{43}")  # 32 bytes of base64, unpadded


def sign(token: str, sandbox_id: str, port: int, expires: int) -> str:
    """The `abx_sig` for a URL to `port` of `sandbox_id` that expires at unix time `expires`."""
    msg = f"{sandbox_id}:{port}:{expires}".encode()
    digest = hmac.new(token.encode(), msg, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def signed_query(
    token: str, sandbox_id: str, port: int, expires_in: float | None, now: float
) -> tuple[int, dict[str, str]]:
    """(expires, query parameters) of a URL to `port` of `sandbox_id` that lives `expires_in`
    seconds from `now` (default DEFAULT_LIFETIME), rounded up to a whole second."""
    expires = math.ceil(now + (expires_in or DEFAULT_LIFETIME))
    return expires, {EXP_PARAM: str(expires), SIG_PARAM: sign(token, sandbox_id, port, expires)}


def check_signature(
    token: str, sandbox_id: str, port: int, expires: str, sig: str, now: float
) -> str | None:
    """None if `sig` signs (sandbox_id, port, expires) and `expires` is not past, else why not.

    `expires` and `sig` come straight from a query string or cookie: anything is tolerated.
    """
    if not _EXPIRES.fullmatch(expires) or not _SIG.fullmatch(sig):
        return "bad signature"
    exp = int(expires)
    if not hmac.compare_digest(sign(token, sandbox_id, port, exp), sig):
        return "bad signature"
    if now > exp:
        if not exp:
            return "signed URL never expires: such URLs are no longer accepted"
        at = datetime.fromtimestamp(exp, UTC).isoformat().replace("+00:00", "Z")
        return f"signed URL expired at {at}"
    if exp > now + MAX_LIFETIME + _SKEW:
        return f"signed URL lives longer than the maximum of {MAX_LIFETIME} s"
    return None


def _port(text: str) -> int | None:
    if not _PORT.fullmatch(text):
        return None
    port = int(text)
    return port if port <= 65535 else None


def parse_port_host(host_header: str, domain: str) -> tuple[int, str] | None:
    """(port, sandbox_id) from a Host like `3000-sbx_0123abcd.example.com:443`, else None.

    Only a single label directly under `domain` matches; the Host's own `:port` is ignored.
    """
    domain = domain.strip().strip(".").lower()
    if not domain:
        return None
    host = host_header.strip().lower()
    if host.startswith("["):  # an IPv6 literal is never a port host
        return None
    host = host.rpartition(":")[0] if ":" in host else host
    host = host.removesuffix(".")  # a fully qualified name may end in a dot
    suffix = "." + domain
    if not host.endswith(suffix):
        return None
    label = host[: -len(suffix)]
    port_text, dash, sandbox_id = label.partition("-")
    if not dash or not _SANDBOX_ID.fullmatch(sandbox_id):
        return None
    port = _port(port_text)
    return None if port is None else (port, sandbox_id)


def port_path_prefix(sandbox_id: str, port: int) -> str:
    """The path under which the API server proxies `port` of `sandbox_id`."""
    return f"/v1/sandboxes/{sandbox_id}/ports/{port}"


def parse_port_path(path: str) -> tuple[int, str, str] | None:
    """(port, sandbox_id, rest) for `/v1/sandboxes/{id}/ports/{P}[/rest]`, else None.

    `rest` is what the sandbox's server sees as its path: at least "/".
    """
    match = _PORT_PATH.fullmatch(path)
    if match is None:
        return None
    port = _port(match.group(2))
    if port is None:
        return None
    return port, match.group(1), match.group(3) or "/"
