"""The shape of every dctl bearer token, `dctl_<key id>_<random>`, and how it is stored.

The control plane mints and checks them (`controlplane.auth`); the gateway checks client tokens
against the hashes in its routing table. Both read a token with these, so they cannot disagree
on what a token looks like. Secrets are random, so SHA-256 is enough (no slow password hash).
"""

from __future__ import annotations

import hashlib
import re

TOKEN_PREFIX = "dctl"
_TOKEN_RE = re.compile(r"dctl_([a-z0-9]{12})_[A-Za-z0-9_\-]{20,128}")


def key_id_of(secret: str) -> str | None:
    """The key id of a well-formed token, or None for anything else."""
    match = _TOKEN_RE.fullmatch(secret)
    return match.group(1) if match else None


def hash_secret(secret: str) -> str:
    """SHA-256 hex of a token's whole secret: what the store keeps and the gateway compares."""
    return hashlib.sha256(secret.encode()).hexdigest()
