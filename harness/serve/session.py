"""One topology, up and serving: ports held, instances launched, proxy in front, requests sent.

`TopologySession` is the unit both the CLI sweep and the pytest scenarios use. Entering it
starts every instance of the topology at once (on a GPU, instances sharing a device one after
another, `harness.spec.placement.start_after`) and waits until all are healthy (a dead instance
fails the start at once, with its log tail); `send()` drives one rendered request through the
proxy and never raises for a failed request: an HTTP error, a timeout or a dead instance
becomes an `Outcome` with the error and the log tail of the instance that died, so one broken
case does not take the rest of the run down silently. Leaving the session stops everything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from harness.environment import LOOPBACK_HOST
from harness.files import write_text_atomic
from harness.outcomes.outcome import InstanceStats, Outcome, ServedTopology
from harness.outcomes.startup import startup_timeline
from harness.outcomes.taps import records_of
from harness.serve.entry import Entry, command_json, open_entry, proxy_key
from harness.serve.in_flight import InFlightWindows
from harness.serve.kv_metrics import KvCounters, read_counters
from harness.serve.launch import ManagedServer, ServerDied
from harness.serve.launcher import LocalLauncher
from harness.serve.ports import PortLease
from harness.serve.proxy import PROXY_FAILED, EPDProxy, ProxyFaults
from harness.serve.proxy_protocol import collect_media
from harness.serve.server_command import ServerCommand
from harness.serve.server_group import ServerGroup
from harness.serve.server_log import keep_earlier_log, log_path_for
from harness.serve.tap import TapSet, TapTarget
from harness.spec.instances import InstanceSpec
from harness.spec.placement import place_instances, start_after, start_stages
from harness.spec.settings import VLLM_PROXY, ProxyChoice, RunSettings
from harness.spec.topology import Role, Topology

LOG_TAIL_LINES = 40
LOG_SLICE_LINES = 30  # error lines kept from an instance's log of one request
LOG_TAIL_SLICE_LINES = 10
# The line a raised exception ends its traceback with: "AssertionError: ...", "vllm....Error: ...".
_RAISED = re.compile(r"\b[A-Za-z_][\w.]*(?:Error|Exception): ")
# After a failed request: how long to give an instance whose engine is dying to exit (real
# vLLM 0.32.0 on two cores: its server exited more than 3 s after its engine died).
DEATH_GRACE_S = 15.0
STORAGE_DIR_NAME = "storage"
# A log an earlier start's `<name>.log` was kept as (`keep_earlier_log`): `<name>.<n>.log`.
KEPT_LOG = re.compile(r"\.\d+\.log$")
# Between an instance's one-line report and its log's last lines.
LOG_TAIL_HEADING = "its last lines:"


@dataclasses.dataclass(frozen=True)
class DeadInstance:
    """An instance of a running session that exited: what a restart of its topology names as
    its cause, and where its log is."""

    name: str
    exit_code: int | None
    log_path: Path
    log_tail: str
    lost: str | None = None  # gone without an exit code: why (`ManagedServer.lost`)

    def ended(self) -> str:
        """How it ended: its exit code, or why there is none to read."""
        return f"exited with code {self.exit_code}" if self.lost is None else f"lost: {self.lost}"

    def headline(self) -> str:
        """One line naming it and its log: a failed request's error begins with it, and its
        case's detail is that first line (it ended "; last lines of PATH:" before, which read
        "...PATH:; declared upstream failure" there, real vLLM)."""
        return f"instance {self.name} {self.ended()} (its log: {self.log_path})"

    def report(self) -> str:
        return f"{self.headline()}\n{LOG_TAIL_HEADING}\n{self.log_tail}"


def launcher_for(settings: RunSettings) -> Any:
    """The launcher the run chose (`settings.launcher`, `harness.serve.launcher`); Ray is
    imported only when chosen."""
    if settings.launcher.is_local:
        return LocalLauncher(settings)
    from harness.serve.ray_launcher import RayLauncher

    return RayLauncher(settings)


def cluster_inherited(settings: RunSettings) -> dict[str, str] | None:
    """On a Ray cluster (`--ray-address`), what an instance inherits on its nodes that can
    change what it computes, asked of one of them (`RayLauncher.node_inherited`); None where
    instances inherit this process's variables (the local launcher; the one-host rehearsal,
    whose nodes it starts)."""
    choice = settings.launcher
    if choice.is_local or choice.rehearses_on_this_host:
        return None
    from harness.serve.ray_launcher import RayLauncher

    return RayLauncher(settings).node_inherited()


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
        role_env: Mapping[Role, Mapping[str, str]] | None = None,
    ):
        """`label` names the artifact directory (default: the topology's name).
        `reuse_storage` serves from an earlier session's storage directory as it was left,
        instead of fresh storage (the "rerun without wiping the EC storage" scenario).
        `devices` are the topology's slot in the schedule (default: all the run's devices).
        `role_env` adds environment variables to the instances of a role, over what the
        renderer gives them (the self-test's plugin in D; recorded in each `.cmd.json`)."""
        self.topology = topology
        self.settings = settings
        self.devices = devices or settings.devices
        self.role_env = role_env or {}
        # One object for the session's life: the harness proxy or the taps hold it, and
        # `harness.run.faults.planted.plant` swaps its hooks.
        self.faults = faults if faults is not None else ProxyFaults()
        self.on_event = on_event
        self.dir = settings.run_dir / safe_name(label or topology.name)
        self._launcher = launcher_for(settings)
        self.storage_dir = reuse_storage or (
            self._launcher.storage_root(self.dir) / STORAGE_DIR_NAME
        )
        self.instances: list[InstanceSpec] = []
        self._inherited: list[dict[str, str]] = []  # per instance: `Reservation.inherited`
        self.stats: dict[str, InstanceStats] = {}
        self._leases: list[PortLease] = []  # the proxies'; the instances' are the launcher's
        self._servers: list[ManagedServer] = []
        self._group: ServerGroup | None = None
        self._taps: TapSet | None = None
        self.tap_urls: dict[str, str] = {}  # instance URL -> its tap's URL
        # Called before waiting for a device another process holds (`lease_devices`): the
        # pool that started this session lets go of its others there.
        self.before_device_wait: Callable[[], None] | None = None
        # Ways in, by proxy_key(): the session's own proxy, and any other proxy asked for
        # through `via` (the same instances judged through another proxy).
        self._entries: dict[str, Entry] = {}
        self._entry: Entry | None = None
        self._entry_url: str | None = None
        self.revivals: dict[str, int] = {}  # instance name -> times started again in place
        # Where the logs of an earlier start in the same directory went (`prepare_session_dir`):
        # a restart's cause names them.
        self.earlier_logs: dict[Path, Path] = {}
        # A load sends concurrently: a window another request shared holds D's counters of
        # its transfers too (NIXL's p2p counter is D's, not a request's).
        self._in_flight = InFlightWindows()

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> TopologySession:
        """Start and wait until serving; on failure close, and a close that fails too is a note
        on the start's failure (as in `__exit__`): the death and its log tail stay the cause."""
        try:
            self.start_servers()
            self.wait_until_serving()
        except BaseException as exc:
            try:
                self.close()
            except Exception as close_error:
                exc.add_note(f"closing {self.topology.name} failed too: {close_error!r}")
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
        """Place the instances (ports held; on GPUs the devices), then start every one that waits
        for no other (`start_after`; `wait_until_serving` spawns the rest); returns at once.
        Where they run is the launcher's business (`harness.serve.launcher`).

        Callers that start several topologies side by side (a wave) start them all first and
        then wait for each; on failure the caller must `close()`.
        """
        self.earlier_logs = prepare_session_dir(self.dir)
        settings = self.settings
        launcher = self._launcher
        placed = launcher.reserve(self.topology, self.devices, self.before_device_wait)
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
        self._inherited = placed.inherited or [{} for _ in self.instances]
        for spec in self.instances:
            for storage in (spec.ec_storage, spec.kv_storage):
                if storage is not None:
                    storage.mkdir(parents=True, exist_ok=True)
        commands = [
            ServerCommand(
                name=spec.name,
                argv=spec.argv(self.settings.vllm_executable),
                env={**launcher.instance_env(spec), **self.role_env.get(spec.role, {})},
                health_url=f"{spec.url}/health",
                log_path=log_path_for(self.dir, spec.name),
                cpu_affinity=spec.cpu_affinity,
            )
            for spec in self.instances
        ]
        # Instances sharing a GPU start one after another (`start_after`'s docstring says why).
        order = start_after(self.instances)
        for command, node, inherited in zip(commands, nodes, self._inherited):
            node_json = node.to_json() if node is not None else None
            document = command_json(command, node_json, order.get(command.name, ()), inherited)
            write_text_atomic(command.log_path.with_suffix(".cmd.json"), document)
        launcher.check_before_start(self.topology, self.instances, commands)
        for index, (spec, command, node) in enumerate(zip(self.instances, commands, nodes)):
            self._servers.append(launcher.server(index, command))
            self.stats[spec.name] = InstanceStats(
                spec.name,
                spec.role.value,
                spec.url,
                str(command.log_path),
                node=node.address if node is not None else None,
                started_after=list(order.get(spec.name, ())),
            )
        self._group = ServerGroup(self._servers, on_event=self.on_event, start_after=order)
        self._group.start_all()

    def wait_until_serving(self) -> None:
        """Wait until every instance is healthy (a death fails at once), then put the proxy in
        front and open the client."""
        assert self._group is not None, "start_servers() first"
        self._group.wait_all_ready(self._startup_timeout_s())
        self._launcher.check_serving(self.instances)
        for server, spec in zip(self._servers, self.instances):
            stats = self.stats[spec.name]
            stats.startup_s = server.startup_seconds
            stats.startup_cpu_s = server.cpu_seconds()
            if server.spawned_wall_s is not None:
                stats.timeline = startup_timeline(
                    server.command.log_path, server.spawned_wall_s, server.startup_seconds
                )
        self._sample_memory()
        if not self.topology.is_baseline:
            self._start_taps()
        self._entry = self._open_entry(self.settings)

    def revive_dead(self) -> list[InstanceStats]:
        """Start every instance that died again, in place, and wait until it serves: the same
        flags, port and storage, a fresh log beside the dead one's (which stays as evidence).
        The other instances, the taps and the proxy keep running with what they hold, so this
        costs one instance's start instead of the topology's. Returns the revived instances'
        stats (raises what stopped one from coming up; the session is then unusable)."""
        assert self._group is not None, "session not started"
        self._launcher.check_revivable()
        revived: list[InstanceStats] = []
        for index, (spec, dead) in enumerate(zip(self.instances, self._servers)):
            if dead.is_alive():
                continue
            lease = dead.detach_port_lease()
            dead.stop()  # whatever of its group is left; the port stays held
            count = self.revivals.get(spec.name, 0) + 1
            self.revivals[spec.name] = count
            command = dataclasses.replace(
                dead.command, log_path=log_path_for(self.dir, f"{spec.name}.revived-{count}")
            )
            waits = self._group.start_after.get(spec.name, ())
            write_text_atomic(
                command.log_path.with_suffix(".cmd.json"),
                command_json(command, None, waits, self._inherited[index]),
            )
            fresh = ManagedServer(command, port_lease=lease)
            self._servers[index] = fresh
            self._group.replace(dead, fresh)
            stats = InstanceStats(
                spec.name, spec.role.value, spec.url, str(command.log_path), started_after=[*waits]
            )
            self.stats[spec.name] = stats
            revived.append(stats)
        self._group.wait_all_ready(self._startup_timeout_s())
        for stats, server in ((s, self._by_name(s.name)) for s in revived):
            stats.startup_s = server.startup_seconds
            stats.startup_cpu_s = server.cpu_seconds()
        return revived

    def _startup_timeout_s(self) -> float:
        """The run's startup timeout once per instance that starts after another on its GPU
        (`start_stages`): a timeout sized for one start must not cut a chain of them short."""
        assert self._group is not None
        return self.settings.startup_timeout_s * start_stages(self._group.start_after)

    def _by_name(self, name: str) -> ManagedServer:
        return next(server for server in self._servers if server.name == name)

    def _start_taps(self) -> None:
        """A recording tap in front of every instance: the guards' evidence, for any proxy.
        Planted faults act in the taps only when the proxy under test is not the harness's
        (whose own hooks plant them, as before)."""
        tap_faults = self.faults if self.settings.proxy.kind == VLLM_PROXY else None
        targets = [TapTarget(spec.name, spec.role.value, spec.url) for spec in self.instances]
        self._taps = TapSet(targets, tap_faults).start(LOOPBACK_HOST)
        self.tap_urls = {spec.url: self._taps.urls[spec.name] for spec in self.instances}

    def _open_entry(self, settings: RunSettings) -> Entry:
        entry = open_entry(
            self.topology,
            settings,
            self.instances,
            self.tap_urls,
            self.faults,
            self.dir,
            self._leases,
        )
        self._entries[entry.key] = entry
        self._entry_url = self._entry_url or entry.url
        return entry

    def via(self, proxy: ProxyChoice) -> ProxiedSession:
        """This running topology reached through `proxy` (started on first use, stopped with
        the session): the same instances and taps, judged through another proxy."""
        assert self._group is not None, "session not started"
        key = proxy_key(self.topology, proxy)
        settings = dataclasses.replace(self.settings, proxy=proxy)
        entry = self._entries.get(key) or self._open_entry(settings)
        return ProxiedSession(self, entry, settings)

    @property
    def entry_url(self) -> str:
        """Where requests enter (kept after the session closed, for the reports)."""
        assert self._entry_url is not None, "session not started"
        return self._entry_url

    @property
    def proxy(self) -> EPDProxy | None:
        """The harness's proxy, when it is this session's own (its traces)."""
        return self._entry.proxy if self._entry is not None else None

    def close(self) -> None:
        """Stop the proxies, then every instance (process groups), then give the ports back.

        Every step runs even when an earlier one fails (the first failure is raised at the
        end): a proxy that does not stop must not leave the instances running.
        """
        entries, group, taps = list(self._entries.values()), self._group, self._taps
        self._entries, self._entry, self._group, self._taps = {}, None, None, None
        leases, self._leases = self._leases, []
        with contextlib.ExitStack() as steps:  # callbacks run last registered, first
            steps.callback(self._launcher.close)
            for lease in leases:
                steps.callback(lease.release)
            if group is not None:
                steps.callback(group.stop_all)
            if taps is not None:
                steps.callback(taps.stop)
            for entry in entries:
                steps.callback(entry.close)

    # -- requests ----------------------------------------------------------------------------

    def send(self, prompt: str, body: dict[str, Any], entry: Entry | None = None) -> Outcome:
        """Send one rendered body (through `entry`, default the session's own proxy); every
        failure becomes an Outcome with its cause."""
        entry = entry or self._entry
        assert entry is not None and self._group is not None, "session not started"
        request_id = f"{safe_name(self.topology.name)}-{prompt}-{uuid.uuid4().hex[:8]}"
        outcome = Outcome(prompt=prompt, media_count=len(collect_media(body)), sent_at=time.time())
        started = time.monotonic()
        log_offsets = {server.name: server.log_size() for server in self._servers}
        self._in_flight.begin(request_id)  # until D's counters are read again
        try:
            self._send_counted(outcome, entry, body, request_id, started, log_offsets)
        finally:
            outcome.others_in_flight = self._in_flight.end(request_id)
        outcome.trace = entry.take_trace(request_id)
        self._sample_memory()
        return outcome

    def _send_counted(
        self,
        outcome: Outcome,
        entry: Entry,
        body: dict[str, Any],
        request_id: str,
        started: float,
        log_offsets: dict[str, int],
    ) -> None:
        """The request, with D's counters read around it and its taps' records."""
        assert self._group is not None, "session not started"
        counters_before = self.decode_counters()
        tap_mark = self._taps.mark() if self._taps is not None else 0
        try:
            self._group.check_alive()
            entry.check_alive()
            reply = entry.client.send(body, request_id=request_id)
            outcome.result, outcome.stream = reply.result, reply.stream
        except ServerDied as exc:
            outcome.error = str(exc)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, none is raised
            outcome.stream = getattr(exc, "record", None)  # a stream that failed: as read
            # The HTTP error rarely says why ("EngineCore encountered an issue"); the
            # instances' logs of this request's window do, and an engine may still be dying.
            failure = f"{type(exc).__name__}: {exc}\n{self.log_slices(log_offsets)}"
            died = self.wait_for_death(DEATH_GRACE_S) or entry.down_report()
            # An instance that died is the cause: its name leads (a case's detail line and
            # every request in flight when it died say which instance it was).
            if died:
                outcome.error = f"{died}\n{failure}"
            else:
                outcome.error = f"{failure}\n{self.waited_on_report(request_id, entry)}"
        outcome.seconds = time.monotonic() - started
        if counters_before is not None and outcome.result is not None:
            counters_after = self.decode_counters()
            if counters_after is not None:
                outcome.kv_counters = counters_after.minus(counters_before)
        if self._taps is not None:
            outcome.taps = self._taps.of_request(tap_mark, request_id)
            self._taps.release(tap_mark)

    def decode_counters(self) -> KvCounters | None:
        """D's KV counters now (None: the topology has no D, or its /metrics is unreadable)."""
        decode_url = next((i.url for i in self.instances if i.role is Role.DECODE), None)
        return read_counters(decode_url) if decode_url else None

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
        """After a failed request, give a dying instance `grace_s` to exit, then report it. An
        engine's death fails its server's /health at once (vLLM answers 503 from then on),
        seconds before the server exits, so with every instance healthy nothing is dying and
        the wait ends (a request refused with a 400 costs no grace)."""
        deadline = time.monotonic() + grace_s
        while True:
            report = self.dead_instance_report()
            if report or time.monotonic() >= deadline:
                return report
            if all(server.health_probe_failure() is None for server in self._servers):
                return None
            time.sleep(0.2)

    def waited_on_report(self, request_id: str, entry: Entry) -> str:
        """Which instance a failed request was still waiting on, from the proxy's trace (the
        entry instance itself without a proxy), and that instance's last log lines; when none
        was, the instance whose error status the proxy passed on (D's, which both proxies relay
        as it came), or the case's error would name no instance."""
        url = entry.url
        failed_status: int | None = None
        trace = entry.trace(request_id)
        if trace is not None and (trace.error or "").startswith(PROXY_FAILED):
            # The proxy's own failure: an instance it was relaying (D's stream) is no cause.
            return f"the harness's proxy ({url}) failed on it itself: {trace.error}"
        if trace is not None:
            pending = [call.url for call in trace.encoder_calls if call.status is None]
            if trace.prefill_url and trace.prefill_status is None:
                pending.append(trace.prefill_url)
            # D's status comes with its headers; a stream is D's until it has ended.
            if trace.decode_url and not trace.decode_seconds:
                pending.append(trace.decode_url)
            url = pending[0] if pending else ""
            if not pending and trace.decode_status not in (None, 200):
                url, failed_status = trace.decode_url or "", trace.decode_status
        by_url = {spec.url: server for spec, server in zip(self.instances, self._servers)}
        tap_urls = self.tap_urls
        by_url.update({tap_urls[u]: server for u, server in list(by_url.items()) if u in tap_urls})
        if self._taps is not None and trace is None:  # vLLM's proxy: the taps know
            pending = [r for r in self._taps.records if not r.ended]
            names = {spec.name: server for spec, server in zip(self.instances, self._servers)}
            url = pending[-1].instance if pending else ""
            refused = [
                r
                for r in records_of(self._taps.records, request_id)
                if r.ended and r.status not in (None, 200)
            ]
            if not pending and refused:
                url, failed_status = refused[-1].instance, refused[-1].status
            by_url.update(names)
        server = by_url.get(url)
        if server is None:
            return "no instance was still working on it (see the proxy's trace)"
        what = (
            f"{server.name} ({url}) answered {failed_status}"
            if failed_status is not None
            else f"the request was still waiting on {server.name} ({url})"
        )
        return (
            f"{what} (its log: {server.command.log_path})\n{LOG_TAIL_HEADING}\n"
            f"{server.log_tail(LOG_TAIL_SLICE_LINES)}"
        )

    def dead_instance_report(self) -> str | None:
        """Name and log tail of the first instance that died, if any."""
        dead = self.dead_instance()
        return dead.report() if dead is not None else None

    def dead_instance(self) -> DeadInstance | None:
        """The first instance that died, if any (the others' logs are not read)."""
        return next(self._dead_instances(), None)

    def dead_instances(self) -> list[DeadInstance]:
        """Every instance that died, in the topology's order."""
        return list(self._dead_instances())

    def _dead_instances(self) -> Iterator[DeadInstance]:
        for server in self._servers:
            if not server.is_alive():
                yield DeadInstance(
                    server.command.name,
                    server.exit_code,
                    server.command.log_path,
                    server.log_tail(LOG_TAIL_LINES),
                    server.lost,
                )

    def dead_roles(self) -> set[Role]:
        """The roles of the instances that are not running."""
        return {
            spec.role
            for spec, server in zip(self.instances, self._servers)
            if not server.is_alive()
        }

    @property
    def inherited_envs(self) -> list[dict[str, str]]:
        """Per instance, the numerics variables it inherited where it runs (the launcher's
        `Reservation.inherited`: this process's locally, its node's on Ray); empty before
        the start."""
        return [dict(env) for env in self._inherited]

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
    def taps(self) -> TapSet | None:
        """The recording taps in front of the instances (None for the baseline)."""
        return self._taps

    @property
    def kv_storage(self) -> Path | None:
        return next((s.kv_storage for s in self.instances if s.kv_storage), None)

    @property
    def ec_storage(self) -> Path | None:
        return next((s.ec_storage for s in self.instances if s.ec_storage), None)

    @property
    def served(self) -> ServedTopology:
        """What the guards need to know of this topology."""
        return served_topology(self.topology, self.ec_storage, self.settings)

    def _sample_memory(self) -> None:
        for server, spec in zip(self._servers, self.instances):
            stats = self.stats[spec.name]
            stats.peak_rss_bytes = max(stats.peak_rss_bytes, server.peak_rss_bytes())


class ProxiedSession:
    """A running topology reached through another proxy than its own (`TopologySession.via`):
    the same instances, taps, storage and guards' facts; requests through this proxy. Stopped
    with the session it views."""

    def __init__(self, base: TopologySession, entry: Entry, settings: RunSettings):
        self.base = base
        self.entry = entry
        self.settings = settings  # the base's, with this view's proxy
        self.topology = base.topology

    def send(self, prompt: str, body: dict[str, Any]) -> Outcome:
        return self.base.send(prompt, body, self.entry)

    @property
    def entry_url(self) -> str:
        return self.entry.url

    @property
    def faults(self) -> ProxyFaults:
        """Faults are planted in the session's own proxy (or its taps); through another proxy
        they would act twice or not at all."""
        if self.entry is not self.base._entry:
            raise RuntimeError(
                f"faults are planted through {self.topology.name}'s own proxy, not {self.entry.key}"
            )
        return self.base.faults

    @property
    def served(self) -> ServedTopology:
        return self.base.served

    @property
    def instances(self) -> list[InstanceSpec]:
        return self.base.instances

    @property
    def ec_storage(self) -> Path | None:
        return self.base.ec_storage

    @property
    def kv_storage(self) -> Path | None:
        return self.base.kv_storage

    @property
    def storage_dir(self) -> Path:
        return self.base.storage_dir

    @property
    def dir(self) -> Path:
        return self.base.dir

    def dead_instance_report(self) -> str | None:
        return self.base.dead_instance_report()

    def dead_instance(self) -> DeadInstance | None:
        return self.base.dead_instance()

    def decode_counters(self) -> KvCounters | None:
        return self.base.decode_counters()

    def server(self, role: Role, index: int = 0) -> ManagedServer:
        return self.base.server(role, index)


def served_topology(
    topology: Topology, ec_storage: Path | None, settings: RunSettings
) -> ServedTopology:
    return ServedTopology(
        topology, ec_storage, settings.serving.block_size, settings.serving.kv_connector
    )


def select_evidence(lines: list[str]) -> str:
    """The error lines (a traceback's cause often comes long before the shutdown noise that
    ends the log), then the last few lines. Of the error lines, the exceptions' own come
    first: vLLM logs every frame of a traceback as an ERROR line and the cause last, so an
    engine core that dies in its in-process worker logs some 50 frame lines before it."""
    errors = [i for i, line in enumerate(lines) if "Error" in line or "ERROR" in line]
    kept = set([i for i in errors if _RAISED.search(lines[i])][:LOG_SLICE_LINES])
    others = [i for i in errors if i not in kept][: LOG_SLICE_LINES - len(kept)]
    picked = [lines[i] for i in sorted(kept.union(others))]
    tail = [line for line in lines[-LOG_TAIL_SLICE_LINES:] if line not in picked]
    return "\n".join(picked + (["..."] if picked and tail else []) + tail)


def prepare_session_dir(path: Path) -> dict[Path, Path]:
    """An empty directory but for the logs of earlier starts in it: storage must never carry
    over from an earlier run by accident, but the log of the start this one replaces (an
    instance that died, a start that timed out) holds the cause of the restart. Each earlier
    `<name>.log` is kept as `<name>.<n>.log` (`keep_earlier_log`), those kept before stay;
    returns where each earlier log went. (Found in review: the directory was deleted whole,
    so the restart reason named a log that was gone.)"""
    kept: dict[Path, Path] = {}
    if path.exists():
        for entry in path.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            elif entry.suffix != ".log":
                entry.unlink()
        for log in sorted(path.glob("*.log")):
            moved = None if KEPT_LOG.search(log.name) else keep_earlier_log(log)
            if moved is not None:
                kept[log] = moved
    path.mkdir(parents=True, exist_ok=True)
    return kept
