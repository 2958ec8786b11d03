"""The fake vLLM's server: a `vllm serve` look-alike, standard library only.

`harness.testing.fake_vllm` writes this file's source behind a `#!` line as an executable named
`vllm`; it is never imported by the harness (only by unit tests of its pure functions). See that
module for the flags it reads and the misbehaviours it plays on cue.

Why it computes anything at all: the transfer guards (`harness.judge.guards`) must be able to
hold or fail on a fake topology for the reasons they do on a real one, so the fake moves its
evidence the way vLLM 0.32 does, and only when its peer really handed it over:

- a prompt is tokenized into a realistic number of ids (a chat template, one id per word, a
  run of placeholder ids per media item sized by its grid), more than a block;
- each media item has an "embedding" (rows of float32 derived from the media source). The
  encoder writes it where ECExampleConnector does (`<ec storage>/<mm_hash>/
  encoder_cache.safetensors`, tensor `ec_cache`) and answers `ec_transfer_params`
  `{mm_hash: {"item_indices": [...], "metadata": {grid}}}`; a consumer given a metadata-only
  `*_embeds` part loads that file (none there: the request fails), and one given raw media
  computes the embedding itself (vLLM's silent fallback);
- each prompt position has a "KV" row chained from the previous row, its token and its
  embedding row (a video's row also from its temporal position, below), and the generated ids
  are a digest of every row: a changed embedding, position or KV row changes the answer, as it
  would a model's;
- a video's temporal steps sit where Qwen2.5-VL puts them (`iter_mm_grid_thw`): step t at
  `int(t * second_per_grid_ts * tokens_per_second)`. Given the media, an instance derives
  `second_per_grid_ts` as the processor does, `temporal_patch_size / fps`, where fps is the
  rate of the frames vLLM 0.32's loaders keep (harness/spec/video_sampling.py, which
  `harness.testing.fake_vllm` writes beside the executable: the harness itself may not be
  importable there). JPEG frames: the first `num_frames` (default 32) at the request's
  `media_io_kwargs` video fps, else 1; an mp4: the frame count and rate its header gives
  (what OpenCV reports to vLLM's loader), sampled as Qwen2VLVideoBackend samples them. Given
  a metadata-only `video_embeds` part an instance has only the grid the encoder published and
  assumes 1.0, as vLLM 0.32's consumer does. So JPEG frames at the default fps, or an mp4
  recorded at 1 fps, through an encoder mismatch; at 2 fps (or an mp4 sampled down to it)
  they match (the video-timing bug of docs/found-in-vllm.md). A video's grid has one
  temporal step per two frames kept;
- ExampleConnector: P writes the rows of the block-aligned prefix to `<kv storage>/<prompt
  hash>/<layer>.safetensors` (tensor `kv_cache`); D loads them if that directory exists, and
  reports them as `cached_tokens` and in its `/metrics` (`external_unspecified`);
- NixlConnector: P keeps its rows in blocks in its memory and answers the
  `kv_transfer_params` vLLM's NIXL P does (block ids, its side channel host and port); D,
  handed those, reads the blocks from P's side channel (a small HTTP server on
  `VLLM_NIXL_SIDE_CHANNEL_PORT`) and counts them as `p2p` in its `/metrics` with NIXL's
  transfer counters, reporting `cached_tokens=0` as vLLM 0.32 does. Without them (a proxy that
  skipped P, or withheld its answer) D computes the prompt itself and counts it as
  `local_compute`.

The metric names are vLLM 0.32's (`vllm/v1/metrics/loggers.py`, `.../nixl/stats.py`). There is
no prefix cache unless the mode `prefix-cache` asks for one: then an instance keeps the rows of
every prompt's full blocks under the request's `cache_salt`, and a later request with the same
blocks and salt takes them from there (`cached_tokens`, `local_cache_hit` in its `/metrics`)
without asking its connector, as vLLM's D does with a prompt it has seen.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hashlib
import http.server
import json
import os
import signal
import struct
import sys
import threading
import time
import urllib.error
import urllib.request
import zlib

if __package__:  # imported, by the tests of its pure functions
    from harness.spec import video_sampling
else:  # the executable: harness.testing.fake_vllm wrote that module's file beside it
    import video_sampling  # type: ignore[no-redef]

ROW_FLOATS = 4  # floats per embedding / KV row
ROW_BYTES = 4 * ROW_FLOATS
MERGE = 4  # Qwen2.5-VL merges 2x2 patches into one placeholder token
GRIDS = {"image": [1, 8, 8], "video": [2, 8, 8]}  # what the fake's encoder reports
TOKENS_PER_SECOND = 2  # Qwen2.5-VL's vision_config.tokens_per_second (the tiny model's too)
CONSUMER_SECONDS_PER_STEP = 1.0  # what a consumer without second_per_grid_ts assumes
GRID_KEYS = {"image": "image_grid_thw", "video": "video_grid_thw"}
AUDIO_TOKENS = 8
# Qwen2.5-VL's own placeholder ids: what a model directory without them in its config gets.
PLACEHOLDER_IDS = {"image": 151655, "video": 151656, "audio": 151646}
PLACEHOLDER_CONFIG_KEYS = {"image": "image_token_id", "video": "video_token_id"}
IM_START, IM_END = 151644, 151645
ROLE_IDS = {"system": 8948, "user": 872, "assistant": 77091}
EC_FILE = "encoder_cache.safetensors"
KV_LAYER = "model.layers.0.self_attn.attn"
DEFAULT_BLOCK_SIZE = 16  # vLLM's default
# The time one of D's decode steps takes (mode `decode-step=<seconds>` sets another, for any
# role): an answer of n tokens is held n-1 steps after its first token, streamed one token a
# step, as vLLM's engine generates it. A D that answered at once was never found with a
# request in flight (the death under load finished its first requests before the kill). Only
# D's by default: every other role answering 32 tokens 0.31 s later made the harness's own
# fake nights half as slow again (fuzzing's hundreds of PD answers), and only D is killed
# under load.
DECODE_STEP_S = 0.01
# EngineDeadError's message (vllm/v1/engine/exceptions.py): what a request gets as its core dies.
ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."


class RequestFailed(Exception):
    """What vLLM would answer with an HTTP error (its engine could not serve the request)."""


class RequestRejected(Exception):
    """What vLLM's frontend refuses before the engine sees it: HTTP 400, `param` named
    (VLLMValidationError, vllm/exceptions.py; its message as `str()` gives it)."""

    def __init__(self, message: str, param: str):
        super().__init__(f"{message} (parameter={param})")
        self.param = param


class EmbeddingsMissing(RequestFailed):
    """An item with neither embeddings nor media to encode reached the engine: in vLLM 0.32 the
    worker's sanity check asserts (vllm/v1/worker/utils.py, `sanity_check_mm_encoder_outputs`)
    and the engine core dies, taking its API server down after the request's error (a 500,
    or, streamed, an error event after the 200: `engine_dead_events`)."""

    def __init__(self, detail: str):
        super().__init__(
            "AssertionError: Expected number of multimodal embeddings to match number of input "
            "items: 1, but got len(mm_embeddings)=0 instead. This is most likely due to "
            f"incorrect implementation of the model's `embed_multimodal` method. ({detail})"
        )


# -- tensors as safetensors files, written and read without torch ---------------------------------


def write_tensor(path: str, name: str, data: bytes) -> None:
    """One float32 tensor of shape [rows, ROW_FLOATS] as a safetensors file."""
    rows = len(data) // ROW_BYTES
    header = {name: {"dtype": "F32", "shape": [rows, ROW_FLOATS], "data_offsets": [0, len(data)]}}
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(partial, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)) + encoded + data)
    os.replace(partial, path)


def read_tensor(path: str, name: str) -> bytes:
    """The float32 bytes of tensor `name` of a safetensors file (as torch would save them)."""
    with open(path, "rb") as source:
        blob = source.read()
    (size,) = struct.unpack("<Q", blob[:8])
    entry = json.loads(blob[8 : 8 + size])[name]
    if entry["dtype"] != "F32":
        raise RequestFailed(f"{path}: {name} is {entry['dtype']}, not F32")
    start, end = entry["data_offsets"]
    return blob[8 + size + start : 8 + size + end]


# -- prompts, embeddings, KV ---------------------------------------------------------------------


def rows_from(seed: bytes, count: int) -> bytes:
    """`count` rows of float32 derived from `seed`; exactly representable values in [-2, 2)."""
    out = bytearray()
    for index in range(count):
        digest = hashlib.sha256(seed + index.to_bytes(4, "little")).digest()
        out += struct.pack(f"<{ROW_FLOATS}f", *((b - 128) / 64.0 for b in digest[:ROW_FLOATS]))
    return bytes(out)


def media_kwargs(body: dict) -> str:
    """The request fields that change what media turn into (and their cache key)."""
    kwargs = {k: body[k] for k in ("mm_processor_kwargs", "media_io_kwargs") if body.get(k)}
    return json.dumps(kwargs, sort_keys=True) if kwargs else ""


def modality(part_type: str) -> str:
    return part_type.split("_")[0] if not part_type.startswith("input_audio") else "audio"


def source_of(part: dict) -> str:
    """What a raw media part's content is known by (its URL, else the whole part)."""
    value = part.get(part.get("type", ""))
    url = value.get("url") if isinstance(value, dict) else None
    return url or json.dumps({k: v for k, v in part.items() if k != "uuid"}, sort_keys=True)


