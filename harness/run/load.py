"""A load: many requests at once over a mix of prompts, every answer judged against the
baseline's answer to its own prompt.

The baseline answers each prompt of the mix once, alone (cached like every baseline answer),
and then, when requests go out more than one at a time, the same requests once more at the
load's concurrency: whether batching changes the baseline's own answers on this platform is
measured there, and the log-prob noise it shows is the tolerance the drift rule gives batched
answers (`harness.judge.policy`: a batched answer may DRIFT within that floor, so where it is
0 every comparison stays exact). A calibration depends on the requests and the concurrency
only, not on the topology: measured once per baseline, it is every later load's of the same
(`BaselineAnswers.known_calibration`), and a pytest session measures its loads' while its
baseline serves (`calibrate_ahead`); the load's account says which. Then the topology serves
the plan (`harness.spec.load`), at most `concurrency` requests in flight; each answer is
observed (its transfer guards read at once) and judged on the run's one judging path, with
the answers of the other prompts, so an answer that belongs to another request is named
("request 17 received request 4's answer").

What the load does when an instance dies: a prompt declared to end an instance on this
topology (media in the part D recomputes, under ExampleConnector) is sent after all others,
alone, and judged as declared. Any other death ends the load: every request in flight ends
ERROR with the instance's name first (the session waits for a dying engine), requests not yet
sent are recorded as not sent with the same cause, and no further round starts. `kill` plants
such a death on purpose, once every request of the round is in flight.

A soak (`duration_s`) repeats rounds of the plan until the time is up; between rounds, with
nothing in flight, it samples every instance's RSS and open files and the connectors' storage,
then cleans the KV storage (ExampleConnector keys files by prompt and writes them again when
they are missing). The EC storage is not cleaned: an encoder that still holds an item's
embeddings in memory does not encode it again, so it does not write the file again either
(vLLM 0.32 `Scheduler._try_schedule_encoder_inputs` asks its encoder cache before the
connector). Measured: after the EC storage of a served image was emptied, the same image was
answered right (the consumer held the embeddings too) with no file written, so the
`encoder_output` guard had nothing to hold and the case was VACUOUS. With a fixed mix the EC
storage holds one file per item and does not grow.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.files import append_json_lines, write_json_atomic, write_text_atomic
from harness.judge.guards import GuardResult, check_kv_account, kv_rule_for
from harness.judge.records import CaseRecord, DeclaredFailure, Verdict
from harness.outcomes.load import ResourceSample
from harness.outcomes.outcome import Outcome
from harness.report.load import (
    FAILURES_KEPT_WHOLE,
    KV_ACCOUNTS_FILE,
    REQUESTS_FILE,
    KvAccountLog,
    LoadRequestResult,
    LoadStats,
    LoadTally,
    RequestRow,
    format_load,
    kv_account_line,
    load_stats,
    stats_json,
)
from harness.report.resources import (
    SAMPLES_FILE,
    ResourceHistory,
    SoakBounds,
    bound_problems,
    sample_line,
)
from harness.run.baseline import BaselineAnswers, BatchCalibration
from harness.run.faults.instance import kill_instance
from harness.run.judging import Observed, observe
from harness.run.scenarios import get_scenario
from harness.run.sweep import BASELINE, Sweep
from harness.serve.attached import AttachedDown, AttachedSession
from harness.serve.kv_metrics import KvCounters
from harness.serve.session import ProxiedSession, TopologySession
from harness.serve.usage import clean_storage, storage_usage, tree_pids, tree_usage
from harness.spec.connectors import KvRule
from harness.spec.load import (
    LoadSpec,
    MediaPlacement,
    PlannedRequest,
    Region,
    load_mix,
    media_placement,
    plan_requests,
)
from harness.spec.topology import TOPOLOGIES, Role, ServingConfig, Topology

DECODE_TAIL_SCENARIO = "epd-media-in-decode-tail"
KILL_WAIT_S = 300.0  # how long a planted kill waits for every request to be in flight
log = logging.getLogger(__name__)

Session = TopologySession | ProxiedSession | AttachedSession


@dataclass
class LoadResult:
    """Everything a load did, judged. Every request judged is counted in `tally` (the
    statistics are over all of them) and is a line of load-requests.jsonl; `results` holds whole
    (answer, log-probs, record) only those worth reading whole (`LoadResult.add`): a soak of
    hours that kept every answer grew by ~48 KB a request. Likewise every resource sample is a
    line of load-samples.jsonl and every KV account one of load-kv-accounts.jsonl, and
    `resources` and `kv` hold what the figures and the bounds read of them."""

    spec: LoadSpec
    results: list[LoadRequestResult] = field(default_factory=list)  # those kept whole, in order
    tally: LoadTally = field(default_factory=LoadTally)  # every request judged
    resources: ResourceHistory = field(default_factory=ResourceHistory)  # every sample
    placements: dict[str, MediaPlacement] = field(default_factory=dict)
    calibration: BatchCalibration | None = None
    calibration_source: str | None = None  # measured now, or earlier in the session for what
    rounds: int = 0
    ended_by: str | None = None  # the death that ended the load early (its first line)
    killed: str | None = None  # the instance a planted kill ended
    killed_at_s: float | None = None
    problems: list[str] = field(default_factory=list)  # bounds a soak broke, a kill not seen
    kv: KvAccountLog = field(default_factory=KvAccountLog)  # one account a round (NIXL's rule)
    processes: list[int] = field(default_factory=list)  # every instance's process tree, at start
    stats: LoadStats | None = None
    # Requests that did not pass and were not kept whole, by (prompt, verdict): beyond the
    # first FAILURES_KEPT_WHOLE of each.
    failed_unlisted: Counter[tuple[str, str]] = field(default_factory=Counter)
    failed_kept: Counter[tuple[str, str]] = field(default_factory=Counter)  # kept whole

    @property
    def records(self) -> list[CaseRecord]:
        """The records of the requests kept whole."""
        return [r.record for r in self.results]

    @property
    def kv_accounts(self) -> list[GuardResult]:
        """The KV accounts kept whole: the first round's, and the first that failed."""
        return [account for _, account in self.kv.kept]

    @property
    def unlisted(self) -> int:
        """Requests judged and counted but not kept whole: those that passed after the first
        round, and the failures beyond the first of their prompt and verdict."""
        return self.tally.requests - len(self.results)

    @property
    def passed(self) -> bool:
        """Every request passed its policy (or, under a planted kill, ended ERROR naming the
        killed instance), nothing ended the load unplanned, every bound held."""
        if self.problems or not self.tally.requests:
            return False
        if self.killed is not None:
            return True  # checked into `problems` by the load itself
        return self.ended_by is None and self.tally.passed == self.tally.requests

    def add(
        self, results: list[LoadRequestResult]
    ) -> tuple[list[RequestRow], list[LoadRequestResult]]:
        """Count a round's judged requests; every one's row, and those kept whole. Kept whole:
        every request of a load's first round (a plain load has only that one, bounded by
        --requests; a soak's shows what every later round repeated) and, after it, the first
        FAILURES_KEPT_WHOLE requests of each prompt and verdict that did not pass (counted
        over the whole load). The others are their row: a broken build soaked for hours fails
        every request."""
        rows, kept = [], []
        for result in results:
            row = result.row()
            self.tally.add(row)
            rows.append(row)
            failing = not result.record.policy_passed
            key = (result.prompt, result.record.verdict.value)
            whole = result.round_number <= 1 or (
                failing and self.failed_kept[key] < FAILURES_KEPT_WHOLE
            )
            if whole:
                self.results.append(result)
                kept.append(result)
                self.failed_kept[key] += failing
            elif failing:
                self.failed_unlisted[key] += 1
        return rows, kept


