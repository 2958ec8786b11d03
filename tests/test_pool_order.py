"""What the pool's `open` hands back, in the order asked (harness/run/pool.py), without any
server: sessions stand in for a topology's instances."""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

import pytest

from harness.run import pool as pool_module
from harness.run.pool import SessionRequest, TopologyPool
from harness.serve.device_wants import DeviceWant
from harness.serve.session import DeadInstance
from harness.spec.placement import CPU_INSTANCE_BYTES, CPU_MEMORY_HEADROOM
from harness.spec.platforms import CUDA
from harness.spec.settings import VLLM_PROXY, LauncherChoice, ProxyChoice, RunSettings
from harness.spec.topology import BASELINE, TOPOLOGIES, Role, ServingConfig

pytestmark = pytest.mark.unit


class StandIn:
    """A session that starts at once (or fails to, with `fails`) and never dies."""

    def __init__(self, request: SessionRequest, fails: bool) -> None:
        self.topology = request.topology
        self.settings = request.settings
        self.devices = ()
        self.dir = request.settings.run_dir / request.topology.name
        self.earlier_logs: dict[Path, Path] = {}
        self.stats: dict = {}
        self.fails = fails

    def start_servers(self) -> None:
        if self.fails:
            raise RuntimeError(f"{self.topology.name} did not start")

    def wait_until_serving(self) -> None: ...

    def dead_instance(self) -> None:
        return None

    def dead_instance_report(self) -> None:
        return None

    def close(self) -> None: ...


def test_open_hands_back_each_session_in_the_order_asked_whichever_were_running(
    tmp_path: Path,
) -> None:
    """Its callers read the answer by position: the sweep pairs it with a wave's slots (zip),
    the fuzzer unpacks `baseline, topology`. A topology already running (the pytest pool's,
    started by an earlier scenario) was put first, ahead of those started now (found in
    review): the fuzzer took 1E+1PD for its baseline and fuzzed the baseline against it, and
    a sweep's 1E+1P+1D, running, was failed as "1E+1P+1D could not start" with the error of its
    reference 1P+1D, which was then served again."""
    settings = RunSettings(serving=ServingConfig(model="/models/tiny"), run_dir=tmp_path)
    pool = TopologyPool(settings)
    failing = {"1P+1D"}
    pool._new_session = lambda request: StandIn(request, request.topology.name in failing)
    running = pool.session(TOPOLOGIES["1E+1PD"])

    opened = pool.open(
        [SessionRequest(BASELINE, settings), SessionRequest(running.topology, settings)]
    )
    assert [s.topology.name for s in opened.values()] == ["baseline", "1E+1PD"]
    assert list(opened.values())[1] is running

    pool.session(TOPOLOGIES["1E+1P+1D"])
    wave = [SessionRequest(TOPOLOGIES[n], settings) for n in ("1P+1D", "1E+1P+1D")]
    opened = pool.open(wave)
    assert [key.topology for key in opened] == ["1P+1D", "1E+1P+1D"]
    first, second = opened.values()
    assert isinstance(first, RuntimeError) and second.topology.name == "1E+1P+1D"


class DiesThenWillNotStop(StandIn):
    """Starts, dies while coming up, and then cannot be stopped either (processes survived
    SIGKILL): a close that raises."""

    def wait_until_serving(self) -> None:
        raise RuntimeError(f"{self.topology.name}/prefill0 died while starting")

    def close(self) -> None:
        raise RuntimeError(f"{self.topology.name}/prefill0: processes survived SIGKILL")


