"""Stop paths of the process handling, with stub servers and a stub process (nothing is
started): what a stop must still do when something around it fails or is interrupted."""

from __future__ import annotations

import pytest

from harness.serve.server_group import ServerGroup, stop_through_interrupts

pytestmark = pytest.mark.unit


class StubServer:
    """What ServerGroup asks of a server; records its starts and stops."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.pid, self.startup_seconds, self._log = name, None, None, log

    def start(self) -> None:
        self.pid = 4242
        self._log.append(f"start {self.name}")

    def stop(self, grace_s: float = 0.0) -> None:
        self._log.append(f"stop {self.name}")


@pytest.mark.parametrize("raised", [BrokenPipeError, KeyboardInterrupt])
def test_a_failing_stopped_event_does_not_leave_the_other_servers_running(raised) -> None:
    """The event callback (the pytest fixture prints; a closed stdout raises, a Ctrl-C can
    land in it) fails for the first server stopped: the others are still stopped, and what
    the callback raised is raised at the end."""
    log: list[str] = []

    def on_event(name: str, state: str, elapsed_s: float) -> None:
        if state == "stopped" and name == "b":
            raise raised()

    group = ServerGroup([StubServer("a", log), StubServer("b", log)], on_event=on_event)
    group.start_all()
    with pytest.raises(raised):
        group.stop_all()
    assert log == ["start a", "start b", "stop b", "stop a"]


class ReapedPopen:
    """A server's Popen whose leader has exited: `wait()` reaps it (returncode set)."""

    pid = 999_999_1  # no such process: nothing real is ever signalled

    def __init__(self) -> None:
        self.returncode: int | None = None

    def wait(self) -> int:
        self.returncode = 0
        return 0


class InterruptedLease:
    """A port lease whose first release is cut short by a Ctrl-C."""

    def __init__(self) -> None:
        self.releases = 0

    def release(self) -> None:
        self.releases += 1
        if self.releases == 1:
            raise KeyboardInterrupt


class NoWatchdog:
    def done(self, pgid: int) -> None:
        pass


def test_a_stop_retried_after_the_leader_was_reaped_signals_no_group(tmp_path, monkeypatch):
    """A Ctrl-C that lands after stop() reaped the leader (in the lease's release) makes
    ServerGroup retry the stop: the leader's pid, and so the group id, may belong to another
    process by then, so the retry must not signal that group; it only gives the port back."""
    from harness.serve import launch
    from harness.serve.server_command import ServerCommand

    signalled: list[tuple[int, int]] = []
    monkeypatch.setattr(launch, "signal_group", lambda pgid, sig: signalled.append((pgid, sig)))
    monkeypatch.setattr(launch, "live_group_members", lambda pgid: [])
    monkeypatch.setattr(launch.watchdog, "client", NoWatchdog)

    class Exited:
        si_code, si_status = launch.os.CLD_EXITED, 0

    monkeypatch.setattr(launch.os, "waitid", lambda *args: Exited())
    command = ServerCommand("1P+1D/decode0", ["vllm"], "http://x/health", tmp_path / "d.log")
    lease = InterruptedLease()
    server = launch.ManagedServer(command, port_lease=lease)  # type: ignore[arg-type]
    server._popen = ReapedPopen()  # type: ignore[assignment]
    with pytest.raises(KeyboardInterrupt):
        server.stop()
    assert len(signalled) == 1
    server.stop(0.0)  # what stop_through_interrupts does next
    assert len(signalled) == 1, f"the reaped leader's group was signalled again: {signalled}"
    assert lease.releases == 2
    server.stop()
    assert lease.releases == 2


class DyingDuringItsProbe:
    """A server that exits while its last health probe before the timeout is under way."""

    name = "1E+1PD/encoder0"
    startup_seconds = None

    class command:  # noqa: N801 - what a timeout's evidence reads
        health_url = "http://127.0.0.1:1/health"

    def _log_evidence(self) -> str:
        return "--- last lines of its log ---"

    def __init__(self) -> None:
        self.dead = False

    def check_alive(self) -> None:
        from harness.serve.launch import ServerDied

        if self.dead:
            raise ServerDied(f"{self.name} (pid 1) died during startup: exit code 1", self.name, 1)

    def health_probe_failure(self) -> str | None:
        self.dead = True
        return "connection refused"


