"""The control plane's REST client (sync and async) and the CLI's credentials (contexts).

Imports only `protocol` of the project: no sqlmodel, fastapi or torch.
"""

from client.calls import Call
from client.credentials import Context, CredentialsError, CredentialsFile
from client.errors import ClientError
from client.http import AsyncControlPlaneClient, ControlPlaneClient

__all__ = [
    "AsyncControlPlaneClient",
    "Call",
    "ClientError",
    "Context",
    "ControlPlaneClient",
    "CredentialsError",
    "CredentialsFile",
]
