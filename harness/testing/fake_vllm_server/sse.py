"""An answer of the fake as the server-sent events vLLM 0.32 streams for a `stream: true` body,
so the streamed scenarios (scenarios/test_stream.py) pass or fail on the fake for the reasons
they do on vLLM: the events are built here from the unstreamed answer, and the handler
(`handlers`) only paces them.
"""

from __future__ import annotations

import json

SSE_DONE = b"data: [DONE]\n\n"  # the end of every OpenAI-style stream


def sse_event(payload: dict) -> bytes:
    """One server-sent event carrying `payload` as JSON, as vLLM frames each chunk."""
    return f"data: {json.dumps(payload)}\n\n".encode()


def engine_dead_events(error: dict) -> list[bytes]:
    """What a streamed request gets when the engine dies under it, as vLLM 0.32 sends it
    (`chat_completion_stream_generator` in vllm/entrypoints/openai/chat_completion/serving.py):
    the frontend answered 200 before the engine ran the request (`create_chat_completion`
    returns the generator, which StreamingResponse starts sending), so the EngineDeadError the
    generator meets is one event, `create_streaming_error_response`'s ErrorResponse (the JSON an
    unstreamed request gets with its 500), then `[DONE]`. The engine died before its first
    output, so no role chunk precedes it."""
    return [sse_event(error), SSE_DONE]


def stream_events(answer: dict, body: dict) -> list[bytes]:
    """`answer` (what `Engine.chat` answers unstreamed) as the server-sent events vLLM 0.32
    streams for a `stream: true` body (`chat_completion_stream_generator` in
    vllm/entrypoints/openai/chat_completion/serving.py, each chunk dumped with
    `exclude_unset`): a role chunk (with `prompt_token_ids` under `return_token_ids`), one
    chunk per generated token (its `token_ids` and log-prob entry; the last with
    `finish_reason` and `stop_reason`), under `stream_options.include_usage` a usage chunk
    without choices (dumped `exclude_none` too), then `[DONE]`. The fake has no detokenizer:
    its text, "fake", rides on the first token's chunk."""
    [choice] = answer["choices"]
    head = {
        "id": answer["id"],
        "object": "chat.completion.chunk",
        "created": answer["created"],
        "model": answer["model"],
    }
    return_ids = bool(body.get("return_token_ids"))
    chunks: list[dict] = [
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
            "prompt_token_ids": answer["prompt_token_ids"] if return_ids else None,
            "prompt_text": None,
        }
    ]
    ids = choice["token_ids"]
    entries = choice["logprobs"]["content"]
    for index, token in enumerate(ids):
        last = index == len(ids) - 1
        streamed: dict = {
            "index": 0,
            "delta": {"content": choice["message"]["content"] if index == 0 else ""},
            "logprobs": {"content": [entries[index]]} if body.get("logprobs") else None,
            "finish_reason": choice["finish_reason"] if last else None,
        }
        if last:
            streamed["stop_reason"] = None
        streamed["token_ids"] = [token] if return_ids else None
        chunks.append({**head, "choices": [streamed]})
    if (body.get("stream_options") or {}).get("include_usage"):
        chunks.append({**head, "choices": [], "usage": answer["usage"]})
    return [sse_event(chunk) for chunk in chunks] + [SSE_DONE]
