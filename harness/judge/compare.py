"""Token-level comparison of two chat results, and the verdicts a case can end with.

Comparing decoded text would hide the failures this harness exists to find (a tokenizer can
render two different id sequences alike), so both the prompt ids and the generated ids are
compared one by one. The prompt check matters on its own: D's prompt must equal the
baseline's, which directly proves the multimodal placeholders were sized right.

At the first differing generated position the logprobs decide whether the difference is
numerical drift or a real mismatch; after other prompt ids it is a mismatch whatever they say.
Drift is what numeric noise looks like: the two tokens were a near-tie on *both* sides (each
side's log-prob gap between them within the tolerance), the two sides put each of the two
tokens at the same log-prob there (within the tolerance: noise moves no log-prob further), and
the two runs agreed on the log-prob of every token before it (within the tolerance). Upstream's
looser rule ("each token is in the other's top-k") excuses a corrupted embedding that merely happens
to flip a token into second place. The tolerance is the noise floor the harness measured on this
platform (the baseline against itself); on CPU with the numerics flags pinned it is zero, so any
difference is a MISMATCH.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from harness.judge.records import Verdict
from harness.outcomes.chat import ChatResult

DEFAULT_WINDOW = 5


@dataclass(frozen=True)
class Divergence:
    """Where two generated sequences first part, with the context needed to judge why."""

    index: int  # first differing generated position
    window_start: int  # position of the first id in both windows
    reference_window: tuple[int, ...]  # ids from index-W to index+W (clipped to the sequence)
    candidate_window: tuple[int, ...]
    reference_token: int | None  # None: the reference had already ended
    candidate_token: int | None
    reference_top: tuple[tuple[int, float], ...] | None  # None: no logprobs at index
    candidate_top: tuple[tuple[int, float], ...] | None
    # log p(own token) - log p(other side's token), on each side at the divergence; None when
    # the other token is not in that side's top-k (or there are no logprobs there).
    reference_gap: float | None
    candidate_gap: float | None
    # The largest |difference| of the generated token's log-prob over the common prefix; None
    # without logprobs for the whole prefix.
    prefix_delta: float | None
    tolerance: float  # nats: the measured noise floor the drift rule allows
    prompt_ids_equal: bool  # both sides answered the same prompt ids
    # The largest |difference| between the sides' log-probs of the two tokens at the divergence;
    # None unless both tokens are in both sides' top-k. A near tie both sides moved far from
    # where the other put it (a flattened distribution) is no noise within the floor.
    divergence_delta: float | None = None
    # The candidate's stream broke its framing: its ids are not an answer a client could read
    # (harness.judge.verdicts makes the case a MISMATCH whatever they say).
    framing_broken: bool = False

    @property
    def drift_not_applicable(self) -> str | None:
        """Why the drift rule cannot excuse this divergence whatever the log-probs say, or None
        when it can. Drift is noise between two answers to one prompt at a position both
        generated: the renderers print this reason, so no MISMATCH reads "drift: yes"."""
        if self.framing_broken:
            return (
                "not applicable: the stream framing is broken, so its ids are no answer a "
                "client could read"
            )
        if not self.prompt_ids_equal:
            return (
                "not applicable: the prompt ids differ, and drift is noise between answers to "
                "the same prompt"
            )
        if self.reference_token is None or self.candidate_token is None:
            return "one side ended: a length difference is no near-tie"
        return None

    @property
    def near_tie(self) -> bool | None:
        """Both sides nearly tied between the two tokens; None when that cannot be known.

        A gap is near when its size is: a side whose own token sits far *below* the other's in
        its own log-probs (a large negative gap) did not pick it by a near-tie, and a NaN gap
        is evidence of nothing (`max` would drop it)."""
        gaps = (self.reference_gap, self.candidate_gap)
        if any(gap is None or not math.isfinite(gap) for gap in gaps):
            return None
        return max(abs(gap) for gap in gaps) <= self.tolerance

    @property
    def is_drift(self) -> bool:
        """Numeric drift: a near-tie at the divergence after a prefix that agreed, within a
        tolerance above zero (a zero noise floor leaves no room for drift)."""
        return (
            self.drift_not_applicable is None
            and self.tolerance > 0
            and self.near_tie is True
            and self.divergence_delta is not None
            and self.divergence_delta <= self.tolerance
            and self.prefix_delta is not None
            and self.prefix_delta <= self.tolerance
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-able form (lists, not tuples) for records and summary.json."""

        def top(entries: tuple[tuple[int, float], ...] | None) -> list[list[Any]] | None:
            return None if entries is None else [[tid, lp] for tid, lp in entries]

        return {
            "index": self.index,
            "window_start": self.window_start,
            "reference_window": list(self.reference_window),
            "candidate_window": list(self.candidate_window),
            "reference_token": self.reference_token,
            "candidate_token": self.candidate_token,
            "reference_top": top(self.reference_top),
            "candidate_top": top(self.candidate_top),
            "reference_gap": self.reference_gap,
            "candidate_gap": self.candidate_gap,
            "prefix_delta": self.prefix_delta,
            "divergence_delta": self.divergence_delta,
            "tolerance": self.tolerance,
            "drift": self.is_drift,
            "drift_not_applicable": self.drift_not_applicable,
        }


