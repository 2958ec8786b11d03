"""Server lifecycle against real subprocesses: small Python HTTP servers misbehaving on cue."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from harness.serve.launch import (
    HEALTH_REQUEST_TIMEOUT_S,
    STARTUP_STOP_GRACE_S,
    TREE_SAMPLE_INTERVAL_S,
    ManagedServer,
    ServerDied,
    StartupTimeout,
)
from harness.serve.ports import reserve_ports
from harness.serve.process_groups import in_child
from harness.serve.server_command import ServerCommand
from harness.serve.server_group import ServerGroup
from harness.serve.server_log import (
    LOG_TAIL_LINES,
    keep_earlier_log,
    log_path_for,
    log_size,
    read_log_from,
    read_log_tail,
)
from harness.testing.processes import (
    child_env,
    is_live,
    live_members_of_group,
    seconds_until_gone,
    survivors,
)

pytestmark = [pytest.mark.process, pytest.mark.wall_clock_bound]

CRASH_LINE = "FATAL: distinctive-fake-crash-7f3a"
# The line as the fake prints it, on a line of its own: the log's header quotes the fake's code,
# so the text alone is found in any tail that reaches back to the header.
PRINTED_CRASH_LINE = re.compile(rf"(?m)^{re.escape(CRASH_LINE)}$")
GONE_TIMEOUT_S = 5.0

# argv: port, delay_s, modes (comma-separated). Serves GET /health -> 200 on 127.0.0.1:port
# after delay_s, unless a mode says otherwise:
#   die          print CRASH_LINE and the death time, exit 3 after delay_s
#   never-ready  stay alive, never listen
#   ignore-term  ignore SIGTERM (only SIGKILL ends it)
#   children     first spawn two sleepers: one in the group, one in a session of its own
#   stubborn-orphan  first spawn a sleeper in a session of its own that ignores SIGTERM
#   graceful-orphan  first spawn a sleeper in a session of its own that logs its SIGTERM, exits
FAKE_SERVER = r"""
import http.server, os, signal, subprocess, sys, time
port, delay_s, modes = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3].split(",")
env = os.environ.get("EPD_FAKE_SERVER")
print(f"fake server pid {os.getpid()} modes {modes} EPD_FAKE_SERVER={env}", flush=True)
if "ignore-term" in modes:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if "children" in modes:
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    print(f"CHILD {subprocess.Popen(sleeper).pid}", flush=True)
    print(f"CHILD {subprocess.Popen(sleeper, start_new_session=True).pid}", flush=True)
if "stubborn-orphan" in modes:
    stubborn = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "print(f'STUBBORN {os.getpid()}', flush=True); time.sleep(120)")
    subprocess.Popen([sys.executable, "-c", stubborn], start_new_session=True)
if "graceful-orphan" in modes:
    graceful = ("import os, signal, sys, time\n"
                "def wind_down(signum, frame):\n"
                "    print(f'TERMINATED {os.getpid()}', flush=True); sys.exit(0)\n"
                "signal.signal(signal.SIGTERM, wind_down)\n"
                "print(f'GRACEFUL {os.getpid()}', flush=True); time.sleep(120)")
    subprocess.Popen([sys.executable, "-c", graceful], start_new_session=True)
if "engine-core" in modes:  # a child named as vLLM names its engine core, busy for 0.5 s of CPU
    busy = ("import ctypes, time; ctypes.CDLL(None).prctl(15, b'VLLM::EngineCore', 0, 0, 0)\n"
            "while time.process_time() < 0.5: pass\n"
            "print('BURNT', flush=True); time.sleep(120)")
    subprocess.Popen([sys.executable, "-c", busy])
time.sleep(delay_s)
if "die" in modes:
    print("FATAL: distinctive-fake-crash-7f3a", flush=True)
    print(f"DIED AT {time.time()}", flush=True)
    sys.exit(3)
if "never-ready" in modes:
    time.sleep(3600)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""

