"""Build a `FleetSnapshot` through the REST client: the doctor's only I/O."""

from __future__ import annotations

from typing import TYPE_CHECKING

from client import calls
from doctor.findings import FleetSnapshot, Points
from protocol.rest import SeriesOut
from protocol.version_ref import VersionRef

if TYPE_CHECKING:
    from client.http import ControlPlaneClient

# Samples the rules read: long enough for a trend (creep) from 10 s buckets, short enough to
# describe the fleet as it is now.
WINDOW_MINUTES = 15


def collect(
    api: ControlPlaneClient,
    deployment: str | None = None,
    host: str | None = None,
    minutes: int = WINDOW_MINUTES,
) -> FleetSnapshot:
    """Deployments (all, or DEPLOYMENT), their versions and traffic, and the hosts they run on
    (all, or HOST) with instances and recent samples. A name that does not exist raises the
    client's 404."""
    snap = FleetSnapshot()
    snap.deployments = (
        [api.get_deployment(deployment)] if deployment is not None else api.list_deployments()
    )
    if host is not None:
        names = [api.get_host(host).name]
        # Only what runs there: a deployment elsewhere is not this host's problem.
        snap.deployments = [
            d for d in snap.deployments if any(i.host in names for i in d.instances)
        ]
    elif deployment is not None:
        names = sorted({i.host for d in snap.deployments for i in d.instances})
    else:
        names = [h.name for h in api.list_hosts()]
    snap.hosts = [api.get_host(name) for name in names]
    for dep in snap.deployments:
        for version in {dep.version, dep.canary_version} - {None}:
            assert version is not None
            snap.versions[VersionRef(dep.model, version)] = api.get_version(dep.model, version)
        snap.traffic[dep.name] = api.deployment_traffic(dep.name)
    for name in names:
        gpu_series, per_instance = split_series(api.send(calls.host_samples(name, minutes=minutes)))
        snap.host_series[name] = gpu_series
        snap.instance_series.update(per_instance)
    return snap


def split_series(
    series: list[SeriesOut],
) -> tuple[dict[str, Points], dict[int, dict[str, Points]]]:
    """A host's samples as (host series by name, instance id -> its series by name)."""
    own: dict[str, Points] = {}
    per_instance: dict[int, dict[str, Points]] = {}
    for one in series:
        if one.instance_id is None:
            own[one.name] = list(one.points)
        else:
            per_instance.setdefault(one.instance_id, {})[one.name] = list(one.points)
    return own, per_instance
