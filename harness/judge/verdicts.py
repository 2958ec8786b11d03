"""From two outcomes and the transfer guards to one case record with a verdict.

The order of the checks is the meaning of the verdicts: a failed request is ERROR whatever
else holds; a baseline that disagreed with itself makes any comparison against it
UNSTABLE_BASELINE; otherwise the tokens (and, at a divergence, the log-probs against the
measured noise floor) decide MATCH / DRIFT / MISMATCH, and a MATCH whose
transfer guards failed is VACUOUS (it proves nothing about EPD). A guard that could not be
checked (attach mode) neither fails nor holds: the verdict stands on the tokens and the guards
that were checked, and its detail names the unchecked ones.
"""

from __future__ import annotations

import dataclasses

from harness.judge.compare import TokenComparison, compare_results, noise_floor, token_verdict
from harness.judge.guards import GuardResult
from harness.judge.records import EXACT, CaseRecord, Policy, Verdict
from harness.serve.session import Outcome
from harness.spec.generations import KnownFailure


def judge_case(
    topology: str,
    reference_name: str,
    reference: Outcome,
    candidate: Outcome,
    guards: list[GuardResult],
    policy: Policy = EXACT,
    baseline_stable: bool = True,
    drift_tolerance: float = 0.0,
) -> CaseRecord:
    """`drift_tolerance` is the noise floor (nats) the run measured: 0 on CPU, where any
    difference is a MISMATCH."""
    comparison: TokenComparison | None = None
    error = None
    if candidate.error or candidate.result is None:
        verdict, error = Verdict.ERROR, candidate.error
        # The error's first line names what failed (the instance that died, when one did).
        first = (error or "").strip().splitlines()[:1]
        detail = f"request failed: {first[0]}" if first else "request failed on this topology"
    elif reference.error or reference.result is None:
        verdict = Verdict.ERROR
        detail = f"reference {reference_name} has no result"
        error = reference.error
    elif not baseline_stable:
        verdict, detail = Verdict.UNSTABLE_BASELINE, "the reference disagreed with itself"
    else:
        comparison = compare_results(reference.result, candidate.result, tolerance=drift_tolerance)
        verdict = token_verdict(comparison)
        detail = comparison.headline()
        failed = [g for g in guards if g.failed]
        unchecked = [g.name for g in guards if not g.checkable]
        if verdict is Verdict.MATCH and failed:
            verdict = Verdict.VACUOUS
            detail = f"tokens equal but guard failed: {failed[0].name}: {failed[0].evidence}"
        elif unchecked:
            detail += f"; not checkable: {', '.join(unchecked)}"
    return CaseRecord(
        topology=topology,
        prompt=candidate.prompt,
        reference=reference_name,
        verdict=verdict,
        policy_passed=policy.passes(verdict),
        detail=detail,
        divergence=comparison.divergence.to_json()
        if comparison and comparison.divergence
        else None,
        guards={g.name: g.to_json() for g in guards},
        timings={"request_s": round(candidate.seconds, 3)},
        error=error,
        explanation=comparison.describe() if comparison else (error or detail),
    )


def baseline_is_stable(first: Outcome, second: Outcome) -> tuple[bool, str, float | None]:
    """The baseline control: the same request twice must give the same ids. Also returns the
    noise floor it shows (the largest log-prob difference; None when unstable)."""
    if first.result is None or second.result is None:
        return False, first.error or second.error or "no result", None
    comparison = compare_results(first.result, second.result)
    return comparison.exact, comparison.headline(), noise_floor(first.result, second.result)


def not_applicable_case(topology: str, prompt: str, reference_name: str, reason: str) -> CaseRecord:
    """The record of a case the served release cannot run meaningfully (nothing was sent)."""
    return CaseRecord(
        topology=topology,
        prompt=prompt,
        reference=reference_name,
        verdict=Verdict.NOT_APPLICABLE,
        policy_passed=False,
        detail=f"not applicable on this vLLM: {reason}",
        divergence=None,
        guards={},
        timings={},
        error=None,
        explanation=reason,
    )


def judged_as_declared(record: CaseRecord, failure: KnownFailure) -> CaseRecord:
    """`record` judged against a failure its vLLM release is declared to have.

    It passes only when the release failed exactly as declared (verdict and the beginning of
    the detail); any other outcome, a MATCH included, fails and says what was declared, so a
    declaration that no longer describes the release cannot hide a change."""
    held = record.verdict.value == failure.verdict and record.detail.startswith(failure.evidence)
    if held:
        detail = f"{record.detail}; declared for this release: {failure.reason}"
    else:
        detail = (
            f"{record.detail}; NOT the declared {failure.verdict} "
            f"({failure.evidence.strip()!r}...): {failure.reason}"
        )
    return dataclasses.replace(record, policy_passed=held, detail=detail)