# A harness stand-in, run as its own process. argv: log_dir, lock_dir, mode, then either
# "server" (start one ManagedServer, print its pid, wait to be SIGKILLed) or "group" (install
# the signal handlers, run a ServerGroup, print the pids and events, wait to be SIGTERMed).
HARNESS = r"""
import sys, time
from pathlib import Path
from harness.serve.launch import ManagedServer
from harness.serve.server_command import ServerCommand
from harness.serve.server_group import ServerGroup
from harness.serve.server_log import log_path_for
from harness.serve.signal_handlers import install_signal_handlers
from harness.serve.ports import reserve_ports
from harness.serve.process_groups import in_child
from harness.testing.processes import (
    child_env,
    is_live,
    live_members_of_group,
    seconds_until_gone,
    survivors,
)
log_dir, lock_dir, mode, shape = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
(lease,) = reserve_ports(1, lock_dir=lock_dir)
command = ServerCommand(
    name="harness-child/server0",
    argv=[sys.executable, "-c", sys.argv[5], str(lease.port), "0.2", mode],
    health_url=f"http://127.0.0.1:{lease.port}/health",
    log_path=log_path_for(log_dir, "harness-child/server0"),
)
server = ManagedServer(command, port_lease=lease)
if shape == "server":
    server.start()
    print(f"SERVER {server.pid}", flush=True)
    time.sleep(60)
install_signal_handlers()
on_event = lambda name, state, elapsed_s: print(f"EVENT {name} {state}", flush=True)
with ServerGroup([server], on_event=on_event) as group:
    group.start_all()
    group.wait_all_ready(timeout_s=20)
    print(f"SERVER {server.pid}", flush=True)
    time.sleep(60)
"""


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[Callable[..., ManagedServer]]:
    """Build fake servers on leased ports; every one is stopped at teardown, whatever happened."""
    servers: list[ManagedServer] = []

    def make(
        name: str, mode: str = "serve", delay_s: float = 0.2, cpu_affinity: tuple[int, ...] = ()
    ) -> ManagedServer:
        (lease,) = reserve_ports(1, lock_dir=tmp_path / "port-locks")
        command = ServerCommand(
            name=name,
            argv=[sys.executable, "-c", FAKE_SERVER, str(lease.port), str(delay_s), mode],
            health_url=f"http://127.0.0.1:{lease.port}/health",
            log_path=log_path_for(tmp_path / "logs", name),
            env={"EPD_FAKE_SERVER": "1"},
            cpu_affinity=cpu_affinity,
        )
        server = ManagedServer(command, port_lease=lease)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop(grace_s=1.0)


def wait_for_log(server: ManagedServer, pattern: str, count: int = 1) -> list[str]:
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while True:
        found = re.findall(pattern, server.command.log_path.read_text())
        if len(found) >= count or time.monotonic() > deadline:
            assert len(found) >= count, f"{pattern!r} not in log:\n{server.log_tail()}"
            return found
        time.sleep(0.05)


def is_gone(pid: int) -> bool:
    return not is_live(pid)


def wait_until_gone(pids: list[int], timeout_s: float = GONE_TIMEOUT_S) -> float:
    """Seconds until every pid is gone; fails the test with the survivors after timeout_s."""
    took = seconds_until_gone(pids, timeout_s)
    assert took is not None, survivors(pids, 0)
    return took


def test_death_at_start_is_reported_within_3s_with_the_log_tail(make_server) -> None:
    server = make_server("1E+1P+1D/encoder0", mode="die", delay_s=0)
    server.start()
    start = time.monotonic()
    with pytest.raises(ServerDied) as died:
        server.wait_until_ready(timeout_s=30)
    elapsed_s = time.monotonic() - start
    assert elapsed_s <= 3.0
    message = str(died.value)
    assert "1E+1P+1D/encoder0" in message
    assert "during startup: exit code 3" in message
    assert PRINTED_CRASH_LINE.search(message), message
    assert str(server.command.log_path) in message
    assert died.value.exit_code == 3 and server.exit_code == 3


def test_death_while_polling_is_noticed_within_a_second(make_server) -> None:
    server = make_server("late-crash", mode="die", delay_s=1.2)
    server.start()
    with pytest.raises(ServerDied, match="late-crash"):
        server.wait_until_ready(timeout_s=30)
    noticed_at = time.time()
    (died_at,) = wait_for_log(server, r"DIED AT ([0-9.]+)")
    delay_s = noticed_at - float(died_at)
    print(f"death-detection delay: {delay_s:.3f} s")
    assert delay_s < 1.0


def test_orphans_of_a_dead_server_are_stopped_too(make_server) -> None:
    server = make_server("orphaning", mode="children,die", delay_s=1.0)
    server.start()
    with pytest.raises(ServerDied, match="orphaning"):
        server.wait_until_ready(timeout_s=20)
    children = [int(pid) for pid in wait_for_log(server, r"CHILD (\d+)", count=2)]
    assert not any(is_gone(pid) for pid in children)  # orphaned, still running
    server.stop(grace_s=2)
    # The one in the group falls to killpg; the one in its own session only to the psutil
    # record taken while the server was still alive.
    assert all(is_gone(pid) for pid in children)


def test_a_descendant_that_left_the_group_is_waited_for_and_killed_before_stop_returns(
    make_server,
) -> None:
    """An empty group is not the end of the stop: a helper in a session of its own that
    ignores SIGTERM outlives its leader, and holds a port or a GPU until it is SIGKILLed."""
    with server_with_orphan(make_server, "stubborn", "STUBBORN") as (server, orphan):
        server.stop(grace_s=1.0)
        assert is_gone(orphan)


def test_a_descendant_that_left_the_group_gets_sigterm_before_any_sigkill(make_server) -> None:
    """killpg misses a helper in a session of its own: it must get its own SIGTERM, the chance
    to wind down (release a GPU, flush a log) that a vLLM worker gets, not only the SIGKILL
    after the grace."""
    with server_with_orphan(make_server, "graceful", "GRACEFUL") as (server, orphan):
        server.stop(grace_s=2.0)
        assert is_gone(orphan)
        assert f"TERMINATED {orphan}" in server.command.log_path.read_text(), server.log_tail()


