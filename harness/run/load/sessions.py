"""What a load asks of the session it serves, whichever it is: a topology the harness launched
(with its servers, taps and storage), the same behind vLLM's own proxy, or an attached
deployment. The one place the load tells them apart, so a test's stand-in for a launched
topology is one name to replace (`TopologySession`)."""

from __future__ import annotations

from typing import TypeGuard

from harness.serve.attached import AttachedSession
from harness.serve.session import ProxiedSession, TopologySession

Session = TopologySession | ProxiedSession | AttachedSession


def is_launched(session: object) -> TypeGuard[TopologySession]:
    return isinstance(session, TopologySession)


def launched(session: Session) -> TopologySession | None:
    """The topology the harness launched behind `session` (through vLLM's proxy too); None
    for an attached deployment, whose processes are not the harness's."""
    base = session.base if isinstance(session, ProxiedSession) else session
    return base if is_launched(base) else None


def dead_instance(session: Session) -> str | None:
    """The report of an instance of `session` that died (its name first), if one did."""
    if isinstance(session, AttachedSession):
        return session.first_down()
    return session.dead_instance_report()


def deaths_beside(session: Session, killed: str) -> list[str]:
    """The reports of the instances of `session` that died other than `killed`, the planted
    kill's (a launched topology's: an attached deployment is never killed)."""
    base = launched(session)
    if base is None:
        return []
    return [dead.report() for dead in base.dead_instances() if dead.name != killed]
