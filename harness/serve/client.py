"""The chat client: sends one rendered request and keeps what a token-level comparison needs.

Requests go out greedy (`temperature 0`, neutral penalties, fixed `seed`) with `logprobs`,
`top_logprobs` and vLLM's `return_token_ids`; `return_tokens_as_token_ids` makes every logprob
entry read `token_id:N`, so the top-k at a divergence is in ids, not in ambiguous decoded
strings.

Requests go out through httpx as rendered, and answers are kept as the server sent them. The
`openai` client stood here for unstreamed requests: its models filled every field an answer left
out with null, its import cost 1.6 CPU-s in every process that opened a client (measured on a
2-core host: each xdist worker, each CLI run), and its connections were kept alive past the 3 s
that vLLM #41567 needs. A body with `stream: true` is read as raw server-sent events (an SSE
reader, the openai one among them, skips what it does not understand): every event is kept with
the seconds since the request left, so its framing can be checked (`harness.outcomes.stream`)
and the time to the first token measured.
"""

from __future__ import annotations

import functools
import ssl
import time
from dataclasses import dataclass
from typing import Any

from harness.outcomes.chat import ChatResult, parse_chat_response
from harness.outcomes.stream import StreamFailed, StreamRecord, parse_stream, split_events

REQUEST_TIMEOUT_S = 300.0
KEEPALIVE_S = 3.0
# No cap on connections: a load's threads (harness.spec.load.MAX_CONCURRENCY) share one client,
# and a cap below theirs would hold requests in the harness, counted as in flight.
MAX_CONNECTIONS: int | None = None
MAX_ERROR_BODY_CHARS = 2000


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """httpx's default verification (its CA bundle, SSL_CERT_FILE / SSL_CERT_DIR), built once
    per process: built per client, TLS contexts cost 0.11 CPU-s a client on a 2-core host, and
    a run opens a client per entry it serves (hundreds in a test session), most of them plain
    HTTP on loopback."""
    import httpx

    return httpx.create_ssl_context()


@dataclass(frozen=True)
class ChatReply:
    """One answer: the result, and for a streamed one how its stream was framed."""

    result: ChatResult
    stream: StreamRecord | None = None


class ChatClient:
    """One server's chat endpoint (a proxy or an instance), over one httpx client that the
    threads of a load share (httpx clients are thread-safe)."""

    def __init__(self, base_url: str, timeout_s: float = REQUEST_TIMEOUT_S):
        import httpx  # imported late: the fast tests of pure logic do not need it

        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        # Idle connections are dropped before a vLLM or uvicorn server's 5 s keep-alive closes
        # them (reusing one it is closing breaks the next request, vLLM #41567).
        limits = httpx.Limits(
            max_connections=MAX_CONNECTIONS,
            max_keepalive_connections=64,
            keepalive_expiry=KEEPALIVE_S,
        )
        # Straight to the server, never through the environment's HTTP(S)_PROXY: httpx follows
        # it and bypasses no loopback address by itself, so on a runner with a proxy set every
        # request to 127.0.0.1 went there and failed (found in review).
        self._http = httpx.Client(
            timeout=timeout_s, limits=limits, verify=_tls_context(), trust_env=False
        )

    def chat(self, body: dict[str, Any], request_id: str | None = None) -> ChatResult:
        return self.send(body, request_id).result

    def send(self, body: dict[str, Any], request_id: str | None = None) -> ChatReply:
        """Send a rendered chat body as-is (streamed when it says `stream: true`). An answer of
        another status than 200 raises `ChatHTTPError`; one that is not JSON, ValueError."""
        if body.get("stream"):
            return self._send_streamed(body, request_id)
        response = self._http.post(self._url, json=body, headers=_headers(request_id))
        if response.status_code != 200:
            raise http_error(response.status_code, response.text)
        return ChatReply(parse_chat_response(response.json()))

    @property
    def _url(self) -> str:
        return f"{self.base_url}/v1/chat/completions"

    def _send_streamed(self, body: dict[str, Any], request_id: str | None) -> ChatReply:
        """POST the body and read its events as they arrive. A non-200 answer raises as an
        unstreamed one does; a stream that reports an error or breaks off raises StreamFailed
        with what was read."""
        import httpx

        started = time.monotonic()
        events: list[tuple[float, bytes]] = []
        with self._http.stream(
            "POST", self._url, json=body, headers=_headers(request_id)
        ) as response:
            if response.status_code != 200:
                text = response.read().decode("utf-8", errors="replace")
                raise http_error(response.status_code, text)
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
        self._http.close()


def _headers(request_id: str | None) -> dict[str, str]:
    return {"x-request-id": request_id} if request_id else {}


class ChatHTTPError(Exception):
    """An answer with another status than 200, its message `Error code: <status> - <body>`
    (what the fuzzer's signatures read the status from)."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"Error code: {status} - {body[:MAX_ERROR_BODY_CHARS]}")
        self.status = status


class RequestRefusedError(ChatHTTPError):
    """A 4xx: the server refused the request, and its body says why (the cause)."""


class ServerFailedError(ChatHTTPError):
    """Any other status (a 5xx): the request failed in the server, whose body or log holds the
    cause; the fuzzer's signatures and an export's headline look past this line for it."""


def http_error(status: int, body: str) -> ChatHTTPError:
    return (RequestRefusedError if 400 <= status < 500 else ServerFailedError)(status, body)