@contextlib.contextmanager
def server_with_orphan(make_server, mode: str, marker: str) -> Iterator[tuple[ManagedServer, int]]:
    """A started fake server (`mode`-orphan) and the pid of its helper that left the group, as
    the helper logged it after `marker`; SIGKILLed afterwards if the test left it alive."""
    server = make_server(mode, mode=f"{mode}-orphan")
    server.start()
    server.wait_until_ready(timeout_s=20)
    [orphan] = [int(pid) for pid in wait_for_log(server, rf"{marker} (\d+)")]
    try:
        yield server, orphan
    finally:
        if not is_gone(orphan):
            os.kill(orphan, signal.SIGKILL)


def test_cpu_affinity_confines_the_server_and_what_it_starts(make_server) -> None:
    core = min(os.sched_getaffinity(0))
    server = make_server("confined", mode="children", cpu_affinity=(core,))
    server.start()
    server.wait_until_ready(timeout_s=20)
    children = [int(pid) for pid in wait_for_log(server, r"CHILD (\d+)", count=2)]
    for pid in [server.pid, *children]:
        assert os.sched_getaffinity(pid) == {core}, pid
    assert f"CPU affinity: {core}" in server.command.log_path.read_text()
    unconfined = make_server("unconfined")
    unconfined.start()
    assert os.sched_getaffinity(unconfined.pid) == os.sched_getaffinity(0)


def test_cpu_affinity_this_process_may_not_use_is_refused_before_the_spawn(make_server) -> None:
    outside = max(os.sched_getaffinity(0)) + 1
    server = make_server("1P+1D/decode0", cpu_affinity=(outside,))
    with pytest.raises(ValueError, match=rf"1P\+1D/decode0: CPU affinity {outside} .*: {outside}$"):
        server.start()
    assert server.pid is None


def test_never_ready_raises_startup_timeout_naming_the_server(make_server) -> None:
    server = make_server("1P+1D/prefill0", mode="never-ready")
    server.start()
    start = time.monotonic()
    with pytest.raises(StartupTimeout) as timed_out:
        server.wait_until_ready(timeout_s=1.5)
    assert 1.5 <= time.monotonic() - start < 3.0
    message = str(timed_out.value)
    # The elapsed time is as measured: a loaded host's last probe may end past 1.5 s (seen: 1.6).
    assert re.search(r"not ready after \d+\.\d s \(timeout 1\.5 s\): 1P\+1D/prefill0", message)
    assert "fake server pid" in message  # the log tail
    assert "/health, last probe: connection refused" in message  # nothing listened
    assert timed_out.value.names == ("1P+1D/prefill0",)
    assert server.is_alive()


def test_a_listener_that_never_answers_is_named_as_such_at_the_timeout(make_server) -> None:
    """A start that times out says what its health URL met: here something listens on the port
    (the kernel accepts the connection) but nothing answers."""
    server = make_server("1P+1D/prefill0", mode="never-ready")
    port = int(server.command.health_url.split(":")[2].split("/")[0])
    server.port_lease.hand_over()
    with socket.socket() as mute:
        mute.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        mute.bind(("127.0.0.1", port))
        mute.listen(8)  # never accepts
        server.start()
        with pytest.raises(StartupTimeout) as timed_out:
            server.wait_until_ready(timeout_s=2.5)
    assert f"/health, last probe: no answer within {HEALTH_REQUEST_TIMEOUT_S} s" in str(
        timed_out.value
    )


def test_a_health_answer_from_a_program_that_took_the_port_is_not_readiness(
    make_server,
) -> None:
    """Seen on this machine: a test's fake server, leasing ports from a lock directory of its
    own, took a revived D's port while vLLM loaded and answered /health for it."""
    server = make_server("1E+1P+1D/decode0", mode="never-ready")
    port = int(server.command.health_url.split(":")[2].split("/")[0])
    server.port_lease.hand_over()
    intruder = subprocess.Popen(
        [sys.executable, "-c", FAKE_SERVER, str(port), "0", "serve"], start_new_session=True
    )
    try:
        deadline = time.monotonic() + GONE_TIMEOUT_S
        while not server.probe_health():
            assert time.monotonic() < deadline, "the intruder never answered"
            time.sleep(0.05)
        server.start()
        with pytest.raises(StartupTimeout) as timed_out:
            server.wait_until_ready(timeout_s=1.5)
        assert not server.owns_health_port()
        assert (
            "last probe: a 2xx answer, but the server's own processes do not listen on the port"
            in str(timed_out.value)
        )
    finally:
        intruder.kill()
        intruder.wait()


def test_ready_then_stop_leaves_no_process_of_the_tree(make_server) -> None:
    server = make_server("baseline/baseline0", mode="children")
    server.start()
    server.wait_until_ready(timeout_s=20)
    assert server.startup_seconds is not None and 0.2 <= server.startup_seconds < 10
    assert server.probe_health()
    server.check_alive()
    assert server.peak_rss_bytes() > 10 * 2**20  # three Python processes
    children = [int(pid) for pid in wait_for_log(server, r"CHILD (\d+)", count=2)]
    log = server.command.log_path.read_text()
    assert log.startswith(f"# epd-harness: baseline/baseline0: {sys.executable} -c ")
    assert "modes ['children'] EPD_FAKE_SERVER=1" in log  # env additions reach the server
    pgid = server.pgid
    assert pgid == server.pid
    assert {os.getpgid(children[0]), os.getpgid(children[1])} == {pgid, children[1]}

    server.stop(grace_s=5)

    assert all(is_gone(pid) for pid in [server.pid, *children])
    # Not os.killpg(pgid, 0): it also counts zombies, which an init that does not reap
    # orphans (like this machine's) keeps forever.
    assert live_members_of_group(pgid) == []
    assert server.exit_code == -signal.SIGTERM
    assert not server.is_alive()


