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


class RecordingRay:
    """`ray.init` and what `connect` asks of Ray afterwards, answered in-process: `fails` an
    init that raises; `alive` how many nodes each look finds alive."""

    def __init__(self, monkeypatch, fails: bool = False, alive: tuple[int, ...] = (1,)) -> None:
        self.inits: list[dict] = []
        self.looks = 0
        self.connected = False
        self.fails = fails
        self.alive = alive
        monkeypatch.setenv(ray_runtime.USAGE_STATS_ENV, "0")
        monkeypatch.setattr(ray_runtime.atexit, "register", lambda *_: None)
        monkeypatch.setattr(ray_runtime.ray, "init", self.init)
        monkeypatch.setattr(ray_runtime.ray, "is_initialized", lambda: self.connected)
        monkeypatch.setattr(ray_runtime.ray, "shutdown", lambda: None)
        monkeypatch.setattr(ray_runtime, "alive_nodes", self.alive_nodes)
        monkeypatch.setattr(ray_runtime, "describe_nodes", lambda: "alive")
        monkeypatch.setattr(ray_runtime, "gcs_problem", lambda address: None)
        monkeypatch.setattr(ray_runtime.time, "sleep", lambda _: None)

    def init(self, **given) -> None:
        self.inits.append(given)
        if self.fails:
            raise ConnectionError("GCS unreachable\nmore lines")
        self.connected = True

    def alive_nodes(self) -> list[dict]:
        self.looks += 1
        return [{}] * self.alive[min(self.looks, len(self.alive)) - 1]


class StartedCluster(FakeCluster):
    """A rehearsal cluster of three nodes that starts at once."""

    addresses = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
    address = "127.0.0.2:6379"
    driver_address = "127.0.0.2"

    def __init__(self, work_dir, addresses=None) -> None:
        StartedCluster.made.append(self)

    def start(self) -> None:
        pass


def test_a_run_connects_to_one_cluster_naming_a_loopback_head_as_its_own_address(
    tmp_path, monkeypatch
) -> None:
    """A driver on a loopback cluster address (127.x) says that address is its own node's (Ray
    would take it for the host's routable one and hang); any other address is left to Ray.
    A connected run refuses a second --ray-address: one run, one cluster."""
    from harness.serve.launcher import LaunchRefused
    from harness.spec.settings import LauncherChoice

    ray = RecordingRay(monkeypatch)
    for address, node_ip in (("127.0.0.5:6379", "127.0.0.5"), ("10.0.0.1:6379", None)):
        ray.connected = False
        runtime = RayRuntime()
        runtime.connect(LauncherChoice("ray", ray_address=address), tmp_path)
        assert (ray.inits[-1]["address"], ray.inits[-1]["_node_ip_address"]) == (address, node_ip)
    runtime.connect(LauncherChoice("ray", ray_address="10.0.0.1:6379"), tmp_path)
    assert len(ray.inits) == 2  # connected already: no second init
    with pytest.raises(LaunchRefused) as refused:
        runtime.connect(LauncherChoice("ray", ray_address="10.0.0.9:6379"), tmp_path)
    assert str(refused.value) == (
        "--ray-address 10.0.0.9:6379: this harness is connected to 10.0.0.1:6379; "
        "one run, one cluster"
    )


def test_an_address_nothing_listens_at_is_refused_before_ray_init(tmp_path, monkeypatch) -> None:
    """Real vLLM: `load --launcher ray --ray-address 127.0.0.9:1` was still in `ray.init`'s
    own retries after 214 s, warning every 30 s, no error said. A head's port that refuses
    the connection is one line at once, and Ray is never asked."""
    from harness.serve.launcher import LaunchRefused
    from harness.spec.settings import LauncherChoice

    ray = RecordingRay(monkeypatch)
    monkeypatch.setattr(ray_runtime, "gcs_problem", RAY_GCS_PROBLEM)
    runtime = RayRuntime()
    with pytest.raises(LaunchRefused) as refused:
        runtime.connect(LauncherChoice("ray", ray_address="127.0.0.9:1"), tmp_path)
    assert str(refused.value).startswith(
        "--ray-address 127.0.0.9:1: no Ray cluster answers there (connect: "
    ), refused.value
    assert str(refused.value).endswith(
        "); start its head (`ray start --head`) or give the address it printed"
    )
    assert ray.inits == [] and runtime.address is None


