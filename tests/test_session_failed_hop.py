"""A request an instance answered with an error: the case's error names that instance (no
process, no socket: the session's proxy, taps and instances are stand-ins)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from harness.outcomes.trace import EncoderCall, RequestTrace
from harness.serve import session as session_module
from harness.serve.client import ServerFailedError
from harness.serve.session import TopologySession
from harness.serve.tap import TapSet
from harness.spec.settings import RunSettings
from harness.spec.topology import TOPOLOGIES, ServingConfig

pytestmark = pytest.mark.unit

PD_URL, PD_TAP = "http://127.0.0.1:9001", "http://127.0.0.1:9101"
ENCODER_URL, ENCODER_TAP = "http://127.0.0.1:9002", "http://127.0.0.1:9102"


class Server:
    """A running instance's stand-in: alive, with a log that says nothing of the failure."""

    def __init__(self, name: str, tmp_path: Path) -> None:
        self.name = name
        self.command = SimpleNamespace(name=name, log_path=tmp_path / f"{name}.log")
        self.lost = None

    def is_alive(self) -> bool:
        return True

    def log_size(self) -> int:
        return 0

    def read_log_from(self, offset: int) -> str:
        return ""

    def log_tail(self, lines: int = 10) -> str:
        return f"{self.name}: INFO serving"

    def health_probe_failure(self) -> str | None:
        return None

    def peak_rss_bytes(self) -> int:
        return 0


class Entry:
    """The proxy in front: it passes on D's 500 as it came (docs/proxies.md), its trace saying
    so when it is the harness's own (`traced`), and nothing when it is vLLM's."""

    def __init__(self, traced: bool) -> None:
        self.url = "http://127.0.0.1:9000"
        self.client = self
        self.traces: dict[str, RequestTrace] = {}
        self.traced = traced
        self.taps: TapSet | None = None

    def check_alive(self) -> None:
        pass

    def down_report(self) -> None:
        return None

    def send(self, body: dict[str, Any], request_id: str) -> Any:
        if self.traced:
            self.traces[request_id] = RequestTrace(
                request_id,
                decode_url=PD_TAP,
                decode_status=500,
                decode_seconds=0.2,
                error=f"decode {PD_TAP} answered 500: b'EngineCore encountered an issue'",
            )
        assert self.taps is not None
        record = self.taps._new_record(  # what PD's tap saw
            SimpleNamespace(name="1E+1PD/pd0", role="prefill_decode"), "/v1/chat/completions", None
        )
        record.status, record.seconds = 500, 0.2
        raise ServerFailedError(500, '{"message": "EngineCore encountered an issue"}')

    def trace(self, request_id: str) -> RequestTrace | None:
        return self.traces.get(request_id)

    def take_trace(self, request_id: str) -> RequestTrace | None:
        return self.traces.pop(request_id, None)


def session_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, entry: Entry
) -> TopologySession:
    """A 1E+1PD session of stand-in servers and taps whose requests go to `entry`."""
    monkeypatch.setattr(session_module, "DEATH_GRACE_S", 0.0)  # nothing dies here
    serving = ServingConfig(model=str(tmp_path / "m"))
    session = TopologySession(TOPOLOGIES["1E+1PD"], RunSettings(serving=serving, run_dir=tmp_path))
    session.instances = [  # type: ignore[list-item]
        SimpleNamespace(url=ENCODER_URL, name="1E+1PD/encoder0"),
        SimpleNamespace(url=PD_URL, name="1E+1PD/pd0"),
    ]
    session._servers = [Server("1E+1PD/encoder0", tmp_path), Server("1E+1PD/pd0", tmp_path)]  # type: ignore[list-item]
    session.tap_urls = {ENCODER_URL: ENCODER_TAP, PD_URL: PD_TAP}
    session._taps = TapSet([])
    entry.taps = session._taps
    session._entry, session._group = entry, entry  # type: ignore[assignment]
    session.decode_counters = lambda: None  # type: ignore[method-assign]
    session._sample_memory = lambda: None  # type: ignore[method-assign]
    return session


