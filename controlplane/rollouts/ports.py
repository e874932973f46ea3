"""What the rollouts package uses of the services, named in one place.

The rollout machine changes a deployment's instances and reads its traffic; the services own both
(placement plans and tells the hosts: a re-plan applies what fits, a manual canary's placement is
refused whole when it does not fit; traffic aggregates the gateways' windows). Every module of
`controlplane/rollouts/` reaches the services through these names only (a test holds it to that),
so what rollouts depend on is this list, and the services may change anything else.

The services' domain errors (`controlplane.services.errors`) are the control plane's shared
vocabulary, not a service, and are imported directly: `webhook` raises them while the services
import it to check a target, so importing them through here would make a cycle.
"""

from __future__ import annotations

from controlplane.services.placement import (
    bump_generation,
    load_versions,
    place_deployment,
    replan_deployment,
)
from controlplane.services.traffic import deployment_traffic, histogram_quantile

__all__ = [
    "bump_generation",
    "deployment_traffic",
    "histogram_quantile",
    "load_versions",
    "place_deployment",
    "replan_deployment",
]
