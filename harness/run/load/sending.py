"""A round's requests sent at the load's concurrency, and what came of each: when it was in
flight (whether it was batched with another, which request carried a prompt) and what it was
answered. After a death nothing more is sent: the requests left are recorded as not sent."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from harness.run.judging import Observed, observe
from harness.run.load.sessions import Death, Session, dead_instance
from harness.spec.load import PlannedRequest


@dataclass
class Sent:
    """A planned request and what came of it (observed None: never sent)."""

    request: PlannedRequest
    observed: Observed | None
    started_s: float
    ended_s: float

    def overlaps(self, other: Sent) -> bool:
        return self.started_s < other.ended_s and other.started_s < self.ended_s


class InFlight:
    """How many requests are in flight right now (the planted kill waits for all of them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current = 0

    def begin(self, now: float) -> float:
        with self._lock:
            self.current += 1
        return now

    def end(self, now: float) -> float:
        with self._lock:
            self.current -= 1
        return now


class Together:
    """The first `parties` requests of a round, which a planted kill waits to see all in
    flight, go out together once each has begun. Sent as each thread began, the first reached
    a fast instance (the fake's D, a small model's on a GPU) and was answered before the last
    thread had begun on a busy host, and the kill's moment never came. A request that does
    not come within `timeout_s` lets the others go (the killer then says it found no moment)."""

    def __init__(self, parties: int, timeout_s: float) -> None:
        self._parties = parties
        self._timeout_s = timeout_s
        self._barrier = threading.Barrier(parties) if parties > 1 else None
        self._lock = threading.Lock()
        self._arrived = 0

    def wait(self) -> None:
        if self._barrier is None:
            return
        with self._lock:
            self._arrived += 1
            if self._arrived > self._parties:  # a later request: it goes as it comes
                return
        try:
            self._barrier.wait(self._timeout_s)
        except threading.BrokenBarrierError:
            pass


def send_round(
    session: Session,
    planned: list[PlannedRequest],
    bodies: Mapping[str, dict[str, Any]],
    *,
    concurrency: int,
    stream: bool,
    flight: InFlight,
    together: Together,
    now: Callable[[], float],
    on_death: Callable[[Death], None],
) -> list[Sent]:
    """Every planned request, at most `concurrency` in flight; after a death (a request that
    failed found an instance dead: `on_death` is told which), nothing more is sent."""
    stop = threading.Event()

    def one(request: PlannedRequest) -> Sent:
        if stop.is_set():
            return Sent(request, None, 0.0, 0.0)
        body = bodies[request.prompt]
        flight.begin(now())
        try:
            together.wait()
            started = now()
            observed = observe(session, request.prompt, body, stream=stream, fresh_prefix=False)
        finally:
            ended = flight.end(now())
        if observed.outcome.error and not stop.is_set():
            dead = dead_instance(session)
            if dead is not None:
                stop.set()
                on_death(dead)
        return Sent(request, observed, started, ended)

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(one, planned))


def carrier(sent: list[Sent], item: Sent, prompt: str) -> str:
    """The name of a request that carried `prompt`: one in flight with `item` if any, else the
    nearest by number, else the prompt itself (a request of the mix that this round lacks, or
    did not send: a request never sent had no answer to give)."""
    carriers = [s for s in sent if s.request.prompt == prompt and s.observed is not None]
    if not carriers:
        return f"prompt {prompt}"
    overlapping = [s for s in carriers if item.overlaps(s)]
    pool = overlapping or carriers
    best = min(pool, key=lambda s: abs(s.request.number - item.request.number))
    return best.request.name
