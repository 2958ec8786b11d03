"""The fake vLLM streams as vLLM 0.32 does (`stream_events` in
harness/testing/fake_vllm_server/sse.py): the streamed scenarios of the GPU night
(scenarios/test_stream.py, the vLLM-proxy module's streamed cases) can pass on the fake for
the reasons they do on vLLM, and their planted fault still turns a case red. Before, the fake
answered a `stream: true` body with one JSON document, and every streamed case on the fake
night was an ERROR. Fakes only: nothing here runs a model.
"""

from __future__ import annotations

import http.client
import http.server
import json
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from harness.judge.verdicts import STREAM_CHECK
from harness.outcomes.stream import parse_stream, split_events
from harness.run.pool import TopologyPool
from harness.run.sweep import Sweep, SweepSpec
from harness.spec.platforms import CUDA
from harness.spec.prompts import SKELETON_PROMPTS, render_request, streaming_request
from harness.spec.topology import TOPOLOGIES, Role, ServingConfig
from harness.testing.fake_vllm import fake_run_settings
from harness.testing.fake_vllm_server.engine import Engine
from harness.testing.fake_vllm_server.handlers import make_handler, make_side_channel
from harness.testing.fake_vllm_server.serve import parse_args
from harness.testing.fake_vllm_server.sse import stream_events

pytestmark = pytest.mark.process

PROMPTS = {p.name: p for p in SKELETON_PROMPTS}


def nixl_settings(tmp_path: Path, fake: Path, **fields):
    """The GPU night's cuda profile with NIXL, on the fake's devices."""
    serving = ServingConfig(model=str(tmp_path / "model"), kv_connector="NixlConnector")
    return fake_run_settings(tmp_path, fake, serving, platform=CUDA, devices=(0, 1, 2), **fields)


def test_a_streamed_answer_carries_the_unstreamed_ones_ids_with_vllms_framing() -> None:
    """The events of one answer read back by the harness's stream reader: the same ids and
    log-probs, no framing problem."""
    body = streaming_request(render_request(PROMPTS["text"], "fake-model"))
    ids = [11, 12, 13]
    entries = [{"token": f"token_id:{t}", "logprob": -0.5, "bytes": None} for t in ids]
    answer = {
        "id": "chatcmpl-r1",
        "created": 0,
        "model": "fake-model",
        "prompt_token_ids": [1, 2, 3, 4],
        "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7},
        "choices": [
            {
                "message": {"role": "assistant", "content": "fake"},
                "finish_reason": "length",
                "token_ids": ids,
                "logprobs": {"content": [{**e, "top_logprobs": [e]} for e in entries]},
            }
        ],
    }
    events = stream_events(answer, body)
    chunks, rest = split_events(b"".join(events))
    assert rest == b""
    result, record = parse_stream(
        [(0.0, chunk) for chunk in chunks], "text/event-stream; charset=utf-8", True
    )
    assert record.ok, record.problems
    assert (result.prompt_token_ids, result.token_ids) == ((1, 2, 3, 4), tuple(ids))
    assert (record.role_chunks, record.token_chunks, record.done_last) == (1, 3, True)
    assert len(result.logprobs) == 3 and result.finish_reason == "length"


@pytest.mark.parametrize(
    "topology,prompt", [("1E+1PD", "image"), ("1P+1D", "text"), ("1E+1P+1D", "two_images")]
)
def test_a_streamed_fake_case_matches_with_its_framing_held(
    tmp_path: Path, fake_vllm: Path, port_locks: Path, topology: str, prompt: str
) -> None:
    """scenarios/test_stream.py's cases, NIXL on the cuda profile: the harness's proxy relays
    D's (or PD's) stream, and the case is a MATCH with its stream check held."""
    spec = SweepSpec((TOPOLOGIES[topology],), prompts=(PROMPTS[prompt],))
    result = Sweep(spec, nixl_settings(tmp_path, fake_vllm, stream=True)).run_all()
    streamed = [r for r in result.records if r.topology == topology]
    assert streamed and all(r.verdict.value == "MATCH" for r in streamed), streamed
    for record in streamed:
        assert record.guards[STREAM_CHECK]["ok"], record.guards[STREAM_CHECK]


def test_a_relayed_chunk_sent_twice_turns_the_streamed_fake_case_red(
    tmp_path: Path, fake_vllm: Path, port_locks: Path
) -> None:
    """scenarios/test_stream.py's planted fault on the fake: a MISMATCH, its framing broken."""
    spec = SweepSpec(
        (TOPOLOGIES["1P+1D"],), prompts=(PROMPTS["text"],), fault="stream-duplicate-chunk"
    )
    result = Sweep(spec, nixl_settings(tmp_path, fake_vllm, stream=True)).run_all()
    [record] = [r for r in result.records if r.topology == "1P+1D"]
    assert record.verdict.value == "MISMATCH", record
    assert not record.guards[STREAM_CHECK]["ok"], record.guards[STREAM_CHECK]


