"""What a load asks of the session it serves, whichever it is: a topology the harness launched
(with its servers, taps and storage), the same behind vLLM's own proxy, or an attached
deployment. The one place the load tells them apart, so a test's stand-in for a launched
topology is one name to replace (`TopologySession`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeGuard

from harness.serve.attached import AttachedSession
from harness.serve.session import DeadInstance, ProxiedSession, TopologySession

Session = TopologySession | ProxiedSession | AttachedSession


def is_launched(session: object) -> TypeGuard[TopologySession]:
    return isinstance(session, TopologySession)


def launched(session: Session) -> TopologySession | None:
    """The topology the harness launched behind `session` (through vLLM's proxy too); None
    for an attached deployment, whose processes are not the harness's."""
    base = session.base if isinstance(session, ProxiedSession) else session
    return base if is_launched(base) else None


@dataclass(frozen=True)
class Death:
    """An instance of the load's session found dead: `headline`, one line naming it, for what
    ended the load and a problem's line, and `report`, what the load says of it (a launched
    instance's log tail too)."""

    headline: str
    report: str
    instance: str | None = None  # a launched instance's name (an attached one's is not sampled)

    @classmethod
    def of(cls, dead: DeadInstance) -> Death:
        return cls(dead.headline(), dead.report(), dead.name)


def dead_instance(session: Session) -> Death | None:
    """An instance of `session` that died, if one did (an attached one: down)."""
    if isinstance(session, AttachedSession):
        down = session.first_down()
        return None if down is None else Death(down, down)
    dead = session.dead_instance()
    return None if dead is None else Death.of(dead)


def deaths_beside(session: Session, killed: str) -> list[Death]:
    """The instances of `session` that died other than `killed`, the planted kill's (a
    launched topology's: an attached deployment is never killed)."""
    base = launched(session)
    if base is None:
        return []
    return [Death.of(dead) for dead in base.dead_instances() if dead.name != killed]
