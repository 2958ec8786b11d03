"""What a load measured besides its answers: the resources its instances held over time.

Filled in by `harness.serve.usage` (processes and files), read by `harness.report.load`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class StorageUsage:
    """A connector's storage directory: files and bytes in it."""

    files: int = 0
    bytes: int = 0


@dataclass(frozen=True)
class InstanceUsage:
    """One instance's process tree (API server, engine core, workers) at one moment."""

    rss_bytes: int = 0
    open_fds: int = 0
    processes: int = 0
    alive: bool = True


@dataclass
class ResourceSample:
    """Every instance and storage of a topology at one moment of a load."""

    at_s: float  # seconds since the load began
    requests_done: int
    label: str  # "before", "round 3", "after", ...
    instances: dict[str, InstanceUsage] = field(default_factory=dict)
    storage: dict[str, StorageUsage] = field(default_factory=dict)  # "ec", "kv"
    # Storage the harness cleaned right after this sample (the soak's cleaning), by kind.
    cleaned: dict[str, StorageUsage] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
