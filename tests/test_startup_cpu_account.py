"""The start-up CPU account of a server's process tree (`ManagedServer.cpu_seconds`), over a
faked process table: what helpers that came and went between two samples, and a pid the
kernel gave again, do to the sums per kind of process; and the tree's peak RSS, which those
samples also take."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from harness.serve import launch
from harness.serve.launch import ManagedServer
from harness.serve.server_command import ServerCommand

pytestmark = pytest.mark.unit

ROOT_PID = 100


@dataclass
class FakeProcess:
    """What `psutil.Process` answers for one process of the faked table."""

    pid: int
    name_: str
    ppid_: int
    started: float  # create_time: tells a process from a later one given the same pid
    user: float = 0.0
    reaped: float = 0.0  # children_user: CPU of the children it waited for
    rss: int = 1
    descendants: list[FakeProcess] = field(default_factory=list)

    def name(self) -> str:
        return self.name_

    def ppid(self) -> int:
        return self.ppid_

    def create_time(self) -> float:
        return self.started

    def cpu_times(self) -> SimpleNamespace:
        return SimpleNamespace(
            user=self.user, system=0.0, children_user=self.reaped, children_system=0.0
        )

    def memory_info(self) -> SimpleNamespace:
        return SimpleNamespace(rss=self.rss)

    def children(self, recursive: bool = False) -> list[FakeProcess]:
        return list(self.descendants)

    @contextmanager
    def oneshot(self) -> Iterator[None]:
        yield


class Table:
    """The faked process table: the tree as the next sample sees it."""

    def __init__(self) -> None:
        self.root = FakeProcess(ROOT_PID, "python3", 1, started=1.0)

    def process(self, pid: int) -> FakeProcess:
        if pid != ROOT_PID:
            raise psutil.NoSuchProcess(pid)
        return self.root


@pytest.fixture
def table(monkeypatch: pytest.MonkeyPatch) -> Table:
    table = Table()
    monkeypatch.setattr(launch.psutil, "Process", table.process)
    return table


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ManagedServer:
    command = ServerCommand(
        name="1P+1D/prefill0",
        argv=["vllm", "serve"],
        health_url="http://127.0.0.1:1/health",
        log_path=tmp_path / "prefill0.log",
    )
    server = ManagedServer(command)
    server._popen = SimpleNamespace(pid=ROOT_PID, returncode=None)
    monkeypatch.setattr(server, "is_alive", lambda: True)
    return server


def test_a_helper_that_came_and_went_between_samples_counts_under_its_parent(
    table: Table, server: ManagedServer
) -> None:
    """The kernel adds a child's CPU to its parent's once the parent waits for it: a `uname`
    the API server ran and reaped between two samples is in the server's children times."""
    core = FakeProcess(200, "VLLM::EngineCore", ROOT_PID, started=2.0, user=2.0)
    table.root.user, table.root.descendants = 1.0, [core]
    server._sample_tree(max_age_s=0.0)
    table.root.reaped, core.user = 0.5, 3.0  # the helper ran 0.5 s, unseen
    assert server.cpu_seconds() == {"server": 1.5, "EngineCore": 3.0}


def test_a_pid_given_again_keeps_the_earlier_process_figure(
    table: Table, server: ManagedServer
) -> None:
    """A helper sampled alive, then reaped by the server, and its pid given to a worker: both
    count, each once (the helper's figure is not also counted in the server's children)."""
    helper = FakeProcess(300, "uname", ROOT_PID, started=2.0, user=0.4)
    table.root.user, table.root.descendants = 1.0, [helper]
    server._sample_tree(max_age_s=0.0)
    worker = FakeProcess(300, "VLLM::Worker", ROOT_PID, started=3.0, user=0.2)
    table.root.reaped, table.root.descendants = 0.45, [worker]  # 0.05 s after its sample
    assert server.cpu_seconds() == {"server": 1.05, "uname": 0.4, "Worker": 0.2}


def test_the_peak_rss_is_the_largest_sample_not_the_latest(
    table: Table, server: ManagedServer
) -> None:
    """A worker that held 900 bytes and is gone by the next sample still made the peak: the
    report's peak RSS is what the tree needed at its most, not what it holds at the end."""
    worker = FakeProcess(200, "VLLM::Worker", ROOT_PID, started=2.0, rss=900)
    table.root.rss, table.root.descendants = 100, [worker]
    server._sample_tree(max_age_s=0.0)
    table.root.descendants = []
    server._sample_tree(max_age_s=0.0)
    assert server.peak_rss_bytes() == 1000


def test_a_reaped_childs_own_reaped_helpers_are_not_counted_twice() -> None:
    """The engine core waited for a compiler (its children times hold it), then the server
    waited for the engine core: the server's children times hold both, and both are the
    engine core's figure already, so the server gains nothing from them."""
    from harness.serve.cpu_account import ProcessCpu, TreeCpuAccount

    root, core = (ROOT_PID, 1.0), (200, 2.0)
    account = TreeCpuAccount()
    account.record(
        [
            ProcessCpu(root, None, "server", own_s=1.0, reaped_s=0.0),
            ProcessCpu(core, root, "EngineCore", own_s=2.0, reaped_s=0.5),
        ]
    )
    account.record([ProcessCpu(root, None, "server", own_s=1.0, reaped_s=2.5)])
    assert account.by_kind() == {"server": 1.0, "EngineCore": 2.5}
