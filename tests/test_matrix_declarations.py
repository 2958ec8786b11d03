"""The scenario matrix's declarations and how a scenario's result is read (no vLLM)."""

from __future__ import annotations

import json

import pytest

from harness.judge.compare import Verdict
from harness.judge.guards import GuardResult
from harness.judge.records import DeclaredFailure
from harness.outcomes.chat import ChatResult
from harness.outcomes.outcome import Outcome
from harness.report.text import CaseRecord
from harness.run.matrix import Scenario, ScenarioResult
from harness.run.scenarios import IDLE_GAP_S, MATRIX, SendMode, get_scenario, matrix_prompts
from harness.spec.prompts import ImagePart, PromptSpec, TextPart
from harness.spec.topology import TOPOLOGIES
from harness.testing.builders import case_record, chat
from harness.testing.judging import judged

pytestmark = pytest.mark.unit


def record(verdict: Verdict, error: str | None = None, passed: bool = True) -> CaseRecord:
    return case_record("1E+1P+1D:s", "p", verdict, passed, detail="d", guards={}, error=error)


def test_every_scenario_names_a_known_topology_and_has_prompts() -> None:
    names = [s.name for s in MATRIX]
    assert len(names) == len(set(names)), "scenario names must be unique (they are test ids)"
    for scenario in MATRIX:
        assert scenario.topology in TOPOLOGIES, scenario.name
        assert scenario.prompts, scenario.name
        if scenario.expect != (Verdict.MATCH,):
            assert scenario.reason and scenario.expect_evidence, f"{scenario.name}: say why"


def test_a_scenario_sends_one_image_under_two_kwarg_sets() -> None:
    """The one test of the engine's key derivation (vLLM #56786) that holds through either
    proxy: the proxy keys an item by its URL as upstream's does, so only the engine keeps one
    image's kwarg sets apart. The same image, under no kwargs and two max_pixels caps, one
    request after another on one 1E+1PD session, each judged against the baseline."""
    scenario = get_scenario("ec-same-image-across-kwargs")
    assert scenario.topology == "1E+1PD" and scenario.mode is SendMode.SEQUENTIAL
    assert scenario.expect == (Verdict.MATCH,)
    seeds = {p.seed for spec in scenario.prompts for p in spec.parts if isinstance(p, ImagePart)}
    assert len(seeds) == 1
    kwarg_sets = [dict(spec.extra).get("mm_processor_kwargs") for spec in scenario.prompts]
    assert None in kwarg_sets
    assert len({json.dumps(k, sort_keys=True) for k in kwarg_sets if k}) >= 2


def test_matrix_prompts_are_distinct_by_name() -> None:
    prompts = matrix_prompts()
    assert len({p.name for p in prompts}) == len(prompts)


def test_a_prompt_name_reused_for_another_prompt_is_refused() -> None:
    a = PromptSpec("same", (TextPart("one"),))
    b = PromptSpec("same", (TextPart("two"),))
    with pytest.raises(ValueError, match="'same' is used for two different prompts"):
        matrix_prompts((Scenario("x", "1E+1PD", (a,)), Scenario("y", "1E+1PD", (b,))))


def test_unknown_scenario_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown scenario 'nope'.*ec-images-1-2-3"):
        get_scenario("nope")


def test_match_scenario_with_a_mismatch_has_a_problem() -> None:
    result = ScenarioResult(Scenario("s", "1E+1PD", ()), [record(Verdict.MISMATCH, passed=False)])
    assert result.problems() == ["p: MISMATCH: d"]


def test_a_failed_check_is_a_problem_even_when_every_case_passed() -> None:
    check = GuardResult("every_encoder_used", False, "encoders ['e0', 'e1']; received work: ['e0']")
    result = ScenarioResult(Scenario("s", "2E+1PD", ()), [record(Verdict.MATCH)], [check])
    assert result.problems() == [f"check every_encoder_used failed: {check.evidence}"]


