"""The seam between a topology session and wherever its servers run.

A `TopologySession` asks its launcher for four things, in this order: where each instance goes
(`reserve`: its address, a held HTTP port, a held NIXL side-channel port, its node, on GPU
nodes its devices, and what it inherits there that can change what it computes), what
environment it gets (`instance_env`), whether the rendered commands may start at all
(`check_before_start`), and a server object for each (`server`): something with a URL to poll,
a log, `check_alive()` and `stop()`, i.e. the interface of
`harness.serve.launch.ManagedServer`. Once every server is healthy, `check_serving` verifies
what can only be seen from running servers, before any request. Everything downstream (the
proxy, the taps, the guards, the verdicts, the bundle) sees only URLs, logs and outcomes, so it
cannot tell which launcher ran.

Two launchers:

* `LocalLauncher` (`--launcher local`, the default): every server is a subprocess of the
  harness on this host, bound to 127.0.0.1, exactly as before the seam existed;
* `harness.serve.ray_launcher.RayLauncher` (`--launcher ray`): each server is started by a Ray
  actor on a node of a cluster, by that same local launcher, there. It is imported only when
  chosen, so `ray` is needed only then.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.errors import HarnessError
from harness.serve.launch import ManagedServer
from harness.serve.ports import PortLease, lease_devices, reserve_ports
from harness.serve.server_command import ServerCommand
from harness.spec.inherited_env import numerics_env
from harness.spec.instances import InstanceSpec
from harness.spec.placement import side_channel_port_count
from harness.spec.settings import RunSettings
from harness.spec.topology import Topology


class LaunchRefused(HarnessError):
    """A topology's rendered instances may not start where they were placed (a network
    invariant, storage that is not shared, a node without the served vLLM): one line naming
    the instance and the cause. Its topology's cases come out ERROR with it; a baseline that
    cannot start ends the run with exit code 2."""


@dataclass(frozen=True)
class NodeInfo:
    """Where an instance landed, as its launcher read it back there."""

    address: str  # the node's address: what the instance binds and peers reach
    node_id: str = ""  # Ray's node id ("" on this host)
    hostname: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"address": self.address, "node_id": self.node_id, "hostname": self.hostname}


@dataclass
class Reservation:
    """A topology's instances, placed: one entry per instance, in role order."""

    hosts: list[str]
    ports: list[int]
    side_channel_ports: list[int]  # one per NIXL instance, in role order
    nodes: list[NodeInfo | None] = field(default_factory=list)
    # Devices per instance from the launcher (Ray's accelerator ids on a GPU node); None: the
    # schedule's (harness.spec.placement).
    devices: list[tuple[int, ...]] | None = None
    # Per instance, what it inherits from the environment it is started in that can change
    # what it computes (`harness.spec.inherited_env.numerics_env`), recorded in its `.cmd.json`;
    # empty: nothing known.
    inherited: list[dict[str, str]] = field(default_factory=list)


class LocalLauncher:
    """Today's launcher: subprocesses of the harness on this host, ports held by leases."""

    kind = "local"

    def __init__(self, settings: RunSettings) -> None:
        self.settings = settings
        self._port_leases: list[PortLease] = []
        self._side_channel_leases: list[PortLease] = []
        self._device_leases: list[PortLease] = []

    def storage_root(self, session_dir: Path) -> Path:
        """Where the topology's connector storage lives: its own artifact directory."""
        return session_dir

    def reserve(
        self,
        topology: Topology,
        devices: tuple[int, ...],
        before_device_wait: Callable[[], None] | None = None,
    ) -> Reservation:
        """Hold the ports (and on GPUs the devices) the topology's instances will bind;
        `before_device_wait` is called before waiting for a device another process holds."""
        settings = self.settings
        if settings.platform.exclusive_devices:
            self._device_leases = lease_devices(
                settings.platform.name, devices, before_wait=before_device_wait
            )
        self._port_leases = reserve_ports(len(topology.roles))
        side_channels = side_channel_port_count(topology, settings.serving)
        self._side_channel_leases = reserve_ports(side_channels) if side_channels else []
        return Reservation(
            hosts=[],  # loopback: InstanceSpec's default
            ports=[lease.port for lease in self._port_leases],
            side_channel_ports=[lease.port for lease in self._side_channel_leases],
            # Started by `ManagedServer` with this process's environment under their own.
            inherited=[numerics_env(os.environ) for _ in topology.roles],
        )

    def instance_env(self, spec: InstanceSpec) -> dict[str, str]:
        return spec.env()

    def check_before_start(
        self, topology: Topology, instances: list[InstanceSpec], commands: list[ServerCommand]
    ) -> None:
        """Hand the side-channel ports over (NIXL binds them itself; the flock keeps other
        workers off). On one host nothing else can be wrong with the network."""
        for lease in self._side_channel_leases:
            lease.hand_over()

    def server(self, index: int, command: ServerCommand) -> ManagedServer:
        return ManagedServer(command, port_lease=self._port_leases[index])

    def check_serving(self, instances: list[InstanceSpec]) -> None:
        """Nothing to check: every address is this host's loopback."""

    def check_revivable(self) -> None:
        """A dead instance may be started again in place (`TopologySession.revive_dead`): its
        port lease passes to the new server on this host."""

    def close(self) -> None:
        """Give every lease back (a server's own lease is released by its stop())."""
        leases = (*self._port_leases, *self._side_channel_leases, *self._device_leases)
        self._port_leases, self._side_channel_leases, self._device_leases = [], [], []
        for lease in leases:
            lease.release()


def end_launchers() -> None:
    """Close what a launcher holds beyond one topology: the Ray connection and the rehearsal
    cluster this harness started (a no-op when Ray was never used)."""
    ray_runtime = sys.modules.get("harness.serve.ray_runtime")
    if ray_runtime is not None:
        ray_runtime.close_runtime()