def test_a_death_during_the_last_probe_before_the_timeout_is_reported_as_a_death() -> None:
    """At the readiness timeout a server that died since the round's check is reported as
    died (exit code, ServerDied), not as a server that was alive but not healthy."""
    from harness.serve.launch import ServerDied, await_ready

    server = DyingDuringItsProbe()
    with pytest.raises(ServerDied, match="died during startup"):
        await_ready([server], 0.0, on_ready=lambda s: None)  # type: ignore[list-item]


class UnstoppableServer(StubServer):
    """A server whose every stop is cut short by a Ctrl-C (a user holding the key down)."""

    def stop(self, grace_s: float = 0.0) -> None:
        self._log.append(f"stop {self.name}")
        raise KeyboardInterrupt


def test_a_server_whose_every_stop_was_interrupted_is_not_reported_stopped() -> None:
    """After the last retry is interrupted too, the server may still run: no "stopped" event
    is emitted for it, the others are stopped and reported, and what is raised at the end
    names the server that may be left."""
    log: list[str] = []
    events: list[tuple[str, str]] = []
    group = ServerGroup(
        [StubServer("a", log), UnstoppableServer("b", log)],
        on_event=lambda name, state, elapsed_s: events.append((name, state)),
    )
    group.start_all()
    with pytest.raises(KeyboardInterrupt) as raised:
        group.stop_all()
    assert ("b", "stopped") not in events
    assert ("a", "stopped") in events
    assert log[-1] == "stop a"
    assert any("b" in note and "may still run" in note for note in raised.value.__notes__)


def test_servers_revived_together_start_in_their_order_whatever_the_list_order() -> None:
    """Two instances that died on one GPU (the second starts after the first) are revived
    together: the one that waits is not spawned beside the other's fresh start because the
    list named it first (its `start_after` server's dead object had been healthy once)."""
    log: list[str] = []
    waiting, first = StubServer("pd", log), StubServer("e", log)
    group = ServerGroup([waiting, first], start_after={"pd": ("e",)})
    group.start_all()
    first.startup_seconds = 1.0
    group._start_due()
    assert log == ["start e", "start pd"]
    fresh_waiting, fresh_first = StubServer("pd", log), StubServer("e", log)
    group.replace(waiting, fresh_waiting)
    group.replace(first, fresh_first)
    group._start_due()  # as wait_all_ready does first
    assert log[2:] == ["start e"]
    fresh_first.startup_seconds = 1.0
    group._start_due()
    assert log[2:] == ["start e", "start pd"]


def test_a_start_whose_cleanup_fails_too_raises_the_start_failure(tmp_path, monkeypatch) -> None:
    """A session that cannot start is closed on the way out; a close that fails as well (a
    process that outlived SIGKILL) is a note on the start's failure, as on leaving the block:
    the death and its log tail stay what the run reports, not "could not stop"."""
    from harness.serve.launch import ServerDied, ServerStopFailed
    from harness.serve.session import TopologySession
    from harness.spec.topology import TOPOLOGIES
    from harness.testing.fake_vllm import fake_run_settings

    session = TopologySession(TOPOLOGIES["1P+1D"], fake_run_settings(tmp_path, tmp_path / "x"))

    def die() -> None:
        raise ServerDied("1P+1D/decode0 (pid 7) died during startup: exit code 1", "1P+1D/decode0")

    def fail_to_stop() -> None:
        raise ServerStopFailed("1P+1D/prefill0: processes survived SIGKILL for 5.0 s: pid 8")

    monkeypatch.setattr(session, "start_servers", die)
    monkeypatch.setattr(session, "close", fail_to_stop)
    with pytest.raises(ServerDied, match="died during startup") as raised:
        session.__enter__()
    assert any("survived SIGKILL" in note for note in raised.value.__notes__)


