"""vLLM's own EPD proxy under test: the served release's `disagg_epd_proxy.py`, fetched from its
sdist through the package index (cached after the first run), in front of the instances' taps.

A release whose shipped proxy breaks EPD turns these red; the transfer guards read only what
the taps in front of every instance saw, since the proxy under test keeps no trace for us.
Whatever `--epd-proxy` says, this module always runs vLLM's proxy (with `--epd-vllm-source`
its files come from that checkout). It stands in front of the session's running topologies
(their instances are not started again), and sends prompts of its own (media no other scenario
sends), so every transfer it is credited with happened through vLLM's proxy.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from harness.report.text import format_failure
from harness.spec.prompts import TAIL_TEXT, ImagePart, PromptSpec, TextPart, VideoPart

# Every test runs vLLM's own files, from --epd-vllm-source when given.
pytestmark = [pytest.mark.e2e, pytest.mark.reads_vllm_source]

TOPOLOGIES = ("1E+1PD", "1E+1P+1D")
IMAGE = PromptSpec("vp-image", (ImagePart(seed=71), TextPart(TAIL_TEXT)))
VIDEO = PromptSpec("vp-video", (VideoPart(seed=72), TextPart(TAIL_TEXT)))
DYNAMIC_IMAGE = PromptSpec("vpd-image", (ImagePart(seed=73), TextPart(TAIL_TEXT)))
PROMPTS = (IMAGE, VIDEO)
EPD_PROXY_NAME = "disagg_epd_proxy.py"
EPD_BASELINE_PROMPTS = (*PROMPTS, DYNAMIC_IMAGE)


def vllm_proxy_sweep_for(
    pytestconfig: pytest.Config,
    epd_sweep,
    epd_events,
    topologies: tuple[str, ...],
    prompts: tuple[PromptSpec, ...],
    registration: str,
):
    from harness.environment import cache_dir
    from harness.errors import BadInput
    from harness.preflight.upstream_proxy import proxy_choice
    from harness.run.sweep import Sweep, SweepSpec
    from harness.spec.topology import TOPOLOGIES as ALL

    settings = epd_sweep.settings
    try:
        proxy = proxy_choice(
            "vllm",
            pytestconfig.getoption("--epd-vllm-source"),
            settings.vllm,
            cache_dir(),
            registration,
        )
    except BadInput as exc:
        pytest.fail(f"epd-harness: {exc}", pytrace=False)
    run_dir = settings.run_dir / f"vllm-proxy-{registration}"
    settings = dataclasses.replace(settings, proxy=proxy, run_dir=run_dir)
    spec = SweepSpec(topologies=tuple(ALL[name] for name in topologies), prompts=prompts)
    return Sweep(
        spec, settings, on_event=epd_events, pool=epd_sweep.pool, baseline=epd_sweep.baseline
    )


def make_vllm_proxy_sweeps(pytestconfig: pytest.Config, epd_sweep, epd_events) -> tuple:
    """Both sweeps, made together: each needs 1P+1D's answers as the exact reference of
    1E+1P+1D, and gets them before the session stops 1P+1D (the pool's before-stop hook
    serves only the sweeps that exist by then). Made when 1P+1D is about to stop
    (`EPD_LATER_SWEEPS`), or at the module's first test if that comes first."""
    static = vllm_proxy_sweep_for(
        pytestconfig, epd_sweep, epd_events, TOPOLOGIES, PROMPTS, "static"
    )
    dynamic = vllm_proxy_sweep_for(
        pytestconfig, epd_sweep, epd_events, ("1E+1P+1D",), (DYNAMIC_IMAGE,), "dynamic"
    )
    return static, dynamic


EPD_LATER_SWEEPS = make_vllm_proxy_sweeps


@pytest.fixture(scope="session")
def vllm_proxy_sweeps(pytestconfig: pytest.Config, epd_sweep, epd_events):
    from harness.testing.before_stop import later_sweeps

    return later_sweeps(pytestconfig, __name__, epd_sweep, epd_events)