def test_cpu_seconds_are_summed_per_kind_of_process(make_server) -> None:
    """The server's own process is `server`; a descendant is named by its process name
    without vLLM's prefix, the kernel's 15-byte cut of `VLLM::EngineCore` included."""
    server = make_server("1P+1D/prefill0", mode="engine-core")
    server.start()
    server.wait_until_ready(timeout_s=20)
    # The child's own line, not the log's header, which quotes the fake's code (print('BURNT'
    # ...)): matching that, the test read the child mid-burn, 0.21-0.22 s of 0.5 s in two
    # fresh-clone CI runs beside the other worker's tests.
    wait_for_log(server, r"(?m)^BURNT$")
    cpu = server.cpu_seconds()
    assert set(cpu) == {"server", "EngineCore"}, cpu
    assert cpu["EngineCore"] >= 0.25, cpu  # half the burn: the kernel's ticks are coarse
    assert 0 < cpu["server"] < cpu["EngineCore"], cpu  # it only imported and slept
    server.stop(grace_s=5)


def test_a_burst_of_checks_scans_the_process_table_once_and_stop_scans_again(
    make_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found profiling the fake GPU night: every request checked each server alive and read its
    peak RSS, and each read listed the server's descendants, which reads every process's
    /proc/<pid>/stat (26 CPU-s of 251 s there). Reads within TREE_SAMPLE_INTERVAL_S of a
    sample reuse it; stop() and cpu_seconds() sample afresh."""
    server = make_server("burst", mode="children")
    server.start()
    server.wait_until_ready(timeout_s=20)
    scans = []
    listed = psutil.Process.children
    monkeypatch.setattr(
        psutil.Process, "children", lambda *a, **k: scans.append(1) or listed(*a, **k)
    )
    started, reads = time.monotonic(), 0
    while time.monotonic() - started < TREE_SAMPLE_INTERVAL_S / 2 or reads < 10:
        server.check_alive()
        server.peak_rss_bytes()
        reads += 1
    burst = len(scans)
    assert burst <= 1, f"{burst} scans for {reads} reads"
    server.cpu_seconds()
    assert len(scans) == burst + 1
    server.stop(grace_s=5)
    assert len(scans) == burst + 2


def test_sigterm_ignoring_server_is_sigkilled_after_the_grace(make_server) -> None:
    server = make_server("stubborn", mode="ignore-term")
    server.start()
    server.wait_until_ready(timeout_s=20)
    start = time.monotonic()
    server.stop(grace_s=1.0)
    elapsed_s = time.monotonic() - start
    assert 1.0 <= elapsed_s < 1.0 + 2.0
    assert server.exit_code == -signal.SIGKILL
    assert is_gone(server.pid)


def wait_until_ignoring_sigterm(pid: int) -> None:
    """Poll the kernel's view (SigIgn in /proc/PID/status) until the fake has set SIG_IGN."""
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while True:
        status = Path(f"/proc/{pid}/status").read_text()
        ignored = int(re.search(r"^SigIgn:\s*([0-9a-f]+)", status, re.M)[1], 16)
        if ignored & (1 << (signal.SIGTERM - 1)):
            return
        assert time.monotonic() < deadline, f"pid {pid} never ignored SIGTERM:\n{status}"
        time.sleep(0.01)


def test_never_ready_server_ignoring_sigterm_gets_the_short_grace(make_server) -> None:
    """Stopping siblings of a server that died at start-up must not cost STOP_GRACE_S each."""
    server = make_server("hung-at-start", mode="ignore-term,never-ready")
    server.start()
    wait_until_ignoring_sigterm(server.pid)
    start = time.monotonic()
    server.stop()  # the default grace: STOP_GRACE_S
    elapsed_s = time.monotonic() - start
    assert STARTUP_STOP_GRACE_S <= elapsed_s < STARTUP_STOP_GRACE_S + 2.0, f"{elapsed_s:.1f} s"
    assert server.exit_code == -signal.SIGKILL


# argv: ready_file. Readiness is a file, not a health URL (the netns rehearsal's `up`); on
# SIGTERM it takes a second to wind down (`up` stopping its nodes), then exits 0.
SLOW_TO_STOP = r"""
import signal, sys, time
from pathlib import Path
def wind_down(signum, frame):
    time.sleep(1.0)
    sys.exit(0)
signal.signal(signal.SIGTERM, wind_down)
Path(sys.argv[1]).write_text("up")
while True:
    time.sleep(1)
"""


def test_a_server_marked_ready_by_its_caller_gets_the_full_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server whose readiness is not a health URL (a ready file) was never marked ready, so
    its stop's grace was cut to STARTUP_STOP_GRACE_S: the netns rehearsal's `up`, stopped with
    30 s while it stopped 4 nodes and 5 namespace holders, was SIGKILLed after 3 s."""
    monkeypatch.setattr("harness.serve.launch.STARTUP_STOP_GRACE_S", 0.2)
    ready = tmp_path / "ready"
    server = ManagedServer(
        ServerCommand(
            name="ready-file/cluster",
            argv=[sys.executable, "-c", SLOW_TO_STOP, str(ready)],
            health_url="",
            log_path=tmp_path / "server.log",
        )
    )
    server.start()
    try:
        deadline = time.monotonic() + GONE_TIMEOUT_S
        while not ready.exists():
            server.check_alive()
            assert time.monotonic() < deadline, server.log_tail()
            time.sleep(0.05)
        server.mark_ready()
        assert server.startup_seconds is not None
    finally:
        server.stop(grace_s=20.0)
    assert server.exit_code == 0, server.log_tail()


def test_stop_is_idempotent_releases_the_port_and_allows_no_restart(make_server) -> None:
    server = make_server("once")
    lease = server.port_lease
    server.start()
    server.wait_until_ready(timeout_s=20)
    assert lease.held
    server.stop()
    server.stop()
    assert not lease.held
    with pytest.raises(RuntimeError) as refused:
        server.start()
    assert str(refused.value) == "once: a ManagedServer starts once; it is already stopped"


def test_a_server_stopped_before_its_start_is_never_started(tmp_path: Path) -> None:
    """A group stopped while a server still waited for its turn stops that one unspawned: a
    start after that is refused, lease or none (a released lease refuses too, but a server
    need not hold one)."""
    command = ServerCommand(
        name="never",
        argv=[sys.executable, "-c", "pass"],
        health_url="http://127.0.0.1:1/health",
        log_path=tmp_path / "never.log",
    )
    server = ManagedServer(command)
    server.stop()
    with pytest.raises(RuntimeError) as refused:
        server.start()
    assert str(refused.value) == "never: a ManagedServer starts once; it is already stopped"
    assert server.pid is None


def test_spawn_failure_names_the_server(tmp_path: Path) -> None:
    command = ServerCommand(
        name="missing/encoder0",
        argv=[str(tmp_path / "no-such-vllm"), "serve"],
        health_url="http://127.0.0.1:1/health",
        log_path=tmp_path / "missing.log",
    )
    with pytest.raises(FileNotFoundError) as failed:
        ManagedServer(command).start()
    assert any("while starting missing/encoder0" in note for note in failed.value.__notes__)


def test_group_fails_at_once_when_one_server_dies_and_stops_the_others(make_server) -> None:
    slow = make_server("1E+1PD/pd0", mode="never-ready")
    crashing = make_server("1E+1PD/encoder0", mode="die", delay_s=1.0)
    events: list[tuple[str, str]] = []
    start = time.monotonic()
    with pytest.raises(ServerDied) as died:
        with ServerGroup(
            [slow, crashing], on_event=lambda name, state, _: events.append((name, state))
        ) as group:
            group.start_all()
            group.wait_all_ready(timeout_s=60)
    assert time.monotonic() - start < 1.0 + 2.0 + 1.0  # death + detection + stopping slow
    assert died.value.name == "1E+1PD/encoder0"
    assert PRINTED_CRASH_LINE.search(str(died.value)), died.value
    assert not slow.is_alive() and is_gone(slow.pid)
    assert events == [
        ("1E+1PD/pd0", "starting"),
        ("1E+1PD/encoder0", "starting"),
        ("1E+1PD/encoder0", "died"),
        ("1E+1PD/encoder0", "stopped"),  # reverse start order
        ("1E+1PD/pd0", "stopped"),
    ]


def test_group_check_alive_notices_a_death_while_serving(make_server) -> None:
    servers = [make_server("1P+1D/prefill0"), make_server("1P+1D/decode0")]
    events: list[tuple[str, str]] = []
    with ServerGroup(servers, on_event=lambda n, s, _: events.append((n, s))) as group:
        group.start_all()
        group.wait_all_ready(timeout_s=20)
        group.check_alive()
        os.kill(servers[1].pid, signal.SIGKILL)
        wait_until_gone([servers[1].pid])
        with pytest.raises(ServerDied) as died:
            group.check_alive()
        assert "1P+1D/decode0" in str(died.value)
        assert "died while serving: killed by SIGKILL" in str(died.value)
    assert sorted(e for e in events if e[1] == "ready") == [
        ("1P+1D/decode0", "ready"),
        ("1P+1D/prefill0", "ready"),
    ]
    assert ("1P+1D/decode0", "died") in events
    assert all(is_gone(server.pid) for server in servers)


def run_harness(tmp_path: Path, mode: str, shape: str) -> tuple[subprocess.Popen[str], list[int]]:
    harness = subprocess.Popen(
        [
            sys.executable,
            "-c",
            HARNESS,
            str(tmp_path / "logs"),
            str(tmp_path / "port-locks"),
            mode,
            shape,
            FAKE_SERVER,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env(),
    )
    lines = []
    while True:
        line = harness.stdout.readline()
        assert line, f"harness ended early:\n{''.join(lines)}"
        lines.append(line)
        if line.startswith("SERVER "):
            return harness, [int(line.split()[1])]


def test_sigkilled_harness_takes_its_server_down(tmp_path: Path) -> None:
    harness, (server_pid,) = run_harness(tmp_path, "never-ready", "server")
    server = psutil.Process(server_pid)
    try:
        harness.kill()
        harness.wait(timeout=GONE_TIMEOUT_S)
        print(f"server gone {wait_until_gone([server_pid]):.3f} s after the harness was SIGKILLed")
    finally:
        if not is_gone(server_pid):
            server.kill()  # psutil refuses if the pid was reused
        harness.stdout.close()


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_server_gets_sigterm_as_its_parent_death_signal_with_or_without_cpus() -> None:
    """The kernel's SIGTERM on the harness's death is what stops a server before the watchdog
    notices (the test above passes on the watchdog alone): the child asks the kernel which
    signal it was given (PR_GET_PDEATHSIG), with CPUs to pin and without."""
    read_it = (
        "import ctypes; n = ctypes.c_int(); "
        "assert ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(n), 0, 0, 0) == 0; "
        "print(n.value)"
    )
    for cpus in ((), tuple(sorted(os.sched_getaffinity(0)))[:1]):
        done = subprocess.run(
            [sys.executable, "-c", read_it],
            preexec_fn=in_child(os.getpid(), cpus),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.stdout.strip() == str(int(signal.SIGTERM)), (cpus, done)


def test_sigterm_to_the_harness_stops_its_group_cleanly(tmp_path: Path) -> None:
    harness, (server_pid,) = run_harness(tmp_path, "children", "group")
    server = psutil.Process(server_pid)
    log = log_path_for(tmp_path / "logs", "harness-child/server0")
    try:
        children = [int(pid) for pid in re.findall(r"CHILD (\d+)", log.read_text())]
        assert len(children) == 2
        harness.send_signal(signal.SIGTERM)
        output, _ = harness.communicate(timeout=GONE_TIMEOUT_S + 15)
        # The grandchildren are beyond the parent-death signal: only the group stop gets them.
        assert all(is_gone(pid) for pid in [server_pid, *children])
        assert "EVENT harness-child/server0 stopped" in output
        assert "KeyboardInterrupt: received SIGTERM" in output
    finally:
        if not is_gone(server_pid):
            server.kill()
        harness.stdout.close()


def test_server_command_normalises_its_fields(tmp_path: Path) -> None:
    command = ServerCommand(
        name="x", argv=["vllm", "serve"], health_url="http://h/health", log_path=tmp_path / "x"
    )
    assert command.argv == ("vllm", "serve")
    with pytest.raises(ValueError) as rejected:
        ServerCommand(name="y", argv=["vllm", 8000], health_url="", log_path=tmp_path / "y")
    assert str(rejected.value) == "y: argv must be a non-empty list of str, got ('vllm', 8000)"
    with pytest.raises(ValueError, match=r"^z: argv must be a non-empty list of str, got \(\)$"):
        ServerCommand(name="z", argv=[], health_url="", log_path=tmp_path / "z")


def test_log_path_for_makes_a_flat_readable_file_name(tmp_path: Path) -> None:
    assert log_path_for(tmp_path, "1E+1P+1D/encoder0") == tmp_path / "1E-1P-1D__encoder0.log"
    assert log_path_for(tmp_path, "a b:c") == tmp_path / "a_b_c.log"


def test_a_logs_tail_is_its_last_lines(tmp_path: Path) -> None:
    """A death is shown with the end of the log, where vLLM's traceback is, not its start
    (the argument dump every vLLM log begins with)."""
    log = tmp_path / "server.log"
    log.write_text("".join(f"line {n}\n" for n in range(1, 101)))
    tail = read_log_tail(log)
    assert tail.splitlines() == [f"line {n}" for n in range(101 - LOG_TAIL_LINES, 101)]
    assert read_log_tail(log, 2) == "line 99\nline 100"
    assert read_log_tail(tmp_path / "none.log") == ""


def test_a_logs_tail_leaves_out_nanobinds_leak_report_so_the_traceback_stays_in_it(
    tmp_path: Path,
) -> None:
    """Found on real vLLM (a fuzz's dead D): every vLLM process that exits where Triton is
    installed prints nanobind's leak report, 31 of the 40 lines shown, and the engine's
    AssertionError was above the tail. Each run of the report is one line saying so."""
    report = [
        "nanobind: leaked 4 instances!",
        ' - leaked instance 0x7f2c0a93d008 of type "triton._C.libtriton.ir.attribute"',
        "nanobind: leaked 64 types!",
        *[f' - leaked type "t{n}"' for n in range(10)],
        " - ... skipped remainder",
        "nanobind: leaked 514 functions!",
        *[f' - leaked function "f{n}"' for n in range(10)],
        " - ... skipped remainder",
        "nanobind: this is likely caused by a reference counting issue in the binding code.",
        "See https://nanobind.readthedocs.io/en/latest/refleaks.html/usr/lib/python3.11/x.py:1: "
        "UserWarning: resource_tracker",
    ]
    log = tmp_path / "server.log"
    traceback = [f"ERROR frame {n}" for n in range(40)] + ["ERROR AssertionError: the cause"]
    log.write_text("\n".join([*traceback, "INFO shutdown complete", *report, "  warnings.warn"]))
    tail = read_log_tail(log).splitlines()
    assert tail[-4:] == [
        "ERROR AssertionError: the cause",
        "INFO shutdown complete",
        f"[{len(report)} lines of nanobind's leak report at exit left out]",
        "  warnings.warn",
    ]
    assert len(tail) == LOG_TAIL_LINES and not any("leaked" in line for line in tail)
    # A report at the very end is still said, and a line that only mentions nanobind stays.
    log.write_text("\n".join(["ERROR uses nanobind: fine", *report]))
    assert read_log_tail(log).splitlines() == [
        "ERROR uses nanobind: fine",
        f"[{len(report)} lines of nanobind's leak report at exit left out]",
    ]


def test_what_a_log_got_after_an_offset_is_only_that(tmp_path: Path) -> None:
    """A failed request's evidence is what each instance logged while it was in flight (read
    from the size its log had before), not the lines of the requests before it."""
    log = tmp_path / "server.log"
    assert (log_size(log), read_log_from(log, 0)) == (0, "")
    log.write_text("earlier request\n")
    offset = log_size(log)
    with log.open("a") as more:
        more.write("this request's traceback\n")
    assert read_log_from(log, offset) == "this request's traceback\n"


def test_a_second_start_keeps_the_first_starts_log(tmp_path: Path) -> None:
    """A pool's restart reuses the server's name: the log of the start that failed stays."""
    for attempt in ("first", "second", "third"):
        command = ServerCommand(
            name="1P+1D/prefill0",
            argv=[sys.executable, "-c", f"print('{attempt} start')"],
            health_url="http://127.0.0.1:1/health",
            log_path=log_path_for(tmp_path, "1P+1D/prefill0"),
        )
        server = ManagedServer(command)
        server.start()
        deadline = time.monotonic() + 30
        while server.exit_code is None and time.monotonic() < deadline:
            time.sleep(0.05)
        server.stop()
    logs = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert sorted(logs) == ["1P-1D__prefill0.1.log", "1P-1D__prefill0.2.log", "1P-1D__prefill0.log"]
    assert "first start" in logs["1P-1D__prefill0.1.log"]
    assert "second start" in logs["1P-1D__prefill0.2.log"]
    assert "third start" in logs["1P-1D__prefill0.log"]
    assert keep_earlier_log(tmp_path / "never.log") is None


def run_to_its_end(command: ServerCommand) -> str:
    """Start `command`'s program, wait for it to exit by itself, and return its log."""
    server = ManagedServer(command)
    server.start()
    try:
        wait_until_gone([server.pid])
    finally:
        server.stop(grace_s=1.0)
    return command.log_path.read_text()


def test_log_header_redacts_credentials_but_the_server_gets_them(tmp_path: Path) -> None:
    """The server needs its token; the log, an artifact that gets uploaded, must not show it."""
    secret = "hf_planted_secret_9d2c"
    report_length = "import os; print('token length', len(os.environ['HF_TOKEN']))"
    command = ServerCommand(
        name="secretive",
        argv=[sys.executable, "-c", report_length],
        health_url="http://127.0.0.1:1/health",
        log_path=tmp_path / "secretive.log",
        env={"HF_TOKEN": secret, "OMP_NUM_THREADS": "1"},
    )
    log = run_to_its_end(command)
    assert secret not in log, log
    assert "HF_TOKEN=[redacted] OMP_NUM_THREADS=1" in log, log
    assert f"token length {len(secret)}" in log, log


def test_an_instances_own_environment_wins_over_the_harnesss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The instance's devices (CUDA_VISIBLE_DEVICES), connector settings and threads are set in
    its command's env; the same name in the shell that started the harness (a runner's
    CUDA_VISIBLE_DEVICES=0,1) must not put it back on the devices of another plan."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("EPD_AMBIENT_ONLY", "kept")
    report = (
        "import os; e = os.environ; print('seen', e['CUDA_VISIBLE_DEVICES'], e['EPD_AMBIENT_ONLY'])"
    )
    command = ServerCommand(
        name="placed",
        argv=[sys.executable, "-c", report],
        health_url="http://127.0.0.1:1/health",
        log_path=tmp_path / "placed.log",
        env={"CUDA_VISIBLE_DEVICES": "1"},
    )
    log = run_to_its_end(command)
    assert "seen 1 kept" in log, log


