"""Streams relayed to the client: the chat client reading vLLM-shaped events through the
harness's proxy and through a tap (as vLLM's proxy reaches D), the planted fault that relays a
chunk twice at either, and a D that breaks its stream off or reports an error in it.

The D here is a fake that streams exactly as vLLM 0.32 frames a chat stream (tests/sse_stream.py);
what real vLLM streams is checked by the streamed e2e scenarios (scenarios/test_stream.py).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from sse_stream import PROMPT_IDS, TOKENS, encode, vllm_chunks

from harness.outcomes.stream import StreamFailed
from harness.serve.client import ChatClient, ServerFailedError
from harness.serve.proxy import EPDProxy, ProxyFaults, ProxyRoutes, ProxyServer
from harness.serve.tap import TapSet, TapTarget
from harness.spec.prompts import sampling_fields, streaming_request
from harness.testing.fake_instance import FakeInstance, LoopThread, Reply

pytestmark = pytest.mark.process

BODY = streaming_request(
    {
        "model": "epd-model",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        **sampling_fields(max_tokens=3),
    }
)


class StreamingD:
    """A fake D: streams `events` (a short pause between them), or breaks off after
    `break_after` events, or answers `status` before streaming anything."""

    def __init__(self) -> None:
        self.events = encode(vllm_chunks())
        self.break_after: int | None = None
        self.status = 200
        self.delay_s = 0.005
        self.instance = FakeInstance(self.answer, name="decode")

    @property
    def url(self) -> str:
        return self.instance.url

    def answer(self, _body: dict[str, Any]) -> Reply:
        if self.status != 200:
            return Reply({"message": "D exploded"}, status=self.status)
        return Reply(list(self.events), chunk_delay_s=self.delay_s, break_after=self.break_after)


@pytest.fixture
def d() -> Iterator[StreamingD]:
    loop = LoopThread()
    fake = StreamingD()
    loop.run(fake.instance.start())
    yield fake
    loop.run(fake.instance.stop())
    loop.close()


def proxy_in_front(url: str, faults: ProxyFaults | None = None) -> tuple[EPDProxy, ProxyServer]:
    proxy = EPDProxy(ProxyRoutes(decode_urls=(url,)), faults)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return proxy, ProxyServer(proxy, sock).start()


def send(url: str, request_id: str = "req-1") -> Any:
    client = ChatClient(url, timeout_s=10)
    try:
        return client.send(BODY, request_id=request_id)
    finally:
        client.close()


def test_a_stream_through_the_harness_proxy_carries_the_answer_framed(d: StreamingD) -> None:
    _, server = proxy_in_front(d.url)
    try:
        reply = send(server.url)
    finally:
        server.stop()
    assert reply.result.prompt_token_ids == tuple(PROMPT_IDS)
    assert reply.result.token_ids == tuple(TOKENS)
    assert reply.stream is not None and reply.stream.ok, reply.stream.problems
    assert reply.stream.content_type.startswith("text/event-stream")
    assert 0 < reply.stream.first_token_s <= reply.stream.last_event_s


def test_the_planted_fault_at_the_harness_proxy_relays_a_chunk_twice(d: StreamingD) -> None:
    proxy, server = proxy_in_front(d.url, ProxyFaults(duplicate_first_token_chunk=True))
    try:
        reply = send(server.url)
    finally:
        server.stop()
    assert reply.result.token_ids == (TOKENS[0], *TOKENS)
    assert reply.stream.ids_counted == 4 and reply.stream.usage_completion_tokens == 3
    [effect] = proxy.traces["req-1"].fault_effects
    assert effect.startswith("relayed twice: event 2")


def test_the_planted_fault_at_ds_tap_relays_a_chunk_twice(d: StreamingD) -> None:
    """The way a fault reaches a stream through vLLM's proxy: at D's tap."""
    faults = ProxyFaults(duplicate_first_token_chunk=True)
    taps = TapSet([TapTarget("t/decode0", "decode", d.url)], faults).start("127.0.0.1")
    try:
        reply = send(taps.urls["t/decode0"])
        [record] = taps.records
    finally:
        taps.stop()
    assert reply.result.token_ids == (TOKENS[0], *TOKENS)
    assert record.rewritten_by_fault and record.streamed
    assert record.usage["completion_tokens"] == 3  # what D itself said


def test_a_stream_that_breaks_off_is_no_answer(d: StreamingD) -> None:
    """The failure says how the connection ended (the transport's error), not only what the
    stream held: a peer that closed is told from a stream that ended unfinished."""
    d.break_after = 2
    _, server = proxy_in_front(d.url)
    try:
        with pytest.raises(StreamFailed, match="broke off") as failure:
            send(server.url)
    finally:
        server.stop()
    assert failure.value.record.ids_counted <= 1
    assert "(RemoteProtocolError: peer closed connection" in str(failure.value)


def test_an_error_in_the_stream_is_no_answer(d: StreamingD) -> None:
    d.events = encode([{"error": {"message": "EngineCore died", "code": 500}}])
    with pytest.raises(StreamFailed, match="EngineCore died"):
        send(d.url)


def test_a_refused_stream_raises_with_its_status(d: StreamingD) -> None:
    d.status = 500
    with pytest.raises(ServerFailedError, match="Error code: 500"):
        send(d.url)


def test_a_stream_that_breaks_off_behind_a_tap_fails_at_once_through_the_proxy(
    d: StreamingD,
) -> None:
    """The chain a run serves: proxy -> D's tap -> D. A relay whose upstream broke off after
    its answer began must break its own stream off too: a second response written into the
    open stream left the proxy waiting on the tap until the client's request timed out."""
    d.break_after = 2
    taps = TapSet([TapTarget("t/decode0", "decode", d.url)]).start("127.0.0.1")
    proxy, server = proxy_in_front(taps.urls["t/decode0"])
    started = time.monotonic()
    try:
        with pytest.raises(StreamFailed, match="broke off") as failure:
            send(server.url)
        elapsed = time.monotonic() - started
        [record] = taps.records
    finally:
        server.stop()
        taps.stop()
    assert elapsed < 5, f"the client waited {elapsed:.1f} s for a stream D broke off"
    assert "502" not in str(failure.value)  # no second response inside the first
    # D's own failure, not the client's going away (which the report would not lay at D's door)
    assert record.error and record.error.startswith("ClientPayloadError"), record.error
    error = proxy.traces["req-1"].error
    assert error and error.startswith("decode ") and "broke off" in error, error


def test_a_client_that_goes_away_mid_stream_is_not_recorded_as_ds_failure(d: StreamingD) -> None:
    """The proxy stops relaying (and lets go of D) once its client is gone, and its trace says
    so: a write to the gone client was recorded as D's failure."""
    import httpx

    d.events = encode(vllm_chunks(tokens=list(range(40, 80))))
    d.delay_s = 0.05
    proxy, server = proxy_in_front(d.url)
    try:
        with (
            httpx.Client() as client,
            client.stream(
                "POST",
                f"{server.url}/v1/chat/completions",
                json=BODY,
                headers={"x-request-id": "r"},
            ) as response,
        ):
            next(response.iter_bytes())
        trace = proxy.traces["r"]
        deadline = time.monotonic() + 5
        while trace.error is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        server.stop()
    assert trace.error and trace.error.startswith("the client went away"), trace.error
    assert d.url not in trace.error


def test_the_trace_of_a_relayed_stream_is_whole_before_the_stream_ends(
    d: StreamingD, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed request's report reads the trace as soon as the client gave up on the answer;
    a stream D had ended must not read as one D was still sending (its seconds were set after
    the end left, so a proxy thread that ran late named D as the instance still working)."""
    from aiohttp import web

    write_eof = web.StreamResponse.write_eof

    async def late_write_eof(self: web.StreamResponse, data: bytes = b"") -> None:
        await write_eof(self, data)
        await asyncio.sleep(0.3)  # the proxy's thread is descheduled once the end has left

    monkeypatch.setattr(web.StreamResponse, "write_eof", late_write_eof)
    proxy, server = proxy_in_front(d.url)
    try:
        send(server.url)
        seconds = proxy.traces["req-1"].decode_seconds
    finally:
        server.stop()
    assert seconds > 0


def test_a_stream_d_refuses_through_the_proxy_is_recorded_in_the_trace(d: StreamingD) -> None:
    """D answers a streamed request with an error status: the client gets it relayed, and the
    proxy's trace keeps it as it does for an unstreamed one (a failed request's report and
    the bundle read the trace; it held no error; found in review)."""
    d.status = 500
    proxy, server = proxy_in_front(d.url)
    try:
        with pytest.raises(ServerFailedError, match="500"):
            send(server.url)
    finally:
        server.stop()
    error = proxy.traces["req-1"].error
    assert error and error.startswith(f"decode {d.url} answered 500") and "D exploded" in error


def test_a_client_that_goes_away_mid_stream_is_not_recorded_at_the_tap_as_ds_failure(
    d: StreamingD,
) -> None:
    """The tap's client (the proxy under test) gives up mid-stream: its record of D says so.
    Found in review: the write to the gone client was recorded as D's own error
    (`ClientConnectionResetError`), which the report and the bundle show under D."""
    import httpx

    d.events = encode(vllm_chunks(tokens=list(range(40, 80))))
    d.delay_s = 0.05
    taps = TapSet([TapTarget("t/decode0", "decode", d.url)]).start("127.0.0.1")
    try:
        with (
            httpx.Client() as client,
            client.stream(
                "POST",
                f"{taps.urls['t/decode0']}/v1/chat/completions",
                json=BODY,
                headers={"x-request-id": "r"},
            ) as response,
        ):
            next(response.iter_bytes())
        [record] = taps.records
        deadline = time.monotonic() + 5
        while record.error is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        taps.stop()
    assert record.error and record.error.startswith("the client went away"), record.error


@pytest.mark.parametrize(
    ("status", "content_type"),
    [(200, "text/event-stream; charset=utf-8"), (500, "text/plain; charset=utf-8")],
    ids=["stream", "refusal"],
)
def test_the_proxy_relays_ds_content_type_as_d_sent_it(status: int, content_type: str) -> None:
    """vLLM's D serves its stream as `text/event-stream; charset=utf-8`, and an error of its
    server as plain text. Found in review: the harness's proxy dropped the charset of the
    one and labelled the other `application/json`, where the client is to see D's answer."""
    import httpx

    events = encode(vllm_chunks())
    body: bytes | list[bytes] = events if status == 200 else b"Internal Server Error"
    loop = LoopThread()
    d = FakeInstance(lambda _body: Reply(body, status=status, content_type=content_type))
    loop.run(d.start())
    proxy, server = proxy_in_front(d.url)
    try:
        with httpx.Client() as client:
            response = client.post(f"{server.url}/v1/chat/completions", json=BODY)
    finally:
        server.stop()
        loop.run(d.stop())
        loop.close()
    assert (response.status_code, response.headers["content-type"]) == (status, content_type)


def test_a_relay_the_proxy_itself_fails_mid_stream_breaks_off_naming_the_proxy(
    d: StreamingD, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The proxy's own failure after the stream began (here its planted fault's rewriter
    raising): a JSON 500 written into the open stream reached the client as a second response
    inside the first ("illegal chunk header: HTTP/1.1 500"), and the trace blamed nothing
    mid-stream. The stream is broken off, and the trace names the proxy (found in review)."""
    from harness.serve import proxy as proxy_module

    fed = []

    def feed(_self: object, data: bytes) -> bytes:
        fed.append(data)
        if len(fed) == 2:
            raise RuntimeError("relay bug")
        return data

    monkeypatch.setattr(proxy_module.FirstTokenChunkTwice, "feed", feed)
    proxy, server = proxy_in_front(d.url, ProxyFaults(duplicate_first_token_chunk=True))
    try:
        with pytest.raises(StreamFailed, match="broke off") as failure:
            send(server.url)
    finally:
        server.stop()
    assert "HTTP/1.1 500" not in str(failure.value)  # no second response inside the first
    error = proxy.traces["req-1"].error
    assert error == "proxy failed mid-stream: RuntimeError: relay bug", error
