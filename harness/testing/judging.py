"""Judging a hand-made outcome in a test, the way a run judges it: one call to the one
judging function (`harness.judge.verdicts.judge_case`) with one reference."""

from __future__ import annotations

from collections.abc import Sequence

from harness.judge.guards import GuardResult
from harness.judge.policy import EXACT_EVERYWHERE, ReferencePolicy
from harness.judge.records import CaseRecord, DeclaredFailure
from harness.judge.verdicts import JudgingRules, Reference, judge_case
from harness.outcomes.outcome import Outcome
from harness.report.text import format_failure
from harness.run.faults.planted import PlantedFault
from harness.spec.topology import TOPOLOGIES


def judged(
    topology: str,
    reference_name: str,
    reference: Outcome,
    candidate: Outcome,
    guards: Sequence[GuardResult] = (),
    *,
    reference_policy: str = EXACT_EVERYWHERE,
    stable: bool = True,
    tolerance: float = 0.0,
    declared: DeclaredFailure | None = None,
    rules: JudgingRules | None = None,
    batched: bool = False,
    others: Sequence[tuple[str, Outcome]] = (),
) -> CaseRecord:
    """`topology` may carry a scenario label (`1E+1PD:name`); the reference is monolithic
    when its name is not a topology's (baseline, golden-*). `rules` replaces the rules made of
    `reference_policy` and `tolerance`; `batched` and `others` as a load judges its answers."""
    monolithic = reference_name not in TOPOLOGIES or TOPOLOGIES[reference_name].is_baseline
    [record] = judge_case(
        topology,
        TOPOLOGIES[topology.split(":")[0]],
        candidate,
        guards,
        [Reference(reference_name, reference, monolithic, stable)],
        rules or JudgingRules(ReferencePolicy(reference_policy), tolerance),
        declared,
        batched=batched,
        others=others,
    )
    return record


def passed_clean(record: CaseRecord) -> bool:
    """A case without a fault passed: MATCH, or a DRIFT its reference policy allows (a P->D
    topology against the monolithic baseline under the GPU policy, where a near tie may fall
    the other way); under the exact policy a DRIFT does not pass, so it fails here too. What a
    scenario asserts of a clean answer, so the GPU night is not red for the harness's own
    reasons (found in review: several asserted MATCH alone)."""
    from harness.judge.records import Verdict

    return record.policy_passed and record.verdict in (Verdict.MATCH, Verdict.DRIFT)


def passed_proven(record: CaseRecord) -> bool:
    """A clean case passed (`passed_clean`) with every guard decided. The scenarios send each
    request under a cache salt of its own (`harness.spec.prompts.fresh_prefix_request`), so
    on a topology the harness served, no instance can hold the prompt from an earlier case and
    every guard has evidence; one that could not be checked there means the MATCH is unproven.
    A load repeats prompts into warm caches, so its requests are held to `passed_clean`."""
    return passed_clean(record) and not record.unchecked_guards()


def fault_inaction(what: str, fault: PlantedFault, record: CaseRecord) -> str:
    """Why `what`, a planted fault, did not do its job, for a scenario's assertion. A fault
    acts on what its request leaves (EC files, D's blocks), so a request that failed first
    leaves it nothing; that failure is then the cause, and its block (the error, each
    instance's log lines) follows (found on real vLLM: with D's NIXL handshake timed out under
    load, a ladder said only "D's plugin reported nothing for this request")."""
    message = (
        f"{what} did not do its job (a verdict would mean nothing): touched {fault.touched}, "
        f"problems {fault.problems}"
    )
    if record.error:
        message += "\nits request failed:\n" + format_failure(record)
    return message
