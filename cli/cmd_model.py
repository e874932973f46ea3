"""`dctl model`: register, list and inspect model versions (immutable weight snapshots)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import typer

from cli.exits import USAGE, fail
from cli.output import (
    JSON_OPTION,
    Column,
    emit,
    human_bytes,
    plain,
    print_json,
    print_table,
)
from cli.remote import connect, parse_version_ref
from protocol.vocabulary import VersionLine

if TYPE_CHECKING:
    from protocol.wire import MemoryPlan

# The checkpoint layouts `create-demo` can write.
DemoFamily = Literal["sdar", "diffusion-gemma"]

model_app = typer.Typer(
    help="Model versions: weight snapshots with sha256 manifests.", no_args_is_help=True
)


VERSION_COLUMNS: list[Column] = [
    ("model", "model"),
    ("version", "version"),
    ("line", "line"),
    ("parent", "parent"),
    ("digest", lambda v: str(v["digest"])[:12]),
    ("files", "file_count"),
    ("size", lambda v: human_bytes(v["total_bytes"])),
    ("deprecated", "deprecated"),
    ("created", "created_at"),
]
FILE_COLUMNS: list[Column] = [
    ("path", "path"),
    ("size", lambda f: human_bytes(f["size"])),
    ("sha256", "sha256"),
]


@model_app.command("list")
def model_list(as_json: bool = JSON_OPTION) -> None:
    """List models and their versions."""
    with connect() as api:
        models = [plain(m) for m in api.list_models()]
    if as_json:
        print_json(models)
        return
    rows = [version for model in models for version in model["versions"]]
    print_table(rows, VERSION_COLUMNS, empty="no models registered")


@model_app.command("register")
def model_register(
    name_version: str = typer.Argument(..., metavar="NAME:VERSION"),
    directory: Path = typer.Argument(
        ..., help="Checkpoint directory (config.json, *.safetensors)."
    ),
    line: VersionLine = typer.Option(
        "base", "--line", help="Base model, its block-diffusion conversion, or a fine-tune."
    ),
    parent: str | None = typer.Option(
        None, "--parent", metavar="NAME:VERSION", help="The version this one derives from."
    ),
    notes: str = typer.Option("", "--notes", help="Free text kept with the version."),
    as_json: bool = JSON_OPTION,
) -> None:
    """Register NAME:VERSION from a checkpoint DIRECTORY: sha256 manifest plus memory plan."""
    from protocol.manifest import ManifestError, compute_manifest
    from protocol.version_ref import VersionRef

    ref = parse_version_ref(name_version)
    if parent is not None:
        parse_version_ref(parent, "--parent")

    def progress(path: str, size: int) -> None:
        # Hashing a large checkpoint takes minutes: show a person at a terminal that it moves.
        print(f"  sha256 {path} ({human_bytes(size)})", file=sys.stderr, flush=True)

    try:
        manifest = compute_manifest(directory, progress if sys.stderr.isatty() else None)
    except ManifestError as exc:
        fail(str(exc))
    plan, plan_note = memory_plan(directory)
    source = str(directory.resolve())
    with connect(timeout=60.0) as api:
        registered = api.register_version(
            ref.model,
            ref.version,
            manifest,
            source_uri=source,
            line=line,
            parent=parent,
            memory_plan=plan,
            notes=notes,
        )
    if as_json:
        print_json(plain(registered))
        return
    print(
        f"registered {VersionRef(registered.model, registered.version)} ({registered.line}): "
        f"digest {registered.digest[:12]}, {registered.file_count} files, "
        f"{human_bytes(registered.total_bytes)}"
    )
    print(plan_note)


# Activations are sized for one sequence of this many tokens (the engine's default max_seq_len);
# the KV cache per token is stored separately, so a host check can use any context length.
PLAN_SEQ_TOKENS = 4096


def memory_plan(directory: Path) -> tuple[MemoryPlan | None, str]:
    """The memory plan of a checkpoint, or None and why not; torch-free engine code only."""
    from protocol.wire import MemoryPlan

    try:
        from engine.errors import CheckpointError
        from engine.families.registry import size_checkpoint
    except ImportError:
        return None, "memory plan: not stored (the engine is not part of this dctl install)"
    try:
        sizing = size_checkpoint(directory, max_batch=1, max_seq=PLAN_SEQ_TOKENS)
    except (OSError, ValueError, CheckpointError) as exc:
        # Registering weights the engine cannot size is allowed (e.g. a future family); the
        # version is just not checked against host memory.
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return None, f"memory plan: not stored ({reason})"
    dtype, plan = sizing.dtype, sizing.plan
    seq = min(sizing.max_context_tokens, PLAN_SEQ_TOKENS)
    stored = MemoryPlan(
        weights_bytes=plan.weights_bytes,
        kv_bytes_per_token=plan.kv_bytes_per_token,
        activation_bytes=plan.activation_bytes,
        dtype=dtype,
        family=sizing.family,
        max_context_tokens=sizing.max_context_tokens,
        num_parameters=sizing.num_parameters,
        num_heads=sizing.num_heads,
        num_kv_heads=list(sizing.num_kv_heads),
        num_experts=sizing.num_experts,
        vocab_size=sizing.vocab_size,
    )
    note = (
        f"memory plan ({dtype}): weights {human_bytes(stored.weights_bytes)}, "
        f"KV {human_bytes(stored.kv_bytes_per_token)}/token, "
        f"activations {human_bytes(stored.activation_bytes)} at {seq} tokens"
    )
    return stored, note


@model_app.command("show")
def model_show(
    ref: str = typer.Argument(..., metavar="NAME[:VERSION]"),
    as_json: bool = JSON_OPTION,
) -> None:
    """Show a model with its versions, or one version with its manifest and memory plan."""
    if ":" not in ref:
        with connect() as api:
            model = plain(api.get_model(ref))
        if as_json:
            print_json(model)
        else:
            print_table(model["versions"], VERSION_COLUMNS, empty=f"{ref} has no versions")
        return
    named = parse_version_ref(ref)
    with connect() as api:
        found = plain(api.get_version(named.model, named.version))
    if as_json:
        print_json(found)
        return
    plan = found.get("memory_plan") or {}
    fields: list[Column] = [
        ("model", "model"),
        ("version", "version"),
        ("line", "line"),
        ("parent", "parent"),
        ("digest", "digest"),
        ("size", lambda v: human_bytes(v["total_bytes"])),
        ("source", "source_uri"),
        ("deprecated", "deprecated"),
        ("created", "created_at"),
        ("notes", "notes"),
        ("family", lambda v: plan.get("family") or "not stored"),
        ("weights", lambda v: human_bytes(plan["weights_bytes"]) if plan else "not stored"),
        ("kv/token", lambda v: human_bytes(plan["kv_bytes_per_token"]) if plan else "not stored"),
    ]
    emit(found, as_json=False, fields=fields)
    print()
    print_table((found.get("manifest") or {}).get("files") or [], FILE_COLUMNS)


@model_app.command("deprecate")
def model_deprecate(ref: str = typer.Argument(..., metavar="NAME:VERSION")) -> None:
    """Deprecate NAME:VERSION: kept for running deployments, refused for new ones."""
    named = parse_version_ref(ref)
    with connect() as api:
        api.deprecate_version(named.model, named.version)
    print(f"{named} deprecated")


@model_app.command("create-demo")
def model_create_demo(
    directory: str = typer.Argument(..., help="New (or empty) directory to write."),
    seed: int = typer.Option(
        0,
        "--seed",
        help="Trained model: recorded in generation_config.json, so each seed is its own "
        "snapshot digest with the same weights. --random: the seed of the weights.",
    ),
    random_weights: bool = typer.Option(
        False, "--random", help="Random weights instead of the trained model (fast, for tests)."
    ),
    size: str | None = typer.Option(
        None, "--size", help="With --random: tiny (tests, the default) or small."
    ),
    family: DemoFamily = typer.Option(
        "sdar",
        "--family",
        help="sdar: the SDAR-MoE layout; diffusion-gemma: a tiny DiffusionGemma (needs --random).",
    ),
) -> None:
    """Write a demo checkpoint into DIRECTORY: the small trained model (default) or, with
    --random, a deterministic random-weight one."""
    if family == "diffusion-gemma":
        _write_diffusion_gemma_demo(directory, seed=seed, random_weights=random_weights, size=size)
        return
    if not random_weights:
        if size is not None:
            fail("--size applies to random checkpoints only: add --random", USAGE)
        from engine.errors import CheckpointError
        from engine.trained_demo import install_trained_demo

        try:
            path = install_trained_demo(directory, seed=seed)
        except (ValueError, CheckpointError) as exc:
            fail(str(exc))
        print(f"trained demo model (seed {seed}) written to {path}")
        return
    from engine.demo_checkpoint import create_demo_checkpoint

    size = size or "tiny"
    try:
        path = create_demo_checkpoint(directory, seed=seed, size=size)
    except ValueError as exc:
        fail(str(exc))
    print(f"demo checkpoint ({size}, random weights, seed {seed}) written to {path}")


def _write_diffusion_gemma_demo(
    directory: str, *, seed: int, random_weights: bool, size: str | None
) -> None:
    """`create-demo --family diffusion-gemma`: the tiny random DiffusionGemma checkpoint."""
    if not random_weights:
        fail("--family diffusion-gemma has no trained demo model yet: add --random", USAGE)
    if size not in (None, "tiny"):
        fail("--family diffusion-gemma comes in --size tiny only", USAGE)
    from engine.families.diffusion_gemma.demo import create_diffusion_gemma_demo as create

    try:
        path = create(directory, seed=seed)
    except ValueError as exc:
        fail(str(exc))
    print(f"DiffusionGemma demo checkpoint (tiny, random weights, seed {seed}) written to {path}")


def register(app: typer.Typer) -> None:
    """Attach these commands to the root app."""
    app.add_typer(model_app, name="model")
