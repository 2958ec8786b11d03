"""The chat client: sends one rendered request and keeps what a token-level comparison needs.

Requests go out greedy (`temperature 0`, fixed `seed`) with `logprobs`, `top_logprobs` and
vLLM's `return_token_ids`; `return_tokens_as_token_ids` makes every logprob entry read
`token_id:N`, so the top-k at a divergence is in ids, not in ambiguous decoded strings.
"""

from __future__ import annotations

import copy
from typing import Any

from harness.outcomes.chat import ChatResult, parse_chat_response

REQUEST_TIMEOUT_S = 300.0


class ChatClient:
    """Thin wrapper over the `openai` client pointed at one server (a proxy or an instance)."""

    def __init__(self, base_url: str, timeout_s: float = REQUEST_TIMEOUT_S):
        import openai  # imported late: the fast tests of pure logic do not need it

        self.base_url = base_url.rstrip("/")
        self._client = openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key="EMPTY", timeout=timeout_s, max_retries=0
        )

    def chat(self, body: dict[str, Any], request_id: str | None = None) -> ChatResult:
        """Send a rendered chat body as-is; vLLM-only fields travel in `extra_body`."""
        body = copy.deepcopy(body)
        standard = {
            key: body.pop(key)
            for key in (
                "model",
                "messages",
                "temperature",
                "seed",
                "max_tokens",
                "logprobs",
                "top_logprobs",
                "stream",
            )
            if key in body
        }
        headers = {"x-request-id": request_id} if request_id else None
        response = self._client.chat.completions.create(
            **standard, extra_body=body or None, extra_headers=headers
        )
        return parse_chat_response(response.model_dump())

    def close(self) -> None:
        self._client.close()
