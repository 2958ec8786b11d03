"""On GPUs a session leases its devices (a file lock each, `harness.serve.ports.lease_devices`)
and waits for any holder to let go, this process's other sessions included: whatever starts
beside a running session must get devices of its own or stop what holds them. The fake vLLM
(harness/testing/fake_vllm.py) stands in for every instance and logs the devices it was given;
nothing here ran on a GPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from export_bundle import REPAIR, plan_for
from test_export_gpu import gpu_bundle

from fixtures.tiny_model import ensure_tiny_model
from harness.environment import cache_dir
from harness.run.export.files import write_export
from harness.run.fuzz.engine import FuzzEngine
from harness.run.pool import TopologyPool
from harness.spec.platforms import CUDA, DevicePlanError
from harness.spec.settings import RunSettings
from harness.spec.topology import TOPOLOGIES, ServingConfig
from harness.testing.cli import run_argv
from harness.testing.fake_vllm import (
    LIVE_DIR_ENV,
    fake_run_settings,
    install_fake_vllm,
    logged_starts,
)
from harness.testing.processes import export_port_variables, run_export_script

pytestmark = pytest.mark.process

# A hang shows as this wait running out, never as a test that does not end.
HANG_S = 60.0
BASELINE = TOPOLOGIES["baseline"]


def devices_by_role(log: Path) -> list[tuple[str, str]]:
    """(role, CUDA_VISIBLE_DEVICES) of every start, in order."""
    return [(s["role"], s["env"].get("CUDA_VISIBLE_DEVICES", "")) for s in logged_starts(log)]


def cuda_settings(tmp_path: Path, fake_vllm: Path, devices: tuple[int, ...]) -> RunSettings:
    serving = ServingConfig(model=str(tmp_path / "model"), kv_connector=CUDA.kv_connector)
    return fake_run_settings(tmp_path, fake_vllm, serving, platform=CUDA, devices=devices)


def finishes(work: Callable[[], None]) -> bool:
    """Whether `work` ends within HANG_S (in a thread: a wait on a lock cannot be interrupted)."""
    done = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            failure.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    done.wait(HANG_S)
    if failure:
        raise failure[0]
    return done.is_set()


def test_a_private_session_stops_what_holds_its_devices_instead_of_waiting_on_it(
    tmp_path: Path, fake_vllm: Path, fake_vllm_start_log: Path
) -> None:
    """The matrix's rerun on kept storage and the attach scenario's deployment are private
    sessions. One that made room for no device waited for ever on the baseline's lease, held
    by the same pool: the nightly would have hung there."""
    pool = TopologyPool(cuda_settings(tmp_path, fake_vllm, (0, 1, 2)))
    try:

        def baseline_then_private() -> None:
            pool.session(BASELINE, devices=(0,))
            with pool.private(TOPOLOGIES["1E+1PD"], "a test", label="private") as session:
                assert session.dead_instance_report() is None

        assert finishes(baseline_then_private), "the private session waited on its own pool"
        assert pool.running() == [], "the baseline held a device the private session took"
        roles = [role for role, _ in devices_by_role(fake_vllm_start_log)]
        # E and PD start side by side: either may log first.
        assert roles[0] == "baseline" and sorted(roles[1:]) == ["encoder", "pd"], roles
    finally:
        pool.close()


def test_a_private_session_on_its_own_devices_leaves_the_others_running(
    tmp_path: Path, fake_vllm: Path, fake_vllm_start_log: Path
) -> None:
    pool = TopologyPool(cuda_settings(tmp_path, fake_vllm, (0, 1, 2)))
    try:

        def baseline_beside_private() -> None:
            pool.session(BASELINE, devices=(0,))
            with pool.private(TOPOLOGIES["1E+1PD"], "a test", label="private", devices=(1, 2)):
                assert [key.topology for key in pool.running()] == ["baseline"]

        assert finishes(baseline_beside_private)
        started = devices_by_role(fake_vllm_start_log)
        assert started[0] == ("baseline", "0") and {d for _, d in started[1:]} <= {"1", "2"}
    finally:
        pool.close()


def test_a_private_session_of_a_running_topology_stops_it_instead_of_waiting_on_it(
    tmp_path: Path, fake_vllm: Path, fake_vllm_start_log: Path
) -> None:
    """The attach scenario keeps a private 1E+1PD up beside the pool's own 1E+1PD, which
    judged the normal run: the same topology under the same flags, so the same devices. The
    private session made room for every running session but its own key's, and waited for
    ever on the devices the pool's 1E+1PD held in this very process: the GPU night, rehearsed
    with the fake vLLM on eight devices, hung there."""
    pool = TopologyPool(cuda_settings(tmp_path, fake_vllm, (0, 1, 2)))
    try:

        def shared_then_private() -> None:
            pool.session(TOPOLOGIES["1E+1PD"], devices=(1, 2))
            with pool.private(TOPOLOGIES["1E+1PD"], "a test", label="private", devices=(1, 2)):
                assert pool.running() == [], "the shared 1E+1PD still holds the devices"

        assert finishes(shared_then_private), "the private session waited on its own pool"
    finally:
        pool.close()


def test_a_pool_that_must_wait_for_devices_first_lets_go_of_what_it_holds(
    tmp_path: Path, fake_vllm: Path, fake_vllm_start_log: Path
) -> None:
    """Two xdist workers on four GPUs, the baseline on device 0 through every wave: one holds
    the baseline and asks for 1P+1D's devices, which the other holds for 1E+1PD while it asks
    for the baseline's device (a load's calibration). Each waited for the other for ever; a
    pool about to wait now stops its other sessions first, so one of them goes on at once, and
    the other when that one's session lets go (its worker's end). Both going on at once is
    the usual case but a race: when one pool has let go before the other asks, the other gets
    its device without waiting and keeps what it holds (seen once on a loaded machine: the
    test asked both to go on at once and went red)."""
    first = TopologyPool(cuda_settings(tmp_path / "gw0", fake_vllm, (0, 1, 2, 3)))
    second = TopologyPool(cuda_settings(tmp_path / "gw1", fake_vllm, (0, 1, 2, 3)))
    pools = {"first": first, "second": second}
    holding = threading.Barrier(2, timeout=HANG_S)
    ended: queue.Queue[tuple[str, BaseException | None]] = queue.Queue()
    try:

        def worker(name: str, held: tuple, wanted: tuple) -> None:
            failure = None
            try:
                pool = pools[name]
                pool.session(TOPOLOGIES[held[0]], devices=held[1])
                holding.wait()
                pool.session(TOPOLOGIES[wanted[0]], devices=wanted[1])
            except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
                failure = exc
            ended.put((name, failure))

        for name, held, wanted in (
            ("first", ("baseline", (0,)), ("1P+1D", (1, 2))),
            ("second", ("1E+1PD", (1, 2)), ("baseline", (0,))),
        ):
            threading.Thread(target=worker, args=(name, held, wanted), daemon=True).start()
        try:
            name, failure = ended.get(timeout=HANG_S)
        except queue.Empty:
            pytest.fail("two pools waited on each other's devices")
        if failure is not None:
            raise failure
        try:
            other, failure = ended.get(timeout=5.0)
        except queue.Empty:
            # The race: `name` got its device without waiting and kept the rest; its
            # worker's end lets go of it, and then the other goes on.
            pools[name].close()
            try:
                other, failure = ended.get(timeout=HANG_S)
            except queue.Empty:
                pytest.fail(f"{name}'s pool closed, yet the other pool still waited")
        if failure is not None:
            raise failure
        assert {name, other} == {"first", "second"}
        asked = {"first": ["1P+1D"], "second": ["baseline"]}
        running = {n: [k.topology for k in pool.running()] for n, pool in pools.items()}
        if running[name] == []:  # the race's way: `name` closed, the other runs what it asked
            asked[name] = []
        assert running == asked
        assert [s for s in logged_starts(fake_vllm_start_log) if s["shared"]] == []
    finally:
        first.close()
        second.close()


# Another xdist worker's pool, in a process of its own: it asks for the baseline on `device`,
# says "asking" before and "serving" once its session serves, then ends.
OTHER_WORKER = """
import sys
from pathlib import Path
from harness.run.pool import TopologyPool
from harness.spec.platforms import CUDA
from harness.spec.topology import TOPOLOGIES, ServingConfig
from harness.testing.fake_vllm import fake_run_settings

