"""Chaos with real processes: whatever dies, and however, nothing is left behind or goes silent.

Every case checks the same three things: the run ends within seconds with an error that names
the instance (and shows its log tail); no process of it survives (checked through psutil
handles taken while it ran; zombies count as gone, since this machine's init does not reap
orphans); and no port it used is still held (by a lease's lock or by a live socket).

These run harness/testing/fake_vllm.py's `vllm serve` look-alike (misbehaving on cue, through
`FAKE_VLLM_MODE`); tests/test_chaos_vllm.py does the same to real vLLM (the e2e tier).

`EPD_CHAOS_TRIALS` sets the length of the mixed-trials loop (default 6, for CI; 30 on request).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from harness.environment import WATCHDOG_ENV
from harness.serve.client import ChatClient
from harness.serve.entry import Entry
from harness.serve.launch import ServerDied
from harness.serve.session import TopologySession
from harness.serve.watchdog import client as watchdog_client
from harness.spec.prompts import SKELETON_PROMPTS, render_request, streaming_request
from harness.spec.settings import RunSettings
from harness.spec.topology import TOPOLOGIES, ServingConfig
from harness.testing.cli import run_argv
from harness.testing.fake_vllm import MODE_ENV, fake_run_settings
from harness.testing.processes import (
    REPO_ROOT,
    alive_or_fail,
    child_env,
    describe,
    export_ports_left,
    files_under,
    held_ports,
    is_live,
    kill_all,
    nothing_left_behind,
    pythons_own_ctrl_c,
    read,
    session_ports,
    sigint_as_at_a_terminal,
    survivors,
    wait_for,
)

pytestmark = [pytest.mark.process, pytest.mark.wall_clock_bound]

# "Within seconds": how soon after the fault a run must have ended. What it guards against are
# hangs of 30-60 s (aiohttp's grace, a server ignoring SIGTERM); an ending that took 7.3 s on a
# host loaded to 19 on 2 cores failed a bound of 5 s, which told a hang from a busy host by
# too little (found hunting flakes).
END_WITHIN_S = 10.0
# Servers that ignore the parent-death SIGTERM: the watchdog's grace and SIGKILL, with margin.
WATCHDOG_END_WITHIN_S = 30.0
WATCHDOG_EXIT_S = 2.0  # how soon the watchdog must be gone once it has nothing left to do
# The startup-timeout trial's deadline: long enough for the fake's interpreter to have logged
# its first line, which the error must quote, on a loaded CI host (1 s was not, once, beside two
# other xdist workers). The trial's end is timed from the deadline, the fault it plants.
STARTUP_TIMEOUT_TRIAL_S = 5.0
CHAOS_TRIALS = int(os.environ.get("EPD_CHAOS_TRIALS", "6"))
TEXT_BODY = render_request(SKELETON_PROMPTS[0], "epd-model")
SECRET = "hf_planted_secret_3b7e91"
# The hung-request tests take ~6 s when teardown works; when it hangs (aiohttp's 60 s grace),
# they are cut here rather than holding the suite for a minute. Survivors are still killed.
# The cut only stops a hang: how soon a run ends after its fault is what the tests assert
# (END_WITHIN_S). It counts the test's body alone (func_only: not the session's parser probe,
# which imports vLLM, 55 s on a loaded host, nor a wait for another worker's probe of it), and
# that body starts the CLI and its servers first: 15 s cut test_sigterm_... while it waited
# for the request to reach pd0 (its start allows 60 s) in a CI-like run (-n 3, loaded host).
HUNG_TEST_TIMEOUT_S = 45

# A harness stand-in for the trial loop: a ServerGroup of two fake servers, chaos/a and
# chaos/b. argv: fake vllm, log dir, readiness timeout. Prints one JSON object per line.
DRIVER = r"""
import json, sys, time
from pathlib import Path
from harness.serve.launch import ManagedServer, ServerDied, StartupTimeout
from harness.serve.server_command import ServerCommand
from harness.serve.server_group import ServerGroup
from harness.serve.server_log import log_path_for
from harness.serve.signal_handlers import install_signal_handlers
from harness.serve.ports import reserve_ports
from harness.serve.watchdog import client as watchdog
fake, log_dir, timeout_s = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
say = lambda **fields: print(json.dumps(fields), flush=True)
install_signal_handlers()
servers = []
for name, lease in zip(("chaos/a", "chaos/b"), reserve_ports(2)):
    argv = [fake, "serve", "m", "--port", str(lease.port), "--served-model-name", name[-1]]
    command = ServerCommand(name=name, argv=argv, log_path=log_path_for(log_dir, name),
                            health_url=f"http://127.0.0.1:{lease.port}/health")
    servers.append(ManagedServer(command, port_lease=lease))
try:
    with ServerGroup(servers, on_event=lambda name, state, _: say(event=state, name=name)) as group:
        group.start_all()
        say(servers=[{"name": s.name, "pid": s.pid, "port": s.port_lease.port} for s in servers],
            watchdog=watchdog().pid)
        group.wait_all_ready(timeout_s)
        say(ready=True)
        while True:  # the harness between requests
            group.check_alive()
            time.sleep(0.05)