def test_expected_error_needs_its_evidence() -> None:
    """A declared failure is judged on the one judging path: it passes only as declared."""
    scenario = Scenario(
        "s",
        "1E+1P+1D",
        (),
        expect=(Verdict.ERROR,),
        expect_evidence="Expected number of multimodal",
        reason="r",
    )
    reference = Outcome("p", ChatResult((1, 2), (5, 6), "", "length"))

    def judged_as_declared(candidate: Outcome):
        return judged("1E+1P+1D:s", "baseline", reference, candidate, declared=scenario.declared)

    died = Outcome("p", error="HTTP 500\n... Expected number of multimodal embeddings ...")
    assert judged_as_declared(died).policy_passed
    other_error = judged_as_declared(Outcome("p", error="connection refused"))
    assert not other_error.policy_passed and "NOT the declared ERROR" in other_error.detail
    fixed_upstream = judged_as_declared(reference)
    assert fixed_upstream.verdict is Verdict.MATCH and not fixed_upstream.policy_passed
    assert ScenarioResult(scenario, [other_error]).problems() == [f"p: ERROR: {other_error.detail}"]


def test_a_declared_error_is_not_held_by_the_references_error() -> None:
    """The evidence of a declared ERROR is what the case's own topology logged: a baseline
    that died with that text, while the topology answered (the failure fixed upstream), is no
    declared failure held (it passed: the reference's error was read as the case's)."""
    failure = DeclaredFailure("ERROR", "Expected number of multimodal", "r", "s")
    baseline_died = Outcome("p", error="baseline died: Expected number of multimodal embeddings")
    answered = Outcome("p", ChatResult((1, 2), (5, 6), "", "length"))
    record = judged("1E+1P+1D:s", "baseline", baseline_died, answered, declared=failure)
    assert record.verdict is Verdict.ERROR and not record.policy_passed, record.detail
    assert "NOT the declared ERROR" in record.detail


class RecordingJudge:
    """Stands in for the sweep's judging: keeps what each answer was judged with."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def judge(self, topology, seen, **how) -> list[CaseRecord]:
        self.calls.append({"prompt": seen.outcome.prompt, **how})
        return [record(Verdict.MATCH)]


def judged_by_matrix(scenario: Scenario) -> list[dict]:
    from types import SimpleNamespace

    from harness.run.judging import Observed
    from harness.run.matrix import MatrixRun
    from harness.testing.builders import outcome

    answers = {p.name: outcome(p.name, [1, 2, 3]) for p in scenario.prompts}
    judging = RecordingJudge()
    sweep = SimpleNamespace(
        judging=judging,
        baseline=SimpleNamespace(outcomes=answers),
        add_records=lambda *args: None,
    )
    session = SimpleNamespace(topology=TOPOLOGIES[scenario.topology])
    observed = [Observed(outcome(p.name, [1, 2, 3]), ()) for p in scenario.prompts]
    MatrixRun(sweep)._judge(scenario, session, observed)
    return judging.calls


def test_concurrent_requests_are_judged_as_batched_with_each_others_answers_at_hand() -> None:
    """In flight together, the engine batches them in shapes the baseline never ran: on a GPU
    their log-probs may move within the measured batch noise (on CPU that floor is 0), and an
    answer that is another request's is named as such."""
    calls = judged_by_matrix(get_scenario("ec-concurrent-requests"))
    names = [p.name for p in get_scenario("ec-concurrent-requests").prompts]
    assert [c["prompt"] for c in calls] == names
    for call in calls:
        assert call["batched"] is True
        assert [name for name, _ in call["others"]] == [n for n in names if n != call["prompt"]]


def test_sequential_requests_are_judged_alone() -> None:
    scenario = get_scenario("ec-images-1-2-3")
    calls = judged_by_matrix(scenario)
    # Every request judged: over no calls at all the loop below asserted nothing.
    assert [c["prompt"] for c in calls] == [p.name for p in scenario.prompts], calls
    for call in calls:
        assert call["batched"] is False and not call["others"]


