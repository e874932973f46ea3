"""Where each provisioned host was reached: what `dctl host deprovision NAME` connects to.

One JSON file beside the credentials (`~/.config/dctl/provisioned.json`, 0600), keyed by the
control plane's URL and the host's name, so two control planes may each have a host `gpu-01`.
It holds no secret: the SSH target, the prefix, sudo, and the key and known-hosts paths.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from runtime import paths


@dataclass(frozen=True)
class ProvisionedHost:
    """How a host was provisioned, as deprovisioning needs it."""

    name: str
    target: str  # USER@HOST[:PORT]
    prefix: str
    sudo: bool
    key_file: str | None = None
    known_hosts: str | None = None


class Registry:
    """The remembered hosts of every control plane (a small JSON file, written atomically)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or paths.config_dir() / "provisioned.json"

    def _load(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise ValueError(f"{self.path}: unreadable ({exc}); fix or remove it") from None
        return data if isinstance(data, dict) else {}

    def get(self, control_plane: str, name: str) -> ProvisionedHost | None:
        """The host NAME provisioned for CONTROL_PLANE, or None."""
        entry = self._load().get(control_plane, {}).get(name)
        return ProvisionedHost(**entry) if isinstance(entry, dict) else None

    def put(self, control_plane: str, host: ProvisionedHost) -> None:
        """Remember HOST (replacing an older entry of the same name)."""
        data = self._load()
        data.setdefault(control_plane, {})[host.name] = asdict(host)
        self._write(data)

    def forget(self, control_plane: str, name: str) -> None:
        """Forget NAME; nothing happens when it is not remembered."""
        data = self._load()
        if data.get(control_plane, {}).pop(name, None) is not None:
            self._write(data)

    def _write(self, data: dict[str, dict[str, Any]]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".provisioned-")
        try:
            with os.fdopen(fd, "w") as out:
                json.dump(data, out, indent=2, sort_keys=True)
            os.chmod(tmp, 0o600)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
