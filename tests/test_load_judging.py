"""Loads, without servers: the mix and its plan, where media land, the matcher that names
whose answer a response is, batched answers under the reference policy, the load's
statistics and bounds, and the load's handling of a death (a stand-in session: pure logic)."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from harness.judge.guards import GuardResult, not_checkable
from harness.judge.policy import EXACT_EVERYWHERE, ReferencePolicy
from harness.judge.records import EXACT, LOGPROB_CLOSE, Verdict
from harness.judge.verdicts import JudgingRules
from harness.outcomes.chat import ChatResult, PositionLogprobs
from harness.outcomes.load import InstanceUsage, ResourceSample, StorageUsage
from harness.outcomes.outcome import Outcome, ServedTopology
from harness.outcomes.taps import TapRecord
from harness.report.load import (
    KV_ACCOUNTS_FILE,
    KvAccountLog,
    LoadRequestResult,
    load_stats,
    percentile,
    role_seconds,
    tally_of,
)
from harness.report.resources import ResourceHistory, SoakBounds, bound_problems, growth
from harness.run.baseline import BatchCalibration
from harness.run.judging import Observed
from harness.run.load.account import account_notes
from harness.run.load.calibration import calibrate_ahead
from harness.run.load.death import KILL_END_S, kill_problems
from harness.run.load.kv_account import accounts_kv
from harness.run.load.plan import decode_tail_failure, media_token_ids, plan_load
from harness.run.load.result import LoadResult
from harness.run.load.run import LoadRun
from harness.run.load.sending import Sent, carrier
from harness.run.sweep import Sweep, SweepSpec
from harness.serve.kv_metrics import KvCounters
from harness.serve.session import DeadInstance, TopologySession
from harness.spec.load import (
    DEFAULT_DISTINCT_MEDIA,
    MAX_CONCURRENCY,
    MAX_REQUESTS,
    MAX_SOAK_S,
    MIN_DISTINCT_MEDIA,
    SHARED_MEDIA,
    TAIL_PROMPT,
    LoadSpec,
    PlannedRequest,
    Region,
    distinct_media_of,
    load_mix,
    media_placement,
    mix_size,
    most_distinct_media,
    plan_requests,
)
from harness.spec.platforms import CUDA
from harness.spec.prompts import TextPart, VideoPart
from harness.spec.settings import RunSettings
from harness.spec.topology import TOPOLOGIES, ServingConfig
from harness.testing.builders import case_record
from harness.testing.judging import judged

pytestmark = pytest.mark.unit

IMAGE = 785

# -- the mix and its plan --------------------------------------------------------------------


@pytest.mark.parametrize("k", [3, 8, 12])
def test_the_mix_has_k_distinct_media_shared_and_unique(k: int) -> None:
    mix = load_mix(k)
    assert distinct_media_of(mix) == k
    assert len({p.name for p in mix}) == len(mix)
    uses: dict[Any, int] = {}
    for prompt in mix:
        for part in set(p for p in prompt.parts if not isinstance(p, TextPart)):
            uses[part] = uses.get(part, 0) + 1
    shared = [part for part, n in uses.items() if n > 1]
    assert len(shared) == SHARED_MEDIA and all(n == 1 for p, n in uses.items() if p not in shared)
    assert TAIL_PROMPT in {p.name for p in mix} and any(not p.media_count for p in mix)
    assert len(mix) == mix_size(k), "what --media is checked against, counted without the mix"
    # Each medium drawn from a seed of its own: one seed at two sizes draws the same colours
    # and shapes (fixtures.media), a unique prompt's image then a near copy of a shared one.
    assert len({part.seed for part in uses}) == k
    # The fourth medium is a video, so a load of the default mix sends video through the EC
    # hop too; the smallest mixes have no room for it.
    assert any(isinstance(part, VideoPart) for part in uses) is (k > 4)


@pytest.mark.parametrize("requests", [12, 13, 64])
@pytest.mark.parametrize("ending", [frozenset(), frozenset({TAIL_PROMPT})])
def test_the_most_media_a_load_takes_are_every_one_sent_in_a_round(
    requests: int, ending: frozenset[str]
) -> None:
    """`most_distinct_media` is the relation `load --media` is refused by: at the most, every
    prompt of the mix goes out in each round (the tail prompt too, last and alone where it
    is declared to end an instance); one medium more and a prompt never does."""
    most = most_distinct_media(requests)
    for media, all_sent in ((most, True), (most + 1, False)):
        names = [p.name for p in load_mix(media)]
        sent = {r.prompt for r in plan_requests(names, requests, ending)}
        assert (sent == set(names)) is all_sent, (media, sorted(set(names) - sent))
    assert most_distinct_media(1) == DEFAULT_DISTINCT_MEDIA, "the default mix goes with any load"


def test_too_few_media_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 3"):
        load_mix(2)


@pytest.mark.parametrize(
    "fields, cause",
    [
        ({"requests": 0}, "at least one request and a concurrency of one"),
        ({"concurrency": 0}, "at least one request and a concurrency of one"),
        ({"distinct_media": MIN_DISTINCT_MEDIA - 1}, "at least 3 distinct media"),
        ({"requests": 4, "distinct_media": 20}, "some media would never be sent"),
        ({"requests": MAX_REQUESTS + 1}, "at most 100000 requests a round"),
        ({"concurrency": MAX_CONCURRENCY + 1}, "at most 1000 in flight"),
        ({"duration_s": float("nan")}, "positive number of seconds"),
        ({"duration_s": 0.0}, "positive number of seconds"),
        ({"duration_s": MAX_SOAK_S + 1.0}, "at most 86400 s"),
    ],
)
def test_a_load_spec_refuses_what_a_load_cannot_honour(fields: dict[str, Any], cause: str) -> None:
    """A load scenario's `epd_load(LoadSpec(...))` mark never passes the CLI's checks. Found in
    review: such a spec's media past what its requests send were silently never sent, and a
    NaN duration soaked for ever (no clock reading is past it)."""
    with pytest.raises(ValueError, match=cause):
        LoadSpec("1E+1PD", **fields)


def test_a_plan_sends_prompts_round_robin_and_each_ending_one_last_alone() -> None:
    plan = plan_requests(["a", "b", "tail"], 8, frozenset({"tail"}))
    assert [r.prompt for r in plan] == ["a", "b", "a", "b", "a", "b", "a", "tail"]
    assert [r.number for r in plan] == list(range(1, 9))
    assert [r.alone for r in plan] == [False] * 7 + [True]
    assert plan[4].name == "request 5"
    with pytest.raises(ValueError):
        plan_requests(["tail"], 4, frozenset({"tail"}))
    # One request a round is the ending prompt's alone: the load would send nothing else.
    with pytest.raises(ValueError, match="1 request"):
        plan_requests(["a", "tail"], 1, frozenset({"tail"}))
    assert [r.prompt for r in plan_requests(["a", "tail"], 2, frozenset({"tail"}))] == [
        "a",
        "tail",
    ]


@pytest.mark.parametrize(
    "ids, region",
    [
        ([1] * 10, Region.NO_MEDIA),
        ([1, IMAGE, IMAGE] + [2] * 80, Region.PREFIX),  # 83 tokens: D computes from 64
        ([1] * 40 + [IMAGE] * 20 + [2] * 23, Region.LAST_BLOCK),  # media end at 60 <= 64
        ([1] * 40 + [IMAGE] * 30 + [2] * 13, Region.DECODE_TAIL),  # media end at 70 > 64
        # the edges: media ending right where D starts are all transferred, and media ending
        # at the last transferred block's start are in the prefix before it
        ([1] * 40 + [IMAGE] * 24 + [2] * 19, Region.LAST_BLOCK),  # media end at 64 = 64
        ([1] * 10 + [IMAGE] * 22 + [2] * 51, Region.PREFIX),  # media end at 32 = 64 - 32
        # one past each edge: a placeholder at position 64 is D's own, one at 32 is in the
        # last transferred block
        ([1] * 40 + [IMAGE] * 25 + [2] * 18, Region.DECODE_TAIL),  # media end at 65 > 64
        ([1] * 10 + [IMAGE] * 23 + [2] * 50, Region.LAST_BLOCK),  # media end at 33 > 32
        # 96 tokens: D computes the last one, so its own part starts at 64, not 96
        ([1] * 40 + [IMAGE] * 30 + [2] * 26, Region.DECODE_TAIL),
    ],
)
def test_where_media_end_against_the_part_d_recomputes(ids: list[int], region: Region) -> None:
    placement = media_placement(ids, frozenset({IMAGE}), 32)
    assert placement.region is region, placement.describe()


def test_the_decode_tail_failure_is_the_matrix_declaration_per_connector() -> None:
    epd = TOPOLOGIES["1E+1P+1D"]
    declared = decode_tail_failure(epd, "ExampleConnector")
    assert declared is not None and declared.verdict == "ERROR"
    assert "multimodal embeddings" in declared.evidence
    assert decode_tail_failure(epd, "NixlConnector") is None
    assert decode_tail_failure(TOPOLOGIES["1E+1PD"], "ExampleConnector") is None


def test_media_token_ids_come_from_the_model_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"image_token_id": 7, "video_token_id": 8}))
    assert media_token_ids(str(tmp_path)) == {7, 8}
    assert media_token_ids("org/hub-name") == frozenset()
    # A config that nests them in its text_config: read there too.
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"image_token_id": 9}}))
    assert media_token_ids(str(tmp_path)) == {9}


# -- whose answer, batched answers -------------------------------------------------------------


def result(tokens: tuple[int, ...], prompt: tuple[int, ...] = (1, 2, 3), lp: float = -1.0):
    logprobs = tuple(PositionLogprobs(t, lp, ((t, lp), (t + 1, lp - 0.01))) for t in tokens)
    return ChatResult(prompt, tokens, "", "length", logprobs)


def judge(candidate: ChatResult, reference: ChatResult, **kwargs: Any):
    reference_outcome, candidate_outcome = (
        Outcome("a", result=reference),
        Outcome("a", result=candidate),
    )
    return judged("1E+1P+1D:load#17", "baseline", reference_outcome, candidate_outcome, **kwargs)


def test_an_answer_that_is_another_requests_is_named() -> None:
    mine, theirs = result((5, 6, 7)), result((8, 9), prompt=(1, 2, 4))
    others = [("request 4", Outcome("b", result=theirs)), ("request 9", Outcome("c"))]
    record = judge(theirs, mine, others=others)
    assert record.verdict is Verdict.MISMATCH
    assert record.detail.startswith("received request 4's answer: prompt ids differ"), record.detail


def test_another_requests_generation_on_its_own_prompt_is_named() -> None:
    mine, theirs = result((5, 6, 7)), result((8, 9), prompt=(1, 2, 4))
    candidate = result((8, 9))  # its own prompt ids, request 4's tokens
    record = judge(candidate, mine, others=[("request 4", Outcome("b", result=theirs))])
    assert record.detail.startswith("generated request 4's answer (its prompt ids are its own)")


def test_an_answer_like_no_other_is_a_plain_mismatch() -> None:
    record = judge(
        result((5, 6, 8)), result((5, 6, 7)), others=[("r", Outcome("b", result=result((9,))))]
    )
    assert record.detail.startswith("generated tokens differ at position 2")


def near_tie_answer(reference: ChatResult) -> ChatResult:
    """`reference` (5, 6, 7) answered with 8 last, where 8 and 7 were a near tie (0.005 nats
    apart): a drift a batched floor may tolerate, a mismatch under an exact one."""
    return ChatResult(
        (1, 2, 3),
        (5, 6, 8),
        "",
        "length",
        (*reference.logprobs[:2], PositionLogprobs(8, -1.0, ((8, -1.0), (7, -1.005)))),
    )


def test_batched_answers_may_drift_within_the_floor_the_baseline_showed_batched() -> None:
    policy = ReferencePolicy(EXACT_EVERYWHERE)
    epd = TOPOLOGIES["1E+1P+1D"]
    assert policy.policy_for(epd, True, batched=True) is LOGPROB_CLOSE
    assert policy.policy_for(epd, True) is EXACT and policy.policy_for(epd, False, True) is EXACT
    reference = result((5, 6, 7))
    near_tie = near_tie_answer(reference)
    measured = JudgingRules(policy, 0.0, batched_noise_floor_nats=0.02)
    drift = judge(near_tie, reference, rules=measured, batched=True)
    assert drift.verdict is Verdict.DRIFT and drift.policy_passed
    unbatched = judge(near_tie, reference, rules=measured)
    assert unbatched.verdict is Verdict.MISMATCH and not unbatched.policy_passed
    zero = judge(near_tie, reference, rules=JudgingRules(policy, 0.0, 0.0), batched=True)
    assert zero.verdict is Verdict.MISMATCH  # a floor of 0: batched or not, exact


def test_a_batched_answer_may_drift_within_the_floor_its_caller_measured() -> None:
    """The floor a load's calibration measured at its concurrency (`CaseJudge.judge`'s
    batched_noise_floor) is its batched answers' tolerance beyond the run's. Found in review:
    a mutant that ignored it, holding every load to the baseline's batched pass alone (a
    calibrated load's near ties then fail as MISMATCH), survived every test."""
    from harness.judge.verdicts import Reference
    from harness.run.judging import CaseJudge, Observed

    reference = result((5, 6, 7))
    near_tie = near_tie_answer(reference)
    settings = RunSettings(
        serving=ServingConfig(model="/m"),
        run_dir=Path("/nonexistent"),
        reference_policy=EXACT_EVERYWHERE,
    )
    baseline = SimpleNamespace(
        label="baseline",
        noise_floor=0.0,  # the baseline's batched pass moved nothing
        reference=lambda prompt: Reference("baseline", Outcome(prompt, reference), True),
    )
    judging = CaseJudge(settings, baseline)  # type: ignore[arg-type]
    observed = Observed(Outcome("a", result=near_tie), ())
    epd = TOPOLOGIES["1E+1P+1D"]
    [drift] = judging.judge(epd, observed, batched=True, batched_noise_floor=0.02)
    assert drift.verdict is Verdict.DRIFT and drift.policy_passed, drift.detail
    [held] = judging.judge(epd, observed, batched=True)  # none measured: the run's floor, 0
    assert held.verdict is Verdict.MISMATCH and not held.policy_passed, held.detail


