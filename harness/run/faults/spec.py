"""The faults a run can be started with, by name: `--plant-fault` parsed, and which topology a
fault has anything to act on in.

Apart from the faults themselves (`harness.run.faults.by_name` builds one from its name), so the
CLI and pre-flight can check a name without loading torch or the serving code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from harness.errors import BadInput
from harness.spec.prompts import (
    MEDIA_PARTS,
    SKELETON_PROMPTS,
    PromptSpec,
    VideoFramesPart,
    VideoPart,
)
from harness.spec.topology import Topology

# Faults a whole run can be started with (`epd-harness run --plant-fault NAME`), so that a
# bundle from a planted failure can be replayed by `epd-harness repro` with the same fault.
FAULT_NAMES = ("corrupt-ec", "zero-kv", "drop-kv", "drop-metadata", "stream-duplicate-chunk")
# Faults that act on the P->D hop (a topology without one has nothing for them to break).
KV_FAULTS = ("zero-kv", "drop-kv", "kv-noise")
# Faults that act on streamed answers only (`--stream`).
STREAM_FAULTS = ("stream-duplicate-chunk",)
# Faults that act on a request's video only (its grid, its frames).
VIDEO_FAULTS = ("ec-zero-frame", "ec-video-grid")
# Graded faults, NAME or NAME:STRENGTH (see `parse_fault`).
GRADED_FAULTS = {
    "ec-noise": "ec-noise:FRACTION  Gaussian noise, FRACTION x std, on each EC tensor (e.g. 0.05)",
    "kv-noise": "kv-noise:FRACTION  the same on the KV files P wrote for D",
    "ec-swap-items": "ec-swap-items      a request's media items get each other's EC embedding",
    "ec-zero-frame": "ec-zero-frame[:N]  temporal frame (pair) N (default 0) of a video's EC "
    "embedding zeroed",
    "ec-video-grid": "ec-video-grid      the consumer is told video grid [2t, h/2, w]: wrong "
    "positions, same size",
}
MAX_NOISE_FRACTION = 100.0
# ec-zero-frame's index: a temporal frame (pair) of the request's video, which has a handful;
# bounded so a long string of digits is refused as a typo, not carried into int() and float().
MAX_FRAME_INDEX = 9999
# Input frames per temporal frame (pair) of a video's EC embedding (Qwen2-VL family; see
# `ec_zero_frame`): an 8-frame video has frame pairs 0-3.
TEMPORAL_PATCH = 2
FAULT_SYNTAX = (
    "ec-noise:FRACTION, kv-noise:FRACTION, ec-swap-items, ec-zero-frame[:N], ec-video-grid"
)


@dataclass(frozen=True)
class FaultSpec:
    """A parsed `--plant-fault` value: the kind and, for graded faults, its strength."""

    kind: str
    strength: float | None = None  # noise: fraction of std; ec-zero-frame: the frame index

    @property
    def name(self) -> str:
        return self.kind if self.strength is None else f"{self.kind}:{self.strength:g}"


def parse_fault(text: str) -> FaultSpec:
    """`corrupt-ec`, `ec-noise:0.05`, `ec-zero-frame:1`, ...; BadInput (one line) otherwise."""
    kind, sep, value = text.strip().partition(":")
    if kind not in (*FAULT_NAMES, *GRADED_FAULTS):
        raise BadInput(
            f"unknown fault {text!r} (known: {', '.join(FAULT_NAMES)}) and no graded "
            f"fault either ({FAULT_SYNTAX})"
        )
    if kind in ("ec-noise", "kv-noise"):
        try:
            fraction = float(value) if sep else math.nan
        except ValueError:
            fraction = math.nan
        if not (0 < fraction <= MAX_NOISE_FRACTION):
            raise BadInput(
                f"fault {text!r}: {kind} needs a strength, a fraction of each "
                f"tensor's std in (0, {MAX_NOISE_FRACTION:g}], e.g. {kind}:0.05"
            )
        return FaultSpec(kind, fraction)
    if kind == "ec-zero-frame" and sep:
        # isascii: '²' is a digit to isdigit(), not to int(); the length before int(), which
        # refuses over 4300 digits.
        digits = value.isascii() and value.isdigit() and len(value) <= len(str(MAX_FRAME_INDEX))
        if not (digits and int(value) <= MAX_FRAME_INDEX):
            raise BadInput(
                f"fault {text!r}: ec-zero-frame takes a temporal frame index "
                f"(0, 1, ... {MAX_FRAME_INDEX}), e.g. ec-zero-frame:1"
            )
        return FaultSpec(kind, float(int(value)))
    if sep:
        raise BadInput(f"fault {text!r}: {kind} takes no strength; drop ':{value}'")
    return FaultSpec(kind)


def zero_frame_of(spec: FaultSpec) -> int:
    """The temporal frame pair ec-zero-frame zeroes (its strength; default 0); 0 for every
    other fault."""
    return int(spec.strength or 0) if spec.kind == "ec-zero-frame" else 0


def fault_reaches(kind: str, topology: Topology) -> bool:
    """Whether a fault of `kind` has anything to act on in `topology`: KV faults need a P->D
    hop, stream faults a stream from D (or PD) through a proxy, the others an encoder."""
    if kind in KV_FAULTS:
        return topology.has_kv_transfer
    if kind in STREAM_FAULTS:
        return not topology.is_baseline
    return topology.has_ec_transfer


def faulted_reference(given: str, topologies: Sequence[Topology]) -> str | None:
    """Why a fault cannot be planted in `topologies` together (None: it can): one of them is
    another's exact reference (1P+1D for 1E+1P+1D). The fault goes into every topology under
    test, so the other would be judged against faulted answers; found in review: with
    `zero-kv` both were zeroed alike and 1E+1P+1D read MATCH against 1P+1D. Alone, a topology
    with a reference has it started unfaulted, only to be compared with."""
    names = {t.name for t in topologies}
    for topology in topologies:
        reference = topology.exact_reference
        if reference in names:
            return (
                f"--plant-fault {given}: {reference} is under test, so the fault is planted in "
                f"it, and it is also {topology.name}'s exact reference: {topology.name} would be "
                f"judged against {reference}'s faulted answers; run them separately (--topology "
                f"{reference}, then --topology {topology.name}, which starts {reference} "
                "unfaulted as its reference)"
            )
    return None


def fault_reaches_prompt(kind: str, prompt: PromptSpec, frame: int = 0) -> bool:
    """Whether a fault of `kind` has anything to act on in a request of `prompt`, on a topology
    it reaches (`fault_reaches`): KV and stream faults act on any request; the others on what
    the encoders return, which a request without media never asks them for; ec-swap-items needs
    two distinct items of one request, the video faults a video (ec-zero-frame one with temporal
    frame pair `frame`)."""
    if kind in KV_FAULTS or kind in STREAM_FAULTS:
        return True
    media = {part for part in prompt.parts if isinstance(part, MEDIA_PARTS)}
    if kind == "ec-swap-items":
        return len(media) >= 2
    if kind in VIDEO_FAULTS:
        videos = [p for p in media if isinstance(p, VideoPart | VideoFramesPart)]
        if kind == "ec-zero-frame":
            return any(frame < -(-p.num_frames // TEMPORAL_PATCH) for p in videos)
        return bool(videos)
    return bool(media)


def fault_needs(spec: FaultSpec) -> str:
    """What a request must hold for a fault on what the encoders return to act on it
    (`fault_reaches_prompt`), in the one wording both refusals use: the run's prompts
    (`refuse_unreached_prompts`) and the fuzz's space (`harness.run.fuzz.space.fault_refusal`),
    which had said "a media item" of ec-swap-items, a need it does not act on."""
    frame = zero_frame_of(spec)
    if spec.kind == "ec-swap-items":
        return "two distinct media items in one request"
    if frame:
        return f"a video of more than {frame * TEMPORAL_PATCH} frames (temporal frame pair {frame})"
    if spec.kind in VIDEO_FAULTS:
        return "a video"
    return "a media item (an image or a video)"


def refuse_unreached_prompts(given: str, prompts: Sequence[PromptSpec]) -> None:
    """A fault none of the run's prompts gives anything to act on is planted and never acts:
    every case MATCHes and the self-test exits 0 (found in the audit of ignored flags:
    `--plant-fault corrupt-ec --prompt text`, `--plant-fault ec-video-grid --prompt image`).
    BadInput, naming what the fault needs and a prompt that has it."""
    spec = parse_fault(given)
    kind = spec.kind
    frame = zero_frame_of(spec)
    if any(fault_reaches_prompt(kind, prompt, frame) for prompt in prompts):
        return
    needs = fault_needs(spec)
    names = ", ".join(prompt.name for prompt in prompts)
    offers = [p.name for p in SKELETON_PROMPTS if fault_reaches_prompt(kind, p, frame)]
    offer = f" (e.g. {offers[0]})" if offers else " or give a smaller frame index"
    raise BadInput(
        f"--plant-fault {given} needs {needs}, which none of the run's prompts ({names}) "
        f"has: it would act on nothing and the run could not turn red; add such a prompt{offer}"
    )
