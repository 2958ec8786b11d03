"""The network namespaces of the netns rehearsal (`harness.serve.ray_cluster.Netns`) with fake
holders, so no namespace, process or Ray is involved: every holder that was spawned is stopped
when the start fails, whenever it fails.

Why: a holder is a server like any other (`ManagedServer`), and its `start()` can raise after
the spawn (a Ctrl-C held back during the spawn by `signals_deferred` is raised once the child
is recorded). A holder the namespaces do not list is never stopped by `Netns.remove`, and its
namespace stays until the harness itself exits.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from harness.environment import LOOPBACK_HOST
from harness.serve import ray_cluster
from harness.serve.launch import ServerDied
from harness.serve.ray_cluster import ClusterError, LocalRayCluster, Netns

pytestmark = pytest.mark.unit


class FakeHolder:
    """A holder whose start spawns (it gets a pid) and may then raise, as a deferred Ctrl-C
    makes `ManagedServer.start` do."""

    spawned: list[FakeHolder] = []
    interrupt_at = ""

    def __init__(self, command) -> None:
        self.command = command
        self.pid: int | None = None
        self.stopped = False

    def start(self) -> None:
        self.pid = 4000 + len(FakeHolder.spawned)
        FakeHolder.spawned.append(self)
        if self.command.name == FakeHolder.interrupt_at:
            raise KeyboardInterrupt

    def stop(self, grace_s: float) -> None:
        self.stopped = True


def test_a_holder_interrupted_right_after_its_spawn_is_stopped_with_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ray_cluster, "ManagedServer", FakeHolder)
    monkeypatch.setattr(FakeHolder, "spawned", [])
    monkeypatch.setattr(FakeHolder, "interrupt_at", "netns-n1")
    cluster = LocalRayCluster(tmp_path / "nodes", netns=True)
    with pytest.raises(KeyboardInterrupt):
        with cluster:
            pass
    names = [holder.command.name for holder in FakeHolder.spawned]
    assert names == ["netns-hub", "netns-n0", "netns-n1"]
    assert [h.command.name for h in FakeHolder.spawned if not h.stopped] == []


PID_MAX_LIMIT = 2**22  # Linux's highest pid_max: no process has a larger pid


class LiveHolder(FakeHolder):
    """A holder that runs; its namespace is ours until `unshared` (its unshare not yet done).
    When `dies` (unshare refused: no CAP_SYS_ADMIN), every holder has exited, so no namespace
    of theirs can be read, and netns-n0's death is the first seen."""

    unshared = True
    dies = False

    def start(self) -> None:
        super().start()
        if LiveHolder.dies:
            self.pid = PID_MAX_LIMIT + len(FakeHolder.spawned)  # no such process
        elif not LiveHolder.unshared:
            self.pid = os.getpid()  # a process whose network namespace is this one's

    def check_alive(self) -> None:
        if LiveHolder.dies and self.command.name == "netns-n0":
            raise ServerDied("netns-n0 (pid 4001) died during startup: exit code 1", "netns-n0")


def netns_of(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, failing: str = "", **holder: bool
) -> Netns:
    """Netns of two nodes with LiveHolders (`holder`: its class attributes), whose `ip`
    commands are recorded in `ran`, not run (`failing`: the pid whose `eth0 up` fails); the
    clock moves 1 s per sleep. An unshared holder's fake pid is taken as in its own netns."""
    monkeypatch.setattr(ray_cluster, "ManagedServer", LiveHolder)
    monkeypatch.setattr(FakeHolder, "spawned", [])
    for name, value in holder.items():
        monkeypatch.setattr(LiveHolder, name, value)
    if LiveHolder.unshared:
        monkeypatch.setattr(Netns, "_in_own_netns", staticmethod(lambda h: True))
    clock = [0.0]
    monkeypatch.setattr(ray_cluster.time, "monotonic", lambda: clock[0])

    def sleep(seconds: float) -> None:
        clock[0] += 1.0
        assert clock[0] < 100, "still waiting for the holders after 100 s"

    monkeypatch.setattr(ray_cluster.time, "sleep", sleep)
    netns = Netns("10.77.5", 2, tmp_path)
    netns.ran = []  # type: ignore[attr-defined]

    def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        netns.ran.append(argv)  # type: ignore[attr-defined]
        fails = " ".join(argv).endswith("eth0 up") and argv[2] == failing
        stderr = "RTNETLINK answers: Operation not permitted\n" if fails else ""
        return subprocess.CompletedProcess(argv, int(fails), "", stderr)

    monkeypatch.setattr(ray_cluster.subprocess, "run", run)
    return netns