root, fake, device = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
serving = ServingConfig(model=str(root / "model"), kv_connector=CUDA.kv_connector)
settings = fake_run_settings(root, fake, serving, platform=CUDA, devices=(device,))
pool = TopologyPool(settings)
try:
    print("asking", flush=True)
    pool.session(TOPOLOGIES["baseline"], devices=(device,))
    print("serving", flush=True)
finally:
    pool.close()
"""
# How long the other worker is given to mark the device it waits for (the marks came with the
# fix: on the old code this wait runs out, and the test goes on to fail on what it asserts).
MARK_WAIT_S = 10.0


def test_a_worker_waiting_for_a_device_another_pool_keeps_idle_gets_it_at_that_pools_next_step(
    tmp_path: Path, fake_vllm: Path, fake_vllm_start_log: Path, port_locks: Path
) -> None:
    """On a multi-worker GPU night a pool keeps a session up after its items until it needs
    the room or its pytest session ends, while its worker serves other topologies on other
    devices. Another worker waiting for that idle session's device sat idle all that time (a
    stall, GPU hours on the 8-GPU night, not a hang): the pool let go at its session's end.
    Now the waiter marks what it waits for, and the pool stops that session at its next step,
    counted as such where the session starts again."""
    pool = TopologyPool(cuda_settings(tmp_path / "gw0", fake_vllm, (0, 1, 2)))
    root = Path(__file__).resolve().parent.parent
    other = None
    try:
        pool.session(BASELINE, devices=(0,))  # its items done, the baseline stays up, idle
        argv = [sys.executable, "-c", OTHER_WORKER, str(tmp_path / "gw1"), str(fake_vllm), "0"]
        other = subprocess.Popen(
            argv, cwd=root, stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        assert other.stdout is not None and other.stdout.readline() == "asking\n"
        deadline = time.monotonic() + MARK_WAIT_S
        while not list(port_locks.glob("cuda-device-0.wanted.*")):
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)

        pool.session(TOPOLOGIES["1P+1D"], devices=(1, 2))  # this pool's next step

        try:
            out, _ = other.communicate(timeout=HANG_S)
        except subprocess.TimeoutExpired:
            pytest.fail("the other worker still waited for device 0 after this pool's next step")
        assert (out, other.returncode) == ("serving\n", 0)
        assert [key.topology for key in pool.running()] == ["1P+1D"]
        pool.session(BASELINE, devices=(0,))
        assert pool.starts[-1].reason == (
            "restart: stopped for another process waiting for its devices "
            f"(cuda device 0 wanted by pid {other.pid})"
        ), pool.summary()
        assert [s for s in logged_starts(fake_vllm_start_log) if s["shared"]] == []
    finally:
        if other is not None and other.poll() is None:
            os.killpg(other.pid, signal.SIGKILL)
            other.communicate()
        pool.close()


def test_a_pool_keeps_an_idle_session_a_gone_process_marked_and_stops_one_a_live_one_marks(
    tmp_path: Path, fake_vllm: Path, fake_vllm_start_log: Path, port_locks: Path
) -> None:
    """The marks a waiter killed by SIGKILL leaves are no reason to stop a session (it would
    only start again); a live waiter's are, and only on the devices it marked."""
    pool = TopologyPool(cuda_settings(tmp_path, fake_vllm, (0, 1, 2, 3, 4)))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    try:
        pool.session(BASELINE, devices=(0,))
        pool.session(TOPOLOGIES["1P+1D"], devices=(1, 2))
        (port_locks / "cuda-device-0.wanted.1.1").write_text(gone.stdout)
        pool.session(TOPOLOGIES["1E+1PD"], devices=(3, 4))
        assert sorted(key.topology for key in pool.running()) == ["1E+1PD", "1P+1D", "baseline"]
        (port_locks / "cuda-device-2.wanted.1.2").write_text(f"{os.getpid()}\n")
        pool.session(BASELINE, devices=(0,))  # the next step: asked, so kept
        assert sorted(key.topology for key in pool.running()) == ["1E+1PD", "baseline"]
        (port_locks / "cuda-device-4.wanted.1.3").write_text(f"{os.getpid()}\n")
        with pool.private(TOPOLOGIES["1P+1D"], "a test", label="private", devices=(1, 2)):
            assert [key.topology for key in pool.running()] == ["baseline"]
    finally:
        pool.close()


