"""Models and their versions: register (immutable, idempotent), look up, deprecate, serve files."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path, PurePosixPath

from sqlmodel import Session, col, select

from controlplane.eventlog import record_event
from controlplane.heartbeat.desired_state import keep_version_ids
from controlplane.models import Instance, Model, ModelVersion
from controlplane.services.errors import Conflict, Forbidden, Invalid, NotFound, NotLocal
from protocol.rest import RegisterVersionRequest
from protocol.sources import SourceUriError, check_source_uri, local_source_dir
from protocol.version_ref import VersionRef
from protocol.wire import ManifestEntry
from runtime.model_roots import locate_in_roots


def list_models(session: Session) -> list[Model]:
    """Every model, by name."""
    return list(session.exec(select(Model).order_by(col(Model.name))).all())


def get_model(session: Session, name: str) -> Model:
    """The model called `name`, or NotFound."""
    model = session.exec(select(Model).where(Model.name == name)).first()
    if model is None:
        raise NotFound(f"model {name!r}")
    return model


def find_version(session: Session, name: str, version: str) -> tuple[Model, ModelVersion] | None:
    """The model `name` and its version `version`, or None (one query)."""
    row = session.exec(
        select(Model, ModelVersion)
        .join(ModelVersion, col(ModelVersion.model_id) == col(Model.id))
        .where(Model.name == name, ModelVersion.version == version)
    ).first()
    return (row[0], row[1]) if row else None


def get_version(session: Session, name: str, version: str) -> tuple[Model, ModelVersion]:
    """The model `name` and its version `version`, or NotFound."""
    found = find_version(session, name, version)
    if found is None:
        raise NotFound(f"model version {VersionRef(name, version)}")
    return found


def register_version(
    session: Session,
    now: datetime,
    actor: str,
    name: str,
    request: RegisterVersionRequest,
    model_roots: Sequence[Path] = (),
) -> tuple[Model, ModelVersion, bool]:
    """Register a version; returns it and whether it is new.

    The same manifest again is a no-op; a different manifest under a registered tag is a
    Conflict: versions are immutable. With MODEL_ROOTS, a local source outside them is
    Forbidden.
    """
    digest = request.manifest.digest()
    if request.digest is not None and request.digest != digest:
        raise Invalid(
            f"digest {request.digest} does not match the manifest's digest {digest}: "
            "recompute the manifest"
        )
    try:
        check_source_uri(request.source_uri)
    except SourceUriError as exc:
        raise Invalid(str(exc)) from exc
    source = local_source_dir(request.source_uri)
    if source is not None and model_roots and locate_in_roots(source, model_roots) is None:
        raise Forbidden(
            f"source {request.source_uri!r} is outside the directories this control plane "
            "serves models from (setting [controlplane] model_roots, env DCTL_MODEL_ROOTS): "
            "move the checkpoint under one of them, or have an admin add its directory"
        )
    existing = find_version(session, name, request.version)
    if existing is not None:
        model, row = existing
        if row.digest != digest:
            raise Conflict(
                f"{VersionRef(name, request.version)} is already registered with a different "
                f"manifest (digest {row.digest}); versions are immutable: register a new version"
            )
        return model, row, False
    parent_id = None
    if request.parent is not None:
        parent_ref = VersionRef.parse(request.parent)
        parent = find_version(session, parent_ref.model, parent_ref.version)
        if parent is None:
            raise Invalid(f"parent {request.parent} is not registered: register it first")
        parent_id = parent[1].id
    model_row = session.exec(select(Model).where(Model.name == name)).first()
    if model_row is None:
        model_row = Model(name=name, created_at=now)
        session.add(model_row)
        session.flush()
    assert model_row.id is not None
    row = ModelVersion(
        model_id=model_row.id,
        version=request.version,
        line=request.line,
        parent_id=parent_id,
        digest=digest,
        manifest=[e.model_dump() for e in request.manifest.files],
        total_bytes=request.manifest.total_bytes(),
        memory_plan=request.memory_plan.model_dump() if request.memory_plan else None,
        source_uri=request.source_uri,
        notes=request.notes,
        created_at=now,
    )
    session.add(row)
    record_event(
        session,
        now,
        actor,
        "model.registered",
        f"model/{VersionRef(name, request.version)}",
        f"registered {VersionRef(name, request.version)} "
        f"({len(request.manifest.files)} files, digest {digest[:12]})",
        digest=digest,
        line=request.line,
        parent=request.parent,
    )
    return model_row, row, True


def deprecate_version(
    session: Session, now: datetime, actor: str, name: str, version: str
) -> tuple[Model, ModelVersion]:
    """Mark a version deprecated: it keeps serving where deployed; new deployments refuse it."""
    model, row = get_version(session, name, version)
    if not row.deprecated:
        row.deprecated = True
        session.add(row)
        record_event(
            session,
            now,
            actor,
            "model.deprecated",
            f"model/{VersionRef(name, version)}",
            f"{VersionRef(name, version)} deprecated",
        )
    return model, row


def deployable_version(session: Session, name: str, version: str) -> tuple[Model, ModelVersion]:
    """The version a deployment may serve: registered and not deprecated, else Invalid."""
    found = find_version(session, name, version)
    if found is None:
        raise Invalid(
            f"model version {VersionRef(name, version)} is not registered: `dctl model register`"
        )
    if found[1].deprecated:
        raise Invalid(f"{VersionRef(name, version)} is deprecated: deploy a newer version")
    return found


@dataclass(frozen=True)
class SourceFile:
    """A file of a version whose source is on the control plane's disk, as its manifest says."""

    label: str
    entry: ManifestEntry
    source_dir: PurePosixPath


def source_file(session: Session, name: str, version: str, path: str) -> SourceFile:
    """The manifest entry `path` of a version and its local source directory.

    NotFound when the manifest lists no such file, NotLocal when the source is elsewhere. The
    file itself is not looked at here: `ModelFiles.open_verified` checks it against the entry.
    """
    _model, row = get_version(session, name, version)
    entry = next((e for e in row.manifest if e["path"] == path), None)
    if entry is None:
        raise NotFound(f"file {path!r} in the manifest of {VersionRef(name, version)}")
    source = local_source_dir(row.source_uri)
    if source is None:
        raise NotLocal(
            f"{VersionRef(name, version)} lives at {row.source_uri}, not on the control plane: "
            "fetch it there"
        )
    return SourceFile(str(VersionRef(name, version)), ManifestEntry.model_validate(entry), source)


def versions_visible_to_host(session: Session, host_id: int) -> set[int]:
    """Ids of the versions host `host_id`'s agent may fetch: those its instances run, and its
    keep-list (stable versions, rollback targets and rollouts, pre-staged ones included, of the
    deployments it serves): nothing else."""
    rows = session.exec(
        select(Instance.version_id).where(Instance.host_id == host_id).distinct()
    ).all()
    return set(rows) | keep_version_ids(session.connection(), host_id)


def ensure_host_may_fetch(session: Session, host_id: int | None, name: str, version: str) -> None:
    """Forbidden unless `name:version` is visible to the agent of host `host_id`.

    An unknown version gets the same answer, so an agent token learns nothing it may not fetch.
    """
    found = find_version(session, name, version)
    if (
        host_id is None
        or found is None
        or found[1].id not in versions_visible_to_host(session, host_id)
    ):
        raise Forbidden(
            f"this agent's host runs no instance of {VersionRef(name, version)}: an agent may "
            "fetch only the versions in its host's desired state"
        )
