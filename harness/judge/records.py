"""What judging produces: the verdicts a case can end with, the policy that accepts some of
them, and the record of one judged case (everything needed to judge it again without rerunning).

The verdicts, in the order they are decided:

* ERROR: the request failed (HTTP error, timeout, crash): nothing to compare;
* UNSTABLE_BASELINE: the reference disagreed with itself, so no comparison with it means much;
* MISMATCH / DRIFT / MATCH: the token ids decide (see `harness.judge.compare`);
* VACUOUS: the tokens are equal but a transfer guard failed, so equality proves nothing;
* NOT_APPLICABLE: the served vLLM release lacks what the case needs (its protocol generation,
  `harness.spec.generations`, says what and why); decided before anything is sent, and never
  passing under any policy: a case that could not be tested is not a pass.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any


class Verdict(str, enum.Enum):
    """How one case ended; a Policy decides which of these pass."""

    MATCH = "MATCH"  # tokens equal and every guard held
    MISMATCH = (
        "MISMATCH"  # ids differ, and not as numeric noise would make them (or prompts differ)
    )
    DRIFT = "DRIFT"  # a near-tie at the divergence after an agreeing prefix, within the noise floor
    VACUOUS = "VACUOUS"  # tokens equal but a transfer guard failed: equality proves nothing
    UNSTABLE_BASELINE = "UNSTABLE_BASELINE"  # the baseline disagreed with itself
    ERROR = "ERROR"  # HTTP error, timeout or crash: nothing to compare
    NOT_APPLICABLE = "NOT_APPLICABLE"  # this vLLM release lacks what the case needs


@dataclass(frozen=True)
class Policy:
    """Which verdicts count as a pass: exact equality, or equality up to measured drift."""

    passing: frozenset[Verdict]

    def passes(self, verdict: Verdict) -> bool:
        return verdict in self.passing


EXACT = Policy(frozenset({Verdict.MATCH}))
LOGPROB_CLOSE = Policy(frozenset({Verdict.MATCH, Verdict.DRIFT}))


@dataclass(frozen=True)
class CaseRecord:
    """The outcome of comparing one topology's answer to one prompt against one reference."""

    topology: str
    prompt: str
    reference: str  # name of the reference topology, e.g. "baseline"
    verdict: Verdict
    policy_passed: bool
    detail: str  # one line, e.g. TokenComparison.headline()
    divergence: dict[str, Any] | None  # Divergence.to_json()
    # name -> {"ok": bool, "evidence": str}, plus "not_checkable": True for a guard nothing
    # could decide (attach mode): not held, not failed (harness.judge.guards)
    guards: dict[str, dict[str, Any]]
    timings: dict[str, float]
    error: str | None
    explanation: str = ""  # TokenComparison.describe(): the multi-line evidence
    # The name of the upstream failure the case was judged against as declared ("": none): the
    # version table and bisect say which one a passing MISMATCH is, where the detail only
    # gives its cause.
    declared_failure: str = ""

    def failed_guards(self) -> dict[str, dict[str, Any]]:
        return {
            name: g
            for name, g in self.guards.items()
            if not g.get("ok") and not g.get("not_checkable")
        }

    def unchecked_guards(self) -> dict[str, dict[str, Any]]:
        return {name: g for name, g in self.guards.items() if g.get("not_checkable")}

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["verdict"] = self.verdict.value
        return data


def unproven_passes(records: Iterable[CaseRecord]) -> list[str]:
    """Each guard of a passing case that nothing could check, as a problem of a run whose
    topologies the harness served. Every request there goes under a cache salt of its own
    (`harness.spec.prompts.fresh_prefix_request`), so no instance held its prompt from an
    earlier case: a guard without evidence leaves the pass proving nothing of that transfer.
    A case that failed says so already."""
    return [
        f"{record.topology}:{record.prompt} (against {record.reference}): guard {name} not "
        f"checkable on a topology the harness served: {guard.get('evidence', '')}"
        for record in records
        if record.policy_passed
        for name, guard in record.unchecked_guards().items()
    ]


@dataclass(frozen=True)
class DeclaredFailure:
    """A failure a case is declared to have upstream: it passes only while it ends with
    `verdict` and its evidence shows `evidence`; `reason` is the upstream cause."""

    verdict: str  # a Verdict's value
    evidence: str
    reason: str
    name: str  # who declares it: a matrix scenario's name, the proxy's failure
