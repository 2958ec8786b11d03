"""How the one-host rehearsal cluster stops its nodes, with fake node servers, so no process or
Ray is involved: an interrupt that lands in one node's stop does not leave the others running.

Why: the cluster is stopped when the run ends (`end_launchers`), a stop of several seconds per
node; a Ctrl-C pressed meanwhile, the first one, is raised inside a node's stop. The servers of a
topology are stopped through such interrupts (`ServerGroup.stop_all`); the cluster's nodes, the
head included, must be too, and the interrupt is raised once every node is stopped.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.serve.ray_cluster import ClusterError, LocalRayCluster, Node

pytestmark = pytest.mark.unit


class FakeNodeServer:
    """A node's server whose stop is interrupted `interrupts` times before it succeeds."""

    stops: list[FakeNodeServer] = []  # every stop asked, in order

    def __init__(self, interrupts: int = 0, fails: str = "") -> None:
        self.interrupts = interrupts
        self.fails = fails  # what its stop raises, every time
        self.stopped = False

    def is_alive(self) -> bool:
        return not self.stopped

    def peak_rss_bytes(self) -> int:
        return 0

    def stop(self, grace_s: float) -> None:
        FakeNodeServer.stops.append(self)
        if self.interrupts:
            self.interrupts -= 1
            raise KeyboardInterrupt
        if self.fails:
            raise RuntimeError(self.fails)
        self.stopped = True


def test_a_ctrl_c_in_one_nodes_stop_still_stops_every_node_then_is_raised(
    tmp_path: Path,
) -> None:
    cluster = LocalRayCluster(tmp_path / "nodes")
    servers = [FakeNodeServer(), FakeNodeServer(), FakeNodeServer(interrupts=1)]
    cluster.nodes = [
        Node(address, index == 0, server)  # type: ignore[arg-type]
        for index, (address, server) in enumerate(zip(cluster.addresses, servers))
    ]
    with pytest.raises(KeyboardInterrupt):
        cluster.stop()
    assert [server.stopped for server in servers] == [True, True, True]
    assert cluster.nodes == []


def test_a_ctrl_c_in_one_namespace_holders_stop_still_removes_every_namespace(
    tmp_path: Path,
) -> None:
    cluster = LocalRayCluster(tmp_path / "nodes", netns=True)
    assert cluster.netns is not None
    holders = [FakeNodeServer(), FakeNodeServer(interrupts=1), FakeNodeServer()]
    cluster.netns.holders = holders  # type: ignore[assignment]
    with pytest.raises(KeyboardInterrupt):
        cluster.stop()
    assert [holder.stopped for holder in holders] == [True, True, True]


def test_a_node_or_namespace_that_would_not_stop_fails_the_stop_once_all_else_is_done(
    tmp_path: Path,
) -> None:
    """A node or a namespace holder that outlived SIGKILL is named in the stop's error, after
    every other node and holder was stopped and every node's temp directory removed: a stop
    that says nothing leaves a Ray node or a namespace behind unseen."""
    cluster = LocalRayCluster(tmp_path / "nodes", netns=True)
    assert cluster.netns is not None
    servers = [FakeNodeServer(), FakeNodeServer(fails="ray-node-10: survived SIGKILL")]
    servers += [FakeNodeServer(), FakeNodeServer()]
    cluster.nodes = [
        Node(address, index == 0, server)  # type: ignore[arg-type]
        for index, (address, server) in enumerate(zip(cluster.addresses, servers))
    ]
    holders = [FakeNodeServer(fails="netns-hub: survived SIGKILL"), FakeNodeServer()]
    cluster.netns.holders = holders  # type: ignore[assignment]
    for temp_dir in cluster.temp_dirs:
        (temp_dir / "session_latest").mkdir(parents=True)
    with pytest.raises(ClusterError) as failed:
        cluster.stop()
    assert str(failed.value) == (
        "stopping the rehearsal cluster: ray-node-10: survived SIGKILL; netns-hub: survived SIGKILL"
    )
    assert [server.stopped for server in servers] == [True, False, True, True]
    assert [holder.stopped for holder in holders] == [False, True]
    assert not [temp_dir for temp_dir in cluster.temp_dirs if temp_dir.exists()]


def test_the_workers_stop_before_the_head_and_the_namespaces_after_every_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers first and the head (their GCS) last, so no worker runs on without its head;
    the namespaces after every node, the hub last, so no node loses its network while it
    stops."""
    monkeypatch.setattr(FakeNodeServer, "stops", [])
    cluster = LocalRayCluster(tmp_path / "nodes", netns=True)
    assert cluster.netns is not None
    servers = [FakeNodeServer() for _ in cluster.addresses]
    cluster.nodes = [
        Node(address, index == 0, server)  # type: ignore[arg-type]
        for index, (address, server) in enumerate(zip(cluster.addresses, servers))
    ]
    holders = [FakeNodeServer() for _ in range(len(cluster.addresses) + 1)]
    cluster.netns.holders = holders  # type: ignore[assignment]
    cluster.stop()
    assert FakeNodeServer.stops == [*reversed(servers), *reversed(holders)]