# -- statistics --------------------------------------------------------------------------------


def test_percentiles_are_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0
    assert percentile([3.0], 99) == 3.0
    # Where p% of the values falls between two ranks, the rank above: the smallest value with
    # at least p% of the values at or below it.
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([float(v) for v in range(1, 11)], 99) == 10.0


def test_growth_is_fitted_after_the_first_sample() -> None:
    g = growth([(0, 100.0), (60, 500.0), (120, 510.0), (180, 520.0)])
    assert g.first == 100.0 and g.last == 520.0 and g.per_minute == pytest.approx(10.0)
    assert growth([(0, 1.0), (60, 2.0)]).per_minute is None


def test_a_rate_is_fitted_from_two_points_after_the_first_and_a_late_rate_from_three() -> None:
    """The rate needs two points after the first; the late rate three in the last half (two
    would be the last step alone, no rate a cache levelling off could show); no points at all
    measured nothing, and say so (rate n/a), never a rate of 0."""
    short = growth([(0, 100.0), (60, 500.0), (120, 510.0)])
    assert short.per_minute == pytest.approx(10.0) and short.late_per_minute is None
    four_after = growth([(60 * m, 100.0 + 10 * m) for m in range(5)])  # late half: 2 points
    assert four_after.per_minute == pytest.approx(10.0) and four_after.late_per_minute is None
    six_after = growth([(60 * m, 100.0 + 10 * m) for m in range(7)])  # late half: 3 points
    assert six_after.late_per_minute == pytest.approx(10.0)
    nothing = growth([])
    assert (nothing.change, nothing.per_minute, nothing.late_per_minute) == (0.0, None, None)


def test_a_filling_cache_levels_off_where_a_leak_keeps_its_rate() -> None:
    minutes = range(11)
    filling = growth([(60 * m, 1000 - 500 * 0.5**m) for m in minutes])
    leaking = growth([(60 * m, 1000 + 10 * m) for m in minutes])
    assert filling.late_per_minute is not None and filling.late_per_minute < 2
    assert filling.per_minute is not None and filling.per_minute > 3 * filling.late_per_minute
    assert leaking.late_per_minute == pytest.approx(10.0)
    assert leaking.per_minute == pytest.approx(10.0)


def tap(role: str, seconds: float, status: int | None = 200) -> TapRecord:
    return TapRecord(0, f"t/{role}0", role, "/v1/chat/completions", status=status, seconds=seconds)


def load_result(number: int, verdict: Verdict, seconds: float, region: str = "prefix"):
    from harness.judge.records import CaseRecord

    record = CaseRecord(
        "t", "a", "baseline", verdict, verdict is Verdict.MATCH, "", None, {}, {}, None
    )
    outcome = Outcome(
        "a",
        result=result((1, 2, 3)) if verdict is not Verdict.ERROR else None,
        seconds=seconds,
        taps=[tap("encoder", 0.1), tap("encoder", 0.3), tap("decode", seconds / 2)],
    )
    return LoadRequestResult(
        number, "a", region, outcome, record, True, number - 1.0, number + seconds
    )


def test_load_stats_count_verdicts_latency_roles_and_regions() -> None:
    results = [load_result(n, Verdict.MATCH, 1.0 + n) for n in range(1, 5)]
    results.append(load_result(5, Verdict.ERROR, 0.5, region="decode tail"))
    stats = load_stats(tally_of(results), ResourceHistory())
    assert stats.verdicts == {"MATCH": 4, "ERROR": 1} and stats.passed == 4
    assert (
        stats.end_to_end.count == 4 and stats.end_to_end.p50 == 3.0 and stats.end_to_end.max == 5.0
    )
    assert stats.by_role["encoder"].p50 == 0.3  # a request's encoder calls: the longest
    assert stats.by_region == {"prefix": {"MATCH": 4}, "decode tail": {"ERROR": 1}}
    assert stats.tokens_per_s > 0 and stats.wall_s == pytest.approx(9.0)
    assert role_seconds(Outcome("a", taps=[tap("decode", 9.0, status=None)])) == {}


def test_the_tally_counts_what_was_sent_and_batched_whatever_order_requests_end_in() -> None:
    """Rows come as their round is judged, in number order, not start order; a request not
    sent is counted but neither sent nor timed."""
    later = load_result(2, Verdict.MATCH, 1.0)  # started at 1 s, ended at 3 s
    first = load_result(1, Verdict.MATCH, 1.5)  # started at 0 s, ended at 2.5 s
    first.number, first.batched = 3, False
    unsent = load_result(4, Verdict.ERROR, 0.0)
    unsent.not_sent, unsent.started_s, unsent.ended_s = True, 50.0, 99.0
    tally = tally_of([later, first, unsent])
    assert (tally.requests, tally.sent, tally.batched) == (3, 2, 1)
    assert (tally.first_started_s, tally.last_ended_s) == (0.0, 3.0)


def test_a_roles_time_is_its_longest_call_answered_or_failed() -> None:
    """A request's encoder calls run side by side: the role took the longest, whichever came
    last. A call that failed took its time too; one never answered has none."""
    failed = TapRecord(
        0, "t/prefill0", "prefill", "/v1/chat/completions", seconds=2.0, error="reset"
    )
    taps = [tap("encoder", 0.3), tap("encoder", 0.1), failed, tap("decode", 9.0, status=None)]
    assert role_seconds(Outcome("a", taps=taps)) == {"encoder": 0.3, "prefill": 2.0}


def sample(at: float, rss_mib: int, fds: int, kv_mib: int, alive: bool = True) -> ResourceSample:
    return ResourceSample(
        at_s=at,
        requests_done=0,
        label=f"at {at}",
        instances={"d": InstanceUsage(rss_mib * 2**20, fds, 3, alive)},
        storage={"kv": StorageUsage(10, kv_mib * 2**20)},
    )


def test_soak_bounds_hold_or_name_what_grew() -> None:
    held = [sample(0, 900, 50, 10), sample(60, 1200, 80, 20), sample(120, 1210, 81, 20)]
    assert bound_problems(ResourceHistory.of(held), SoakBounds()) == []
    leaking = [*held, sample(180, 1600, 200, 600), sample(240, 2000, 300, 20)]
    problems = bound_problems(ResourceHistory.of(leaking), SoakBounds())
    assert any(p.startswith("kv storage reached 600.0 MiB") for p in problems), problems
    assert any(p.startswith("d: RSS grew 800.0 MiB after the first round") for p in problems)
    assert any(p.startswith("d: open files grew by 220") for p in problems)
    dead = [*held, sample(180, 0, 0, 0, alive=False)]
    assert "d not running at at 180" in bound_problems(ResourceHistory.of(dead), SoakBounds())


def test_a_soak_within_its_first_round_measured_no_growth_and_says_so() -> None:
    """Growth is held from the end of the first round (warm-up is not growth). Found in review:
    with no sample after it, the warm-up itself was held to the growth bound."""
    one_round = [sample(0, 900, 50, 10), sample(60, 1300, 60, 10)]  # warm-up: +400 MiB
    assert bound_problems(ResourceHistory.of(one_round), SoakBounds()) == [
        "growth after the first round was not measured: the soak ended within its first round "
        "(give a --duration longer than one round)"
    ]


def test_a_soak_that_sampled_no_instance_measured_no_growth_and_says_so() -> None:
    """Samples that hold storage only (as an attached deployment's did, before the CLI refused
    an attached soak). Found in review: the growth bounds looped over no instance and the soak
    passed with its RSS and open files never read."""
    storage_only = [
        dataclasses.replace(sample(at, 900, 50, 10), instances={}) for at in (0, 60, 120)
    ]
    problems = bound_problems(ResourceHistory.of(storage_only), SoakBounds())
    assert problems == [
        "RSS and open files were not measured: no instance's processes were sampled"
    ], problems


def test_a_calibration_says_which_answers_batching_changed() -> None:
    from harness.run.baseline import BatchedAnswer

    calibration = BatchCalibration(
        16,
        (
            BatchedAnswer("request 1", "a", True, 0.0, ""),
            BatchedAnswer("request 2", "b", False, 0.03, ""),
        ),
    )
    assert calibration.noise_floor == 0.03 and [a.prompt for a in calibration.changed] == ["b"]
    assert "batching changed the ids of 1 answer(s) (b)" in calibration.describe()


# -- a load's rounds, with a stand-in session ----------------------------------------------------


class StandIn:
    """What a load needs of a session, answering from a table: a prompt's baseline answer,
    another prompt's on cue, or nothing once `dies_after` requests were answered."""

    servers: tuple = ()  # no process to sample, where a test lets it pass for a TopologySession

    def __init__(
        self, answers: dict[str, ChatResult], settings: RunSettings, swap=None, dies_after=None
    ):
        self.answers = answers
        self.settings = settings
        self.topology = TOPOLOGIES["1E+1PD"]
        self.served = ServedTopology(self.topology, None, 32, "ExampleConnector")
        self.swap = swap or {}  # call number -> prompt whose answer is given instead
        self.dies_after = dies_after
        self.calls = 0
        self.ec_storage = self.kv_storage = None

    def send(self, prompt: str, body: dict[str, Any]) -> Outcome:
        self.calls += 1
        if self.dies_after is not None and self.calls > self.dies_after:
            return Outcome(prompt, error=f"{self.dead_instance_report()}\nHTTP 502")
        given = self.swap.get(self.calls, prompt)
        return Outcome(prompt, result=self.answers[given], seconds=0.01)

    def dead_instance(self) -> DeadInstance | None:
        if self.dies_after is not None and self.calls > self.dies_after:
            return DeadInstance("1E+1PD/pd0", -9, Path("pd0.log"), "...")
        return None

    dead_instance_report = TopologySession.dead_instance_report


class NixlStandIn(StandIn):
    """1P+1D under NIXL: D's p2p counter grows by each prompt it receives, and each request's
    own reading also holds a neighbour's transfer, as when requests overlap. `withheld`: the
    call whose KV never reaches D (D computed it itself)."""

    def __init__(self, answers: dict[str, ChatResult], settings: RunSettings, withheld=None):
        super().__init__(answers, settings)
        self.topology = TOPOLOGIES["1P+1D"]
        self.served = ServedTopology(self.topology, None, 32, "NixlConnector")
        self.withheld = withheld
        self.p2p = self.computed = 0.0

    def send(self, prompt: str, body: dict[str, Any]) -> Outcome:
        outcome = super().send(prompt, body)
        assert outcome.result is not None
        tokens = len(outcome.result.prompt_token_ids)
        if self.calls == self.withheld:
            self.computed += tokens
        else:
            self.p2p += tokens
        outcome.kv_counters = {"p2p_cached_tokens": 2.0 * tokens, "nixl_failed_transfers": 0.0}
        return outcome

    def decode_counters(self) -> KvCounters:
        return KvCounters({"p2p_cached_tokens": self.p2p, "local_compute_tokens": self.computed})


