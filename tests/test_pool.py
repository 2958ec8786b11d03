"""The topology pool starts each topology once and shares it (harness/run/pool.py), with the
fake vLLM (harness/testing/fake_vllm.py) counting every start: a sweep starts each distinct
instance once, a second request for a running topology starts nothing, another proxy in front
starts nothing, a dead or released topology is started again with its reason."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from harness.environment import cache_dir
from harness.run.pool import TopologyPool
from harness.run.sweep import Sweep, SweepSpec
from harness.spec.prompts import SKELETON_PROMPTS
from harness.spec.settings import ProxyChoice, RunSettings
from harness.spec.topology import EPD_TOPOLOGY_NAMES, TOPOLOGIES, Role
from harness.testing.fake_vllm import fake_run_settings, install_fake_vllm, logged_starts
from harness.testing.processes import wait_for

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parent.parent

TEXT = next(p for p in SKELETON_PROMPTS if p.name == "text")


def settings_for(tmp_path: Path) -> RunSettings:
    return fake_run_settings(tmp_path, install_fake_vllm(tmp_path / "bin"))


def test_a_sweep_starts_each_distinct_instance_once(
    tmp_path: Path, fake_vllm_start_log: Path
) -> None:
    settings = settings_for(tmp_path)
    spec = SweepSpec(tuple(TOPOLOGIES[n] for n in EPD_TOPOLOGY_NAMES), prompts=(TEXT,))
    sweep = Sweep(spec, settings)
    result = sweep.run_all()
    assert {(r.topology, r.reference) for r in result.records} == {
        ("1E+1PD", "baseline"),
        ("1P+1D", "baseline"),
        ("1E+1P+1D", "baseline"),
        ("1E+1P+1D", "1P+1D"),
    }
    launches = Counter(json.dumps(s["launch"]) for s in logged_starts(fake_vllm_start_log))
    assert launches and set(launches.values()) == {1}, f"an instance started twice: {launches}"
    roles = Counter(s["role"] for s in logged_starts(fake_vllm_start_log))
    # baseline; 1E+1PD (E, PD); 1P+1D (P, D); 1E+1P+1D (E, P, D): 8 instances, each once
    assert roles == {"baseline": 1, "encoder": 2, "pd": 1, "prefill": 2, "decode": 2}, roles
    assert [s.reason for s in sweep.pool.starts] == ["first use"] * 4, sweep.pool.summary()
    # The fake moves KV as ExampleConnector does: MATCH with the kv_transfer guard held.
    assert result.passed, [(r.topology, r.verdict.value, r.guards) for r in result.records]
    assert sweep.pool.running() == [], "a sweep that owns its pool stops everything"


def test_a_running_topology_is_shared_and_a_dead_one_started_again_with_its_cause(
    tmp_path: Path, fake_vllm_start_log: Path
) -> None:
    settings = settings_for(tmp_path)
    pool = TopologyPool(settings)
    try:
        first = pool.session(TOPOLOGIES["1P+1D"])
        again = pool.session(TOPOLOGIES["1P+1D"])
        assert again is first and len(logged_starts(fake_vllm_start_log)) == 2
        victim = first.server(Role.DECODE)
        os.killpg(victim.pgid, signal.SIGKILL)
        wait_for(lambda: not victim.is_alive(), "the decode instance to die", 10)
        restarted = pool.session(TOPOLOGIES["1P+1D"])
        assert restarted is not first and len(logged_starts(fake_vllm_start_log)) == 4
        reason = pool.starts[-1].reason
        assert reason.startswith("restart: instance 1P+1D/decode0 exited"), reason
        pool.release("1P+1D")
        assert pool.running() == []
        pool.session(TOPOLOGIES["1P+1D"])
        assert pool.starts[-1].reason == "restart: stopped earlier"
        summary = pool.summary()
        assert summary.startswith("topology starts: 3 for 1 distinct"), summary
    finally:
        pool.close()
    assert pool.running() == []


def test_a_dead_instance_is_revived_in_place_and_its_siblings_keep_running(
    tmp_path: Path, fake_vllm_start_log: Path
) -> None:
    """`revive` starts only the instance that died, on its port, with a log of its own (the
    dead one's stays as evidence); the same session, its sibling and its proxy serve on."""
    settings = settings_for(tmp_path)
    pool = TopologyPool(settings)
    body = {"model": "epd-model", "messages": [{"role": "user", "content": "hi"}]}
    try:
        session = pool.session(TOPOLOGIES["1P+1D"])
        prefill, victim = session.server(Role.PREFILL), session.server(Role.DECODE)
        old_log, port = victim.command.log_path, victim.port_lease.port
        os.killpg(victim.pgid, signal.SIGKILL)
        wait_for(lambda: not victim.is_alive(), "the killed D to be gone")
        assert (
            pool.revive(TOPOLOGIES["1P+1D"]) is session
            and len(logged_starts(fake_vllm_start_log)) == 3
        )
        fresh = session.server(Role.DECODE)
        assert fresh is not victim and fresh.is_alive() and fresh.port_lease.port == port
        assert session.server(Role.PREFILL) is prefill and prefill.is_alive()
        assert old_log.exists() and fresh.command.log_path.name.endswith(".revived-1.log")
        assert session.dead_instance_report() is None
        assert session.send("text", body).result is not None
        reason = pool.starts[-1].reason
        assert reason.startswith("revive decode0: instance 1P+1D/decode0 exited"), reason
        assert pool.revive(TOPOLOGIES["1P+1D"]) is session, "nothing dead: nothing started"
        assert len(logged_starts(fake_vllm_start_log)) == 3
    finally:
        pool.close()
    assert pool.running() == []


def test_another_proxy_in_front_starts_no_instance(
    tmp_path: Path, fake_vllm_start_log: Path
) -> None:
    """The same instances through the harness's proxy and through another entry (here a
    second harness proxy stands in for vLLM's, which the fake cannot run)."""
    settings = settings_for(tmp_path)
    pool = TopologyPool(settings)
    try:
        own = pool.session(TOPOLOGIES["1E+1PD"])
        body = {"model": "epd-model", "messages": [{"role": "user", "content": "hi"}]}
        entry = own.via(ProxyChoice())
        assert entry.entry.key == "harness" and entry.entry is own._entry
        assert own.send("text", body).result is not None
        assert len(logged_starts(fake_vllm_start_log)) == 2
    finally:
        pool.close()


def test_the_proxy_keeps_no_trace_a_session_has_taken(tmp_path: Path) -> None:
    """Each request's trace goes into its outcome; the proxy holding every one as well grew by
    every request of a soak of hours, as the taps' records did before their marks."""
    pool = TopologyPool(settings_for(tmp_path))
    try:
        own = pool.session(TOPOLOGIES["1E+1PD"])
        body = {"model": "epd-model", "messages": [{"role": "user", "content": "hi"}]}
        outcomes = [own.send("text", body) for _ in range(3)]
        assert all(o.result is not None and o.trace is not None for o in outcomes), outcomes
        assert own.proxy is not None and own.proxy.traces == {}
    finally:
        pool.close()


def test_a_private_session_is_counted_with_its_reason(
    tmp_path: Path, fake_vllm_start_log: Path
) -> None:
    settings = settings_for(tmp_path)
    pool = TopologyPool(settings)
    with pool.private(TOPOLOGIES["1E+1PD"], "a rerun on kept storage", label="rerun") as session:
        assert session.dead_instance_report() is None
    assert [s.reason for s in pool.starts] == ["private: a rerun on kept storage"]
    assert len(logged_starts(fake_vllm_start_log)) == 2
    pool.close()


def text_sweep(settings: RunSettings, pool: TopologyPool | None = None) -> Sweep:
    """A sweep of 1E+1P+1D on the text prompt (1P+1D its exact reference), on `pool` if any."""
    return Sweep(SweepSpec((TOPOLOGIES["1E+1P+1D"],), prompts=(TEXT,)), settings, pool=pool)


def test_a_sweep_judges_only_its_topologies_not_the_references_it_starts_for_them(
    tmp_path: Path, fake_vllm_start_log: Path
) -> None:
    """A sweep of 1E+1P+1D starts 1P+1D to hold it exact to, and judges 1E+1P+1D alone:
    cases of 1P+1D would be verdicts nobody asked for, each a failure that could fail the
    run. Each case is judged once, though its wave's judging and the run's last both ask."""
    sweep = text_sweep(settings_for(tmp_path))
    result = sweep.run_all()
    assert sorted((r.topology, r.reference) for r in result.records) == [
        ("1E+1P+1D", "1P+1D"),
        ("1E+1P+1D", "baseline"),
    ]
    assert "1P+1D" in sweep.observed


def test_a_sweep_on_its_own_pool_stops_each_topology_once_its_prompts_are_answered(
    tmp_path: Path, fake_vllm_start_log: Path
) -> None:
    """Without a shared pool, each topology is stopped as soon as its wave has answered (the
    memory is the next wave's), not left running until the run ends."""
    sweep = Sweep(SweepSpec((TOPOLOGIES["1P+1D"],), prompts=(TEXT,)), settings_for(tmp_path))
    released: list[str | None] = []
    release = sweep.pool.release

    def noted(topology=None, launcher=None):
        released.append(topology)
        release(topology, launcher)

    sweep.pool.release = noted  # type: ignore[method-assign]
    sweep.run_all()
    assert released[:2] == ["baseline", "1P+1D"], released


def test_a_shared_sweep_answers_its_reference_before_the_pool_stops_it(
    tmp_path: Path, fake_vllm_start_log: Path
) -> None:
    """1P+1D is stopped before 1E+1P+1D is judged (a pytest group ended): the sweep sharing
    the pool answered its prompts on 1P+1D first, so judging 1E+1P+1D starts no 1P+1D."""
    settings = settings_for(tmp_path)
    pool = TopologyPool(settings)
    try:
        sweep = text_sweep(settings, pool)
        sweep.serve_baseline()
        pool.session(TOPOLOGIES["1P+1D"])  # something else used it
        pool.release("1P+1D")
        assert "1P+1D" in sweep.observed
        records = sweep.judge("1E+1P+1D", "text")
        assert {r.reference for r in records} == {"baseline", "1P+1D"}
        assert [s.key.topology for s in pool.starts] == ["baseline", "1P+1D", "1E+1P+1D"]
    finally:
        pool.close()


def test_a_shared_sweep_answers_nothing_on_a_reference_served_under_other_flags(
    tmp_path: Path, fake_vllm_start_log: Path
) -> None:
    """1P+1D started by another scenario with other serving flags (another max_num_seqs) is
    stopped: its answers are not the ones this sweep's 1E+1P+1D is held exact to, so the
    sweep sends it nothing, and judging 1E+1P+1D starts 1P+1D under the sweep's own flags."""
    settings = settings_for(tmp_path)
    pool = TopologyPool(settings)
    try:
        sweep = text_sweep(settings, pool)
        sweep.serve_baseline()
        other = dataclasses.replace(
            settings, serving=dataclasses.replace(settings.serving, max_num_seqs=4)
        )
        pool.session(TOPOLOGIES["1P+1D"], other)  # another scenario's, under its own flags
        pool.release("1P+1D")
        assert "1P+1D" not in sweep.observed
        records = sweep.judge("1E+1P+1D", "text")
        assert {r.reference for r in records} == {"baseline", "1P+1D"}
        starts = [(s.key.topology, s.key.serving.max_num_seqs) for s in pool.starts]
        assert ("1P+1D", settings.serving.max_num_seqs) in starts, starts
    finally:
        pool.close()


def test_a_shared_sweep_answers_nothing_on_a_reference_run_by_another_launcher(
    tmp_path: Path, fake_vllm_start_log: Path
) -> None:
    """1P+1D started by another scenario under another launcher (its instances given other
    environment, as a Ray cluster's nodes would be) is stopped: under the same serving flags its
    answers are still not those of the instances this sweep's 1E+1P+1D is held exact to, so the
    sweep sends it nothing, and judging 1E+1P+1D starts 1P+1D under the sweep's own launcher.
    Found in review: a mutant that compared the serving flags alone survived every test."""
    settings = settings_for(tmp_path)
    pool = TopologyPool(settings)
    try:
        sweep = text_sweep(settings, pool)
        sweep.serve_baseline()
        launcher = dataclasses.replace(settings.launcher, instance_env=(("EPD_OTHER", "1"),))
        other = dataclasses.replace(settings, launcher=launcher)
        pool.session(TOPOLOGIES["1P+1D"], other)  # another scenario's, on its own launcher
        pool.release("1P+1D")
        assert "1P+1D" not in sweep.observed
        records = sweep.judge("1E+1P+1D", "text")
        assert {r.reference for r in records} == {"baseline", "1P+1D"}
        starts = [(s.key.topology, s.key.launcher) for s in pool.starts]
        assert ("1P+1D", settings.launcher) in starts, starts
    finally:
        pool.close()


def test_a_shared_sweep_answers_on_a_stopping_topology_only_its_unanswered_references(
    tmp_path: Path, fake_vllm_start_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool stops everything: 1P+1D, the sweep's reference, already answered the sweep's
    prompts, and 1E+1PD is nobody's reference here, so neither is sent them again (a request
    each that nothing would judge, on instances about to stop)."""
    import harness.run.sweep as sweep_module

    asked: list[str] = []
    real_observe = sweep_module.observe

    def counted(session, prompt, body, stream, *, fresh_prefix):
        asked.append(session.topology.name)
        return real_observe(session, prompt, body, stream, fresh_prefix=fresh_prefix)

    monkeypatch.setattr(sweep_module, "observe", counted)
    settings = settings_for(tmp_path)
    pool = TopologyPool(settings)
    try:
        sweep = text_sweep(settings, pool)
        sweep.judge("1E+1P+1D", "text")
        pool.session(TOPOLOGIES["1E+1PD"])  # another scenario's
        pool.release()
        assert sorted(asked) == ["1E+1P+1D", "1P+1D"], asked
        assert "1E+1PD" not in sweep.observed
    finally:
        pool.close()


def test_a_streamed_sweep_streams_on_a_topology_an_unstreamed_one_started(
    tmp_path: Path, fake_vllm_start_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sharing a running topology must not share how it is sent to: the streamed sweep asks
    for streamed requests on the session the unstreamed sweep started (whose own settings say
    unstreamed). The fake vLLM does not stream, so what is checked is what each sweep asked."""
    import harness.run.sweep as sweep_module

    asked: list[tuple[str, bool, bool]] = []

    def observe_unstreamed(session, prompt, body, stream, *, fresh_prefix):
        asked.append((session.topology.name, stream, fresh_prefix))
        return real_observe(session, prompt, body, False, fresh_prefix=fresh_prefix)

    real_observe = sweep_module.observe
    monkeypatch.setattr(sweep_module, "observe", observe_unstreamed)
    settings = settings_for(tmp_path)
    pool = TopologyPool(settings)
    try:
        spec = SweepSpec((TOPOLOGIES["1E+1PD"],), prompts=(TEXT,))
        plain = Sweep(spec, settings, pool=pool)
        assert [r.verdict.value for r in plain.judge("1E+1PD", "text")] == ["MATCH"]
        streamed_settings = dataclasses.replace(settings, stream=True)
        streamed = Sweep(spec, streamed_settings, pool=pool, baseline=plain.baseline)
        streamed.judge("1E+1PD", "text")
        # ... and each case under a salt of its own (D may hold the prompt from the other)
        assert asked == [("1E+1PD", False, True), ("1E+1PD", True, True)]
        assert [s.key.topology for s in pool.starts] == ["baseline", "1E+1PD"]
    finally:
        pool.close()


def xdist_sweep(
    tmp_path: Path, workers: int, *options: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """The sweep's text cases under `-n workers --dist loadgroup`, the fake vLLM standing in
    for each instance; it must count the four topologies it needs, each started once. `env`:
    the session's environment, where not this test's own."""
    fake = install_fake_vllm(tmp_path / "bin")
    argv = [
        sys.executable, "-m", "pytest", "scenarios/test_epd_matches_baseline.py",
        "-m", "e2e", "-k", "text", "-n", str(workers), "--dist", "loadgroup",
        "-p", "no:cacheprovider", "--epd-vllm", str(fake),
        "--epd-kv-connector", "example",  # the count does not depend on it; NIXL needs nixl
        "--epd-model", str(tiny_model_dir()), "--epd-baseline-cache", str(tmp_path / "cache"),
        "--epd-run-dir", str(tmp_path / "run"), *options,
    ]  # fmt: skip
    run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert "topology starts: 4 for 4 distinct" in run.stdout, run.stdout[-3000:]
    # Every case passed, the transfer guards held (the fake moves EC and KV as vLLM does).
    assert run.returncode == 0 and " 3 passed" in run.stdout, run.stdout[-3000:]
    return run


@pytest.mark.usefixtures("served_vllm_parser")  # its runs (subprocesses) find their lines judged
def test_xdist_workers_on_eight_gpus_start_each_topology_once(
    tmp_path: Path, fake_vllm_start_log: Path
) -> None:
    """The GPU nightly's shape: four workers on an 8-device cuda plan. One wave holds every
    topology, yet each worker starts only the topologies of its own cases (and their exact
    references): every topology once across the workers."""
    xdist_sweep(tmp_path, 4, "--epd-platform", "cuda", "--epd-devices", "0,1,2,3,4,5,6,7")
    roles = Counter(s["role"] for s in logged_starts(fake_vllm_start_log))
    assert roles == {"baseline": 1, "encoder": 2, "pd": 1, "prefill": 2, "decode": 2}, roles
    devices = [s["env"]["CUDA_VISIBLE_DEVICES"] for s in logged_starts(fake_vllm_start_log)]
    assert sorted(devices) == [str(d) for d in range(8)], "one device each, as planned"


@dataclasses.dataclass(frozen=True)
class FakeNight:
    """A pytest session on the fake vLLM that tests read after it ended: its directory (the
    fake, baseline cache and run root, as `xdist_sweep` lays them out), output and start log."""

    root: Path
    run: subprocess.CompletedProcess
    start_log: Path


# The tests reading one night share an xdist group: the night runs once, on their worker.
CPU_HOST_NIGHT = "test_pool-cpu-host-night"


@pytest.fixture(scope="module")
def cpu_host_night(
    tmp_path_factory: pytest.TempPathFactory, served_vllm_parser, epd_argv_check_dir: Path
) -> FakeNight:
    """`xdist_sweep` with three workers on the CPU host, once for the tests that read it (its
    runs keep their accepted lines where the session's do: set up before any test's own)."""
    from harness.environment import ARGV_CHECK_DIR_ENV, PORT_LOCK_DIR_ENV
    from harness.testing.fake_vllm import START_LOG_ENV

    root = tmp_path_factory.mktemp("cpu-host-night")
    start_log = root / "starts.jsonl"
    env = {**os.environ, START_LOG_ENV: str(start_log), PORT_LOCK_DIR_ENV: str(root / "ports")}
    env[ARGV_CHECK_DIR_ENV] = str(epd_argv_check_dir)
    return FakeNight(root, xdist_sweep(root, 3, env=env), start_log)


@pytest.mark.xdist_group(CPU_HOST_NIGHT)
def test_xdist_workers_on_a_cpu_host_leave_every_topology_to_one_worker(
    cpu_host_night: FakeNight,
) -> None:
    """CI's shape (`scripts/cpu test`): on the CPU host one worker takes every e2e item, so
    each topology, the baseline too, starts once however many workers run the other tiers."""
    run = cpu_host_night.run
    roles = Counter(s["role"] for s in logged_starts(cpu_host_night.start_log))
    assert roles == {"baseline": 1, "encoder": 2, "pd": 1, "prefill": 2, "decode": 2}, roles
    run_root = cpu_host_night.root / "run"
    workers = {log.parent.parent.name for log in run_root.glob("gw*/*/*.cmd.json")}
    assert len(workers) == 1, workers
    # The worker's verdict table reaches the terminal of the run.
    [worker] = workers
    assert f"EPD verdicts ({worker})" in run.stdout and " MATCH " in run.stdout, run.stdout[-3000:]
    # So does each instance's start, one line per instance started (8), from that worker.
    section = run.stdout.split("EPD instance starts", 1)[-1].split("EPD topology starts", 1)[0]
    lines = [line for line in section.splitlines() if ": ready in " in line]
    assert len(lines) == 8 and all("; CPU " in line for line in lines), section


def tiny_model_dir() -> Path:
    from fixtures.tiny_model import ensure_tiny_model

    return ensure_tiny_model(cache_dir() / "models")


def test_a_fault_goes_into_the_topologies_under_test_never_their_references(
    tmp_path: Path, fake_vllm_start_log: Path
) -> None:
    """`--plant-fault ec-noise:0.05 --topology 1E+1P+1D`: 1P+1D starts as its exact reference
    only, and an EC fault has nothing to act on there (it once raised and ended the sweep)."""
    settings = settings_for(tmp_path)
    spec = SweepSpec((TOPOLOGIES["1E+1P+1D"],), prompts=(TEXT,), fault="ec-noise:0.05")
    result = Sweep(spec, settings).run_all()
    assert {(r.topology, r.reference) for r in result.records} == {
        ("1E+1P+1D", "baseline"),
        ("1E+1P+1D", "1P+1D"),
    }


def test_a_fault_is_never_planted_in_a_reference_under_test_too(
    tmp_path: Path, fake_vllm_start_log: Path
) -> None:
    """Found in review: `--plant-fault zero-kv --topology 1P+1D,1E+1P+1D` planted the fault in
    1P+1D, under test, and judged 1E+1P+1D against those faulted answers: on the fake, every
    1E+1P+1D case read MATCH against 1P+1D ("identical", both zeroed). Refused before a start."""
    settings = settings_for(tmp_path)
    both = (TOPOLOGIES["1P+1D"], TOPOLOGIES["1E+1P+1D"])
    with pytest.raises(ValueError, match="1E\\+1P\\+1D would be judged against 1P\\+1D's"):
        Sweep(SweepSpec(both, prompts=(TEXT,), fault="zero-kv"), settings).run_all()
    assert logged_starts(fake_vllm_start_log) == [], "nothing started"


def test_a_session_that_fails_to_close_does_not_leave_the_pools_others_running(
    tmp_path: Path,
) -> None:
    """Found in review: `release()` stopped session after session in a plain loop, so one
    close that raised (a tap that did not stop in time) left every later session running."""
    from harness.run.pool import SessionRequest
    from harness.testing.processes import survivors

    settings = settings_for(tmp_path)
    pool = TopologyPool(settings)
    opened = pool.open([SessionRequest(TOPOLOGIES[n], settings) for n in ("1P+1D", "1E+1PD")])
    first, second = opened.values()
    servers = [*first.servers, *second.servers]
    real_stop = first.taps.stop

    def stop_then_fail() -> None:
        real_stop()
        raise TimeoutError("the taps did not stop in time (planted)")

    first.taps.stop = stop_then_fail
    try:
        with pytest.raises(TimeoutError, match="planted"):
            pool.close()
        running = [server.name for server in servers if server.is_alive()]
        assert running == [], f"left running by pool.close(): {running}"
    finally:
        for session in (first, second):
            session.close()
        assert survivors([server.pid for server in servers]) == []


def test_a_revival_that_does_not_come_up_in_time_restarts_the_topology(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: the fallback of a revival whose instance was still starting at the
    deadline handed back the same session, its revived instance never ready."""
    from harness.testing.fake_vllm import MODE_ENV
    from harness.testing.processes import survivors, wait_for

    settings = dataclasses.replace(settings_for(tmp_path), startup_timeout_s=8.0)
    pool = TopologyPool(settings)
    topology = TOPOLOGIES["1P+1D"]
    pids: list[int] = []
    try:
        session = pool.session(topology)
        pids += [server.pid for server in session.servers]
        victim = session.server(Role.DECODE)
        os.killpg(victim.pgid, signal.SIGKILL)
        wait_for(lambda: not victim.is_alive(), "decode to die", 10)
        revive = session.revive_dead

        def slow_revival():  # the revived D misses the deadline; a restart's would not
            monkeypatch.setenv(MODE_ENV, "decode:slow-start=60")
            try:
                return revive()
            finally:
                monkeypatch.delenv(MODE_ENV)

        monkeypatch.setattr(session, "revive_dead", slow_revival)
        served = pool.revive(topology)
        pids += [server.pid for server in served.servers]
        not_ready = [server.name for server in served.servers if server.startup_seconds is None]
    finally:
        pool.close()
        assert survivors([pid for pid in pids if pid]) == []
    assert served is not session and not_ready == [], not_ready
    assert [start.reason.split(":")[0] for start in pool.starts][-2:] == ["revive", "restart"]


# -- review findings (pool and plugin) ----------------------------------------------------------


@pytest.mark.usefixtures("served_vllm_parser")  # its runs (subprocesses) find their lines judged
def test_refreshing_the_baseline_under_xdist_on_gpus_starts_it_once(
    tmp_path: Path, fake_vllm_start_log: Path
) -> None:
    """Found in review: `--epd-refresh-baseline` makes every worker's cache ignore what the
    first worker just stored under the lock, so each worker with e2e items starts a baseline
    of its own (here 4 on 8 GPUs: 7 starts for 4 distinct). The same with
    `--epd-baseline-cache off`, where the workers have no cache to share at all."""
    xdist_sweep(
        tmp_path, 4, "--epd-platform", "cuda", "--epd-devices", "0,1,2,3,4,5,6,7",
        "--epd-refresh-baseline",
    )  # fmt: skip


@pytest.mark.usefixtures("served_vllm_parser")  # its runs (subprocesses) find their lines judged
def test_the_baseline_cache_off_under_xdist_on_gpus_starts_it_once(
    tmp_path: Path, fake_vllm_start_log: Path
) -> None:
    """`--epd-baseline-cache off` where workers share devices: the baseline is shared through a
    cache private to the session (in the run root's `session-shared`, emptied as the session
    begins), so it starts once, and nothing is read from or kept in the user's cache."""
    xdist_sweep(
        tmp_path, 4, "--epd-platform", "cuda", "--epd-devices", "0,1,2,3,4,5,6,7",
        "--epd-baseline-cache", "off",
    )  # fmt: skip
    assert not (tmp_path / "cache").exists()
    assert list((tmp_path / "run" / "session-shared" / "baseline").glob("*.json"))


def test_a_restart_keeps_the_log_of_the_instance_that_died(
    tmp_path: Path, fake_vllm_start_log: Path
) -> None:
    """Found in review: a restart names the dead instance's log as its cause ("restart:
    instance 1P+1D/decode0 exited with code -9; last lines of <log>:"), then deletes it: the
    new session's `prepare_session_dir` empties the same directory before `keep_earlier_log`
    can move the log to `<name>.1.log`. The cause of an unexpected death between two items (or
    of a start that timed out, docs/testing.md) is gone from the run's artifacts."""
    settings = settings_for(tmp_path)
    pool = TopologyPool(settings)
    try:
        dead_log = kill_the_decode_instance(pool)
        pool.session(TOPOLOGIES["1P+1D"])
        reason = pool.starts[-1].reason
        assert reason.startswith("restart: instance 1P+1D/decode0 exited"), reason
        assert str(dead_log) in reason, reason
        kept = sorted(p.name for p in dead_log.parent.glob(f"{dead_log.stem}*.log"))
        assert f"{dead_log.stem}.1.log" in kept, f"the dead D's log is gone: {kept}"
        # The new D writes `dead_log` again: the reason names where the dead one's went.
        assert reason.endswith(f"is kept as {dead_log.stem}.1.log"), reason
    finally:
        pool.close()


def kill_the_decode_instance(pool: TopologyPool) -> Path:
    """Start 1P+1D in `pool`, kill its D by group, and return D's log: a death between items."""
    victim = pool.session(TOPOLOGIES["1P+1D"]).server(Role.DECODE)
    os.killpg(victim.pgid, signal.SIGKILL)
    wait_for(lambda: not victim.is_alive(), "the decode instance to die", 10)
    return victim.command.log_path


def test_a_restart_in_another_run_directory_names_where_the_dead_log_is_kept(
    tmp_path: Path, fake_vllm_start_log: Path
) -> None:
    """A pool shared by sweeps of several run directories (a pytest session's) restarts a
    topology whose instance died in the directory of the sweep asking now: the new start
    keeps the earlier logs of *its* directory only, so the reason named the dead log under
    its old name, with no "kept as"; a later start in the old directory then moved it, and
    the reason named a log that was not there."""
    settings = settings_for(tmp_path)
    pool = TopologyPool(settings)
    try:
        dead_log = kill_the_decode_instance(pool)
        elsewhere = dataclasses.replace(settings, run_dir=tmp_path / "another-run")
        restarted = pool.session(TOPOLOGIES["1P+1D"], elsewhere)
        assert restarted.dir.parent == elsewhere.run_dir
        reason = pool.starts[-1].reason
        kept = dead_log.with_name(f"{dead_log.stem}.1.log")
        assert reason.endswith(f"its log {dead_log} is kept as {kept.name}"), reason
        assert kept.is_file() and not dead_log.exists()
        # A later start in the first directory keeps its own logs; the named one stays.
        pool.release("1P+1D")
        pool.session(TOPOLOGIES["1P+1D"])
        assert kept.is_file(), "the log the reason names was moved again"
    finally:
        pool.close()


def test_a_start_that_timed_out_keeps_its_log_when_the_pool_starts_it_again(
    tmp_path: Path, fake_vllm_start_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/testing.md: after a prefill that never answered its health probes, "a restarted
    server now keeps the earlier log as `<name>.<n>.log`". Through the pool it does not: the
    next start of the topology empties the session directory first."""
    from harness.testing.fake_vllm import MODE_ENV

    settings = dataclasses.replace(settings_for(tmp_path), startup_timeout_s=3.0)
    pool = TopologyPool(settings)
    try:
        monkeypatch.setenv(MODE_ENV, "prefill:slow-start=60")
        with pytest.raises(Exception):  # noqa: B017 - whatever the start raises
            pool.session(TOPOLOGIES["1P+1D"])
        monkeypatch.delenv(MODE_ENV)
        session = pool.session(TOPOLOGIES["1P+1D"])
        log = session.server(Role.PREFILL).command.log_path
        kept = sorted(p.name for p in log.parent.glob(f"{log.stem}*.log"))
        assert f"{log.stem}.1.log" in kept, f"the timed-out start's log is gone: {kept}"
    finally:
        pool.close()


LATE_SWEEP_SCENARIO = '''
"""As scenarios/test_vllm_proxy.py: a session-scoped sweep of its own on the session's pool
(another proxy), made at the module's first item or when 1P+1D is about to stop
(EPD_LATER_SWEEPS), its 1E+1P+1D judged against 1P+1D."""
import dataclasses

import pytest

from harness.run.sweep import Sweep, SweepSpec
from harness.spec.prompts import SKELETON_PROMPTS
from harness.spec.topology import TOPOLOGIES

pytestmark = pytest.mark.e2e
TEXT = next(p for p in SKELETON_PROMPTS if p.name == "text")


def make_other_proxy_sweep(pytestconfig, epd_sweep, epd_events):
    settings = dataclasses.replace(
        epd_sweep.settings, run_dir=epd_sweep.settings.run_dir / "other-proxy"
    )
    spec = SweepSpec((TOPOLOGIES["1E+1P+1D"],), prompts=(TEXT,))
    return Sweep(spec, settings, pool=epd_sweep.pool, baseline=epd_sweep.baseline)


EPD_LATER_SWEEPS = make_other_proxy_sweep


@pytest.fixture(scope="session")
def other_proxy_sweep(pytestconfig, epd_sweep, epd_events):
    from harness.testing.before_stop import later_sweeps

    return later_sweeps(pytestconfig, __name__, epd_sweep, epd_events)


@pytest.mark.parametrize("topology", ["1P+1D", "1E+1P+1D"])
def test_sweep_case(epd_sweep, topology):
    assert all(r.policy_passed for r in epd_sweep.judge(topology, "text"))


@pytest.mark.epd_topology("1E+1P+1D")
@pytest.mark.epd_proxy("other")
def test_through_another_proxy(other_proxy_sweep):
    assert other_proxy_sweep.judge("1E+1P+1D", "text")
'''


def run_scenario_project(
    tmp_path: Path, scenario: str, *options: str
) -> subprocess.CompletedProcess:
    """`scenario` as a project of its own (this repository's conftest.py) in one pytest
    process on the fake vLLM, with these options."""
    fake = install_fake_vllm(tmp_path / "bin")
    project = tmp_path / "project"
    project.mkdir()
    (project / "conftest.py").write_text((ROOT / "conftest.py").read_text())
    (project / "pytest.ini").write_text("[pytest]\n")
    (project / "test_scenario.py").write_text(scenario)
    argv = [
        sys.executable, "-m", "pytest", "test_scenario.py", "-m", "e2e",
        "-p", "no:cacheprovider", "--epd-vllm", str(fake), *options,
        "--epd-model", str(tiny_model_dir()), "--epd-baseline-cache", str(tmp_path / "cache"),
        "--epd-run-dir", str(tmp_path / "run"),
    ]  # fmt: skip
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run(argv, cwd=project, capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.usefixtures("served_vllm_parser")  # its runs (subprocesses) find their lines judged
def test_a_reference_is_not_stopped_before_a_later_sweep_of_its_group_needs_it(
    tmp_path: Path, fake_vllm_start_log: Path
) -> None:
    """Found in review: the plugin stops 1P+1D at the end of its items, and only sweeps that
    exist by then answer their prompts on it (`before_stop`). scenarios/test_vllm_proxy.py makes
    its sweeps at its first item; on the GPU nightly (-n 4, one xdist group per topology) the
    worker of group "1P+1D" reaches that item only among the 1E+1P+1D items (the module's
    1E+1PD items are another group, on another worker), so 1P+1D starts a second time there
    ("restart: stopped earlier"). Also on CPU with `--epd-topology 1P+1D,1E+1P+1D`. Here the
    same order in one process: baseline, 1P+1D, 1E+1P+1D, 1E+1P+1D through another proxy."""
    run = run_scenario_project(tmp_path, LATE_SWEEP_SCENARIO, "--epd-kv-connector", "example")
    assert run.returncode == 0 and " 3 passed" in run.stdout, run.stdout[-3000:]
    assert "topology starts: 3 for 3 distinct" in run.stdout, run.stdout[-3000:]


@pytest.mark.usefixtures("served_vllm_parser")  # its runs (subprocesses) find their lines judged
def test_on_two_gpus_a_later_sweep_gets_the_reference_before_the_topology_stops_it(
    tmp_path: Path, fake_vllm_start_log: Path
) -> None:
    """The same session on two GPUs (the 2-GPU nightly; 4 GPUs alike), where 1P+1D and
    1E+1P+1D cannot serve side by side: 1E+1P+1D's first start stopped 1P+1D before the
    sweep through another proxy existed, so that sweep started 1P+1D again for its reference,
    and then 1E+1P+1D again (seen with the fake vLLM on the nightly's selection: vLLM's proxy
    module). A module's later sweeps (EPD_LATER_SWEEPS) are now made as 1P+1D stops."""
    run = run_scenario_project(
        tmp_path,
        LATE_SWEEP_SCENARIO,
        "--epd-platform",
        "cuda",
        "--epd-devices",
        "0,1",
        "--epd-colocate",
    )
    assert run.returncode == 0 and " 3 passed" in run.stdout, run.stdout[-3000:]
    assert "topology starts: 3 for 3 distinct" in run.stdout, run.stdout[-3000:]


@pytest.mark.xdist_group(CPU_HOST_NIGHT)
def test_a_session_in_a_reused_run_dir_counts_only_its_own_starts(
    tmp_path: Path, fake_vllm_start_log: Path, cpu_host_night: FakeNight
) -> None:
    """Found in review: the summary sums every `topology-starts.json` under the run root
    (`**/`), so a session given the `--epd-run-dir` of an earlier one (a rerun, `--lf`) counts
    the earlier session's starts too: here an earlier xdist run (the CPU host's night, copied)
    left gw*/topology-starts.json and this `-n 0` run printed "8 for 4" for its own 4 starts
    (and the earlier verdict tables)."""
    earlier = cpu_host_night.root / "run"
    assert list(earlier.glob("gw*/topology-starts.json")), "the earlier session left no count"
    shutil.copytree(earlier, tmp_path / "run")
    xdist_sweep(tmp_path, 0, "--epd-refresh-baseline")  # this one: 4 starts of its own


def test_the_streamed_harness_proxy_cases_go_through_the_harness_proxy_under_epd_proxy_vllm(
    tmp_path: Path,
) -> None:
    """Found in review: scenarios/test_stream.py's `harness-*` items take the session's proxy
    (`streamed_sweep(..., proxy=None)` keeps `epd_sweep.settings.proxy`). Under the documented
    `pytest scenarios --epd-proxy vllm` they run through vLLM's proxy and pass as the harness
    proxy's streaming (1E+1PD, 1E+1P+1D), or fail for the wrong reason on 1P+1D (the toy
    proxy's declared JSON stream, asserted clean): the harness proxy's streams go unchecked."""
    import scenarios.test_stream as stream_scenario

    fake = install_fake_vllm(tmp_path / "bin")
    vllm_proxy = ProxyChoice("vllm", tmp_path, "stand-in", (sys.executable,))
    settings = fake_run_settings(tmp_path, fake, proxy=vllm_proxy)
    session_sweep = Sweep(SweepSpec((TOPOLOGIES["1E+1PD"],), prompts=(TEXT,)), settings)
    harness_cases = stream_scenario.streamed_sweep(session_sweep, None)
    assert harness_cases.settings.proxy.kind == "harness", harness_cases.settings.proxy


def test_a_variant_with_added_environment_is_stopped_alone_and_answers_no_reference(
    tmp_path: Path, fake_vllm_start_log: Path
) -> None:
    """`release_variants` stops the sessions whose role runs with added environment (the
    KV-noise plugin in D under NIXL) and only those; and a stopped variant of 1P+1D does not
    answer a sweep's prompts as 1E+1P+1D's exact reference: its D is not the plain one."""
    settings = settings_for(tmp_path)
    pool = TopologyPool(settings)
    try:
        sweep = text_sweep(settings, pool)
        sweep.serve_baseline()
        variant = pool.session(TOPOLOGIES["1P+1D"], role_env={Role.DECODE: {"EPD_X": "1"}})
        plain = pool.session(TOPOLOGIES["1E+1PD"])
        assert variant is not plain
        pool.release_variants()
        running = [(k.topology, bool(k.role_env)) for k in pool.running()]
        assert ("1P+1D", True) not in running and ("1E+1PD", False) in running, running
        assert "1P+1D" not in sweep.observed, "the variant answered as the plain reference"
        records = sweep.judge("1E+1P+1D", "text")
        assert {r.reference for r in records} == {"baseline", "1P+1D"}
        plain_starts = [s for s in pool.starts if s.key.topology == "1P+1D" and not s.key.role_env]
        assert [s.reason for s in plain_starts] == ["first use"], pool.summary()
    finally:
        pool.close()


VARIANT_SCENARIO = '''
"""A class whose fixture starts 1P+1D with environment added to D (as the detection ladders'
KV-noise plugin under NIXL), and a class after it on the plain 1P+1D."""
import pytest

from harness.spec.topology import Role

pytestmark = pytest.mark.e2e
NOISE = {Role.DECODE: {"EPD_HARNESS_TEST_VARIANT": "1"}}


def variants(pool):
    return [key for key in pool.running() if key.role_env]


@pytest.mark.epd_topology("1P+1D")
class TestWithVariant:
    def test_first(self, epd_live):
        assert epd_live("1P+1D", role_env=NOISE).session.role_env

    def test_second_shares_it(self, epd_live, epd_pool):
        epd_live("1P+1D", role_env=NOISE)
        assert len(variants(epd_pool)) == 1


@pytest.mark.epd_topology("1P+1D")
class TestPlain:
    def test_the_variant_stopped_when_its_class_ended(self, epd_live, epd_pool):
        epd_live("1P+1D")
        assert variants(epd_pool) == [], epd_pool.summary()
'''


@pytest.mark.usefixtures("served_vllm_parser")  # its runs (subprocesses) find their lines judged
def test_a_variant_a_class_started_stops_where_the_class_ends(
    tmp_path: Path, fake_vllm_start_log: Path
) -> None:
    """Seen on the NIXL night line (2026-12-04): the detection classes' 1P+1D and 1E+1P+1D
    with the KV-noise plugin in D ran until their topology's group ended (1P+1D's, kept as
    1E+1P+1D's reference, until the end), three NIXL topologies spinning on 2 cores. The
    variant starts once for its class's items and is stopped where the class ends."""
    run = run_scenario_project(tmp_path, VARIANT_SCENARIO, "--epd-kv-connector", "example")
    assert run.returncode == 0 and " 3 passed" in run.stdout, run.stdout[-3000:]
    assert "1P+1D decode+env(EPD_HARNESS_TEST_VARIANT): first use" in run.stdout, run.stdout
    assert run.stdout.count("decode+env(EPD_HARNESS_TEST_VARIANT)") == 1, run.stdout[-3000:]


def test_a_wave_that_fails_leaves_the_cases_of_the_waves_before_it_judged(
    tmp_path: Path, fake_vllm_start_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cases are judged as their topology (and its reference) has answered, not only after
    the last wave: a run interrupted in a later wave (Ctrl-C on a GPU night, a start that
    raises) keeps the verdicts of what already ran in summary.json. Found in review: every
    case was judged after the last wave, so such a run kept answers and no verdict at all."""
    settings = settings_for(tmp_path)
    spec = SweepSpec((TOPOLOGIES["1E+1PD"], TOPOLOGIES["1P+1D"]), prompts=(TEXT,))
    sweep = Sweep(spec, settings)
    monkeypatch.setattr(sweep, "_cpu_budget", lambda: 2)  # a wave each
    waves = [[s.topology.name for s in w.slots] for w in sweep.schedule().waves]
    assert len(waves) == 3 and "1P+1D" in waves[-1], waves
    opened = sweep.pool.open

    def interrupted(requests):
        if any(r.topology.name == "1P+1D" for r in requests):
            raise KeyboardInterrupt
        return opened(requests)

    monkeypatch.setattr(sweep.pool, "open", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sweep.run_all()
    judged = {(r.topology, r.prompt, r.verdict.value) for r in sweep.result.records}
    assert judged == {("1E+1PD", "text", "MATCH")}, judged
    summary = json.loads((settings.run_dir / "summary.json").read_text())
    assert [(c["topology"], c["verdict"]) for c in summary["cases"]] == [("1E+1PD", "MATCH")]
    assert sweep.pool.running() == [], "nothing is left running when a wave fails"
