"""Where a topology's requests enter: the proxy under test in front of the instances' taps.

A topology's instances and taps are one thing; the proxy a request goes through is another, so
one running topology can be judged through the harness's proxy and through the served release's
own (static or dynamic registration) without starting its instances again. An `Entry` is one
such proxy with the client that sends through it; the monolithic baseline's entry is the
instance itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.environment import LOOPBACK_HOST
from harness.files import write_text_atomic
from harness.outcomes.trace import RequestTrace
from harness.redact import redact_argv, redact_env, remember_secrets
from harness.serve.client import ChatClient
from harness.serve.launch import ManagedServer
from harness.serve.ports import PortLease, reserve_ports
from harness.serve.proxy import EPDProxy, ProxyFaults, ProxyRoutes, ProxyServer
from harness.serve.server_command import ServerCommand
from harness.serve.server_log import log_path_for
from harness.serve.vllm_proxy import (
    VllmProxyLaunch,
    register_instances,
    registrations,
    vllm_proxy_launch,
    with_inherited_bypass,
)
from harness.spec.instances import InstanceSpec
from harness.spec.settings import (
    DYNAMIC_REGISTRATION,
    STATIC_REGISTRATION,
    VLLM_PROXY,
    ProxyChoice,
    RunSettings,
)
from harness.spec.topology import Role, Topology

PROXY_STARTUP_TIMEOUT_S = 120.0
LOG_TAIL_SLICE_LINES = 10


def proxy_key(topology: Topology, choice: ProxyChoice) -> str:
    """What tells two entries apart: the proxy, and for vLLM's EPD proxy its registration (a
    topology without encoders runs vLLM's toy P/D proxy, which has static URLs only)."""
    if choice.kind != VLLM_PROXY:
        return choice.kind
    registration = choice.registration if topology.encoders else STATIC_REGISTRATION
    return f"{VLLM_PROXY}/{registration}"


@dataclass
class Entry:
    """One way into a running topology."""

    key: str  # proxy_key()
    url: str
    client: ChatClient
    proxy: EPDProxy | None = None  # the harness's proxy: its own trace of every request
    proxy_server: ProxyServer | None = None
    vllm_proxy: ManagedServer | None = None  # the served release's proxy, run like an instance

    def check_alive(self) -> None:
        """Raise ServerDied (naming it, with its log tail) when vLLM's proxy has exited."""
        if self.vllm_proxy is not None:
            self.vllm_proxy.check_alive()

    def trace(self, request_id: str) -> RequestTrace | None:
        return self.proxy.traces.get(request_id) if self.proxy is not None else None

    def take_trace(self, request_id: str) -> RequestTrace | None:
        """The request's trace, which the proxy then lets go of: the outcome holds it, and a
        soak's every request's would otherwise stay in the proxy for the run."""
        return self.proxy.traces.pop(request_id, None) if self.proxy is not None else None

    def down_report(self) -> str | None:
        """Why the proxy itself cannot have answered (None: it is running)."""
        if self.proxy_server is not None and not self.proxy_server.running:
            return f"proxy {self.url} is not running (stopped or crashed)"
        if self.vllm_proxy is not None and not self.vllm_proxy.is_alive():
            return (
                f"vLLM's proxy exited ({self.vllm_proxy.exit_code}); last lines of "
                f"{self.vllm_proxy.command.log_path}:\n"
                f"{self.vllm_proxy.log_tail(LOG_TAIL_SLICE_LINES)}"
            )
        return None

    def close(self) -> None:
        """Stop the proxy and the client; every step runs even when one fails."""
        with contextlib.ExitStack() as steps:
            if self.vllm_proxy is not None:
                steps.callback(self.vllm_proxy.stop)
            if self.proxy_server is not None:
                steps.callback(self.proxy_server.stop)
            steps.callback(self.client.close)


def open_entry(
    topology: Topology,
    settings: RunSettings,
    instances: list[InstanceSpec],
    tap_urls: dict[str, str],
    faults: ProxyFaults,
    session_dir: Path,
    leases: list[PortLease],
) -> Entry:
    """The entry `settings.proxy` names, in front of the taps (`tap_urls`: instance URL -> its
    tap's); a port it holds is appended to `leases`, given back with the topology's."""
    key = proxy_key(topology, settings.proxy)
    timeout_s = settings.request_timeout_s
    if topology.is_baseline:
        url = instances[0].url
        return Entry(key, url, ChatClient(url, timeout_s=timeout_s))
    routes = routes_for(instances, tap_urls)
    if settings.proxy.kind == VLLM_PROXY:
        server, url = start_vllm_proxy(topology, settings.proxy, routes, session_dir, leases)
        return Entry(key, url, ChatClient(url, timeout_s=timeout_s), vllm_proxy=server)
    proxy = EPDProxy(routes, faults, settings.protocol)
    proxy_server = ProxyServer(proxy, bind_loopback_socket())
    proxy_server.start()
    url = proxy_server.url
    return Entry(
        key, url, ChatClient(url, timeout_s=timeout_s), proxy=proxy, proxy_server=proxy_server
    )