@dataclass(frozen=True)
class TokenComparison:
    """The outcome of comparing a candidate's ids with a reference's ids."""

    prompt_ids_equal: bool
    prompt_divergence_index: int | None
    tokens_equal: bool
    divergence: Divergence | None
    reference_len: int  # generated tokens
    candidate_len: int
    reference_prompt_len: int  # prompt tokens: their difference is the placeholder error
    candidate_prompt_len: int

    @property
    def exact(self) -> bool:
        return self.prompt_ids_equal and self.tokens_equal

    def with_broken_framing(self) -> TokenComparison:
        """This comparison of ids a stream with broken framing carried: no drift applies."""
        if self.divergence is None:
            return self
        return dataclasses.replace(
            self, divergence=dataclasses.replace(self.divergence, framing_broken=True)
        )

    def headline(self) -> str:
        """One line, fit for a table cell or a log line."""
        lengths = f"{self.reference_len}/{self.candidate_len}"
        if self.tokens_equal:
            tokens = f"generated tokens equal ({lengths})"
        else:
            assert self.divergence is not None
            tokens = f"generated tokens differ at position {self.divergence.index} of {lengths}"
        if self.prompt_ids_equal:
            return f"identical: {tokens}" if self.tokens_equal else tokens
        prompt = (
            f"prompt ids differ at position {self.prompt_divergence_index} (reference "
            f"{self.reference_prompt_len} ids, candidate {self.candidate_prompt_len} ids)"
        )
        return f"{prompt}; {tokens}"

    def describe(self) -> str:
        """The headline plus the evidence: both windows, both top-k and the closeness rule."""
        lines = [self.headline()]
        if not self.prompt_ids_equal:
            lines.append(
                "  the candidate was not given the reference's prompt: "
                "were the multimodal placeholders sized differently?"
            )
        d = self.divergence
        if d is None:
            return "\n".join(lines)
        for side, window, token, length in (
            ("reference", d.reference_window, d.reference_token, self.reference_len),
            ("candidate", d.candidate_window, d.candidate_token, self.candidate_len),
        ):
            shown = "(ended)" if token is None else str(token)
            lines.append(f"  {side} ⟶ {shown:<8} {_render_window(d, window, length)}")
        for side, token, top in (
            ("reference", d.reference_token, d.reference_top),
            ("candidate", d.candidate_token, d.candidate_top),
        ):
            lines.append(f"  {side} {_render_top(d.index, token, top)}")
        lines.append(f"  drift: {_render_drift(d)}")
        return "\n".join(lines)


def _render_window(d: Divergence, window: tuple[int, ...], length: int) -> str:
    """`…a b c [x] d e…`: ids before the divergence, the one at it bracketed, ids after."""
    before = window[: d.index - d.window_start]
    at_and_after = window[d.index - d.window_start :]
    parts = [str(t) for t in before]
    if at_and_after:
        parts.append(f"[{at_and_after[0]}]")
        parts += [str(t) for t in at_and_after[1:]]
    else:
        parts.append("[end]")
    lead = "…" if d.window_start > 0 else ""
    trail = "…" if d.window_start + len(window) < length else ""
    return f"{lead}{' '.join(parts)}{trail}"


def _render_top(index: int, token: int | None, top: tuple[tuple[int, float], ...] | None) -> str:
    if top is None:
        reason = "sequence ended" if token is None else "no logprobs"
        return f"top-k at {index}: unavailable ({reason})"
    entries = " ".join(f"{tid}({lp:.2f})" for tid, lp in top)
    return f"top-{len(top)} at {index}: {entries}"


def _render_drift(d: Divergence) -> str:
    if d.drift_not_applicable is not None:
        return f"no ({d.drift_not_applicable})"
    gaps = []
    for side, gap in (("reference", d.reference_gap), ("candidate", d.candidate_gap)):
        gaps.append(
            f"{side} gap {'n/a (other token not in its top-k)' if gap is None else f'{gap:.3f}'}"
        )
    prefix = "n/a" if d.prefix_delta is None else f"{d.prefix_delta:.3f}"
    at = "n/a" if d.divergence_delta is None else f"{d.divergence_delta:.3f}"
    verdict = "yes" if d.is_drift else "no"
    return (
        f"{verdict} ({', '.join(gaps)}; log-prob delta at the divergence {at}; prefix "
        f"log-prob delta {prefix}; tolerance "
        f"{d.tolerance:g} nats, the measured noise floor)"
    )


