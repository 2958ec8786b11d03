"""NixlConnector on CPU, whatever connector the session runs: 1P+1D with NIXL matches the
baseline with the NIXL rule holding, and the planted KV fault (block ids misrouted on their way
from P to D) turns it into a MISMATCH.

This is the connector GPU users deploy; on CPU it needs the `nixl` extra (`scripts/cpu setup
--nixl`; `scripts/cpu test`, the README's test command and CI's, installs it). Without it these
tests fail with that one line, never skip. CI's NIXL case is 1E+1P+1D on Ray's nodes
(`scenarios/test_ray.py`), which moves KV from P to D as this module's clean case does; these
stay `e2e`.
"""

from __future__ import annotations

import pytest

from harness.errors import BadInput
from harness.judge.records import CaseRecord, Verdict
from harness.preflight.connectors import check_kv_connector
from harness.report.text import format_failure
from harness.run.faults.by_name import fault_for
from harness.spec.connectors import NIXL
from harness.testing.judging import passed_proven
from harness.testing.live import LiveTopology

pytestmark = [pytest.mark.e2e, pytest.mark.epd_topology("1P+1D"), pytest.mark.epd_variant("nixl")]

CLEAN_PROMPT = "image"
FAULT_PROMPT = "two_images"  # other media, so other blocks than the clean request's


@pytest.fixture
def nixl_topology(epd_live, epd_settings) -> LiveTopology:
    """1P+1D under NixlConnector: the session's running one (started after the baseline)."""
    try:
        check_kv_connector(epd_settings.vllm, NIXL)
    except BadInput as exc:
        pytest.fail(f"epd-harness: {exc}", pytrace=False)
    return epd_live("1P+1D", kv_connector=NIXL.vllm_class)


def judged(live: LiveTopology, observed) -> CaseRecord:
    record = live.judge(observed)
    print(format_failure(record))
    return record


def test_nixl_1p1d_matches_with_the_whole_prompt_transferred(nixl_topology) -> None:
    record = judged(nixl_topology, nixl_topology.send(CLEAN_PROMPT))
    assert passed_proven(record), format_failure(record)
    evidence = record.guards["kv_transfer"]["evidence"]
    assert "whole prompt rule" in evidence, evidence


def test_misrouted_nixl_blocks_are_a_mismatch(nixl_topology) -> None:
    """A MISMATCH under the fault shows it caught only if this very prompt passes under NIXL
    without it (as scenarios/test_self_test.py's corrupted EC files): the sweep judges it under
    the session's connector, not NIXL. Each request has a cache salt of its own, so the
    control leaves nothing in P's or D's prefix cache for the faulted one."""
    live = nixl_topology
    control = judged(live, live.send(FAULT_PROMPT))
    assert passed_proven(control), (
        "the prompt must pass under NIXL without the fault, or its MISMATCH with the fault "
        "proves nothing about the fault:\n" + format_failure(control)
    )
    fault = fault_for(
        "zero-kv", None, live.session.kv_storage, live.session.settings.serving.kv_connector
    )
    record = judged(live, live.send_with_fault(fault, FAULT_PROMPT))
    assert fault.effects and not fault.problems, (fault.effects, fault.problems)
    assert record.verdict is Verdict.MISMATCH, format_failure(record)
    assert not record.policy_passed