def media_token_ids(model: str) -> frozenset[int]:
    """The placeholder ids media expand to, from the model's config (Qwen2/2.5-VL:
    `image_token_id`, `video_token_id`); empty when the model is not a local directory."""
    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return frozenset()
    found = set()
    for source in (config, config.get("text_config") or {}):
        for key in ("image_token_id", "video_token_id"):
            if isinstance(source.get(key), int):
                found.add(source[key])
    return frozenset(found)


def decode_tail_failure(topology: Topology, kv_connector: str) -> DeclaredFailure | None:
    """The failure a request whose media end in D's recomputed tail is declared to have on
    `topology` under `kv_connector`: the matrix's declaration, the one place it is made."""
    if not topology.has_kv_transfer:
        return None
    return get_scenario(DECODE_TAIL_SCENARIO).for_kv_connector(kv_connector).declared


@dataclass(frozen=True)
class LoadPlan:
    """What a load sends, decided from the baseline's answers before anything is sent: where
    each prompt's media end, the failure each is declared to have on the topology, the
    requests (those declared to end an instance last, alone) and why a prompt was left out."""

    placements: dict[str, MediaPlacement]
    declared: dict[str, DeclaredFailure | None]
    requests: tuple[PlannedRequest, ...]
    notes: tuple[str, ...]

    @property
    def regular(self) -> list[PlannedRequest]:
        """The requests of a round (what the baseline's calibration sends too)."""
        return [r for r in self.requests if not r.alone]