def test_the_fake_streams_only_what_the_body_asks_for(
    tmp_path: Path, fake_vllm: Path, port_locks: Path
) -> None:
    """Without return_token_ids, logprobs or include_usage vLLM sends no ids, log-probs or
    usage chunk; the fake neither."""
    pool = TopologyPool(nixl_settings(tmp_path, fake_vllm))
    try:
        session = pool.session(TOPOLOGIES["baseline"])
        url = next(i.url for i in session.instances if i.role is Role.BASELINE)
        body = {
            "model": "fake-model",
            "messages": [{"role": "user", "content": "one two three"}],
            "max_tokens": 2,
            "stream": True,
        }
        request = urllib.request.Request(
            f"{url}/v1/chat/completions", json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=30) as reply:
            content_type, raw = reply.headers["Content-Type"], reply.read()
    finally:
        pool.close()
    assert content_type == "text/event-stream; charset=utf-8"
    events, _ = split_events(raw)
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    assert len(chunks) == 3, chunks  # the role chunk, then one per token: no usage chunk
    assert chunks[0]["prompt_token_ids"] is None
    assert [c["choices"][0]["token_ids"] for c in chunks[1:]] == [None, None]
    assert [c["choices"][0]["logprobs"] for c in chunks[1:]] == [None, None]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_fake_stream_chunk_has_the_fields_vllm_dumps(tmp_path: Path) -> None:
    """The chunk's keys as vLLM 0.32's ChatCompletionStreamResponse dumps them
    (`exclude_unset`): checked against vLLM's own model where it is installed."""
    protocol = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
    body = streaming_request(render_request(PROMPTS["text"], "fake-model"))
    entry = {"token": "token_id:5", "logprob": -0.5, "bytes": None}
    answer = {
        "id": "chatcmpl-r1",
        "created": 0,
        "model": "fake-model",
        "prompt_token_ids": [1, 2],
        "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
        "choices": [
            {
                "message": {"role": "assistant", "content": "fake"},
                "finish_reason": "length",
                "token_ids": [5],
                "logprobs": {"content": [{**entry, "top_logprobs": [entry]}]},
            }
        ],
    }
    for event in stream_events(answer, body)[:-1]:
        chunk = json.loads(event.removeprefix(b"data: "))
        model = protocol.ChatCompletionStreamResponse.model_validate(chunk)
        assert json.loads(model.model_dump_json(exclude_unset=True)) == chunk


def test_the_fake_holds_an_answer_for_its_decode_steps(
    tmp_path: Path, fake_vllm: Path, port_locks: Path
) -> None:
    """D's answer of n tokens comes n-1 decode steps after its first token, streamed one token
    a step, as vLLM's engine generates it. The fake answered at once, so the death under load's
    kill (scenarios/test_load.py), which waits for a request in flight at D, found D had
    answered the first requests on some runs: they passed, and the scenario failed."""
    from harness.testing.fake_vllm_server.handlers import DECODE_STEP_S

    tokens = 32
    pool = TopologyPool(nixl_settings(tmp_path, fake_vllm))
    try:
        session = pool.session(TOPOLOGIES["1P+1D"])
        url = next(i.url for i in session.instances if i.role is Role.DECODE)
        body = {  # no kv_transfer_params: D computes the prompt itself
            "model": "fake-model",
            "messages": [{"role": "user", "content": "one two three"}],
            "max_tokens": tokens,
        }

        def post(body: dict) -> list[tuple[float, bytes]]:
            """Each line of the answer with when it came, from the request's start."""
            request = urllib.request.Request(
                f"{url}/v1/chat/completions", json.dumps(body).encode(),
                {"Content-Type": "application/json"},
            )  # fmt: skip
            started = time.monotonic()
            with urllib.request.urlopen(request, timeout=30) as reply:
                return [(time.monotonic() - started, line) for line in iter(reply.readline, b"")]

        [(answered_s, _)] = post(body)
        token_events = [
            at
            for at, line in post({**body, "stream": True})
            if line.startswith(b"data: {") and b'"delta": {"role"' not in line
        ]
    finally:
        pool.close()
    held_s = (tokens - 1) * DECODE_STEP_S
    assert answered_s >= held_s, f"answered in {answered_s:.3f}s, not held {held_s:.2f}s"
    assert len(token_events) == tokens
    # Times are when this client read each line, never before the fake wrote it, but later
    # when this process waits for a core: the last token's, from the request's start, cannot
    # undercut the hold; the first's may come late (on a loaded host the first four tokens
    # were read together 0.048 s in, the spread then 0.285 s, not 0.31). Spread over at least
    # half the hold still tells one token a step from a hold answered in one burst (spread 0).
    assert token_events[-1] >= held_s, token_events
    assert token_events[-1] - token_events[0] >= held_s / 2, token_events


def nodelay_of_an_answer(handler: type[http.server.BaseHTTPRequestHandler]) -> list[int]:
    """TCP_NODELAY on the connection `handler` answers a GET on, served in this process."""
    nodelay: list[int] = []

    class Recording(handler):  # type: ignore[misc, valid-type]
        def setup(self) -> None:
            super().setup()
            nodelay.append(self.connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        def log_message(self, *args) -> None:  # quiet
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recording)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        connection = http.client.HTTPConnection(*server.server_address, timeout=10)
        connection.request("GET", "/health")
        connection.getresponse().read()
        connection.close()
    finally:
        server.shutdown()
        server.server_close()
    return nodelay


@pytest.mark.parametrize("make", [make_handler, make_side_channel], ids=["chat", "side-channel"])
def test_the_fake_answers_without_waiting_for_the_clients_delayed_ack(tmp_path: Path, make) -> None:
    """vLLM's server (uvicorn) sends with TCP_NODELAY. The fake's http.server did not: it
    writes an answer's headers and body apart, and with Nagle's algorithm on the body waited
    for the client's delayed ACK, 40 ms an answer on Linux. Every request to the fake took
    about 50 ms (a baseline's, each fuzz example's, each streamed token after the first): the
    bulk of the fake nights' wall time, no part of what they test. Checked on the socket the
    fake's servers answer on (its chat server, a NIXL prefill's side channel), not by a timer:
    50 answers took 2.2 s before, 0.02-0.03 s after."""
    engine = Engine(parse_args(["serve", str(tmp_path / "model"), "--port", "0"]), {})
    assert nodelay_of_an_answer(make(engine)) == [1]
