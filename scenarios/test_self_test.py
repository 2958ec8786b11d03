"""The harness's self-test: planted faults must turn a run red, each with the right verdict.

A harness that only ever says MATCH proves nothing (upstream's bash harness stayed green while
every comparison failed). So real topologies are run with one link broken on purpose, and the
judge must name the break: corrupted EC files and zeroed KV files are MISMATCH, raw media that
bypassed the encoder are VACUOUS (tokens equal, a transfer guard failed), a killed instance is
ERROR within seconds and leaves no process behind.

Each topology starts once per class (~40 s on CPU) and serves a clean request first, then one
fault after another on prompts whose media differ (distinct images, so distinct mm hashes and
EC files), so one fault cannot bleed into the next case. Every verdict is judged against the
shared baseline, which is computed before any topology here starts: never two of ours at once.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass

import psutil
import pytest

from harness.judge.guards import GuardResult, outcome_evidence, session_guards
from harness.judge.records import CaseRecord, Verdict
from harness.judge.verdicts import judge_case
from harness.report.text import format_failure
from harness.run.faults import (
    PlantedFault,
    corrupt_ec_files,
    drop_encoder_metadata,
    fault_for,
    kill_instance,
    plant,
)
from harness.serve.launch import ManagedServer, describe_process, is_live_process
from harness.serve.proxy import ProxyFaults
from harness.serve.session import Outcome, TopologySession
from harness.spec.settings import RunSettings
from harness.spec.topology import TOPOLOGIES, Role

pytestmark = pytest.mark.e2e

# Prompts of the shared sweep (so the baseline already has their answers), each with media of
# its own: image (seed 1), two_images (seeds 2 and 3), video (seed 4).
CLEAN_PROMPT = "image"
CORRUPT_EC_PROMPT = "two_images"
DROP_METADATA_PROMPT = "video"
ZERO_KV_PROMPT = "two_images"
# A dead instance must fail the next request quickly, not after a request timeout.
DEATH_NOTICE_MAX_S = 10.0


@dataclass
class LiveTopology:
    """A started topology and the fault object its proxy reads."""

    session: TopologySession
    faults: ProxyFaults  # the very object the proxy holds: `plant` swaps its hooks

    @property
    def name(self) -> str:
        return self.session.topology.name

    def server(self, role: Role) -> ManagedServer:
        """The first instance with `role`."""
        return self.session.server(role)

    def send(self, prompt: str, body: dict) -> tuple[Outcome, list[GuardResult]]:
        """One request and its transfer guards, read at once, while the storage is as it left it."""
        started = time.monotonic()
        outcome = self.session.send(prompt, body)
        guards = session_guards(self.session, outcome)
        print(f"[self-test] {self.name} {prompt}: {time.monotonic() - started:.1f}s")
        return outcome, guards

    def send_with_fault(
        self, fault: PlantedFault, prompt: str, body: dict
    ) -> tuple[Outcome, list[GuardResult]]:
        """One request with `fault` planted; the proxy is clean again afterwards, whatever
        happened, so the next test of the class starts from a clean proxy."""
        plant(self.faults, fault)
        try:
            return self.send(prompt, body)
        finally:
            plant(self.faults, None)


def self_test_settings(settings: RunSettings) -> RunSettings:
    """Artifacts in a directory of their own: the sweep's topology dirs are wiped on start."""
    return dataclasses.replace(settings, run_dir=settings.run_dir / "self-test")


@pytest.fixture(scope="module")
def baseline(epd_sweep) -> dict[str, Outcome]:
    """The shared baseline, computed before this module starts any topology of its own."""
    return epd_sweep.serve_baseline()


def start_topology(name: str, settings: RunSettings) -> Iterator[LiveTopology]:
    faults = ProxyFaults()
    started = time.monotonic()
    with TopologySession(TOPOLOGIES[name], self_test_settings(settings), faults) as session:
        print(f"\n[self-test] {name} started in {time.monotonic() - started:.1f}s")
        yield LiveTopology(session, faults)
    print(f"[self-test] {name} ran {time.monotonic() - started:.1f}s in all")


@pytest.fixture(scope="class")
def encoder_topology(epd_settings, baseline) -> Iterator[LiveTopology]:
    yield from start_topology("1E+1PD", epd_settings)


@pytest.fixture(scope="class")
def kv_topology(epd_settings, baseline) -> Iterator[LiveTopology]:
    yield from start_topology("1P+1D", epd_settings)


def judge(epd_sweep, live: LiveTopology, outcome: Outcome, guards: list[GuardResult]) -> CaseRecord:
    """The case against the baseline, exactly as the sweep would judge it; printed as evidence."""
    stable = epd_sweep.stability[outcome.prompt][0]  # (stable, detail, noise floor)
    record = judge_case(
        live.name,
        "baseline",
        epd_sweep.serve_baseline()[outcome.prompt],
        outcome,
        guards,
        baseline_stable=stable,
        drift_tolerance=epd_sweep.noise_floor,
    )
    print(format_failure(record))
    return record


def assert_fault_fired(fault: PlantedFault) -> None:
    """A fault that touched nothing would make a red verdict mean something else."""
    assert (fault.touched or fault.effects) and not fault.problems, (
        f"the planted fault did not do its job: touched {fault.touched}, problems {fault.problems}"
    )


