"""The correctness sweep: the baseline and each EPD topology, every prompt, one verdict each.

Topologies start in the waves `harness.spec.placement.schedule` computes (what `epd-harness
plan` prints), through the run's topology pool (`harness.run.pool`): each starts once, serves
every prompt, and stays available to whatever else the run judges on it (the pytest scenarios
share one sweep and one pool per session). The baseline's answers, with their determinism
control and measured noise floor, come from `harness.run.baseline`; every case is judged on the
one judging path (`harness.run.judging`). Artifacts land in the run directory as they are
produced, so a failed run keeps what it had.

With `--proxy attach` the one EPD topology is a deployment somebody else started
(`harness.serve.attached`): nothing of it is launched; its cases are judged against the
baseline only (an exact reference such as 1E+1P+1D's 1P+1D would have to be started beside the
deployment, which is not the deployment under test).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.files import write_json_atomic
from harness.judge.guards import GuardResult
from harness.judge.records import CaseRecord
from harness.judge.verdicts import Declaration
from harness.outcomes.outcome import InstanceStats, Outcome
from harness.report.bundle import write_run_info
from harness.report.run_outputs import write_run_outputs
from harness.run.baseline import BaselineAnswers
from harness.run.baseline_cache import BaselineCache
from harness.run.faults.by_name import fault_for
from harness.run.faults.planted import PlantedFault, plant
from harness.run.faults.spec import faulted_reference
from harness.run.goldens import GoldenStore
from harness.run.judging import CaseJudge, Observed, observe
from harness.run.pool import SessionRequest, TopologyPool
from harness.serve.attached import AttachedDown, AttachedMismatch, AttachedSession
from harness.serve.server_group import EventCallback
from harness.serve.session import ProxiedSession, TopologySession
from harness.spec.placement import (
    Schedule,
    TopologySlot,
    Wave,
    available_memory_bytes,
    cpu_instance_budget,
)
from harness.spec.placement import schedule as pack_waves
from harness.spec.prompts import PromptSpec, render_request
from harness.spec.settings import RunSettings
from harness.spec.topology import BASELINE, TOPOLOGIES, Topology, ordered_topologies

# responses.json's label of a stage's answers: `stage:<topology>`.
STAGE_LABEL = "stage:"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SweepSpec:
    """Which topologies and prompts a sweep covers (the baseline always runs, unless cached)."""

    topologies: tuple[Topology, ...]  # EPD topologies
    prompts: tuple[PromptSpec, ...]  # sent to the baseline and to every topology
    # Answered by the baseline only, for callers that send them elsewhere (the matrix, the
    # self-test and detection scenarios): one baseline start answers them all.
    baseline_only_prompts: tuple[PromptSpec, ...] = ()
    # A planted fault (harness.run.faults.spec.FAULT_NAMES) for self-tests from the command line;
    # recorded in run.json so `repro` replays it. Never set in a normal run.
    fault: str | None = None
    # Served from the sweep's pool by other scenarios, never judged by the sweep (the
    # matrix's 2E+1PD): placed in its schedule all the same, for on GPUs a topology with no
    # place leases every device, stopping everything else this process serves.
    placed_only: tuple[Topology, ...] = ()
    # Prompt -> the failure a matrix scenario declares it has on the sweep's one topology (an
    # attached deployment sent a scenario's prompt: `harness.run.scenarios.attached_prompt`).
    declared: tuple[tuple[str, Declaration], ...] = ()

    def __post_init__(self) -> None:
        # The CLI refuses it as bad input; any other caller is refused here, before a start.
        conflict = faulted_reference(self.fault, self.topologies) if self.fault else None
        if conflict is not None:
            raise ValueError(conflict)


@dataclass(frozen=True)
class Stage:
    """Requests one topology is sent, in order, before its own prompts, on the same servers:
    the earlier requests of a sequential matrix scenario, which set the stage for the case
    `repro` reruns (the KV an earlier prompt stored under the key the case's request looks up,
    the encoder cache it filled, the encoder a round robin hands the case's request to).

    Sent as the scenario sent them (`harness.run.matrix`): one after another, streamed when the
    sweep streams, each under a cache salt of its own (`observe`, fresh_prefix), with the run's
    planted fault if it has one (a fuzz run sent its earlier requests so), and never judged.
    The baseline and any reference answer the case's request alone, cold, as the run's
    baseline did. The first that gets no answer ends the stage, and the topology's own
    prompts are not sent (`Sweep.stage_unset` says why): they would meet servers in a state the
    run never left them in (an instance dead, nothing stored), and an ERROR there would read as
    the recorded one."""

    topology: str
    requests: tuple[tuple[str, dict[str, Any]], ...]  # (prompt, body), in the order sent


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


@dataclass(frozen=True)
class StageUnset:
    """Why a stage was not set: its request `prompt` got no answer (`error`'s first line)."""

    prompt: str
    error: str

    def __str__(self) -> str:
        return (
            f"the earlier request {self.prompt}, sent before it on the same servers, got no "
            f"answer ({self.error})"
        )


def answered(outcome: Outcome) -> bool:
    """Whether a request got an answer (a result, wrong or right), not an error."""
    return outcome.error is None and outcome.result is not None


class Sweep:
    """Serves the baseline and topologies on demand and judges their cases.

    The CLI walks every case; the pytest scenarios ask for single (topology, prompt) cases and
    share one Sweep (and its pool) per session, so each topology and the baseline start once.
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
        pool: TopologyPool | None = None,
        baseline: BaselineAnswers | None = None,
        stage: Stage | None = None,
    ):
        """`bodies` replays recorded request bodies (repro) instead of rendering the spec's.
        `pool` is shared with the caller (pytest); without one the sweep has its own and stops
        each wave once its prompts are answered (memory for the next). `baseline` is another
        sweep's baseline answers, to share (its cache and goldens are used, not these).
        `stage`: requests its topology is sent first (repro of a scenario's later case)."""
        self.spec = spec
        self.settings = settings
        self.on_event = on_event
        self.result = SweepResult(run_dir=settings.run_dir)
        self.bodies = bodies or {
            p.name: render_request(p, settings.serving.served_model_name)
            for p in (*spec.prompts, *spec.baseline_only_prompts)
        }
        self.topology_prompts = list(bodies) if bodies else [p.name for p in spec.prompts]
        self.specs = {p.name: p for p in (*spec.prompts, *spec.baseline_only_prompts)}
        self.baseline = baseline or BaselineAnswers(
            settings, baseline_cache, goldens, golden_release
        )
        self.baseline.add(self.bodies)
        if not self.baseline.batch_probes:  # a shared baseline keeps the first sweep's probes
            self.baseline.batch_probes = set(self.topology_prompts) or None
        self.judging = CaseJudge(settings, self.baseline)
        self.owns_pool = pool is None
        self.pool = pool or TopologyPool(settings, on_event)
        if not self.owns_pool:
            self.pool.before_stop(self._serve_as_reference)
        self.observed: dict[str, dict[str, Observed]] = {}
        # (topology, prompt) -> what it was asked with (declared, exact_reference), records
        self._judged: dict[
            tuple[str, str], tuple[tuple[Declaration | None, bool], list[CaseRecord]]
        ] = {}
        self._schedule: Schedule | None = None
        self._baseline_loaded = False
        self.attached = settings.proxy.attach  # the deployment under test (--proxy attach)
        self.stage = stage
        self.staged: list[Observed] = []  # the stage's requests as answered, in order
        self.stage_unset: StageUnset | None = None  # why the stage was not set, if it was not
        # Per topology a planted fault acted on nothing in, what it said: a run then proves
        # nothing about the fault, and its MATCHes must not read as the harness missing it.
        self.fault_misses: list[str] = []
        settings.run_dir.mkdir(parents=True, exist_ok=True)
        # Every body this run sends: the stage's too, before the ones it judges.
        sent = {**dict(stage.requests), **self.bodies} if stage else self.bodies
        write_json_atomic(settings.run_dir / "requests.json", sent)
        self.run_info = write_run_info(
            settings,
            (BASELINE, *spec.topologies),
            (*spec.prompts, *spec.baseline_only_prompts),
            fault=spec.fault,
            protocol=settings.protocol.to_json(),
            reference_policy=self.judging.reference_policy.describe(),
        )
        if golden_release is not None:
            self.run_info["golden_release"] = golden_release
        self.result.outcomes[BASELINE.name] = self.baseline.outcomes

    @property
    def noise_floor(self) -> float:
        return self.baseline.noise_floor

    # -- the schedule --------------------------------------------------------------------------

    def schedule(self) -> Schedule:
        """The waves this sweep runs: the baseline (unless every answer is stored) and the
        topologies, packed by the one scheduler; computed once, so waves never reshuffle.

        xdist workers each pack the session's topologies, and must all put each on the same
        devices. Whether the baseline's answers are stored depends on whether a neighbour has
        stored them yet, so where instances own devices the baseline keeps its slot either way
        (a wave skips a baseline it does not need). Seen with the fake vLLM on an 8-device
        plan: a worker that found the answers stored started 1E+1PD on devices 0,1, the
        baseline's device among them. One worker alone keeps it too: a load's calibration
        and fuzzing serve the baseline live, stored answers or not."""
        if self._schedule is None:
            # An attached deployment is served by none of this run's waves.
            topologies = [] if self.attached else self._topologies_with_cases()
            topologies += [t for t in self.spec.placed_only if t not in topologies]
            owns_devices = self.settings.platform.exclusive_devices
            if self._needs_baseline_run() or (owns_devices and not self.attached):
                topologies.insert(0, BASELINE)
            self._schedule = pack_waves(
                topologies,
                self.settings.devices,
                self.settings.platform,
                self.settings.colocate,
                cpu_budget=self._cpu_budget(),
                # A cluster's room is not this host's cores or devices: each instance takes a
                # node's bundle, and a wave whose topologies Ray cannot place together would
                # wait and be refused (the rehearsal has three nodes; found in review with
                # --devices 0-3), or, on GPUs, each start would stop the wave's previous one
                # (the pool keeps one topology on a cluster).
                one_a_wave=not self.settings.launcher.is_local,
            )
            self.pool.place(
                {s.topology.name: s.devices for w in self._schedule.waves for s in w.slots}
            )
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

    def _cpu_budget(self) -> int | None:
        if self.settings.platform.exclusive_devices:
            return None
        return cpu_instance_budget(
            len(self.settings.devices), available_memory_bytes(), self.settings.workers
        )

    # -- the baseline ------------------------------------------------------------------------

    def _needs_baseline_run(self) -> bool:
        if not self._baseline_loaded:
            self.baseline.load_stored()
            self._baseline_loaded = True
            if not self.baseline.missing():
                self.write_outputs()
        return bool(self.baseline.missing())

    def serve_baseline(self) -> dict[str, Outcome]:
        """Baseline outcomes for every body: stored ones where valid, else computed (this
        serves the baseline's wave)."""
        if self._needs_baseline_run():
            self._serve_wave(self.schedule().wave_of(BASELINE.name), {BASELINE.name})
        return self.baseline.outcomes

    # -- serving -----------------------------------------------------------------------------

    def serve_topology(self, name: str) -> dict[str, Observed]:
        """The observed answers of topology `name`, serving its prompts first if it has not
        (with its exact reference, when that shares its wave: they start together; an
        attached deployment is sent them instead)."""
        if name not in self.observed:
            if self.attached is not None and name == self.attached.topology.name:
                self._serve_attached()
            else:
                reference = TOPOLOGIES[name].exact_reference
                self._serve_wave(self.schedule().wave_of(name), {name, reference} - {None})
        return self.observed[name]

    def _serve_wave(self, wave: Wave, wanted: set[str] | None = None) -> None:
        """The wave's slots (those `wanted`, default all) not served yet, started together,
        then each one's prompts. Only what is wanted: a parallel xdist worker serves the
        topologies of its own cases, never its neighbours' (each starts once across workers).
        A wave with the baseline holds the baseline cache's lock throughout, so a parallel
        worker waits and then reads what this one stored."""
        with contextlib.ExitStack() as lock:
            slots = [
                s
                for s in wave.slots
                if s.topology.name not in self.observed
                and (wanted is None or s.topology.name in wanted)
            ]
            if any(s.topology.is_baseline for s in slots) and self._needs_baseline_run():
                lock.enter_context(self.baseline.locked())
                self.baseline.load_stored(again=True)  # a parallel worker may have stored them
            if not self.baseline.missing():
                slots = [s for s in slots if not s.topology.is_baseline]
            if not slots:
                return
            self._start_and_serve(wave, slots)

    def _start_and_serve(self, wave: Wave, slots: list[TopologySlot]) -> None:
        started = time.monotonic()
        log.info(
            "[sweep] wave %d: %s",
            wave.index,
            ", ".join(f"{s.topology.name} ({len(s.topology.roles)})" for s in slots),
        )
        sessions = self.pool.open(
            [SessionRequest(s.topology, self.settings, s.devices) for s in slots]
        )
        for slot, opened in zip(slots, sessions.values(), strict=True):
            topology = slot.topology
            if isinstance(opened, BaseException):
                if topology.is_baseline:  # nothing to compare with: the run cannot go on
                    raise opened
                self._fail_cases(
                    topology,
                    f"{topology.name} could not start: {type(opened).__name__}: {opened}",
                )
            elif topology.is_baseline:
                self.baseline.answer_on(opened)
            else:
                self._serve_prompts(self.pool.through(opened, self.settings))
            # Done with it for this sweep: stop it to free its memory, unless the pool is
            # shared (pytest), where other scenarios use it and the pool decides.
            if self.owns_pool:
                self.pool.release(topology.name)
        self.result.instances = list(self.pool.instances)
        self.result.seconds_by_wave[f"wave {wave.index}"] = round(time.monotonic() - started, 1)
        self.write_outputs()

    def _serve_as_reference(self, session: TopologySession) -> None:
        """A shared pool is about to stop `session`: if it is the exact reference of one of
        this sweep's topologies, under this sweep's serving flags, answer this sweep's prompts
        on it now (a few requests) rather than start it again when a case needs them."""
        name = session.topology.name
        wanted = any(t.exact_reference == name for t in self.spec.topologies)
        if (
            not wanted
            or name in self.observed
            or session.settings.serving != self.settings.serving
            or session.settings.launcher != self.settings.launcher
        ):
            return
        log.info("[sweep] %s: answering the sweep's prompts before it stops (a reference)", name)
        self._serve_prompts(self.pool.through(session, self.settings))

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
        except AttachedMismatch as exc:
            self._fail_cases(
                self.attached.topology,
                f"{exc}\nthe attached {self.attached.topology.name} does not serve the model as "
                "the baseline does, so its answers would not be comparable: no request was sent",
            )
        except AttachedDown as exc:
            self._fail_cases(
                self.attached.topology,
                f"{exc}\nthe attached {self.attached.topology.name} was not serving when the "
                "run began: no request was sent",
            )
        else:
            try:
                self._note_attached_versions(session.versions)
                self._note_attached_roles(session)
                self._serve_prompts(session)
            finally:
                session.close()
        self.write_outputs()

    def _note_attached_roles(self, session: AttachedSession) -> None:
        """Record, and warn of, each attached instance whose declared role its /metrics cannot
        confirm (`harness.serve.attached_roles`): the verdicts then rest on the attach file's
        word for it, which the run must say rather than pass over (found in review)."""
        unverified = session.roles_unverified
        self.run_info["attached_roles_unverified"] = unverified
        for instance in session.spec.instances:
            if instance.name in unverified:
                log.warning(
                    "[sweep] %s's role (%s) is not verified: %s",
                    instance.name,
                    instance.role.value,
                    "; ".join(unverified[instance.name]),
                )

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

    def _serve_prompts(self, session: TopologySession | ProxiedSession | AttachedSession) -> None:
        """Every prompt on one topology, each observed (guards read at once)."""
        topology = session.topology
        # The fault goes into the topologies under test, never into an exact reference (1P+1D
        # for 1E+1P+1D) that is only there to be compared with. Planted before the stage's
        # requests: a fuzz run, whose bundle's earlier requests these may be, sent them with
        # its fault planted, and a case can fail on what the fault did to them (the matrix,
        # whose scenario's earlier requests they may be too, plants none).
        planted = bool(self.spec.fault) and topology in self.spec.topologies
        if planted:  # the session's faults: its proxy's (harness) or its taps' (vllm)
            fault = fault_for(
                self.spec.fault,
                session.ec_storage,
                session.kv_storage,
                session.settings.serving.kv_connector,
            )
            plant(session.faults, fault)
        observed: dict[str, Observed] = {}
        try:
            unset = self._set_stage(session)
            for name in self.topology_prompts:
                if self.not_applicable(topology.name, name):
                    continue  # judged NOT_APPLICABLE without a request
                if unset is not None:  # judged ERROR without a request
                    observed[name] = Observed(Outcome(prompt=name, error=unset), ())
                    continue
                observed[name] = observe(
                    session, name, self.bodies[name], self.settings.stream, fresh_prefix=True
                )
                outcome = observed[name].outcome
                status = "failed" if outcome.error else "answered"
                log.info("[sweep] %s %s: %s in %.2fs", topology.name, name, status, outcome.seconds)
        finally:
            if planted:
                plant(session.faults, None)
                self._account_fault(topology.name, fault)
        self._keep(topology, observed)

    def _account_fault(self, topology: str, fault: PlantedFault) -> None:
        """Record in run.json what the planted fault did on `topology`; one that acted on
        nothing and said why (its problems: no video among the items, a file missing) is a
        miss. A fault that records nothing either way (a proxy flag: drop-metadata) is none."""
        self.run_info.setdefault("fault_effects", {})[topology] = {
            "touched": len(fault.touched),
            "effects": fault.effects[:20],
            "problems": fault.problems[:20],
        }
        if fault.problems and not fault.touched and not fault.effects:
            said = "; ".join(fault.problems[:3])
            self.fault_misses.append(
                f"{topology}: the planted fault {self.spec.fault} acted on nothing ({said}): "
                "its cases prove nothing about it"
            )

    def _set_stage(self, session: TopologySession | ProxiedSession | AttachedSession) -> str | None:
        """Send the stage's requests, in order, when `session` is its topology (once); None
        when every one was answered (or there is no stage here), else the error the topology's
        own prompts then fail with, unsent. That error says only that the stage failed
        (`stage_unset` and the log say how): a declared ERROR's evidence in it would judge the
        unsent case "as declared"."""
        stage = self.stage
        if stage is None or session.topology.name != stage.topology:
            return None
        if not self.staged:
            for number, (name, body) in enumerate(stage.requests, start=1):
                if not self._stage_request(session, number, name, body):
                    break
        if self.stage_unset is None:
            return None
        return (
            f"not sent: the stage was not set: the earlier request {self.stage_unset.prompt} "
            f"got no answer (its error is under {STAGE_LABEL}{stage.topology} in responses.json)"
        )

    def _stage_request(
        self,
        session: TopologySession | ProxiedSession | AttachedSession,
        number: int,
        name: str,
        body: dict[str, Any],
    ) -> bool:
        """One request of the stage, observed and kept (responses.json); whether answered."""
        assert self.stage is not None
        topology, count = self.stage.topology, len(self.stage.requests)
        seen = observe(session, name, body, self.settings.stream, fresh_prefix=True)
        self.staged.append(seen)
        outcome = seen.outcome
        self.result.outcomes.setdefault(f"{STAGE_LABEL}{topology}", {})[name] = outcome
        if answered(outcome):
            log.info(
                "[sweep] %s stage %d/%d %s: answered in %.2fs (not judged)",
                topology,
                number,
                count,
                name,
                outcome.seconds,
            )
            return True
        first = (outcome.error or "").strip().splitlines()[:1]
        self.stage_unset = StageUnset(name, first[0] if first else "no result")
        # Its whole error (what each instance logged during it) is the evidence of why.
        error = outcome.error or "no result"
        log.error(
            "[sweep] %s stage %d/%d: %s:\n%s", topology, number, count, self.stage_unset, error
        )
        return False

    def _keep(self, topology: Topology, observed: dict[str, Observed]) -> None:
        self.observed[topology.name] = observed
        self.result.outcomes[topology.name] = {n: o.outcome for n, o in observed.items()}

    def _fail_cases(self, topology: Topology, error: str) -> None:
        """Every case of the topology fails with `error` (its first line names the cause)."""
        log.error("[sweep] %s", error)
        self._keep(
            topology,
            {
                name: Observed(Outcome(prompt=name, error=error), ())
                for name in self.topology_prompts
            },
        )

    # -- judging -------------------------------------------------------------------------------

    def not_applicable(self, topology_name: str, prompt: str) -> str | None:
        """Why the served release cannot run this case meaningfully (None: it can)."""
        return self.judging.not_applicable(TOPOLOGIES[topology_name], self.specs.get(prompt))

    def judge(
        self,
        topology_name: str,
        prompt: str,
        declared: Declaration | None = None,
        exact_reference: bool = True,
    ) -> list[CaseRecord]:
        """Records for one case: against the baseline, and its exact reference if it has one
        (unless `exact_reference` is False: a rerun of a case its run never judged so). A case
        the served release cannot run is NOT_APPLICABLE, with the table's reason; one it is
        declared to fail (by its release, or `declared`, else the spec's: a matrix scenario's
        failure, rerun by `repro` or sent to an attached deployment) passes only when it
        failed exactly so."""
        key = (topology_name, prompt)
        asked = (declared, exact_reference)
        if key in self._judged:
            first, records = self._judged[key]
            if first != asked:  # the cache would answer another question
                raise ValueError(
                    f"{topology_name} {prompt}: judged already with exact_reference="
                    f"{first[1]} and declared={first[0]!r}, now asked with {exact_reference} "
                    f"and {declared!r}: a case is judged once"
                )
            return records
        topology = TOPOLOGIES[topology_name]
        reason = self.not_applicable(topology_name, prompt)
        if reason is not None:
            records = [self.judging.not_applicable_record(topology_name, prompt, reason)]
            log.info("[sweep] %s %s: NOT_APPLICABLE (%s)", topology_name, prompt, reason)
        else:
            self.serve_baseline()
            observed = self.serve_topology(topology_name)[prompt]
            exact = None
            if topology.exact_reference and exact_reference and self.attached is None:
                reference = self.serve_topology(topology.exact_reference)[prompt]
                exact = (topology.exact_reference, reference.outcome)
            records = self.judging.judge(
                topology,
                observed,
                spec=self.specs.get(prompt),
                exact_reference=exact,
                declared=declared or dict(self.spec.declared).get(prompt),
            )
            for record in records:
                log.info(
                    "[sweep] %s %s vs %s: %s (%s)",
                    topology_name,
                    prompt,
                    record.reference,
                    record.verdict.value,
                    record.detail,
                )
        self._judged[key] = (asked, records)
        self.result.records.extend(records)
        self.write_outputs()
        return records

    def add_records(self, label: str, outcomes: list[Outcome], records: list[CaseRecord]) -> None:
        """Cases judged elsewhere on this sweep's baseline (the matrix, fuzzing) into the same
        artifacts: responses.json, summary.json, the report."""
        self.result.outcomes.setdefault(label, {}).update({o.prompt: o for o in outcomes})
        self.result.records.extend(records)
        self.write_outputs()

    def run_all(self) -> SweepResult:
        """Every wave, each followed by the cases it completed, then every case left
        (references before the topologies judged against them). Judged wave by wave, a run
        that fails or is interrupted in a later wave keeps the verdicts of what already ran
        (found in review: every case waited for the last wave, and such a run kept none)."""
        try:
            for wave in self.schedule().waves:
                self._serve_wave(wave)
                self._judge_cases(served_only=True)
            self._judge_cases(served_only=False)
        finally:
            if self.owns_pool:
                self.pool.close()
        return self.result

    def _judge_cases(self, served_only: bool) -> None:
        """Every case of the spec's topologies; `served_only`: only those that need nothing
        served any more (the baseline answered, the topology and its exact reference too)."""
        for topology in ordered_topologies(self.spec.topologies):
            if topology not in self.spec.topologies:
                continue
            if served_only and (
                self.baseline.missing()
                or topology.name not in self.observed
                or (topology.exact_reference or topology.name) not in self.observed
            ):
                continue
            for prompt in self.topology_prompts:
                self.judge(topology.name, prompt)

    def guards(self, topology_name: str, prompt: str) -> list[GuardResult]:
        return list(self.observed[topology_name][prompt].guards)

    def write_outputs(self) -> None:
        """Everything so far, rewritten after each step: a failed run keeps what it had."""
        self.run_info["noise_floor_nats"] = self.noise_floor
        self.run_info["topology_starts"] = self.pool.summary()
        # Which answers the baseline did not serve in this run, and where they came from.
        self.run_info["baseline_sources"] = self.baseline.sources
        write_run_outputs(
            self.result.run_dir,
            self.result.records,
            self.result.outcomes,
            {
                "topologies": [t.name for t in self.spec.topologies],
                "prompts": list(self.bodies),
                "baseline_stability": {
                    p: [s.stable, s.detail, s.noise_floor]
                    for p, s in self.baseline.stability.items()
                },
                "baseline_sources": self.baseline.sources,
                "noise_floor_nats": self.noise_floor,
                "reference_policy": self.judging.reference_policy.name,
                "instances": [stats.__dict__ for stats in self.pool.instances],
                "seconds_by_wave": dict(self.result.seconds_by_wave),
                "topology_starts": self.pool.starts_json(),
            },
            self.run_info,
        )
        if self.owns_pool:  # a shared pool's owner writes its account (the pytest plugin)
            self.pool.write_starts(self.result.run_dir)
