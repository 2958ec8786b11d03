"""One linter and formatter for the whole tree (ruff, configured in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.check

ROOT = Path(__file__).resolve().parent.parent
RUFF = str(Path(sys.executable).parent / "ruff")
TREE = ["harness", "fixtures", "tests", "scenarios", "scripts", "conftest.py"]


def ruff(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([RUFF, *args, *TREE], cwd=ROOT, capture_output=True, text=True)


def test_ruff_finds_nothing_to_lint() -> None:
    result = ruff("check", "--no-cache")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_tree_is_formatted() -> None:
    result = ruff("format", "--check", "--no-cache")
    assert result.returncode == 0, "run `ruff format`:\n" + result.stdout + result.stderr
