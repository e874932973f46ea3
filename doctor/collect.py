"""Build a `FleetSnapshot` through the REST client: the doctor's only I/O."""

from __future__ import annotations

from typing import TYPE_CHECKING

from client import calls
from client.errors import ClientError
from doctor.findings import FleetSnapshot, Points
from protocol.logs import AuditReport
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
    (all, or HOST) with instances and recent samples; for the whole fleet, the access audit too.
    A name that does not exist raises the client's 404."""
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
    if deployment is None and host is None:
        # Client tokens are the fleet's, not one deployment's or host's.
        snap.audit, skipped = read_audit(api)
        if skipped:
            snap.notes.append(f"access.audit skipped: {skipped}")
    return snap


def read_audit(api: ControlPlaneClient) -> tuple[AuditReport | None, str | None]:
    """The access audit (the control plane's default range), or None and why it was not read:
    only admins may, and a control plane older than the audit has none."""
    try:
        return api.access_audit(), None
    except ClientError as exc:
        if exc.status == 403:
            return None, "reading the access audit needs an admin token"
        if exc.status == 404:
            return None, "this control plane keeps no access audit (upgrade it)"
        raise


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
