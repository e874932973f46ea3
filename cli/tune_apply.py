"""`dctl tune --deployment NAME --apply`: canary the recommended decoding settings.

A tuning change is rolled out like a new version: the recommended `model:` keys are merged into
the deployment's current engine config (every other key kept), and a config-only rollout starts
at a 10% canary under the deployment's rollout policy, so the analysis compares the new settings
with the old ones on live traffic and aborts them if they do worse.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cli.exits import fail
from cli.remote import connect

if TYPE_CHECKING:
    from protocol.rest import DeploymentOut
    from protocol.rollouts import RolloutOut

APPLY_CANARY = 10
APPLIED_CONFIG = "applied-engine-config.yaml"
_FILE_MODE = 0o644


def merged_engine_config(current: dict[str, Any], keys: dict[str, Any]) -> dict[str, Any]:
    """CURRENT with the `model:` decoding KEYS laid over it; nothing else changes.

    A threshold-mode recommendation drops a `model.steps` the deployment had: `steps` makes
    steps mode the default, and the recommendation would otherwise never take effect.
    """
    merged = copy.deepcopy(current)
    model = dict(merged.get("model") or {})
    if "steps" not in keys:
        model.pop("steps", None)
    model.update(keys)
    merged["model"] = model
    return merged


def check_deployment(name: str) -> DeploymentOut:
    """The deployment, checked before a sweep of minutes: a wrong name, bad credentials or an
    active rollout (which would refuse ours) fail now rather than after it."""
    from client.errors import ClientError
    from protocol.rollout_states import ACTIVE_STATES

    with connect() as api:
        deployment = api.get_deployment(name)
        try:
            rollout = api.get_rollout(name)
        except ClientError as exc:
            if exc.status != 404:  # 404: it never had one
                raise
        else:
            if rollout.state in ACTIVE_STATES:
                fail(
                    f"deployment {name} has an active {rollout.kind} ({rollout.id}, "
                    f"{rollout.state}): --apply would be refused; wait for it, or "
                    f"`dctl rollout abort {name}`"
                )
    return deployment


def apply_recommendation(
    name: str, keys: dict[str, Any], label: str, criterion: str, out_dir: Path
) -> RolloutOut | None:
    """Merge KEYS into NAME's engine config (re-read now), record the whole config in OUT_DIR
    and start a config-only canary rollout; None when the deployment already decodes so. A
    refused start (say, a rollout already active) exits 1 with the API's message."""
    import yaml

    from cli.remote import validated
    from protocol.rollouts import RolloutCreate

    with connect() as api:
        current = api.get_deployment(name)
        config = merged_engine_config(current.engine_config, keys)
        if config == current.engine_config:
            return None
        path = out_dir / APPLIED_CONFIG
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _FILE_MODE)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(f"# dctl tune --apply: {name}'s engine config with {label}\n")
            out.write(yaml.safe_dump(config, sort_keys=False))
        spec = validated(
            lambda: RolloutCreate(
                engine_config=config,
                canary=APPLY_CANARY,
                reason=f"dctl tune: {label} ({criterion})",
            )
        )
        return api.start_rollout(name, spec)
