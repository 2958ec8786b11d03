"""Recording taps (harness/serve/tap.py) against fake instances on loopback.

The fakes (harness/testing/fake_instance.py) keep the exact bytes they received and answer
with exact bytes (JSON, or an event stream in chunks), so the tests can show that a tap is
transparent: bytes in == bytes out in both directions. Then what the tap records, and the planted
faults that act at taps.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.judge.guards import TransferEvidence, check_consumer_embeds, check_encoder_output
from harness.outcomes.taps import TapRecord, records_of
from harness.serve.proxy import ProxyFaults
from harness.serve.tap import TapSet, TapTarget, describe_answer, is_metadata_only
from harness.testing.fake_instance import FakeInstance, LoopThread, Reply

pytestmark = pytest.mark.process

DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
# Deliberately not what json.dumps would write: odd spacing, key order, a non-ASCII byte.
ENCODER_ANSWER = (
    b'{"id":"x",  "ec_transfer_params": {"h1": {"item_indices": [0], '
    b'"metadata": {"image_grid_thw": [1, 4, 4]}}}, "note": "caf\xc3\xa9"}'
)
DECODE_ANSWER = (
    b'{"choices": [], "usage": {"prompt_tokens": 40, "prompt_tokens_details": '
    b'{"cached_tokens": 32}}, "kv_transfer_params": null}'
)
STREAM_CHUNKS = [
    b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n',
    b'data: {"choices": [], "usage": {"prompt_tokens": 9, "prompt_tokens_details": '
    b'{"cached_tokens": 8}}}\n\n',
    b"data: [DONE]\n\n",
]


def answering(answer: bytes):
    """Exact `answer` bytes, or STREAM_CHUNKS for a stream request."""
    return lambda body: Reply(STREAM_CHUNKS, chunk_delay_s=0.01) if body.get("stream") else answer


@pytest.fixture
def fakes() -> Iterator[dict[str, Any]]:
    loop = LoopThread()
    instances = {
        "encoder": FakeInstance(answering(ENCODER_ANSWER)),
        "pd": FakeInstance(answering(DECODE_ANSWER)),
    }
    for fake in instances.values():
        loop.run(fake.start())
    yield {"instances": instances, "urls": {role: fake.url for role, fake in instances.items()}}
    for fake in instances.values():
        loop.run(fake.stop())
    loop.close()


def taps_for(fakes: dict[str, Any], faults: ProxyFaults | None = None) -> TapSet:
    targets = [TapTarget(f"x/{role}", role, url) for role, url in fakes["urls"].items()]
    return TapSet(targets, faults).start("127.0.0.1")


def post(url: str, body: bytes) -> tuple[int, bytes, str]:
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with DIRECT.open(request, timeout=10) as response:
        return response.status, response.read(), response.headers.get("Content-Type", "")


def chat_bytes(parts: list[dict[str, Any]], **extra: Any) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": parts}], **extra}
    # Odd spacing on purpose: a tap that re-serialized would change these bytes.
    return json.dumps(body, indent=3, ensure_ascii=False).encode()


IMAGE = {"type": "image_url", "image_url": {"url": "file:///cat.png"}, "uuid": "u1"}
EMBEDS = {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 4, 4]}, "uuid": "u1"}


def test_bodies_pass_byte_for_byte_both_ways(fakes: dict[str, Any]) -> None:
    sent = chat_bytes([{"type": "text", "text": "héllo"}, IMAGE], max_tokens=1)
    with taps_for(fakes) as taps:
        status, answered, _ = post(taps.urls["x/encoder"], sent)
    assert status == 200
    assert fakes["instances"]["encoder"].received == [sent]
    assert answered == ENCODER_ANSWER


def test_a_streamed_answer_passes_byte_for_byte_and_is_recorded(fakes: dict[str, Any]) -> None:
    sent = chat_bytes([EMBEDS], stream=True)
    with taps_for(fakes) as taps:
        status, answered, content_type = post(taps.urls["x/pd"], sent)
        [record] = taps.records
    assert status == 200 and "text/event-stream" in content_type
    assert fakes["instances"]["pd"].received == [sent]
    assert answered == b"".join(STREAM_CHUNKS)
    assert record.streamed and record.cached_tokens == 8


def test_a_streamed_record_is_whole_before_the_stream_ends_downstream(
    fakes: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session reads a request's records as soon as its answer is whole, so the tap must
    have read D's stream into the record before it ends the stream: it did so after, and a
    slow read (a loaded host) left the guards D's record without its usage (cached_tokens
    None: a kv_transfer failed that held)."""
    from harness.serve import tap as tap_module

    described = tap_module.describe_answer

    def slow_describe(*args: Any) -> Any:
        time.sleep(0.3)
        return described(*args)

    monkeypatch.setattr(tap_module, "describe_answer", slow_describe)
    sent = chat_bytes([EMBEDS], stream=True)
    with taps_for(fakes) as taps:
        post(taps.urls["x/pd"], sent)
        [record] = taps.records
        seen = (record.ended, record.streamed, record.cached_tokens)
    assert seen == (True, True, 8)


