"""The watchdog process on its own: what it stops once the harness is gone, and what it spares.

The harness is played by the test: it writes the protocol lines to a watchdog's stdin and
closes it (EOF: "the harness is gone"). The processes to stop are Python sleepers in sessions
of their own, like servers. How the harness and vLLM-like servers fare when a real harness
is SIGKILLed is tests/test_chaos.py's part (tests/test_chaos_vllm.py's with real vLLM).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from harness.environment import (
    NETWORK_CHECKS_ENV,
    WATCHDOG_ENV,
    network_checks_enabled,
    watchdog_enabled,
)
from harness.serve import watchdog
from harness.testing.processes import child_env, is_live, seconds_until_gone, wait_for

pytestmark = [pytest.mark.process, pytest.mark.wall_clock_bound]

BOUND_S = 30.0

# argv: mode. Ignores SIGTERM; "fork" forks a child into its group and prints its pid; with
# "fork,exit" the leader then exits, leaving the child holding the group; with "fork,setsid"
# the child leaves the group for a session of its own.
SLEEPER = r"""
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if "fork" in sys.argv[1]:
    child = os.fork()
    if child == 0:
        if "setsid" in sys.argv[1]:
            os.setsid()  # leaves the group (and the session), still the leader's child
        time.sleep(600)
        os._exit(0)
    print(child, flush=True)
else:
    print(os.getpid(), flush=True)
if "exit" in sys.argv[1]:
    os._exit(0)
time.sleep(600)
"""

# A harness that ends normally: one ManagedServer (a SIGTERM-ignoring sleeper), started and
# stopped; prints the watchdog's pid and exits.
NORMAL_HARNESS = r"""
import sys
from pathlib import Path
from harness.serve.launch import ManagedServer
from harness.serve.server_command import ServerCommand
from harness.serve.watchdog import client
command = ServerCommand(name="normal/server0", argv=[sys.executable, "-c", sys.argv[2], "plain"],
                        health_url="http://127.0.0.1:9/health", log_path=Path(sys.argv[1]))
server = ManagedServer(command)
server.start()
print(client().pid, flush=True)
server.stop(grace_s=0.5)
"""

# A harness SIGKILLed while it runs one server with a scratch directory (as a Ray rehearsal
# node's temp dir): argv log, scratch. Prints the server's pid and the watchdog's, then waits.
KILLED_HARNESS = r"""
import sys, time
from pathlib import Path
from harness.serve.launch import ManagedServer
from harness.serve.server_command import ServerCommand
from harness.serve.watchdog import client
scratch = Path(sys.argv[2])
scratch.mkdir()
(scratch / "session.sock").write_text("")
command = ServerCommand(name="killed/server0", argv=["sleep", "600"],
                        health_url="http://127.0.0.1:9/health", log_path=Path(sys.argv[1]),
                        scratch_dir=scratch)
