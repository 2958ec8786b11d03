"""`--launcher ray`: each instance on a node of a Ray cluster, started there by the same launcher.

Per topology the harness asks Ray for a placement group of one bundle per instance, STRICT_SPREAD
by default (every instance on a node of its own; PACK with `--ray-placement pack`), and puts one
actor, an `InstanceAgent`, in each bundle. Which bundle lands on which node is Ray's choice, so
nothing is assumed: each agent reports where it is (`where`: node address, node id, host name,
accelerator ids), and that is what the instance binds, what its side channels announce, what
its URL is, what `run.json` records. On a GPU node the instance's devices are the accelerator
ids Ray gave its agent.

An agent runs `harness.serve.launch.ManagedServer` on its node, unchanged: the server in its own
session with a parent-death signal, the harness's watchdog beside it, ports held by leases
reserved on that node (`harness.serve.ports`, bound at the node's address). Two Ray settings
make that work (measured with Ray 2.60, docs/multi-node.md):

* the agent's `runtime_env` sets `RAY_kill_child_processes_on_worker_exit=0`. Ray's default
  SIGKILLs a worker's direct children when it exits: the server's leader and the watchdog,
  leaving vLLM's EngineCore, a grandchild, running (it does not exit when its API server is
  SIGKILLed). With the variable off, the watchdog outlives the agent, sees it gone and stops
  the whole server group: that is the one path for every way an agent can end (the driver
  SIGKILLed, so Ray kills its actors; the agent SIGKILLed; its raylet SIGKILLed);
* agents are ordinary (not detached) actors owned by the driver: Ray ends them when the
  harness ends, however it ends.

Evidence does not rely on one host: the harness polls each agent (is the server alive, its
newest log bytes, the RSS of its tree), mirrors the log into the bundle at the path the local
launcher would have written it, and reads `/health`, `/metrics` and the taps' upstreams at the
instances' node URLs. Streamed worker logs are off (`log_to_driver=False`): Ray merges them and
can attribute lines to the wrong actor.

Before any server starts, `check_before_start` refuses, in one line naming the instance and
the variable, a rendered command that breaks a network invariant (`harness.spec.network`), a
node that lacks the served vLLM executable, and connector storage that is not one directory
shared by every node of the topology and the harness (a file written on each is read on every
other). Once every server answers `/health`, `check_serving` checks from the nodes what the
rendered command cannot show: each instance listens at its node's address (HTTP and NIXL side
channel), and every NIXL side channel can be reached from every peer's node.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from harness.environment import NETWORK_CHECKS_ENV, network_checks_enabled
from harness.serve import server_log
from harness.serve.launch import (
    KILL_WAIT_S,
    STARTUP_STOP_GRACE_S,
    STOP_GRACE_S,
    ManagedServer,
    ServerDied,
    await_ready,
    health_probe_failure,
)
from harness.serve.launcher import LaunchRefused, NodeInfo, Reservation
from harness.serve.ports import PortLease, reserve_ports
from harness.serve.process_groups import describe_exit
from harness.serve.ray_cluster import USAGE_STATS_ENV, LocalRayCluster
from harness.serve.server_command import ServerCommand
from harness.spec.instances import InstanceSpec
from harness.spec.network import side_channels, violations
from harness.spec.placement import needs_side_channel
from harness.spec.settings import PACK_PLACEMENT, LauncherChoice, RunSettings
from harness.spec.topology import Topology

log = logging.getLogger(__name__)

KILL_CHILDREN_ENV = "RAY_kill_child_processes_on_worker_exit"
# Given to every agent: its children (server leader, watchdog) must outlive it (see above).
AGENT_ENV = {KILL_CHILDREN_ENV: "0", USAGE_STATS_ENV: "0"}
PLACEMENT_TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 60.0  # one agent call; agents answer in milliseconds unless a node is lost
LOG_CHUNK_BYTES = 4 * 1024 * 1024  # log bytes one poll brings back
SIDE_CHANNEL_WAIT_S = 20.0  # NIXL's listener starts with the engine; /health may come first
CONNECT_TIMEOUT_S = 5.0
REHEARSAL_DIR = "ray-cluster"


# -- the connection ------------------------------------------------------------------------------


class RayRuntime:
    """The harness's one connection to its cluster: opened at the first Ray topology, closed
    when the run ends (`close_runtime`, also at exit). Without `--ray-address` it first starts
    the one-host rehearsal cluster (`harness.serve.ray_cluster`) and stops it at close."""

    def __init__(self) -> None:
        self.cluster: LocalRayCluster | None = None
        self.address: str | None = None
        self._at_exit = False

    def connect(self, choice: LauncherChoice, run_dir: Path) -> None:
        if ray.is_initialized():
            wanted = choice.ray_address
            if wanted is not None and self.address is not None and wanted != self.address:
                raise LaunchRefused(
                    f"--ray-address {wanted}: this harness is connected to {self.address}; "
                    "one run, one cluster"
                )
            return
        os.environ[USAGE_STATS_ENV] = "0"
        if not self._at_exit:
            atexit.register(close_runtime)
            self._at_exit = True
        node_ip = None
        expected_nodes = 1
        if choice.ray_address is None:
            cluster = LocalRayCluster(run_dir / REHEARSAL_DIR)
            log.info("[ray] starting a one-host cluster: nodes %s", ", ".join(cluster.addresses))
            try:
                cluster.start()
            except BaseException:
                with contextlib.suppress(Exception):
                    cluster.stop()
                raise
            self.cluster = cluster
            self.address, node_ip = cluster.address, cluster.driver_address
            expected_nodes = len(cluster.addresses)
        else:
            self.address = choice.ray_address
            host = self.address.rsplit(":", 1)[0]
            # Ray takes a driver's loopback address for the host's routable one: say which.
            node_ip = host if host.startswith("127.") else None
        try:
            ray.init(
                address=self.address,
                _node_ip_address=node_ip,
                log_to_driver=False,
                namespace=f"epd-harness-{os.getpid()}",
            )
        except Exception as exc:
            self.close()
            first = (str(exc).strip().splitlines() or [""])[0]
            raise LaunchRefused(
                f"cannot connect to the Ray cluster at {self.address}: {type(exc).__name__}: "
                f"{first}"
            ) from None
        except BaseException:
            self.close()
            raise
        deadline = time.monotonic() + PLACEMENT_TIMEOUT_S
        while len(alive_nodes()) < expected_nodes and time.monotonic() < deadline:
            time.sleep(0.2)
        log.info("[ray] connected to %s: nodes %s", self.address, describe_nodes())

    def log_memory(self) -> None:
        """The rehearsal cluster's RSS per node (its workers and the agents' servers
        included), for the record: on a small machine the cluster is part of the budget."""
        if self.cluster is not None:
            rss = self.cluster.memory_bytes()
            log.info(
                "[ray] RSS per node (Ray's processes, agents and their vLLM servers): %s; "
                "total %.1f GB",
                ", ".join(f"{node} {size / 1e9:.1f} GB" for node, size in rss.items()),
                sum(rss.values()) / 1e9,
            )

    def close(self) -> None:
        """Disconnect, then stop the rehearsal cluster if this harness started it."""
        cluster, self.cluster = self.cluster, None
        self.address = None
        if ray.is_initialized():
            ray.shutdown()
        if cluster is not None:
            cluster.stop()


_RUNTIME = RayRuntime()


def runtime() -> RayRuntime:
    return _RUNTIME


def close_runtime() -> None:
    """End the run's Ray connection (and its rehearsal cluster); harmless when there is none."""
    _RUNTIME.close()