def send_clean(epd_sweep, live: LiveTopology, prompt: str) -> CaseRecord:
    plant(live.faults, None)
    outcome, guards = live.send(prompt, epd_sweep.bodies[prompt])
    record = judge(epd_sweep, live, outcome, guards)
    assert record.verdict is Verdict.MATCH and record.policy_passed, (
        "the clean request must MATCH before any fault means anything:\n" + format_failure(record)
    )
    return record


@pytest.mark.ci
class TestEncoderFaults:
    """One 1E+1PD topology: clean, corrupted EC files, raw media, then a killed encoder."""

    def test_clean_request_matches(self, epd_sweep, encoder_topology: LiveTopology):
        send_clean(epd_sweep, encoder_topology, CLEAN_PROMPT)

    def test_corrupted_ec_files_are_a_mismatch(self, epd_sweep, encoder_topology: LiveTopology):
        live = encoder_topology
        fault = corrupt_ec_files(live.session.ec_storage)
        outcome, guards = live.send_with_fault(
            fault, CORRUPT_EC_PROMPT, epd_sweep.bodies[CORRUPT_EC_PROMPT]
        )
        assert_fault_fired(fault)
        assert len(fault.touched) == 2, f"two images, two EC files expected: {fault.touched}"
        record = judge(epd_sweep, live, outcome, guards)
        assert record.verdict is Verdict.MISMATCH, (
            f"corrupted embeddings must be a MISMATCH, got {record.verdict.value}:\n"
            + format_failure(record)
        )
        assert record.policy_passed is False, f"a MISMATCH passed the policy: {record}"
        failed = record.failed_guards()
        assert not failed, f"the transfer itself happened; no guard should fail: {failed}"

    def test_dropped_encoder_metadata_is_vacuous(self, epd_sweep, encoder_topology: LiveTopology):
        live = encoder_topology
        outcome, guards = live.send_with_fault(
            drop_encoder_metadata(), DROP_METADATA_PROMPT, epd_sweep.bodies[DROP_METADATA_PROMPT]
        )
        record = judge(epd_sweep, live, outcome, guards)
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
        evidence = outcome_evidence(outcome)  # the taps' records, whichever proxy served
        assert evidence is not None and evidence.consumer_calls, f"no consumer call: {outcome}"
        assert not any(any(call.metadata_only) for call in evidence.consumer_calls), (
            f"the consumer should have received raw media: {evidence.consumer_calls}"
        )

    def test_killed_encoder_fails_the_next_request_fast(
        self, epd_sweep, encoder_topology: LiveTopology
    ):
        live = encoder_topology
        send_clean(epd_sweep, live, CLEAN_PROMPT)  # one good request first, in any test order
        processes = topology_processes(live.session)
        victim = live.server(Role.ENCODER)
        log_line = last_log_line(victim)

        killed_at = time.monotonic()
        kill_instance(victim)
        outcome, guards = live.send(CLEAN_PROMPT, epd_sweep.bodies[CLEAN_PROMPT])
        noticed_s = time.monotonic() - killed_at
        print(f"[self-test] the killed {victim.name} failed the next request in {noticed_s:.2f}s")

        record = judge(epd_sweep, live, outcome, guards)
        assert record.verdict is Verdict.ERROR and record.policy_passed is False, (
            f"a request after a kill must be ERROR, got {record.verdict.value}:\n"
            + format_failure(record)
        )
        error = outcome.error or ""
        assert victim.name in error, f"the error does not name {victim.name}: {error}"
        assert str(victim.command.log_path) in error and log_line in error, (
            f"the error lacks the log tail of {victim.command.log_path} "
            f"(last line {log_line!r}): {error}"
        )
        assert noticed_s < DEATH_NOTICE_MAX_S, (
            f"the death took {noticed_s:.1f}s to surface (limit {DEATH_NOTICE_MAX_S}s)"
        )

        live.session.close()  # the fixture's close() afterwards is a no-op
        survivors = [describe_process(p) for p in processes if is_live_process(p)]
        assert not survivors, (
            f"processes of {live.name} outlived the session ({len(processes)} recorded): "
            f"{survivors}"
        )


@pytest.mark.ci
class TestKvFaults:
    """One 1P+1D topology: a clean request, then zeroed KV files under another prompt.

    ExampleConnector keys KV by the prompt's token ids (and mm hashes), so the faulted prompt
    differs from the clean one: D looks up its own files, which the fault zeroed.
    """

    def test_clean_request_matches(self, epd_sweep, kv_topology: LiveTopology):
        send_clean(epd_sweep, kv_topology, CLEAN_PROMPT)

    def test_zeroed_kv_is_a_mismatch(self, epd_sweep, kv_topology: LiveTopology):
        live = kv_topology
        # ExampleConnector: its files zeroed; NixlConnector: its block ids misrouted (faults.py)
        fault = fault_for(
            "zero-kv", None, live.session.kv_storage, live.session.settings.serving.kv_connector
        )
        outcome, guards = live.send_with_fault(
            fault, ZERO_KV_PROMPT, epd_sweep.bodies[ZERO_KV_PROMPT]
        )
        assert_fault_fired(fault)
        record = judge(epd_sweep, live, outcome, guards)
        assert record.verdict is Verdict.MISMATCH, (
            f"zeroed KV must be a MISMATCH, got {record.verdict.value} "
            f"({len(fault.touched)} KV files zeroed; {fault.effects}):\n" + format_failure(record)
        )
        assert record.policy_passed is False, f"a MISMATCH passed the policy: {record}"
        failed = record.failed_guards()
        assert not failed, f"D did load the (zeroed) KV; no guard should fail: {failed}"


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