SIGNALLED_TWICE = r"""
import os, signal, sys
from harness.serve.signal_handlers import install_signal_handlers
install_signal_handlers()
try:
    os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    signal.pause()
except KeyboardInterrupt as exc:
    print(f"interrupted: {exc!r}", flush=True)
for again in ("SIGINT", "SIGTERM", "SIGHUP"):
    os.kill(os.getpid(), getattr(signal, again))  # the cleanup goes on
print("cleanup finished", flush=True)
"""


@pytest.mark.parametrize(
    "first, said", [("SIGINT", "KeyboardInterrupt()"), ("SIGTERM", "received SIGTERM")]
)
def test_only_the_first_interrupt_cuts_in_later_ones_let_the_cleanup_finish(
    first: str, said: str
) -> None:
    """A second Ctrl-C while servers are given their grace must not cut their stop short
    (found in review: SIGINT kept Python's handler, and a second one skipped the servers not
    yet stopped). A Ctrl-C says nothing more than Python's own does."""
    from harness.testing.processes import sigint_as_at_a_terminal

    done = subprocess.run(
        [sys.executable, "-c", SIGNALLED_TWICE, first],
        capture_output=True,
        text=True,
        timeout=30,
        env=child_env(),
        preexec_fn=sigint_as_at_a_terminal,  # a backgrounded CI run has SIGINT ignored
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].startswith("interrupted: KeyboardInterrupt(")
    assert said in done.stdout.splitlines()[0]
    assert done.stdout.splitlines()[1:] == ["cleanup finished"]


