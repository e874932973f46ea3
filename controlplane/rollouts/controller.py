"""The rollout controller: every round, moves each active rollout, rollback and restart on.

Each record in its own transaction, its row locked: the machine (`controlplane.rollouts.machine`,
whose docstring draws the lifecycle) decides, the store (`controlplane.rollouts.store`) observes
and carries out; the notifications go out after the commit. Everything lives in the rollout row,
so a control plane killed mid-step resumes where it was.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy.engine import Engine
from sqlmodel import Session

from controlplane.eventlog import record_event
from controlplane.rollouts import store
from controlplane.rollouts.machine import LEADERLESS_GAP
from controlplane.rollouts.notify import Notice, Notifier
from protocol.rollout_policy import notify_origin

ACTOR = "controller:rollouts"


class RolloutController:
    """Runs every active rollout one round (`tick`); each in its own transaction."""

    name = "rollouts"

    def __init__(
        self,
        engine: Engine,
        notifier: Notifier | None = None,
        leaderless_gap: timedelta = LEADERLESS_GAP,
        notify_allow_private: bool = False,
    ) -> None:
        self._engine = engine
        self.leaderless_gap = leaderless_gap
        self.notifier = notifier or Notifier(
            self._notice_failed, allow_private=notify_allow_private
        )

    def tick(self, now: datetime) -> None:
        """One round over the rollouts that are active or still have an ending to record."""
        with Session(self._engine) as session:
            ids = store.to_advance(session)
        for rollout_id in ids:
            with Session(self._engine) as session:
                rollout = store.locked(session, rollout_id)
                if rollout is None:
                    continue
                notices = store.advance(session, now, ACTOR, rollout, self.leaderless_gap)
                session.commit()
            for url, body in notices:
                self.notifier.send(url, body)

    # --- notifications ---------------------------------------------------------------------

    def _notice_failed(self, notice: Notice, error: str) -> None:
        with Session(self._engine) as session:
            now = datetime.now(UTC)
            record_event(
                session,
                now,
                ACTOR,
                "rollout.notify_failed",
                f"deployment/{notice.body.get('deployment', '')}",
                f"notification to {notify_origin(notice.url)} failed: {error} "
                f"({len(notice.attempts)} attempt{'' if len(notice.attempts) == 1 else 's'})",
                rollout=notice.body.get("rollout"),
                event=notice.body.get("event"),
            )
            session.commit()
