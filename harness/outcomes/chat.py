"""What a chat completion came back with, reduced to what a token-level comparison needs.

`return_tokens_as_token_ids` makes every logprob entry read `token_id:N`, so the top-k at a
divergence is in ids, not in ambiguous decoded strings; a response without vLLM's
`return_token_ids` fields cannot be compared id by id and is refused when parsed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# finish_reasons of an answer that did not finish (vLLM's FinishReason: `abort`, the request was
# aborted; `error`, it failed in the engine, e.g. its KV did not load; none, vLLM never ends an
# answer so): its ids are as short as the end made them, no answer to compare.
UNFINISHED = {
    None: "no finish_reason",
    "abort": "the request was aborted",
    "error": "the request failed in the engine",
}


def unfinished(finish_reason: str | None) -> str | None:
    """Why an answer with this finish_reason did not finish, or None when it did."""
    if finish_reason not in UNFINISHED:
        return None
    return f"finish_reason {json.dumps(finish_reason)}: {UNFINISHED[finish_reason]}"


@dataclass(frozen=True)
class PositionLogprobs:
    """What the server said about one generated position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), best first

    def top_ids(self) -> set[int]:
        return {token_id for token_id, _ in self.top}


@dataclass(frozen=True)
class ChatResult:
    """One chat completion reduced to what the harness compares and guards."""

    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    logprobs: tuple[PositionLogprobs, ...] = ()
    # usage.prompt_tokens_details.cached_tokens: on D, prompt tokens loaded from the KV
    # connector plus local prefix-cache hits (None when the server did not report it).
    cached_tokens: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt_token_ids": list(self.prompt_token_ids),
            "token_ids": list(self.token_ids),
            "text": self.text,
            "finish_reason": self.finish_reason,
            "cached_tokens": self.cached_tokens,
            "logprobs": [
                {"token_id": p.token_id, "logprob": p.logprob, "top": [list(t) for t in p.top]}
                for p in self.logprobs
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ChatResult:
        return cls(
            prompt_token_ids=tuple(data["prompt_token_ids"]),
            token_ids=tuple(data["token_ids"]),
            text=data.get("text", ""),
            finish_reason=data.get("finish_reason"),
            cached_tokens=data.get("cached_tokens"),
            logprobs=tuple(
                PositionLogprobs(
                    token_id=p["token_id"],
                    logprob=p["logprob"],
                    top=tuple((int(t[0]), float(t[1])) for t in p["top"]),
                )
                for p in data.get("logprobs", [])
            ),
        )


def token_id_of(label: str) -> int:
    """`token_id:123` -> 123 (what `return_tokens_as_token_ids` makes vLLM print)."""
    prefix, _, number = label.partition(":")
    if prefix != "token_id" or not number.lstrip("-").isdigit():
        raise ValueError(f"expected a 'token_id:N' logprob token, got {label!r}")
    return int(number)


def position_logprobs(entry: dict[str, Any]) -> PositionLogprobs:
    """One entry of an OpenAI `logprobs.content` list, a whole answer's or a streamed chunk's."""
    return PositionLogprobs(
        token_id=token_id_of(entry["token"]),
        logprob=float(entry["logprob"]),
        top=tuple(
            (token_id_of(t["token"]), float(t["logprob"])) for t in entry.get("top_logprobs") or []
        ),
    )


def integer_ids(ids: Any, what: str) -> tuple[int, ...]:
    """`ids` as token ids: a list of integers, or ValueError. Ids are compared, stored and
    shown (report.html): anything else is a broken answer, never data to carry (found in
    review: markup in an answer's ids reached the HTML report; a float would be truncated)."""
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in ids
    ):
        raise ValueError(f"the answer's {what} are not a list of integers: {str(ids)[:200]}")
    return tuple(ids)


