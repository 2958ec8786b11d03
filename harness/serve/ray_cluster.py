"""A Ray cluster of several nodes on this one host: the rehearsal of a multi-node run.

`epd-harness run --launcher ray` without `--ray-address` starts one (three nodes, on 127.0.0.2,
127.0.0.3 and 127.0.0.4; a node more for each instance a run keeps up beyond three, as a fuzz
of 1E+1P+1D does with its baseline) for the run and stops it afterwards; the e2e scenarios do
the same.
Why those addresses: Ray rewrites a node address of 127.0.0.1 or `localhost` to the host's
routable address, and a driver then hangs retrying it; other loopback addresses are taken as
given, and each node, and each actor on it, reports its own.

Every node is one `ray start --block` process, launched like a vLLM server
(`harness.serve.launch.ManagedServer`): in its own session, watched by the harness's watchdog,
and stopped by its process group and the descendants recorded while it ran (Ray's workers sit
in process groups of their own), never by `ray stop`, which kills every Ray process on the
machine, other people's included. A harness that is SIGKILLed therefore takes its rehearsal
cluster with it too. Each node gets ports reserved through `harness.serve.ports` and a Ray
temp directory per node, removed at the end; usage statistics are off.

All loopback addresses share one `lo`: on them a side channel announced as `localhost` still
works, so a forgotten host setting passes unnoticed. With `netns=True` each node runs in a
network namespace of its own instead (iproute2, nsenter and CAP_NET_ADMIN needed), joined by a
bridge in a further namespace, with addresses that exist only inside those namespaces. There
`localhost` is the node itself, as on a real cluster. The namespaces are held by processes of
the run, not named, so they vanish with it however it ends (`Netns`). The driver (the harness)
must run inside the head's namespace (`driver_prefix`), so that rehearsal is used from a
subprocess: `python -m harness.serve.ray_cluster up --netns` starts one and says how.
`private_dir` gives every node but the head a private, empty tmpfs at that path (a mount
namespace per node): a directory that looks the same everywhere and is shared by nobody, which
is how a node-local disk looks to a connector that needs shared storage.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from harness.environment import LOOPBACK_HOST
from harness.errors import HarnessError
from harness.serve.launch import ManagedServer, ServerDied
from harness.serve.ports import PortLease, reserve_ports
from harness.serve.server_command import ServerCommand
from harness.serve.server_group import stop_through_interrupts
from harness.serve.signal_handlers import install_signal_handlers
from harness.spec.settings import REHEARSAL_NODES


def rehearsal_addresses(nodes: int) -> tuple[str, ...]:
    """The loopback addresses of a rehearsal cluster of `nodes` nodes: 127.0.0.2 and up."""
    return tuple(f"127.0.0.{2 + index}" for index in range(nodes))


REHEARSAL_ADDRESSES = rehearsal_addresses(REHEARSAL_NODES)
NODE_START_TIMEOUT_S = 90.0
NODE_STOP_GRACE_S = 5.0  # `ray start --block` takes its time on SIGTERM; then SIGKILL
STARTED_MARK = "Ray runtime started"
# Ray's own words when a worker's raylet did not register with the GCS within the 30 s
# `ray._private.node.Node` waits (hard-coded in Ray 2.60): seen when three workers of the netns
# rehearsal registered at once on a loaded 2-core host (load average 8), one of them started.
# Such a node is started once more, alone: the GCS has then only it to register.
RAY_REGISTRATION_TIMEOUT = "The current node timed out during startup"
WORKER_START_ATTEMPTS = 2
USAGE_STATS_ENV = "RAY_USAGE_STATS_ENABLED"
# Ports of one node: node manager, object manager, runtime-env agent, dashboard agent (gRPC and
# HTTP) and metrics export; the head adds the GCS, the Ray client server and the dashboard.
NODE_PORTS = 6
HEAD_PORTS = 3
IP, NSENTER, UNSHARE = "ip", "nsenter", "unshare"
CLONE_NEWNS = 0x00020000
MS_REC, MS_PRIVATE = 0x4000, 1 << 18
log = logging.getLogger(__name__)


class ClusterError(HarnessError):
    """The rehearsal cluster could not be set up (one line naming the node and why)."""


class Netns:
    """The network namespaces of a rehearsal: one per node plus a hub holding the bridge.

    Each namespace belongs to a holder process (`unshare --net sleep infinity`, managed like a
    server): nothing names it in /var/run/netns, so it vanishes with the last process inside
    it, even when the harness and everything it started were SIGKILLed; nothing to clean up.
    """

    def __init__(self, subnet: str, nodes: int, work_dir: Path) -> None:
        self.subnet = subnet  # "10.77.<n>": a /24 that exists only inside these namespaces
        self.nodes = nodes
        self.work_dir = work_dir
        self.holders: list[ManagedServer] = []  # the hub's, then one per node

    def address(self, index: int) -> str:
        return f"{self.subnet}.{index + 1}"

    def exec_prefix(self, index: int) -> list[str]:
        """argv prefix that runs a command in node `index`'s namespace."""
        return [NSENTER, "-t", str(self.holders[1 + index].pid), "-n"]

    def create(self) -> None:
        """The namespaces, a bridge in the hub and a veth pair per node; lo up everywhere."""
        for name in ["hub", *(f"n{i}" for i in range(self.nodes))]:
            holder = ManagedServer(
                ServerCommand(
                    name=f"netns-{name}",
                    argv=[UNSHARE, "--net", "sleep", "infinity"],
                    health_url="",
                    log_path=self.work_dir / f"netns-{name}.log",
                )
            )
            # Listed before its start: a start can raise after the spawn (a Ctrl-C held back
            # during it), and `remove` stops only the holders listed here.
            self.holders.append(holder)
            holder.start()
        deadline = time.monotonic() + 10.0
        while not all(self._in_own_netns(h) for h in self.holders):
            for holder in self.holders:
                holder.check_alive()
            if time.monotonic() > deadline:
                raise ClusterError("the network namespaces' holders did not start in 10 s")
            time.sleep(0.05)
        hub = str(self.holders[0].pid)
        self._run(hub, IP, "link", "add", "br0", "type", "bridge")
        self._run(hub, IP, "link", "set", "br0", "up")
        for index in range(self.nodes):
            node, peer = str(self.holders[1 + index].pid), f"h{index}"
            self._run(node, IP, "link", "set", "lo", "up")
            self._run(
                node, IP, "link", "add", "eth0", "type", "veth", "peer", "name", peer, "netns", hub
            )
            self._run(node, IP, "addr", "add", f"{self.address(index)}/24", "dev", "eth0")
            self._run(node, IP, "link", "set", "eth0", "up")
            self._run(hub, IP, "link", "set", peer, "master", "br0")
            self._run(hub, IP, "link", "set", peer, "up")

    def remove(self, interrupts: list[BaseException]) -> list[str]:
        """Stop the holders: each namespace goes with its last process. Returns failures; an
        interrupt in a stop is added to `interrupts` and the stop retried (the others still
        stop)."""
        failed = []
        for holder in reversed(self.holders):
            try:
                if not stop_through_interrupts(holder, 1.0, interrupts):
                    failed.append(f"{holder.name} may still run: each of its stops was interrupted")
            except Exception as exc:  # noqa: BLE001 - the others must still stop
                failed.append(str(exc))
        self.holders = []
        return failed

    @staticmethod
    def _in_own_netns(holder: ManagedServer) -> bool:
        """Whether the holder's unshare has happened (its netns differs from ours)."""
        try:
            return os.readlink(f"/proc/{holder.pid}/ns/net") != os.readlink("/proc/self/ns/net")
        except OSError:
            return False

    @staticmethod
    def _run(pid: str, *argv: str) -> None:
        done = subprocess.run([NSENTER, "-t", pid, "-n", *argv], capture_output=True, text=True)
        if done.returncode != 0:
            raise ClusterError(f"{' '.join(argv)} (netns of {pid}): {done.stderr.strip()}")


