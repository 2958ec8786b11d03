"""The EPD proxy protocol as pure functions, against request bodies and recorded responses."""

from __future__ import annotations

import copy

import pytest

from harness.serve.proxy_protocol import (
    EncodedItem,
    EncoderAnswerError,
    EncoderAnswerUnfit,
    EncoderBatch,
    MediaRef,
    build_decode_request,
    build_encoder_request,
    build_prefill_request,
    collect_media,
    index_encoder_response,
    media_uuid,
    plan_encoder_batches,
    rewrite_for_consumer,
)

pytestmark = pytest.mark.unit

CAT = "file:///media/cat.png"
DOG = "file:///media/dog.png"
CLIP = "file:///media/clip.mp4"

# What a vLLM 0.32 encoder answered for one image whose item carried this uuid.
RECORDED_HASH = "epd-e456d13150a50187998c5d612c086e23"
RECORDED_ENCODER_RESPONSE = {
    "id": "chatcmpl-3f1c",
    "object": "chat.completion",
    "model": "epd-model",
    "ec_transfer_params": {
        RECORDED_HASH: {"item_indices": [0], "metadata": {"image_grid_thw": [1, 16, 16]}}
    },
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": ""},
            "finish_reason": "stop",
            "logprobs": None,
        }
    ],
    "usage": {"prompt_tokens": 80, "completion_tokens": 0, "total_tokens": 80},
}
RECORDED_PREFILL_RESPONSE = {
    "kv_transfer_params": {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "p0",
        "remote_block_ids": [0, 1, 2],
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
    },
    "choices": [{"index": 0, "finish_reason": "length", "message": {"content": "A"}}],
}


