#!/usr/bin/env python
"""What a KV connector costs on this machine: start-up, request latency, CPU burnt while idle.

For each `--kv-connector` given, starts one topology (default 1P+1D) exactly as `epd-harness
run` would (same preflight, same instance flags), sends the image prompt `--requests` times,
then leaves it idle for `--idle` seconds and reads the CPU time each instance's process tree
used meanwhile (psutil, children included: vLLM's engine core and NIXL's threads live in child
processes), and which threads used it (by name, from /proc: NIXL's progress thread is not one
of vLLM's). `--idle-before` measures the same before the first request, i.e. before any NIXL
handshake. Instances inherit this process's environment, so a UCX_* or NIXL_* variable set
for the script reaches NIXL; the ones set are recorded with the figures. After stopping, it
checks that every HTTP and NIXL side-channel port it used is free again. The verdicts come from
`epd-harness run`; this only measures. docs/connectors.md.

    flock /tmp/epd-vllm.lock .venv/bin/python scripts/connector_costs.py \\
        --kv-connector example --kv-connector nixl [--topology 1E+1P+1D] [--out costs.json]
"""

from __future__ import annotations

import argparse
import json
import os
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
    """User + system CPU seconds of a process and all its descendants so far, with those of
    the descendants that ended and were reaped (each process's `children_*` times): a helper
    that ends between two samples must not take the CPU it used out of the later one."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
            total += times.user + times.system + times.children_user + times.children_system
        except psutil.NoSuchProcess:
            pass
    return total


def tree_thread_cpu_seconds(pid: int) -> dict[tuple[int, str], float]:
    """CPU seconds so far of every thread of a process tree, keyed by (thread id, thread name).
    Linux only (/proc/<pid>/task/<tid>/stat: utime and stime, fields 14 and 15, in ticks)."""
    try:
        root = psutil.Process(pid)
        pids = [root.pid, *(child.pid for child in root.children(recursive=True))]
    except psutil.NoSuchProcess:
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    threads: dict[tuple[int, str], float] = {}
    for process_id in pids:
        for task in Path(f"/proc/{process_id}/task").glob("*"):
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue
            # The name sits in parentheses and may hold spaces: split after the last ')'.
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            if int(task.name) == process_id:
                name += " (main thread)"  # threads inherit the name the process had
            fields = stat[stat.rindex(")") + 2 :].split()
            threads[(int(task.name), name)] = (int(fields[11]) + int(fields[12])) / tick
    return threads


def idle_cpu(pids: dict[str, int], seconds: float) -> tuple[dict[str, float], dict[str, list]]:
    """% of one core each instance's tree used over `seconds` of idling, and its three hottest
    threads as (name, %)."""
    before = {name: tree_cpu_seconds(pid) for name, pid in pids.items()}
    threads_before = {name: tree_thread_cpu_seconds(pid) for name, pid in pids.items()}
    time.sleep(seconds)
    percent = {
        name: round(100.0 * (tree_cpu_seconds(pids[name]) - used) / seconds, 1)
        for name, used in before.items()
    }
    hottest: dict[str, list] = {}
    for name, pid in pids.items():
        after = tree_thread_cpu_seconds(pid)
        used = {key: after[key] - threads_before[name].get(key, 0.0) for key in after}
        top = sorted(used.items(), key=lambda item: item[1], reverse=True)[:3]
        hottest[name] = [(key[1], round(100.0 * cpu / seconds, 1)) for key, cpu in top]
    return percent, hottest


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


def measure(
    connector: str,
    topology_name: str,
    requests: int,
    idle_s: float,
    run_dir: Path,
    idle_before_s: float = 0.0,
):
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
        pids = {spec.name: server.pid for spec, server in zip(session.instances, session.servers)}
        pids = {name: pid for name, pid in pids.items() if pid}
        idle_before, hottest_before = idle_cpu(pids, idle_before_s) if idle_before_s else ({}, {})
        latencies, cached, errors = [], [], []
        for _ in range(requests):
            outcome = session.send("image", body)
            if outcome.result is not None:  # a failed request is an error, not a latency
                latencies.append(round(outcome.seconds, 3))
                cached.append(outcome.result.cached_tokens)
            else:
                errors.append((outcome.error or "")[:300])
        idle, hottest = idle_cpu(pids, idle_s)
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
        "idle_cpu_percent_before_first_request": idle_before,
        "hottest_threads_before_first_request": hottest_before,
        "idle_s": idle_s,
        "idle_cpu_percent": idle,
        "hottest_threads": hottest,
        "environment": {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_"))},
        "ports_free_after_stop": {port: port_is_free(port) for port in ports},
        "total_s": round(stopped_s, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-connector", action="append", required=True)
    parser.add_argument("--topology", default="1P+1D")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--idle", type=float, default=10.0, help="idle seconds measured")
    parser.add_argument(
        "--idle-before",
        type=float,
        default=0.0,
        help="idle seconds measured before the first request (0: not measured)",
    )
    parser.add_argument("--run-dir", default="runs/connector-costs")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    figures = []
    for connector in args.kv_connector:
        run_dir = Path(args.run_dir) / f"{connector}-{time.strftime('%H%M%S')}"
        figures.append(
            measure(connector, args.topology, args.requests, args.idle, run_dir, args.idle_before)
        )
        print(json.dumps(figures[-1], indent=1), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