def test_a_ctrl_c_while_a_server_is_spawned_leaves_it_tracked(
    tmp_path: Path, fake_vllm: Path, port_locks: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Popen forks, then waits for the child's exec: found in review, a Ctrl-C in that wait
    left a child nothing held (no pid, unknown to the watchdog), out of stop()'s reach. The
    interrupt now comes once the server is recorded. The wait is stretched to be hit."""
    import threading

    from harness.serve import launch
    from harness.serve.server_log import log_path_for
    from harness.testing.processes import pythons_own_ctrl_c, survivors

    in_child = launch.in_child  # launch.py calls the name it imported: patched there

    def slow_in_child(parent_pid: int, cpu_affinity: tuple[int, ...]):
        inner = in_child(parent_pid, cpu_affinity)

        def preexec() -> None:
            time.sleep(1.0)  # a slow fork-to-exec: the parent waits in Popen meanwhile
            if inner is not None:
                inner()

        return preexec

    monkeypatch.setattr(launch, "in_child", slow_in_child)
    (lease,) = reserve_ports(1, lock_dir=port_locks)
    command = ServerCommand(
        name="spawned/server0",
        argv=[str(fake_vllm), "serve", "m", "--port", str(lease.port)],
        health_url=f"http://127.0.0.1:{lease.port}/health",
        log_path=log_path_for(tmp_path, "spawned/server0"),
    )
    server = ManagedServer(command, port_lease=lease)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pythons_own_ctrl_c(), pytest.raises(KeyboardInterrupt):
            server.start()
        assert server.pid is not None, "the interrupted spawn's child is not held"
    finally:
        timer.cancel()
        server.stop(grace_s=0.1)
    assert survivors([server.pid]) == []


def test_a_cli_run_in_process_gives_back_the_signal_handlers_it_replaced() -> None:
    """The harness swallows every Ctrl-C after the first while it cleans up; run inside another
    program (a test's), it must not leave that program so once it returns."""
    from harness.cli.main import main

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    assert main(["list"]) == 0
    after = {sig: signal.getsignal(sig) for sig in before}
    assert after == before


def test_a_signal_ignored_on_entry_stays_ignored() -> None:
    """Under nohup SIGHUP is ignored, and a command a script starts in the background ignores
    SIGINT: the harness keeps that (it takes only what the shell left it)."""
    script = (
        "import signal\n"
        "from harness.serve.signal_handlers import install_signal_handlers\n"
        "replaced = install_signal_handlers()\n"
        "print(sorted(s.name for s in replaced), signal.getsignal(signal.SIGHUP) == signal.SIG_IGN)\n"
    )

    def nohup() -> None:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=30,
        env=child_env(),
        preexec_fn=nohup,
    )
    assert done.stdout.strip() == "['SIGINT', 'SIGTERM'] True", done.stderr


def test_a_signal_held_back_from_a_spawn_is_not_lost_behind_an_ignored_one() -> None:
    """Under nohup SIGHUP is ignored: one that comes during a server's spawn, before the
    SIGTERM that ends the run, must not take the SIGTERM's place when the held-back signals
    are handled (found in review: only the first was, and an ignored one did nothing)."""
    script = (
        "import os, signal\n"
        "from harness.serve.signal_handlers import install_signal_handlers, signals_deferred\n"
        "install_signal_handlers()\n"
        "try:\n"
        "    with signals_deferred():\n"
        "        os.kill(os.getpid(), signal.SIGHUP)\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    print('not interrupted')\n"
        "except KeyboardInterrupt as exc:\n"
        "    print(f'interrupted: {exc}')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=30,
        env=child_env(),
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN),  # nohup
    )
    assert done.stdout.strip() == "interrupted: received SIGTERM", done.stderr


def test_a_default_sigterm_held_back_from_a_spawn_still_ends_the_process_after_it() -> None:
    """Without the harness's handlers SIGTERM ends Python at once: one that came during a
    spawn is held back, not dropped, and ends the process once the server is recorded."""
    script = (
        "import os, signal\n"
        "from harness.serve.signal_handlers import signals_deferred\n"
        "with signals_deferred():\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    print('held back', flush=True)\n"
        "print('still running', flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30, env=child_env()
    )
    assert (done.returncode, done.stdout) == (-signal.SIGTERM, "held back\n"), done.stderr
