"""What the fuzzer may generate for one served release, topology and model.

The strategies draw only requests the served release can run meaningfully on the topology
(the protocol generation's `not_applicable` answers for a probe of each kind: media at all,
video, per-request media kwargs) and that fit the model's context.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from harness.run.faults.spec import (
    KV_FAULTS,
    STREAM_FAULTS,
    VIDEO_FAULTS,
    fault_needs,
    parse_fault,
    zero_frame_of,
)
from harness.spec.generations import ProtocolGeneration, not_applicable
from harness.spec.prompts import ImagePart, PromptSpec, TextPart, VideoPart
from harness.spec.topology import ServingConfig, Topology
from harness.spec.video_sampling import TEMPORAL_PATCH, container_frames, jpeg_frames

# Per-request media kwargs the strategies may add (values JSON-able, as sent).
MAX_PIXELS_CHOICES = (28 * 28 * 16, 28 * 28 * 64, 28 * 28 * 256)
VIDEO_FPS_CHOICES = (1.0, 2.0, 4.0)
# The videos the strategies draw: an mp4 of 2..MAX_MP4_FRAMES frames recorded at one of
# MP4_RECORD_FPS, or a JPEG frame list of 2..MAX_JPEG_FRAMES frames.
MAX_MP4_FRAMES = 16
MP4_RECORD_FPS = (2.0, 1.0, 3.0, 4.0)
MAX_JPEG_FRAMES = 8


def most_frame_pairs() -> int:
    """The most temporal frame pairs of any video the fuzz draws, as vLLM's Qwen2.5-VL makes
    them of the frames its loaders keep (an mp4 below 2 fps is kept whole): ec-zero-frame:N
    acts on the fuzz's requests only for N below it."""
    kept = [container_frames(MAX_MP4_FRAMES, fps, {}, qwen2vl=True) for fps in MP4_RECORD_FPS]
    kept.append(jpeg_frames(MAX_JPEG_FRAMES))
    return -(-max(kept) // TEMPORAL_PATCH)


@dataclass(frozen=True)
class FuzzSpace:
    """Bounds of the generated requests."""

    block_size: int = 32
    max_model_len: int = 4096
    max_images: int = 4
    max_videos: int = 1
    media: bool = True  # any media at all (False: the release cannot run media here)
    videos: bool = True
    media_kwargs: bool = True  # mm_processor_kwargs / media_io_kwargs per request
    min_max_tokens: int = 1
    max_max_tokens: int = 48
    seed_pool: int = 6  # media seeds drawn from [0, pool): repeats across requests are common
    max_words: int = 40  # per text slot, before any padding towards a target
    # A KV consumer loads align_down(n - 1, block) tokens: a shorter prompt moves no KV, and
    # the kv_transfer guard (rightly) calls its MATCH vacuous. Such requests test nothing of
    # P->D, so a topology with D gets prompts of at least one block and two tokens (at one
    # block and one token ExampleConnector's D looks up zero tokens: harness/run/fuzz/consumer.py).
    min_prompt_tokens: int = 0
    notes: tuple[str, ...] = ()  # why a dimension is off

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def space_for(
    generation: ProtocolGeneration, topology: Topology, serving: ServingConfig
) -> FuzzSpace:
    """The space for this release and topology: a dimension the release cannot run is off,
    with the generation table's reason kept in `notes`."""
    notes: list[str] = []
    image = PromptSpec("probe-image", (ImagePart(seed=0), TextPart("x")))
    video = PromptSpec("probe-video", (VideoPart(seed=0), TextPart("x")))
    kwargs = PromptSpec(
        "probe-kwargs",
        (ImagePart(seed=0), TextPart("x")),
        extra=(("mm_processor_kwargs", {"max_pixels": MAX_PIXELS_CHOICES[0]}),),
    )
    media = _allowed(generation, topology, image, notes)
    videos = media and _allowed(generation, topology, video, notes)
    media_kwargs = media and _allowed(generation, topology, kwargs, notes)
    if media_kwargs and not generation.accepts_request_media_kwargs(
        serving.trust_request_mm_kwargs
    ):
        media_kwargs = False
        notes.append(
            "per-request media kwargs: the release refuses them unless trusted, and the run "
            "turned --trust-request-mm-kwargs off"
        )
    return FuzzSpace(
        block_size=serving.block_size,
        max_model_len=serving.max_model_len,
        media=media,
        videos=videos,
        media_kwargs=media_kwargs,
        max_images=4 if media else 0,
        max_videos=1 if videos else 0,
        min_prompt_tokens=serving.block_size + 2 if topology.has_kv_transfer else 0,
        notes=tuple(notes),
    )


def _allowed(
    generation: ProtocolGeneration, topology: Topology, probe: PromptSpec, notes: list[str]
) -> bool:
    reason = not_applicable(generation, topology, probe)
    if reason is not None:
        notes.append(f"{probe.name.removeprefix('probe-')}: {reason}")
    return reason is None


def fault_refusal(fault: str, space: FuzzSpace, topology: Topology) -> str | None:
    """Why `--plant-fault fault` would act on nothing the fuzz draws in `space`, or None. The
    fuzz sends its own requests, not the run's prompts (the preflight leaves the fault to this
    check: `draws_own_requests`); where the served release allows no media (or no video) on
    the topology, a fault on what the encoders return never acts, and the self-test, finding
    nothing, exited 0 (found in review); ec-zero-frame:N acts on the drawn videos of more than
    N temporal frame pairs only (`most_frame_pairs`)."""
    spec = parse_fault(fault)
    if spec.kind in KV_FAULTS or spec.kind in STREAM_FAULTS:
        return None
    videos = spec.kind in VIDEO_FAULTS
    if not (space.videos if videos else space.media):
        why = "; ".join(space.notes)
        return (
            f"--plant-fault {fault} needs {fault_needs(spec)}, and the fuzz draws none for "
            f"{topology.name} on this release ({why}): it would act on nothing and the fuzz "
            "could not find a failure; plant it on a release that sends them through the "
            "encoder, or drop --plant-fault"
        )
    frame, pairs = zero_frame_of(spec), most_frame_pairs()
    if frame < pairs:
        return None
    return (
        f"--plant-fault {fault} needs {fault_needs(spec)}, and the fuzz's videos have at most "
        f"{pairs} temporal frame pairs (mp4s of up to {MAX_MP4_FRAMES} frames, JPEG frame lists of "
        f"up to {MAX_JPEG_FRAMES}): it would act on nothing and the fuzz could not find a "
        f"failure; give a frame index below {pairs}"
    )