def test_the_record_holds_what_the_instance_was_sent_and_answered(fakes: dict[str, Any]) -> None:
    kv = {"do_remote_prefill": True, "remote_block_ids": [1]}
    with taps_for(fakes) as taps:
        mark = taps.mark()
        post(taps.urls["x/encoder"], chat_bytes([IMAGE]))
        post(
            taps.urls["x/pd"],
            chat_bytes([EMBEDS], ec_transfer_params={"h1": {}}, kv_transfer_params=kv),
        )
        encoder, consumer = taps.since(mark)
        assert taps.since(taps.mark()) == []
    assert (encoder.instance, encoder.status, encoder.part_types) == (
        "x/encoder",
        200,
        ["image_url"],
    )
    assert encoder.ec_transfer_params == json.loads(ENCODER_ANSWER)["ec_transfer_params"]
    assert consumer.part_types == ["image_embeds"] and consumer.metadata_only == [True]
    assert consumer.uuids == ["u1"]
    assert consumer.sent_ec_transfer_params == {"h1": {}}
    assert consumer.sent_kv_transfer_params == kv
    assert consumer.cached_tokens == 32


def test_guards_read_from_tap_records(fakes: dict[str, Any], tmp_path: Any) -> None:
    (tmp_path / "h1").mkdir()
    (tmp_path / "h1" / "encoder_cache.safetensors").write_bytes(b"x")
    with taps_for(fakes) as taps:
        post(taps.urls["x/encoder"], chat_bytes([IMAGE]))
        post(taps.urls["x/pd"], chat_bytes([EMBEDS]))
        good = TransferEvidence.from_taps(taps.since(0), media_count=1)
        post(taps.urls["x/pd"], chat_bytes([IMAGE]))  # a consumer that got raw media
        raw = TransferEvidence.from_taps(taps.since(0), media_count=1)
    assert check_encoder_output(good, tmp_path).ok
    assert check_consumer_embeds(good).ok
    assert good.decode_cached_tokens == 32
    assert not check_consumer_embeds(raw).ok
    assert not check_encoder_output(good, tmp_path / "elsewhere").ok


def test_drop_metadata_planted_at_the_tap_gives_the_consumer_raw_media(
    fakes: dict[str, Any],
) -> None:
    with taps_for(fakes, ProxyFaults(drop_encoder_metadata=True)) as taps:
        post(taps.urls["x/encoder"], chat_bytes([IMAGE]))
        post(taps.urls["x/pd"], chat_bytes([EMBEDS], ec_transfer_params={"h1": {}}))
        consumer = taps.records[-1]
    got = json.loads(fakes["instances"]["pd"].received[-1])
    assert got["messages"][0]["content"] == [IMAGE]
    assert "ec_transfer_params" not in got
    assert consumer.rewritten_by_fault and consumer.part_types == ["image_url"]
    assert not check_consumer_embeds(TransferEvidence.from_taps([consumer], 1)).ok


def test_raw_media_are_kept_only_while_the_fault_that_needs_them_is_planted(
    fakes: dict[str, Any],
) -> None:
    """Every distinct medium an encoder was sent (its base64 in a real run) was kept for the
    tap's life, for a fault a soak never plants."""
    faults = ProxyFaults()
    with taps_for(fakes, faults) as taps:
        post(taps.urls["x/encoder"], chat_bytes([IMAGE]))
        assert taps.raw_parts == {}
        faults.drop_encoder_metadata = True
        post(taps.urls["x/encoder"], chat_bytes([IMAGE]))
        assert taps.raw_parts == {"u1": IMAGE}
        faults.drop_encoder_metadata = False
        post(taps.urls["x/encoder"], chat_bytes([IMAGE]))
        assert taps.raw_parts == {}