def plan_load(
    spec: LoadSpec, prompts: Sequence[str], baseline: BaselineAnswers, serving: ServingConfig
) -> LoadPlan:
    """The plan of `spec` over `prompts` (each answered by `baseline`), under `serving`'s
    model, block size and KV connector: the one place a load's requests are decided, so a
    calibration computed ahead of a load (`calibrate_ahead`) is of the requests it sends."""
    topology = TOPOLOGIES[spec.topology]
    media_ids = media_token_ids(serving.model)
    placements = {}
    for prompt in prompts:
        answer = baseline.outcomes[prompt].result
        if answer is not None and media_ids:
            placements[prompt] = media_placement(
                answer.prompt_token_ids, media_ids, serving.block_size
            )
    declared = {
        prompt: decode_tail_failure(topology, serving.kv_connector)
        if prompt in placements and placements[prompt].region is Region.DECODE_TAIL
        else None
        for prompt in prompts
    }
    ending = {p for p, d in declared.items() if d is not None and d.verdict == "ERROR"}
    sent = list(prompts)
    notes = []
    left_out = spec.duration_s is not None or spec.kill is not None
    too_few = spec.requests < len(ending) + 1
    if ending and (left_out or too_few or not spec.ending):
        # A soak measures resources over time and a planted death its own cause: a request
        # that ends D by a declared failure would cut either short. Too few requests to send
        # it last as well as one of the others: the others come first.
        sent = [p for p in sent if p not in ending]
        why = (
            f"{spec.requests} request(s) leave no room for it"
            if too_few and not left_out
            else "a plain load sends it last"
        )
        notes.append(
            f"not in this load: {', '.join(sorted(ending))} (declared to end an instance "
            f"on {topology.name}; {why})"
        )
        ending = set()
    requests = plan_requests(sent, spec.requests, frozenset(ending))
    return LoadPlan(placements, declared, tuple(requests), tuple(notes))


def calibrate_ahead(
    specs: Sequence[LoadSpec],
    baseline: BaselineAnswers,
    serving: ServingConfig,
    session: TopologySession,
    say: Callable[[str], None] = log.info,
) -> int:
    """The batch calibration each load of `specs` will need, measured now on the running
    baseline `session` unless one of the same requests at the same concurrency is known
    already; how many were measured. A calibration is the baseline's own behaviour under a
    load's traffic, whatever topology the load then serves: a pytest session computes its
    loads' calibrations while the baseline serves, before it stops. Where every device the
    baseline could take is a topology's (2 GPUs, 1), each load served it again for its own,
    stopping its topology and starting it again after. A load's prompts are its mix
    (`load_mix(spec.distinct_media)`), as its sweep's; one whose prompts the baseline has not
    answered is left to measure its own."""
    measured = 0
    for spec in specs:
        if spec.concurrency <= 1:
            continue
        prompts = [p.name for p in load_mix(spec.distinct_media) if p.name in baseline.bodies]
        if not prompts or any(p not in baseline.outcomes for p in prompts):
            continue
        regular = plan_load(spec, prompts, baseline, serving).regular
        requests = [(r.name, r.prompt) for r in regular]
        if baseline.known_calibration(requests, spec.concurrency) is not None:
            continue
        say(
            f"[load] ahead of a load on {spec.topology}: the baseline answers its "
            f"{len(requests)} requests at concurrency {spec.concurrency} before it stops"
        )
        baseline.calibrate_batched(
            session,
            requests,
            spec.concurrency,
            "ahead of the loads to come, while the baseline served before it stopped",
        )
        measured += 1
    return measured