def sent_by_matrix(scenario: Scenario, run_streams: bool) -> list[dict]:
    """The bodies the matrix sends for `scenario` in a run given `--stream` or not."""
    from types import SimpleNamespace

    from harness.run.matrix import MatrixRun

    bodies: list[dict] = []

    def send(prompt: str, body: dict) -> Outcome:
        bodies.append(body)
        return Outcome(prompt, error="not served in this test")

    sweep = SimpleNamespace(
        bodies={p.name: {"messages": []} for p in scenario.prompts},
        settings=SimpleNamespace(stream=run_streams),
    )
    MatrixRun(sweep)._send(SimpleNamespace(send=send, served=None), scenario)
    return bodies


@pytest.mark.parametrize("run_streams", [True, False])
def test_a_scenario_is_sent_as_the_run_says_unless_it_streams_itself(run_streams: bool) -> None:
    """`run --stream` streams every EPD request, the matrix's too (found in review: an
    unstreamed scenario was sent unstreamed, its framing never checked); a scenario declared
    streamed streams whatever the run says."""
    spec = PromptSpec("p", (TextPart("hello"),))
    plain = sent_by_matrix(Scenario("s", "1E+1PD", (spec,)), run_streams)
    assert [body.get("stream", False) for body in plain] == [run_streams]
    streamed = sent_by_matrix(Scenario("s", "1E+1PD", (spec,), stream=True), run_streams)
    assert [body.get("stream") for body in streamed] == [True]


def test_a_round_robin_that_left_an_encoder_idle_fails_its_cases_in_every_artifact(
    tmp_path,
) -> None:
    """The scenario's check is a guard of each of its cases, judged on the one path: found in
    review, kept apart it failed the exit code while summary.json, verdicts.txt and the
    report said every case passed."""
    import json
    from types import SimpleNamespace

    from harness.report.run_outputs import write_run_outputs
    from harness.run.judging import Observed
    from harness.run.matrix import MatrixRun
    from harness.spec.topology import Role
    from harness.testing.builders import chat

    scenario = get_scenario("ec-two-encoders-round-robin")
    records: list = []

    def add_records(label, seen, new_records):
        records.extend(new_records)
        write_run_outputs(tmp_path, records, {label: {o.prompt: o for o in seen}}, {}, {})

    def judge(topology, seen, **_):
        same = Outcome(seen.outcome.prompt, result=chat((5, 6)))
        return [judged(f"2E+1PD:{scenario.name}", "baseline", same, seen.outcome, seen.guards)]

    sweep = SimpleNamespace(
        baseline=SimpleNamespace(outcomes={p.name: None for p in scenario.prompts}),
        judging=SimpleNamespace(judge=judge),
        add_records=add_records,
    )
    encoders = [SimpleNamespace(name=f"2E+1PD/encoder{i}", role=Role.ENCODER) for i in (0, 1)]
    pd = SimpleNamespace(name="2E+1PD/pd0", role=Role.PREFILL_DECODE)
    session = SimpleNamespace(topology=None, instances=[*encoders, pd])
    only_encoder0 = SimpleNamespace(
        instance="2E+1PD/encoder0", status=200, to_json=lambda: {"instance": "2E+1PD/encoder0"}
    )
    observed = [
        Observed(Outcome(p.name, result=chat((5, 6)), taps=[only_encoder0]), ())
        for p in scenario.prompts
    ]
    result = MatrixRun(sweep)._judge(scenario, session, observed)
    assert {record.verdict for record in result.records} == {Verdict.VACUOUS}
    assert json.loads((tmp_path / "summary.json").read_text())["passed"] is False