def test_records_older_than_every_open_mark_are_dropped_when_a_mark_is_released(
    fakes: dict[str, Any],
) -> None:
    """A soak sends requests for hours: records nobody can ask for any more must go."""
    with taps_for(fakes) as taps:
        first = taps.mark()
        post(taps.urls["x/encoder"], chat_bytes([IMAGE]))
        second = taps.mark()  # a request in flight beside the first
        post(taps.urls["x/pd"], chat_bytes([EMBEDS]))
        taps.release(first)
        assert [r.instance for r in taps.since(second)] == ["x/pd"]
        assert [r.instance for r in taps.records] == ["x/pd"]  # the first's record went
        post(taps.urls["x/pd"], chat_bytes([EMBEDS]))
        assert len(taps.since(second)) == 2  # an open mark keeps what came after it
        taps.release(second)
        assert taps.records == []
        twice = taps.mark()
        assert taps.mark() == twice  # two requests may hold the same position
        post(taps.urls["x/encoder"], chat_bytes([IMAGE]))
        taps.release(twice)
        assert len(taps.since(twice)) == 1  # the other holder still reads it
        taps.release(twice)
        assert taps.records == []


def test_a_mark_released_before_an_older_one_keeps_what_the_older_still_reads(
    fakes: dict[str, Any],
) -> None:
    """Requests in flight together end in any order: the later one's release must not drop
    the records the earlier one, still open, will read as its evidence."""
    with taps_for(fakes) as taps:
        older = taps.mark()
        post(taps.urls["x/encoder"], chat_bytes([IMAGE]))
        newer = taps.mark()
        post(taps.urls["x/pd"], chat_bytes([EMBEDS]))
        newest = taps.mark()
        taps.release(newer)
        assert [r.instance for r in taps.since(older)] == ["x/encoder", "x/pd"]
        taps.release(newest)
        taps.release(older)
        assert taps.records == []


def test_after_encode_runs_before_the_answer_leaves_the_tap(fakes: dict[str, Any]) -> None:
    seen: list[dict[str, Any]] = []
    faults = ProxyFaults(after_encode=lambda _rid, params: seen.append(params))
    with taps_for(fakes, faults) as taps:
        post(taps.urls["x/encoder"], chat_bytes([IMAGE]))
        assert seen == [json.loads(ENCODER_ANSWER)["ec_transfer_params"]]
        post(taps.urls["x/pd"], chat_bytes([EMBEDS]))
    assert len(seen) == 1  # only encoder answers


def test_after_prefill_runs_on_ps_answers_only(fakes: dict[str, Any]) -> None:
    """A KV fault acts on P's answer: an encoder's or a PD's answer passing its hook would
    count the fault as planted where no KV left P (and a withholding hook would strip them)."""
    seen: list[str] = []
    faults = ProxyFaults(after_prefill=lambda _rid, answer: seen.append(json.dumps(answer)))
    with taps_for(fakes, faults) as taps:
        _, from_encoder, _ = post(taps.urls["x/encoder"], chat_bytes([IMAGE]))
        _, from_pd, _ = post(taps.urls["x/pd"], chat_bytes([EMBEDS]))
    assert seen == []
    assert (from_encoder, from_pd) == (ENCODER_ANSWER, DECODE_ANSWER)


PREFILL_ANSWER = (
    b'{"choices": [],   "kv_transfer_params": {"do_remote_prefill": true, '
    b'"remote_block_ids": [[3, 4]], "remote_engine_id": "p0"}}'
)


@pytest.mark.parametrize("withhold", [False, True])
def test_what_ps_answer_hook_leaves_is_what_the_proxy_receives(withhold: bool) -> None:
    """Under vLLM's proxy a KV fault acts in P's tap: under NIXL it changes P's
    `kv_transfer_params`, so the proxy must get the answer as the hook left it (and the
    upstream bytes themselves when the hook changed nothing)."""
    from harness.run.faults.kv_files import drop_kv

    loop = LoopThread()
    prefill = FakeInstance(answering(PREFILL_ANSWER))
    loop.run(prefill.start())
    fault = drop_kv(Path("/nonexistent"), "NixlConnector") if withhold else None
    faults = fault or ProxyFaults(after_prefill=lambda _rid, answer: None)
    try:
        with TapSet([TapTarget("x/prefill", "prefill", prefill.url)], faults).start(
            "127.0.0.1"
        ) as taps:
            _, answered, _ = post(taps.urls["x/prefill"], chat_bytes([EMBEDS], max_tokens=1))
            [record] = taps.records
    finally:
        loop.run(prefill.stop())
        loop.close()
    if withhold:
        assert "kv_transfer_params" not in json.loads(answered), answered
        assert record.rewritten_by_fault and fault is not None and len(fault.effects) == 1
    else:
        assert answered == PREFILL_ANSWER and not record.rewritten_by_fault


