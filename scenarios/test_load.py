"""Loads on real vLLM: many requests at once over the load mix (harness.spec.load), every
answer judged against the baseline's answer to its own prompt.

- a small load on 1E+1P+1D, unstreamed and streamed (what CI runs): every request passes;
- under NIXL, a load on 1P+1D in which one request's KV never reached D fails the round's KV
  account;
- a load that ends with the mix's media-in-the-decode-tail request, sent last and alone, which
  must fail exactly as the matrix declares it for the run's KV connector (it ends D: CI leaves
  it to the matrix's `epd-media-in-decode-tail`, so D is not started twice);
- death under load: D is SIGKILLed with every request in flight; each must end ERROR naming D
  within seconds, nothing may hang, and nothing of the topology may be left running;
- a short soak on 1E+1PD: RSS, open files and storage held to the load's bounds.

The long figures (64 requests at concurrency 16, a 600 s soak) come from `epd-harness load`
(docs/load.md).
"""

from __future__ import annotations

import dataclasses

import pytest

from harness.judge.records import Verdict
from harness.report.text import format_failure
from harness.spec.load import TAIL_PROMPT, TEXT_PROMPT, LoadSpec, load_mix
from harness.testing.judging import passed_clean

pytestmark = pytest.mark.e2e

MIX = load_mix()
EPD_BASELINE_PROMPTS = MIX
SMALL_REQUESTS, SMALL_CONCURRENCY = 16, 8
KILL_IN_FLIGHT = 32
SOAK_S = 90.0
# Each test's load is named once, on its `epd_load` mark, and handed to the test by the
# `epd_load_spec` fixture: the session reads the marks to measure every selected load's batch
# calibration while its baseline serves (harness.testing.before_stop), so no load serves the
# baseline again for its own.


@pytest.fixture(scope="session")
def load_sweep(epd_sweep, epd_events):
    """A sweep whose baseline answers the mix (the session's baseline, shared) on the
    session's pool; its artifacts under load/."""
    from harness.run.sweep import Sweep, SweepSpec

    settings = dataclasses.replace(epd_sweep.settings, run_dir=epd_sweep.settings.run_dir / "load")
    return Sweep(
        SweepSpec((), (), baseline_only_prompts=MIX),
        settings,
        on_event=epd_events,
        pool=epd_sweep.pool,
        baseline=epd_sweep.baseline,
    )


def run_load(load_sweep, spec: LoadSpec, label: str, on_session=None):
    from harness.run.load.run import LoadRun
    from harness.run.sweep import Sweep

    settings = dataclasses.replace(
        load_sweep.settings, run_dir=load_sweep.settings.run_dir / label, stream=spec.stream
    )
    sweep = Sweep(load_sweep.spec, settings, pool=load_sweep.pool, baseline=load_sweep.baseline)
    load = LoadRun(spec, sweep, on_progress=print, keep_baseline=True, on_session=on_session)
    result = load.run()
    print((settings.run_dir / "load.md").read_text())
    return result


def assert_every_request_passed(result) -> None:
    failing = [r.record for r in result.results if not r.record.policy_passed]
    assert not failing, "\n\n".join(format_failure(r) for r in failing[:5])
    assert result.passed and not result.problems, result.problems


@pytest.mark.ci
@pytest.mark.epd_topology("1E+1P+1D")
@pytest.mark.epd_load(LoadSpec("1E+1P+1D", SMALL_REQUESTS, SMALL_CONCURRENCY, ending=False))
def test_a_small_load_every_answer_its_own(load_sweep, epd_load_spec) -> None:
    result = run_load(load_sweep, epd_load_spec, "small")
    assert len(result.results) == SMALL_REQUESTS
    assert_every_request_passed(result)
    assert result.stats is not None and result.stats.by_role.keys() >= {
        "encoder",
        "prefill",
        "decode",
    }
    assert result.calibration is not None  # batch numerics measured on the baseline


@pytest.mark.ci
@pytest.mark.epd_topology("1E+1P+1D")
@pytest.mark.epd_load(
    LoadSpec("1E+1P+1D", SMALL_REQUESTS, SMALL_CONCURRENCY, ending=False, stream=True)
)
def test_a_small_streamed_load_every_answer_its_own_and_framed(load_sweep, epd_load_spec) -> None:
    result = run_load(load_sweep, epd_load_spec, "small-streamed")
    assert len(result.results) == SMALL_REQUESTS
    assert_every_request_passed(result)
    assert all(r.outcome.stream is not None and r.outcome.stream.ok for r in result.results)
    assert result.stats is not None and result.stats.first_token.count == SMALL_REQUESTS