def start_vllm_proxy(
    topology: Topology,
    choice: ProxyChoice,
    routes: ProxyRoutes,
    session_dir: Path,
    leases: list[PortLease],
) -> tuple[ManagedServer, str]:
    """The served release's own proxy, pointed at the taps, managed like an instance; with
    dynamic registration the EPD proxy starts empty and each tap URL is registered once it
    answers."""
    assert choice.files_dir is not None and choice.interpreter, "preflight sets them"
    lease = reserve_ports(1)[0]
    leases.append(lease)
    urls = (list(routes.encoder_urls), list(routes.prefill_urls), list(routes.decode_urls))
    # The toy P/D proxy (no encoders) has only static URLs: 1P+1D keeps them.
    dynamic = choice.registration == DYNAMIC_REGISTRATION and bool(routes.encoder_urls)
    admin_key = secrets.token_hex(16) if dynamic else None
    launch = vllm_proxy_for(choice.interpreter, choice.files_dir, lease.port, routes, admin_key)
    url = f"http://{LOOPBACK_HOST}:{lease.port}"
    name = f"{topology.name}/vllm-proxy" + ("-dynamic" if dynamic else "")
    command = ServerCommand(
        name=name,
        argv=launch.argv,
        health_url=f"{url}{launch.health_path}",
        log_path=log_path_for(session_dir, name),
        env=with_inherited_bypass(launch.env, os.environ),
    )
    write_text_atomic(command.log_path.with_suffix(".cmd.json"), command_json(command))
    server = ManagedServer(command, port_lease=lease)
    try:
        server.start()
        server.wait_until_ready(PROXY_STARTUP_TIMEOUT_S)
        if admin_key is not None:
            roster = register_instances(url, admin_key, registrations(*urls))
            write_text_atomic(
                command.log_path.with_suffix(".instances.json"), json.dumps(roster, indent=2)
            )
    except BaseException as exc:
        try:  # a stop that fails too must not replace the cause (the death, its log tail)
            server.stop()
        except Exception as stop_error:
            exc.add_note(f"stopping {name} failed too: {stop_error!r}")
        raise
    return server, url


def vllm_proxy_for(
    interpreter: tuple[str, ...],
    files_dir: Path,
    port: int,
    routes: ProxyRoutes,
    admin_key: str | None = None,
) -> VllmProxyLaunch:
    """The served release's proxy command for `routes` (`routes_for`: the taps' URLs), bound
    to loopback: what a session starts, and what upstream parity compares with upstream's."""
    urls = (list(routes.encoder_urls), list(routes.prefill_urls), list(routes.decode_urls))
    return vllm_proxy_launch(interpreter, files_dir, LOOPBACK_HOST, port, *urls, admin_key)


def routes_for(instances: list[InstanceSpec], via: dict[str, str] | None = None) -> ProxyRoutes:
    """Where a proxy sends each role's work; `via` maps instance URLs to their taps' URLs."""
    by_role: dict[Role, list[str]] = {}
    for spec in instances:
        by_role.setdefault(spec.role, []).append((via or {}).get(spec.url, spec.url))
    return ProxyRoutes(
        encoder_urls=tuple(by_role.get(Role.ENCODER, ())),
        prefill_urls=tuple(by_role.get(Role.PREFILL, ())),
        decode_urls=tuple(by_role.get(Role.DECODE, ()) or by_role.get(Role.PREFILL_DECODE, ())),
    )


def bind_loopback_socket() -> socket.socket:
    """A socket the kernel bound to a free loopback port: no window between choice and bind."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((LOOPBACK_HOST, 0))
    return sock


def command_json(
    command: ServerCommand,
    node: dict[str, Any] | None = None,
    start_after: Sequence[str] = (),
    inherited: Mapping[str, str] | None = None,
) -> str:
    """The launch command as an artifact (and the node it ran on, when a launcher placed it on
    a cluster; the instances that had to be healthy before it was spawned, when it shares a
    GPU with them); secret values never reach it, and are remembered for the bundle to
    scrub from free text (`remember_secrets`).

    `inherited`: what the instance inherits from the environment it is started in that can
    change what it computes (`harness.spec.inherited_env.numerics_env`), recorded as
    `inherited_env` less what `env` sets over it, so that `export` sets it again: a case run
    under VLLM_ATTENTION_BACKEND is not re-run upstream without it."""
    inherited_env = {k: v for k, v in (inherited or {}).items() if k not in command.env}
    remember_secrets({**inherited_env, **command.env}, command.argv)
    document: dict[str, Any] = {
        "name": command.name,
        "argv": redact_argv(command.argv),
        "env": redact_env(command.env),
    }
    if inherited_env:
        document["inherited_env"] = redact_env(dict(sorted(inherited_env.items())))
    if command.cpu_affinity:
        document["cpu_affinity"] = list(command.cpu_affinity)
    if node is not None:
        document["node"] = node
    if start_after:
        document["start_after"] = list(start_after)
    return json.dumps(document, indent=2)