except (ServerDied, StartupTimeout) as exc:
    say(error=str(exc))
    sys.exit(3)
except KeyboardInterrupt as exc:
    say(interrupted=str(exc))
    sys.exit(130)
"""

# Several "pytest workers" at once: each reserves a 1E+1P+1D topology's HTTP ports and, for a
# NIXL run, its side-channel ports, prints them, and holds them until stdin closes.
PORT_WORKER = r"""
import json, sys
from harness.serve.ports import reserve_ports
from harness.spec.placement import side_channel_port_count
from harness.spec.platforms import NIXL_CONNECTOR
from harness.spec.topology import TOPOLOGIES, ServingConfig
topology = TOPOLOGIES["1E+1P+1D"]
serving = ServingConfig(model="m", kv_connector=NIXL_CONNECTOR)
sys.stdin.readline()  # all start together
http = reserve_ports(len(topology.roles))
side = reserve_ports(side_channel_port_count(topology, serving))
print(json.dumps({"http": [l.port for l in http], "side": [l.port for l in side]}), flush=True)
sys.stdin.read()
"""


# -- helpers ----------------------------------------------------------------------------------


def fake_processes(root_pid: int, fake: Path) -> list[psutil.Process]:
    """The fake servers under `root_pid`, and everything under them, as psutil handles."""
    found = []
    for proc in psutil.Process(root_pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if str(fake) in " ".join(proc.cmdline()):
                found += [proc, *proc.children(recursive=True)]
    return found


def fake_settings(
    tmp_path: Path, fake: Path, request_timeout_s: float = 30.0, extra_args: tuple[str, ...] = ()
) -> RunSettings:
    return fake_run_settings(
        tmp_path,
        fake,
        ServingConfig(model=str(tmp_path / "model"), extra_args=extra_args),
        request_timeout_s=request_timeout_s,
    )


def when_request_reaches(log: Path, action: Callable[[], None]) -> None:
    """Run `action` on a thread as soon as `log` shows a request arriving, so the fault lands
    mid-request."""

    def watch() -> None:
        wait_for(lambda: "REQUEST " in read(log), f"a request in {log}")
        action()

    threading.Thread(target=watch, daemon=True).start()


# -- the harness process interrupted ---------------------------------------------------------


def start_cli(tmp_path: Path, fake: Path, mode: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "harness.cli.main", *run_argv(fake, tmp_path / "run", *args)],
        cwd=REPO_ROOT,
        env=child_env(**{MODE_ENV: mode}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_as_at_a_terminal,
    )


def signal_cli(harness: subprocess.Popen[str], sig: signal.Signals) -> tuple[str, float]:
    """Send `sig`; return the harness's stderr and the seconds it took to exit."""
    harness.send_signal(sig)
    sent = time.monotonic()
    _, err = harness.communicate(timeout=90)
    return err, time.monotonic() - sent


@pytest.mark.usefixtures("served_vllm_parser")  # its runs (subprocesses) find their lines judged
def test_sigint_during_startup_stops_everything(
    tmp_path: Path, fake_vllm: Path, port_locks: Path
) -> None:
    # One core: a CPU wave holds two instances, so the baseline starts alone.
    began = time.time()
    harness = start_cli(
        tmp_path,
        fake_vllm,
        "*:slow-start=60",
        "--topology",
        "1E+1PD",
        "--prompt",
        "text",
        "--devices",
        "0",
    )
    run_dir = tmp_path / "run"
    log = run_dir / "baseline" / "baseline__baseline0.log"
    procs: list[psutil.Process] = []
    try:
        with nothing_left_behind(procs, [], port_locks):
            wait_for(
                lambda: alive_or_fail(harness) or "fake vllm pid" in read(log),
                "the baseline to be starting",
                60,
            )
            procs += fake_processes(harness.pid, fake_vllm)
            err, ended_s = signal_cli(harness, signal.SIGINT)
    finally:
        kill_all([psutil.Process(harness.pid)] if harness.poll() is None else [])
    argv = json.loads(log.with_suffix(".cmd.json").read_text())["argv"]
    port = int(argv[argv.index("--port") + 1])
    # Only what this run's processes hold (`nothing_left_behind` says why).
    held = held_ports([port], port_locks, born_after=began)
    assert not held, f"port {port} of baseline0 still held: {held}"
    assert len(procs) == 1, f"expected the baseline server, recorded {describe(procs)}"
    expected = (
        "epd-harness: interrupted while baseline/baseline0 was starting; every server was "
        f"stopped; artifacts in {run_dir}\n"
    )
    assert (harness.returncode, err) == (130, expected), f"exit {harness.returncode}\n{err}"
    assert ended_s < END_WITHIN_S, f"took {ended_s:.1f} s to end after SIGINT"
    expected_files = {
        "requests.json",
        "run.json",
        "baseline/baseline__baseline0.log",
        "baseline/baseline__baseline0.cmd.json",
    }
    assert expected_files <= files_under(run_dir), files_under(run_dir)


