"""Shrinking a failing request to the smallest one that fails with the same signature.

The cost model decides the design. A candidate that does not reproduce costs a request (under
a second). One that reproduces a crash kills an instance, and the next request needs the
topology restarted: tens of seconds on CPU. So:

* the search is greedy and takes the biggest step first: every candidate is one
  simplification of the current request (one media item kept alone, one dropped, an image
  made small, a text dropped, halved or cut shorter, a kwarg dropped, fewer tokens), and
  candidates are tried smallest first, so the first one that reproduces is the largest
  reduction on offer and the number of accepted steps (the expensive ones) stays small;
* a text is cut in ever smaller steps (half, a block's worth of words, a quarter, an eighth,
  one word), so a shrink that a minimum prompt length stops at "half is too short" still gets
  near that minimum; the small steps are tried last (smallest first), so they cost trials
  only where the big ones did not reproduce. Each step is cut from the text's end, its middle
  and its start, so the words a failure needs are kept wherever they sit and the rest go;
* a candidate that was too short to judge (the oracle says so: `Trial.too_short`) tells the
  shrinker that any candidate contained in it (its parts a subsequence of that one's, each the
  same or a text keeping some of its words, in order: `contained`) is too short too: those
  are skipped, not tried, and cost neither a request nor a trial of the budget;
* the topology is restarted only after a death, lazily, before the next request that needs it;
* a budget caps trials, restarts and seconds, and the result says what it cost and whether
  the budget, not a local minimum, ended it;
* a known crash whose trigger can be read from the baseline's layout is shrunk against that
  prediction (baseline requests only), and only the end result is sent to the topology to
  confirm it (`harness.run.fuzz.engine`): one restart instead of one per step.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

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

SMALL_IMAGE = (56, 56)  # the smallest a Qwen2-VL processor keeps as is (4 tokens)
MIN_SIDE = 28
DEFAULT_FPS = 2.0  # the rate vLLM's video loader samples at unless told otherwise


def size_key(spec: PromptSpec) -> tuple[int, ...]:
    """How big a request is, most significant first: media items, videos, pixels, text
    parts, text length, kwargs, tokens to generate, and last mp4s not at the default 2 fps
    (uncounted, the candidate at 2 fps was never smaller, and never tried)."""
    media = [p for p in spec.parts if isinstance(p, MEDIA_PARTS)]
    videos = sum(isinstance(p, (VideoPart, VideoFramesPart)) for p in media)
    pixels = sum(
        p.size[0] * p.size[1] * (1 if isinstance(p, ImagePart) else p.num_frames) for p in media
    )
    texts = [p.text for p in spec.parts if isinstance(p, TextPart)]
    return (
        len(media),
        videos,
        pixels,
        len(texts),
        sum(len(t) for t in texts),
        len(spec.extra),
        spec.max_tokens,
        sum(isinstance(p, VideoPart) and p.fps != DEFAULT_FPS for p in media),
    )


def _with(spec: PromptSpec, parts: list[Part] | None = None, **changes: Any) -> PromptSpec:
    return PromptSpec(
        spec.name,
        tuple(parts if parts is not None else spec.parts),
        changes.get("max_tokens", spec.max_tokens),
        changes.get("extra", spec.extra),
    )


def _spaced_words(text: str) -> list[str]:
    """`text` as its words, each with the space before it (the first as the text starts):
    joined they are the text again. A tokenizer splits a text before each space and a word's
    first token holds that space, so a cut that keeps whole pieces keeps how every word it
    keeps is tokenized; a cut from the start keeps the next word's space."""
    words = text.split(" ")
    pieces = [words[0]] + [" " + word for word in words[1:]]
    return pieces if pieces[0] else pieces[1:]


