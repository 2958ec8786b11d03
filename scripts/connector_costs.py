#!/usr/bin/env python
"""What a KV connector costs on this machine: start-up, request latency, CPU burnt while idle.

For each `--kv-connector` given, starts one topology (default 1P+1D) exactly as `epd-harness
run` would (same preflight, same instance flags), sends the image prompt `--requests` times,
then leaves it idle for `--idle` seconds and reads the CPU time each instance's process tree
used meanwhile (psutil, children included: vLLM's engine core and NIXL's threads live in child
processes). After stopping, it checks that every HTTP and NIXL side-channel port it used is
free again. The verdicts come from `epd-harness run`; this only measures. docs/connectors.md.

    flock /tmp/epd-vllm.lock .venv/bin/python scripts/connector_costs.py \\
        --kv-connector example --kv-connector nixl [--topology 1E+1P+1D] [--out costs.json]
"""

from __future__ import annotations

import argparse
import json
import socket
import time
from pathlib import Path

import psutil

from harness.environment import LOOPBACK_HOST
from harness.preflight import RunRequest, prepare_run
from harness.serve.session import TopologySession
from harness.spec.prompts import SKELETON_PROMPTS, render_request
from harness.spec.topology import get_topology


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and all its descendants so far."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def port_is_free(port: int) -> bool:
    """Bindable as a server binds (SO_REUSEADDR): connections of the stopped server may still
    sit in TIME_WAIT, which does not keep the next server off the port."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((LOOPBACK_HOST, port))
        except OSError:
            return False
    return True


def measure(connector: str, topology_name: str, requests: int, idle_s: float, run_dir: Path):
    config = prepare_run(
        RunRequest(
            topologies=(topology_name,),
            prompts=("image",),
            run_dir=str(run_dir),
            kv_connector=connector,
            baseline_cache="off",
            count_tokens=False,
        )
    )
    body = render_request(
        next(p for p in SKELETON_PROMPTS if p.name == "image"),
        config.settings.serving.served_model_name,
    )
    started = time.monotonic()
    with TopologySession(get_topology(topology_name), config.settings) as session:
        ready_s = time.monotonic() - started
        startup = {name: stats.startup_s for name, stats in session.stats.items()}
        latencies, cached, errors = [], [], []
        for _ in range(requests):
            outcome = session.send("image", body)
            latencies.append(round(outcome.seconds, 3))
            if outcome.result is not None:
                cached.append(outcome.result.cached_tokens)
            else:
                errors.append((outcome.error or "")[:300])
        pids = {spec.name: server.pid for spec, server in zip(session.instances, session.servers)}
        before = {name: tree_cpu_seconds(pid) for name, pid in pids.items() if pid}
        time.sleep(idle_s)
        idle = {
            name: round(100.0 * (tree_cpu_seconds(pids[name]) - used) / idle_s, 1)
            for name, used in before.items()
        }
        ports = [spec.port for spec in session.instances]
        ports += [s.side_channel_port for s in session.instances if s.side_channel_port]
    stopped_s = time.monotonic() - started
    time.sleep(1.0)
    return {
        "connector": connector,
        "topology": topology_name,
        "ready_s": round(ready_s, 1),
        "startup_s": startup,
        "request_s": latencies,
        "cached_tokens": cached,
        "errors": errors,
        "idle_cpu_percent": idle,
        "ports_free_after_stop": {port: port_is_free(port) for port in ports},
        "total_s": round(stopped_s, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-connector", action="append", required=True)
    parser.add_argument("--topology", default="1P+1D")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--idle", type=float, default=10.0, help="idle seconds measured")
    parser.add_argument("--run-dir", default="runs/connector-costs")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    figures = []
    for connector in args.kv_connector:
        run_dir = Path(args.run_dir) / f"{connector}-{time.strftime('%H%M%S')}"
        figures.append(measure(connector, args.topology, args.requests, args.idle, run_dir))
        print(json.dumps(figures[-1], indent=1), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
