"""How many frames of a video vLLM's loaders hand the processor (harness/spec/video_sampling.py),
against what vLLM 0.32's own `Qwen2VLVideoBackend.compute_frames_index_to_sample` returns for
the same clip (read by calling it; the values below are its answers)."""

from __future__ import annotations

import pytest

from harness.spec.video_sampling import qwen2vl_frames

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
