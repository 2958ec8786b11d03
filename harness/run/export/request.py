"""The case's request body as the export sends it (and the scenario's earlier requests, sent
before it): its local media inlined, what it asks for, the cache salt each goes under, and a
reader's one-line picture of it."""

from __future__ import annotations

import base64
import copy
import mimetypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.errors import BadInput
from harness.run.export.standalone_check import BEFORE_DIR
from harness.serve.proxy_protocol import MEDIA_PART_TYPES, MEDIA_URL_PART_TYPES
from harness.serve.session import safe_name
from harness.spec.file_media import FILE_URL_PREFIX
from harness.spec.prompts import CACHE_SALT

# The salts of an export with earlier requests: fixed, since serve.sh starts fresh instances
# every time, and written into each file, so what a reader sees is what is sent.
CASE_SALT = "epd-export-case"
BEFORE_SALT = "epd-export-before-{number:02d}"


@dataclass(frozen=True)
class EarlierRequest:
    """A matrix scenario's request the run sent before the case's, on the same servers:
    check.py sends its file first (`file`, relative to the export), and does not judge it."""

    prompt: str
    body: dict[str, Any]
    file: str


def earlier_request(number: int, prompt: str, body: dict[str, Any]) -> EarlierRequest:
    """The `number`th (from 1) earlier request: `before/NN-<prompt>.json`, its body under a
    cache salt of its own (`own_salt`)."""
    return EarlierRequest(
        prompt,
        own_salt(body, BEFORE_SALT.format(number=number)),
        f"{BEFORE_DIR}/{number:02d}-{safe_name(prompt)}.json",
    )


def own_salt(body: dict[str, Any], salt: str) -> dict[str, Any]:
    """`body` under the `cache_salt` `salt`, unless it carries its own (kept, as
    `harness.spec.prompts.fresh_prefix_request` keeps it).

    The run sent each request under a salt of its own, so no instance took a request's
    leading blocks from its prefix cache because an earlier one had computed them. On fresh
    instances a lone request needs none; after earlier requests sharing its prefix it does:
    ExampleConnector counts a hit beyond the tokens the prefix cache holds, so with P's cache
    holding the earlier prompt's blocks, epd-kv-lookup-miss-kills-prefill's P would find
    nothing more to load, and live."""
    return body if body.get(CACHE_SALT) else {**body, CACHE_SALT: salt}


def inline_local_media(body: dict[str, Any]) -> dict[str, Any]:
    """`body` with every file:// media URL (a run with `--media-dir`) replaced by a data: URL
    of the same bytes, so the export needs no file of the recording machine. vLLM reads both
    into the same bytes; BadInput when a file is gone since the run.

    Every kind vLLM reads by URL, audio too (found in review: only images and videos were),
    and in either form it accepts: `{"url": ...}`, or the URL itself (its typeless parts)."""
    body = copy.deepcopy(body)
    for message in body.get("messages", []):
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            for key in MEDIA_URL_PART_TYPES:
                media = part.get(key) if isinstance(part, dict) else None
                if isinstance(media, dict) and is_file_url(media.get("url")):
                    media["url"] = data_url(Path(media["url"][len(FILE_URL_PREFIX) :]))
                elif is_file_url(media):
                    part[key] = data_url(Path(media[len(FILE_URL_PREFIX) :]))
    return body


def is_file_url(url: Any) -> bool:
    return isinstance(url, str) and url.startswith(FILE_URL_PREFIX)


def data_url(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BadInput(
            f"the case's request reads {path} (file:// media), which cannot be read now: {exc}"
        ) from exc
    mime = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def asks_for_logprobs(body: dict[str, Any]) -> bool:
    """Whether a chat request asks for the top-k log-probs (at least 2: the drift rule needs
    the other token's)."""
    top = body.get("top_logprobs")
    return bool(body.get("logprobs")) and isinstance(top, int) and top >= 2


def describe_request(body: dict[str, Any]) -> str:
    """'one image + 4 words of text': what a reader of the issue needs to picture it."""
    names = {
        "image_url": "image",
        "video_url": "video",
        "image_embeds": "image_embeds part",
        "audio_url": "audio clip",
        "input_audio": "audio clip",
    }
    kinds: dict[str, int] = {}  # by name: an audio clip is one, by URL or inline
    words = 0
    for message in body.get("messages", []):
        content = message.get("content")
        parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
        for part in parts:
            kind = part.get("type") or _typeless_kind(part)
            if kind == "text":
                words += len(str(part.get("text", "")).split())
            else:
                name = names.get(kind, kind)
                kinds[name] = kinds.get(name, 0) + 1
    media = [f"{count} {name}{'s' if count > 1 else ''}" for name, count in kinds.items()]
    return " + ".join([*media, f"{words} words of text"])


def _typeless_kind(part: dict[str, Any]) -> str:
    """The media kind of one of vLLM's typeless parts (`{"audio_url": "file://..."}`), named
    by its media key as vLLM reads it; "?" for a part that has none."""
    return next((key for key in MEDIA_PART_TYPES if key in part), "?")