class LoadRun:
    """One load on a sweep's baseline and pool (its judging path and its artifacts)."""

    def __init__(
        self,
        spec: LoadSpec,
        sweep: Sweep,
        bounds: SoakBounds | None = None,
        on_progress: Callable[[str], None] | None = None,
        keep_baseline: bool = False,
        on_session: Callable[[Session], None] | None = None,
    ):
        """`keep_baseline`: leave the baseline running after its calibration (a pytest
        session's other scenarios use it); else it is stopped to make room. Never where
        workers share devices: there it is stopped all the same (`workers_share_devices`).
        `on_session`: called with the topology's session the load's requests go to, before
        the first (a test plants a fault there). A session opened before the load may not be
        that one: where the baseline's device is one of the topology's (2 GPUs, or 1), a
        calibration measured by the load itself (none was computed ahead of it) stops the
        topology, and the load starts it again."""
        self.spec = spec
        self.sweep = sweep
        self.topology = TOPOLOGIES[spec.topology]
        self.bounds = bounds or SoakBounds()
        self.say = on_progress or log.info
        self.keep_baseline = keep_baseline
        self.on_session = on_session
        self.result = LoadResult(spec)
        self.prompts = [name for name in sweep.specs if name in sweep.baseline.bodies]
        self.notes: list[str] = []
        self._started = 0.0
        self._attached: AttachedSession | None = None

    # -- the whole load ------------------------------------------------------------------------

    def run(self) -> LoadResult:
        """Baseline (and its batch calibration), then the topology's rounds, then the requests
        that must go alone; the account is rewritten as it grows."""
        for appended in (REQUESTS_FILE, SAMPLES_FILE, KV_ACCOUNTS_FILE):
            (self.sweep.settings.run_dir / appended).unlink(missing_ok=True)  # an earlier load's
        self.sweep.serve_baseline()
        planned = plan_load(
            self.spec, self.prompts, self.sweep.baseline, self.sweep.settings.serving
        )
        self.result.placements = dict(planned.placements)
        self.notes += planned.notes
        declared = planned.declared
        plan = list(planned.requests)
        regular = planned.regular
        if self.spec.concurrency > 1:
            self._calibrate(regular)
        try:
            session = self._open()
        except AttachedDown as exc:  # a deployment not serving: nothing is sent
            self.result.ended_by = str(exc).splitlines()[0]
            self._judge_round([_Sent(r, None, 0.0, 0.0) for r in plan], declared)
            self._finish()
            return self.result
        if self.on_session is not None:
            self.on_session(session)
        self._started = time.monotonic()
        self._sample(session, "before")
        try:
            self._rounds(session, regular, declared)
            alone = [r for r in plan if r.alone]
            if alone:
                self._send_alone(alone, declared)
        finally:
            self._finish()
        return self.result

    def _region(self, prompt: str) -> str:
        placement = self.result.placements.get(prompt)
        return placement.region.value if placement else "unknown"

    def _calibrate(self, regular: list[PlannedRequest]) -> None:
        """The baseline under the same traffic: batch numerics measured, not assumed. Measured
        once per (requests, concurrency) on a baseline: a calibration measured earlier (for
        another load of the same requests, or ahead of this one while the baseline served:
        `calibrate_ahead`) is this load's too, and the baseline is not served again for it."""
        requests = [(r.name, r.prompt) for r in regular]
        concurrency = self.spec.concurrency
        known = self.sweep.baseline.known_calibration(requests, concurrency)
        if known is not None:
            self.result.calibration = known
            self.result.calibration_source = (
                f"measured earlier in this session {known.measured_for} (the same "
                f"{len(requests)} requests at concurrency {concurrency}), not again"
            )
            self.say(f"[load] the baseline's batch numerics: {self.result.calibration_source}")
            return
        baseline = self.sweep.pool.session(BASELINE)
        assert isinstance(baseline, TopologySession)
        self.say(
            f"[load] the baseline answers the {len(regular)} requests at concurrency "
            f"{concurrency}: does batching change its answers?"
        )
        self.result.calibration = self.sweep.baseline.calibrate_batched(
            baseline, requests, concurrency, f"for a load on {self.topology.name}"
        )
        self.result.calibration_source = "measured now, for this load"
        # Kept up, the baseline would hold its device for this worker's whole session, and
        # every other worker's calibration would wait for it (found in review: the 8-GPU
        # night's loads run one after another).
        if not self.keep_baseline or self.sweep.settings.workers_share_devices:
            self.sweep.pool.release(BASELINE.name)

    def _open(self) -> Session:
        """The topology's running session (started again if an instance of it died), or the
        attached deployment."""
        attached = self.sweep.attached
        if attached is not None:
            if self._attached is None:
                self._attached = AttachedSession(attached, self.sweep.settings)
                self._attached.open()
            return self._attached
        return self.sweep.pool.session(self.topology, self.sweep.settings)

    # -- rounds ------------------------------------------------------------------------------

    def _rounds(
        self,
        session: Session,
        regular: list[PlannedRequest],
        declared: dict[str, DeclaredFailure | None],
    ) -> None:
        deadline = None
        if self.spec.duration_s is not None:
            deadline = self._started + self.spec.duration_s
        while True:
            offset = self.result.rounds * len(regular)
            self.result.rounds += 1
            planned = [PlannedRequest(r.number + offset, r.prompt) for r in regular]
            counters_before = session.decode_counters() if self._kv_accounted else None
            sent = self._round(session, planned)
            if self._kv_accounted:
                self._account_kv(sent, counters_before, session.decode_counters())
            self._judge_round(sent, declared)
            label = f"round {self.result.rounds}" if deadline is not None else "after"
            if not (self.result.ended_by or self.result.killed):
                self._notice_a_quiet_death(session)
            stop = self.result.ended_by or self.result.killed
            last = bool(stop) or deadline is None or time.monotonic() >= deadline
            self._sample(session, label, clean_kv=not last)
            if last:
                return
            self.say(
                f"[load] round {self.result.rounds} done at "
                f"{time.monotonic() - self._started:.0f}s of {self.spec.duration_s:.0f}s"
            )

    def _notice_a_quiet_death(self, session: Session) -> None:
        """An instance that died with every request of the round answered (P crashing as it
        frees the KV it sent, say) ends the load as a death during a request does: deaths
        are otherwise noticed through a request that failed."""
        died = _dead_instance(session)
        if died is None:
            return
        self.result.ended_by = died.splitlines()[0]
        self.result.problems.append(
            f"round {self.result.rounds}: every request was answered, then {self.result.ended_by}"
        )
        self.say(f"[load] {died}")

    def _round(self, session: Session, planned: list[PlannedRequest]) -> list[_Sent]:
        """Every planned request, at most `concurrency` in flight; after a death, nothing
        more is sent."""
        stop = threading.Event()
        flight = _InFlight()
        killing = self.spec.kill is not None and self.result.rounds == 1
        target = min(self.spec.concurrency, len(planned))
        together = _Together(target if killing else 0, KILL_WAIT_S)

        def one(request: PlannedRequest) -> _Sent:
            if stop.is_set():
                return _Sent(request, None, 0.0, 0.0)
            body = self.sweep.bodies[request.prompt]
            flight.begin(self._now())
            try:
                together.wait()
                started = self._now()
                observed = observe(
                    session, request.prompt, body, stream=self.spec.stream, fresh_prefix=False
                )
            finally:
                ended = flight.end(self._now())
            if observed.outcome.error and not stop.is_set():
                dead = _dead_instance(session)
                if dead is not None:
                    stop.set()
                    if self.result.killed is None:
                        self.result.ended_by = dead.splitlines()[0]
            return _Sent(request, observed, started, ended)

        killer = None
        taps, mark = None, 0  # the taps and their mark a planted kill watches the round by
        round_over = threading.Event()
        if killing:
            base = session.base if isinstance(session, ProxiedSession) else session
            taps = base.taps if isinstance(base, TopologySession) else None
            # Before any request goes out: what the taps recorded from here on is the round's.
            mark = taps.mark() if taps is not None else 0
            killer = threading.Thread(
                target=self._kill_or_say_why,
                args=(lambda: self._kill_when_in_flight(base, flight, target, round_over, mark),),
                daemon=True,
            )
            killer.start()
        self.say(
            f"[load] {self.topology.name}: {len(planned)} request(s), "
            f"{self.spec.concurrency} at a time{', streamed' if self.spec.stream else ''}"
        )
        with ThreadPoolExecutor(max_workers=self.spec.concurrency) as pool:
            sent = list(pool.map(one, planned))
        if killer is not None:
            # Whole, so the kill either happened or was given up before the round is judged
            # (a waiting killer gives up as soon as the round is over).
            round_over.set()
            killer.join()
            if taps is not None:
                taps.release(mark)
        return sent

    def _kill_or_say_why(self, kill: Callable[[], None]) -> None:
        """The killer thread: what stops it from killing is a problem of the load, not a
        traceback on stderr and a load that passes."""
        try:
            kill()
        except Exception as exc:  # noqa: BLE001 - said as the load's problem
            self.result.problems.append(f"the planted kill failed: {type(exc).__name__}: {exc}")

    def _kill_when_in_flight(
        self,
        base: Session,
        flight: _InFlight,
        target: int,
        round_over: threading.Event,
        mark: int,
    ) -> None:
        """SIGKILL the instance of the spec's role once `target` requests are in flight and
        one of them has reached it, before it has answered any: its tap recorded a call of
        this round (after `mark`; a call of an earlier load on the same topology is no
        request in flight) and has relayed no answer of the round whole. An instance that
        answered a request first cannot be killed with every request in flight any more (the
        fake vLLM's D, which answers at once, did so on some runs, and that request passed).
        A kill that never came (that, the round ended first, or the wait ran out) is a
        problem of the load: its death under load was not tested, however well every answer
        held."""
        assert self.spec.kill is not None
        assert isinstance(base, TopologySession), "a planted kill needs a launched topology"
        server = base.server(Role(self.spec.kill))
        deadline = time.monotonic() + KILL_WAIT_S
        while time.monotonic() < deadline and not round_over.is_set():
            calls = base.taps.since(mark) if base.taps is not None else []
            at_server = [r for r in calls if r.instance == server.name]
            answered = next((r for r in at_server if r.ended), None)
            if answered is not None:
                self.result.problems.append(
                    f"the planted kill never happened: {server.name} answered a request of "
                    f"the round (id {answered.request_id}) before {target} request(s) were in "
                    "flight with one at it: its moment passed"
                )
                return
            if flight.current >= target and at_server:
                break
            time.sleep(0.05)
        else:
            when = "before the round ended" if round_over.is_set() else f"in {KILL_WAIT_S:g} s"
            self.result.problems.append(
                f"the planted kill never happened: it found no moment with {target} request(s) "
                f"in flight and one at {server.name} {when}"
            )
            return
        self.result.killed_at_s = self._now()
        self.result.killed = server.name
        self.sweep.run_info["killed"] = server.name  # run.json, verdicts.txt: red on purpose
        kill_instance(server)
        self.say(f"[load] killed {server.name} with {flight.current} request(s) in flight")

    def _send_alone(
        self, alone: list[PlannedRequest], declared: dict[str, DeclaredFailure | None]
    ) -> None:
        """The requests declared to end an instance, one at a time after all others (the
        topology started again before each one that finds an instance dead)."""
        for request in alone:
            if self.result.ended_by is not None:
                sent = _Sent(request, None, 0.0, 0.0)
            else:
                session = self._open()
                body = self.sweep.bodies[request.prompt]
                self.say(
                    f"[load] {request.name} ({request.prompt}) alone, last: its media end in "
                    f"the part D recomputes ({self._region(request.prompt)})"
                )
                started = self._now()
                observed = observe(
                    session, request.prompt, body, stream=self.spec.stream, fresh_prefix=False
                )
                sent = _Sent(request, observed, started, self._now())
            self._judge_round([sent], declared, alone=True)

    # -- judging -----------------------------------------------------------------------------

    @property
    def _kv_accounted(self) -> bool:
        """Whether a round's KV is accounted as a whole: only where D's evidence is a counter
        shared by every request in flight (NIXL's whole-prompt rule). ExampleConnector's
        evidence is each request's own `cached_tokens`, read at D's tap."""
        rule = kv_rule_for(self.sweep.settings.serving.kv_connector)
        return self.topology.has_kv_transfer and rule is KvRule.WHOLE_PROMPT

    def _account_kv(
        self, sent: list[_Sent], before: KvCounters | None, after: KvCounters | None
    ) -> None:
        """The round's requests against D's counters over the whole round
        (`harness.judge.guards.check_kv_account`); a shortfall fails the load. A round a death
        ended is not accounted: its requests' transfers stopped part way."""
        if self.result.ended_by or self.result.killed:
            return
        prompts = {
            item.request.name: len(item.observed.outcome.result.prompt_token_ids)
            for item in sent
            if item.observed is not None and item.observed.outcome.result is not None
        }
        if not prompts:
            return
        counters = None if before is None or after is None else after.minus(before)
        block = self.sweep.settings.serving.block_size
        account = check_kv_account(prompts, counters, KvRule.WHOLE_PROMPT, block)
        kept = self.result.kv.add(self.result.rounds, account)
        append_json_lines(self._kv_accounts_file, [kv_account_line(self.result.rounds, account)])
        if account.failed and kept:  # the others are counted (`_finish` says how many)
            self.result.problems.append(
                f"round {self.result.rounds}, KV account: {account.evidence}"
            )

    def _judge_round(
        self,
        sent: list[_Sent],
        declared: dict[str, DeclaredFailure | None],
        alone: bool = False,
    ) -> None:
        """Each request against the baseline's answer to its own prompt, with the answers of
        the other prompts named by a request that carried them."""
        baseline = self.sweep.baseline
        results: list[LoadRequestResult] = []
        for item in sent:
            request = item.request
            observed = item.observed
            if observed is None:
                cause = self.result.ended_by or self.result.killed or "the load ended"
                observed = Observed(Outcome(prompt=request.prompt, error=f"not sent: {cause}"), ())
            batched = not alone and any(
                other is not item and other.observed is not None and item.overlaps(other)
                for other in sent
            )
            others = [
                (_carrier(sent, item, prompt), baseline.outcomes[prompt])
                for prompt in self.prompts
                if prompt != request.prompt and baseline.outcomes[prompt].result is not None
            ]
            [record] = self.sweep.judging.judge(
                self.topology,
                observed,
                label=f"{self.topology.name}:load#{request.number}",
                spec=self.sweep.specs.get(request.prompt),
                declared=None if self.result.killed else declared.get(request.prompt),
                batched=batched,
                others=others,
            )
            results.append(
                LoadRequestResult(
                    number=request.number,
                    prompt=request.prompt,
                    region=self._region(request.prompt),
                    outcome=observed.outcome,
                    record=record,
                    batched=batched,
                    started_s=item.started_s,
                    ended_s=item.ended_s,
                    not_sent=item.observed is None,
                    round_number=max(self.result.rounds, 1),
                )
            )
        rows, kept = self.result.add(results)
        append_json_lines(self._requests_file, [row.to_json() for row in rows])
        # The run's bundle (responses.json, report.html) holds the requests the load keeps
        # whole (`LoadResult.add`: a soak's first round, the first failures of each prompt and
        # verdict), or a long soak's bundle would be rewritten whole at tens of MB per round.
        for result in kept:
            label = f"load:{self.topology.name}:{result.number}"
            self.sweep.result.outcomes[label] = {result.prompt: result.outcome}
            self.sweep.result.records.append(result.record)
        if kept or self.result.rounds <= 1:
            self.sweep.write_outputs()
        self._write_account()

    # -- resources ---------------------------------------------------------------------------

    def _sample(self, session: Session, label: str, clean_kv: bool = False) -> None:
        """Every instance's RSS and open files and the connectors' storage, then (`clean_kv`:
        between a soak's rounds) the KV storage cleaned; counted into the load's resource
        history and appended to load-samples.jsonl."""
        base = session.base if isinstance(session, ProxiedSession) else session
        sample = ResourceSample(
            at_s=round(self._now(), 2),
            requests_done=self.result.tally.sent,
            label=label,
        )
        if isinstance(base, TopologySession):
            for server in base.servers:
                sample.instances[server.name] = tree_usage(server.pid)
                if label == "before":
                    self.result.processes += tree_pids(server.pid)
        for kind in ("ec", "kv"):
            storage = _storage_of(session, kind)
            if storage is not None:
                sample.storage[kind] = storage_usage(storage)
        kv = _storage_of(session, "kv")
        if clean_kv and kv is not None:
            sample.cleaned["kv"] = clean_storage(kv)
        number = self.result.resources.add(sample)
        append_json_lines(self._samples_file, [sample_line(number, sample)])

    # -- the account ---------------------------------------------------------------------------

    def _finish(self) -> None:
        result = self.result
        if result.killed is not None:
            result.problems += self._kill_problems()
        if result.kv.failed_unlisted:
            result.problems.append(
                f"KV account: {result.kv.failed_unlisted} more round(s) failed than the "
                f"{FAILURES_KEPT_WHOLE} above, each a line of {KV_ACCOUNTS_FILE}"
            )
        if self.spec.duration_s is not None:
            result.problems += bound_problems(result.resources, self.bounds)
        self._write_account()
        if self._attached is not None:
            self._attached.close()

    def _kill_problems(self) -> list[str]:
        """Under a planted kill: every request in flight ended ERROR naming the killed
        instance first, each within KILL_END_S of the kill. A kill is planted in a load's one
        round (never in a soak), all of whose requests are kept whole."""
        assert self.result.killed is not None and self.result.killed_at_s is not None
        problems = []
        for result in self.result.results:
            first = (result.outcome.error or "").strip().splitlines()[:1]
            if result.record.verdict is not Verdict.ERROR:
                problems.append(
                    f"request {result.number}: {result.record.verdict.value}, not ERROR"
                )
            elif not first or self.result.killed not in first[0]:
                problems.append(
                    f"request {result.number}: ERROR without {self.result.killed} first: "
                    f"{first[0] if first else '(no error)'}"
                )
            elif not result.not_sent and result.ended_s - self.result.killed_at_s > KILL_END_S:
                problems.append(
                    f"request {result.number} ended {result.ended_s - self.result.killed_at_s:.1f}s "
                    f"after the kill (bound {KILL_END_S:g}s)"
                )
        return problems

    def account_notes(self) -> list[str]:
        result = self.result
        notes = list(self.notes)
        if result.calibration is not None:
            notes.append(
                f"batch numerics: {result.calibration.describe()}; {result.calibration_source}"
            )
        if result.killed is not None and result.killed_at_s is not None:
            ends = [r.ended_s - result.killed_at_s for r in result.results if not r.not_sent]
            held = "" if result.problems else "; every request ended ERROR naming it, as it must"
            notes.append(
                f"killed {result.killed} at {result.killed_at_s:.1f}s (planted); the last "
                f"request in flight ended {max(ends, default=0.0):.2f}s later{held}"
            )
        if result.ended_by is not None:
            notes.append(f"the load ended early: {result.ended_by}")
        if result.kv.rounds:
            notes.append(result.kv.describe())
        if self.spec.duration_s is not None:
            b = self.bounds
            notes.append(
                f"soak of {self.spec.duration_s:.0f}s, {result.rounds} round(s); bounds: storage "
                f"<= {b.storage_bytes / 2**20:.0f} MiB each, RSS growth <= "
                f"{b.rss_growth_bytes / 2**20:.0f} MiB and open files growth <= {b.fd_growth} "
                "per instance after the first round"
            )
        notes += [f"problem: {p}" for p in result.problems]
        return notes

    @property
    def _requests_file(self) -> Path:
        return self.sweep.settings.run_dir / REQUESTS_FILE

    @property
    def _samples_file(self) -> Path:
        return self.sweep.settings.run_dir / SAMPLES_FILE

    @property
    def _kv_accounts_file(self) -> Path:
        return self.sweep.settings.run_dir / KV_ACCOUNTS_FILE

    def _write_account(self) -> None:
        """load.md and load.json, rewritten whole: the figures over every request judged and
        every sample, and what is kept whole (`LoadResult`). Every request's row, sample and
        KV account is a line of its .jsonl file, appended as it is taken."""
        result = self.result
        result.stats = load_stats(result.tally, result.resources)
        run_dir = self.sweep.settings.run_dir
        title = (
            f"Load on {self.topology.name}: {self.spec.requests} request(s) per round, "
            f"concurrency {self.spec.concurrency}{', streamed' if self.spec.stream else ''}"
        )
        rows = [r.row() for r in result.results]
        write_text_atomic(
            run_dir / "load.md",
            format_load(
                title,
                result.stats,
                rows,
                result.resources,
                self.account_notes(),
                result.unlisted,
                result.failed_unlisted,
            ),
        )
        write_json_atomic(run_dir / "load.json", self.account_json())

    def account_json(self) -> dict[str, Any]:
        result = self.result
        assert result.stats is not None
        return {
            "spec": {
                "topology": self.spec.topology,
                "requests": self.spec.requests,
                "concurrency": self.spec.concurrency,
                "stream": self.spec.stream,
                "duration_s": self.spec.duration_s,
                "distinct_media": self.spec.distinct_media,
                "kill": self.spec.kill,
                "ending": self.spec.ending,
            },
            "passed": result.passed,
            "stats": stats_json(result.stats),
            "placements": {
                prompt: {**placement.__dict__, "region": placement.region.value}
                for prompt, placement in result.placements.items()
            },
            "calibration": None
            if result.calibration is None
            else {
                "concurrency": result.calibration.concurrency,
                "noise_floor_nats": result.calibration.noise_floor,
                "changed": [a.__dict__ for a in result.calibration.changed],
                "describe": result.calibration.describe(),
                "source": result.calibration_source,
            },
            "rounds": result.rounds,
            "ended_by": result.ended_by,
            "killed": result.killed,
            "killed_at_s": result.killed_at_s,
            "problems": result.problems,
            "kv_accounts": [kv_account_line(n, a) for n, a in result.kv.kept],
            "kv_accounts_counted": result.kv.to_json(),
            "notes": self.account_notes(),
            # The first round's and the first failures of each prompt and verdict: a soak's
            # every request here made each round's rewrite cost the soak so far. Every request
            # judged is a line of load-requests.jsonl, and counted in the stats.
            "requests": [r.to_json() for r in result.results],
            "requests_unlisted": result.unlisted,
            "requests_failed_unlisted": [
                {"prompt": prompt, "verdict": verdict, "requests": n}
                for (prompt, verdict), n in sorted(result.failed_unlisted.items())
            ],
            "requests_file": REQUESTS_FILE,
            # Likewise the samples: those a reader needs whole; every one is a line of
            # load-samples.jsonl, and in the stats and the bounds.
            "samples": result.resources.listed_json(),
            "samples_taken": result.resources.count,
            "samples_file": SAMPLES_FILE,
        }

    def _now(self) -> float:
        return time.monotonic() - self._started