def test_a_vllm_proxy_start_whose_stop_fails_too_raises_the_start_failure(
    tmp_path, monkeypatch
) -> None:
    """vLLM's proxy that dies during its start is stopped on the way out; a stop that fails as
    well is a note on the death (its exit code and log tail), not what is raised instead."""
    from types import SimpleNamespace

    from harness.serve import entry
    from harness.serve.launch import ServerDied, ServerStopFailed
    from harness.serve.proxy import ProxyRoutes
    from harness.spec.settings import ProxyChoice
    from harness.spec.topology import TOPOLOGIES

    class DyingProxy:
        def __init__(self, command, *, port_lease) -> None:
            self.name = command.name

        def start(self) -> None:
            pass

        def wait_until_ready(self, timeout_s: float) -> None:
            raise ServerDied(f"{self.name} (pid 7) died during startup: exit code 1", self.name)

        def stop(self) -> None:
            raise ServerStopFailed(f"{self.name}: processes survived SIGKILL for 5.0 s: pid 7")

    monkeypatch.setattr(entry, "ManagedServer", DyingProxy)
    monkeypatch.setattr(entry, "reserve_ports", lambda count: [SimpleNamespace(port=20001)])
    monkeypatch.setattr(
        entry,
        "vllm_proxy_launch",
        lambda *args: SimpleNamespace(argv=["proxy"], health_path="/health", env={}),
    )
    choice = ProxyChoice("vllm", files_dir=tmp_path, interpreter=("python",))
    routes = ProxyRoutes(encoder_urls=(), prefill_urls=("http://p",), decode_urls=("http://d",))
    with pytest.raises(ServerDied, match="died during startup") as raised:
        entry.start_vllm_proxy(TOPOLOGIES["1P+1D"], choice, routes, tmp_path, [])
    assert any("survived SIGKILL" in note for note in raised.value.__notes__)


class ProbedServer(StubServer):
    """A stub that answers its health probe at once and records each probe."""

    def check_alive(self) -> None:
        pass

    def health_probe_failure(self) -> str | None:
        self._log.append(f"probe {self.name}")
        return None

    def owns_health_port(self) -> bool:
        return True

    def mark_ready(self) -> None:
        if self.startup_seconds is None:
            self.startup_seconds = 1.0


def test_a_revival_waits_for_the_revived_server_only() -> None:
    """After one instance died and was started again, the group's wait is for that one: the
    instances still ready from before are neither probed nor reported ready a second time
    (a session's events and startup times would count their start twice)."""
    log: list[str] = []
    events: list[tuple[str, str]] = []
    ready, dead = ProbedServer("e", log), ProbedServer("pd", log)
    group = ServerGroup(
        [ready, dead], on_event=lambda name, state, elapsed_s: events.append((name, state))
    )
    group.start_all()
    group.wait_all_ready(timeout_s=5)
    revived = ProbedServer("pd", log)
    group.replace(dead, revived)
    del log[:], events[:]
    group.wait_all_ready(timeout_s=5)
    assert log == ["start pd", "probe pd"]
    assert events == [("pd", "starting"), ("pd", "ready")]


def test_two_servers_of_one_name_are_refused() -> None:
    """Names key the logs, the start order and a death's report: two servers of one name
    would write one log and be stopped or revived for each other."""
    log: list[str] = []
    with pytest.raises(ValueError) as refused:
        ServerGroup([StubServer("a", log), StubServer("b", log), StubServer("a", log)])
    assert str(refused.value) == "server names must be unique; repeated: ['a']"


class GraceRecordingServer(StubServer):
    """A server whose first stop is cut short by a Ctrl-C; records the grace of each."""

    def __init__(self, name: str, log: list[str]) -> None:
        super().__init__(name, log)
        self.graces: list[float] = []

    def stop(self, grace_s: float = 0.0) -> None:
        self.graces.append(grace_s)
        if len(self.graces) == 1:
            raise KeyboardInterrupt


def test_a_stop_cut_short_by_a_ctrl_c_is_retried_without_grace() -> None:
    """A user who presses Ctrl-C during a server's grace is in a hurry: the retry goes
    straight to SIGKILL (no grace), not another 15 s for a server that ignores SIGTERM."""
    server = GraceRecordingServer("a", [])
    interrupts: list[BaseException] = []
    assert stop_through_interrupts(server, 15.0, interrupts)  # type: ignore[arg-type]
    assert server.graces == [15.0, 0.0]
    assert [type(i) for i in interrupts] == [KeyboardInterrupt]


def test_the_first_mark_of_readiness_is_the_startup_time(tmp_path, monkeypatch) -> None:
    """A server's caller may see it ready more than once (a ready file, a log line read
    again): the startup time is the first sighting, not the last."""
    from harness.serve import launch
    from harness.serve.server_command import ServerCommand

    command = ServerCommand("s", ["true"], "http://127.0.0.1:1/health", tmp_path / "s.log")
    server = launch.ManagedServer(command)
    server._spawned_at = 100.0
    now = iter([103.0, 110.0])
    monkeypatch.setattr(launch.time, "monotonic", lambda: next(now))
    server.mark_ready()
    server.mark_ready()
    assert server.startup_seconds == 3.0


