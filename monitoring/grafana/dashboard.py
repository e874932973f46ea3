"""Typed builders for a Grafana dashboard of Prometheus panels, rendered to Grafana's JSON model.

Only what our dashboards use: rows of time series, stat and heatmap panels laid out left to
right on Grafana's 24-column grid, PromQL targets, and query/datasource variables. Rendering is
deterministic (ids and positions follow declaration order, keys are sorted on output), so the
generated file only changes when the code does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

GRID_WIDTH = 24
SCHEMA_VERSION = 39  # Grafana 10.x / 11.x dashboard JSON
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

PanelKind = Literal["timeseries", "stat", "heatmap"]


@dataclass(frozen=True)
class Target:
    """One PromQL query of a panel; `legend` uses Grafana's `{{label}}` syntax."""

    expr: str
    legend: str = ""
    # "heatmap" tells Grafana the series are cumulative histogram buckets keyed by `le`.
    format: Literal["time_series", "heatmap"] = "time_series"

    def render(self, ref_id: str) -> dict[str, Any]:
        """The target's JSON."""
        return {
            "datasource": DATASOURCE,
            "editorMode": "code",
            "expr": self.expr,
            "format": self.format,
            "legendFormat": self.legend or "__auto",
            "range": True,
            "refId": ref_id,
        }


@dataclass(frozen=True)
class Panel:
    """A panel: a title, what it shows and how wide it is (out of 24 columns)."""

    title: str
    targets: tuple[Target, ...]
    description: str = ""
    unit: str = "short"
    kind: PanelKind = "timeseries"
    width: int = 8
    height: int = 8
    # Draw a red line (time series) or turn red (stat) at this value.
    threshold: float | None = None

    def render(self, panel_id: int, x: int, y: int) -> dict[str, Any]:
        """The panel's JSON at grid position (x, y)."""
        steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
        if self.threshold is not None:
            steps.append({"color": "red", "value": self.threshold})
        defaults: dict[str, Any] = {
            "unit": self.unit,
            "thresholds": {"mode": "absolute", "steps": steps},
        }
        if self.kind == "timeseries" and self.threshold is not None:
            defaults["custom"] = {"thresholdsStyle": {"mode": "line"}}
        return {
            "datasource": DATASOURCE,
            "description": self.description,
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "gridPos": {"h": self.height, "w": self.width, "x": x, "y": y},
            "id": panel_id,
            "options": _OPTIONS[self.kind],
            "targets": [target.render(chr(ord("A") + i)) for i, target in enumerate(self.targets)],
            "title": self.title,
            "type": self.kind,
        }


_OPTIONS: dict[PanelKind, dict[str, Any]] = {
    "timeseries": {
        "legend": {"calcs": [], "displayMode": "list", "placement": "bottom", "showLegend": True},
        "tooltip": {"mode": "multi", "sort": "desc"},
    },
    "stat": {
        "colorMode": "value",
        "graphMode": "area",
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        "textMode": "auto",
    },
    "heatmap": {
        "calculate": False,
        "cellGap": 1,
        "color": {"mode": "scheme", "scheme": "Oranges"},
        "yAxis": {"axisPlacement": "left"},
    },
}


@dataclass(frozen=True)
class Row:
    """A titled row; its panels flow left to right and wrap at 24 columns."""

    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True)
class Variable:
    """A dashboard variable. `query` is a Grafana `label_values(...)` query; `all_value` is what
    `$name` stands for when "All" is picked (a regex, since panels match with `=~`)."""

    name: str
    label: str
    query: str
    all_value: str = ".*"

    def render(self) -> dict[str, Any]:
        """The variable's JSON."""
        return {
            "allValue": self.all_value,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "datasource": DATASOURCE,
            "definition": self.query,
            "includeAll": True,
            "label": self.label,
            "multi": True,
            "name": self.name,
            "query": {"query": self.query, "refId": f"{self.name}-values"},
            "refresh": 2,  # on time range change: new hosts and versions show up
            "sort": 1,
            "type": "query",
        }


@dataclass(frozen=True)
class Dashboard:
    """A whole dashboard: its identity, variables and rows."""

    uid: str
    title: str
    description: str
    rows: tuple[Row, ...]
    variables: tuple[Variable, ...] = ()
    tags: tuple[str, ...] = ()
    refresh: str = "30s"
    time_from: str = "now-6h"

    def panels(self) -> list[Panel]:
        """Every panel, in order."""
        return [panel for row in self.rows for panel in row.panels]

    def render(self) -> dict[str, Any]:
        """Grafana's JSON model, ready for import or file provisioning."""
        panels: list[dict[str, Any]] = []
        panel_id, y = 1, 0
        for row in self.rows:
            panels.append(_row_json(row.title, panel_id, y))
            panel_id, y = panel_id + 1, y + 1
            x, line_height = 0, 0
            for panel in row.panels:
                if x + panel.width > GRID_WIDTH:
                    x, y, line_height = 0, y + line_height, 0
                panels.append(panel.render(panel_id, x, y))
                panel_id += 1
                x += panel.width
                line_height = max(line_height, panel.height)
            y += line_height
        datasource_variable = {
            "current": {},
            "hide": 0,
            "includeAll": False,
            "label": "Prometheus",
            "name": "datasource",
            "query": "prometheus",
            "refresh": 1,
            "type": "datasource",
        }
        return {
            "annotations": {"list": []},
            "description": self.description,
            "editable": True,
            "graphTooltip": 1,  # shared crosshair: line up a latency spike with its GPU
            "links": [],
            "panels": panels,
            "refresh": self.refresh,
            "schemaVersion": SCHEMA_VERSION,
            "tags": list(self.tags),
            "templating": {"list": [datasource_variable, *(v.render() for v in self.variables)]},
            "time": {"from": self.time_from, "to": "now"},
            "timepicker": {},
            "timezone": "browser",
            "title": self.title,
            "uid": self.uid,
            "version": 1,
        }

    def to_json(self) -> str:
        """The rendered model as stable, diff-friendly text."""
        return json.dumps(self.render(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _row_json(title: str, panel_id: int, y: int) -> dict[str, Any]:
    return {
        "collapsed": False,
        "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y},
        "id": panel_id,
        "panels": [],
        "title": title,
        "type": "row",
    }