def test_a_topology_that_dies_and_will_not_stop_fails_alone_with_its_death(
    tmp_path: Path,
) -> None:
    """A close that fails after a start failed raised out of `open`, in place of the death (and
    its log tail), and failed the whole wave: the sibling that came up was closed with it
    (found in review, the class of the session's own start). The close's failure is a note on
    the death, which stays the topology's error; the sibling serves."""
    settings = RunSettings(serving=ServingConfig(model="/models/tiny"), run_dir=tmp_path)
    pool = TopologyPool(settings)
    pool._new_session = lambda request: (
        DiesThenWillNotStop(request, False)
        if request.topology.name == "1P+1D"
        else StandIn(request, False)
    )
    wave = [SessionRequest(TOPOLOGIES[n], settings) for n in ("1P+1D", "1E+1PD")]
    opened = pool.open(wave)
    dead, serving = opened.values()
    assert isinstance(dead, RuntimeError) and "died while starting" in str(dead), dead
    assert any("survived SIGKILL" in note for note in getattr(dead, "__notes__", [])), dead
    assert serving.topology.name == "1E+1PD"


def test_a_session_with_environment_added_to_a_role_is_never_the_plain_topologys(
    tmp_path: Path,
) -> None:
    """A scenario's variant (the KV-noise plugin in D) runs instances the plain topology does
    not: handed the plain topology's running session, the variant would plant nothing, and
    handed the variant's, the plain sweep would be judged on a plugin's noise. The same
    environment again shares the variant's session."""
    settings = RunSettings(serving=ServingConfig(model="/models/tiny"), run_dir=tmp_path)
    pool = TopologyPool(settings)
    pool._new_session = lambda request: StandIn(request, False)
    topology = TOPOLOGIES["1E+1P+1D"]
    plain = pool.session(topology)
    noisy = {Role.DECODE: {"EPD_KV_NOISE": "1"}}
    variant = pool.session(topology, role_env=noisy)
    assert variant is not plain
    assert pool.session(topology, role_env={Role.DECODE: {"EPD_KV_NOISE": "1"}}) is variant
    assert pool.session(topology) is plain
    assert len(pool.starts) == 2


class Placed(StandIn):
    """A `TopologySession` stand-in built as the pool builds one (`harness.run.pool`'s
    `TopologySession`): it keeps the devices it was given and says whether it was closed,
    and reached through another proxy it is a view of itself."""

    def __init__(self, topology, settings, *, devices=None, **_: object) -> None:
        super().__init__(SessionRequest(topology, settings), fails=False)
        self.devices = devices or ()
        self.closed = False
        self.before_device_wait = None  # as a `TopologySession`'s: the pool sets it

    def __enter__(self) -> Placed:
        return self

    def close(self) -> None:
        self.closed = True

    def via(self, proxy: ProxyChoice) -> types.SimpleNamespace:
        return types.SimpleNamespace(of=self, entry=types.SimpleNamespace(key=proxy.kind))


@pytest.fixture
def gpu_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> TopologyPool:
    """A pool on four GPUs, no other process waiting for any of them."""
    monkeypatch.setattr(pool_module, "TopologySession", Placed)
    monkeypatch.setattr(pool_module, "wanted_devices", lambda lock_dir, kind: [])
    serving = ServingConfig(model="/models/tiny")
    return TopologyPool(RunSettings(serving=serving, run_dir=tmp_path, platform=CUDA))


def test_a_topology_starts_where_it_was_first_placed_unless_asked_for_other_devices(
    gpu_pool: TopologyPool,
) -> None:
    """The sweep's schedule places each topology; a later sweep on the pool (a load's) does
    not move it, and a caller that names devices gets those."""
    topology = TOPOLOGIES["1E+1PD"]
    gpu_pool.place({"1E+1PD": (1,)})
    gpu_pool.place({"1E+1PD": (2, 3)})  # a later plan: the first placement stands
    assert gpu_pool.session(topology).devices == (1,)
    gpu_pool.release()
    assert gpu_pool.session(topology, devices=(3,)).devices == (3,)


def test_a_private_session_stops_the_shared_one_of_the_same_key_on_its_devices(
    gpu_pool: TopologyPool,
) -> None:
    """A private start is another start beside whatever runs under its key: on GPUs the
    shared session of the same topology holds its devices, and left running the private one
    waits on its own process's lease for ever (seen with the fake vLLM on eight devices)."""
    topology = TOPOLOGIES["1E+1PD"]
    shared = gpu_pool.session(topology, devices=(0,))
    with gpu_pool.private(topology, "a rerun", "rerun", devices=(0,)) as private:
        assert shared.closed and not private.closed


