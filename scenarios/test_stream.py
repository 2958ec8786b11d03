"""Streamed answers on real vLLM: the sweep's cases sent `stream: true` (with usage) to every EPD
topology, through the harness's proxy and through vLLM's own; the token ids read from the
stream's events are compared with the baseline's (unstreamed) ids, and the stream's framing is
checked (every event parses, one role chunk, [DONE] last, usage equal to the ids counted).

A planted fault shows the check can fail: the harness proxy relays the first chunk of D's
stream that carries tokens twice (what a proxy that relays P's first token and then D's whole
stream does), and the case must be a MISMATCH on both the ids and the framing.

vLLM's toy P/D proxy (the one its NIXL tests run; the harness runs it for 1P+1D under
`--proxy vllm`) answers every stream with `media_type="application/json"`: the events are
right, the content type is not an event stream's. That is declared as the upstream failure it
is (`harness.run.judging.TOY_PROXY_JSON_STREAM`: a MISMATCH whose evidence names it), so it
shows, and a fix turns it red.
"""

from __future__ import annotations

import dataclasses

import pytest

from harness.judge.records import Verdict
from harness.judge.verdicts import STREAM_CHECK
from harness.report.text import format_failure
from harness.run.faults.planted import plant
from harness.run.faults.relayed import duplicate_stream_chunk
from harness.run.judging import TOY_PROXY_JSON_STREAM, observe
from harness.spec.prompts import SKELETON_PROMPTS, TAIL_TEXT, ImagePart, PromptSpec, TextPart
from harness.spec.settings import ProxyChoice
from harness.spec.topology import EPD_TOPOLOGY_NAMES, TOPOLOGIES
from harness.testing.judging import passed_proven

pytestmark = pytest.mark.e2e

STREAM_FAULT_PROMPT = PromptSpec("st-fault", (ImagePart(seed=81), TextPart(TAIL_TEXT)))
EPD_BASELINE_PROMPTS = (STREAM_FAULT_PROMPT,)
HARNESS_PROXY_CHOICE = ProxyChoice()  # the harness's own proxy (`harness.serve.proxy`)
STREAMED_TOPOLOGIES = tuple(n for n in EPD_TOPOLOGY_NAMES if n in ("1E+1PD", "1P+1D", "1E+1P+1D"))


def streamed_sweep(
    epd_sweep, epd_events, proxy: ProxyChoice = HARNESS_PROXY_CHOICE, label: str = "streamed"
):
    """The sweep's cases streamed through `proxy`, on the session's pool and baseline. The
    proxy is always set, never the session's: under `--epd-proxy vllm` the "harness" cases
    kept vLLM's proxy and passed as the harness proxy's streaming (found in review), as
    scenarios/test_vllm_proxy.py sets vLLM's whatever `--epd-proxy` says."""
    from harness.run.sweep import Sweep, SweepSpec

    settings = dataclasses.replace(
        epd_sweep.settings, stream=True, run_dir=epd_sweep.settings.run_dir / label, proxy=proxy
    )
    spec = SweepSpec(
        topologies=tuple(TOPOLOGIES[n] for n in STREAMED_TOPOLOGIES), prompts=SKELETON_PROMPTS
    )
    return Sweep(
        spec, settings, on_event=epd_events, pool=epd_sweep.pool, baseline=epd_sweep.baseline
    )


def make_streamed_sweeps(pytestconfig: pytest.Config, epd_sweep, epd_events) -> dict:
    """Both streamed sweeps, made together (each needs 1P+1D's answers as 1E+1P+1D's exact
    reference before the session stops 1P+1D): at the module's first test, or earlier, when
    1P+1D is about to stop (`EPD_LATER_SWEEPS`)."""
    from harness.environment import cache_dir
    from harness.errors import BadInput
    from harness.preflight.upstream_proxy import proxy_choice

    try:
        vllm = proxy_choice(
            "vllm",
            pytestconfig.getoption("--epd-vllm-source"),
            epd_sweep.settings.vllm,
            cache_dir(),
            "static",
        )
    except BadInput as exc:
        pytest.fail(f"epd-harness: {exc}", pytrace=False)
    return {
        "harness": streamed_sweep(epd_sweep, epd_events),
        "vllm": streamed_sweep(epd_sweep, epd_events, vllm, "streamed-vllm-proxy"),
    }


