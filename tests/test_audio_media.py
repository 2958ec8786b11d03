"""Audio parts through the harness: every list of media kinds must hold audio too.

The proxy, the export and vLLM read `audio_url` (and `input_audio`) as they read images and
videos; a check that walks only `image_url` / `video_url` judges a request with audio wrongly
(found in review).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harness.errors import BadInput
from harness.preflight import files

pytestmark = pytest.mark.unit


def _body(part: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "?"}]}]}


def _url_part(kind: str, url: str, typeless: bool) -> dict[str, Any]:
    """A media part in either form vLLM reads: typed, or its typeless shorthand."""
    return {kind: url} if typeless else {"type": kind, kind: {"url": url}}


@pytest.mark.parametrize(
    ("kind", "typeless"),
    [("audio_url", False), ("audio_url", True), ("image_url", True)],
)
def test_media_dir_check_reads_audio_urls(tmp_path: Path, kind: str, typeless: bool) -> None:
    """A run whose only file:// medium is an audio clip (or a typeless part) was refused with
    --media-dir ("no prompt ... names a file:// medium") and not checked at all without it."""
    media_dir = tmp_path / "media"
    media_dir.mkdir()
    clip = media_dir / "clip.wav"
    clip.write_bytes(b"RIFF")
    body = _body(_url_part(kind, f"file://{clip}", typeless))
    files.check_media_references({"clip": body}, media_dir)  # read: no refusal
    with pytest.raises(BadInput, match="no --media-dir was given"):
        files.check_media_references({"clip": body}, None)
    clip.unlink()
    with pytest.raises(BadInput, match=f"media file {clip} does not exist"):
        files.check_media_references({"clip": body}, media_dir)