def test_a_scenario_the_served_release_cannot_run_is_not_applicable_and_sends_nothing() -> None:
    """On 0.27-0.30 a scenario with media was sent and ERRORed or MISMATCHed for reasons the
    sweep declares (found in review). Its requests belong together: one request the release
    cannot run makes the whole scenario NOT_APPLICABLE, none sent."""
    from types import SimpleNamespace

    from harness.judge.verdicts import not_applicable_case
    from harness.run.matrix import MatrixRun

    scenario = get_scenario("ec-same-image-across-requests")
    added: list = []

    def never(*args, **kwargs):
        raise AssertionError("nothing may start or be sent")

    judging = SimpleNamespace(
        not_applicable=lambda topology, spec: "raw-media: no metadata" if spec.parts else None,
        not_applicable_record=lambda label, prompt, why: not_applicable_case(
            label, prompt, "baseline", why
        ),
    )
    sweep = SimpleNamespace(
        settings=SimpleNamespace(serving=SimpleNamespace(kv_connector="ExampleConnector")),
        judging=judging,
        serve_baseline=never,
        pool=SimpleNamespace(session=never),
        add_records=lambda label, outcomes, records: added.extend(records),
    )
    result = MatrixRun(sweep).run(scenario)
    assert [r.verdict for r in result.records] == [Verdict.NOT_APPLICABLE] * len(scenario.prompts)
    assert not any(r.policy_passed for r in result.records) and added == result.records
    assert result.records[1].detail.endswith(
        f"with {scenario.prompts[0].name}: raw-media: no metadata"
    )


def test_a_prompt_that_sets_the_stage_is_judged_without_the_declaration() -> None:
    """`declared_for`: the earlier request of a two-request scenario must MATCH; only the one
    the failure is of is judged as declared."""
    scenario = get_scenario("epd-kv-lookup-miss-kills-prefill")
    stage, failing = (p.name for p in scenario.prompts)
    assert scenario.declared_of(stage) is None
    assert scenario.declared_of(failing) == scenario.declared is not None
    calls = {call["prompt"]: call["declared"] for call in judged_by_matrix(scenario)}
    assert calls == {stage: None, failing: scenario.declared}
    plain = get_scenario("epd-kv-lookup-miss-text")
    assert plain.declared_of(plain.prompts[0].name) == plain.declared is not None


def test_a_scenario_declared_on_empty_kv_storage_gets_it_emptied_first(tmp_path) -> None:
    """ExampleConnector keys KV by the prompt's token prefix alone: a folder an earlier request
    left under the same prefix changes what P and D find (real vLLM: after the sweep's text,
    P died on epd-kv-lookup-miss-text's prompt). The matrix empties the KV storage, and only
    for the scenarios that say so."""
    from types import SimpleNamespace

    from harness.run.matrix import MatrixRun

    kv = tmp_path / "kv"
    (kv / "leftover").mkdir(parents=True)
    (kv / "leftover" / "layer.safetensors").write_bytes(b"x")
    seen_before_send: list[list[str]] = []

    def send(session, scenario):
        seen_before_send.append(sorted(p.name for p in kv.rglob("*")))
        return []

    session = SimpleNamespace(kv_storage=kv)
    sweep = SimpleNamespace(
        serve_baseline=lambda: None,
        pool=SimpleNamespace(session=lambda topology: session),
        settings=SimpleNamespace(serving=SimpleNamespace(kv_connector="ExampleConnector")),
        judging=SimpleNamespace(not_applicable=lambda topology, prompt: None),
        add_records=lambda *args: None,
    )
    run = MatrixRun(sweep)
    run._send = send
    run._judge = lambda scenario, session, observed: ScenarioResult(scenario)
    run.run(get_scenario("epd-kv-lookup-miss-media"))  # declared on any storage: left alone
    run.run(get_scenario("epd-kv-lookup-miss-text"))
    assert seen_before_send == [["layer.safetensors", "leftover"], []]
    assert kv.is_dir(), "the storage directory itself stays"


def test_a_declaration_is_of_the_scenarios_own_prompts_and_not_of_all_when_it_names_some() -> None:
    for scenario in MATRIX:
        names = {p.name for p in scenario.prompts}
        assert set(scenario.declared_for) <= names, scenario.name
        assert not scenario.declared_for or scenario.declared is not None, scenario.name
        assert len(scenario.declared_for) < len(names) or not scenario.declared_for, (
            f"{scenario.name}: a declaration of every prompt names none"
        )


