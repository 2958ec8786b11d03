"""How many frames of a video vLLM hands the model's processor: its video loaders' rules (vLLM
0.32, read in `vllm/multimodal/media/video.py` and `vllm/multimodal/video.py`), in one place
for the four that need them: the preflight's token count, the fuzzer's video timing and its
layout estimate (harness/run/fuzz/layout.py), and the fake vLLM's processor
(harness/testing/fake_vllm_server/, which runs where the harness cannot be imported: its
installer writes this file beside it, so this module imports nothing of the harness).

A video's prompt tokens follow from the frames the processor receives, not from the frames
sent: vLLM samples an mp4 down before its processor sees it, and reads at most 32 JPEG frames
of a frame list. Counting the frames as sent refused prompts every server accepts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

TEMPORAL_PATCH = 2  # Qwen2-VL's temporal_patch_size: two frames per step
TARGET_FPS = 2.0  # Qwen2VLVideoBackend's default sampling rate (media_io_kwargs video.fps)
JPEG_FRAMES_FPS = 1.0  # the rate JPEG frames are read at unless media_io_kwargs says
# VideoMediaIO's num_frames default: a JPEG frame list is cut to its first 32 frames, and the
# generic loader samples a container down to 32.
DEFAULT_NUM_FRAMES = 32
MIN_FRAMES, MAX_FRAMES, MAX_FPS = 4, 768, 30  # Qwen2VLVideoBackend's clamps
# The video processor whose loader vLLM picks by name (`get_video_loader_backend_for_processor`);
# every other video processor gets the generic uniform loader.
QWEN2VL_VIDEO_PROCESSOR = "Qwen2VLVideoProcessor"
# The loaders by the names media_io_kwargs' video.video_backend gives them: Qwen2VLVideoBackend
# (`qwen2vl_frames`) and the generic uniform one (`uniform_frames`).
QWEN2VL_LOADER = "qwen2_vl"
UNIFORM_LOADER = "opencv"
LOADERS = (QWEN2VL_LOADER, UNIFORM_LOADER)


def qwen2vl_frames(total: int, original_fps: float, target_fps: float = TARGET_FPS) -> int:
    """Frames Qwen2VLVideoBackend keeps of a container video of `total` frames recorded at
    `original_fps`: n = `total / original_fps * fps`, clamped to [4, 768] and to the video,
    floored to whole temporal steps, then as many indices as `torch.arange(0, total,
    total / n)` yields, which is n + 1 where the step's rounding leaves room for one more
    (75 frames at 10 fps: 15, not 14; the extra index is clamped onto the last frame and kept,
    and the processor pads the odd count to whole steps). That length is
    `ceil(total / (total / n))` in double precision, as torch sizes an arange (checked
    against torch for every clip up to 3000 frames). It ignores num_frames (fps-driven)."""
    if original_fps <= 0:
        raise ValueError("the video reports no frame rate (vLLM's Qwen2-VL loader needs one)")
    most = math.floor(min(MAX_FRAMES, total) / TEMPORAL_PATCH) * TEMPORAL_PATCH
    frames = total / original_fps * min(target_fps, MAX_FPS)
    frames = min(max(frames, MIN_FRAMES), most, total)
    kept = math.floor(frames / TEMPORAL_PATCH) * TEMPORAL_PATCH
    if kept < 1:
        raise ValueError(f"a video of {total} frame(s) has no whole temporal step to sample")
    return math.ceil(total / (total / kept))


def uniform_frames(total: int, original_fps: float, num_frames: int, fps: float) -> int:
    """Frames the generic loader (`VideoBackend`) keeps: at most `num_frames`, at most one
    every 1/fps seconds (each bound off when not positive), at least one."""
    kept = total
    if num_frames > 0:
        kept = min(num_frames, total)
    if fps > 0 and original_fps > 0:
        kept = min(kept, math.floor(total / original_fps * fps))
    return max(1, kept)


def jpeg_frames(sent: int, num_frames: int = DEFAULT_NUM_FRAMES) -> int:
    """Frames VideoMediaIO reads of a `data:video/jpeg` list of `sent` frames: the first
    `num_frames` (-1: all of them)."""
    if num_frames == 0:
        raise ValueError("media_io_kwargs video.num_frames must be greater than 0 or -1")
    return sent if num_frames < 0 else min(sent, num_frames)


def jpeg_sampling(sent: int, video_io: Mapping[str, Any]) -> tuple[int, float]:
    """(frames read, the rate they stand for) of a JPEG frame list of `sent` frames, under a
    request's media_io_kwargs `video` object (num_frames, fps)."""
    kept = jpeg_frames(sent, int(video_io.get("num_frames", DEFAULT_NUM_FRAMES)))
    return kept, float(video_io.get("fps", JPEG_FRAMES_FPS))


def container_frames(
    total: int, original_fps: float, video_io: Mapping[str, Any], qwen2vl: bool
) -> int:
    """Frames kept of a container video of `total` frames at `original_fps`, under a request's
    media_io_kwargs `video` object: Qwen2VLVideoBackend's rule for a Qwen2-VL video processor
    (`qwen2vl`), the generic loader's for every other."""
    if qwen2vl:
        return qwen2vl_frames(total, original_fps, float(video_io.get("fps", TARGET_FPS)))
    num_frames = int(video_io.get("num_frames", DEFAULT_NUM_FRAMES))
    return uniform_frames(total, original_fps, num_frames, float(video_io.get("fps", -1)))


def container_sampling(
    total: int, original_fps: float, video_io: Mapping[str, Any], qwen2vl: bool
) -> tuple[int, float]:
    """(frames kept, the rate they stand for) of a container video (`container_frames`): the
    kept frames span the whole clip, so they stand for `kept / total * original_fps`."""
    kept = container_frames(total, original_fps, video_io, qwen2vl)
    return kept, kept / total * original_fps
