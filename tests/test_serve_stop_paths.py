"""Stop paths of the process handling, with stub servers and a stub process (nothing is
started): what a stop must still do when something around it fails or is interrupted."""

from __future__ import annotations

import pytest

from harness.serve.server_group import ServerGroup

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
