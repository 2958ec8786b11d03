"""The command that runs vLLM's own proxy (the release's files, see
`harness.preflight.upstream_proxy`) in front of a topology's taps.

Topologies with encoders get `disagg_epd_proxy.py` with static URLs (E+PD without prefill
URLs, E+P+D with them); 1P+1D gets the toy proxy of vLLM's NIXL tests, as upstream's own
correctness script does. It runs with the served vLLM's interpreter (its dependencies are
vLLM's: fastapi, uvicorn, uvloop, msgspec, httpx), bound to loopback, as a managed process
like an instance.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

EPD_PROXY_FILE = "examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py"
TOY_PROXY_FILE = "tests/v1/kv_connector/nixl_integration/toy_proxy_server.py"


@dataclass(frozen=True)
class VllmProxyLaunch:
    argv: tuple[str, ...]
    health_path: str


def vllm_proxy_launch(
    interpreter: tuple[str, ...],
    files_dir: Path,
    host: str,
    port: int,
    encoder_urls: list[str],
    prefill_urls: list[str],
    decode_urls: list[str],
) -> VllmProxyLaunch:
    """argv and health path of the release's proxy for these (tap) URLs."""
    if not decode_urls:
        raise ValueError("vLLM's proxy needs a decode (or PD) URL")
    if encoder_urls:
        argv = [
            *interpreter,
            str(files_dir / EPD_PROXY_FILE),
            "--host",
            host,
            "--port",
            str(port),
            "--encode-servers-urls",
            ",".join(encoder_urls),
            "--prefill-servers-urls",
            ",".join(prefill_urls) if prefill_urls else "none",
            "--decode-servers-urls",
            ",".join(decode_urls),
        ]
        return VllmProxyLaunch(tuple(argv), "/health")
    if not prefill_urls:
        raise ValueError("vLLM ships no proxy for a topology without encoders and prefill")
    argv = [
        *interpreter,
        str(files_dir / TOY_PROXY_FILE),
        "--host",
        host,
        "--port",
        str(port),
        "--prefiller-hosts",
        *(_host(u) for u in prefill_urls),
        "--prefiller-ports",
        *(_port(u) for u in prefill_urls),
        "--decoder-hosts",
        *(_host(u) for u in decode_urls),
        "--decoder-ports",
        *(_port(u) for u in decode_urls),
    ]
    return VllmProxyLaunch(tuple(argv), "/healthcheck")


def _host(url: str) -> str:
    return url.split("://", 1)[-1].rsplit(":", 1)[0]


def _port(url: str) -> str:
    return url.rsplit(":", 1)[-1].rstrip("/")