@pytest.mark.parametrize("traced", [True, False], ids=["harness-proxy", "vllm-proxy"])
def test_an_error_status_of_d_passed_on_names_d(
    tmp_path: Path, traced: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D answered 500 and the proxy passed it on, as both proxies do: found in review, the
    case's error said "no instance was still working on it" and named no instance."""
    session = session_behind(tmp_path, monkeypatch, Entry(traced))
    outcome = session.send("text", {"model": "m", "messages": []})
    assert outcome.result is None
    assert "1E+1PD/pd0" in outcome.error and "answered 500" in outcome.error, outcome.error
    assert "1E+1PD/pd0: INFO serving" in outcome.error  # its log tail


class FailingProxy(Entry):
    """The harness's proxy failed itself while it relayed D's stream: it broke the stream off,
    its trace naming itself, D's stream not ended."""

    def send(self, body: dict[str, Any], request_id: str) -> Any:
        self.traces[request_id] = RequestTrace(
            request_id,
            decode_url=PD_TAP,
            decode_status=200,
            error="proxy failed mid-stream: RuntimeError: relay bug",
        )
        raise ConnectionError("the stream broke off after 1 event(s)")


def test_the_proxys_own_failure_mid_stream_names_the_proxy_not_d(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: the case's error said the request "was still waiting on" D, whose
    stream the proxy itself had failed to relay, and quoted D's log as the evidence."""
    session = session_behind(tmp_path, monkeypatch, FailingProxy(traced=True))
    outcome = session.send("text", {"model": "m", "messages": []})
    assert outcome.result is None
    assert "proxy failed mid-stream: RuntimeError: relay bug" in outcome.error, outcome.error
    assert "still waiting on 1E+1PD/pd0" not in outcome.error, outcome.error


class DeadServer(Server):
    """An instance whose engine died on the request: exited, its log saying why."""

    exit_code = -9

    def is_alive(self) -> bool:
        return False

    def log_tail(self, lines: int = 10) -> str:
        return f"{self.name}: ERROR EngineCore died"


def test_an_instance_that_died_on_the_request_leads_the_error_with_its_log_tail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The request failed because PD died: the case's error names it first, how it ended and
    its log's last lines, not only the HTTP error the proxy passed on."""
    session = session_behind(tmp_path, monkeypatch, Entry(traced=True))
    session._servers[1] = DeadServer("1E+1PD/pd0", tmp_path)  # type: ignore[call-overload]
    outcome = session.send("text", {"model": "m", "messages": []})
    assert outcome.error is not None and outcome.error.startswith(
        f"instance 1E+1PD/pd0 exited with code -9 (its log: {tmp_path / '1E+1PD/pd0.log'})\n"
        "its last lines:\n1E+1PD/pd0: ERROR EngineCore died\n"
    ), outcome.error


class Clock:
    """The session's `time`: sleeping moves it on, nothing waits."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


class ExitsAfterItsEngine(Server):
    """As real vLLM 0.32.0 on two cores: its engine died with the request (its /health answers
    503 from then on), and its API server exits more than 3 s later (shutdown, nanobind's leak
    report at exit)."""

    exit_code = 0

    def __init__(self, name: str, tmp_path: Path, clock: Clock, exits_at: float) -> None:
        super().__init__(name, tmp_path)
        self.clock, self.exits_at = clock, exits_at

    def is_alive(self) -> bool:
        return self.clock.now < self.exits_at

    def health_probe_failure(self) -> str | None:
        return "HTTP 503"


def test_an_instance_still_exiting_after_its_engine_died_is_waited_for_and_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A streamed load on real vLLM: D's engine died of the request, whose error came back at
    once; 3 s later D's server was still exiting, so the request's error named no instance
    (and its export said "NOT reproduced (decode0 died now, no instance in the recording)").
    An instance whose /health fails is given the whole grace to exit."""
    session = session_behind(tmp_path, monkeypatch, Entry(traced=True))
    monkeypatch.undo()  # the real grace, on the session's clock
    clock = Clock()
    monkeypatch.setattr(session_module, "time", clock)
    session._servers[1] = ExitsAfterItsEngine("1E+1PD/pd0", tmp_path, clock, clock.now + 6.0)  # type: ignore[call-overload]
    outcome = session.send("text", {"model": "m", "messages": []})
    assert outcome.error is not None and outcome.error.startswith(
        "instance 1E+1PD/pd0 exited with code 0 (its log: "
    ), outcome.error


def test_a_failed_request_with_every_instance_healthy_waits_for_no_death(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No instance's /health fails: no engine is dying, so the failed request's cause is looked
    for at once (a fuzz's refused trials do not each wait out the grace)."""
    session = session_behind(tmp_path, monkeypatch, Entry(traced=True))
    monkeypatch.undo()  # the real grace, on the session's clock
    clock = Clock()
    monkeypatch.setattr(session_module, "time", clock)
    outcome = session.send("text", {"model": "m", "messages": []})
    assert outcome.error is not None and "1E+1PD/pd0" in outcome.error, outcome.error
    assert clock.slept == [], clock.slept


class EncoderHangs(Entry):
    """The harness's proxy gave up on the request while E had not answered its sub-request."""

    def send(self, body: dict[str, Any], request_id: str) -> Any:
        trace = RequestTrace(request_id)
        trace.encoder_calls.append(EncoderCall(url=ENCODER_TAP, positions=(0,)))
        self.traces[request_id] = trace
        raise TimeoutError("no answer in 600 s")


def test_a_request_still_waiting_on_the_encoder_names_the_encoder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """E's sub-request never returned (its status unset in the trace): the case's error names
    E and shows its log, not "no instance was still working on it"."""
    session = session_behind(tmp_path, monkeypatch, EncoderHangs(traced=True))
    outcome = session.send("image", {"model": "m", "messages": []})
    assert (
        f"the request was still waiting on 1E+1PD/encoder0 ({ENCODER_TAP}) (its log: "
        in outcome.error
    ), outcome.error
    assert "1E+1PD/encoder0: INFO serving" in outcome.error


class UnreadableAnswer(Entry):
    """D answered 200 and its answer ended; the client could not read it."""

    def send(self, body: dict[str, Any], request_id: str) -> Any:
        self.traces[request_id] = RequestTrace(
            request_id, decode_url=PD_TAP, decode_status=200, decode_seconds=0.2
        )
        raise ValueError("the answer is no chat completion")


def test_a_request_no_instance_failed_names_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every hop answered 200 and ended: no instance is blamed (D's 200 is no refusal)."""
    session = session_behind(tmp_path, monkeypatch, UnreadableAnswer(traced=True))
    outcome = session.send("text", {"model": "m", "messages": []})
    assert "no instance was still working on it" in outcome.error, outcome.error
    assert "answered 200" not in outcome.error, outcome.error


PREFILL_URL, PREFILL_TAP = "http://127.0.0.1:9003", "http://127.0.0.1:9103"
SECOND_ENCODER_URL = "http://127.0.0.1:9004"


def with_instance(session: TopologySession, name: str, url: str, tmp_path: Path) -> None:
    """One more stand-in instance behind `session` (a P, or a second E)."""
    session.instances.append(SimpleNamespace(url=url, name=name))  # type: ignore[arg-type]
    session._servers.append(Server(name, tmp_path))  # type: ignore[arg-type]


class PrefillHangs(Entry):
    """The harness's proxy gave up on the request while P had not answered: E had, and D was
    never called (the proxy calls D once P is done)."""

    def send(self, body: dict[str, Any], request_id: str) -> Any:
        trace = RequestTrace(request_id, prefill_url=PREFILL_TAP)
        trace.encoder_calls.append(EncoderCall(url=ENCODER_TAP, positions=(0,), status=200))
        self.traces[request_id] = trace
        raise TimeoutError("no answer in 600 s")


def test_a_request_still_waiting_on_p_names_p(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P's sub-request never returned (its status unset in the trace): the case's error names
    P and shows its log, not "no instance was still working on it"."""
    session = session_behind(tmp_path, monkeypatch, PrefillHangs(traced=True))
    with_instance(session, "1E+1P+1D/prefill0", PREFILL_URL, tmp_path)
    session.tap_urls[PREFILL_URL] = PREFILL_TAP
    outcome = session.send("image", {"model": "m", "messages": []})
    assert (
        f"the request was still waiting on 1E+1P+1D/prefill0 ({PREFILL_TAP}) (its log: "
        in outcome.error
    ), outcome.error
    assert "1E+1P+1D/prefill0: INFO serving" in outcome.error


class OneEncoderRefusesOneHangs(Entry):
    """vLLM's proxy (no trace) waits for every encoder sub-request before it goes on: one E
    refused its part with 500, the other never answered, and the client timed out."""

    def send(self, body: dict[str, Any], request_id: str) -> Any:
        assert self.taps is not None
        refused = self.taps._new_record(
            SimpleNamespace(name="1E+1PD/encoder0", role="encode"), "/v1/chat/completions", None
        )
        refused.status, refused.seconds = 500, 0.1
        self.taps._new_record(
            SimpleNamespace(name="1E+1PD/encoder1", role="encode"), "/v1/chat/completions", None
        )
        raise TimeoutError("no answer in 600 s")


def test_with_vllms_proxy_the_instance_still_working_outranks_one_that_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client timed out because the proxy still waited on encoder1; encoder0's 500 did not
    end the request, so the case's error names encoder1 as still working, not encoder0."""
    session = session_behind(tmp_path, monkeypatch, OneEncoderRefusesOneHangs(traced=False))
    with_instance(session, "1E+1PD/encoder1", SECOND_ENCODER_URL, tmp_path)
    outcome = session.send("image", {"model": "m", "messages": []})
    assert "the request was still waiting on 1E+1PD/encoder1" in outcome.error, outcome.error
    assert "answered 500" not in outcome.error, outcome.error


def test_an_entry_says_its_proxy_is_down_only_when_it_is() -> None:
    """When no instance died, a failed request's cause may be the proxy itself: the harness's
    proxy that stopped or crashed is named; one still serving is no cause."""
    from harness.serve.entry import Entry as RealEntry

    proxy = SimpleNamespace(running=True)
    entry = RealEntry("harness", "http://127.0.0.1:9", client=None, proxy_server=proxy)  # type: ignore[arg-type]
    assert entry.down_report() is None
    proxy.running = False
    assert entry.down_report() == ("proxy http://127.0.0.1:9 is not running (stopped or crashed)")


def test_the_baselines_entry_is_the_instance_itself(tmp_path: Path, monkeypatch) -> None:
    """The monolithic baseline is the reference: its requests go straight to the instance,
    through no proxy whose relaying or faults would then be part of the reference (found in
    review: only the process tier opened a baseline's entry)."""
    from harness.serve import entry as entry_module
    from harness.serve.proxy import ProxyFaults
    from harness.spec.platforms import CPU
    from harness.spec.topology import BASELINE, Role, serving_for

    def no_proxy(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the baseline is served through no proxy")

    monkeypatch.setattr(entry_module, "ProxyServer", no_proxy)
    monkeypatch.setattr(entry_module, "start_vllm_proxy", no_proxy)
    settings = RunSettings(serving_for(CPU, "/m"), tmp_path, platform=CPU)
    instance = SimpleNamespace(url="http://127.0.0.1:8000", role=Role.BASELINE)
    opened = entry_module.open_entry(
        BASELINE,
        settings,
        [instance],  # type: ignore[list-item]
        {"http://127.0.0.1:8000": "http://127.0.0.1:9000"},
        ProxyFaults(),
        tmp_path,
        [],
    )
    try:
        assert (opened.url, opened.proxy, opened.proxy_server) == (instance.url, None, None)
    finally:
        opened.close()


def test_a_trace_taken_from_an_entry_is_let_go_of() -> None:
    """The outcome holds a request's trace once taken: the harness's proxy keeps it no longer,
    or a soak's every request's stays in the proxy for the run (found in review)."""
    from harness.serve.entry import Entry as RealEntry

    proxy = SimpleNamespace(traces={"req-1": "trace of req-1"})
    entry = RealEntry("harness", "http://127.0.0.1:9", client=None, proxy=proxy)  # type: ignore[arg-type]
    assert entry.trace("req-1") == "trace of req-1"
    assert entry.take_trace("req-1") == "trace of req-1"
    assert entry.trace("req-1") is None and proxy.traces == {}


def test_an_entry_says_vllms_proxy_exited_with_its_code_and_log() -> None:
    """vLLM's proxy, run like an instance, is named down once it has exited, with its exit
    code and the last lines of its log (the cause is there, not in the harness)."""
    from harness.serve.entry import Entry as RealEntry

    proxy = SimpleNamespace(
        is_alive=lambda: True,
        exit_code=1,
        command=SimpleNamespace(log_path=Path("/logs/vllm-proxy.log")),
        log_tail=lambda lines: "Traceback: address in use",
    )
    entry = RealEntry("vllm/static", "http://127.0.0.1:9", client=None, vllm_proxy=proxy)  # type: ignore[arg-type]
    assert entry.down_report() is None
    proxy.is_alive = lambda: False
    assert entry.down_report() == (
        "vLLM's proxy exited (1); last lines of /logs/vllm-proxy.log:\nTraceback: address in use"
    )
