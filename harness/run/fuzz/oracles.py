"""How the shrinker's candidates are tried (`harness.run.fuzz.shrink.Oracle`): sent to the
topology and judged (`SendingOracle`), or, for a known crash with a trigger, asked of the
baseline alone and reproduced when the trigger holds (`PredictingOracle`), so shrinking such a
crash costs no revival per step. `harness.run.fuzz.group_shrink` shrinks each failure group
through one of them."""

from __future__ import annotations

from typing import Protocol

from harness.run.fuzz.fault_effect import FAULT_NOT_ACTED
from harness.run.fuzz.known import KnownRule
from harness.run.fuzz.predictions import CrashPredictions
from harness.run.fuzz.records import Evaluation, FailureGroup, fault_reached
from harness.run.fuzz.shrink import Trial
from harness.spec.prompts import PromptSpec


class Engine(Protocol):
    """What an oracle asks of the fuzz engine (`harness.run.fuzz.engine.FuzzEngine`, which
    imports the oracles through `harness.run.fuzz.group_shrink`)."""

    predictions: CrashPredictions

    def topology_dead(self) -> str | None: ...

    def ask_baseline(self, spec: PromptSpec) -> Evaluation: ...

    def send_topology(self, evaluation: Evaluation) -> Evaluation: ...

    def too_short(self, evaluation: Evaluation) -> str | None: ...


class SendingOracle:
    """Candidates sent to the topology: reproduced when one fails with the group's signature
    and is the same kind of failure (the same declaration, or new). A candidate a trusted
    known crash's trigger predicts is not sent: it would kill D on the known bug (a restart)
    and cannot be the group's failure unless the group is that crash."""

    def __init__(self, engine: Engine, group: FailureGroup):
        self.engine = engine
        self.target = group.signature
        self.rule = group.recognition.rule
        # A group the planted fault made (its start is one the fault acted on) reproduces only
        # where the fault acts: the same failure without it is what earlier requests left.
        self.needs_fault = fault_reached(group.start)
        self.last_reproduced: Evaluation | None = None

    def restart_pending(self) -> bool:
        return self.engine.topology_dead() is not None

    def attempt(self, spec: PromptSpec) -> Trial:
        evaluation = self.engine.ask_baseline(spec)
        if evaluation.status == "judged":
            short = self.engine.too_short(evaluation)
            if short is not None:
                return Trial(spec, False, short, evaluation.seconds, too_short=True)
            predicted = self.engine.predictions.predicted_crash(evaluation)
            if predicted is not None and predicted != self.rule:
                note = f"not sent: {predicted.name} predicted ({predicted.trigger_text})"
                return Trial(spec, False, note, evaluation.seconds)
            self.engine.send_topology(evaluation)
            if evaluation.status == "not-sent":
                return Trial(spec, False, evaluation.note, evaluation.seconds, unsendable=True)
        recognition = evaluation.recognition
        reproduced = (
            evaluation.signature is not None
            and evaluation.signature.key == self.target.key
            and (recognition.rule if recognition else None) == self.rule
        )
        summary = evaluation.summary()
        if reproduced and self.needs_fault and not fault_reached(evaluation):
            reproduced = False
            why = (evaluation.fault or "").removeprefix(f"{FAULT_NOT_ACTED}: ")
            summary += f" (not reproduced: the planted fault did not act on it: {why})"
        divergence = None
        if reproduced:
            self.last_reproduced = evaluation
            record = evaluation.record
            divergence = (record.divergence or {}).get("index") if record else None
        return Trial(
            spec,
            reproduced,
            summary,
            evaluation.seconds,
            restarted=evaluation.restart_seconds > 0,
            divergence=divergence,
            fault=evaluation.fault,
        )


class PredictingOracle:
    """Baseline requests only: reproduced when the known crash's trigger holds."""

    def __init__(self, engine: Engine, rule: KnownRule):
        self.engine = engine
        self.rule = rule

    def restart_pending(self) -> bool:
        return False

    def attempt(self, spec: PromptSpec) -> Trial:
        evaluation = self.engine.ask_baseline(spec)
        if evaluation.status != "judged":
            return Trial(spec, False, evaluation.summary(), evaluation.seconds)
        short = self.engine.too_short(evaluation)
        if short is not None:
            note = short.replace("not sent", "not tried")
            return Trial(spec, False, note, evaluation.seconds, too_short=True)
        reproduced = self.rule.predicts(spec, evaluation.layout)
        layout = evaluation.layout.to_json() if evaluation.layout else {}
        outcome = (
            f"trigger {'holds' if reproduced else 'does not hold'} (predicted, not sent): "
            f"prompt {layout.get('prompt_tokens')} tokens, last media ends at "
            f"{layout.get('last_media_end')}, D loads {layout.get('kv_prefix')}"
        )
        return Trial(spec, reproduced, outcome, evaluation.seconds)