def stand_in_load(
    tmp_path: Path,
    requests: int,
    session_type: type[StandIn] = StandIn,
    concurrency: int = 1,
    **stand_in: Any,
) -> tuple[LoadRun, StandIn]:
    nixl = issubclass(session_type, NixlStandIn)
    serving = ServingConfig(
        model=str(tmp_path / "no-model"),
        kv_connector="NixlConnector" if nixl else "ExampleConnector",
    )
    settings = RunSettings(serving=serving, run_dir=tmp_path)
    mix = load_mix(3)
    sweep = Sweep(SweepSpec((), (), baseline_only_prompts=mix), settings)
    # 40-token prompts: a withheld one leaves D far more to compute than the NIXL rule's one
    # token a request.
    answers = {
        p.name: result((10 + n, 20 + n), prompt=(1, n, *range(100, 138))) for n, p in enumerate(mix)
    }
    for name, answer in answers.items():
        sweep.baseline.outcomes[name] = Outcome(name, result=answer)
    from harness.judge.verdicts import Stability

    sweep.baseline.stability = {name: Stability(True, "stable", 0.0) for name in answers}
    session = session_type(answers, settings, **stand_in)
    sweep.pool.session = lambda topology, settings=None, devices=None: session  # type: ignore[method-assign]
    topology = "1P+1D" if nixl else "1E+1PD"
    spec = LoadSpec(topology, requests=requests, concurrency=concurrency, distinct_media=3)
    return LoadRun(spec, sweep, on_progress=lambda _: None), session


def test_every_request_is_judged_and_a_swapped_answer_is_named(tmp_path: Path) -> None:
    load, _ = stand_in_load(tmp_path, requests=10, swap={3: "ld-shared-a"})
    result_ = load.run()
    assert len(result_.results) == 10 and result_.rounds == 1
    third = result_.results[2]
    assert third.record.verdict is Verdict.MISMATCH
    assert third.record.detail.startswith("received request 1's answer"), third.record.detail
    assert all(r.record.policy_passed for n, r in enumerate(result_.results) if n != 2)
    assert not result_.passed
    account = json.loads((tmp_path / "load.json").read_text())
    assert account["stats"]["verdicts"] == {"MATCH": 9, "MISMATCH": 1}
    assert "received request 1's answer" in (tmp_path / "load.md").read_text()


def test_a_death_ends_the_load_and_every_later_request_says_why(tmp_path: Path) -> None:
    load, session = stand_in_load(tmp_path, requests=10, dies_after=4)
    result_ = load.run()
    assert session.calls == 5  # the fifth found the instance dead: nothing was sent after it
    assert result_.ended_by == "instance 1E+1PD/pd0 exited with code -9 (its log: pd0.log)"
    verdicts = [r.record.verdict for r in result_.results]
    assert verdicts == [Verdict.MATCH] * 4 + [Verdict.ERROR] * 6
    for later in result_.results[4:]:
        assert "instance 1E+1PD/pd0 exited with code -9" in later.record.detail
    assert [r.not_sent for r in result_.results] == [False] * 5 + [True] * 5
    assert result_.results[5].record.detail.startswith(
        "request failed: not sent: the load had ended: instance 1E+1PD/pd0 exited with code -9"
    ), result_.results[5].record.detail
    # load.md's figures say the five never left, not that 5 + 5 made the 10.
    assert "; 5 never sent: the load ended first); verdicts:" in (tmp_path / "load.md").read_text()
    assert not result_.passed


def test_a_load_whose_every_request_left_names_none_never_sent(tmp_path: Path) -> None:
    """load.md counts the batched among the sent ("of them"), and says "never sent" only of
    a load that ended first: a whole load's line read "; 0 never sent" otherwise."""
    load, _ = stand_in_load(tmp_path, requests=4)
    load.run()
    text = (tmp_path / "load.md").read_text()
    assert "- requests: 4 (4 sent, 0 of them in flight with another); verdicts:" in text, text
    assert "never sent" not in text, text


def test_a_request_never_sent_says_what_ended_the_load_before_its_turn() -> None:
    """A planted kill's unsent requests name the killed instance (first, as `kill_problems`
    wants); a death that ended the load is quoted; with neither, the load just ended."""
    spec = LoadSpec("1E+1PD", requests=4, concurrency=2, distinct_media=3, kill="pd")
    why = LoadRun._unsent_why
    killed = SimpleNamespace(result=LoadResult(spec, killed="1E+1PD/pd0"))
    assert why(killed) == "not sent: 1E+1PD/pd0 was killed (planted) before its turn"  # type: ignore[arg-type]
    died = SimpleNamespace(result=LoadResult(spec, ended_by="instance 1E+1PD/pd0 exited"))
    assert why(died) == "not sent: the load had ended: instance 1E+1PD/pd0 exited"  # type: ignore[arg-type]
    assert why(SimpleNamespace(result=LoadResult(spec))) == "not sent: the load had ended"  # type: ignore[arg-type]


def test_a_swapped_answer_is_never_named_after_a_request_that_was_not_sent(tmp_path: Path) -> None:
    """Requests 1 and 8 carry ld-shared-a; request 5 is answered with its answer, then the
    instance dies and request 8 is never sent. Found in review: the nearest carrier by number
    was named whether it was sent or not ("received request 8's answer")."""
    load, _ = stand_in_load(tmp_path, requests=10, dies_after=5, swap={5: "ld-shared-a"})
    result_ = load.run()
    assert result_.results[7].prompt == "ld-shared-a" and result_.results[7].not_sent
    fifth = result_.results[4]
    assert fifth.record.verdict is Verdict.MISMATCH
    assert fifth.record.detail.startswith("received request 1's answer"), fifth.record.detail


def test_a_round_under_nixl_is_accounted_against_ds_counters_as_a_whole(tmp_path: Path) -> None:
    load, _ = stand_in_load(tmp_path, requests=6, session_type=NixlStandIn)
    result_ = load.run()
    assert result_.passed, result_.problems
    [account] = result_.kv_accounts
    assert account.ok and account.evidence.startswith(
        "6 request(s), 240 prompt tokens: D took 240 from P"
    )
    assert json.loads((tmp_path / "load.json").read_text())["kv_accounts"][0]["ok"] is True
    assert (
        "KV account (D's counters over each whole round): 1 of 1"
        in (tmp_path / "load.md").read_text()
    )


def test_a_request_whose_kv_never_moved_fails_the_round_though_its_own_reading_held(
    tmp_path: Path,
) -> None:
    load, _ = stand_in_load(tmp_path, requests=6, session_type=NixlStandIn, withheld=4)
    result_ = load.run()
    assert all(r.record.verdict is Verdict.MATCH for r in result_.results), "each reading held"
    assert not result_.passed
    assert result_.kv_accounts[0].failed
    [problem] = result_.problems
    assert (
        problem.startswith("round 1, KV account:") and "D computed 34 prompt tokens more" in problem
    )
    assert json.loads((tmp_path / "load.json").read_text())["passed"] is False


def test_a_load_failed_by_its_problems_alone_is_red_in_every_report_of_its_bundle(
    tmp_path: Path,
) -> None:
    """Every request MATCH on its own reading, and the round's KV account failed the load
    (exit 1). Found in review: the load's problems never reached the run's `problems`, so
    verdicts.txt, summary.json, diff.md and junit.xml (a CI view) showed every case passed."""
    load, _ = stand_in_load(tmp_path, requests=6, session_type=NixlStandIn, withheld=4)
    result_ = load.run()
    assert all(r.record.policy_passed for r in result_.results) and not result_.passed
    [problem] = result_.problems
    assert f"problem: {problem}" in (tmp_path / "verdicts.txt").read_text()
    assert json.loads((tmp_path / "summary.json").read_text())["problems"] == [problem]
    junit = (tmp_path / "junit.xml").read_text()
    assert 'name="run problems"' in junit and "round 1, KV account" in junit


class NixlErrors(NixlStandIn):
    """A request (call `errs`) whose transfer failed: D computed its prompt itself and it
    ended in an HTTP error, every instance alive (no death ends the load)."""

    def __init__(self, answers: dict[str, ChatResult], settings: RunSettings, errs=None, **kw):
        super().__init__(answers, settings, **kw)
        self.errs = errs

    def send(self, prompt: str, body: dict[str, Any]) -> Outcome:
        if self.calls + 1 != self.errs:
            return super().send(prompt, body)
        self.calls += 1
        self.computed += len(self.answers[prompt].prompt_token_ids)
        return Outcome(prompt, error="HTTPError: 500 Internal Server Error")


def test_a_request_that_errored_is_in_ds_counters_and_the_account_counts_it(
    tmp_path: Path,
) -> None:
    """D's counters over a round hold what they did for a request that errored too, while
    the account counted only the answered ones. Found in review: D computing the errored
    request's prompt failed the account as "the KV of at least one request never reached D",
    of requests whose KV all did (the errored one fails the load as an ERROR of its own). What
    D computed beyond what the errored requests' whole prompts explain still fails it."""
    load, _ = stand_in_load(tmp_path, requests=6, session_type=NixlErrors, errs=4)
    result_ = load.run()
    assert result_.ended_by is None
    assert [r.record.verdict for r in result_.results].count(Verdict.ERROR) == 1
    [account] = result_.kv_accounts
    assert not account.failed, account.evidence
    assert not account.checkable and "request 4 errored" in account.evidence, account.evidence
    assert not result_.passed and not result_.problems  # the ERROR fails it, not the account
    both = tmp_path / "both"
    both.mkdir()
    load, _ = stand_in_load(both, requests=6, session_type=NixlErrors, errs=4, withheld=2)
    [account] = load.run().kv_accounts
    assert account.failed and "D computed 35 prompt tokens more" in account.evidence, account


