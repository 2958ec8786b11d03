"""A vLLM instance stand-in inside the test's own process, for tests of the proxy and the taps.

`FakeInstance` is a small aiohttp app on 127.0.0.1 (port 0): it keeps every request it is sent
(the exact bytes, the parsed body, the x-request-id) and answers what the test's `answer`
function returns for the body. The fakes run on a `LoopThread`, so the test thread can talk to
them (and to a proxy in front of them) over real HTTP::

    loop = LoopThread()
    decode = FakeInstance(lambda body: {"choices": []}, name="decode")
    loop.run(decode.start())
    ...  # send to decode.url; then read decode.bodies
    loop.run(decode.stop()); loop.close()

For a whole `vllm serve` process (the launcher, the watchdog, chaos) use
`harness.testing.fake_vllm` instead.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from aiohttp import web


@dataclass(frozen=True)
class Reply:
    """What a fake instance answers: JSON bytes exactly as given, a JSON object, or the chunks
    of an event stream (written with `chunk_delay_s` after each; with `break_after`, the
    connection drops before that chunk, as a dying instance's does mid-stream)."""

    body: bytes | dict[str, Any] | list[bytes]
    status: int = 200
    chunk_delay_s: float = 0.0
    break_after: int | None = None
    content_type: str | None = None  # default: application/json, or text/event-stream


# The request body (parsed) -> the reply; a dict or bytes stands for Reply(that).
Answer = Callable[[dict[str, Any]], Reply | dict[str, Any] | bytes]


class LoopThread:
    """One asyncio event loop on a daemon thread, for fake servers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


class FakeInstance:
    """Serves POST /v1/chat/completions with `answer(body)` and GET /health with 200.

    `events`, when given (shared by several fakes), gets `(name, url)` at each request: the
    order in which the fakes were reached.
    """

    def __init__(
        self, answer: Answer, name: str = "", events: list[tuple[str, str]] | None = None
    ) -> None:
        self.answer = answer
        self.name = name
        self.events = events
        self.received: list[bytes] = []  # exact bytes, in arrival order
        self.bodies: list[dict[str, Any]] = []  # the same, parsed
        self.request_ids: list[str | None] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        await web.SockSite(self._runner, sock).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw)
        self.received.append(raw)
        self.bodies.append(body)
        self.request_ids.append(request.headers.get("x-request-id"))
        if self.events is not None:
            self.events.append((self.name, self.url))
        reply = self.answer(body)
        if not isinstance(reply, Reply):
            reply = Reply(reply)
        if isinstance(reply.body, bytes):
            content_type = reply.content_type or "application/json"
            return web.Response(
                body=reply.body, status=reply.status, headers={"Content-Type": content_type}
            )
        if isinstance(reply.body, dict):
            return web.json_response(reply.body, status=reply.status)
        response = web.StreamResponse(
            status=reply.status,
            headers={"Content-Type": reply.content_type or "text/event-stream"},
        )
        await response.prepare(request)
        for index, chunk in enumerate(reply.body):
            if index == reply.break_after:
                request.transport.close()
                return response
            await response.write(chunk)
            if reply.chunk_delay_s:
                await asyncio.sleep(reply.chunk_delay_s)
        await response.write_eof()
        return response
