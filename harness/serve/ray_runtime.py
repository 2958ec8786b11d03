"""The Ray connection a run holds across its topologies, in a module of its own: each Ray
topology's launcher connects through it, and `harness.serve.launcher.end_launchers` closes it
when the run ends, finding it by this module's name (a run that never chose Ray imports no
Ray). Also the cluster's live nodes, as a refusal names them."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray

from harness.serve.launcher import LaunchRefused
from harness.serve.ray_cluster import USAGE_STATS_ENV, LocalRayCluster, rehearsal_addresses
from harness.spec.settings import LauncherChoice

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0
REHEARSAL_DIR = "ray-cluster"
# How long the head's GCS port is given to accept a connection before `ray.init`, which on an
# address nothing listens at retries on its own, warning every 30 s (real vLLM: `load
# --launcher ray --ray-address 127.0.0.9:1` was still retrying after 214 s, no error said).
GCS_CONNECT_TIMEOUT_S = 10.0


@contextlib.contextmanager
def sigterm_kept() -> Iterator[None]:
    """SIGTERM handled after `ray.init` as before it. Ray's init sets a Python handler that
    calls sys.exit, and its driver's core worker then puts a C-level handler over it that logs
    the signal and ends the process a moment later. Found on real vLLM: SIGTERM to `run
    --launcher ray` (CI cancelling a job) stopped one instance, then the harness died without
    its "interrupted" line, its rehearsal cluster left to the watchdog and a node's scratch
    directory to nobody. Setting the handler again puts Python's own C-level handler back
    (only the main thread may, as only it handles signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if before is not None:  # None: set outside Python, which cannot be put back
            signal.signal(signal.SIGTERM, before)


class RayRuntime:
    """The harness's one connection to its cluster: opened at the first Ray topology, closed
    when the run ends (`close_runtime`, also at exit). Without `--ray-address` it first starts
    the one-host rehearsal cluster (`harness.serve.ray_cluster`) and stops it at close."""

    def __init__(self) -> None:
        self.cluster: LocalRayCluster | None = None
        self.address: str | None = None
        self._at_exit = False

    def connect(self, choice: LauncherChoice, run_dir: Path) -> None:
        if ray.is_initialized():
            wanted = choice.ray_address
            if wanted is not None and self.address is not None and wanted != self.address:
                raise LaunchRefused(
                    f"--ray-address {wanted}: this harness is connected to {self.address}; "
                    "one run, one cluster"
                )
            started = self.cluster
            if started is not None and len(started.addresses) < choice.rehearsal_nodes:
                raise LaunchRefused(
                    f"the rehearsal cluster this harness started has {len(started.addresses)} "
                    f"nodes, and this run keeps {choice.rehearsal_nodes} instances up at once; "
                    "one run, one cluster"
                )
            return
        os.environ[USAGE_STATS_ENV] = "0"
        if not self._at_exit:
            atexit.register(close_runtime)
            self._at_exit = True
        node_ip = None
        expected_nodes = 1
        if choice.ray_address is None:
            cluster = LocalRayCluster(
                run_dir / REHEARSAL_DIR, rehearsal_addresses(choice.rehearsal_nodes)
            )
            log.info("[ray] starting a one-host cluster: nodes %s", ", ".join(cluster.addresses))
            try:
                cluster.start()
            except BaseException:
                with contextlib.suppress(Exception):
                    cluster.stop()
                raise
            self.cluster = cluster
            self.address, node_ip = cluster.address, cluster.driver_address
            expected_nodes = len(cluster.addresses)
        else:
            problem = gcs_problem(choice.ray_address)
            if problem is not None:
                raise LaunchRefused(
                    f"--ray-address {choice.ray_address}: no Ray cluster answers there "
                    f"({problem}); start its head (`ray start --head`) or give the address "
                    "it printed"
                )
            self.address = choice.ray_address
            host = self.address.rsplit(":", 1)[0]
            # Ray takes a driver's loopback address for the host's routable one: say which.
            node_ip = host if host.startswith("127.") else None
        try:
            with sigterm_kept():
                ray.init(
                    address=self.address,
                    _node_ip_address=node_ip,
                    log_to_driver=False,
                    namespace=f"epd-harness-{os.getpid()}",
                )
        except Exception as exc:
            address = self.address  # named before close() forgets it
            self.close()
            first = (str(exc).strip().splitlines() or [""])[0]
            raise LaunchRefused(
                f"cannot connect to the Ray cluster at {address}: {type(exc).__name__}: {first}"
            ) from None
        except BaseException:
            self.close()
            raise
        deadline = time.monotonic() + PLACEMENT_TIMEOUT_S
        while len(alive_nodes()) < expected_nodes and time.monotonic() < deadline:
            time.sleep(0.2)
        log.info("[ray] connected to %s: nodes %s", self.address, describe_nodes())

    def log_memory(self) -> None:
        """The rehearsal cluster's RSS per node (its workers and the agents' servers
        included), for the record: on a small machine the cluster is part of the budget."""
        if self.cluster is not None:
            rss = self.cluster.memory_bytes()
            log.info(
                "[ray] RSS per node (Ray's processes, agents and their vLLM servers): %s; "
                "total %.1f GB",
                ", ".join(f"{node} {size / 1e9:.1f} GB" for node, size in rss.items()),
                sum(rss.values()) / 1e9,
            )

    def close(self) -> None:
        """Disconnect, then stop the rehearsal cluster if this harness started it (also when
        the disconnect raised: the cluster is forgotten here, so nothing else would)."""
        cluster, self.cluster = self.cluster, None
        self.address = None
        try:
            if ray.is_initialized():
                ray.shutdown()
        finally:
            if cluster is not None:
                cluster.stop()


_RUNTIME = RayRuntime()


def runtime() -> RayRuntime:
    return _RUNTIME


def close_runtime() -> None:
    """End the run's Ray connection (and its rehearsal cluster); harmless when there is none."""
    _RUNTIME.close()


def gcs_problem(address: str, timeout_s: float = GCS_CONNECT_TIMEOUT_S) -> str | None:
    """Why nothing accepts a connection at a cluster head's `HOST:PORT` (None: something
    does, which `ray.init` then speaks to)."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        return f"connect: {exc.strerror or exc}"
    return None


def alive_nodes() -> list[dict[str, Any]]:
    return [node for node in ray.nodes() if node.get("Alive")]


def describe_nodes() -> str:
    nodes = alive_nodes()
    parts = [
        f"{n['NodeManagerAddress']} (CPU {n['Resources'].get('CPU', 0):g}"
        + (f", GPU {n['Resources']['GPU']:g}" if n["Resources"].get("GPU") else "")
        + ")"
        for n in nodes
    ]
    return f"{len(nodes)} alive: " + ", ".join(parts)
