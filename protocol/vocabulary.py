"""Closed sets of words the API uses: token roles and version lines.

Standard library only, so the CLI can offer them as choices when it builds its options (which
`dctl --help` does) without paying for pydantic; `protocol.rest` and `protocol.wire` use them in
their schemas, the control plane in its authorization.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal


class Role(StrEnum):
    """What a token may do. viewer < operator < admin; the other roles stand apart."""

    VIEWER = "viewer"
    OPERATOR = "operator"
    ADMIN = "admin"
    BOOTSTRAP = "bootstrap"  # may only register agents
    AGENT = "agent"  # one host's heartbeats and the model files it serves
    GATEWAY = "gateway"  # reads routes (instance API keys, client token hashes), posts traffic
    CLIENT = "client"  # calls the gateway's OpenAI API; nothing of the control plane's


# Roles `POST /api/v1/tokens` hands out: agent tokens come only from agent registration, bound to
# their host. Spelled out (not derived from `Role`) because a Literal must be, for mypy and for
# the OpenAPI schema; tests/cli/test_options.py holds it to `Role`.
CreatableRole = Literal["viewer", "operator", "admin", "bootstrap", "gateway", "client"]

# The line a model version belongs to: a base model, its block-diffusion conversion, a fine-tune.
VersionLine = Literal["base", "diffusion", "finetune"]


# `dctl rollout DEPLOYMENT` shares its first argument with these subcommands, so a deployment
# may not be named like one of them (`dctl rollout status` must never mean a deployment).
ROLLOUT_SUBCOMMANDS = ("start", "status", "promote", "abort", "pause", "resume", "history")
