"""What a load is: its traffic mix, the order its requests go out in, and where each request's
media land in its prompt.

A load sends many requests at once over a mix of prompts, so that what breaks only in real
traffic has a chance to: requests that share an image reach the encoder together (the same
mm_hash in flight twice), each request's answer must be its own (a proxy or a batch that mixes
requests up hands one request another's embeddings, KV or response), and media end in every
part of the prompt a P->D topology splits: deep in the prefix P computes and hands over, in the
last block it hands over, and in the tail D recomputes itself. That last place is where vLLM
0.32's ExampleConnector fails (D needs embeddings it was never sent), declared in the matrix as
`epd-media-in-decode-tail`; a load shows it as that declared failure, per connector.

Media are generated from seeds of their own (no other scenario sends them), in several sizes;
the first `SHARED_MEDIA` items recur across prompts, every other item is in one prompt only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from harness.spec.prompts import SHORT_TEXT, TAIL_TEXT, ImagePart, PromptSpec, TextPart, VideoPart

DEFAULT_REQUESTS = 64
DEFAULT_CONCURRENCY = 16
DEFAULT_DISTINCT_MEDIA = 8
MIN_DISTINCT_MEDIA = 3  # the shared items and at least the one whose media end in the tail
# The most requests of a round. Each answer of a load's first round is kept until the load ends
# (about 0.1 MB with its raw body and top-5 log-probs, measured on a 300-token prompt's 32-token
# answer; the baseline's calibration keeps one per request as well) and load.md / load.json list
# each: 100,000 is about 20 GB, past the tens of thousands a GPU night's load sends. Longer
# traffic is a soak: rounds of them (--duration), whose later rounds keep whole only the first
# requests of each prompt and verdict that did not pass
# (`harness.run.load.result.LoadResult.add`).
MAX_REQUESTS = 100_000
# The most requests in flight, each a thread of the harness sharing the session's one chat
# client (harness.serve.client, whose pool must hold them all, or the rest would wait for a
# connection in the harness, counted as in flight, never reaching vLLM). vLLM's instances
# batch `max_num_seqs` and queue the rest anyway.
MAX_CONCURRENCY = 1_000
# The longest soak, in seconds. A soak's bounds are judged when it ends: a day is longer than
# any night's soak, and a --duration given in milliseconds (600000 for ten minutes) is refused
# rather than run for a week.
MAX_SOAK_S = 86_400
SHARED_MEDIA = 2
MEDIA_SEED_BASE = 300
IMAGE_SIZES = ((224, 224), (336, 224), (112, 112), (224, 336), (448, 280))
LONG_TEXT = " ".join([TAIL_TEXT] * 3)
LEAD_TEXT = "Look at the following picture carefully before you answer."
MEDIUM_TEXTS = (
    "What colors and shapes do you see? Answer in one short sentence, please.",
    "Name the largest shape in the picture, then the smallest one, then their colors.",
)
TAIL_PROMPT = "ld-media-in-tail"
TEXT_PROMPT = "ld-text"  # the mix's one prompt without media


class Region(str, Enum):
    """Where a prompt's last media placeholder sits, seen from a KV consumer (D) that loads the
    block-aligned prefix of the prompt and computes the rest itself."""

    NO_MEDIA = "no media"
    PREFIX = "prefix"  # before the last block D loads
    LAST_BLOCK = "last transferred block"  # in the last block D loads
    DECODE_TAIL = "decode tail"  # in the part D recomputes: it needs the embeddings itself


@dataclass(frozen=True)
class MediaPlacement:
    """Where a prompt's media end, in prompt token positions."""

    prompt_tokens: int
    media_end: int | None  # one past the last media placeholder; None without media
    tail_start: int  # the first position D computes itself: align_down(prompt - 1, block)
    block_size: int

    @property
    def region(self) -> Region:
        if self.media_end is None:
            return Region.NO_MEDIA
        if self.media_end > self.tail_start:
            return Region.DECODE_TAIL
        if self.media_end > self.tail_start - self.block_size:
            return Region.LAST_BLOCK
        return Region.PREFIX

    def describe(self) -> str:
        if self.media_end is None:
            return f"no media ({self.prompt_tokens} prompt tokens)"
        return (
            f"media end at {self.media_end} of {self.prompt_tokens} prompt tokens; D computes "
            f"from {self.tail_start} ({self.region.value})"
        )


