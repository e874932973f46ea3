"""`/api/v1/models`: register immutable versions, list, show, deprecate, serve files."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from fastapi import Path as PathParam
from sqlmodel import Session
from starlette.concurrency import run_in_threadpool

from controlplane.api.deps import (
    AdminOrAgent,
    AppContext,
    ContextDep,
    Operator,
    SessionDep,
    Viewer,
)
from controlplane.api.file_response import (
    OpenFileResponse,
    RangeNotSatisfiable,
    range_not_satisfiable,
)
from controlplane.api.views import model_out, models_out, parent_refs, version_out
from controlplane.auth import Principal
from controlplane.model_files import ModelFiles
from controlplane.models import Model, ModelVersion
from controlplane.services import models
from protocol.rest import ModelOut, RegisterVersionRequest, VersionOut
from protocol.vocabulary import Role
from protocol.wire import NAME_PATTERN

router = APIRouter(prefix="/api/v1/models", tags=["models"])


def _version_body(session: Session, model: Model, row: ModelVersion) -> VersionOut:
    parent = parent_refs(session, [row]).get(row.parent_id or -1)
    return version_out(row, model.name, parent, with_manifest=True)


@router.get("", response_model=list[ModelOut])
def list_models(session: SessionDep, _who: Viewer) -> list[ModelOut]:
    """Every model with its versions."""
    return models_out(session, models.list_models(session))


@router.get("/{name}", response_model=ModelOut)
def show_model(name: str, session: SessionDep, _who: Viewer) -> ModelOut:
    """One model with its versions."""
    return model_out(session, models.get_model(session, name))


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
    model, row, created = models.register_version(
        session, ctx.clock(), who.actor, name, body, ctx.settings.model_roots
    )
    if created:
        session.commit()
    else:
        response.status_code = 200
    return _version_body(session, model, row)


@router.get("/{name}/versions/{version}", response_model=VersionOut)
def show_version(name: str, version: str, session: SessionDep, _who: Viewer) -> VersionOut:
    """One version with its manifest."""
    model, row = models.get_version(session, name, version)
    return _version_body(session, model, row)


@router.post("/{name}/versions/{version}/deprecate", response_model=VersionOut)
def deprecate_version(
    name: str, version: str, session: SessionDep, ctx: ContextDep, who: Operator
) -> VersionOut:
    """Mark a version deprecated (it keeps serving where deployed; new deployments refuse it)."""
    model, row = models.deprecate_version(session, ctx.clock(), who.actor, name, version)
    session.commit()
    return _version_body(session, model, row)


async def get_model_files(request: Request) -> ModelFiles:
    """The app's verified-file server (async: no I/O)."""
    files: ModelFiles = request.app.state.model_files
    return files


ModelFilesDep = Annotated[ModelFiles, Depends(get_model_files)]


def _source_file(
    ctx: AppContext, who: Principal, name: str, version: str, path: str
) -> models.SourceFile:
    # Its own short session: a download lasts minutes and must not hold a pooled connection.
    with Session(ctx.engine) as session:
        if who.role is Role.AGENT:
            models.ensure_host_may_fetch(session, who.host_id, name, version)
        return models.source_file(session, name, version, path)


@router.get("/{name}/versions/{version}/files/{path:path}")
async def version_file(
    name: str,
    version: str,
    path: str,
    request: Request,
    ctx: ContextDep,
    who: AdminOrAgent,
    files: ModelFilesDep,
) -> Response:
    """A file of the version from the control plane's disk, once it matches the manifest.

    For agents and admins only; an agent gets only the versions its host runs. One Range
    (`bytes=N-`, `N-M`, `-N`) is answered with 206, one past the end with 416.
    """
    wanted = await run_in_threadpool(_source_file, ctx, who, name, version, path)
    opened = await files.open_verified(wanted.source_dir, wanted.entry, wanted.label)
    etag = f'"{wanted.entry.sha256}"'
    try:
        return OpenFileResponse(opened, request.headers, etag)
    except RangeNotSatisfiable:
        return range_not_satisfiable(opened)