def _shorter_texts(text: str, step_words: int | None) -> list[str]:
    """`text` with words dropped: half of them, a block's worth (`step_words`), a quarter, an
    eighth or one word, each cut from its end, from its middle and from its start.

    Halving alone jumps from a text whose prompt is long enough to one under the minimum the
    topology needs (seen on real vLLM: 43 prompt tokens, half 31, minimum 34); the smaller
    cuts fill that gap, and being bigger than half they are tried after it. Cutting from the
    end alone keeps the words a failure needs only when they sit at the start: a word near
    the end, or two far apart, stayed with every word before it. Of cuts the same size, the
    one keeping more of the prompt's start (and the KV blocks a failure may hang on) comes
    first: the end, then the middle (a span centred in the text, words kept on both sides),
    then the start. A block's worth from anywhere keeps the prompt's length, and where a
    later media item lands, modulo the block. Words all alike (the fuzzer's filler) make the
    three cuts of a size one text, which `candidates` keeps once."""
    words = _spaced_words(text)
    count = len(words)
    found: list[list[str]] = []
    for drop in (count // 2, step_words or 0, count // 4, count // 8, 1):
        if 1 <= drop < count:
            found.append(words[: count - drop])
            if drop <= count - 2:  # a word kept on each side, else it is the start cut
                middle = (count - drop) // 2
                found.append(words[:middle] + words[middle + drop :])
            found.append(words[drop:])
    cuts = ["".join(kept) for kept in found]
    return [cut for cut in cuts if cut.strip()]


def contained(spec: PromptSpec, longer: PromptSpec) -> bool:
    """`spec`'s prompt is no longer than `longer`'s: the same kwargs, and its parts a
    subsequence of `longer`'s, each the same part or a text whose words are a subsequence of
    that text's (`_kept_words`), as any cut leaves it, from the end, the middle or the start.

    A subsequence, not only a prefix: the shrinker asks this of a prompt found too short,
    which is a matter of length alone, and dropping whole words wherever they sit never
    lengthens a prompt (a tokenizer splits before each space), so a prefix alone would send
    the middle and start cuts of a text already known too short. Nothing looser: each word is
    compared with the space before it, so a text whose first word lost its space ("b c" from
    " a b c") is not contained, nor is part of a word (" understand" from " understanding"):
    either may tokenize longer. Nor are fewer words that are not the same words, which may
    be longer ones. The order is kept as the cuts keep it. Near enough even so: a candidate
    wrongly skipped is a step left untried, never a wrong minimal."""
    if spec.extra != longer.extra:
        return False
    theirs = iter(longer.parts)
    for part in spec.parts:
        for other in theirs:
            if part == other or (
                isinstance(part, TextPart)
                and isinstance(other, TextPart)
                and _kept_words(part.text, other.text)
            ):
                break
        else:
            return False
    return True


def _kept_words(text: str, longer: str) -> bool:
    """Every word of `text`, with its space, is one of `longer`'s, in the same order."""
    theirs = iter(_spaced_words(longer))
    return all(word in theirs for word in _spaced_words(text))  # `in` consumes `theirs`


def candidates(
    spec: PromptSpec, divergence: int | None = None, step_words: int | None = None
) -> list[PromptSpec]:
    """Every one-step simplification of `spec` that is smaller by `size_key`, smallest first
    (duplicates removed; a request always keeps at least one part). `step_words` (the KV
    block size) adds texts shortened by that many words: with one-token words a prompt
    shorter by whole blocks, which keeps a failure that depends on the prompt's length
    modulo the block (the KV lookup miss) while the text shrinks. Smaller cuts of a text
    (`_shorter_texts`) come after the bigger ones, by the sort, which is stable: candidates
    the same size keep the order they were made in, the same for the same request."""
    parts = list(spec.parts)
    media_at = [i for i, p in enumerate(parts) if isinstance(p, MEDIA_PARTS)]
    text_at = [i for i, p in enumerate(parts) if isinstance(p, TextPart)]
    found: list[PromptSpec] = []

    def add(new_parts: list[Part], **changes: Any) -> None:
        if new_parts:
            found.append(_with(spec, new_parts, **changes))

    for keep in media_at:  # one media item alone, texts kept
        add([p for i, p in enumerate(parts) if i == keep or i not in media_at])
    for drop in media_at:
        add([p for i, p in enumerate(parts) if i != drop])
    if text_at:
        add([p for i, p in enumerate(parts) if i not in text_at])
    for drop in text_at:
        add([p for i, p in enumerate(parts) if i != drop])
        text = parts[drop].text  # type: ignore[union-attr]
        for shorter in _shorter_texts(text, step_words):
            add([TextPart(shorter) if i == drop else p for i, p in enumerate(parts)])
    for index in media_at:
        for smaller in _smaller_media(parts[index]):
            add([smaller if i == index else p for i, p in enumerate(parts)])
    extra = dict(spec.extra)
    for key in extra:
        add(parts, extra=tuple((k, v) for k, v in spec.extra if k != key))
    for tokens in {1, spec.max_tokens // 2, (divergence or 0) + 1}:
        if 1 <= tokens < spec.max_tokens:
            add(parts, max_tokens=tokens)
    current = size_key(spec)
    unique: dict[str, PromptSpec] = {}
    for candidate in found:
        if size_key(candidate) < current:
            unique.setdefault(json.dumps(prompt_to_json(candidate), sort_keys=True), candidate)
    return sorted(unique.values(), key=size_key)


def _smaller_media(part: Part) -> list[Part]:
    width, height = part.size  # type: ignore[union-attr]
    sizes = {SMALL_IMAGE, (max(MIN_SIDE, width // 2), max(MIN_SIDE, height // 2))}
    sizes.add((min(width, height), min(width, height)))
    out: list[Part] = []
    for size in sorted(sizes):
        if size[0] * size[1] < width * height:
            out.append(_resized(part, size))
    if isinstance(part, (VideoPart, VideoFramesPart)) and part.num_frames > 2:
        out.append(_frames(part, max(2, part.num_frames // 2)))
    if isinstance(part, VideoPart) and part.fps != DEFAULT_FPS:
        out.append(VideoPart(part.seed, part.num_frames, DEFAULT_FPS, part.size))
    return out


def _resized(part: Part, size: tuple[int, int]) -> Part:
    if isinstance(part, ImagePart):
        return ImagePart(part.seed, size)
    if isinstance(part, VideoPart):
        return VideoPart(part.seed, part.num_frames, part.fps, size)
    assert isinstance(part, VideoFramesPart)
    return VideoFramesPart(part.seed, part.num_frames, size)


def _frames(part: VideoPart | VideoFramesPart, frames: int) -> Part:
    if isinstance(part, VideoPart):
        return VideoPart(part.seed, frames, part.fps, part.size)
    return VideoFramesPart(part.seed, frames, part.size)


@dataclass(frozen=True)
class Trial:
    """One candidate tried: whether it failed the same way, and what it cost."""

    spec: PromptSpec
    reproduced: bool
    outcome: str  # one line: the verdict and signature seen, or why it was not judged
    seconds: float
    restarted: bool = False  # the topology had to be restarted before it could be sent
    # Where a reproducing candidate's answers first differed (None: no token divergence, e.g.
    # a crash). A smaller request may diverge later than the one it came from, so the
    # shrinker reads it from each accepted trial for its "fewer tokens" candidates.
    divergence: int | None = None
    # Not judged: its prompt is under the minimum the topology needs (no KV moved). The
    # shrinker skips every later candidate `contained` in it.
    too_short: bool = False
    # With --plant-fault, whether the fault acted on this candidate (as `Evaluation.fault`
    # says it): a trial the fault missed is why a shrink stopped where it did, and fuzz.json
    # shows it per trial as it does per example.
    fault: str | None = None
    # Not sent, nor will any later candidate be: the run's restart budget is spent and the
    # topology down, or an attached deployment is down. The shrink ends here and says why
    # (`outcome`): counted as a candidate that did not reproduce, it ran through every other
    # one and called the request it had not shrunk a local minimum.
    unsendable: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.spec.name,
            "spec": prompt_to_json(self.spec),
            "reproduced": self.reproduced,
            "outcome": self.outcome,
            "seconds": round(self.seconds, 3),
            "restarted": self.restarted,
            "divergence": self.divergence,
            "too_short": self.too_short,
            "fault": self.fault,
            "unsendable": self.unsendable,
        }


class Oracle(Protocol):
    """Sends a candidate and says whether it fails with the target signature."""

    def attempt(self, spec: PromptSpec) -> Trial: ...

    def restart_pending(self) -> bool:
        """The next attempt must restart the topology first (an instance died)."""
        ...


@dataclass(frozen=True)
class ShrinkBudget:
    max_trials: int = 80
    max_restarts: int = 6
    max_seconds: float = 1200.0

    def to_json(self) -> dict[str, Any]:
        return {
            "max_trials": self.max_trials,
            "max_restarts": self.max_restarts,
            "max_seconds": self.max_seconds,
        }


@dataclass
class ShrinkResult:
    start: PromptSpec
    minimal: PromptSpec
    mode: str  # "sent" (every step sent to the topology) or "predicted" (see the module doc)
    trials: list[Trial] = field(default_factory=list)
    accepted: int = 0
    seconds: float = 0.0
    stopped_by: str = "local minimum"  # or which budget ended it
    confirmed: bool | None = None  # predicted mode: the minimal request sent and reproduced
    skipped: int = 0  # candidates not tried: contained in one found too short

    @property
    def restarts(self) -> int:
        return sum(t.restarted for t in self.trials)

    def to_json(self) -> dict[str, Any]:
        return {
            "start": self.start.name,
            "minimal": prompt_to_json(self.minimal),
            "mode": self.mode,
            "accepted_steps": self.accepted,
            "trials": len(self.trials),
            "restarts": self.restarts,
            "seconds": round(self.seconds, 1),
            "stopped_by": self.stopped_by,
            "confirmed": self.confirmed,
            "skipped_too_short": self.skipped,
            "steps": [t.to_json() for t in self.trials],
        }


def shrink(
    start: PromptSpec,
    oracle: Oracle,
    budget: ShrinkBudget,
    mode: str = "sent",
    divergence: int | None = None,
    clock: Callable[[], float] = time.monotonic,
    step_words: int | None = None,
) -> ShrinkResult:
    """Greedy: from the current request, try its candidates smallest first; take the first
    that reproduces and start over from it; stop at a request none of whose candidates
    reproduces, or when the budget is spent. Candidates are named START-sNNN (START-pNNN
    in predicted mode: when its minimal request, sent to confirm it, does not reproduce, the
    shrink by sending that follows numbers from 0 again, and a name must not stand for two
    bodies the topology got, which a stage may name). `divergence`
    is where the start's answers first differed; each accepted trial that reports its own
    replaces it, so "fewer tokens" aims at the current request's divergence, not the
    start's. A candidate `contained` in one found too short is skipped: it would be too
    short as well, and trying it would spend a request and a trial of the budget."""
    began = clock()
    result = ShrinkResult(start=start, minimal=start, mode=mode)
    restarts = 0
    too_short: list[PromptSpec] = []
    while True:
        progressed = False
        for candidate in candidates(result.minimal, divergence, step_words):
            if any(contained(candidate, short) for short in too_short):
                result.skipped += 1
                continue
            stop = _over_budget(result, budget, restarts, oracle, clock() - began)
            if stop:
                result.stopped_by = stop
                result.seconds = clock() - began
                return result
            named = _with(candidate)
            named = PromptSpec(
                f"{start.name}-{'p' if mode == 'predicted' else 's'}{len(result.trials):03d}",
                named.parts,
                named.max_tokens,
                named.extra,
            )
            trial = oracle.attempt(named)
            result.trials.append(trial)
            restarts += trial.restarted
            if trial.unsendable:
                result.stopped_by = f"nothing more can be sent: {trial.outcome}"
                result.seconds = clock() - began
                return result
            if trial.too_short:
                too_short.append(named)
            if trial.reproduced:
                result.minimal = named
                result.accepted += 1
                if trial.divergence is not None:  # where the smaller request diverges
                    divergence = trial.divergence
                progressed = True
                break
        if not progressed:
            result.seconds = clock() - began
            return result


def _over_budget(
    result: ShrinkResult, budget: ShrinkBudget, restarts: int, oracle: Oracle, elapsed: float
) -> str | None:
    if len(result.trials) >= budget.max_trials:
        return f"trial budget ({budget.max_trials})"
    if elapsed >= budget.max_seconds:
        return f"time budget ({budget.max_seconds:.0f} s)"
    if oracle.restart_pending() and restarts >= budget.max_restarts:
        return f"restart budget ({budget.max_restarts})"
    return None
