"""Engine `/metrics` as heartbeat deltas: counters and histogram buckets since the last heartbeat
the control plane acknowledged, gauges as last seen.

Deltas are taken against the last *acknowledged* scrape, so while the control plane is down they
keep accumulating and the first heartbeat after it returns carries everything it missed. A value
that went down means the engine restarted; then the delta is the new value itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from agent.backends.metric_names import is_foreign, renamed
from protocol.wire import HistogramDelta, InstanceMetrics

# Label sets whose size grows with the model (layer x expert) stay out of the heartbeat: the
# engine's own /metrics has them for Prometheus. The tokens routed to each expert are reduced
# here instead, per layer and heartbeat interval, to the load skew (max / mean over experts) and
# the expert that took the most: two gauges per layer, whatever the number of experts.
_SKIPPED_LABELS = {"expert"}
EXPERT_TOKENS = "dllm_expert_tokens_total"
EXPERT_SKEW = "dllm_expert_load_skew"
EXPERT_HOT = "dllm_expert_load_hot_expert"
MAX_COUNTERS, MAX_HISTOGRAMS, MAX_GAUGES = 256, 64, 256


def series_key(name: str, labels: dict[str, str]) -> str:
    """`name{a="1",b="2"}` with labels sorted; just `name` without labels."""
    if not labels:
        return name
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


@dataclass
class Scrape:
    """One parsed /metrics page: cumulative counters and histograms, gauges."""

    counters: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, HistogramDelta] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    # Cumulative tokens routed, by (layer, expert).
    experts: dict[tuple[str, str], float] = field(default_factory=dict)


def parse_metrics(text: str) -> Scrape:
    """Parse Prometheus text exposition into counters, histograms and gauges; another engine's
    series (vLLM, SGLang, llama.cpp) under the dctl engine's names (`metric_names.renamed`)."""
    scrape = Scrape()
    for family in text_string_to_metric_families(text):
        # A renamed series may gather several of theirs (label sets we drop): those add up.
        adds = is_foreign(family.name)
        for sample in family.samples:
            if not math.isfinite(sample.value):
                continue  # NaN (an empty summary) or Inf: heartbeats carry finite numbers only
            named = renamed(family.name, sample.name, dict(sample.labels))
            if named is None:
                continue
            family_name, sample_name, labels = named
            if _SKIPPED_LABELS & labels.keys():
                if sample_name == EXPERT_TOKENS and "expert" in labels:
                    scrape.experts[(labels.get("layer", "0"), labels["expert"])] = sample.value
                continue
            if family.type == "counter" and sample_name.endswith("_total"):
                _put(scrape.counters, series_key(sample_name, labels), sample.value, adds,
                     MAX_COUNTERS)  # fmt: skip
            elif family.type == "gauge":
                _put(scrape.gauges, series_key(sample_name, labels), sample.value, adds,
                     MAX_GAUGES)  # fmt: skip
            elif family.type == "histogram":
                le = labels.pop("le", None)
                key = series_key(family_name, labels)
                if key not in scrape.histograms:
                    if len(scrape.histograms) >= MAX_HISTOGRAMS:
                        continue
                    scrape.histograms[key] = HistogramDelta()
                hist = scrape.histograms[key]
                base = 0.0
                if sample_name.endswith("_bucket") and le is not None:
                    base = hist.buckets.get(le, 0.0) if adds else 0.0
                    hist.buckets[le] = base + sample.value
                elif sample_name.endswith("_sum"):
                    hist.sum = (hist.sum if adds else 0.0) + sample.value
                elif sample_name.endswith("_count"):
                    hist.count = (hist.count if adds else 0.0) + sample.value
    return scrape


def _put(values: dict[str, float], key: str, value: float, adds: bool, limit: int) -> None:
    """VALUES[KEY] = VALUE (added to what is there when ADDS), if the key fits under LIMIT."""
    if key in values:
        values[key] = values[key] + value if adds else value
    elif len(values) < limit:
        values[key] = value


def expert_load(now: Scrape, before: Scrape) -> dict[str, float]:
    """Per layer, the skew (max / mean over experts) of the tokens routed since BEFORE and the
    expert that took the most, as heartbeat gauges; layers that routed nothing are left out."""
    reset = any(v < before.experts.get(k, 0.0) for k, v in now.experts.items())
    by_layer: dict[str, dict[str, float]] = {}
    for (layer, expert), value in now.experts.items():
        start = 0.0 if reset else before.experts.get((layer, expert), 0.0)
        by_layer.setdefault(layer, {})[expert] = value - start
    gauges = {}
    for layer, routed in by_layer.items():
        mean = sum(routed.values()) / len(routed)
        if mean <= 0:
            continue
        hot = max(routed, key=lambda e: (routed[e], -int(e) if e.isdigit() else 0))
        gauges[series_key(EXPERT_SKEW, {"layer": layer})] = round(routed[hot] / mean, 4)
        if hot.isdigit():
            gauges[series_key(EXPERT_HOT, {"layer": layer})] = float(hot)
    return gauges


def _capped(values: dict[str, float], limit: int) -> dict[str, float]:
    """The first LIMIT entries (the engine's own gauges come first, then per-layer loads)."""
    return values if len(values) <= limit else dict(list(values.items())[:limit])


def _delta(now: float, before: float | None) -> float:
    if before is None or now < before:  # new series, or the engine restarted
        return now
    return now - before


class EngineMetricsTracker:
    """Per-instance deltas against the last acknowledged scrape."""

    def __init__(self) -> None:
        self._acked: dict[int, Scrape] = {}
        self._latest: dict[int, Scrape] = {}

    def record(self, instance_id: int, text: str) -> None:
        """Remember the latest scrape of an instance."""
        self._latest[instance_id] = parse_metrics(text)

    def latest_gauge(self, instance_id: int, name: str) -> float | None:
        """A gauge from the latest scrape (e.g. requests running), if present."""
        scrape = self._latest.get(instance_id)
        return scrape.gauges.get(name) if scrape else None

    def deltas(self) -> list[InstanceMetrics]:
        """What changed since the last acknowledged heartbeat, per instance."""
        result = []
        for instance_id, now in self._latest.items():
            before = self._acked.get(instance_id, Scrape())
            reset = any(v < before.counters.get(k, 0) for k, v in now.counters.items())
            if reset:
                before = Scrape()
            counters = {k: _delta(v, before.counters.get(k)) for k, v in now.counters.items()}
            histograms = {}
            for key, hist in now.histograms.items():
                old = before.histograms.get(key)
                if old is None or hist.count < old.count:
                    histograms[key] = hist.model_copy()
                    continue
                histograms[key] = HistogramDelta(
                    buckets={le: _delta(v, old.buckets.get(le)) for le, v in hist.buckets.items()},
                    sum=hist.sum - old.sum,
                    count=hist.count - old.count,
                )
            result.append(
                InstanceMetrics(
                    instance_id=instance_id,
                    counters=counters,
                    histograms=histograms,
                    gauges=_capped({**now.gauges, **expert_load(now, before)}, MAX_GAUGES),
                )
            )
        return result

    def acknowledge(self) -> None:
        """The control plane has the deltas: later deltas start from here."""
        self._acked = {i: s for i, s in self._latest.items()}

    def forget(self, instance_id: int) -> None:
        """Drop an instance that no longer exists."""
        self._acked.pop(instance_id, None)
        self._latest.pop(instance_id, None)
