"""Closing the run's Ray connection (`harness.serve.ray_runtime.RayRuntime.close`) with a fake
cluster and a fake Ray, so no process or Ray is involved: the rehearsal cluster this harness
started is stopped however the disconnect ends.

Why: `close` forgets the cluster before it disconnects (a second close must not stop it twice),
so a disconnect that raises (a Ctrl-C landing in `ray.shutdown`, a driver whose cluster is
already broken) left the cluster's nodes running with nothing left to stop them.
"""

from __future__ import annotations

import pytest

from harness.serve import ray_runtime
from harness.serve.ray_runtime import RayRuntime

pytestmark = pytest.mark.unit


class FakeCluster:
    stopped = False

    def stop(self) -> None:
        self.stopped = True


def test_a_disconnect_interrupted_still_stops_the_rehearsal_cluster(monkeypatch) -> None:
    def interrupted_shutdown() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(ray_runtime.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray_runtime.ray, "shutdown", interrupted_shutdown)
    runtime = RayRuntime()
    cluster = FakeCluster()
    runtime.cluster = cluster  # type: ignore[assignment]
    with pytest.raises(KeyboardInterrupt):
        runtime.close()
    assert cluster.stopped
