"""The harness's self-test: planted faults must turn a run red, each with the right verdict.

A harness that only ever says MATCH proves nothing (upstream's bash harness stayed green while
every comparison failed). So real topologies are run with one link broken on purpose, and the
judge must name the break: corrupted EC files and zeroed KV files are MISMATCH, raw media that
bypassed the encoder and a prompt D computed itself (no KV from P) are VACUOUS (tokens equal, a
transfer guard failed), a killed instance is ERROR within seconds and leaves no process behind.

Each topology is the session's running one (harness.testing.collection: started once for every
scenario that needs it) and serves a clean request first, then one fault after another on the
self-test's own prompts (harness.run.self_test: media of their own, so distinct mm hashes, EC
and KV files), so one fault cannot bleed into the next case, nor into another scenario's. The
corrupted EC files' prompt is first sent clean, its control, and the fault then goes to the
topology started afresh (its consumer would serve the control's embeddings from memory). Every
verdict is judged on the run's one judging path against the shared baseline. The kill runs
last in its topology's group (`epd_ends_session`).
"""

from __future__ import annotations

import time

import psutil
import pytest

from harness.judge.guards import outcome_evidence
from harness.judge.records import CaseRecord, Verdict
from harness.report.text import format_failure
from harness.run.faults.by_name import fault_for
from harness.run.faults.ec_files import corrupt_ec_files
from harness.run.faults.instance import kill_instance
from harness.run.faults.planted import PlantedFault
from harness.run.faults.relayed import drop_encoder_metadata
from harness.run.judging import Observed
from harness.run.self_test import (
    AFTER_KILL_PROMPT,
    CLEAN_PROMPT,
    CORRUPT_EC_PROMPT,
    DROP_KV_PROMPT,
    DROP_METADATA_PROMPT,
    SELF_TEST_PROMPTS,
    ZERO_KV_PROMPT,
)
from harness.serve.launch import ManagedServer
from harness.serve.process_groups import describe_process, is_live_process
from harness.serve.session import TopologySession
from harness.spec.topology import Role
from harness.testing.judging import fault_inaction, passed_proven
from harness.testing.live import LiveTopology

pytestmark = pytest.mark.e2e
EPD_BASELINE_PROMPTS = SELF_TEST_PROMPTS

# A dead instance must fail the next request quickly, not after a request timeout.
DEATH_NOTICE_MAX_S = 10.0


@pytest.fixture
def encoder_topology(epd_live) -> LiveTopology:
    return epd_live("1E+1PD")


@pytest.fixture
def kv_topology(epd_live) -> LiveTopology:
    return epd_live("1P+1D")


def judged(live: LiveTopology, observed: Observed) -> CaseRecord:
    """The case against the baseline, exactly as the sweep would judge it; printed as evidence."""
    record = live.judge(observed)
    print(format_failure(record))
    return record


def assert_fault_fired(fault: PlantedFault, record: CaseRecord) -> None:
    """A fault that touched nothing would make a red verdict mean something else."""
    assert (fault.touched or fault.effects) and not fault.problems, fault_inaction(
        "the planted fault", fault, record
    )


def send_kv_fault(live: LiveTopology, name: str, prompt: str) -> tuple[PlantedFault, CaseRecord]:
    """`prompt` sent with the KV fault `name` in the form the session's KV connector takes."""
    session = live.session
    fault = fault_for(name, None, session.kv_storage, session.settings.serving.kv_connector)
    record = judged(live, live.send_with_fault(fault, prompt))
    assert_fault_fired(fault, record)
    return fault, record


def send_clean(live: LiveTopology) -> CaseRecord:
    record = judged(live, live.send(CLEAN_PROMPT.name))
    assert passed_proven(record), (
        "the clean request must pass before any fault means anything:\n" + format_failure(record)
    )
    return record


