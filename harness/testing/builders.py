"""Hand-made records for tests of judging and reporting: answers, outcomes, judged cases.

Only the fields a test is about need saying; the rest get plain values that no check reads
as meaningful (prompt ids (1, 2, 3), an empty text, finish "length", no evidence).

    chat((5, 6, 7))                                 three generated ids, no log-probs
    chat((5, 6), top=lambda i, t: [(t, -0.5), (t + 1, -2.0)])   with a top-2 at each position
    cached_answer(89, 64)                           D's answer, 64 of 89 prompt tokens cached
    outcome("image", (5, 6))  outcome("image", error="HTTP 500")
    case_record(verdict=Verdict.MISMATCH, passed=False)

To judge a hand-made outcome as a run would, use `harness.testing.judging.judged`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from harness.judge.records import CaseRecord, Verdict
from harness.outcomes.chat import ChatResult, PositionLogprobs
from harness.outcomes.outcome import Outcome

PROMPT_IDS = (1, 2, 3)
# position, generated id -> that position's top-k, best first: [(token id, logprob), ...]
TopK = Callable[[int, int], Sequence[tuple[int, float]]]


def positions(token_ids: Sequence[int], top: TopK) -> tuple[PositionLogprobs, ...]:
    """Log-probs of `token_ids`: each position's top-k from `top`, and the generated token's
    own logprob that of the top-1 (greedy decoding picks it)."""
    logprobs = []
    for index, token_id in enumerate(token_ids):
        ranked = tuple((int(t), float(lp)) for t, lp in top(index, token_id))
        logprobs.append(PositionLogprobs(token_id, ranked[0][1], ranked))
    return tuple(logprobs)


def chat(
    token_ids: Sequence[int],
    *,
    prompt_ids: Sequence[int] = PROMPT_IDS,
    text: str = "",
    finish_reason: str | None = "length",
    top: TopK | None = None,
    cached_tokens: int | None = None,
) -> ChatResult:
    """One answer: `token_ids` generated after `prompt_ids`; log-probs only with `top`."""
    return ChatResult(
        prompt_token_ids=tuple(prompt_ids),
        token_ids=tuple(token_ids),
        text=text,
        finish_reason=finish_reason,
        logprobs=positions(token_ids, top) if top is not None else (),
        cached_tokens=cached_tokens,
    )


def cached_answer(
    prompt_tokens: int, cached_tokens: int | None, token_ids: Sequence[int] = (1,)
) -> ChatResult:
    """An answer to a prompt of `prompt_tokens` tokens that reports `cached_tokens` of them as
    cached (usage.prompt_tokens_details; None: not reported): the kv_transfer guard's evidence."""
    return chat(token_ids, prompt_ids=range(prompt_tokens), cached_tokens=cached_tokens)


def outcome(
    prompt: str,
    token_ids: Sequence[int] | None = None,
    *,
    error: str | None = None,
    **answer: Any,
) -> Outcome:
    """One request's outcome: an answer (`chat(token_ids, **answer)`) or, with `error`, none."""
    if error is not None:
        return Outcome(prompt, error=error)
    return Outcome(prompt, chat(token_ids or (), **answer))


def case_record(
    topology: str = "1E+1P+1D",
    prompt: str = "image-cat",
    verdict: Verdict = Verdict.MATCH,
    passed: bool = True,
    **fields: Any,
) -> CaseRecord:
    """A judged case as a report reads it; `fields` override any other CaseRecord field."""
    values: dict[str, Any] = dict(
        topology=topology,
        prompt=prompt,
        reference="baseline",
        verdict=verdict,
        policy_passed=passed,
        detail="identical: generated tokens equal (32/32)",
        divergence=None,
        guards={"kv_transfer": {"ok": True, "evidence": "cached_tokens=96 of 120"}},
        timings={"request_s": 1.25},
        error=None,
    )
    values.update(fields)
    return CaseRecord(**values)
