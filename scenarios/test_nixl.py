"""NixlConnector on CPU, whatever connector the session runs: 1P+1D with NIXL matches the
baseline with the NIXL rule holding, and the planted KV fault (block ids misrouted on their way
from P to D) turns it into a MISMATCH.

This is the connector GPU users deploy; on CPU it needs the `nixl` extra (`scripts/cpu setup
--nixl`; CI installs it: `.ci/run` and ci.yml set EPD_CPU_NIXL=1). Without it these tests fail
with that one line, never skip. CI runs the clean 1P+1D image case (`ci`): passed in each of its
runs under the shared lock on the project's loaded 2-core machine, 81-125 s per run (NIXL start
and the first request's handshake; docs/connectors.md). The misrouted-blocks fault stays `e2e`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from harness.errors import BadInput
from harness.judge.guards import session_guards
from harness.judge.records import Verdict
from harness.judge.verdicts import judge_case
from harness.preflight.connectors import check_kv_connector
from harness.report.text import format_failure
from harness.run.faults import fault_for, plant
from harness.serve.proxy import ProxyFaults
from harness.serve.session import TopologySession
from harness.spec.connectors import NIXL
from harness.spec.topology import TOPOLOGIES

pytestmark = pytest.mark.e2e

CLEAN_PROMPT = "image"
FAULT_PROMPT = "two_images"  # other media, so other blocks than the clean request's


@pytest.fixture(scope="module")
def nixl_session(epd_sweep, epd_settings) -> Iterator[tuple[TopologySession, ProxyFaults]]:
    """1P+1D under NixlConnector, started after the shared baseline (never two at once)."""
    try:
        check_kv_connector(epd_settings.vllm, NIXL)
    except BadInput as exc:
        pytest.fail(f"epd-harness: {exc}", pytrace=False)
    epd_sweep.serve_baseline()
    serving = dataclasses.replace(epd_settings.serving, kv_connector=NIXL.vllm_class)
    settings = dataclasses.replace(
        epd_settings, serving=serving, run_dir=epd_settings.run_dir / "nixl"
    )
    faults = ProxyFaults()
    with TopologySession(TOPOLOGIES["1P+1D"], settings, faults) as session:
        yield session, faults


def judged(epd_sweep, session: TopologySession, prompt: str):
    outcome = session.send(prompt, epd_sweep.bodies[prompt])
    guards = session_guards(session, outcome)
    stable = epd_sweep.stability[prompt][0]
    record = judge_case(
        "1P+1D",
        "baseline",
        epd_sweep.serve_baseline()[prompt],
        outcome,
        guards,
        baseline_stable=stable,
    )
    print(format_failure(record))
    return record


@pytest.mark.ci
def test_nixl_1p1d_matches_with_the_whole_prompt_transferred(epd_sweep, nixl_session) -> None:
    session, _ = nixl_session
    record = judged(epd_sweep, session, CLEAN_PROMPT)
    assert record.verdict is Verdict.MATCH and record.policy_passed, format_failure(record)
    evidence = record.guards["kv_transfer"]["evidence"]
    assert "whole prompt rule" in evidence, evidence


def test_misrouted_nixl_blocks_are_a_mismatch(epd_sweep, nixl_session) -> None:
    session, faults = nixl_session
    fault = fault_for("zero-kv", None, session.kv_storage, session.settings.serving.kv_connector)
    plant(faults, fault)
    try:
        record = judged(epd_sweep, session, FAULT_PROMPT)
    finally:
        plant(faults, None)
    assert fault.effects and not fault.problems, (fault.effects, fault.problems)
    assert record.verdict is Verdict.MISMATCH, format_failure(record)
    assert not record.policy_passed