def test_metadata_an_encoder_hook_rewrites_is_what_the_proxy_receives(
    fakes: dict[str, Any],
) -> None:
    """`ec-video-grid` tells the consumer another grid by rewriting the encoder's answer in
    place: through vLLM's proxy, the tap must pass that answer on, not the upstream bytes."""

    def regrid(_rid: str, params: dict[str, Any]) -> None:
        for entry in params.values():
            entry["metadata"]["image_grid_thw"] = [1, 2, 8]

    with taps_for(fakes, ProxyFaults(after_encode=regrid)) as taps:
        _, answered, _ = post(taps.urls["x/encoder"], chat_bytes([IMAGE]))
        [record] = taps.records
    [entry] = json.loads(answered)["ec_transfer_params"].values()
    assert entry["metadata"]["image_grid_thw"] == [1, 2, 8], answered
    assert record.rewritten_by_fault


def test_other_paths_pass_through_unrecorded(fakes: dict[str, Any]) -> None:
    with taps_for(fakes) as taps:
        with DIRECT.open(f"{taps.urls['x/pd']}/health", timeout=10) as response:
            assert response.status == 200
        assert taps.records == []


def test_records_of_one_request_leave_out_requests_in_flight_beside_it() -> None:
    def record(seq: int, request_id: str | None) -> TapRecord:
        return TapRecord(seq, "1E+1PD/encoder0", "encoder", "/v1/chat/completions", request_id)

    window = [
        record(0, "req-a:0:encode"),
        record(1, "req-b:0:1f2e3d"),  # vLLM's proxy: <parent>:<item>:<random>
        record(2, "req-a"),
        record(3, "req-b"),
        record(4, "req-ab"),  # a request whose id merely starts with "req-a"
    ]
    assert [r.seq for r in records_of(window, "req-a")] == [0, 2]
    assert [r.seq for r in records_of(window, "req-b")] == [1, 3]
    # A proxy that sets its own ids (vLLM's toy P/D proxy): the window is all there is.
    theirs = [record(5, "3f1c"), record(6, None)]
    assert records_of(theirs, "req-a") == theirs


def test_a_tap_set_whose_start_fails_stops_what_it_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The caller never gets a TapSet whose start raised, so it cannot stop it: found in
    review, its event-loop thread and the sockets it had bound lived as long as the process.
    The same holds for the harness's proxy server (`ProxyServer.start`)."""
    from aiohttp import web

    site_start, sites = web.SockSite.start, []

    async def second_site_fails(self) -> None:
        sites.append(self)
        if len(sites) == 2:
            raise OSError("the second tap's site did not start (planted)")
        await site_start(self)

    monkeypatch.setattr(web.SockSite, "start", second_site_fails)
    targets = [TapTarget(name, "pd", "http://127.0.0.1:9") for name in ("a", "b", "c")]
    taps = TapSet(targets)
    with pytest.raises(OSError, match="planted"):
        taps.start("127.0.0.1")
    assert not taps.running
    assert [sock for sock in taps._socks if sock.fileno() != -1] == []


def test_an_embeds_part_is_metadata_only_when_it_holds_a_dict_not_tensors() -> None:
    """The encoder's metadata is a dict; an `*_embeds` part whose value is a string carries
    the tensors themselves (a client's precomputed embeddings), which a consumer must not be
    judged as having been sent by an encoder."""
    metadata = {"type": "image_embeds", "image_embeds": {"mm_hash": "h1"}, "uuid": "u1"}
    tensors = {"type": "image_embeds", "image_embeds": "dGVuc29y", "uuid": "u1"}
    assert is_metadata_only(metadata)
    assert not is_metadata_only(tensors)
    assert not is_metadata_only({"type": "image_url", "image_url": {"url": "x"}})


def test_a_later_chunk_without_transfer_params_does_not_erase_the_earlier_ones() -> None:
    """A stream's chunks each carry the answer's fields, most of them empty (`null`): the
    record keeps the last one that said something, so D's or an encoder's params sent in one
    chunk are still the evidence when the next chunk says null."""
    kv = {"remote_block_ids": [1, 2], "remote_engine_id": "p0"}
    chunks = [
        {"choices": [], "kv_transfer_params": kv, "usage": None},
        {"choices": [], "kv_transfer_params": None, "ec_transfer_params": None, "usage": None},
    ]
    stream = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    record = TapRecord(0, "x/pd", "pd", "/v1/chat/completions")
    assert describe_answer(record, stream.encode(), "text/event-stream") is None
    assert record.streamed and record.kv_transfer_params == kv


