"""The preflight's prompt-token count (harness.preflight.tokens) without the model's processor:
what it decodes of each medium, and what its cache key covers."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.preflight import tokens
from harness.spec.prompts import VideoFramesPart, render_part

pytestmark = pytest.mark.unit


def test_a_jpeg_frame_list_video_is_counted_with_all_its_frames() -> None:
    """`data:video/jpeg;base64,<f1>,<f2>,...` (VideoFramesPart; scenario m-video-jpeg-frames
    and the fuzzer) is a list of frames to vLLM (it splits on ','). Decoded as one blob,
    OpenCV read one frame of it: the video was counted as 1 frame instead of 8 (64 merged
    tokens instead of 256 with the tiny model), so `check_prompts_fit` passed a request every
    server then rejected, and the cached count kept the wrong number."""
    url = render_part(VideoFramesPart(seed=22, num_frames=8))["video_url"]["url"]
    frames = tokens._load_video(url)
    assert frames.shape[0] == 8
    assert frames.shape[-1] == 3, "RGB frames, as vLLM's image loader converts them"


def test_a_file_media_changed_in_place_is_counted_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--media-dir` requests name media by file:// URL; the key hashed the body (the URL),
    not the bytes behind it. Replace the video with a longer one and the preflight reused the
    old count: `check_prompts_fit` passed a request every server will reject (or refused one
    that fits)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    media = tmp_path / "media" / "clip.bin"
    media.parent.mkdir()
    body = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": f"file://{media}"}}],
            }
        ]
    }
    counted: list[str] = []

    def count(_model: Path, bodies: dict) -> dict[str, int]:
        counted.extend(bodies)
        return {name: 10 + media.stat().st_size for name in bodies}

    monkeypatch.setattr(tokens, "_count_with_processor", count)
    cache = tmp_path / "prompt-tokens"
    media.write_bytes(b"x" * 5)
    assert tokens.estimate_prompt_tokens(model, {"p": body}, cache) == {"p": 15}
    assert tokens.estimate_prompt_tokens(model, {"p": body}, cache) == {"p": 15}
    assert counted == ["p"], "the same bytes again are read from the cache"
    media.write_bytes(b"x" * 5000)
    assert tokens.estimate_prompt_tokens(model, {"p": body}, cache) == {"p": 5010}, (
        "the count of the old file was reused"
    )
