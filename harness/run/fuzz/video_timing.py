"""Whether a video's temporal positions differ between the baseline and an EC consumer.

Qwen2.5-VL gives the t-th temporal step of a video the position `int(t * second_per_grid_ts *
tokens_per_second)`. The baseline's processor derives `second_per_grid_ts` from the rate the
frames were sampled at (`temporal_patch_size / sampled_fps`); an EC consumer gets only the
grid from the encoder, not this field, and uses 1.0 (vLLM 0.32, `iter_mm_grid_thw`). So the
two disagree exactly when the sampled rate is not 2 fps *and* some step's position moves:
JPEG frames read at their default 1 fps, an mp4 recorded below 2 fps (nothing to sample
down), an odd frame count that sampling trims (a rate just under 2, which moves only late
steps). Which frames are kept is vLLM 0.32's video loaders' rule (harness/spec/video_sampling.py).
"""

from __future__ import annotations

import math
import struct

from harness.spec.prompts import PromptSpec, VideoFramesPart, VideoPart
from harness.spec.video_sampling import TEMPORAL_PATCH, container_sampling, jpeg_sampling

TOKENS_PER_SECOND = 2  # Qwen2.5-VL's vision_config.tokens_per_second (the tiny model's too)
CONSUMER_SECONDS_PER_STEP = 1.0


def sampled(part: VideoPart | VideoFramesPart, spec: PromptSpec) -> tuple[int, float]:
    """(frames the processor keeps, the rate they stand for) for one video of `spec`."""
    io = spec.video_io
    if isinstance(part, VideoFramesPart):
        return jpeg_sampling(part.num_frames, io)
    return container_sampling(part.num_frames, part.fps, io, qwen2vl=True)


def positions_differ(frames: int, fps: float) -> bool:
    """Some temporal step of this video sits elsewhere on the baseline than on a consumer."""
    steps = math.ceil(frames / TEMPORAL_PATCH)
    seconds = _float32(TEMPORAL_PATCH / fps)  # held in a float32 tensor, then .item()
    baseline, consumer = seconds * TOKENS_PER_SECOND, CONSUMER_SECONDS_PER_STEP * TOKENS_PER_SECOND
    return any(int(t * baseline) != int(t * consumer) for t in range(steps))


def video_positions_differ(part: VideoPart | VideoFramesPart, spec: PromptSpec) -> bool:
    return positions_differ(*sampled(part, spec))


def _float32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]
