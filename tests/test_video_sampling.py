"""How many frames of a video vLLM's loaders hand the processor (harness/spec/video_sampling.py),
against what vLLM 0.32's own `Qwen2VLVideoBackend.compute_frames_index_to_sample` returns for
the same clip (read by calling it; the values below are its answers)."""

from __future__ import annotations

import pytest

from harness.spec.video_sampling import (
    MAX_FPS,
    container_sampling,
    jpeg_frames,
    qwen2vl_frames,
    uniform_frames,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("total", "fps", "kept"),
    [
        (16, 4.0, 8),
        (11, 2.0, 10),
        (13, 2.0, 12),
        (8, 1.0, 8),
        # The loader's float32 step (torch.arange(0, total, total / n)) yields one index past
        # n here, clamped onto the last frame, and vLLM keeps it: the processor then pads the
        # odd count to whole temporal steps, one step more than n frames take.
        (75, 10.0, 15),
        (107, 4.0, 53),
        (59, 2.0, 59),
    ],
)
def test_qwen2vl_keeps_the_frames_vllms_loader_keeps(total: int, fps: float, kept: int) -> None:
    """The count stopped at n (14 of a 75-frame 10 fps clip) where vLLM keeps n + 1 (15), so
    the preflight counted one temporal step fewer than every server took, and let through a
    request that did not fit (found in review)."""
    assert qwen2vl_frames(total, fps) == kept


def test_qwen2vl_samples_a_rate_past_its_clamp_at_the_clamp() -> None:
    """media_io_kwargs video.fps above Qwen2VLVideoBackend's 30 samples as 30: a 2 s clip of
    120 frames at 60 fps keeps 60 frames asked at 60 fps, not all 120, or the preflight counts
    twice the tokens every server computes and refuses a prompt that fits."""
    assert qwen2vl_frames(120, 60.0, target_fps=60.0) == 2 * MAX_FPS == 60
    assert qwen2vl_frames(120, 60.0, target_fps=MAX_FPS) == 60


def test_the_generic_loader_keeps_at_most_num_frames_one_per_step_and_never_none() -> None:
    """VideoBackend's bounds, each on its own: num_frames (32 of 100), the rate (20 of a
    10 s clip at 2 fps), both off when not positive, and at least one frame where the rate
    leaves none (a 0.3 s clip sampled at 1 fps still hands the processor one frame)."""
    assert uniform_frames(100, 10.0, 32, -1) == 32
    assert uniform_frames(100, 10.0, 64, 2.0) == 20
    assert uniform_frames(100, 10.0, -1, -1) == 100
    assert uniform_frames(10, 30.0, 32, 1.0) == 1


def test_a_jpeg_frame_list_is_cut_to_num_frames_unless_minus_one() -> None:
    assert jpeg_frames(40) == 32
    assert jpeg_frames(40, 8) == 8
    assert jpeg_frames(40, -1) == 40
    assert jpeg_frames(5, 8) == 5


def test_kept_frames_of_a_container_stand_for_the_rate_they_span() -> None:
    """32 frames kept of a 100-frame clip at 10 fps span its 10 s: 3.2 frames a second, not
    the 10 it was recorded at (the rate the processor's temporal positions follow)."""
    assert container_sampling(100, 10.0, {}, qwen2vl=False) == (32, 3.2)
