"""The harness's own HTTP calls to the servers it runs or attaches to go straight to them,
whatever the environment's HTTP_PROXY says.

urllib's default opener and an httpx client both follow HTTP(S)_PROXY / ALL_PROXY and, on
Linux, bypass nothing by themselves, not even 127.0.0.1, unless NO_PROXY names it: on a CI
runner with a proxy set, a call that honoured it went to the runner's proxy and failed. Each
test sets HTTP_PROXY to a port nothing listens on and asks a stand-in server on loopback; a
call through the proxy fails with a refused connection there, a direct one is answered.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from tests.test_chat_client import ANSWER as CHAT_ANSWER

pytestmark = pytest.mark.process

DEAD_PROXY = "http://127.0.0.1:9"  # discard: nothing listens there
BLOCK = b"\x01" * 64  # what the stand-in P's side channel serves for a NIXL read


class StandIn:
    """A loopback server that answers every GET with a 200 page and every POST with a chat
    answer, and counts the requests it was asked."""

    def __init__(self) -> None:
        owner = self
        self.asked: list[str] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *_args: object) -> None:
                pass

            def answer(self, body: bytes, content_type: str) -> None:
                owner.asked.append(f"{self.command} {self.path}")
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self.answer(BLOCK, "application/octet-stream")

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                self.answer(json.dumps(CHAT_ANSWER).encode(), "application/json")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.host, self.port = self.server.server_address[:2]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[StandIn]:
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, DEAD_PROXY)
    server = StandIn()
    yield server
    server.close()


def test_the_chat_client_goes_straight_to_the_server(stand_in: StandIn) -> None:
    from harness.serve.client import ChatClient

    client = ChatClient(stand_in.url, timeout_s=10)
    try:
        result = client.chat({"model": "epd-model", "messages": []})
    finally:
        client.close()
    assert list(result.token_ids) == [7, 8]
    assert stand_in.asked == ["POST /v1/chat/completions"]


def test_the_fake_decodes_nixl_read_goes_straight_to_the_fake_prefill(stand_in: StandIn) -> None:
    """The fake vLLM's D reads P's blocks over HTTP, as a stand-in for NIXL: through a proxy
    the read failed and D recomputed, so a fake topology's transfer counters read nothing."""
    from harness.testing.fake_vllm_server.engine import Engine

    counted: dict[str, float] = {}
    decode = SimpleNamespace(block_size=16, count=lambda **more: counted.update(more))
    params = {
        "do_remote_prefill": True,
        "remote_block_ids": [[0]],
        "remote_host": stand_in.host,
        "remote_port": stand_in.port,
        "remote_request_id": "r1",
    }
    Engine.read_remote_blocks(decode, params, prompt_tokens=16)  # type: ignore[arg-type]
    assert "nixl_failed" not in counted, counted
    assert counted["nixl_transfers"] == 1
    assert stand_in.asked == ["GET /read?request=r1&blocks=0"]


def test_a_launched_servers_health_probe_goes_straight_to_it(stand_in: StandIn) -> None:
    from harness.serve.launch import health_probe_failure

    assert health_probe_failure(f"{stand_in.url}/health") is None


def test_an_attached_instances_health_goes_straight_to_it(stand_in: StandIn) -> None:
    from harness.serve.attached import health_problem

    assert health_problem(f"{stand_in.url}/health") is None


def test_an_instances_metrics_page_is_read_straight_from_it(stand_in: StandIn) -> None:
    from harness.serve.kv_metrics import metrics_page

    assert metrics_page(stand_in.url) is not None
    assert stand_in.asked == ["GET /metrics"]


def test_the_direct_opener_ignores_a_proxy_the_environment_had_when_the_harness_started(
    stand_in: StandIn,
) -> None:
    """The opener is built once, at import: a runner's HTTP_PROXY is in the environment by
    then, unlike the tests above, which set it after the harness was imported (a default
    urllib opener reads the environment's proxies when it is built). Found in review: a mutant
    that built the opener with urllib's default handlers survived every test."""
    import importlib
    import urllib.request

    from harness.serve import http_direct

    opener = importlib.reload(http_direct).DIRECT_OPENER  # built under DEAD_PROXY
    with opener.open(f"{stand_in.url}/metrics", timeout=10) as reply:
        assert reply.status == 200
    assert stand_in.asked == ["GET /metrics"]
    # An empty ProxyHandler opens nothing, so urllib keeps none: no handler sends elsewhere.
    proxied = [h.proxies for h in opener.handlers if isinstance(h, urllib.request.ProxyHandler)]
    assert proxied == [], proxied
