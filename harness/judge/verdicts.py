"""From an outcome, its transfer guards and its references to the verdict records of one case.

`judge_case` is the only place a verdict is decided; everything that judges (the sweep, the
matrix, the self-test, detection, NIXL, fuzzing, load) reaches it through the run's one judging
path (`harness.run.judging.CaseJudge`), so a change to how cases are judged is made once.

The order of the checks is the meaning of the verdicts: a failed request is ERROR whatever
else holds; a reference that disagreed with itself makes any comparison against it
UNSTABLE_BASELINE; otherwise the tokens (and, at a divergence, the log-probs against the
measured noise floor) decide MATCH / DRIFT / MISMATCH, and a MATCH whose transfer guards failed
is VACUOUS (it proves nothing about EPD). A guard that could not be checked (attach mode)
neither fails nor holds: the verdict stands on the tokens and the guards that were checked,
and its detail names the unchecked ones. Which verdicts pass is the reference policy's call
(`harness.judge.policy`), unless the case is declared to fail upstream: then it passes only
while it fails exactly as declared.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from harness.judge.compare import (
    TokenComparison,
    compare_results,
    noise_floor,
    prefix_noise_floor,
    token_verdict,
    whose_answer,
)
from harness.judge.guards import GuardResult
from harness.judge.policy import ReferencePolicy
from harness.judge.records import CaseRecord, Policy, Verdict
from harness.outcomes.chat import ChatResult
from harness.outcomes.outcome import Outcome
from harness.spec.topology import Topology

# The record's entry for a streamed answer's framing (beside the transfer guards).
STREAM_CHECK = "stream_framing"
# How a case's detail begins when its streamed answer's framing broke (an export's title reads it).
STREAM_BROKEN = "stream framing broken: "


@dataclass(frozen=True)
class Reference:
    """An answer a case is compared with."""

    name: str  # "baseline", "1P+1D", "golden-0.31.0"
    outcome: Outcome
    # The single-instance baseline (or another release's stored answers of it): the reference
    # policy may allow drift against it for topologies with a P->D hop.
    monolithic: bool
    stable: bool = True  # the reference agreed with itself (the baseline's control)


@dataclass(frozen=True)
class JudgingRules:
    """What a run decides once about judging."""

    reference_policy: ReferencePolicy
    # nats: the drift rule's tolerance, measured by the run (harness.run.baseline); 0 on CPU.
    noise_floor_nats: float = 0.0
    # nats: the log-prob noise the baseline itself showed when its answers were batched with
    # other requests (its batched pass; a load's calibration at the load's concurrency): the
    # tolerance for answers that were batched too. None: not measured beyond the pass.
    batched_noise_floor_nats: float | None = None

    def tolerance(self, batched: bool) -> float:
        if batched and self.batched_noise_floor_nats is not None:
            return max(self.noise_floor_nats, self.batched_noise_floor_nats)
        return self.noise_floor_nats


class Declaration(Protocol):
    """A failure a case is declared to have upstream (a release's KnownFailure, a matrix
    scenario's expectation): the verdict it must end with, a text its evidence must show, and
    the upstream cause."""

    @property
    def verdict(self) -> str: ...

    @property
    def evidence(self) -> str: ...

    @property
    def reason(self) -> str: ...

    @property
    def name(self) -> str: ...


def judge_case(
    label: str,
    topology: Topology,
    outcome: Outcome,
    guards: Sequence[GuardResult],
    references: Sequence[Reference],
    rules: JudgingRules,
    declared: Declaration | None = None,
    *,
    batched: bool = False,
    others: Sequence[tuple[str, Outcome]] = (),
) -> list[CaseRecord]:
    """One record per reference: `label` names the case's topology (and scenario).

    `batched`: the answer was computed in flight together with other requests (a load, a
    scenario's concurrent requests), so the reference policy may allow it the batch noise the
    baseline showed. `others`: answers of other requests in flight with it (name, outcome), to
    name whose answer it is when it is not its own."""
    records = []
    answers = [(name, o.result) for name, o in others if o.result is not None]
    for reference in references:
        policy = rules.reference_policy.policy_for(topology, reference.monolithic, batched)
        tolerance = rules.tolerance(batched)
        record = _against(label, reference, outcome, guards, policy, tolerance, answers)
        if declared is not None:
            record = _as_declared(record, declared, outcome.error, guards)
        records.append(record)
    return records


def _against(
    label: str,
    reference: Reference,
    candidate: Outcome,
    guards: Sequence[GuardResult],
    policy: Policy,
    tolerance: float,
    others: Sequence[tuple[str, ChatResult]] = (),
) -> CaseRecord:
    comparison: TokenComparison | None = None
    error = None
    checks = {g.name: g.to_json() for g in guards}
    if candidate.error or candidate.result is None:
        verdict, error = Verdict.ERROR, candidate.error
        # The error's first line names what failed (the instance that died, when one did).
        first = (error or "").strip().splitlines()[:1]
        detail = f"request failed: {first[0]}" if first else "request failed on this topology"
    elif reference.outcome.error or reference.outcome.result is None:
        verdict = Verdict.ERROR
        detail = f"reference {reference.name} has no result"
        error = reference.outcome.error
    elif not reference.outcome.result.token_ids:
        # vLLM generates at least one id per request (max_tokens >= 1): an empty reference is
        # a broken answer, and equal to an empty candidate it compared nothing (found in
        # review: that MATCH passed).
        verdict = Verdict.ERROR
        detail = f"reference {reference.name} generated no token ids: nothing to compare"
    elif not reference.stable:
        verdict, detail = Verdict.UNSTABLE_BASELINE, "the reference disagreed with itself"
    else:
        comparison = compare_results(
            reference.outcome.result, candidate.result, tolerance=tolerance
        )
        verdict = token_verdict(comparison)
        detail = comparison.headline()
        failed = [g for g in guards if g.failed]
        unchecked = [g.name for g in guards if not g.checkable]
        # A DRIFT passes as a MATCH does (within the noise floor), so it proves no more than
        # one when a transfer did not happen: under pd-drift, a D that got no KV and computed
        # the prompt itself would otherwise pass on GPU noise.
        if verdict in (Verdict.MATCH, Verdict.DRIFT) and failed:
            ids = "tokens equal" if verdict is Verdict.MATCH else "tokens within the noise floor"
            verdict = Verdict.VACUOUS
            detail = f"{ids} but guard failed: {failed[0].name}: {failed[0].evidence}"
        elif unchecked:
            detail += f"; not checkable: {', '.join(unchecked)}"
        if verdict is not Verdict.MATCH and not comparison.exact:
            owner = whose_answer(candidate.result, others)
            detail = f"{owner}: {detail}" if owner else detail
        # A stream that carried the answer with broken framing is not that answer to a client:
        # evidence that fails the case, whatever the ids say.
        framing = candidate.stream
        if framing is not None and not framing.ok:
            verdict = Verdict.MISMATCH
            comparison = comparison.with_broken_framing()
            detail = f"{STREAM_BROKEN}{'; '.join(framing.problems)}; {detail}"
    if candidate.stream is not None:
        checks[STREAM_CHECK] = {"ok": candidate.stream.ok, "evidence": candidate.stream.describe()}
    return CaseRecord(
        topology=label,
        prompt=candidate.prompt,
        reference=reference.name,
        verdict=verdict,
        policy_passed=policy.passes(verdict),
        detail=detail,
        divergence=comparison.divergence.to_json()
        if comparison and comparison.divergence
        else None,
        guards=checks,
        timings={"request_s": round(candidate.seconds, 3)},
        error=error,
        explanation=comparison.describe() if comparison else (error or detail),
    )


def _as_declared(
    record: CaseRecord,
    failure: Declaration,
    candidate_error: str | None,
    guards: Sequence[GuardResult] = (),
) -> CaseRecord:
    """`record` judged against a failure it is declared to have.

    It passes only when it failed exactly as declared: the verdict, and the evidence text
    starting its detail line (a comparison's headline) or inside the case's own error (what
    an instance of its topology logged: `candidate_error`, never the reference's, whose
    failure is no failure of the case); any other outcome, a MATCH included, fails and says
    what was declared, so a declaration that no longer describes vLLM cannot hide a change.
    A transfer guard that failed and is not the declared evidence (a VACUOUS names its guard)
    is another failure of the case, which the declaration must not hide either (found in
    review: a declared MISMATCH passed with its EC guard failed, named nowhere)."""
    undeclared = [g for g in guards if g.failed and not excuses_guard(failure, g.name)]
    if shows_declared(record, failure, candidate_error) and not undeclared:
        return held_as_declared(record, failure)
    detail = (
        f"{record.detail}; NOT the declared {failure.verdict} "
        f"({failure.evidence.strip()!r}...): {failure.reason}"
    )
    if undeclared:
        detail += "; and guard failed: " + "; ".join(f"{g.name}: {g.evidence}" for g in undeclared)
    return dataclasses.replace(
        record, policy_passed=False, detail=detail, declared_failure=failure.name
    )


def shows_declared(record: CaseRecord, failure: Declaration, error: str | None) -> bool:
    """Whether `record` shows the failure `failure` declares: its verdict, and its evidence
    text starting the detail line (a comparison's headline) or inside `error`, the case's own
    error. With `excuses_guard`, what a declared case (`_as_declared`) and a fuzz run's known
    failure (`harness.run.fuzz.known`) are both held to."""
    shows = record.detail.startswith(failure.evidence) or failure.evidence in (error or "")
    return record.verdict.value == failure.verdict and shows


def excuses_guard(failure: Declaration, guard: str) -> bool:
    """Whether `failure` excuses the transfer guard named `guard` having failed: only a guard
    its evidence names (a declared VACUOUS's "guard failed: kv_transfer"). Any other failed
    guard is another failure of the case, which the declaration must not hide: here
    (`_as_declared`) and where a fuzz run tells a known failure from a new one
    (`harness.run.fuzz.known`), one rule for both (found in review: a fuzz run recognised a
    known MISMATCH with its EC guard failed beside it, and exited 0)."""
    return guard in failure.evidence


# What a case held as declared says before its upstream cause, which the export reads back
# (`harness.run.export.plan.declared_failure`).
DECLARED_UPSTREAM = "declared upstream failure: "


def held_as_declared(record: CaseRecord, failure: Declaration) -> CaseRecord:
    """`record`, which failed exactly as `failure` declares, as the pass a run counts it: the
    declaration named (`declared_failure`: the verdict table says `yes (declared: NAME)`)
    and its upstream cause said. A fuzz run's own bundle counts a known failure so
    (`harness.run.fuzz.bundle`), having told it from a new one by the declaration."""
    return dataclasses.replace(
        record,
        policy_passed=True,
        detail=f"{record.detail}; {DECLARED_UPSTREAM}{failure.reason}",
        declared_failure=failure.name,
    )


def not_applicable_case(label: str, prompt: str, reference_name: str, reason: str) -> CaseRecord:
    """The record of a case the served release cannot run meaningfully (nothing was sent)."""
    return CaseRecord(
        topology=label,
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


@dataclass(frozen=True)
class Stability:
    """The baseline's determinism control for one request, and the noise it showed."""

    stable: bool  # the same request twice, alone, gave the same ids
    detail: str
    # nats: the largest log-prob difference seen between answers to this request (the
    # control, and the pass in another batch shape); None when nothing could be read.
    noise_floor: float | None = None


def baseline_stability(first: Outcome, again: Outcome) -> Stability:
    """The control: the same request twice must give the same ids; the log-prob differences
    between the two are noise of the platform."""
    if first.result is None or again.result is None:
        return Stability(False, first.error or again.error or "no result")
    comparison = compare_results(first.result, again.result)
    return Stability(
        comparison.exact, comparison.headline(), noise_floor(first.result, again.result)
    )


def batch_shape_noise(alone: Outcome, batched: Outcome) -> tuple[float | None, str]:
    """The same request answered alone and in a batch with another: how far the log-probs moved
    (over the tokens both agree on), and whether the ids changed at all."""
    if alone.result is None or batched.result is None:
        return None, f"no answer in the batched pass: {batched.error or alone.error}"
    comparison = compare_results(alone.result, batched.result)
    floor = prefix_noise_floor(alone.result, batched.result)
    where = "same ids" if comparison.exact else comparison.headline()
    return floor, f"batched with another request: {where}; log-prob noise {floor or 0:.3g} nats"
