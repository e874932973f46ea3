"""`dctl deploy`: deployments of a model version onto hosts."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from cli.autoscale_view import replicas_cell, show_fields
from cli.columns import DEPLOYMENT_INSTANCE_COLUMNS
from cli.exits import USAGE, fail
from cli.options import duration_option, engine_config_option, label_option, mapping_file_option
from cli.output import JSON_OPTION, Column, emit, plain, print_json, print_table
from cli.remote import connect, describe, parse_version_ref, validated

if TYPE_CHECKING:
    from protocol.rollout_policy import RolloutPolicy

deploy_app = typer.Typer(help="Deployments: a model version placed on hosts.", no_args_is_help=True)

ENGINE_CONFIG_OPTION = typer.Option(
    None, "--engine-config", help="YAML or JSON file with the engine settings of every instance."
)
GPUS_HELP = (
    "GPUs each instance gets, its own on its host, one rank of the model on each (engine config "
    "parallel.size); 0: all GPUs of the host."
)


def _ready(deployment: Mapping[str, Any]) -> str:
    instances = deployment.get("instances") or []
    ready = sum(1 for i in instances if i.get("observed_state") == "ready")
    return f"{ready}/{len(instances)}"


def _placement(deployment: Mapping[str, Any]) -> str:
    placement = deployment.get("placement") or {}
    parts = list(placement.get("hosts") or [])
    parts += [f"{k}={v}" for k, v in (placement.get("labels") or {}).items()]
    return ", ".join(parts) or "-"


def _canary(deployment: Mapping[str, Any]) -> str:
    version = deployment.get("canary_version")
    return f"{version} at {deployment.get('canary_weight', 0)}%" if version else "-"


def _policy(deployment: Mapping[str, Any]) -> dict[str, Any] | str:
    # Only what the deployment sets: the rest comes from the defaults at each rollout.
    own = {k: v for k, v in (deployment.get("rollout_policy") or {}).items() if v is not None}
    return own or "defaults"


def _ms(key: str) -> Callable[[Mapping[str, Any]], str | None]:
    def read(row: Mapping[str, Any]) -> str | None:
        value = row.get(key)
        return None if value is None else f"{value * 1000:.0f} ms"

    return read


def _percent(row: Mapping[str, Any]) -> str | None:
    rate = row.get("error_rate")
    return None if rate is None else f"{rate * 100:.2f}%"


def _mean(key: str) -> Callable[[Mapping[str, Any]], str | None]:
    return lambda row: None if row.get(key) is None else f"{row[key]:.2f}"


TRAFFIC_COLUMNS: list[Column] = [
    ("version", "version"),
    ("pool", "pool"),
    ("requests", "requests"),
    ("errors", "errors"),
    ("error %", _percent),
    ("client 4xx", "client_4xx"),
    ("p50", _ms("latency_p50_s")),
    ("p95", _ms("latency_p95_s")),
    ("p99", _ms("latency_p99_s")),
    ("ttft p50", _ms("ttft_p50_s")),
    ("ttft p95", _ms("ttft_p95_s")),
    ("tokens out", "output_tokens"),
    ("steps/block", _mean("steps_per_block")),
    ("tokens/fwd", _mean("tokens_per_forward")),
]


DEPLOYMENT_COLUMNS: list[Column] = [
    ("name", "name"),
    ("model", "model"),
    ("version", "version"),
    ("canary", _canary),
    ("placement", _placement),
    # An autoscaled deployment's count is the autoscaler's: instances_per_host does not apply.
    ("per host", lambda d: "-" if d.get("autoscale") else d.get("instances_per_host")),
    ("gpus each", lambda d: d.get("gpus_per_instance") or "all"),
    ("ready", _ready),
    ("autoscale", replicas_cell),
    ("updated", "updated_at"),
]


def read_rollout_policy(path: Path) -> RolloutPolicy:
    """Read a rollout-policy file: a mapping of `RolloutPolicy` fields; an unknown key or a bad
    value is a usage error naming the file and the key."""
    from pydantic import ValidationError

    from protocol.rollout_policy import RolloutPolicy

    data = mapping_file_option(path, "--rollout-policy")
    try:
        return RolloutPolicy.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        if err["type"] == "extra_forbidden":
            known = ", ".join(RolloutPolicy.model_fields)
            key = ".".join(str(p) for p in err["loc"])
            fail(f"--rollout-policy {path}: unknown key {key!r}; the keys are {known}", USAGE)
        fail(f"--rollout-policy {path}: {describe(exc)}", USAGE)


def _split_hosts(hosts: list[str]) -> list[str]:
    # `--hosts a,b --hosts c` and `--hosts a --hosts b` both work.
    return [h.strip() for item in hosts for h in item.split(",") if h.strip()]


@deploy_app.command("create")
def deploy_create(
    name: str,
    model: str = typer.Option(..., "--model", metavar="NAME:VERSION", help="Version to serve."),
    hosts: list[str] = typer.Option([], "--hosts", help="Host names, comma-separated or repeated."),
    labels: list[str] = typer.Option(
        [], "--label", metavar="KEY=VALUE", help="Also every host with all these labels."
    ),
    instances_per_host: int = typer.Option(1, "--instances-per-host", min=0),
    gpus_per_instance: int | None = typer.Option(
        None, "--gpus-per-instance", min=0, help=GPUS_HELP
    ),
    engine_config: Path | None = ENGINE_CONFIG_OPTION,
    as_json: bool = JSON_OPTION,
) -> None:
    """Create deployment NAME serving --model on --hosts (operator)."""
    from protocol.rest import DeploymentCreate, Placement

    serving = parse_version_ref(model, "--model")
    host_names, selector = _split_hosts(hosts), label_option(labels)
    if not host_names and not selector:
        fail("say where to run it: --hosts NAME[,NAME...] and/or --label KEY=VALUE", USAGE)
    config = engine_config_option(engine_config) if engine_config else {}
    spec = validated(
        lambda: DeploymentCreate(
            name=name,
            model=serving.model,
            version=serving.version,
            placement=Placement(hosts=host_names, labels=selector),
            instances_per_host=instances_per_host,
            gpus_per_instance=gpus_per_instance,
            engine_config=config,
        )
    )
    with connect() as api:
        created = plain(api.create_deployment(spec))
    if as_json:
        print_json(created)
        return
    print(f"deployment {name} created: {serving}, {len(created['instances'])} instance(s)")


@deploy_app.command("list")
def deploy_list(as_json: bool = JSON_OPTION) -> None:
    """List deployments."""
    with connect() as api:
        rows = [plain(d) for d in api.list_deployments()]
    emit(rows, as_json=as_json, columns=DEPLOYMENT_COLUMNS, empty="no deployments")


@deploy_app.command("show")
def deploy_show(name: str, as_json: bool = JSON_OPTION) -> None:
    """Show deployment NAME with its instances."""
    from datetime import UTC, datetime

    with connect() as api:
        deployment = api.get_deployment(name)
    found = plain(deployment)
    if as_json:
        print_json(found)
        return
    fields: list[Column] = [
        *DEPLOYMENT_COLUMNS,
        ("created", "created_at"),
        ("engine config", "engine_config"),
        ("rollout policy", _policy),
        *show_fields(deployment, datetime.now(UTC)),
    ]
    emit(found, as_json=False, fields=fields)
    print()
    print_table(found["instances"], DEPLOYMENT_INSTANCE_COLUMNS, empty="no instances")


@deploy_app.command("traffic")
def deploy_traffic(
    name: str,
    since: str = typer.Option(
        "5m", "--since", help="How far back: 30s, 5m, 1h ... up to 24h (default 5m)."
    ),
    as_json: bool = JSON_OPTION,
) -> None:
    """What the gateways served of deployment NAME, per version: requests, errors, latency
    quantiles, TTFT, and the engines' denoising steps per block and tokens per forward."""
    from datetime import UTC, datetime, timedelta

    start = datetime.now(UTC) - timedelta(seconds=duration_option(since, "--since"))
    with connect() as api:
        traffic = plain(api.deployment_traffic(name, since=start))
    if as_json:
        print_json(traffic)
        return
    versions = traffic["versions"]
    for row in versions:
        row["errors"] = row["errors_5xx"] + row["errors_timeout"] + row["errors_connect"]
    print(f"deployment {name}, last {since}, from {traffic['gateways']} gateway(s)")
    print_table(versions, TRAFFIC_COLUMNS, empty="no traffic reported in that range")


