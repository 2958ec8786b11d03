"""The command that runs vLLM's own proxy (the release's files, see
`harness.preflight.upstream_proxy`) in front of a topology's taps.

Topologies with encoders get `disagg_epd_proxy.py`, either with static URLs (E+PD without
prefill URLs, E+P+D with them) or, with dynamic registration, with none: it starts empty and
each instance is registered through its `/instances` admin API, as an external launcher (e.g.
Kubernetes) would do. 1P+1D gets the toy proxy of vLLM's NIXL tests, as upstream's own
correctness script does; it knows only static URLs. It runs with the served vLLM's interpreter (its
dependencies are vLLM's: fastapi, uvicorn, uvloop, msgspec, httpx), bound to loopback, as a managed
process like an instance.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from harness.serve.http_direct import DIRECT_OPENER

EPD_PROXY_FILE = "examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py"
TOY_PROXY_FILE = "tests/v1/kv_connector/nixl_integration/toy_proxy_server.py"
DYNAMIC_REGISTRATION_FLAG = "--dynamic-registration"
ADMIN_KEY_ENV = "ADMIN_API_KEY"  # the proxy refuses --dynamic-registration without it
ADMIN_KEY_HEADER = "x-api-key"
INSTANCES_PATH = "/instances"
REGISTRATION_TIMEOUT_S = 10.0
# --prefill-servers-urls for E+PD: upstream's spelling (every release's proxy also takes "none").
NO_PREFILL = "disable"
# The proxy's own calls to the instances must go direct too, as the harness's own admin calls
# do (`harness.serve.http_direct`): the toy proxy's httpx clients trust the environment and
# bypass no proxy for 127.0.0.1 by themselves, so a runner's HTTP_PROXY relayed every call to
# P and D and failed. Both spellings are read
# (urllib's getproxies: the lower-case one wins); each keeps what the environment names.
NO_PROXY_VARS = ("NO_PROXY", "no_proxy")
LOOPBACK_NAMES = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class VllmProxyLaunch:
    argv: tuple[str, ...]
    health_path: str
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Registration:
    """One instance as the proxy's admin API takes it: `disagg_epd_proxy.InstanceRole`."""

    role: str  # "encode", "prefill", "decode" or "prefill_decode"
    url: str


def vllm_proxy_launch(
    interpreter: tuple[str, ...],
    files_dir: Path,
    host: str,
    port: int,
    encoder_urls: list[str],
    prefill_urls: list[str],
    decode_urls: list[str],
    admin_key: str | None = None,
) -> VllmProxyLaunch:
    """argv, health path and environment of the release's proxy for these (tap) URLs.

    With `admin_key` the EPD proxy starts with dynamic registration and no URLs (the caller
    registers `registrations(...)` once it answers); the toy proxy has no such mode.
    """
    if not decode_urls:
        raise ValueError("vLLM's proxy needs a decode (or PD) URL")
    direct = ",".join(
        dict.fromkeys([*LOOPBACK_NAMES, *map(_host, [*encoder_urls, *prefill_urls, *decode_urls])])
    )
    bypass = {name: direct for name in NO_PROXY_VARS}
    if encoder_urls:
        argv = [*interpreter, str(files_dir / EPD_PROXY_FILE), "--host", host, "--port", str(port)]
        if admin_key is not None:
            argv.append(DYNAMIC_REGISTRATION_FLAG)
            return VllmProxyLaunch(tuple(argv), "/health", {**bypass, ADMIN_KEY_ENV: admin_key})
        argv += [
            "--encode-servers-urls",
            ",".join(encoder_urls),
            "--prefill-servers-urls",
            ",".join(prefill_urls) if prefill_urls else NO_PREFILL,
            "--decode-servers-urls",
            ",".join(decode_urls),
        ]
        return VllmProxyLaunch(tuple(argv), "/health", bypass)
    if admin_key is not None:
        raise ValueError("the toy proxy (1P+1D) has no dynamic registration")
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
    return VllmProxyLaunch(tuple(argv), "/healthcheck", bypass)


def with_inherited_bypass(env: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """`env` with each NO_PROXY variable it sets appended to the environment's own list, never
    replacing it (the environment's hosts still bypass the proxy too)."""
    merged = dict(env)
    for name in NO_PROXY_VARS:
        if name in merged and environ.get(name):
            merged[name] = f"{environ[name]},{merged[name]}"
    return merged


def _host(url: str) -> str:
    return url.split("://", 1)[-1].rsplit(":", 1)[0]


def _port(url: str) -> str:
    return url.rsplit(":", 1)[-1].rstrip("/")


def registrations(
    encoder_urls: list[str], prefill_urls: list[str], decode_urls: list[str]
) -> list[Registration]:
    """What to register, in the proxy's roles: without prefill URLs decode is a PD instance."""
    consumer_role = "decode" if prefill_urls else "prefill_decode"
    return [
        *(Registration("encode", url) for url in encoder_urls),
        *(Registration("prefill", url) for url in prefill_urls),
        *(Registration(consumer_role, url) for url in decode_urls),
    ]


def register_instances(
    proxy_url: str, admin_key: str, wanted: list[Registration]
) -> dict[str, object]:
    """POST each instance to the proxy's admin API, then read its roster back.

    Returns the roster (`GET /instances`). Raises RuntimeError naming the instance whose
    registration the proxy refused, or the instances its roster does not show live: a proxy
    that routes to fewer instances than the topology has would be judged on something else.
    """
    for item in wanted:
        body = json.dumps({"role": item.role, "url": item.url}).encode()
        request = urllib.request.Request(
            f"{proxy_url}{INSTANCES_PATH}",
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", ADMIN_KEY_HEADER: admin_key},
        )
        try:
            with DIRECT_OPENER.open(request, timeout=REGISTRATION_TIMEOUT_S) as answer:
                answer.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            raise RuntimeError(
                f"vLLM's proxy refused to register {item.role} {item.url}: {exc.code} {detail}"
            ) from exc
    with DIRECT_OPENER.open(
        f"{proxy_url}{INSTANCES_PATH}", timeout=REGISTRATION_TIMEOUT_S
    ) as answer:
        roster = json.loads(answer.read())
    missing = [
        f"{item.role} {item.url}"
        for item in wanted
        if item.url not in roster.get(item.role, {}).get("live", [])
    ]
    if missing:
        raise RuntimeError(
            f"vLLM's proxy does not list as live: {', '.join(missing)} (roster: {roster})"
        )
    return roster
