"""`/api/v1/models`: register immutable versions, list, show, deprecate, serve files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Response
from fastapi import Path as PathParam
from fastapi.responses import FileResponse
from sqlmodel import Session, col, select

from controlplane.api.deps import ContextDep, Operator, SessionDep, Viewer, ViewerOrAgent
from controlplane.api.errors import ApiError, conflict, invalid, not_found
from controlplane.api.views import model_out, parent_refs, version_out
from controlplane.eventlog import record_event
from controlplane.models import Model, ModelVersion
from protocol.rest import ModelOut, RegisterVersionRequest, VersionOut, split_ref
from protocol.sources import SourceUriError, check_source_uri, local_source_dir
from protocol.wire import NAME_PATTERN

router = APIRouter(prefix="/api/v1/models", tags=["models"])


def get_model(session: Session, name: str) -> Model:
    """The model called `name`, or 404."""
    model = session.exec(select(Model).where(Model.name == name)).first()
    if model is None:
        raise not_found(f"model {name!r}")
    return model


def get_version(session: Session, name: str, version: str) -> tuple[Model, ModelVersion]:
    """The model and its version `version`, or 404."""
    model = get_model(session, name)
    row = session.exec(
        select(ModelVersion).where(
            ModelVersion.model_id == model.id, ModelVersion.version == version
        )
    ).first()
    if row is None:
        raise not_found(f"model version {name}:{version}")
    return model, row


def _version_body(session: Session, model: Model, row: ModelVersion) -> VersionOut:
    parent = parent_refs(session, [row]).get(row.parent_id or -1)
    return version_out(row, model.name, parent, with_manifest=True)


@router.get("", response_model=list[ModelOut])
def list_models(session: SessionDep, _who: Viewer) -> list[ModelOut]:
    """Every model with its versions."""
    models = session.exec(select(Model).order_by(col(Model.name))).all()
    return [model_out(session, m) for m in models]


@router.get("/{name}", response_model=ModelOut)
def show_model(name: str, session: SessionDep, _who: Viewer) -> ModelOut:
    """One model with its versions."""
    return model_out(session, get_model(session, name))


@router.post("/{name}/versions", response_model=VersionOut, status_code=201)
def register_version(
    name: Annotated[str, PathParam(pattern=NAME_PATTERN, max_length=63)],
    body: RegisterVersionRequest,
    session: SessionDep,
    ctx: ContextDep,
    who: Operator,
    response: Response,
) -> VersionOut:
    """Register a version; the same manifest again is a no-op (200), a different one is 409."""
    digest = body.manifest.digest()
    if body.digest is not None and body.digest != digest:
        raise invalid(
            f"digest {body.digest} does not match the manifest's digest {digest}: "
            "recompute the manifest"
        )
    try:
        check_source_uri(body.source_uri)
    except SourceUriError as exc:
        raise invalid(str(exc)) from exc
    now = ctx.clock()
    model = session.exec(select(Model).where(Model.name == name)).first()
    if model is not None:
        existing = session.exec(
            select(ModelVersion).where(
                ModelVersion.model_id == model.id, ModelVersion.version == body.version
            )
        ).first()
        if existing is not None:
            if existing.digest != digest:
                raise conflict(
                    f"{name}:{body.version} is already registered with a different manifest "
                    f"(digest {existing.digest}); versions are immutable: register a new version"
                )
            response.status_code = 200
            return _version_body(session, model, existing)
    parent_id = None
    if body.parent is not None:
        parent_name, parent_tag = split_ref(body.parent)
        parent_model = session.exec(select(Model).where(Model.name == parent_name)).first()
        parent = (
            session.exec(
                select(ModelVersion).where(
                    ModelVersion.model_id == parent_model.id, ModelVersion.version == parent_tag
                )
            ).first()
            if parent_model
            else None
        )
        if parent is None:
            raise invalid(f"parent {body.parent} is not registered: register it first")
        parent_id = parent.id
    if model is None:
        model = Model(name=name, created_at=now)
        session.add(model)
        session.flush()
    assert model.id is not None
    row = ModelVersion(
        model_id=model.id,
        version=body.version,
        line=body.line,
        parent_id=parent_id,
        digest=digest,
        manifest=[e.model_dump() for e in body.manifest.files],
        total_bytes=body.manifest.total_bytes(),
        memory_plan=body.memory_plan.model_dump() if body.memory_plan else None,
        source_uri=body.source_uri,
        notes=body.notes,
        created_at=now,
    )
    session.add(row)
    record_event(
        session,
        now,
        who.actor,
        "model.registered",
        f"model/{name}:{body.version}",
        f"registered {name}:{body.version} "
        f"({len(body.manifest.files)} files, digest {digest[:12]})",
        digest=digest,
        line=body.line,
        parent=body.parent,
    )
    session.commit()
    return _version_body(session, model, row)


@router.get("/{name}/versions/{version}", response_model=VersionOut)
def show_version(name: str, version: str, session: SessionDep, _who: Viewer) -> VersionOut:
    """One version with its manifest."""
    model, row = get_version(session, name, version)
    return _version_body(session, model, row)


@router.post("/{name}/versions/{version}/deprecate", response_model=VersionOut)
def deprecate_version(
    name: str, version: str, session: SessionDep, ctx: ContextDep, who: Operator
) -> VersionOut:
    """Mark a version deprecated (it keeps serving where deployed; new deployments refuse it)."""
    model, row = get_version(session, name, version)
    if not row.deprecated:
        row.deprecated = True
        session.add(row)
        record_event(
            session,
            ctx.clock(),
            who.actor,
            "model.deprecated",
            f"model/{name}:{version}",
            f"{name}:{version} deprecated",
        )
        session.commit()
    return _version_body(session, model, row)


@router.get("/{name}/versions/{version}/files/{path:path}")
def version_file(
    name: str, version: str, path: str, session: SessionDep, _who: ViewerOrAgent
) -> FileResponse:
    """A file of the version, from its local source directory (Range requests supported)."""
    _model, row = get_version(session, name, version)
    entry = next((e for e in row.manifest if e["path"] == path), None)
    if entry is None:
        raise not_found(f"file {path!r} in the manifest of {name}:{version}")
    source = local_source_dir(row.source_uri)
    if source is None:
        raise ApiError(
            404,
            "not_local",
            f"{name}:{version} lives at {row.source_uri}, not on the control plane: fetch it there",
        )
    root = Path(source).resolve()
    target = (root / path).resolve()
    # The manifest path is checked at registration; resolve() also defeats symlinks out of root.
    if not target.is_relative_to(root) or not target.is_file():
        raise not_found(f"file {path!r} at the source of {name}:{version} ({root})")
    return FileResponse(target, media_type="application/octet-stream")
