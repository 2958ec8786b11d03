"""Hypothesis strategies over what EPD depends on, and the seeded draw of a run's examples.

Every EPD bug found so far depends on the shape of a request: how many media items, how large,
where they sit relative to KV block boundaries and to the tail a KV consumer recomputes,
repeated items, video frames and fps, per-request media kwargs. The strategy draws each of
those, then (with a layout estimate) aims some requests on purpose: the last placeholder run
ending just before, on or just after a block boundary, and inside or past D's recomputed tail.

The examples are drawn up front, as plain `PromptSpec`s, by Hypothesis's generator alone
(`draw_examples`): a seed gives the same list every time, whatever the servers answer, and the
list is written to the bundle before anything is sent. Shrinking is the fuzzer's own
(`harness.run.fuzz.shrink`), because every step it takes may cost a restart of the topology.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from harness.run.fuzz.layout import LayoutEstimator, estimate_positions
from harness.run.fuzz.space import MAX_PIXELS_CHOICES, VIDEO_FPS_CHOICES, FuzzSpace
from harness.spec.prompt_codec import prompt_to_json
from harness.spec.prompts import (
    MEDIA_PARTS,
    ImagePart,
    Part,
    PromptSpec,
    TextPart,
    VideoFramesPart,
    VideoPart,
)

WORDS = (
    "the a red blue green small large circle square house tree car sky left right top "
    "center picture image video frame shows what is in on of and describe detail color "
    "shape one two three word answer please tell about where how many"
).split()
# One token in any byte-level BPE vocabulary (" a" is a pre-token of its own): the unit the
# aim pads with, so an estimate in tokens becomes a count of words.
FILLER = " a"
COMMON_SIZES = ((224, 224), (448, 448), (56, 56), (28, 28), (336, 224), (224, 448), (640, 360))
VIDEO_SIZES = ((56, 56), (112, 112), (224, 224), (112, 56))
BOUNDARY_AIMS = {"before": -1, "on": 0, "after": 1}
TAIL_AIMS = ("in-tail", "past-tail")


@dataclass(frozen=True)
class FuzzExample:
    """One generated request: its spec, and what the strategy aimed it at."""

    spec: PromptSpec
    aim: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec.name

    def to_json(self) -> dict[str, Any]:
        return {"spec": prompt_to_json(self.spec), "aim": self.aim}


def _text(words: list[str]) -> str:
    return "".join(f" {w}" for w in words)


@st.composite
def image_parts(draw: st.DrawFn, space: FuzzSpace) -> ImagePart:
    seed = draw(st.integers(0, space.seed_pool - 1))
    if draw(st.booleans()):
        size = draw(st.sampled_from(COMMON_SIZES))
    else:
        width = draw(st.integers(16, 640))
        ratio = draw(st.sampled_from((1.0, 0.5, 2.0, 0.25, 4.0, 1 / 8, 8.0, 0.75)))
        size = (width, max(16, min(640, round(width * ratio))))
    return ImagePart(seed=seed, size=size)


@st.composite
def video_parts(draw: st.DrawFn, space: FuzzSpace) -> VideoPart | VideoFramesPart:
    seed = draw(st.integers(0, space.seed_pool - 1))
    size = draw(st.sampled_from(VIDEO_SIZES))
    if draw(st.booleans()):
        frames = draw(st.integers(2, 16))
        fps = draw(st.sampled_from((2.0, 1.0, 3.0, 4.0)))
        return VideoPart(seed=seed, num_frames=frames, fps=fps, size=size)
    return VideoFramesPart(seed=seed, num_frames=draw(st.integers(2, 8)), size=size)


@st.composite
def media_lists(draw: st.DrawFn, space: FuzzSpace) -> list[Part]:
    """0..max images and 0..max videos in a drawn order; an item may repeat an earlier one
    exactly (same seed and size: an encoder-cache hit within the request)."""
    if not space.media:
        return []
    items: list[Part] = []
    for _ in range(draw(st.integers(0, space.max_images))):
        if items and draw(st.integers(0, 3)) == 0:
            items.append(draw(st.sampled_from([i for i in items if isinstance(i, ImagePart)])))
        else:
            items.append(draw(image_parts(space)))
    if space.videos:
        items += [draw(video_parts(space)) for _ in range(draw(st.integers(0, space.max_videos)))]
    return draw(st.permutations(items)) if len(items) > 1 else items


@st.composite
def media_kwargs(draw: st.DrawFn, space: FuzzSpace, media: list[Part]) -> dict[str, Any]:
    if not space.media_kwargs or not media or draw(st.integers(0, 3)) != 0:
        return {}
    extra: dict[str, Any] = {}
    if any(isinstance(m, ImagePart) for m in media) and draw(st.booleans()):
        extra["mm_processor_kwargs"] = {"max_pixels": draw(st.sampled_from(MAX_PIXELS_CHOICES))}
    if any(isinstance(m, VideoFramesPart) for m in media) and draw(st.booleans()):
        extra["media_io_kwargs"] = {"video": {"fps": draw(st.sampled_from(VIDEO_FPS_CHOICES))}}
    if any(isinstance(m, VideoPart) for m in media) and draw(st.booleans()):
        kwargs = extra.setdefault("mm_processor_kwargs", {})
        kwargs["fps"] = draw(st.sampled_from(VIDEO_FPS_CHOICES))
    return extra


@st.composite
def fuzz_examples(
    draw: st.DrawFn, space: FuzzSpace, estimator: LayoutEstimator | None = None
) -> FuzzExample:
    """One request: media, text before / between / after them, kwargs, max_tokens, and an
    aim at a block boundary and at D's tail when there is media and an estimator."""
    media = draw(media_lists(space))
    slots = [draw(st.lists(st.sampled_from(WORDS), max_size=space.max_words)) for _ in media]
    slots.append(draw(st.lists(st.sampled_from(WORDS), min_size=0, max_size=space.max_words)))
    extra = draw(media_kwargs(space, media))
    max_tokens = draw(st.integers(space.min_max_tokens, space.max_max_tokens))
    boundary = draw(st.sampled_from(("free", *BOUNDARY_AIMS))) if media else "free"
    tail = draw(st.sampled_from(("free", *TAIL_AIMS))) if media else "free"
    aim: dict[str, Any] = {"boundary": boundary, "tail": tail}
    texts = [_text(words) for words in slots]
    if media and estimator is not None:
        texts = aim_texts(media, texts, extra, max_tokens, space, estimator, boundary, tail, draw)
        spec = assemble(media, texts, extra, max_tokens)
        end, total = estimate_positions(spec, estimator)
        aim.update(estimated_last_media_end=end, estimated_prompt_tokens=total)
    spec = assemble(media, texts, extra, max_tokens)
    if estimator is not None:
        _, total = estimate_positions(spec, estimator)
        assume(space.min_prompt_tokens <= total <= space.max_model_len - max_tokens)
    return FuzzExample(spec, aim)