def test_a_scenario_whose_topology_cannot_start_fails_its_cases_and_the_matrix_goes_on() -> None:
    """As the sweep fails the cases of a topology that cannot start: found in review, the
    start's exception left `run --scenario` mid-matrix, exit 2 ("error:", as a baseline that
    cannot start), with no verdict table and none of the later scenarios run."""
    from pathlib import Path
    from types import SimpleNamespace

    from harness.judge.verdicts import Reference
    from harness.run.judging import CaseJudge
    from harness.run.matrix import MatrixRun
    from harness.spec.settings import RunSettings
    from harness.spec.topology import ServingConfig

    scenario = get_scenario("ec-images-1-2-3")
    added: list = []

    def cannot_start(topology):
        raise RuntimeError(f"{topology.name}/encoder0 exited with code 1 during start-up")

    answers = {p.name: Outcome(p.name, result=chat((5, 6))) for p in scenario.prompts}
    baseline = SimpleNamespace(
        outcomes=answers,
        label="baseline",
        noise_floor=0.0,
        batched_noise_floor=None,
        reference=lambda prompt: Reference("baseline", answers[prompt], True, stable=True),
    )
    settings = RunSettings(serving=ServingConfig(model="/m"), run_dir=Path("/nonexistent"))
    sweep = SimpleNamespace(
        settings=settings,
        judging=CaseJudge(settings, baseline),
        serve_baseline=lambda: None,
        pool=SimpleNamespace(session=cannot_start),
        add_records=lambda label, outcomes, records: added.extend(records),
    )
    result = MatrixRun(sweep).run(scenario)
    assert [r.verdict for r in result.records] == [Verdict.ERROR] * len(scenario.prompts)
    # Each case under its scenario's label (the report's row, repro's case name).
    assert {r.topology for r in result.records} == {"1E+1PD:ec-images-1-2-3"}
    assert all("1E+1PD could not start" in (r.error or "") for r in result.records)
    assert "encoder0 exited" in (result.records[0].error or "")
    assert added == result.records and result.problems()


def test_a_concurrent_scenario_is_not_held_to_a_loads_calibrated_floor() -> None:
    """A scenario's concurrent requests may drift within the noise the baseline's batched
    pass showed (`noise_floor`). Found in review: they were held to the largest floor of every
    load's calibration the session had measured (a pytest session calibrates its loads ahead),
    so a near tie the baseline never showed passed, or not, by which loads the session ran."""
    from pathlib import Path
    from types import SimpleNamespace

    from harness.judge.verdicts import Reference
    from harness.outcomes.chat import PositionLogprobs
    from harness.run.judging import CaseJudge, Observed
    from harness.run.matrix import MatrixRun
    from harness.spec.settings import RunSettings
    from harness.spec.topology import ServingConfig

    scenario = get_scenario("ec-concurrent-requests")
    assert scenario.mode is SendMode.CONCURRENT

    def answer(last: int, rival: int) -> ChatResult:
        logprobs = (
            PositionLogprobs(5, -1.0, ((5, -1.0), (6, -1.01))),
            PositionLogprobs(last, -1.0, ((last, -1.0), (rival, -1.005))),
        )
        return ChatResult((1, 2, 3), (5, last), "", "length", logprobs)

    answers = {p.name: Outcome(p.name, result=answer(7, 8)) for p in scenario.prompts}
    baseline = SimpleNamespace(
        outcomes=answers,
        label="baseline",
        noise_floor=0.0,  # the batched pass moved nothing
        batched_noise_floor=0.5,  # a load's calibration, at its own concurrency
        reference=lambda prompt: Reference("baseline", answers[prompt], True, stable=True),
    )
    settings = RunSettings(serving=ServingConfig(model="/m"), run_dir=Path("/nonexistent"))
    sweep = SimpleNamespace(
        settings=settings,
        baseline=baseline,
        judging=CaseJudge(settings, baseline),
        add_records=lambda label, outcomes, records: None,
    )
    near_tie = scenario.prompts[0].name
    observed = [
        Observed(Outcome(p.name, result=answer(8, 7) if p.name == near_tie else answer(7, 8)), ())
        for p in scenario.prompts
    ]
    session = SimpleNamespace(topology=TOPOLOGIES[scenario.topology])
    result = MatrixRun(sweep)._judge(scenario, session, observed)  # type: ignore[arg-type]
    [record] = [r for r in result.records if r.prompt == near_tie]
    assert record.verdict is Verdict.MISMATCH, record.detail


