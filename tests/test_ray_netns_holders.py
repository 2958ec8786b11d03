"""The network namespaces of the netns rehearsal (`harness.serve.ray_cluster.Netns`) with fake
holders, so no namespace, process or Ray is involved: every holder that was spawned is stopped
when the start fails, whenever it fails.

Why: a holder is a server like any other (`ManagedServer`), and its `start()` can raise after
the spawn (a Ctrl-C held back during the spawn by `signals_deferred` is raised once the child
is recorded). A holder the namespaces do not list is never stopped by `Netns.remove`, and its
namespace stays until the harness itself exits.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.serve import ray_cluster
from harness.serve.ray_cluster import LocalRayCluster

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
