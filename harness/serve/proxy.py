"""The EPD proxy: an aiohttp server on 127.0.0.1 that drives encode -> prefill -> decode.

It runs inside the harness process, on its own event-loop thread, so the harness can read the
trace of every request (what each encoder returned, which parts reached the consumer as
metadata-only embeds, what P handed to D): that trace is the evidence that a MATCH is not
vacuous. The protocol itself lives in `harness.serve.proxy_protocol`.

Planted faults (the self-test) enter only through `ProxyFaults`; the default does nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from harness.outcomes.stream import event_data, split_events
from harness.outcomes.trace import EncoderCall, RequestTrace
from harness.serve import proxy_protocol as protocol
from harness.spec.generations import NEWEST, ProtocolGeneration

# vLLM closes idle keep-alive connections after 5 s; reusing one it is closing breaks the
# next request (vLLM #41567), so the proxy drops its own idle connections sooner.
CLIENT_KEEPALIVE_S = 3.0
UPSTREAM_TIMEOUT_S = 600.0
HEALTH_PROBE_TIMEOUT_S = 5.0
# When the proxy stops, requests still in flight get this long, then are cancelled. aiohttp's
# default (60 s) lets one hung instance hold every teardown (and Ctrl-C) for a minute.
SHUTDOWN_GRACE_S = 1.0
STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ProxyRoutes:
    """Where the proxy sends work. Without a prefill URL, decode is a PD instance."""

    encoder_urls: tuple[str, ...] = ()
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.decode_urls:
            raise ValueError("a proxy needs at least one decode (or PD) URL")


@dataclass
class ProxyFaults:
    """Hooks for the self-test: each turns one guard or comparison red on purpose.

    `after_encode` runs after every encoder sub-request has returned and before anything is
    sent downstream (e.g. to corrupt the EC files); `drop_encoder_metadata` makes the proxy
    ignore the encoder's metadata so raw media reach the consumer; `after_prefill` runs after
    P answered (e.g. to zero the KV files).
    """

    after_encode: Callable[[str, dict[str, Any]], None] | None = None
    drop_encoder_metadata: bool = False
    after_prefill: Callable[[str, dict[str, Any]], None] | None = None
    # The decode stream's first event with generated tokens is relayed twice, as a proxy that
    # relays P's first token and then all of D's stream would.
    duplicate_first_token_chunk: bool = False


# How a trace's error begins when the proxy itself failed (no upstream did): a failed request's
# report (`TopologySession.waited_on_report`) then names the proxy, not an instance.
PROXY_FAILED = "proxy failed"


class FirstTokenChunkTwice:
    """Relays a server-sent event stream, its first event carrying generated token ids
    twice (the planted `duplicate_first_token_chunk`); everything else byte for byte."""

    def __init__(self) -> None:
        self._pending = b""
        self._seen = 0  # events relayed so far
        self.duplicated: str | None = None  # what was relayed twice, once it was

    def feed(self, data: bytes) -> bytes:
        if self.duplicated is not None:
            return data
        self._pending += data
        events, rest = split_events(self._pending)
        out = b""
        for event in events:
            self._seen += 1
            out += event + b"\n\n"
            if self.duplicated is None and carries_tokens(event):
                out += event + b"\n\n"
                self.duplicated = f"event {self._seen}: {event[:80]!r}..."
        if self.duplicated is not None:
            self._pending = b""
            return out + rest
        self._pending = rest
        return out

    def flush(self) -> bytes:
        pending, self._pending = self._pending, b""
        return pending


def carries_tokens(event: bytes) -> bool:
    data = event_data(event)
    try:
        chunk = json.loads(data) if data else None
    except json.JSONDecodeError:
        return False
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    # Choices of another shape than vLLM's list (an object, a number) carry no tokens a client
    # reads; relayed as they are, never indexed (an object's [0] raised KeyError mid-relay).
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return False
    return bool(choices[0].get("token_ids"))


class UpstreamError(Exception):
    """An instance answered non-200 or could not be reached; becomes the proxy's reply."""

    def __init__(self, stage: str, url: str, status: int | None, body: str):
        super().__init__(f"{stage} {url} answered {status}: {body[:1000]}")
        self.stage, self.url, self.status, self.body = stage, url, status, body


