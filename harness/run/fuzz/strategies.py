"""Hypothesis strategies over what EPD depends on, and the seeded draw of a run's examples.

Every EPD bug found so far depends on the shape of a request: how many media items, how large,
where they sit relative to KV block boundaries and to the tail a KV consumer recomputes,
repeated items, video frames and fps, per-request media kwargs. The strategy draws each of
those, then (with a layout estimate) aims some requests on purpose: the last placeholder run
ending just before, on or just after a block boundary, and inside or past D's recomputed tail.

Some requests are followed by one that extends them (the same media and kwargs, more text at
the end), as a chat's next turn extends the last. What such a request meets depends on the one
before it: D's prefix cache, the encoder's cache, and under ExampleConnector the KV folder the
earlier request stored. Aimed at `block-plus-one`, the follow-up has k * block + 1 tokens where
the earlier request stored k - 1 blocks of the same prefix: P's lookup finds that folder and
loads one of k blocks nobody wrote (harness/run/fuzz/consumer.py), which independent draws of
one request each almost never reach.

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

from harness.run.fuzz.consumer import stored_tokens
from harness.run.fuzz.layout import LayoutEstimator, estimate_positions
from harness.run.fuzz.space import (
    MAX_JPEG_FRAMES,
    MAX_MP4_FRAMES,
    MAX_PIXELS_CHOICES,
    MP4_RECORD_FPS,
    VIDEO_FPS_CHOICES,
    FuzzSpace,
)
from harness.spec.prompt_codec import prompt_to_json
from harness.spec.prompts import (
    CACHE_SALT,
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
# How a follow-up extends the request before it: to k * block + 1 tokens over the k - 1
# blocks the earlier one stored, or by a few drawn words.
FOLLOW_UPS = ("block-plus-one", "free")


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
        frames = draw(st.integers(2, MAX_MP4_FRAMES))
        fps = draw(st.sampled_from(MP4_RECORD_FPS))
        return VideoPart(seed=seed, num_frames=frames, fps=fps, size=size)
    return VideoFramesPart(seed=seed, num_frames=draw(st.integers(2, MAX_JPEG_FRAMES)), size=size)


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
) -> tuple[FuzzExample, ...]:
    """One request: media, text before / between / after them, kwargs, max_tokens, and an
    aim at a block boundary and at D's tail when there is media and an estimator; with an
    estimator, sometimes a second request that follows it (`follow_up`)."""
    # One request in five is text alone, drawn on purpose: media_lists' own zero images and
    # zero videos came up in none of 60 examples of some seeds (Hypothesis draws in runs of
    # like examples), and a text-only follow-up is the commonest next turn of real traffic.
    text_only = draw(st.integers(0, 4)) == 0
    media = [] if text_only else draw(media_lists(space))
    slots = [draw(st.lists(st.sampled_from(WORDS), max_size=space.max_words)) for _ in media]
    slots.append(draw(st.lists(st.sampled_from(WORDS), min_size=0, max_size=space.max_words)))
    extra = draw(media_kwargs(space, media))
    max_tokens = draw(st.integers(space.min_max_tokens, space.max_max_tokens))
    follow = draw(st.sampled_from((None, None, *FOLLOW_UPS))) if estimator is not None else None
    boundary = draw(st.sampled_from(("free", *BOUNDARY_AIMS))) if media else "free"
    # An aimed follow-up sets the length of the request it follows (below), so that
    # request's tail is not aimed as well.
    tail = draw(st.sampled_from(("free", *TAIL_AIMS))) if media else "free"
    if follow == "block-plus-one":
        tail = "free"
    aim: dict[str, Any] = {"boundary": boundary, "tail": tail}
    texts = [_text(words) for words in slots]
    if media and estimator is not None:
        texts = aim_texts(media, texts, extra, max_tokens, space, estimator, boundary, tail, draw)
    if not media and estimator is not None:
        # A text too short for the space would be rejected below, and most drawn texts are.
        _, total = estimate_positions(assemble(media, texts, extra, max_tokens), estimator)
        texts[-1] += FILLER * max(0, space.min_prompt_tokens - total)
    if follow == "block-plus-one" and estimator is not None:
        texts = room_for_follow_up(media, texts, extra, max_tokens, space, estimator)
    spec = assemble(media, texts, extra, max_tokens)
    if estimator is None:
        return (FuzzExample(spec, aim),)
    end, total = estimate_positions(spec, estimator)
    if media:
        aim.update(estimated_last_media_end=end, estimated_prompt_tokens=total)
    assume(space.min_prompt_tokens <= total <= space.max_model_len - max_tokens)
    first = FuzzExample(spec, aim)
    if follow is None:
        return (first,)
    second = draw(follow_up(media, texts, extra, space, estimator, follow))
    return (first,) if second is None else (first, second)


def room_for_follow_up(
    media: list[Part],
    texts: list[str],
    extra: dict[str, Any],
    max_tokens: int,
    space: FuzzSpace,
    estimator: LayoutEstimator,
) -> list[str]:
    """Pad the end of the text so the block-aligned prefix P stores of this request lies
    inside what a request extending its text shares with it: everything but the chat frame's
    tail (end of turn, assistant header)."""
    _, total = estimate_positions(assemble(media, texts, extra, max_tokens), estimator)
    past_block = (total - 1) % space.block_size
    pad = max(0, estimator.tail_tokens - 1 - past_block)
    texts = list(texts)
    texts[-1] += FILLER * pad
    return texts


@st.composite
def follow_up(
    draw: st.DrawFn,
    media: list[Part],
    texts: list[str],
    extra: dict[str, Any],
    space: FuzzSpace,
    estimator: LayoutEstimator,
    how: str,
) -> FuzzExample | None:
    """The request extending the one of `media` and `texts`: the same media and kwargs, its
    last text longer; None when it would not fit the model's context. Named and told which
    request it follows by `draw_examples`."""
    max_tokens = draw(st.integers(space.min_max_tokens, space.max_max_tokens))
    earlier = assemble(media, texts, extra, max_tokens)
    _, before = estimate_positions(earlier, estimator)
    texts = list(texts)
    if how == "block-plus-one":
        target = stored_tokens(before, space.block_size) + space.block_size + 1
        texts[-1] += FILLER * max(1, target - before)
    else:
        texts[-1] += _text(draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=12)))
    # The same tenant's next turn shares the earlier request's prefix-cache blocks; another
    # tenant's (a cache salt of its own) shares only the connector's storage, which ignores
    # the salt.
    salt = draw(st.sampled_from((None, f"tenant-{draw(st.integers(0, 2**31))}")))
    spec = assemble(media, texts, {**extra, CACHE_SALT: salt} if salt else extra, max_tokens)
    _, total = estimate_positions(spec, estimator)
    if total > space.max_model_len - max_tokens:
        return None
    aim = {"follow_up": how, "cache_salt": "own" if salt else "shared"}
    return FuzzExample(spec, {**aim, "estimated_prompt_tokens": total})


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
    duplicates dropped. A follow-up comes right after the request it extends, and its aim
    names that request (`follows`: the earlier equal one, when it was a duplicate)."""
    drawn: list[tuple[FuzzExample, ...]] = []

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
    def collect(examples: tuple[FuzzExample, ...]) -> None:
        drawn.append(examples)

    collect()
    names: dict[str, str] = {}  # a request's content -> the name it was kept under
    unique: list[FuzzExample] = []
    for group in drawn:
        previous: str | None = None
        for example in group:
            key = json.dumps(prompt_to_json(example.spec), sort_keys=True)
            if key not in names and len(unique) < count:
                name = f"ex-{len(unique):04d}"
                names[key] = name
                aim = example.aim if previous is None else {**example.aim, "follows": previous}
                unique.append(FuzzExample(rename(example.spec, name), aim))
            previous = names.get(key)
            if previous is None:  # a request not kept: nothing after it follows it
                break
        if len(unique) == count:
            break
    return unique


def rename(spec: PromptSpec, name: str) -> PromptSpec:
    return PromptSpec(name, spec.parts, spec.max_tokens, spec.extra)


def media_items(spec: PromptSpec) -> list[Part]:
    return [p for p in spec.parts if isinstance(p, MEDIA_PARTS)]
