"""One topology, up and serving: ports held, instances launched, proxy in front, requests sent.

`TopologySession` is the unit both the CLI sweep and the pytest scenarios use. Entering it
starts every instance of the topology at once and waits until all are healthy (a dead instance
fails the start at once, with its log tail); `send()` drives one rendered request through the
proxy and never raises for a failed request: an HTTP error, a timeout or a dead instance
becomes an `Outcome` with the error and the log tail of the instance that died, so one broken
case does not take the rest of the run down silently. Leaving the session stops everything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import secrets
import shutil
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.environment import LOOPBACK_HOST
from harness.files import write_text_atomic
from harness.redact import redact_argv, redact_env
from harness.serve.client import ChatClient, ChatResult
from harness.serve.kv_metrics import read_counters
from harness.serve.launch import ManagedServer, ServerCommand, ServerDied, ServerGroup, log_path_for
from harness.serve.launcher import NodeInfo, launcher_for
from harness.serve.ports import PortLease, reserve_ports
from harness.serve.proxy import EPDProxy, ProxyFaults, ProxyRoutes, ProxyServer, RequestTrace
from harness.serve.proxy_protocol import collect_media
from harness.serve.tap import TapRecord, TapSet, TapTarget
from harness.serve.vllm_proxy import register_instances, registrations, vllm_proxy_launch
from harness.spec.instances import InstanceSpec
from harness.spec.placement import place_instances
from harness.spec.settings import DYNAMIC_REGISTRATION, VLLM_PROXY, RunSettings
from harness.spec.topology import Role, Topology

if TYPE_CHECKING:
    from harness.serve.attached import AttachedEvidence

LOG_TAIL_LINES = 40
LOG_SLICE_LINES = 30  # error lines kept from an instance's log of one request
LOG_TAIL_SLICE_LINES = 10
# After a failed request: how long to give an instance whose engine is dying to exit.
DEATH_GRACE_S = 3.0
PROXY_STARTUP_TIMEOUT_S = 120.0
STORAGE_DIR_NAME = "storage"


@dataclass
class Outcome:
    """One request on one topology: a result, or the reason there is none."""

    prompt: str
    result: ChatResult | None = None
    error: str | None = None
    trace: RequestTrace | None = None  # the harness proxy's own account (--proxy harness)
    taps: list[TapRecord] | None = None  # what every instance was sent and answered
    media_count: int = 0  # media parts in the request the client sent
    seconds: float = 0.0
    # D's KV counters, after minus before the request (harness.serve.kv_metrics); None without
    # a D, or when its /metrics could not be read.
    kv_counters: dict[str, float] | None = None
    # An attached deployment's (--proxy attach): what could be seen from outside it.
    attached: AttachedEvidence | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "result": self.result.to_json() if self.result else None,
            "error": self.error,
            "trace": self.trace.to_json() if self.trace else None,
            "taps": [r.to_json() for r in self.taps] if self.taps is not None else None,
            "media_count": self.media_count,
            "seconds": round(self.seconds, 3),
            "kv_counters": self.kv_counters,
            "attached": self.attached.to_json() if self.attached else None,
        }


@dataclass
class InstanceStats:
    name: str
    role: str
    url: str
    log_path: str
    startup_s: float | None = None
    peak_rss_bytes: int = 0
    node: str | None = None  # the node's address when a launcher placed it on a cluster


def safe_name(name: str) -> str:
    """A topology name usable in paths and request ids: 1E+1P+1D -> 1E-1P-1D."""
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)


class TopologySession:
    """Context manager: a running topology and the means to send it requests."""

    def __init__(
        self,
        topology: Topology,
        settings: RunSettings,
        faults: ProxyFaults | None = None,
        on_event: Callable[[str, str, float], None] | None = None,
        label: str | None = None,
        reuse_storage: Path | None = None,
        devices: tuple[int, ...] | None = None,
    ):
        """`label` names the artifact directory (default: the topology's name).
        `reuse_storage` serves from an earlier session's storage directory as it was left,
        instead of fresh storage (the "rerun without wiping the EC storage" scenario).
        `devices` are the topology's slot in the schedule (default: all the run's devices)."""
        self.topology = topology
        self.settings = settings
        self.devices = devices or settings.devices
        # One object for the session's life: the harness proxy or the taps hold it, and
        # `harness.run.faults.plant` swaps its hooks.
        self.faults = faults if faults is not None else ProxyFaults()
        self.on_event = on_event
        self.dir = settings.run_dir / safe_name(label or topology.name)
        self._launcher = launcher_for(settings)
        self.storage_dir = reuse_storage or (
            self._launcher.storage_root(self.dir) / STORAGE_DIR_NAME
        )
        self.instances: list[InstanceSpec] = []
        self.stats: dict[str, InstanceStats] = {}
        self.proxy: EPDProxy | None = None
        self._leases: list[PortLease] = []  # the vLLM proxy's; the instances' are the launcher's
        self._servers: list[ManagedServer] = []
        self._group: ServerGroup | None = None
        self._proxy_server: ProxyServer | None = None
        self._taps: TapSet | None = None
        self.tap_urls: dict[str, str] = {}  # instance URL -> its tap's URL
        self._vllm_proxy: ManagedServer | None = None
        self._client: ChatClient | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> TopologySession:
        try:
            self.start_servers()
            self.wait_until_serving()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        """Close; a failure to close must not replace the exception that ended the session
        (a Ctrl-C turned into a TimeoutError would be swallowed as "could not start")."""
        try:
            self.close()
        except Exception as close_error:
            if exc is None:
                raise
            exc.add_note(f"closing {self.topology.name} failed too: {close_error!r}")

    def start_servers(self) -> None:
        """Place the instances (ports held; on GPUs the devices), then start every one; returns
        at once. Where they run is the launcher's business (`harness.serve.launcher`).

        Callers that start several topologies side by side (a wave) start them all first and
        then wait for each; on failure the caller must `close()`.
        """
        prepare_session_dir(self.dir)
        settings = self.settings
        launcher = self._launcher
        placed = launcher.reserve(self.topology, self.devices)
        self.instances = place_instances(
            self.topology,
            settings.serving,
            settings.platform,
            placed.ports,
            self.storage_dir,
            self.devices,
            colocate=settings.colocate,
            side_channel_ports=placed.side_channel_ports,
            generation=settings.protocol,
            hosts=placed.hosts,
        )
        if placed.devices is not None:
            self.instances = [
                dataclasses.replace(spec, devices=devices)
                for spec, devices in zip(self.instances, placed.devices, strict=True)
            ]
        nodes = placed.nodes or [None] * len(self.instances)
        for spec in self.instances:
            for storage in (spec.ec_storage, spec.kv_storage):
                if storage is not None:
                    storage.mkdir(parents=True, exist_ok=True)
        commands = [
            ServerCommand(
                name=spec.name,
                argv=spec.argv(self.settings.vllm_executable),
                env=launcher.instance_env(spec),
                health_url=f"{spec.url}/health",
                log_path=log_path_for(self.dir, spec.name),
            )
            for spec in self.instances
        ]
        for command, node in zip(commands, nodes):
            write_text_atomic(
                command.log_path.with_suffix(".cmd.json"), command_json(command, node)
            )
        launcher.check_before_start(self.topology, self.instances, commands)
        for index, (spec, command, node) in enumerate(zip(self.instances, commands, nodes)):
            self._servers.append(launcher.server(index, command))
            self.stats[spec.name] = InstanceStats(
                spec.name,
                spec.role.value,
                spec.url,
                str(command.log_path),
                node=node.address if node is not None else None,
            )
        self._group = ServerGroup(self._servers, on_event=self.on_event)
        self._group.start_all()

    def wait_until_serving(self) -> None:
        """Wait until every instance is healthy (a death fails at once), then put the proxy in
        front and open the client."""
        assert self._group is not None, "start_servers() first"
        self._group.wait_all_ready(self.settings.startup_timeout_s)
        self._launcher.check_serving(self.instances)
        for server, spec in zip(self._servers, self.instances):
            self.stats[spec.name].startup_s = server.startup_seconds
        self._sample_memory()
        self.entry_url = self.instances[0].url
        if not self.topology.is_baseline:
            self._start_taps()
            if self.settings.proxy.kind == VLLM_PROXY:
                self._start_vllm_proxy()
            else:
                self.proxy = EPDProxy(
                    routes_for(self.instances, self.tap_urls), self.faults, self.settings.protocol
                )
                self._proxy_server = ProxyServer(self.proxy, bind_loopback_socket())
                self._proxy_server.start()
                self.entry_url = self._proxy_server.url
        self._client = ChatClient(self.entry_url, timeout_s=self.settings.request_timeout_s)

    def _start_taps(self) -> None:
        """A recording tap in front of every instance: the guards' evidence, for any proxy.
        Planted faults act in the taps only when the proxy under test is not the harness's
        (whose own hooks plant them, as before)."""
        tap_faults = self.faults if self.settings.proxy.kind == VLLM_PROXY else None
        targets = [TapTarget(spec.name, spec.role.value, spec.url) for spec in self.instances]
        self._taps = TapSet(targets, tap_faults).start(LOOPBACK_HOST)
        self.tap_urls = {spec.url: self._taps.urls[spec.name] for spec in self.instances}

    def _start_vllm_proxy(self) -> None:
        """The served release's own proxy, pointed at the taps, managed like an instance; with
        dynamic registration the EPD proxy starts empty and each tap URL is registered once it
        answers."""
        choice = self.settings.proxy
        assert choice.files_dir is not None and choice.interpreter, "preflight sets them"
        lease = reserve_ports(1)[0]
        self._leases.append(lease)
        routes = routes_for(self.instances, self.tap_urls)
        urls = (list(routes.encoder_urls), list(routes.prefill_urls), list(routes.decode_urls))
        # The toy P/D proxy (no encoders) has only static URLs: 1P+1D keeps them.
        dynamic = choice.registration == DYNAMIC_REGISTRATION and bool(routes.encoder_urls)
        admin_key = secrets.token_hex(16) if dynamic else None
        launch = vllm_proxy_launch(
            choice.interpreter, choice.files_dir, LOOPBACK_HOST, lease.port, *urls, admin_key
        )
        url = f"http://{LOOPBACK_HOST}:{lease.port}"
        command = ServerCommand(
            name=f"{self.topology.name}/vllm-proxy",
            argv=launch.argv,
            health_url=f"{url}{launch.health_path}",
            log_path=log_path_for(self.dir, f"{self.topology.name}/vllm-proxy"),
            env=launch.env,
        )
        write_text_atomic(command.log_path.with_suffix(".cmd.json"), command_json(command))
        server = ManagedServer(command, port_lease=lease)
        self._vllm_proxy = server
        server.start()
        server.wait_until_ready(PROXY_STARTUP_TIMEOUT_S)
        if admin_key is not None:
            roster = register_instances(url, admin_key, registrations(*urls))
            write_text_atomic(
                command.log_path.with_suffix(".instances.json"), json.dumps(roster, indent=2)
            )
        self.entry_url = url

    def close(self) -> None:
        """Stop the proxy, then every instance (process groups), then give the ports back.

        Every step runs even when an earlier one fails (the first failure is raised at the
        end): a proxy that does not stop must not leave the instances running.
        """
        client, proxy_server, group = self._client, self._proxy_server, self._group
        taps, vllm_proxy = self._taps, self._vllm_proxy
        self._client = self._proxy_server = self._group = None
        self._taps = self._vllm_proxy = None
        leases, self._leases = self._leases, []
        with contextlib.ExitStack() as steps:  # callbacks run last registered, first
            steps.callback(self._launcher.close)
            for lease in leases:
                steps.callback(lease.release)
            if group is not None:
                steps.callback(group.stop_all)
            if taps is not None:
                steps.callback(taps.stop)
            if vllm_proxy is not None:
                steps.callback(vllm_proxy.stop)
            if proxy_server is not None:
                steps.callback(proxy_server.stop)
            if client is not None:
                steps.callback(client.close)

    # -- requests ----------------------------------------------------------------------------

    def send(self, prompt: str, body: dict[str, Any]) -> Outcome:
        """Send one rendered body; every failure becomes an Outcome with its cause."""
        assert self._client is not None and self._group is not None, "session not started"
        request_id = f"{safe_name(self.topology.name)}-{prompt}-{uuid.uuid4().hex[:8]}"
        outcome = Outcome(prompt=prompt, media_count=len(collect_media(body)))
        started = time.monotonic()
        log_offsets = {server.name: server.log_size() for server in self._servers}
        decode_url = next((i.url for i in self.instances if i.role is Role.DECODE), None)
        counters_before = read_counters(decode_url) if decode_url else None
        tap_mark = self._taps.mark() if self._taps is not None else 0
        try:
            self._group.check_alive()
            if self._vllm_proxy is not None:
                self._vllm_proxy.check_alive()
            outcome.result = self._client.chat(body, request_id=request_id)
        except ServerDied as exc:
            outcome.error = str(exc)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, none is raised
            # The HTTP error rarely says why ("EngineCore encountered an issue"); the
            # instances' logs of this request's window do, and an engine may still be dying.
            outcome.error = f"{type(exc).__name__}: {exc}\n{self.log_slices(log_offsets)}"
            died = self.wait_for_death(DEATH_GRACE_S)
            if died:
                outcome.error += f"\n{died}"
            elif self._proxy_server is not None and not self._proxy_server.running:
                outcome.error += f"\nproxy {self.entry_url} is not running (stopped or crashed)"
            elif self._vllm_proxy is not None and not self._vllm_proxy.is_alive():
                outcome.error += (
                    f"\nvLLM's proxy exited ({self._vllm_proxy.exit_code}); last lines of "
                    f"{self._vllm_proxy.command.log_path}:\n"
                    f"{self._vllm_proxy.log_tail(LOG_TAIL_SLICE_LINES)}"
                )
            else:
                outcome.error += f"\n{self.waited_on_report(request_id)}"
        outcome.seconds = time.monotonic() - started
        if decode_url and counters_before is not None and outcome.result is not None:
            counters_after = read_counters(decode_url)
            if counters_after is not None:
                outcome.kv_counters = counters_after.minus(counters_before)
        if self.proxy is not None:
            outcome.trace = self.proxy.traces.get(request_id)
        if self._taps is not None:
            outcome.taps = self._taps.of_request(tap_mark, request_id)
        self._sample_memory()
        return outcome

    def log_slices(self, offsets: dict[str, int]) -> str:
        """What each instance logged since `offsets` (its last lines), for error evidence."""
        slices = []
        for server in self._servers:
            new_lines = server.read_log_from(offsets.get(server.name, 0)).splitlines()
            if new_lines:
                picked = select_evidence(new_lines)
                slices.append(f"--- {server.command.name} logged during the request ---\n{picked}")
        return "\n".join(slices)

    def wait_for_death(self, grace_s: float) -> str | None:
        """After a failed request, give a dying instance `grace_s` to exit, then report it."""
        deadline = time.monotonic() + grace_s
        while True:
            report = self.dead_instance_report()
            if report or time.monotonic() >= deadline:
                return report
            time.sleep(0.2)

    def waited_on_report(self, request_id: str) -> str:
        """Which instance a failed request was still waiting on, from the proxy's trace (the
        entry instance itself without a proxy), and that instance's last log lines."""
        url = self.entry_url
        trace = self.proxy.traces.get(request_id) if self.proxy is not None else None
        if trace is not None:
            pending = [call.url for call in trace.encoder_calls if call.status is None]
            if trace.prefill_url and trace.prefill_status is None:
                pending.append(trace.prefill_url)
            if trace.decode_url and trace.decode_status is None:
                pending.append(trace.decode_url)
            url = pending[0] if pending else ""
        by_url = {spec.url: server for spec, server in zip(self.instances, self._servers)}
        tap_urls = self.tap_urls
        by_url.update({tap_urls[u]: server for u, server in list(by_url.items()) if u in tap_urls})
        if self._taps is not None and trace is None:  # vLLM's proxy: the taps know
            pending = [r for r in self._taps.records if r.status is None and r.error is None]
            names = {spec.name: server for spec, server in zip(self.instances, self._servers)}
            url = pending[-1].instance if pending else ""
            by_url.update(names)
        server = by_url.get(url)
        if server is None:
            return "no instance was still working on it (see the proxy's trace)"
        return (
            f"the request was still waiting on {server.name} ({url}); last lines of "
            f"{server.command.log_path}:\n{server.log_tail(LOG_TAIL_SLICE_LINES)}"
        )

    def dead_instance_report(self) -> str | None:
        """Name and log tail of the first instance that died, if any."""
        for server in self._servers:
            if not server.is_alive():
                return (
                    f"instance {server.command.name} exited with code {server.exit_code}; "
                    f"last lines of {server.command.log_path}:\n"
                    f"{server.log_tail(LOG_TAIL_LINES)}"
                )
        return None

    def server(self, role: Role, index: int = 0) -> ManagedServer:
        """The running server of the index-th instance with `role` (fault injection, checks)."""
        matching = [srv for spec, srv in zip(self.instances, self._servers) if spec.role is role]
        if index >= len(matching):
            raise LookupError(f"{self.topology.name} has no {role.value} instance #{index}")
        return matching[index]

    @property
    def servers(self) -> tuple[ManagedServer, ...]:
        return tuple(self._servers)

    @property
    def kv_storage(self) -> Path | None:
        return next((s.kv_storage for s in self.instances if s.kv_storage), None)

    @property
    def ec_storage(self) -> Path | None:
        return next((s.ec_storage for s in self.instances if s.ec_storage), None)

    def _sample_memory(self) -> None:
        for server, spec in zip(self._servers, self.instances):
            stats = self.stats[spec.name]
            stats.peak_rss_bytes = max(stats.peak_rss_bytes, server.peak_rss_bytes())


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


def select_evidence(lines: list[str]) -> str:
    """The error lines (a traceback's cause often comes long before the shutdown noise that
    ends the log), then the last few lines."""
    errors = [line for line in lines if "Error" in line or "ERROR" in line][:LOG_SLICE_LINES]
    tail = [line for line in lines[-LOG_TAIL_SLICE_LINES:] if line not in errors]
    return "\n".join(errors + (["..."] if errors and tail else []) + tail)


def bind_loopback_socket() -> socket.socket:
    """A socket the kernel bound to a free loopback port: no window between choice and bind."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((LOOPBACK_HOST, 0))
    return sock


def prepare_session_dir(path: Path) -> None:
    """An empty directory: storage must never carry over from an earlier run by accident."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)


def command_json(command: ServerCommand, node: NodeInfo | None = None) -> str:
    """The launch command as an artifact (and the node it ran on, when a launcher placed it on
    a cluster); secret values never reach it."""
    document: dict[str, Any] = {
        "name": command.name,
        "argv": redact_argv(command.argv),
        "env": redact_env(command.env),
    }
    if node is not None:
        document["node"] = node.to_json()
    return json.dumps(document, indent=2)
