"""Tests for the generated media: deterministic bytes, decodable, seed-dependent.

They need only pillow, numpy and opencv (the unit tier); the tiny model's tests are in
test_tiny_model.py and test_tiny_model_sensitivity.py.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image

from fixtures import media

pytestmark = pytest.mark.unit

# --- media -----------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [media.make_image, media.make_noise_image])
def test_same_seed_gives_identical_png_bytes(make) -> None:
    assert media.image_png_bytes(make(7)) == media.image_png_bytes(make(7))


@pytest.mark.parametrize("make", [media.make_image, media.make_noise_image])
def test_distinct_seeds_give_distinct_pixels(make) -> None:
    images = [np.asarray(make(seed)) for seed in range(20)]
    for i, first in enumerate(images):
        for second in images[i + 1 :]:
            assert not np.array_equal(first, second)


def test_image_size_is_width_by_height() -> None:
    image = media.make_image(1, size=(320, 200))
    assert image.mode == "RGB"
    assert image.size == (320, 200)
    assert np.asarray(image).shape == (200, 320, 3)


def test_png_decodes_to_the_same_pixels() -> None:
    image = media.make_image(3)
    decoded = Image.open(io.BytesIO(media.image_png_bytes(image)))
    assert np.array_equal(np.asarray(decoded), np.asarray(image))


def test_data_url_round_trips() -> None:
    payload = media.image_png_bytes(media.make_image(4))
    url = media.data_url("image/png", payload)
    header, _, encoded = url.partition(",")
    assert header == "data:image/png;base64"
    assert base64.b64decode(encoded, validate=True) == payload


def _decode_video(path: Path) -> tuple[float, list[np.ndarray]]:
    capture = cv2.VideoCapture(str(path))
    try:
        fps = capture.get(cv2.CAP_PROP_FPS)
        frames = []
        ok, frame = capture.read()
        while ok:
            frames.append(frame)
            ok, frame = capture.read()
        return fps, frames
    finally:
        capture.release()


def test_mp4_decodes_with_expected_frame_count_fps_and_size(tmp_path: Path) -> None:
    path = media.make_video_mp4(
        tmp_path / "clip.mp4", seed=5, num_frames=12, fps=4.0, size=(160, 112)
    )
    fps, frames = _decode_video(path)
    assert fps == pytest.approx(4.0)
    assert len(frames) == 12
    assert frames[0].shape == (112, 160, 3)
    # The shapes move, so consecutive frames differ.
    assert not np.array_equal(frames[0], frames[1])


def test_mp4_bytes_are_deterministic_and_seed_dependent() -> None:
    first = media.video_mp4_bytes(9)
    assert first == media.video_mp4_bytes(9)
    assert first != media.video_mp4_bytes(10)


def _jpeg_pixels(jpeg: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"), dtype=np.int16)


def test_jpeg_frames_are_deterministic_and_match_the_video(tmp_path: Path) -> None:
    jpegs = media.make_video_frames_jpeg(6, num_frames=4)
    assert jpegs == media.make_video_frames_jpeg(6, num_frames=4)
    assert len(jpegs) == 4
    assert len(set(jpegs)) == 4
    _, video_frames = _decode_video(media.make_video_mp4(tmp_path / "v.mp4", 6, num_frames=4))
    other_seed = _jpeg_pixels(media.make_video_frames_jpeg(60, num_frames=1)[0])
    for jpeg, bgr in zip(jpegs, video_frames, strict=True):
        pixels = _jpeg_pixels(jpeg)
        video_pixels = bgr[..., ::-1].astype(np.int16)
        # Both are lossy encodings of one scene: close on average, far from another seed's.
        assert np.abs(pixels - video_pixels).mean() < 8.0
        assert np.abs(pixels - other_seed).mean() > 8.0


# --- tiny model ------------------------------------------------------------------------------


# -- rendered into a request: each medium made once per process ---------------------------------


def test_a_medium_is_made_once_per_process_and_every_body_is_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found profiling the fake GPU night: each sweep rendered its prompts anew, and making and
    encoding the images took 12 CPU-s of its 251 s. The same part renders the same URL, so it is
    made once; each body is still a dict of its own (a case adds its salt to it)."""
    from harness.spec import prompts

    made = []
    make_image = media.make_image
    monkeypatch.setattr(media, "make_image", lambda *a: made.append(a) or make_image(*a))
    spec = prompts.PromptSpec("p", (prompts.ImagePart(seed=987654), prompts.TextPart("hi")))
    first = prompts.render_request(spec, "m")
    second = prompts.render_request(spec, "m")
    assert first == second and first is not second
    assert len(made) == 1
    first["messages"][0]["content"][0]["image_url"]["url"] = "changed"
    assert prompts.render_request(spec, "m") == second


def test_a_part_that_cannot_be_hashed_is_still_rendered() -> None:
    """A size read back from JSON is a list: rendered as it is, without the cache."""
    from harness.spec import prompts

    listed = prompts.render_part(prompts.ImagePart(seed=5, size=[64, 48]))  # type: ignore[arg-type]
    assert listed == prompts.render_part(prompts.ImagePart(seed=5, size=(64, 48)))
