"""The gateway (`dctl gateway`): one OpenAI-compatible front door for the fleet.

A stateless process of its own, run as many times as needed behind an L4 load balancer. It
reads its routing table from the control plane (or a static file), sends each request to an
instance of the named deployment (stable or canary by weight, least outstanding requests,
passive health), streams the answer back, and reports what it served per version.

It imports only `protocol`, `runtime`, `client` and third-party packages: nothing of the control
plane (no database, no FastAPI), so it starts fast and runs anywhere. Its entry module is `main`.
"""

from gateway.main import Gateway, build_gateway, run
from gateway.settings import GatewaySettings, SettingsError, load_gateway_settings

__all__ = [
    "Gateway",
    "GatewaySettings",
    "SettingsError",
    "build_gateway",
    "load_gateway_settings",
    "run",
]