def found_entry(topology: str, kv_connector: str | None) -> dict:
    """A found_scenarios.json entry as `fuzz --save` writes it (harness.run.fuzz.save)."""
    from harness.spec.prompt_codec import prompt_to_json

    meta = {"seed": 3, "vllm": "0.32.0+cpu"}
    if kv_connector is not None:
        meta["kv_connector"] = kv_connector
    prompt = PromptSpec("fuzz-x-request", (ImagePart(seed=9), TextPart("hi")))
    return {
        "name": f"fuzz-x-{topology}",
        "topology": topology,
        "prompts": [prompt_to_json(prompt)],
        "expect": ["ERROR"],
        "expect_evidence": "Expected number of multimodal embeddings to match",
        "reason": "found by fuzz",
        "found_by": meta,
    }


def test_a_found_failure_is_declared_under_the_kv_connector_it_was_found_under(tmp_path) -> None:
    """`fuzz --save` records the KV connector a failure was found under (found_by), and the
    matrix declared it under every one: a KV failure of ExampleConnector's, expected of a
    NixlConnector run too, failed that run's matrix as 'NOT as declared' (the built-in ones
    say so with expect_by_kv_connector). A topology without a P->D hop is declared whatever
    the connector."""
    from harness.run.scenarios import found_scenarios

    path = tmp_path / "found.json"
    path.write_text(
        json.dumps(
            [
                found_entry("1E+1P+1D", "ExampleConnector"),
                found_entry("1E+1PD", "ExampleConnector"),
                found_entry("1P+1D", None),  # saved before the connector was recorded
            ]
        )
    )
    kv, ec_only, unsaid = found_scenarios(path)
    assert kv.for_kv_connector("ExampleConnector").declared is not None
    assert kv.for_kv_connector("NixlConnector").declared is None
    assert ec_only.for_kv_connector("NixlConnector").declared is not None
    assert unsaid.for_kv_connector("NixlConnector").declared is not None


def test_a_declared_failure_does_not_hide_a_transfer_guard_that_failed_too() -> None:
    """A declared failure holds only while it is the case's one failure: a declared MISMATCH
    ('generated tokens differ') whose transfer guard failed too, or a declared VACUOUS on the
    kv_transfer guard whose EC guard failed too, is another failure of the same case (found in
    review: both passed as declared, the failed guard named nowhere in the detail)."""
    reference = Outcome("p", ChatResult((1, 2), (5, 6), "", "length"))
    differs = Outcome("p", ChatResult((1, 2), (5, 7), "", "length"))
    no_ec = GuardResult("consumer_embeds", False, "parts the consumer received: ['image_url']")
    no_kv = GuardResult("kv_transfer", False, "D cached_tokens=0, expected >= 96")
    mismatch = DeclaredFailure("MISMATCH", "generated tokens differ", "r", "s")
    vacuous = DeclaredFailure("VACUOUS", "tokens equal but guard failed: kv_transfer", "r", "s")

    def as_declared(candidate: Outcome, guards, declared: DeclaredFailure):
        return judged("1E+1P+1D:s", "baseline", reference, candidate, guards, declared=declared)

    assert as_declared(differs, [], mismatch).policy_passed  # the declared failure alone
    hidden = as_declared(differs, [no_ec], mismatch)
    assert hidden.verdict is Verdict.MISMATCH and not hidden.policy_passed, hidden.detail
    assert "consumer_embeds" in hidden.detail
    assert as_declared(reference, [no_kv], vacuous).policy_passed  # the declared failure alone
    both = as_declared(reference, [no_kv, no_ec], vacuous)
    assert both.verdict is Verdict.VACUOUS and not both.policy_passed, both.detail
    assert "consumer_embeds" in both.detail