def test_each_node_gets_its_own_namespace_address_and_link_and_a_failed_command_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node i is the holder after the hub, at <subnet>.i+1 (.0 is no host address); every
    `ip` command of a node runs in that node's namespace, the bridge's in the hub's; a
    command that fails ends the set-up naming it, the namespace and what `ip` said."""
    netns = netns_of(monkeypatch, tmp_path)
    netns.create()
    assert [netns.address(i) for i in range(2)] == ["10.77.5.1", "10.77.5.2"]
    assert [netns.exec_prefix(i) for i in range(2)] == [
        ["nsenter", "-t", "4001", "-n"],
        ["nsenter", "-t", "4002", "-n"],
    ]
    addresses = [(argv[2], argv[7]) for argv in netns.ran if argv[5:7] == ["addr", "add"]]
    assert addresses == [("4001", "10.77.5.1/24"), ("4002", "10.77.5.2/24")]
    assert [argv[2] for argv in netns.ran if "br0" in argv] == ["4000"] * 4
    failing = netns_of(monkeypatch, tmp_path / "failing", failing="4002")
    with pytest.raises(ClusterError) as failed:
        failing.create()
    assert str(failed.value) == (
        "ip link set eth0 up (netns of 4002): RTNETLINK answers: Operation not permitted"
    )


def test_no_ip_command_runs_before_every_holder_is_in_a_namespace_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A holder still in this namespace (its unshare not done) is waited for: an `ip` command
    then would change this host's own network. A holder that dies ends the wait at once with
    its own death (its log says why), though the dead have no namespace to compare; one that
    never unshares ends it after 10 s."""
    dying = netns_of(monkeypatch, tmp_path, unshared=False, dies=True)
    with pytest.raises(ServerDied, match="netns-n0 .* died during startup"):
        dying.create()
    assert dying.ran == []  # type: ignore[attr-defined]
    stuck = netns_of(monkeypatch, tmp_path / "stuck", unshared=False, dies=False)
    with pytest.raises(ClusterError, match="holders did not start in 10 s"):
        stuck.create()
    assert stuck.ran == []  # type: ignore[attr-defined]


class FakeLease:
    def __init__(self, port: int) -> None:
        self.port = port

    def hand_over(self) -> int:
        return self.port

    def release(self) -> None:
        pass


def test_a_netns_node_reserves_its_ports_on_loopback_and_starts_in_its_namespace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node's address in a namespace does not exist in this one: its ports are reserved on
    loopback (the lock files alone hold them; a probe bound to 10.77.x.y here fails), and its
    `ray start` runs in its own namespace, joining the head at the head's address there."""
    hosts: list[str] = []

    def reserve_ports(count: int, *, host: str) -> list[FakeLease]:
        hosts.append(host)
        return [FakeLease(7000 + 10 * len(hosts) + i) for i in range(count)]

    monkeypatch.setattr(ray_cluster, "reserve_ports", reserve_ports)
    monkeypatch.setattr(ray_cluster, "ManagedServer", FakeHolder)
    monkeypatch.setattr(FakeHolder, "spawned", [])
    cluster = LocalRayCluster(tmp_path / "nodes", netns=True)
    assert cluster.netns is not None
    cluster.netns.holders = [FakeHolder(None) for _ in range(5)]  # type: ignore[misc]
    for index, holder in enumerate(cluster.netns.holders):
        holder.pid = 4100 + index
    head = cluster._start_node(0, cluster.addresses[0])
    worker = cluster._start_node(2, cluster.addresses[2])
    assert hosts == [LOOPBACK_HOST, LOOPBACK_HOST]
    head_argv, argv = list(head.server.command.argv), list(worker.server.command.argv)
    assert head_argv[:4] == ["nsenter", "-t", "4101", "-n"]
    assert argv[:4] == ["nsenter", "-t", "4103", "-n"]
    assert argv[argv.index("--address") + 1] == f"{cluster.addresses[0]}:{cluster.gcs_port}"
    assert argv[argv.index("--node-ip-address") + 1] == cluster.addresses[2]
