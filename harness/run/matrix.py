"""Running the scenario matrix (declared in `harness.run.scenarios`) on a sweep's baseline.

Scenarios of one topology share one running session, in order; a scenario after one that
killed an instance gets a fresh session, so one crash does not fail the rest of the run.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from harness.judge.guards import GuardResult, session_guards
from harness.judge.records import CaseRecord, Verdict
from harness.judge.verdicts import judge_case
from harness.run.scenarios import IDLE_GAP_S, Scenario, SendMode
from harness.run.sweep import Sweep
from harness.serve.session import Outcome, TopologySession
from harness.spec.topology import TOPOLOGIES

log = logging.getLogger(__name__)


@dataclass
class ScenarioResult:
    scenario: Scenario
    records: list[CaseRecord] = field(default_factory=list)
    checks: list[GuardResult] = field(default_factory=list)

    def problems(self) -> list[str]:
        """Why the scenario did not behave as declared; empty when it did."""
        found = []
        expected = self.scenario.expect
        wanted = "/".join(v.value for v in expected)
        for record in self.records:
            if record.verdict not in expected:
                found.append(
                    f"{record.prompt}: expected {wanted}, got "
                    f"{record.verdict.value}: {record.detail}"
                )
            elif record.verdict is Verdict.MATCH and not record.policy_passed:
                found.append(f"{record.prompt}: policy rejected {record.verdict.value}")
            elif self.scenario.expect_evidence:
                evidence = f"{record.error or ''}\n{record.explanation}"
                if self.scenario.expect_evidence not in evidence:
                    found.append(
                        f"{record.prompt}: {record.verdict.value} as expected, but the "
                        f"evidence lacks {self.scenario.expect_evidence!r}"
                    )
        found += [f"check {c.name} failed: {c.evidence}" for c in self.checks if not c.ok]
        return found


class MatrixRun:
    """Runs scenarios against a shared sweep's baseline, one topology session at a time."""

    def __init__(self, sweep: Sweep):
        self.sweep = sweep
        self.results: dict[str, ScenarioResult] = {}
        self._session: TopologySession | None = None

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    def run(self, scenario: Scenario) -> ScenarioResult:
        """The scenario, with its expectation for the run's KV connector."""
        scenario = scenario.for_kv_connector(self.sweep.settings.serving.kv_connector)
        if scenario.name not in self.results:
            self.results[scenario.name] = self._run(scenario)
        return self.results[scenario.name]

    def _start_or_reuse_session(self, topology_name: str) -> TopologySession:
        """The open session of this topology, or a new one (closing any other first: memory)."""
        session = self._session
        healthy = session is not None and session.dead_instance_report() is None
        if session is not None and (session.topology.name != topology_name or not healthy):
            self.close()
        if self._session is None:
            log.info(f"[matrix] starting {topology_name}")
            self._session = TopologySession(
                TOPOLOGIES[topology_name],
                self.sweep.settings,
                on_event=self.sweep.on_event,
                label=f"matrix-{topology_name}",
            ).__enter__()
        return self._session

    def _run(self, scenario: Scenario) -> ScenarioResult:
        baseline = self.sweep.serve_baseline()
        session = self._start_or_reuse_session(scenario.topology)
        outcomes = self._send(session, scenario)
        result = self._judge(scenario, session, outcomes, baseline)
        if scenario.rerun_on_kept_storage:
            kept = session.storage_dir
            self.close()
            log.info(f"[matrix] {scenario.name}: rerun on the storage the last session left")
            with TopologySession(
                TOPOLOGIES[scenario.topology],
                self.sweep.settings,
                on_event=self.sweep.on_event,
                label=f"matrix-{scenario.topology}-rerun",
                reuse_storage=kept,
            ) as rerun:
                rerun_result = self._judge(scenario, rerun, self._send(rerun, scenario), baseline)
            result.records += rerun_result.records
            result.checks += rerun_result.checks
        for record in result.records:
            log.info(
                f"[matrix] {scenario.name} {record.prompt}: {record.verdict.value} "
                f"({record.detail})"
            )
        return result

    def _send(self, session: TopologySession, scenario: Scenario) -> list[Outcome]:
        bodies = [(p.name, self.sweep.bodies[p.name]) for p in scenario.prompts]
        if scenario.mode is SendMode.CONCURRENT:
            with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
                return list(pool.map(lambda item: session.send(*item), bodies))
        outcomes = []
        for index, (name, body) in enumerate(bodies):
            if scenario.mode is SendMode.IDLE_GAPS and index:
                time.sleep(IDLE_GAP_S)
            outcomes.append(session.send(name, body))
        return outcomes

    def _judge(
        self,
        scenario: Scenario,
        session: TopologySession,
        outcomes: list[Outcome],
        baseline: dict[str, Outcome],
    ) -> ScenarioResult:
        result = ScenarioResult(scenario)
        for outcome in outcomes:
            guards = session_guards(session, outcome)
            result.records.append(
                judge_case(
                    f"{scenario.topology}:{scenario.name}",
                    "baseline",
                    baseline[outcome.prompt],
                    outcome,
                    guards,
                    policy=scenario.effective_policy,
                    baseline_stable=self.sweep.stability[outcome.prompt][0],
                    drift_tolerance=self.sweep.noise_floor,
                )
            )
        if scenario.require_every_encoder:
            result.checks.append(check_every_encoder_used(session, outcomes))
        self._record(scenario, outcomes, result)
        return result

    def _record(self, scenario: Scenario, outcomes: list[Outcome], result: ScenarioResult) -> None:
        """Into the sweep's artifacts (responses.json, summary.json, report) as they come."""
        key = f"matrix:{scenario.name}"
        self.sweep.result.outcomes.setdefault(key, {}).update({o.prompt: o for o in outcomes})
        self.sweep.result.records.extend(result.records)
        self.sweep.write_outputs()


def check_every_encoder_used(session: TopologySession, outcomes: list[Outcome]) -> GuardResult:
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
