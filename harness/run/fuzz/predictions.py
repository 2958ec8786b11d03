"""Which declared crashes the fuzz run trusts its prediction of. A crash's trigger is read
from the request and its exact layout (`harness.run.fuzz.known`); once the trigger has held
and the crash followed `confirm_known` times on real vLLM, later examples it predicts are not
sent: a request that kills D on a known bug can show nothing else on this release, and each
kill costs a restart. The counts travel in the report (`summary`)."""

from __future__ import annotations

import logging
from typing import Any

from harness.run.fuzz.known import KnownRule
from harness.run.fuzz.records import Evaluation

log = logging.getLogger(__name__)


class CrashPredictions:
    """The crash triggers of one run's declarations: confirmed, distrusted, or outrun."""

    def __init__(self, rules: list[KnownRule], confirm_known: int) -> None:
        self.rules = rules
        self.confirm_known = confirm_known
        self._confirmed: dict[str, int] = {}
        self._mispredicted: dict[str, str] = {}  # rule name -> the example that disagreed
        self._outside_trigger: dict[str, list[str]] = {}  # rule name -> crashes without it

    def predicted_crash(self, evaluation: Evaluation) -> KnownRule | None:
        """The known crash this example triggers, if its prediction is trusted by now."""
        for rule in self.rules:
            if rule.crash and rule.predicts(evaluation.spec, evaluation.layout):
                trusted = self._confirmed.get(rule.name, 0) >= self.confirm_known
                if trusted and rule.name not in self._mispredicted:
                    return rule
        return None

    def check(self, evaluation: Evaluation) -> None:
        """Count confirmations of each crash trigger. A trigger that held without the crash
        is not trusted again in this run (skipping on it could hide an answer). A crash that
        no trigger predicted says a trigger is too narrow, not wrong where it holds: the
        example is judged and grouped as new (`recognise`), and skipping goes on. Two
        declarations may share a crash's signature (the decode-tail bug and the KV lookup
        miss kill D alike): the one whose trigger held is the one it confirms."""
        record = evaluation.record
        if record is None:  # not sent (a spent budget, a deployment down): it showed nothing
            return
        crash_rules = [r for r in self.rules if r.crash and r.trigger is not None]
        predicted = [r for r in crash_rules if r.predicts(evaluation.spec, evaluation.layout)]
        for rule in predicted:
            if rule.signature_matches(record):
                self._confirmed[rule.name] = self._confirmed.get(rule.name, 0) + 1
            elif rule.name not in self._mispredicted:
                self._mispredicted[rule.name] = evaluation.spec.name
                log.warning(
                    "[fuzz] %s: the trigger of %s held but %s; its predictions are no "
                    "longer trusted",
                    evaluation.spec.name,
                    rule.name,
                    evaluation.summary(),
                )
        if predicted:
            return
        for rule in crash_rules:
            if rule.signature_matches(record):
                self._outside_trigger.setdefault(rule.name, []).append(evaluation.spec.name)
                log.warning(
                    "[fuzz] %s: %s's crash without its trigger (%s): reported as new",
                    evaluation.spec.name,
                    rule.name,
                    rule.trigger_text,
                )

    def summary(self) -> dict[str, Any]:
        return {
            "confirm_known": self.confirm_known,
            "confirmed": dict(self._confirmed),
            "mispredicted": dict(self._mispredicted),
            "crashed_outside_trigger": dict(self._outside_trigger),
        }
