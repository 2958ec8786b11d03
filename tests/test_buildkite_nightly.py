"""ci/buildkite/nightly.sh run in a copy of the repository layout, with stand-ins for uv,
python3, vllm and the Buildkite agent: the installs the GitHub nightly makes (the harness, the
NIXL the tree declares, FlashInfer's kernels), parity first, then the GPU rehearsal, and the
artifacts uploaded whatever happened. The step file itself is checked in tests/test_buildkite.py.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest

from harness.testing.venvs import FAKE_UV_NIXL, stand_in_site

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[1]
NIGHTLY = ROOT / "ci" / "buildkite" / "nightly.sh"
# The scripts nightly.sh runs by path with the image's Python (they need no harness installed).
SCRIPTS_BY_PATH = ("torch_hold.py", "nixl_variant.py")


# What the image's Python holds: a made-up torch build and its companions, so a held version
# copied from anywhere else cannot pass for having been read from the image.
IMAGE_TORCH = {"numpy": "2.2.6", "torch": "2.99.1+cu130", "torchvision": "0.99.1+cu130"}
IMAGE_HELD = ["torch==2.99.1+cu130", "torchvision==0.99.1+cu130"]


# What `epd-harness upstream-requirement nixl` prints for the stand-in tree, per CUDA major.
DECLARED_NIXL = {"12": "nixl==1.4.1", "13": "nixl==1.5.0"}


def run_nightly(
    tmp_path: Path,
    parity: int = 0,
    rehearsal: int = 0,
    cuda_major: str = "13",
    image_dists: Mapping[str, str] = IMAGE_TORCH,
    from_files: tuple[str, ...] = (),
    download_kernels: str = "0",
    nixl_brings: str = "",
) -> tuple[subprocess.CompletedProcess[str], list[str], Path]:
    """nightly.sh in a copy of the repository layout, with stand-ins for uv, python3 (torch
    built for `cuda_major`; `upstream-requirement nixl` printing DECLARED_NIXL's line for the
    CUDA major it is given; the hold, `PYTHONSAFEPATH=1 python3 .../torch_hold.py --hold`, is
    the real script run by this test's Python on the image's installed distributions alone:
    `image_dists`, name: version, those in `from_files` from a wheel file; so is
    `nixl_variant.py`, as the image's python3; uv changes them as FAKE_UV_NIXL says, installing
    `nixl` bringing a `nixl-cuN` for each N of `nixl_brings`), vllm (its
    `download-kernels` exits `download_kernels`, "absent": no such subcommand) and the agent
    that record how they were called; (the run, the calls, the vLLM tree)."""
    tree = tmp_path / "harness"
    (tree / "ci" / "buildkite").mkdir(parents=True)
    (tree / "ci" / "buildkite" / "nightly.sh").write_text(NIGHTLY.read_text())
    (tree / "harness" / "cli").mkdir(parents=True)
    for script in SCRIPTS_BY_PATH:
        (tree / "harness" / "cli" / script).write_text(
            (ROOT / "harness" / "cli" / script).read_text()
        )
    log = tmp_path / "calls.log"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, body in (
        ("uv", FAKE_UV_NIXL + 'echo "uv $*" >> "$CALLS"\nfake_uv_nixl "$@"'),
        ("buildkite-agent", 'echo "agent $*" >> "$CALLS"'),
        (
            "vllm",
            'case "$DOWNLOAD_KERNELS $*" in "absent download-kernels"*) exit 2;; esac\n'
            'case "$*" in *--help*) exit 0;; esac\n'
            'echo "vllm $*" >> "$CALLS"\n'
            'exit "$DOWNLOAD_KERNELS"',
        ),
        (
            "python3",
            'case "$PYTHONSAFEPATH $*" in "1 "*/torch_hold.py" --hold")\n'
            '  PYTHONPATH=$FAKE_SITE exec "$REAL_PYTHON" -S "$@";; esac\n'
            'case "$PYTHONSAFEPATH $1" in "1 "*/nixl_variant.py)\n'
            '  PYTHONPATH=$FAKE_SITE exec -a "$0" "$REAL_PYTHON" -S "$@";; esac\n'
            'case "$*" in *torch.version.cuda*) echo "$CUDA_MAJOR"; exit 0;; esac\n'
            'echo "python3 $*" >> "$CALLS"\n'
            'case "$*" in *"upstream-requirement nixl --cuda-major 12 "*) echo nixl==1.4.1;; esac\n'
            'case "$*" in *"upstream-requirement nixl --cuda-major 13 "*) echo nixl==1.5.0;; esac\n'
            'case "$*" in *test_upstream_parity*) exit "$PARITY";; esac\n'
            'case "$*" in *gpu_rehearsal*) exit "$REHEARSAL";; esac',
        ),
    ):
        (bin_dir / tool).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / tool).chmod(0o755)
    vllm_tree = tmp_path / "vllm"
    (vllm_tree / "requirements").mkdir(parents=True)
    (vllm_tree / "requirements" / "kv_connectors.txt").write_text("nixl == 1.5.0\n")
    (vllm_tree / "requirements" / "kv_connectors_cu12.txt").write_text("nixl == 1.4.1\n")
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "CALLS": str(log),
        "PARITY": str(parity),
        "REHEARSAL": str(rehearsal),
        "CUDA_MAJOR": cuda_major,
        "DOWNLOAD_KERNELS": download_kernels,
        "BUILDKITE_BUILD_NUMBER": "77",
        "FAKE_NIXL_BRINGS": nixl_brings,
        "FAKE_NIXL_PUBLISHED": "12 13",
        "EPD_DEVICES": "0,1",
        "EPD_MODEL": "Qwen/Qwen2.5-VL-3B-Instruct",
        "HOME": os.environ.get("HOME", str(tmp_path)),
        **stand_in_site(tmp_path / "site", image_dists, from_files),
    }
    done = subprocess.run(
        ["bash", str(tree / "ci" / "buildkite" / "nightly.sh"), str(vllm_tree)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done, log.read_text().splitlines(), vllm_tree


@pytest.mark.parametrize(("parity", "rehearsal", "expected"), [(0, 0, 0), (1, 0, 1), (0, 2, 2)])
def test_the_nightly_script_runs_parity_and_the_rehearsal_then_uploads_whatever_happened(
    tmp_path: Path, parity: int, rehearsal: int, expected: int
) -> None:
    done, calls, vllm_tree = run_nightly(tmp_path, parity, rehearsal)
    tree = tmp_path / "harness"
    assert done.returncode == expected, done.stderr
    held = "--constraints runs/buildkite-77/torch-held.txt"
    assert calls[0] == f"uv pip install --system {held} -e .[test]"
    assert calls[1] == (
        f"python3 -m harness.cli.main upstream-requirement nixl --cuda-major 13 "
        f"--vllm-source {vllm_tree}"
    )
    assert calls[2] == f"uv pip install --system {held} {DECLARED_NIXL['13']}"
    assert calls[3] == "vllm download-kernels"
    assert calls[4].startswith("python3 -m pytest tests/test_upstream_parity.py -m index -k served")
    assert f"--epd-vllm-source {vllm_tree}" in calls[4]
    assert calls[5] == (
        f"python3 scripts/gpu_rehearsal.py --vllm-source {vllm_tree} --run-name buildkite-77 "
        "--devices 0,1 --model Qwen/Qwen2.5-VL-3B-Instruct"
    )
    assert calls[6] == "agent artifact upload runs/**/*", "uploaded last, whatever happened"
    assert (tree / "runs" / "buildkite-77").is_dir()


@pytest.mark.parametrize("cuda_major", ["12", "13"])
def test_the_nightly_installs_only_the_nixl_the_tree_declares_as_the_workflow_does(
    tmp_path: Path, cuda_major: str
) -> None:
    """The nightly installed the tree's whole kv_connectors[_cu12].txt (NIXL, LMCache,
    Mooncake, cupy) under `set -e`: a conflict among connectors no test here serves stopped
    the night before anything ran. It now installs NIXL alone, as the GitHub nightly does:
    what `epd-harness upstream-requirement nixl` reads for torch's CUDA major (12 picks
    kv_connectors_cu12.txt where the tree has one, as vLLM's CI does)."""
    done, calls, vllm_tree = run_nightly(tmp_path, cuda_major=cuda_major)
    assert done.returncode == 0, done.stderr
    installs = [call for call in calls if call.startswith("uv pip install")]
    assert not [call for call in installs if "kv_connectors" in call], installs
    asked = [call for call in calls if "upstream-requirement" in call]
    assert asked == [
        f"python3 -m harness.cli.main upstream-requirement nixl --cuda-major {cuda_major} "
        f"--vllm-source {vllm_tree}"
    ]
    assert installs[-1].endswith(f" {DECLARED_NIXL[cuda_major]}"), installs


