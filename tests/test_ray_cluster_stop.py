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

from harness.serve.ray_cluster import LocalRayCluster, Node

pytestmark = pytest.mark.unit


class FakeNodeServer:
    """A node's server whose stop is interrupted `interrupts` times before it succeeds."""

    def __init__(self, interrupts: int = 0) -> None:
        self.interrupts = interrupts
        self.stopped = False

    def is_alive(self) -> bool:
        return not self.stopped

    def peak_rss_bytes(self) -> int:
        return 0

    def stop(self, grace_s: float) -> None:
        if self.interrupts:
            self.interrupts -= 1
            raise KeyboardInterrupt
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
