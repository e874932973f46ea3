"""`autoscale.limits`: an autoscaled deployment pinned at its max or starved of GPUs, stated with
the autoscaler's status (a snapshot in, findings out)."""

from __future__ import annotations

from datetime import timedelta

from cli.cmd_doctor import render
from doctor import diagnose, has_error
from doctor.findings import Finding, FleetSnapshot
from protocol.autoscale import AutoscalePolicy
from protocol.rest import Placement
from tests.doctor.builders import T0, autoscaled, deployment, fleet, instance


def limits(snap: FleetSnapshot) -> list[Finding]:
    return [f for f in diagnose(snap) if f.rule == "autoscale.limits"]


def test_pinned_at_max_is_a_warning_naming_the_deployment_since_when_and_the_fix() -> None:
    web = autoscaled(
        instance(1), instance(2), policy=AutoscalePolicy(min=1, max=2),
        pinned_at_max_since=T0 - timedelta(minutes=12), queue_per_instance=9.5, utilization=1.0,
    )  # fmt: skip
    (found,) = limits(fleet(web))
    assert (found.severity, found.subject) == ("warning", "deployment/web")
    assert found.summary.startswith("autoscaler pinned at max 2 since 2026-01-01 11:48:00Z")
    assert "dctl deploy autoscale web --max N" in found.fix and "add GPUs" in found.fix
    assert found.evidence == {
        "max": 2, "pinned_at_max_since": "2026-01-01 11:48:00Z", "replicas": 2,
        "serving_ready": 2, "queue_per_instance": 9.5, "utilization": 1.0,
    }  # fmt: skip
    printed = render(limits(fleet(web)))
    assert printed.startswith("WARNING deployment/web: autoscaler pinned at max 2 since")
    assert printed.splitlines()[0].endswith("[autoscale.limits]")


def test_starved_names_the_reason_and_what_frees_gpus() -> None:
    reason = "no host of the placement has 1 free GPU"
    web = autoscaled(
        instance(1), instance(2), replicas=3, placed=2,
        starved_since=T0 - timedelta(minutes=4), starved_reason=reason,
    )  # fmt: skip
    (found,) = limits(fleet(web))
    assert found.severity == "warning"  # 2 ready, over its min of 1
    assert found.summary == (
        f"autoscaler starved since 2026-01-01 11:56:00Z: 2 of 3 instance(s) placed ({reason})"
    )
    assert found.evidence["reason"] == reason and found.evidence["wanted"] == 3
    assert found.fix.startswith("free GPUs on its placement's hosts")
    assert "add hosts to its placement (now gpu-1)" in found.fix
    # Placed by label: the fix says which labels bring a host in.
    by_label = web.model_copy(update={"placement": Placement(labels={"pool": "chat"})})
    (labelled,) = limits(fleet(by_label))
    assert "`dctl host label HOST pool=chat`" in labelled.fix


def test_starved_below_its_min_is_an_error() -> None:
    web = autoscaled(
        instance(1, observed_state="starting"), policy=AutoscalePolicy(min=2, max=4),
        replicas=2, serving_ready=0, placed=1, starved_since=T0, starved_reason="no free GPU",
    )  # fmt: skip
    (found,) = limits(fleet(web))
    assert found.severity == "error" and has_error(limits(fleet(web)))
    assert found.summary.endswith("(no free GPU); 0 serving ready, under its min 2")


def test_pinned_and_starved_together_say_both() -> None:
    web = autoscaled(instance(1), pinned_at_max_since=T0, starved_since=T0, standby=1)
    assert [f.summary.split(" since")[0] for f in limits(fleet(web))] == [
        "autoscaler starved",
        "autoscaler pinned at max 8",
    ]


def test_silent_for_a_fine_autoscaler_one_not_reported_yet_and_a_fixed_count() -> None:
    fine = autoscaled(instance(1), instance(2, standby=True), standby=1, standby_ready=1)
    assert limits(fleet(fine)) == []
    unreported = fine.model_copy(update={"autoscale_status": None})
    assert limits(fleet(unreported)) == []
    assert limits(fleet(deployment(instance(1)))) == []