@pytest.mark.parametrize("cuda_major", ["12", "13"])
def test_the_nightly_keeps_only_the_nixl_variant_of_the_images_cuda(
    tmp_path: Path, cuda_major: str
) -> None:
    """nixl>=1.1 installs nixl-cu12 and nixl-cu13 beside it; the night stopped there, as the
    GitHub workflows did, where vLLM's CI keeps only the variant of torch's CUDA major. Now it
    runs harness/cli/nixl_variant.py by the image's Python, right after NIXL's install, as the
    workflows do (tests/test_workflows.py has the rest of its behaviour)."""
    done, calls, _ = run_nightly(tmp_path, cuda_major=cuda_major, nixl_brings="12 13")
    assert done.returncode == 0, done.stderr
    python3 = tmp_path / "bin" / "python3"
    version = DECLARED_NIXL[cuda_major].split("==")[1]
    nixl_calls = [call for call in calls if "nixl" in call and call.startswith("uv pip")]
    assert nixl_calls[1:] == [
        f"uv pip uninstall --python {python3} nixl-cu12 nixl-cu13",
        f"uv pip install --python {python3} --no-deps nixl-cu{cuda_major}=={version}",
    ], calls
    installed = {major: "(not installed)" for major in ("12", "13")} | {cuda_major: version}
    assert (
        f"NIXL installed now: nixl {version}, nixl-cu12 {installed['12']}, "
        f"nixl-cu13 {installed['13']}" in done.stdout
    ), done.stdout