class FailingStopServer(StubServer):
    """A server whose stop fails (processes outlived SIGKILL)."""

    def stop(self, grace_s: float = 0.0) -> None:
        self._log.append(f"stop {self.name}")
        raise RuntimeError(f"{self.name}: processes survived SIGKILL")


def test_a_ctrl_c_during_the_stops_is_raised_though_a_stop_failed_before_it() -> None:
    """The stops go on through a Ctrl-C and a failed stop alike; at the end the interrupt is
    what is raised (the user asked to stop), the failure a note on it, whichever came first."""
    log: list[str] = []
    group = ServerGroup([GraceRecordingServer("a", log), FailingStopServer("b", log)])
    group.start_all()
    with pytest.raises(KeyboardInterrupt) as raised:
        group.stop_all()
    assert any("b: processes survived SIGKILL" in note for note in raised.value.__notes__)


class DeadServer(StubServer):
    """A spawned server that has died: each check raises its death."""

    def check_alive(self) -> None:
        from harness.serve.launch import ServerDied

        raise ServerDied(f"{self.name} died while serving", self.name, 1)


def test_a_revived_server_that_dies_again_is_reported_dead_again() -> None:
    """A death is reported once per server object: the revival of one that died is a new
    start, and its own death is a new "died" event, not swallowed as the first one's."""
    from harness.serve.launch import ServerDied

    log: list[str] = []
    events: list[tuple[str, str]] = []
    dead = DeadServer("pd", log)
    group = ServerGroup(
        [dead], on_event=lambda name, state, elapsed_s: events.append((name, state))
    )
    group.start_all()
    for _ in range(2):
        with pytest.raises(ServerDied):
            group.check_alive()
    revived = DeadServer("pd", log)
    group.replace(dead, revived)
    group._start_due()
    with pytest.raises(ServerDied):
        group.check_alive()
    assert [state for _, state in events] == ["starting", "died", "starting", "died"]


class CheckedServer(StubServer):
    """A stub that, as a ManagedServer does, refuses a check before its start."""

    def check_alive(self) -> None:
        if self.pid is None:
            raise RuntimeError(f"{self.name}: not started")


def test_a_server_still_waiting_for_its_turn_is_not_checked() -> None:
    """Between requests the group checks its servers; one that starts after another and is
    not spawned yet has nothing to check (a check would refuse: not started)."""
    log: list[str] = []
    first, waiting = CheckedServer("e", log), CheckedServer("pd", log)
    group = ServerGroup([first, waiting], start_after={"pd": ("e",)})
    group.start_all()
    group.check_alive()
    assert log == ["start e"]


class AnsweredServer:
    """A server whose health URL answers 200 (whoever listens there) and that owns its port."""

    def __init__(self, name: str) -> None:
        self.name, self.startup_seconds, self.probed = name, None, 0

    def check_alive(self) -> None:
        pass

    def health_probe_failure(self) -> str | None:
        self.probed += 1
        return None

    def owns_health_port(self) -> bool:
        return True  # as a ManagedServer not spawned yet says: it has no tree to ask

    def mark_ready(self) -> None:
        self.startup_seconds = 0.0


def test_a_server_not_spawned_yet_is_not_ready_whatever_answers_on_its_port() -> None:
    """A server that starts once another is healthy (`start_after`) is not spawned while it
    waits: a program already answering on its port (an earlier run's leftover) is not its
    readiness, and marking it ready would let the group go on without ever spawning it."""
    from harness.serve.launch import StartupTimeout, await_ready

    first, waiting = AnsweredServer("e"), AnsweredServer("pd")
    readied: list[str] = []
    with pytest.raises(StartupTimeout, match="pd was never started"):
        await_ready(
            [first, waiting],  # type: ignore[list-item]
            0.0,
            on_ready=lambda server: readied.append(server.name),
            waits_for=lambda server: ("e",) if server is waiting else (),
        )
    assert readied == ["e"]
    assert waiting.probed == 0 and waiting.startup_seconds is None