def _first_difference(a: tuple[int, ...], b: tuple[int, ...]) -> int | None:
    """First index where the sequences differ; the shorter length if one is a prefix."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _top_at(result: ChatResult, index: int) -> tuple[tuple[int, float], ...] | None:
    """The top-k at a position, if the server returned it for the token actually generated.

    A logprob entry for another token means the logprobs are misaligned with the ids; they
    cannot then be evidence of closeness.
    """
    if index >= len(result.logprobs) or index >= len(result.token_ids):
        return None
    position = result.logprobs[index]
    if position.token_id != result.token_ids[index] or not position.top:
        return None
    return position.top


def _gap(
    top: tuple[tuple[int, float], ...] | None, own: int | None, other: int | None
) -> float | None:
    """log p(own) - log p(other) from one side's top-k; None if either is missing from it."""
    if top is None or own is None or other is None:
        return None
    logprobs = dict(top)
    if own not in logprobs or other not in logprobs:
        return None
    return logprobs[own] - logprobs[other]


def _divergence_delta(
    reference_top: tuple[tuple[int, float], ...] | None,
    candidate_top: tuple[tuple[int, float], ...] | None,
    tokens: tuple[int | None, int | None],
) -> float | None:
    """max |Δ log p| between the sides of the two tokens at the divergence; None unless each
    side's top-k lists both, or when a difference is not finite (`max` would drop a NaN)."""
    if reference_top is None or candidate_top is None or None in tokens:
        return None
    ref, cand = dict(reference_top), dict(candidate_top)
    if any(token not in ref or token not in cand for token in tokens):
        return None
    deltas = [abs(ref[token] - cand[token]) for token in tokens]
    return max(deltas) if all(math.isfinite(delta) for delta in deltas) else None


def _prefix_delta(reference: ChatResult, candidate: ChatResult, index: int) -> float | None:
    """max |Δ log p| of the generated token over positions 0..index-1 (equal tokens there)."""
    deltas = []
    for position in range(index):
        ref, cand = _logprob_at(reference, position), _logprob_at(candidate, position)
        if ref is None or cand is None or not math.isfinite(ref - cand):
            return None
        deltas.append(abs(ref - cand))
    return max(deltas, default=0.0)


def _logprob_at(result: ChatResult, index: int) -> float | None:
    if index >= len(result.logprobs) or index >= len(result.token_ids):
        return None
    position = result.logprobs[index]
    return position.logprob if position.token_id == result.token_ids[index] else None


def _divergence(
    reference: ChatResult,
    candidate: ChatResult,
    index: int,
    window: int,
    tolerance: float,
    prompt_ids_equal: bool,
) -> Divergence:
    start = max(0, index - window)
    end = index + window + 1
    ref_ids, cand_ids = reference.token_ids, candidate.token_ids
    ref_token = ref_ids[index] if index < len(ref_ids) else None
    cand_token = cand_ids[index] if index < len(cand_ids) else None
    ref_top, cand_top = _top_at(reference, index), _top_at(candidate, index)
    return Divergence(
        index=index,
        window_start=start,
        reference_window=ref_ids[start:end],
        candidate_window=cand_ids[start:end],
        reference_token=ref_token,
        candidate_token=cand_token,
        reference_top=ref_top,
        candidate_top=cand_top,
        reference_gap=_gap(ref_top, ref_token, cand_token),
        candidate_gap=_gap(cand_top, cand_token, ref_token),
        prefix_delta=_prefix_delta(reference, candidate, index),
        tolerance=tolerance,
        prompt_ids_equal=prompt_ids_equal,
        divergence_delta=_divergence_delta(ref_top, cand_top, (ref_token, cand_token)),
    )


def compare_results(
    reference: ChatResult,
    candidate: ChatResult,
    window: int = DEFAULT_WINDOW,
    tolerance: float = 0.0,
) -> TokenComparison:
    """Compare prompt ids and generated ids; describe the first generated divergence, judged
    against the drift `tolerance` (nats; the measured noise floor, 0 on CPU)."""
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    prompt_index = _first_difference(reference.prompt_token_ids, candidate.prompt_token_ids)
    index = _first_difference(reference.token_ids, candidate.token_ids)
    return TokenComparison(
        prompt_ids_equal=prompt_index is None,
        prompt_divergence_index=prompt_index,
        tokens_equal=index is None,
        divergence=(
            None
            if index is None
            else _divergence(reference, candidate, index, window, tolerance, prompt_index is None)
        ),
        reference_len=len(reference.token_ids),
        candidate_len=len(candidate.token_ids),
        reference_prompt_len=len(reference.prompt_token_ids),
        candidate_prompt_len=len(candidate.prompt_token_ids),
    )


