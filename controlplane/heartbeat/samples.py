"""Downsampling of heartbeat metrics into MetricSample rows: one row per series per 10 s.

Histograms are kept as two counters, their sum and their count (`NAME_sum`, `NAME_count`, the
names Prometheus gives them), so a mean over any range is sum(_sum) / sum(_count); the buckets
are Prometheus' to keep.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, insert, select, update
from sqlalchemy.engine import Connection
from sqlmodel import col

from controlplane.models import Instance, MetricSample
from protocol.wire import GpuStatus, Heartbeat

SAMPLE_BUCKET_S = 10
GPU_SERIES = ("utilization_percent", "memory_used_bytes", "temperature_c", "power_w")
MAX_NAME = 128
# Series one host may open in one bucket. An agent reports a few dozen per instance; the names
# are the agent's to choose, so past this a new name waits for the next bucket.
MAX_SERIES_PER_BUCKET = 4096


def histogram_sum_name(name: str) -> str:
    """The counter a histogram's sum is kept under: `NAME_sum`, before any `{labels}`."""
    return _suffixed(name, "_sum")


def histogram_count_name(name: str) -> str:
    """The counter a histogram's count is kept under: `NAME_count`, before any `{labels}`."""
    return _suffixed(name, "_count")


def _suffixed(series: str, suffix: str) -> str:
    base, brace, labels = series.partition("{")
    return f"{base}{suffix}{brace}{labels}"


@dataclass
class HostSampleBucket:
    """The open 10 s bucket of one host, accumulated in memory and written when it closes.

    Counters (histograms' sums and counts among them) are summed deltas over the bucket; gauges
    and GPU readings are the last value seen in it. Rows carry the bucket's start time.

    With several replicas, one agent's heartbeats may land on more than one of them, each
    holding part of a bucket. A bucket that saw such a heartbeat (`shared`: the caller saw
    another replica write since this one did) is merged into the rows already stored when it
    closes: counters add up, gauges take this replica's value. The caller holds the host row
    locked (its heartbeat UPDATE), so two replicas never merge the same host's bucket at once.
    A bucket nobody else touched is written with plain INSERTs, as before.
    """

    host_id: int
    bucket: int = -1
    last_gpus: list[GpuStatus] = field(default_factory=list)
    counters: dict[tuple[int, str], float] = field(default_factory=dict)
    gauges: dict[tuple[int | None, str], float] = field(default_factory=dict)
    shared: bool = False

    def add(self, conn: Connection, beat: Heartbeat, now: datetime, *, shared: bool) -> None:
        """Fold a heartbeat in; first write the previous bucket if `now` starts a new one.

        `shared`: another replica wrote this host's observed state since this one last did.
        """
        bucket = int(now.timestamp()) // SAMPLE_BUCKET_S
        self.shared = self.shared or shared
        if self.bucket == -1:
            self.bucket = bucket
        if bucket != self.bucket:
            self._flush(conn, now)
            self.bucket = bucket
            self.shared = shared
        self.last_gpus = beat.gpus
        counters, gauges = self.counters, self.gauges
        for metrics in beat.metrics:
            for name, delta in metrics.counters.items():
                key = (metrics.instance_id, name[:MAX_NAME])
                if key in counters or len(counters) < MAX_SERIES_PER_BUCKET:
                    counters[key] = counters.get(key, 0.0) + delta
            for name, hist in metrics.histograms.items():
                if not hist.count and not hist.sum:
                    continue  # nothing observed since the last heartbeat: no rows of zeros
                for series, delta in (
                    (histogram_sum_name(name), hist.sum),
                    (histogram_count_name(name), hist.count),
                ):
                    key = (metrics.instance_id, series[:MAX_NAME])
                    if key in counters or len(counters) < MAX_SERIES_PER_BUCKET:
                        counters[key] = counters.get(key, 0.0) + delta
            for name, value in metrics.gauges.items():
                gauge = (metrics.instance_id, name[:MAX_NAME])
                if gauge in gauges or len(gauges) < MAX_SERIES_PER_BUCKET:
                    gauges[gauge] = value

    def _flush(self, conn: Connection, now: datetime) -> None:
        bucket_time = datetime.fromtimestamp(self.bucket * SAMPLE_BUCKET_S, tz=now.tzinfo)
        for gpu in self.last_gpus:
            for series in GPU_SERIES:
                value = getattr(gpu, series)
                if value is not None:
                    self.gauges[(None, f"gpu{gpu.index}.{series}")] = float(value)
        own = set(
            conn.execute(
                select(col(Instance.id)).where(col(Instance.host_id) == self.host_id)
            ).scalars()
        )
        rows = [
            {
                "host_id": self.host_id,
                "instance_id": instance_id,
                "name": name,
                "time": bucket_time,
                "value": value,
            }
            for (instance_id, name), value in [*self.counters.items(), *self.gauges.items()]
            # Metrics of instances that are not (or no longer) this host's are dropped.
            if instance_id is None or instance_id in own
        ]
        if rows and self.shared:
            rows = self._merge(conn, bucket_time, rows)
        if rows:
            conn.execute(insert(MetricSample), rows)
        self.counters.clear()
        self.gauges.clear()

    def _merge(
        self, conn: Connection, bucket_time: datetime, rows: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """Fold `rows` into the bucket's stored rows; returns the rows that are new."""
        stored = {
            (r.instance_id, r.name): (r.id, r.value)
            for r in conn.execute(
                select(
                    col(MetricSample.id),
                    col(MetricSample.instance_id),
                    col(MetricSample.name),
                    col(MetricSample.value),
                ).where(
                    col(MetricSample.host_id) == self.host_id, col(MetricSample.time) == bucket_time
                )
            )
        }
        fresh, updates = [], []
        for row in rows:
            key = (row["instance_id"], row["name"])
            if key not in stored:
                fresh.append(row)
                continue
            sample_id, value = stored[key]
            if key in self.counters:
                value += row["value"]
            else:
                value = row["value"]
            updates.append({"b_id": sample_id, "b_value": value})
        if updates:
            conn.execute(
                update(MetricSample)
                .where(col(MetricSample.id) == bindparam("b_id"))
                .values(value=bindparam("b_value")),
                updates,
            )
        return fresh
