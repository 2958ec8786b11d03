"""The CPU a server's process tree has used, per kind of process, from samples of the tree.

Samples come every readiness poll or so, and many of a start's processes live shorter than
that (multiprocessing's resource tracker, a `uname`, a compiler): summing each process's last
sample missed every one that started and ended between two samples, and a pid the kernel gave
again overwrote the earlier process's figure. The kernel adds a child's CPU to its parent's
`children_user`/`children_system` once the parent waits for it, so those count too, under the
parent's kind, less what the samples already counted of the children that parent reaped.
Processes are told apart by pid and start time.
"""

from __future__ import annotations

from dataclasses import dataclass

# A process: (pid, create_time), which a reused pid does not repeat.
ProcessKey = tuple[int, float]


@dataclass(frozen=True)
class ProcessCpu:
    """One process in one sample of the tree."""

    key: ProcessKey
    parent: ProcessKey | None  # None: its parent is outside the tree (the root's)
    kind: str
    own_s: float  # user + system
    reaped_s: float  # children_user + children_system: the children it waited for


@dataclass
class _Seen:
    latest: ProcessCpu
    sample: int  # the number of the last sample that listed it


class TreeCpuAccount:
    """Every process of one tree ever sampled, and what it used by its last sample."""

    def __init__(self) -> None:
        self._seen: dict[ProcessKey, _Seen] = {}
        self._samples = 0

    def record(self, sample: list[ProcessCpu]) -> None:
        """One sample: every process of the tree listed at one moment."""
        self._samples += 1
        for process in sample:
            self._seen[process.key] = _Seen(process, self._samples)

    def by_kind(self) -> dict[str, float]:
        """CPU seconds per kind of process. A child gone by its parent's last sample was reaped
        by that parent (a child whose parent lives is never handed to another), so its last
        figure is taken off the parent's reaped CPU, which holds it already; the rest of that
        is helpers no sample saw, and what the child used after its last sample."""
        counted_in_parent: dict[ProcessKey, float] = {}
        for seen in self._seen.values():
            parent = self._seen.get(seen.latest.parent) if seen.latest.parent else None
            if parent is not None and seen.sample < parent.sample:
                total = seen.latest.own_s + seen.latest.reaped_s
                key = parent.latest.key
                counted_in_parent[key] = counted_in_parent.get(key, 0.0) + total
        totals: dict[str, float] = {}
        for key, seen in self._seen.items():
            process = seen.latest
            # Never below its own: a parent that ignores SIGCHLD has its children reaped unseen.
            unseen = max(0.0, process.reaped_s - counted_in_parent.get(key, 0.0))
            totals[process.kind] = round(totals.get(process.kind, 0.0) + process.own_s + unseen, 2)
        return totals
