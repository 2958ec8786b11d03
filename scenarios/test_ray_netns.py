"""The rehearsal that fails like a real cluster: every Ray node in a network namespace of its own.

On loopback addresses every node shares one `lo`, so a NIXL side channel announced as
`localhost` still reaches P, and a forgotten host setting passes. Here each node (and the
harness, inside the head's namespace) has its own `lo`: `localhost` is the node itself, as on
separate machines. Three runs of `epd-harness run --launcher ray --kv-connector nixl` on 1P+1D,
P and D on two nodes:

1. as rendered: MATCH, the KV guard held across the namespaces;
2. every instance told `VLLM_NIXL_SIDE_CHANNEL_HOST=localhost`: refused before any start,
   ERROR naming the instance and the variable;
3. the same with the harness's network checks off (`EPD_HARNESS_NETWORK_CHECKS=off`): what the
   misconfiguration does to vLLM itself when nobody stops it. Never MATCH.

Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN), iproute2 and nsenter, Ray and NIXL; without them it
fails with one line, never skips.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.environment import NETWORK_CHECKS_ENV
from harness.serve.launch import ManagedServer
from harness.serve.server_command import ServerCommand
from harness.serve.server_log import log_path_for

# It builds its own rehearsal cluster, in namespaces of this host: the cpu platform's.
pytestmark = [pytest.mark.e2e, pytest.mark.one_host_rehearsal]

REPO_ROOT = Path(__file__).resolve().parents[1]
CLUSTER_START_S = 180.0
RUN_TIMEOUT_S = 900.0
LOCALHOST = "VLLM_NIXL_SIDE_CHANNEL_HOST=localhost"


@pytest.fixture(scope="module")
def netns_cluster(epd_run_dir: Path) -> Iterator[tuple[str, list[str], Path]]:
    """(address, driver prefix, work dir) of a rehearsal cluster in network namespaces."""
    missing = [tool for tool in ("ip", "nsenter", "unshare") if shutil.which(tool) is None]
    if missing or os.geteuid() != 0:
        pytest.fail(
            f"epd-harness: the netns rehearsal needs root and {', '.join(missing) or 'iproute2'}",
            pytrace=False,
        )
    work = epd_run_dir / "ray-netns"
    ready = work / "ready.txt"
    work.mkdir(parents=True, exist_ok=True)
    cluster = ManagedServer(
        ServerCommand(
            name="ray-netns-cluster",
            argv=[sys.executable, "-m", "harness.serve.ray_cluster", "up", "--netns",
                  "--work-dir", str(work), "--ready-file", str(ready)],
            health_url="",
            log_path=work / "cluster.log",
            env={"PYTHONPATH": str(REPO_ROOT)},
        )
    )  # fmt: skip
    cluster.start()
    try:
        deadline = time.monotonic() + CLUSTER_START_S
        while not ready.exists():
            cluster.check_alive()
            assert time.monotonic() < deadline, cluster.log_tail()
            time.sleep(0.5)
        address, prefix, _ = ready.read_text(encoding="utf-8").splitlines()
        # Ready by its ready file, not a health URL: marked so, its stop gets the 30 s below
        # (a never-ready server gets 3 s, and `up` was SIGKILLed while it stopped its nodes).
        cluster.mark_ready()
        yield address, prefix.split(), work
    finally:
        cluster.stop(30.0)  # SIGTERM: it stops its nodes, the namespaces go with them


def run_in_head(
    netns_cluster: tuple[str, list[str], Path], label: str, *extra: str, env: dict | None = None
) -> tuple[int, str, dict]:
    address, prefix, work = netns_cluster
    run_dir = work / label
    argv = [*prefix, sys.executable, "-m", "harness.cli.main", "run", "--launcher", "ray",
            "--ray-address", address, "--kv-connector", "nixl", "--topology", "1P+1D",
            "--prompt", "text", "--run-dir", str(run_dir), *extra]  # fmt: skip
    done = subprocess.run(
        argv,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})},
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    output = done.stdout + done.stderr
    print(f"\n--- {label} (exit {done.returncode}) ---\n{output[-4000:]}")
    summary = run_dir / "summary.json"
    cases = json.loads(summary.read_text())["cases"] if summary.exists() else []
    return done.returncode, output, (cases[0] if cases else {})


def test_in_namespaces_1p1d_over_nixl_matches(netns_cluster) -> None:
    code, output, case = run_in_head(netns_cluster, "as-rendered")
    assert code == 0 and case.get("verdict") == "MATCH", output[-3000:]
    assert case["guards"]["kv_transfer"]["ok"], case["guards"]
    # Where P and D ran, as their launcher read it back there: two nodes, neither the head.
    address, _, work = netns_cluster
    head = address.rsplit(":", 1)[0]
    ran_on = {
        name: json.loads(
            log_path_for(work / "as-rendered" / "1P-1D", f"1P+1D/{name}")
            .with_suffix(".cmd.json")
            .read_text(encoding="utf-8")
        )["node"]["address"]
        for name in ("prefill0", "decode0")
    }
    assert len(set(ran_on.values())) == 2 and head not in ran_on.values(), (head, ran_on)


def test_in_namespaces_localhost_is_refused_by_the_checks(netns_cluster) -> None:
    code, output, case = run_in_head(netns_cluster, "localhost", "--ray-instance-env", LOCALHOST)
    assert code == 1 and case.get("verdict") == "ERROR", output[-3000:]
    assert "1P+1D/prefill0: VLLM_NIXL_SIDE_CHANNEL_HOST is 'localhost'" in case["error"]


def test_in_namespaces_localhost_unchecked_never_matches(netns_cluster) -> None:
    """With the checks off, vLLM gets the misconfiguration: what happens is printed."""
    code, output, case = run_in_head(
        netns_cluster,
        "localhost-unchecked",
        "--ray-instance-env",
        LOCALHOST,
        env={NETWORK_CHECKS_ENV: "off"},
    )
    assert code != 0 and case.get("verdict") != "MATCH", output[-3000:]
    print(f"verdict {case.get('verdict')}: {case.get('detail')}\n{case.get('error') or ''}")
    # What vLLM itself did: D asked "localhost" (itself) for P's NIXL metadata, and failed.
    decode_log = netns_cluster[2] / "localhost-unchecked" / "1P-1D" / "1P-1D__decode0.log"
    assert "handshake_failed" in decode_log.read_text(errors="replace"), decode_log