def assemble(
    media: list[Part], texts: list[str], extra: dict[str, Any], max_tokens: int, name: str = "x"
) -> PromptSpec:
    """Text slot i before media item i; the last slot after the last item. Empty text parts
    are left out (a request of media alone is a shape of its own)."""
    parts: list[Part] = []
    for index, item in enumerate(media):
        if texts[index]:
            parts.append(TextPart(texts[index]))
        parts.append(item)
    if texts[len(media)]:
        parts.append(TextPart(texts[len(media)]))
    if not parts:
        parts.append(TextPart(FILLER))
    return PromptSpec(name, tuple(parts), max_tokens=max_tokens, extra=tuple(extra.items()))


def aim_texts(
    media: list[Part],
    texts: list[str],
    extra: dict[str, Any],
    max_tokens: int,
    space: FuzzSpace,
    estimator: LayoutEstimator,
    boundary: str,
    tail: str,
    draw: st.DrawFn,
) -> list[str]:
    """Pad the text before the last media item so its run ends at the aimed offset from a
    block boundary, and set the text after it so the run ends inside (or past) the part of
    the prompt a block-aligned KV consumer recomputes."""
    block = space.block_size
    texts = list(texts)
    last = len(media) - 1
    if boundary in BOUNDARY_AIMS:
        end, _ = estimate_positions(assemble(media, texts, extra, max_tokens), estimator)
        assert end is not None
        pad = (BOUNDARY_AIMS[boundary] - end) % block
        texts[last] += FILLER * pad
    if tail in TAIL_AIMS:
        end, _ = estimate_positions(assemble(media, texts, extra, max_tokens), estimator)
        assert end is not None
        texts[last + 1] = ""
        _, bare = estimate_positions(assemble(media, texts, extra, max_tokens), estimator)
        choices = []
        for words in range(2 * block):
            prompt = bare + words * max(1, estimator.text_tokens(FILLER))
            in_tail = end > ((prompt - 1) // block) * block
            if in_tail == (tail == "in-tail"):
                choices.append(words)
        if choices:
            texts[last + 1] = FILLER * draw(st.sampled_from(choices))
    return texts


def draw_examples(
    space: FuzzSpace,
    count: int,
    seed: int,
    estimator: LayoutEstimator | None = None,
) -> list[FuzzExample]:
    """`count` examples (fewer if Hypothesis runs out of distinct ones), the same list for the
    same seed, space, estimator and Hypothesis version; named ex-0000... in draw order, with
    duplicates dropped."""
    drawn: list[FuzzExample] = []

    @settings(
        # Hypothesis repeats itself now and then (most of all among its first, simplest
        # examples): draw more than needed, keep the first `count` distinct ones.
        max_examples=count + count // 2 + 10,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        derandomize=False,
    )
    @hypothesis_seed(seed)
    @given(fuzz_examples(space, estimator))
    def collect(example: FuzzExample) -> None:
        drawn.append(example)

    collect()
    seen: set[str] = set()
    unique: list[FuzzExample] = []
    for example in drawn:
        key = json.dumps(prompt_to_json(example.spec), sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        name = f"ex-{len(unique):04d}"
        unique.append(FuzzExample(rename(example.spec, name), example.aim))
        if len(unique) == count:
            break
    return unique


def rename(spec: PromptSpec, name: str) -> PromptSpec:
    return PromptSpec(name, spec.parts, spec.max_tokens, spec.extra)


def media_items(spec: PromptSpec) -> list[Part]:
    return [p for p in spec.parts if isinstance(p, MEDIA_PARTS)]
