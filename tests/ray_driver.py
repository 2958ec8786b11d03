"""A harness stand-in for the Ray launcher's kill tests: one topology up on a Ray cluster.

argv: vllm, model, run dir, topology, cluster address ("" to start a one-host rehearsal
cluster itself), KV connector class, then NAME=VALUE pairs given to every instance (the
instances run on the nodes, in their agents' environment, not in this one's). Prints one JSON line once every instance is healthy
(each server's name, pid and node, its agent's pid, its server's descendants), then checks
the instances like a harness between requests until it is killed or one dies; with
`IDLE_ENV=1` it only waits, so that several instances can be killed one way each.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import psutil

from harness.serve.launch import install_signal_handlers
from harness.serve.launcher import end_launchers
from harness.serve.session import TopologySession
from harness.spec.platforms import CPU
from harness.spec.settings import RAY_LAUNCHER, LauncherChoice, RunSettings, ServedVllm
from harness.spec.topology import TOPOLOGIES, serving_for

IDLE_ENV = "EPD_RAY_DRIVER_IDLE"


def main() -> None:
    vllm, model, run_dir, topology, address, kv = sys.argv[1:7]
    instance_env = tuple(tuple(pair.split("=", 1)) for pair in sys.argv[7:])
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
            while os.environ.get(IDLE_ENV) == "1":
                time.sleep(1)
            while True:
                for server in session.servers:
                    server.check_alive()
                time.sleep(0.2)
    finally:
        end_launchers()


if __name__ == "__main__":
    main()
