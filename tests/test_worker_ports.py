"""Each xdist worker's own slice of the port range (harness/testing/worker_ports.py)."""

from __future__ import annotations

import os

import pytest

from harness.environment import DEFAULT_PORT_RANGE, PORT_RANGE_ENV, port_range
from harness.testing.worker_ports import WORKER_ENV, worker_slice

pytestmark = pytest.mark.unit


def test_the_slices_are_disjoint_and_cover_the_range() -> None:
    slices = [worker_slice(DEFAULT_PORT_RANGE, worker, 3) for worker in range(3)]
    assert slices[0] == range(20000, 23333) and slices[2].stop == DEFAULT_PORT_RANGE.stop
    assert sorted(p for s in slices for p in s) == list(DEFAULT_PORT_RANGE)


def test_a_range_smaller_than_the_workers_is_refused() -> None:
    with pytest.raises(pytest.UsageError, match="holds 2 port"):
        worker_slice(range(24000, 24002), 0, 4)


def test_a_worker_picks_from_its_own_slice_only() -> None:
    """Under xdist (as CI runs the tests) the slice is this worker's; alone, the whole range."""
    worker = os.environ.get(WORKER_ENV, "")
    if not worker.startswith("gw"):
        assert port_range() == DEFAULT_PORT_RANGE or PORT_RANGE_ENV in os.environ
        return
    count = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    assert count == 1 or len(port_range()) < len(DEFAULT_PORT_RANGE)
    assert port_range() == worker_slice(DEFAULT_PORT_RANGE, int(worker[2:]), count)


def test_a_pytest_inside_a_worker_leaves_the_range_alone(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A test that sets a one-port range and runs pytest inside the worker (pytester): the
    inner run's configure sliced it again ("holds 1 port(s), fewer than the 2 xdist workers")
    and narrowed the worker's environment for every later test (seen in the unit suite)."""
    from harness.testing import worker_ports

    monkeypatch.setenv(WORKER_ENV, "gw1")
    monkeypatch.setenv(worker_ports.WORKER_COUNT_ENV, "2")
    monkeypatch.setenv(PORT_RANGE_ENV, "20000-29999")
    monkeypatch.delenv(worker_ports.SLICED_FOR_ENV, raising=False)
    worker_ports.pytest_configure(pytester.parseconfig())  # the worker's own configure
    assert os.environ[PORT_RANGE_ENV] == "25000-29999"
    monkeypatch.setenv(PORT_RANGE_ENV, "24000-24000")  # a test's own range
    worker_ports.pytest_configure(pytester.parseconfig())  # a pytest inside that test
    assert os.environ[PORT_RANGE_ENV] == "24000-24000"


def test_a_worker_replacing_a_crashed_one_takes_the_crashed_ones_slice() -> None:
    """Whichever worker crashed, its replacement takes its slice, never a live worker's: with
    gw0 down and gw1 alive, gw2 takes slice 0 (gw1 keeps 1); with gw1 down, slice 1."""
    from types import SimpleNamespace

    from harness.testing.worker_ports import (
        WORKER_SLICE,
        pytest_configure_node,
        pytest_testnodedown,
    )

    for crashed, freed in (("gw0", 0), ("gw1", 1)):
        config = SimpleNamespace(stash=pytest.Stash())

        def node(worker: str, config: SimpleNamespace = config) -> SimpleNamespace:
            return SimpleNamespace(
                config=config, gateway=SimpleNamespace(id=worker), workerinput={}
            )

        started = {worker: node(worker) for worker in ("gw0", "gw1")}
        for worker in started.values():
            pytest_configure_node(worker)
        assert [w.workerinput[WORKER_SLICE] for w in started.values()] == [0, 1]
        pytest_testnodedown(started[crashed], error=None)
        replacement = node("gw2")
        pytest_configure_node(replacement)
        assert replacement.workerinput[WORKER_SLICE] == freed, crashed
