"""The Ray launcher on a one-host cluster of three nodes (127.0.0.2-4), with the fake vLLM.

What is checked: a topology's instances land on distinct nodes and are driven, proxied, tapped
and logged exactly as local ones; a planted misconfiguration (a side-channel host left at
`localhost`, connector storage the nodes do not share) is refused before anything starts,
naming the instance and the cause; and nothing outlives a SIGKILL of the harness, of an
instance's agent or of its node's raylet. Real vLLM does the same in `scenarios/test_ray.py`
and `tests/test_ray_chaos_vllm.py`; what only the fake shows here is not known to hold with
vLLM. Checks that need no running node are shown with fake agents and no cluster (here, not in
the unit tier, because they import Ray): a --media-dir a node does not see, and bfloat16 on a
node's GPU below compute capability 8.0, for `run` and for `repro` of a Ray bundle.

Needs Ray (`scripts/cpu setup --ray`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from harness.devices import GpuCapability
from harness.environment import NETWORK_CHECKS_ENV
from harness.serve import ray_launcher
from harness.serve.launch import ServerDied
from harness.serve.launcher import LaunchRefused, NodeInfo
from harness.serve.ray_agent import InstanceAgent
from harness.serve.ray_cluster import LocalRayCluster
from harness.serve.ray_runtime import close_runtime
from harness.serve.session import TopologySession
from harness.spec.platforms import CPU, CUDA, NIXL_CONNECTOR
from harness.spec.prompts import SKELETON_PROMPTS, render_request
from harness.spec.settings import RAY_LAUNCHER, LauncherChoice, RunSettings
from harness.spec.topology import TOPOLOGIES, ServingConfig, serving_for
from harness.testing import fake_nvidia_smi
from harness.testing.fake_vllm import MODE_ENV, fake_run_settings
from harness.testing.processes import describe, kill_all, seconds_until_gone
from harness.testing.ray_driver import (
    end_driver,
    raylet_of,
    reported_death,
    start_driver,
    tree_of,
)
from tests.test_repro_bundle import rerun_bundle, rerun_settings

# Under xdist on a CPU host the e2e items' worker runs these before its first topology, while
# another worker runs the other wall-clock bounds (harness/testing/collection.py).
pytestmark = [pytest.mark.process, pytest.mark.wall_clock_bound(on_e2e_worker=True)]

GONE_WITHIN_S = 30.0  # the bound for every process of a run after a SIGKILL
# Ray declares a node dead after its health checks fail for a while; the harness's poll of an
# agent there gives up after CALL_TIMEOUT_S at the latest.
RAY_NOTICES_NODE_DEATH_S = 90.0
# Servers that ignore SIGTERM, each with a child in its group (vLLM's EngineCore): only a
# SIGKILL of the whole group ends them.
STUBBORN = "*:ignore-term;*:fork-child"
IMAGE_BODY = render_request(SKELETON_PROMPTS[1], "epd-model")
HEALTH_CHECK_PERIOD_ENV = "RAY_health_check_period_ms"  # read by Ray's GCS at its start
HEALTH_CHECK_PERIOD_MS = 500


@pytest.fixture(scope="module")
def module_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRayCluster]:
    """One rehearsal cluster for the module; the harness (this process) connects at first use.
    An e2e Ray scenario that ran earlier in this process keeps its own cluster's connection until
    the session ends, and a harness has one cluster: that connection ends first.

    Every node but the head sees a private tmpfs at `private_dir` (the storage test's; nothing
    else uses the path). The GCS checks each node's health every HEALTH_CHECK_PERIOD_MS instead
    of Ray's 3 s: a node whose raylet is SIGKILLed is declared dead after five failed checks, in
    5 s, not 15 s (measured here). A raylet that answers is not declared dead by this (each
    check still waits Ray's 10 s for its answer), and the harness is unchanged: it learns of the
    death from Ray, whenever Ray declares it."""
    close_runtime()
    private = tmp_path_factory.mktemp("private")
    with contextlib.ExitStack() as stack:
        with pytest.MonkeyPatch.context() as env:
            env.setenv(HEALTH_CHECK_PERIOD_ENV, str(HEALTH_CHECK_PERIOD_MS))
            nodes = LocalRayCluster(tmp_path_factory.mktemp("ray") / "nodes", private_dir=private)
            stack.enter_context(nodes)
        try:
            yield nodes
        finally:
            close_runtime()


@pytest.fixture
def cluster(module_cluster: LocalRayCluster) -> LocalRayCluster:
    """The module's cluster, every node up: the raylet test, which takes a node down for good,
    is the module's last user of it."""
    down = [node.address for node in module_cluster.nodes if not node.server.is_alive()]
    assert not down, f"Ray nodes {down} are down: a test before this one took them down"
    return module_cluster


@pytest.fixture
def fake(fake_vllm: Path) -> Path:
    return fake_vllm


def settings_for(
    tmp_path: Path, fake: Path, address: str, kv: str = "ExampleConnector", **launcher
) -> RunSettings:
    return fake_run_settings(
        tmp_path,
        fake,
        ServingConfig(model=str(tmp_path / "model"), kv_connector=kv),
        startup_timeout_s=60.0,
        request_timeout_s=30.0,
        launcher=LauncherChoice(RAY_LAUNCHER, ray_address=address, **launcher),
    )


def gone_after(procs: list[psutil.Process], limit_s: float = GONE_WITHIN_S) -> float | None:
    """Seconds until every process in `procs` is gone, or None if some outlive `limit_s`."""
    return seconds_until_gone(procs, limit_s)


def kill_survivors(procs: list[psutil.Process]) -> str:
    """What outlived its bound (for the failure message), then SIGKILLed by handle."""
    left = describe(procs)
    kill_all(procs)
    return left


def test_a_topology_runs_on_three_nodes_and_is_served_like_a_local_one(
    cluster: LocalRayCluster, fake: Path, tmp_path: Path
) -> None:
    settings = settings_for(tmp_path, fake, cluster.address)
    with TopologySession(TOPOLOGIES["1E+1P+1D"], settings) as session:
        hosts = [spec.host for spec in session.instances]
        assert sorted(hosts) == sorted(cluster.addresses), hosts
        procs = [p for server in session.servers for p in tree_of(server.pid)]
        outcome = session.send("image", IMAGE_BODY)
        assert outcome.error is None and outcome.result is not None, outcome.error
        assert {r.role for r in outcome.taps or []} == {"encoder", "prefill", "decode"}
        for spec, stats in ((s, session.stats[s.name]) for s in session.instances):
            assert stats.node == spec.host and stats.url == f"http://{spec.host}:{spec.port}"
            command = json.loads(Path(stats.log_path).with_suffix(".cmd.json").read_text())
            assert command["node"]["address"] == spec.host
            if spec.ec_transfer_config() is not None:
                assert command["env"]["VLLM_EC_SIDE_CHANNEL_HOST"] == spec.host
        decode_log = Path(session.stats["1E+1P+1D/decode0"].log_path)
    # The bundle holds each instance's log, fetched through its agent from its node.
    text = decode_log.read_text()
    assert f"on Ray node {session.instances[2].host}" in text
    assert "fake vllm pid" in text and "REQUEST 1E-1P-1D-image-" in text
    assert gone_after(procs, 5.0) is not None, kill_survivors(procs)


def test_a_side_channel_host_left_at_localhost_is_refused_before_any_start(
    cluster: LocalRayCluster, fake: Path, tmp_path: Path
) -> None:
    settings = settings_for(
        tmp_path,
        fake,
        cluster.address,
        kv=NIXL_CONNECTOR,
        instance_env=(("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost"),),
    )
    session = TopologySession(TOPOLOGIES["1P+1D"], settings)
    try:
        with pytest.raises(LaunchRefused) as refused:
            session.start_servers()
        assert session.servers == ()  # nothing was started
    finally:
        session.close()
    message = str(refused.value)
    prefill = session.instances[0]
    assert message.startswith(
        f"1P+1D/prefill0: VLLM_NIXL_SIDE_CHANNEL_HOST is 'localhost', but its node's address "
        f"is {prefill.host}"
    ), message
    assert "1P+1D/decode0: VLLM_NIXL_SIDE_CHANNEL_HOST is 'localhost'" in message


def test_an_agent_sigkilled_takes_its_server_down_and_is_named(
    cluster: LocalRayCluster, fake: Path, tmp_path: Path
) -> None:
    # Only the decode server, whose agent is killed, is stubborn: the prefill server is stopped
    # at the session's end as any server is, not after STOP_GRACE_S of SIGTERM ignored.
    stubborn = (MODE_ENV, "decode:ignore-term;decode:fork-child")
    settings = settings_for(tmp_path, fake, cluster.address, instance_env=(stubborn,))
    with TopologySession(TOPOLOGIES["1P+1D"], settings) as session:
        decode = session.servers[1]
        procs = tree_of(decode.pid)
        assert len(procs) == 2, procs  # the server and the child it forked
        os.kill(decode.agent_pid, signal.SIGKILL)
        seconds = gone_after(procs)
        assert seconds is not None, kill_survivors(procs)
        print(f"\nagent SIGKILL: the decode server's 2 processes gone in {seconds:.1f} s")
        with pytest.raises(ServerDied) as died:
            decode.check_alive()
        assert f"1P+1D/decode0 (pid {procs[0].pid} on Ray node {decode.node.address})" in str(
            died.value
        )
        assert "its agent is gone" in str(died.value)


def driver_args(tmp_path: Path, fake: Path, address: str, topology: str = "1P+1D") -> list[str]:
    return [str(fake), str(tmp_path / "model"), str(tmp_path / "run"), topology, address,
            "ExampleConnector", f"{MODE_ENV}={STUBBORN}"]  # fmt: skip


def test_a_sigkilled_harness_leaves_no_server_on_any_node(
    cluster: LocalRayCluster, fake: Path, tmp_path: Path
) -> None:
    """Ray ends the agents of a dead driver; each agent's watchdog then stops its server."""
    driver, started = start_driver(driver_args(tmp_path, fake, cluster.address))
    try:
        procs = [psutil.Process(pid) for s in started["servers"] for pid in (s["pid"], *s["tree"])]
        assert len(procs) == 4
        driver.kill()
        seconds = gone_after(procs)
        assert seconds is not None, kill_survivors(procs)
        print(f"\nharness SIGKILL: 4 server processes on 2 nodes gone in {seconds:.1f} s")
    finally:
        end_driver(driver)


def test_storage_the_nodes_do_not_share_is_refused(
    cluster: LocalRayCluster, fake: Path, tmp_path: Path
) -> None:
    """Every node but the head sees its own empty tmpfs at `private`: same path, not shared."""
    private = cluster.private_dir
    assert private is not None
    settings = settings_for(tmp_path, fake, cluster.address, shared_dir=private)
    session = TopologySession(TOPOLOGIES["1E+1PD"], settings)
    try:
        with pytest.raises(LaunchRefused) as refused:
            session.start_servers()
        assert session.servers == ()
    finally:
        session.close()
    message = str(refused.value)
    assert message.startswith(f"EC storage {private}/"), message
    assert "is not shared: 1E+1P" in message and "does not see what" in message, message
    assert "--ray-shared-dir" in message


def test_a_sigkilled_raylet_takes_its_nodes_servers_down(
    cluster: LocalRayCluster, fake: Path, tmp_path: Path
) -> None:
    """The node whose raylet dies is gone for good: the module's last test on its cluster."""
    driver, started = start_driver(driver_args(tmp_path, fake, cluster.address))
    try:
        # Not the head's: the driver's own node, whose raylet's death ends the whole
        # cluster (`ray start --block` then stops the GCS too), as it would on a cluster.
        victim = next(s for s in started["servers"] if s["node"] != cluster.driver_address)
        procs = [psutil.Process(pid) for pid in (victim["pid"], *victim["tree"])]
        killed = time.monotonic()
        raylet_of(cluster, victim["node"]).kill()
        seconds = gone_after(procs)
        assert seconds is not None, kill_survivors(procs)
        # The harness notices once Ray declares the node dead (or a poll times out), and says
        # so before its session's close, which would give the surviving server (it ignores
        # SIGTERM) its whole stop grace: the driver is SIGKILLed then, and the other server
        # goes as the harness-SIGKILL test shows.
        died = reported_death(driver, RAY_NOTICES_NODE_DEATH_S)
        noticed = time.monotonic() - killed
        print(
            f"\nraylet SIGKILL: {victim['name']}'s processes gone in {seconds:.1f} s; "
            f"the harness noticed after {noticed:.1f} s"
        )
        assert died is not None and victim["name"] in died, died
    finally:
        end_driver(driver)


class ListingAgent:
    """A node's agent as the launcher's checks call it (`.remote` runs at once)."""

    def __init__(self, listing) -> None:
        self.directory_listing = dataclasses.make_dataclass("Call", ["remote"])(
            lambda path: listing
        )


def test_a_media_dir_a_node_does_not_see_is_refused_before_a_start(tmp_path, monkeypatch) -> None:
    """Each instance's vLLM reads file:// media on its own node: found in review, a
    --media-dir the nodes did not see was not refused, and every media case ERRORed. (Here, not
    in the unit tier's tests/test_launcher_seam.py: it imports Ray, which `tox -e fast` lacks.)"""
    media = tmp_path / "media"
    media.mkdir()
    (media / "cat.png").write_bytes(b"png")
    serving = serving_for(CPU, "/models/m", allowed_local_media_path=str(media))
    launcher = ray_launcher.RayLauncher(
        RunSettings(serving, tmp_path / "run", platform=CPU, launcher=LauncherChoice("ray"))
    )
    monkeypatch.setattr(ray_launcher, "get_or_refuse", lambda answers, doing: answers)
    instances = [
        dataclasses.make_dataclass("Spec", ["name", "host"])(name, host)
        for name, host in (("1E+1PD/encoder0", "10.0.0.2"), ("1E+1PD/pd0", "10.0.0.3"))
    ]
    launcher._agents = [ListingAgent(["cat.png"]), ListingAgent(["cat.png"])]
    launcher._check_media_dir(instances)  # both nodes see it
    launcher._agents[1] = ListingAgent(f"cannot list {media}: No such file or directory")
    with pytest.raises(LaunchRefused, match="1E\\+1PD/pd0's node 10.0.0.3 \\(cannot list"):
        launcher._check_media_dir(instances)
    launcher._agents[1] = ListingAgent([])
    with pytest.raises(LaunchRefused, match="it lists other files there"):
        launcher._check_media_dir(instances)


class NodeAgent:
    """A node's agent as the launcher's checks call it: each method named in `answers` answers
    its `.remote` at once; any other is absent (AttributeError: the launcher asked it)."""

    def __init__(self, **answers) -> None:
        for method, answer in answers.items():
            setattr(self, method, types.SimpleNamespace(remote=lambda *_, answer=answer: answer))


# What a node's nvidia-smi lists: GPU 0 computes in bfloat16, GPU 1 does not.
NODE_GPUS = [
    GpuCapability(0, "NVIDIA A100-SXM4-80GB", (8, 0)),
    GpuCapability(1, "Tesla T4", (7, 5)),
]
ON_THE_T4 = (
    "1P+1D/decode0 on node 10.0.0.3: --dtype bfloat16 needs compute capability 8.0 or more, "
    "which vLLM checks only once an instance has started, and GPU 1 (Tesla T4, compute "
    "capability 7.5) has less: pass --dtype float16 (repro: run the case again with run "
    "--dtype float16), or serve on Ray nodes whose GPUs have 8.0 or more"
)


def test_an_agent_reads_its_own_nodes_gpus(tmp_path: Path, monkeypatch) -> None:
    """The GPUs a Ray instance computes on are its node's: its agent reads them there."""
    tools = fake_nvidia_smi.install_fake_nvidia_smi(
        tmp_path / "bin", [fake_nvidia_smi.A100, fake_nvidia_smi.T4]
    )
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    assert InstanceAgent().compute_capabilities() == NODE_GPUS
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no nvidia-smi on the node
    assert InstanceAgent().compute_capabilities() is None


def placed_launcher(settings: RunSettings, monkeypatch, *agents: NodeAgent):
    """A Ray launcher whose topology is placed, one agent a node (no cluster)."""
    launcher = ray_launcher.RayLauncher(settings)
    monkeypatch.setattr(ray_launcher, "get_or_refuse", lambda answers, doing: answers)
    monkeypatch.setattr(ray_launcher, "violations", lambda *_: [])
    launcher._agents = list(agents)
    launcher._nodes = [NodeInfo(f"10.0.0.{2 + i}") for i in range(len(agents))]
    return launcher


def gpu_nodes(settings: RunSettings, monkeypatch, *listings) -> ray_launcher.RayLauncher:
    """`placed_launcher` on nodes with the served vLLM whose nvidia-smi lists `listings`."""
    agents = [NodeAgent(check_executable=None, compute_capabilities=gpus) for gpus in listings]
    return placed_launcher(settings, monkeypatch, *agents)


@dataclasses.dataclass
class PlacedSpec:
    """An instance as the launcher's checks read it: its name, node and accelerator ids."""

    name: str
    host: str
    devices: tuple[int, ...]

    def shared_storage(self) -> dict:
        return {}  # no connector storage to probe


def placed(*devices: tuple[int, ...]) -> list[PlacedSpec]:
    """1P+1D's instances on nodes 10.0.0.2 and .3, with the accelerator ids Ray gave each."""
    names = ("1P+1D/prefill0", "1P+1D/decode0")
    return [
        PlacedSpec(name, f"10.0.0.{2 + i}", ids)
        for i, (name, ids) in enumerate(zip(names, devices))
    ]


def check_before_start(launcher: ray_launcher.RayLauncher, instances: list) -> None:
    commands = [types.SimpleNamespace(argv=["vllm"], env={}) for _ in instances]
    launcher.check_before_start(TOPOLOGIES["1P+1D"], instances, commands)


def test_bfloat16_on_a_nodes_gpu_below_8_is_refused_before_a_start(tmp_path, monkeypatch) -> None:
    """The preflight reads this host's GPUs, and with --launcher ray those are not the
    instances': vLLM refused bfloat16 on a node's T4 only once its instance had started."""
    ray = LauncherChoice("ray", ray_address="10.0.0.1:6379")
    settings = RunSettings(serving_for(CUDA, "/m"), tmp_path, platform=CUDA, launcher=ray)
    launcher = gpu_nodes(settings, monkeypatch, NODE_GPUS, NODE_GPUS)
    with pytest.raises(LaunchRefused) as refused:
        check_before_start(launcher, placed((0,), (1,)))
    assert str(refused.value) == ON_THE_T4
    check_before_start(launcher, placed((0,), (0,)))  # the T4 is nobody's: nothing refused
    # A node whose nvidia-smi cannot say is not judged: vLLM still refuses there.
    check_before_start(gpu_nodes(settings, monkeypatch, NODE_GPUS, None), placed((0,), (1,)))
    float16 = dataclasses.replace(settings, serving=serving_for(CUDA, "/m", dtype="float16"))
    check_before_start(gpu_nodes(float16, monkeypatch, NODE_GPUS, NODE_GPUS), placed((1,), (1,)))


def test_a_cpu_topology_asks_no_node_for_gpus(tmp_path, monkeypatch) -> None:
    """Agents without `compute_capabilities`: asked, they would raise AttributeError."""
    cpu = RunSettings(
        serving_for(CPU, "/m"), tmp_path, platform=CPU, launcher=LauncherChoice("ray")
    )
    agents = [NodeAgent(check_executable=None) for _ in range(2)]
    check_before_start(placed_launcher(cpu, monkeypatch, *agents), placed((), ()))


def test_repro_of_a_ray_bundle_is_refused_on_its_nodes_gpus(tmp_path, monkeypatch) -> None:
    """`repro` checks the bundle's dtype against this host's GPUs only where it places the
    instances itself; a Ray bundle's rerun serves the bundle's dtype on the nodes, and the
    launcher refuses it there as for `run`."""
    root = rerun_bundle(
        tmp_path / "b",
        "1P+1D",
        platform_profile="cuda",
        devices=[0, 1],
        serving={"model": "/models/qwen", "dtype": "bfloat16"},
        launcher={"kind": "ray", "ray_address": "10.0.0.1:6379"},
    )
    settings = rerun_settings(root, monkeypatch, "0.32.0")
    launcher = gpu_nodes(settings, monkeypatch, NODE_GPUS, NODE_GPUS)
    with pytest.raises(LaunchRefused) as refused:
        check_before_start(launcher, placed((0,), (1,)))
    assert str(refused.value) == ON_THE_T4


def node_report(address: str, gpus: list[str], kill_children: str | None = "0") -> dict:
    """What an agent's `where` says of its node."""
    return {
        "address": address,
        "node_id": address.replace(".", "") * 8,
        "hostname": f"host-{address}",
        "accelerators": {"GPU": gpus},
        "pid": 7,
        "kill_children": kill_children,
        "inherited": {},
    }


class PlacingRay:
    """Ray as `RayLauncher.reserve` calls it, answered in-process: records each placement
    group's bundles and strategy, each agent's options and the side channels asked of them."""

    def __init__(self, monkeypatch, *reports: dict) -> None:
        self.groups: list[tuple[list[dict], str]] = []
        self.options: list[dict] = []
        self.sides: list[bool] = []
        monkeypatch.setattr(
            ray_launcher, "runtime", lambda: types.SimpleNamespace(connect=lambda *_: None)
        )
        monkeypatch.setattr(ray_launcher, "placement_group", self.placement_group)
        monkeypatch.setattr(ray_launcher.ray, "get", lambda *a, **k: None)
        monkeypatch.setattr(ray_launcher, "PlacementGroupSchedulingStrategy", lambda *a, **k: None)
        monkeypatch.setattr(ray_launcher, "get_or_refuse", lambda answers, doing: answers)
        agents = iter(reports)

        def options(**given):
            self.options.append(given)
            agent = NodeAgent(where=next(agents))
            agent.reserve = types.SimpleNamespace(remote=self.reserve)  # type: ignore[attr-defined]
            return types.SimpleNamespace(remote=lambda: agent)

        monkeypatch.setattr(ray_launcher, "RemoteAgent", types.SimpleNamespace(options=options))

    def placement_group(self, bundles: list[dict], strategy: str, name: str):
        self.groups.append((bundles, strategy))
        return types.SimpleNamespace(ready=lambda: None)

    def reserve(self, address: str, side: bool) -> tuple[int, int | None]:
        self.sides.append(side)
        return 41000 + len(self.sides), (42000 + len(self.sides)) if side else None


def test_reserve_asks_ray_for_a_node_and_a_gpu_per_instance_and_binds_what_each_agent_got(
    tmp_path: Path, monkeypatch
) -> None:
    """STRICT_SPREAD unless --ray-placement pack; on a GPU platform a GPU in each bundle and the
    instance's devices the accelerator ids Ray gave its agent; a NIXL instance a side-channel
    port on its node (found in review: none of it was checked by a test without a cluster)."""
    cluster = LauncherChoice("ray", ray_address="10.0.0.1:6379")
    nixl = serving_for(CUDA, "/m", kv_connector=NIXL_CONNECTOR)
    settings = RunSettings(nixl, tmp_path, platform=CUDA, launcher=cluster)
    placing = PlacingRay(
        monkeypatch, node_report("10.0.0.2", ["3"]), node_report("10.0.0.3", ["5"])
    )
    reservation = ray_launcher.RayLauncher(settings).reserve(TOPOLOGIES["1P+1D"], ())
    assert placing.groups == [([{"CPU": 1, "GPU": 1}] * 2, "STRICT_SPREAD")]
    assert [(o["num_cpus"], o["num_gpus"]) for o in placing.options] == [(1, 1), (1, 1)]
    assert reservation.devices == [(3,), (5,)]
    assert reservation.hosts == ["10.0.0.2", "10.0.0.3"]
    assert placing.sides == [True, True]
    assert reservation.ports == [41001, 41002]
    assert reservation.side_channel_ports == [42001, 42002]

    packed = dataclasses.replace(
        settings,
        serving=serving_for(CPU, "/m"),
        platform=CPU,
        launcher=dataclasses.replace(cluster, placement="pack"),
    )
    placing = PlacingRay(monkeypatch, node_report("10.0.0.2", []), node_report("10.0.0.2", []))
    reservation = ray_launcher.RayLauncher(packed).reserve(TOPOLOGIES["1P+1D"], ())
    assert placing.groups == [([{"CPU": 1}] * 2, "PACK")]
    assert [(o["num_cpus"], o["num_gpus"]) for o in placing.options] == [(1, 0), (1, 0)]
    assert reservation.devices is None
    assert placing.sides == [False, False]  # no NIXL: no side channel
    assert reservation.side_channel_ports == []


def test_what_ray_instance_env_gives_every_instance_wins_over_what_the_harness_renders(
    tmp_path: Path,
) -> None:
    """`--ray-instance-env NAME=VALUE` is set over the instance's own variables: the planted
    `VLLM_NIXL_SIDE_CHANNEL_HOST=localhost` of docs/multi-node.md reaches the command, where
    `check_before_start` refuses it, instead of being replaced by the node's address and passing
    unseen (found in review: only a test with a cluster showed it)."""
    given = (("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost"), ("UCX_TLS", "tcp"))
    cpu = RunSettings(
        serving_for(CPU, "/m"),
        tmp_path,
        platform=CPU,
        launcher=LauncherChoice("ray", instance_env=given),
    )
    own = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.3", "OMP_NUM_THREADS": "1"}
    spec = types.SimpleNamespace(env=lambda: dict(own))
    assert ray_launcher.RayLauncher(cpu).instance_env(spec) == {  # type: ignore[arg-type]
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "localhost",
        "OMP_NUM_THREADS": "1",
        "UCX_TLS": "tcp",
    }


def test_reserve_refuses_the_rehearsal_on_gpus_and_an_agent_ray_would_kill_the_children_of(
    tmp_path: Path, monkeypatch
) -> None:
    """The one-host rehearsal on a GPU platform is refused before Ray is asked for anything
    (its nodes would each report every device of the host); an agent running with Ray's
    default of SIGKILLing its children would leave vLLM's engine behind when it ends."""
    rehearsal = RunSettings(
        serving_for(CUDA, "/m"), tmp_path, platform=CUDA, launcher=LauncherChoice("ray")
    )
    placing = PlacingRay(monkeypatch)
    with pytest.raises(LaunchRefused, match=r"^1P\+1D: .*--ray-address"):
        ray_launcher.RayLauncher(rehearsal).reserve(TOPOLOGIES["1P+1D"], ())
    assert placing.groups == []
    cpu = RunSettings(
        serving_for(CPU, "/m"), tmp_path, platform=CPU, launcher=LauncherChoice("ray")
    )
    PlacingRay(
        monkeypatch,
        node_report("10.0.0.2", []),
        node_report("10.0.0.3", [], kill_children=None),
    )
    with pytest.raises(LaunchRefused) as refused:
        ray_launcher.RayLauncher(cpu).reserve(TOPOLOGIES["1P+1D"], ())
    assert str(refused.value).startswith(
        "1P+1D: the agent on node 10.0.0.3 runs with RAY_kill_child_processes_on_worker_exit=None"
    ), refused.value


def test_a_network_rule_broken_or_a_node_without_the_served_vllm_is_refused_before_a_start(
    tmp_path: Path, monkeypatch
) -> None:
    """A rendered command that breaks a network rule is refused (only warned of with the
    network checks off), judged as multi-node when its instances are on several nodes; a node
    that lacks the served vLLM executable is refused naming the instance and the node."""
    cpu = RunSettings(
        serving_for(CPU, "/m"), tmp_path, platform=CPU, launcher=LauncherChoice("ray")
    )
    judged: list[bool] = []

    def violations(spec, argv, env, multi_node):
        judged.append(multi_node)
        return [f"{spec.name}: the side channel is announced as localhost"] * (
            spec.name == "1P+1D/decode0"
        )

    agents = [NodeAgent(check_executable=None) for _ in range(2)]
    launcher = placed_launcher(cpu, monkeypatch, *agents)
    monkeypatch.setattr(ray_launcher, "violations", violations)
    with pytest.raises(LaunchRefused) as refused:
        check_before_start(launcher, placed((), ()))
    assert str(refused.value) == "1P+1D/decode0: the side channel is announced as localhost"
    assert judged == [True, True]
    monkeypatch.setenv(NETWORK_CHECKS_ENV, "off")
    check_before_start(launcher, placed((), ()))  # warned of, not refused
    judged.clear()
    one_node = [dataclasses.replace(spec, host="10.0.0.2") for spec in placed((), ())]
    check_before_start(launcher, one_node)
    assert judged == [False, False]
    monkeypatch.delenv(NETWORK_CHECKS_ENV)

    missing = NodeAgent(check_executable="vllm is not an executable on this node")
    launcher = placed_launcher(cpu, monkeypatch, NodeAgent(check_executable=None), missing)
    with pytest.raises(LaunchRefused) as refused:
        check_before_start(launcher, placed((), ()))
    assert str(refused.value) == (
        "1P+1D/decode0: vllm is not an executable on this node (node 10.0.0.3)"
    )


@dataclasses.dataclass
class StoringSpec(PlacedSpec):
    """An instance whose connector stores under `storage` (ExampleConnector's directory)."""

    storage: Path = Path()

    def shared_storage(self) -> dict:
        return {"KV storage": self.storage}


def storage_node(view: Callable[[Path, bool], Path]) -> types.SimpleNamespace:
    """An agent whose node sees the path the harness names as `view(path, writing)`: the real
    `storage_probe` run on what that node would read and write."""

    def probe(reads: list[tuple[str, str]], write: tuple[str, str] | None) -> str:
        return InstanceAgent().storage_probe(
            [(str(view(Path(p), False)), text) for p, text in reads],
            None if write is None else (str(view(Path(write[0]), True)), write[1]),
        )

    return types.SimpleNamespace(storage_probe=types.SimpleNamespace(remote=probe))


def test_connector_storage_is_refused_unless_each_node_and_the_harness_see_every_write(
    tmp_path: Path, monkeypatch
) -> None:
    """Each way a directory can fail to be one directory is refused, by the probe that sees it:
    a node that does not see the harness's file, nodes that do not see each other's, and nodes
    that see each other's where the harness does not (found in review: only the first was
    checked, and with a cluster)."""
    shared, elsewhere = tmp_path / "shared", tmp_path / "elsewhere"
    for directory in (shared, elsewhere, elsewhere / "0", elsewhere / "1"):
        directory.mkdir()
    cpu = RunSettings(
        serving_for(CPU, "/m"), tmp_path, platform=CPU, launcher=LauncherChoice("ray")
    )
    instances = [StoringSpec(spec.name, spec.host, (), storage=shared) for spec in placed((), ())]

    def check(*views: Callable[[Path, bool], Path]) -> None:
        agents = [storage_node(view) for view in views]
        placed_launcher(cpu, monkeypatch, *agents)._check_storage(instances)

    def same(path: Path, writing: bool) -> Path:
        return path

    check(same, same)
    assert list(shared.iterdir()) == []  # the probe's files removed
    with pytest.raises(
        LaunchRefused,
        match=r"1P\+1D/decode0's node 10\.0\.0\.3 does not see "
        r"what the harness wrote there \(cannot read",
    ):
        check(same, lambda path, writing: elsewhere / path.name)
    writes_aside = iter([elsewhere / "0", elsewhere / "1"])
    asides = [
        lambda path, writing, aside=next(writes_aside): aside / path.name if writing else path
        for _ in range(2)
    ]
    with pytest.raises(
        LaunchRefused,
        match=r"1P\+1D/prefill0's node 10\.0\.0\.2 does not see "
        r"what another node wrote there",
    ):
        check(*asides)

    def among_nodes(path: Path, writing: bool) -> Path:
        """The harness's file where it wrote it; the nodes' own in a directory of theirs."""
        return path if path.name.endswith("-harness") else elsewhere / path.name

    with pytest.raises(
        LaunchRefused,
        match=r"the harness does not see what 1P\+1D/prefill0's "
        r"node 10\.0\.0\.2 wrote there",
    ):
        check(among_nodes, among_nodes)


def test_a_nodes_storage_probe_reads_what_was_written_and_writes_its_own(tmp_path: Path) -> None:
    """A file holding something else than what was written is no shared file; the node's own
    file is written for the others to read."""
    written = tmp_path / "harness"
    written.write_text("token harness", encoding="utf-8")
    agent = InstanceAgent()
    assert agent.storage_probe([(str(written), "token harness")], None) == ""
    assert agent.storage_probe([(str(written), "token other")], None) == (
        f"{written} holds something else than what was written"
    )
    own = tmp_path / "node"
    assert agent.storage_probe([], (str(own), "token 0")) == ""
    assert own.read_text(encoding="utf-8") == "token 0"


def test_an_instance_not_listening_at_its_node_or_a_side_channel_a_peer_cannot_reach_is_refused(
    tmp_path: Path, monkeypatch
) -> None:
    """From the nodes: each instance listens at its node's address, and each NIXL side channel
    opens from every peer on another node (a peer on the same node is not asked: the channel's
    reach between nodes is what is checked)."""
    cpu = RunSettings(
        serving_for(CPU, "/m"), tmp_path, platform=CPU, launcher=LauncherChoice("ray")
    )
    monkeypatch.setattr(ray_launcher, "SIDE_CHANNEL_WAIT_S", 0.0)
    monkeypatch.setattr(ray_launcher, "side_channels", lambda spec: [(spec.host, 5600)])
    monkeypatch.setattr(
        ray_launcher, "runtime", lambda: types.SimpleNamespace(log_memory=lambda: None)
    )
    instances = [
        dataclasses.make_dataclass("Spec", ["name", "host", "port"])(name, host, 8000)
        for name, host in (("1P+1D/prefill0", "10.0.0.2"), ("1P+1D/decode0", "10.0.0.3"))
    ]

    def node(host: str, **answers) -> NodeAgent:
        return NodeAgent(listening=[(host, 8000), (host, 5600)], **answers)

    placed_launcher(
        cpu, monkeypatch, node("10.0.0.2", can_connect=""), node("10.0.0.3", can_connect="")
    ).check_serving(instances)
    deaf = NodeAgent(listening=[("127.0.0.1", 8000)], can_connect="")
    with pytest.raises(LaunchRefused) as refused:
        placed_launcher(cpu, monkeypatch, node("10.0.0.2", can_connect=""), deaf).check_serving(
            instances
        )
    assert str(refused.value) == (
        "1P+1D/decode0: nothing listens at 10.0.0.3:8000 (--host/--port) on its node; it "
        "listens on 127.0.0.1:8000"
    )
    # Its HTTP port at its node's address but its NIXL side channel elsewhere (on loopback):
    # the peers' KV transfers would find nothing there (found in review: only the HTTP
    # address was checked by a test without a cluster).
    side_on_loopback = NodeAgent(
        listening=[("10.0.0.3", 8000), ("127.0.0.1", 5600)], can_connect=""
    )
    with pytest.raises(LaunchRefused) as refused:
        placed_launcher(
            cpu, monkeypatch, node("10.0.0.2", can_connect=""), side_on_loopback
        ).check_serving(instances)
    assert str(refused.value) == (
        "1P+1D/decode0: nothing listens at 10.0.0.3:5600 (VLLM_NIXL_SIDE_CHANNEL_HOST/_PORT) on "
        "its node; it listens on 10.0.0.3:8000, 127.0.0.1:5600"
    )
    cut_off = node("10.0.0.3", can_connect="ConnectionRefusedError: refused")
    with pytest.raises(
        LaunchRefused,
        match=r"^1P\+1D/prefill0's NIXL side channel "
        r"10\.0\.0\.2:5600 cannot be reached from 1P\+1D/decode0's node",
    ):
        placed_launcher(cpu, monkeypatch, node("10.0.0.2", can_connect=""), cut_off).check_serving(
            instances
        )
    # Two instances on one node: neither is asked to reach the other's channel (no
    # `can_connect` on these agents: asked, they would raise AttributeError).
    same_node = [dataclasses.replace(spec, host="10.0.0.2") for spec in instances]
    placed_launcher(cpu, monkeypatch, node("10.0.0.2"), node("10.0.0.2")).check_serving(same_node)
    # With the network checks off nothing is asked of the nodes (NodeAgents without
    # `listening`: asked, they would raise AttributeError), so nothing can refuse the topology.
    monkeypatch.setenv(NETWORK_CHECKS_ENV, "off")
    placed_launcher(cpu, monkeypatch, NodeAgent(), NodeAgent()).check_serving(instances)


def test_a_shared_dir_is_fresh_per_run_and_close_frees_the_agents_and_the_placement(
    tmp_path: Path, monkeypatch
) -> None:
    """Without --ray-shared-dir a connector stores under the session's own directory; with it,
    under a directory of this run's in the shared one. `close` ends each agent and removes the
    placement group, so the next topology can be placed."""
    cpu = RunSettings(
        serving_for(CPU, "/m"), tmp_path, platform=CPU, launcher=LauncherChoice("ray")
    )
    session = tmp_path / "run" / "1P+1D"
    assert ray_launcher.RayLauncher(cpu).storage_root(session) == session
    shared = dataclasses.replace(cpu, launcher=LauncherChoice("ray", shared_dir=tmp_path / "nfs"))
    root = ray_launcher.RayLauncher(shared).storage_root(session)
    assert root.parent.parent == tmp_path / "nfs" and root.name == "1P+1D", root
    assert root.parent.name.startswith("epd-"), root
    launcher = ray_launcher.RayLauncher(cpu)
    ended: list = []
    monkeypatch.setattr(ray_launcher.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray_launcher.ray, "kill", ended.append)
    monkeypatch.setattr(ray_launcher, "remove_placement_group", ended.append)
    launcher._agents, launcher._group = ["agent0", "agent1"], "group"
    launcher.close()
    assert ended == ["agent0", "agent1", "group"]
    # Ray already shut down (the run's connection closed after a Ctrl-C): nothing is asked of
    # it, where a placement group's removal would raise from the run's clean-up (found in
    # review).
    monkeypatch.setattr(ray_launcher.ray, "is_initialized", lambda: False)
    launcher._agents, launcher._group = ["agent2"], "group2"
    launcher.close()
    assert ended == ["agent0", "agent1", "group"] and launcher._agents == []


class ExitingServer:
    """A server as its agent polls it, that writes its last lines and exits the moment its
    exit status is first asked for: the moment a dying vLLM writes its traceback and ends."""

    def __init__(self, log_path: Path) -> None:
        self.command = types.SimpleNamespace(log_path=log_path)
        self.exited = False

    def sampled_usage(self) -> tuple[int, dict]:
        return 0, {}

    @property
    def exit_code(self) -> int | None:
        if not self.exited:
            with open(self.command.log_path, "a", encoding="utf-8") as log:
                log.write("RuntimeError: the engine's last words\n")
            self.exited = True
        return 1


def test_a_poll_that_reports_an_exit_carries_the_log_written_before_it(tmp_path) -> None:
    """The harness names a dead server with the log its agent brought back in the poll that
    reported the exit (`RayServer.check_alive`), as a local server's is read after its exit is
    seen. Found in review: the agent read the log before the exit status, so a server that wrote
    its traceback and exited between the two was reported dead without its last lines."""
    log_path = tmp_path / "server.log"
    log_path.write_text("starting\n", encoding="utf-8")
    agent = InstanceAgent()
    agent.server = ExitingServer(log_path)
    state = agent.poll(0)
    assert state["exit"] == 1
    assert b"the engine's last words" in state["data"]


def test_an_instance_whose_agent_is_lost_is_reported_lost_not_exited(tmp_path, monkeypatch) -> None:
    """A request that failed, a load that ended and the pool's restart name a dead instance by
    `dead_instance()`. Found in review: an instance whose node (its agent) was lost has no exit
    code, and was reported as "exited with code None", its cause (the agent gone) left out."""
    from ray.exceptions import GetTimeoutError

    from harness.run.pool import StartCause
    from harness.serve import ray_server
    from harness.serve.server_command import ServerCommand

    def no_answer(*_args, **_kwargs):
        raise GetTimeoutError("no answer")

    command = ServerCommand(
        "1P+1D/decode0", ["vllm"], "http://10.0.0.3:8000/health", tmp_path / "d.log"
    )
    command.log_path.write_text("serving\n", encoding="utf-8")
    agent = types.SimpleNamespace(poll=types.SimpleNamespace(remote=lambda offset: None))
    server = ray_server.RayServer(agent, command, NodeInfo("10.0.0.3"))
    server._pid = 4242
    monkeypatch.setattr(ray_server.ray, "get", no_answer)
    session = TopologySession.__new__(TopologySession)
    session._servers = [server]
    report = session.dead_instance_report()
    assert report is not None
    first = report.splitlines()[0]
    assert "exited with code None" not in first, first
    assert first.startswith("instance 1P+1D/decode0 ") and "no answer from it in 60 s" in first
    restart = StartCause(True, False, session.dead_instance()).reason({})
    assert "exited with code None" not in restart and "no answer from it" in restart, restart


def test_polls_from_several_threads_mirror_the_nodes_log_once(tmp_path, monkeypatch) -> None:
    """A load's threads each check the instances alive and read their log sizes around every
    request, so a Ray server is polled from several threads at once. Found in review: two polls
    from the same offset each appended what they brought and each advanced the offset, so the
    mirrored log held lines twice and then skipped as many of the node's (a death's evidence
    among them)."""
    from harness.serve import ray_server
    from harness.serve.server_command import ServerCommand

    node_log = bytearray(b"first line\n")
    both_in = threading.Barrier(2)

    def get(offset, timeout=None):
        with contextlib.suppress(threading.BrokenBarrierError):
            both_in.wait(0.5)  # two polls in flight together, unless one waits for the other
        return {"exit": None, "data": bytes(node_log[offset:]), "rss": 0, "cpu": {}}

    command = ServerCommand(
        "1P+1D/decode0", ["vllm"], "http://10.0.0.3:8000/health", tmp_path / "d.log"
    )
    agent = types.SimpleNamespace(poll=types.SimpleNamespace(remote=lambda offset: offset))
    monkeypatch.setattr(ray_server.ray, "get", get)
    server = ray_server.RayServer(agent, command, NodeInfo("10.0.0.3"))
    server._pid = 4242
    command.log_path.write_bytes(b"")  # the mirror's header left out
    threads = [threading.Thread(target=server.log_size) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    node_log += b"second line\n"
    server.log_size()
    assert command.log_path.read_bytes() == bytes(node_log)


def test_a_stop_the_agent_never_confirms_fails_naming_the_instance(tmp_path, monkeypatch) -> None:
    """The agent's answer to stop() does not come in time (its node overloaded, or cut off):
    the stop fails as a stop of that instance (ServerStopFailed naming it and its node, which
    the group and the CLI report), not as Ray's bare GetTimeoutError naming nothing, and the
    agent is killed, so the agent's watchdog ends the server (found in review)."""
    from ray.exceptions import GetTimeoutError

    from harness.serve import ray_server
    from harness.serve.launch import ServerStopFailed
    from harness.serve.server_command import ServerCommand

    def get(call, timeout=None):
        if call == "stop":
            raise GetTimeoutError("no answer")
        return {"exit": None, "data": b"", "rss": 0, "cpu": {}}

    killed = []
    command = ServerCommand(
        "1P+1D/decode0", ["vllm"], "http://10.0.0.3:8000/health", tmp_path / "d.log"
    )
    command.log_path.write_bytes(b"")
    agent = types.SimpleNamespace(
        poll=types.SimpleNamespace(remote=lambda offset: "poll"),
        stop=types.SimpleNamespace(remote=lambda grace, ready: "stop"),
    )
    monkeypatch.setattr(ray_server.ray, "get", get)
    monkeypatch.setattr(ray_server.ray, "kill", killed.append)
    server = ray_server.RayServer(agent, command, NodeInfo("10.0.0.3"))
    server._pid = 4242
    with pytest.raises(ServerStopFailed, match=r"1P\+1D/decode0: .*Ray node 10\.0\.0\.3"):
        server.stop(1.0)
    assert killed == [agent]


class ScriptedAgent:
    """A RayServer's agent whose calls `ray.get` answers from `answers` (a method name to a
    list of answers, the last one repeated; an exception is raised), recording each call."""

    def __init__(self, monkeypatch, **answers: list) -> None:
        from harness.serve import ray_server

        self.calls: list[tuple] = []
        self.answers = answers
        for method in ("poll", "stop", "discard", "owns_health_port"):
            setattr(
                self,
                method,
                types.SimpleNamespace(remote=lambda *args, method=method: (method, *args)),
            )
        monkeypatch.setattr(ray_server.ray, "get", self.get)
        monkeypatch.setattr(ray_server.ray, "kill", lambda agent: self.calls.append(("kill",)))

    def get(self, call: tuple, timeout: float | None = None):
        self.calls.append(call)
        queue = self.answers.get(call[0], [None])
        answer = queue.pop(0) if len(queue) > 1 else queue[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer


def started_server(tmp_path: Path, agent: ScriptedAgent):
    from harness.serve import ray_server
    from harness.serve.server_command import ServerCommand

    command = ServerCommand(
        "1P+1D/decode0", ["vllm"], "http://10.0.0.3:8000/health", tmp_path / "d.log"
    )
    command.log_path.write_bytes(b"")
    server = ray_server.RayServer(agent, command, NodeInfo("10.0.0.3"))
    server._pid = 4242
    return server


def polled(rss: int, cpu: dict, exit_code: int | None = None) -> dict:
    return {"exit": exit_code, "data": b"", "rss": rss, "cpu": cpu}


def test_a_ray_servers_usage_is_its_peak_and_its_death_names_the_phase(
    tmp_path: Path, monkeypatch
) -> None:
    """The peak RSS of every poll, not the last one's; the CPU seconds of the last poll that
    had them; a death before readiness said to be during startup, after it while serving."""
    agent = ScriptedAgent(
        monkeypatch,
        poll=[
            polled(900, {"user": 2.0}),
            polled(400, {}),
            polled(400, {}, exit_code=1),
        ],
    )
    server = started_server(tmp_path, agent)
    assert server.peak_rss_bytes() == 900
    assert server.peak_rss_bytes() == 900
    assert server.cpu_seconds() == {"user": 2.0}
    with pytest.raises(ServerDied, match=r"died during startup: "):
        server.check_alive()
    serving = started_server(tmp_path, ScriptedAgent(monkeypatch, poll=[polled(0, {}, 1)]))
    serving._spawned_at = time.monotonic() - 5.0  # spawned 5 s ago
    serving.mark_ready()
    first = serving.startup_seconds
    serving.mark_ready()
    assert serving.startup_seconds == first  # readiness is when it came first
    with pytest.raises(ServerDied, match=r"died while serving: "):
        serving.check_alive()


def test_a_ray_server_whose_agent_is_lost_is_not_alive_and_its_stop_asks_no_more_of_it(
    tmp_path: Path, monkeypatch
) -> None:
    """An agent lost during the stop ended its server (its watchdog): the instance is not
    alive, and nothing more is asked of the agent, whose node-side log is gone with it."""
    from ray.exceptions import RayActorError

    agent = ScriptedAgent(
        monkeypatch, poll=[polled(0, {})], stop=[RayActorError()], owns_health_port=[True]
    )
    server = started_server(tmp_path, agent)
    assert server.is_alive() and server.owns_health_port()
    agent.calls.clear()
    server.stop(1.0)
    assert [call[0] for call in agent.calls] == ["poll", "stop", "kill"]
    assert server.lost is not None and "10.0.0.3 is gone" in server.lost
    assert not server.is_alive()
    agent.answers["owns_health_port"] = [RayActorError()]
    assert not server.owns_health_port()  # no answer is no readiness


def test_a_ray_server_whose_agent_stopped_answering_is_named_dead_and_its_stop_asks_it_nothing(
    tmp_path: Path, monkeypatch
) -> None:
    """An agent that no longer answers (its node gone or cut off) took its server with it (its
    watchdog): `check_alive` raises ServerDied saying so, which is how a request's failure and
    the pool learn of it, and the stop asks the lost agent nothing more (asked, a stop of an
    unreachable node waits out its timeout and then fails the stop) (found in review)."""
    from ray.exceptions import GetTimeoutError

    agent = ScriptedAgent(monkeypatch, poll=[GetTimeoutError("no answer")])
    server = started_server(tmp_path, agent)
    with pytest.raises(
        ServerDied,
        match=r"^1P\+1D/decode0 \(pid 4242 on Ray node 10\.0\.0\.3\): its agent is gone during "
        r"startup \(",
    ):
        server.check_alive()
    agent.calls.clear()
    server.stop(1.0)
    assert agent.calls == [("kill",)]


def test_a_ray_server_stopped_before_it_was_ready_gets_the_start_up_grace(
    tmp_path: Path, monkeypatch
) -> None:
    """As a local server: a server not yet ready is stopped with at most the start-up grace,
    a ready one with the grace asked for, and a second stop does nothing."""
    from harness.serve.launch import STARTUP_STOP_GRACE_S

    for ready, grace in ((False, STARTUP_STOP_GRACE_S), (True, 60.0)):
        agent = ScriptedAgent(monkeypatch, poll=[polled(0, {})])
        server = started_server(tmp_path, agent)
        if ready:
            server.mark_ready()
        server.stop(60.0)
        assert ("stop", grace, ready) in agent.calls, agent.calls
        calls = len(agent.calls)
        server.stop(60.0)
        server.log_size()  # a stopped server's ended agent is polled no more
        assert len(agent.calls) == calls


def test_a_ray_server_started_again_keeps_its_earlier_log(tmp_path: Path, monkeypatch) -> None:
    """On Ray a dead instance's topology is started again under the same names: the new start
    moves the earlier mirror aside (<name>.1.log, as a local server does) instead of writing
    over the log that shows why the restart was needed (found in review)."""
    from harness.serve import ray_server

    monkeypatch.setattr(ray_server, "get_or_refuse", lambda call, doing: {"pid": 4243})
    agent = types.SimpleNamespace(start=types.SimpleNamespace(remote=lambda *args: "start"))
    server = started_server(tmp_path, ScriptedAgent(monkeypatch))
    server.command.log_path.write_text("RuntimeError: the first start's death\n")
    again = ray_server.RayServer(agent, server.command, NodeInfo("10.0.0.3"))
    again.start()
    kept = tmp_path / "d.1.log"
    assert kept.read_text() == "RuntimeError: the first start's death\n"
    assert "the first start's death" not in server.command.log_path.read_text()
    assert again.pid == 4243


def test_a_poll_brings_every_chunk_the_node_has_in_one_call(tmp_path: Path, monkeypatch) -> None:
    """A log that grew by more than one chunk since the last poll is brought over whole: the
    poll asks again while a chunk came back full."""
    from harness.serve import ray_server

    monkeypatch.setattr(ray_server, "LOG_CHUNK_BYTES", 4)
    chunks = [b"abcd", b"efgh", b"ij"]
    agent = ScriptedAgent(
        monkeypatch, poll=[{"exit": None, "data": c, "rss": 0, "cpu": {}} for c in chunks]
    )
    server = started_server(tmp_path, agent)
    assert server.log_size() == 10
    assert server.command.log_path.read_bytes() == b"abcdefghij"


def test_an_agent_holds_a_side_channel_port_only_for_nixl_and_finds_the_served_executable(
    tmp_path: Path,
) -> None:
    """`reserve` holds an HTTP port, and a NIXL side-channel port only when asked; an
    executable the node lacks is named, one it has is not."""
    agent = InstanceAgent()
    try:
        http, side = agent.reserve("127.0.0.1", True)
        assert len(agent.leases) == 2 and side is not None and side != http
    finally:
        agent.stop(0.0, ready=False)
    try:
        assert agent.reserve("127.0.0.1", False)[1] is None and len(agent.leases) == 1
    finally:
        agent.stop(0.0, ready=False)
    assert agent.check_executable(sys.executable) is None
    missing = str(tmp_path / "vllm")
    assert agent.check_executable(missing) == f"{missing} is not an executable on this node"


def test_an_agent_lists_only_what_its_server_listens_on_and_stops_a_ready_one_as_ready(
    tmp_path: Path,
) -> None:
    """`listening` is the sockets the server's tree listens on, not its open connections;
    a server stopped as ready is marked ready first, so it gets its full grace."""
    agent = InstanceAgent()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    try:
        agent.server = types.SimpleNamespace(pid=os.getpid())  # type: ignore[assignment]
        found = agent.listening()
        assert listener.getsockname() in found and client.getsockname() not in found, found
    finally:
        for sock in (accepted, client, listener):
            sock.close()
    media = tmp_path / "media"
    media.mkdir()
    for name in "abcdefghij":
        (media / name).write_bytes(b"")
    assert agent.directory_listing(str(media)) == list("abcdefghij")  # as the harness lists it
    done: list = []
    agent.server = types.SimpleNamespace(  # type: ignore[assignment]
        mark_ready=lambda: done.append("ready"), stop=lambda grace: done.append(grace)
    )
    agent.stop(30.0, ready=True)
    agent.stop(5.0, ready=False)
    assert done == ["ready", 30.0, 5.0]


def test_a_call_that_raised_on_the_node_is_one_line_naming_what_was_done_and_the_cause(
    monkeypatch,
) -> None:
    from ray.exceptions import RayTaskError

    from harness.serve import ray_calls

    def raised_there(refs, timeout=None):
        raise RayTaskError("storage_probe", "PermissionError: read-only", PermissionError())

    monkeypatch.setattr(ray_calls.ray, "get", raised_there)
    with pytest.raises(LaunchRefused) as refused:
        ray_calls.get_or_refuse([], "probing KV storage /nfs on the nodes")
    assert str(refused.value).startswith(
        "probing KV storage /nfs on the nodes: RayTaskError(PermissionError): "
    ), refused.value


def test_a_refused_placement_says_what_the_cluster_has_free(monkeypatch) -> None:
    """Found on real vLLM: a placement refused on three alive nodes of CPU 1 for three
    instances read as if Ray were wrong; a fuzz's baseline held one of them. The refusal says
    what is free of what the bundle asks, of the cluster's total."""
    monkeypatch.setattr(ray_launcher.ray, "available_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(ray_launcher.ray, "cluster_resources", lambda: {"CPU": 3.0, "GPU": 8.0})
    assert ray_launcher.describe_free({"CPU": 1}) == "CPU 2 of 3"
    assert ray_launcher.describe_free({"CPU": 1, "GPU": 1}) == "CPU 2 of 3, GPU 0 of 8"


def test_a_placement_ray_never_grants_is_refused_naming_the_nodes_and_what_is_free(
    tmp_path: Path, monkeypatch
) -> None:
    """The refusal a user reads when Ray waits out the placement: the topology, its bundles,
    the nodes and what is free of them (a mutant that dropped 'free now' from the message
    survived: describe_free was checked alone)."""
    from ray.exceptions import GetTimeoutError

    def never(*args, **kwargs):
        raise GetTimeoutError("placement group not ready")

    PlacingRay(monkeypatch)
    monkeypatch.setattr(ray_launcher.ray, "get", never)
    monkeypatch.setattr(ray_launcher, "describe_nodes", lambda: "127.0.0.2, 127.0.0.3")
    monkeypatch.setattr(ray_launcher.ray, "available_resources", lambda: {"CPU": 1.0})
    monkeypatch.setattr(ray_launcher.ray, "cluster_resources", lambda: {"CPU": 2.0})
    settings = RunSettings(
        serving_for(CPU, "/m"), tmp_path, platform=CPU, launcher=LauncherChoice("ray")
    )
    with pytest.raises(LaunchRefused) as refused:
        ray_launcher.RayLauncher(settings).reserve(TOPOLOGIES["1E+1P+1D"], ())
    assert str(refused.value) == (
        "1E+1P+1D: Ray cannot place its 3 instances (CPU 1 each, every one on a node of its "
        "own) within 60 s; nodes: 127.0.0.2, 127.0.0.3; free now: CPU 1 of 2"
    )
