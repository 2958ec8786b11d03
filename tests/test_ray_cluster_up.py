"""`python -m harness.serve.ray_cluster up` with a fake cluster, so no process or Ray is
involved: a node that dies while the cluster is up ends `up` at once, naming the node.

Why: `up` holds the netns rehearsal for a driver in another process; a node that died there
left `up` waiting for a signal, and the driver found out only as a placement Ray could not make
or an agent lost, without the node's log tail.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.serve import ray_cluster
from harness.serve.launch import ServerDied
from harness.serve.ray_cluster import Node

pytestmark = pytest.mark.unit


class FakeNodeServer:
    def __init__(self, name: str, dead: bool) -> None:
        self.name = name
        self.dead = dead

    def is_alive(self) -> bool:
        return not self.dead

    def peak_rss_bytes(self) -> int:
        return 0

    def check_alive(self) -> None:
        if self.dead:
            raise ServerDied(f"{self.name} (pid 1) died while serving: exit code 1", self.name)


class FakeCluster:
    """Up at once; its second worker dies once it is up."""

    instances: list[FakeCluster] = []

    def __init__(self, work_dir: Path, **options: object) -> None:
        self.address = "127.0.0.2:6379"
        self.instance_nodes = 3
        self.nodes = [
            Node(a, a == "127.0.0.2", FakeNodeServer(f"ray-node-{a}", a == "127.0.0.4"))  # type: ignore[arg-type]
            for a in ("127.0.0.2", "127.0.0.3", "127.0.0.4")
        ]
        self.stopped = False
        FakeCluster.instances.append(self)

    def start(self) -> None:
        pass

    def driver_prefix(self) -> list[str]:
        return []

    def sample(self) -> None:
        for node in self.nodes:
            if node.server.is_alive():
                node.server.peak_rss_bytes()

    def check_alive(self) -> None:
        for node in self.nodes:
            node.server.check_alive()

    def stop(self) -> None:
        self.stopped = True


def test_a_node_that_dies_while_up_ends_up_naming_it(tmp_path: Path, monkeypatch) -> None:
    waits = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) > 5:
            raise AssertionError("up still waits with a dead node")

    monkeypatch.setattr(ray_cluster, "LocalRayCluster", FakeCluster)
    monkeypatch.setattr(FakeCluster, "instances", [])
    monkeypatch.setattr(ray_cluster, "install_signal_handlers", lambda: {})
    monkeypatch.setattr(ray_cluster.time, "sleep", sleep)
    with pytest.raises(ServerDied, match=r"ray-node-127\.0\.0\.4 .*died while serving"):
        ray_cluster.main(["up", "--work-dir", str(tmp_path / "nodes")])
    assert FakeCluster.instances[0].stopped


def test_up_says_how_to_use_the_cluster_and_a_ctrl_c_stops_it_with_exit_code_0(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """The ready file is what a script waits for: three lines, the address, the driver's
    prefix and the nodes an instance can land on (scenarios/test_ray_netns.py unpacks all
    three). A Ctrl-C or SIGTERM is how `up` is meant to end: it stops the cluster and is a
    success, not a failure."""

    def interrupt(seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(ray_cluster, "LocalRayCluster", FakeCluster)
    monkeypatch.setattr(FakeCluster, "instances", [])
    monkeypatch.setattr(FakeCluster, "driver_prefix", lambda self: ["nsenter", "-t", "7", "-n"])
    monkeypatch.setattr(ray_cluster, "install_signal_handlers", lambda: {})
    monkeypatch.setattr(ray_cluster.time, "sleep", interrupt)
    ready = tmp_path / "ready"
    argv = ["up", "--work-dir", str(tmp_path / "nodes"), "--ready-file", str(ready)]
    assert ray_cluster.main(argv) == 0
    assert FakeCluster.instances[0].stopped
    assert ready.read_text() == "127.0.0.2:6379\nnsenter -t 7 -n\n3\n"
    assert capsys.readouterr().out == (
        "ray cluster up: address 127.0.0.2:6379\nrun a driver there with: nsenter -t 7 -n\n"
    )


def test_a_private_mount_runs_the_ray_start_after_the_double_dash_unchanged(monkeypatch) -> None:
    """How each node but the head of a cluster with `private_dir` starts (`_start_node` wraps
    its `ray start` in `private-mount DIR -- ARGV`): the tmpfs at DIR, then exactly ARGV, the
    `--` itself not taken as the program (found in review: only the e2e cluster ran it)."""
    mounted: list[tuple[str, list[str]]] = []

    class Execed(Exception):
        """What replaces the process in `private_mount` (os.execvp) here."""

    def private_mount(directory: str, argv: list[str]) -> None:
        mounted.append((directory, argv))
        raise Execed

    monkeypatch.setattr(ray_cluster, "private_mount", private_mount)
    ray_start = ["python", "-m", "ray.scripts.scripts", "start", "--block", "--", "x"]
    with pytest.raises(Execed):
        ray_cluster.main(["private-mount", "/data/kv", "--", *ray_start])
    assert mounted == [("/data/kv", ray_start)]