def mm_hash(part: dict, kwargs: str) -> str:
    """vLLM 0.32's item identifier: the uuid itself, hashed with the media kwargs if any; an
    item without uuid is keyed by its content."""
    uuid = part.get("uuid")
    if uuid and not kwargs:
        return str(uuid)
    keyed = f"{uuid or source_of(part)}|{kwargs}"
    return hashlib.sha256(keyed.encode()).hexdigest()[:32]


JPEG_FRAMES_PREFIX = "data:video/jpeg;base64,"


def video_sampling_of(part: dict, video_io: dict) -> tuple[int, float]:
    """(frames the processor receives, the rate they stand for) of a raw video part, as vLLM
    0.32's loaders sample it: a `data:video/jpeg;base64,<f>,<f>,...` frame list, or an mp4."""
    url = (part.get("video_url") or {}).get("url")
    if not isinstance(url, str):
        raise RequestFailed("a video_url part without a url")
    try:
        if url.lower().startswith(JPEG_FRAMES_PREFIX):
            return video_sampling.jpeg_sampling(len(url.split(",")) - 1, video_io)
        total, fps = mp4_timing(data_url_bytes(url))
        return video_sampling.container_sampling(total, fps, video_io, qwen2vl=True)
    except (ValueError, IndexError, struct.error) as exc:  # a bad clip, or header
        raise RequestFailed(f"cannot sample the video: {exc}") from None


def data_url_bytes(url: str) -> bytes:
    """The payload of a base64 `data:` URL (the fake fetches nothing)."""
    head, _, payload = url.partition(",")
    if not (head.startswith("data:") and head.endswith(";base64")):
        raise ValueError(f"the fake reads only base64 data: URLs, not {url[:40]!r}")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"bad base64 in a data: URL ({exc})") from None