@pytest.mark.ci
@pytest.mark.epd_topology("1E+1PD")
class TestEncoderFaults:
    """1E+1PD: clean, corrupted EC files, raw media, then a killed encoder."""

    def test_clean_request_matches(self, encoder_topology: LiveTopology):
        send_clean(encoder_topology)

    def test_corrupted_ec_files_are_a_mismatch(
        self, encoder_topology: LiveTopology, epd_pool, epd_live
    ):
        """A MISMATCH under the fault shows it caught only if this very prompt MATCHes without
        it (else the two-image prompt itself may differ), so the prompt goes clean first. Its
        consumer then keeps the clean embeddings by mm_hash (vLLM's encoder cache,
        docs/load.md) and would read them instead of the corrupted files: the faulted request
        goes to the topology started afresh, one start more."""
        control = judged(encoder_topology, encoder_topology.send(CORRUPT_EC_PROMPT.name))
        assert passed_proven(control), (
            "the prompt must MATCH without the fault, or its MISMATCH with the fault proves "
            "nothing about the fault:\n" + format_failure(control)
        )
        epd_pool.release(encoder_topology.name)  # its next use starts it again
        live = epd_live(encoder_topology.name)
        fault = corrupt_ec_files(live.session.ec_storage)
        record = judged(live, live.send_with_fault(fault, CORRUPT_EC_PROMPT.name))
        assert_fault_fired(fault, record)
        assert len(fault.touched) == 2, f"two images, two EC files expected: {fault.touched}"
        assert record.verdict is Verdict.MISMATCH, (
            f"corrupted embeddings must be a MISMATCH, got {record.verdict.value}:\n"
            + format_failure(record)
        )
        assert record.policy_passed is False, f"a MISMATCH passed the policy: {record}"
        failed = record.failed_guards()
        assert not failed, f"the transfer itself happened; no guard should fail: {failed}"

    def test_dropped_encoder_metadata_is_vacuous(self, encoder_topology: LiveTopology):
        live = encoder_topology
        observed = live.send_with_fault(drop_encoder_metadata(), DROP_METADATA_PROMPT.name)
        record = judged(live, observed)
        assert record.verdict is Verdict.VACUOUS, (
            f"raw media reaching the consumer must be VACUOUS, got {record.verdict.value}:\n"
            + format_failure(record)
        )
        assert record.policy_passed is False, f"a VACUOUS case passed the policy: {record}"
        assert "consumer_embeds" in record.detail, (
            f"the detail must name the failed guard: {record.detail!r}"
        )
        failed = sorted(record.failed_guards())
        assert failed == ["consumer_embeds"], (
            f"the encoder did run and write its file; only consumer_embeds should fail: {failed}"
        )
        evidence = outcome_evidence(observed.outcome)  # the taps' records, whichever proxy
        assert evidence is not None and evidence.consumer_calls, f"no consumer call: {observed}"
        assert not any(any(call.metadata_only) for call in evidence.consumer_calls), (
            f"the consumer should have received raw media: {evidence.consumer_calls}"
        )

    @pytest.mark.epd_ends_session
    @pytest.mark.reads_instance_processes  # kills E and reads its tree by pid, on this host
    def test_killed_encoder_fails_the_next_request_fast(self, encoder_topology: LiveTopology):
        live = encoder_topology
        send_clean(live)  # one good request first, in any test order
        processes = topology_processes(live.session)
        victim = live.server(Role.ENCODER)
        log_line = last_log_line(victim)

        killed_at = time.monotonic()
        kill_instance(victim)
        observed = live.send(AFTER_KILL_PROMPT.name)
        noticed_s = time.monotonic() - killed_at
        print(f"[self-test] the killed {victim.name} failed the next request in {noticed_s:.2f}s")

        record = judged(live, observed)
        assert record.verdict is Verdict.ERROR and record.policy_passed is False, (
            f"a request after a kill must be ERROR, got {record.verdict.value}:\n"
            + format_failure(record)
        )
        error = observed.outcome.error or ""
        assert victim.name in error, f"the error does not name {victim.name}: {error}"
        assert str(victim.command.log_path) in error and log_line in error, (
            f"the error lacks the log tail of {victim.command.log_path} "
            f"(last line {log_line!r}): {error}"
        )
        assert noticed_s < DEATH_NOTICE_MAX_S, (
            f"the death took {noticed_s:.1f}s to surface (limit {DEATH_NOTICE_MAX_S}s)"
        )

        live.session.close()  # the pool starts it again for whatever needs it later
        survivors = [describe_process(p) for p in processes if is_live_process(p)]
        assert not survivors, (
            f"processes of {live.name} outlived the session ({len(processes)} recorded): "
            f"{survivors}"
        )


@pytest.mark.ci
@pytest.mark.epd_topology("1P+1D")
class TestKvFaults:
    """1P+1D: a clean request, then zeroed KV and KV withheld from D, each under a prompt of
    its own.

    ExampleConnector keys KV by the prompt's token ids (and mm hashes), so the faulted prompt
    differs from the clean one: D looks up its own files, which the fault zeroed.
    """

    def test_clean_request_matches(self, kv_topology: LiveTopology):
        send_clean(kv_topology)

    def test_zeroed_kv_is_a_mismatch(self, kv_topology: LiveTopology):
        # ExampleConnector: its files zeroed; NixlConnector: its block ids misrouted
        # (faults/by_name.py)
        fault, record = send_kv_fault(kv_topology, "zero-kv", ZERO_KV_PROMPT.name)
        assert record.verdict is Verdict.MISMATCH, (
            f"zeroed KV must be a MISMATCH, got {record.verdict.value} "
            f"({len(fault.touched)} KV files zeroed; {fault.effects}):\n" + format_failure(record)
        )
        assert record.policy_passed is False, f"a MISMATCH passed the policy: {record}"
        failed = record.failed_guards()
        assert not failed, f"D did load the (zeroed) KV; no guard should fail: {failed}"

    def test_kv_that_never_reached_d_is_vacuous(self, kv_topology: LiveTopology):
        """D computes the prompt itself and answers right: only the KV guard can tell."""
        fault, record = send_kv_fault(kv_topology, "drop-kv", DROP_KV_PROMPT.name)
        assert record.verdict is Verdict.VACUOUS, (
            f"a D that received no KV must be VACUOUS, got {record.verdict.value} "
            f"({fault.effects}):\n" + format_failure(record)
        )
        assert record.policy_passed is False, f"a VACUOUS case passed the policy: {record}"
        assert list(record.failed_guards()) == ["kv_transfer"], record.guards


def topology_processes(session: TopologySession) -> list[psutil.Process]:
    """Every process of every instance right now: leaders and the EngineCores they forked."""
    processes = []
    for server in session.servers:
        leader = psutil.Process(server.pid)
        processes += [leader, *leader.children(recursive=True)]
    return processes


def last_log_line(server: ManagedServer) -> str:
    lines = [line for line in server.log_tail(5).splitlines() if line.strip()]
    assert lines, f"{server.name} has an empty log at {server.command.log_path}"
    return lines[-1]