def test_a_ctrl_c_during_a_sessions_stop_still_stops_every_server(
    tmp_path: Path, fake_vllm: Path, port_locks: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C that lands while a stop waits out a server's grace (vLLM ignores SIGTERM while
    its engine starts): Python's own SIGINT handler, as under pytest, or the first one while
    a cleanup something else began runs. Found in review: the interrupt skipped every server
    not yet stopped, and the session gave their ports back while they ran."""
    monkeypatch.setenv(MODE_ENV, "decode:ignore-term")  # stopped first: the Ctrl-C lands there
    session = TopologySession(TOPOLOGIES["1P+1D"], fake_run_settings(tmp_path, fake_vllm))
    session.__enter__()
    servers = session.servers
    pids = [server.pid for server in servers]
    # Taken while they run: what the block must find gone (servers) and free (their ports).
    procs = [psutil.Process(pid) for pid in pids]
    ports = session_ports(session)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    try:
        with nothing_left_behind(procs, ports, port_locks), pythons_own_ctrl_c():
            timer.start()
            with pytest.raises(KeyboardInterrupt):
                session.close()
            running = [server.name for server in servers if server.is_alive()]
            assert running == [], f"still running after the interrupted close: {running}"
            assert survivors(pids) == []
    finally:
        timer.cancel()
        for server in servers:
            server.stop(grace_s=0.1)


@pytest.mark.usefixtures("served_vllm_parser")  # its runs (subprocesses) find their lines judged
@pytest.mark.timeout(HUNG_TEST_TIMEOUT_S, func_only=True)
def test_sigterm_while_a_request_hangs_ends_within_seconds(
    tmp_path: Path, fake_vllm: Path, port_locks: Path
) -> None:
    """pd0 never answers; CI cancels the job (SIGTERM) in the middle of the request."""
    harness = start_cli(
        tmp_path, fake_vllm, "pd:hang", "--topology", "1E+1PD", "--prompt", "text", "--devices", "0"
    )
    run_dir = tmp_path / "run"
    pd_log = run_dir / "1E-1PD" / "1E-1PD__pd0.log"
    procs: list[psutil.Process] = []
    try:
        with nothing_left_behind(procs, [], port_locks):
            wait_for(
                lambda: alive_or_fail(harness) or "REQUEST " in read(pd_log),
                "the request to reach pd0",
                60,
            )
            procs += fake_processes(harness.pid, fake_vllm)
            err, ended_s = signal_cli(harness, signal.SIGTERM)
    finally:
        kill_all([psutil.Process(harness.pid)] if harness.poll() is None else [])
    assert len(procs) == 2, f"expected encoder0 and pd0, recorded {describe(procs)}"
    expected = (
        "epd-harness: interrupted (received SIGTERM) while 1E+1PD/encoder0 was ready, "
        f"1E+1PD/pd0 was ready; every server was stopped; artifacts in {run_dir}\n"
    )
    assert (harness.returncode, err) == (130, expected), f"exit {harness.returncode}\n{err}"
    assert ended_s < END_WITHIN_S, f"took {ended_s:.1f} s to end after SIGTERM"


# -- an instance dies or hangs; the proxy goes away ------------------------------------------


def test_instance_sigkilled_mid_request_is_named_with_its_log_tail(
    tmp_path: Path, fake_vllm: Path, port_locks: Path, monkeypatch
) -> None:
    monkeypatch.setenv(MODE_ENV, "decode:slow=30")
    procs: list[psutil.Process] = []
    ports: list[int] = []
    killed_at: list[float] = []
    with nothing_left_behind(procs, ports, port_locks):
        with TopologySession(TOPOLOGIES["1P+1D"], fake_settings(tmp_path, fake_vllm)) as session:
            procs += fake_processes(os.getpid(), fake_vllm)
            ports += session_ports(session)
            decode = next(p for p in procs if "kv_consumer" in " ".join(p.cmdline()))

            def kill_decode() -> None:
                decode.kill()
                killed_at.append(time.monotonic())

            when_request_reaches(session.dir / "1P-1D__decode0.log", kill_decode)
            outcome = session.send("text", TEXT_BODY)
            reported_s = time.monotonic() - killed_at[0]
    print(f"death mid-request reported {reported_s:.2f} s after the SIGKILL")
    assert outcome.result is None and outcome.error, outcome
    assert "instance 1P+1D/decode0 exited with code -9" in outcome.error, outcome.error
    assert f"fake vllm pid {decode.pid} role decode" in outcome.error, outcome.error  # log tail
    assert reported_s < END_WITHIN_S, f"reported {reported_s:.1f} s after the kill"
    expected_files = {"1P-1D/1P-1D__decode0.log", "1P-1D/1P-1D__decode0.cmd.json"}
    assert expected_files <= files_under(tmp_path / "run")


@contextlib.contextmanager
def timing_out_1p1d(tmp_path: Path, fake_vllm: Path, port_locks: Path) -> Iterator[TopologySession]:
    """A fake 1P+1D whose client gives up after 1.5 s; on leaving, nothing of it may be left
    (processes, ports)."""
    procs: list[psutil.Process] = []
    ports: list[int] = []
    with nothing_left_behind(procs, ports, port_locks):
        settings = fake_settings(tmp_path, fake_vllm, request_timeout_s=1.5)
        with TopologySession(TOPOLOGIES["1P+1D"], settings) as session:
            procs += fake_processes(os.getpid(), fake_vllm)
            ports += session_ports(session)
            yield session


@pytest.mark.timeout(HUNG_TEST_TIMEOUT_S, func_only=True)
def test_request_timeout_names_the_hung_instance_and_ends_within_seconds(
    tmp_path: Path, fake_vllm: Path, port_locks: Path, monkeypatch
) -> None:
    """decode0 accepts the request and never answers; the client gives up after 1.5 s."""
    monkeypatch.setenv(MODE_ENV, "decode:hang")
    with timing_out_1p1d(tmp_path, fake_vllm, port_locks) as session:
        outcome = session.send("text", TEXT_BODY)
        closing = time.monotonic()
    closed_s = time.monotonic() - closing
    assert outcome.error and "timed out" in outcome.error.lower(), outcome.error
    assert "waiting on 1P+1D/decode0" in outcome.error, outcome.error
    assert "fake vllm pid" in outcome.error, outcome.error  # its log tail
    assert 1.5 <= outcome.seconds < 1.5 + END_WITHIN_S, f"{outcome.seconds:.1f} s"
    assert closed_s < END_WITHIN_S, f"closing the session took {closed_s:.1f} s"


@pytest.mark.timeout(HUNG_TEST_TIMEOUT_S, func_only=True)
def test_request_timeout_mid_stream_names_the_instance_still_streaming(
    tmp_path: Path, fake_vllm: Path, port_locks: Path, monkeypatch
) -> None:
    """decode0 starts its stream and then stalls (a decode step of 60 s); the client gives up
    after 1.5 s. D had answered its headers, and that was read as D being done with it: the
    error said no instance was still working on the request."""
    monkeypatch.setenv(MODE_ENV, "decode:decode-step=60")
    with timing_out_1p1d(tmp_path, fake_vllm, port_locks) as session:
        outcome = session.send("text", streaming_request(TEXT_BODY))
        # The same through a proxy whose trace the harness cannot read (vLLM's): the taps.
        url = session.entry_url
        theirs = Entry("other", url, ChatClient(url, timeout_s=1.5))
        try:
            through_taps = session.send("text", streaming_request(TEXT_BODY), theirs)
        finally:
            theirs.close()
    for failed in (outcome, through_taps):
        assert failed.error and "timed out" in failed.error.lower(), failed.error
        assert "waiting on 1P+1D/decode0" in failed.error, failed.error
        assert "fake vllm pid" in failed.error, failed.error  # its log tail


def test_proxy_stopped_mid_run_fails_the_request_and_leaves_nothing(
    tmp_path: Path, fake_vllm: Path, port_locks: Path
) -> None:
    procs: list[psutil.Process] = []
    ports: list[int] = []
    with nothing_left_behind(procs, ports, port_locks):
        with TopologySession(TOPOLOGIES["1E+1PD"], fake_settings(tmp_path, fake_vllm)) as session:
            procs += fake_processes(os.getpid(), fake_vllm)
            ports += session_ports(session)
            assert session.send("text", TEXT_BODY).result is not None
            session._entry.proxy_server.stop()
            outcome = session.send("text", TEXT_BODY)
    assert outcome.result is None and "Connection" in outcome.error, outcome.error
    assert outcome.seconds < END_WITHIN_S, f"{outcome.seconds:.1f} s"


def test_proxy_stopped_mid_run_is_reported_as_such(
    tmp_path: Path, fake_vllm: Path, port_locks: Path
) -> None:
    procs: list[psutil.Process] = []
    with nothing_left_behind(procs, [], port_locks):
        with TopologySession(TOPOLOGIES["1E+1PD"], fake_settings(tmp_path, fake_vllm)) as session:
            procs += fake_processes(os.getpid(), fake_vllm)
            session._entry.proxy_server.stop()
            outcome = session.send("text", TEXT_BODY)
    assert f"proxy {session.entry_url} is not running" in outcome.error, outcome.error


def test_proxy_event_loop_dying_mid_run_frees_its_port(
    tmp_path: Path, fake_vllm: Path, port_locks: Path
) -> None:
    """The proxy's loop stops without cleanup (a crash): its socket still queues connections
    nobody serves, so the request times out; closing the session must still free the port."""
    procs: list[psutil.Process] = []
    ports: list[int] = []
    with nothing_left_behind(procs, ports, port_locks):
        settings = fake_settings(tmp_path, fake_vllm, request_timeout_s=1.0)
        with TopologySession(TOPOLOGIES["1E+1PD"], settings) as session:
            procs += fake_processes(os.getpid(), fake_vllm)
            ports += session_ports(session)
            proxy = session._entry.proxy_server
            proxy._loop.call_soon_threadsafe(proxy._loop.stop)
            proxy._thread.join(timeout=5)
            outcome = session.send("text", TEXT_BODY)
    assert outcome.result is None and "timed out" in outcome.error.lower(), outcome.error


def test_instance_with_a_bad_flag_fails_the_start_at_once(
    tmp_path: Path, fake_vllm: Path, port_locks: Path
) -> None:
    settings = fake_settings(tmp_path, fake_vllm, extra_args=("--no-such-flag",))
    session = TopologySession(TOPOLOGIES["1E+1PD"], settings)
    procs: list[int] = []
    ports: list[int] = []
    start = time.monotonic()
    with nothing_left_behind(procs, ports, port_locks):
        with pytest.raises(ServerDied) as died:
            with session:
                pass
        # Known once the start failed (the servers die before a handle could be taken): what
        # it started, to be gone, and the ports it leased, to be free.
        procs += [server.pid for server in session.servers]
        ports += session_ports(session)
    elapsed_s = time.monotonic() - start
    message = str(died.value)
    assert message.startswith(("1E+1PD/encoder0 (pid ", "1E+1PD/pd0 (pid ")), message
    assert "died during startup: exit code 2" in message, message
    assert "vllm: error: unrecognized arguments: --no-such-flag" in message, message
    assert elapsed_s < END_WITHIN_S, f"{elapsed_s:.1f} s to report a server that died at once"
    names = files_under(tmp_path / "run")
    assert {"1E-1PD/1E-1PD__encoder0.log", "1E-1PD/1E-1PD__pd0.log"} <= names, names


# -- the harness SIGKILLed, and many trials of everything ------------------------------------


@dataclass
class Trial:
    """One run of the DRIVER with one fault, and what it left behind."""

    kind: str
    code: int | None = None
    # From the fault (from the spawn, for a server's own fault) to the driver's exit, or to its
    # servers' exit when the driver was SIGKILLed.
    ended_s: float = 0.0
    output: list[dict] = field(default_factory=list)
    procs: list[psutil.Process] = field(default_factory=list)  # servers and forked children
    ports: list[int] = field(default_factory=list)
    watchdog: psutil.Process | None = None  # the driver's, if it started one
    started_at: float = 0.0  # epoch seconds: a process born earlier cannot be the trial's
    ended_at: float = 0.0  # epoch seconds: a process born later cannot be the trial's


@dataclass(frozen=True)
class TrialKind:
    mode: str  # FAKE_VLLM_MODE
    exit_code: int  # the driver's, as the fault should end it
    waits_for_ready: bool  # the fault lands on serving servers, not starting ones
    error_has: str = ""  # what the driver's error must say about chaos/b, if it reports one
    end_within_s: float = END_WITHIN_S


# Servers that ignore SIGTERM and fork a child into their group, as vLLM does while its engine
# starts: after a harness SIGKILL only the watchdog (its grace, then SIGKILL) can end them.
STUBBORN = "*:ignore-term;*:fork-child"
TRIAL_KINDS = {
    "server-dies-at-start": TrialKind("b:die-start", 3, False, "chaos-7c1d"),
    "server-sigkilled-while-serving": TrialKind("", 3, True, "killed by SIGKILL"),
    "startup-timeout": TrialKind("b:slow-start=60", 3, False, "not ready after"),
    "harness-sigint-at-startup": TrialKind("*:slow-start=60", 130, False),
    "harness-sigterm-while-serving": TrialKind("", 130, True),
    "harness-sigkilled": TrialKind("", -signal.SIGKILL, True),
    "harness-sigkilled-stubborn-at-start": TrialKind(
        f"{STUBBORN};*:slow-start=60", -signal.SIGKILL, False, end_within_s=WATCHDOG_END_WITHIN_S
    ),
    "harness-sigkilled-stubborn-serving": TrialKind(
        STUBBORN, -signal.SIGKILL, True, end_within_s=WATCHDOG_END_WITHIN_S
    ),
}


def run_trial(kind: str, tmp_path: Path, fake: Path, gone_within_s: float | None = None) -> Trial:
    """Start the driver, inflict `kind`, wait for the driver to exit; record what it ran.

    After a harness SIGKILL, waits up to `gone_within_s` (default: the kind's bound) for its
    processes to go."""
    spec = TRIAL_KINDS[kind]
    trial = Trial(kind, started_at=time.time())
    ready_timeout_s = str(STARTUP_TIMEOUT_TRIAL_S) if kind == "startup-timeout" else "20"
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(fake), str(tmp_path / "logs"), ready_timeout_s],
        env=child_env(**{MODE_ENV: spec.mode}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=sigint_as_at_a_terminal,
    )
    logs = [tmp_path / "logs" / f"chaos__{name}.log" for name in "ab"]

    def read_until(key: str) -> None:
        while True:
            line = driver.stdout.readline()
            assert line, f"{kind}: the driver ended early: {trial.output}"
            trial.output.append(json.loads(line) if line.startswith("{") else {"text": line})
            if key in trial.output[-1]:
                return

    try:
        read_until("servers")
        trial.ports = [server["port"] for server in trial.output[-1]["servers"]]
        trial.procs = [psutil.Process(server["pid"]) for server in trial.output[-1]["servers"]]
        if trial.output[-1].get("watchdog"):
            trial.watchdog = psutil.Process(trial.output[-1]["watchdog"])
        if "fork-child" in spec.mode:  # also proves SIGTERM is ignored by now: that comes first
            children = wait_for(
                lambda: len(found := forked_children(logs)) == 2 and found, "both children"
            )
            trial.procs += [psutil.Process(pid) for pid in children]
        if spec.waits_for_ready:
            read_until("ready")
        started = time.monotonic()
        if kind == "startup-timeout":
            started += STARTUP_TIMEOUT_TRIAL_S  # the fault is the deadline passing
        elif kind == "server-sigkilled-while-serving":
            trial.procs[1].kill()
        elif kind == "harness-sigint-at-startup":
            wait_for(lambda: all("fake vllm pid" in read(log) for log in logs), "both to start")
            started = time.monotonic()
            driver.send_signal(signal.SIGINT)
        elif kind.startswith("harness-sig"):
            driver.send_signal(signal.SIGTERM if "sigterm" in kind else signal.SIGKILL)
        rest, _ = driver.communicate(timeout=30)
        if kind.startswith("harness-sigkilled"):  # the end is the servers' end
            survivors(trial.procs, spec.end_within_s if gone_within_s is None else gone_within_s)
        trial.ended_s = time.monotonic() - started
        trial.ended_at = time.time()
        trial.output += [json.loads(line) for line in rest.splitlines() if line.startswith("{")]
        trial.code = driver.returncode
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        driver.stdout.close()
    return trial


def forked_children(logs: list[Path]) -> list[int]:
    return [
        int(line.split()[1])
        for log in logs
        for line in read(log).splitlines()
        if line.startswith("CHILD ")
    ]


def check_trial(trial: Trial, port_locks: Path) -> list[str]:
    """Everything wrong with one trial, one line each (empty: the trial was clean)."""
    spec = TRIAL_KINDS[trial.kind]
    problems = []
    if trial.code != spec.exit_code:
        problems.append(f"exit code {trial.code}, expected {spec.exit_code}")
    if trial.ended_s > spec.end_within_s:
        problems.append(f"ended {trial.ended_s:.1f} s after the fault")
    errors = [entry["error"] for entry in trial.output if "error" in entry]
    if spec.error_has:
        if not errors or "chaos/b" not in errors[0] or spec.error_has not in errors[0]:
            problems.append(f"error does not name chaos/b with {spec.error_has!r}: {errors}")
        elif "fake vllm pid" not in errors[0]:
            problems.append(f"error lacks the log tail: {errors[0]}")
    alive = survivors(trial.procs)
    if alive:
        kill_all(alive)
        problems.append(f"left behind: {describe(alive)}")
    # A trial seen leaving port 20486 LISTENing under a pid none of its processes had, in a
    # fresh-clone CI run: the other worker may lease a port a trial gave back.
    held = held_ports(
        trial.ports, port_locks, born_before=trial.ended_at, born_after=trial.started_at
    )
    if held:
        problems.append(f"ports still held: {held}")
    # The driver's exit (or, after its SIGKILL, its servers' end) ends the watchdog at once.
    if trial.watchdog is not None and survivors([trial.watchdog], WATCHDOG_EXIT_S):
        kill_all([trial.watchdog])
        problems.append(f"watchdog left behind: {describe([trial.watchdog])}")
    return problems


def test_sigkilled_harness_takes_its_servers_down(
    tmp_path: Path, fake_vllm: Path, port_locks: Path
) -> None:
    """The parent-death signal: nothing of a SIGKILLed harness's ServerGroup survives it."""
    trial = run_trial("harness-sigkilled", tmp_path, fake_vllm)
    assert len(trial.procs) == 2, trial.output
    assert check_trial(trial, port_locks) == [], trial.output


@pytest.mark.parametrize(
    "kind", ["harness-sigkilled-stubborn-at-start", "harness-sigkilled-stubborn-serving"]
)
def test_watchdog_stops_servers_that_ignore_the_harness_death(
    kind: str, tmp_path: Path, fake_vllm: Path, port_locks: Path
) -> None:
    """The servers ignore SIGTERM, each with a child in its group: the parent-death signal
    does nothing, so only the watchdog can end them once the harness is SIGKILLed."""
    trial = run_trial(kind, tmp_path, fake_vllm)
    print(f"\n{kind}: all 4 processes gone {trial.ended_s:.1f} s after the harness's SIGKILL")
    assert len(trial.procs) == 4 and trial.watchdog is not None, trial.output
    assert check_trial(trial, port_locks) == [], trial.output
    log = read(tmp_path / "logs" / "watchdog.log")
    assert "harness gone; SIGTERM to 2 process(es)" in log, log
    assert "SIGKILL to" in log and "gone" in log, log


def test_without_the_watchdog_stubborn_servers_outlive_a_sigkilled_harness(
    tmp_path: Path, fake_vllm: Path, port_locks: Path, monkeypatch
) -> None:
    """What the watchdog is for, and proof that the test above can fail: with it switched off,
    SIGTERM-ignoring servers and their children survive the harness."""
    monkeypatch.setenv(WATCHDOG_ENV, "off")
    trial = run_trial("harness-sigkilled-stubborn-serving", tmp_path, fake_vllm, gone_within_s=3)
    try:
        assert trial.watchdog is None, trial.output
        alive = survivors(trial.procs, timeout_s=0)
        assert len(alive) == 4, f"expected all 4 alive: {describe(alive)}"
    finally:
        kill_all(trial.procs)


def test_chaos_trials_leave_nothing_behind(
    tmp_path: Path, fake_vllm: Path, port_locks: Path
) -> None:
    """Mixed faults, one after another: every trial must end fast and leave nothing."""
    kinds = list(TRIAL_KINDS)
    results = []
    for number in range(CHAOS_TRIALS):
        trial = run_trial(kinds[number % len(kinds)], tmp_path / f"trial-{number}", fake_vllm)
        results.append((trial, check_trial(trial, port_locks)))
    count = collections.Counter(
        problem.split(":")[0] for _, problems in results for problem in problems
    )
    slowest: dict[str, float] = {}
    for trial, _ in results:
        slowest[trial.kind] = max(slowest.get(trial.kind, 0.0), trial.ended_s)
    print(
        f"\nchaos: {len(results)} trials; trials leaving processes: {count['left behind']}, "
        f"leaving ports held: {count['ports still held']}; slowest end per kind: "
        + ", ".join(f"{kind} {s:.2f} s" for kind, s in slowest.items())
    )
    failed = [f"trial {n} {t.kind}: {'; '.join(p)}" for n, (t, p) in enumerate(results) if p]
    assert not failed, "\n".join(failed)


def test_parallel_workers_never_share_http_or_side_channel_ports(
    tmp_path: Path, port_locks: Path
) -> None:
    environment = child_env()
    started_at = time.time()
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", PORT_WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=environment,
        )
        for _ in range(4)
    ]
    try:
        for worker in workers:
            worker.stdin.write("go\n")
            worker.stdin.flush()
        reports = [json.loads(worker.stdout.readline() or "{}") for worker in workers]
    finally:
        for worker in workers:
            worker.stdin.close()
            worker.wait(timeout=10)
            worker.stdout.close()
    sizes = [len(report.get("http", [])) + len(report.get("side", [])) for report in reports]
    ports = [port for report in reports for port in report.get("http", []) + report.get("side", [])]
    assert sizes == [5] * 4, f"3 HTTP + 2 side-channel ports each: {reports}"
    assert len(set(ports)) == len(ports), f"a port was handed out twice: {reports}"
    # Only what these workers (born after `started_at`) left: a fresh-clone CI run saw a port
    # they gave back LISTENed by an older process, the other xdist worker's, which leases from
    # another lock directory.
    held = held_ports(ports, port_locks, born_after=started_at)
    assert not held, f"an exited worker's leases must be gone: {held}"