def image(url: str, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": url}, **extra}


def video(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def chat(*contents, **fields) -> dict:
    """A chat body with one user message per content list (a str content is kept as-is)."""
    body = {
        "model": "epd-model",
        "messages": [{"role": "user", "content": c} for c in contents],
        "max_tokens": 16,
        "temperature": 0.0,
    }
    body.update(fields)
    return body


# --- collect_media ---------------------------------------------------------------------------


def test_collect_media_order_across_parts_and_messages() -> None:
    request = chat(
        [text("look"), image(CAT), video(CLIP)],
        "plain text message",
        [image(DOG), text("and"), {"type": "input_audio", "input_audio": {"data": "AAA="}}],
    )
    request["messages"].insert(0, {"role": "system", "content": "be brief"})
    refs = collect_media(request)
    assert [(r.position, r.message_index, r.part_index, r.part_type) for r in refs] == [
        (0, 1, 1, "image_url"),
        (1, 1, 2, "video_url"),
        (2, 3, 0, "image_url"),
        (3, 3, 2, "input_audio"),
    ]
    assert [r.is_video for r in refs] == [False, True, False, False]
    assert refs[0].uuid == media_uuid(image(CAT))


def test_collect_media_without_media() -> None:
    assert collect_media(chat("hello")) == []
    assert collect_media(chat([text("hi")])) == []
    assert collect_media({"messages": None}) == []


# --- media_uuid ------------------------------------------------------------------------------


def test_media_uuid_is_stable_for_identical_parts() -> None:
    a = media_uuid(image(CAT))
    b = media_uuid(copy.deepcopy(image(CAT)))
    assert a == b
    assert a.startswith("epd-") and len(a) == len("epd-") + 32
    assert a != media_uuid(image(DOG))


def test_the_cache_key_leaves_per_request_kwargs_to_the_engine_as_upstreams_does() -> None:
    """vLLM 0.28-0.32's `content_uuid` (disagg_epd_proxy.py, 0.32: lines 455-468) keys an item
    by its URL only; the engine folds mm_processor_kwargs / media_io_kwargs into the key itself
    (`get_mm_hashes`, `has_hash_factors`), and vLLM's proxy users depend on that (#56786). A
    proxy key that mixed the kwargs in would give two kwarg sets two keys whether or not the
    engine does, and an engine that stopped folding one in would still MATCH through it."""
    keys = {
        collect_media(chat([image(CAT)], **kwargs))[0].uuid
        for kwargs in (
            {},
            {"mm_processor_kwargs": {"max_pixels": 3136}},
            {"mm_processor_kwargs": {"max_pixels": 12544}},
            {"media_io_kwargs": {"video": {"num_frames": 4}}},
        )
    }
    assert keys == {media_uuid(image(CAT))}


def test_media_uuid_hashes_the_whole_part_when_it_has_no_url() -> None:
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    other = {"type": "input_audio", "input_audio": {"data": "BBBB", "format": "wav"}}
    assert media_uuid(audio) != media_uuid(other)
    assert media_uuid(audio) == media_uuid({**audio, "uuid": ""})


def test_media_uuid_honours_client_uuid() -> None:
    assert media_uuid(image(CAT, uuid="client-cat-1")) == "client-cat-1"
    # an empty uuid is no uuid
    assert media_uuid(image(CAT, uuid="")) == media_uuid(image(CAT))


def test_collect_media_uses_client_uuid() -> None:
    refs = collect_media(chat([image(CAT, uuid="mine"), image(CAT)]))
    assert refs[0].uuid == "mine"
    assert refs[1].uuid.startswith("epd-")


# --- plan_encoder_batches --------------------------------------------------------------------


def refs_for(*types: str) -> list[MediaRef]:
    return [MediaRef(i, 0, i, t, f"h{i}") for i, t in enumerate(types)]


def test_cursor_persists_across_single_image_requests() -> None:
    cursor = 0
    used = []
    for _ in range(3):
        batches, cursor = plan_encoder_batches(refs_for("image_url"), 2, cursor)
        assert len(batches) == 1
        used.append(batches[0].encoder_index)
    assert used == [0, 1, 0]  # vLLM #52484 restarted at encoder 0 every request
    assert cursor == 3


def test_images_on_one_encoder_share_a_sub_request() -> None:
    media = refs_for("image_url", "image_url", "image_url")
    batches, cursor = plan_encoder_batches(media, 2, 0)
    assert batches == [EncoderBatch(0, (0, 2)), EncoderBatch(1, (1,))]
    assert cursor == 3
    batches, _ = plan_encoder_batches(media, 1, 5)
    assert batches == [EncoderBatch(0, (0, 1, 2))]


def test_each_video_gets_its_own_sub_request() -> None:
    media = refs_for("video_url", "image_url", "video_url", "image_url")
    batches, cursor = plan_encoder_batches(media, 1, 0)
    assert batches == [
        EncoderBatch(0, (0,)),
        EncoderBatch(0, (1, 3)),
        EncoderBatch(0, (2,)),
    ]
    assert cursor == 4
    batches, _ = plan_encoder_batches(media, 2, 1)
    assert batches == [
        EncoderBatch(1, (0,)),
        EncoderBatch(0, (1, 3)),  # both images landed on encoder 0: one sub-request
        EncoderBatch(1, (2,)),
    ]


def test_plan_without_encoders_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one encoder"):
        plan_encoder_batches(refs_for("image_url"), 0, 0)


# --- build_encoder_request -------------------------------------------------------------------


def test_encoder_request_carries_only_the_batch_media_with_uuids() -> None:
    request = chat(
        [text("compare"), image(CAT), video(CLIP)],
        [image(DOG, uuid="dog-1"), text("please")],
        mm_processor_kwargs={"max_pixels": 3136},
        media_io_kwargs={"video": {"num_frames": 4}},
        stream=True,
        logprobs=True,
    )
    original = copy.deepcopy(request)
    media = collect_media(request)
    body = build_encoder_request(request, media, EncoderBatch(0, (0, 2)))
    assert body == {
        "model": "epd-model",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": CAT}, "uuid": media[0].uuid},
                    {"type": "image_url", "image_url": {"url": DOG}, "uuid": "dog-1"},
                ],
            }
        ],
        "stream": False,
        "mm_processor_kwargs": {"max_pixels": 3136},
        "media_io_kwargs": {"video": {"num_frames": 4}},
    }
    body["mm_processor_kwargs"]["max_pixels"] = 1
    body["messages"][0]["content"][0]["image_url"]["url"] = "changed"
    assert request == original  # copied, not shared


def test_encoder_request_without_passthrough_fields() -> None:
    request = chat([video(CLIP)])
    media = collect_media(request)
    body = build_encoder_request(request, media, EncoderBatch(1, (0,)))
    assert "mm_processor_kwargs" not in body and "media_io_kwargs" not in body
    assert body["messages"][0]["content"] == [{**video(CLIP), "uuid": media[0].uuid}]


# --- index_encoder_response ------------------------------------------------------------------


def test_index_recorded_response() -> None:
    found = index_encoder_response(
        EncoderBatch(0, (3,)), RECORDED_ENCODER_RESPONSE["ec_transfer_params"]
    )
    assert found == {3: EncodedItem(RECORDED_HASH, {"image_grid_thw": [1, 16, 16]})}


def test_index_maps_item_indices_to_request_positions() -> None:
    params = {
        "hA": {"item_indices": [1], "metadata": {"image_grid_thw": [1, 8, 8]}},
        "hB": {"item_indices": [0, 2], "metadata": {"image_grid_thw": [1, 4, 4]}},
    }
    found = index_encoder_response(EncoderBatch(1, (2, 5, 7)), params)
    assert found == {
        5: EncodedItem("hA", {"image_grid_thw": [1, 8, 8]}),
        2: EncodedItem("hB", {"image_grid_thw": [1, 4, 4]}),
        7: EncodedItem("hB", {"image_grid_thw": [1, 4, 4]}),
    }


