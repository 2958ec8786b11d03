"""What runs on a Ray node for one instance, apart from the harness's side of it: the agent
(`InstanceAgent`), an actor Ray places in the instance's bundle and builds there from this
module, and the settings it must be given.

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
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import uuid
from pathlib import Path
from typing import Any

import psutil
import ray

from harness.devices import GpuCapability, smi_compute_capabilities
from harness.serve.launch import ManagedServer
from harness.serve.ports import PortLease, reserve_ports
from harness.serve.ray_cluster import USAGE_STATS_ENV
from harness.serve.server_command import ServerCommand
from harness.spec.inherited_env import numerics_env

KILL_CHILDREN_ENV = "RAY_kill_child_processes_on_worker_exit"
# Given to every agent: its children (server leader, watchdog) must outlive it (see above).
AGENT_ENV = {KILL_CHILDREN_ENV: "0", USAGE_STATS_ENV: "0"}
LOG_CHUNK_BYTES = 4 * 1024 * 1024  # log bytes one poll brings back
CONNECT_TIMEOUT_S = 5.0


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
            # What a server this agent starts inherits that can change what it computes: the
            # node's environment, not the harness's (recorded in the instance's `.cmd.json`).
            "inherited": numerics_env(os.environ),
        }

    def reserve(self, address: str, side_channel: bool) -> tuple[int, int | None]:
        """An HTTP port (and a NIXL side-channel port) held on this node, at `address`."""
        self.leases = reserve_ports(2 if side_channel else 1, host=address)
        return self.leases[0].port, self.leases[1].port if side_channel else None

    def check_executable(self, executable: str) -> str | None:
        """None if `executable` can be run here, else why not."""
        found = shutil.which(executable)
        return None if found else f"{executable} is not an executable on this node"

    def compute_capabilities(self) -> list[GpuCapability] | None:
        """Every GPU of this node with its compute capability (None where nvidia-smi cannot
        say), by nvidia-smi's index: how the instance's CUDA_VISIBLE_DEVICES, the accelerator
        ids `where` reports, numbers them (CUDA_DEVICE_ORDER=PCI_BUS_ID). The harness's host
        cannot read a node's GPUs."""
        return smi_compute_capabilities()

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
        # The exit status before the log, as a local server's check reads them: an exit seen
        # after the log was read may come with its last lines (its traceback) left unread.
        exit_code = server.exit_code
        try:
            with open(server.command.log_path, "rb") as log_file:
                log_file.seek(offset)
                data = log_file.read(LOG_CHUNK_BYTES)
        except FileNotFoundError:
            data = b""
        return {"exit": exit_code, "data": data, "rss": rss, "cpu": cpu}

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
                self.server.mark_ready()  # a serving server gets its full grace
            self.server.stop(grace_s)
        for lease in self.leases:
            lease.release()

    def discard(self) -> None:
        """Remove the node-side log, once the harness has fetched all of it."""
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


RemoteAgent = ray.remote(InstanceAgent)