class EPDProxy:
    """The aiohttp application; one instance per topology run."""

    def __init__(
        self,
        routes: ProxyRoutes,
        faults: ProxyFaults | None = None,
        generation: ProtocolGeneration = NEWEST,
    ):
        self.routes = routes
        self.faults = faults or ProxyFaults()
        self.generation = generation
        self.traces: dict[str, RequestTrace] = {}
        self._encoder_cursor = 0  # persists across requests: round-robin is per proxy
        self._prefill_cycle = itertools.cycle(routes.prefill_urls or (None,))
        self._decode_cycle = itertools.cycle(routes.decode_urls)
        self._session: aiohttp.ClientSession | None = None

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=512 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.handle_chat)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/v1/models", self.handle_models)
        app.on_startup.append(self._open_session)
        app.on_cleanup.append(self._close_session)
        return app

    async def _open_session(self, _app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S)
        timeout = aiohttp.ClientTimeout(total=UPSTREAM_TIMEOUT_S)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)

    async def _close_session(self, _app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    async def _post(self, stage: str, url: str, body: dict, request_id: str) -> dict[str, Any]:
        assert self._session is not None
        try:
            async with self._session.post(
                f"{url}/v1/chat/completions", json=body, headers={"x-request-id": request_id}
            ) as response:
                payload = await response.read()
                text = payload.decode("utf-8", errors="replace")
                if response.status != 200:
                    raise UpstreamError(stage, url, response.status, text)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise UpstreamError(stage, url, None, f"{type(exc).__name__}: {exc}") from exc
        # A 200 whose body is no JSON object is a broken answer of this hop, named as such: read
        # on, it failed later as the proxy's own error (`'list' object has no attribute 'get'`).
        try:
            answer = json.loads(payload)
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            raise UpstreamError(stage, url, 200, f"answer is not JSON ({exc}): {text}") from exc
        if not isinstance(answer, dict):
            raise UpstreamError(stage, url, 200, f"answer is no JSON object: {text}")
        return answer

    async def _encode(
        self, request: dict, media: list[protocol.MediaRef], request_id: str, trace: RequestTrace
    ) -> tuple[dict[int, protocol.EncodedItem], dict[str, Any]]:
        batches, self._encoder_cursor = protocol.plan_encoder_batches(
            media, len(self.routes.encoder_urls), self._encoder_cursor, self.generation
        )

        async def run(n: int, batch: protocol.EncoderBatch):
            url = self.routes.encoder_urls[batch.encoder_index]
            call = EncoderCall(url=url, positions=batch.positions)
            trace.encoder_calls.append(call)
            started = time.monotonic()
            body = protocol.build_encoder_request(request, media, batch, self.generation)
            response = await self._post("encoder", url, body, f"{request_id}:{n}:encode")
            call.seconds = time.monotonic() - started
            call.status = 200
            call.ec_transfer_params = params = response.get("ec_transfer_params")
            # No generation answers them as anything but an object: read on, they failed as
            # the proxy's own error (`'list' object has no attribute 'get'`).
            if params is not None and not isinstance(params, dict):
                raise UpstreamError(
                    "encoder", url, 200, f"ec_transfer_params are no JSON object: {params!r:.300}"
                )
            return batch, call

        sub_requests = [asyncio.ensure_future(run(n, b)) for n, b in enumerate(batches)]
        try:
            results = await asyncio.gather(*sub_requests)
        except BaseException:
            # One sub-request failed and the case ends with it: the others are let go of (their
            # connections closed, as an engine sees an abandoned request), not left running into
            # the next case's window.
            for sub_request in sub_requests:
                sub_request.cancel()
            await asyncio.gather(*sub_requests, return_exceptions=True)
            raise
        merged = protocol.merge_encoder_params(
            [call.ec_transfer_params for _, call in results], self.generation
        )
        # Before the answers are read: a planted fault that rewrites an entry in place (the
        # merge keeps the entries themselves) must reach what the consumer is told.
        if self.faults.after_encode is not None:
            self.faults.after_encode(request_id, merged)
        encoded: dict[int, protocol.EncodedItem] = {}
        for batch, call in results:
            try:
                items = protocol.index_encoder_response(
                    batch, call.ec_transfer_params, self.generation
                )
            except protocol.EncoderAnswerUnfit as exc:
                raise UpstreamError("encoder", call.url, 200, str(exc)) from exc
            call.indexed = {position: item.mm_hash for position, item in items.items()}
            encoded.update(items)
        if self.faults.drop_encoder_metadata:
            return {}, {}
        return encoded, merged

    async def handle_chat(self, http_request: web.Request) -> web.StreamResponse:
        request_id = http_request.headers.get("x-request-id") or f"epd-{uuid.uuid4().hex}"
        trace = RequestTrace(request_id=request_id)
        self.traces[request_id] = trace
        try:
            request = await http_request.json()
        except json.JSONDecodeError as exc:
            trace.error = f"request body is not JSON: {exc}"
            return web.json_response({"error": trace.error}, status=400)
        try:
            body = await self._route(request, request_id, trace)
            decode_url = next(self._decode_cycle)
            trace.decode_url = decode_url
            return await self._forward_decode(http_request, decode_url, body, request_id, trace)
        except UpstreamError as exc:
            trace.error = str(exc)
            return web.json_response(
                {
                    "error": {
                        "stage": exc.stage,
                        "url": exc.url,
                        "status": exc.status,
                        "message": exc.body[:2000],
                    }
                },
                status=502,
            )
        except Exception as exc:
            # The proxy's own failure (e.g. an encoder answer of another protocol generation):
            # recorded with its cause, or the case's error would be an empty 500.
            trace.error = f"{PROXY_FAILED}: {type(exc).__name__}: {exc}"
            return web.json_response(
                {"error": {"stage": "proxy", "message": trace.error}}, status=500
            )

    async def _route(self, request: dict, request_id: str, trace: RequestTrace) -> dict:
        media = protocol.collect_media(request)
        trace.media_count = len(media)
        encoded: dict[int, protocol.EncodedItem] = {}
        ec_params: dict[str, Any] = {}
        if media and self.routes.encoder_urls:
            encoded, ec_params = await self._encode(request, media, request_id, trace)
        rewrite = protocol.rewrite_for_consumer(request, media, encoded, ec_params, self.generation)
        trace.forwarded_part_types = rewrite.forwarded_part_types
        trace.metadata_only = rewrite.metadata_only
        prefill_url = next(self._prefill_cycle)
        prefill_response = None
        if prefill_url is not None:
            trace.prefill_url = prefill_url
            started = time.monotonic()
            prefill_response = await self._post(
                "prefill", prefill_url, protocol.build_prefill_request(rewrite.body), request_id
            )
            trace.prefill_seconds = time.monotonic() - started
            trace.prefill_status = 200
            kv_params = prefill_response.get("kv_transfer_params")
            trace.prefill_kv_transfer_params = kv_params
            # No KV coordinates: handed on, they failed as D's refusal of its request.
            if kv_params is not None and not isinstance(kv_params, dict):
                raise UpstreamError(
                    "prefill",
                    prefill_url,
                    200,
                    f"kv_transfer_params are no JSON object: {kv_params!r:.300}",
                )
            if self.faults.after_prefill is not None:
                self.faults.after_prefill(request_id, prefill_response)
        return protocol.build_decode_request(rewrite.body, prefill_response)

    async def _forward_decode(
        self,
        http_request: web.Request,
        url: str,
        body: dict,
        request_id: str,
        trace: RequestTrace,
    ) -> web.StreamResponse:
        assert self._session is not None
        started = time.monotonic()
        response: web.StreamResponse | None = None
        try:
            async with self._session.post(
                f"{url}/v1/chat/completions", json=body, headers={"x-request-id": request_id}
            ) as upstream:
                trace.decode_status = upstream.status
                # A refusal of a streamed request is one error body, kept as an unstreamed one's.
                if not body.get("stream") or upstream.status != 200:
                    payload = await upstream.read()
                    trace.decode_seconds = time.monotonic() - started
                    if upstream.status != 200:
                        trace.error = f"decode {url} answered {upstream.status}: {payload[:1000]!r}"
                    return web.Response(
                        body=payload, status=upstream.status, headers=content_type_of(upstream)
                    )
                response = web.StreamResponse(
                    status=upstream.status, headers=content_type_of(upstream)
                )
                await response.prepare(http_request)
                fault = FirstTokenChunkTwice() if self.faults.duplicate_first_token_chunk else None
                async for chunk in upstream.content.iter_any():
                    await response.write(fault.feed(chunk) if fault else chunk)
                if fault is not None:
                    await response.write(fault.flush())
                    trace.fault_effects.append(f"relayed twice: {fault.duplicated}")
                # Before the stream ends downstream: a failed request's report reads it then.
                trace.decode_seconds = time.monotonic() - started
                await response.write_eof()
                return response
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            if response is not None and response.prepared:
                who = (
                    "the client went away"
                    if client_gone(http_request)
                    else f"decode {url} broke off"
                )
                trace.error = f"{who} mid-stream: {type(exc).__name__}: {exc}"
                return break_off(http_request, response)
            raise UpstreamError("decode", url, None, f"{type(exc).__name__}: {exc}") from exc
        except Exception as exc:
            if response is None or not response.prepared:
                raise  # `handle_chat` answers the proxy's own failure as a 500
            # The proxy's own failure once the stream began: a 500 in its place would be a
            # second response written into the open one (found in review).
            trace.error = f"{PROXY_FAILED} mid-stream: {type(exc).__name__}: {exc}"
            return break_off(http_request, response)

    async def handle_health(self, _request: web.Request) -> web.Response:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=HEALTH_PROBE_TIMEOUT_S)

        async def probe(url: str) -> bool:
            try:
                async with self._session.get(f"{url}/health", timeout=timeout) as response:
                    return response.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return False

        urls = [*self.routes.encoder_urls, *self.routes.prefill_urls, *self.routes.decode_urls]
        healthy = await asyncio.gather(*(probe(u) for u in urls))
        status = dict(zip(urls, healthy))
        return web.json_response({"instances": status}, status=200 if all(healthy) else 503)

    async def handle_models(self, _request: web.Request) -> web.Response:
        assert self._session is not None
        url = self.routes.decode_urls[0]
        try:
            async with self._session.get(f"{url}/v1/models") as upstream:
                payload = await upstream.read()
                return web.Response(
                    body=payload, status=upstream.status, content_type="application/json"
                )
        except aiohttp.ClientError as exc:
            return web.json_response({"error": f"decode {url}: {exc}"}, status=502)


