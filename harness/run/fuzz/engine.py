"""The fuzz run: baseline and topology kept up side by side, every example sent to both and
judged, failures grouped by signature and shrunk.

Each example goes to the baseline first. A request the baseline rejects is skipped and
counted, never judged. Otherwise the baseline's prompt ids give the example's exact layout
(`harness.run.fuzz.layout`), which says whether a declared crash's trigger holds; an example
whose crash the run trusts its prediction of is not sent (`harness.run.fuzz.predictions`).
Then the topology answers, the transfer guards are read, and the case is judged by the
harness's own verdicts (one function, `judge_example`). A failure is checked against a second
baseline answer (an unstable baseline blames nothing). Every baseline send goes under a cache
salt of its own (`cold_request`), so neither answer is read from the baseline's prefix cache;
the topology's go as drawn (what D holds is followed).

An instance that died is noticed before the next request that needs it, and only then is it
started again, in place (`TopologyPool.revive`: its siblings, storage and proxy keep running;
the dead one's log stays as evidence); a topology that cannot be revived is restarted in a
fresh session directory. What D holds before each request (its prefix cache, the KV files of
earlier requests) is followed across examples (`harness.run.fuzz.consumer`), because whether
some requests kill D depends on it. An attached deployment cannot be restarted: after a death
the remaining examples are not sent.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.judge.guards import GuardResult, transfer_guards
from harness.judge.records import CaseRecord
from harness.judge.verdicts import Reference, baseline_stability
from harness.outcomes.outcome import Outcome
from harness.run.baseline import BaselineAnswers
from harness.run.faults.by_name import fault_for
from harness.run.faults.planted import PlantedFault, plant
from harness.run.fuzz.consumer import (
    ConsumerState,
    SentPrompt,
    block_aligned_kv,
    media_identities,
)
from harness.run.fuzz.fault_effect import (
    FAULT_ACTED,
    FAULT_ACTED_BEFORE,
    fault_mark,
    fault_since,
    request_content,
)
from harness.run.fuzz.group_shrink import confirm_predicted, shrink_group, shrink_order
from harness.run.fuzz.known import KnownRule, recognise, rules_for
from harness.run.fuzz.layout import PlaceholderIds, PromptLayout, layout_from_ids
from harness.run.fuzz.predictions import CrashPredictions
from harness.run.fuzz.records import Evaluation, FailureGroup, FuzzReport, group_failures
from harness.run.fuzz.run_budget import BudgetSpent, RunBudget
from harness.run.fuzz.shrink import ShrinkBudget
from harness.run.fuzz.signature import is_failure, signature_of
from harness.run.judging import CaseJudge, Observed
from harness.run.pool import SessionRequest, TopologyPool
from harness.serve.attached import AttachedSession
from harness.serve.server_group import EventCallback
from harness.serve.session import ProxiedSession, TopologySession
from harness.spec.placement import side_by_side
from harness.spec.prompts import (
    CACHE_SALT,
    MEDIA_PARTS,
    ImagePart,
    PromptSpec,
    cold_request,
    render_request,
    streaming_request,
)
from harness.spec.settings import RunSettings
from harness.spec.topology import BASELINE, Role, Topology

if TYPE_CHECKING:  # the strategies need Hypothesis, which the engine itself does not
    from harness.run.fuzz.strategies import FuzzExample

log = logging.getLogger(__name__)


def judge_example(
    judging: CaseJudge,
    topology: Topology,
    baseline: Outcome,
    candidate: Outcome,
    guards: list[GuardResult],
    baseline_stable: bool = True,
    drift_tolerance: float = 0.0,
) -> CaseRecord:
    """The fuzzer's cases on the run's one judging path, against the monolithic baseline's
    answer the fuzzer asked for this very request (the run's reference policy applies)."""
    [record] = judging.judge(
        topology,
        Observed(candidate, tuple(guards)),
        baseline=Reference(BASELINE.name, baseline, monolithic=True, stable=baseline_stable),
        noise_floor=drift_tolerance,
    )
    return record


class FuzzEngine:
    """Context manager: the baseline and the topology (or an attached deployment) up."""

    def __init__(
        self,
        settings: RunSettings,
        topology: Topology,
        *,
        fault: str | None = None,
        attached: bool = False,
        on_event: EventCallback | None = None,
        confirm_known: int = 2,
        budget: ShrinkBudget = ShrinkBudget(),
        run_budget: RunBudget = RunBudget(),
        pool: TopologyPool | None = None,
        min_prompt_tokens: int = 0,
    ):
        """`pool` is the run's running topologies (a pytest session's); without one the
        engine has its own, stopped when it closes. `min_prompt_tokens` is the space's
        (`FuzzSpace.min_prompt_tokens`): shrinking keeps a request at least that long, since
        a shorter one moves no KV and shows nothing of P->D."""
        self.settings = settings
        self.owns_pool = pool is None
        self.pool = pool or TopologyPool(settings, on_event)
        self.judging = CaseJudge(settings, BaselineAnswers(settings))
        self.topology = topology
        # Where the baseline and the topology (unless attached) serve side by side, on GPUs
        # on devices of their own; refused here, before anything starts, when the run's
        # devices cannot hold both.
        served = (BASELINE,) if attached else (BASELINE, topology)
        self.devices = side_by_side(served, settings.devices, settings.platform, settings.colocate)
        self.fault = fault
        self.attached = attached
        self.budget = budget
        self.run_budget = run_budget
        self.min_prompt_tokens = min_prompt_tokens
        self.began = time.monotonic()
        self.rules: list[KnownRule] = rules_for(
            topology, settings.serving.kv_connector, settings.protocol
        )
        self.predictions = CrashPredictions(self.rules, confirm_known)
        self.placeholders = PlaceholderIds.from_model_dir(Path(settings.serving.model))
        self.consumer = ConsumerState(settings.serving.block_size)
        self.block_aligned_kv = block_aligned_kv(topology, settings.serving.kv_connector)
        self.sent: dict[str, dict[str, Any]] = {}  # every body the topology got, by name
        self.baseline: TopologySession | ProxiedSession | None = None
        self.planted: PlantedFault | None = None  # the fault in the topology's proxy now
        self._fault_acted_on: set[str] = set()  # request_content() of sends it acted on
        self.session: TopologySession | ProxiedSession | AttachedSession | None = None
        self.report_restarts: list[dict[str, Any]] = []
        self._down: str | None = None  # an attached deployment that died

    # -- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> FuzzEngine:
        try:
            if self.attached:
                self.baseline = self.pool.session(BASELINE, devices=self.devices[BASELINE.name])
                attach = self.settings.proxy.attach
                assert attach is not None, "an attached fuzz run needs the attach spec"
                self.session = AttachedSession(attach, self.settings)
                self.session.open()
            else:
                # The baseline and the topology start together (one wave) and stay up side
                # by side: every example goes to both.
                opened = self.pool.open(self._requests(BASELINE, self.topology))
                for session in opened.values():
                    if isinstance(session, BaseException):
                        raise session
                baseline, topology = opened.values()
                self.baseline = baseline
                self.session = self.pool.through(topology, self.settings)
                self._plant(self.session)
        except BaseException:
            self.close()
            raise
        return self

    def _requests(self, *topologies: Topology) -> list[SessionRequest]:
        """What the pool is asked for `topologies`, each on its devices. Asked for together,
        the baseline and the topology stay up together (`TopologyPool.session`'s `beside`)."""
        return [SessionRequest(t, self.settings, self.devices[t.name]) for t in topologies]

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close an attached session; the pool's sessions are the pool's (stopped here only
        when the engine has a pool of its own), handed back without the planted fault, which
        would break every later request of a shared pool's running topology."""
        session, self.session, self.baseline = self.session, None, None
        planted, self.planted = self.planted, None
        try:
            if isinstance(session, AttachedSession):
                session.close()
            elif session is not None and planted is not None:
                plant(session.faults)
        finally:
            if self.owns_pool:
                self.pool.close()

    def _plant(self, session: TopologySession | ProxiedSession) -> None:
        if self.fault:
            planted = fault_for(
                self.fault,
                session.ec_storage,
                session.kv_storage,
                session.settings.serving.kv_connector,
            )
            plant(session.faults, planted)
            self.planted = planted

    def topology_dead(self) -> str | None:
        """Why the topology cannot take a request now (an instance died), or None."""
        if isinstance(self.session, (TopologySession, ProxiedSession)):
            return self.session.dead_instance_report()
        if isinstance(self.session, AttachedSession):
            return self._down
        return "not started"

    def _ensure_topology(self) -> float:
        """Restart the topology if an instance died; returns the seconds that took."""
        dead = self.topology_dead()
        if dead is None:
            return 0.0
        if isinstance(self.session, AttachedSession):
            raise RuntimeError(f"the attached deployment is down: {dead}")
        restarts = sum(r["what"] == self.topology.name for r in self.report_restarts)
        if restarts >= self.run_budget.max_restarts:
            raise BudgetSpent(
                f"the run's restart budget ({self.run_budget.max_restarts}) is spent and "
                f"{self.topology.name} is down"
            )
        began = time.monotonic()
        log.info("[fuzz] %s: reviving (%s)", self.topology.name, dead.splitlines()[0])
        before = _base(self.session)
        roles = dead_roles(self.session)
        # The dead instance starts again in place (its log stays as evidence); a topology the
        # pool could not revive starts afresh, in a new session directory with new storage.
        # With the baseline beside it: on a Ray cluster a restart stopped it (real vLLM).
        self.session = self.pool.revive(
            self.topology,
            devices=self.devices[self.topology.name],
            beside=self._requests(BASELINE),
        )
        how = "revived"
        if _base(self.session) is before:
            self.consumer.restarted(prefill=Role.PREFILL in roles, consumer=Role.DECODE in roles)
        else:
            how = "restarted"
            self.consumer.storage_reset()
            self._plant(self.session)
        seconds = time.monotonic() - began
        self.report_restarts.append(
            {
                "what": self.topology.name,
                "how": how,
                "why": dead.splitlines()[0],
                "seconds": round(seconds, 1),
            }
        )
        return seconds

    def _ensure_baseline(self) -> float:
        assert self.baseline is not None
        dead = self.baseline.dead_instance_report()
        if dead is None:
            return 0.0
        began = time.monotonic()
        log.warning("[fuzz] the baseline died; restarting (%s)", dead.splitlines()[0])
        beside = () if isinstance(self.session, AttachedSession) else self._requests(self.topology)
        self.baseline = self.pool.session(
            BASELINE, devices=self.devices[BASELINE.name], beside=beside
        )
        seconds = time.monotonic() - began
        self.report_restarts.append(
            {"what": "baseline", "why": dead.splitlines()[0], "seconds": round(seconds, 1)}
        )
        return seconds

    # -- one request ---------------------------------------------------------------------------

    def ask_baseline(self, spec: PromptSpec) -> Evaluation:
        """The baseline's answer and the exact layout; status baseline-rejected when it had
        none (the request is then never judged)."""
        began = time.monotonic()
        restart = self._ensure_baseline()
        assert self.baseline is not None
        body = render_request(spec, self.settings.serving.served_model_name)
        answer = self.baseline.send(spec.name, cold_request(body))
        evaluation = Evaluation(spec, body, answer, status="judged", restart_seconds=restart)
        if answer.result is None:
            evaluation.status = "baseline-rejected"
            evaluation.note = (answer.error or "no result").strip().splitlines()[0][:200]
        elif self.placeholders is not None:
            # An instance down now is revived, its prefix cache empty, before this request
            # reaches it (`_ensure_topology`, after this layout is read): forgotten at the
            # revival only, its cache counted here for a D that no longer held it.
            dead = dead_roles(self.session)
            self.consumer.restarted(prefill=Role.PREFILL in dead, consumer=Role.DECODE in dead)
            ids = answer.result.prompt_token_ids
            layout = layout_from_ids(ids, self.placeholders, self.settings.serving.block_size)
            sent = sent_prompt(evaluation, layout)
            evaluation.layout = dataclasses.replace(
                layout,
                decode_has_media=not self.topology.has_ec_transfer,
                consumer_holds=self.consumer.holds(sent),
                prefill_loads_missing=self.consumer.prefill_loads_missing(sent),
                decode_loads_missing=self.consumer.decode_loads_missing(sent),
            )
            if self.block_aligned_kv and evaluation.layout.decode_dies_of_media:
                # Sent alone, D holds less and computes more of the prompt: it dies so too,
                # and a stage that killed D itself could not be replayed.
                names = ()
            elif evaluation.layout.loads_missing:
                names = self.consumer.stage_of(sent)
            else:
                names = self.consumer.holds_stage(sent)
            evaluation.stage = tuple((n, self.sent[n]) for n in names if n in self.sent)
            evaluation.stage_in_prefill_cache = self.consumer.prefill_hit(sent) > 0
        evaluation.seconds = time.monotonic() - began
        return evaluation

    def send_topology(self, evaluation: Evaluation) -> Evaluation:
        """The topology's answer to an evaluation the baseline answered, judged."""
        began = time.monotonic()
        spec = evaluation.spec
        if self._down is not None:
            evaluation.status = "not-sent"
            evaluation.note = f"the attached deployment is down: {self._down}"
            return evaluation
        try:
            evaluation.restart_seconds += self._ensure_topology()
        except BudgetSpent as exc:
            evaluation.status, evaluation.note = "not-sent", str(exc)
            return evaluation
        assert self.session is not None
        mark = fault_mark(self.planted)
        # Streamed under --stream, as real traffic is: the baseline answers unstreamed (its
        # control too), and the stream's framing is judged beside its ids (`run --stream`).
        sent = streaming_request(evaluation.body) if self.settings.stream else evaluation.body
        candidate = self.session.send(spec.name, sent)
        evaluation.fault = fault_since(self.planted, mark)
        content = request_content(evaluation.body)
        if evaluation.fault == FAULT_ACTED:
            self._fault_acted_on.add(content)
        elif evaluation.fault is not None and content in self._fault_acted_on:
            evaluation.fault = FAULT_ACTED_BEFORE
        self._served(evaluation)
        guards = transfer_guards(self.session.served, candidate)
        record = judge_example(self.judging, self.topology, evaluation.baseline, candidate, guards)
        if is_failure(record):  # the control: does the baseline agree with itself?
            assert self.baseline is not None
            again = self.baseline.send(spec.name, cold_request(evaluation.body))
            control = baseline_stability(evaluation.baseline, again)
            if not control.stable or control.noise_floor:
                record = judge_example(
                    self.judging,
                    self.topology,
                    evaluation.baseline,
                    candidate,
                    guards,
                    baseline_stable=control.stable,
                    drift_tolerance=control.noise_floor or 0.0,
                )
        evaluation.candidate, evaluation.record = candidate, record
        if is_failure(record):
            evaluation.signature = signature_of(record)
            evaluation.recognition = recognise(self.rules, record, spec, evaluation.layout)
        if isinstance(self.session, AttachedSession):
            # Which instance, and after which request: the report's only trace of a crash a
            # shrink trial caused (found on real vLLM: "the attached deployment is down" was
            # all a fuzz said after two images without text took D down).
            down = self.session.first_down()
            if down is not None:
                self._down = f"{down} (since {spec.name}, the last request sent)"
        evaluation.seconds += time.monotonic() - began
        return evaluation

    def _served(self, evaluation: Evaluation) -> None:
        """What the request left in the KV storage and in P's and D's prefix caches."""
        if evaluation.baseline.result is None or evaluation.layout is None:
            return
        # Every instance was up when the request was sent: one down now died on it, and the
        # proxy asked nothing of the roles after it (encoder, then P, then D).
        dead = dead_roles(self.session)
        self.sent[evaluation.spec.name] = evaluation.body
        self.consumer.served(
            sent_prompt(evaluation, evaluation.layout),
            reached_prefill=Role.ENCODER not in dead,
            prefill_alive=Role.PREFILL not in dead,
            consumer_alive=Role.DECODE not in dead,
            decode_reaches_load=not evaluation.layout.decode_dies_of_media,
            name=evaluation.spec.name,
        )

    def too_short(self, evaluation: Evaluation) -> str | None:
        """Why a shrink candidate is not tried: a prompt under the space's minimum."""
        layout = evaluation.layout
        if layout is not None and layout.prompt_tokens < self.min_prompt_tokens:
            return (
                f"not sent: {layout.prompt_tokens} prompt tokens, under the space's "
                f"{self.min_prompt_tokens} (no KV moved)"
            )
        return None

    def evaluate(self, spec: PromptSpec) -> Evaluation:
        evaluation = self.ask_baseline(spec)
        if evaluation.status != "judged":
            return evaluation
        return self.send_topology(evaluation)

    # -- the run -------------------------------------------------------------------------------

    def run(
        self,
        examples: list[FuzzExample],
        report: FuzzReport | None = None,
        on_progress: Callable[[FuzzReport], None] | None = None,
    ) -> FuzzReport:
        """Every example, then every group shrunk; `on_progress` gets the report after the
        examples and after each group (the CLI writes the bundle there, so an interrupted run
        keeps what it had). Cheap groups shrink first (`shrink_order`), and the minimal
        requests of known crashes, shrunk against their triggers without a send, are sent
        last: each kills D, and the last one costs no revival."""
        report = report if report is not None else FuzzReport(examples=list(examples))
        began = time.monotonic()
        try:
            self._send_examples(examples, report)
        except BaseException:
            # Interrupted (Ctrl-C, a topology that could not be started again): what was
            # judged so far is written before the interruption goes on.
            report.examples_seconds = time.monotonic() - began
            report.groups = group_failures(report.evaluations)
            self._progress(report, on_progress)
            raise
        report.examples_seconds = time.monotonic() - began
        report.groups = group_failures(report.evaluations)
        self._progress(report, on_progress)
        began = time.monotonic()
        unconfirmed: list[FailureGroup] = []
        for group in sorted(report.groups, key=shrink_order):
            if self.time_left() <= 0:
                group.note = "not shrunk: the run's time budget is spent"
                continue
            if not shrink_group(self, group):
                unconfirmed.append(group)
            report.shrink_seconds = time.monotonic() - began
            self._progress(report, on_progress)
        for group in unconfirmed:
            if self.time_left() <= 0:
                group.note = "minimal request predicted, not sent: the run's time budget is spent"
                continue
            confirm_predicted(self, group)
            report.shrink_seconds = time.monotonic() - began
            self._progress(report, on_progress)
        return report

    def _send_examples(self, examples: list[FuzzExample], report: FuzzReport) -> None:
        """Each example to the baseline, then (unless predicted or out of budget) to the
        topology, judged; its evaluation appended to `report` at once."""
        for index, example in enumerate(examples):
            if self.time_left() <= 0:
                evaluation = Evaluation(example.spec, {}, Outcome(prompt=example.name), "not-sent")
                evaluation.note = f"the run's time budget ({self.run_budget.max_seconds:.0f} s)"
                report.evaluations.append(evaluation)
                continue
            evaluation = self.ask_baseline(example.spec)
            if evaluation.status == "judged":
                rule = self.predictions.predicted_crash(evaluation)
                if rule is not None:
                    evaluation.status = "known-predicted"
                    evaluation.note = f"{rule.name}: {rule.trigger_text} (not sent)"
                else:
                    self.send_topology(evaluation)
                    self.predictions.check(evaluation)
            if not evaluation.failed:
                evaluation.body = {}  # only failing bodies are kept for the bundle
            report.evaluations.append(evaluation)
            log.info(
                "[fuzz] %d/%d %s %s: %s (%.2fs)",
                index + 1,
                len(examples),
                example.name,
                describe(example.spec, evaluation.layout, self.block_aligned_kv),
                evaluation.summary(),
                evaluation.seconds,
            )

    def _progress(
        self, report: FuzzReport, on_progress: Callable[[FuzzReport], None] | None
    ) -> None:
        report.restarts = list(self.report_restarts)
        report.predictions = self.predictions.summary()
        if on_progress is not None:
            on_progress(report)

    def time_left(self) -> float:
        return self.run_budget.max_seconds - (time.monotonic() - self.began)


def _base(session: object) -> object:
    """The running topology behind a session (a proxied view shares its base's instances)."""
    return session.base if isinstance(session, ProxiedSession) else session


def sent_prompt(evaluation: Evaluation, layout: PromptLayout) -> SentPrompt:
    """The request as the storage model follows it: the baseline's prompt ids (the
    topology's are the same), its media, and the salt the topology gets it under."""
    assert evaluation.baseline.result is not None
    return SentPrompt(
        tuple(evaluation.baseline.result.prompt_token_ids),
        media_identities(evaluation.spec),
        layout.run_starts,
        evaluation.body.get(CACHE_SALT),
    )


def dead_roles(session: object) -> set[Role]:
    """The roles of a started topology's instances that are not running (an attached
    deployment's are unknown: none)."""
    base = _base(session)
    return base.dead_roles() if isinstance(base, TopologySession) else set()


def describe(spec: PromptSpec, layout: PromptLayout | None, kv: bool = True) -> str:
    """'2 img 1 vid, 143 tok, ends -1 from a block, in D's tail'; D's tail only where `kv`
    (`block_aligned_kv`): on 1E+1PD no D recomputes a tail, and under NIXL D gets the whole
    prompt's KV; saying so misled."""
    images = sum(isinstance(p, ImagePart) for p in spec.parts)
    media = sum(isinstance(p, MEDIA_PARTS) for p in spec.parts)
    text = f"{images} img {media - images} vid"
    if layout is not None:
        text += f", {layout.prompt_tokens} tok"
        if layout.boundary_offset is not None:
            text += f", ends {layout.boundary_offset:+d} from a block"
            text += ", in D's tail" if kv and layout.media_in_decode_tail else ""
    return text