def parse_chat_response(body: dict[str, Any]) -> ChatResult:
    """Reduce a vLLM chat completion JSON body to a ChatResult; fail on a missing field."""
    try:
        choice = body["choices"][0]
        token_ids = choice["token_ids"]
        prompt_token_ids = body["prompt_token_ids"]
    except (KeyError, IndexError, TypeError) as exc:
        raise ValueError(
            f"response lacks {exc}: was return_token_ids honoured? body: {json.dumps(body)[:500]}"
        ) from None
    if len(body["choices"]) != 1:
        raise ValueError(
            f"the answer has {len(body['choices'])} choices (one expected): each would need "
            "judging, and the harness asks for one"
        )
    if token_ids is None or prompt_token_ids is None:
        raise ValueError("response carries null token ids: was return_token_ids honoured?")
    prompt_token_ids = integer_ids(prompt_token_ids, "prompt_token_ids")
    token_ids = integer_ids(token_ids, "token_ids")
    positions = [
        position_logprobs(entry) for entry in (choice.get("logprobs") or {}).get("content") or []
    ]
    _check_logprobs_are_of(positions, token_ids)
    _check_usage_counts(body.get("usage"), token_ids)
    text = _optional_object(choice.get("message"), "choices[0].message").get("content")
    finish_reason = choice.get("finish_reason")
    for name, value in (("message.content", text), ("finish_reason", finish_reason)):
        if value is not None and not isinstance(value, str):
            raise ValueError(
                f"the answer's choices[0].{name} is {json.dumps(value)[:120]}, not a string"
            )
    why = unfinished(finish_reason)
    if why is not None:
        raise ValueError(f"the answer did not finish: {why}")
    return ChatResult(
        prompt_token_ids=prompt_token_ids,
        token_ids=token_ids,
        text=text or "",
        finish_reason=finish_reason,
        logprobs=tuple(positions),
        cached_tokens=cached_tokens(body.get("usage")),
        raw=body,
    )


def _check_logprobs_are_of(positions: list[PositionLogprobs], token_ids: tuple[int, ...]) -> None:
    """Log-probs, when asked for, must be one entry per generated id, each of that id: the drift
    rule reads them at a divergence's position, and another position's near-tie must never
    excuse it (ValueError naming the first that is not)."""
    if not positions:
        return  # not asked for
    if len(positions) != len(token_ids):
        raise ValueError(
            f"the answer's log-probs are not of its ids: {len(token_ids)} token ids, "
            f"{len(positions)} log-prob entries"
        )
    for index, (position, token_id) in enumerate(zip(positions, token_ids)):
        if position.token_id != token_id:
            raise ValueError(
                f"the answer's log-probs are not of its ids: entry {index} is of token "
                f"{position.token_id}, its position's id is {token_id}"
            )


def _check_usage_counts(usage: Any, token_ids: tuple[int, ...]) -> None:
    """vLLM counts every generated id (EOS included) in `usage.completion_tokens`: another
    count than the answer's ids means ids lost or added on the way, as the stream reader
    (harness.outcomes.stream) makes it a problem of a stream (ValueError). vLLM's unstreamed
    answer always carries the count (its ChatCompletionResponse requires usage, and
    serving.py sets completion_tokens): an answer without it (a relay that dropped it) could
    hide lost ids, and is refused too (found in review: it was accepted unchecked)."""
    counted = _optional_object(usage, "usage").get("completion_tokens")
    if counted is None:
        raise ValueError(
            "the answer's usage has no completion_tokens (vLLM always counts the generated "
            "ids there): its ids cannot be checked whole"
        )
    if not isinstance(counted, int) or isinstance(counted, bool):
        raise ValueError(
            f"the answer's usage.completion_tokens is {json.dumps(counted)[:120]}, not an integer"
        )
    if counted != len(token_ids):
        raise ValueError(
            f"the answer's usage counts {counted} completion tokens, its token_ids {len(token_ids)}"
        )


def cached_tokens(usage: Any) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens` (None: not reported), the KV guard's
    evidence: of another shape than vLLM's it is a broken answer (ValueError naming the
    field), as the stream reader (harness.outcomes.stream) makes it a problem, never a count
    the guard compares (a string raised there; True counted as 1)."""
    details = _optional_object(usage, "usage").get("prompt_tokens_details")
    cached = _optional_object(details, "usage.prompt_tokens_details").get("cached_tokens")
    if cached is not None and (not isinstance(cached, int) or isinstance(cached, bool)):
        raise ValueError(
            "the answer's usage.prompt_tokens_details.cached_tokens is "
            f"{json.dumps(cached)[:120]}, not an integer"
        )
    return cached


def _optional_object(value: Any, field: str) -> dict[str, Any]:
    """An optional object of the answer: {} when absent (null)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"the answer's {field} is {json.dumps(value)[:120]}, not an object")
    return value