def test_a_pool_lets_go_for_a_waiter_only_when_that_gives_it_every_device_it_waits_for(
    tmp_path: Path, fake_vllm: Path, fake_vllm_start_log: Path, port_locks: Path
) -> None:
    """A lease takes its devices all or none: on the fake 8-GPU night 2E+1PD waited for 1-3,
    1E+1PD's (one worker) and 1P+1D's (another). Each worker let go of its session for it in
    turn, started it again for its next item, and 2E+1PD still waited (21 starts for 19, and
    its wait longer). Nor is a session the item running now asked for, or one this worker's
    later items need: let go of, it starts again for them."""
    from harness.serve.ports import lease_devices

    pool = TopologyPool(cuda_settings(tmp_path, fake_vllm, (0, 1, 2, 3)))
    elsewhere = lease_devices("cuda", (3,), port_locks)  # another worker's session on device 3
    try:
        pool.item_begins()
        pool.session(TOPOLOGIES["1P+1D"], devices=(1, 2))
        for device in (1, 2, 3):  # one waiter (pid, thread) for all three
            (port_locks / f"cuda-device-{device}.wanted.7.7").write_text(f"{os.getpid()}\n")
        pool.session(BASELINE, devices=(0,))
        assert sorted(key.topology for key in pool.running()) == ["1P+1D", "baseline"]
        for lease in elsewhere:
            lease.release()
        pool.session(BASELINE, devices=(0,))
        assert sorted(key.topology for key in pool.running()) == ["1P+1D", "baseline"], (
            "let go of a session the item running now asked for"
        )
        pool.item_begins(needed_later={"1P+1D"})  # this worker's next items need it
        pool.session(BASELINE, devices=(0,))
        assert sorted(key.topology for key in pool.running()) == ["1P+1D", "baseline"]
        pool.item_begins()
        pool.session(BASELINE, devices=(0,))
        assert [key.topology for key in pool.running()] == ["baseline"]
    finally:
        for lease in elsewhere:
            lease.release()
        pool.close()
    assert [start.reason for start in pool.starts] == ["first use", "first use"]


def test_fuzzing_on_gpus_serves_the_baseline_and_the_topology_on_devices_of_their_own(
    tmp_path: Path, fake_vllm: Path, fake_vllm_start_log: Path
) -> None:
    """Every example goes to both, so both stay up: given no slot, each session leased every
    device and the topology's would have waited for ever on the baseline's."""
    settings = cuda_settings(tmp_path, fake_vllm, (0, 1, 2))
    engine = FuzzEngine(settings, TOPOLOGIES["1P+1D"])

    def open_both() -> None:
        with engine:
            assert engine.session is not None and engine.baseline is not None

    assert finishes(open_both), "the topology waited on the baseline's devices"
    started = dict(devices_by_role(fake_vllm_start_log))
    assert started == {"baseline": "0", "prefill": "1", "decode": "2"}, started


