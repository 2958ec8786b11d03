"""The correctness sweep: the baseline and each EPD topology, every prompt, one verdict each.

Topologies run in the waves `harness.spec.placement.schedule` computes (what `epd-harness
plan` prints): the topologies of a wave start side by side, serve every prompt, and stop before
the next wave starts; each topology gets fresh storage. The baseline answers every prompt twice:
a baseline that disagrees with itself would make EPD look broken when it is not, so its cases
get UNSTABLE_BASELINE instead. A baseline already in the cache (same served vLLM, model, flags
and request) is not started at all. Artifacts land in the run directory as they are produced,
so a failed run keeps what it had.

With `--proxy attach` the one EPD topology is a deployment somebody else started
(`harness.serve.attached`): it is served by no wave and nothing of it is launched; its cases
are judged against the baseline only (an exact reference such as 1E+1P+1D's 1P+1D would have
to be started beside the deployment, which is not the deployment under test).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.files import write_json_atomic, write_text_atomic
from harness.fixtures.tiny_model import model_digest
from harness.judge.guards import GuardResult, session_guards
from harness.judge.records import EXACT, CaseRecord, Policy
from harness.judge.verdicts import (
    baseline_is_stable,
    judge_case,
    judged_as_declared,
    not_applicable_case,
)
from harness.report.bundle import write_bundle, write_run_info
from harness.report.text import format_verdict_table, write_summary_json
from harness.run.baseline_cache import BaselineCache, baseline_key
from harness.run.faults import fault_for, plant
from harness.run.goldens import GoldenStore, golden_key
from harness.serve.attached import AttachedDown, AttachedSession
from harness.serve.launch import EventCallback
from harness.serve.session import InstanceStats, Outcome, TopologySession
from harness.spec.generations import KnownFailure, known_failure, not_applicable
from harness.spec.placement import (
    Schedule,
    Wave,
    available_memory_bytes,
    cpu_instance_budget,
    schedule,
)
from harness.spec.prompts import PromptSpec, render_request
from harness.spec.settings import RunSettings
from harness.spec.topology import TOPOLOGIES, Topology

BASELINE = TOPOLOGIES["baseline"]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SweepSpec:
    """Which topologies and prompts a sweep covers (the baseline always runs, unless cached)."""

    topologies: tuple[Topology, ...]  # EPD topologies
    prompts: tuple[PromptSpec, ...]  # sent to the baseline and to every topology
    # Answered by the baseline only, for callers that send them elsewhere (the matrix).
    baseline_only_prompts: tuple[PromptSpec, ...] = ()
    # Policy against the monolithic baseline. Exact on CPU (deterministic); on GPUs upstream
    # allows logprob-close drift for P/D and keeps exactness for 1E+1P+1D vs 1P+1D.
    baseline_policy: Policy = EXACT
    # A planted fault (harness.run.faults.FAULT_NAMES) for self-tests from the command line;
    # recorded in run.json so `repro` replays it. Never set in a normal run.
    fault: str | None = None


@dataclass
class SweepResult:
    run_dir: Path
    records: list[CaseRecord] = field(default_factory=list)
    outcomes: dict[str, dict[str, Outcome]] = field(default_factory=dict)
    instances: list[InstanceStats] = field(default_factory=list)
    seconds_by_wave: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.records) and all(r.policy_passed for r in self.records)


def ordered_topologies(topologies: tuple[Topology, ...]) -> list[Topology]:
    """EPD topologies in run order: each exact reference before the topology using it."""
    pending = [t for t in topologies if not t.is_baseline]
    for topology in list(pending):
        reference = topology.exact_reference
        if reference and reference not in {t.name for t in pending}:
            pending.append(TOPOLOGIES[reference])
    names = {t.name for t in pending}
    ordered: list[Topology] = []
    while pending:
        done = {o.name for o in ordered}
        ready = [t for t in pending if t.exact_reference not in names - done] or pending[:1]
        ordered.append(ready[0])
        pending.remove(ready[0])
    return ordered


class Sweep:
    """Serves the baseline and topologies on demand, a wave at a time, and judges their cases.

    The CLI walks every case; the pytest scenarios ask for single (topology, prompt) cases and
    share one Sweep per session, so each wave (and the baseline) is started once.
    """

    def __init__(
        self,
        spec: SweepSpec,
        settings: RunSettings,
        on_event: EventCallback | None = None,
        baseline_cache: BaselineCache | None = None,
        bodies: dict[str, dict] | None = None,
        goldens: GoldenStore | None = None,
        golden_release: str | None = None,
    ):
        """`bodies` replays recorded request bodies (repro) instead of rendering the spec's.
        `goldens` keeps every baseline answer per release (harness.run.goldens); with
        `golden_release` the baseline is never started: that release's goldens stand in."""
        self.goldens = goldens
        self.golden_release = golden_release
        if golden_release is not None and goldens is None:
            raise ValueError("golden_release needs a GoldenStore")
        self.baseline_label = f"golden-{golden_release}" if golden_release else BASELINE.name
        self.spec = spec
        self.settings = settings
        self.on_event = on_event
        self.baseline_cache = baseline_cache
        self.result = SweepResult(run_dir=settings.run_dir)
        self.bodies = bodies or {
            p.name: render_request(p, settings.serving.served_model_name)
            for p in (*spec.prompts, *spec.baseline_only_prompts)
        }
        self.topology_prompts = list(bodies) if bodies else [p.name for p in spec.prompts]
        # prompt -> (stable, detail, noise floor in nats) from the baseline's control
        self.stability: dict[str, tuple[bool, str, float | None]] = {}
        self.guards: dict[str, dict[str, list[GuardResult]]] = {}
        self._judged: dict[tuple[str, str], list[CaseRecord]] = {}
        self._model_digest: str | None = None
        self._baseline_missing: list[str] | None = None  # prompts the cache lacks
        self._schedule: Schedule | None = None
        self.attached = settings.proxy.attach  # the deployment under test (--proxy attach)
        settings.run_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(settings.run_dir / "requests.json", self.bodies)
        self.run_info = write_run_info(
            settings,
            (BASELINE, *spec.topologies),
            (*spec.prompts, *spec.baseline_only_prompts),
            fault=spec.fault,
            protocol=settings.protocol.to_json(),
        )
        if golden_release is not None:
            self.run_info["golden_release"] = golden_release

    # -- the schedule --------------------------------------------------------------------------

    def schedule(self) -> Schedule:
        """The waves this sweep runs: the baseline (unless every answer is cached) and the
        topologies, packed by the one scheduler; computed once, so waves never reshuffle."""
        if self._schedule is None:
            # An attached deployment is served by none of this run's waves.
            topologies = [] if self.attached else self._topologies_with_cases()
            if self._needs_baseline_run():
                topologies.insert(0, BASELINE)
            self._schedule = self._pack(topologies)
        return self._schedule

    def _topologies_with_cases(self) -> list[Topology]:
        """The EPD topologies worth starting: those with a case the served release can run,
        and the exact references those are judged against. One whose every case is
        NOT_APPLICABLE (an encoder topology with only media prompts on 0.27 / 0.28) is judged
        without a request, so starting its instances would only cost time."""
        prompts = self.topology_prompts
        wanted = [
            t
            for t in ordered_topologies(self.spec.topologies)
            if not prompts or any(self.not_applicable(t.name, p) is None for p in prompts)
        ]
        references = {t.exact_reference for t in wanted if t.exact_reference}
        return [
            t
            for t in ordered_topologies(self.spec.topologies)
            if t in wanted or t.name in references
        ]

    def _pack(self, topologies: list[Topology]) -> Schedule:
        return schedule(
            topologies,
            self.settings.devices,
            self.settings.platform,
            self.settings.colocate,
            cpu_budget=self._cpu_budget(),
        )

    def _cpu_budget(self) -> int | None:
        if self.settings.platform.exclusive_devices:
            return None
        return cpu_instance_budget(
            len(self.settings.devices), available_memory_bytes(), self.settings.workers
        )

    def _needs_baseline_run(self) -> bool:
        if self._baseline_missing is None:
            self._load_cached_baseline()
        return bool(self._baseline_missing)

    def _load_cached_baseline(self, locked: bool = False) -> None:
        self.result.outcomes.setdefault(BASELINE.name, {})
        if self.golden_release is not None:
            self._load_goldens()
            return
        cache = self.baseline_cache
        if cache is None:
            self._baseline_missing = list(self.bodies)
            return
        with contextlib.nullcontext() if locked else cache.locked():
            outcomes = self.result.outcomes[BASELINE.name]
            for name, body in self.bodies.items():
                cached = cache.load(self._baseline_key(body), name)
                if cached is not None:
                    outcomes[name] = cached.outcome
                    self._store_golden(name, body, cached.outcome)
                    self.stability[name] = (
                        True,
                        "from the baseline cache",
                        cached.noise_floor_nats,
                    )
        self._baseline_missing = [
            n for n in self.bodies if n not in self.result.outcomes[BASELINE.name]
        ]
        log.log(
            logging.DEBUG if locked else logging.INFO,
            "[sweep] baseline cache: %d hit(s), %d to compute",
            len(self.bodies) - len(self._baseline_missing),
            len(self._baseline_missing),
        )
        if not self._baseline_missing:
            self.write_outputs()

    def _digest(self) -> str:
        if self._model_digest is None:
            model = Path(self.settings.serving.model)
            self._model_digest = model_digest(model) if model.is_dir() else str(model)
        return self._model_digest

    def _baseline_key(self, body: dict) -> str:
        return baseline_key(self.settings.vllm, self.settings.serving, self._digest(), body)

    def _golden_key(self, body: dict) -> str:
        return golden_key(self.settings.serving, self._digest(), body)

    def _load_goldens(self) -> None:
        """--golden: another release's stored baseline answers; a missing one is BadInput."""
        assert self.goldens is not None and self.golden_release is not None
        outcomes = self.result.outcomes[BASELINE.name]
        for name, body in self.bodies.items():
            outcomes[name] = self.goldens.outcome_for(
                self._golden_key(body), name, self.golden_release
            )
            self.stability[name] = (True, f"golden of vLLM {self.golden_release}", 0.0)
        self._baseline_missing = []
        log.info(
            "[sweep] baseline: the goldens of vLLM %s (%d prompt(s)); no baseline started",
            self.golden_release,
            len(outcomes),
        )

    def _store_golden(self, name: str, body: dict, outcome: Outcome) -> None:
        if self.goldens is not None and self.golden_release is None:
            self.goldens.store(self._golden_key(body), name, self.settings.vllm, outcome)

    # -- serving -----------------------------------------------------------------------------

    def serve_baseline(self) -> dict[str, Outcome]:
        """Baseline outcomes for every body: from the cache where valid, else computed (this
        starts the baseline's wave)."""
        if self._needs_baseline_run():
            self._serve_wave_of(BASELINE.name)
        return self.result.outcomes[BASELINE.name]

    def serve_topology(self, name: str) -> dict[str, Outcome]:
        """The outcomes of topology `name`, starting its wave if it has not run yet (an
        attached deployment's are sent to it instead)."""
        if name not in self.result.outcomes:
            if self.attached is not None and name == self.attached.topology.name:
                self._serve_attached()
            else:
                self._serve_wave_of(name)
        return self.result.outcomes[name]

    def _serve_attached(self) -> None:
        """Every prompt through the attached deployment's proxy. A deployment that is not
        serving fails its cases (ERROR naming the instance), as a topology that cannot start."""
        assert self.attached is not None
        log.info(
            "[sweep] %s: attached at %s (%s); nothing launched",
            self.attached.topology.name,
            self.attached.proxy_url,
            ", ".join(i.describe() for i in self.attached.instances),
        )
        session = AttachedSession(self.attached, self.settings)
        try:
            session.open()
        except AttachedDown as exc:
            self._fail_cases(
                self.attached.topology,
                f"{exc}\nthe attached {self.attached.topology.name} was not serving when the "
                "run began: no request was sent",
            )
        else:
            try:
                self._note_attached_versions(session.versions)
                self._serve_prompts(session)
            finally:
                session.close()
        self.write_outputs()

    def _note_attached_versions(self, versions: dict[str, str]) -> None:
        """Record the versions the attached instances report; a version other than the
        baseline's is worth a warning (the baseline is this machine's vLLM)."""
        self.run_info["attached_versions"] = versions
        ours = self.settings.vllm.version.split("+")[0]  # a local build suffix is not a release
        others = {v for v in versions.values() if v != "unknown" and v.split("+")[0] != ours}
        if others:
            log.warning(
                "[sweep] the attached instances serve vLLM %s; the baseline is vLLM %s",
                ", ".join(sorted(others)),
                self.settings.vllm.version,
            )

    def _serve_wave_of(self, name: str) -> None:
        """Start every topology of `name`'s wave that has not run yet, side by side; serve
        their prompts; stop them. A wave with the baseline holds the baseline cache's lock
        throughout, so a parallel worker waits and then reads what this one stored."""
        self._serve_wave(self.schedule().wave_of(name))

    def _serve_wave(self, wave: Wave) -> None:
        with contextlib.ExitStack() as lock:
            if (
                self.baseline_cache is not None
                and any(s.topology.is_baseline for s in wave.slots)
                and self._needs_baseline_run()
            ):
                lock.enter_context(self.baseline_cache.locked())
                self._load_cached_baseline(locked=True)  # a parallel worker may have stored it
            self._serve_slots(wave)

    def _serve_slots(self, wave: Wave) -> None:
        slots = [s for s in wave.slots if s.topology.name not in self._served()]
        if not slots:
            return
        started = time.monotonic()
        log.info(
            "[sweep] wave %d: starting %s",
            wave.index,
            ", ".join(f"{s.topology.name} ({len(s.topology.roles)})" for s in slots),
        )
        with contextlib.ExitStack() as stack:
            sessions: list[TopologySession] = []
            failed: dict[str, Exception] = {}
            for slot in slots:
                session = TopologySession(
                    slot.topology, self.settings, on_event=self.on_event, devices=slot.devices
                )
                stack.callback(session.close)
                sessions.append(session)
                try:
                    session.start_servers()
                except Exception as exc:  # noqa: BLE001 - a topology that cannot start fails its cases
                    failed[slot.topology.name] = exc
            for session in sessions:
                if session.topology.name in failed:
                    continue
                try:
                    session.wait_until_serving()
                except Exception as exc:  # noqa: BLE001
                    failed[session.topology.name] = exc
                    session.close()  # a dead sibling must not hold memory while others serve
            for session in sessions:
                if session.topology.name in failed:
                    self._record_start_failure(session.topology, failed[session.topology.name])
                elif session.topology.is_baseline:
                    self._serve_baseline_prompts(session)
                else:
                    self._serve_prompts(session)
                self.result.instances.extend(session.stats.values())
                session.close()  # free its memory before the next topology's requests
        self.result.seconds_by_wave[f"wave {wave.index}"] = round(time.monotonic() - started, 1)
        self.write_outputs()

    def _served(self) -> set[str]:
        served = {name for name in self.result.outcomes if name != BASELINE.name}
        if not self._needs_baseline_run():
            served.add(BASELINE.name)
        return served

    def _serve_baseline_prompts(self, session: TopologySession) -> None:
        """Each missing prompt twice on one monolithic instance: the second is the control."""
        names = list(self._baseline_missing or ())
        outcomes = self.result.outcomes[BASELINE.name]
        log.info("[sweep] baseline: %d prompt(s), each twice (determinism control)", len(names))
        for name in names:
            outcomes[name] = session.send(name, self.bodies[name])
        for name in names:
            again = session.send(name, self.bodies[name])
            self.stability[name] = baseline_is_stable(outcomes[name], again)
            if not self.stability[name][0]:
                log.warning("[sweep] baseline UNSTABLE on %s: %s", name, self.stability[name][1])
        if self.baseline_cache is not None:  # its lock is held by _serve_wave_of
            for name in names:
                stable, _, floor = self.stability[name]
                if stable:
                    key = self._baseline_key(self.bodies[name])
                    self.baseline_cache.store(key, outcomes[name], floor or 0.0)
        for name in names:
            if self.stability[name][0]:
                self._store_golden(name, self.bodies[name], outcomes[name])
        self._baseline_missing = []

    def _serve_prompts(self, session: TopologySession | AttachedSession) -> None:
        """Every prompt on one topology, with the guards read while its storage exists."""
        topology = session.topology
        outcomes: dict[str, Outcome] = {}
        guards: dict[str, list[GuardResult]] = {}
        if self.spec.fault:  # the session's faults: its proxy's (harness) or its taps' (vllm)
            fault = fault_for(
                self.spec.fault,
                session.ec_storage,
                session.kv_storage,
                session.settings.serving.kv_connector,
            )
            plant(session.faults, fault)
        for name in self.topology_prompts:
            if self.not_applicable(topology.name, name):
                continue  # judged NOT_APPLICABLE without a request
            outcome = session.send(name, self.bodies[name])
            outcomes[name] = outcome
            status = "failed" if outcome.error else "answered"
            log.info("[sweep] %s %s: %s in %.2fs", topology.name, name, status, outcome.seconds)
            guards[name] = session_guards(session, outcome)
        self.guards[topology.name] = guards
        self.result.outcomes[topology.name] = outcomes

    def _record_start_failure(self, topology: Topology, cause: Exception) -> None:
        """An EPD topology that cannot start fails its cases (ERROR, with the cause); a baseline
        that cannot start fails the run: there is nothing to compare with."""
        if topology.is_baseline:
            raise cause
        self._fail_cases(
            topology, f"{topology.name} could not start: {type(cause).__name__}: {cause}"
        )

    def _fail_cases(self, topology: Topology, error: str) -> None:
        """Every case of the topology fails with `error` (its first line names the cause)."""
        log.error("[sweep] %s", error)
        self.guards[topology.name] = {name: [] for name in self.topology_prompts}
        self.result.outcomes[topology.name] = {
            name: Outcome(prompt=name, error=error) for name in self.topology_prompts
        }

    # -- judging -------------------------------------------------------------------------------

    @property
    def noise_floor(self) -> float:
        """The largest log-prob difference the baseline showed against itself (nats): the drift
        tolerance of every comparison. 0 on CPU, where the numerics flags make runs bitwise
        repeatable, so any difference there is a MISMATCH."""
        floors = [floor for stable, _, floor in self.stability.values() if stable and floor]
        return max(floors, default=0.0)

    def not_applicable(self, topology_name: str, prompt: str) -> str | None:
        """Why the served release cannot run this case meaningfully (None: it can)."""
        spec = next((p for p in self.spec.prompts if p.name == prompt), None)
        if spec is None:  # a replayed body without its spec: send it
            return None
        return not_applicable(self.settings.protocol, TOPOLOGIES[topology_name], spec)

    def declared_failure(self, topology_name: str, prompt: str) -> KnownFailure | None:
        """The failure the served release is declared to have on this case (None: none)."""
        spec = next((p for p in self.spec.prompts if p.name == prompt), None)
        if spec is None:
            return None
        return known_failure(self.settings.protocol, TOPOLOGIES[topology_name], spec)

    def judge(self, topology_name: str, prompt: str) -> list[CaseRecord]:
        """Records for one case: against the baseline, and its exact reference if it has one.
        A case the served release cannot run is NOT_APPLICABLE, with the table's reason; one
        it is declared to fail passes only when it failed exactly so (`judged_as_declared`)."""
        key = (topology_name, prompt)
        reason = self.not_applicable(topology_name, prompt)
        if key not in self._judged and reason is not None:
            record = not_applicable_case(topology_name, prompt, self.baseline_label, reason)
            log.info("[sweep] %s %s: NOT_APPLICABLE (%s)", topology_name, prompt, reason)
            self._judged[key] = [record]
            self.result.records.append(record)
            self.write_outputs()
        if key not in self._judged:
            baseline = self.serve_baseline()
            outcome = self.serve_topology(topology_name)[prompt]
            topology = TOPOLOGIES[topology_name]
            references = [(self.baseline_label, baseline, self.spec.baseline_policy)]
            if topology.exact_reference and self.attached is None:
                reference = self.serve_topology(topology.exact_reference)
                references.append((topology.exact_reference, reference, EXACT))
            records = []
            declared = self.declared_failure(topology_name, prompt)
            for reference_name, reference_outcomes, policy in references:
                record = judge_case(
                    topology_name,
                    reference_name,
                    reference_outcomes[prompt],
                    outcome,
                    self.guards[topology_name][prompt],
                    policy=policy,
                    baseline_stable=reference_name != self.baseline_label
                    or self.stability[prompt][0],
                    drift_tolerance=self.noise_floor,
                )
                if declared is not None:
                    record = judged_as_declared(record, declared)
                log.info(
                    "[sweep] %s %s vs %s: %s (%s)",
                    topology_name,
                    prompt,
                    reference_name,
                    record.verdict.value,
                    record.detail,
                )
                records.append(record)
            self._judged[key] = records
            self.result.records.extend(records)
            self.write_outputs()
        return self._judged[key]

    def run_all(self) -> SweepResult:
        """Every wave, then every case (references before the topologies judged against them)."""
        for wave in self.schedule().waves:
            self._serve_wave(wave)
        for topology in ordered_topologies(self.spec.topologies):
            if topology in self.spec.topologies:
                for prompt in self.topology_prompts:
                    self.judge(topology.name, prompt)
        return self.result

    def write_outputs(self) -> None:
        """Everything so far, rewritten after each step: a failed run keeps what it had."""
        result = self.result
        responses = {
            topology: {prompt: outcome.to_json() for prompt, outcome in by_prompt.items()}
            for topology, by_prompt in result.outcomes.items()
        }
        write_json_atomic(result.run_dir / "responses.json", responses)
        write_summary_json(
            result.run_dir / "summary.json",
            result.records,
            {
                "topologies": [t.name for t in self.spec.topologies],
                "prompts": list(self.bodies),
                "baseline_stability": {p: list(s) for p, s in self.stability.items()},
                "noise_floor_nats": self.noise_floor,
                "instances": [stats.__dict__ for stats in result.instances],
                "seconds_by_wave": dict(result.seconds_by_wave),
            },
        )
        write_text_atomic(
            result.run_dir / "verdicts.txt", format_verdict_table(result.records) + "\n"
        )
        # run.json: the drift tolerance every comparison used, as measured (0 on CPU).
        self.run_info["noise_floor_nats"] = self.noise_floor
        write_bundle(result.run_dir, result.records, responses, self.run_info)