def content_type_of(upstream: aiohttp.ClientResponse) -> dict[str, str]:
    """D's Content-Type as D sent it (charset and all; an error of its HTTP server may be plain
    text): the client is to see D's answer, not the proxy's idea of it."""
    return {"Content-Type": upstream.headers.get("Content-Type", "application/json")}


def client_gone(request: web.Request) -> bool:
    """Whether the client of a relayed answer has gone away (a write to it then fails, and
    that failure is the client's, not the upstream's)."""
    return request.transport is None or request.transport.is_closing()


def break_off(request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
    """End a relayed answer whose upstream failed after it began: its connection is dropped, so
    the client sees the stream break off as the upstream's did. An error response in its place
    would be written into the open stream, where the next hop (the proxy behind a tap) waits for
    the rest of it until its request times out."""
    if request.transport is not None:
        request.transport.close()
    return response


class ProxyServer:
    """Runs an EPDProxy on a background event-loop thread, on a socket the caller bound.

    Taking an already-bound socket (from the port lease) leaves no window in which another
    process could take the port between choosing it and serving on it.
    """

    def __init__(self, proxy: EPDProxy, sock: socket.socket):
        self.proxy = proxy
        self._sock = sock
        host, port = sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    def start(self) -> ProxyServer:
        """Serve; a start that fails (or is interrupted) stops what it started, since the
        caller never got a running object to stop."""
        try:
            self._thread.start()
            asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        except BaseException:
            self.stop()
            raise
        return self

    async def _start(self) -> None:
        self._runner = web.AppRunner(
            self.proxy.make_app(), access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S
        )
        await self._runner.setup()
        self._sock.listen(128)
        await web.SockSite(self._runner, self._sock).start()

    @property
    def running(self) -> bool:
        """False once stopped, or when the event loop died (then nothing serves the port)."""
        return self._thread.is_alive() and not self._loop.is_closed()

    def stop(self) -> None:
        """Stop serving and free the port; idempotent.

        If the event loop died without cleanup, nothing will ever run it again: its loop and
        listening socket are closed here all the same (closing the listener also drops the
        connections queued on it), or the port would stay bound until garbage collection.
        """
        stop_loop_thread(self._loop, self._thread, self._runner, [self._sock])

    def __enter__(self) -> ProxyServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def stop_loop_thread(
    loop: asyncio.AbstractEventLoop,
    thread: threading.Thread,
    runner: web.AppRunner | None,
    socks: list[socket.socket],
) -> None:
    """Stop an aiohttp app served by `runner` on `loop` in `thread`, then free its sockets;
    idempotent. A loop that died without cleanup is closed all the same (closing a listener
    also drops the connections queued on it), or its ports would stay bound until garbage
    collection. The proxy and the taps both stop through here."""
    if loop.is_closed():
        return
    try:
        if thread.is_alive():
            if runner is not None:
                cleanup = asyncio.run_coroutine_threadsafe(runner.cleanup(), loop)
                cleanup.result(timeout=STOP_TIMEOUT_S)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=STOP_TIMEOUT_S)
    finally:
        if not loop.is_running():
            loop.close()
        for sock in socks:
            sock.close()
