"""The EPD proxy protocol, as pure functions over request and response bodies.

Written for vLLM 0.31 / 0.32 (the `by-hash-indexed` generation) and parameterised by the served
release's `ProtocolGeneration` (`harness.spec.generations`) where older releases differ: how
media are batched, which media go to encoders, and how the encoder's answer is read.

Kept apart from the HTTP server (`harness.serve.proxy`) so every rewrite can be unit-tested against
recorded encoder / prefill responses without a server. Per chat request the proxy:

1. collects the media parts in order (`image_url`, `video_url`, `audio_url`, `input_audio`);
2. fans them out to the encoders round-robin (cursor kept across requests); images that land
   on the same encoder share one sub-request, each video or audio item gets its own; every
   item carries a `uuid` so the encoder's cache key is stable and known (not in the
   `raw-media` flow of 0.27, where the consumer gets the media untouched and both sides key
   them by content);
3. reads each encoder's `ec_transfer_params = {mm_hash: {"item_indices": [...],
   "metadata": {...}}}`;
4. rewrites every media part that has metadata into a metadata-only `image_embeds` /
   `video_embeds` part (with the item's own `uuid`, which vLLM turns into the same mm_hash
   the encoder used) and copies the entries into `ec_transfer_params`;
   media without metadata stay raw (vLLM's silent fallback, which the guards look for);
5. with a prefill instance: sends the rewritten body with `max_tokens: 1` and
   `kv_transfer_params.do_remote_decode`, then hands P's `kv_transfer_params` to decode.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from harness.spec.generations import NEWEST, EncoderAnswer, ProtocolGeneration, ec_item_entry

MEDIA_PART_TYPES = ("image_url", "video_url", "audio_url", "input_audio")
MEDIA_URL_PART_TYPES = ("image_url", "video_url", "audio_url")
EMBEDS_PART_TYPE = {"image_url": "image_embeds", "video_url": "video_embeds"}
# Request fields the encoder must see too: they change what the media turn into (#56786).
ENCODER_PASSTHROUGH_FIELDS = ("mm_processor_kwargs", "media_io_kwargs")
PREFILL_KV_TRANSFER_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass(frozen=True)
class MediaRef:
    """Where one media part sits in a chat body, and the cache key the encoder will use."""

    position: int  # index among the request's media parts, in order
    message_index: int
    part_index: int
    part_type: str  # one of MEDIA_PART_TYPES
    uuid: str

    @property
    def is_video(self) -> bool:
        return self.part_type == "video_url"


@dataclass(frozen=True)
class EncoderBatch:
    """One encoder sub-request: the media positions it carries, in sub-request order."""

    encoder_index: int
    positions: tuple[int, ...]


@dataclass(frozen=True)
class EncodedItem:
    """What an encoder reported for one media position."""

    mm_hash: str
    metadata: dict[str, Any]


@dataclass
class RewriteResult:
    """The consumer-bound body plus a record of what was rewritten (the guards read it)."""

    body: dict[str, Any]
    forwarded_part_types: list[str] = field(default_factory=list)  # per media position
    metadata_only: list[bool] = field(default_factory=list)  # per media position


def media_part_type(part: Any) -> str | None:
    """The media kind of a content part: its `type` when that is one of MEDIA_PART_TYPES; for
    one of vLLM's typeless parts (`{"audio_url": "file://..."}`, which vLLM reads as the typed
    part: `_parse_chat_message_content_mm_part`), the media key it carries; else None.
    Typeless parts were not collected (found in review): a request whose only medium was one
    counted no media, and its EC guards were never applied."""
    if not isinstance(part, dict):
        return None
    kind = part.get("type")
    if kind is None:
        return next((key for key in MEDIA_PART_TYPES if part.get(key) is not None), None)
    return kind if kind in MEDIA_PART_TYPES else None


def media_uuid(part: dict[str, Any]) -> str:
    """A stable cache key for a media part: its own `uuid` if the client gave one, else a hash
    of its URL (of the whole part when it has none, e.g. `input_audio`), as vLLM 0.28-0.32's
    proxy keys an item (`content_uuid` in `disagg_epd_proxy.py`).

    The request's mm_processor_kwargs / media_io_kwargs are left out on purpose, as upstream
    leaves them: the engine folds them into the key itself (`get_mm_hashes`, from 0.30), and
    that derivation is under test (vLLM #56786: a kwarg left out of the engine's key feeds one
    kwarg set's embeddings to another). A key that mixed them in would hide such an engine
    behind the proxy (scenario ec-same-image-across-kwargs sends one image under two sets).
    Like upstream it hashes the URL, not the bytes behind a `file://` URL: a file changed in
    place keeps its key (failure mode: stale embeddings), which the scenarios probe on purpose.
    """
    if part.get("uuid"):
        return str(part["uuid"])
    kind = media_part_type(part)
    source = part.get(kind) if kind in MEDIA_URL_PART_TYPES else None
    url = source.get("url") if isinstance(source, dict) else source  # typeless: the URL itself
    keyed = url or json.dumps({k: v for k, v in part.items() if k != "uuid"}, sort_keys=True)
    digest = hashlib.sha256(str(keyed).encode()).hexdigest()
    return f"epd-{digest[:32]}"


def collect_media(request: dict[str, Any]) -> list[MediaRef]:
    """Every media part of the request, in order of appearance, typed or typeless."""
    refs: list[MediaRef] = []
    for message_index, message in enumerate(request.get("messages") or []):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part_index, part in enumerate(content):
            kind = media_part_type(part)
            if kind is not None:
                refs.append(
                    MediaRef(
                        position=len(refs),
                        message_index=message_index,
                        part_index=part_index,
                        part_type=kind,
                        uuid=media_uuid(part),
                    )
                )
    return refs


def plan_encoder_batches(
    media: list[MediaRef],
    encoder_count: int,
    cursor: int,
    generation: ProtocolGeneration = NEWEST,
) -> tuple[list[EncoderBatch], int]:
    """Assign media to encoders round-robin from `cursor`; return batches and the next cursor.

    The cursor persists across requests: restarting it at encoder 0 for every request sent all
    single-image traffic to one encoder (vLLM #52484). Only images share a sub-request, as in
    vLLM 0.31 / 0.32's proxy (`image_groups`): a video or audio item gets one of its own. A
    generation whose answer does not say which item of a sub-request an entry belongs to gets
    one item per sub-request; videos skip the encoder where the generation does not encode them.
    """
    if encoder_count <= 0:
        raise ValueError("media need at least one encoder")
    one_per_batch = generation.encoder_answer is not EncoderAnswer.BY_HASH_INDEXED
    images_by_encoder: dict[int, list[int]] = {}
    batches: list[EncoderBatch] = []
    for ref in media:
        if ref.is_video and not generation.video_through_encoder:
            continue
        encoder_index = cursor % encoder_count
        cursor += 1
        if ref.part_type != "image_url" or one_per_batch:
            batches.append(EncoderBatch(encoder_index, (ref.position,)))
        else:
            images_by_encoder.setdefault(encoder_index, []).append(ref.position)
    for encoder_index, positions in images_by_encoder.items():
        batches.append(EncoderBatch(encoder_index, tuple(positions)))
    batches.sort(key=lambda b: b.positions[0])
    return batches, cursor


def _part_at(request: dict[str, Any], ref: MediaRef) -> dict[str, Any]:
    return request["messages"][ref.message_index]["content"][ref.part_index]


def build_encoder_request(
    request: dict[str, Any],
    media: list[MediaRef],
    batch: EncoderBatch,
    generation: ProtocolGeneration = NEWEST,
) -> dict[str, Any]:
    """The encoder sub-request: only the batch's media parts, each with its `uuid`, and the
    request's media kwargs; no `max_tokens`, as vLLM 0.28+'s proxy sends none (the encoder
    finishes once the media are encoded).

    `raw-media` (0.27) as 0.27.1's proxy: the parts as the client sent them, no uuid added,
    and `max_tokens: 1` (`generation.encoder_max_tokens`). Its consumer gets the untouched
    request and finds the encoder's EC file under the key it derives from the same part; a
    uuid only the encoder got would make the two keys differ."""
    keyed = generation.encoder_answer is not EncoderAnswer.NONE
    parts = []
    for position in batch.positions:
        ref = media[position]
        part = copy.deepcopy(_part_at(request, ref))
        if keyed:
            part["uuid"] = ref.uuid
        parts.append(part)
    body: dict[str, Any] = {
        "model": request.get("model"),
        "messages": [{"role": "user", "content": parts}],
        "stream": False,
    }
    if generation.encoder_max_tokens is not None:
        body["max_tokens"] = generation.encoder_max_tokens
    for name in ENCODER_PASSTHROUGH_FIELDS:
        if name in request:
            body[name] = copy.deepcopy(request[name])
    return body


class EncoderAnswerError(ValueError):
    """The encoder's `ec_transfer_params` do not have the shape the generation expects."""


class EncoderAnswerUnfit(EncoderAnswerError):
    """The encoder's answer, of the generation's shape, names items its sub-request did not
    hold (an item index past them, more items with metadata than it sent), or an entry of it
    is broken (no object, item_indices no list, metadata no object): a broken answer of that
    encoder, which the proxy names as such (not the proxy's own failure)."""


def index_encoder_response(
    batch: EncoderBatch,
    ec_transfer_params: dict[str, Any] | None,
    generation: ProtocolGeneration = NEWEST,
) -> dict[int, EncodedItem]:
    """Map the encoder's entries back to request media positions.

    `raw-media` (0.27): the encoder answers no ec_transfer_params (its ECExampleConnector has
    no request_finished), so nothing is indexed and the consumer gets the media raw.
    `by-hash-indexed`: each entry's `item_indices` (sub-request order) say where it belongs.
    Older answers carry no position; their sub-requests hold one item (`plan_encoder_batches`),
    so every entry belongs to it. An entry without metadata is left out: such media stay raw
    downstream. An item claimed by two entries with metadata is a broken answer (each item
    has one mm_hash), as is more than one such entry for a one-item sub-request. A shape
    other than the generation's raises EncoderAnswerError with the answer.
    """
    answer = generation.encoder_answer
    if answer is EncoderAnswer.NONE:
        return {}  # 0.27: nothing to read; the consumer finds the file by its own key
    params = ec_transfer_params or {}
    if not isinstance(params, dict):
        raise EncoderAnswerError(
            f"encoder answered ec_transfer_params of type "
            f"{type(params).__name__}: {_excerpt(params)}"
        )
    if answer is EncoderAnswer.ITEM_LIST:
        return _index_item_list(batch, params)
    if "ec_items" in params:
        raise EncoderAnswerError(
            f"encoder answered an ec_items list, which {generation.name} does not speak "
            f"(a release older than 0.30?): {_excerpt(params)}"
        )
    if answer is EncoderAnswer.BY_HASH:
        return _index_single_item(batch, [(h, e) for h, e in params.items()], params)
    found: dict[int, EncodedItem] = {}
    for mm_hash, entry in params.items():
        if not isinstance(entry, dict):
            raise EncoderAnswerUnfit(
                f"encoder entry {mm_hash!r} is not an object: {_excerpt(params)}"
            )
        metadata = entry.get("metadata") or {}
        indices = entry.get("item_indices")
        if not isinstance(metadata, dict) or not isinstance(indices, list | None):
            raise EncoderAnswerUnfit(
                f"encoder entry {mm_hash!r} has item_indices no list or metadata no object: "
                f"{_excerpt(params)}"
            )
        for item_index in indices or []:
            if type(item_index) is not int or not 0 <= item_index < len(batch.positions):
                raise EncoderAnswerUnfit(
                    f"encoder reported item index {item_index} for a sub-request of "
                    f"{len(batch.positions)} item(s): {_excerpt(params)}"
                )
            if not metadata:
                continue
            position = batch.positions[item_index]
            if position in found and found[position].mm_hash != mm_hash:
                raise EncoderAnswerUnfit(
                    f"encoder entries {found[position].mm_hash!r} and {mm_hash!r} both have "
                    f"metadata for item {item_index}: {_excerpt(params)}"
                )
            found[position] = EncodedItem(mm_hash, metadata)
    return found


def _index_item_list(batch: EncoderBatch, params: dict[str, Any]) -> dict[int, EncodedItem]:
    items = params.get("ec_items")
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise EncoderAnswerError(
            f"expected {{'ec_items': [{{...}}, ...]}}, encoder answered {_excerpt(params)}"
        )
    return _index_single_item(batch, [ec_item_entry(item) for item in items], params)


def _index_single_item(
    batch: EncoderBatch, entries: list[tuple[str, Any]], params: dict[str, Any]
) -> dict[int, EncodedItem]:
    """Answers without positions: valid only for one-item sub-requests."""
    if len(batch.positions) != 1:
        raise ValueError(
            f"an answer without item positions needs one item per sub-request, "
            f"got {len(batch.positions)}"
        )
    for mm_hash, entry in entries:
        # Else passed on: the media left raw, or a list handed to the consumers as metadata.
        if not isinstance(entry, dict):
            raise EncoderAnswerUnfit(
                f"encoder entry {mm_hash!r} is not an object: {_excerpt(params)}"
            )
        if not isinstance(entry.get("metadata") or {}, dict):
            raise EncoderAnswerUnfit(
                f"encoder entry {mm_hash!r} has metadata no object: {_excerpt(params)}"
            )
    with_metadata = [(h, e) for h, e in entries if e.get("metadata")]
    if len(with_metadata) > 1:
        raise EncoderAnswerUnfit(
            f"{len(with_metadata)} entries with metadata for one item: {_excerpt(params)}"
        )
    if not with_metadata:
        return {}
    mm_hash, entry = with_metadata[0]
    return {batch.positions[0]: EncodedItem(mm_hash, entry["metadata"])}


def merge_encoder_params(
    answers: list[dict[str, Any] | None], generation: ProtocolGeneration = NEWEST
) -> dict[str, Any]:
    """The `ec_transfer_params` a consumer gets: every sub-request's answer in one object
    (entries by hash merged; `ec_items` lists concatenated in sub-request order). The entries
    themselves are shared, not copied: a planted fault that rewrites one (ProxyFaults.after_encode)
    must reach the consumer and the trace alike."""
    merged: dict[str, Any] = {}
    for params in answers:
        if not params or generation.encoder_answer is EncoderAnswer.NONE:
            continue
        if generation.encoder_answer is EncoderAnswer.ITEM_LIST:
            merged.setdefault("ec_items", []).extend(params.get("ec_items") or [])
        else:
            merged.update(params)
    return merged


def tensor_metadata(metadata: dict[str, Any]) -> dict[str, str]:
    """Each metadata value as vLLM 0.28 / 0.29 read it: base64 of `torch.save(tensor)`.
    torch is imported here only: no other generation (and no unit test of them) needs it."""
    import base64
    import io

    import torch

    encoded = {}
    for name, value in metadata.items():
        buffer = io.BytesIO()
        torch.save(torch.tensor(value), buffer)
        encoded[name] = base64.b64encode(buffer.getvalue()).decode("ascii")
    return encoded


def _excerpt(value: Any) -> str:
    return json.dumps(value, default=str)[:300]


def rewrite_for_consumer(
    request: dict[str, Any],
    media: list[MediaRef],
    encoded: dict[int, EncodedItem],
    ec_transfer_params: dict[str, Any],
    generation: ProtocolGeneration = NEWEST,
) -> RewriteResult:
    """Replace encoded media parts by metadata-only `*_embeds` parts; attach the EC params.
    Generations that read every metadata value as a tensor get base64 torch tensors."""
    body = copy.deepcopy(request)
    result = RewriteResult(body=body)
    for ref in media:
        item = encoded.get(ref.position)
        embeds_type = EMBEDS_PART_TYPE.get(ref.part_type)
        content = body["messages"][ref.message_index]["content"]
        if item is None or embeds_type is None:
            result.forwarded_part_types.append(ref.part_type)
            result.metadata_only.append(False)
            continue
        # The consumer must derive the encoder's cache key itself, so it gets the same uuid
        # the encoder got, not the key the encoder returned: with per-request
        # mm_processor_kwargs / media_io_kwargs vLLM hashes (uuid, kwargs) into the key, and
        # handing back the key would hash it twice, miss the EC file, and leave a consumer
        # with metadata only and no embeddings (its engine dies). Without kwargs both are equal.
        content[ref.part_index] = {
            "type": embeds_type,
            embeds_type: (
                tensor_metadata(item.metadata)
                if generation.metadata_as_tensors
                else copy.deepcopy(item.metadata)
            ),
            "uuid": ref.uuid,
        }
        result.forwarded_part_types.append(embeds_type)
        result.metadata_only.append(True)
    if ec_transfer_params:
        body["ec_transfer_params"] = copy.deepcopy(ec_transfer_params)
    return result


def build_prefill_request(consumer_body: dict[str, Any]) -> dict[str, Any]:
    """P computes the prompt (one token) and keeps its KV for D."""
    body = copy.deepcopy(consumer_body)
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    body.pop("stream_options", None)
    body["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    return body


def build_decode_request(
    consumer_body: dict[str, Any], prefill_response: dict[str, Any] | None
) -> dict[str, Any]:
    """D gets the same rewritten body plus whatever KV coordinates P returned."""
    body = copy.deepcopy(consumer_body)
    kv_params = (prefill_response or {}).get("kv_transfer_params")
    if kv_params:
        body["kv_transfer_params"] = kv_params
    return body