def test_drop_metadata_leaves_a_consumer_request_without_metadata_as_it_was(
    fakes: dict[str, Any],
) -> None:
    """Under the planted `drop_encoder_metadata` a consumer sent no metadata-only part (raw
    media, text) has nothing to lose: its body passes byte for byte, its EC params too, and
    its record does not say the fault rewrote it (which the self-test reads as the fault
    having acted)."""
    sent = chat_bytes([IMAGE], ec_transfer_params={"h1": {}})
    with taps_for(fakes, ProxyFaults(drop_encoder_metadata=True)) as taps:
        post(taps.urls["x/encoder"], chat_bytes([IMAGE]))
        post(taps.urls["x/pd"], sent)
        consumer = taps.records[-1]
    assert fakes["instances"]["pd"].received[-1] == sent
    assert not consumer.rewritten_by_fault


TOKEN_STREAM = [
    b'data: {"choices": [{"index": 0, "token_ids": [5], "delta": {"content": "a"}}]}\n\n',
    b'data: {"choices": [{"index": 0, "token_ids": [6], "delta": {"content": "b"}}]}\n\n',
    b"data: [DONE]\n\n",
]


def test_the_first_token_chunk_fault_acts_on_ds_stream_only_and_is_said_only_where_it_acted(
    fakes: dict[str, Any],
) -> None:
    """`duplicate_first_token_chunk` stands for a D that repeats its first tokens: another
    role's stream (a P asked to stream) passes byte for byte, and a D stream with no event
    carrying tokens is not rewritten, so neither record says the fault acted."""
    loop = LoopThread()
    prefill = FakeInstance(lambda body: Reply(TOKEN_STREAM))
    loop.run(prefill.start())
    targets = [
        TapTarget("x/prefill", "prefill", prefill.url),
        TapTarget("x/decode", "decode", fakes["urls"]["pd"]),
    ]
    try:
        taps = TapSet(targets, ProxyFaults(duplicate_first_token_chunk=True)).start("127.0.0.1")
        with taps:
            _, from_p, _ = post(taps.urls["x/prefill"], chat_bytes([EMBEDS], stream=True))
            _, from_d, _ = post(taps.urls["x/decode"], chat_bytes([EMBEDS], stream=True))
            by_instance = {r.instance: r for r in taps.records}
    finally:
        loop.run(prefill.stop())
        loop.close()
    assert from_p == b"".join(TOKEN_STREAM)
    assert from_d == b"".join(STREAM_CHUNKS)  # no event of it carries token ids
    assert not by_instance["x/prefill"].rewritten_by_fault
    assert not by_instance["x/decode"].rewritten_by_fault


def test_the_first_token_chunk_fault_acts_on_the_stream_of_d_and_of_pd() -> None:
    """The client's stream comes from D, or from PD on 1E+1PD: the fault must act on both (a
    review's mutant dropping PD left a 1E+1PD self-test whose fault acted on nothing)."""
    loop = LoopThread()
    server = FakeInstance(lambda body: Reply(TOKEN_STREAM))
    loop.run(server.start())
    targets = [TapTarget(f"x/{role}", role, server.url) for role in ("pd", "decode")]
    try:
        taps = TapSet(targets, ProxyFaults(duplicate_first_token_chunk=True)).start("127.0.0.1")
        with taps:
            answers = {
                role: post(taps.urls[f"x/{role}"], chat_bytes([EMBEDS], stream=True))[1]
                for role in ("pd", "decode")
            }
            by_instance = {r.instance: r for r in taps.records}
    finally:
        loop.run(server.stop())
        loop.close()
    for role in ("pd", "decode"):
        assert by_instance[f"x/{role}"].rewritten_by_fault, role
        assert answers[role].count(TOKEN_STREAM[0]) == 2, answers[role]


def test_an_error_answer_of_p_passes_unhooked() -> None:
    """P's answer hooks (a KV fault under NIXL) act on a 200 answer: an error answer has no
    KV to misroute, and a hook run on it would count the fault as planted on a request P
    refused."""
    error = b'{"error": {"message": "no",   "type": "BadRequestError"}, "kv_transfer_params": {}}'
    hooked: list[str] = []
    loop = LoopThread()
    prefill = FakeInstance(lambda body: Reply(error, status=400))
    loop.run(prefill.start())
    faults = ProxyFaults(after_prefill=lambda rid, answer: hooked.append(rid))
    try:
        with TapSet([TapTarget("x/prefill", "prefill", prefill.url)], faults).start(
            "127.0.0.1"
        ) as taps:
            with pytest.raises(urllib.error.HTTPError) as refused:
                post(taps.urls["x/prefill"], chat_bytes([EMBEDS], max_tokens=1))
            [record] = taps.records
    finally:
        loop.run(prefill.stop())
        loop.close()
    assert refused.value.code == 400 and refused.value.read() == error
    assert hooked == [] and not record.rewritten_by_fault
