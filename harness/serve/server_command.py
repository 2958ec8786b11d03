"""`ServerCommand`, in a module of its own: both a server's log (`server_log`) and its launch
(`launch`) read it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ServerCommand:
    """How to run one server: what `ManagedServer` spawns and where it writes its log."""

    name: str  # unique within a run, e.g. "1E+1P+1D/encoder0"
    argv: tuple[str, ...]  # a list is accepted and stored as a tuple; never a shell string
    health_url: str  # answers 2xx once the server can take requests
    log_path: Path  # stdout and stderr together; truncated at start
    env: Mapping[str, str] = field(default_factory=dict)  # merged over os.environ
    # The CPUs the server and everything it starts may run on (inherited by its children);
    # empty: wherever the harness itself may run.
    cpu_affinity: tuple[int, ...] = ()
    # A directory the harness made for this server alone (a Ray rehearsal node's temp dir).
    # Its owner removes it after a stop; if the harness is SIGKILLed first, the watchdog
    # removes it once it has stopped the server's group (harness.serve.watchdog).
    scratch_dir: Path | None = None

    def __post_init__(self) -> None:
        argv = tuple(self.argv)
        if not argv or not all(isinstance(arg, str) for arg in argv):
            raise ValueError(f"{self.name}: argv must be a non-empty list of str, got {argv!r}")
        object.__setattr__(self, "argv", argv)
        object.__setattr__(self, "env", dict(self.env))
        object.__setattr__(self, "cpu_affinity", tuple(self.cpu_affinity))
