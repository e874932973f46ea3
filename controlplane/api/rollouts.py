"""`/api/v1/deployments/{name}/rollout...`, `/rollback`, `/restart`: start and steer rollouts,
roll back to a kept version, restart engines one at a time (operator); status and history
(viewer). Below admin, a rollout's `notify` URL shows its scheme and host only."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query
from fastapi import Path as PathParam

from controlplane.api.deps import ContextDep, Operator, SessionDep, Viewer
from controlplane.auth import Role
from controlplane.services import rollouts
from protocol.rollouts import (
    RestartCreate,
    RollbackCreate,
    RolloutAction,
    RolloutCreate,
    RolloutOut,
)

router = APIRouter(prefix="/api/v1/deployments", tags=["rollouts"])

NamePath = Annotated[str, PathParam(max_length=63)]
Action = Literal["promote", "abort", "pause", "resume"]


@router.post("/{name}/rollout", response_model=RolloutOut, status_code=201)
def start_rollout(
    name: NamePath, body: RolloutCreate, session: SessionDep, ctx: ContextDep, who: Operator
) -> RolloutOut:
    """Start a canary rollout of a new version (and engine config); 409 while one is active."""
    now = ctx.clock()
    allow_private = ctx.settings.notify_allow_private
    rollout = rollouts.start_rollout(session, now, who.actor, name, body, allow_private)
    session.commit()
    return rollouts.view(session, now, rollout, admin=who.may(Role.ADMIN))


@router.get("/{name}/rollout", response_model=RolloutOut)
def current_rollout(
    name: NamePath, session: SessionDep, ctx: ContextDep, who: Viewer
) -> RolloutOut:
    """The active rollout, rollback or restart; else the most recent one."""
    rollout = rollouts.current(session, name)
    return rollouts.view(session, ctx.clock(), rollout, admin=who.may(Role.ADMIN))


@router.post("/{name}/rollout/{action}", response_model=RolloutOut)
def rollout_action(
    name: NamePath,
    action: Action,
    session: SessionDep,
    ctx: ContextDep,
    who: Operator,
    body: RolloutAction | None = None,
) -> RolloutOut:
    """promote (`full`: all the way), abort, pause or resume the active rollout."""
    now = ctx.clock()
    rollout = rollouts.act(session, now, who.actor, name, action, body or RolloutAction())
    session.commit()
    return rollouts.view(session, now, rollout, admin=who.may(Role.ADMIN))


@router.get("/{name}/rollouts", response_model=list[RolloutOut])
def rollout_history(
    name: NamePath,
    session: SessionDep,
    ctx: ContextDep,
    who: Viewer,
    limit: Annotated[int, Query(ge=1, le=500)] = rollouts.HISTORY_LIMIT,
) -> list[RolloutOut]:
    """Past and present rollouts, rollbacks and restarts, newest first."""
    now, admin = ctx.clock(), who.may(Role.ADMIN)
    return [
        rollouts.view(session, now, r, admin=admin) for r in rollouts.history(session, name, limit)
    ]


@router.get("/{name}/rollouts/{rollout_id}", response_model=RolloutOut)
def rollout_by_id(
    name: NamePath,
    rollout_id: Annotated[int, PathParam(ge=1, le=2**31 - 1)],
    session: SessionDep,
    ctx: ContextDep,
    who: Viewer,
) -> RolloutOut:
    """One rollout, rollback or restart."""
    rollout = rollouts.by_id(session, name, rollout_id)
    return rollouts.view(session, ctx.clock(), rollout, admin=who.may(Role.ADMIN))


@router.post("/{name}/rollback", response_model=RolloutOut, status_code=201)
def rollback(
    name: NamePath, body: RollbackCreate, session: SessionDep, ctx: ContextDep, who: Operator
) -> RolloutOut:
    """Back to the previous stable version (or `to`), one instance at a time unless
    `all_at_once`; during an active rollout, that rollout's canary goes away at once."""
    now = ctx.clock()
    rollout = rollouts.start_rollback(session, now, who.actor, name, body)
    session.commit()
    return rollouts.view(session, now, rollout, admin=who.may(Role.ADMIN))


@router.post("/{name}/restart", response_model=RolloutOut, status_code=201)
def restart(
    name: NamePath, body: RestartCreate, session: SessionDep, ctx: ContextDep, who: Operator
) -> RolloutOut:
    """Restart the deployment's engines (or those on `host`, or `instance`) one at a time."""
    now = ctx.clock()
    rollout = rollouts.start_restart(session, now, who.actor, name, body)
    session.commit()
    return rollouts.view(session, now, rollout, admin=who.may(Role.ADMIN))
