"""A harness stand-in for the Ray launcher's kill tests: one topology up on a Ray cluster.

`python -m harness.testing.ray_driver [--idle]` with argv: vllm, model, run dir, topology, cluster
address ("" to start a one-host rehearsal cluster itself), KV connector class, then NAME=VALUE
pairs given to every instance (the instances run on the nodes, in their agents' environment,
not in this one's). Prints one JSON line once every instance is healthy (each server's name,
pid and node, its agent's pid, its server's descendants), then checks the instances like a
harness between requests until it is killed or one dies; with `--idle` it only waits, so
that several instances can be killed one way each. `start_driver` runs it for a test; the
helpers below find what a kill test kills (a node's raylet) and watches (a process tree).
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil

from harness.serve.launch import ServerDied
from harness.serve.launcher import end_launchers
from harness.serve.ray_cluster import LocalRayCluster
from harness.serve.session import TopologySession
from harness.serve.signal_handlers import install_signal_handlers
from harness.spec.platforms import CPU
from harness.spec.settings import RAY_LAUNCHER, LauncherChoice, RunSettings, ServedVllm
from harness.spec.topology import TOPOLOGIES, serving_for
from harness.testing.processes import child_env

IDLE_FLAG = "--idle"
DIED_KEY = "died"  # the line a driver prints once it found an instance dead


def start_driver(
    args: Sequence[str], idle: bool = False, env: Mapping[str, str] | None = None
) -> tuple[subprocess.Popen[str], dict]:
    """The driver with `args` (see above), once every instance is healthy: the process and
    what it printed; a driver that ends early fails the test with its last lines."""
    driver = subprocess.Popen(
        [sys.executable, "-m", "harness.testing.ray_driver", *([IDLE_FLAG] if idle else []), *args],
        env={**child_env(), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert driver.stdout is not None
    lines = []
    for line in driver.stdout:
        lines.append(line)
        if line.startswith('{"servers"'):
            return driver, json.loads(line)
    driver.wait()
    raise AssertionError(f"the driver ended early ({driver.returncode}):\n{''.join(lines[-60:])}")


def reported_death(driver: subprocess.Popen[str], timeout_s: float) -> str | None:
    """What the driver said when it found an instance dead (the harness's ServerDied), as soon
    as it says it; None if it ended, or `timeout_s` passed, without saying so."""
    said: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        try:
            for line in driver.stdout or ():
                if line.startswith(f'{{"{DIED_KEY}"'):
                    said.put(json.loads(line)[DIED_KEY])
                    return
        except (OSError, ValueError):  # end_driver closed the pipe
            pass
        said.put(None)

    threading.Thread(target=read, daemon=True).start()
    try:
        return said.get(timeout=timeout_s)
    except queue.Empty:
        return None


def end_driver(driver: subprocess.Popen[str]) -> None:
    driver.kill()
    driver.wait()
    if driver.stdout is not None:
        driver.stdout.close()


def tree_of(pid: int) -> list[psutil.Process]:
    """A process and its descendants now."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def raylet_of(cluster: LocalRayCluster, address: str) -> psutil.Process:
    """The raylet of the rehearsal cluster's node at `address`."""
    node = next(n for n in cluster.nodes if n.address == address)
    raylets = [p for p in tree_of(node.server.pid) if p.name() == "raylet"]
    assert len(raylets) == 1, raylets
    return raylets[0]


def main() -> None:
    args = sys.argv[1:]
    idle = args[:1] == [IDLE_FLAG]
    args = args[1:] if idle else args
    vllm, model, run_dir, topology, address, kv = args[:6]
    instance_env = tuple(tuple(pair.split("=", 1)) for pair in args[6:])
    install_signal_handlers()
    settings = RunSettings(
        serving=serving_for(CPU, model, kv_connector=kv),
        run_dir=Path(run_dir),
        vllm=ServedVllm(vllm, "unknown"),
        launcher=LauncherChoice(
            RAY_LAUNCHER, ray_address=address or None, instance_env=instance_env
        ),
    )
    try:
        with TopologySession(TOPOLOGIES[topology], settings) as session:
            servers = []
            for server in session.servers:
                tree = psutil.Process(server.pid).children(recursive=True)
                servers.append(
                    {
                        "name": server.name,
                        "pid": server.pid,
                        "node": server.node.address,
                        "agent": server.agent_pid,
                        "tree": [p.pid for p in tree],
                    }
                )
            print(json.dumps({"servers": servers}), flush=True)
            while idle:
                time.sleep(1)
            while True:
                for server in session.servers:
                    try:
                        server.check_alive()
                    except ServerDied as died:
                        # Said at once: the session's close that follows gives a server that
                        # ignores SIGTERM its whole stop grace before the driver ends.
                        print(json.dumps({DIED_KEY: str(died)}), flush=True)
                        raise
                time.sleep(0.2)
    finally:
        end_launchers()


if __name__ == "__main__":
    main()
