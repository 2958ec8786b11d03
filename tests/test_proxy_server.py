"""The aiohttp EPD proxy end to end, against fake encoder / prefill / decode instances.

The fakes (harness/testing/fake_instance.py) are small aiohttp apps on 127.0.0.1 (each on its
own bound socket, port 0) that record every body they receive and answer the way vLLM 0.32
does (`vllm_answer`). They run on one background event-loop thread; the proxy runs on its own
(`ProxyServer`), and the test thread talks to it with `ChatClient` or plain urllib, so every call
below is a real HTTP round trip.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from harness.outcomes.chat import ChatResult
from harness.serve.client import ChatClient
from harness.serve.proxy import EPDProxy, ProxyFaults, ProxyRoutes, ProxyServer
from harness.serve.proxy_protocol import media_uuid
from harness.spec.generations import GENERATIONS_BY_NAME, NEWEST, ProtocolGeneration
from harness.spec.prompts import sampling_fields
from harness.testing.fake_instance import Answer, FakeInstance, LoopThread, Reply

pytestmark = pytest.mark.process

CAT = "file:///media/cat.png"
DOG = "file:///media/dog.png"
PROMPT_IDS = list(range(100, 189))  # 89 prompt tokens
DECODE_TOKENS = [11, 22, 33]
PREFILL_KV_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "p0",
    "remote_block_ids": [0, 1],
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
}
# urllib without any environment proxy: the fakes live on loopback.
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
DONE = b"data: [DONE]\n\n"


def vllm_answer(kind: str, status: int = 200) -> Answer:
    """What a vLLM 0.32 instance of `kind` answers (encoder, encoder-ec-items, prefill, decode),
    or an error with `status`."""

    def answer(body: dict[str, Any]) -> Reply | dict[str, Any]:
        if status != 200:
            error = {"object": "error", "message": f"{kind} exploded", "code": status}
            return Reply(error, status)
        if kind == "encoder":
            return encoder_answer(body)
        if kind == "encoder-ec-items":
            return ec_items_answer(body)
        if kind == "prefill":
            return {
                "id": "chatcmpl-p",
                "kv_transfer_params": dict(PREFILL_KV_PARAMS),
                "choices": [{"index": 0, "finish_reason": "length", "message": {"content": "A"}}],
                "usage": {"prompt_tokens": 89, "completion_tokens": 1, "total_tokens": 90},
            }
        if body.get("stream"):
            chunks = [{"choices": [{"index": 0, "delta": {"content": t}}]} for t in ("Hel", "lo")]
            return Reply([f"data: {json.dumps(c)}\n\n".encode() for c in chunks] + [DONE])
        return decode_answer()

    return answer


def encoder_answer(body: dict[str, Any]) -> dict[str, Any]:
    """Like vLLM 0.32: one entry per item uuid, with the grid as metadata."""
    params: dict[str, Any] = {}
    for index, part in enumerate(body["messages"][0]["content"]):
        if part["type"] == "video_url":
            metadata = {"video_grid_thw": [2, 8, 8]}
        else:
            metadata = {"image_grid_thw": [1, 16, 16]}
        entry = params.setdefault(part["uuid"], {"item_indices": [], "metadata": metadata})
        entry["item_indices"].append(index)
    return {
        "id": "chatcmpl-e",
        "object": "chat.completion",
        "ec_transfer_params": params,
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": ""},
            }
        ],
        "usage": {"prompt_tokens": 80, "completion_tokens": 0, "total_tokens": 80},
    }


def ec_items_answer(body: dict[str, Any]) -> dict[str, Any]:
    """Like vLLM 0.28 / 0.29 (example_connector.request_finished): a list, metadata flattened."""
    items = [
        {"mm_hash": part["uuid"], "image_grid_thw": [[1, 16, 16]]}
        for part in body["messages"][0]["content"]
    ]
    return {
        "id": "chatcmpl-e",
        "ec_transfer_params": {"ec_items": items},
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"content": ""}}],
    }


def decode_answer() -> dict[str, Any]:
    """A vLLM chat completion with return_token_ids and token-id logprobs."""
    content = [
        {
            "token": f"token_id:{t}",
            "logprob": -0.25 * (i + 1),
            "bytes": None,
            "top_logprobs": [
                {"token": f"token_id:{t}", "logprob": -0.25 * (i + 1), "bytes": None},
                {"token": f"token_id:{t + 1}", "logprob": -3.0, "bytes": None},
            ],
        }
        for i, t in enumerate(DECODE_TOKENS)
    ]
    return {
        "id": "chatcmpl-d",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "epd-model",
        "prompt_token_ids": PROMPT_IDS,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "a cat!"},
                "logprobs": {"content": content},
                "finish_reason": "length",
                "token_ids": DECODE_TOKENS,
            }
        ],
        "usage": {
            "prompt_tokens": 89,
            "completion_tokens": 3,
            "total_tokens": 92,
            "prompt_tokens_details": {"cached_tokens": 64},
        },
    }


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


class Harness:
    """Starts fakes and proxies for one test and tears all of them down."""

    def __init__(self, loop_thread: LoopThread) -> None:
        self.lt = loop_thread
        self.events: list[tuple[str, str]] = []
        self.fakes: list[FakeInstance] = []
        self.proxies: list[ProxyServer] = []
        self.sockets: list[socket.socket] = []

    def fake(self, kind: str, status: int = 200) -> FakeInstance:
        instance = FakeInstance(vllm_answer(kind, status), name=kind, events=self.events)
        self.lt.run(instance.start())
        self.fakes.append(instance)
        return instance

    def dead_url(self) -> str:
        """A bound but never-listening port: connections to it are refused."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.sockets.append(sock)
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    def proxy(
        self,
        encoders: tuple[FakeInstance | str, ...] = (),
        prefills: tuple[FakeInstance | str, ...] = (),
        decodes: tuple[FakeInstance | str, ...] = (),
        faults: ProxyFaults | None = None,
        generation: ProtocolGeneration = NEWEST,
    ) -> tuple[EPDProxy, ProxyServer]:
        def urls(items: tuple[FakeInstance | str, ...]) -> tuple[str, ...]:
            return tuple(i if isinstance(i, str) else i.url for i in items)

        routes = ProxyRoutes(urls(encoders), urls(prefills), urls(decodes))
        proxy = EPDProxy(routes, faults, generation)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        server = ProxyServer(proxy, sock).start()
        self.proxies.append(server)
        return proxy, server

    def close(self) -> None:
        for server in self.proxies:
            server.stop()
        for instance in self.fakes:
            self.lt.run(instance.stop())
        for sock in self.sockets:
            sock.close()