def test_a_session_asked_through_another_proxy_is_reached_through_that_proxy(
    gpu_pool: TopologyPool,
) -> None:
    """The instances are shared whatever the proxy, but the caller that asks for vLLM's proxy
    is judging that proxy: handed the session itself, it went through the harness's."""
    topology = TOPOLOGIES["1E+1PD"]
    running = gpu_pool.session(topology, devices=(0,))
    other = dataclasses.replace(gpu_pool.settings, proxy=ProxyChoice(kind=VLLM_PROXY))
    view = gpu_pool.session(topology, other, devices=(0,))
    assert view is not running and (view.of, view.entry.key) == (running, VLLM_PROXY)
    assert gpu_pool.session(topology, devices=(0,)) is running
    assert len(gpu_pool.starts) == 1
    assert gpu_pool.summary().endswith("(no start: another proxy in front)"), gpu_pool.summary()


def test_reviving_a_session_with_no_dead_instance_hands_it_back_as_it_is(
    gpu_pool: TopologyPool,
) -> None:
    """`revive` is for a session one of whose instances died (fuzzing); called on one that
    serves whole, it is the running session, nothing started or revived."""
    topology = TOPOLOGIES["1E+1PD"]
    running = gpu_pool.session(topology, devices=(0,))
    assert gpu_pool.revive(topology, devices=(0,)) is running
    assert len(gpu_pool.starts) == 1 and not running.closed


def test_a_cpu_session_that_fits_beside_the_running_ones_stops_none_of_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CPU the least recently used sessions stop only until the coming one fits: with room
    for exactly its instances, every running session stays."""
    monkeypatch.setattr(pool_module, "TopologySession", Placed)
    settings = RunSettings(serving=ServingConfig(model="/models/tiny"), run_dir=tmp_path)
    pool = TopologyPool(settings)
    monkeypatch.setattr(pool_module, "cpu_instances_that_fit", lambda: 100)
    running = pool.session(TOPOLOGIES["1E+1PD"])
    monkeypatch.setattr(pool_module, "cpu_instances_that_fit", lambda: 3)  # 1E+1P+1D: three
    pool.session(TOPOLOGIES["1E+1P+1D"])
    assert not running.closed, "a session stopped though the coming one fitted beside it"


def test_the_memory_a_cpu_instance_may_take_keeps_a_headroom(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Memory for exactly three instances is not room for three: the page cache, the
    harness and the proxy need some too (`CPU_MEMORY_HEADROOM`)."""
    monkeypatch.setattr(pool_module, "available_memory_bytes", lambda: 3 * CPU_INSTANCE_BYTES)
    assert pool_module.cpu_instances_that_fit() == 2
    roomy = 10 * CPU_INSTANCE_BYTES
    monkeypatch.setattr(pool_module, "available_memory_bytes", lambda: roomy)
    assert pool_module.cpu_instances_that_fit() == int(roomy * CPU_MEMORY_HEADROOM) // (
        CPU_INSTANCE_BYTES
    )