def test_fuzzing_on_two_colocated_gpus_serves_the_topology_beside_the_baseline(
    tmp_path: Path, fake_vllm: Path, fake_vllm_start_log: Path
) -> None:
    """The 2-GPU nightly (`--epd-colocate`): the planted-fuzz scenario's `fuzz` was refused,
    "baseline and 1E+1PD serve side by side: together they need 3 devices, but only 2 given
    (0,1); ... let instances share with --colocate". Colocated, 1E+1PD shares the device the
    baseline leaves."""
    settings = dataclasses.replace(cuda_settings(tmp_path, fake_vllm, (0, 1)), colocate=True)
    engine = FuzzEngine(settings, TOPOLOGIES["1E+1PD"])

    def open_both() -> None:
        with engine:
            assert engine.session is not None and engine.baseline is not None

    assert finishes(open_both)
    started = sorted(devices_by_role(fake_vllm_start_log))
    assert started == [("baseline", "0"), ("encoder", "1"), ("pd", "1")], started


def test_fuzzing_on_too_few_gpus_is_refused_before_anything_starts(
    tmp_path: Path, fake_vllm: Path, fake_vllm_start_log: Path
) -> None:
    settings = cuda_settings(tmp_path, fake_vllm, (0, 1))
    with pytest.raises(DevicePlanError) as refused:
        FuzzEngine(settings, TOPOLOGIES["1P+1D"])
    assert "baseline and 1P+1D serve side by side: together they need 3 devices" in str(
        refused.value
    )
    assert devices_by_role(fake_vllm_start_log) == []


def test_a_session_asked_outside_the_waves_starts_on_its_place_in_the_sweeps_schedule(
    tmp_path: Path, fake_vllm: Path, fake_vllm_start_log: Path
) -> None:
    """A matrix, live or load scenario asks the pool for its topology directly: on its place
    in the plan it starts beside the baseline the sweep keeps; given every device it would
    have stopped the baseline, and under xdist waited for every other worker's devices."""
    from harness.run.sweep import Sweep, SweepSpec
    from harness.spec.prompts import SKELETON_PROMPTS

    text = next(p for p in SKELETON_PROMPTS if p.name == "text")
    settings = cuda_settings(tmp_path, fake_vllm, (0, 1, 2))
    pool = TopologyPool(settings)
    try:
        sweep = Sweep(SweepSpec((TOPOLOGIES["1P+1D"],), prompts=(text,)), settings, pool=pool)
        sweep.serve_baseline()

        def asked_directly() -> None:
            pool.session(TOPOLOGIES["1P+1D"])

        assert finishes(asked_directly)
        assert sorted(key.topology for key in pool.running()) == ["1P+1D", "baseline"]
        started = dict(devices_by_role(fake_vllm_start_log))
        assert started == {"baseline": "0", "prefill": "1", "decode": "2"}, started
    finally:
        pool.close()


@pytest.mark.parametrize("stored", [False, True])
def test_xdist_workers_place_every_topology_alike_whether_or_not_the_baseline_is_stored(
    tmp_path: Path, fake_vllm: Path, stored: bool
) -> None:
    """A worker that finds the baseline's answers stored (a neighbour stored them) packs the
    same devices as one that must serve them: the baseline keeps its slot."""
    import dataclasses

    from harness.run.sweep import Sweep, SweepSpec
    from harness.spec.prompts import SKELETON_PROMPTS

    text = next(p for p in SKELETON_PROMPTS if p.name == "text")
    settings = dataclasses.replace(cuda_settings(tmp_path, fake_vllm, tuple(range(8))), workers=4)
    topologies = tuple(TOPOLOGIES[n] for n in ("1E+1PD", "1P+1D", "1E+1P+1D"))
    sweep = Sweep(SweepSpec(topologies, prompts=(text,)), settings, pool=TopologyPool(settings))
    sweep._needs_baseline_run = lambda: not stored  # type: ignore[method-assign]
    placed = {s.topology.name: s.devices for w in sweep.schedule().waves for s in w.slots}
    assert placed == {
        "baseline": (0,),
        "1E+1PD": (1, 2),
        "1P+1D": (3, 4),
        "1E+1P+1D": (5, 6, 7),
    }, placed


EXPORT_TIMEOUT_S = 120.0


@pytest.mark.parametrize(
    ("devices", "shared"),
    [("0,1,2", {"encoder": ["0"]}), ("1,2,3", {})],
    ids=["on-the-baselines-device", "on-devices-of-its-own"],
)
def test_an_exports_servers_are_seen_by_the_check_that_no_device_is_held_twice(
    tmp_path: Path,
    fake_vllm: Path,
    fake_vllm_start_log: Path,
    monkeypatch: pytest.MonkeyPatch,
    leased_ports: Callable[[int], list[int]],
    devices: str,
    shared: dict[str, list[str]],
) -> None:
    """The GPU night's check "no device held by two live instances" reads the fakes' start
    lines. An export's run.sh runs in an environment built from scratch (the e2e scenario's
    `run_exported`), so its fake servers never saw FAKE_VLLM_START_LOG / FAKE_VLLM_LIVE_DIR:
    an export on devices a live pool instance held went unseen. Planted: a cuda export given
    the device the pool's live baseline holds (DEVICES=0,1,2: its encoder on device 0)."""
    live = tmp_path / "live"
    live.mkdir()
    monkeypatch.setenv(LIVE_DIR_ENV, str(live))
    out = tmp_path / "export"
    write_export(plan_for(gpu_bundle(tmp_path / "recorded")), out, REPAIR)
    variables = export_port_variables((out / "serve.sh").read_text())
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "VLLM": str(fake_vllm),
        "MODEL": str(tmp_path / "model"),
        "CPU_REPAIR": "no",
        "STOP_TIMEOUT": "3",
        "DEVICES": devices,
        **dict(zip(variables, map(str, leased_ports(len(variables))))),
    }  # built from scratch, as run_exported builds it
    pool = TopologyPool(cuda_settings(tmp_path, fake_vllm, (0,)))
    try:
        pool.session(BASELINE, devices=(0,))
        run_export_script(out, ["run.sh"], env, EXPORT_TIMEOUT_S)
    finally:
        pool.close()
    starts = logged_starts(fake_vllm_start_log)
    exported = sorted(s["role"] for s in starts if s["role"] != "baseline")
    assert exported == ["decode", "encoder", "prefill"], "the export's servers went unlogged"
    assert {s["role"]: s["shared"] for s in starts if s["shared"]} == shared, starts