server = ManagedServer(command)
server.start()
print(server.pid, client().pid, flush=True)
time.sleep(600)
"""


def spawn_sleeper(mode: str) -> tuple[subprocess.Popen[str], int]:
    """A sleeper in a session of its own; returns it and the pid it printed."""
    sleeper = subprocess.Popen(
        [sys.executable, "-c", SLEEPER, mode],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    return sleeper, int(sleeper.stdout.readline())


def start_watchdog() -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "harness.serve.watchdog"],
        stdin=subprocess.PIPE,
        env=child_env(),
        start_new_session=True,
    )


def tell(dog: subprocess.Popen[bytes], **fields: object) -> None:
    dog.stdin.write((json.dumps(fields) + "\n").encode())
    dog.stdin.flush()


def start_line(pgid: int, log: Path, create_time: float | None = None) -> dict:
    if create_time is None:
        create_time = watchdog.boot_seconds(pgid)
    return {
        "event": "start",
        "pgid": pgid,
        "create_time": create_time,
        "name": f"t/{pgid}",
        "log": str(log),
    }


def cleanup(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream:
                stream.close()


@contextlib.contextmanager
def watched_with_scratch(
    tmp_path: Path, mode: str
) -> Iterator[tuple[subprocess.Popen[str], int, Path, subprocess.Popen[bytes]]]:
    """A sleeper (`mode` as SLEEPER reads it) whose group a watchdog was told of, with an
    existing scratch directory: (the sleeper, the pid it printed, the scratch dir, the
    watchdog). Both processes are cleaned up after."""
    sleeper, pid = spawn_sleeper(mode)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    dog = start_watchdog()
    try:
        tell(dog, **start_line(sleeper.pid, tmp_path / "server.log"), scratch=str(scratch))
        yield sleeper, pid, scratch, dog
    finally:
        cleanup(sleeper, dog)


def test_harness_gone_stops_a_group_that_ignores_sigterm(tmp_path: Path) -> None:
    leader, pid = spawn_sleeper("fork")
    dog = start_watchdog()
    try:
        tell(dog, **start_line(leader.pid, tmp_path / "server.log"))
        time.sleep(2 * watchdog.SAMPLE_INTERVAL_S)
        dog.stdin.close()  # the harness is gone
        gone_s = seconds_until_gone([leader.pid, pid], BOUND_S)
        assert gone_s is not None, f"leader {leader.pid} or child {pid} survived the watchdog"
        print(f"SIGTERM-ignoring leader and child gone {gone_s:.1f} s after EOF")
        assert gone_s < watchdog.GRACE_S + watchdog.KILL_WAIT_S
        assert dog.wait(timeout=5) == 0
        log = (tmp_path / watchdog.LOG_NAME).read_text()
        assert f"t/{leader.pid} (group {leader.pid}) harness gone; SIGTERM to 2" in log, log
        assert "SIGKILL to" in log and "gone" in log, log
    finally:
        cleanup(leader, dog)


def test_a_member_holding_the_group_after_the_leader_was_reaped_is_stopped(
    tmp_path: Path,
) -> None:
    """The leader exited and was reaped (as happens once the harness is gone): the group id is
    held only by a child the watchdog sampled, so that is what identifies the group."""
    leader, child = spawn_sleeper("fork,exit")
    dog = start_watchdog()
    try:
        tell(dog, **start_line(leader.pid, tmp_path / "server.log"))
        time.sleep(2 * watchdog.SAMPLE_INTERVAL_S)  # the watchdog records the child
        leader.wait()  # reaped: its pid is free, only the child keeps the group id
        assert os.getpgid(child) == leader.pid and is_live(child)
        dog.stdin.close()
        gone_s = seconds_until_gone([child], BOUND_S)
        assert gone_s is not None, f"the child {child} survived the watchdog"
        print(f"orphaned group member gone {gone_s:.1f} s after EOF")
    finally:
        if is_live(child):
            os.kill(child, signal.SIGKILL)
        cleanup(leader, dog)


def test_a_recorded_descendant_that_left_the_group_is_stopped_too(tmp_path: Path) -> None:
    """A server's child that moved to a session of its own (a daemon, a Ray worker) is out of
    reach of the group's signal; the watchdog recorded it under the leader, and stops it by
    its pid."""
    leader, pid = spawn_sleeper("fork,setsid")
    dog = start_watchdog()
    try:
        wait_for(lambda: os.getpgid(pid) == pid, "the child's own session", BOUND_S)
        tell(dog, **start_line(leader.pid, tmp_path / "server.log"))
        time.sleep(2 * watchdog.SAMPLE_INTERVAL_S)
        dog.stdin.close()
        wait_for(lambda: not is_live(pid), "the child that left the group stopped", BOUND_S)
        assert dog.wait(timeout=10) == 0
    finally:
        if is_live(pid):
            os.kill(pid, signal.SIGKILL)
        cleanup(leader, dog)


def test_a_group_gone_before_the_harness_still_has_its_scratch_dir_removed(
    tmp_path: Path,
) -> None:
    """The server died by itself before the harness was SIGKILLed (no "done" sent): nothing
    is left to stop, and its scratch directory goes all the same."""
    with watched_with_scratch(tmp_path, "plain") as (sleeper, _, scratch, dog):
        time.sleep(2 * watchdog.SAMPLE_INTERVAL_S)
        sleeper.kill()
        sleeper.wait()
        dog.stdin.close()
        assert dog.wait(timeout=10) == 0
        assert not scratch.exists(), (tmp_path / watchdog.LOG_NAME).read_text()


def test_a_process_that_is_not_the_recorded_one_is_spared(tmp_path: Path) -> None:
    """Pid reuse: the group's id now belongs to a process created at another time."""
    stranger, pid = spawn_sleeper("plain")
    dog = start_watchdog()
    try:
        wrong_time = watchdog.boot_seconds(pid) - 100
        tell(dog, **start_line(pid, tmp_path / "server.log", create_time=wrong_time))
        time.sleep(2 * watchdog.SAMPLE_INTERVAL_S)
        dog.stdin.close()
        assert dog.wait(timeout=10) == 0
        assert is_live(pid), "the watchdog signalled a process it had not recorded"
        assert "nothing of this group left running" in (tmp_path / watchdog.LOG_NAME).read_text()
    finally:
        cleanup(stranger, dog)