def media_placement(
    prompt_token_ids: tuple[int, ...] | list[int],
    media_token_ids: frozenset[int],
    block_size: int,
) -> MediaPlacement:
    """Where the media placeholders of a prompt (the baseline's prompt ids) end."""
    positions = [i for i, token in enumerate(prompt_token_ids) if token in media_token_ids]
    count = len(prompt_token_ids)
    return MediaPlacement(
        prompt_tokens=count,
        media_end=positions[-1] + 1 if positions else None,
        tail_start=max(0, (count - 1) // block_size * block_size),
        block_size=block_size,
    )


@dataclass(frozen=True)
class LoadSpec:
    """One load: what to send, how many at once, for how long, and what to break."""

    topology: str
    requests: int = DEFAULT_REQUESTS
    concurrency: int = DEFAULT_CONCURRENCY
    stream: bool = False
    # A soak: rounds of `requests` for this many seconds, the storage the harness may clean
    # cleaned between rounds, resources sampled at every round's end (None: one round).
    duration_s: float | None = None
    distinct_media: int = DEFAULT_DISTINCT_MEDIA
    # Death under load: the role (Role.value) of the instance SIGKILLed once every request of
    # the round is in flight and one has reached it.
    kill: str | None = None
    # Send the prompts declared to end an instance on the topology (last, one each); False
    # leaves them out (a load that another will follow on the same running topology).
    ending: bool = True

    def __post_init__(self) -> None:
        if self.requests < 1 or self.concurrency < 1:
            raise ValueError("a load needs at least one request and a concurrency of one")
        if self.distinct_media < MIN_DISTINCT_MEDIA:
            raise ValueError(f"a load mix needs at least {MIN_DISTINCT_MEDIA} distinct media")
        # The CLI's checks (`harness.cli.load.refuse_load_counts`), for a spec a load
        # scenario's mark names: its media past what its requests send were never sent, and a
        # NaN duration soaked for ever (found in review).
        if self.distinct_media > most_distinct_media(self.requests):
            raise ValueError(
                f"{self.distinct_media} distinct media with {self.requests} request(s) a round: "
                "some media would never be sent"
            )
        if self.requests > MAX_REQUESTS:
            raise ValueError(f"{self.requests} requests: at most {MAX_REQUESTS} requests a round")
        if self.concurrency > MAX_CONCURRENCY:
            raise ValueError(f"concurrency {self.concurrency}: at most {MAX_CONCURRENCY} in flight")
        if self.duration_s is not None:
            if not (math.isfinite(self.duration_s) and self.duration_s > 0):
                raise ValueError("a soak's duration is a positive number of seconds")
            if self.duration_s > MAX_SOAK_S:
                raise ValueError(f"a soak of {self.duration_s:g} s: at most {MAX_SOAK_S} s")


def _media(index: int) -> ImagePart | VideoPart:
    """The mix's index-th distinct medium: images of several sizes, the fourth a video."""
    seed = MEDIA_SEED_BASE + index
    if index == 3:
        return VideoPart(seed=seed)
    return ImagePart(seed=seed, size=IMAGE_SIZES[index % len(IMAGE_SIZES)])


def mix_size(distinct_media: int) -> int:
    """How many prompts `load_mix(distinct_media)` holds, counted without building it: the
    five prompts of the shared items, one per other item but the tail's, the text prompt and
    the tail prompt."""
    return 5 + (distinct_media - SHARED_MEDIA - 1) + 2


def most_distinct_media(requests: int) -> int:
    """The most distinct media a load of `requests` a round may ask for: as many as leave
    every prompt of the mix sent in each round (the rest of a larger mix, and its media, would
    never be). The default mix goes with any count, as a load of a few requests always has."""
    return max(DEFAULT_DISTINCT_MEDIA, requests - mix_size(0))


def load_mix(distinct_media: int = DEFAULT_DISTINCT_MEDIA) -> tuple[PromptSpec, ...]:
    """The prompts of a load with `distinct_media` distinct media items: the shared items in
    several prompts (alone, twice in one request, after text), each other item in one prompt
    with a text of its own length, a text-only prompt, and one prompt whose image is followed
    by a few words only, so its media end in the part a KV consumer recomputes (the prompt of
    the matrix's `epd-media-in-decode-tail`, with an image of its own)."""
    if distinct_media < MIN_DISTINCT_MEDIA:
        raise ValueError(f"a load mix needs at least {MIN_DISTINCT_MEDIA} distinct media")
    first, second = _media(0), _media(1)
    prompts = [
        PromptSpec("ld-shared-a", (first, TextPart(TAIL_TEXT))),
        PromptSpec("ld-shared-a-long", (first, TextPart(LONG_TEXT))),
        PromptSpec("ld-shared-b", (second, TextPart(MEDIUM_TEXTS[0]))),
        PromptSpec("ld-shared-ab", (first, second, TextPart(TAIL_TEXT))),
        PromptSpec("ld-shared-b-after-text", (TextPart(LEAD_TEXT), second, TextPart(TAIL_TEXT))),
    ]
    texts = (TAIL_TEXT, MEDIUM_TEXTS[1], LONG_TEXT, MEDIUM_TEXTS[0])
    for index in range(SHARED_MEDIA, distinct_media - 1):
        text = texts[(index - SHARED_MEDIA) % len(texts)]
        prompts.append(PromptSpec(f"ld-unique-{index}", (_media(index), TextPart(text))))
    prompts.append(PromptSpec(TEXT_PROMPT, (TextPart(LONG_TEXT),)))
    tail_image = ImagePart(seed=MEDIA_SEED_BASE + distinct_media - 1)
    prompts.append(PromptSpec(TAIL_PROMPT, (tail_image, TextPart(SHORT_TEXT))))
    return tuple(prompts)


def distinct_media_of(prompts: tuple[PromptSpec, ...]) -> int:
    """How many distinct media items the prompts carry."""
    return len({p for prompt in prompts for p in prompt.parts if not isinstance(p, TextPart)})


@dataclass(frozen=True)
class PlannedRequest:
    """One request of a load: its number (from 1, as reports name it) and its prompt."""

    number: int
    prompt: str
    # Sent after every other request, one at a time: its prompt is declared to end an
    # instance on this topology (the decode-tail failure), which would fail the others too.
    alone: bool = False

    @property
    def name(self) -> str:
        return f"request {self.number}"


def plan_requests(
    prompts: list[str], count: int, ending: frozenset[str] = frozenset()
) -> list[PlannedRequest]:
    """`count` requests over `prompts`: one request for each prompt in `ending` (declared to
    end an instance), sent last and alone; the others round-robin over the remaining prompts,
    so requests in flight together carry different prompts, and every prompt recurs."""
    regular = [p for p in prompts if p not in ending]
    last = [p for p in prompts if p in ending]
    if not regular:
        raise ValueError("every prompt of the mix is declared to end an instance")
    if count < len(last) + 1:
        raise ValueError(f"{count} request(s) cannot carry the mix's {len(last)} ending prompt(s)")
    planned = [PlannedRequest(n + 1, regular[n % len(regular)]) for n in range(count - len(last))]
    start = len(planned)
    planned += [PlannedRequest(start + n + 1, p, alone=True) for n, p in enumerate(last)]
    return planned
