"""The launcher seam (harness.serve.launcher): what a session takes from its launcher, in order.

A stub launcher stands in for Ray: it places two GPU instances on two nodes with accelerator ids
of its own choosing. Nothing is launched (the stub's servers only record that they were
started), so this is pure logic: the session must bind each instance to its node's address,
give it the launcher's devices, write the node into the bundle's `.cmd.json`, and ask whether
the commands may start before starting any of them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.errors import BadInput
from harness.preflight import launcher as launcher_flags
from harness.serve import session as session_module
from harness.serve.launcher import LaunchRefused, LocalLauncher, NodeInfo, Reservation
from harness.serve.session import TopologySession
from harness.spec.platforms import CPU, CUDA
from harness.spec.settings import LauncherChoice, RunSettings
from harness.spec.topology import TOPOLOGIES, serving_for

pytestmark = pytest.mark.unit

NODES = [NodeInfo("10.0.0.2", "n2", "host-p"), NodeInfo("10.0.0.3", "n3", "host-d")]


class StubServer:
    def __init__(self, command, log: list[str]) -> None:
        self.command, self.name, self.pid, self._log = command, command.name, None, log

    def start(self) -> None:
        self._log.append(f"start {self.name}")

    def stop(self, grace_s: float = 0.0) -> None:
        self._log.append(f"stop {self.name}")


class StubLauncher:
    kind = "stub"

    def __init__(self, refuse: bool = False) -> None:
        self.log: list[str] = []
        self.refuse = refuse

    def storage_root(self, session_dir: Path) -> Path:
        return session_dir

    def reserve(self, topology, devices, before_device_wait=None) -> Reservation:
        self.log.append("reserve")
        return Reservation(
            hosts=[n.address for n in NODES],
            ports=[23001, 23002],
            side_channel_ports=[24001, 24002],
            nodes=list(NODES),
            devices=[(3,), (5,)],
        )

    def instance_env(self, spec) -> dict[str, str]:
        return {**spec.env(), "UCX_TLS": "tcp"}

    def check_before_start(self, topology, instances, commands) -> None:
        self.log.append(f"check {len(commands)} commands")
        if self.refuse:
            raise LaunchRefused(f"{instances[0].name}: refused by the stub")

    def server(self, index: int, command) -> StubServer:
        return StubServer(command, self.log)

    def check_serving(self, instances) -> None:
        self.log.append("check serving")

    def close(self) -> None:
        self.log.append("close")


def gpu_settings(tmp_path: Path) -> RunSettings:
    return RunSettings(
        serving=serving_for(CUDA, "/models/m", kv_connector="NixlConnector"),
        run_dir=tmp_path / "run",
        platform=CUDA,
        devices=(0, 1),
        launcher=LauncherChoice("ray"),
    )


def test_instances_get_the_launchers_nodes_devices_and_env(tmp_path, monkeypatch) -> None:
    stub = StubLauncher()
    monkeypatch.setattr(session_module, "launcher_for", lambda settings: stub)
    session = TopologySession(TOPOLOGIES["1P+1D"], gpu_settings(tmp_path))
    session.start_servers()
    assert stub.log == [
        "reserve",
        "check 2 commands",
        "start 1P+1D/prefill0",
        "start 1P+1D/decode0",
    ]
    for spec, node, device in zip(session.instances, NODES, ("3", "5")):
        env = spec.env()
        assert spec.host == node.address and spec.url.startswith(f"http://{node.address}:")
        assert env["CUDA_VISIBLE_DEVICES"] == device  # Ray's accelerator ids, not the schedule's
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == node.address
        assert session.stats[spec.name].node == node.address
        cmd = json.loads(
            Path(session.stats[spec.name].log_path).with_suffix(".cmd.json").read_text()
        )
        assert cmd["node"] == node.to_json() and cmd["env"]["UCX_TLS"] == "tcp"
    session.close()
    assert stub.log[-1] == "close"


def test_a_refused_launch_starts_nothing(tmp_path, monkeypatch) -> None:
    stub = StubLauncher(refuse=True)
    monkeypatch.setattr(session_module, "launcher_for", lambda settings: stub)
    session = TopologySession(TOPOLOGIES["1P+1D"], gpu_settings(tmp_path))
    with pytest.raises(LaunchRefused, match="1P\\+1D/prefill0: refused by the stub"):
        session.start_servers()
    assert not any(entry.startswith("start") for entry in stub.log)
    session.close()


def test_the_local_launcher_binds_loopback_and_has_no_nodes(tmp_path) -> None:
    settings = RunSettings(
        serving=serving_for(CPU, "/models/m", kv_connector="NixlConnector"),
        run_dir=tmp_path / "run",
    )
    launcher = LocalLauncher(settings)
    try:
        placed = launcher.reserve(TOPOLOGIES["1P+1D"], (0, 1))
        assert placed.hosts == [] and placed.nodes == [] and placed.devices is None
        assert len(placed.ports) == 2 and len(placed.side_channel_ports) == 2
    finally:
        launcher.close()


@dataclass
class Request:
    launcher: str = "ray"
    proxy: str = "harness"
    ray_address: str | None = None
    ray_placement: str | None = None
    ray_shared_dir: str | None = None
    ray_instance_env: tuple[str, ...] = ()


def test_the_ray_flags_become_one_launcher_choice(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(launcher_flags.importlib.metadata, "version", lambda name: "2.60.0")
    choice = launcher_flags.launcher_choice(
        Request(
            ray_address="10.0.0.1:6379",
            ray_placement="pack",
            ray_shared_dir=str(tmp_path),
            ray_instance_env=("UCX_TLS=tcp", "A=b=c"),
        )
    )
    assert choice == LauncherChoice(
        "ray",
        ray_address="10.0.0.1:6379",
        placement="pack",
        shared_dir=tmp_path.resolve(),
        instance_env=(("UCX_TLS", "tcp"), ("A", "b=c")),
    )
    launcher_flags.check_launcher_here(choice)  # Ray "installed", the directory there
    assert launcher_flags.launcher_choice(Request(launcher="local")) == LauncherChoice()


def test_without_ray_installed_the_ray_launcher_is_one_line(monkeypatch) -> None:
    def missing(name: str) -> str:
        raise launcher_flags.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(launcher_flags.importlib.metadata, "version", missing)
    with pytest.raises(BadInput, match=r"--launcher ray needs Ray .*scripts/cpu setup --ray"):
        launcher_flags.check_launcher_here(launcher_flags.launcher_choice(Request()))


# -- the pool ------------------------------------------------------------------------------------


class StubSession:
    def __init__(self, name: str, stopped: list[str]) -> None:
        self.name, self._stopped = name, stopped

    def dead_instance_report(self) -> None:
        return None

    def dead_instance(self) -> None:
        return None

    def close(self) -> None:
        self._stopped.append(self.name)


def test_a_ray_session_is_another_session_and_frees_its_cluster_for_the_next(
    tmp_path, monkeypatch
) -> None:
    """The pool keys a session by its launcher too (a Ray 1E+1P+1D is not the local one),
    and a session coming on a Ray cluster first stops the others on that cluster (the
    rehearsal cluster's nodes hold one topology), never a local session."""
    from harness.run.pool import SessionKey, TopologyPool, _Live

    local = RunSettings(serving=serving_for(CPU, "/models/m"), run_dir=tmp_path / "run")
    on_ray = dataclasses.replace(local, launcher=LauncherChoice("ray"))
    nixl_on_ray = dataclasses.replace(
        on_ray, serving=dataclasses.replace(on_ray.serving, kv_connector="NixlConnector")
    )
    elsewhere = dataclasses.replace(on_ray, launcher=LauncherChoice("ray", "10.0.0.1:6379"))
    epd = TOPOLOGIES["1E+1P+1D"]
    keys = {
        name: SessionKey.of(epd, settings)
        for name, settings in (
            ("local", local),
            ("ray", on_ray),
            ("nixl-ray", nixl_on_ray),
            ("elsewhere", elsewhere),
        )
    }
    assert len(set(keys.values())) == 4
    assert keys["ray"].describe(local.serving, local.launcher) == "1E+1P+1D launcher=ray"
    monkeypatch.setattr("harness.run.pool.cpu_instances_that_fit", lambda: 100)  # memory: plenty
    pool = TopologyPool(local)
    stopped: list[str] = []
    for name in ("local", "ray", "elsewhere"):
        pool._live[keys[name]] = _Live(StubSession(name, stopped), 0.0)  # type: ignore[arg-type]
    pool._make_room([(keys["nixl-ray"], epd, ())])
    assert stopped == ["ray"], stopped


class StartingStub(StubSession):
    """A session the pool starts: it serves at once."""

    def __init__(self, name: str, stopped: list[str], topology, devices=()) -> None:
        super().__init__(name, stopped)
        self.topology, self.devices = topology, devices
        self.dir, self.earlier_logs, self.stats = Path("/nowhere"), (), {}

    def start_servers(self) -> None:
        pass

    def wait_until_serving(self) -> None:
        pass


def test_a_restart_on_ray_keeps_the_sessions_asked_for_with_it(tmp_path, monkeypatch) -> None:
    """Found on real vLLM: `fuzz --launcher ray --plant-fault corrupt-ec` on 1E+1P+1D: D died,
    its revival is the local launcher's, so the topology started again, and the pool stopped
    the baseline beside it on the cluster (one topology at a time); the shrink's next control
    request to the baseline was a traceback ("session not started"). Sessions asked for
    together are kept together: a running one asked for with one that starts stays up."""
    from harness.run import pool as pool_module
    from harness.run.pool import SessionKey, SessionRequest, TopologyPool, _Live
    from harness.spec.topology import BASELINE

    on_ray = RunSettings(
        serving=serving_for(CPU, "/models/m"),
        run_dir=tmp_path / "run",
        launcher=LauncherChoice("ray"),
    )
    epd = TOPOLOGIES["1E+1P+1D"]
    monkeypatch.setattr(pool_module, "cpu_instances_that_fit", lambda: 100)
    pool = TopologyPool(on_ray)
    stopped: list[str] = []
    baseline = StubSession("baseline", stopped)
    pool._live[SessionKey.of(BASELINE, on_ray)] = _Live(baseline, 0.0)  # type: ignore[arg-type]
    monkeypatch.setattr(
        pool, "_new_session", lambda request: StartingStub("epd", stopped, request.topology)
    )
    opened = pool.open([SessionRequest(t, on_ray, None) for t in (BASELINE, epd)])
    assert stopped == [] and list(opened.values())[0] is baseline, stopped
    # Asked for alone, the topology on the cluster still stops the others there.
    pool._live.pop(SessionKey.of(epd, on_ray))
    pool.open([SessionRequest(epd, on_ray, None)])
    assert stopped == ["baseline"], stopped


def test_the_one_host_ray_rehearsal_is_refused_on_a_gpu_platform() -> None:
    """Its nodes would each report every device of the host; a real cluster is fine anywhere,
    and the rehearsal is fine on CPU."""
    rehearsal = LauncherChoice(kind="ray")
    refusal = rehearsal.refusal_on(CUDA)
    assert refusal is not None and "--ray-address" in refusal and "cuda" in refusal
    assert rehearsal.refusal_on(CPU) is None
    assert LauncherChoice(kind="ray", ray_address="10.0.0.1:6379").refusal_on(CUDA) is None
    assert LauncherChoice().refusal_on(CUDA) is None


def test_a_sweep_on_ray_runs_one_topology_a_wave(tmp_path, monkeypatch) -> None:
    """A wave's topologies start together, each instance taking a node's bundle: found in
    review, with --devices 0-3 the CPU packing put 1E+1PD and 1P+1D (four instances) in one
    wave of the three-node rehearsal, and Ray could not place the second."""
    from harness.run import sweep as sweep_module
    from harness.run.sweep import Sweep, SweepSpec
    from harness.spec.topology import EPD_TOPOLOGY_NAMES

    monkeypatch.setattr(sweep_module, "available_memory_bytes", lambda: 24 * 2**30)
    topologies = tuple(TOPOLOGIES[name] for name in EPD_TOPOLOGY_NAMES)
    for launcher, most in ((LauncherChoice("ray"), 1), (LauncherChoice(), 2)):
        settings = RunSettings(
            serving_for(CPU, "/models/m"),
            tmp_path / launcher.kind,
            platform=CPU,
            devices=(0, 1, 2, 3),
            launcher=launcher,
        )
        waves = Sweep(SweepSpec(topologies, prompts=()), settings).schedule().waves
        assert max(len(wave.slots) for wave in waves) == most, (launcher, waves)


def test_a_sweep_on_a_gpu_cluster_runs_one_topology_a_wave_too(tmp_path) -> None:
    """On GPUs the waves were packed by the devices listed here (8: every topology in the
    first wave), and on a cluster the pool keeps one topology at a time: each start of the
    wave stopped the one before, to be started again for its cases."""
    from harness.run.sweep import Sweep, SweepSpec
    from harness.spec.topology import EPD_TOPOLOGY_NAMES

    topologies = tuple(TOPOLOGIES[name] for name in EPD_TOPOLOGY_NAMES)
    for launcher, waves_of_one in (
        (LauncherChoice("ray", ray_address="10.0.0.1:6379"), True),
        (LauncherChoice(), False),
    ):
        settings = RunSettings(
            serving_for(CUDA, "/models/m"),
            tmp_path / launcher.kind,
            platform=CUDA,
            devices=tuple(range(8)),
            launcher=launcher,
        )
        waves = Sweep(SweepSpec(topologies, prompts=()), settings).schedule().waves
        assert [len(w.slots) == 1 for w in waves] == [waves_of_one] * len(waves), waves
        assert len(waves) == (4 if waves_of_one else 1), waves  # the baseline and three


def test_a_rehearsal_cluster_has_a_node_for_every_instance_a_run_keeps_up() -> None:
    """Found on real vLLM: `fuzz --topology 1E+1P+1D --launcher ray` keeps the baseline up
    beside the topology, and the rehearsal's three nodes held the baseline and two of the
    three instances: Ray waited 60 s and refused the placement. A fuzz's rehearsal cluster has
    a node for the baseline too; a run's (one topology at a time) stays at three; a cluster
    given by address is the user's, never resized."""
    from harness.cli.fuzz import fuzz_request
    from harness.cli.main import check_command_line, request_from_args
    from harness.preflight.config import check_arguments

    def nodes(*argv: str) -> int:
        args = check_command_line(list(argv))
        request = fuzz_request(args) if argv[0] == "fuzz" else request_from_args(args)
        return check_arguments(request, read_files=False).launcher.rehearsal_nodes

    assert nodes("fuzz", "--topology", "1E+1P+1D", "--launcher", "ray") == 4
    assert nodes("fuzz", "--topology", "1E+1PD", "--launcher", "ray") == 3
    assert nodes("run", "--topology", "1E+1P+1D", "--launcher", "ray") == 3
    # Never fewer than three (docs/multi-node.md): a run of two instances rehearses on three.
    assert nodes("run", "--topology", "1P+1D", "--launcher", "ray") == 3
    given = ("--launcher", "ray", "--ray-address", "10.0.0.1:6379")
    assert nodes("fuzz", "--topology", "1E+1P+1D", *given) == 3
