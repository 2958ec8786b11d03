"""What a fuzz run came to, as the bundle, `--save` and the command's summary read it: each
example's `Evaluation` (the baseline's answer, the topology's, the verdict, the signature, what
a planted fault did), the failures grouped by signature (`group_failures`, `FailureGroup`) and
the `FuzzReport` over them all. Records only: the engine fills them in, nothing here sends."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from harness.judge.records import CaseRecord, Verdict
from harness.outcomes.outcome import Outcome
from harness.run.fuzz.fault_effect import (
    FAULT_ACTED,
    FAULT_ACTED_BEFORE,
    FAULT_NOT_ACTED,
    FAULT_ON_LEFTOVER,
    FAULT_OUTLIVED,
)
from harness.run.fuzz.known import Recognition
from harness.run.fuzz.layout import PromptLayout
from harness.run.fuzz.shrink import ShrinkResult, size_key
from harness.run.fuzz.signature import Signature, is_failure
from harness.spec.prompts import PromptSpec

# How an example whose baseline disagreed with itself is told: the run fails on it, and says
# whose fault it is not.
UNSTABLE_SAID = "against a baseline that disagreed with itself (not judged: nothing blamed on EPD)"

if TYPE_CHECKING:  # the strategies need Hypothesis, which the records themselves do not
    from harness.run.fuzz.strategies import FuzzExample


def fault_reached(evaluation: Evaluation) -> bool:
    """The planted fault acted on this request, now, on an earlier send of it, or on the
    leftover state it read; not when the request's shape gave it nothing to act on."""
    fault = evaluation.fault or ""
    return fault in (FAULT_ACTED, FAULT_ACTED_BEFORE) or fault.startswith(FAULT_ON_LEFTOVER)


@dataclass
class Evaluation:
    """One request through the baseline and (unless skipped) the topology, judged."""

    spec: PromptSpec
    body: dict[str, Any]
    baseline: Outcome
    status: str  # judged | baseline-rejected | known-predicted | not-sent
    layout: PromptLayout | None = None
    candidate: Outcome | None = None
    record: CaseRecord | None = None
    signature: Signature | None = None
    recognition: Recognition | None = None
    note: str = ""
    seconds: float = 0.0
    restart_seconds: float = 0.0
    # With --plant-fault: "acted", or "not acted: <why>" (the fault's own words), or None (no
    # fault, or one that records nothing). A planted fault acts on some shapes only, and a
    # self-test that found nothing must say whether the fault ever acted at all.
    fault: str | None = None
    # The earlier requests (name, body as the topology got it) whose leftovers this one's
    # outcome needs: a KV folder its lookup finds where an instance loads one nobody wrote
    # (`ConsumerState.stage_of`), else what gives D the prefix it holds (`holds_stage`).
    # Bundles replay them first (run.json `sent_after`).
    stage: tuple[tuple[str, dict[str, Any]], ...] = ()
    # Whether P's prefix cache held this prompt's leading blocks under its salt when it was
    # sent: the replay sends it under its stage's salt only then (`bundle.staged`).
    stage_in_prefill_cache: bool = False

    @property
    def failed(self) -> bool:
        return self.record is not None and is_failure(self.record)

    def summary(self) -> str:
        if self.record is None:
            return f"{self.status}: {self.note}" if self.note else self.status
        text = self.record.verdict.value
        if self.signature is not None:
            text = self.signature.key
        if self.recognition is not None and self.recognition.known:
            text += f" (known: {self.recognition.rule.name})"  # type: ignore[union-attr]
        return text


@dataclass
class FailureGroup:
    signature: Signature
    recognition: Recognition
    members: list[Evaluation] = field(default_factory=list)
    shrink: ShrinkResult | None = None
    minimal: Evaluation | None = None  # the minimal request's own evaluation
    note: str = ""

    @property
    def known(self) -> bool:
        return self.recognition.known

    @property
    def start(self) -> Evaluation:
        """The smallest member, of those a planted fault acted on when it acted on any: a
        member that failed without the fault acting failed on what an earlier request left
        (the consumer's encoder cache keeps a swapped embedding by mm_hash), and shrinking
        from it ends at a request the fault cannot act on, which fresh servers pass."""
        acted = [e for e in self.members if fault_reached(e)]
        return min(acted or self.members, key=lambda e: size_key(e.spec))

    @property
    def outlived_only(self) -> bool:
        """Every member failed where the planted fault did not act, but what it did to an
        earlier request reached it (`FAULT_OUTLIVED`): the fault's failure, which fresh
        servers would pass, so no request shape to shrink nor a failure of vLLM's."""
        return all((e.fault or "").startswith(FAULT_OUTLIVED) for e in self.members)


