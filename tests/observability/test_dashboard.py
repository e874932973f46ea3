"""The Grafana dashboard is generated, never hand-edited, and lays out as a dashboard should."""

from __future__ import annotations

import json
import re

from monitoring.grafana.__main__ import OUTPUT
from monitoring.grafana.dctl_dashboard import DASHBOARD


def test_dctl_json_is_what_the_generator_writes() -> None:
    assert OUTPUT.read_text() == DASHBOARD.to_json(), (
        "monitoring/grafana/dctl.json differs from the code: run python -m monitoring.grafana"
    )


def test_the_rows_are_the_ones_operators_look_for() -> None:
    assert [row.title for row in DASHBOARD.rows] == [
        "Fleet", "GPUs", "Engine", "Diffusion", "Gateway by version", "Rollouts",
    ]  # fmt: skip
    assert all(row.panels for row in DASHBOARD.rows)


def test_panels_have_unique_ids_and_do_not_overlap() -> None:
    panels = DASHBOARD.render()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"])
                for y in range(pos["y"], pos["y"] + pos["h"])}  # fmt: skip
        assert not cells & mine, f"{panel['title']} overlaps another panel"
        cells |= mine


def test_every_query_filters_by_the_dashboard_variables_it_offers() -> None:
    exprs = [t.expr for p in DASHBOARD.panels() for t in p.targets]
    assert all("${" not in e for e in exprs)  # one syntax, so the live test can substitute
    used = {name for e in exprs for name in re.findall(r"\$(\w+)", e)}
    assert used == {v.name for v in DASHBOARD.variables} | {"__rate_interval"}
    json.dumps(DASHBOARD.render())  # serialisable as is