def test_a_declared_mismatch_that_now_drifts_is_not_as_declared() -> None:
    """A declaration holds only while the case ends with the declared verdict: a DRIFT's
    headline reads "generated tokens differ" too, so the evidence alone would hold a declared
    MISMATCH that vLLM now answers within the noise floor, and hide that change."""

    def near_tie(tokens: tuple[int, ...]) -> Outcome:
        ranked = lambda i, t: [(t, -1.0), (8 if t == 6 else 6, -1.1)]  # noqa: E731
        return Outcome("p", chat(tokens, top=ranked))

    mismatch = DeclaredFailure("MISMATCH", "generated tokens differ", "r", "s")
    record = judged(
        "1E+1P+1D:s",
        "baseline",
        near_tie((5, 6)),
        near_tie((5, 8)),
        [],
        reference_policy="pd-drift",
        tolerance=0.2,
        declared=mismatch,
    )
    assert record.verdict is Verdict.DRIFT and record.detail.startswith("generated tokens differ")
    assert not record.policy_passed and "NOT the declared MISMATCH" in record.detail


@pytest.mark.parametrize(
    ("kv_connector", "declared"), [("ExampleConnector", True), ("NixlConnector", False)]
)
def test_a_matrix_run_judges_a_scenario_as_declared_under_the_runs_kv_connector(
    kv_connector: str, declared: bool
) -> None:
    """A failure declared of one KV connector only (`expect_by_kv_connector`) is judged as
    declared under that one, and as a plain case under the run's other connector: declared
    under every one, a NixlConnector run's MATCH failed as 'NOT as declared'. Found in review:
    a mutant that ran the scenario as written, whatever the run's connector, survived."""
    from types import SimpleNamespace

    from harness.run.judging import Observed
    from harness.run.matrix import MatrixRun
    from harness.testing.builders import outcome

    prompt = PromptSpec("p", (ImagePart(seed=9), TextPart("hi")))
    scenario = Scenario(
        "kv-only",
        "1E+1P+1D",
        (prompt,),
        expect=(Verdict.ERROR,),
        expect_evidence="boom",
        reason="upstream",
        expect_by_kv_connector=(("NixlConnector", (Verdict.MATCH,)),),
    )
    judging = RecordingJudge()
    judging.not_applicable = lambda topology, spec: None
    sweep = SimpleNamespace(
        settings=SimpleNamespace(serving=SimpleNamespace(kv_connector=kv_connector)),
        judging=judging,
        baseline=SimpleNamespace(outcomes={"p": outcome("p", [1, 2, 3])}),
        serve_baseline=lambda: None,
        pool=SimpleNamespace(session=lambda topology: SimpleNamespace(topology=topology)),
        add_records=lambda *args: None,
    )
    run = MatrixRun(sweep)
    run._send = lambda session, scenario: [Observed(outcome("p", [1, 2, 3]), ())]
    run.run(scenario)
    (call,) = judging.calls
    assert call["declared"] == (scenario.declared if declared else None)
    assert declared == (call["declared"] is not None)


