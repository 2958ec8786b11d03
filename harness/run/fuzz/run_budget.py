"""The caps on one whole fuzz run, in a module of their own: the command line builds them
(`--max-run-restarts`, `--budget-s`) without importing the engine and what it serves with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RunBudget:
    """Caps on one whole fuzz run, so it holds the shared machine for a bounded time: topology
    restarts (each one after a death costs tens of seconds to minutes on CPU) and wall time
    from the start of the servers. What a spent budget left unsent or unshrunk is counted and
    reported, never dropped silently."""

    max_restarts: int = 6
    max_seconds: float = 780.0

    def to_json(self) -> dict[str, Any]:
        return {"max_restarts": self.max_restarts, "max_seconds": self.max_seconds}


class BudgetSpent(Exception):
    """The run's restart budget is spent and the topology is down."""