@dataclass
class Node:
    address: str
    head: bool
    server: ManagedServer
    leases: list[PortLease] = field(default_factory=list)


class LocalRayCluster:
    """Ray nodes on this host, started and stopped by the harness (by pid, never `ray stop`).

        with LocalRayCluster(run_dir / "ray-cluster") as cluster:
            ray.init(address=cluster.address, _node_ip_address=cluster.driver_address)

    `head_cpus` 0 keeps instances off the head (the netns rehearsal's head hosts only the
    driver); `cpus_per_node` is Ray's accounting, one instance per CPU bundle, not cores.
    """

    def __init__(
        self,
        work_dir: Path,
        addresses: tuple[str, ...] = REHEARSAL_ADDRESSES,
        *,
        netns: bool = False,
        private_dir: Path | None = None,
        cpus_per_node: int = 1,
        head_cpus: int | None = None,
        python: str = sys.executable,
    ) -> None:
        self.work_dir = work_dir
        self.python = python
        self.private_dir = private_dir
        self.cpus_per_node = cpus_per_node
        self.tag = secrets.token_hex(3)
        self.netns: Netns | None = None
        if netns:
            # The head (the driver's node) plus one node per instance address asked for.
            subnet = f"10.77.{secrets.randbelow(256)}"
            self.netns = Netns(subnet, 1 + len(addresses), work_dir)
            addresses = tuple(self.netns.address(i) for i in range(self.netns.nodes))
        self.addresses = addresses
        self.head_cpus = cpus_per_node if head_cpus is None else head_cpus
        if netns and head_cpus is None:
            self.head_cpus = 0
        # One per node, as on separate machines: nodes starting together in one temp dir race
        # for the same socket names. Short: socket paths are limited to 107 bytes.
        self.temp_dirs = [Path(f"/tmp/epdray-{self.tag}-{i}") for i in range(len(addresses))]
        self.nodes: list[Node] = []
        self.gcs_port: int | None = None

    @property
    def address(self) -> str:
        assert self.gcs_port is not None, "start() first"
        return f"{self.addresses[0]}:{self.gcs_port}"

    @property
    def driver_address(self) -> str:
        """The node address a driver on this cluster uses: the head's."""
        return self.addresses[0]

    @property
    def instance_nodes(self) -> int:
        """Nodes an instance can land on."""
        return len(self.addresses) - (1 if self.head_cpus == 0 else 0)

    def driver_prefix(self) -> list[str]:
        """The argv prefix that runs a driver where it can reach the cluster (netns: the
        head's namespace; loopback: nothing)."""
        return self.netns.exec_prefix(0) if self.netns else []

    def __enter__(self) -> LocalRayCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_s: float = NODE_START_TIMEOUT_S) -> None:
        """Start the head; once it runs, every other node at once; return once each has said
        it runs. A node that dies fails the start at once, with its log tail, except a worker
        Ray itself gave up on while it registered (`RAY_REGISTRATION_TIMEOUT`), which is
        started again, alone, once; its first log is kept beside the second."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        if self.netns is not None:
            self.netns.create()
        deadline = time.monotonic() + timeout_s
        self.nodes.append(self._start_node(0, self.addresses[0]))
        self._wait_started(self.nodes[0], deadline)
        for index, address in enumerate(self.addresses[1:], start=1):
            self.nodes.append(self._start_node(index, address))
        for index in range(1, len(self.nodes)):
            for attempt in range(1, WORKER_START_ATTEMPTS + 1):
                try:
                    self._wait_started(self.nodes[index], deadline)
                    break
                except ServerDied as died:
                    if attempt == WORKER_START_ATTEMPTS or RAY_REGISTRATION_TIMEOUT not in str(
                        died
                    ):
                        raise
                    self._restart_worker(index, attempt)

    def _restart_worker(self, index: int, attempt: int) -> None:
        node = self.nodes[index]
        log_path = node.server.command.log_path
        kept = log_path.with_name(f"{log_path.stem}.attempt{attempt}{log_path.suffix}")
        log.warning(
            "Ray node %s did not register with the head in Ray's 30 s (a loaded host): "
            "starting it again alone; its first log: %s",
            node.address,
            kept,
        )
        node.server.stop(NODE_STOP_GRACE_S)  # what the dead `ray start` left in its group
        for lease in node.leases:
            lease.release()
        log_path.replace(kept)
        self.nodes[index] = self._start_node(index, node.address)

    def _wait_started(self, node: Node, deadline: float) -> None:
        """Wait for the node's "started" line; then mark it ready (its readiness is not a
        health URL), so its stop gets NODE_STOP_GRACE_S, not the start-up grace."""
        while STARTED_MARK not in node.server.log_tail(200):
            node.server.check_alive()
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"Ray node {node.address} has not started in time; last lines of "
                    f"{node.server.command.log_path}:\n{node.server.log_tail(20)}"
                )
            time.sleep(0.3)
        node.server.mark_ready()

    def sample(self) -> None:
        """Record every node's descendants now (Ray's workers leave the node's process group):
        what `stop()` and the watchdog reach besides the group."""
        for node in self.nodes:
            if node.server.is_alive():
                node.server.peak_rss_bytes()

    def check_alive(self) -> None:
        """Raise ServerDied, with its log tail, for the first node that is no longer running."""
        for node in self.nodes:
            node.server.check_alive()

    def memory_bytes(self) -> dict[str, int]:
        """Summed RSS of each node's process tree now (workers, agents and what they run
        included; pages shared between processes count once per process)."""
        self.sample()
        sizes = {}
        for node in self.nodes:
            total = 0
            try:
                root = psutil.Process(node.server.pid)
                for proc in [root, *root.children(recursive=True)]:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        total += proc.memory_info().rss
            except psutil.NoSuchProcess:
                pass
            sizes[node.address] = total
        return sizes

    def stop(self) -> None:
        """Stop every node (workers first, the head last), release their ports, remove the
        namespaces and the temp directory. Every step runs even if one fails, or a Ctrl-C lands
        in it (that stop is retried without grace, as `ServerGroup.stop_all` does; the
        interrupt is raised at the end)."""
        failures: list[str] = []
        interrupts: list[BaseException] = []
        self.sample()
        for node in reversed(self.nodes):
            try:
                if not stop_through_interrupts(node.server, NODE_STOP_GRACE_S, interrupts):
                    failures.append(
                        f"Ray node {node.address} may still run: each of its stops was interrupted"
                    )
            except Exception as exc:  # noqa: BLE001 - the other nodes must still stop
                failures.append(str(exc))
            for lease in node.leases:
                lease.release()
        self.nodes = []
        if self.netns is not None:
            failures += self.netns.remove(interrupts)
        for temp_dir in self.temp_dirs:
            shutil.rmtree(temp_dir, ignore_errors=True)
        if interrupts:
            for failure in failures:
                interrupts[0].add_note(f"stopping the rehearsal cluster: {failure}")
            raise interrupts[0]
        if failures:
            raise ClusterError("stopping the rehearsal cluster: " + "; ".join(failures))

    def _start_node(self, index: int, address: str) -> Node:
        head = index == 0
        # In a namespace the node's address does not exist here: the flock alone holds them.
        probe_host = LOOPBACK_HOST if self.netns else address
        leases = reserve_ports(NODE_PORTS + (HEAD_PORTS if head else 0), host=probe_host)
        ports = iter(lease.port for lease in leases)
        argv = [self.python, "-m", "ray.scripts.scripts", "start", "--block"]
        if head:
            self.gcs_port = next(ports)
            argv += ["--head", "--port", str(self.gcs_port)]
            argv += ["--ray-client-server-port", str(next(ports))]
            argv += ["--include-dashboard", "false", "--dashboard-port", str(next(ports))]
        else:
            argv += ["--address", f"{self.addresses[0]}:{self.gcs_port}"]
        argv += [
            "--node-ip-address",
            address,
            "--num-cpus",
            str(self.head_cpus if head else self.cpus_per_node),
            "--temp-dir",
            str(self.temp_dirs[index]),
            "--disable-usage-stats",
            "--min-worker-port",
            "0",
            "--max-worker-port",
            "0",
        ]
        for flag in (
            "--node-manager-port",
            "--object-manager-port",
            "--runtime-env-agent-port",
            "--dashboard-agent-grpc-port",
            "--dashboard-agent-listen-port",
            "--metrics-export-port",
        ):
            argv += [flag, str(next(ports))]
        if self.private_dir is not None and not head:
            argv = [
                self.python,
                "-m",
                "harness.serve.ray_cluster",
                "private-mount",
                str(self.private_dir),
                "--",
                *argv,
            ]
        if self.netns is not None:
            argv = [*self.netns.exec_prefix(index), *argv]
        name = f"ray-node-{address}"
        command = ServerCommand(
            name=name,
            argv=argv,
            health_url="",  # readiness is the node's own "started" line (start())
            log_path=self.work_dir / f"{name}.log",
            env={USAGE_STATS_ENV: "0"},
            scratch_dir=self.temp_dirs[index],  # the watchdog's to remove after a SIGKILL
        )
        server = ManagedServer(command)
        try:
            for lease in leases:
                lease.hand_over()
            server.start()
        except BaseException:  # not a node yet: the cluster's stop would not see it
            try:
                if server.pid is not None:  # spawned, then failed (a Ctrl-C, the watchdog)
                    server.stop(0.0)
            finally:
                for lease in leases:
                    lease.release()
            raise
        return Node(address, head, server, leases)


def private_mount(directory: str, argv: list[str]) -> None:
    """Run argv in a mount namespace of its own with an empty tmpfs at `directory`: the same
    path as everywhere else, seen by nobody else. Linux only; needs CAP_SYS_ADMIN."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        raise OSError(ctypes.get_errno(), "making / private")
    Path(directory).mkdir(parents=True, exist_ok=True)
    if libc.mount(b"epd-private", directory.encode(), b"tmpfs", 0, b"size=64m") != 0:
        raise OSError(ctypes.get_errno(), f"mounting a tmpfs at {directory}")
    os.execvp(argv[0], argv)