SESSION_HANG_S = 300.0
# Every item must pass on the fake GPUs, each for its verdict: the sweep cases (MATCH with every
# transfer guard held), the repro of a planted EC corruption (MISMATCH, reproduced), the fuzz
# that finds the planted ec-swap-items, the JPEG-frame video's export (MISMATCH reproduced: the
# fake's consumer places video steps as vLLM's does without second_per_grid_ts) and its 2 fps
# control (MATCH), and run.sh reference (1P+1D served behind vLLM's toy proxy, then the case
# judged against its answer: MATCH). The decode-tail exports are ExampleConnector's only.
GREEN_ON_FAKE_GPUS = {
    "scenarios/test_epd_matches_baseline.py::test_topology_matches_references[1E+1PD-text]",
    "scenarios/test_epd_matches_baseline.py::test_topology_matches_references[1P+1D-text]",
    "scenarios/test_epd_matches_baseline.py::test_topology_matches_references[1E+1P+1D-text]",
    "scenarios/test_repro.py::test_repro_of_a_planted_mismatch_reproduces_it",
    "scenarios/test_fuzz.py::test_fuzzing_finds_and_shrinks_a_planted_shape_dependent_fault",
    "scenarios/test_export_repro.py::test_the_export_reproduces_with_vllm_alone"
    "[1E+1PD:m-video-jpeg-frames]",
    "scenarios/test_export_repro.py::test_the_export_reproduces_with_vllm_alone"
    "[1E+1PD:m-video-jpeg-frames-2fps]",
    "scenarios/test_export_repro.py::"
    "test_run_sh_reference_serves_1p1d_there_and_judges_the_case_against_its_answer",
}
OWN_INSTANCES_SELECTION = (
    "scenarios/test_epd_matches_baseline.py",
    "scenarios/test_repro.py",
    "scenarios/test_fuzz.py",
    "scenarios/test_export_repro.py",
)


def fake_gpu_session(tmp_path: Path, devices: str, *args: str) -> list[str]:
    """The argv of a pytest session on the fake vLLM under the cuda profile on `devices`:
    `args` (what it selects, how it runs) with what every such session passes (its fake
    installed under `tmp_path`, the tiny model, a baseline cache and run directory of its own)."""
    fake = install_fake_vllm(tmp_path / "bin")
    return [
        sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider", "-p", "no:randomly",
        "--epd-vllm", str(fake), "--epd-platform", "cuda", "--epd-devices", devices,
        "--epd-model", str(ensure_tiny_model(cache_dir() / "models")),
        "--epd-baseline-cache", str(tmp_path / "cache"), "--epd-run-dir", str(tmp_path / "run"),
    ]  # fmt: skip


