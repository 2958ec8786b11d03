"""Recording taps: a transparent reverse proxy on loopback in front of every launched instance.

The transfer guards must hold whichever EPD proxy is under test (the harness's own, or the one
a vLLM release ships), so their evidence is taken where no proxy can hide it: at the instance
boundary. The proxy under test is pointed at the taps' URLs; each tap passes bodies through
byte for byte, both directions, streaming answers chunk by chunk, and records per chat request
what its instance was sent (the media part types, their uuids, `ec_transfer_params`,
`kv_transfer_params`) and what it answered (status, `ec_transfer_params`,
`kv_transfer_params`, `usage`).

All taps of a topology run on one event-loop thread in the harness process, one listening
socket each; the socket a request arrived on names the instance. Records carry a sequence
number: a session sends one request at a time, so the records made while a request was in
flight are that request's evidence, whatever request ids the proxy under test invents. A mark
holds the records from it on until it is released; records older than every open mark are
dropped then (a soak of hours that kept every call grew by ~2.5 KB a call, and by every distinct
medium an encoder was sent, base64 and all, where only one planted fault needs them).

Planted faults (the self-test) can act here too, so a fault needs no cooperation from the
proxy under test: `after_encode` runs when an encoder's answer passes (before the proxy sees
it), `after_prefill` when P's answer passes, and `drop_encoder_metadata` makes the consumer's
taps replace each metadata-only `*_embeds` part by the raw media part an encoder was sent with
the same uuid (the consumer then encodes the media itself), and `duplicate_first_token_chunk`
makes D's (or PD's) tap relay the first event of its stream that carries tokens twice. Only
under a planted fault is a body changed.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from harness.outcomes.taps import TapRecord, records_of
from harness.serve.proxy import (
    FirstTokenChunkTwice,
    ProxyFaults,
    break_off,
    client_gone,
    stop_loop_thread,
)
from harness.serve.proxy_protocol import media_part_type

RECORDED_PATHS = ("/v1/chat/completions", "/v1/completions")
DECODE_ROLES = ("decode", "pd")  # where a client's stream comes from
EMBEDS_PART_TYPES = ("image_embeds", "video_embeds", "audio_embeds")
# Headers that describe one hop, not the message: aiohttp sets its own for the next hop.
HOP_HEADERS = frozenset(
    h.lower()
    for h in (
        "Host",
        "Content-Length",
        "Transfer-Encoding",
        "Connection",
        "Keep-Alive",
        "Proxy-Connection",
        "TE",
        "Trailer",
        "Upgrade",
    )
)
UPSTREAM_TIMEOUT_S = 900.0
CLIENT_KEEPALIVE_S = 3.0  # below vLLM's 5 s idle close (vLLM #41567), as in the proxy
SHUTDOWN_GRACE_S = 1.0
MAX_BODY_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True)
class TapTarget:
    """One instance behind a tap."""

    name: str
    role: str  # Role.value: "encoder", "prefill", "decode", "prefill_decode", ...
    url: str  # the instance's own URL


def is_metadata_only(part: dict[str, Any]) -> bool:
    """An `*_embeds` part carrying the encoder's metadata (a dict), not tensors (a string)."""
    kind = part.get("type")
    return kind in EMBEDS_PART_TYPES and isinstance(part.get(kind), dict)


def describe_request(record: TapRecord, body: Any) -> None:
    """Fill the request side of a record from a parsed chat body."""
    if not isinstance(body, dict):
        return
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict):
                continue
            kind = part.get("type") or media_part_type(part)  # typeless media parts too
            if kind in (None, "text"):
                continue
            record.part_types.append(str(kind))
            record.metadata_only.append(is_metadata_only(part))
            record.uuids.append(part.get("uuid"))
    record.sent_ec_transfer_params = body.get("ec_transfer_params")
    record.sent_kv_transfer_params = body.get("kv_transfer_params")


def describe_answer(record: TapRecord, payload: bytes, content_type: str) -> dict[str, Any] | None:
    """Fill the answer side of a record; returns the parsed JSON answer (None if streamed)."""
    if "text/event-stream" in content_type:
        record.streamed = True
        for line in payload.decode("utf-8", errors="replace").splitlines():
            data = line[len("data:") :].strip() if line.startswith("data:") else ""
            if not data or data == "[DONE]":
                continue
            try:
                chunk = json.loads(data)
            except json.JSONDecodeError:
                continue
            if isinstance(chunk, dict):
                _take_answer_fields(record, chunk)
        return None
    try:
        answer = json.loads(payload)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if isinstance(answer, dict):
        _take_answer_fields(record, answer)
        return answer
    return None