@pytest.fixture
def vllm_proxy_sweep(vllm_proxy_sweeps):
    return vllm_proxy_sweeps[0]


@pytest.fixture
def dynamic_registration_sweep(vllm_proxy_sweeps):
    return vllm_proxy_sweeps[1]


def case_params():
    for topology in TOPOLOGIES:
        for prompt in PROMPTS:
            yield pytest.param(
                topology,
                prompt.name,
                marks=[pytest.mark.ci, pytest.mark.epd_proxy("vllm")],
                id=f"vllm-proxy-{topology}-{prompt}",
            )


def assert_matches_with_transfers_seen_at_the_taps(sweep, topology: str, prompt: str) -> list:
    records = sweep.judge(topology, prompt)
    assert records, f"no comparison was made for {topology} / {prompt}"
    failures = [record for record in records if not record.policy_passed]
    assert not failures, "\n\n".join(format_failure(record) for record in failures)
    for record in records:
        ec = record.guards.get("encoder_output")
        assert ec and ec["ok"] and "seen at the taps" in ec["evidence"], record.guards
        assert record.guards["consumer_embeds"]["ok"], record.guards
    # This very answer came through vLLM's proxy: the harness's keeps a trace of every request
    # it serves, vLLM's none. (A proxy command file alone could be another module's: the
    # streamed sweeps start vLLM's proxy on the same sessions.)
    outcome = sweep.observed[topology][prompt].outcome
    assert outcome.trace is None, f"the harness's proxy served {topology} / {prompt}"
    # vLLM's proxy runs beside the topology's instances, in its session's directory.
    root = sweep.pool.settings.run_dir
    commands = [json.loads(p.read_text()) for p in root.rglob("*vllm-proxy*.cmd.json")]
    return [c for c in commands if c["name"].startswith(f"{topology}/vllm-proxy")]


@pytest.mark.parametrize("topology,prompt", list(case_params()))
def test_vllm_proxy_matches_with_transfers_seen_at_the_taps(
    vllm_proxy_sweep, topology: str, prompt: str
) -> None:
    commands = assert_matches_with_transfers_seen_at_the_taps(vllm_proxy_sweep, topology, prompt)
    # The proxy that served was vLLM's own, not the harness's: its EPD proxy, statically
    # registered (the dynamic one is another test's).
    argv = [command["argv"] for command in commands if command["name"] == f"{topology}/vllm-proxy"]
    assert any(any(arg.endswith(EPD_PROXY_NAME) for arg in a) for a in argv), argv


@pytest.mark.ci
@pytest.mark.epd_topology("1E+1P+1D")
@pytest.mark.epd_proxy("vllm-dynamic")
def test_dynamic_registration_matches(dynamic_registration_sweep) -> None:
    """vLLM's proxy started empty (`--dynamic-registration`), every instance registered through
    its admin API as an external launcher would: same tokens, same evidence at the taps."""
    commands = assert_matches_with_transfers_seen_at_the_taps(
        dynamic_registration_sweep, "1E+1P+1D", DYNAMIC_IMAGE.name
    )
    # 1P+1D, the reference of 1E+1P+1D, runs the toy proxy with static URLs.
    (command,) = [c for c in commands if c["name"] == "1E+1P+1D/vllm-proxy-dynamic"]
    assert any(a.endswith(EPD_PROXY_NAME) for a in command["argv"]), command["argv"]
    assert "--dynamic-registration" in command["argv"], command["argv"]
    assert not [a for a in command["argv"] if a.endswith("-servers-urls")], command["argv"]
    assert command["env"].get("ADMIN_API_KEY") == "[redacted]", command["env"]
    (roster_file,) = list(
        dynamic_registration_sweep.pool.settings.run_dir.rglob("*vllm-proxy*.instances.json")
    )
    roster = json.loads(roster_file.read_text())
    assert [len(roster[role]["live"]) for role in ("encode", "prefill", "decode")] == [1, 1, 1]
