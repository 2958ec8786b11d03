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
from harness.outcomes.taps import TapRecord
from harness.preflight import files
from harness.serve.proxy_protocol import collect_media, media_uuid
from harness.serve.tap import describe_request
from harness.spec.prompts import VideoFramesPart, render_part
from harness.testing.fake_vllm_server.model import tokenize

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


def test_typeless_audio_is_a_medium_of_the_request() -> None:
    """vLLM reads a typeless `{"audio_url": ...}` part as it reads a typed one, but the proxy
    collected only typed parts (found in review): an E+PD case whose only medium was such a
    clip counted no media, so its EC guards were never applied and it passed as text."""
    typed = {"type": "audio_url", "audio_url": {"url": "file:///media/clip.wav"}}
    typeless = {"audio_url": "file:///media/clip.wav"}
    refs = collect_media(_body(typeless))
    assert [(r.part_index, r.part_type) for r in refs] == [(0, "audio_url")]
    assert refs[0].uuid == media_uuid(typed)  # keyed by its URL, as the typed part is


def test_a_tap_records_typeless_media_parts() -> None:
    """A consumer sent a typeless clip raw must show it in its tap record, or the guards read
    the consumer as sent no media at all."""
    record = TapRecord(seq=0, instance="pd0", role="prefill_decode", path="/v1/chat/completions")
    describe_request(record, _body({"audio_url": "file:///media/clip.wav", "uuid": "u1"}))
    assert (record.part_types, record.metadata_only, record.uuids) == (
        ["audio_url"],
        [False],
        ["u1"],
    )


def test_the_fake_vllm_reads_typeless_parts_as_vllm_does() -> None:
    """vLLM reads a typeless `{"audio_url": ...}` part as the typed one; the fake server died
    of it (KeyError 'None'), and the proxy now sends such parts on (found in review)."""
    typed = {"type": "audio_url", "audio_url": {"url": "file:///media/clip.wav"}}
    typeless = {"audio_url": "file:///media/clip.wav"}
    typed_ids, _, typed_items = tokenize(_body(typed))
    typeless_ids, _, typeless_items = tokenize(_body(typeless))
    assert typeless_ids == typed_ids
    assert [i.kind for i in typeless_items] == [i.kind for i in typed_items] == ["audio"]
    assert typeless_items[0].computed() == typed_items[0].computed()  # the same clip
    frames = render_part(VideoFramesPart(seed=1))
    typeless_video = {"video_url": frames["video_url"]["url"]}
    assert tokenize(_body(typeless_video))[0] == tokenize(_body(frames))[0]