RAY_GCS_PROBLEM = ray_runtime.gcs_problem  # the real probe: a refused port answers at once


def test_the_rehearsal_is_waited_for_node_by_node_and_stopped_when_ray_cannot_connect(
    tmp_path, monkeypatch
) -> None:
    """The driver starts once every node of the rehearsal cluster is alive, not at the first;
    a connection Ray refuses is one line, and the cluster this harness started for it stops."""
    from harness.serve.launcher import LaunchRefused
    from harness.spec.settings import LauncherChoice

    monkeypatch.setattr(ray_runtime, "LocalRayCluster", StartedCluster)
    monkeypatch.setattr(StartedCluster, "made", [], raising=False)
    ray = RecordingRay(monkeypatch, alive=(1, 2, 3))
    runtime = RayRuntime()
    runtime.connect(LauncherChoice("ray"), tmp_path)
    assert ray.looks == 3, ray.looks
    assert ray.inits[-1]["_node_ip_address"] == "127.0.0.2"
    ray = RecordingRay(monkeypatch, fails=True)
    runtime = RayRuntime()
    with pytest.raises(LaunchRefused) as refused:
        runtime.connect(LauncherChoice("ray"), tmp_path)
    assert str(refused.value) == (
        "cannot connect to the Ray cluster at 127.0.0.2:6379: ConnectionError: GCS unreachable"
    )
    assert StartedCluster.made[-1].stopped and runtime.address is None


class SizedCluster(StartedCluster):
    """A rehearsal cluster that records the addresses it was asked to start on."""

    def __init__(self, work_dir, addresses=None) -> None:
        self.addresses = addresses
        SizedCluster.made.append(self)


def test_the_rehearsal_has_the_nodes_the_run_asks_for_and_a_smaller_one_is_refused(
    tmp_path, monkeypatch
) -> None:
    """A run keeping four instances up at once (a fuzz of 1E+1P+1D beside its baseline) starts
    a rehearsal of four nodes, 127.0.0.2-5, and waits for every one; a connection already held
    to a rehearsal of fewer nodes is refused in one line, not left to Ray's 60 s placement
    wait."""
    from harness.serve.launcher import LaunchRefused
    from harness.spec.settings import LauncherChoice

    monkeypatch.setattr(ray_runtime, "LocalRayCluster", SizedCluster)
    monkeypatch.setattr(SizedCluster, "made", [], raising=False)
    ray = RecordingRay(monkeypatch, alive=(1, 2, 3, 4))
    runtime = RayRuntime()
    runtime.connect(LauncherChoice("ray", rehearsal_nodes=4), tmp_path)
    assert SizedCluster.made[-1].addresses == ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")
    assert ray.looks == 4, ray.looks
    runtime.connect(LauncherChoice("ray", rehearsal_nodes=4), tmp_path)  # connected: as it is
    with pytest.raises(LaunchRefused) as refused:
        runtime.connect(LauncherChoice("ray", rehearsal_nodes=5), tmp_path)
    assert str(refused.value) == (
        "the rehearsal cluster this harness started has 4 nodes, and this run keeps 5 "
        "instances up at once; one run, one cluster"
    )
    assert len(SizedCluster.made) == 1


def test_connecting_to_ray_leaves_sigterm_as_the_harness_handles_it(tmp_path, monkeypatch) -> None:
    """`ray.init` puts its own SIGTERM handler (sys.exit) in place, and its core worker a
    C-level one over it that ends the process a moment later: SIGTERM to `run --launcher ray`
    on real vLLM stopped one instance, then the harness died without its "interrupted" line.
    After connecting, SIGTERM is handled by whatever handled it before."""
    import signal

    from harness.spec.settings import LauncherChoice

    ray = RecordingRay(monkeypatch)
    recorded_init = ray.init

    def init_as_ray_does(**given) -> None:
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
        recorded_init(**given)

    monkeypatch.setattr(ray_runtime.ray, "init", init_as_ray_does)

    def harness_handler(signum, frame) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, harness_handler)
    try:
        RayRuntime().connect(LauncherChoice("ray", ray_address="10.0.0.1:6379"), tmp_path)
        assert signal.getsignal(signal.SIGTERM) is harness_handler
    finally:
        signal.signal(signal.SIGTERM, previous)
