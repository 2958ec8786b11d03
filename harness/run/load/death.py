"""A death under load. A prompt declared to end an instance on this topology (media in the
part D recomputes, under ExampleConnector) is sent after all others, alone, and judged as
declared (`harness.run.load.plan`). Any other death ends the load: every request in flight ends
ERROR with the instance's name first (the session waits for a dying engine), requests not yet
sent are recorded as not sent with the same cause, and no further round starts. `--kill ROLE`
plants such a death on purpose (`PlantedKill`), once every request of the round is in flight."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, Any

from harness.judge.records import Verdict
from harness.report.load import LoadRequestResult
from harness.run.faults.instance import kill_instance
from harness.run.load.result import LoadResult
from harness.run.load.sending import InFlight
from harness.run.load.sessions import Death, Session, dead_instance, deaths_beside, launched
from harness.spec.topology import Role

if TYPE_CHECKING:  # not at run time: `sessions` is the one module that tells sessions apart
    from harness.serve.session import TopologySession
    from harness.serve.tap import TapSet

KILL_WAIT_S = 300.0  # how long a planted kill waits for every request to be in flight
KILL_END_S = 30.0  # a request in flight when its instance is killed must end within this
# vLLM's API server exits a second or two after its engine died, and the request that killed
# it is answered first (real vLLM 0.32.0: the tail request's error came back with D still
# shutting down), so a death a request declares is looked for this long at most.
DECLARED_DEATH_WAIT_S = 30.0
DEATH_POLL_S = 0.25


@dataclass
class PlantedKill:
    """The killer of a load's one round (a kill is never planted in a soak): a thread that
    SIGKILLs the instance of `role` at the moment `_kill_when_in_flight` waits for, recording
    the kill (or why it never came) in `result`."""

    role: str
    session: InitVar[Session]
    flight: InFlight
    target: int  # the requests in flight the kill waits for
    result: LoadResult
    run_info: dict[str, Any]  # run.json's: the kill is recorded there too
    now: Callable[[], float]  # the load's clock
    say: Callable[[str], None]
    base: TopologySession | None = field(init=False)
    taps: TapSet | None = field(init=False)
    mark: int = field(init=False)
    round_over: threading.Event = field(init=False, default_factory=threading.Event)
    thread: threading.Thread = field(init=False)

    def __post_init__(self, session: Session) -> None:
        self.base = launched(session)
        self.taps = self.base.taps if self.base is not None else None
        # Before any request goes out: what the taps recorded from here on is the round's.
        self.mark = self.taps.mark() if self.taps is not None else 0
        self.thread = threading.Thread(target=self._kill_or_say_why, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def finish(self) -> None:
        """Waited for whole, so the kill either happened or was given up before the round is
        judged (a waiting killer gives up as soon as the round is over)."""
        self.round_over.set()
        self.thread.join()
        if self.taps is not None:
            self.taps.release(self.mark)

    def _kill_or_say_why(self) -> None:
        """What stops the killer from killing is a problem of the load, not a traceback on
        stderr and a load that passes."""
        try:
            self._kill_when_in_flight()
        except Exception as exc:  # noqa: BLE001 - said as the load's problem
            self.result.problems.append(f"the planted kill failed: {type(exc).__name__}: {exc}")

    def _kill_when_in_flight(self) -> None:
        """SIGKILL the instance of the role once `target` requests are in flight and one of
        them has reached it, before it has answered any: its tap recorded a call of this round
        (after `mark`; a call of an earlier load on the same topology is no request in flight)
        and has relayed no answer of the round whole. An instance that answered a request
        first cannot be killed with every request in flight any more (the fake vLLM's D, which
        answers at once, did so on some runs, and that request passed). A kill that never came
        (that, the round ended first, or the wait ran out) is a problem of the load: its death
        under load was not tested, however well every answer held."""
        base, target = self.base, self.target
        assert base is not None, "a planted kill needs a launched topology"
        server = base.server(Role(self.role))
        deadline = time.monotonic() + KILL_WAIT_S
        while time.monotonic() < deadline and not self.round_over.is_set():
            calls = base.taps.since(self.mark) if base.taps is not None else []
            at_server = [r for r in calls if r.instance == server.name]
            answered = next((r for r in at_server if r.ended), None)
            if answered is not None:
                self.result.problems.append(
                    f"the planted kill never happened: {server.name} answered a request of "
                    f"the round (id {answered.request_id}) before {target} request(s) were in "
                    "flight with one at it: its moment passed"
                )
                return
            if self.flight.current >= target and at_server:
                break
            time.sleep(0.05)
        else:
            when = "before the round ended" if self.round_over.is_set() else f"in {KILL_WAIT_S:g} s"
            self.result.problems.append(
                f"the planted kill never happened: it found no moment with {target} request(s) "
                f"in flight and one at {server.name} {when}"
            )
            return
        # Named before the signal, so the death it causes is never read as an unplanned one.
        earlier = self.run_info.get("killed")  # an earlier load's of the same run
        self.result.killed_at_s = self.now()
        self.result.killed = server.name
        self.run_info["killed"] = server.name  # run.json, verdicts.txt: red on purpose
        try:
            kill_instance(server)
        except Exception:
            # Nothing was killed: nothing of this load is red on purpose.
            self.result.killed = self.result.killed_at_s = None
            if earlier is None:
                self.run_info.pop("killed", None)
            else:
                self.run_info["killed"] = earlier
            raise
        self.say(f"[load] killed {server.name} with {self.flight.current} request(s) in flight")


def spared_by_the_kill(result: LoadResult) -> list[LoadRequestResult]:
    """The requests of a kill's round that another instance of the killed one's role served
    whole: not ERROR, and every call their taps recorded was at another instance (2E+1PD's
    other encoder; real vLLM: `load --topology 2E+1PD --kill encoder` failed on a request
    encoder1 had served right). A request without taps is taken to have reached it."""
    return [
        request
        for request in result.results
        if request.record.verdict is not Verdict.ERROR
        and request.outcome.taps
        and all(call.instance != result.killed for call in request.outcome.taps)
    ]


def kill_problems(result: LoadResult) -> list[str]:
    """Under a planted kill: every request in flight ended ERROR naming the killed instance
    first, each within KILL_END_S of the kill, but those it never reached
    (`spared_by_the_kill`). A kill is planted in a load's one round (never in a soak), all of
    whose requests are kept whole."""
    assert result.killed is not None and result.killed_at_s is not None
    problems = []
    spared = {id(request) for request in spared_by_the_kill(result)}
    for request in result.results:
        first = (request.outcome.error or "").strip().splitlines()[:1]
        if id(request) in spared:
            continue
        if request.record.verdict is not Verdict.ERROR:
            problems.append(f"request {request.number}: {request.record.verdict.value}, not ERROR")
        elif not first or result.killed not in first[0]:
            problems.append(
                f"request {request.number}: ERROR without {result.killed} first: "
                f"{first[0] if first else '(no error)'}"
            )
        elif not request.not_sent and request.ended_s - result.killed_at_s > KILL_END_S:
            problems.append(
                f"request {request.number} ended {request.ended_s - result.killed_at_s:.1f}s "
                f"after the kill (bound {KILL_END_S:g}s)"
            )
    return problems


def notice_deaths_beside_the_kill(
    session: Session, result: LoadResult, say: Callable[[str], None]
) -> None:
    """An instance that died beside the planted kill (P's death taking D down) is a problem of
    the load: the requests name the instance they found dead first, often the killed one, and
    every death was taken for the planted one (found in review: such a load passed)."""
    assert result.killed is not None
    for died in deaths_beside(session, result.killed):
        result.problems.append(
            f"round {result.rounds}: beside the planted kill of {result.killed}, {died.headline}"
        )
        say(f"[load] {died.report}")


def notice_a_quiet_death(session: Session, result: LoadResult, say: Callable[[str], None]) -> None:
    """An instance that died with every request of the round answered (P crashing as it frees
    the KV it sent, say) ends the load as a death during a request does: deaths are otherwise
    noticed through a request that failed."""
    died = dead_instance(session)
    if died is None:
        return
    result.ended_by = died.headline
    result.problems.append(
        f"round {result.rounds}: every request was answered, then {result.ended_by}"
    )
    say(f"[load] {died.report}")


def declared_death(session: Session, request_failed: bool) -> Death | None:
    """After a request declared to end an instance: the instance that died
    (None: every instance still serves), looked for, after a failed request, until one is dead
    or DECLARED_DEATH_WAIT_S has passed."""
    deadline = time.monotonic() + (DECLARED_DEATH_WAIT_S if request_failed else 0.0)
    while True:
        died = dead_instance(session)
        if died is not None or time.monotonic() >= deadline:
            return died
        time.sleep(DEATH_POLL_S)