def _take_answer_fields(record: TapRecord, answer: dict[str, Any]) -> None:
    for name in ("ec_transfer_params", "kv_transfer_params", "usage"):
        if answer.get(name):
            setattr(record, name, answer[name])


class TapSet:
    """The taps of one topology: one aiohttp app, one listening socket per instance."""

    def __init__(self, targets: list[TapTarget], faults: ProxyFaults | None = None):
        self.targets = targets
        self.faults = faults or ProxyFaults()
        self.records: list[TapRecord] = []  # from the oldest open mark on (all, if none taken)
        self._open_marks: Counter[int] = Counter()
        # The raw media part each uuid was sent to an encoder with, while drop_encoder_metadata
        # is planted (the consumer's tap puts them back in its place).
        self.raw_parts: dict[str, dict[str, Any]] = {}
        self.urls: dict[str, str] = {}  # instance name -> tap URL
        self._by_port: dict[int, TapTarget] = {}
        self._socks: list[socket.socket] = []
        self._seq = 0
        self._lock = threading.Lock()
        self._session: aiohttp.ClientSession | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, host: str) -> TapSet:
        """Bind one loopback socket per instance (the kernel picks the port: no window between
        choice and bind) and serve them all. A start that fails (or is interrupted) stops
        what it started: the caller never got the object to stop it with."""
        try:
            for target in self.targets:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                self._socks.append(sock)
                sock.bind((host, 0))
                port = sock.getsockname()[1]
                self._by_port[port] = target
                self.urls[target.name] = f"http://{host}:{port}"
            self._thread.start()
            asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        except BaseException:
            self.stop()
            raise
        return self

    async def _start(self) -> None:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        app.on_startup.append(self._open_session)
        app.on_cleanup.append(self._close_session)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S)
        await self._runner.setup()
        for sock in self._socks:
            sock.listen(128)
            await web.SockSite(self._runner, sock).start()

    async def _open_session(self, _app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=UPSTREAM_TIMEOUT_S),
            auto_decompress=False,  # bytes out == bytes in, whatever the encoding
        )

    async def _close_session(self, _app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._loop.is_closed()

    def stop(self) -> None:
        """Stop serving and free the ports; idempotent."""
        stop_loop_thread(self._loop, self._thread, self._runner, self._socks)

    def __enter__(self) -> TapSet:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- records -----------------------------------------------------------------------------

    def mark(self) -> int:
        """A position in the record stream: `since(mark)` gives what was recorded after it,
        until `release(mark)`."""
        with self._lock:
            self._open_marks[self._seq] += 1
            return self._seq

    def release(self, mark: int) -> None:
        """Done with `mark`: the records older than every mark still open are dropped (a call
        still in flight keeps filling its record; nobody reads it from here any more)."""
        with self._lock:
            self._open_marks[mark] -= 1
            if self._open_marks[mark] <= 0:
                del self._open_marks[mark]
            oldest = min(self._open_marks, default=self._seq)
            if self.records and self.records[0].seq < oldest:
                self.records = [r for r in self.records if r.seq >= oldest]

    def since(self, mark: int) -> list[TapRecord]:
        with self._lock:
            return [r for r in self.records if r.seq >= mark]

    def of_request(self, mark: int, request_id: str) -> list[TapRecord]:
        """What the instances received for one client request sent after `mark`."""
        return records_of(self.since(mark), request_id)

    def _new_record(self, target: TapTarget, path: str, request_id: str | None) -> TapRecord:
        with self._lock:
            record = TapRecord(self._seq, target.name, target.role, path, request_id)
            self._seq += 1
            self.records.append(record)
            return record

    # -- forwarding --------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        target = self._by_port.get(sockname[1]) if sockname else None
        if target is None:
            return web.json_response({"error": "tap: unknown listening socket"}, status=500)
        body = await request.read()
        recorded = request.method == "POST" and request.path in RECORDED_PATHS
        record = None
        if recorded:
            record = self._new_record(target, request.path, request.headers.get("x-request-id"))
            body = self._inspect_request(target, record, body)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        started = time.monotonic()
        response: web.StreamResponse | None = None
        try:
            async with self._session.request(
                request.method,
                f"{target.url}{request.path_qs}",
                data=body if body else None,
                headers=headers,
                allow_redirects=False,
            ) as upstream:
                response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
                for key, value in upstream.headers.items():
                    if key.lower() not in HOP_HEADERS:
                        response.headers.add(key, value)
                if upstream.content_length is not None and record is None:
                    response.content_length = upstream.content_length
                if record is None:
                    await response.prepare(request)
                    async for chunk in upstream.content.iter_any():
                        await response.write(chunk)
                    await response.write_eof()
                    return response
                return await self._relay_recorded(request, upstream, response, record, started)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            relaying = response is not None and response.prepared
            if record is not None:
                record.error = f"{type(exc).__name__}: {exc}"
                if relaying and client_gone(request):  # not the instance's failure
                    record.error = f"the client went away mid-stream: {record.error}"
                record.seconds = time.monotonic() - started
            if relaying:
                return break_off(request, response)
            return web.json_response(
                {"error": f"tap for {target.name}: {target.url} unreachable: {exc}"}, status=502
            )

    async def _relay_recorded(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        response: web.StreamResponse,
        record: TapRecord,
        started: float,
    ) -> web.StreamResponse:
        """Relay a chat answer and record it. A streamed answer goes out chunk by chunk as it
        comes; a whole JSON answer is read first, so a fault hook runs before the proxy under
        test sees the answer (the hook stands where a broken transfer would be)."""
        record.status = upstream.status
        content_type = upstream.headers.get("Content-Type", "")
        if "text/event-stream" in content_type:
            kept = bytearray()
            await response.prepare(request)
            fault = None
            if self.faults.duplicate_first_token_chunk and record.role in DECODE_ROLES:
                fault = FirstTokenChunkTwice()
            async for chunk in upstream.content.iter_any():
                kept.extend(chunk)
                await response.write(fault.feed(chunk) if fault else chunk)
            if fault is not None:
                await response.write(fault.flush())
                record.rewritten_by_fault = fault.duplicated is not None
            # Before the stream ends downstream: the session reads the record once it has.
            describe_answer(record, bytes(kept), content_type)
            record.seconds = time.monotonic() - started
            await response.write_eof()
            return response
        payload = await upstream.read()
        answer = describe_answer(record, payload, content_type)
        record.seconds = time.monotonic() - started
        if answer is not None and upstream.status == 200:
            payload = self._run_answer_hooks(record, answer, payload)
        response.content_length = len(payload)
        await response.prepare(request)
        await response.write(payload)
        await response.write_eof()
        return response

    def _inspect_request(self, target: TapTarget, record: TapRecord, body: bytes) -> bytes:
        try:
            parsed = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return body
        describe_request(record, parsed)
        if target.role == "encoder":
            if self.faults.drop_encoder_metadata:
                self._remember_raw_parts(parsed)
            else:
                self.raw_parts.clear()
        elif self.faults.drop_encoder_metadata and any(record.metadata_only):
            return self._restore_raw_parts(record, parsed)
        return body

    def _remember_raw_parts(self, body: dict[str, Any]) -> None:
        for message in body.get("messages") or []:
            for part in message.get("content") or []:
                if media_part_type(part) is not None:
                    if part.get("uuid"):
                        self.raw_parts[str(part["uuid"])] = part

    def _restore_raw_parts(self, record: TapRecord, body: dict[str, Any]) -> bytes:
        """The planted `drop_encoder_metadata`: every metadata-only part the consumer was sent
        becomes the raw media part an encoder got under the same uuid; the EC params go."""
        for message in body.get("messages") or []:
            content = message.get("content")
            if not isinstance(content, list):
                continue
            for index, part in enumerate(content):
                if isinstance(part, dict) and is_metadata_only(part):
                    raw = self.raw_parts.get(str(part.get("uuid")))
                    if raw is not None:
                        content[index] = raw
        body.pop("ec_transfer_params", None)
        record.part_types, record.metadata_only, record.uuids = [], [], []
        describe_request(record, body)  # the record shows what the consumer really got
        record.rewritten_by_fault = True
        return json.dumps(body).encode()

    def _run_answer_hooks(self, record: TapRecord, answer: dict[str, Any], payload: bytes) -> bytes:
        """The planted faults' answer hooks; what the proxy under test receives is the answer
        as a hook left it (P's `kv_transfer_params` misrouted or withheld under NIXL), the
        upstream bytes unchanged when no hook changed it (`ec-video-grid` rewrites the
        encoder's metadata in place the same way)."""
        encoder_hook = record.role == "encoder" and self.faults.after_encode is not None
        prefill_hook = record.role == "prefill" and self.faults.after_prefill is not None
        if not (encoder_hook or prefill_hook):
            return payload
        before = json.dumps(answer, sort_keys=True)
        if encoder_hook:
            self.faults.after_encode(
                record.request_id or "", answer.get("ec_transfer_params") or {}
            )
        if prefill_hook:
            self.faults.after_prefill(record.request_id or "", answer)
        if json.dumps(answer, sort_keys=True) == before:
            return payload
        record.rewritten_by_fault = True
        return json.dumps(answer).encode()