@deploy_app.command("scale")
def deploy_scale(
    name: str,
    instances_per_host: int = typer.Argument(..., min=0, help="Instances on each host."),
    as_json: bool = JSON_OPTION,
) -> None:
    """Set the number of instances per host of deployment NAME (operator)."""
    from protocol.rest import DeploymentUpdate

    change = validated(lambda: DeploymentUpdate(instances_per_host=instances_per_host))
    with connect() as api:
        updated = plain(api.update_deployment(name, change))
    if as_json:
        print_json(updated)
        return
    print(f"deployment {name}: {instances_per_host} per host, {len(updated['instances'])} total")


@deploy_app.command("configure")
def deploy_configure(
    name: str,
    engine_config: Path | None = ENGINE_CONFIG_OPTION,
    gpus_per_instance: int | None = typer.Option(
        None, "--gpus-per-instance", min=0, help=GPUS_HELP
    ),
    rollout_policy: Path | None = typer.Option(
        None,
        "--rollout-policy",
        help="YAML or JSON file: the deployment's rollout thresholds (replaces the old ones).",
    ),
    as_json: bool = JSON_OPTION,
) -> None:
    """Replace the engine config, GPUs per instance and/or rollout policy of deployment NAME
    (operator).

    Its instances restart with a new engine config or GPU count.
    """
    from protocol.rest import DeploymentUpdate

    if engine_config is None and gpus_per_instance is None and rollout_policy is None:
        fail(
            "say what to change: --engine-config FILE, --gpus-per-instance N "
            "and/or --rollout-policy FILE",
            USAGE,
        )
    config = engine_config_option(engine_config) if engine_config is not None else None
    policy = read_rollout_policy(rollout_policy) if rollout_policy is not None else None
    change = validated(
        lambda: DeploymentUpdate(
            engine_config=config, gpus_per_instance=gpus_per_instance, rollout_policy=policy
        )
    )
    with connect() as api:
        updated = plain(api.update_deployment(name, change))
    if as_json:
        print_json(updated)
        return
    changed = []
    if config is not None:
        changed.append("engine config updated")
    if gpus_per_instance is not None:
        changed.append(f"{gpus_per_instance or 'all'} GPU(s) per instance")
    if policy is not None:
        changed.append("rollout policy updated")
    print(f"deployment {name}: {', '.join(changed)}")


@deploy_app.command("delete")
def deploy_delete(
    name: str,
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
) -> None:
    """Delete deployment NAME; its agents stop its instances (operator)."""
    if not yes and not typer.confirm(f"delete deployment {name}?", default=False, err=True):
        fail("not deleted")
    with connect() as api:
        api.delete_deployment(name)
    print(f"deployment {name} deleted")


def register(app: typer.Typer) -> None:
    """Attach these commands to the root app."""
    app.add_typer(deploy_app, name="deploy")