@dataclass
class FuzzReport:
    examples: list[FuzzExample]
    evaluations: list[Evaluation] = field(default_factory=list)
    groups: list[FailureGroup] = field(default_factory=list)
    restarts: list[dict[str, Any]] = field(default_factory=list)  # what, why, seconds
    startup_seconds: float = 0.0
    examples_seconds: float = 0.0
    shrink_seconds: float = 0.0
    predictions: dict[str, Any] = field(default_factory=dict)  # crash triggers: trusted or not

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for ev in self.evaluations:
            key = ev.status if ev.record is None else ev.record.verdict.value
            if ev.record is not None and ev.record.policy_passed and ev.record.declared_failure:
                key += f" (declared: {ev.record.declared_failure})"  # a pass, as `run` has it
            counts[key] = counts.get(key, 0) + 1
        return counts

    @property
    def new_groups(self) -> list[FailureGroup]:
        return [g for g in self.groups if not g.known]

    @property
    def judged_any(self) -> bool:
        return any(e.status == "judged" for e in self.evaluations)

    @property
    def unstable_baseline(self) -> list[Evaluation]:
        """The examples whose baseline disagreed with itself (UNSTABLE_BASELINE): no failure of
        the topology's (`is_failure`: not grouped, shrunk or blamed on EPD), and no pass
        either: a case the run could not judge proved nothing, as `epd-harness run` has it."""
        return [
            e
            for e in self.evaluations
            if e.record is not None and e.record.verdict is Verdict.UNSTABLE_BASELINE
        ]

    def unstable_baseline_line(self) -> str:
        """What fuzz.md and the command's last line say of `unstable_baseline` ('' if none)."""
        if not (unstable := self.unstable_baseline):
            return ""
        return f"{len(unstable)} example(s) {UNSTABLE_SAID}: " + ", ".join(
            e.spec.name for e in unstable
        )

    @property
    def passed(self) -> bool:
        """What the command's exit code says, and every top-level file of its bundle with it
        (`harness.run.fuzz.bundle`): some example was judged, no failure is new (a known
        one is a declared upstream failure, as a matrix scenario's is) and no example's
        baseline disagreed with itself (found in review: such a run exited 0 while its
        summary.json, which counts the case failed, said `passed: false`), and a planted fault
        acted on some example (one that acted on none left a self-test that tested nothing,
        which exited 0: `run` says that as a `problem:` and fails)."""
        return (
            self.judged_any
            and not self.new_groups
            and not self.unstable_baseline
            and not self.fault_acted_on_nothing
        )

    @property
    def fault_acted_on_nothing(self) -> bool:
        """A fault was planted (the examples sent record what it did) and acted on none."""
        effect = self.fault_effect()
        return effect["not_acted"] > 0 and not effect["acted"]

    def fault_effect(self) -> dict[str, Any]:
        """What a planted fault did to the examples sent to the topology: how many it acted
        on, and how many it did not, by its reason (numbers blanked, so one reason counts
        once whatever the item counts). Shrink trials are not counted."""
        acted, reasons = 0, dict[str, int]()
        for evaluation in self.evaluations:
            if evaluation.fault is None:
                continue
            if fault_reached(evaluation):
                acted += 1
                continue
            reason = evaluation.fault.removeprefix(f"{FAULT_NOT_ACTED}: ")
            reasons[reason] = reasons.get(reason, 0) + 1
        return {"acted": acted, "not_acted": sum(reasons.values()), "reasons": reasons}

    def timing(self) -> dict[str, Any]:
        sent = [e.seconds - e.restart_seconds for e in self.evaluations if e.status == "judged"]
        return {
            "startup_s": round(self.startup_seconds, 1),
            "examples_s": round(self.examples_seconds, 1),
            "shrink_s": round(self.shrink_seconds, 1),
            "total_s": round(self.startup_seconds + self.examples_seconds + self.shrink_seconds, 1),
            "per_judged_example_mean_s": round(statistics.mean(sent), 3) if sent else None,
            "per_judged_example_median_s": round(statistics.median(sent), 3) if sent else None,
            "restarts": len(self.restarts),
            "restart_s": round(sum(r["seconds"] for r in self.restarts), 1),
        }


def group_failures(evaluations: list[Evaluation]) -> list[FailureGroup]:
    """Failing examples by signature and by what they are (a declaration, or new)."""
    groups: dict[tuple[str, str], FailureGroup] = {}
    for evaluation in evaluations:
        if not evaluation.failed or evaluation.signature is None:
            continue
        recognition = evaluation.recognition or Recognition(None)
        known = recognition.rule.name if recognition.rule else "new"
        key = (evaluation.signature.key, known)
        group = groups.setdefault(key, FailureGroup(evaluation.signature, recognition))
        group.members.append(evaluation)
    return sorted(groups.values(), key=lambda g: (g.known, g.members[0].spec.name))
