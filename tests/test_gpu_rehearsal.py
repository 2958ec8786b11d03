"""scripts/gpu_rehearsal.py, as far as it can be tried without a GPU: it refuses clearly, its
pytest line is the GitHub nightly's own, its workers are the xdist groups its plan serves side
by side, and its summary says
what the run's summary.json files hold."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness.spec.topology import DEFAULT_DTYPE

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_rehearsal.py"
WORKFLOW = ROOT / ".github" / "workflows" / "nightly-gpu.yml"


def load_rehearsal():
    spec = importlib.util.spec_from_file_location("gpu_rehearsal", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(*args: str, path: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": path}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120
    )


def fake_nvidia_smi(directory: Path, body: str) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    tool = directory / "nvidia-smi"
    tool.write_text(f"#!/bin/sh\n{body}\n")
    tool.chmod(0o755)
    return f"{directory}:/usr/bin:/bin"


def workflow_pytest(inputs: dict[str, str], tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """What the nightly's "EPD scenarios" step gives pytest, its arguments and the variables it
    exports for it: its bash run with a python that records both (independent of the
    rehearsal's own reading of the step)."""
    workflow = yaml.safe_load(WORKFLOW.read_text())
    (step,) = [s for s in workflow["jobs"]["gpu"]["steps"] if s.get("name") == "EPD scenarios"]
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(
        '#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done > "$OUT"\n'
        'printf "%s\\n" "${EPD_VLLM_SOURCE-unset}" > "$OUT.source"\n'
    )
    python.chmod(0o755)
    out = tmp_path / "args.txt"
    env = {"PATH": "/usr/bin:/bin", "VENV": str(venv), "OUT": str(out), **inputs}
    subprocess.run(["bash", "-e", "-c", step["run"]], env=env, check=True, cwd=tmp_path)
    args = out.read_text().splitlines()
    assert args[:2] == ["-m", "pytest"]
    source = Path(f"{out}.source").read_text().rstrip("\n")
    return args[2:], ({} if source == "unset" else {"EPD_VLLM_SOURCE": source})


def workflow_pytest_args(inputs: dict[str, str], tmp_path: Path) -> list[str]:
    return workflow_pytest(inputs, tmp_path)[0]


# --- refusals --------------------------------------------------------------------------------


def test_without_nvidia_smi_it_refuses_in_one_line(tmp_path: Path) -> None:
    done = run_script(path=f"{tmp_path}:/usr/bin:/bin")
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == (
        "gpu-rehearsal: no GPU here (no nvidia-smi on PATH): this rehearses the first GPU "
        "night; on CPU run scripts/cpu sweep\n"
    )


def test_an_nvidia_smi_that_lists_no_gpu_is_refused_naming_what_it_said(tmp_path: Path) -> None:
    path = fake_nvidia_smi(
        tmp_path / "bin",
        "echo 'NVIDIA-SMI has failed because it could not communicate' >&2; exit 9",
    )
    done = run_script(path=path)
    assert done.returncode == 2
    assert done.stderr.startswith("gpu-rehearsal: no GPU here (nvidia-smi: NVIDIA-SMI has failed")
    assert done.stderr.count("\n") == 1


def test_a_python_without_the_test_extra_is_refused_before_the_model_is_fetched() -> None:
    """A vLLM developer's own environment had vLLM but not the harness's test extra: the
    rehearsal fetched the model, ran doctor and plan, and only then pytest stopped at `-n`."""
    rehearsal = load_rehearsal()
    lacking = {"xdist", "hypothesis"}
    with pytest.raises(rehearsal.Refused) as caught:
        rehearsal.check_test_extra(lambda module: None if module in lacking else object())
    message = str(caught.value)
    assert "lacks pytest-xdist, hypothesis" in message and "'.[test]'" in message, message
    rehearsal.check_test_extra()  # this environment has the extra


def test_the_extra_is_checked_before_anything_is_fetched(tmp_path: Path, monkeypatch) -> None:
    rehearsal = load_rehearsal()
    calls: list[str] = []
    monkeypatch.setattr(rehearsal, "gpus_here", lambda: [0, 1])
    monkeypatch.setattr(rehearsal, "check_test_extra", lambda: calls.append("extra"))
    monkeypatch.setattr(rehearsal, "fetch_model", lambda name: calls.append("fetch") or 1 / 0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(ZeroDivisionError):
        rehearsal.main(["--devices", "0,1", "--run-name", "x"])
    assert calls == ["extra", "fetch"]


def test_bfloat16_on_a_t4_is_refused_in_one_line_before_the_model_is_fetched(
    tmp_path: Path,
) -> None:
    """A T4 box rehearsed with the default dtype fetched the model (7.5 GB) and only then
    stopped at doctor, the cause one check among its others; `run` refuses it in one line
    naming the GPU and `--dtype float16`, and so does the rehearsal now, before any fetch.
    Its nvidia-smi answers both the rehearsal's index query and the capability query."""
    listing = "0, Tesla T4, 7.5\\n1, Tesla T4, 7.5\\n"
    path = fake_nvidia_smi(
        tmp_path / "bin",
        f"case \"$1\" in --query-gpu=index) printf '0\\n1\\n' ;; "
        f"--query-gpu=index,name,compute_cap) printf '{listing}' ;; *) exit 6 ;; esac",
    )
    # A model name would be fetched from the Hub: the refusal must come first.
    done = run_script("--model", "no-such-org/never-fetched", path=path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == "", done.stdout
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("gpu-rehearsal: --dtype bfloat16 (the default) needs"), done
    assert "GPU 0 (Tesla T4, compute capability 7.5)" in done.stderr
    assert done.stderr.endswith(": pass --dtype float16\n")
    # Named, it is not "the default" (found walking a T4 box).
    done = run_script("--model", "no-such-org/never-fetched", "--dtype", "bfloat16", path=path)
    assert (done.returncode, done.stdout) == (2, ""), done.stdout + done.stderr
    assert done.stderr.startswith("gpu-rehearsal: --dtype bfloat16 needs compute"), done


def test_devices_the_host_lacks_are_refused(tmp_path: Path) -> None:
    path = fake_nvidia_smi(tmp_path / "bin", "printf '0\\n1\\n'")
    done = run_script("--devices", "0,1,2,3", path=path)
    assert (done.returncode, done.stderr) == (
        2,
        "gpu-rehearsal: --devices 0,1,2,3: nvidia-smi lists no GPU 2, 3\n",
    )


def test_devices_an_inherited_cuda_visible_devices_did_not_give_are_refused(
    tmp_path: Path,
) -> None:
    """nvidia-smi ignores CUDA_VISIBLE_DEVICES, and the harness sets each instance's own from
    --devices: an agent given GPUs 2,3 and run with --devices 0,1 (or, by default, every GPU
    nvidia-smi lists) placed instances on GPUs it was not given."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "2,3"}
    argv = ["--dry-run", "--devices", "0,1", "--colocate", "--model", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(
        "gpu-rehearsal: --devices 0,1: CUDA_VISIBLE_DEVICES=2,3 gives this process no device 0,1"
    ), done.stderr
    assert done.stderr.count("\n") == 1, done.stderr


def test_by_default_the_rehearsal_takes_the_gpus_it_was_given() -> None:
    rehearsal = load_rehearsal()
    assert rehearsal.given_here([0, 1, 2, 3], {}) == [0, 1, 2, 3]
    assert rehearsal.given_here([0, 1, 2, 3], {"CUDA_VISIBLE_DEVICES": "3,2"}) == [2, 3]
    with pytest.raises(rehearsal.Refused, match="CUDA_VISIBLE_DEVICES=7 names none"):
        rehearsal.given_here([0, 1], {"CUDA_VISIBLE_DEVICES": "7"})


def test_a_dry_run_needs_the_devices_it_will_not_look_for(capsys) -> None:
    assert load_rehearsal().main(["--dry-run"]) == 2
    assert "--dry-run needs --devices" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "cause"),
    [
        (["--topology", ""], "--topology '' is empty: give a value, or leave --topology out"),
        (["--topology", ","], "--topology ',' is empty"),
        (["-k", " "], "-k ' ' is empty"),
        (["--run-name", ""], "--run-name '' is empty"),
        (["--run-name", "../x"], "--run-name '../x': a name, not a path"),
        (["--workers", "0"], "--workers 0: give 1 or more xdist workers"),
        (["--workers", "-3"], "--workers -3: give 1 or more xdist workers"),
    ],
)
def test_a_value_it_would_drop_or_hand_on_broken_is_refused(argv, cause, capsys) -> None:
    """An empty --topology or -k ran everything, an empty --run-name wrote into runs/ itself,
    --workers 0 ran one worker and -3 reached pytest as `-n -3` (found in review)."""
    assert load_rehearsal().main(["--dry-run", "--devices", "0,1", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gpu-rehearsal: {cause}") and err.count("\n") == 1, err


# --- the nightly's pytest line ---------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--colocate", "--topology", "1P+1D,1E+1P+1D", "-k", "image or video"],
        ["--no-enforce-eager", "--vllm-source", "/src/vllm", "--workers", "1"],
        ["--dtype", "float16"],  # a T4 / V100 box
    ],
    ids=["defaults", "colocate-topologies-k", "graphs-source", "float16"],
)
def test_the_pytest_line_is_the_nightly_workflows_own(
    extra: list[str], tmp_path: Path, capsys
) -> None:
    rehearsal = load_rehearsal()
    argv = ["--dry-run", "--devices", "0,1,2,3", "--model", "/models/qwen", "--run-name", "r1"]
    assert rehearsal.main([*argv, *extra]) == 0
    doctor, plan, pytest_line = capsys.readouterr().out.splitlines()
    ours = shlex.split(pytest_line)
    given = rehearsal.parse_args([*argv, *extra])
    workers = given.workers or rehearsal.useful_workers("0,1,2,3", given)
    inputs = {
        "RUN_NAME": "r1",
        "DEVICES": "0,1,2,3",
        "WORKERS": str(workers),
        "COLOCATE": "true" if given.colocate else "false",
        "TOPOLOGIES": given.topology or "",
        "SCENARIOS": given.k or "",
        "GRAPHS": "true" if given.no_enforce_eager else "false",
        "DTYPE": given.dtype or DEFAULT_DTYPE,  # the nightly's: every night names its dtype
        "EPD_MODEL_DIR": "/models/qwen",
        "VLLM_SOURCE": given.vllm_source or "",
    }
    theirs, exported = workflow_pytest(inputs, tmp_path)
    assignments = dict(word.split("=", 1) for word in ours[: ours.index(sys.executable)])
    assert assignments == exported, "pytest runs with what the step exports for it"
    ours = ours[len(assignments) :]
    assert ours[3:] == theirs
    assert shlex.split(doctor)[-6:] == [
        *("harness.cli.main", "doctor", "--model", "/models/qwen"),
        *("--dtype", given.dtype or DEFAULT_DTYPE),
    ]
    assert shlex.split(plan)[3:9] == [
        "plan",
        "--platform",
        "cuda",
        "--devices",
        "0,1,2,3",
        "--model",
    ]
    assert ("--no-enforce-eager" in plan) == given.no_enforce_eager
    assert f"--dtype {given.dtype or DEFAULT_DTYPE}" in plan
    assert ["--epd-dtype", given.dtype or DEFAULT_DTYPE] in [
        theirs[i : i + 2] for i in range(len(theirs))
    ]


def test_the_nightlys_pytest_gets_the_vllm_source_tree_the_rehearsal_was_given(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """ci/buildkite/nightly.sh runs the rehearsal with --vllm-source /vllm-workspace (the CI
    image's development build has no sdist). The rehearsal handed it to the workflow's step,
    which exports it for pytest as EPD_VLLM_SOURCE, but ran pytest with its own environment:
    neither the flag nor the variable reached pytest, and every test reading vLLM's own files
    failed ("development build ... pass --vllm-source"). The rehearsal's pytest now runs with
    what the step exports, here as on the night, and its printed line says so."""
    rehearsal = load_rehearsal()
    model = tmp_path / "model"
    model.mkdir()
    real_run = subprocess.run
    pytest_runs: list[tuple[list[str], dict]] = []

    def run(command, *args, **kwargs):
        if command[:1] == ["bash"]:  # the workflow's step, read by the rehearsal
            return real_run(command, *args, **kwargs)
        if command[1:3] == ["-m", "pytest"]:
            pytest_runs.append((command, kwargs.get("env")))
        return subprocess.CompletedProcess(command, 0, stdout="", stderr="")

    monkeypatch.setattr(rehearsal, "gpus_here", lambda: [0, 1, 2, 3])
    monkeypatch.setattr(rehearsal, "ROOT", tmp_path)
    monkeypatch.setattr(rehearsal.subprocess, "run", run)
    monkeypatch.delenv("EPD_VLLM_SOURCE", raising=False)
    argv = ["--devices", "0,1,2,3", "--model", str(model), "--run-name", "r1", "--workers", "1"]
    assert rehearsal.main([*argv, "--vllm-source", "/vllm-workspace"]) == 0
    [(command, env)] = pytest_runs
    assert env is not None and env.get("EPD_VLLM_SOURCE") == "/vllm-workspace", env
    assert "EPD_VLLM_SOURCE=/vllm-workspace " in capsys.readouterr().out


def test_workers_default_to_the_xdist_groups_the_plan_serves_side_by_side() -> None:
    """The plan's widest wave gave 4 GPUs two workers (the baseline beside 1E+1PD), though no
    two groups serve side by side there: the second only waited for the first one's devices,
    and, the baseline's device shared, each load's calibration started the baseline again."""
    rehearsal = load_rehearsal()
    args = rehearsal.parse_args(["--dry-run"])
    assert rehearsal.useful_workers("0,1,2,3,4,5,6,7", args) == 2  # 1E+1PD's, 1P+1D's
    assert rehearsal.useful_workers("0,1,2,3", args) == 1
    colocated = rehearsal.parse_args(["--colocate"])
    assert rehearsal.useful_workers("0,1", colocated) == 1


@pytest.mark.parametrize("name", ["nightly-gpu.yml", "cherry-pick.yml"])
def test_each_gpu_workflow_leg_runs_the_workers_the_rehearsal_would(name: str) -> None:
    """One rule for both: each leg of a GPU workflow's matrix runs as many xdist workers as
    `useful_workers` gives its devices, colocation and topologies. The 8-GPU legs ran 4 where
    the rehearsal (and its docs' "cannot drift") ran 2: two more workers only waited for the
    first two's GPUs, and each kept a baseline of its own."""
    rehearsal = load_rehearsal()
    workflow = yaml.safe_load((WORKFLOW.parent / name).read_text())
    topologies = workflow.get("env", {}).get("ALL_TOPOLOGIES")
    legs = workflow["jobs"]["gpu"]["strategy"]["matrix"]["include"]
    assert legs
    for leg in legs:
        argv = ["--colocate"] if leg["colocate"] else []
        argv += ["--topology", topologies] if topologies else []
        expected = rehearsal.useful_workers(leg["devices"], rehearsal.parse_args(argv))
        assert leg["workers"] == expected, (name, leg["name"], leg["workers"], expected)


# --- the summary -----------------------------------------------------------------------------


def test_the_summary_shows_start_up_makespan_and_every_verdict(tmp_path: Path) -> None:
    for worker, topology, verdict, passed in (
        ("gw0", "1E+1PD", "MATCH", True),
        ("gw1", "1P+1D", "MISMATCH", False),
    ):
        (tmp_path / worker).mkdir()
        summary = {
            "run": {
                "instances": [{"name": f"{topology}/encoder0", "startup_s": 41.25}],
                "seconds_by_wave": {"wave 1": 300.4},  # as harness/run/sweep.py keys it
            },
            "cases": [
                {
                    "topology": topology,
                    "prompt": "image",
                    "reference": "baseline",
                    "verdict": verdict,
                    "policy_passed": passed,
                }
            ],
        }
        (tmp_path / worker / "summary.json").write_text(json.dumps(summary))
    lines = load_rehearsal().summarize(tmp_path, 812.0)
    assert "     41.2  1E+1PD/encoder0 [gw0]" in lines
    assert "makespan: 812 s of pytest (wave 1 [gw0] 300 s, wave 1 [gw1] 300 s)" in lines
    assert any(
        line.split()[:5] == ["1P+1D", "image", "vs", "baseline", "MISMATCH"] for line in lines
    )
    assert any("MISMATCH" in line and line.split()[5] == "FAIL" for line in lines)
    assert lines[-1] == "1 pass, 1 fail (2 cases)"


def test_the_summary_counts_apart_the_cases_a_test_made_red_on_purpose(tmp_path: Path) -> None:
    """A green night holds red bundles on purpose: a planted fault caught (the self-test, the
    planted repro and fuzz: run.json's `fault`), a death under load (run.json's `killed`).
    Counted as failures, the fake night's summary said "159 pass, 111 fail" of a run whose
    every such test had passed."""

    def bundle(name: str, verdict: str, passed: bool, **files: dict) -> None:
        where = tmp_path / name
        where.mkdir(parents=True, exist_ok=True)
        case = {
            "topology": "1E+1PD",
            "prompt": "image",
            "reference": "baseline",
            "verdict": verdict,
            "policy_passed": passed,
        }
        (where / "summary.json").write_text(json.dumps({"run": {}, "cases": [case]}))
        for file_name, content in files.items():
            (where / f"{file_name}.json").write_text(json.dumps(content))

    bundle("gw0", "MATCH", True, run={"fault": None})
    bundle("gw0/planted-repro", "MISMATCH", False, run={"fault": "corrupt-ec"})
    bundle("gw1/load/death", "ERROR", False, run={"fault": None, "killed": "1P+1D/decode0"})
    bundle("gw1", "MISMATCH", False, run={"fault": None})
    lines = load_rehearsal().summarize(tmp_path, 10.0)
    assert lines[-1] == "1 pass, 1 fail, 2 red on purpose (4 cases)"
    planted = next(line for line in lines if "[gw0/planted-repro]" in line)
    assert "red on purpose: the run planted the fault corrupt-ec" in planted, planted
    killed = next(line for line in lines if "[gw1/load/death]" in line)
    assert "red on purpose: the load killed 1P+1D/decode0" in killed, killed
    assert any(line.split()[-2:] == ["FAIL", "[gw1]"] for line in lines), lines


def test_devices_that_cannot_hold_the_topologies_are_refused_in_one_line(capsys) -> None:
    """`python scripts/gpu_rehearsal.py` on a one-GPU box (every GPU nvidia-smi lists) printed
    the plan's DevicePlanError as a traceback, exit 1."""
    assert load_rehearsal().main(["--dry-run", "--devices", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpu-rehearsal: 1P+1D needs 2, 1E+1P+1D needs 2 devices"), err
    assert "use --colocate" in err and err.count("\n") == 1, err


def test_what_holds_its_gpus_after_pytest_and_not_before_is_left_running() -> None:
    from harness.devices import GpuProcess

    rehearsal = load_rehearsal()
    another_jobs = GpuProcess(pid=10, name="python", gpu=0, used_mib=500)
    lost_server = GpuProcess(pid=20, name="VLLM::EngineCore", gpu=1, used_mib=70000)
    elsewhere = GpuProcess(pid=30, name="python", gpu=5, used_mib=500)
    after = [another_jobs, lost_server, elsewhere]
    assert rehearsal.left_on_gpus([another_jobs], after, (0, 1)) == [lost_server]
    assert rehearsal.left_on_gpus([another_jobs], [another_jobs], (0, 1)) == []
    with pytest.raises(rehearsal.Unlisted):
        rehearsal.left_on_gpus([another_jobs], None, (0, 1))


def test_a_fuzz_runs_failure_bundles_do_not_count_its_cases_again(tmp_path: Path) -> None:
    """A fuzz run writes its summary.json with every case it judged, and a bundle per failure
    group under failures/ holding that group's key cases again (run `fuzz_group`): counted from
    both, a night's one fuzz failure read as two."""
    fuzz_run = tmp_path / "gw0" / "fuzz"
    group = fuzz_run / "failures" / "01-new-mismatch"
    group.mkdir(parents=True)

    def case(prompt: str, verdict: str, passed: bool) -> dict:
        return {
            "topology": "1E+1PD",
            "prompt": prompt,
            "reference": "baseline",
            "verdict": verdict,
            "policy_passed": passed,
        }

    failing, passing = case("fz-3", "MISMATCH", False), case("fz-1", "MATCH", True)
    run_summary = {"run": {"fuzz": {"groups": 1}}, "cases": [failing, passing]}
    group_summary = {"run": {"fuzz_group": {"signature": "mismatch"}}, "cases": [failing]}
    (fuzz_run / "summary.json").write_text(json.dumps(run_summary))
    (group / "summary.json").write_text(json.dumps(group_summary))
    lines = load_rehearsal().summarize(tmp_path, 10.0)
    assert lines[-1] == "1 pass, 1 fail (2 cases)", lines


def test_the_summary_says_what_failed_a_run_beyond_its_verdicts(tmp_path: Path) -> None:
    """summary.json's `problems` (a pass whose guard nothing could check, a planted fault not
    caught) fail a run whose every case passed; the summary read such a red run as "1 pass,
    0 fail", the reason only in pytest's output far above (found in review)."""
    (tmp_path / "gw0").mkdir()
    case = {
        "topology": "1E+1PD",
        "prompt": "image",
        "reference": "baseline",
        "verdict": "MATCH",
        "policy_passed": True,
    }
    problem = "1E+1PD image: MATCH unproven (guard ec_transfer not checkable)"
    summary = {"run": {}, "cases": [case], "passed": False, "problems": [problem]}
    (tmp_path / "gw0" / "summary.json").write_text(json.dumps(summary))
    lines = load_rehearsal().summarize(tmp_path, 10.0)
    assert f"  problem: {problem} [gw0]" in lines, lines
    assert lines[-1] == "1 pass, 0 fail, 1 problem (1 cases)", lines