EPD_LATER_SWEEPS = make_streamed_sweeps


@pytest.fixture(scope="session")
def streamed_sweeps(pytestconfig: pytest.Config, epd_sweep, epd_events):
    from harness.testing.before_stop import later_sweeps

    return later_sweeps(pytestconfig, __name__, epd_sweep, epd_events)


def case_params():
    for proxy in ("harness", "vllm"):
        for topology in STREAMED_TOPOLOGIES:
            for prompt in SKELETON_PROMPTS:
                marks = [pytest.mark.e2e]
                if proxy == "vllm":
                    marks.append(pytest.mark.epd_proxy("vllm"))
                yield pytest.param(
                    proxy,
                    topology,
                    prompt.name,
                    marks=marks,
                    id=f"{proxy}-{topology}-{prompt.name}",
                )


# Both proxies' cases take `streamed_sweeps`, which makes vLLM's proxy from --epd-vllm-source.
@pytest.mark.reads_vllm_source
@pytest.mark.parametrize("proxy,topology,prompt", list(case_params()))
def test_streamed_answers_match_and_are_framed(
    streamed_sweeps, proxy: str, topology: str, prompt: str
) -> None:
    records = streamed_sweeps[proxy].judge(topology, prompt)
    failures = [r for r in records if not r.policy_passed]
    assert not failures, "\n\n".join(format_failure(r) for r in failures)
    # The proxy named served: the harness's keeps a trace of every request, vLLM's none (the
    # harness cases once kept vLLM's proxy and passed for the harness's streaming).
    outcome = streamed_sweeps[proxy].observed[topology][prompt].outcome
    assert (outcome.trace is not None) == (proxy == "harness"), f"{proxy}'s proxy did not serve"
    toy_proxy = proxy == "vllm" and not TOPOLOGIES[topology].encoders
    for record in records:
        if toy_proxy:  # declared (harness.run.judging.TOY_PROXY_JSON_STREAM), and so it failed
            assert record.verdict is Verdict.MISMATCH, record.detail
            assert TOY_PROXY_JSON_STREAM.reason in record.detail
        else:
            assert passed_proven(record) and record.guards[STREAM_CHECK]["ok"], record


@pytest.mark.ci
@pytest.mark.epd_topology("1E+1P+1D")
def test_a_chunk_relayed_twice_by_the_proxy_is_a_mismatch(epd_live) -> None:
    live = epd_live("1E+1P+1D")
    fault = duplicate_stream_chunk()
    plant(live.session.faults, fault)
    try:
        body = live.sweep.bodies[STREAM_FAULT_PROMPT.name]
        observed = observe(
            live.session, STREAM_FAULT_PROMPT.name, body, stream=True, fresh_prefix=True
        )
    finally:
        plant(live.session.faults, None)
    record = live.judge(observed)
    print(format_failure(record))
    trace = observed.outcome.trace
    assert trace is not None and len(trace.fault_effects) == 1, "the fault did not act"
    assert record.verdict is Verdict.MISMATCH and not record.policy_passed
    baseline_ids = live.sweep.baseline.outcomes[STREAM_FAULT_PROMPT.name].result.token_ids
    generated, read = len(baseline_ids), observed.outcome.result.token_ids
    # vLLM puts every token ready since its last event into the next one: the relayed chunk
    # holds one token on a quiet machine, several on a busy one (measured: 1, and 4 under xdist).
    repeated = len(read) - generated
    assert repeated >= 1, read
    assert "generated tokens differ at position" in record.detail
    assert (
        f"usage counts {generated} completion tokens, the stream carried {generated + repeated} "
        "token ids" in record.detail
    ), record.detail
    # the same request without the fault passes: the fault, not the stream, broke it
    unfaulted = observe(
        live.session, STREAM_FAULT_PROMPT.name, body, stream=True, fresh_prefix=True
    )
    clean = live.judge(unfaulted)
    assert passed_proven(clean), format_failure(clean)
    # what the client read: the first chunk's tokens twice, then the topology's own answer (the
    # baseline's on CPU; under the GPU policy it may DRIFT from it, never from itself)
    own_ids = unfaulted.outcome.result.token_ids
    assert read == (*own_ids[:repeated], *own_ids)
