"""`dctl metrics targets`: the fleet's live scrape targets, for a Prometheus to read;
`dctl metrics config`: the Prometheus config, alert rules, Grafana dashboard and log shippers'
configs (Vector, Promtail) dctl ships.

`--format file_sd` (the default) prints the JSON of a `file_sd_configs` file; `--format static`
a `scrape_configs:` YAML snippet with one job per role and scheme. With `-o FILE` the text is
written atomically (a temporary file in FILE's directory, then renamed over it, mode 0644), so
Prometheus never reads half a file; `--watch` keeps polling and rewrites FILE only when the
fleet's targets changed, until interrupted.

`dctl metrics config -o DIR` writes the files of the `monitoring` package (read as package data,
so an installed wheel has them) into DIR, created if missing, each 0644. A file there that
differs from the packaged one (an operator's edit) is kept unless `--force`; then nothing is
written at all.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from cli.exits import USAGE, fail
from cli.remote import connect

if TYPE_CHECKING:
    from client.http import ControlPlaneClient
    from protocol.monitoring import ScrapeTargetGroup

    Render = Callable[[Sequence[ScrapeTargetGroup]], str]

metrics_app = typer.Typer(
    help="Prometheus and Grafana: the fleet's scrape targets, the config and dashboard to load.",
    no_args_is_help=True,
)

FORMATS = ("file_sd", "static")
FILE_MODE = 0o644
# Labels Prometheus reads as scrape settings: a static job says them as `scheme`/`metrics_path`.
_SCRAPE_SETTINGS = ("__scheme__", "__metrics_path__")


def render_file_sd(groups: Sequence[ScrapeTargetGroup]) -> str:
    """The JSON of a Prometheus `file_sd` file (a list of {targets, labels} groups)."""
    return json.dumps([g.model_dump(mode="json") for g in groups], indent=2) + "\n"


def render_static(groups: Sequence[ScrapeTargetGroup]) -> str:
    """A `scrape_configs:` YAML snippet: one job per (role, scheme, metrics path), named
    `dctl-ROLE` (with `-SCHEME` or the path appended when a role needs several jobs)."""
    import yaml

    jobs: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for group in groups:
        labels = dict(group.labels)
        scheme = labels.pop("__scheme__", "http")
        path = labels.pop("__metrics_path__", "/metrics")
        key = (labels.get("role", "target"), scheme, path)
        jobs.setdefault(key, []).append({"targets": list(group.targets), "labels": labels})
    roles = [role for role, _, _ in jobs]
    configs = []
    for (role, scheme, path), static in jobs.items():
        name = f"dctl-{role}"
        if roles.count(role) > 1:
            name += f"-{scheme}" + ("" if path == "/metrics" else path.replace("/", "-"))
        configs.append(
            {"job_name": name, "scheme": scheme, "metrics_path": path, "static_configs": static}
        )
    return yaml.safe_dump({"scrape_configs": configs}, sort_keys=False)


def write_atomically(path: Path, content: str | bytes) -> None:
    """Replace PATH with CONTENT (text as UTF-8) in one rename (a reader sees the old file or the
    new one), mode 0644."""
    data = content.encode() if isinstance(content, str) else content
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temp, FILE_MODE)  # mkstemp's 0600 would keep Prometheus out
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def _current(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def targets(
    fmt: str = typer.Option(
        "file_sd", "--format", help="file_sd (JSON for file_sd_configs) or static (YAML)."
    ),
    output: Path | None = typer.Option(
        None, "--output", "-o", help="Write FILE atomically (mode 0644) instead of printing."
    ),
    watch: bool = typer.Option(
        False, "--watch", help="Keep polling; rewrite FILE when the targets change (needs -o)."
    ),
    interval: str = typer.Option("5s", "--interval", help="Time between polls with --watch."),
) -> None:
    """Every live scrape target of the fleet: control plane, agents, ready engines, gateways."""
    from cli.options import duration_option

    if fmt not in FORMATS:
        fail(f"--format {fmt!r}: use one of {', '.join(FORMATS)}", USAGE)
    interval_s = duration_option(interval, "--interval")
    if watch and output is None:
        fail("--watch rewrites a file: give it with -o FILE", USAGE)
    if output is not None and not output.parent.is_dir():
        fail(f"-o {output}: directory {output.parent} does not exist", USAGE)
    render = render_file_sd if fmt == "file_sd" else render_static
    with connect() as api:
        text = render(api.metrics_targets())
        if output is None:
            sys.stdout.write(text)
            return
        _write(output, text)
        if watch:
            _watch(api, output, render, text, interval_s)


def _write(output: Path, text: str) -> None:
    if _current(output) == text.encode():
        return  # unchanged: leave the file (and its mtime) alone
    try:
        write_atomically(output, text)
    except OSError as exc:
        fail(f"-o {output}: {exc.strerror or exc}")
    print(f"wrote {output}", file=sys.stderr)


def _watch(
    api: ControlPlaneClient, output: Path, render: Render, text: str, interval_s: int
) -> None:
    """Poll every INTERVAL_S until Ctrl-C / SIGTERM; a failed poll is reported and retried."""
    from client.errors import ClientError

    def stop(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    # Explicitly too: a process started in the background by a non-interactive shell inherits
    # SIGINT ignored, and Python then installs no KeyboardInterrupt handler of its own.
    signal.signal(signal.SIGINT, stop)
    last, failing = text, False
    try:
        while True:
            time.sleep(interval_s)
            try:
                text = render(api.metrics_targets())
            except ClientError as exc:
                if not failing:
                    print(f"warning: {exc}; keeping {output} as it is", file=sys.stderr)
                failing = True
                continue
            failing = False
            if text != last:
                _write(output, text)
                last = text
    except KeyboardInterrupt:
        return


def config(
    output: Path = typer.Option(
        ..., "--output", "-o", help="Directory to write into (created if missing)."
    ),
    force: bool = typer.Option(
        False, "--force", help="Overwrite files there that differ from the packaged ones."
    ),
) -> None:
    """Write the Prometheus config, alert rules, Grafana dashboard and Vector/Promtail configs
    (logs to Loki) that ship with dctl."""
    import monitoring

    if output.exists() and not output.is_dir():
        fail(f"-o {output}: not a directory", USAGE)
    files = {output / name: monitoring.artefact(name) for name in monitoring.ARTEFACTS}
    # Every refusal before any write, so a refused run leaves the directory as it was.
    edited = [path for path, content in files.items() if _differs(path, content)]
    if edited and not force:
        names = ", ".join(str(path) for path in edited)
        fail(f"{names}: not what dctl ships (edited?); keep it, or overwrite with --force", USAGE)
    try:
        output.mkdir(parents=True, exist_ok=True)
        for path, content in files.items():
            if _current(path) != content:
                write_atomically(path, content)
                print(f"wrote {path}", file=sys.stderr)
    except OSError as exc:
        fail(f"-o {output}: {exc}")
    dashboard = output / "grafana-dashboard.json"
    print(
        f"next: dctl metrics targets -o {output / 'targets.json'} --watch &\n"
        f"      prometheus --config.file={output / 'prometheus.yml'}\n"
        f"      Grafana: Dashboards -> Import -> {dashboard}\n"
        f"      logs to Loki (edit paths and URL first): vector --config {output / 'vector.toml'}"
        f" or promtail -config.file={output / 'promtail.yml'}"
    )


def _differs(path: Path, content: bytes) -> bool:
    """Whether PATH holds something other than CONTENT: missing is not different."""
    return path.exists() and _current(path) != content


def register(app: typer.Typer) -> None:
    """Attach `dctl metrics` to the root app."""
    metrics_app.command("targets")(targets)
    metrics_app.command("config")(config)
    app.add_typer(metrics_app, name="metrics")