def test_index_skips_entries_without_metadata() -> None:
    params = {
        "hA": {"item_indices": [0], "metadata": {}},
        "hB": {"item_indices": [1]},
        "hC": {"item_indices": [2], "metadata": {"image_grid_thw": [1, 2, 2]}},
    }
    found = index_encoder_response(EncoderBatch(0, (0, 1, 2)), params)
    assert found == {2: EncodedItem("hC", {"image_grid_thw": [1, 2, 2]})}
    assert index_encoder_response(EncoderBatch(0, (0,)), None) == {}
    assert index_encoder_response(EncoderBatch(0, (0,)), {}) == {}


@pytest.mark.parametrize("bad_index", [1, -1, 7])
def test_index_rejects_out_of_range_item_index(bad_index: int) -> None:
    params = {"hA": {"item_indices": [bad_index], "metadata": {"image_grid_thw": [1, 2, 2]}}}
    with pytest.raises(ValueError, match=f"item index {bad_index} for a sub-request of 1 item"):
        index_encoder_response(EncoderBatch(0, (4,)), params)


def test_index_rejects_two_entries_with_metadata_for_one_item() -> None:
    """Each item has one mm_hash, so a second entry with metadata claiming an item is a broken
    answer of the encoder, as it is for the answers without positions. It was read silently,
    the last entry's metadata winning: the consumer got one of two encodings, unsaid which."""
    params = {
        "hA": {"item_indices": [0], "metadata": {"image_grid_thw": [1, 2, 2]}},
        "hB": {"item_indices": [1, 0], "metadata": {"image_grid_thw": [1, 4, 4]}},
        "hC": {"item_indices": [0], "metadata": {}},  # no metadata: no claim, left out
    }
    with pytest.raises(
        EncoderAnswerUnfit, match="entries .hA. and .hB. both have metadata for item 0"
    ):
        index_encoder_response(EncoderBatch(0, (4, 5)), params)
    del params["hB"]
    assert index_encoder_response(EncoderBatch(0, (4, 5)), params) == {
        4: EncodedItem("hA", {"image_grid_thw": [1, 2, 2]})
    }


@pytest.mark.parametrize("params", [[{"mm_hash": "hA"}], "hA"], ids=["list", "str"])
def test_index_names_ec_transfer_params_that_are_no_object(params: object) -> None:
    """Called on its own (not only behind the proxy's check), an answer that is no object is
    the generation's shape error with the answer, not an AttributeError of `.items()`."""
    with pytest.raises(EncoderAnswerError, match="ec_transfer_params of type"):
        index_encoder_response(EncoderBatch(0, (0,)), params)  # type: ignore[arg-type]


# --- rewrite_for_consumer --------------------------------------------------------------------


def test_rewrite_recorded_image() -> None:
    request = chat([text("what is this?"), image(CAT)])
    media = collect_media(request)
    params = RECORDED_ENCODER_RESPONSE["ec_transfer_params"]
    encoded = index_encoder_response(EncoderBatch(0, (0,)), params)
    result = rewrite_for_consumer(request, media, encoded, params)
    assert result.body["messages"][0]["content"] == [
        text("what is this?"),
        {
            "type": "image_embeds",
            "image_embeds": {"image_grid_thw": [1, 16, 16]},
            "uuid": media[0].uuid,
        },
    ]
    assert result.body["ec_transfer_params"] == params
    assert result.forwarded_part_types == ["image_embeds"]
    assert result.metadata_only == [True]
    assert result.body["max_tokens"] == 16 and result.body["model"] == "epd-model"


def test_rewrite_mixed_media_keeps_text_and_unencoded_parts() -> None:
    audio = {"type": "input_audio", "input_audio": {"data": "AAA=", "format": "wav"}}
    request = chat([image(CAT), text("then"), video(CLIP)], [image(DOG), audio])
    original = copy.deepcopy(request)
    media = collect_media(request)
    encoded = {
        0: EncodedItem("hCat", {"image_grid_thw": [1, 16, 16]}),
        1: EncodedItem("hClip", {"video_grid_thw": [2, 8, 8]}),
        3: EncodedItem("hAudio", {"audio_len": 10}),  # audio has no embeds form: stays raw
    }
    params = {
        "hCat": {"item_indices": [0], "metadata": {"image_grid_thw": [1, 16, 16]}},
        "hClip": {"item_indices": [0], "metadata": {"video_grid_thw": [2, 8, 8]}},
    }
    result = rewrite_for_consumer(request, media, encoded, params)
    assert result.body["messages"][0]["content"] == [
        {
            "type": "image_embeds",
            "image_embeds": {"image_grid_thw": [1, 16, 16]},
            "uuid": media[0].uuid,
        },
        text("then"),
        {
            "type": "video_embeds",
            "video_embeds": {"video_grid_thw": [2, 8, 8]},
            "uuid": media[1].uuid,
        },
    ]
    assert result.body["messages"][1]["content"] == [image(DOG), audio]
    assert result.forwarded_part_types == [
        "image_embeds",
        "video_embeds",
        "image_url",
        "input_audio",
    ]
    assert result.metadata_only == [True, True, False, False]
    assert result.body["ec_transfer_params"] == params
    assert request == original  # the input is not mutated
    result.body["ec_transfer_params"]["hCat"]["metadata"]["image_grid_thw"][0] = 99
    result.body["messages"][0]["content"][0]["image_embeds"]["image_grid_thw"][1] = 99
    assert params["hCat"]["metadata"]["image_grid_thw"] == [1, 16, 16]
    assert encoded[0].metadata == {"image_grid_thw": [1, 16, 16]}