def test_a_gpu_session_stops_only_the_sessions_on_the_devices_it_comes_on(
    gpu_pool: TopologyPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On GPUs no two sessions hold one device: the one on the coming session's device stops,
    the one on another device keeps running (stopped, it would only start again later),
    however little host memory is free (the CPU rule: a GPU instance's memory is its
    device's)."""
    monkeypatch.setattr(pool_module, "cpu_instances_that_fit", lambda: 0)
    elsewhere = gpu_pool.session(TOPOLOGIES["1P+1D"], devices=(1,))
    in_the_way = gpu_pool.session(TOPOLOGIES["1E+1PD"], devices=(0,))
    gpu_pool.session(TOPOLOGIES["2E+1PD"], devices=(0,))
    assert in_the_way.closed and not elsewhere.closed


def waiting_for(monkeypatch: pytest.MonkeyPatch, *devices: int) -> None:
    """Another process (pid 4242) waits for `devices` of the pool's GPUs, all or none."""
    wants = [DeviceWant(CUDA.name, d, 4242, "w") for d in devices]
    monkeypatch.setattr(pool_module, "wanted_devices", lambda lock_dir, kind: wants)
    monkeypatch.setattr(pool_module, "devices_free", lambda kind, devices, lock_dir: True)


def test_a_session_the_item_uses_is_not_let_go_of_for_another_process(
    gpu_pool: TopologyPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the running pytest item asked for is in use until the next item begins: stopped
    for another worker waiting for its device, the item's own scenario lost it mid-way. Once
    the next item begins, an idle session on the wanted device is let go of."""
    gpu_pool.item_begins()
    used = gpu_pool.session(TOPOLOGIES["1E+1PD"], devices=(0,))
    waiting_for(monkeypatch, 0)
    gpu_pool.session(TOPOLOGIES["1P+1D"], devices=(1,))
    assert not used.closed, "a session the item uses was stopped for another process"
    gpu_pool.item_begins()
    gpu_pool.session(TOPOLOGIES["1P+1D"], devices=(1,))
    assert used.closed, "an idle session kept the device another process waits for"


def test_no_session_is_let_go_of_when_the_waiter_would_still_wait(
    gpu_pool: TopologyPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A waiter leases all its devices or none: where a session kept here (in use) holds one
    of them, stopping the idle one on the other would only cost its restart later (the fake
    8-GPU night: each let go of in turn, and restarted, while 2E+1PD still waited)."""
    gpu_pool.item_begins()
    idle = gpu_pool.session(TOPOLOGIES["1P+1D"], devices=(1,))
    gpu_pool.item_begins()
    used = gpu_pool.session(TOPOLOGIES["1E+1PD"], devices=(0,))
    waiting_for(monkeypatch, 0, 1)
    gpu_pool.session(TOPOLOGIES["1E+1PD"], devices=(0,))
    assert not used.closed and not idle.closed, "let go of while the waiter still waits"


def test_a_session_asked_for_now_is_not_let_go_of_for_another_process(
    gpu_pool: TopologyPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CLI run has no items, so only what a step asks for is in use: let go of for a
    process waiting for its device, the session asked for was handed back stopped."""
    running = gpu_pool.session(TOPOLOGIES["1E+1PD"], devices=(0,))
    waiting_for(monkeypatch, 0)
    assert gpu_pool.session(TOPOLOGIES["1E+1PD"], devices=(0,)) is running
    assert not running.closed, "the session asked for was stopped for another process"


def test_a_session_a_later_item_needs_is_not_let_go_of_for_another_process(
    gpu_pool: TopologyPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A topology the worker's later items need is its to come back to: let go of, it starts
    again for them. Its devices are kept, so an idle session on the waiter's other device is
    not stopped either (the waiter leases all its devices or none)."""
    gpu_pool.item_begins()
    later = gpu_pool.session(TOPOLOGIES["1P+1D"], devices=(1,))
    idle = gpu_pool.session(TOPOLOGIES["2E+1PD"], devices=(0,))
    gpu_pool.item_begins(needed_later=["1P+1D"])
    waiting_for(monkeypatch, 1)
    gpu_pool.session(TOPOLOGIES["1E+1PD"], devices=(2,))
    assert not later.closed, "a session a later item needs was let go of"
    waiting_for(monkeypatch, 0, 1)
    gpu_pool.session(TOPOLOGIES["1E+1PD"], devices=(2,))
    assert not idle.closed, "let go of while a session kept for later holds the waiter's device"


def test_no_session_is_let_go_of_while_another_holder_keeps_the_waiter_waiting(
    gpu_pool: TopologyPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a third process holds one of the waiter's devices, letting go of ours would only
    cost a restart: the waiter still waits."""
    gpu_pool.item_begins()
    idle = gpu_pool.session(TOPOLOGIES["1P+1D"], devices=(0,))
    gpu_pool.item_begins()
    waiting_for(monkeypatch, 0, 1)
    monkeypatch.setattr(pool_module, "devices_free", lambda kind, devices, lock_dir: False)
    gpu_pool.session(TOPOLOGIES["1E+1PD"], devices=(2,))
    assert not idle.closed, "let go of while another holder keeps the waiter waiting"


def test_before_waiting_for_a_device_a_start_lets_go_of_all_but_what_was_asked_with_it(
    gpu_pool: TopologyPool,
) -> None:
    """A start about to wait for a device another xdist worker holds stops this pool's other
    sessions (one could hold what that worker waits for in turn), but not those asked for
    with it: they are used together."""
    settings = gpu_pool.settings
    beside = gpu_pool.session(TOPOLOGIES["1P+1D"], devices=(1,))
    other = gpu_pool.session(TOPOLOGIES["2E+1PD"], devices=(2,))
    wanted = [
        SessionRequest(TOPOLOGIES["1P+1D"], settings, (1,)),
        SessionRequest(TOPOLOGIES["1E+1PD"], settings, (0,)),
    ]
    coming = gpu_pool.open(wanted)[wanted[1].key]
    coming.before_device_wait()  # as its start does before waiting for device 0
    assert other.closed, "a session kept while a start waited for another worker's device"
    assert not beside.closed and not coming.closed, "a session asked for with it was stopped"
    with gpu_pool.private(TOPOLOGIES["1E+1PD"], "a rerun", "rerun", devices=(3,)) as private:
        private.before_device_wait()
        assert beside.closed and coming.closed, "a private start waited with sessions kept"


def test_a_topology_that_cannot_start_is_counted_and_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start that fails part-way (a port taken after the first instance spawned) leaves
    nothing running, and the account shows it did not come up."""
    made: list[Placed] = []

    class CannotStart(Placed):
        def start_servers(self) -> None:
            made.append(self)
            raise RuntimeError(f"{self.topology.name}: a port was taken")

    monkeypatch.setattr(pool_module, "TopologySession", CannotStart)
    monkeypatch.setattr(pool_module, "cpu_instances_that_fit", lambda: 100)
    pool = TopologyPool(RunSettings(serving=ServingConfig(model="/models/tiny"), run_dir=tmp_path))
    with pytest.raises(RuntimeError, match="a port was taken"):
        pool.session(TOPOLOGIES["1P+1D"])
    assert [(s.reason, s.seconds) for s in pool.starts] == [("first use", None)]
    assert made[0].closed, "what the failed start spawned was left running"


def test_a_session_whose_instance_died_is_stopped_before_its_topology_starts_again(
    gpu_pool: TopologyPool, tmp_path: Path
) -> None:
    """Its siblings still run: left to themselves they hold their memory, devices and ports
    until the harness ends. The restart names the death."""
    running = gpu_pool.session(TOPOLOGIES["1P+1D"], devices=(0,))
    log = tmp_path / "decode0.log"
    running.dead_instance = lambda: DeadInstance("1P+1D/decode0", -9, log, "")
    again = gpu_pool.session(TOPOLOGIES["1P+1D"], devices=(0,))
    assert again is not running and running.closed, "the dead instance's siblings still run"
    reason = gpu_pool.starts[-1].reason
    assert reason == f"restart: instance 1P+1D/decode0 exited with code -9; its log {log}", reason


def test_the_sessions_asked_for_beside_one_on_a_ray_cluster_stay_up_however_it_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session coming on a Ray cluster stops the others there, except those asked for with
    it (the fuzzer's baseline beside its topology): asked for with `session`, with `revive`
    when nothing runs, and with `revive` whose revival failed and restarts the topology."""
    monkeypatch.setattr(pool_module, "TopologySession", Placed)
    monkeypatch.setattr(pool_module, "cpu_instances_that_fit", lambda: 100)
    serving = ServingConfig(model="/models/tiny")
    settings = RunSettings(serving=serving, run_dir=tmp_path, launcher=LauncherChoice("ray"))
    pool = TopologyPool(settings)
    epd, beside = TOPOLOGIES["1E+1P+1D"], [SessionRequest(BASELINE, settings)]
    baseline = pool.session(BASELINE)
    pool.session(epd, beside=beside)
    assert not baseline.closed, "session(beside=...) stopped the baseline on the cluster"
    pool.release(epd.name)
    running = pool.revive(epd, beside=beside)
    assert not baseline.closed, "revive(beside=...) of a stopped topology stopped the baseline"

    def revival_fails() -> list:
        raise RuntimeError("the revived decode0 did not come up")

    running.dead_instance = lambda: DeadInstance("1E+1P+1D/decode0", -9, tmp_path / "d.log", "")
    running.revive_dead = revival_fails
    assert pool.revive(epd, beside=beside) is not running and running.closed
    assert not baseline.closed, "the restart after a failed revival stopped the baseline"


def test_a_session_with_a_dead_instance_serves_no_reference_as_it_stops(
    gpu_pool: TopologyPool, tmp_path: Path
) -> None:
    """What a sweep serves on a stopping topology becomes an exact reference; a topology whose
    instance died answers errors (or a surviving instance's half of the flow), no reference."""
    served: list[str] = []
    gpu_pool.before_stop(lambda session: served.append(session.topology.name))
    healthy = gpu_pool.session(TOPOLOGIES["1E+1PD"], devices=(0,))
    dead = gpu_pool.session(TOPOLOGIES["1P+1D"], devices=(1,))
    dead.dead_instance_report = lambda: f"instance 1P+1D/decode0 exited with code -9 ({tmp_path})"
    gpu_pool.release()
    assert served == ["1E+1PD"] and healthy.closed and dead.closed, served


def test_a_revival_is_counted_with_its_cause_and_its_instance(
    gpu_pool: TopologyPool, tmp_path: Path
) -> None:
    """`starts` and `instances` are what pytest and `epd-harness` print at the end: a revived
    instance is a start after the topology's first use, said with the death it answers."""
    topology = TOPOLOGIES["1P+1D"]
    running = gpu_pool.session(topology, devices=(0,))
    log = tmp_path / "decode0.log"
    running.dead_instance = lambda: DeadInstance("1P+1D/decode0", -9, log, "")
    revived = types.SimpleNamespace(name="1P+1D/decode0")
    running.revive_dead = lambda: [revived]
    assert gpu_pool.revive(topology, devices=(0,)) is running
    assert gpu_pool.starts[-1].reason == (
        f"revive decode0: instance 1P+1D/decode0 exited with code -9 (its log: {log})"
    )
    assert gpu_pool.instances == [revived]
    first_line = gpu_pool.summary().splitlines()[0]
    assert first_line.endswith("; 1 more than once, each with its reason:"), first_line


def test_a_private_start_is_counted_with_its_instances_whether_or_not_it_comes_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refuse = False

    class Private(Placed):
        def __init__(self, topology, settings, **kwargs: object) -> None:
            super().__init__(topology, settings, **kwargs)
            self.stats = {"encoder0": types.SimpleNamespace(name=f"{topology.name}/encoder0")}

        def __enter__(self) -> Private:
            if refuse:
                raise RuntimeError("the rerun's encoder0 did not come up")
            return self

    monkeypatch.setattr(pool_module, "TopologySession", Private)
    monkeypatch.setattr(pool_module, "cpu_instances_that_fit", lambda: 100)
    pool = TopologyPool(RunSettings(serving=ServingConfig(model="/models/tiny"), run_dir=tmp_path))
    with pool.private(TOPOLOGIES["1E+1PD"], "a rerun", "rerun"):
        pass
    refuse = True
    with pytest.raises(RuntimeError, match="did not come up"):
        with pool.private(TOPOLOGIES["1E+1PD"], "a rerun", "rerun"):
            pass
    assert [(s.reason, s.seconds is None) for s in pool.starts] == [
        ("private: a rerun", False),
        ("private: a rerun", True),
    ]
    assert [stats.name for stats in pool.instances] == ["1E+1PD/encoder0"]
