"""One request on one topology, as the serving stage hands it to judging: a result or the
reason there is none, with every piece of evidence gathered while it ran.

These are plain records: `harness.serve` produces them, `harness.judge` reads them, and
nothing here opens a socket or a process, so judging a stored outcome needs no server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.outcomes.attached import AttachedEvidence
from harness.outcomes.chat import ChatResult
from harness.outcomes.stream import StreamRecord
from harness.outcomes.taps import TapRecord
from harness.outcomes.trace import RequestTrace
from harness.spec.topology import Topology


@dataclass
class Outcome:
    """One request on one topology: a result, or the reason there is none."""

    prompt: str
    result: ChatResult | None = None
    error: str | None = None
    trace: RequestTrace | None = None  # the harness proxy's own account (--proxy harness)
    taps: list[TapRecord] | None = None  # what every instance was sent and answered
    media_count: int = 0  # media parts in the request the client sent
    seconds: float = 0.0
    # D's KV counters, after minus before the request (harness.serve.kv_metrics); None without
    # a D, or when its /metrics could not be read.
    kv_counters: dict[str, float] | None = None
    # Another request was in flight at the session during this one's window (a load): the
    # counters above hold its transfers too, and show nothing of this request's own.
    others_in_flight: bool = False
    # An attached deployment's (--proxy attach): what could be seen from outside it.
    attached: AttachedEvidence | None = None
    # A streamed answer's framing, as the client received it (None: not streamed).
    stream: StreamRecord | None = None
    # Seconds since the epoch when the request was sent (load: which requests overlapped).
    sent_at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "result": self.result.to_json() if self.result else None,
            "error": self.error,
            "trace": self.trace.to_json() if self.trace else None,
            "taps": [r.to_json() for r in self.taps] if self.taps is not None else None,
            "media_count": self.media_count,
            "seconds": round(self.seconds, 3),
            "kv_counters": self.kv_counters,
            "others_in_flight": self.others_in_flight,
            "attached": self.attached.to_json() if self.attached else None,
            "stream": self.stream.to_json() if self.stream else None,
            "sent_at": round(self.sent_at, 3),
        }


@dataclass
class InstanceStats:
    """One instance of a run: where it served, how long it took to start and where that time
    went (harness.outcomes.startup), the CPU its processes used to start, and the most memory
    its process tree held."""

    name: str
    role: str
    url: str
    log_path: str
    startup_s: float | None = None
    peak_rss_bytes: int = 0
    timeline: dict[str, float | None] = field(default_factory=dict)
    # CPU seconds each kind of process used until the instance was ready (`server`, then vLLM's
    # `EngineCore` and `Worker`): `ManagedServer.cpu_seconds`.
    startup_cpu_s: dict[str, float] = field(default_factory=dict)
    node: str | None = None  # the node's address when a launcher placed it on a cluster
    # The instances that had to be healthy before it was spawned: those before it on a GPU it
    # shares (`harness.spec.placement.start_after`); its startup_s counts from its own spawn.
    started_after: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ServedTopology:
    """What the transfer guards need to know of the topology that answered: which transfers
    it carries, where its EC storage is (the encoder_output guard reads the files), and how its
    KV connector moves KV (the kv_transfer guard's rule)."""

    topology: Topology
    ec_storage: Path | None
    block_size: int
    kv_connector: str  # the vLLM class name the instances were given
