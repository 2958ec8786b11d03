"""vLLM's own proxy in an export, pointed straight at the instances.

Upstream's proxy is shipped beside the scripts (unmodified, its Apache-2.0 header intact, its
sha256 recorded and checked by serve.sh before it runs) rather than fetched by them: the export
then reproduces offline, with the very bytes that ran, whatever happens to the package index,
and the sha256 lets anyone check it against their own checkout of that release.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from harness.errors import BadInput
from harness.run.export.servers import FIRST_PORT, ExportedServer
from harness.run.export.shell import Arg, Var, shell_variable
from harness.serve.vllm_proxy import (
    EPD_PROXY_FILE,
    NO_PROXY_VARS,
    TOY_PROXY_FILE,
    vllm_proxy_launch,
)
from harness.spec.topology import Role

LICENCE_MARKER = "SPDX-License-Identifier"
PROXY_NAME = "proxy"


@dataclass(frozen=True)
class UpstreamProxy:
    """vLLM's proxy files for the served release, as the harness has them (directory + origin)."""

    directory: Path
    origin: str


@dataclass(frozen=True)
class ProxyFile:
    relative: str  # its path in a vLLM source tree, kept under vllm-proxy/ in the export
    source: Path
    sha256: str
    origin: str


def proxy_server(
    servers: tuple[ExportedServer, ...],
    upstream: UpstreamProxy,
    name: str = PROXY_NAME,
    default_port: int = FIRST_PORT,
) -> tuple[ExportedServer, ProxyFile]:
    """vLLM's proxy for these instances, rendered by the harness's one renderer of its
    command (`vllm_proxy_launch`) with static URLs straight to the instances (no taps);
    `name` gives it its port variable (`proxy`: PROXY_PORT, `ref-proxy`: REF_PROXY_PORT).
    Its NO_PROXY entries are appended to the user's own, as a session appends them."""
    marker = {"python": "\x00PYTHON\x00", "dir": "\x00PROXY_DIR\x00", "host": "\x00HOST\x00"}

    def url(server: ExportedServer) -> str:
        return f"http://{marker['host']}:\x00{server.port.name}\x00"

    by_role: dict[str, list[str]] = {}
    for server in servers:
        by_role.setdefault(server.role, []).append(url(server))
    decode = by_role.get(Role.DECODE.value) or by_role.get(Role.PREFILL_DECODE.value) or []
    launch = vllm_proxy_launch(
        (marker["python"],),
        Path(marker["dir"]),
        marker["host"],
        FIRST_PORT,
        by_role.get(Role.ENCODER.value, []),
        by_role.get(Role.PREFILL.value, []),
        decode,
    )
    variables = {
        marker["python"]: Var("PYTHON"),
        marker["dir"]: Var("PROXY_DIR"),
        marker["host"]: Var("HOST"),
        **{f"\x00{s.port.name}\x00": s.port for s in servers},
    }
    port = Var(shell_variable(name) + "_PORT")
    argv: list[Arg] = []
    for previous, arg in zip(("",) + launch.argv, launch.argv):
        argv.append((port,) if previous == "--port" else split_markers(arg, variables))
    relative = EPD_PROXY_FILE if any(EPD_PROXY_FILE in a for a in launch.argv) else TOY_PROXY_FILE
    source = upstream.directory / relative
    if not source.is_file():
        raise BadInput(f"vLLM's proxy file {source} is missing ({upstream.origin})")
    head = source.read_text(encoding="utf-8", errors="replace")[:2000]
    if LICENCE_MARKER not in head:
        raise BadInput(f"{source} has no licence header ({LICENCE_MARKER}): not shipping it")
    proxy_file = ProxyFile(relative, source, sha256_of(source), upstream.origin)
    server = ExportedServer(
        name=name,
        role=PROXY_NAME,
        port=port,
        default_port=default_port,
        argv=tuple(argv),
        env=exported_env(launch.env, variables),
        health_path=launch.health_path,
    )
    return server, proxy_file


def exported_env(env: Mapping[str, str], variables: dict[str, Var]) -> tuple[tuple[str, Arg], ...]:
    """The proxy's environment in serve.sh: its NO_PROXY entries after the user's own list."""
    rendered = []
    for key, value in sorted(env.items()):
        head = (Var(key, list_head=True),) if key in NO_PROXY_VARS else ()
        rendered.append((key, (*head, *split_markers(value, variables))))
    return tuple(rendered)


def split_markers(text: str, variables: dict[str, Var]) -> Arg:
    pattern = "(" + "|".join(re.escape(m) for m in variables) + ")"
    return tuple(variables.get(piece, piece) for piece in re.split(pattern, text) if piece != "")


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
