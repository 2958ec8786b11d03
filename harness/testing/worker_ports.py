"""Each xdist worker picks ports from a slice of the job's range of its own.

A test that leases ports from a lock directory of its own (`port_locks`) hands a port to a
server it starts, and between the release and the server's bind (an interpreter's start, a
second under load) no other process can see the lease: another worker's harness could pick the
same port, and the server failed with EADDRINUSE (seen twice: once in CI, once hunting flakes).
Within one worker the tests run one at a time, so disjoint slices per worker leave no such
window between workers. Subprocesses inherit the slice through EPD_HARNESS_PORT_RANGE.

The controller hands each worker its slice's index (`pytest_configure_node`): xdist replaces a
crashed worker with one of a new id (gw2 of two workers), whose number read as the index took a
slice past the job's range (30000-34999 of 20000-29999: another job's ports; past 65535 after a
few crashes) or into the last worker's where the range does not divide evenly. It takes the
crashed worker's slice, freed as that worker went down (`pytest_testnodedown`).
"""

from __future__ import annotations

import os

import pytest

from harness.environment import PORT_RANGE_ENV, port_range

WORKER_ENV = "PYTEST_XDIST_WORKER"  # "gw0", "gw1", ... set by xdist before pytest configures
WORKER_COUNT_ENV = "PYTEST_XDIST_WORKER_COUNT"
# The worker whose slice EPD_HARNESS_PORT_RANGE holds: a pytest a test runs inside the worker
# (pytester, in its process or a child) configures again and must neither slice the slice nor
# a range the test set for itself (a one-port range refused, the worker's environment narrowed
# for every later test: seen in the unit suite).
SLICED_FOR_ENV = "EPD_HARNESS_PORT_SLICE_OF"
WORKER_SLICE = "epd_port_slice"  # how the controller hands a worker its slice's index
# On the controller: worker id -> the index of its slice, for every worker not yet down.
SLICES_KEY = pytest.StashKey[dict]()


def worker_slice(ports: range, worker: int, workers: int) -> range:
    """The `worker`th of `workers` equal, disjoint slices of `ports` (the last takes the rest)."""
    size = len(ports) // workers
    if size < 1:
        raise pytest.UsageError(
            f"{PORT_RANGE_ENV} holds {len(ports)} port(s), fewer than the {workers} xdist workers"
        )
    start = ports.start + worker * size
    stop = ports.stop if worker == workers - 1 else start + size
    return range(start, stop)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:  # xdist, on the controller
    """The lowest slice no live worker holds: a worker that replaces a crashed one takes the
    crashed one's."""
    held = node.config.stash.setdefault(SLICES_KEY, {})
    index = next(n for n in range(len(held) + 1) if n not in held.values())
    held[node.gateway.id] = index
    node.workerinput[WORKER_SLICE] = index


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # xdist, on the controller
    node.config.stash.get(SLICES_KEY, {}).pop(node.gateway.id, None)


def pytest_configure(config: pytest.Config) -> None:
    worker = os.environ.get(WORKER_ENV, "")
    if not worker.startswith("gw"):
        return  # not an xdist worker: the whole range, as a harness run has it
    if os.environ.get(SLICED_FOR_ENV) == worker:
        return  # a pytest inside this worker's test: the range is the test's to set
    index = getattr(config, "workerinput", {}).get(WORKER_SLICE)
    if index is None:  # a controller without this plugin: the worker's number
        index = int(worker.removeprefix("gw"))
    ports = worker_slice(port_range(), index, int(os.environ.get(WORKER_COUNT_ENV, "1")))
    os.environ[PORT_RANGE_ENV] = f"{ports.start}-{ports.stop - 1}"
    os.environ[SLICED_FOR_ENV] = worker
