"""What `dctl up --demo` prints once the demo is up: its endpoints and what to try."""

from __future__ import annotations

from cli.demo.stack import (
    CANARY_INSTANCES,
    DEPLOYMENT,
    MODEL,
    ROLLOUT_INTERVAL_S,
    ROLLOUT_MIN_REQUESTS,
    DemoEndpoints,
)


def demo_summary(endpoints: DemoEndpoints, size: str | None, traffic_rps: float) -> str:
    """What `dctl up --demo` prints once the demo is up: endpoints and what to try."""
    lines = [
        "",
        "dctl demo is up.",
        f"Control plane: {endpoints.control_plane}",
        f"OpenAI base URL: {endpoints.base_url}",
        f"OpenAI API key: {endpoints.api_key}",
        f"Engine, bypassing the gateway: {endpoints.engine_url} (API key {endpoints.engine_key})",
    ]
    if endpoints.context:
        note = f"Credentials: context {endpoints.context!r} in the credentials file"
        if not endpoints.context_is_current:
            note += f" (`dctl context use {endpoints.context}` makes it current)"
        lines.append(note)
    can_canary = endpoints.instances >= CANARY_INSTANCES
    if can_canary:
        lines.append(
            f"Deployment {DEPLOYMENT!r}: {endpoints.instances} instances, one GPU each; its "
            f"rollout policy holds each step {ROLLOUT_INTERVAL_S:g} s and wants at least "
            f"{ROLLOUT_MIN_REQUESTS} requests per pool"
        )
    else:
        lines.append(
            f"Deployment {DEPLOYMENT!r}: one instance (one GPU here): no room for a canary"
        )
    if traffic_rps > 0:
        lines.append(
            f"Demo traffic: {traffic_rps:g} requests/s through the gateway "
            "(--traffic-rps 0 turns it off)"
        )
    else:
        lines.append("Demo traffic: off (a rollout is analysed only on the requests it gets)")
    sample = (
        f"curl {endpoints.base_url}/chat/completions -H 'Content-Type: application/json' "
        f"-H 'Authorization: Bearer {endpoints.api_key}' "
        f"""-d '{{"model": "{DEPLOYMENT}", "messages": [{{"role": "user", "content": """
        """"Hello!"}], "max_tokens": 32}'"""
    )
    lines += ["Try:", f"  {sample}", *(rollout_lines(size) if can_canary else [])]
    lines += [
        "  dctl status",
        "  dctl tui",
        f"  dctl doctor {DEPLOYMENT}",
        "  dctl metrics targets -o targets.json --watch   # for Prometheus",
        "Ctrl-C stops everything.",
    ]
    return "\n".join(lines)


def rollout_lines(size: str | None) -> list[str]:
    """The `Try:` lines that make `demo:v2` (a checkpoint of its own digest) and roll it out."""
    # On the trained model --seed changes only generation_config.json: same weights, own digest.
    # A random checkpoint has no trained weights to keep (--seed picks other random ones).
    create = "dctl model create-demo ./demo-v2"
    if size is not None:
        create += f" --random --size {size}"
    create += " --seed 2"
    minutes = 3 * ROLLOUT_INTERVAL_S / 60  # steps 10, 50 and the promotion to 100
    return [
        f"  {create} && dctl model register {MODEL}:v2 ./demo-v2",
        f"  dctl rollout {DEPLOYMENT} --to {MODEL}:v2 --canary 10% --wait"
        f"      # ~{minutes:g} min: 10% -> 50% -> 100%",
        f"  dctl rollout status {DEPLOYMENT} --watch",
        f"  dctl rollback {DEPLOYMENT}",
    ]
