"""A call from the harness to an agent on a Ray node, in a module of its own: the launcher
(placing, checking) and each instance's `RayServer` (starting, polling, stopping) both wait on
agents the same way, under one timeout, and a lost agent or a failed call becomes one line
saying what was being done, and where."""

from __future__ import annotations

from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from harness.serve.launcher import LaunchRefused

CALL_TIMEOUT_S = 60.0  # one agent call; agents answer in milliseconds unless a node is lost


def lost_reason(exc: Exception) -> str:
    if isinstance(exc, GetTimeoutError):
        return f"no answer from it in {CALL_TIMEOUT_S:.0f} s"
    first = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {first[0] if first else ''}".strip()


def get_or_refuse(refs: Any, doing: str) -> Any:
    """ray.get, with a failure turned into one line saying what was being done, and where."""
    try:
        return ray.get(refs, timeout=CALL_TIMEOUT_S)
    except RayTaskError as exc:
        cause = exc.as_instanceof_cause()
        raise LaunchRefused(f"{doing}: {type(cause).__name__}: {cause}") from None
    except (RayActorError, GetTimeoutError) as exc:
        raise LaunchRefused(f"{doing}: {lost_reason(exc)}") from None