def main(argv: list[str] | None = None) -> int:
    """`up`: start a rehearsal cluster, print how to use it, wait for SIGINT / SIGTERM or a
    node's death, stop it.
    `private-mount DIR -- ARGV...`: how a node of a cluster with `private_dir` starts."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["private-mount"] and "--" in argv:
        split = argv.index("--")
        private_mount(argv[1], argv[split + 1 :])
    parser = argparse.ArgumentParser(prog="python -m harness.serve.ray_cluster")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a one-host Ray cluster; Ctrl-C or SIGTERM stops it")
    up.add_argument("--netns", action="store_true", help="each node in a network namespace")
    up.add_argument("--private-dir", help="a path every node but the head sees as its own tmpfs")
    up.add_argument("--work-dir", default="runs/ray-cluster", help="the nodes' logs")
    up.add_argument("--ready-file", help="once the nodes run: address, driver prefix, nodes")
    args = parser.parse_args(argv)
    install_signal_handlers()
    private = Path(args.private_dir) if args.private_dir else None
    cluster = LocalRayCluster(Path(args.work_dir).resolve(), netns=args.netns, private_dir=private)
    try:
        cluster.start()
        prefix = " ".join(cluster.driver_prefix())
        print(f"ray cluster up: address {cluster.address}", flush=True)
        print(f"run a driver there with: {prefix or '(no prefix)'}", flush=True)
        if args.ready_file:
            Path(args.ready_file).write_text(
                f"{cluster.address}\n{prefix}\n{cluster.instance_nodes}\n", encoding="utf-8"
            )
        while True:  # a node that dies ends `up` at once, with its log tail
            time.sleep(1)
            cluster.check_alive()
            cluster.sample()
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