@pytest.fixture
def h(loop_thread: LoopThread) -> Iterator[Harness]:
    harness = Harness(loop_thread)
    yield harness
    harness.close()


def image_request(url: str = CAT, question: str = "What is in the image?") -> dict[str, Any]:
    return {
        "model": "epd-model",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": question},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
        **sampling_fields(max_tokens=3),
    }


def raw_post(url: str, body: dict[str, Any], request_id: str) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "x-request-id": request_id},
        method="POST",
    )
    try:
        with DIRECT.open(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def raw_get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with DIRECT.open(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


# --- encode -> prefill -> decode -------------------------------------------------------------


def test_full_epd_round_trip(h: Harness) -> None:
    encoder, prefill, decode = h.fake("encoder"), h.fake("prefill"), h.fake("decode")
    proxy, server = h.proxy((encoder,), (prefill,), (decode,))
    request = image_request()
    client = ChatClient(server.url, timeout_s=10)
    try:
        result = client.chat(request, request_id="req-epd-1")
    finally:
        client.close()

    # the encoder got the image alone, with the uuid the proxy chose
    expected_uuid = media_uuid(request["messages"][0]["content"][1])
    assert len(encoder.bodies) == 1
    assert encoder.bodies[0]["messages"] == [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": CAT}, "uuid": expected_uuid}],
        }
    ]
    # no max_tokens, as vLLM 0.28+'s proxy: the encoder stops once the media are encoded
    assert "max_tokens" not in encoder.bodies[0] and encoder.bodies[0]["stream"] is False
    assert encoder.request_ids == ["req-epd-1:0:encode"]
    ec_params = {expected_uuid: {"item_indices": [0], "metadata": {"image_grid_thw": [1, 16, 16]}}}
    embeds_part = {
        "type": "image_embeds",
        "image_embeds": {"image_grid_thw": [1, 16, 16]},
        "uuid": expected_uuid,
    }

    # prefill: metadata-only embeds, one token, asked to keep its KV for a remote decode
    assert len(prefill.bodies) == 1
    p_body = prefill.bodies[0]
    assert p_body["max_tokens"] == 1
    assert p_body["stream"] is False
    assert p_body["kv_transfer_params"]["do_remote_decode"] is True
    assert p_body["kv_transfer_params"]["do_remote_prefill"] is False
    assert p_body["messages"][0]["content"][1] == embeds_part
    assert p_body["ec_transfer_params"] == ec_params
    assert prefill.request_ids == ["req-epd-1"]

    # decode: the same rewritten body, the client's length, and P's KV coordinates
    assert len(decode.bodies) == 1
    d_body = decode.bodies[0]
    assert d_body["messages"][0]["content"] == [
        {"type": "text", "text": "What is in the image?"},
        embeds_part,
    ]
    assert d_body["ec_transfer_params"] == ec_params
    assert d_body["kv_transfer_params"] == PREFILL_KV_PARAMS
    assert d_body["max_tokens"] == 3
    assert d_body["return_token_ids"] is True
    assert d_body["return_tokens_as_token_ids"] is True
    assert decode.request_ids == ["req-epd-1"]
    assert [kind for kind, _ in h.events] == ["encoder", "prefill", "decode"]

    # the client's result is the decode's answer
    assert isinstance(result, ChatResult)
    assert result.token_ids == (11, 22, 33)
    assert result.prompt_token_ids == tuple(PROMPT_IDS)
    assert [p.token_id for p in result.logprobs] == [11, 22, 33]
    assert [p.top_ids() for p in result.logprobs] == [{11, 12}, {22, 23}, {33, 34}]
    assert result.cached_tokens == 64
    assert result.text == "a cat!"

    # the trace is the evidence the guards read
    trace = proxy.traces["req-epd-1"]
    assert trace.media_count == 1
    assert [(c.url, c.positions, c.status) for c in trace.encoder_calls] == [
        (encoder.url, (0,), 200)
    ]
    assert trace.encoder_calls[0].ec_transfer_params == ec_params
    assert trace.forwarded_part_types == ["image_embeds"]
    assert trace.metadata_only == [True]
    assert trace.prefill_url == prefill.url
    assert trace.prefill_status == 200
    assert trace.prefill_kv_transfer_params == PREFILL_KV_PARAMS
    assert trace.decode_url == decode.url
    assert trace.decode_status == 200
    assert trace.error is None
    assert json.loads(json.dumps(trace.to_json()))["encoder_calls"][0]["url"] == encoder.url


def test_pd_topology_has_no_prefill_leg(h: Harness) -> None:
    encoder, pd = h.fake("encoder"), h.fake("decode")
    proxy, server = h.proxy((encoder,), (), (pd,))
    status, body = raw_post(server.url, image_request(), "req-pd")
    assert status == 200
    assert body["choices"][0]["token_ids"] == DECODE_TOKENS
    assert "kv_transfer_params" not in pd.bodies[0]
    assert pd.bodies[0]["messages"][0]["content"][1]["type"] == "image_embeds"
    trace = proxy.traces["req-pd"]
    assert trace.prefill_url is None and trace.prefill_kv_transfer_params is None


def test_text_only_request_skips_the_encoder(h: Harness) -> None:
    encoder, prefill, decode = h.fake("encoder"), h.fake("prefill"), h.fake("decode")
    proxy, server = h.proxy((encoder,), (prefill,), (decode,))
    request = {
        "model": "epd-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    }
    status, _ = raw_post(server.url, request, "req-text")
    assert status == 200
    assert encoder.bodies == []
    assert "ec_transfer_params" not in decode.bodies[0]
    assert decode.bodies[0]["messages"] == request["messages"]
    assert proxy.traces["req-text"].media_count == 0
    assert proxy.traces["req-text"].encoder_calls == []


def test_streaming_passes_decode_chunks_through(h: Harness) -> None:
    encoder, prefill, decode = h.fake("encoder"), h.fake("prefill"), h.fake("decode")
    _, server = h.proxy((encoder,), (prefill,), (decode,))
    body = {**image_request(), "stream": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(
        f"{server.url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with DIRECT.open(request, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        text = response.read().decode()
    lines = [line for line in text.split("\n") if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert [json.loads(line[6:])["choices"][0]["delta"]["content"] for line in lines[:-1]] == [
        "Hel",
        "lo",
    ]
    assert prefill.bodies[0]["stream"] is False
    assert "stream_options" not in prefill.bodies[0]
    assert decode.bodies[0]["stream"] is True
    assert decode.bodies[0]["stream_options"] == {"include_usage": True}


# --- failures --------------------------------------------------------------------------------


def test_encoder_error_becomes_502_naming_the_encoder(h: Harness) -> None:
    encoder, prefill, decode = h.fake("encoder", status=500), h.fake("prefill"), h.fake("decode")
    proxy, server = h.proxy((encoder,), (prefill,), (decode,))
    status, body = raw_post(server.url, image_request(), "req-enc-500")
    assert status == 502
    assert body["error"]["stage"] == "encoder"
    assert body["error"]["url"] == encoder.url
    assert body["error"]["status"] == 500
    assert "encoder exploded" in body["error"]["message"]
    assert len(encoder.bodies) == 1
    assert prefill.bodies == []
    assert decode.bodies == []
    trace = proxy.traces["req-enc-500"]
    assert encoder.url in trace.error and "500" in trace.error
    assert trace.decode_url is None


@pytest.mark.parametrize("stage", ["encoder", "prefill"])
def test_a_4xx_refusal_of_e_or_p_becomes_502_and_reaches_no_later_hop(
    h: Harness, stage: str
) -> None:
    """Any status but 200 is the hop's failure, a 4xx too: an error object read as the answer
    left the media raw (no ec_transfer_params) or D without KV coordinates (it computes the
    prompt itself), and the case passed through a hop that had refused it."""
    encoder = h.fake("encoder", status=400 if stage == "encoder" else 200)
    prefill = h.fake("prefill", status=400 if stage == "prefill" else 200)
    decode = h.fake("decode")
    _, server = h.proxy((encoder,), (prefill,), (decode,))
    status, body = raw_post(server.url, image_request(), f"req-{stage}-400")
    assert status == 502, body
    assert (body["error"]["stage"], body["error"]["status"]) == (stage, 400), body
    assert decode.bodies == []


def test_unreachable_decode_becomes_502(h: Harness) -> None:
    encoder, prefill = h.fake("encoder"), h.fake("prefill")
    dead = h.dead_url()
    _, server = h.proxy((encoder,), (prefill,), (dead,))
    status, body = raw_post(server.url, image_request(), "req-dead-d")
    assert status == 502
    assert body["error"]["stage"] == "decode"
    assert body["error"]["url"] == dead
    assert body["error"]["status"] is None
    assert len(prefill.bodies) == 1


def test_decode_error_status_is_passed_through(h: Harness) -> None:
    decode = h.fake("decode", status=400)
    proxy, server = h.proxy((), (), (decode,))
    status, body = raw_post(server.url, image_request(), "req-d-400")
    assert status == 400
    assert body["message"] == "decode exploded"
    trace = proxy.traces["req-d-400"]
    assert trace.decode_status == 400
    assert trace.error.startswith(f"decode {decode.url} answered 400")


def test_non_json_request_is_400(h: Harness) -> None:
    decode = h.fake("decode")
    proxy, server = h.proxy((), (), (decode,))
    request = urllib.request.Request(
        f"{server.url}/v1/chat/completions",
        data=b"{not json",
        headers={"x-request-id": "req-bad"},
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        DIRECT.open(request, timeout=10)
    assert info.value.code == 400
    assert "not JSON" in json.loads(info.value.read())["error"]
    assert decode.bodies == []
    assert proxy.traces["req-bad"].error.startswith("request body is not JSON")


# --- health ----------------------------------------------------------------------------------


def test_health_is_503_when_one_upstream_is_down(h: Harness) -> None:
    encoder, decode = h.fake("encoder"), h.fake("decode")
    dead = h.dead_url()
    _, server = h.proxy((encoder,), (dead,), (decode,))
    status, body = raw_get(f"{server.url}/health")
    assert status == 503
    assert body == {"instances": {encoder.url: True, dead: False, decode.url: True}}


def test_health_is_200_when_all_answer(h: Harness) -> None:
    encoder, prefill, decode = h.fake("encoder"), h.fake("prefill"), h.fake("decode")
    _, server = h.proxy((encoder,), (prefill,), (decode,))
    status, body = raw_get(f"{server.url}/health")
    assert status == 200
    assert body == {"instances": {encoder.url: True, prefill.url: True, decode.url: True}}


# --- round robin and faults ------------------------------------------------------------------


def test_two_encoders_share_single_image_requests(h: Harness) -> None:
    e0, e1, pd = h.fake("encoder"), h.fake("encoder"), h.fake("decode")
    proxy, server = h.proxy((e0, e1), (), (pd,))
    for n, url in enumerate((CAT, DOG, CAT)):
        status, _ = raw_post(server.url, image_request(url), f"req-rr-{n}")
        assert status == 200
    assert len(e0.bodies) == 2
    assert len(e1.bodies) == 1
    assert [proxy.traces[f"req-rr-{n}"].encoder_calls[0].url for n in range(3)] == [
        e0.url,
        e1.url,
        e0.url,
    ]
    assert [b["messages"][0]["content"][0]["image_url"]["url"] for b in e0.bodies] == [CAT, CAT]
    assert all(proxy.traces[f"req-rr-{n}"].metadata_only == [True] for n in range(3))


def test_two_images_on_two_encoders_in_one_request(h: Harness) -> None:
    e0, e1, pd = h.fake("encoder"), h.fake("encoder"), h.fake("decode")
    proxy, server = h.proxy((e0, e1), (), (pd,))
    request = image_request(CAT)
    request["messages"][0]["content"].append({"type": "image_url", "image_url": {"url": DOG}})
    status, _ = raw_post(server.url, request, "req-two")
    assert status == 200
    assert len(e0.bodies) == 1 and len(e1.bodies) == 1
    parts = pd.bodies[0]["messages"][0]["content"]
    cat_uuid = e0.bodies[0]["messages"][0]["content"][0]["uuid"]
    dog_uuid = e1.bodies[0]["messages"][0]["content"][0]["uuid"]
    assert cat_uuid != dog_uuid
    assert [p.get("uuid") for p in parts] == [None, cat_uuid, dog_uuid]
    assert set(pd.bodies[0]["ec_transfer_params"]) == {cat_uuid, dog_uuid}
    trace = proxy.traces["req-two"]
    assert sorted((c.url, c.positions) for c in trace.encoder_calls) == sorted(
        [(e0.url, (0,)), (e1.url, (1,))]
    )
    assert trace.metadata_only == [True, True]


def test_drop_encoder_metadata_sends_raw_media_to_decode(h: Harness) -> None:
    encoder, prefill, decode = h.fake("encoder"), h.fake("prefill"), h.fake("decode")
    proxy, server = h.proxy(
        (encoder,), (prefill,), (decode,), faults=ProxyFaults(drop_encoder_metadata=True)
    )
    request = image_request()
    status, _ = raw_post(server.url, request, "req-drop")
    assert status == 200
    assert len(encoder.bodies) == 1  # the encoder still ran
    d_body = decode.bodies[0]
    assert d_body["messages"] == request["messages"]  # raw image_url, no uuid added
    assert d_body["messages"][0]["content"][1] == {"type": "image_url", "image_url": {"url": CAT}}
    assert "ec_transfer_params" not in d_body
    assert d_body["kv_transfer_params"] == PREFILL_KV_PARAMS
    trace = proxy.traces["req-drop"]
    assert trace.metadata_only == [False]
    assert trace.forwarded_part_types == ["image_url"]
    assert len(trace.encoder_calls) == 1  # what the encoder said is still on record


def test_fault_hooks_see_encoder_params_and_prefill_response(h: Harness) -> None:
    seen: list[tuple[str, str, Any]] = []
    faults = ProxyFaults(
        after_encode=lambda rid, params: seen.append(("encode", rid, params)),
        after_prefill=lambda rid, resp: seen.append(("prefill", rid, resp["kv_transfer_params"])),
    )
    encoder, prefill, decode = h.fake("encoder"), h.fake("prefill"), h.fake("decode")
    _, server = h.proxy((encoder,), (prefill,), (decode,), faults=faults)
    request = image_request()
    status, _ = raw_post(server.url, request, "req-hooks")
    assert status == 200
    uuid = media_uuid(request["messages"][0]["content"][1])
    assert seen == [
        (
            "encode",
            "req-hooks",
            {uuid: {"item_indices": [0], "metadata": {"image_grid_thw": [1, 16, 16]}}},
        ),
        ("prefill", "req-hooks", PREFILL_KV_PARAMS),
    ]


def test_an_entry_rewritten_in_after_encode_reaches_the_consumer(h: Harness) -> None:
    """The graded position fault rewrites the encoder's metadata in place; the consumer must be
    told the rewritten value (a copy taken before the hook would silently drop the fault:
    CI once saw the planted video-grid error come out MATCH)."""

    def regrid(request_id: str, params: dict[str, Any]) -> None:
        for entry in params.values():
            entry["metadata"]["image_grid_thw"] = [2, 8, 16]

    encoder, prefill, decode = h.fake("encoder"), h.fake("prefill"), h.fake("decode")
    _, server = h.proxy((encoder,), (prefill,), (decode,), faults=ProxyFaults(after_encode=regrid))
    status, _ = raw_post(server.url, image_request(), "req-regrid")
    assert status == 200
    for consumer in (prefill, decode):
        part = consumer.bodies[0]["messages"][0]["content"][1]
        assert part["type"] == "image_embeds", part
        assert part["image_embeds"]["image_grid_thw"] == [2, 8, 16], part


# --- older protocol generations -------------------------------------------------------------


def test_an_encoder_answer_of_another_generation_is_recorded_with_its_cause(h: Harness) -> None:
    """0.28's list answer once crashed a 0.32 proxy with an empty error: now the cause is said."""
    encoder, decode = h.fake("encoder-ec-items"), h.fake("decode")
    proxy, server = h.proxy((encoder,), (), (decode,))
    status, body = raw_post(server.url, image_request(), "req-gen")
    assert status == 500 and body["error"]["stage"] == "proxy"
    trace = proxy.traces["req-gen"]
    assert trace.error and "EncoderAnswerError" in trace.error and "ec_items" in trace.error
    assert body["error"]["message"] == trace.error
    assert decode.bodies == []


# The ec-items rewrite serialises metadata with torch: there in the CPU environment, as for
# every process test.
def test_the_ec_items_generation_rewrites_one_image_per_sub_request(h: Harness) -> None:
    import base64
    import io

    import torch

    encoder, decode = h.fake("encoder-ec-items"), h.fake("decode")
    proxy, server = h.proxy((encoder,), (), (decode,), generation=GENERATIONS_BY_NAME["ec-items"])
    request = image_request()
    request["messages"][0]["content"].append({"type": "image_url", "image_url": {"url": DOG}})
    status, _ = raw_post(server.url, request, "req-items")
    assert status == 200, proxy.traces["req-items"].error
    assert [len(b["messages"][0]["content"]) for b in encoder.bodies] == [1, 1]
    parts = decode.bodies[0]["messages"][0]["content"]
    embeds = [p for p in parts if p["type"] == "image_embeds"]
    assert len(embeds) == 2
    for part in embeds:  # what 0.28's parse_image_embeds reads: base64 of torch.save(tensor)
        raw = base64.b64decode(part["image_embeds"]["image_grid_thw"])
        tensor = torch.load(io.BytesIO(raw), weights_only=True)
        assert tensor.tolist() == [[1, 16, 16]] and tensor.dtype == torch.int64
    assert len(decode.bodies[0]["ec_transfer_params"]["ec_items"]) == 2
    assert proxy.traces["req-items"].metadata_only == [True, True]


@pytest.mark.parametrize(
    "broken", [b"[]", b"null", b'{"id": "\xff"}'], ids=["list", "null", "bytes"]
)
def test_a_broken_200_answer_of_p_becomes_502_naming_p(h: Harness, broken: bytes) -> None:
    """P answers 200 with a body that is no JSON object (or no text): the proxy cannot read its
    KV coordinates, and says which hop sent it. It was a 500 of stage `proxy` naming no hop."""
    prefill = FakeInstance(lambda body: Reply(broken), name="prefill")
    h.lt.run(prefill.start())
    h.fakes.append(prefill)
    decode = h.fake("decode")
    proxy, server = h.proxy((), (prefill,), (decode,))
    status, body = raw_post(server.url, image_request(), "req-p-broken")
    assert (status, body["error"]["stage"]) == (502, "prefill"), body
    assert body["error"]["url"] == prefill.url
    assert body["error"]["status"] == 200
    assert decode.bodies == []
    assert proxy.traces["req-p-broken"].error.startswith(f"prefill {prefill.url} answered 200")


def test_an_encoder_failure_abandons_the_other_encoders_sub_requests(h: Harness) -> None:
    """Two images on two encoders; the first answers 500 at once, the second slowly. The case
    ends with the 502, and the proxy lets go of the second encoder's call then (its connection
    closed, as an engine sees an abandoned request). Found in review: the call ran on after the
    case had ended, into the next case's window (its EC file written there), its trace filled
    in after the outcome held it."""
    import time

    def slow_answer(body: dict[str, Any]) -> Reply:
        answer = json.dumps(encoder_answer(body)).encode()
        return Reply([answer[:10], answer[10:]], chunk_delay_s=0.5)

    failing, slow = h.fake("encoder", status=500), FakeInstance(slow_answer, name="slow")
    h.lt.run(slow.start())
    h.fakes.append(slow)
    decode = h.fake("decode")
    proxy, server = h.proxy((failing, slow), (), (decode,))
    request = image_request(CAT)
    request["messages"][0]["content"].append({"type": "image_url", "image_url": {"url": DOG}})
    status, body = raw_post(server.url, request, "req-enc-abandon")
    assert (status, body["error"]["url"]) == (502, failing.url)
    trace = proxy.traces["req-enc-abandon"]
    time.sleep(1.5)  # the slow encoder's answer would have been read by now
    assert [call.status for call in trace.encoder_calls] == [None, None]


def answering(params: Any) -> Answer:
    """An encoder that answers 200 with these ec_transfer_params, whatever it was sent."""
    return lambda body: {**encoder_answer(body), "ec_transfer_params": params}


@pytest.mark.parametrize(
    "generation, params, cause",
    [
        ("by-hash-indexed", {"h": {"item_indices": [3], "metadata": {"x": 1}}}, "item index 3"),
        ("by-hash-indexed", {"h": {"item_indices": ["0"], "metadata": {"x": 1}}}, "item index"),
        (
            "ec-items",
            {"ec_items": [{"mm_hash": "a", "x": 1}, {"mm_hash": "b", "x": 2}]},
            "2 entries with metadata for one item",
        ),
        (
            "by-hash-indexed",
            {
                "a": {"item_indices": [0], "metadata": {"x": 1}},
                "b": {"item_indices": [0], "metadata": {"x": 2}},
            },
            "both have metadata for item 0",
        ),
        ("by-hash-indexed", {"h": {"item_indices": 0, "metadata": {"x": 1}}}, "item_indices"),
        ("by-hash-indexed", {"h": {"item_indices": [0], "metadata": [1]}}, "metadata"),
        ("by-hash-indexed", {"h": [0]}, "is not an object"),
        ("by-hash", {"h": {"metadata": [1]}}, "metadata"),
        ("by-hash", {"h": [0]}, "is not an object"),
    ],
    ids=[
        "index-past-items",
        "index-not-a-number",
        "two-ec-items-for-one",
        "two-entries-for-one-item",
        "indices-not-a-list",
        "metadata-not-an-object",
        "entry-not-an-object",
        "by-hash-metadata-not-an-object",
        "by-hash-entry-not-an-object",
    ],
)
def test_an_encoder_answer_that_does_not_fit_its_request_becomes_502_naming_the_encoder(
    h: Harness, generation: str, params: dict[str, Any], cause: str
) -> None:
    """The encoder answers items its sub-request did not hold (of the generation's shape all
    the same): its broken answer, said of its hop. It was a 500 of stage `proxy`, "proxy
    failed: ValueError: encoder reported item index 3 ...", blaming the harness's proxy."""
    encoder = FakeInstance(answering(params), name="encoder")
    h.lt.run(encoder.start())
    h.fakes.append(encoder)
    decode = h.fake("decode")
    proxy, server = h.proxy((encoder,), (), (decode,), generation=GENERATIONS_BY_NAME[generation])
    status, body = raw_post(server.url, image_request(), "req-e-unfit")
    assert (status, body["error"]["stage"]) == (502, "encoder"), body
    assert (body["error"]["url"], body["error"]["status"]) == (encoder.url, 200)
    assert cause in body["error"]["message"], body
    assert decode.bodies == []
    assert proxy.traces["req-e-unfit"].error.startswith(f"encoder {encoder.url} answered 200")


@pytest.mark.parametrize("generation", ["by-hash-indexed", "ec-items"])
@pytest.mark.parametrize("params", [[], "h", 7], ids=["list", "string", "number"])
def test_an_encoder_answer_whose_ec_transfer_params_are_no_object_becomes_502(
    h: Harness, generation: str, params: Any
) -> None:
    """ec_transfer_params that are no JSON object are no generation's answer: a broken answer
    of the encoder. Merged before they were read, they failed as the proxy's own 500 ("proxy
    failed: AttributeError: 'list' object has no attribute 'get'")."""
    encoder = FakeInstance(answering(params), name="encoder")
    h.lt.run(encoder.start())
    h.fakes.append(encoder)
    decode = h.fake("decode")
    proxy, server = h.proxy((encoder,), (), (decode,), generation=GENERATIONS_BY_NAME[generation])
    status, body = raw_post(server.url, image_request(), "req-e-params")
    assert (status, body["error"]["stage"]) == (502, "encoder"), body
    assert (body["error"]["url"], body["error"]["status"]) == (encoder.url, 200)
    assert "ec_transfer_params" in body["error"]["message"], body
    assert decode.bodies == []


@pytest.mark.parametrize("kv_params", [[1, 2], "p0", 7], ids=["list", "string", "number"])
def test_a_prefill_answer_whose_kv_transfer_params_are_no_object_becomes_502_naming_p(
    h: Harness, kv_params: Any
) -> None:
    """P's kv_transfer_params that are no JSON object are no KV coordinates: P's broken answer.
    They were handed to D as they came, so the case failed (if at all) as D's refusal."""
    answer = vllm_answer("prefill")
    prefill = FakeInstance(
        lambda body: {**answer(body), "kv_transfer_params": kv_params}, name="prefill"
    )
    h.lt.run(prefill.start())
    h.fakes.append(prefill)
    decode = h.fake("decode")
    _, server = h.proxy((), (prefill,), (decode,))
    status, body = raw_post(server.url, image_request(), "req-p-kv")
    assert (status, body.get("error", {}).get("stage")) == (502, "prefill"), body
    assert (body["error"]["url"], body["error"]["status"]) == (prefill.url, 200)
    assert "kv_transfer_params" in body["error"]["message"], body
    assert decode.bodies == []