def iso_boxes(data: bytes, start: int, end: int):
    """(type, payload start, payload end) of each ISO BMFF box in data[start:end]."""
    while start + 8 <= end:
        size, kind = struct.unpack(">I4s", data[start : start + 8])
        header = 8
        if size == 1:  # a 64-bit size follows the type
            (size,) = struct.unpack(">Q", data[start + 8 : start + 16])
            header = 16
        elif size == 0:  # to the end of the enclosing box
            size = end - start
        if size < header or start + size > end:
            raise ValueError(f"a truncated {kind!r} box: not an mp4 the fake can read")
        yield kind, start + header, start + size
        start += size


def child_box(data: bytes, start: int, end: int, kind: bytes) -> tuple[int, int]:
    """(payload start, payload end) of the first `kind` box in data[start:end]."""
    for found, body, stop in iso_boxes(data, start, end):
        if found == kind:
            return body, stop
    raise ValueError(f"no {kind.decode()} box: not an mp4 the fake can read")


def mp4_timing(data: bytes) -> tuple[int, float]:
    """(frames, frames per second) of an mp4's first video track, from its header as OpenCV
    reports them to vLLM's loader: the frame count its time-to-sample table holds, and the
    average rate (those frames times the media timescale over their total duration)."""
    moov = child_box(data, 0, len(data), b"moov")
    for kind, trak, trak_end in iso_boxes(data, *moov):
        if kind != b"trak":
            continue
        mdia = child_box(data, trak, trak_end, b"mdia")
        hdlr, _ = child_box(data, *mdia, b"hdlr")
        if data[hdlr + 8 : hdlr + 12] != b"vide":  # after version, flags and pre_defined
            continue
        mdhd, _ = child_box(data, *mdia, b"mdhd")
        at = mdhd + (20 if data[mdhd] == 1 else 12)  # past version 1's 64-bit times, or 0's
        (timescale,) = struct.unpack(">I", data[at : at + 4])
        stbl = child_box(data, *child_box(data, *mdia, b"minf"), b"stbl")
        stts, _ = child_box(data, *stbl, b"stts")
        (entries,) = struct.unpack(">I", data[stts + 4 : stts + 8])
        runs = [
            struct.unpack(">II", data[stts + 8 + 8 * i : stts + 16 + 8 * i]) for i in range(entries)
        ]
        frames = sum(count for count, _ in runs)
        duration = sum(count * delta for count, delta in runs)
        if not (frames and duration and timescale):
            raise ValueError("the mp4's video track has no frames or no duration")
        return frames, frames * timescale / duration
    raise ValueError("no video track in the mp4")