def fake_night_output(argv: list[str]) -> str:
    """A pytest session on the fake vLLM, run from the project's root in a process group of
    its own: its output, or a failure naming the hang (its group killed) past SESSION_HANG_S."""
    root = Path(__file__).resolve().parent.parent
    session = subprocess.Popen(
        argv, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        return session.communicate(timeout=SESSION_HANG_S)[0]
    except subprocess.TimeoutExpired:
        os.killpg(session.pid, signal.SIGKILL)
        out, _ = session.communicate()
        pytest.fail(f"the session did not end within {SESSION_HANG_S:.0f}s:\n{out[-4000:]}")


@pytest.mark.usefixtures("served_vllm_parser")  # its runs (subprocesses) find their lines judged
def test_scenarios_with_instances_of_their_own_share_eight_gpus_with_four_workers(
    tmp_path: Path, fake_vllm_start_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU night's shape (cuda, NIXL, four workers on eight devices) with the repro, the
    planted fuzz and the exports beside the sweep: they were deselected on GPUs, because the
    CLI they drive served the cpu profile on every device of its own choosing. Now each runs
    on its xdist group's devices after that group's pool items: no device is held by two live
    instances (each fake holds a lock per device while it lives, `LIVE_DIR_ENV`), the exports'
    servers included (`run_export_script` passes the fakes' observation variables into the
    environment a test builds: before, this check never saw them), every item ends, each CLI
    command served cuda on its group's devices, and each topology of the pools started once. The
    fake moves EC and KV as vLLM's connectors do (NIXL here) and places a video's steps as vLLM 0.32
    does, so every item passes for the reasons it does on GPUs (every transfer guard held; the
    planted faults caught; the video export's MISMATCH reproduced and its control's MATCH). Found in
    review: the exports' items were only asked to end, so a wrong verdict could not turn this red;
    the fake had no video timing bug, and run.sh reference fell back to a `python3` without vLLM's
    proxy's dependencies (the fake had no Python beside it, where a virtualenv keeps vLLM's)."""
    live = tmp_path / "live"
    live.mkdir()
    monkeypatch.setenv(LIVE_DIR_ENV, str(live))
    run_root = tmp_path / "run"
    argv = fake_gpu_session(
        tmp_path, "0,1,2,3,4,5,6,7", *OWN_INSTANCES_SELECTION,
        "-m", "e2e", "-k", "text or repro or planted or export",
        "-n", "4", "--dist", "loadgroup", "-rA",
    )  # fmt: skip
    # About 30 s here; a pool left holding the devices its CLI leases hung for ever.
    out = fake_night_output(argv)
    summary = out.strip().splitlines()[-1]
    # 3 sweep cases, repro, fuzz, 2 exports and run.sh reference (NIXL), each passed
    assert re.fullmatch(r"=+ 8 passed in .*", summary), out[-8000:]
    passed = set(re.findall(r"^PASSED (\S+?)(?:@\S+)?$", out, re.M))
    assert passed == GREEN_ON_FAKE_GPUS, out[-8000:]
    starts = logged_starts(fake_vllm_start_log)
    assert [s for s in starts if s["shared"]] == [], "a device held by two live instances"
    # The check saw the exports' servers too (run_exported's scratch copy, `scratch/export`):
    # the two video exports' E and PD, run.sh reference's 1P+1D then its 1E+1P+1D.
    exported = Counter(
        s["role"] for s in starts if any("/scratch/export/" in arg for arg in s["launch"])
    )
    assert exported == {"encoder": 3, "pd": 2, "prefill": 2, "decode": 2}, exported
    # Each command an item ran served cuda on its group's devices: the baseline's slot and
    # its group's in the plan (baseline 0, 1E+1PD 1-2, 1P+1D 3-4, 1E+1P+1D 5-7; 1E+1P+1D is
    # in 1P+1D's group, its reference).
    bundles = {
        path.parent.name: json.loads(path.read_text()) for path in run_root.glob("gw*/*/run.json")
    }
    in_1e1pd = {"planted-corrupt-ec", "planted-repro", "fuzz-planted", "export-sources-1E+1PD"}
    assert in_1e1pd | {"export-reference-source"} <= set(bundles), sorted(bundles)
    for name, bundle in bundles.items():
        devices = [0, 1, 2] if name in in_1e1pd else [0, 3, 4, 5, 6, 7]
        assert (bundle["platform_profile"], bundle["devices"]) == ("cuda", devices), bundle
    pool_starts = [
        start["topology"]
        for path in run_root.glob("gw*/topology-starts.json")
        for start in json.loads(path.read_text())
    ]
    assert sorted(pool_starts) == sorted(set(pool_starts)), pool_starts
    assert set(pool_starts) == {"baseline", "1E+1PD", "1P+1D", "1E+1P+1D"}, pool_starts


@pytest.mark.usefixtures("served_vllm_parser")  # its runs (subprocesses) find their lines judged
def test_a_session_on_one_gpu_plans_only_the_topologies_its_items_run(tmp_path: Path) -> None:
    """A developer on one GPU box runs 1E+1PD's items (its encoder shares the GPU): the
    session's preflight planned every EPD topology, so it refused the session because 1P+1D
    needs two devices, and told it to leave 1P+1D out with --topology, which a pytest command
    line does not have. The plan is now the selected items' (and their references'); a
    selection that does need two names the session's own options."""
    one_gpu = fake_gpu_session(
        tmp_path, "0", "scenarios/test_epd_matches_baseline.py", "-m", "e2e", "-k", "text"
    )
    out = fake_night_output([*one_gpu, "--epd-topology", "1E+1PD"])
    assert re.search(r"^=+ 1 passed, \d+ deselected in ", out, re.M), out[-6000:]

    out = fake_night_output([*one_gpu, "--epd-topology", "1E+1P+1D"])
    assert re.search(r"^=+ \d+ deselected, 1 error in ", out, re.M), out[-6000:]
    # 1E+1P+1D is judged against 1P+1D, which the plan holds too; no --topology in pytest.
    assert "1P+1D needs 2, 1E+1P+1D needs 2 devices" in out, out[-6000:]
    assert "--epd-colocate" in out and not re.search(r"(?<![\w-])--(colocate|topology)\b", out)


# The nightly's selection in small: each topology's text case, the load on 1E+1P+1D (its
# calibration serves the baseline beside the topology) and the matrix's 2E+1PD round robin.
START_COUNT_SELECTION = (
    "scenarios/test_epd_matches_baseline.py",
    "scenarios/test_load.py",
    "scenarios/test_matrix.py",
)
START_COUNT_ITEMS = "matches_references and text or small_load_every or two-encoders-round-robin"


@dataclasses.dataclass(frozen=True)
class NightShape:
    """One GPU night's shape (devices, workers, colocation) and the pool starts its plan
    forces: each topology once, more where the devices make a topology stop for another."""

    devices: str
    workers: int
    colocate: bool
    starts: dict[str, int]
    # The devices 2E+1PD's instances started on: its place in the plan.
    two_encoders_on: set[str]


