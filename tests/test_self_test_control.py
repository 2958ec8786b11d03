"""The self-test's corrupt-EC check claims a caught fault only over a clean control of its own
prompt (scenarios/test_self_test.py, run here on stand-ins: no vLLM, no process).

A MISMATCH under the planted fault means the fault was caught only if the very prompt MATCHes
without it: otherwise the two-image prompt itself (a multi-image bug, a near tie) may be what
differs, and the self-test would stay green with a fault that does nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.judge.records import CaseRecord, Verdict
from harness.outcomes.outcome import Outcome
from harness.run.faults.planted import PlantedFault
from harness.run.judging import Observed
from harness.run.self_test import CORRUPT_EC_PROMPT
from harness.testing.builders import case_record

pytestmark = pytest.mark.unit

EC_HELD = {
    "encoder_output": {"ok": True, "evidence": "2 EC files written"},
    "consumer_embeds": {"ok": True, "evidence": "2 embeds parts"},
}


class StandInSession:
    def __init__(self, ec_storage: Path):
        self.ec_storage = ec_storage
        self.closed = False

    def close(self) -> None:
        self.closed = True


class StandInTopology:
    """A running 1E+1PD as the scenario uses it. Its consumer keeps the embeddings of every
    item it was sent (vLLM's encoder cache, by mm_hash): a prompt it answered clean once is
    answered clean again whatever the EC files hold. `mismatches_alone`: its answer to the
    prompt differs from the baseline's without any fault."""

    name = "1E+1PD"

    def __init__(self, ec_storage: Path, mismatches_alone: bool):
        self.session = StandInSession(ec_storage)
        self.mismatches_alone = mismatches_alone
        self.held: set[str] = set()  # prompts whose embeddings the consumer keeps
        self.sent: list[tuple[str, bool]] = []  # (prompt, with a fault)

    def send(self, prompt: str) -> Observed:
        assert not self.session.closed, "a request to a closed session"
        self.sent.append((prompt, False))
        self.held.add(prompt)
        return Observed(Outcome(prompt=prompt, error=None), ())

    def send_with_fault(self, fault: PlantedFault, prompt: str) -> Observed:
        assert not self.session.closed, "a request to a closed session"
        self.sent.append((prompt, True))
        fault.touched += [self.session.ec_storage / f"item-{n}" for n in range(2)]
        corrupted = prompt not in self.held  # the consumer loads the (corrupted) files
        self.held.add(prompt)
        return Observed(Outcome(prompt=prompt, error="corrupted" if corrupted else None), ())

    def judge(self, observed: Observed) -> CaseRecord:
        differs = self.mismatches_alone or observed.outcome.error == "corrupted"
        verdict = Verdict.MISMATCH if differs else Verdict.MATCH
        return case_record(
            "1E+1PD", observed.outcome.prompt, verdict, passed=not differs, guards=EC_HELD
        )


def corrupt_ec_check(live: StandInTopology, fresh: StandInTopology) -> None:
    import scenarios.test_self_test as self_test  # not imported whole: its classes are e2e

    class Pool:
        def release(self, topology: str) -> None:
            assert topology == live.name, topology
            live.session.closed = True

    check = self_test.TestEncoderFaults().test_corrupted_ec_files_are_a_mismatch
    check(live, Pool(), lambda name: fresh if live.session.closed else live)


def test_a_prompt_that_mismatches_without_the_fault_is_no_caught_fault(tmp_path: Path):
    live = StandInTopology(tmp_path, mismatches_alone=True)
    fresh = StandInTopology(tmp_path, mismatches_alone=True)
    with pytest.raises(AssertionError, match="without the fault"):
        corrupt_ec_check(live, fresh)


def test_the_fault_is_caught_on_a_consumer_that_never_held_the_controls_embeddings(
    tmp_path: Path,
):
    """The control fills the consumer's encoder cache with the prompt's clean embeddings, which
    a faulted request on the same consumer would read instead of the corrupted files: the
    fault goes to a fresh consumer."""
    live = StandInTopology(tmp_path, mismatches_alone=False)
    fresh = StandInTopology(tmp_path, mismatches_alone=False)
    corrupt_ec_check(live, fresh)
    assert live.sent == [(CORRUPT_EC_PROMPT.name, False)] and live.session.closed, live.sent
    assert fresh.sent == [(CORRUPT_EC_PROMPT.name, True)], fresh.sent


@pytest.mark.parametrize(
    "fault, missed",
    [
        (PlantedFault(problems=["no video among the encoded items"]), True),
        (PlantedFault(problems=["one item only"], touched=[Path("ec/a.safetensors")]), False),
        (PlantedFault(problems=["one item only"], effects=["relative std 0.1"]), False),
        (PlantedFault(), False),  # a proxy flag records nothing either way: no miss
    ],
)
def test_a_planted_fault_is_a_miss_only_when_it_acted_on_nothing_and_said_why(
    tmp_path: Path, fault: PlantedFault, missed: bool
) -> None:
    """A miss fails `run --plant-fault` (a run that proves nothing of the fault); a fault that
    rewrote a file or measured an effect acted, whatever else it could not do. Found in review:
    mutants that counted a fault that acted as a miss survived every unit test."""
    from harness.run.sweep import Sweep, SweepSpec
    from harness.spec.platforms import CPU
    from harness.spec.prompts import SKELETON_PROMPTS
    from harness.spec.settings import RunSettings
    from harness.spec.topology import TOPOLOGIES, serving_for

    settings = RunSettings(
        serving=serving_for(CPU, "/not-a-dir-model", max_model_len=4096), run_dir=tmp_path / "run"
    )
    image = next(p for p in SKELETON_PROMPTS if p.name == "image")
    spec = SweepSpec((TOPOLOGIES["1E+1PD"],), prompts=(image,), fault="corrupt-ec")
    sweep = Sweep(spec, settings)
    sweep._account_fault("1E+1PD", fault)
    assert bool(sweep.fault_misses) is missed, sweep.fault_misses
    assert sweep.run_info["fault_effects"]["1E+1PD"]["problems"] == fault.problems