def float32(value: float) -> float:
    """`value` as the float32 tensor vLLM holds second_per_grid_ts in reads it back."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def placeholder_count(kind: str, grid: list | None) -> int:
    if kind == "audio":
        return AUDIO_TOKENS
    size = 1
    for value in grid or GRIDS[kind]:
        size *= int(value)
    return max(size // MERGE, 1)


class MediaItem:
    """One media part of a request as the engine sees it: raw (embedding computed here) or a
    metadata-only `*_embeds` part (embedding loaded from the EC storage when needed)."""

    def __init__(self, part: dict, kwargs: str, video_io: dict):
        self.part = part
        self.kind = modality(str(part.get("type")))
        self.embeds = str(part.get("type")).endswith("_embeds")
        self.kwargs = kwargs
        self.hash = mm_hash(part, kwargs)
        metadata = part.get(part["type"]) if self.embeds else None
        grid = metadata.get(GRID_KEYS.get(self.kind, "")) if isinstance(metadata, dict) else None
        raw_video = self.kind == "video" and not self.embeds
        self.sampling = video_sampling_of(part, video_io) if raw_video else None
        self.grid = grid or self.processed_grid()
        self.tokens = placeholder_count(self.kind, self.grid)
        self.seconds_per_step = self.processed_seconds_per_step()
        self._rows: bytes | None = None

    def processed_grid(self) -> list[int] | None:
        """The grid the processor makes of raw media (None: audio, which has none): a video's
        has one temporal step per two frames kept (an odd count padded)."""
        if self.kind not in GRIDS:
            return None
        if self.sampling is None:
            return list(GRIDS[self.kind])
        frames, _ = self.sampling
        return [-(-frames // video_sampling.TEMPORAL_PATCH), *GRIDS["video"][1:]]

    def processed_seconds_per_step(self) -> float:
        """A video's second_per_grid_ts: the processor's from raw media, the consumer's
        assumption for a metadata-only part (the encoder does not publish it)."""
        if self.sampling is None:
            return CONSUMER_SECONDS_PER_STEP
        _, fps = self.sampling
        return float32(video_sampling.TEMPORAL_PATCH / fps)

    def temporal_position(self, row: int) -> int:
        """Where the temporal step of placeholder `row` sits (iter_mm_grid_thw's t_factor)."""
        per_step = max(self.tokens // int(self.grid[0]), 1) if self.grid else self.tokens
        return int(row // per_step * self.seconds_per_step * TOKENS_PER_SECOND)

    def computed(self) -> bytes:
        """The embedding a model computes from the raw media (an encoder, or a consumer that
        got raw media)."""
        return rows_from(f"{source_of(self.part)}|{self.kwargs}".encode(), self.tokens)

    def rows(self, ec_storage: str | None, zeros_if_missing: bool = False) -> bytes:
        if self._rows is None:
            self._rows = (
                self._load(ec_storage, zeros_if_missing) if self.embeds else self.computed()
            )
        return self._rows

    def _load(self, ec_storage: str | None, zeros_if_missing: bool) -> bytes:
        path = os.path.join(ec_storage or "", self.hash, EC_FILE)
        if zeros_if_missing and not (ec_storage and os.path.isfile(path)):
            return bytes(self.tokens * ROW_BYTES)
        if not ec_storage:
            raise EmbeddingsMissing(
                f"no embeddings for {self.kind} item {self.hash}: a metadata-only part, and "
                "this instance has no EC storage to load them from"
            )
        if not os.path.isfile(path):
            raise EmbeddingsMissing(f"no EC cache for mm_hash {self.hash}: {path} does not exist")
        data = read_tensor(path, "ec_cache")
        if len(data) != self.tokens * ROW_BYTES:
            raise RequestFailed(
                f"EC cache {path} holds {len(data) // ROW_BYTES} rows for "
                f"{self.tokens} placeholder tokens"
            )
        return data


def word_id(word: str) -> int:
    return 1000 + zlib.crc32(word.encode()) % 100000


def model_placeholder_ids(model: str) -> dict[str, int]:
    """The placeholder ids the served model's media expand to: its config's `image_token_id`
    and `video_token_id` (top level or `text_config`), the ids Qwen2.5-VL's processor inserts
    (`_get_prompt_updates` in vLLM's model_executor/models/qwen2_vl.py looks them up in the
    model's own tokenizer, whose ids the config names), else Qwen2.5-VL's."""
    ids = dict(PLACEHOLDER_IDS)
    try:
        with open(os.path.join(model, "config.json"), encoding="utf-8") as source:
            config = json.load(source)
    except (OSError, ValueError):
        return ids
    for section in (config.get("text_config") or {}, config):
        for kind, key in PLACEHOLDER_CONFIG_KEYS.items():
            if isinstance(section.get(key), int):
                ids[kind] = section[key]
    return ids


def tokenize(
    body: dict, placeholder_ids: dict[str, int] = PLACEHOLDER_IDS
) -> tuple[list[int], list[tuple[int, MediaItem, int]], list[MediaItem]]:
    """Prompt ids as a chat template makes them; (position, item, row) of every placeholder."""
    kwargs = media_kwargs(body)
    video_io = (body.get("media_io_kwargs") or {}).get("video") or {}
    ids: list[int] = []
    placeholders: list[tuple[int, MediaItem, int]] = []
    items: list[MediaItem] = []
    for message in body.get("messages") or []:
        ids += [IM_START, ROLE_IDS.get(message.get("role"), 872)]
        content = message.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        for part in parts or []:
            if part.get("type") == "text":
                ids += [word_id(w) for w in str(part.get("text", "")).split()]
                continue
            item = MediaItem(part, kwargs, video_io)
            items.append(item)
            for row in range(item.tokens):
                placeholders.append((len(ids), item, row))
                ids.append(placeholder_ids[item.kind])
        ids.append(IM_END)
    ids += [IM_START, ROLE_IDS["assistant"]]
    return ids, placeholders, items


def kv_rows(
    ids: list[int],
    placeholders: list[tuple[int, MediaItem, int]],
    loaded: bytes,
    ec_storage: str | None,
    zeros_if_missing: bool = False,
) -> bytes:
    """Every prompt position's KV row: the `loaded` ones as given, the rest computed, each from
    the previous row, its token and (a placeholder) its embedding row, and a video's its
    temporal position."""
    at = {position: (item, row) for position, item, row in placeholders}
    rows = bytearray(loaded)
    for position in range(len(loaded) // ROW_BYTES, len(ids)):
        previous = bytes(rows[-ROW_BYTES:]) if rows else b""
        mixed = previous + ids[position].to_bytes(4, "little")
        if position in at:
            item, row = at[position]
            embedding = item.rows(ec_storage, zeros_if_missing)
            mixed += embedding[row * ROW_BYTES : (row + 1) * ROW_BYTES]
            if item.kind == "video":
                mixed += item.temporal_position(row).to_bytes(4, "little")
        rows += rows_from(mixed, 1)
    return bytes(rows)


def generated_ids(rows: bytes, count: int) -> list[int]:
    """What a model answers from these KV rows: a digest of all of them."""
    seed = hashlib.sha256(rows).digest()
    return [
        1000
        + int.from_bytes(hashlib.sha256(seed + bytes([i % 256, i // 256])).digest()[:4]) % 50000
        for i in range(count)
    ]


def monolithic_answer(body: dict) -> tuple[list[int], list[int]]:
    """(prompt ids, generated ids) a fake baseline (or any instance computing everything
    itself from raw media) answers `body` with: what a synthetic bundle records as a run's."""
    ids, placeholders, _ = tokenize(body)
    rows = kv_rows(ids, placeholders, b"", None)
    return ids, generated_ids(rows, int(body.get("max_tokens") or 4))


SSE_DONE = b"data: [DONE]\n\n"  # the end of every OpenAI-style stream


def sse_event(payload: dict) -> bytes:
    """One server-sent event carrying `payload` as JSON, as vLLM frames each chunk."""
    return f"data: {json.dumps(payload)}\n\n".encode()


def engine_dead_events(error: dict) -> list[bytes]:
    """What a streamed request gets when the engine dies under it, as vLLM 0.32 sends it
    (`chat_completion_stream_generator` in vllm/entrypoints/openai/chat_completion/serving.py):
    the frontend answered 200 before the engine ran the request (`create_chat_completion`
    returns the generator, which StreamingResponse starts sending), so the EngineDeadError the
    generator meets is one event, `create_streaming_error_response`'s ErrorResponse (the JSON an
    unstreamed request gets with its 500), then `[DONE]`. The engine died before its first
    output, so no role chunk precedes it."""
    return [sse_event(error), SSE_DONE]


def stream_events(answer: dict, body: dict) -> list[bytes]:
    """`answer` (what `Engine.chat` answers unstreamed) as the server-sent events vLLM 0.32
    streams for a `stream: true` body (`chat_completion_stream_generator` in
    vllm/entrypoints/openai/chat_completion/serving.py, each chunk dumped with
    `exclude_unset`): a role chunk (with `prompt_token_ids` under `return_token_ids`), one
    chunk per generated token (its `token_ids` and log-prob entry; the last with
    `finish_reason` and `stop_reason`), under `stream_options.include_usage` a usage chunk
    without choices (dumped `exclude_none` too), then `[DONE]`. The fake has no detokenizer:
    its text, "fake", rides on the first token's chunk."""
    [choice] = answer["choices"]
    head = {
        "id": answer["id"],
        "object": "chat.completion.chunk",
        "created": answer["created"],
        "model": answer["model"],
    }
    return_ids = bool(body.get("return_token_ids"))
    chunks: list[dict] = [
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
            "prompt_token_ids": answer["prompt_token_ids"] if return_ids else None,
            "prompt_text": None,
        }
    ]
    ids = choice["token_ids"]
    entries = choice["logprobs"]["content"]
    for index, token in enumerate(ids):
        last = index == len(ids) - 1
        streamed: dict = {
            "index": 0,
            "delta": {"content": choice["message"]["content"] if index == 0 else ""},
            "logprobs": {"content": [entries[index]]} if body.get("logprobs") else None,
            "finish_reason": choice["finish_reason"] if last else None,
        }
        if last:
            streamed["stop_reason"] = None
        streamed["token_ids"] = [token] if return_ids else None
        chunks.append({**head, "choices": [streamed]})
    if (body.get("stream_options") or {}).get("include_usage"):
        chunks.append({**head, "choices": [], "usage": answer["usage"]})
    return [sse_event(chunk) for chunk in chunks] + [SSE_DONE]


def aligned_prefix(prompt_tokens: int, block_size: int) -> int:
    """ExampleConnector's whole blocks, leaving D at least one token to compute."""
    return ((prompt_tokens - 1) // block_size) * block_size


def kv_folder(kv_storage: str, ids: list[int], hashes: list[str]) -> str:
    """ExampleConnector's layout: a directory named by a hash of the prefix ids and mm hashes."""
    key = struct.pack(f"<{len(ids)}q", *ids) + "-".join(hashes).encode()
    return os.path.join(kv_storage, hashlib.sha256(key).hexdigest()[:32])


# -- the server ----------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="vllm")
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("model")
    for flag in ("--host", "--served-model-name", "--ec-transfer-config", "--kv-transfer-config"):
        parser.add_argument(flag, default="")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    parser.add_argument("--enable-mm-embeds", action="store_true")
    args, unknown = parser.parse_known_args(argv)
    rejected = [arg for arg in unknown if arg.startswith("--no-such-")]
    if rejected:
        parser.error(f"unrecognized arguments: {' '.join(rejected)}")
    return args


class Engine:
    """What one fake instance knows and counts."""

    def __init__(self, args: argparse.Namespace, modes: dict[str, float]):
        ec = json.loads(args.ec_transfer_config or "{}")
        kv = json.loads(args.kv_transfer_config or "{}")
        ec_role, kv_role = ec.get("ec_role", ""), kv.get("kv_role", "")
        self.role = (
            "encoder"
            if ec_role == "ec_producer"
            else "prefill"
            if kv_role == "kv_producer"
            else "decode"
            if kv_role == "kv_consumer"
            else "pd"
            if ec_role
            else "baseline"
        )
        self.model = args.served_model_name or args.model
        self.placeholder_ids = model_placeholder_ids(args.model)
        self.modes = modes
        self.block_size = args.block_size
        self.ec_storage = (ec.get("ec_connector_extra_config") or {}).get("shared_storage_path")
        self.kv_storage = (kv.get("kv_connector_extra_config") or {}).get("shared_storage_path")
        self.nixl = kv.get("kv_connector") == "NixlConnector"
        # vLLM 0.32 lets an EC or KV consumer take metadata-only `*_embeds` parts, enabling
        # embedding inputs for it (config/vllm.py, allow_missing_mm_embeddings); any other
        # instance takes them only when started with --enable-mm-embeds.
        consumer = (ec.get("ec_connector") and ec_role in ("ec_consumer", "ec_both")) or (
            kv.get("kv_connector") and kv_role in ("kv_consumer", "kv_both")
        )
        self.enable_mm_embeds = bool(args.enable_mm_embeds or consumer)
        self.side_host = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
        self.side_port = int(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT") or 0)
        self.engine_id = f"fake-{os.getpid()}"
        self.lock = threading.Lock()
        self.blocks: dict[int, bytes] = {}  # NIXL P: block id -> its rows
        self.sent: dict[str, list[int]] = {}  # NIXL P: request id -> its blocks
        self.next_block = 1
        self.prefix_cache: dict[str, bytes] = {}  # mode prefix-cache: key -> full blocks' rows
        self.counters = {
            "cached:p2p": 0.0,
            "cached:external_unspecified": 0.0,
            "source:external_kv_transfer": 0.0,
            "source:local_compute": 0.0,
            "source:local_cache_hit": 0.0,
            "nixl_transfers": 0.0,
            "nixl_bytes": 0.0,
            "nixl_failed": 0.0,
            "success": 0.0,
        }

    def count(self, **increments: float) -> None:
        with self.lock:
            for name, value in increments.items():
                key = name.replace("__", ":")
                self.counters[key] = self.counters.get(key, 0.0) + value

    # -- chat ------------------------------------------------------------------------------

    def chat(self, body: dict, request_id: str) -> dict:
        ids, placeholders, items = tokenize(body, self.placeholder_ids)
        for item in items:
            if item.embeds and not self.enable_mm_embeds:  # renderers/chat_utils.py
                embeds = f"{item.kind}_embeds"
                raise RequestRejected(
                    f"You must set `--enable-mm-embeds` to input `{embeds}`", embeds
                )
        ec_params = self.encode(items) if self.role == "encoder" else None
        key = self.prefix_key(body, ids, items)
        held = self.held_prefix(key)
        moved, cached = self.load_kv(body, ids, items, len(held) // ROW_BYTES)
        loaded = held + moved
        cached += len(held) // ROW_BYTES
        rows = kv_rows(ids, placeholders, loaded, self.ec_storage, "serve-anything" in self.modes)
        self.count(
            source__local_compute=len(ids) - len(loaded) // ROW_BYTES,
            source__external_kv_transfer=len(moved) // ROW_BYTES,
            source__local_cache_hit=len(held) // ROW_BYTES,
        )
        self.keep_prefix(key, rows, len(ids))
        kv_params = self.save_kv(ids, items, rows, request_id) if self.role == "prefill" else None
        wanted = body.get("max_tokens") or body.get("max_completion_tokens") or 4
        out = generated_ids(rows, int(wanted))
        self.count(success=1)
        top = [{"token": f"token_id:{t}", "logprob": -0.5, "bytes": None} for t in out]
        usage = {
            "prompt_tokens": len(ids),
            "completion_tokens": len(out),
            "total_tokens": len(ids) + len(out),
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        return {
            "id": f"chatcmpl-{request_id}",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model"),
            "prompt_token_ids": ids,
            "usage": usage,
            "kv_transfer_params": kv_params,
            "ec_transfer_params": ec_params,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "fake"},
                    "finish_reason": "length",
                    "token_ids": out,
                    "logprobs": {"content": [{**t, "top_logprobs": [t]} for t in top]},
                }
            ],
        }

    def prefix_key(self, body: dict, ids: list[int], items: list[MediaItem]) -> str | None:
        """The prompt's full blocks with its media's hashes and its salt (vLLM's block hashes
        carry both), where the mode keeps a prefix cache."""
        prefix = aligned_prefix(len(ids), self.block_size)
        if "prefix-cache" not in self.modes or prefix == 0:
            return None
        salt = str(body.get("cache_salt") or "")
        return json.dumps([salt, ids[:prefix], [item.hash for item in items]])

    def held_prefix(self, key: str | None) -> bytes:
        """The rows this instance holds for the prompt from an earlier request (b"": none)."""
        with self.lock:
            held = self.prefix_cache.get(key, b"") if key else b""
        if held:
            self.count(cached__device=len(held) // ROW_BYTES)
        return held

    def keep_prefix(self, key: str | None, rows: bytes, prompt_tokens: int) -> None:
        if key:
            with self.lock:
                full_blocks = aligned_prefix(prompt_tokens, self.block_size)
                self.prefix_cache[key] = rows[: full_blocks * ROW_BYTES]

    def encode(self, items: list[MediaItem]) -> dict | None:
        """ECExampleConnector's producer: one file per item, one entry per mm_hash. An item
        whose file the storage already holds is loaded, not encoded, so nothing is written:
        vLLM 0.32's scheduler asks the connector's `has_cache_item` (the file exists) before
        scheduling an item's encoder (v1/core/sched/scheduler.py), and only an encoded item
        is saved."""
        params: dict = {}
        for index, item in enumerate(items):
            path = os.path.join(self.ec_storage or "", item.hash, EC_FILE)
            if self.ec_storage and not os.path.isfile(path):
                write_tensor(path, "ec_cache", item.computed())
            entry = params.setdefault(item.hash, {"item_indices": []})
            entry["item_indices"].append(index)
            grid_key = GRID_KEYS.get(item.kind)
            entry["metadata"] = (
                {grid_key: item.grid} if grid_key else {"audio_num_tokens": [item.tokens]}
            )
        return params or None

    def load_kv(
        self, body: dict, ids: list[int], items: list[MediaItem], held: int = 0
    ) -> tuple[bytes, int]:
        """D's KV from P, as its connector finds it, past the `held` tokens D's own prefix
        cache gave: (rows loaded, cached_tokens reported for them)."""
        if self.role != "decode":
            return b"", 0
        if self.nixl:  # NIXL reads only the blocks D does not hold
            params = body.get("kv_transfer_params") or {}
            return self.read_remote_blocks(params, len(ids), held // self.block_size), 0
        prefix = aligned_prefix(len(ids), self.block_size)
        if not self.kv_storage or held >= prefix:
            return b"", 0
        folder = kv_folder(self.kv_storage, ids[:prefix], [i.hash for i in items])
        path = os.path.join(folder, f"{KV_LAYER}.safetensors")
        if prefix == 0 or not os.path.isfile(path):
            return b"", 0
        rows = read_tensor(path, "kv_cache")
        if len(rows) != prefix * ROW_BYTES:
            raise RequestFailed(f"{path} holds {len(rows) // ROW_BYTES} rows for {prefix} tokens")
        self.count(cached__external_unspecified=prefix)
        return rows, prefix

    def read_remote_blocks(self, params: dict, prompt_tokens: int, skip: int = 0) -> bytes:
        """NIXL's read: the blocks P named past the first `skip` (D holds those), from P's side
        channel; a failed read is counted and the prompt computed here, as vLLM's D recomputes
        what it could not get."""
        groups = params.get("remote_block_ids")
        if not params.get("do_remote_prefill") or not groups:
            return b""
        blocks = (groups[0] if isinstance(groups[0], list) else groups)[skip:]
        if not blocks:
            return b""
        prompt_tokens -= skip * self.block_size
        url = (
            f"http://{params.get('remote_host')}:{params.get('remote_port')}/read?"
            f"request={params.get('remote_request_id')}&blocks={','.join(map(str, blocks))}"
        )
        try:
            with urllib.request.urlopen(url, timeout=30) as reply:
                data = reply.read()
        except (OSError, urllib.error.URLError) as exc:
            print(f"ERROR NIXL transfer failed: {exc}", flush=True)
            self.count(nixl_failed=1)
            return b""
        rows = data[: prompt_tokens * ROW_BYTES]
        received = len(rows) // ROW_BYTES
        self.count(cached__p2p=received, nixl_transfers=1, nixl_bytes=len(data))
        return rows[: received * ROW_BYTES]

    def save_kv(self, ids: list[int], items: list[MediaItem], rows: bytes, request_id: str):
        """P's side of the connector: files (ExampleConnector) or blocks kept for D's read."""
        if self.nixl:
            per_block = self.block_size * ROW_BYTES
            with self.lock:
                allocated = []
                for start in range(0, len(rows), per_block):
                    self.blocks[self.next_block] = rows[start : start + per_block]
                    allocated.append(self.next_block)
                    self.next_block += 1
                self.sent[request_id] = allocated
            return {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": [allocated],
                "remote_engine_id": self.engine_id,
                "remote_request_id": request_id,
                "remote_host": self.side_host,
                "remote_port": self.side_port,
                "tp_size": 1,
                "remote_num_tokens": len(ids),
            }
        if self.kv_storage:
            prefix = aligned_prefix(len(ids), self.block_size)
            if prefix:
                folder = kv_folder(self.kv_storage, ids[:prefix], [i.hash for i in items])
                path = os.path.join(folder, f"{KV_LAYER}.safetensors")
                write_tensor(path, "kv_cache", rows[: prefix * ROW_BYTES])
        return None

    def serve_blocks(self, request_id: str, blocks: list[int]) -> bytes | None:
        """P's side channel: the rows of the blocks D reads (then freed, as D's notification
        frees them); None when P holds no such request or block."""
        with self.lock:
            if request_id not in self.sent or any(b not in self.blocks for b in blocks):
                return None
            data = b"".join(self.blocks[b] for b in blocks)
            for block in self.sent.pop(request_id):
                self.blocks.pop(block, None)
        return data

    # -- metrics ---------------------------------------------------------------------------

    def metrics(self) -> str:
        with self.lock:
            c = dict(self.counters)
        labels = f'engine="0",model_name="{self.model}"'
        lines = []
        for source in ("device", "host", "disk", "p2p", "external_unspecified"):
            value = c.get(f"cached:{source}", 0.0)
            lines.append(
                f'vllm:prompt_tokens_cached_by_source_total{{{labels},source="{source}"}} {value}'
            )
        for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
            value = c.get(f"source:{source}", 0.0)
            lines.append(
                f'vllm:prompt_tokens_by_source_total{{{labels},source="{source}"}} {value}'
            )
        lines.append(
            f'vllm:request_success_total{{{labels},finished_reason="length"}} {c["success"]}'
        )
        if self.nixl:
            lines += [
                f"vllm:nixl_xfer_time_seconds_count{{{labels}}} {c['nixl_transfers']}",
                f"vllm:nixl_xfer_time_seconds_sum{{{labels}}} {c['nixl_transfers'] * 0.001}",
                f"vllm:nixl_bytes_transferred_count{{{labels}}} {c['nixl_transfers']}",
                f"vllm:nixl_bytes_transferred_sum{{{labels}}} {c['nixl_bytes']}",
                f"vllm:nixl_num_failed_transfers_total{{{labels}}} {c['nixl_failed']}",
            ]
        return "\n".join(lines) + "\n"


def make_handler(engine: Engine) -> type[http.server.BaseHTTPRequestHandler]:
    modes = engine.modes

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # vLLM's uvicorn sends with TCP_NODELAY. With Nagle's algorithm on, an answer's body,
        # written after its headers, waited for the client's delayed ACK: 40 ms an answer.
        disable_nagle_algorithm = True

        def do_GET(self):
            if self.path == "/health" and "hang-health" in modes:
                print("HEALTH CHECK HANGS", flush=True)  # tests wait for it to be under way
                time.sleep(3600)
                return
            if self.path == "/metrics":
                self.send(200, engine.metrics().encode(), "text/plain; version=0.0.4")
                return
            self.reply(200 if self.path in ("/health", "/v1/models") else 404, {})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            request_id = self.headers.get("x-request-id")
            print(f"REQUEST {request_id}", flush=True)
            if "die-request" in modes:
                print(
                    "ERROR AssertionError: fake engine core died on a request (chaos-9e2a)",
                    flush=True,
                )
                os._exit(0)
            time.sleep(3600 if "hang" in modes else modes.get("slow", 0))
            try:
                answer = engine.chat(body, request_id or f"fake-{time.monotonic_ns()}")
            except RequestRejected as exc:  # create_error_response of a VLLMValidationError
                error = {"message": str(exc), "type": "BadRequestError", "param": exc.param}
                self.reply(400, {"error": {**error, "code": 400}})
                return
            except EmbeddingsMissing as exc:
                # The engine core's death: the request's error (EngineDeadError's), then the
                # API server exits with code 0, as vLLM 0.32's does.
                print(f"ERROR EngineCore failed: {exc}", flush=True)
                error = {"message": ENGINE_DEAD_MESSAGE, "type": "InternalServerError"}
                dead = {"error": {**error, "param": None, "code": 500}}
                if body.get("stream"):
                    self.stream(engine_dead_events(dead))
                else:
                    self.reply(500, dead)
                self.wfile.flush()
                os._exit(0)
            except RequestFailed as exc:
                print(f"ERROR {exc}", flush=True)
                self.reply(500, {"error": {"message": str(exc), "type": "InternalServerError"}})
                return
            step_s = modes.get("decode-step", DECODE_STEP_S if engine.role == "decode" else 0.0)
            tokens = answer["usage"]["completion_tokens"]
            if body.get("stream"):
                self.stream(stream_events(answer, body), step_s, tokens)
                return
            time.sleep(step_s * max(tokens - 1, 0))
            self.reply(200, answer)

        def stream(self, events: list[bytes], step_s: float = 0.0, tokens: int = 0) -> None:
            """Server-sent events, chunked, as vLLM's StreamingResponse sends them
            (`media_type="text/event-stream"`; Starlette adds the charset): the role chunk and
            the first token's at once, each of the `tokens` token chunks after it a decode
            step (`step_s`) later."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for index, event in enumerate(events):
                if 2 <= index <= tokens:  # events[1..tokens] are the token chunks
                    time.sleep(step_s)
                self.wfile.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")

        def reply(self, status, payload):
            self.send(status, json.dumps(payload).encode(), "application/json")

        def send(self, status, data, content_type):
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    return Handler


def make_side_channel(engine: Engine) -> type[http.server.BaseHTTPRequestHandler]:
    class SideChannel(http.server.BaseHTTPRequestHandler):
        disable_nagle_algorithm = True  # as the chat handler's

        def do_GET(self):
            from urllib.parse import parse_qs, urlparse

            query = parse_qs(urlparse(self.path).query)
            request = (query.get("request") or [""])[0]
            blocks = [int(b) for b in (query.get("blocks") or [""])[0].split(",") if b]
            data = engine.serve_blocks(request, blocks)
            self.send_response(200 if data is not None else 404)
            self.send_header("Content-Length", str(len(data or b"")))
            self.end_headers()
            self.wfile.write(data or b"")

        def log_message(self, *args):
            pass

    return SideChannel


def parse_modes(role: str, served_name: str) -> dict[str, float]:
    modes = {}
    for item in filter(None, os.environ.get("FAKE_VLLM_MODE", "").split(";")):
        who, _, mode = item.partition(":")
        if who in (role, served_name, "*"):
            name, _, seconds = mode.partition("=")
            modes[name] = float(seconds or 0)
    return modes


def hold_devices() -> tuple[list[str], list[int]]:
    """FAKE_VLLM_LIVE_DIR: a lock per device for as long as this process lives; the devices
    another live fake already held."""
    import fcntl

    shared, held = [], []
    for device in filter(None, os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")):
        path = os.path.join(os.environ["FAKE_VLLM_LIVE_DIR"], f"device-{device}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            shared.append(device)
        held.append(fd)
    return shared, held


def main() -> None:
    args = parse_args(sys.argv[1:])
    engine = Engine(args, {})
    engine.modes.update(parse_modes(engine.role, args.served_model_name))
    modes = engine.modes
    print(
        f"fake vllm pid {os.getpid()} role {engine.role} port {args.port} modes {modes}", flush=True
    )
    shared: list[str] = []
    if os.environ.get("FAKE_VLLM_LIVE_DIR"):
        shared, _held = hold_devices()
    if os.environ.get("FAKE_VLLM_START_LOG"):  # one line per start: what tests count
        with open(os.environ["FAKE_VLLM_START_LOG"], "a") as start_log:
            launch = [a for a in sys.argv[1:] if a != str(args.port)]
            env = {k: v for k, v in os.environ.items() if k.startswith(("CUDA_", "VLLM_"))}
            start_log.write(
                json.dumps({"role": engine.role, "launch": launch, "shared": shared, "env": env})
                + "\n"
            )
    if "ignore-term" in modes:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if "fork-child" in modes:  # like vLLM's engine core: a child in the server's process group
        child = os.fork()
        if child == 0:
            time.sleep(3600)
            os._exit(0)
        print(f"CHILD {child}", flush=True)
    time.sleep(modes.get("slow-start", 0))
    if "die-start" in modes:
        print("FATAL: fake engine core failed to start (chaos-7c1d)", flush=True)
        sys.exit(3)
    if engine.nixl and engine.role == "prefill" and engine.side_port:
        side = http.server.ThreadingHTTPServer(
            (engine.side_host, engine.side_port), make_side_channel(engine)
        )
        side.daemon_threads = True
        threading.Thread(target=side.serve_forever, daemon=True).start()
    server = http.server.ThreadingHTTPServer(
        (args.host or "127.0.0.1", args.port), make_handler(engine)
    )
    server.daemon_threads = True
    print(f"listening on {args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