def alive_nodes() -> list[dict[str, Any]]:
    return [node for node in ray.nodes() if node.get("Alive")]


def describe_nodes() -> str:
    nodes = alive_nodes()
    parts = [
        f"{n['NodeManagerAddress']} (CPU {n['Resources'].get('CPU', 0):g}"
        + (f", GPU {n['Resources']['GPU']:g}" if n["Resources"].get("GPU") else "")
        + ")"
        for n in nodes
    ]
    return f"{len(nodes)} alive: " + ", ".join(parts)


# -- on the node ---------------------------------------------------------------------------------


class InstanceAgent:
    """Runs on the node Ray placed it on: holds the instance's ports there, starts and stops
    its server with the local launcher, and answers what the harness cannot see from afar."""

    def __init__(self) -> None:
        self.leases: list[PortLease] = []
        self.server: ManagedServer | None = None
        self.workdir: Path | None = None  # the server's log (and, if the agent is killed, the
        # watchdog's watchdog.log: left on the node as the evidence of what it stopped)

    def where(self) -> dict[str, Any]:
        context = ray.get_runtime_context()
        return {
            "address": ray.util.get_node_ip_address(),
            "node_id": context.get_node_id(),
            "hostname": socket.gethostname(),
            "accelerators": {k: list(v) for k, v in context.get_accelerator_ids().items()},
            "pid": os.getpid(),
            "kill_children": os.environ.get(KILL_CHILDREN_ENV),
        }

    def reserve(self, address: str, side_channel: bool) -> tuple[int, int | None]:
        """An HTTP port (and a NIXL side-channel port) held on this node, at `address`."""
        self.leases = reserve_ports(2 if side_channel else 1, host=address)
        return self.leases[0].port, self.leases[1].port if side_channel else None

    def check_executable(self, executable: str) -> str | None:
        """None if `executable` can be run here, else why not."""
        found = shutil.which(executable)
        return None if found else f"{executable} is not an executable on this node"

    def directory_listing(self, path: str) -> list[str] | str:
        """The names in directory `path` on this node, or why it cannot be listed."""
        try:
            return sorted(os.listdir(path))
        except OSError as exc:
            return f"cannot list {path}: {exc.strerror or exc}"

    def storage_probe(self, reads: list[tuple[str, str]], write: tuple[str, str] | None) -> str:
        """Read each (path, expected content); then write `write`. Returns the first problem."""
        for path, expected in reads:
            try:
                found = Path(path).read_text(encoding="utf-8")
            except OSError as exc:
                return f"cannot read {path}: {exc.strerror or exc}"
            if found != expected:
                return f"{path} holds something else than what was written"
        if write is not None:
            try:
                Path(write[0]).write_text(write[1], encoding="utf-8")
            except OSError as exc:
                return f"cannot write {write[0]}: {exc.strerror or exc}"
        return ""

    def start(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        health_url: str,
        cpu_affinity: tuple[int, ...],
    ) -> dict:
        self.workdir = Path(tempfile.mkdtemp(prefix="epd-harness-ray-"))
        log_path = self.workdir / f"{uuid.uuid4().hex[:8]}.log"
        command = ServerCommand(name, argv, health_url, log_path, env, cpu_affinity)
        self.server = ManagedServer(command, port_lease=self.leases[0] if self.leases else None)
        for lease in self.leases[1:]:
            lease.hand_over()  # NIXL binds its side channel itself; the flock stays
        self.server.start()
        return {
            "pid": self.server.pid,
            "log": str(log_path),
            "spawned_wall_s": self.server.spawned_wall_s,
        }

    def owns_health_port(self) -> bool:
        """The server's own process tree listens on its health port, on this node."""
        return self.server is not None and self.server.owns_health_port()

    def poll(self, offset: int) -> dict[str, Any]:
        """The server's exit code (None: running), its log from `offset`, its tree's RSS and
        CPU seconds."""
        server = self.server
        if server is None:
            return {"exit": None, "data": b"", "rss": 0, "cpu": {}}
        rss, cpu = server.sampled_usage()  # the sample also lets stop() reach what left the group
        try:
            with open(server.command.log_path, "rb") as log_file:
                log_file.seek(offset)
                data = log_file.read(LOG_CHUNK_BYTES)
        except FileNotFoundError:
            data = b""
        return {"exit": server.exit_code, "data": data, "rss": rss, "cpu": cpu}

    def listening(self) -> list[tuple[str, int]]:
        """Every (address, port) the server's process tree listens on."""
        if self.server is None or self.server.pid is None:
            return []
        try:
            root = psutil.Process(self.server.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        found = set()
        for proc in procs:
            try:
                for conn in proc.net_connections(kind="inet"):
                    if conn.status == psutil.CONN_LISTEN:
                        found.add((conn.laddr.ip, conn.laddr.port))
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return sorted(found)

    def can_connect(self, host: str, port: int) -> str:
        """ "" if a TCP connection to host:port opens from this node, else the error."""
        try:
            socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as exc:
            return f"{type(exc).__name__}: {exc}"
        return ""

    def stop(self, grace_s: float, ready: bool) -> None:
        if self.server is not None:
            if ready:
                self.server._mark_ready()  # a serving server gets its full grace
            self.server.stop(grace_s)
        for lease in self.leases:
            lease.release()

    def discard(self) -> None:
        """Remove the node-side log, once the harness has fetched all of it."""
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


_Agent = ray.remote(InstanceAgent)


# -- on the harness's side ----------------------------------------------------------------------


class RayServer:
    """One instance run by an agent: the interface of `ManagedServer`, so `ServerGroup` and the
    session drive it unchanged. Its log is mirrored into the bundle as it grows."""

    def __init__(
        self, agent: Any, command: ServerCommand, node: NodeInfo, agent_pid: int | None = None
    ) -> None:
        self.command = command
        self.node = node
        self.agent_pid = agent_pid  # the agent's process on the node (chaos tests kill it)
        self._agent = agent
        self._pid: int | None = None
        self._exit: int | None = None
        self._lost: str | None = None  # why the agent is gone, once it is
        self._offset = 0
        self._rss = 0
        self._cpu: dict[str, float] = {}
        self._spawned_at: float | None = None
        self._spawned_wall_s: float | None = None
        self._startup_seconds: float | None = None
        self._stopped = False

    @property
    def name(self) -> str:
        return self.command.name

    @property
    def pid(self) -> int | None:
        """The server's pid on its node."""
        return self._pid

    @property
    def pgid(self) -> int | None:
        return self._pid

    @property
    def port_lease(self) -> None:
        return None  # held by the agent, on the node

    @property
    def startup_seconds(self) -> float | None:
        return self._startup_seconds

    @property
    def spawned_wall_s(self) -> float | None:
        """The spawn's wall-clock time on the node (its clock stamps the log the start-up
        timeline reads)."""
        return self._spawned_wall_s

    @property
    def exit_code(self) -> int | None:
        return self._exit

    def start(self) -> None:
        command = self.command
        command.log_path.parent.mkdir(parents=True, exist_ok=True)
        node = self.node
        server_log.keep_earlier_log(command.log_path)
        with open(command.log_path, "wb") as mirror:
            mirror.write(
                f"{server_log.log_header(command)}"
                f"# epd-harness: on Ray node {node.address} (node id {node.node_id}, host "
                f"{node.hostname}); the lines below are its log, fetched through its agent\n".encode()
            )
        try:
            started = _get(
                self._agent.start.remote(
                    command.name,
                    list(command.argv),
                    dict(command.env),
                    command.health_url,
                    command.cpu_affinity,
                ),
                f"starting {command.name} on node {node.address}",
            )
        except Exception as exc:
            exc.add_note(f"while starting {command.name} on Ray node {node.address}")
            raise
        self._pid = started["pid"]
        self._spawned_at = time.monotonic()
        self._spawned_wall_s = started.get("spawned_wall_s")

    def health_probe_failure(self) -> str | None:
        return health_probe_failure(self.command.health_url)

    def owns_health_port(self) -> bool:
        """Asked on the node: an answer from another program on the port is no readiness."""
        try:
            return bool(ray.get(self._agent.owns_health_port.remote(), timeout=CALL_TIMEOUT_S))
        except (RayActorError, GetTimeoutError):
            return False  # check_alive() says what happened to the agent

    def wait_until_ready(self, timeout_s: float) -> None:
        await_ready([self], timeout_s, on_ready=lambda server: None)

    def is_alive(self) -> bool:
        self._poll()
        return self._pid is not None and self._exit is None and self._lost is None

    def check_alive(self) -> None:
        if self._pid is None:
            raise RuntimeError(f"{self.name}: not started")
        self._poll()
        phase = "while serving" if self._startup_seconds is not None else "during startup"
        where = f"{self.name} (pid {self._pid} on Ray node {self.node.address})"
        if self._lost is not None:
            raise ServerDied(
                f"{where}: its agent is gone {phase} ({self._lost}), noticed "
                f"{self._age_s():.1f} s after start\n{self._log_evidence()}",
                name=self.name,
            )
        if self._exit is not None:
            raise ServerDied(
                f"{where} died {phase}: {describe_exit(self._exit)}, noticed "
                f"{self._age_s():.1f} s after start\n{self._log_evidence()}",
                name=self.name,
                exit_code=self._exit,
            )

    def log_tail(self, lines: int = server_log.LOG_TAIL_LINES) -> str:
        self._poll()
        return server_log.read_log_tail(self.command.log_path, lines)

    def log_size(self) -> int:
        self._poll()
        return server_log.log_size(self.command.log_path)

    def read_log_from(self, offset: int) -> str:
        self._poll()
        return server_log.read_log_from(self.command.log_path, offset)

    def peak_rss_bytes(self) -> int:
        self._poll()
        return self._rss

    def cpu_seconds(self) -> dict[str, float]:
        self._poll()
        return dict(self._cpu)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """The agent stops the server as the local launcher does (SIGTERM, grace, SIGKILL, its
        group and recorded descendants); the rest of the log is fetched; the agent ends."""
        if self._stopped:
            return
        if self._pid is not None and self._lost is None:
            ready = self._startup_seconds is not None
            grace = grace_s if ready else min(grace_s, STARTUP_STOP_GRACE_S)
            self._poll()
            try:
                ray.get(self._agent.stop.remote(grace, ready), timeout=grace + KILL_WAIT_S + 30)
            except RayActorError as exc:
                self._lost = _lost(exc)  # the agent's end stopped its server (its watchdog)
            except RayTaskError as exc:
                raise exc.as_instanceof_cause() from None
            self._poll()  # the server's last lines (its shutdown)
            if self._lost is None:
                _get(self._agent.discard.remote(), f"cleaning up after {self.name}")
        self._stopped = True
        ray.kill(self._agent)

    def _mark_ready(self) -> None:
        self._startup_seconds = self._age_s()

    def _age_s(self) -> float:
        return 0.0 if self._spawned_at is None else time.monotonic() - self._spawned_at

    def _log_evidence(self) -> str:
        tail = server_log.read_log_tail(self.command.log_path, server_log.LOG_TAIL_LINES)
        return (
            f"--- last {server_log.LOG_TAIL_LINES} lines of {self.command.log_path} (from node "
            f"{self.node.address}) ---\n{tail}"
        )

    def _poll(self) -> None:
        """Bring the server's state and newest log lines over from its agent."""
        if self._pid is None or self._lost is not None or self._stopped:
            return
        while True:
            try:
                state = ray.get(self._agent.poll.remote(self._offset), timeout=CALL_TIMEOUT_S)
            except (RayActorError, GetTimeoutError) as exc:
                self._lost = _lost(exc)
                return
            data: bytes = state["data"]
            if data:
                with open(self.command.log_path, "ab") as mirror:
                    mirror.write(data)
                self._offset += len(data)
            self._exit = state["exit"]
            self._rss = max(self._rss, state["rss"])
            self._cpu = state["cpu"] or self._cpu
            if len(data) < LOG_CHUNK_BYTES:
                return


def _lost(exc: Exception) -> str:
    if isinstance(exc, GetTimeoutError):
        return f"no answer from it in {CALL_TIMEOUT_S:.0f} s"
    first = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {first[0] if first else ''}".strip()


def _get(refs: Any, doing: str) -> Any:
    """ray.get, with a failure turned into one line saying what was being done, and where."""
    try:
        return ray.get(refs, timeout=CALL_TIMEOUT_S)
    except RayTaskError as exc:
        cause = exc.as_instanceof_cause()
        raise LaunchRefused(f"{doing}: {type(cause).__name__}: {cause}") from None
    except (RayActorError, GetTimeoutError) as exc:
        raise LaunchRefused(f"{doing}: {_lost(exc)}") from None


class RayLauncher:
    """Places a topology's instances on the cluster's nodes and runs each through an agent."""

    kind = "ray"

    def __init__(self, settings: RunSettings) -> None:
        self.settings = settings
        self.choice = settings.launcher
        self._group: Any = None
        self._agents: list[Any] = []
        self._nodes: list[NodeInfo] = []
        self._agent_pids: list[int] = []
        self._storage_tag = uuid.uuid4().hex[:8]

    def storage_root(self, session_dir: Path) -> Path:
        """The shared directory if one was given (fresh per session: connectors key what they
        store by content), else the session's own artifact directory."""
        if self.choice.shared_dir is None:
            return session_dir
        return self.choice.shared_dir / f"epd-{self._storage_tag}" / session_dir.name

    def reserve(
        self,
        topology: Topology,
        devices: tuple[int, ...],
        before_device_wait: Callable[[], None] | None = None,
    ) -> Reservation:
        """The placement group's bundles (Ray places the instances; no device leases here, so
        `before_device_wait` is never called)."""
        refusal = self.choice.refusal_on(self.settings.platform)
        if refusal is not None:  # prepare_run refuses it too; scenarios build settings directly
            raise LaunchRefused(f"{topology.name}: {refusal}")
        runtime().connect(self.choice, self.settings.run_dir)
        roles = topology.roles
        bundle: dict[str, float] = {"CPU": 1}
        if self.settings.platform.exclusive_devices:
            bundle["GPU"] = 1
        spread = self.choice.placement != PACK_PLACEMENT
        self._group = placement_group(
            [dict(bundle) for _ in roles],
            strategy="STRICT_SPREAD" if spread else "PACK",
            name=f"epd-{topology.name}-{uuid.uuid4().hex[:6]}",
        )
        try:
            ray.get(self._group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except GetTimeoutError:
            raise LaunchRefused(
                f"{topology.name}: Ray cannot place its {len(roles)} instances "
                f"({', '.join(f'{k} {v:g}' for k, v in bundle.items())} each"
                f"{', every one on a node of its own' if spread else ''}) within "
                f"{PLACEMENT_TIMEOUT_S:.0f} s; nodes: {describe_nodes()}"
            ) from None
        self._agents = [
            _Agent.options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._group, placement_group_bundle_index=index
                ),
                runtime_env={"env_vars": dict(AGENT_ENV)},
                max_restarts=0,
            ).remote()
            for index in range(len(roles))
        ]
        where = _get(
            [agent.where.remote() for agent in self._agents],
            f"starting {topology.name}'s agents (is epd-harness installed on every node?)",
        )
        for w in where:
            if w["kill_children"] != AGENT_ENV[KILL_CHILDREN_ENV]:
                raise LaunchRefused(
                    f"{topology.name}: the agent on node {w['address']} runs with "
                    f"{KILL_CHILDREN_ENV}={w['kill_children']!r}, so Ray would SIGKILL its "
                    "server's leader and watchdog and leave vLLM's engine behind; does the "
                    "cluster allow runtime_env env_vars?"
                )
        self._nodes = [NodeInfo(w["address"], w["node_id"], w["hostname"]) for w in where]
        self._agent_pids = [w["pid"] for w in where]
        sides = [needs_side_channel(role, self.settings.serving) for role in roles]
        ports = _get(
            [
                agent.reserve.remote(node.address, side)
                for agent, node, side in zip(self._agents, self._nodes, sides)
            ],
            f"reserving {topology.name}'s ports on its nodes",
        )
        for role, node in zip(roles, self._nodes):
            log.info(
                "[ray] %s %s -> node %s (%s)",
                topology.name,
                role.value,
                node.address,
                node.node_id[:12],
            )
        accelerators = None
        if self.settings.platform.exclusive_devices:
            accelerators = [tuple(int(i) for i in w["accelerators"].get("GPU", [])) for w in where]
        return Reservation(
            hosts=[node.address for node in self._nodes],
            ports=[http for http, _ in ports],
            side_channel_ports=[side for _, side in ports if side is not None],
            nodes=list(self._nodes),
            devices=accelerators,
        )

    def instance_env(self, spec: InstanceSpec) -> dict[str, str]:
        return {**spec.env(), **dict(self.choice.instance_env)}

    def check_before_start(
        self, topology: Topology, instances: list[InstanceSpec], commands: list[ServerCommand]
    ) -> None:
        """Refuse what cannot work across nodes, in one line naming the instance and cause."""
        multi_node = len({spec.host for spec in instances}) > 1
        problems = [
            str(violation)
            for spec, command in zip(instances, commands)
            for violation in violations(spec, command.argv, command.env, multi_node)
        ]
        if problems and not network_checks_enabled():
            log.warning("[ray] %s=off: starting despite: %s", NETWORK_CHECKS_ENV, problems)
        elif problems:
            raise LaunchRefused("; ".join(problems))
        missing = _get(
            [a.check_executable.remote(c.argv[0]) for a, c in zip(self._agents, commands)],
            f"checking {topology.name}'s nodes for the served vLLM",
        )
        for spec, node, problem in zip(instances, self._nodes, missing):
            if problem:
                raise LaunchRefused(f"{spec.name}: {problem} (node {node.address})")
        self._check_storage(instances)
        self._check_media_dir(instances)

    def server(self, index: int, command: ServerCommand) -> RayServer:
        return RayServer(self._agents[index], command, self._nodes[index], self._agent_pids[index])

    def check_serving(self, instances: list[InstanceSpec]) -> None:
        """From the nodes: each instance listens at its node's address, and every NIXL side
        channel opens from every other node of the topology."""
        if not network_checks_enabled():
            log.warning(
                "[ray] %s=off: the instances' addresses are not checked", NETWORK_CHECKS_ENV
            )
            return
        deadline = time.monotonic() + SIDE_CHANNEL_WAIT_S
        for agent, spec in zip(self._agents, instances):
            wanted = [
                (spec.host, spec.port, "--host/--port"),
                *(
                    (host, port, "VLLM_NIXL_SIDE_CHANNEL_HOST/_PORT")
                    for host, port in side_channels(spec)
                ),
            ]
            while True:
                listening = _get(agent.listening.remote(), f"asking {spec.name}'s node")
                missing = [w for w in wanted if (w[0], w[1]) not in listening]
                if not missing or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            for host, port, variable in missing:
                shown = ", ".join(f"{h}:{p}" for h, p in listening) or "nothing"
                raise LaunchRefused(
                    f"{spec.name}: nothing listens at {host}:{port} ({variable}) on its node; "
                    f"it listens on {shown}"
                )
        for spec in instances:
            for host, port in side_channels(spec):
                for agent, peer in zip(self._agents, instances):
                    if peer is spec or peer.host == spec.host:
                        continue
                    error = _get(agent.can_connect.remote(host, port), f"asking {peer.name}")
                    if error:
                        raise LaunchRefused(
                            f"{spec.name}'s NIXL side channel {host}:{port} cannot be reached "
                            f"from {peer.name}'s node {peer.host}: {error}"
                        )
        runtime().log_memory()

    def check_revivable(self) -> None:
        """Reviving one instance in place needs its port held across the restart, which an
        agent gives back when its server stops: on Ray the caller starts the topology again
        (`TopologyPool.revive` does)."""
        raise LaunchRefused(
            "reviving an instance in place is the local launcher's; on Ray the topology is "
            "started again"
        )

    def close(self) -> None:
        """End the agents (their servers were stopped by then) and free the placement group."""
        agents, group = self._agents, self._group
        self._agents, self._group = [], None
        if not ray.is_initialized():
            return
        for agent in agents:
            try:
                ray.kill(agent)
            except RayError:
                pass
        if group is not None:
            remove_placement_group(group)

    def _check_media_dir(self, instances: Sequence[InstanceSpec]) -> None:
        """`--media-dir`: each instance's vLLM reads the file:// media under it on its own
        node, so every node must see the directory the harness sees (the same names in it);
        otherwise the topology is refused before a start, not ERROR request by request."""
        media = self.settings.serving.allowed_local_media_path
        if not media:
            return
        mine = sorted(os.listdir(media))
        answers = _get(
            [agent.directory_listing.remote(media) for agent in self._agents],
            f"listing --media-dir {media} on the nodes",
        )
        for spec, theirs in zip(instances, answers):
            if theirs != mine:
                problem = theirs if isinstance(theirs, str) else "it lists other files there"
                raise LaunchRefused(
                    f"--media-dir {media} is not the same directory on {spec.name}'s node "
                    f"{spec.host} ({problem}): each instance reads file:// media on its own "
                    "node; put the media on a filesystem every node mounts at that path"
                )

    def _check_storage(self, instances: Sequence[InstanceSpec]) -> None:
        """Every directory a connector shares between instances (ExampleConnector's) must be
        the same directory on each of their nodes and for the harness: a file written by each
        is read by all the others. Otherwise the topology is refused, naming the node."""
        users: dict[tuple[str, Path], list[int]] = {}
        for index, spec in enumerate(instances):
            for label, path in spec.shared_storage().items():
                users.setdefault((label, path), []).append(index)
        for (label, path), members in users.items():
            self._probe_storage(label, path, [instances[i] for i in members], members)

    def _probe_storage(
        self, label: str, path: Path, members: list[InstanceSpec], indexes: list[int]
    ) -> None:
        token = uuid.uuid4().hex
        mine = (str(path / f".epd-shared-{token}-harness"), f"{token} harness")
        theirs = [(str(path / f".epd-shared-{token}-{i}"), f"{token} {i}") for i in indexes]
        hint = (
            "its connector needs one directory every node of the topology and the harness "
            "see (--ray-shared-dir DIR on a shared filesystem)"
        )

        def on_each_node(probe: Callable[[tuple[str, str]], tuple], writer: str) -> None:
            """Each member's agent runs `storage_probe(*probe(its own file))`; the first node
            with a problem refuses the topology."""
            answers = _get(
                [
                    self._agents[i].storage_probe.remote(*probe(own))
                    for i, own in zip(indexes, theirs)
                ],
                f"probing {label} {path} on the nodes",
            )
            for spec, problem in zip(members, answers):
                if problem:
                    raise LaunchRefused(
                        f"{label} {path} is not shared: {spec.name}'s node {spec.host} does not "
                        f"see what {writer} wrote there ({problem}); {hint}"
                    )

        try:
            Path(mine[0]).write_text(mine[1], encoding="utf-8")
            on_each_node(lambda own: ([mine], own), "the harness")
            on_each_node(lambda own: ([t for t in theirs if t != own], None), "another node")
            for (probe, expected), spec in zip(theirs, members):
                try:
                    same = Path(probe).read_text(encoding="utf-8") == expected
                except OSError:
                    same = False
                if not same:
                    raise LaunchRefused(
                        f"{label} {path} is not shared: the harness does not see what "
                        f"{spec.name}'s node {spec.host} wrote there; {hint}"
                    )
        finally:
            for probe, _ in [mine, *theirs]:
                Path(probe).unlink(missing_ok=True)
