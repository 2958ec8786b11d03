"""A soak's memory and account stay bounded by what failed, not by how long it ran (a stand-in
session and a clock it moves: pure logic). Measured before: every request of every round was
kept whole (~48 KB each on the fake vLLM's answers) and load.json / load.md listed each one,
rewritten every round: a round cost what the soak had done so far."""

from __future__ import annotations

import dataclasses
import gc
import json
import random
import threading
import time
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from test_load_judging import StandIn, stand_in_load

import harness.run.load as load_module
from harness.outcomes.outcome import Outcome
from harness.report.load import REQUESTS_FILE, LatencySeries, Percentiles

pytestmark = pytest.mark.unit

PER_ROUND = 6
SOAK_S = 20.0  # one second a request: the soak ends with its 4th round (24 s >= 20 s)
FAILING_CALL = 15  # the 3rd request of round 3: answered with another prompt's answer


class SoakClock:
    """The load's `time` as its stand-in moves it: each request answered takes one second, so
    a soak's rounds are as many on any machine."""

    def __init__(self) -> None:
        self.now = 1000.0
        self._lock = threading.Lock()
        self.sleep = time.sleep

    def monotonic(self) -> float:
        with self._lock:
            return self.now

    def tick(self) -> None:
        with self._lock:
            self.now += 1.0


class TimedStandIn(StandIn):
    """A stand-in whose answers take a second of the soak's clock each, and a latency that
    differs per call (so percentiles have something to order); it holds each answer only
    weakly, to see which answers the load let go."""

    def __init__(self, *args: Any, clock: SoakClock, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.clock = clock
        self.answered: dict[int, weakref.ref[Outcome]] = {}

    def send(self, prompt: str, body: dict[str, Any]) -> Outcome:
        outcome = super().send(prompt, body)
        outcome.seconds = 0.01 * self.calls
        self.answered[self.calls] = weakref.ref(outcome)
        self.clock.tick()
        return outcome


def test_latency_percentiles_stay_exact_as_rounds_are_merged_in() -> None:
    """The series merges each round's latencies into those it holds sorted: after any number
    of rounds read in between, its percentiles are those of every value sorted at once."""
    rng = random.Random(7)
    series, every = LatencySeries(), []
    for size in (1, 5, 64, 3, 200, 17):
        for _ in range(size):
            value = round(rng.uniform(0.0, 5.0), rng.choice((1, 3, 6)))  # ties too
            series.add(value)
            every.append(value)
        assert series.percentiles() == Percentiles.of(every)
        assert list(series.ordered()) == sorted(every)
    assert len(series) == len(every) == 290
    assert LatencySeries().percentiles() == Percentiles(0, None, None, None)


def test_a_soak_keeps_whole_its_first_round_and_what_failed_and_counts_every_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = SoakClock()
    monkeypatch.setattr(load_module, "time", SimpleNamespace(monotonic=clock.monotonic))
    (tmp_path / REQUESTS_FILE).write_text('{"an earlier load": "in this directory"}\n')
    load, session = stand_in_load(
        tmp_path,
        requests=PER_ROUND,
        session_type=TimedStandIn,
        swap={FAILING_CALL: "ld-shared-a"},
        clock=clock,
    )
    load.spec = dataclasses.replace(load.spec, duration_s=SOAK_S)
    result = load.run()
    assert isinstance(session, TimedStandIn)
    total = 4 * PER_ROUND
    assert result.rounds == 4 and session.calls == total

    # Held whole: round 1 and the request that failed in round 3; nothing else.
    whole = {r.number: r for r in result.results}
    assert sorted(whole) == [*range(1, PER_ROUND + 1), FAILING_CALL]
    failing = whole[FAILING_CALL]
    assert failing.round_number == 3 and not failing.record.policy_passed
    assert failing.outcome.result is not None and failing.outcome.result.logprobs
    assert not result.passed
    # The answers of the requests that passed after round 1 are let go by everything the load
    # holds (its result, the sweep's bundle): only the stand-in's weak references are left.
    gc.collect()
    alive = {call for call, answer in session.answered.items() if answer() is not None}
    assert alive == set(whole), sorted(alive)

    # The figures are over every request judged, exactly.
    stats = result.stats
    assert stats is not None and result.tally.requests == stats.requests == total
    assert stats.verdicts == {"MATCH": total - 1, "MISMATCH": 1} and stats.passed == total - 1
    latencies = [0.01 * call for call in range(1, total + 1)]
    assert stats.end_to_end == Percentiles.of(latencies) and stats.end_to_end.count == total
    assert stats.wall_s == pytest.approx(float(total))  # one second a request
    assert result.samples[-1].requests_done == total

    # load.json lists round 1 and the failure whole, and says how many more it counted where.
    account = json.loads((tmp_path / "load.json").read_text())
    listed = {row["number"]: row for row in account["requests"]}
    assert sorted(listed) == sorted(whole)
    assert listed[FAILING_CALL]["verdict"] == "MISMATCH" and listed[FAILING_CALL]["round"] == 3
    assert listed[FAILING_CALL]["detail"].startswith("received request ")
    assert account["requests_unlisted"] == total - len(whole) == result.unlisted
    assert account["requests_file"] == REQUESTS_FILE
    assert (
        account["stats"]["requests"] == total and account["stats"]["end_to_end"]["count"] == total
    )

    # load-requests.jsonl: every request judged, once, in order, appended (the earlier load's
    # line is gone).
    lines = [json.loads(line) for line in (tmp_path / REQUESTS_FILE).read_text().splitlines()]
    assert [row["number"] for row in lines] == list(range(1, total + 1))
    assert [row["round"] for row in lines] == [n // PER_ROUND + 1 for n in range(total)]
    assert [row["number"] for row in lines if not row["passed"]] == [FAILING_CALL]

    # load.md: the same rows, and the count of the others.
    markdown = (tmp_path / "load.md").read_text()
    table = markdown.split("\n## Requests\n")[1]
    assert f"The {total - len(whole)} other request(s) passed after the first round" in table
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == len(whole) + 1  # and the header
    assert f"| {FAILING_CALL} | " in table and "MISMATCH" in table
