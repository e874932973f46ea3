"""The control plane's REST client and the CLI's credentials (contexts), shared by CLI and TUI.

Imports only `protocol` of the project: no sqlmodel, fastapi or torch.
"""

from client.credentials import Context, CredentialsError, CredentialsFile
from client.http import ClientError, ControlPlaneClient

__all__ = [
    "ClientError",
    "Context",
    "ControlPlaneClient",
    "CredentialsError",
    "CredentialsFile",
]
