"""Rollout gauges of the control plane's /metrics: per deployment, its current rollout (else its
latest), which versions it moves between, its state and phase, its step and its canary weight.

Read from the store at scrape time, like the fleet's gauges, so every replica reports the same
and a dashboard or an alert sees what `dctl rollout status` says. The newest record of a
deployment is the active one when there is one: a rollout cannot start while another is active.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from controlplane.models import Deployment, Rollout
from controlplane.services.placement import load_versions


class RolloutCollector(Collector):
    """`dctl_rollout_info`, `dctl_rollout_step` and `dctl_rollout_weight`, one series per
    deployment that has ever had a rollout, rollback or restart."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """The gauges of each deployment's newest record."""
        info = GaugeMetricFamily(
            "dctl_rollout_info",
            "1 for each deployment's current rollout (else its latest): versions, state, phase",
            labels=["deployment", "from", "to", "state", "phase"],
        )
        step = GaugeMetricFamily(
            "dctl_rollout_step",
            "Index of the plan's step the rollout is at, from 0 (rollout status counts from 1)",
            labels=["deployment"],
        )
        weight = GaugeMetricFamily(
            "dctl_rollout_weight",
            "Percent of the deployment's requests its canary gets now (0 once it has ended)",
            labels=["deployment"],
        )
        newest = select(func.max(Rollout.id)).group_by(col(Rollout.deployment_id))
        with Session(self._engine) as session:
            rows = session.exec(
                select(Rollout, Deployment.name)
                .join(Deployment, col(Deployment.id) == col(Rollout.deployment_id))
                .where(col(Rollout.id).in_(newest))
                .order_by(col(Deployment.name))
            ).all()
            ids = [v for r, _ in rows for v in (r.from_version_id, r.to_version_id)]
            versions = load_versions(session, ids)
        for rollout, name in rows:
            # Versions are restricted from deletion while a rollout names them; the id is a
            # label of last resort rather than a failed scrape.
            old, new = (
                versions[v].label if v in versions else str(v)
                for v in (rollout.from_version_id, rollout.to_version_id)
            )
            # str() of the enums is their wire value ("paused", "analysing").
            info.add_metric([name, old, new, str(rollout.state), str(rollout.phase)], 1.0)
            step.add_metric([name], float(rollout.step_index))
            weight.add_metric([name], float(rollout.canary_weight))
        yield info
        yield step
        yield weight
