"""One load from start to end (`LoadRun`): the baseline and its calibration, the topology's
rounds, the requests that must go alone, every answer judged on the run's one judging path with
the answers of the other prompts, so an answer that belongs to another request is named
("request 17 received request 4's answer"). A soak (`duration_s`) repeats rounds of the plan
until the time is up, sampling between them. The load's clock (`time`) is this module's."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from harness.judge.records import DeclaredFailure
from harness.outcomes.outcome import Outcome
from harness.report.load import (
    FAILURES_KEPT_WHOLE,
    KV_ACCOUNTS_FILE,
    REQUESTS_FILE,
    LoadRequestResult,
)
from harness.report.resources import SAMPLES_FILE, SoakBounds, bound_problems
from harness.run.judging import Observed, observe
from harness.run.load.account import append_request_rows, write_account
from harness.run.load.calibration import calibrate_load
from harness.run.load.death import (
    KILL_WAIT_S,
    PlantedKill,
    declared_death,
    kill_problems,
    notice_a_quiet_death,
    notice_deaths_beside_the_kill,
)
from harness.run.load.kv_account import account_kv, accounts_kv
from harness.run.load.plan import plan_load
from harness.run.load.result import LoadResult
from harness.run.load.samples import sample_resources
from harness.run.load.sending import InFlight, Sent, Together, carrier, send_round
from harness.run.load.sessions import Death, Session
from harness.run.sweep import Sweep
from harness.serve.attached import AttachedDown, AttachedSession
from harness.spec.load import LoadSpec, PlannedRequest
from harness.spec.topology import TOPOLOGIES

log = logging.getLogger(__name__)


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
            self._judge_round([Sent(r, None, 0.0, 0.0) for r in plan], declared)
            self._finish()
            return self.result
        # From here on the account is written however the load ends, and says what ended it:
        # a failure of the hook or of the first sample left no load.json (found in review).
        try:
            if self.on_session is not None:
                self.on_session(session)
            self._started = time.monotonic()
            self._sample(session, "before")
            self._rounds(session, regular, declared)
            alone = [r for r in plan if r.alone]
            if alone:
                self._send_alone(alone, declared)
        except Exception as exc:
            self.result.ended_by = f"the load failed: {type(exc).__name__}: {exc}".splitlines()[0]
            raise
        finally:
            self._finish()
        return self.result

    def _prompt_tokens(self) -> dict[str, int]:
        """Each prompt's tokens, as the baseline's answer to it counts them."""
        return {
            prompt: len(outcome.result.prompt_token_ids)
            for prompt, outcome in self.sweep.baseline.outcomes.items()
            if outcome.result is not None
        }

    def _region(self, prompt: str) -> str:
        placement = self.result.placements.get(prompt)
        return placement.region.value if placement else "unknown"

    def _calibrate(self, regular: list[PlannedRequest]) -> None:
        self.result.calibration, self.result.calibration_source = calibrate_load(
            self.sweep,
            regular,
            self.spec.concurrency,
            self.topology.name,
            self.keep_baseline,
            self.say,
        )

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
            accounted = accounts_kv(self.topology, self.sweep.settings.serving.kv_connector)
            counters_before = session.decode_counters() if accounted else None
            sent = self._round(session, planned)
            if accounted:
                account_kv(
                    self.result,
                    sent,
                    counters_before,
                    session.decode_counters(),
                    self.sweep.settings.serving.block_size,
                    self.sweep.settings.run_dir,
                    self._prompt_tokens(),
                )
            self._judge_round(sent, declared)
            label = f"round {self.result.rounds}" if deadline is not None else "after"
            if self.result.ended_by is None and self.result.killed is not None:
                notice_deaths_beside_the_kill(session, self.result, self.say)
            elif self.result.ended_by is None:
                notice_a_quiet_death(session, self.result, self.say)
            stop = self.result.ended_by or self.result.killed
            last = bool(stop) or deadline is None or time.monotonic() >= deadline
            self._sample(session, label, clean_kv=not last)
            if last:
                return
            self.say(
                f"[load] round {self.result.rounds} done at "
                f"{time.monotonic() - self._started:.0f}s of {self.spec.duration_s:.0f}s"
            )

    def _round(self, session: Session, planned: list[PlannedRequest]) -> list[Sent]:
        """The round's requests (`send_round`); in a load's first round, with a planted kill
        watching them."""
        flight = InFlight()
        kill = self.spec.kill if self.result.rounds == 1 else None
        target = min(self.spec.concurrency, len(planned))
        together = Together(target if kill is not None else 0, KILL_WAIT_S)
        killer = None
        if kill is not None:
            killer = PlantedKill(
                kill,
                session,
                flight,
                target,
                self.result,
                self.sweep.run_info,
                self._now,
                self.say,
            )
            killer.start()
        # A round that raises ends its killer all the same: else it waits on, up to
        # KILL_WAIT_S, to kill an instance of a session a later load may be using.
        try:
            self.say(
                f"[load] {self.topology.name}: {len(planned)} request(s), "
                f"{self.spec.concurrency} at a time{', streamed' if self.spec.stream else ''}"
            )
            return send_round(
                session,
                planned,
                self.sweep.bodies,
                concurrency=self.spec.concurrency,
                stream=self.spec.stream,
                flight=flight,
                together=together,
                now=self._now,
                on_death=self._on_death,
            )
        finally:
            if killer is not None:
                killer.finish()

    def _on_death(self, dead: Death) -> None:
        """A death a request of the round found ends the load (unless it is the one planted)."""
        if self.result.killed is None:
            self.result.ended_by = dead.headline

    def _send_alone(
        self, alone: list[PlannedRequest], declared: dict[str, DeclaredFailure | None]
    ) -> None:
        """The requests declared to end an instance, one at a time after all others (the
        topology started again before each one that finds an instance dead)."""
        for request in alone:
            if self.result.ended_by is not None:
                sent = Sent(request, None, 0.0, 0.0)
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
                sent = Sent(request, observed, started, self._now())
                died = declared_death(session, request_failed=observed.outcome.error is not None)
                if died is not None:  # as declared; said, not only counted (real vLLM: unsaid)
                    self.result.declared_deaths.append(
                        f"{request.name} ({request.prompt}), sent last and alone, ended "
                        f"{died.headline}"
                    )
                    if died.instance is not None:  # its row showed its live figures (review)
                        self.result.resources.ended_after_the_samples(
                            died.instance,
                            f"after {request.name} (sent alone, after the last sample)",
                        )
            self._judge_round([sent], declared, alone=True)

    # -- judging -----------------------------------------------------------------------------

    def _unsent_why(self) -> str:
        """A request the load never sent says what ended the load before its turn (a planted
        kill's request names the killed instance first, as `kill_problems` demands)."""
        if self.result.ended_by is not None:
            return f"not sent: the load had ended: {self.result.ended_by}"
        if self.result.killed is not None:
            return f"not sent: {self.result.killed} was killed (planted) before its turn"
        return "not sent: the load had ended"

    def _judge_round(
        self,
        sent: list[Sent],
        declared: dict[str, DeclaredFailure | None],
        alone: bool = False,
    ) -> None:
        """Each request against the baseline's answer to its own prompt, with the answers of
        the other prompts named by a request that carried them."""
        baseline = self.sweep.baseline
        # This load's own calibration: the largest of every load's let a drift another
        # load's traffic showed pass here.
        calibration = self.result.calibration
        floor = None if calibration is None else calibration.noise_floor
        results: list[LoadRequestResult] = []
        for item in sent:
            request = item.request
            observed = item.observed
            if observed is None:
                observed = Observed(Outcome(prompt=request.prompt, error=self._unsent_why()), ())
            batched = not alone and any(
                other is not item and other.observed is not None and item.overlaps(other)
                for other in sent
            )
            others = [
                (carrier(sent, item, prompt), baseline.outcomes[prompt])
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
                batched_noise_floor=floor,
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
        append_request_rows(self.sweep.settings.run_dir, rows)
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

    def _sample(self, session: Session, label: str, clean_kv: bool = False) -> None:
        sample_resources(
            session, label, self._now(), self.result, self.sweep.settings.run_dir, clean_kv
        )

    # -- the account ---------------------------------------------------------------------------

    def _finish(self) -> None:
        result = self.result
        if result.killed is not None:
            result.problems += kill_problems(result)
        if result.kv.failed_unlisted:
            result.problems.append(
                f"KV account: {result.kv.failed_unlisted} more round(s) failed than the "
                f"{FAILURES_KEPT_WHOLE} above, each a line of {KV_ACCOUNTS_FILE}"
            )
        if self.spec.duration_s is not None:
            result.problems += bound_problems(result.resources, self.bounds)
        if result.problems:
            # The run's problems: verdicts.txt, summary.json, diff.md, junit.xml and
            # report.html say them, so a load every request of which passed and that failed
            # by its KV account, its bounds or a death is red in its bundle as in its exit.
            info = self.sweep.run_info
            info["problems"] = [*info.get("problems", ()), *result.problems]
            self.sweep.write_outputs()
        self._write_account()
        if self._attached is not None:
            self._attached.close()

    def _write_account(self) -> None:
        write_account(
            self.sweep.settings.run_dir,
            self.topology.name,
            self.spec,
            self.bounds,
            self.notes,
            self.result,
        )

    def _now(self) -> float:
        return time.monotonic() - self._started
