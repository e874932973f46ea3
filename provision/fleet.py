"""What provisioning asks of the control plane, behind one small interface.

`ApiFleet` is the real one, over the REST client; the provisioner takes any `Fleet`, so its
flow reads as the steps of the issue and not as HTTP calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from client.http import ControlPlaneClient
    from protocol.rest import HostOut

# A minted bootstrap token lives this long: enough to install torch on a slow link, short
# enough that a token left on a failed host is useless by the time anyone finds it.
BOOTSTRAP_TTL_S = 3600
# Observed states of an instance whose engine does not run (a drained host keeps its instances,
# stopped, in place).
IDLE_STATES = frozenset({"pending", "stopped", "failed"})


@dataclass(frozen=True)
class BootstrapToken:
    """A one-use token that registers one host; `token_id` is None for a rekey token."""

    secret: str
    token_id: str | None


class Fleet(Protocol):
    """The control-plane calls provisioning makes."""

    def host(self, name: str) -> HostOut | None:
        """The host (with its instances), or None when the control plane does not know it."""

    def bootstrap_token(self, name: str, labels: Mapping[str, str]) -> BootstrapToken:
        """A new one-use bootstrap token for a host not yet registered, stamping LABELS on it."""

    def rekey(self, name: str) -> BootstrapToken:
        """A one-use token that registers a known host again (its old agent token then stops)."""

    def revoke(self, token: BootstrapToken) -> None:
        """Revoke a token this run minted and did not use."""

    def drain(self, name: str) -> None:
        """Stop placing engines on the host and move its instances away."""

    def undrain(self, name: str) -> None:
        """Make the host schedulable again."""

    def remove(self, name: str) -> None:
        """Forget the host; its agent token stops working."""


class ApiFleet:
    """`Fleet` over the control plane's REST API (a token with the admin role)."""

    def __init__(self, client: ControlPlaneClient) -> None:
        self.client = client

    def host(self, name: str) -> HostOut | None:
        """GET /hosts/NAME; a 404 is None."""
        from client.errors import ClientError

        try:
            return self.client.get_host(name)
        except ClientError as exc:
            if exc.status == 404:
                return None
            raise

    def bootstrap_token(self, name: str, labels: Mapping[str, str]) -> BootstrapToken:
        """A bootstrap token for one use within the hour, named after the host and the time,
        that stamps LABELS on the host (the labels placement reads; the agent's are reported)."""
        from protocol.rest import TokenCreate

        stamp = datetime.now(UTC).strftime("%Y%m%d%H%M%S")
        spec = TokenCreate(
            name=f"provision-{name}-{stamp}"[:63],
            role="bootstrap",
            expires_in_s=BOOTSTRAP_TTL_S,
            uses=1,
            labels=dict(labels),
        )
        created = self.client.create_token(spec)
        return BootstrapToken(created.secret, created.id)

    def rekey(self, name: str) -> BootstrapToken:
        """POST /hosts/NAME/rekey."""
        return BootstrapToken(self.client.rekey_host(name).secret, None)

    def revoke(self, token: BootstrapToken) -> None:
        """Revoke by id; a rekey token (no id) expires on its own."""
        if token.token_id is not None:
            self.client.revoke_token(token.token_id)

    def drain(self, name: str) -> None:
        """POST /hosts/NAME/drain."""
        self.client.drain_host(name)

    def undrain(self, name: str) -> None:
        """POST /hosts/NAME/undrain."""
        self.client.undrain_host(name)

    def remove(self, name: str) -> None:
        """DELETE /hosts/NAME."""
        self.client.remove_host(name)


def busy_instances(host: HostOut | None) -> list[Any]:
    """The host's instances whose engines still run."""
    if host is None:
        return []
    return [i for i in host.instances or [] if i.observed_state not in IDLE_STATES]


def drain_and_wait(
    fleet: Fleet,
    name: str,
    timeout_s: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Drain NAME and wait until none of its engines runs; returns how many ran at first.

    Raises `ProvisionError` after TIMEOUT_S (the host stays drained)."""
    from provision.errors import ProvisionError

    fleet.drain(name)
    first = busy = len(busy_instances(fleet.host(name)))
    deadline = clock() + timeout_s
    while busy:
        if clock() > deadline:
            raise ProvisionError(
                f"{busy} engine(s) still run on {name} after {timeout_s:.0f} s of draining; "
                f"see `dctl host show {name}`"
            )
        sleep(1.0)
        busy = len(busy_instances(fleet.host(name)))
    return first