def test_a_port_taken_by_a_process_born_outside_the_trial_is_not_a_leftover(
    tmp_path: Path,
) -> None:
    """Under xdist another test may bind a port a trial gave back, from a process born after
    the trial or long before it: that is not the trial's."""
    with listening_process() as (pid, port, born):
        held = [f"{port} (LISTEN pid {pid})"]
        assert held_ports([port], tmp_path, born_before=born + 1.0) == held
        assert held_ports([port], tmp_path, born_before=born - 1.0) == []
        assert held_ports([port], tmp_path, born_after=born - 1.0) == held
        assert held_ports([port], tmp_path, born_after=born + 2.5) == []
        # Dated up to a second early by psutil: a process born just after the run began counts.
        assert held_ports([port], tmp_path, born_after=born + 0.5) == held
        assert held_ports([port], tmp_path, born_after=born + 2.5, always=[pid]) == held


def test_an_exports_port_counts_as_left_only_when_a_process_of_its_run_holds_it(
    tmp_path: Path,
) -> None:
    """An export's run begins with its first server's pid file: a listener born since is the
    run's leftover; one born seconds before is another test's, on a port the export gave back
    (a fresh-clone CI run failed on such a port with `Address already in use`)."""
    pid_file = tmp_path / "work/state/pd0.pid"
    pid_file.parent.mkdir(parents=True)
    pid_file.write_text("1\n")
    with listening_process() as (pid, port, born):
        os.utime(pid_file, (born - 1.0, born - 1.0))
        assert export_ports_left(tmp_path, [port]) == [f"{port} (LISTEN pid {pid})"]
        os.utime(pid_file, (born + 5.0, born + 5.0))
        assert export_ports_left(tmp_path, [port]) == []


