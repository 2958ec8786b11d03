"""`epd-harness upstream-requirement` (harness/cli/upstream_requirement.py) as the GPU workflows
run it: a served vLLM (a stand-in that reports a version), its release's files from the harness
cache as a fetch leaves them, or a development build's source tree; stdout is the requirement
alone, the errors one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.environment import CACHE_ENV
from harness.preflight.upstream_requirements import KV_CONNECTORS_CU12_FILE, KV_CONNECTORS_FILE
from harness.testing.fake_vllm import install_fake_vllm
from harness.testing.upstream_files import cached_release, write_tree

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 60


def upstream_requirement(cache: Path, vllm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, CACHE_ENV: str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "harness.cli.main", "upstream-requirement", "nixl"]
        + ["--vllm", str(vllm), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


DECLARING = {
    KV_CONNECTORS_FILE: "lmcache >= 0.3.9\nnixl == 9.9.9\n",
    KV_CONNECTORS_CU12_FILE: "nixl == 9.9.8\n",
}


@pytest.mark.parametrize("cuda_major, expected", [("13", "nixl==9.9.9"), ("12", "nixl==9.9.8")])
def test_a_release_gets_what_its_sdist_declares(
    tmp_path: Path, cuda_major: str, expected: str
) -> None:
    cached_release(tmp_path / "cache", "9.9.0", DECLARING)
    vllm = install_fake_vllm(tmp_path / "bin", serves=False, vllm_version="9.9.0+cu129")
    done = upstream_requirement(tmp_path / "cache", vllm, "--cuda-major", cuda_major)
    assert (done.returncode, done.stdout) == (0, f"{expected}\n"), done.stderr
    assert "vLLM 9.9.0+cu129" in done.stderr and "index.invalid" in done.stderr


def test_a_development_build_gets_what_its_source_tree_declares(tmp_path: Path) -> None:
    tree = write_tree(tmp_path / "vllm-src", {KV_CONNECTORS_FILE: "nixl == 9.9.7\n"})
    vllm = install_fake_vllm(tmp_path / "bin", serves=False, vllm_version="9.10.0.dev3+gabc1234")
    done = upstream_requirement(
        tmp_path / "cache", vllm, "--cuda-major", "12", "--vllm-source", str(tree)
    )
    assert (done.returncode, done.stdout) == (0, "nixl==9.9.7\n"), done.stderr
    without = upstream_requirement(tmp_path / "cache", vllm, "--cuda-major", "12")
    assert without.returncode == 2 and without.stdout == ""
    (line,) = without.stderr.splitlines()
    assert "development build" in line and "--vllm-source DIR" in line


def test_a_release_declaring_no_nixl_fails_in_one_line_and_prints_nothing(tmp_path: Path) -> None:
    cached_release(tmp_path / "cache", "9.9.0", {KV_CONNECTORS_FILE: "lmcache\n"})
    vllm = install_fake_vllm(tmp_path / "bin", serves=False, vllm_version="9.9.0")
    done = upstream_requirement(tmp_path / "cache", vllm, "--cuda-major", "13")
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert "vLLM 9.9.0" in line and "kv_connectors.txt (for CUDA 13) declares no nixl" in line


def test_a_source_tree_whose_epd_proxy_moved_still_declares_its_nixl(tmp_path: Path) -> None:
    """The requirement is read from the tree's requirements/ only: a tree without the EPD proxy
    where the harness looks (a main that moved it) still gets its NIXL installed, so a night is
    not stopped at the install, before upstream parity can name what moved."""
    from harness.serve.vllm_proxy import EPD_PROXY_FILE

    tree = write_tree(tmp_path / "vllm-src", {KV_CONNECTORS_FILE: "nixl == 9.9.7\n"})
    (tree / EPD_PROXY_FILE).unlink()
    vllm = install_fake_vllm(tmp_path / "bin", serves=False, vllm_version="9.10.0.dev3+gabc1234")
    done = upstream_requirement(
        tmp_path / "cache", vllm, "--cuda-major", "12", "--vllm-source", str(tree)
    )
    assert (done.returncode, done.stdout) == (0, "nixl==9.9.7\n"), done.stderr
