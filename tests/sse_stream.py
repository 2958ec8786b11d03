"""Streams shaped as vLLM 0.32 sends them (chat_completion/serving.py,
`chat_completion_stream_generator`, with `return_token_ids`, `logprobs`,
`return_tokens_as_token_ids` and `stream_options.include_usage`), for the tests of stream
parsing, framing and relaying. Each event is `data: <json>\\n\\n`; the first chunk carries the
role and `prompt_token_ids`, each later one its token ids and their log-probs, the last choice
chunk `finish_reason`, then a usage chunk with no choices, then `[DONE]`.
"""

from __future__ import annotations

import json
from typing import Any

PROMPT_IDS = [1, 2, 3, 785, 785, 4]
TOKENS = [40, 41, 42]


def logprob_entry(token: int, rank_logprob: float) -> dict[str, Any]:
    return {
        "token": f"token_id:{token}",
        "logprob": rank_logprob,
        "bytes": None,
        "top_logprobs": [
            {"token": f"token_id:{token}", "logprob": rank_logprob, "bytes": None},
            {"token": f"token_id:{token + 100}", "logprob": -4.0, "bytes": None},
        ],
    }


def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "epd-model",
        "choices": choices,
        **extra,
    }


def vllm_chunks(
    prompt_ids: list[int] = PROMPT_IDS, tokens: list[int] = TOKENS, cached: int = 0
) -> list[dict[str, Any]]:
    chunks = [
        chunk(
            [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}],
            prompt_token_ids=prompt_ids,
        )
    ]
    for index, token in enumerate(tokens):
        last = index == len(tokens) - 1
        chunks.append(
            chunk(
                [
                    {
                        "index": 0,
                        "delta": {"content": f"t{token}"},
                        "logprobs": {"content": [logprob_entry(token, -0.1 * (index + 1))]},
                        "finish_reason": "length" if last else None,
                        "token_ids": [token],
                    }
                ]
            )
        )
    chunks.append(
        chunk(
            [],
            usage={
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(tokens),
                "total_tokens": len(prompt_ids) + len(tokens),
                "prompt_tokens_details": {"cached_tokens": cached},
            },
        )
    )
    return chunks


def encode(chunks: list[Any], done: bool = True) -> list[bytes]:
    """The events' bytes: JSON chunks (a str is sent as the data itself)."""
    events = [f"data: {c if isinstance(c, str) else json.dumps(c)}\n\n".encode() for c in chunks]
    return events + ([b"data: [DONE]\n\n"] if done else [])


def timed(events: list[bytes]) -> list[tuple[float, bytes]]:
    """Events as the client records them: (seconds since the request, the event without its
    terminating blank line)."""
    return [(0.01 * (n + 1), event.rstrip(b"\n")) for n, event in enumerate(events)]