def test_nothing_left_behind_fails_on_a_process_left_and_kills_it(tmp_path: Path) -> None:
    """The check every chaos trial ends with can go red: a process still running fails it,
    and is killed before the failure propagates, so it leaks into no later test."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(AssertionError, match=f"processes left behind: pid {sleeper.pid} "):
            with nothing_left_behind([sleeper.pid], [], tmp_path):
                pass
        assert sleeper.wait(timeout=10) == -signal.SIGKILL
    finally:
        sleeper.kill()
        sleeper.wait()


def test_nothing_left_behind_fails_on_a_port_the_tests_own_process_holds(
    tmp_path: Path,
) -> None:
    """A harness run in-process leaks its sockets into the test's own process, born long
    before the block: a port it still listens on fails the check all the same."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        held = re.escape(str([f"{port} (LISTEN pid {os.getpid()})"]))
        with pytest.raises(AssertionError, match=f"ports left held: {held}"):
            with nothing_left_behind([], [port], tmp_path):
                pass


def test_a_lease_still_locked_is_a_port_held(tmp_path: Path) -> None:
    """A port no socket holds is still the run's while a process keeps its lease locked."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with open(tmp_path / f"port-{port}.lock", "w") as lease:
        fcntl.flock(lease, fcntl.LOCK_EX)
        assert held_ports([port], tmp_path) == [f"{port} (lease still locked)"]
    assert held_ports([port], tmp_path) == []


def test_what_has_ended_is_gone_an_unreaped_process_and_a_time_wait_too(tmp_path: Path) -> None:
    """A process that ends while the check waits is no survivor, nor one ended but not yet
    reaped (this machine's init reaps no orphans); a connection of a closed port left in
    TIME_WAIT is the kernel's, no process holds the port."""
    ending = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        assert survivors([ending.pid]) == []
        wait_for(lambda: psutil.Process(ended.pid).status() == psutil.STATUS_ZOMBIE, "a zombie")
        assert not is_live(ended.pid) and survivors([ended.pid], timeout_s=0) == []
    finally:
        for child in (ending, ended):
            child.kill()
            child.wait()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        served, _ = listener.accept()
        served.close()  # the server's end closes first, so it is the one left in TIME_WAIT
        client.close()

    def time_wait() -> bool:
        return any(
            c.laddr and c.laddr.port == port and c.status == psutil.CONN_TIME_WAIT
            for c in psutil.net_connections(kind="tcp")
        )

    wait_for(time_wait, f"port {port} in TIME_WAIT")
    assert held_ports([port], tmp_path, always=[os.getpid()]) == []


@contextlib.contextmanager
def listening_process() -> Iterator[tuple[int, int, float]]:
    """A process listening on a free port: (its pid, the port, when it was born)."""
    listener = subprocess.Popen(
        [sys.executable, "-c", LISTENER],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(listener.stdout.readline())
        yield listener.pid, port, psutil.Process(listener.pid).create_time()
    finally:
        listener.kill()
        listener.wait(timeout=10)
        listener.stdout.close()


LISTENER = (
    "import socket, time\n"
    "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
    "print(s.getsockname()[1], flush=True); time.sleep(60)"
)


# -- the whole CLI in-process, with fake servers ---------------------------------------------


def test_disk_full_mid_run_keeps_what_was_written(
    tmp_path: Path, fake_vllm: Path, port_locks: Path, epd_cli, monkeypatch
) -> None:
    """The disk fills after the baseline: summary.json cannot be written (a write() that fails
    carries no file name, as on a real full disk). The harness process's watchdog lives as long
    as it does, by design: found failing when this test ran alone, the first to start one in
    its process (under xdist an earlier test had, so it was among those already running)."""
    import harness.report.run_outputs

    def full_disk(*_args: object, **_kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(harness.report.run_outputs, "write_summary_json", full_disk)
    before = set(psutil.Process().children(recursive=True))
    code, out, err = epd_cli(
        *run_argv(fake_vllm, tmp_path / "run", "--topology", "1P+1D", "--prompt", "text")
    )
    run_dir = tmp_path / "run"
    expected = (
        f"epd-harness: error: no space left on device while writing under {run_dir}; "
        "artifacts written so far are kept\n"
    )
    assert (code, err) == (2, expected), f"exit {code}\n{out}\n{err}"
    expected_files = {
        "requests.json",
        "run.json",
        "responses.json",
        "baseline/baseline__baseline0.log",
    }
    assert expected_files <= files_under(run_dir), files_under(run_dir)
    own_watchdog = watchdog_client().pid
    started = [p for p in psutil.Process().children(recursive=True) if p not in before]
    left = survivors([p for p in started if p.pid != own_watchdog])
    assert not left, f"left behind: {describe(left)}"


def test_planted_token_reaches_no_artifact(
    tmp_path: Path, fake_vllm: Path, port_locks: Path, epd_cli, monkeypatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.setenv("EPD_TEST_API_KEY", f"{SECRET}-key")
    code, out, err = epd_cli(
        *run_argv(fake_vllm, tmp_path / "run", "--topology", "1E+1PD", "--prompt", "text")
    )
    assert code == 0, f"exit {code}\n{out}\n{err}"
    names = files_under(tmp_path / "run")
    assert len(names) > 8, f"too few artifacts to prove anything: {names}"
    leaks = sorted(name for name in names if SECRET in read(tmp_path / "run" / name))
    assert not leaks, f"{SECRET} found in {leaks}"
    assert SECRET not in out + err


def test_cases_file_runs_only_its_cases(
    tmp_path: Path, fake_vllm: Path, port_locks: Path, epd_cli
) -> None:
    scenarios = tmp_path / "cases.json"
    scenarios.write_text('[{"topology": "1E+1PD", "prompt": "text"}]')
    code, out, err = epd_cli(*run_argv(fake_vllm, tmp_path / "run", "--cases-file", str(scenarios)))
    assert code == 0, f"exit {code}\n{out}\n{err}"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    cases = [(case["topology"], case["prompt"], case["reference"]) for case in summary["cases"]]
    assert cases == [("1E+1PD", "text", "baseline")], cases