NIGHT_SHAPES = {
    # One wave; 2E+1PD in a second, on 1E+1PD's and 1P+1D's devices. The baseline's device
    # is its own: its answers computed once (the other workers read them stored), the load's
    # calibration in the 1P+1D group's worker, which may not be the one that computed them.
    "8-gpus": NightShape("0,1,2,3,4,5,6,7", 4, False, {}, {"1", "2", "3"}),
    # vLLM's Buildkite step, with two workers (its default before: the plan's widest wave),
    # which share the baseline's device. The baseline keeps device 0: the calibration stops
    # nothing.
    "4-gpus": NightShape("0,1,2,3", 2, False, {}, {"1", "2", "3"}),
    # The GitHub nightly's small row: every slot holds the baseline's device. The load's
    # calibration is measured as the baseline stops for 1E+1PD: before, the load stopped
    # 1E+1P+1D (and 1P+1D, the reference, stopped for it), started the baseline again and
    # then 1E+1P+1D again.
    "2-gpus": NightShape("0,1", 1, True, {}, {"0", "1"}),
    "1-gpu": NightShape("0", 1, True, {}, {"0"}),
}


@pytest.mark.usefixtures("served_vllm_parser")  # its runs (subprocesses) find their lines judged
@pytest.mark.parametrize("shape", list(NIGHT_SHAPES.values()), ids=list(NIGHT_SHAPES))
def test_the_gpu_night_starts_each_topology_as_few_times_as_its_devices_force(
    tmp_path: Path, fake_vllm_start_log: Path, monkeypatch: pytest.MonkeyPatch, shape: NightShape
) -> None:
    """The nightly's own pytest line (`--dist loadgroup`, the workflow's workers) on the fake
    vLLM. Seen on the whole selection before: on 4 GPUs 29 topology starts for 7 distinct,
    1E+1P+1D 7 times (each load's calibration on the baseline's device, inside its slot,
    stopped it), and 2E+1PD, with no place in the plan, leased every device. Now each
    topology starts once, but where its devices force more (`NightShape.starts`), and
    2E+1PD on its place. Every item still passes, each for its verdict."""
    live = tmp_path / "live"
    live.mkdir()
    monkeypatch.setenv(LIVE_DIR_ENV, str(live))
    run_root = tmp_path / "run"
    argv = fake_gpu_session(
        tmp_path, shape.devices, *START_COUNT_SELECTION, "-m", "e2e",
        "-k", START_COUNT_ITEMS, "-n", str(shape.workers), "--dist", "loadgroup",
        *(["--epd-colocate"] if shape.colocate else []),
    )  # fmt: skip
    out = fake_night_output(argv)
    # 3 text cases, the load, the round robin
    assert re.search(r"^=+ 5 passed in ", out, re.M), out[-6000:]
    starts = [
        start
        for path in run_root.glob("**/topology-starts.json")
        for start in json.loads(path.read_text())
    ]
    counted = Counter(start["topology"] for start in starts)
    every = {"baseline", "1E+1PD", "2E+1PD", "1P+1D", "1E+1P+1D"}
    forced = {name: shape.starts.get(name, 1) for name in every}
    if shape.workers > 1:
        # A worker that did not compute the baseline's answers starts it for the calibration.
        assert counted["baseline"] in (1, 2), starts
        forced["baseline"] = counted["baseline"]
    assert dict(counted) == forced, "\n".join(f"{s['topology']}: {s['reason']}" for s in starts)
    fakes = logged_starts(fake_vllm_start_log)
    two_encoders = {
        s["env"].get("CUDA_VISIBLE_DEVICES", "0")
        for s in fakes
        if any("/2E-1PD/" in arg for arg in s["launch"])
    }
    assert two_encoders == shape.two_encoders_on, fakes
    if not shape.colocate:
        assert [s for s in fakes if s["shared"]] == [], "a device held by two live instances"


def test_repro_reruns_a_colocated_one_gpu_run_and_on_the_devices_it_is_given(
    tmp_path: Path, fake_vllm: Path, fake_vllm_start_log: Path, epd_cli
) -> None:
    """A developer reproducing a red case on one GPU. A run on `--devices 0 --colocate`
    recorded no colocation, so its repro refused ("1P+1D needs 2 devices ...; use --colocate",
    an option repro did not have); and a bundle of the 8-GPU night names devices (0, 3-7 for
    1P+1D's group) that a one-GPU box lacks, where repro would start instances on GPUs that
    are not there. Repro now shares devices as the run did, and `--devices` / `--colocate`
    put the rerun on this host's."""
    model = ensure_tiny_model(cache_dir() / "models")
    red = tmp_path / "red"
    one_gpu = ("--platform", "cuda", "--devices", "0", "--colocate")
    case = ("--topology", "1P+1D", "--prompt", "text", "--plant-fault", "drop-kv")
    code, out, _ = epd_cli(*run_argv(fake_vllm, red, *one_gpu, *case, "--model", str(model)))
    assert code == 1 and "VACUOUS" in out, out[-2000:]
    assert json.loads((red / "run.json").read_text())["colocate"] is True

    code, out, err = epd_cli("repro", red, "--vllm", fake_vllm)
    assert code == 0, err[-2000:]
    assert "VACUOUS now, VACUOUS in the bundle: reproduced" in out

    night = json.loads((red / "run.json").read_text())
    (red / "run.json").write_text(
        json.dumps({**night, "devices": [0, 3, 4, 5, 6, 7], "colocate": False})
    )  # as the 8-GPU night recorded 1P+1D's group
    again = tmp_path / "again"
    rerun = ("--devices", "5", "--colocate", "--run-dir", again)
    code, out, err = epd_cli("repro", red, "--vllm", fake_vllm, *rerun)
    assert code == 0, err[-2000:]
    last = [env for role, env in devices_by_role(fake_vllm_start_log)[-3:] if role != "baseline"]
    assert last == ["5", "5"], devices_by_role(fake_vllm_start_log)
    assert json.loads((again / "run.json").read_text())["devices"] == [5]


