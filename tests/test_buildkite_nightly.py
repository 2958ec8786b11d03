"""ci/buildkite/nightly.sh run in a copy of the repository layout, with stand-ins for uv,
python3 and the Buildkite agent: parity first, then the GPU rehearsal, and the artifacts
uploaded whatever happened. The step file itself is checked in tests/test_buildkite.py.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest

from harness.testing.venvs import stand_in_site

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[1]
NIGHTLY = ROOT / "ci" / "buildkite" / "nightly.sh"
TORCH_HOLD = ROOT / "harness" / "cli" / "torch_hold.py"


# What the image's Python holds: a made-up torch build and its companions, so a held version
# copied from anywhere else cannot pass for having been read from the image.
IMAGE_TORCH = {"numpy": "2.2.6", "torch": "2.99.1+cu130", "torchvision": "0.99.1+cu130"}
IMAGE_HELD = ["torch==2.99.1+cu130", "torchvision==0.99.1+cu130"]


def run_nightly(
    tmp_path: Path,
    parity: int = 0,
    rehearsal: int = 0,
    cuda_major: str = "13",
    image_dists: Mapping[str, str] = IMAGE_TORCH,
    from_files: tuple[str, ...] = (),
) -> tuple[subprocess.CompletedProcess[str], list[str], Path]:
    """nightly.sh in a copy of the repository layout, with stand-ins for uv, python3 (torch
    built for `cuda_major`; the hold, `PYTHONSAFEPATH=1 python3 .../torch_hold.py --hold`, is
    the real script run by this test's Python on the image's installed distributions alone:
    `image_dists`, name: version, those in `from_files` from a wheel file) and the agent that
    record how they were called; (the run, the calls, the vLLM tree)."""
    tree = tmp_path / "harness"
    (tree / "ci" / "buildkite").mkdir(parents=True)
    (tree / "ci" / "buildkite" / "nightly.sh").write_text(NIGHTLY.read_text())
    (tree / "harness" / "cli").mkdir(parents=True)
    (tree / "harness" / "cli" / "torch_hold.py").write_text(TORCH_HOLD.read_text())
    log = tmp_path / "calls.log"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, body in (
        ("uv", 'echo "uv $*" >> "$CALLS"'),
        ("buildkite-agent", 'echo "agent $*" >> "$CALLS"'),
        (
            "python3",
            'case "$PYTHONSAFEPATH $*" in "1 "*/torch_hold.py" --hold")\n'
            '  PYTHONPATH=$FAKE_SITE exec "$REAL_PYTHON" -S "$@";; esac\n'
            'case "$*" in *torch.version.cuda*) echo "$CUDA_MAJOR"; exit 0;; esac\n'
            'echo "python3 $*" >> "$CALLS"\n'
            'case "$*" in *test_upstream_parity*) exit "$PARITY";; esac\n'
            'case "$*" in *gpu_rehearsal*) exit "$REHEARSAL";; esac',
        ),
    ):
        (bin_dir / tool).write_text(f"#!/bin/sh\n{body}\n")
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
        "BUILDKITE_BUILD_NUMBER": "77",
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
    assert calls[0] == (
        f"uv pip install --system {held} -r {vllm_tree}/requirements/kv_connectors.txt"
    )
    assert calls[1] == f"uv pip install --system {held} -e .[test]"
    assert calls[2].startswith("python3 -m pytest tests/test_upstream_parity.py -m index -k served")
    assert f"--epd-vllm-source {vllm_tree}" in calls[2]
    assert calls[3] == (
        f"python3 scripts/gpu_rehearsal.py --vllm-source {vllm_tree} --run-name buildkite-77 "
        "--devices 0,1 --model Qwen/Qwen2.5-VL-3B-Instruct"
    )
    assert calls[4] == "agent artifact upload runs/**/*", "uploaded last, whatever happened"
    assert (tree / "runs" / "buildkite-77").is_dir()


def test_on_cuda_12_the_nightly_installs_the_trees_cuda_12_connectors(tmp_path: Path) -> None:
    """vLLM declares its KV connectors (NIXL among them) per CUDA major: kv_connectors.txt
    (nixl == 1.5.0 in 0.32.0) and, for a torch built for CUDA 12, kv_connectors_cu12.txt
    (nixl == 1.4.1), as its install-kv-connectors.sh chooses. The nightly installed the first
    everywhere, over a CUDA 12 image's own."""
    done, calls, vllm_tree = run_nightly(tmp_path, cuda_major="12")
    assert done.returncode == 0, done.stderr
    assert calls[0] == (
        "uv pip install --system --constraints runs/buildkite-77/torch-held.txt "
        f"-r {vllm_tree}/requirements/kv_connectors_cu12.txt"
    )


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
    """kv_connectors.txt (NIXL, lmcache) requires torch and the harness's own install resolves
    again; nothing held the torch the image's vLLM was built with, so either could replace it
    (another version, another CUDA build) and the night would test vLLM on a torch it was not
    built for. Both installs now pass a constraints file naming the image's torch (and
    torchvision, torchaudio where present), kept in the run's artifacts. Read from the installed
    distributions' metadata (harness/cli/torch_hold.py --hold, by the image's python3), not from
    `uv pip freeze`'s `^torch==` lines: an image whose torch was installed from a wheel file
    freezes as `torch @ file:///...whl`, and the night stopped "no torch" beside its torch."""
    done, calls, vllm_tree = run_nightly(tmp_path, from_files=from_files)
    assert done.returncode == 0, done.stderr
    connectors, harness = calls[0], calls[1]
    assert connectors.endswith(f"-r {vllm_tree}/requirements/kv_connectors.txt"), connectors
    assert harness.endswith("-e .[test]"), harness
    for call in (connectors, harness):
        assert held_by(call, tmp_path / "harness") == IMAGE_HELD, call


def test_an_image_without_torch_stops_the_nightly_before_any_install(tmp_path: Path) -> None:
    done, calls, _ = run_nightly(tmp_path, image_dists={"numpy": "2.2.6"})
    assert done.returncode != 0
    assert not [call for call in calls if call.startswith("uv pip install")], calls
    assert "no torch in the image's Python" in done.stderr