def test_a_recorded_member_that_left_the_group_does_not_make_a_reused_group_id_ours() -> None:
    """After the harness died, group id G may belong to strangers; a recorded member still
    alive elsewhere (it left G) is signalled by its own pid, but is no evidence that G is
    still the harness's: only a recorded process inside G is. Else the strangers of G get
    the SIGTERM and SIGKILL."""
    stranger, pid = spawn_sleeper("plain")
    try:
        me = os.getpid()  # a recorded member, alive, in another group than `pid`'s
        group = watchdog.Group(
            pid, watchdog.boot_seconds(pid) - 100, "1P+1D/decode0", "", members={}
        )
        group.members[me] = watchdog.boot_seconds(me)
        assert not watchdog.group_is_ours(group)
        assert [p.pid for p in watchdog.live_processes(group)] == [me]
    finally:
        cleanup(stranger)


# A sitecustomize for the watchdog: the wall clock stepped 2 s forward after the
# harness recorded its groups (an NTP step, a VM resumed), as psutil's epoch times see it.
CLOCK_STEPPED = """
import psutil._pslinux as linux
_boot_time = linux.boot_time
linux.boot_time = lambda: _boot_time() + 2.0
"""


def test_a_wall_clock_step_does_not_make_the_groups_strangers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process's identity is its pid and the moment it was created; an epoch creation time
    is the boot time (which moves with the wall clock) plus the ticks since boot. Recorded by
    the harness before a clock step and compared by the watchdog after it, every group looked
    like a reused pid: the watchdog spared the servers it exists to stop."""
    stepped = tmp_path / "clock-stepped"
    stepped.mkdir()
    (stepped / "sitecustomize.py").write_text(CLOCK_STEPPED)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(stepped), child_env()["PYTHONPATH"]]))
    sleeper, pid = spawn_sleeper("plain")
    client = watchdog.WatchdogClient()
    try:
        client.ensure_running()
        client.started(pid, "t/clock", tmp_path / "server.log")
        time.sleep(2 * watchdog.SAMPLE_INTERVAL_S)
        dog = psutil.Process(client.pid)
        client.close()  # the harness is gone
        gone_s = seconds_until_gone([pid], BOUND_S)
        assert gone_s is not None, (tmp_path / watchdog.LOG_NAME).read_text()
        dog.wait(timeout=10)
    finally:
        cleanup(sleeper)


def test_groups_the_harness_stopped_are_forgotten_and_the_watchdog_exits_at_once(
    tmp_path: Path,
) -> None:
    sleeper, pid = spawn_sleeper("plain")
    dog = start_watchdog()
    try:
        tell(dog, **start_line(pid, tmp_path / "server.log"))
        tell(dog, event="done", pgid=pid)
        time.sleep(2 * watchdog.SAMPLE_INTERVAL_S)
        closed = time.monotonic()
        dog.stdin.close()
        assert dog.wait(timeout=5) == 0
        exit_s = time.monotonic() - closed
        # Not a stop: that would signal the group and wait up to GRACE_S. Usually well under a
        # second; 4.25 s once beside three vLLM interpreters importing on two cores.
        assert exit_s < watchdog.GRACE_S, f"{exit_s:.2f} s"
        assert is_live(pid)
        assert not (tmp_path / watchdog.LOG_NAME).exists()
    finally:
        cleanup(sleeper, dog)


def test_a_sigkilled_harness_leaves_no_scratch_dir_of_its_servers(tmp_path: Path) -> None:
    """A Ray rehearsal node's temp dir outlived a SIGKILLed harness (43 files per node, one
    directory per node per run): the watchdog stopped the node but nothing removed it."""
    scratch = tmp_path / "scratch"
    harness = subprocess.Popen(
        [sys.executable, "-c", KILLED_HARNESS, str(tmp_path / "server.log"), str(scratch)],
        stdout=subprocess.PIPE,
        env=child_env(),
        text=True,
        start_new_session=True,
    )
    try:
        server, dog = map(int, harness.stdout.readline().split())
        time.sleep(2 * watchdog.SAMPLE_INTERVAL_S)
        harness.kill()
        assert seconds_until_gone([server, dog], BOUND_S) is not None
        log = (tmp_path / watchdog.LOG_NAME).read_text()
        assert not scratch.exists(), log
        assert f"removed its scratch directory {scratch}" in log, log
    finally:
        cleanup(harness)


def test_a_scratch_dir_is_removed_only_once_its_group_is_gone(tmp_path: Path) -> None:
    # "fork" ignores SIGTERM: gone only at the SIGKILL
    with watched_with_scratch(tmp_path, "fork") as (leader, pid, scratch, dog):
        time.sleep(2 * watchdog.SAMPLE_INTERVAL_S)
        dog.stdin.close()
        wait_for(lambda: not scratch.exists(), "the scratch directory's removal", BOUND_S)
        assert not is_live(leader.pid) and not is_live(pid), "removed while its group ran"
        assert dog.wait(timeout=10) == 0


def test_a_relative_scratch_path_is_never_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The harness sends absolute paths only; a relative one (a malformed line) would name a
    directory under wherever the watchdog runs, which is not the harness's to remove."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "work").mkdir()
    group = watchdog.Group(1, 0.0, "1P+1D/decode0", str(tmp_path / "server.log"), "work")
    watchdog.remove_scratch(group, watchdog.Log())
    assert (tmp_path / "work").is_dir()


def test_the_scratch_dir_of_a_group_the_harness_stopped_is_left_to_the_harness(
    tmp_path: Path,
) -> None:
    with watched_with_scratch(tmp_path, "plain") as (_, pid, scratch, dog):
        tell(dog, event="done", pgid=pid)
        dog.stdin.close()
        assert dog.wait(timeout=10) == 0
        assert scratch.is_dir()


def test_a_replacement_watchdog_takes_over_the_groups_recorded_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watchdog died while the harness ran; the next event starts a new one, which must
    learn every live group, the earlier ones too, or a SIGKILLed harness leaves them running."""
    monkeypatch.delenv(WATCHDOG_ENV, raising=False)
    first, _ = spawn_sleeper("plain")  # ignore SIGTERM: gone at the watchdog's SIGKILL
    second, _ = spawn_sleeper("plain")
    dog = watchdog.WatchdogClient()
    replacement = None
    try:
        dog.started(first.pid, "t/first", tmp_path / "first.log")
        died = dog._popen
        died.kill()
        died.wait()
        dog.started(second.pid, "t/second", tmp_path / "second.log")
        replacement = dog._popen
        assert replacement is not died
        dog.close()  # the harness's end, as the watchdog sees it
        wait_for(
            lambda: not is_live(first.pid) and not is_live(second.pid),
            "both groups stopped by the replacement watchdog",
            BOUND_S,
        )
    finally:
        cleanup(first, second, *([replacement] if replacement else []))