@pytest.mark.usefixtures("served_vllm_parser")  # its runs (subprocesses) find their lines judged
def test_a_fault_planted_for_a_load_survives_the_calibration_on_two_gpus(
    tmp_path: Path, fake_vllm_start_log: Path
) -> None:
    """The 2-GPU nightly serves where 1P+1D's slot holds the baseline's device (so did vLLM's
    Buildkite step on 4 GPUs, before the baseline kept a device of its own there): the load's
    baseline calibration stops 1P+1D and starts it again. The NIXL KV-account scenario planted
    its `drop-kv` in the 1P+1D it had opened before the load, so the load ran on a fresh start
    without it, and the scenario failed ("fault.effects == []"; seen with the fake vLLM on 4
    devices, green on 8)."""
    argv = fake_gpu_session(
        tmp_path, "0,1", "scenarios/test_load.py", "-m", "e2e", "-k", "got_no_kv", "-rA"
    )
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        argv, cwd=root, capture_output=True, text=True, timeout=SESSION_HANG_S,
        start_new_session=True,
    )  # fmt: skip
    assert re.search(r"^PASSED \S+got_no_kv", done.stdout, re.M), done.stdout[-4000:]
    # The baseline's device is 1P+1D's prefill's: the calibration and the load take turns.
    started = devices_by_role(fake_vllm_start_log)  # P and D start together: either first
    assert started[0] == ("baseline", "0") and sorted(started[1:]) == [
        ("decode", "1"),
        ("prefill", "0"),
    ], started


# What the fake vLLM imitates for the GPU night beyond serving: vLLM 0.32's streams, its 400 for
# an embeddings part on an instance that is no consumer, and a consumer's death on a uuid no
# encoder produced. Each module on the fake: every item passes (the D check driven without P's
# kv_transfer_params applies to ExampleConnector only, deselected under NIXL).
IMITATED_SELECTION = ("scenarios/test_stream.py", "scenarios/test_negative_checks.py")
IMITATED_PASSED = 24 + 1 + 4  # streamed cases, the relayed chunk, the negative checks


@pytest.mark.usefixtures("served_vllm_parser")  # its runs (subprocesses) find their lines judged
def test_the_streamed_and_negative_scenarios_pass_on_the_fake_gpu_night(
    tmp_path: Path, fake_vllm_start_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole nightly selection on the fake (cuda, NIXL, four devices, one worker) failed
    40 of its 98 items: these two modules' 28 (the fake answered a stream with one JSON
    document, an embeddings part with a 500 everywhere, and lived on), with others for the
    harness's own reasons and the fake's placeholder ids. The whole selection takes minutes;
    these two modules are what the fake newly imitates, and each passes for its verdict (the
    toy proxy's declared JSON stream a MISMATCH; the planted duplicate chunk a MISMATCH)."""
    live = tmp_path / "live"
    live.mkdir()
    monkeypatch.setenv(LIVE_DIR_ENV, str(live))
    argv = fake_gpu_session(
        tmp_path, "0,1,2,3", *IMITATED_SELECTION, "-m", "e2e",
        "-n", "1", "--dist", "loadgroup", "-rA", "--epd-kv-connector", "nixl",
    )  # fmt: skip
    out = fake_night_output(argv)
    summary = out.strip().splitlines()[-1]
    # About 2 minutes here (126 s), the sweeps of both streamed modules made whatever -k says.
    assert re.fullmatch(rf"=+ {IMITATED_PASSED} passed in .*", summary), out[-8000:]
    assert [s for s in logged_starts(fake_vllm_start_log) if s["shared"]] == []


@pytest.mark.usefixtures("served_vllm_parser")  # its runs (subprocesses) find their lines judged
def test_the_death_under_load_passes_on_the_fake_gpu_night(tmp_path: Path) -> None:
    """scenarios/test_load.py's death under load on the fake night's shape (cuda, NIXL, four
    devices): D SIGKILLed with all 32 requests in flight, each ERROR naming D, nothing left
    running. It failed about one run in three ("request 1: MATCH, not ERROR"): the fake's D
    answered at once, so some requests were done before the kill, and the killer counted any
    call D's tap had ever seen as one in flight there. Now the fake decodes a step a token and
    the killer waits for a call of its round still at D.

    At the fake's 0.01 s step it still failed one run in 18 (so D's step was 0.05 s here): the
    load sent each request as its thread began, the 32 threads took up to 0.5 s to begin on a
    busy host, and D answered the first in 0.31 s. The kill round's requests now go out
    together (harness/run/load/sending.py `Together`), and the fake's own step is kept."""
    argv = fake_gpu_session(
        tmp_path, "0,1,2,3", "scenarios/test_load.py", "-m", "e2e", "-k", "death",
        "-rA", "--epd-kv-connector", "nixl",
    )  # fmt: skip
    out = fake_night_output(argv)
    assert re.search(r"^PASSED \S+test_death_under_load_ends_every_request_naming_d", out, re.M), (
        out[-6000:]
    )
    assert re.search(
        r"^\[load\] killed 1E\+1P\+1D/decode0 with 32 request\(s\) in flight", out, re.M
    )
