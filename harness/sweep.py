"""The correctness sweep: baseline first, then each EPD topology, every prompt, one verdict each.

Topologies run one after another (a 1E+1P+1D topology alone takes ~8 GB on CPU), each with
fresh storage. The baseline answers every prompt twice: a baseline that disagrees with itself
would make EPD look broken when it is not, so its cases get UNSTABLE_BASELINE instead.
Artifacts land in the run directory as they are produced, so a failed run keeps what it had.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fixtures.tiny_model import model_digest
from harness.baseline_cache import BaselineCache, baseline_key
from harness.bundle import write_bundle, write_run_info
from harness.compare import EXACT, Policy
from harness.faults import fault_for, plant
from harness.guards import GuardResult
from harness.judge import baseline_is_stable, judge_case
from harness.prompts import PromptSpec, render_request
from harness.report import CaseRecord, format_verdict_table, write_summary_json, write_text_atomic
from harness.runner import InstanceStats, Outcome, RunSettings, TopologySession
from harness.topology import TOPOLOGIES, Topology

BASELINE = TOPOLOGIES["baseline"]


@dataclass(frozen=True)
class SweepPlan:
    topologies: tuple[Topology, ...]  # EPD topologies; the baseline always runs first
    prompts: tuple[PromptSpec, ...]  # sent to the baseline and to every topology
    # Answered by the baseline only, for callers that send them elsewhere (the matrix).
    baseline_only_prompts: tuple[PromptSpec, ...] = ()
    # Policy against the monolithic baseline. Exact on CPU (deterministic); on GPUs upstream
    # allows logprob-close drift for P/D and keeps exactness for 1E+1P+1D vs 1P+1D.
    baseline_policy: Policy = EXACT
    # A planted fault (harness.faults.FAULT_NAMES) for self-tests from the command line;
    # recorded in run.json so `repro` replays it. Never set in a normal run.
    fault: str | None = None


@dataclass
class SweepResult:
    run_dir: Path
    records: list[CaseRecord] = field(default_factory=list)
    outcomes: dict[str, dict[str, Outcome]] = field(default_factory=dict)
    instances: list[InstanceStats] = field(default_factory=list)
    seconds_by_topology: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.records) and all(r.policy_passed for r in self.records)


def ordered_topologies(topologies: tuple[Topology, ...]) -> list[Topology]:
    """EPD topologies in run order: each exact reference runs before the topology using it."""
    pending = [t for t in topologies if not t.is_baseline]
    names = {t.name for t in pending}
    ordered: list[Topology] = []
    while pending:
        ready = [t for t in pending if t.exact_reference not in names - {o.name for o in ordered}]
        ready = ready or pending[:1]
        ordered.append(ready[0])
        pending.remove(ready[0])
    return ordered


class Sweep:
    """Runs the baseline and topologies on demand, once each, and judges their cases.

    The CLI walks it in order; the pytest scenarios ask for single (topology, prompt) cases
    and share one instance per session, so the baseline is computed once.
    """

    def __init__(
        self,
        plan: SweepPlan,
        settings: RunSettings,
        log: Callable[[str], None] = print,
        on_event: Callable[[str, str, float], None] | None = None,
        baseline_cache: BaselineCache | None = None,
        bodies: dict[str, dict] | None = None,
    ):
        """`bodies` replays recorded request bodies (repro) instead of rendering the plan's."""
        self.plan = plan
        self.baseline_cache = baseline_cache
        self.baseline_outcomes: dict[str, Outcome] = {}
        self._model_digest: str | None = None
        self.settings = settings
        self.log = log
        self.on_event = on_event
        self.result = SweepResult(run_dir=settings.run_dir)
        self.bodies = bodies or {
            p.name: render_request(p, settings.serving.served_model_name)
            for p in (*plan.prompts, *plan.baseline_only_prompts)
        }
        self.topology_prompts = list(bodies) if bodies else [p.name for p in plan.prompts]
        self.stability: dict[str, tuple[bool, str]] = {}
        self.guards: dict[str, dict[str, list[GuardResult]]] = {}
        self._judged: dict[tuple[str, str], list[CaseRecord]] = {}
        settings.run_dir.mkdir(parents=True, exist_ok=True)
        write_json(settings.run_dir / "requests.json", self.bodies)
        self.run_info = write_run_info(
            settings.run_dir,
            settings.serving,
            (BASELINE, *plan.topologies),
            (*plan.prompts, *plan.baseline_only_prompts),
            settings.serving.model,
        )
        self.run_info.update(
            platform_profile=settings.platform.name,
            devices=list(settings.devices),
            fault=plan.fault,
        )

    def baseline(self) -> dict[str, Outcome]:
        """Baseline outcomes for every body: from the cache where valid, else computed."""
        if BASELINE.name in self.result.outcomes:
            return self.result.outcomes[BASELINE.name]
        cache = self.baseline_cache
        if cache is None:
            self._run_baseline(list(self.bodies))
        else:
            with cache.locked():
                keys = {name: self._baseline_key(body) for name, body in self.bodies.items()}
                cached = {name: cache.load(key, name) for name, key in keys.items()}
                for name, outcome in cached.items():
                    if outcome is not None:
                        self.baseline_outcomes[name] = outcome
                        self.stability[name] = (True, "from the baseline cache")
                missing = [name for name, outcome in cached.items() if outcome is None]
                self.log(f"[sweep] baseline cache: {len(cached) - len(missing)} hit(s), "
                         f"{len(missing)} to compute")  # fmt: skip
                if missing:
                    self._run_baseline(missing)
                    for name in missing:
                        if self.stability[name][0]:
                            cache.store(keys[name], self.baseline_outcomes[name])
        self.result.outcomes[BASELINE.name] = self.baseline_outcomes
        self.write_outputs()
        return self.baseline_outcomes

    def _baseline_key(self, body: dict) -> str:
        if self._model_digest is None:
            model = Path(self.settings.serving.model)
            self._model_digest = model_digest(model) if model.is_dir() else str(model)
        return baseline_key(self.settings.serving, self._model_digest, body)

    def topology(self, name: str) -> dict[str, Outcome]:
        if name not in self.result.outcomes:
            topology = TOPOLOGIES[name]
            if topology.exact_reference:
                self.topology(topology.exact_reference)
            self.log(f"[sweep] {name}: starting {len(topology.roles)} instance(s)")
            self._run_topology(topology)
            self.write_outputs()
        return self.result.outcomes[name]

    def judge(self, topology_name: str, prompt: str) -> list[CaseRecord]:
        """Records for one case: against the baseline, and its exact reference if it has one."""
        key = (topology_name, prompt)
        if key not in self._judged:
            baseline = self.baseline()
            outcome = self.topology(topology_name)[prompt]
            topology = TOPOLOGIES[topology_name]
            references = [(BASELINE.name, baseline, self.plan.baseline_policy)]
            if topology.exact_reference:
                references.append(
                    (topology.exact_reference, self.topology(topology.exact_reference), EXACT)
                )
            records = []
            for reference_name, reference_outcomes, policy in references:
                record = judge_case(
                    topology_name,
                    reference_name,
                    reference_outcomes[prompt],
                    outcome,
                    self.guards[topology_name][prompt],
                    policy=policy,
                    baseline_stable=reference_name != BASELINE.name or self.stability[prompt][0],
                )
                self.log(f"[sweep] {topology_name} {prompt} vs {reference_name}: "
                         f"{record.verdict.value} ({record.detail})")  # fmt: skip
                records.append(record)
            self._judged[key] = records
            self.result.records.extend(records)
            self.write_outputs()
        return self._judged[key]

    def run_all(self) -> SweepResult:
        self.baseline()
        for topology in ordered_topologies(self.plan.topologies):
            for prompt in self.topology_prompts:
                self.judge(topology.name, prompt)
        return self.result

    def _run_baseline(self, names: list[str]) -> None:
        """Each prompt twice on one monolithic instance: the second answer is the control."""
        self.log(f"[sweep] baseline: {len(names)} prompt(s), each twice (determinism control)")
        started = time.monotonic()
        with TopologySession(BASELINE, self.settings, on_event=self.on_event) as session:
            for name in names:
                self.baseline_outcomes[name] = session.send(name, self.bodies[name])
            for name in names:
                again = session.send(name, self.bodies[name])
                self.stability[name] = baseline_is_stable(self.baseline_outcomes[name], again)
                if not self.stability[name][0]:
                    self.log(f"[sweep] baseline UNSTABLE on {name}: {self.stability[name][1]}")
            self.result.instances.extend(session.stats.values())
        self.result.seconds_by_topology[BASELINE.name] = time.monotonic() - started

    def _run_topology(self, topology: Topology) -> None:
        """Every prompt on one topology, with the guards read while its storage exists."""
        started = time.monotonic()
        outcomes: dict[str, Outcome] = {}
        guards: dict[str, list[GuardResult]] = {}
        try:
            with TopologySession(topology, self.settings, on_event=self.on_event) as session:
                if self.plan.fault and session.proxy is not None:
                    plant(
                        session.proxy.faults,
                        fault_for(self.plan.fault, session.ec_storage, session.kv_storage),
                    )
                for name in self.topology_prompts:
                    outcome = session.send(name, self.bodies[name])
                    outcomes[name] = outcome
                    status = "failed" if outcome.error else "answered"
                    self.log(f"[sweep] {topology.name} {name}: {status} in {outcome.seconds:.2f}s")
                    guards[name] = session.transfer_guards(outcome)
                self.result.instances.extend(session.stats.values())
        except Exception as exc:  # noqa: BLE001 - a topology that cannot start fails its cases
            error = f"{topology.name} could not start: {type(exc).__name__}: {exc}"
            self.log(f"[sweep] {error}")
            for name in self.topology_prompts:
                outcomes.setdefault(name, Outcome(prompt=name, error=error))
                guards.setdefault(name, [])
        self.guards[topology.name] = guards
        self.result.outcomes[topology.name] = outcomes
        self.result.seconds_by_topology[topology.name] = time.monotonic() - started

    def write_outputs(self) -> None:
        """Everything so far, rewritten after each step: a failed run keeps what it had."""
        result = self.result
        responses = {
            topology: {prompt: outcome.to_json() for prompt, outcome in by_prompt.items()}
            for topology, by_prompt in result.outcomes.items()
        }
        write_json(result.run_dir / "responses.json", responses)
        write_summary_json(
            result.run_dir / "summary.json",
            result.records,
            {
                "topologies": [t.name for t in self.plan.topologies],
                "prompts": list(self.bodies),
                "baseline_stability": {p: list(s) for p, s in self.stability.items()},
                "instances": [stats.__dict__ for stats in result.instances],
                "seconds_by_topology": {
                    name: round(seconds, 1) for name, seconds in result.seconds_by_topology.items()
                },
            },
        )
        write_text_atomic(result.run_dir / "verdicts.txt", format_verdict_table(result.records) + "\n")
        write_bundle(result.run_dir, result.records, responses, self.run_info)


def write_json(path: Path, data: object) -> None:
    try:
        path.write_text(json.dumps(data, indent=2, sort_keys=True))
    except OSError as exc:
        if exc.filename is None:  # a failed write() (a full disk) does not say which file
            exc.filename = str(path)
        raise