def test_a_normally_ending_harness_leaves_no_watchdog(tmp_path: Path) -> None:
    harness = subprocess.run(
        [sys.executable, "-c", NORMAL_HARNESS, str(tmp_path / "server.log"), SLEEPER],
        check=False,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert harness.returncode == 0, harness.stderr
    dog_pid = int(harness.stdout.split()[0])
    assert not is_live(dog_pid), f"watchdog {dog_pid} outlived the harness"
    assert not (tmp_path / watchdog.LOG_NAME).exists()


def test_every_spelling_of_off_the_docs_name_turns_the_switches_off() -> None:
    """docs/environment.md says "off (or 0)"; a value as a CI matrix or a shell writes it
    (`Off`, ` 0 `, `false`, `NO`) turns the watchdog and the network checks off too, and
    anything else, unset included, leaves them on."""
    for value in ("off", " Off ", "0", "false", "NO"):
        assert not watchdog_enabled({WATCHDOG_ENV: value}), value
        assert not network_checks_enabled({NETWORK_CHECKS_ENV: value}), value
    for environ in ({}, {WATCHDOG_ENV: "on", NETWORK_CHECKS_ENV: "1"}):
        assert watchdog_enabled(environ) and network_checks_enabled(environ), environ


def test_disabled_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WATCHDOG_ENV, "off")
    client = watchdog.WatchdogClient()
    client.ensure_running()
    client.started(os.getpid(), "x", None)
    assert client.pid is None


