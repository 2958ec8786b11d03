"""The fake's model: a request's prompt ids as a chat template makes them, every prompt
position's KV row, and the ids generated from those rows. The rows chain each token and each
placeholder's embedding row (a video's with its temporal position) into the next, and the answer
is a digest of them all, so a changed embedding, position or KV row changes the answer, as it
would a model's: what lets a fake topology's transfer fault show in its answer.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib

if __package__:  # imported, by the tests of its pure functions
    from harness.testing.fake_vllm_server.media import MediaItem, media_kwargs
    from harness.testing.fake_vllm_server.tensors import ROW_BYTES, rows_from
else:  # the executable: harness.testing.fake_vllm wrote these modules beside it
    from media import MediaItem, media_kwargs  # type: ignore[no-redef]
    from tensors import ROW_BYTES, rows_from  # type: ignore[no-redef]

# Qwen2.5-VL's own placeholder ids: what a model directory without them in its config gets.
PLACEHOLDER_IDS = {"image": 151655, "video": 151656, "audio": 151646}
PLACEHOLDER_CONFIG_KEYS = {"image": "image_token_id", "video": "video_token_id"}
IM_START, IM_END = 151644, 151645
ROLE_IDS = {"system": 8948, "user": 872, "assistant": 77091}


def word_id(word: str) -> int:
    """One id per word, stable across processes (a crc, not Python's salted hash)."""
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