def test_a_rerun_on_kept_storage_adds_its_own_verdicts_and_checks_to_the_scenarios() -> None:
    """A scenario rerun on the storage its session left (encoder-cache hits) is judged on
    both runs: the rerun's records and checks are the scenario's too, so a rerun that failed
    fails it. Found in review: mutants that dropped the rerun's records, or its checks,
    survived every unit test."""
    import contextlib
    from types import SimpleNamespace

    from harness.run.matrix import MatrixRun

    scenario = Scenario(
        "rerun",
        "1E+1PD",
        (PromptSpec("p", (ImagePart(seed=9), TextPart("hi"))),),
        rerun_on_kept_storage=True,
    )
    released: list[str] = []

    @contextlib.contextmanager
    def private(topology, why, label, reuse_storage):
        assert reuse_storage == "/kept"
        yield SimpleNamespace(name="rerun")

    sweep = SimpleNamespace(
        settings=SimpleNamespace(serving=SimpleNamespace(kv_connector="ExampleConnector")),
        judging=SimpleNamespace(not_applicable=lambda topology, spec: None),
        serve_baseline=lambda: None,
        pool=SimpleNamespace(
            session=lambda topology: SimpleNamespace(name="first", storage_dir="/kept"),
            release=released.append,
            private=private,
        ),
    )
    run = MatrixRun(sweep)
    run._send = lambda session, scenario: session.name
    failed = GuardResult("encoder_cache_hit", False, "no hit")

    def judge(scenario, session, observed):
        if observed == "first":
            return ScenarioResult(scenario, [record(Verdict.MATCH)], [])
        return ScenarioResult(scenario, [record(Verdict.MISMATCH, passed=False)], [failed])

    run._judge = judge
    result = run.run(scenario)
    assert released == ["1E+1PD"]
    assert [r.verdict for r in result.records] == [Verdict.MATCH, Verdict.MISMATCH]
    assert result.checks == [failed]
    assert len(result.problems()) == 2


def test_a_scenario_declaring_two_failing_verdicts_is_refused() -> None:
    """A declared failure names one verdict: a scenario that expected ERROR or MISMATCH would
    pass either way, so neither is a claim anything checks."""
    prompt = PromptSpec("two-verdicts", (TextPart("one"),))
    scenario = Scenario("x", "1E+1PD", (prompt,), expect=(Verdict.MISMATCH, Verdict.ERROR))
    with pytest.raises(ValueError, match="a declared failure names one verdict"):
        scenario.declared  # noqa: B018


@pytest.mark.parametrize(
    "name, ends",
    [
        ("epd-media-in-decode-tail", True),  # declared ERROR: an instance dies
        ("ec-rerun-on-kept-storage", True),  # stops the shared session to start afresh
        ("ec-video-jpeg-frames-default-fps", False),  # declared MISMATCH: nothing dies
        ("ec-images-1-2-3", False),
    ],
)
def test_a_scenario_that_kills_an_instance_or_reruns_ends_its_session(
    name: str, ends: bool
) -> None:
    """The matrix runs a scenario that ends its session after the others of its topology
    (harness.cli.main.run_matrix): one run before them would leave them a dead or stopped
    topology."""
    assert get_scenario(name).ends_its_session is ends


def test_each_scenario_sends_its_requests_as_its_name_says() -> None:
    """A scenario's name is what docs/scenarios.md and a run's verdicts call it: one named
    streamed, concurrent, idle, round-robin or a rerun on kept storage must send its requests
    that way, or the matrix covers less than it says (ec-streamed-concurrent without its
    stream is ec-concurrent-requests twice)."""
    for s in MATRIX:
        assert ("streamed" in s.name) is s.stream, s.name
        assert ("concurrent" in s.name) is (s.mode is SendMode.CONCURRENT), s.name
        assert ("idle" in s.name) is (s.mode is SendMode.IDLE_GAPS), s.name
        assert ("round-robin" in s.name) is s.require_every_encoder, s.name
        assert ("rerun-on-kept-storage" in s.name) is s.rerun_on_kept_storage, s.name


def test_the_idle_gap_outlasts_vllms_keep_alive() -> None:
    """ec-idle-over-keepalive pauses between requests so that vLLM closes the idle keep-alive
    connection (after 5 s, #41567): a shorter pause tests nothing."""
    vllm_keep_alive_s = 5.0
    assert IDLE_GAP_S > vllm_keep_alive_s
