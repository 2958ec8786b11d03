"""A soak's memory and account stay bounded by what failed, not by how long it ran (a stand-in
session and a clock it moves: pure logic). Measured before: every request of every round was
kept whole (~48 KB each on the fake vLLM's answers) and load.json / load.md listed each one,
rewritten every round: a round cost what the soak had done so far."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import random
import threading
import time
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from test_load_judging import NixlStandIn, StandIn, stand_in_load

import harness.run.load.run as run_module
import harness.run.load.samples as samples_module
import harness.run.load.sessions as sessions_module
from harness.outcomes.load import InstanceUsage, ResourceSample, StorageUsage
from harness.outcomes.outcome import Outcome
from harness.report.load import (
    FAILURES_KEPT_WHOLE,
    KV_ACCOUNTS_FILE,
    REQUESTS_FILE,
    LatencySeries,
    LoadRequestResult,
    LoadTally,
    Percentiles,
    load_stats,
)
from harness.report.resources import (
    MIB,
    SAMPLES_FILE,
    TREND_SAMPLES,
    Growth,
    ResourceHistory,
    SoakBounds,
    bound_problems,
    growth,
    rate,
)
from harness.run.load.result import LoadResult
from harness.spec.load import LoadSpec
from harness.testing.builders import case_record

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
    monkeypatch.setattr(run_module, "time", SimpleNamespace(monotonic=clock.monotonic))
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
    assert result.resources.last is not None and result.resources.last.requests_done == total

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


# -- what a soak holds of its samples, KV accounts and failures ------------------------------


def growth_over_every_sample(samples: list[ResourceSample]) -> dict[str, dict[str, Growth]]:
    """The oracle: each instance's growth read from every sample whole, as the account read
    them before a soak kept only its `ResourceHistory` (c3cb33f's `instance_growth`)."""
    names = dict.fromkeys(name for s in samples for name in s.instances)
    found = {}
    for name in names:
        alive = [(s.at_s, s.instances[name]) for s in samples if s.instances.get(name)]
        alive = [(t, usage) for t, usage in alive if usage.alive]
        found[name] = {
            "rss_bytes": growth([(t, u.rss_bytes) for t, u in alive]),
            "open_fds": growth([(t, u.open_fds) for t, u in alive]),
        }
    return found


def storage_over_every_sample(samples: list[ResourceSample]) -> dict[str, dict[str, Growth]]:
    """The oracle of each storage's growth (c3cb33f's `storage_growth`)."""
    kinds = dict.fromkeys(kind for s in samples for kind in s.storage)
    found = {}
    for kind in kinds:
        points = [(s.at_s, s.storage[kind]) for s in samples if kind in s.storage]
        found[kind] = {
            "files": growth([(t, u.files) for t, u in points]),
            "bytes": growth([(t, u.bytes) for t, u in points]),
        }
    return found


def bounds_over_every_sample(samples: list[ResourceSample], bounds: SoakBounds) -> list[str]:
    """The oracle of the bounds: c3cb33f's `bound_problems`, reading every sample whole."""
    problems = []
    for kind in dict.fromkeys(k for s in samples for k in s.storage):
        peak = max(s.storage[kind].bytes for s in samples if kind in s.storage)
        if peak > bounds.storage_bytes:
            problems.append(
                f"{kind} storage reached {peak / MIB:.1f} MiB (bound {bounds.storage_bytes / MIB:.0f} MiB)"
            )
    warm = samples[1:]
    if len(warm) < 2:
        problems.append(
            "growth after the first round was not measured: the soak ended within its first "
            "round (give a --duration longer than one round)"
        )
        warm = []
    for name, figures in growth_over_every_sample(warm).items():
        rss, fds = figures["rss_bytes"], figures["open_fds"]
        if rss.change > bounds.rss_growth_bytes:
            problems.append(
                f"{name}: RSS grew {rss.change / MIB:.1f} MiB after the first round "
                f"(bound {bounds.rss_growth_bytes / MIB:.0f} MiB; {rate(rss.per_minute, MIB, 'MiB')}, "
                f"last half {rate(rss.late_per_minute, MIB, 'MiB')})"
            )
        if fds.change > bounds.fd_growth:
            problems.append(
                f"{name}: open files grew by {fds.change:.0f} after the first round "
                f"(bound {bounds.fd_growth}; {rate(fds.per_minute, 1, 'fds')})"
            )
    for sample in samples:
        dead = [name for name, usage in sample.instances.items() if not usage.alive]
        if dead:
            problems.append(f"{', '.join(dead)} not running at {sample.label}")
            break
    return problems


def random_samples(rng: random.Random, count: int) -> list[ResourceSample]:
    """Samples as a soak takes them, and then some: instances that start late, die, come
    back; storage that appears late and peaks anywhere; RSS and open files that level off or
    leak; times with ties."""
    samples, at = [], 0.0
    rss = {"e0": 900 * MIB, "p0": 1200 * MIB, "d0": 1000 * MIB}
    fds = dict.fromkeys(rss, 40)
    leak = {name: rng.choice((0, 0, 2 * MIB, 9 * MIB)) for name in rss}
    for number in range(count):
        at = round(at + rng.choice((0.0, 0.5, 3.0, 7.25)), 2)
        sample = ResourceSample(at_s=at, requests_done=number * 6, label=f"round {number}")
        for name in rss:
            if name == "p0" and number < 2 and rng.random() < 0.5:
                continue  # not launched yet
            rss[name] += leak[name] + rng.randrange(-3 * MIB, 3 * MIB)
            fds[name] += rng.choice((-1, 0, 0, 1, 3))
            alive = rng.random() > 0.03
            sample.instances[name] = InstanceUsage(rss[name], fds[name], 3, alive)
        for kind in ("ec", "kv"):
            if kind == "kv" and number < 3:
                continue
            size = rng.randrange(0, 700 * MIB) if rng.random() < 0.1 else rng.randrange(MIB)
            sample.storage[kind] = StorageUsage(rng.randrange(50), size)
            if kind == "kv" and rng.random() < 0.5:
                sample.cleaned[kind] = StorageUsage(3, size)
        samples.append(sample)
    return samples


@pytest.mark.parametrize("seed", range(40))
def test_the_bounds_read_from_what_a_soak_keeps_are_those_of_every_sample(seed: int) -> None:
    """A soak keeps of its samples a `ResourceHistory` (and lists a few whole): the bounds'
    verdicts and the figures read from it are exactly those read from every sample."""
    rng = random.Random(seed)
    samples = random_samples(rng, rng.choice((0, 1, 2, 3, 5, 40, 300)))
    bounds = SoakBounds(rss_growth_bytes=rng.choice((256, 64)) * MIB)
    history = ResourceHistory(trend_samples=8)
    for sample in samples:
        history.add(sample)
    assert bound_problems(history, bounds) == bounds_over_every_sample(samples, bounds)
    stats = load_stats(LoadTally(), history)
    assert stats.instances == growth_over_every_sample(samples)
    assert stats.storage == storage_over_every_sample(samples)
    assert history.count == len(samples)
    if not samples:
        return
    # Listed whole: the first, the end of the first round, the last, each storage's peak, the
    # first sample with an instance down, and an evenly spaced trend of at most 8.
    listed = {number: why for number, why, _ in history.listed()}
    assert "first" in listed[0] and "last" in listed[len(samples) - 1]
    if len(samples) > 1:
        assert "end of the first round: growth is held from here" in listed[1]
    for kind in ("ec", "kv"):
        sizes = [s.storage[kind].bytes for s in samples if kind in s.storage]
        if sizes:
            peak = next(
                n
                for n, s in enumerate(samples)
                if s.storage.get(kind) is not None and s.storage[kind].bytes == max(sizes)
            )
            assert f"peak {kind} storage" in listed[peak]
    down = [n for n, s in enumerate(samples) if any(not u.alive for u in s.instances.values())]
    if down:
        assert "first with an instance down" in listed[down[0]]
    trend = sorted(n for n, why in listed.items() if "trend" in why)
    assert len(trend) <= 8 and len(listed) <= 8 + 6
    if len(samples) > 8:
        assert len(trend) >= 4 and len({b - a for a, b in itertools.pairwise(trend)}) == 1


class Launched(TimedStandIn):
    """A launched topology to the load: three instances whose RSS and open files it reads
    (`usage`), and KV storage it cleans."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.servers = tuple(SimpleNamespace(name=f"1E+1PD/{n}", pid=n) for n in ("e0", "pd0"))


def leaking_usage(rng: random.Random) -> Any:
    """What `tree_usage` reads of an instance: pd0 leaks 6 MiB and 2 files a sample, and is
    read as not running once; e0 wanders."""
    reads = {"e0": 0, "pd0": 0}

    def usage(pid: str) -> InstanceUsage:
        reads[pid] += 1
        if pid == "pd0":
            return InstanceUsage(
                900 * MIB + 6 * MIB * reads[pid], 40 + 2 * reads[pid], 3, reads[pid] != 30
            )
        return InstanceUsage(700 * MIB + rng.randrange(-MIB, MIB), 30 + rng.randrange(3), 2)

    return usage


def test_a_soak_lists_a_few_samples_and_appends_every_one_and_its_bounds_are_every_samples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rounds = 60
    clock = SoakClock()
    monkeypatch.setattr(run_module, "time", SimpleNamespace(monotonic=clock.monotonic))
    monkeypatch.setattr(sessions_module, "TopologySession", Launched)
    monkeypatch.setattr(samples_module, "tree_usage", leaking_usage(random.Random(3)))
    monkeypatch.setattr(samples_module, "tree_pids", lambda pid: [])
    load, session = stand_in_load(tmp_path, requests=3, session_type=Launched, clock=clock)
    load.spec = dataclasses.replace(load.spec, duration_s=3.0 * rounds)
    result = load.run()
    assert result.rounds == rounds and session.calls == 3 * rounds

    lines = [json.loads(line) for line in (tmp_path / SAMPLES_FILE).read_text().splitlines()]
    assert [line.pop("number") for line in lines] == list(range(rounds + 1))
    samples = [
        ResourceSample(
            at_s=line["at_s"],
            requests_done=line["requests_done"],
            label=line["label"],
            instances={n: InstanceUsage(**u) for n, u in line["instances"].items()},
            storage={k: StorageUsage(**u) for k, u in line["storage"].items()},
            cleaned={k: StorageUsage(**u) for k, u in line["cleaned"].items()},
        )
        for line in lines
    ]
    assert [s.label for s in samples] == ["before", *(f"round {n}" for n in range(1, rounds + 1))]
    # The verdicts are those of every sample: pd0's leak and its one read as not running.
    expected = bounds_over_every_sample(samples, load.bounds)
    assert result.problems == expected
    assert any(p.startswith("1E+1PD/pd0: RSS grew 354.0 MiB") for p in expected), expected
    assert "1E+1PD/pd0 not running at round 29" in expected
    assert result.stats is not None
    assert result.stats.instances == growth_over_every_sample(samples)

    # load.json lists the samples a reader needs whole, not one a round; the load holds no more.
    account = json.loads((tmp_path / "load.json").read_text())
    assert account["samples_taken"] == rounds + 1 and account["samples_file"] == SAMPLES_FILE
    listed = {row["number"]: row["kept_for"] for row in account["samples"]}
    assert len(listed) <= TREND_SAMPLES + 6 < rounds + 1
    assert {0, 1, 29, rounds} <= set(listed)
    assert "first with an instance down" in listed[29]
    gc.collect()
    read_back = {id(sample) for sample in samples}
    held = [o for o in gc.get_objects() if type(o) is ResourceSample]
    held = [o for o in held if id(o) not in read_back]
    assert len(held) == len(listed), len(held)
    markdown = (tmp_path / "load.md").read_text()
    assert f"Sampled {rounds + 1} time(s): before, round 1 ... round {rounds}." in markdown


def test_a_history_lists_up_to_its_trend_limit_the_first_peak_and_names_the_last_once() -> None:
    """The trend keeps up to its limit of samples before thinning (4 of 4 here, all listed as
    trend); a storage's peak is the first sample that reached it; the labels are the first four
    and, only past four samples, the last's."""

    def sample(n: int, stored: int) -> ResourceSample:
        label = "before" if n == 0 else f"round {n}"
        return ResourceSample(float(n), n, label, storage={"kv": StorageUsage(1, stored)})

    history = ResourceHistory(trend_samples=4)
    for n, stored in enumerate((5, 10, 10, 7)):
        history.add(sample(n, stored))
    listed = {number: why for number, why, _ in history.listed()}
    assert listed == {
        0: ["first", "trend"],
        1: ["end of the first round: growth is held from here", "peak kv storage", "trend"],
        2: ["trend"],
        3: ["trend", "last"],
    }
    assert history.labels() == ["before", "round 1", "round 2", "round 3"]
    history.add(sample(4, 0))
    assert history.labels() == ["before", "round 1", "round 2", "round 3", "round 4"]


def test_a_soak_holds_each_instances_process_tree_once_however_many_rounds_it_ran(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process trees (what must be gone once the topology is stopped) are read before the
    first round: a list extended at every sample would grow with the soak's length."""
    rounds = 5
    clock = SoakClock()
    monkeypatch.setattr(run_module, "time", SimpleNamespace(monotonic=clock.monotonic))
    monkeypatch.setattr(sessions_module, "TopologySession", Launched)
    monkeypatch.setattr(samples_module, "tree_usage", leaking_usage(random.Random(3)))
    monkeypatch.setattr(samples_module, "tree_pids", lambda pid: [pid, f"{pid}-engine"])
    load, _ = stand_in_load(tmp_path, requests=3, session_type=Launched, clock=clock)
    load.spec = dataclasses.replace(load.spec, duration_s=3.0 * rounds)
    result = load.run()
    assert result.rounds == rounds
    assert result.processes == ["e0", "e0-engine", "pd0", "pd0-engine"]


class WrongAnswers(TimedStandIn):
    """A broken build: every request is answered with the next prompt's answer."""

    def send(self, prompt: str, body: dict[str, Any]) -> Outcome:
        names = sorted(self.answers)
        self.swap[self.calls + 1] = names[(names.index(prompt) + 1) % len(names)]
        return super().send(prompt, body)


def test_a_soak_where_everything_fails_keeps_whole_the_first_of_each_prompt_and_verdict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    rounds, per_round = 30, 6
    clock = SoakClock()
    monkeypatch.setattr(run_module, "time", SimpleNamespace(monotonic=clock.monotonic))
    load, session = stand_in_load(
        tmp_path, requests=per_round, session_type=WrongAnswers, clock=clock
    )
    load.spec = dataclasses.replace(load.spec, duration_s=float(rounds * per_round))
    result = load.run()
    assert isinstance(session, WrongAnswers)
    total = rounds * per_round
    assert result.rounds == rounds and result.tally.requests == total
    assert result.tally.verdicts == {"MISMATCH": total} and not result.passed

    # Kept whole: the first 20 of each prompt's MISMATCHes (the first round's among them): a
    # round sends each prompt of the mix once.
    prompts = sorted({r.prompt for r in result.results})
    assert len(prompts) == per_round
    kept = [r.number for r in result.results]
    assert kept == list(range(1, 20 * per_round + 1))
    assert result.failed_unlisted == {(p, "MISMATCH"): rounds - 20 for p in prompts}
    gc.collect()
    alive = {call for call, answer in session.answered.items() if answer() is not None}
    assert alive == set(kept)
    # The run's bundle holds the same requests whole.
    bundled = sorted(
        int(label.rsplit(":", 1)[1])
        for label in load.sweep.result.outcomes
        if label.startswith("load:")
    )
    assert bundled == kept and len(load.sweep.result.records) == len(kept)

    # Every one counted, and a line of load-requests.jsonl; load.json and load.md say where.
    lines = (tmp_path / REQUESTS_FILE).read_text().splitlines()
    assert len(lines) == total
    account = json.loads((tmp_path / "load.json").read_text())
    assert [row["number"] for row in account["requests"]] == kept
    assert account["requests_unlisted"] == total - len(kept)
    assert account["requests_failed_unlisted"] == [
        {"prompt": p, "verdict": "MISMATCH", "requests": rounds - 20} for p in prompts
    ]
    markdown = (tmp_path / "load.md").read_text()
    assert f"{total - len(kept)} more request(s) did not pass (" in markdown
    assert f"{prompts[0]} MISMATCH {rounds - 20}" in markdown


class NothingReachesD(TimedStandIn, NixlStandIn):
    """1P+1D under NIXL where no request's KV ever reaches D: every round's account fails."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.withheld = None

    def send(self, prompt: str, body: dict[str, Any]) -> Outcome:
        outcome = super().send(prompt, body)
        assert outcome.result is not None
        tokens = len(outcome.result.prompt_token_ids)
        self.p2p -= tokens
        self.computed += tokens
        return outcome


def test_a_soak_under_nixl_keeps_the_kv_accounts_that_failed_first_and_counts_every_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rounds, per_round = 30, 2
    clock = SoakClock()
    monkeypatch.setattr(run_module, "time", SimpleNamespace(monotonic=clock.monotonic))
    load, _ = stand_in_load(tmp_path, requests=per_round, session_type=NothingReachesD, clock=clock)
    load.spec = dataclasses.replace(load.spec, duration_s=float(rounds * per_round))
    result = load.run()
    assert result.rounds == rounds
    assert result.kv.rounds == result.kv.failed == rounds and result.kv.held == 0
    assert [n for n, _ in result.kv.kept] == list(range(1, 21))
    assert len(result.kv_accounts) == 20 and all(a.failed for a in result.kv_accounts)
    kv_problems = [p for p in result.problems if "KV account" in p]
    assert len(kv_problems) == 21 and kv_problems[0].startswith("round 1, KV account:")
    assert kv_problems[-1] == (
        "KV account: 10 more round(s) failed than the 20 above, each a line of "
        "load-kv-accounts.jsonl"
    )
    lines = [json.loads(line) for line in (tmp_path / KV_ACCOUNTS_FILE).read_text().splitlines()]
    assert [line["round"] for line in lines] == list(range(1, rounds + 1))
    assert not any(line["ok"] for line in lines)
    account = json.loads((tmp_path / "load.json").read_text())
    assert [a["round"] for a in account["kv_accounts"]] == list(range(1, 21))
    counted = account["kv_accounts_counted"]
    sources = counted.pop("prompt_tokens_by_source")
    assert counted == {
        "rounds": rounds,
        "held": 0,
        "failed": rounds,
        "not_checkable": 0,
        "file": KV_ACCOUNTS_FILE,
    }
    # D computed every prompt itself, every round: the sum over all of them says so.
    assert sources["local_compute_tokens"] > 0 and sources["p2p_cached_tokens"] == 0, sources
    report = (tmp_path / "load.md").read_text()
    assert "0 of 30 round(s) held" in report and "; over all 30 rounds D took" in report


def test_a_failure_is_kept_whole_however_often_its_prompt_passed_with_the_same_verdict() -> None:
    """Kept whole are the first failures of each prompt and verdict: what passed earlier with
    that verdict does not use up their room. A MATCH can fail (a guard found the KV
    recomputed); in a soak whose first rounds passed with MATCH, that failure was unlisted."""

    def request(number: int, round_number: int, passed: bool) -> LoadRequestResult:
        return LoadRequestResult(
            number=number,
            prompt="ld-shared-a",
            region="no media",
            outcome=Outcome("ld-shared-a", error=None),
            record=case_record(prompt="ld-shared-a", passed=passed),
            batched=False,
            started_s=0.0,
            ended_s=1.0,
            round_number=round_number,
        )

    result = LoadResult(LoadSpec("1E+1PD", requests=3, concurrency=1, distinct_media=3))
    passing = FAILURES_KEPT_WHOLE + 1
    result.add([request(n, 1, passed=True) for n in range(1, passing + 1)])
    _, kept = result.add([request(passing + 1, 2, passed=False)])
    assert [r.number for r in kept] == [passing + 1]
    assert not result.failed_unlisted


def test_a_sample_reads_each_storage_and_cleans_the_kv_one_only_between_rounds(
    tmp_path: Path,
) -> None:
    """The EC storage is never cleaned (an encoder holding an item's embeddings does not
    write them again) and the KV one only between a soak's rounds, after it was read."""
    ec, kv = tmp_path / "ec", tmp_path / "kv"
    ec.mkdir()
    kv.mkdir()
    (ec / "item").write_bytes(b"e" * 10)
    (kv / "a").write_bytes(b"k" * 300)
    (kv / "b").write_bytes(b"k" * 200)
    session: Any = stand_in_with_storage(ec, kv, "ExampleConnector")
    result = LoadResult(LoadSpec("1E+1P+1D", requests=3, concurrency=1, distinct_media=3))
    samples_module.sample_resources(session, "after", 1.0, result, tmp_path)
    last = result.resources.last
    assert last is not None and not last.cleaned
    assert last.storage == {"ec": StorageUsage(1, 10), "kv": StorageUsage(2, 500)}
    samples_module.sample_resources(session, "round 1", 2.0, result, tmp_path, clean_kv=True)
    last = result.resources.last
    assert last is not None and last.storage["kv"] == StorageUsage(2, 500)
    assert last.cleaned == {"kv": StorageUsage(2, 500)}
    assert not list(kv.iterdir()) and list(ec.iterdir()) == [ec / "item"]


def stand_in_with_storage(ec: Path, kv: Path, kv_connector: str) -> Any:
    """A session with these storage directories, served with `kv_connector` (vLLM's class)."""
    serving = SimpleNamespace(kv_connector=kv_connector)
    return SimpleNamespace(ec_storage=ec, kv_storage=kv, settings=SimpleNamespace(serving=serving))


def test_under_nixl_no_kv_storage_is_sampled(tmp_path: Path) -> None:
    """Real vLLM (`load --kv-connector nixl`): load.md gave a KV storage row of 0 files, which
    read as if no KV had moved; NIXL keeps the KV in P's memory and shares no directory."""
    ec, kv = tmp_path / "ec", tmp_path / "kv"
    ec.mkdir()
    kv.mkdir()
    session = stand_in_with_storage(ec, kv, "NixlConnector")
    result = LoadResult(LoadSpec("1E+1P+1D", requests=3, concurrency=1, distinct_media=3))
    samples_module.sample_resources(session, "after", 1.0, result, tmp_path)
    last = result.resources.last
    assert last is not None and set(last.storage) == {"ec"}, last.storage


def test_a_load_without_shared_storage_says_so_instead_of_an_empty_table() -> None:
    """1P+1D under NIXL shares no directory: load.md's storage table would be headers alone."""
    from harness.report.load import resource_lines

    up = InstanceUsage(rss_bytes=2**30, open_fds=100, processes=2)
    history = ResourceHistory.of([ResourceSample(0.0, 0, "before", {"1P+1D/decode0": up})])
    lines = resource_lines(load_stats(LoadTally(), history), history)
    assert lines[-1] == "Storage: none sampled (no connector here shares a directory).", lines
    assert not any(line.startswith("| storage") for line in lines), lines


def test_what_the_harness_cleaned_is_summed_over_every_sample_that_cleaned() -> None:
    """load.md says how much the soak's cleaning removed: every cleaning's bytes, by kind, not
    the last one's."""
    cleaned = {"kv": StorageUsage(files=2, bytes=3 * 2**20)}
    samples = [
        ResourceSample(at_s=float(n), requests_done=n, label=f"round {n}", cleaned=cleaned)
        for n in range(3)
    ]
    history = ResourceHistory.of([*samples, ResourceSample(9.0, 9, "after")])
    assert (history.cleaned_samples, history.cleaned_bytes) == (3, {"kv": 9 * 2**20})


def test_growth_up_to_its_bound_passes_and_a_byte_or_a_file_more_fails() -> None:
    """The bounds are what growth may reach: RSS up to 256 MiB and 64 open files more after the
    first round pass; one byte or one file beyond fails."""

    def soak(rss_growth: int, fd_growth: int) -> list[str]:
        def sample(n: int, rss: int, fds: int) -> ResourceSample:
            usage = InstanceUsage(rss_bytes=rss, open_fds=fds, processes=3)
            return ResourceSample(float(n), n, f"round {n}", instances={"decode0": usage})

        base = sample(1, 2**30, 100)
        end = sample(2, 2**30 + rss_growth, 100 + fd_growth)
        return bound_problems(ResourceHistory.of([sample(0, 0, 0), base, end]), SoakBounds())

    assert soak(256 * 2**20, 64) == []
    assert [p.split(" grew")[0] for p in soak(256 * 2**20 + 1, 65)] == [
        "decode0: RSS",
        "decode0: open files",
    ]


def test_storage_up_to_its_bound_passes_and_a_byte_more_fails() -> None:
    """As growth: a storage may reach its bound (512 MiB at its peak); one byte beyond fails."""

    def soak(peak: int) -> list[str]:
        def sample(n: int, stored: int) -> ResourceSample:
            usage = InstanceUsage(rss_bytes=2**30, open_fds=100, processes=3)
            return ResourceSample(
                float(n),
                n,
                f"round {n}",
                instances={"decode0": usage},
                storage={"kv": StorageUsage(files=1, bytes=stored)},
            )

        history = ResourceHistory.of([sample(0, 0), sample(1, peak), sample(2, 0)])
        return bound_problems(history, SoakBounds())

    assert soak(512 * 2**20) == []
    assert soak(512 * 2**20 + 1) == ["kv storage reached 512.0 MiB (bound 512 MiB)"]


class WritesKv(TimedStandIn):
    """Each request leaves a file in the KV storage, as a connector's store does."""

    def send(self, prompt: str, body: dict[str, Any]) -> Outcome:
        outcome = super().send(prompt, body)
        (self.kv_storage / f"{self.calls}.bin").write_bytes(b"kv")
        return outcome


def test_a_soak_cleans_the_kv_storage_between_rounds_and_leaves_the_last_rounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The KV storage is cleaned to make room for the next round, never after the last: what
    the soak's last round stored is there to read after it, and load.md's cleaned bytes are
    those cleaned between rounds."""
    clock = SoakClock()
    monkeypatch.setattr(run_module, "time", SimpleNamespace(monotonic=clock.monotonic))
    load, session = stand_in_load(tmp_path, requests=3, session_type=WritesKv, clock=clock)
    session.kv_storage = tmp_path / "kv"
    session.kv_storage.mkdir()
    load.spec = dataclasses.replace(load.spec, duration_s=5.0)  # 3 s a round: 2 rounds
    result = load.run()
    assert result.rounds == 2
    lines = [json.loads(line) for line in (tmp_path / SAMPLES_FILE).read_text().splitlines()]
    assert [(line["label"], line["cleaned"]) for line in lines] == [
        ("before", {}),
        ("round 1", {"kv": {"files": 3, "bytes": 6}}),
        ("round 2", {}),
    ]
    assert sorted(p.name for p in session.kv_storage.iterdir()) == ["4.bin", "5.bin", "6.bin"]


def test_an_instance_that_died_during_the_load_is_marked_in_the_resources_table() -> None:
    """Real vLLM (`load --kill encoder`): the table gave the killed encoder "RSS last 1483 MiB",
    its last figure while alive, as if it still ran. Its row says from which sample it was down."""
    from harness.report.load import resource_lines

    def sample(n: int, label: str, encoder_alive: bool) -> ResourceSample:
        up = InstanceUsage(rss_bytes=2**30, open_fds=100, processes=2)
        encoder = up if encoder_alive else InstanceUsage(alive=False)
        return ResourceSample(
            float(n), n, label, instances={"1E+1P+1D/encoder0": encoder, "1E+1P+1D/decode0": up}
        )

    history = ResourceHistory.of([sample(0, "before", True), sample(1, "after", False)])
    lines = resource_lines(load_stats(LoadTally(), history), history)
    rows = {line.split(" | ")[0]: line for line in lines if line.startswith("| 1E+1P+1D/")}
    assert set(rows) == {
        "| 1E+1P+1D/encoder0 (down from sample 'after': its figures are from before)",
        "| 1E+1P+1D/decode0",
    }, rows


def test_an_instance_a_request_sent_alone_ended_is_marked_though_no_sample_saw_it() -> None:
    """Real vLLM (`load --topology 1E+1P+1D --stream`): the tail request declared to end D is
    sent alone after the last sample, so D's row showed its live figures from before. The
    load says it ended after that request, with no sample taken (a soak's growth and bounds
    stay its rounds')."""
    from harness.report.load import resource_lines

    up = InstanceUsage(rss_bytes=2**30, open_fds=100, processes=2)
    history = ResourceHistory.of(
        [
            ResourceSample(float(n), n, label, {"1E+1P+1D/decode0": up})
            for n, label in enumerate(("before", "after"))
        ]
    )
    history.ended_after_the_samples("1E+1P+1D/decode0", "after request 8 (sent alone)")
    history.ended_after_the_samples("1E+1P+1D/prefill0", "after request 8 (sent alone)")
    lines = resource_lines(load_stats(LoadTally(), history), history)
    rows = [line.split(" | ")[0] for line in lines if line.startswith("| 1E+1P+1D/")]
    assert rows == [
        "| 1E+1P+1D/decode0 (down after request 8 (sent alone): its figures are from before)"
    ], rows
    assert history.down is None and history.count == 2  # no sample, nothing for the bounds