KILL_END_S = 30.0  # a request in flight when its instance is killed must end within this


@dataclass
class _Sent:
    """A planned request and what came of it (observed None: never sent)."""

    request: PlannedRequest
    observed: Observed | None
    started_s: float
    ended_s: float

    def overlaps(self, other: _Sent) -> bool:
        return self.started_s < other.ended_s and other.started_s < self.ended_s


class _InFlight:
    """How many requests are in flight right now (the planted kill waits for all of them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current = 0

    def begin(self, now: float) -> float:
        with self._lock:
            self.current += 1
        return now

    def end(self, now: float) -> float:
        with self._lock:
            self.current -= 1
        return now


class _Together:
    """The first `parties` requests of a round, which a planted kill waits to see all in
    flight, go out together once each has begun. Sent as each thread began, the first reached
    a fast instance (the fake's D, a small model's on a GPU) and was answered before the last
    thread had begun on a busy host, and the kill's moment never came. A request that does
    not come within `timeout_s` lets the others go (the killer then says it found no moment)."""

    def __init__(self, parties: int, timeout_s: float) -> None:
        self._parties = parties
        self._timeout_s = timeout_s
        self._barrier = threading.Barrier(parties) if parties > 1 else None
        self._lock = threading.Lock()
        self._arrived = 0

    def wait(self) -> None:
        if self._barrier is None:
            return
        with self._lock:
            self._arrived += 1
            if self._arrived > self._parties:  # a later request: it goes as it comes
                return
        try:
            self._barrier.wait(self._timeout_s)
        except threading.BrokenBarrierError:
            pass


def _carrier(sent: list[_Sent], item: _Sent, prompt: str) -> str:
    """The name of a request that carried `prompt`: one in flight with `item` if any, else the
    nearest by number, else the prompt itself (a request of the mix that this round lacks)."""
    carriers = [s for s in sent if s.request.prompt == prompt]
    if not carriers:
        return f"prompt {prompt}"
    overlapping = [s for s in carriers if s.observed is not None and item.overlaps(s)]
    pool = overlapping or carriers
    best = min(pool, key=lambda s: abs(s.request.number - item.request.number))
    return best.request.name


def _dead_instance(session: Session) -> str | None:
    if isinstance(session, AttachedSession):
        return session.first_down()
    return session.dead_instance_report()


def _storage_of(session: Session, kind: str) -> Path | None:
    return session.ec_storage if kind == "ec" else session.kv_storage
