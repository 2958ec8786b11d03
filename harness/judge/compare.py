"""Token-level comparison of two chat results, and the verdicts a case can end with.

Comparing decoded text would hide the failures this harness exists to find (a tokenizer can
render two different id sequences alike), so both the prompt ids and the generated ids are
compared one by one. The prompt check matters on its own: D's prompt must equal the
baseline's, which directly proves the multimodal placeholders were sized right.

At the first differing generated position the top-k logprobs decide whether the difference is
numerical drift (each side's token is in the other side's top-k, the rule upstream vLLM's
`check_logprobs_close` applies) or a real mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.judge.records import Verdict
from harness.serve.client import ChatResult

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
    # Each token in the other side's top-k; None when that cannot be proved either way.
    logprob_close: bool | None

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
            "logprob_close": self.logprob_close,
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
        lines.append(f"  logprob-close: {_render_closeness(d)}")
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


def _render_closeness(d: Divergence) -> str:
    if d.logprob_close is None:
        if d.reference_token is None or d.candidate_token is None:
            return "unknown (one side ended: there is no token to look up)"
        missing = [
            side
            for side, top in (("reference", d.reference_top), ("candidate", d.candidate_top))
            if top is None
        ]
        return f"unknown (no logprobs at {d.index} on the {' and '.join(missing)})"
    if d.logprob_close:
        return "yes (each token is in the other's top-k)"
    assert d.reference_top is not None and d.candidate_top is not None
    ref_in_cand = d.reference_token in {tid for tid, _ in d.candidate_top}
    cand_in_ref = d.candidate_token in {tid for tid, _ in d.reference_top}
    return (
        f"no (reference {d.reference_token} in candidate's top-{len(d.candidate_top)}: "
        f"{'yes' if ref_in_cand else 'no'}; candidate {d.candidate_token} in reference's "
        f"top-{len(d.reference_top)}: {'yes' if cand_in_ref else 'no'})"
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


def _divergence(
    reference: ChatResult, candidate: ChatResult, index: int, window: int
) -> Divergence:
    start = max(0, index - window)
    end = index + window + 1
    ref_ids, cand_ids = reference.token_ids, candidate.token_ids
    ref_token = ref_ids[index] if index < len(ref_ids) else None
    cand_token = cand_ids[index] if index < len(cand_ids) else None
    ref_top, cand_top = _top_at(reference, index), _top_at(candidate, index)
    close: bool | None = None
    if ref_top is not None and cand_top is not None:
        close = ref_token in {t for t, _ in cand_top} and cand_token in {t for t, _ in ref_top}
    return Divergence(
        index=index,
        window_start=start,
        reference_window=ref_ids[start:end],
        candidate_window=cand_ids[start:end],
        reference_token=ref_token,
        candidate_token=cand_token,
        reference_top=ref_top,
        candidate_top=cand_top,
        logprob_close=close,
    )


def compare_results(
    reference: ChatResult, candidate: ChatResult, window: int = DEFAULT_WINDOW
) -> TokenComparison:
    """Compare prompt ids and generated ids; describe the first generated divergence."""
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    prompt_index = _first_difference(reference.prompt_token_ids, candidate.prompt_token_ids)
    index = _first_difference(reference.token_ids, candidate.token_ids)
    return TokenComparison(
        prompt_ids_equal=prompt_index is None,
        prompt_divergence_index=prompt_index,
        tokens_equal=index is None,
        divergence=None if index is None else _divergence(reference, candidate, index, window),
        reference_len=len(reference.token_ids),
        candidate_len=len(candidate.token_ids),
        reference_prompt_len=len(reference.prompt_token_ids),
        candidate_prompt_len=len(candidate.prompt_token_ids),
    )


def token_verdict(cmp: TokenComparison) -> Verdict:
    """MATCH / DRIFT / MISMATCH from the ids alone; guards may later downgrade MATCH.

    Missing logprobs cannot prove closeness, so a divergence without them is a MISMATCH.
    """
    if not cmp.prompt_ids_equal:
        return Verdict.MISMATCH
    if cmp.tokens_equal:
        return Verdict.MATCH
    assert cmp.divergence is not None
    return Verdict.DRIFT if cmp.divergence.logprob_close else Verdict.MISMATCH
