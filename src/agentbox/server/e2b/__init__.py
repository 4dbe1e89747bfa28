"""E2B wire compatibility: the stock `e2b` SDKs work against agentbox when pointed at it with
environment variables only (docs/E2B.md).

Two surfaces share the server's port with the /v1 API: `control_surface`, E2B's REST control
plane (`/sandboxes`, `/v2/sandboxes`, ...), and `envd_surface`, the sandbox traffic the SDK
addresses with the `E2b-Sandbox-Id` and `E2b-Sandbox-Port` headers (envd's `/health` and
`/files`). Both act through the same core, tenant checks, limits and audit as the /v1 API.
"""

from agentbox.server.e2b.control import control_surface
from agentbox.server.e2b.envd import envd_surface

__all__ = ["control_surface", "envd_surface"]
