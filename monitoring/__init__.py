"""What operators run next to a fleet: Prometheus config and alert rules, the Grafana dashboard,
and Vector / Promtail configs that ship the gateway's request log and the engines' logs to Loki.

The files ship inside the wheel as package data and are read through `importlib.resources`, so
`dctl metrics config -o DIR` writes the same files from an installed wheel as from a checkout.
"""

from __future__ import annotations

from importlib import resources

# Every file `dctl metrics config` writes, by the name it gets in the output directory, and where
# it lives in this package. One flat directory because prometheus.yml reads alerts.yml (and the
# targets.json that `dctl metrics targets -o` writes) relative to itself, and alerts_test.yml
# reads alerts.yml the same way.
ARTEFACTS: dict[str, tuple[str, str]] = {
    "prometheus.yml": ("prometheus", "prometheus.yml"),
    "alerts.yml": ("prometheus", "alerts.yml"),
    "alerts_test.yml": ("prometheus", "alerts_test.yml"),
    "grafana-dashboard.json": ("grafana", "dctl.json"),
    "vector.toml": ("logs", "vector.toml"),
    "promtail.yml": ("logs", "promtail.yml"),
}


def artefact(name: str) -> bytes:
    """The packaged content of the artefact written as NAME (a key of `ARTEFACTS`)."""
    folder, filename = ARTEFACTS[name]
    return (resources.files(__name__) / folder / filename).read_bytes()