def test_rewrite_hands_the_consumer_the_item_uuid_not_the_encoder_key() -> None:
    """With per-request kwargs vLLM keys the EC file by hash(uuid, kwargs); the consumer, given
    the same uuid and kwargs, derives the same key. Handing it the key itself would hash it a
    second time (seen on vLLM 0.32: the consumer missed the file and its engine died)."""
    request = chat([image(CAT)], mm_processor_kwargs={"max_pixels": 12544})
    media = collect_media(request)
    key = "5f0c"  # what the encoder answered: not the uuid it was given
    params = {key: {"item_indices": [0], "metadata": {"image_grid_thw": [1, 4, 4]}}}
    result = rewrite_for_consumer(
        request, media, index_encoder_response(EncoderBatch(0, (0,)), params), params
    )
    part = result.body["messages"][0]["content"][0]
    assert part["uuid"] == media[0].uuid != key
    assert result.body["mm_processor_kwargs"] == {"max_pixels": 12544}
    assert result.body["ec_transfer_params"] == params


def test_rewrite_without_encoded_media_leaves_body_alone() -> None:
    request = chat([text("hi"), image(CAT)])
    result = rewrite_for_consumer(request, collect_media(request), {}, {})
    assert result.body == request
    assert "ec_transfer_params" not in result.body
    assert result.forwarded_part_types == ["image_url"]
    assert result.metadata_only == [False]
    assert result.body is not request


# --- prefill / decode ------------------------------------------------------------------------


def test_build_prefill_request() -> None:
    consumer = chat(
        [text("hi")],
        max_completion_tokens=32,
        stream=True,
        stream_options={"include_usage": True},
        ec_transfer_params={"h": {"item_indices": [0], "metadata": {"image_grid_thw": [1, 2, 2]}}},
    )
    original = copy.deepcopy(consumer)
    body = build_prefill_request(consumer)
    assert body["max_tokens"] == 1
    assert body["max_completion_tokens"] == 1
    assert body["stream"] is False
    assert "stream_options" not in body
    assert body["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert body["messages"] == consumer["messages"]
    assert body["ec_transfer_params"] == consumer["ec_transfer_params"]
    assert consumer == original
    # each prefill request gets its own params dict
    body["kv_transfer_params"]["remote_engine_id"] = "x"
    assert build_prefill_request(consumer)["kv_transfer_params"]["remote_engine_id"] is None


def test_build_prefill_request_without_max_completion_tokens() -> None:
    body = build_prefill_request(chat([text("hi")]))
    assert "max_completion_tokens" not in body
    assert body["max_tokens"] == 1


def test_build_decode_request_copies_prefill_kv_params() -> None:
    consumer = chat([text("hi")], stream=True)
    original = copy.deepcopy(consumer)
    body = build_decode_request(consumer, RECORDED_PREFILL_RESPONSE)
    assert body["kv_transfer_params"] == RECORDED_PREFILL_RESPONSE["kv_transfer_params"]
    assert body["max_tokens"] == 16  # D keeps the client's length
    assert body["stream"] is True
    assert consumer == original


def test_build_decode_request_without_prefill() -> None:
    consumer = chat([text("hi")])
    assert build_decode_request(consumer, None) == consumer
    assert "kv_transfer_params" not in build_decode_request(consumer, {"choices": []})


@pytest.mark.parametrize("indices", [0, [True]])
def test_index_rejects_item_indices_that_are_no_list_of_integers(indices: object) -> None:
    """`item_indices: 0` is no list, `[true]` no index (it would read as item 1): a broken
    answer of that encoder (EncoderAnswerUnfit), not a crash and not another item's metadata."""
    params = {"hA": {"item_indices": indices, "metadata": {"image_grid_thw": [1, 2, 2]}}}
    with pytest.raises(EncoderAnswerUnfit):
        index_encoder_response(EncoderBatch(0, (4, 5)), params)
