"""The package's layering contract (pyproject.toml, [tool.importlinter]) holds, and can fail.

Stages import only downwards: spec -> serve -> judge -> report -> run -> preflight -> cli, with
the leaf modules below them all. A newcomer finds a concern by its folder, and no low stage
reaches up for a dataclass or a helper.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = str(Path(sys.executable).parent / "lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [LINT_IMPORTS, "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
    )


def test_the_package_keeps_its_layers() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout, result.stdout


def test_an_upward_import_breaks_the_contract(tmp_path: Path) -> None:
    """The contract is not vacuous: a spec module importing the CLI turns it red."""
    shutil.copytree(
        ROOT / "harness", tmp_path / "harness", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    topology = tmp_path / "harness" / "spec" / "topology.py"
    topology.write_text(
        topology.read_text() + "\nfrom harness.cli import main as _upward  # noqa\n"
    )
    result = lint_imports(tmp_path)
    assert result.returncode != 0, result.stdout
    assert "harness.spec is not allowed to import harness.cli" in result.stdout, result.stdout