@pytest.mark.parametrize(
    ("download_kernels", "asked"), [("1", True), ("absent", False)], ids=["failing", "absent"]
)
def test_a_failed_or_absent_kernel_download_does_not_stop_the_night(
    tmp_path: Path, download_kernels: str, asked: bool
) -> None:
    """The GitHub nightly runs `vllm download-kernels` where the served vLLM has it (0.32.0
    asks for it after every install: without FlashInfer's precompiled kernels each instance
    fetches or compiles them while it starts) and only warns when it fails; the Buildkite
    night did not run it at all. Now it does, as the workflow: warned, never stopped."""
    done, calls, _ = run_nightly(tmp_path, download_kernels=download_kernels)
    assert done.returncode == 0, done.stderr
    assert ("vllm download-kernels" in calls) == asked, calls
    assert calls[-2].startswith("python3 scripts/gpu_rehearsal.py"), calls
    if asked:
        assert "vllm download-kernels failed" in done.stderr, done.stderr


def held_by(call: str, tree: Path) -> list[str] | None:
    """The lines of the constraints file a recorded `uv pip install` passes (its path relative
    to the harness tree, where the script runs), or None when it passes none."""
    argv = call.split()
    for flag in ("--constraint", "--constraints", "-c"):
        if flag in argv:
            held = tree / argv[argv.index(flag) + 1]
            return sorted(line for line in held.read_text().splitlines() if line.strip())
    return None


@pytest.mark.parametrize(
    "from_files", [(), ("torch", "torchvision")], ids=["from-an-index", "from-wheel-files"]
)
def test_the_nightly_holds_the_images_torch_through_both_installs(
    tmp_path: Path, from_files: tuple[str, ...]
) -> None:
    """NIXL requires torch and the harness's own install resolves again; nothing held the torch the
    image's vLLM was built with, so either could replace it (another version, another CUDA build)
    and the night would test vLLM on a torch it was not built for. Both installs now pass a
    constraints file naming the image's torch (and torchvision, torchaudio where present), kept in
    the run's artifacts. Read from the installed distributions' metadata (harness/cli/torch_hold.py
    --hold, by the image's python3), not from `uv pip freeze`'s `^torch==` lines: an image whose
    torch was installed from a wheel file freezes as `torch @ file:///...whl`, and the night stopped
    "no torch" beside its torch."""
    done, calls, _ = run_nightly(tmp_path, from_files=from_files)
    assert done.returncode == 0, done.stderr
    harness, nixl = [call for call in calls if call.startswith("uv pip install")]
    assert harness.endswith("-e .[test]"), harness
    assert nixl.endswith(DECLARED_NIXL["13"]), nixl
    for call in (harness, nixl):
        assert held_by(call, tmp_path / "harness") == IMAGE_HELD, call


def test_an_image_without_torch_stops_the_nightly_before_any_install(tmp_path: Path) -> None:
    done, calls, _ = run_nightly(tmp_path, image_dists={"numpy": "2.2.6"})
    assert done.returncode != 0
    assert not [call for call in calls if call.startswith("uv pip install")], calls
    assert "no torch in the image's Python" in done.stderr
