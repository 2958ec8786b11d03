"""The fuzz run's second phase: each failure group shrunk to a minimal request.

Which oracle a group is shrunk through (`harness.run.fuzz.oracles`), in which order the groups
go, and the confirmation that a known crash's predicted minimal request does fail. Kept apart
from the engine, which keeps the servers up and sends: this is the policy of what a shrink
costs (a crash kills D, so cheap groups go first and predicted crashes are sent last).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

from harness.run.fuzz.oracles import Engine, PredictingOracle, SendingOracle
from harness.run.fuzz.records import Evaluation, FailureGroup
from harness.run.fuzz.shrink import ShrinkBudget, Trial, shrink
from harness.spec.prompts import PromptSpec
from harness.spec.settings import RunSettings
from harness.spec.topology import Topology

log = logging.getLogger(__name__)


class ShrinkingEngine(Engine, Protocol):
    """What shrinking a group asks of the fuzz engine (`harness.run.fuzz.engine.FuzzEngine`,
    which imports this module), besides what its oracles ask."""

    settings: RunSettings
    topology: Topology
    budget: ShrinkBudget
    attached: bool

    def evaluate(self, spec: PromptSpec) -> Evaluation: ...

    def time_left(self) -> float: ...


def shrink_order(group: FailureGroup) -> int:
    """0: a new failure that kills nothing (each trial one request); 1: a known crash, shrunk
    against its trigger (baseline requests only); 2: a known failure that kills nothing;
    3: a new crash (every accepted step costs a revival)."""
    rule = group.recognition.rule
    crash = group.signature.verdict == "ERROR"
    if rule is not None and rule.crash and rule.trigger is not None:
        return 1
    if not crash:
        return 0 if rule is None else 2
    return 3


def shrink_group(engine: ShrinkingEngine, group: FailureGroup) -> bool:
    """Shrink one group. A known crash with a trigger is shrunk against its prediction
    (baseline requests only) and left for `confirm_predicted` (returns False); any
    other group is shrunk by sending (returns True)."""
    start = group.start
    rule = group.recognition.rule
    divergence = _divergence(group)
    log.info("[fuzz] shrinking %s from %s", group.signature.key, start.spec.name)
    budget = _budget(engine)
    if engine.attached and start.record is not None and start.record.verdict.value == "ERROR":
        group.note = "not shrunk: an attached deployment cannot be restarted after a crash"
        return True
    if group.outlived_only:
        group.note = (
            "not shrunk: the planted fault did not act on these requests, but what it did to an"
            " earlier one reached them (fresh servers would pass them)"
        )
        return True
    if rule is not None and rule.crash and rule.trigger is not None:
        group.shrink = shrink(
            start.spec,
            PredictingOracle(engine, rule),
            budget,
            "predicted",
            divergence,
            step_words=engine.settings.serving.block_size,
        )
        return False
    _shrink_by_sending(engine, group, budget, divergence)
    return True


def confirm_predicted(engine: ShrinkingEngine, group: FailureGroup) -> None:
    """Send the minimal request a known crash was shrunk to against its trigger; if it
    does not fail as the group did, shrink the group by sending instead."""
    predicted = group.shrink
    assert predicted is not None
    confirm = engine.evaluate(predicted.minimal)
    if confirm.status == "not-sent":
        group.note = f"minimal request not confirmed: {confirm.note}"
        return
    # The same signature and the same declaration, as `SendingOracle` asks: the decode-tail
    # crash and the KV lookup miss kill D alike, and a crash outside its trigger is new.
    recognised = confirm.recognition.rule if confirm.recognition else None
    predicted.confirmed = (
        confirm.signature is not None
        and confirm.signature.key == group.signature.key
        and recognised == group.recognition.rule
    )
    predicted.trials.append(
        Trial(
            predicted.minimal,
            bool(predicted.confirmed),
            f"confirmation on {engine.topology.name}: {confirm.summary()}",
            confirm.seconds,
            restarted=confirm.restart_seconds > 0,
        )
    )
    # What the trigger's prediction came to, on real vLLM: a confirmation, or a trigger that
    # held without its crash (the run's predictions say so, as for an example).
    engine.predictions.check(confirm)
    if predicted.confirmed:
        group.minimal = confirm
        return
    log.warning("[fuzz] the predicted minimal request did not reproduce; shrinking by sending")
    # The shrink by sending replaces the predicted one: its end and what it came to stay here.
    group.note = (
        f"predicted minimal request {predicted.minimal.name} ({predicted.accepted} step(s), "
        f"{len(predicted.trials)} trial(s)) did not reproduce: {confirm.summary()}; "
        "shrunk by sending"
    )
    _shrink_by_sending(engine, group, _budget(engine), _divergence(group))


def _divergence(group: FailureGroup) -> int | None:
    """Where the group's start first differed from the baseline's answer (the shrinker
    follows it through the accepted trials), or None when its record says nowhere."""
    start = group.start
    return (start.record.divergence or {}).get("index") if start.record else None


def _budget(engine: ShrinkingEngine) -> ShrinkBudget:
    """The per-group shrink budget, its seconds cut to what is left of the run's, so the
    last group shrunk cannot outlast the run."""
    return dataclasses.replace(
        engine.budget, max_seconds=min(engine.budget.max_seconds, engine.time_left())
    )


def _shrink_by_sending(
    engine: ShrinkingEngine, group: FailureGroup, budget: ShrinkBudget, divergence: int | None
) -> None:
    oracle = SendingOracle(engine, group)
    group.shrink = shrink(
        group.start.spec,
        oracle,
        budget,
        "sent",
        divergence,
        step_words=engine.settings.serving.block_size,
    )
    # Every reproducing trial is accepted at once, so the last one is the minimal request.
    group.minimal = oracle.last_reproduced if group.shrink.accepted else group.start
