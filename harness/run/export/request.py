"""The case's request body as the export sends it: its local media inlined, what it asks for,
and a reader's one-line picture of it."""

from __future__ import annotations

import base64
import copy
import mimetypes
from pathlib import Path
from typing import Any

from harness.errors import BadInput


def inline_local_media(body: dict[str, Any]) -> dict[str, Any]:
    """`body` with every file:// media URL (a run with `--media-dir`) replaced by a data: URL
    of the same bytes, so the export needs no file of the recording machine. vLLM reads both
    into the same bytes; BadInput when a file is gone since the run."""
    body = copy.deepcopy(body)
    for message in body.get("messages", []):
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            for key in ("image_url", "video_url"):
                media = part.get(key)
                url = media.get("url", "") if isinstance(media, dict) else ""
                if url.startswith("file://"):
                    media["url"] = data_url(Path(url[len("file://") :]))
    return body


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
    kinds: dict[str, int] = {}
    words = 0
    for message in body.get("messages", []):
        content = message.get("content")
        parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
        for part in parts:
            kind = part.get("type", "?")
            if kind == "text":
                words += len(str(part.get("text", "")).split())
            else:
                kinds[kind] = kinds.get(kind, 0) + 1
    names = {"image_url": "image", "video_url": "video", "image_embeds": "image_embeds part"}
    media = [
        f"{count} {names.get(kind, kind)}{'s' if count > 1 else ''}"
        for kind, count in kinds.items()
    ]
    return " + ".join([*media, f"{words} words of text"])