@pytest.mark.kv_connector("nixl")
@pytest.mark.epd_topology("1P+1D")
@pytest.mark.epd_load(LoadSpec("1P+1D", SMALL_REQUESTS, SMALL_CONCURRENCY))
def test_a_load_in_which_one_request_got_no_kv_fails_its_kv_account(
    load_sweep, epd_load_spec
) -> None:
    """Under NIXL a request's KV evidence is D's p2p counter, one number for every request in
    flight: a request whose KV never moved can look covered by its neighbours' transfers. One
    request of a concurrent load reaches D without P's kv_transfer_params (the planted
    `drop-kv`), so D computes its prompt itself and answers right; the round's account over
    D's counters must show it and fail the load, whatever that request's own reading says.

    On 1P+1D, whose D has seen none of the mix (the other loads run on 1E+1P+1D), and on the
    text-only prompt, which no other prompt of the mix begins like: D has almost none of it
    cached, so it computes nearly the whole prompt. (A prompt D held all but a few tokens of
    would leave it too little to compute for any account to tell from the rule's one token a
    request; and on 1E+1P+1D a media prompt would end D instead: vLLM's
    `epd-media-in-decode-tail` failure, D has no embeddings to compute the media with.)"""
    from harness.run.faults.by_name import fault_for
    from harness.run.faults.planted import first_request_only, plant

    connector = load_sweep.settings.serving.kv_connector
    planted = []

    def plant_in(session) -> None:
        """In the session the load sends to: on 4 or 2 GPUs the calibration on the baseline's
        device stops and restarts 1P+1D, so one opened before the load is not it."""
        fault = fault_for("drop-kv", None, session.kv_storage, connector)
        planted.append((session, first_request_only(fault, id_contains=f"-{TEXT_PROMPT}-")))
        plant(session.faults, planted[0][1])

    try:
        result = run_load(
            load_sweep,
            epd_load_spec,
            "kv-dropped",
            on_session=plant_in,
        )
    finally:
        for session, _ in planted:
            plant(session.faults)
    ((_, fault),) = planted
    assert len(fault.effects) == 1 and not fault.problems, (fault.effects, fault.problems)
    assert not result.passed, "a load with a request whose KV never moved passed"
    short = [a for a in result.kv_accounts if a.failed]
    assert short and "never reached D" in short[0].evidence, result.kv_accounts
    assert any("KV account" in p for p in result.problems), result.problems
    # Nothing else broke: every answer passed its policy (MATCH, or DRIFT under the GPU
    # policy) or, if its own reading happened to fail too, is VACUOUS.
    other = [
        r.record
        for r in result.results
        if not r.record.policy_passed and r.record.verdict is not Verdict.VACUOUS
    ]
    assert not other, "\n\n".join(format_failure(r) for r in other[:3])
    caught = [r.number for r in result.results if r.record.verdict is Verdict.VACUOUS]
    print(f"requests whose own KV reading failed too: {caught or 'none'}")


@pytest.mark.epd_ends_session
@pytest.mark.epd_topology("1E+1P+1D")
@pytest.mark.epd_load(LoadSpec("1E+1P+1D", SMALL_REQUESTS, SMALL_CONCURRENCY))
def test_a_load_sends_the_decode_tail_prompt_as_its_connector_declares(
    load_sweep, epd_load_spec
) -> None:
    """Media in D's recomputed tail kill D under ExampleConnector (declared): that request goes
    last, alone, ERROR as declared. Under NIXL, which moves the whole prompt, it is an ordinary
    request of the mix and MATCHes (the GPU nightly's case)."""
    result = run_load(load_sweep, epd_load_spec, "with-tail")
    assert len(result.results) == SMALL_REQUESTS
    assert_every_request_passed(result)
    tail = [r for r in result.results if r.prompt == TAIL_PROMPT]
    assert tail and all(r.region == "decode tail" for r in tail), [r.prompt for r in result.results]
    if "NixlConnector" in load_sweep.settings.serving.kv_connector:
        assert all(passed_clean(r.record) for r in tail), [r.record.detail for r in tail]
    else:
        assert tail == [result.results[-1]], "the declared crash must go last, alone"
        assert tail[0].record.verdict is Verdict.ERROR, tail[0].record.detail
    regions = {r.region for r in result.results}
    assert regions >= {"no media", "prefix", "last transferred block", "decode tail"}, regions


@pytest.mark.epd_ends_session
@pytest.mark.epd_topology("1E+1P+1D")
@pytest.mark.epd_load(LoadSpec("1E+1P+1D", KILL_IN_FLIGHT, KILL_IN_FLIGHT, kill="decode"))
def test_death_under_load_ends_every_request_naming_d(load_sweep, epd_load_spec) -> None:
    import psutil

    from harness.serve.process_groups import is_live_process

    result = run_load(load_sweep, epd_load_spec, "death")
    assert result.killed is not None and result.killed.endswith("decode0"), result.problems
    assert len(result.results) == KILL_IN_FLIGHT
    assert all(r.record.verdict is Verdict.ERROR for r in result.results)
    assert not result.problems, result.problems  # each named D first, within the bound
    load_sweep.pool.release("1E+1P+1D")  # the run ends: nothing of the topology is left
    left = []
    for pid in result.processes:
        try:
            process = psutil.Process(pid)
        except psutil.NoSuchProcess:
            continue
        if is_live_process(process):
            left.append(pid)
    assert result.processes and not left, f"left running: {left}"


@pytest.mark.epd_topology("1E+1PD")
@pytest.mark.epd_load(LoadSpec("1E+1PD", SMALL_REQUESTS, SMALL_CONCURRENCY, duration_s=SOAK_S))
def test_a_short_soak_stays_within_its_bounds(load_sweep, epd_load_spec) -> None:
    result = run_load(load_sweep, epd_load_spec, "soak")
    assert result.rounds >= 2
    assert_every_request_passed(result)
