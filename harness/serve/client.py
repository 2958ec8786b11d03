"""The chat client: sends one rendered request and keeps what a token-level comparison needs.

Requests go out greedy (`temperature 0`, neutral penalties, fixed `seed`) with `logprobs`,
`top_logprobs` and vLLM's `return_token_ids`; `return_tokens_as_token_ids` makes every logprob
entry read `token_id:N`, so the top-k at a divergence is in ids, not in ambiguous decoded
strings.

A body with `stream: true` is read as raw server-sent events (httpx, not the `openai` client,
whose stream reader skips what it does not understand): every event is kept with the seconds
since the request left, so its framing can be checked (`harness.outcomes.stream`) and the time
to the first token measured.
"""

from __future__ import annotations

import copy
import functools
import ssl
import time
from dataclasses import dataclass
from typing import Any

from harness.outcomes.chat import ChatResult, parse_chat_response
from harness.outcomes.stream import StreamFailed, StreamRecord, parse_stream, split_events

REQUEST_TIMEOUT_S = 300.0
KEEPALIVE_S = 3.0


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """httpx's default verification (its CA bundle, SSL_CERT_FILE / SSL_CERT_DIR), built once
    per process: each client built its own, two per ChatClient, 0.11 CPU-s on a 2-core host,
    and a run opens a client per entry it serves (hundreds in a test session), most of them
    plain HTTP on loopback."""
    import httpx

    return httpx.create_ssl_context()


@dataclass(frozen=True)
class ChatReply:
    """One answer: the result, and for a streamed one how its stream was framed."""

    result: ChatResult
    stream: StreamRecord | None = None


class ChatClient:
    """Thin wrapper over the `openai` client pointed at one server (a proxy or an instance)."""

    def __init__(self, base_url: str, timeout_s: float = REQUEST_TIMEOUT_S):
        import httpx  # imported late: the fast tests of pure logic do not need them
        import openai

        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._client = openai.OpenAI(
            base_url=f"{self.base_url}/v1",
            api_key="EMPTY",
            timeout=timeout_s,
            max_retries=0,
            http_client=openai.DefaultHttpxClient(verify=_tls_context()),
        )
        # Streams; shared by the threads of a load (httpx clients are thread-safe). Idle
        # connections are dropped before a vLLM or uvicorn server's 5 s keep-alive closes them
        # (reusing one it is closing breaks the next request, vLLM #41567).
        limits = httpx.Limits(
            max_connections=None, max_keepalive_connections=64, keepalive_expiry=KEEPALIVE_S
        )
        self._http = httpx.Client(timeout=timeout_s, limits=limits, verify=_tls_context())

    def chat(self, body: dict[str, Any], request_id: str | None = None) -> ChatResult:
        return self.send(body, request_id).result

    def send(self, body: dict[str, Any], request_id: str | None = None) -> ChatReply:
        """Send a rendered chat body as-is (streamed when it says `stream: true`)."""
        if body.get("stream"):
            return self._send_streamed(body, request_id)
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
        return ChatReply(parse_chat_response(response.model_dump()))

    def _send_streamed(self, body: dict[str, Any], request_id: str | None) -> ChatReply:
        """POST the body and read its events as they arrive. A non-200 answer raises like the
        openai client's errors do (its status and body in the message); a stream that reports
        an error or breaks off raises StreamFailed with what was read."""
        import httpx

        headers = {"x-request-id": request_id} if request_id else {}
        started = time.monotonic()
        events: list[tuple[float, bytes]] = []
        with self._http.stream(
            "POST", f"{self.base_url}/v1/chat/completions", json=body, headers=headers
        ) as response:
            if response.status_code != 200:
                text = response.read().decode("utf-8", errors="replace")
                raise StreamHTTPError(f"Error code: {response.status_code} - {text[:2000]}")
            content_type = response.headers.get("content-type", "")
            buffer = b""
            complete = True
            try:
                for data in response.iter_bytes():
                    buffer += data
                    done, buffer = split_events(buffer)
                    now = time.monotonic() - started
                    events += [(now, event) for event in done]
            except httpx.HTTPError as exc:
                complete = False
                broke = f"{type(exc).__name__}: {exc}"
            unterminated = bool(buffer.strip())
            if unterminated:
                events.append((time.monotonic() - started, buffer))
        try:
            result, record = parse_stream(events, content_type, complete, unterminated)
        except StreamFailed as exc:
            if not complete:
                raise StreamFailed(f"{exc} ({broke})", exc.record) from None
            raise
        return ChatReply(result, record)

    def close(self) -> None:
        self._client.close()
        self._http.close()


class StreamHTTPError(Exception):
    """A streamed request answered with another status than 200."""
