"""Running the scenario matrix (declared in `harness.run.scenarios`) on a sweep's baseline.

Scenarios of one topology share the run's running session of it (`harness.run.pool`); a
scenario after one that killed an instance gets it started again, so one crash does not fail
the rest of the run; a topology that cannot start fails its scenario's cases (ERROR), as the
sweep's. Every answer is judged on the run's one judging path, with the
scenario's declared upstream failure, if it has one.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from harness.judge.guards import GuardResult
from harness.judge.records import CaseRecord, unproven_passes
from harness.outcomes.outcome import Outcome
from harness.run.judging import Observed, observe
from harness.run.scenarios import IDLE_GAP_S, Scenario, SendMode
from harness.run.sweep import Sweep
from harness.serve.session import TopologySession
from harness.serve.usage import clean_storage
from harness.spec.topology import TOPOLOGIES

log = logging.getLogger(__name__)


@dataclass
class ScenarioResult:
    scenario: Scenario
    records: list[CaseRecord] = field(default_factory=list)
    checks: list[GuardResult] = field(default_factory=list)

    def problems(self) -> list[str]:
        """Why the scenario did not behave as declared; empty when it did."""
        found = [
            f"{record.prompt}: {record.verdict.value}: {record.detail}"
            for record in self.records
            if not record.policy_passed
        ]
        found += [f"check {c.name} failed: {c.evidence}" for c in self.checks if not c.ok]
        return found + unproven_passes(self.records)  # each request under a salt of its own


class MatrixRun:
    """Runs scenarios against a shared sweep's baseline, on the sweep's topology pool."""

    def __init__(self, sweep: Sweep):
        self.sweep = sweep
        self.results: dict[str, ScenarioResult] = {}

    def close(self) -> None:
        """Nothing of its own to stop: the sessions are the pool's."""

    def run(self, scenario: Scenario) -> ScenarioResult:
        """The scenario, with its expectation for the run's KV connector."""
        scenario = scenario.for_kv_connector(self.sweep.settings.serving.kv_connector)
        if scenario.name not in self.results:
            self.results[scenario.name] = self._run(scenario)
        return self.results[scenario.name]

    def _run(self, scenario: Scenario) -> ScenarioResult:
        topology = TOPOLOGIES[scenario.topology]
        missing = self._not_applicable(scenario)
        if missing is not None:
            return missing
        self.sweep.serve_baseline()
        try:
            session = self.sweep.pool.session(topology)
        except Exception as exc:  # noqa: BLE001 - a topology that cannot start fails its cases
            return self._not_started(scenario, exc)
        if scenario.empty_kv_storage:
            empty_kv_storage(session, scenario)
        result = self._judge(scenario, session, self._send(session, scenario))
        if scenario.rerun_on_kept_storage:
            kept = session.storage_dir
            self.sweep.pool.release(topology.name)  # its storage, as left, is the rerun's
            log.info("[matrix] %s: rerun on the storage the last session left", scenario.name)
            with self.sweep.pool.private(
                topology,
                "a rerun on the storage the previous session left (encoder-cache hits)",
                label=f"matrix-{scenario.topology}-rerun",
                reuse_storage=kept,
            ) as rerun:
                rerun_result = self._judge(scenario, rerun, self._send(rerun, scenario))
            result.records += rerun_result.records
            result.checks += rerun_result.checks
        for record in result.records:
            log.info(
                f"[matrix] {scenario.name} {record.prompt}: {record.verdict.value} "
                f"({record.detail})"
            )
        return result

    def _not_started(self, scenario: Scenario, exc: Exception) -> ScenarioResult:
        """Every case of a scenario whose topology could not start is an ERROR naming why, as
        the sweep's are; the matrix goes on with the next scenario (the pool tries the start
        again for the next one of the topology)."""
        topology = TOPOLOGIES[scenario.topology]
        error = f"{topology.name} could not start: {type(exc).__name__}: {exc}"
        log.error("[matrix] %s: %s", scenario.name, error)
        result = ScenarioResult(scenario)
        outcomes = [Outcome(prompt=p.name, error=error) for p in scenario.prompts]
        for prompt, outcome in zip(scenario.prompts, outcomes, strict=True):
            result.records += self.sweep.judging.judge(
                topology,
                Observed(outcome, ()),
                label=f"{scenario.topology}:{scenario.name}",
                spec=prompt,
                declared=scenario.declared_of(prompt.name),
            )
        self.sweep.add_records(f"matrix:{scenario.name}", outcomes, result.records)
        return result

    def _not_applicable(self, scenario: Scenario) -> ScenarioResult | None:
        """A scenario one of whose requests the served release cannot run (its protocol
        generation: an encoder that publishes no metadata, ...) is NOT_APPLICABLE as a whole,
        nothing sent: its requests belong together (the same image across requests, ...).
        Found in review: on 0.27-0.30 they were sent, and ERRORed or MISMATCHed for reasons
        the sweep declares."""
        topology = TOPOLOGIES[scenario.topology]
        reasons = [
            (prompt, why)
            for prompt in scenario.prompts
            if (why := self.sweep.judging.not_applicable(topology, prompt)) is not None
        ]
        if not reasons:
            return None
        label = f"{scenario.topology}:{scenario.name}"
        first, why = reasons[0]
        result = ScenarioResult(scenario)
        result.records = [
            self.sweep.judging.not_applicable_record(
                label, prompt.name, why if prompt is first else f"with {first.name}: {why}"
            )
            for prompt in scenario.prompts
        ]
        self.sweep.add_records(f"matrix:{scenario.name}", [], result.records)
        return result

    def _send(self, session: TopologySession, scenario: Scenario) -> list[Observed]:
        bodies = [(p.name, self.sweep.bodies[p.name]) for p in scenario.prompts]
        # A scenario that streams streams; the others as the run says (`--stream`).
        stream = scenario.stream or self.sweep.settings.stream
        if scenario.mode is SendMode.CONCURRENT:
            with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
                return list(
                    pool.map(
                        lambda item: observe(session, *item, stream, fresh_prefix=True), bodies
                    )
                )
        observed = []
        for index, (name, body) in enumerate(bodies):
            if scenario.mode is SendMode.IDLE_GAPS and index:
                time.sleep(IDLE_GAP_S)
            observed.append(observe(session, name, body, stream, fresh_prefix=True))
        return observed

    def _judge(
        self, scenario: Scenario, session: TopologySession, observed: list[Observed]
    ) -> ScenarioResult:
        result = ScenarioResult(scenario)
        # Requests in flight together are batched by the engine, in shapes the baseline's
        # single requests never ran: judged as a load's are (`harness.judge.policy`), with
        # the others' baseline answers at hand to name an answer that is another request's.
        batched = scenario.mode is SendMode.CONCURRENT
        answers = self.sweep.baseline.outcomes
        if scenario.require_every_encoder:
            # The scenario's own evidence, a guard of each of its cases: a round robin that
            # left an encoder idle proves nothing of it, and the run's artifacts say so (found
            # in review: kept apart, the check failed the exit code while summary.json,
            # verdicts.txt and the report said every case passed).
            used = check_every_encoder_used(session, [o.outcome for o in observed])
            result.checks.append(used)
            observed = [dataclasses.replace(o, guards=(*o.guards, used)) for o in observed]
        specs = {p.name: p for p in scenario.prompts}
        for seen in observed:
            mine = seen.outcome.prompt
            others = [(p.name, answers[p.name]) for p in scenario.prompts if p.name != mine]
            result.records += self.sweep.judging.judge(
                session.topology,
                seen,
                label=f"{scenario.topology}:{scenario.name}",
                # A scenario expected to MATCH still has the served release's declared
                # failures (0.29/0.30's video timing): the sweep's own judging of the spec.
                spec=specs.get(mine),
                declared=scenario.declared_of(mine),
                batched=batched,
                others=others if batched else [],
            )
        self.sweep.add_records(
            f"matrix:{scenario.name}", [o.outcome for o in observed], result.records
        )
        return result


def empty_kv_storage(session: TopologySession, scenario: Scenario) -> None:
    """Empty the shared session's KV storage for a scenario declared on an empty one. Safe
    here: no request is in flight between scenarios, since every item of a topology runs on
    one worker, one after another (`harness.testing.groups`), and P has written its files by
    the time it answers."""
    removed = clean_storage(session.kv_storage)
    if removed.files:
        log.info(
            "[matrix] %s: emptied the KV storage first (%d files earlier requests left)",
            scenario.name,
            removed.files,
        )


def check_every_encoder_used(session: TopologySession, outcomes: list) -> GuardResult:
    """Read at the encoders' taps (any proxy): the instances that answered encoder work."""
    encoders = {spec.name for spec in session.instances if spec.role.is_ec_producer}
    used = {
        record.instance
        for outcome in outcomes
        for record in outcome.taps or ()
        if record.instance in encoders and record.status == 200
    }
    return GuardResult(
        "every_encoder_used",
        encoders <= used,
        f"encoders {sorted(encoders)}; received work: {sorted(used)}",
    )