def test_the_watchdog_imports_the_harness_it_watches_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watchdog is `python -m harness.serve.watchdog` with the harness's own tree first on
    its PYTHONPATH: whatever else the interpreter finds (an installed copy of another version,
    or nothing at all from a harness put on sys.path by a script) must not be what stops the
    servers. The tree is the directory that holds the `harness` package, not the package
    itself: that would make `run`, `spec`, `errors`... top-level names ahead of the stdlib."""
    import harness

    tree = Path(harness.__file__).resolve().parents[1]
    spawned: list[dict[str, str]] = []

    class CapturingPopen:
        def __init__(self, argv: list[str], *, env: dict[str, str], **kwargs: object) -> None:
            spawned.append(env)
            self.pid, self.stdin = 0, None

    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.setattr(watchdog.subprocess, "Popen", CapturingPopen)
    monkeypatch.setattr(watchdog.atexit, "register", lambda function: None)
    watchdog.WatchdogClient()._spawn()
    monkeypatch.undo()
    (env,) = spawned
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(tree)
    imported = subprocess.run(
        [sys.executable, "-c", "import harness; print(harness.__file__)"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    assert Path(imported).resolve() == Path(harness.__file__).resolve()


def test_a_malformed_line_is_logged_and_the_watch_goes_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A line the watchdog cannot read must not end it: the groups it was told of before and
    after still need stopping if the harness dies."""
    groups: dict[int, watchdog.Group] = {}
    for line in (b"not json", b'{"event": "start", "pgid": "x"}', b'{"event": "stop", "pgid": 1}'):
        watchdog.handle(groups, line, watchdog.Log())
    watchdog.handle(
        groups, json.dumps(start_line(os.getpid(), Path("/nowhere"))).encode(), watchdog.Log()
    )
    assert list(groups) == [os.getpid()]
    assert capsys.readouterr().err.count("ignoring a malformed line") == 3


def test_a_forked_copy_of_the_harness_gets_a_watchdog_client_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sharing the parent's, a forked harness's servers would be told to a watchdog that
    watches the parent: SIGKILLed, the fork would leave its servers running."""
    parents = watchdog.client()
    assert watchdog.client() is parents
    monkeypatch.setattr(watchdog.os, "getpid", lambda: parents.owner_pid + 1)
    assert watchdog.client() is not parents


def test_the_watchdog_runs_in_a_session_of_its_own_and_ignores_the_stop_signals(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal to the harness's process group (Ctrl-C, a CI job's SIGTERM or SIGHUP) must
    not stop the process that stops the servers once the harness is gone."""
    monkeypatch.delenv(WATCHDOG_ENV, raising=False)
    sleeper, pid = spawn_sleeper("plain")
    client = watchdog.WatchdogClient()
    try:
        client.ensure_running()
        assert os.getsid(client.pid) not in (os.getsid(0), os.getpgid(0))
        client.started(pid, "t/signalled", tmp_path / "server.log")
        time.sleep(2 * watchdog.SAMPLE_INTERVAL_S)  # it has set up its signal handling
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            os.kill(client.pid, sig)
        dog = psutil.Process(client.pid)
        client.close()  # the harness is gone
        assert seconds_until_gone([pid], BOUND_S) is not None, "the watchdog died of a signal"
        dog.wait(timeout=10)
    finally:
        cleanup(sleeper)