def token_verdict(cmp: TokenComparison) -> Verdict:
    """MATCH / DRIFT / MISMATCH from the ids and log-probs; guards may later downgrade MATCH.

    Missing logprobs cannot prove drift, so a divergence without them is a MISMATCH.
    """
    if not cmp.prompt_ids_equal:
        return Verdict.MISMATCH
    if cmp.tokens_equal:
        return Verdict.MATCH
    assert cmp.divergence is not None
    return Verdict.DRIFT if cmp.divergence.is_drift else Verdict.MISMATCH


def is_measured_floor(value: Any) -> bool:
    """Whether a stored value can be a noise floor the harness measured: a finite number of
    nats, 0 or more. The floor is the drift rule's tolerance, so a value read back from a file
    (a cache entry, a bundle) that is anything else (an Infinity, which Python's json reads,
    made every near tie a DRIFT) must be refused, never used. check.py, which runs without the
    harness, restates this test."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def noise_floor(first: ChatResult, second: ChatResult) -> float | None:
    """The largest |Δ log p| between two answers to the same request with the same tokens: the
    numeric noise of the platform, which the drift rule may excuse. None if the tokens differ
    or logprobs are missing or not finite (no floor can be read then)."""
    if first.token_ids != second.token_ids or len(first.logprobs) != len(second.logprobs):
        return None
    return prefix_noise_floor(first, second)


def prefix_noise_floor(first: ChatResult, second: ChatResult) -> float | None:
    """The largest |Δ log p| over the positions before the two answers' ids part (the chosen
    token's and every top-k entry both sides list): the noise floor read from two answers that
    may differ, e.g. one request alone and the same request batched with another. None
    without logprobs there, or with one that is not finite: an infinite floor would excuse any
    divergence as drift, and `max` would drop a NaN as if its position had agreed. None too
    when an entry is another token's than the id generated there: log-probs misaligned with
    the ids measure no noise of these tokens (as they are no evidence at a divergence,
    `_top_at`), and compared as if they did they made a floor of any size. None too for
    answers to other prompt ids: noise is between answers to one request (found in review: a
    batched answer to another prompt that generated the same ids read as a floor)."""
    if first.prompt_token_ids != second.prompt_token_ids:
        return None
    index = _first_difference(first.token_ids, second.token_ids)
    agreed = len(first.token_ids) if index is None else index
    if len(first.logprobs) < agreed or len(second.logprobs) < agreed:
        return None
    deltas = [0.0]
    for position, (a, b) in enumerate(zip(first.logprobs[:agreed], second.logprobs[:agreed])):
        if a.token_id != first.token_ids[position] or b.token_id != second.token_ids[position]:
            return None
        deltas.append(abs(a.logprob - b.logprob))
        other = dict(b.top)
        deltas += [abs(lp - other[tid]) for tid, lp in a.top if tid in other]
    if not all(math.isfinite(delta) for delta in deltas):
        return None
    return max(deltas)


def whose_answer(candidate: ChatResult, others: Sequence[tuple[str, ChatResult]]) -> str | None:
    """Whose answer a candidate that is not its own request's answer is, among `others` (name,
    answer): requests in flight together that share an encoder, a prefill batch or a proxy can
    be handed each other's embeddings, KV or response. Names the first whose prompt ids and
    generated ids both equal the candidate's ("received X's answer"), else the first whose
    generated ids alone do: the candidate's prompt is its own, but what it generated was
    computed from X's context ("generated X's answer")."""
    whole = [name for name, other in others if _same_answer(candidate, other, prompt=True)]
    if whole:
        return f"received {_owners(whole)}"
    generated = [name for name, other in others if _same_answer(candidate, other, prompt=False)]
    if generated:
        return f"generated {_owners(generated)} (its prompt ids are its own)"
    return None


def _same_answer(candidate: ChatResult, other: ChatResult, prompt: bool) -> bool:
    if not candidate.token_ids or candidate.token_ids != other.token_ids:
        return False
    return not prompt or candidate.prompt_token_ids == other.prompt_token_ids


def _owners(names: list[str]) -> str:
    """`request 4's answer`; when several answers are alike, the others are named too."""
    text = f"{names[0]}'s answer"
    if len(names) > 1:
        more = ", ".join(names[1:4]) + (", ..." if len(names) > 4 else "")
        text += f" (alike: {more})"
    return text