@pytest.mark.parametrize(
    "argv, cause",
    [
        ([], "load needs --topology"),
        (["--topology", "baseline"], "the baseline is what a load is judged against"),
        (["--topology", "9E"], "unknown topology '9E'"),
        (["--topology", "1E+1PD", "--kill", "decode"], "--kill decode: 1E+1PD has encoder, pd"),
        (["--topology", "1E+1P+1D", "--kill", "decode", "--duration", "60"], "no soak"),
        (["--topology", "1E+1PD", "--duration", "0"], "--duration is the soak's length"),
        (["--topology", "1E+1PD", "--media", "2"], "at least 3 distinct media"),
        (["--topology", "1E+1PD", "--concurrency", "0"], "at least 1"),
    ],
)
def test_bad_load_options_are_one_line_exit_2(argv: list[str], cause: str, capsys) -> None:
    from harness.cli.main import main

    assert main(["load", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and cause in err[0], err


HUGE = 10**11


@pytest.mark.parametrize(
    "argv, cause",
    [
        (["--requests", str(HUGE)], f"--requests {HUGE}: at most {MAX_REQUESTS} a round"),
        # The flag and value named (found walking the CLI: "--requests and --concurrency must be
        # at least 1" for either).
        (["--requests", "0"], "--requests 0: must be at least 1"),
        (["--concurrency", "-3"], "--concurrency -3: must be at least 1"),
        (
            ["--concurrency", str(HUGE)],
            f"--concurrency {HUGE}: at most {MAX_CONCURRENCY} in flight",
        ),
        (["--duration", "600000"], f"--duration 600000: a soak is at most {MAX_SOAK_S} s"),
        (
            ["--media", str(HUGE)],
            f"--media {HUGE}: a mix of {HUGE} distinct media has {HUGE + 4} prompts and "
            "--requests 64 sends 64 a round, so some media would never be sent: at most 60 "
            "with --requests 64",
        ),
        (["--requests", "20", "--media", "17"], "at most 16 with --requests 20"),
    ],
)
@pytest.mark.parametrize("deployment", [["--topology", "1E+1PD"], ["--attach", "deploy.json"]])
def test_counts_past_what_a_load_sends_are_refused_before_its_mix_is_built(
    argv: list[str], cause: str, deployment: list[str], monkeypatch, capsys
) -> None:
    """`load --media 1000000` built (and would have rendered and counted) a prompt per medium
    before anything started; with --attach its counts were not checked at all. Each count is
    refused in one line, the mix never built."""
    import harness.cli.load as load_cli
    from harness.cli.main import main

    def never(distinct_media: int) -> None:
        raise AssertionError(f"a mix of {distinct_media} media was built")

    monkeypatch.setattr(load_cli, "load_mix", never)
    assert main(["load", *deployment, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and cause in err[0], err


@pytest.mark.parametrize(
    "argv",
    [
        [
            *("--requests", str(MAX_REQUESTS), "--concurrency", str(MAX_CONCURRENCY)),
            *("--duration", str(MAX_SOAK_S)),
        ],
        ["--requests", "64", "--media", "60"],
        ["--requests", "1"],  # the default mix of 8 media, as a load of one request always had
        ["--media", str(MIN_DISTINCT_MEDIA)],  # the fewest a mix has
    ],
)
def test_a_load_at_its_count_limits_passes_its_checks(argv: list[str]) -> None:
    from harness.cli.main import check_command_line

    check_command_line(["load", "--topology", "1E+1PD", *argv])


def test_the_concurrency_limit_is_what_the_harness_client_holds_at_once() -> None:
    """MAX_CONCURRENCY's reason: a load's requests share the session's one ChatClient, whose
    connection pool must hold this many; a smaller pool would hold requests within the limit in
    the harness."""
    from harness.serve.client import MAX_CONNECTIONS

    assert MAX_CONNECTIONS is None or MAX_CONNECTIONS >= MAX_CONCURRENCY


class DiesQuietly(StandIn):
    """Answers every request, and its pd instance is gone once the round has been answered
    (P crashing as it frees the KV it sent, say): no request ever failed."""

    def dead_instance(self) -> DeadInstance | None:
        if self.calls >= 6:
            return DeadInstance("1E+1PD/pd0", -11, Path("pd0.log"), "...")
        return None


def test_an_instance_that_died_after_answering_every_request_fails_the_load(
    tmp_path: Path,
) -> None:
    """Found in review: deaths were noticed through failed requests only, so a plain load
    whose instance died after the last answer passed (a soak's samples did fail it)."""
    load, _ = stand_in_load(tmp_path, requests=6, session_type=DiesQuietly)
    result_ = load.run()
    assert all(record.policy_passed for record in result_.records)
    assert not result_.passed
    assert result_.ended_by == "instance 1E+1PD/pd0 exited with code -11 (its log: pd0.log)"
    assert result_.problems == [f"round 1: every request was answered, then {result_.ended_by}"]


CHAT = "/v1/chat/completions"


class StandInTaps:
    """The records a session's taps hold, with TapSet's marks."""

    def __init__(self, records: list[TapRecord]) -> None:
        self.records = list(records)
        self.open_marks: list[int] = []

    def mark(self) -> int:
        self.open_marks.append(len(self.records))
        return len(self.records)

    def release(self, mark: int) -> None:
        self.open_marks.remove(mark)

    def since(self, mark: int) -> list[TapRecord]:
        return self.records[mark:]


class Unkillable(StandIn):
    """A launched topology to the load (it may kill one of its instances), whose taps never
    see a request reach pd0: the moment to kill never comes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pd = SimpleNamespace(name="1E+1PD/pd0", pid=os.getpid())
        self.servers = (self.pd,)
        self.taps = StandInTaps([])

    def server(self, role: Any, index: int = 0) -> Any:
        return self.pd


def test_a_planted_kill_that_never_came_fails_the_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: the killer was waited for 5 s only, so a round that ended before the
    kill found its moment passed, its death under load never tested."""
    import harness.run.load.sessions as sessions_module

    monkeypatch.setattr(sessions_module, "TopologySession", Unkillable)
    load, _ = stand_in_load(tmp_path, requests=4, session_type=Unkillable)
    load.spec = LoadSpec("1E+1PD", requests=4, concurrency=2, distinct_media=3, kill="pd")
    result_ = load.run()
    assert result_.killed is None and not result_.passed
    assert result_.problems == [
        "the planted kill never happened: it found no moment with 2 request(s) in flight and "
        "one at 1E+1PD/pd0 before the round ended"
    ]
    assert json.loads((tmp_path / "load.json").read_text())["passed"] is False


class Killable(StandIn):
    """A launched topology to the load whose requests stay in flight until pd0 is killed (or
    a second passes): `reaches_pd` is whether a request of the round reaches pd0's tap, and
    `answered_first` whether pd0 answers the first one at once, before the second is sent;
    `earlier` are its taps' records from before the round (an earlier load on the same
    session). The kill is recorded, not sent."""

    def __init__(
        self,
        *args: Any,
        reaches_pd: bool = True,
        answered_first: bool = False,
        earlier: tuple[TapRecord, ...] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.pd = SimpleNamespace(name="1E+1PD/pd0", pid=os.getpid())
        self.servers = (self.pd,)
        self.taps = StandInTaps(list(earlier))
        self.reaches_pd, self.answered_first = reaches_pd, answered_first
        self.killed = threading.Event()
        self.second_sent = threading.Event()
        self.lock = threading.Lock()

    def server(self, role: Any, index: int = 0) -> Any:
        return self.pd

    def send(self, prompt: str, body: dict[str, Any]) -> Outcome:
        with self.lock:
            self.calls += 1
            call = self.calls
            if self.reaches_pd:
                record = TapRecord(len(self.taps.records), self.pd.name, "pd", CHAT, str(call))
                if call == 1 and self.answered_first:
                    record.status, record.seconds = 200, 0.01
                self.taps.records.append(record)
        if call == 1 and self.answered_first:
            self.second_sent.wait(5.0)  # answered at pd0; the proxy relays it with the second
        else:
            self.second_sent.set()
        self.killed.wait(1.0)
        if self.killed.is_set():
            return Outcome(prompt, error=f"{self.dead_instance_report()}\nHTTP 502")
        return Outcome(prompt, result=self.answers[prompt], seconds=0.01)

    def dead_instance(self) -> DeadInstance | None:
        if self.killed.is_set():
            return DeadInstance("1E+1PD/pd0", -9, Path("pd0.log"), "...")
        return None

    def dead_instances(self) -> list[DeadInstance]:
        return (
            [DeadInstance(self.pd.name, -9, Path("pd0.log"), "...")] if self.killed.is_set() else []
        )


class KillableBaseline(Killable):
    """The baseline beside a Killable topology: it answers at once, through no tap."""

    send = StandIn.send


def killable_load(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    session_type: type[Killable] = Killable,
    **killable: Any,
) -> tuple[LoadRun, Killable, list[str]]:
    """A load of 2 requests, 2 at a time, that plants the kill of pd0: (load, session, the
    names of the instances killed)."""
    import harness.run.load.death as death_module
    import harness.run.load.sessions as sessions_module

    monkeypatch.setattr(sessions_module, "TopologySession", Killable)  # the baseline's too
    load, session = stand_in_load(
        tmp_path, requests=2, concurrency=2, session_type=session_type, **killable
    )
    load.spec = LoadSpec("1E+1PD", requests=2, concurrency=2, distinct_media=3, kill="pd")
    # The baseline's batch calibration is served by a stand-in of its own: every call pd0's
    # taps see is the round's.
    baseline = KillableBaseline(session.answers, session.settings)
    load.sweep.pool.session = (  # type: ignore[method-assign]
        lambda topology, settings=None, devices=None: baseline if topology.is_baseline else session
    )
    killed: list[str] = []

    def kill(server: Any) -> None:
        killed.append(server.name)
        session.killed.set()

    monkeypatch.setattr(death_module, "kill_instance", kill)
    return load, session, killed


def test_a_planted_kill_comes_with_every_request_in_flight_and_one_at_its_instance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    load, session, killed = killable_load(tmp_path, monkeypatch)
    result_ = load.run()
    assert killed == ["1E+1PD/pd0"] and result_.killed == "1E+1PD/pd0", result_.problems
    assert all(r.record.verdict is Verdict.ERROR for r in result_.results)
    assert result_.passed, result_.problems
    assert session.taps.open_marks == []  # the killer's mark, released with the round
    # run.json's too: verdicts.txt says the run is red on purpose.
    assert load.sweep.run_info["killed"] == "1E+1PD/pd0"
    # The death was the one planted: nothing ended the load early.
    assert result_.ended_by is None


class KillTakesAnotherDown(Killable):
    """The planted kill of pd0 takes another instance down with it (P's death crashing D, as
    vLLM's D should not): the requests found pd0 dead first, as one does where the killed
    instance comes first in the topology (P before D)."""

    def dead_instances(self) -> list[DeadInstance]:
        beside = DeadInstance("1E+1PD/encoder0", -11, Path("encoder0.log"), "Segmentation fault")
        return [*super().dead_instances(), beside] if self.killed.is_set() else []


def test_an_instance_that_died_beside_the_planted_kill_fails_the_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: under a planted kill every death a request found was taken for the
    planted one, so a kill of pd0 that took encoder0 down too passed, load.md saying "every
    request ended ERROR naming it, as it must" and nothing of encoder0. The death beside the
    kill is a problem of the load, named; what ended the load is still the kill."""
    load, _, killed = killable_load(tmp_path, monkeypatch, session_type=KillTakesAnotherDown)
    result_ = load.run()
    assert killed == ["1E+1PD/pd0"] and result_.killed == "1E+1PD/pd0"
    assert result_.problems == [
        "round 1: beside the planted kill of 1E+1PD/pd0, instance 1E+1PD/encoder0 exited with "
        "code -11 (its log: encoder0.log)"
    ]
    assert not result_.passed and result_.ended_by is None
    text = (tmp_path / "load.md").read_text()
    assert "instance 1E+1PD/encoder0 exited with code -11" in text
    assert "as it must" not in text


def test_a_planted_kill_does_not_count_a_call_its_instance_had_before_the_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found with the fake vLLM: the killer took any call its instance's tap had ever
    recorded as one in flight there, so after an earlier load on the same topology it killed
    as soon as the client had every request out, none yet at D."""
    earlier = TapRecord(0, "1E+1PD/pd0", "pd", CHAT, "earlier", status=200, seconds=0.2)
    load, _, killed = killable_load(tmp_path, monkeypatch, reaches_pd=False, earlier=(earlier,))
    result_ = load.run()
    assert killed == [] and result_.killed is None
    assert result_.problems == [
        "the planted kill never happened: it found no moment with 2 request(s) in flight and "
        "one at 1E+1PD/pd0 before the round ended"
    ]


def test_a_planted_kill_whose_instance_answered_a_request_first_names_that(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An instance that answered a request of the round before every request was in flight:
    its kill can no longer have every request in flight. Before, the killer killed all the
    same and that request passed, "request 1: MATCH, not ERROR" (the fake vLLM's D, which
    answered at once, on some runs of the death under load)."""
    load, _, killed = killable_load(tmp_path, monkeypatch, answered_first=True)
    result_ = load.run()
    assert killed == [] and result_.killed is None
    assert result_.problems == [
        "the planted kill never happened: 1E+1PD/pd0 answered a request of the round (id 1) "
        "before 2 request(s) were in flight with one at it: its moment passed"
    ]


class RaisesMidRound(Killable):
    """The session raises at the round's requests (a bug, a Ctrl-C), before the kill's moment
    came (no request reaches pd0's tap: it never comes)."""

    def send(self, prompt: str, body: dict[str, Any]) -> Outcome:
        raise RuntimeError("the session broke mid-round")


def test_a_round_that_raises_ends_its_planted_kill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: the killer was finished only after a round that returned, so a round
    that raised left it waiting (up to KILL_WAIT_S) for a moment to kill an instance of a
    session a later load may use, its taps' mark never released."""
    import harness.run.load.run as run_module

    killers: list[Any] = []

    class Recorded(run_module.PlantedKill):
        def start(self) -> None:
            killers.append(self)
            super().start()

    monkeypatch.setattr(run_module, "PlantedKill", Recorded)
    load, session, killed = killable_load(tmp_path, monkeypatch, session_type=RaisesMidRound)
    with pytest.raises(RuntimeError, match="the session broke mid-round"):
        load.run()
    [killer] = killers
    assert not killer.thread.is_alive(), "the killer outlived its round"
    assert session.taps.open_marks == [] and killed == []


# A fast pd0 answers a request this long after it reached it; the slow client puts each of its
# requests out this long after the one before (a loaded host starting the load's threads).
# The killer looks every 0.05 s; PD's answer leaves it 1 s to see the round in flight (0.2 s
# was missed once under a full machine), and the client's gap stays longer than the answer.
PD_ANSWERS_IN_S = 1.0
CLIENT_SEND_GAP_S = 1.5


class AnswersInTime(Killable):
    """pd0 answers each request PD_ANSWERS_IN_S after it reached it, unless killed first."""

    def send(self, prompt: str, body: dict[str, Any]) -> Outcome:
        with self.lock:
            self.calls += 1
            record = TapRecord(len(self.taps.records), self.pd.name, "pd", CHAT, str(self.calls))
            self.taps.records.append(record)
        if self.killed.wait(PD_ANSWERS_IN_S):
            return Outcome(prompt, error=f"{self.dead_instance_report()}\nHTTP 502")
        record.status, record.seconds = 200, PD_ANSWERS_IN_S
        return Outcome(prompt, result=self.answers[prompt], seconds=PD_ANSWERS_IN_S)


class SlowClient(ThreadPoolExecutor):
    """The load's request threads, each submitted CLIENT_SEND_GAP_S after the one before."""

    submitted = 0

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.submitted:
            time.sleep(CLIENT_SEND_GAP_S)
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


def test_a_planted_kill_comes_though_the_client_is_slower_to_send_than_the_instance_to_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The death under load on the fake night failed about one run in 18 at the fake's
    0.01 s decode step ("1E+1P+1D/decode0 answered a request of the round before 32
    request(s) were in flight"). Timed on that night: the load's 32 threads took 0.1-0.5 s
    to all begin (started one after another in a process busy with the taps, the proxy and
    the requests already out), while D answers in 0.31 s; the first request was sent as soon
    as its thread began, so a run where it reached D early lost the kill's moment. On a GPU
    a small model's D is that fast too. The kill round's requests now wait for each other
    and go out together."""
    import harness.run.load.sending as sending_module

    monkeypatch.setattr(sending_module, "ThreadPoolExecutor", SlowClient)
    load, _, killed = killable_load(tmp_path, monkeypatch, session_type=AnswersInTime)
    result_ = load.run()
    assert killed == ["1E+1PD/pd0"] and result_.killed == "1E+1PD/pd0", result_.problems
    assert all(r.record.verdict is Verdict.ERROR for r in result_.results)
    assert result_.passed, result_.problems


class EpdStandIn(StandIn):
    def __init__(self, answers: dict[str, ChatResult], settings: RunSettings) -> None:
        super().__init__(answers, settings)
        self.topology = TOPOLOGIES["1E+1P+1D"]
        self.served = ServedTopology(self.topology, None, 32, "ExampleConnector")


def test_too_few_requests_for_the_ending_prompt_leave_it_out_and_say_so(tmp_path: Path) -> None:
    """`load --topology 1E+1P+1D --requests 1` under ExampleConnector, whose mix holds a prompt
    declared to end D: found in review, a ValueError's traceback after the baseline was
    served. One request is one of the others; the ending prompt is left out, with a note."""
    sweep, answers = tail_sweep(tmp_path)
    from harness.judge.verdicts import Stability

    sweep.baseline.stability = {name: Stability(True, "stable", 0.0) for name in answers}
    session = EpdStandIn(answers, sweep.settings)
    sweep.pool.session = lambda topology, settings=None, devices=None: session  # type: ignore[method-assign]
    spec = LoadSpec("1E+1P+1D", requests=1, concurrency=1, distinct_media=3)
    load = LoadRun(spec, sweep, on_progress=lambda _: None)
    result_ = load.run()
    assert [r.record.prompt for r in result_.results] != [TAIL_PROMPT]
    assert len(result_.results) == 1  # judged (the stand-in moves no KV: VACUOUS)
    assert any(
        TAIL_PROMPT in note and "1 request(s) leave no room for it" in note for note in load.notes
    ), load.notes


@pytest.mark.parametrize(
    "keep, share, workers, released",
    [
        (True, False, 2, []),
        (True, True, 2, ["baseline"]),
        (True, True, 1, []),
        (False, False, 2, ["baseline"]),
    ],
)
def test_a_kept_baseline_is_stopped_all_the_same_where_workers_share_devices(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    keep: bool,
    share: bool,
    workers: int,
    released: list[str],
) -> None:
    """Kept up after a load's calibration, the baseline holds its GPU for the worker's whole
    session and every other worker's calibration waits for it (found in review). One not
    asked to be kept is stopped: a load's topology may need its device. A GPU run of one
    worker has no other worker to wait, and keeps it."""
    import dataclasses

    import harness.run.load.sessions as sessions_module

    load, _ = stand_in_load(tmp_path, requests=4)
    monkeypatch.setattr(sessions_module, "TopologySession", StandIn)
    sweep = load.sweep
    sweep.settings = dataclasses.replace(
        sweep.settings, platform=CUDA if share else sweep.settings.platform, workers=workers
    )
    stopped: list[str] = []
    baseline_session = StandIn({}, sweep.settings)
    monkeypatch.setattr(sweep.pool, "session", lambda *args, **kwargs: baseline_session)
    monkeypatch.setattr(sweep.pool, "release", lambda name, *args: stopped.append(name))
    monkeypatch.setattr(sweep.baseline, "calibrate_batched", lambda *args: None)
    load.keep_baseline = keep
    load._calibrate([])
    assert stopped == released


def baseline_asked(load: LoadRun, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The topologies the load asks its pool for, recorded (the stand-in answers as both)."""
    import harness.run.load.sessions as sessions_module

    monkeypatch.setattr(sessions_module, "TopologySession", StandIn)  # the baseline's type check
    asked: list[str] = []
    serve = load.sweep.pool.session

    def session(topology, settings=None, devices=None):
        asked.append(topology.name)
        return serve(topology, settings, devices)

    monkeypatch.setattr(load.sweep.pool, "session", session)
    return asked


def test_a_load_of_requests_calibrated_at_its_concurrency_serves_no_baseline_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A calibration is the baseline's behaviour under the load's requests at its
    concurrency, whatever the topology: a second load of the same reads the first's (on 2
    GPUs or 1 each load stopped its topology to serve the baseline again), and says so in
    its account; another concurrency is measured for itself."""
    first, _ = stand_in_load(tmp_path, requests=6, concurrency=3)
    asked = baseline_asked(first, monkeypatch)
    measured = first.run().calibration
    assert asked == ["baseline", "1E+1PD"] and measured is not None
    assert measured.concurrency == 3 and len(measured.answers) == 6
    account = json.loads((tmp_path / "load.json").read_text())
    assert account["calibration"]["source"] == "measured now, for this load"

    again = LoadRun(first.spec, first.sweep, on_progress=lambda _: None)
    asked.clear()
    result_ = again.run()
    assert asked == ["1E+1PD"], "the baseline was served again for the same calibration"
    assert result_.calibration is measured and result_.passed
    source = json.loads((tmp_path / "load.json").read_text())["calibration"]["source"]
    assert source == (
        "measured earlier in this session for a load on 1E+1PD (the same 6 requests at "
        "concurrency 3), not again"
    )
    assert f"batch numerics: {measured.describe()}; {source}" in (tmp_path / "load.md").read_text()

    other = dataclasses.replace(first.spec, concurrency=2)
    asked.clear()
    calibration = LoadRun(other, first.sweep, on_progress=lambda _: None).run().calibration
    assert asked == ["baseline", "1E+1PD"] and calibration is not None
    assert calibration.concurrency == 2


def test_calibrations_computed_ahead_are_of_the_requests_each_load_then_sends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a pytest session does as its baseline stops (`calibrate_ahead`, for the loads to
    come): each distinct (requests, concurrency) once, none for a load of one request at a
    time; the load then finds its own among them and serves no baseline."""
    from harness.run.load.calibration import calibrate_ahead

    load, session = stand_in_load(tmp_path, requests=6, concurrency=3)
    sweep = load.sweep
    specs = [
        load.spec,
        dataclasses.replace(load.spec, topology="1E+1P+1D", stream=True),  # the same requests
        dataclasses.replace(load.spec, requests=5),
        dataclasses.replace(load.spec, concurrency=1),  # never calibrated
    ]
    measured = calibrate_ahead(specs, sweep.baseline, sweep.settings.serving, session)  # type: ignore[arg-type]
    assert measured == 2 and session.calls == 6 + 5
    assert calibrate_ahead(specs, sweep.baseline, sweep.settings.serving, session) == 0  # type: ignore[arg-type]
    asked = baseline_asked(load, monkeypatch)
    result_ = load.run()
    assert asked == ["1E+1PD"], asked
    assert result_.calibration is not None and result_.calibration_source is not None
    assert result_.calibration_source.startswith(
        "measured earlier in this session ahead of the loads to come"
    ), result_.calibration_source


def test_a_calibration_the_baseline_did_not_answer_in_full_is_not_reused(tmp_path: Path) -> None:
    """A baseline that failed a request of the calibration (it died, say) measured nothing
    of batching for that request: the next load of the same measures its own."""
    load, session = stand_in_load(tmp_path, requests=4, concurrency=2, dies_after=3)
    sweep = load.sweep
    requests = [("request 1", "ld-shared-a"), ("request 2", "ld-text")] * 2
    failed = sweep.baseline.calibrate_batched(session, requests, 2)  # type: ignore[arg-type]
    assert len(failed.unanswered) == 1  # the fourth found the stand-in dead
    assert sweep.baseline.known_calibration(requests, 2) is None
    session.dies_after = None
    answered = sweep.baseline.calibrate_batched(session, requests, 2)  # type: ignore[arg-type]
    assert sweep.baseline.known_calibration(requests, 2) is answered and not answered.changed


class SlowStandIn(StandIn):
    """A stand-in whose every answer takes a while, so requests sent together overlap."""

    def send(self, prompt: str, body: dict[str, Any]) -> Outcome:
        time.sleep(0.2)
        return super().send(prompt, body)


class NearTieAfterCalibration(SlowStandIn):
    """Answers ld-shared-a with "near-tie" once the calibration's two calls are done, whichever
    of the load's overlapping requests comes first (a swap by call number raced)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counting = threading.Lock()

    def send(self, prompt: str, body: dict[str, Any]) -> Outcome:
        time.sleep(0.2)
        with self.counting:
            self.calls += 1
            call = self.calls
        given = "near-tie" if call > 2 and prompt == "ld-shared-a" else prompt
        return Outcome(prompt, result=self.answers[given], seconds=0.01)


def near_tie_on_a_gpu(load: LoadRun, session: Any) -> None:
    """The stand-in's "near-tie" answer: ld-shared-a's, its last token the runner-up of a
    0.005-nat tie; and the load judged as on a GPU, under EXACT everywhere, so that only a
    batch floor can let it pass as DRIFT."""
    reference = session.answers["ld-shared-a"]
    last = reference.logprobs[-1]
    session.answers["near-tie"] = dataclasses.replace(
        reference,
        token_ids=(*reference.token_ids[:-1], last.token_id + 1),
        logprobs=(
            *reference.logprobs[:-1],
            PositionLogprobs(
                last.token_id + 1, -1.0, ((last.token_id + 1, -1.0), (last.token_id, -1.005))
            ),
        ),
    )
    load.sweep.settings = dataclasses.replace(load.sweep.settings, platform=CUDA)
    load.sweep.judging.settings = load.sweep.settings
    load.sweep.judging.reference_policy = ReferencePolicy(EXACT_EVERYWHERE)


def test_a_batched_answer_is_held_to_its_own_loads_floor_not_another_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load's batched answers may drift within the noise the baseline showed under that
    load's requests at its concurrency. Found in review: the tolerance was the largest floor
    of every calibration the baseline had measured (every load's of a pytest session, measured
    ahead), so a load whose own calibration moved nothing passed a drift another load's
    traffic had shown."""
    from harness.run.baseline import BatchedAnswer

    load, session = stand_in_load(
        tmp_path, requests=2, session_type=NearTieAfterCalibration, concurrency=2
    )
    near_tie_on_a_gpu(load, session)
    wider = BatchCalibration(16, (BatchedAnswer("request 1", "ld-text", True, 0.5, ""),), "x")
    load.sweep.baseline.calibrations.append(wider)  # another load's, measured ahead
    baseline_asked(load, monkeypatch)
    result_ = load.run()
    assert result_.calibration is not None and result_.calibration.noise_floor == 0.0
    first = result_.results[0]
    assert first.prompt == "ld-shared-a" and first.batched
    assert first.record.verdict is Verdict.MISMATCH, first.record.detail
    assert not result_.passed


def test_a_calibration_request_the_baseline_did_not_answer_is_not_said_changed_by_batching(
    tmp_path: Path,
) -> None:
    """A calibration request the baseline failed (it died, say) measured nothing of batching.
    Found in review: it was counted as an answer whose ids batching changed, and the account
    said so ("batching changed the ids of 1 answer(s)") of a baseline that never answered."""
    load, session = stand_in_load(tmp_path, requests=4, concurrency=2, dies_after=3)
    requests = [("request 1", "ld-shared-a"), ("request 2", "ld-text")] * 2
    failed = load.sweep.baseline.calibrate_batched(session, requests, 2)  # type: ignore[arg-type]
    # Which request meets the death depends on the two threads' order: either may.
    [unanswered] = failed.unanswered
    assert not failed.changed, failed
    text = failed.describe()
    assert "batching changed" not in text and "every answer's ids equal" not in text, text
    said = f"the baseline did not answer 1 of them ({unanswered.prompt}): nothing measured there"
    assert said in text, text


class DiesWithASecretInItsLog(StandIn):
    """Its pd instance dies after `dies_after` answers; the error each request then gets
    quotes the instance's log tail, and an HTTP error body, both holding a credential of the
    environment (an instance that printed its HF token as it failed)."""

    def send(self, prompt: str, body: dict[str, Any]) -> Outcome:
        outcome = super().send(prompt, body)
        if outcome.error is None:
            return outcome
        secret = os.environ["HF_TOKEN"]
        return Outcome(prompt, error=f"HTTP 401: bad token {secret}\n{outcome.error}")

    def dead_instance(self) -> DeadInstance | None:
        dead = super().dead_instance()
        if dead is None:
            return None
        tail = f"OSError: 401 for token {os.environ['HF_TOKEN']}"
        return dataclasses.replace(dead, log_tail=tail)


def test_no_secret_reaches_any_file_of_a_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: load.md, load.json and load-requests.jsonl wrote each request's
    detail (an error's first line) and the calibration's (an error whole, with the instance's
    log tail) as they came, where every file of the bundle is scrubbed of the environment's
    secrets (`harness.report.bundle.Redactor`). The baseline dies during the calibration, then
    every request of the load fails."""
    secret = "hf_load_secret_4711"
    monkeypatch.setenv("HF_TOKEN", secret)
    load, _ = stand_in_load(
        tmp_path, requests=4, session_type=DiesWithASecretInItsLog, concurrency=2, dies_after=3
    )
    baseline_asked(load, monkeypatch)
    result_ = load.run()
    assert result_.calibration is not None and result_.calibration.unanswered
    assert all(secret in (r.outcome.error or "") for r in result_.results if not r.not_sent)
    for name in ("load.md", "load.json", "load-requests.jsonl", "load-samples.jsonl"):
        text = (tmp_path / name).read_text()
        assert secret not in text, f"{name} holds the environment's secret"
    assert "for token [redacted]" in (tmp_path / "load.json").read_text()
    assert "bad token [redacted]" in (tmp_path / "load-requests.jsonl").read_text()


def test_a_load_that_fails_before_its_first_round_still_writes_its_account(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hook given the load's session (`on_session`: a test plants a fault there) and the
    first resource sample ran outside the part whose end writes the account: a failure there
    left no load.json, and the calibration measured for the load was in no file. The failure
    propagates, and the account says it (found in review)."""
    load, _ = stand_in_load(tmp_path, requests=6, concurrency=3)
    baseline_asked(load, monkeypatch)

    def refuse(_session: object) -> None:
        raise RuntimeError("planted fault refused")

    load.on_session = refuse
    with pytest.raises(RuntimeError, match="planted fault refused"):
        load.run()
    account = json.loads((tmp_path / "load.json").read_text())
    assert account["calibration"]["source"] == "measured now, for this load"
    assert account["ended_by"] == "the load failed: RuntimeError: planted fault refused"


def test_a_load_that_judged_nothing_or_ended_early_did_not_pass() -> None:
    """`LoadResult.passed` decides `epd-harness load`'s exit code: a load with no request
    judged proved nothing, and one a death ended early did not run its load, however its
    judged requests ended."""
    from harness.run.load.result import LoadResult

    spec = LoadSpec("1E+1PD", requests=3, concurrency=1, distinct_media=3)
    nothing = LoadResult(spec)
    assert not nothing.passed
    clean = LoadResult(spec)
    clean.tally.requests = clean.tally.passed = 2
    assert clean.passed
    ended = LoadResult(spec, ended_by="decode0 died (exit 137)")
    ended.tally.requests = ended.tally.passed = 2
    assert not ended.passed


def test_a_loads_problems_are_in_its_own_account(tmp_path: Path) -> None:
    """load.md and load.json say what failed a load whose every request passed (here its
    round's KV account), not only the run's verdicts.txt: a reader of the load's account
    saw a red `passed` and no reason."""
    load, _ = stand_in_load(tmp_path, requests=6, session_type=NixlStandIn, withheld=4)
    result_ = load.run()
    [problem] = result_.problems
    assert f"- problem: {problem}" in (tmp_path / "load.md").read_text()
    assert json.loads((tmp_path / "load.json").read_text())["problems"] == [problem]


def test_what_ended_a_load_early_is_in_its_account(tmp_path: Path) -> None:
    load, _ = stand_in_load(tmp_path, requests=10, dies_after=4)
    result_ = load.run()
    assert result_.ended_by is not None
    assert f"- the load ended early: {result_.ended_by}" in (tmp_path / "load.md").read_text()
    assert json.loads((tmp_path / "load.json").read_text())["ended_by"] == result_.ended_by


def test_a_kill_whose_requests_did_not_all_end_error_naming_it_is_not_said_to_have_held() -> None:
    """The kill's note says every request ended ERROR naming the killed instance only when
    the load found no problem: else load.md said so beside the problem that it did not."""
    spec = LoadSpec("1E+1PD", requests=2, concurrency=2, distinct_media=3, kill="pd")
    broke = LoadResult(spec, killed="1E+1PD/pd0", killed_at_s=1.0)
    broke.problems.append("request 1: MATCH, not ERROR")
    [kill_note, problem] = account_notes(spec, SoakBounds(), (), broke)
    assert kill_note.startswith("killed 1E+1PD/pd0 at 1.0s (planted)")
    assert "as it must" not in kill_note and problem == "problem: request 1: MATCH, not ERROR"
    held = LoadResult(spec, killed="1E+1PD/pd0", killed_at_s=1.0)
    [kill_note] = account_notes(spec, SoakBounds(), (), held)
    assert kill_note.endswith("; every request ended ERROR naming it, as it must")


def test_a_load_whose_prompt_the_baseline_did_not_answer_is_left_to_calibrate_its_own(
    tmp_path: Path,
) -> None:
    """`calibrate_ahead` as a pytest session's baseline stops: a load one of whose prompts
    the baseline has no answer to is not planned there (its plan reads every prompt's
    answer), and nothing is sent for it."""

    load, session = stand_in_load(tmp_path, requests=6, concurrency=3)
    baseline = load.sweep.baseline
    del baseline.outcomes["ld-text"]
    assert "ld-text" in baseline.bodies
    measured = calibrate_ahead([load.spec], baseline, load.sweep.settings.serving, session)  # type: ignore[arg-type]
    assert measured == 0 and session.calls == 0


def test_a_calibration_ahead_is_of_a_rounds_requests_not_of_those_sent_alone(
    tmp_path: Path,
) -> None:
    """A load sends the prompt declared to end D alone, after its rounds, and its
    calibration is of the rounds' requests: one computed ahead must be of those, or the
    load finds none and serves the baseline again for its own."""
    sweep, answers = tail_sweep(tmp_path)
    settings = sweep.settings
    session = EpdStandIn(answers, settings)
    spec = LoadSpec("1E+1P+1D", requests=8, concurrency=2, distinct_media=3)
    plan = plan_load(spec, list(answers), sweep.baseline, settings.serving)
    assert [r.prompt for r in plan.requests if r.alone] == [TAIL_PROMPT]
    assert calibrate_ahead([spec], sweep.baseline, settings.serving, session) == 1  # type: ignore[arg-type]
    regular = [(r.name, r.prompt) for r in plan.regular]
    assert sweep.baseline.known_calibration(regular, 2) is not None


class EncoderAnswersFirst(Killable):
    """The round's requests reach pd0 after the encoder answered them, as every request with
    media does in 1E+1PD: the encoder's tap holds an answered call of the round."""

    def send(self, prompt: str, body: dict[str, Any]) -> Outcome:
        with self.lock:
            index = len(self.taps.records)
            encoded = TapRecord(index, "1E+1PD/encoder0", "encoder", "/v1/encode", f"e{index}")
            encoded.status, encoded.seconds = 200, 0.01
            self.taps.records.append(encoded)
        return super().send(prompt, body)


def test_a_planted_kill_reads_the_calls_of_its_own_instance_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another instance that answered a request of the round (the encoder, before pd0 took
    it) is no sign that the killed instance's moment passed."""
    load, _, killed = killable_load(tmp_path, monkeypatch, session_type=EncoderAnswersFirst)
    result_ = load.run()
    assert killed == ["1E+1PD/pd0"] and result_.killed == "1E+1PD/pd0", result_.problems
    assert result_.passed, result_.problems


def test_load_md_says_how_many_requests_passed_and_which_did_not(tmp_path: Path) -> None:
    load, _ = stand_in_load(tmp_path, requests=4, swap={3: "ld-shared-a"})
    load.run()
    markdown = (tmp_path / "load.md").read_text()
    assert "; 3/4 passed" in markdown
    rows = {line.split(" | ")[0]: line for line in markdown.splitlines() if line.startswith("| ")}
    assert "| MISMATCH | no |" in rows["| 3"] and "| MATCH | yes |" in rows["| 1"]


def test_a_request_that_failed_as_declared_passed_the_load() -> None:
    """A request's row passes by its policy, not by its verdict: one that ended ERROR as the
    matrix declares for its media (passed by its declaration) or drifted within the batch
    floor passed, and a load of such requests passes (its exit is 0)."""
    declared = case_record(
        prompt="ld-shared-a",
        verdict=Verdict.ERROR,
        passed=True,
        declared_failure="epd-media-in-decode-tail",
    )
    request = LoadRequestResult(
        number=1,
        prompt="ld-shared-a",
        region="decode tail",
        outcome=Outcome("ld-shared-a", error="instance 1E+1P+1D/decode0 exited"),
        record=declared,
        batched=False,
        started_s=0.0,
        ended_s=1.0,
    )
    assert request.row().passed
    load = LoadResult(LoadSpec("1E+1P+1D", requests=1, concurrency=1, distinct_media=3))
    load.add([request])
    assert load.tally.passed == 1 and load.passed


def test_under_a_planted_kill_each_request_must_end_error_naming_it_soon_after() -> None:
    """What a planted kill demands of every request of its round (`kill_problems`): ERROR,
    the killed instance named first, and ended within KILL_END_S of the kill; a request
    never sent has no end to time."""

    def request(number: int, verdict: Verdict, error: str | None, ended_s: float, **kw: Any):
        return LoadRequestResult(
            number=number,
            prompt="ld-text",
            region="no media",
            outcome=Outcome("ld-text", error=error),
            record=case_record(prompt="ld-text", verdict=verdict, passed=False),
            batched=True,
            started_s=0.0,
            ended_s=ended_s,
            **kw,
        )

    named = "instance 1E+1PD/pd0 exited with code -9\nHTTP 502"
    late = 1.0 + KILL_END_S + 1.0
    load = LoadResult(
        LoadSpec("1E+1PD", requests=5, concurrency=5, distinct_media=3, kill="pd"),
        killed="1E+1PD/pd0",
        killed_at_s=1.0,
    )
    load.results = [
        request(1, Verdict.ERROR, named, 2.0),
        request(2, Verdict.MATCH, None, 2.0),
        request(3, Verdict.ERROR, "HTTP 502\ninstance 1E+1PD/pd0 exited", 2.0),
        request(4, Verdict.ERROR, named, late),
        request(5, Verdict.ERROR, f"not sent: {named}", 0.0, not_sent=True),
    ]
    assert kill_problems(load) == [
        "request 2: MATCH, not ERROR",
        "request 3: ERROR without 1E+1PD/pd0 first: HTTP 502",
        f"request 4 ended {late - 1.0:.1f}s after the kill (bound {KILL_END_S:g}s)",
    ]


def test_a_request_another_instance_of_the_killed_role_served_may_pass() -> None:
    """Real vLLM: `load --topology 2E+1PD --kill encoder` killed encoder0, and request 1, which
    encoder1 had served, MATCHed as it should; the load failed on "request 1: MATCH, not
    ERROR". A request whose every call was at another instance passes the kill's rule; one
    that reached the killed instance, or recorded no call at all, must still end ERROR."""
    from harness.outcomes.taps import TapRecord
    from harness.run.load.account import account_notes

    def request(number: int, verdict: Verdict, *instances: str) -> LoadRequestResult:
        taps = [
            TapRecord(n, name, name.rstrip("0123456789"), "/v1/chat/completions")
            for n, name in enumerate(instances)
        ]
        return LoadRequestResult(
            number=number,
            prompt="ld-shared-a",
            region="prefix",
            outcome=Outcome("ld-shared-a", error=None, taps=taps or None),
            record=case_record(prompt="ld-shared-a", verdict=verdict, passed=True),
            batched=True,
            started_s=0.0,
            ended_s=2.0,
        )

    spec = LoadSpec("2E+1PD", requests=3, concurrency=3, distinct_media=3, kill="encoder")
    load = LoadResult(spec, killed="2E+1PD/encoder0", killed_at_s=1.0)
    load.results = [request(1, Verdict.MATCH, "2E+1PD/encoder1", "2E+1PD/pd0")]
    assert kill_problems(load) == []
    notes = account_notes(spec, SoakBounds(), [], load)
    assert any(
        "every request that reached it ended ERROR naming it, as it must; request(s) 1, "
        "served whole by the other instances of its role, passed" in note
        for note in notes
    ), notes
    load.results = [
        request(2, Verdict.MATCH, "2E+1PD/encoder0", "2E+1PD/pd0"),
        request(3, Verdict.MATCH),
    ]
    assert kill_problems(load) == ["request 2: MATCH, not ERROR", "request 3: MATCH, not ERROR"]


def test_a_load_accounts_kv_on_a_topology_that_moves_kv_under_the_whole_prompt_rule_only() -> None:
    """A topology with no KV transfer (1E+1PD) has no D counters to account, whatever the
    connector: accounting it would fail every round of a load on it."""
    assert accounts_kv(TOPOLOGIES["1P+1D"], "NixlConnector")
    assert not accounts_kv(TOPOLOGIES["1E+1PD"], "NixlConnector")
    assert not accounts_kv(TOPOLOGIES["1P+1D"], "ExampleConnector")


def test_a_kv_account_log_counts_the_rounds_nothing_could_check() -> None:
    log = KvAccountLog()
    log.add(1, GuardResult("kv_account", True, "held"))
    log.add(2, not_checkable("kv_account", "D held every prompt itself"))
    assert (log.rounds, log.held, log.failed, log.not_checkable) == (2, 1, 0, 1)
    assert log.to_json()["not_checkable"] == 1


def test_a_kv_account_log_says_where_d_took_every_rounds_prompts_from() -> None:
    """Real vLLM (a NIXL soak of 26 rounds): load.md gave the first round's account alone, "D
    took 1338 from P", while rounds 2-26 took 122 of 1402 tokens from P and 1280 from D's own
    prefix cache (the load's prompts repeat into a warm cache). The sum over every round is
    said beside it, and recorded in load.json."""
    log = KvAccountLog()
    first = {"p2p_cached_tokens": 1338.0, "local_cache_hit_tokens": 64.0, "nixl_transfers": 6.0}
    later = {"p2p_cached_tokens": 122.0, "local_cache_hit_tokens": 1280.0}
    log.add(1, GuardResult("kv_account", True, "D took 1338 from P"), first)
    assert "over all" not in log.describe()  # one round: its own account says it all
    log.add(2, GuardResult("kv_account", True, "D took 122 from P"), later)
    assert "; over all 2 rounds D took 1460 prompt tokens from P" in log.describe()
    log.add(3, GuardResult("kv_account", False, "D's /metrics could not be read"), None)
    assert log.describe().endswith(
        "; over the 2 rounds whose counters were read D took 1460 prompt tokens from P, 1344 "
        "from its own prefix cache and computed 0 itself"
    ), log.describe()
    assert log.to_json()["prompt_tokens_by_source"] == {
        "p2p_cached_tokens": 1460.0,
        "local_cache_hit_tokens": 1344.0,
        "local_compute_tokens": 0.0,
    }


def tail_sweep(tmp_path: Path) -> tuple[Sweep, dict[str, ChatResult]]:
    """A sweep whose baseline answered the mix, TAIL_PROMPT with its image in the part D
    recomputes (declared to end D under ExampleConnector): (sweep, the answers)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"image_token_id": 999}))
    settings = RunSettings(serving=ServingConfig(model=str(model)), run_dir=tmp_path)
    mix = load_mix(3)
    sweep = Sweep(SweepSpec((), (), baseline_only_prompts=mix), settings)
    answers = {
        p.name: result((10 + n, 20 + n), prompt=(1, n, *range(100, 138))) for n, p in enumerate(mix)
    }
    # Its image ends past the last whole block of 32: in the part D computes itself.
    answers[TAIL_PROMPT] = result((7, 8), prompt=(1, *range(100, 133), 999, 999, 5, 6))
    for name, answer in answers.items():
        sweep.baseline.outcomes[name] = Outcome(name, result=answer)
    return sweep, answers


def test_a_soak_or_a_planted_kill_leaves_out_the_prompt_declared_to_end_d(tmp_path: Path) -> None:
    """A soak measures resources over time and a planted kill its own death: a request that
    ends D by a declared failure would cut either short. A plain load sends it last, alone,
    unless asked not to (`LoadSpec.ending`)."""
    sweep, answers = tail_sweep(tmp_path)
    plain = LoadSpec("1E+1P+1D", requests=8, concurrency=2, distinct_media=3)
    for spec, sent_alone in [
        (plain, [TAIL_PROMPT]),
        (dataclasses.replace(plain, duration_s=60.0), []),
        (dataclasses.replace(plain, kill="decode"), []),
        (dataclasses.replace(plain, ending=False), []),  # asked not to send it
    ]:
        plan = plan_load(spec, list(answers), sweep.baseline, sweep.settings.serving)
        assert [r.prompt for r in plan.requests if r.alone] == sent_alone, spec
        assert TAIL_PROMPT not in [r.prompt for r in plan.regular]
        assert bool(plan.notes) == (not sent_alone), plan.notes


class OutlivesItsKill(Killable):
    """pd0 killed, and its requests answered all the same: no sign of the death reached the
    client (a proxy that answered from elsewhere, say)."""

    def send(self, prompt: str, body: dict[str, Any]) -> Outcome:
        super().send(prompt, body)
        return Outcome(prompt, result=self.answers[prompt], seconds=0.01)


def test_a_planted_kill_whose_requests_were_answered_fails_the_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    load, _, killed = killable_load(tmp_path, monkeypatch, session_type=OutlivesItsKill)
    result_ = load.run()
    assert killed == ["1E+1PD/pd0"] and not result_.passed
    assert result_.problems == ["request 1: MATCH, not ERROR", "request 2: MATCH, not ERROR"]


@pytest.mark.parametrize("earlier", [None, "1P+1D/decode0"])
def test_a_planted_kill_that_failed_to_kill_fails_the_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, earlier: str | None
) -> None:
    """What stops the killer (here the kill itself) is the load's problem, not a traceback on
    a thread's stderr beside a load that passed; and no instance was killed, so nothing names
    one (run.json's `killed` would call the run red on purpose, load.json a planted kill).
    Found in review: the killed instance was recorded before the kill was tried."""
    import harness.run.load.death as death_module

    load, _, _ = killable_load(tmp_path, monkeypatch)

    def cannot(server: Any) -> None:
        raise PermissionError(f"cannot signal {server.name}")

    monkeypatch.setattr(death_module, "kill_instance", cannot)
    if earlier is not None:  # an earlier load of the same run killed one
        load.sweep.run_info["killed"] = earlier
    result_ = load.run()
    assert not result_.passed
    assert result_.problems[0] == (
        "the planted kill failed: PermissionError: cannot signal 1E+1PD/pd0"
    )
    assert result_.killed is None and result_.killed_at_s is None
    assert load.sweep.run_info.get("killed") == earlier


def test_a_loads_problems_add_to_those_the_run_had_before_it(tmp_path: Path) -> None:
    """A pytest session's loads share one run: each one's problems join those of the run
    (an earlier load's, a fault's), never replace them."""
    load, _ = stand_in_load(tmp_path, requests=6, session_type=NixlStandIn, withheld=4)
    load.sweep.run_info["problems"] = ["an earlier load's problem"]
    [problem] = load.run().problems
    assert load.sweep.run_info["problems"] == ["an earlier load's problem", problem]


def test_requests_that_only_touch_in_time_were_not_in_flight_together() -> None:
    answered = Observed(Outcome("ld-text", result=result((1,))), ())
    first = Sent(PlannedRequest(1, "ld-text"), answered, 0.0, 1.0)
    after = Sent(PlannedRequest(2, "ld-text"), answered, 1.0, 2.0)
    during = Sent(PlannedRequest(3, "ld-text"), answered, 0.5, 1.5)
    assert not first.overlaps(after) and not after.overlaps(first)
    assert first.overlaps(during) and during.overlaps(after)


class DiesUnderNixl(NixlStandIn):
    """1P+1D under NIXL whose instance dies after answering 3 requests."""

    def __init__(self, answers: dict[str, ChatResult], settings: RunSettings) -> None:
        super().__init__(answers, settings)
        self.dies_after = 3

    def send(self, prompt: str, body: dict[str, Any]) -> Outcome:
        if self.calls >= self.dies_after:
            return StandIn.send(self, prompt, body)  # the instance is dead: an error
        return super().send(prompt, body)


def test_a_round_a_death_ended_is_not_accounted(tmp_path: Path) -> None:
    """Its requests' transfers stopped part way: D's counters hold no whole round to account,
    and the death is what failed the load."""
    load, _ = stand_in_load(tmp_path, requests=6, session_type=DiesUnderNixl)
    result_ = load.run()
    assert result_.ended_by is not None and not result_.passed
    assert result_.kv.rounds == 0 and result_.kv_accounts == []
    assert not (tmp_path / KV_ACCOUNTS_FILE).exists()


def test_a_plain_load_sends_the_prompt_declared_to_end_d_last_alone(tmp_path: Path) -> None:
    sweep, answers = tail_sweep(tmp_path)
    session = EpdStandIn(answers, sweep.settings)
    sweep.pool.session = lambda topology, settings=None, devices=None: session  # type: ignore[method-assign]
    spec = LoadSpec("1E+1P+1D", requests=8, concurrency=1, distinct_media=3)
    result_ = LoadRun(spec, sweep, on_progress=lambda _: None).run()
    last = result_.results[-1]
    assert last.prompt == TAIL_PROMPT and not last.not_sent
    assert TAIL_PROMPT not in [r.prompt for r in result_.results[:-1]]


def test_the_prompt_declared_to_end_d_is_not_sent_alone_after_a_death_ended_the_load(
    tmp_path: Path,
) -> None:
    """A death in the rounds ends the load: the request kept to go last, alone, is recorded
    as not sent, never sent to a topology started again after the load ended."""
    sweep, answers = tail_sweep(tmp_path)
    session = EpdStandIn(answers, sweep.settings)
    session.dies_after = 3
    sweep.pool.session = lambda topology, settings=None, devices=None: session  # type: ignore[method-assign]
    spec = LoadSpec("1E+1P+1D", requests=8, concurrency=1, distinct_media=3)
    result_ = LoadRun(spec, sweep, on_progress=lambda _: None).run()
    assert result_.ended_by is not None
    last = result_.results[-1]
    assert last.prompt == TAIL_PROMPT and last.not_sent


def test_a_death_ends_a_soak_with_the_round_it_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No round starts after a death, however long the soak had to run."""
    import harness.run.load.run as run_module

    ticks = iter(range(10_000))
    monkeypatch.setattr(run_module, "time", SimpleNamespace(monotonic=lambda: float(next(ticks))))
    load, session = stand_in_load(tmp_path, requests=4, dies_after=6)
    load.spec = dataclasses.replace(load.spec, duration_s=1000.0)
    result_ = load.run()
    assert result_.ended_by is not None
    assert result_.rounds == 2 and session.calls == 7


def test_the_request_named_as_carrying_a_prompt_is_one_in_flight_with_the_answer() -> None:
    """An answer that belongs to another prompt came from a request in flight with it: that
    one is named, before one nearer by number that was not."""
    answered = Observed(Outcome("ld-text", result=result((1,))), ())
    item = Sent(PlannedRequest(5, "ld-text"), answered, 10.0, 11.0)
    nearer = Sent(PlannedRequest(4, "ld-shared-a"), answered, 0.0, 1.0)
    together = Sent(PlannedRequest(9, "ld-shared-a"), answered, 10.5, 12.0)
    assert carrier([nearer, item, together], item, "ld-shared-a") == together.request.name
    assert carrier([nearer, item], item, "ld-shared-a") == nearer.request.name


def command_load_with_stand_ins(
    argv: list[str], result_of, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> tuple[int, list[LoadSpec], list[Any]]:
    """`epd-harness load ARGV` through `command_load`, its run stood in: no preflight, no pool,
    no sweep; `result_of(spec)` is what the load's run returns. The exit code, every spec the
    load was run with, and every run request it prepared."""
    import harness.cli.load as load_cli
    from harness.cli.main import Progress, build_parser

    settings = SimpleNamespace(run_dir=tmp_path)

    asked: list[Any] = []

    def prepared(request):
        asked.append(request)
        topology = SimpleNamespace(name=request.topologies[0])
        return SimpleNamespace(
            settings=settings, topologies=[topology], prompts=(), baseline_cache=None, goldens=()
        )

    class Pool:
        def __init__(self, *args: object) -> None:
            pass

        def close(self) -> None:
            pass

        def summary(self) -> str:
            return "no instance started"

    class StoodInSweep:
        def __init__(self, *args: object, **kwargs: object) -> None:
            self.run_info: dict[str, Any] = {}

        def write_outputs(self) -> None:
            (tmp_path / "load.md").write_text("# Load\n\n## Requests\n")

    ran: list[LoadSpec] = []

    class StoodInRun:
        def __init__(self, spec: LoadSpec, sweep: StoodInSweep) -> None:
            self.spec = spec
            self.recorded = sweep.run_info["load"]  # run.json's record of the load

        def run(self) -> LoadResult:
            ran.append(self.spec)
            fields = ("requests", "concurrency", "stream", "distinct_media", "kill")
            said = {"topology": self.spec.topology, "duration_s": self.spec.duration_s}
            assert self.recorded == said | {f: getattr(self.spec, f) for f in fields}
            return result_of(self.spec)

    monkeypatch.setattr(load_cli, "prepare_run", prepared)
    monkeypatch.setattr(load_cli, "TopologyPool", Pool)
    monkeypatch.setattr(load_cli, "Sweep", StoodInSweep)
    monkeypatch.setattr(load_cli, "LoadRun", StoodInRun)
    args = build_parser().parse_args(["load", *argv])
    args.progress = Progress()
    return load_cli.command_load(args), ran, asked


@pytest.mark.parametrize("passed, exit_code", [(2, 0), (1, 1), (0, 1)])
def test_load_exits_0_only_when_every_request_passed(
    passed: int, exit_code: int, monkeypatch, tmp_path: Path
) -> None:
    """`epd-harness load`'s exit code is its result's verdict (`LoadResult.passed`): a load
    one of whose requests failed exits 1, whatever the rest did."""

    def judged_two(spec: LoadSpec) -> LoadResult:
        result_ = LoadResult(spec)
        result_.tally.requests, result_.tally.passed = 2, passed
        return result_

    code, _, _ = command_load_with_stand_ins(
        ["--topology", "1E+1PD"], judged_two, monkeypatch, tmp_path
    )
    assert code == exit_code


def test_the_load_run_is_the_one_its_flags_ask_for(monkeypatch, tmp_path: Path) -> None:
    """Every load flag reaches the load that runs, and run.json's record of it, not only its
    checks: a dropped one ran the default load (no kill planted, unstreamed, the default mix)
    and judged it."""
    flags = ["--topology", "1E+1P+1D", "--requests", "20", "--concurrency", "5", "--stream"]
    _, [killed], [request] = command_load_with_stand_ins(
        [*flags, "--media", "7", "--kill", "decode"], LoadResult, monkeypatch, tmp_path
    )
    assert killed == LoadSpec(
        "1E+1P+1D", requests=20, concurrency=5, stream=True, distinct_media=7, kill="decode"
    )
    assert request.stream, "the run's settings (run.json's stream) say the load streamed"
    _, [soak], _ = command_load_with_stand_ins(
        ["--topology", "1E+1PD", "--duration", "90"], LoadResult, monkeypatch, tmp_path
    )
    assert soak.duration_s == 90 and not soak.stream and soak.kill is None


def test_a_load_sent_one_at_a_time_has_no_request_batched(tmp_path: Path) -> None:
    """A request is batched only if another request was in flight with it, never by
    overlapping itself: a load of concurrency 1 judges every answer exactly, with no batch
    floor, and its account counts none batched."""
    load, _ = stand_in_load(tmp_path, requests=4)
    result_ = load.run()
    assert [r.batched for r in result_.results] == [False] * 4
    assert result_.tally.batched == 0
    assert json.loads((tmp_path / "load.json").read_text())["stats"]["batched"] == 0


class NearTie(SlowStandIn):
    """Answers ld-shared-a with "near-tie" every time (no calibration runs on it here)."""

    def send(self, prompt: str, body: dict[str, Any]) -> Outcome:
        time.sleep(0.2)
        given = "near-tie" if prompt == "ld-shared-a" else prompt
        return Outcome(prompt, result=self.answers[given], seconds=0.01)


def test_a_batched_answer_may_drift_within_its_own_loads_floor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The floor this load's calibration measured at its concurrency is its batched answers'
    tolerance: a near tie within it is a DRIFT that passes, as the baseline showed batching
    moves log-probs that much."""
    import harness.run.load.run as run_module
    from harness.run.baseline import BatchedAnswer

    load, session = stand_in_load(tmp_path, requests=2, session_type=NearTie, concurrency=2)
    near_tie_on_a_gpu(load, session)
    own = BatchCalibration(2, (BatchedAnswer("request 1", "ld-shared-a", True, 0.5, ""),), "x")
    monkeypatch.setattr(run_module, "calibrate_load", lambda *_: (own, "measured"))
    result_ = load.run()
    first = result_.results[0]
    assert first.prompt == "ld-shared-a" and first.batched
    assert first.record.verdict is Verdict.DRIFT and first.record.policy_passed, first.record
    assert result_.passed, result_.problems


def test_an_answer_whose_prompt_ids_alone_differ_names_no_request_of_its_own_prompt(
    tmp_path: Path,
) -> None:
    """Request 8 carries ld-shared-a as request 1 does; its answer generated ld-shared-a's
    tokens on other prompt ids. That is its own prompt's answer gone wrong, no answer of
    another request: no "generated request 1's answer"."""
    load, session = stand_in_load(tmp_path, requests=10, swap={8: "other-ids"})
    own = session.answers["ld-shared-a"]
    session.answers["other-ids"] = dataclasses.replace(own, prompt_token_ids=(1, 7, 7, 7))
    result_ = load.run()
    eighth = result_.results[7]
    assert eighth.prompt == "ld-shared-a" and eighth.record.verdict is Verdict.MISMATCH
    assert "request" not in eighth.record.detail, eighth.record.detail


class DiesOfItsDecodeTail(EpdStandIn):
    """D dies on the request whose media end in the part it recomputes, as declared."""

    def send(self, prompt: str, body: dict[str, Any]) -> Outcome:
        if prompt != TAIL_PROMPT:
            return super().send(prompt, body)
        self.calls += 1
        self.tail_sent = True
        return Outcome(
            prompt,
            error="instance 1E+1P+1D/decode0 exited with code 1; last lines of decode0.log:\n"
            "AssertionError: Expected number of multimodal embeddings to match\nHTTP 502",
        )

    def dead_instance(self) -> DeadInstance | None:
        if getattr(self, "tail_sent", False):
            return DeadInstance("1E+1P+1D/decode0", 1, Path("decode0.log"), "...")
        return None


def test_the_request_sent_alone_that_ends_d_as_declared_passes_the_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prompt declared to end D is sent last, alone, and judged with its declaration: its
    ERROR is the declared failure, a row of the load that passed (no load fails by it)."""
    from harness.report.resources import ResourceHistory

    ended: list[tuple[str, str]] = []
    monkeypatch.setattr(
        ResourceHistory, "ended_after_the_samples", lambda _, *args: ended.append(args)
    )
    sweep, answers = tail_sweep(tmp_path)
    from harness.judge.verdicts import Stability

    sweep.baseline.stability = {name: Stability(True, "stable", 0.0) for name in answers}
    session = DiesOfItsDecodeTail(answers, sweep.settings)
    sweep.pool.session = lambda topology, settings=None, devices=None: session  # type: ignore[method-assign]
    spec = LoadSpec("1E+1P+1D", requests=8, concurrency=1, distinct_media=3)
    result_ = LoadRun(spec, sweep, on_progress=lambda _: None).run()
    last = result_.results[-1]
    assert last.prompt == TAIL_PROMPT and last.record.verdict is Verdict.ERROR
    assert last.record.declared_failure == "epd-media-in-decode-tail", last.record
    assert last.record.policy_passed and last.row().passed
    # The death it declares is said, not only its ERROR counted (real vLLM: load.md named
    # neither D nor its end).
    assert result_.declared_deaths == [
        f"request 8 ({TAIL_PROMPT}), sent last and alone, ended instance 1E+1P+1D/decode0 "
        "exited with code 1 (its log: decode0.log)"
    ], result_.declared_deaths
    notes = json.loads((tmp_path / "load.json").read_text())["notes"]
    assert f"as declared: {result_.declared_deaths[0]}" in notes, notes
    # D's resources row says it ended after the last sample (real vLLM: its live figures).
    assert ended == [("1E+1P+1D/decode0", "after request 8 (sent alone, after the last sample)")]


class ExitsAfterItsDecodeTail(DiesOfItsDecodeTail):
    """As real vLLM 0.32.0: the tail request's error comes back while D is still shutting down
    (its API server exits a second or two after its engine died), so D is found dead only on
    a later look."""

    looks_before_dead = 3

    def dead_instance(self) -> DeadInstance | None:
        if not getattr(self, "tail_sent", False):
            return None
        self.looks_before_dead -= 1
        return super().dead_instance() if self.looks_before_dead < 0 else None


def test_the_death_a_request_sent_alone_declares_is_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load on real vLLM looked for D's death the moment the tail request's error came back,
    found D still exiting, and load.md said nothing of it. The death is waited for (bounded)."""
    sweep, answers = tail_sweep(tmp_path)
    from harness.judge.verdicts import Stability
    from harness.run.load import death as death_module

    monkeypatch.setattr(death_module, "DEATH_POLL_S", 0.0)
    sweep.baseline.stability = {name: Stability(True, "stable", 0.0) for name in answers}
    session = ExitsAfterItsDecodeTail(answers, sweep.settings)
    sweep.pool.session = lambda topology, settings=None, devices=None: session  # type: ignore[method-assign]
    spec = LoadSpec("1E+1P+1D", requests=8, concurrency=1, distinct_media=3)
    result_ = LoadRun(spec, sweep, on_progress=lambda _: None).run()
    assert result_.results[-1].record.verdict is Verdict.ERROR
    assert result_.declared_deaths == [
        f"request 8 ({TAIL_PROMPT}), sent last and alone, ended instance 1E+1P+1D/decode0 "
        "exited with code 1 (its log: decode0.log)"
    ], result_.declared_deaths


def test_a_kill_planted_in_a_round_of_fewer_requests_than_its_concurrency_comes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--requests 2 --concurrency 4 --kill pd`: the round can have 2 requests in flight, not
    4, and the kill comes once both are (a wait short here: held for the 4 of the concurrency
    the round would wait out KILL_WAIT_S and the kill never come)."""
    import harness.run.load.run as run_module

    monkeypatch.setattr(run_module, "KILL_WAIT_S", 2.0)
    load, _, killed = killable_load(tmp_path, monkeypatch)
    load.spec = LoadSpec("1E+1PD", requests=2, concurrency=4, distinct_media=3, kill="pd")
    result_ = load.run()
    assert killed == ["1E+1PD/pd0"] and result_.killed == "1E+1PD/pd0", result_.problems
    assert result_.passed, result_.problems
