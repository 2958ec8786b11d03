"""vLLM's real toy proxy (1P+1D), started as a session starts it (`harness.serve.entry`), relays
to P and D straight over loopback whatever the environment's HTTP_PROXY says.

The toy proxy's `httpx.AsyncClient` trusts the environment (trust_env) and, as urllib does on
Linux, bypasses no proxy for 127.0.0.1 unless NO_PROXY names it (the harness's own loopback
calls go direct by design: `harness.serve.http_direct`, `trust_env=False`): on a CI runner with
HTTP_PROXY set and no NO_PROXY, every relayed call went to the runner's proxy and failed. The
proxy file is the 0.32.0 release's own (from its sdist, through the package index once, then
the harness cache); P and D are stubs that answer any chat request.
"""

from __future__ import annotations

import http.server
import json
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.environment import cache_dir
from harness.preflight import upstream_proxy
from harness.serve.entry import start_vllm_proxy
from harness.serve.proxy import ProxyRoutes
from harness.spec.settings import VLLM_PROXY, ProxyChoice
from harness.spec.topology import TOPOLOGIES

pytestmark = pytest.mark.index

RELEASE = "0.32.0"
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
CLOSED_PROXY = "http://127.0.0.1:9"  # discard: nothing listens there


class StubInstance(http.server.BaseHTTPRequestHandler):
    """P or D: any chat request gets one short answer."""

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = json.dumps(
            {
                "id": "chatcmpl-stub",
                "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
                "kv_transfer_params": {"do_remote_prefill": True},
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def stub_urls() -> Iterator[tuple[str, str]]:
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), StubInstance) for _ in "PD"]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        prefill, decode = (f"http://127.0.0.1:{s.server_address[1]}" for s in servers)
        yield prefill, decode
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def test_the_toy_proxy_relays_straight_to_p_and_d_whatever_http_proxy_says(
    stub_urls: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = upstream_proxy.cached_or_fetched(RELEASE, cache_dir())
    # The toy proxy's dependencies (fastapi, uvicorn, httpx) are this environment's too.
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, CLOSED_PROXY)
    choice = ProxyChoice(VLLM_PROXY, files.directory, files.origin, (sys.executable,))
    prefill, decode = stub_urls
    routes = ProxyRoutes(encoder_urls=(), prefill_urls=(prefill,), decode_urls=(decode,))
    server, url = start_vllm_proxy(TOPOLOGIES["1P+1D"], choice, routes, tmp_path, [])
    try:
        request = urllib.request.Request(
            f"{url}/v1/chat/completions",
            data=json.dumps(
                {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            ).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with DIRECT.open(request, timeout=30) as answer:
                status, body = answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            status, body = exc.code, exc.read().decode(errors="replace")
        assert status == 200, f"{status} {body}\n{server.log_tail(20)}"
        assert body["choices"][0]["message"]["content"] == "ok"
    finally:
        server.stop()
