"""One linter and formatter for the whole tree (ruff, configured in pyproject.toml)."""

from __future__ import annotations

import re
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


def test_test_module_names_are_unique_across_tests_and_scenarios() -> None:
    """Neither folder is a package, so pytest imports a test module by its file name: two
    `test_x.py` collected together make a collection error (`-m "e2e and ci"` alone never
    imports the unit one, so only the whole selection shows it)."""
    names: dict[str, list[str]] = {}
    for folder in ("tests", "scenarios"):
        for path in (ROOT / folder).glob("test_*.py"):
            names.setdefault(path.name, []).append(folder)
    clashes = {name: folders for name, folders in names.items() if len(folders) > 1}
    assert not clashes, f"rename one of each: {clashes}"


def test_no_test_reads_pytests_private_option_parser() -> None:
    """pytest.Config's `_parser` is private: a pytest release may rename or drop it, and the
    docs' check of their pytest command lines then breaks for no fault of the docs. The
    session's parser is the one the public `pytest_addoption` hook receives (conftest.py)."""
    private = re.compile(r"\._parser\b")
    sources = [ROOT / "conftest.py", *(ROOT / "harness").rglob("*.py")]
    for folder in ("tests", "scenarios"):
        sources += (ROOT / folder).glob("*.py")
    readers = [
        str(path.relative_to(ROOT))
        for path in sources
        if path != Path(__file__).resolve() and private.search(path.read_text(encoding="utf-8"))
    ]
    assert not readers, f"read the option parser through conftest.py's fixture: {readers}"


def test_no_scenario_asserts_a_verdict_is_match_alone() -> None:
    """Under the GPU night's reference policy (pd-drift) a clean P->D topology judged against
    the monolithic baseline may pass as DRIFT, and a scenario asserting `Verdict.MATCH` there
    is red for the harness's own reasons (found in review: scenarios/test_detection.py's clean
    request of 1P+1D and 1E+1P+1D). A scenario asserts a clean answer with
    `harness.testing.judging.passed_proven` (or `passed_clean`), which hold what the policy
    allows; an expected red verdict (MISMATCH, ERROR) is named as it is."""
    import ast

    strict: list[str] = []
    for path in sorted((ROOT / "scenarios").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for statement in ast.walk(tree):
            if not isinstance(statement, ast.Assert):
                continue
            for node in ast.walk(statement.test):
                if (
                    isinstance(node, ast.Attribute)
                    and node.attr == "MATCH"
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "Verdict"
                ):
                    strict.append(f"{path.relative_to(ROOT)}:{statement.lineno}")
    assert not strict, f"assert passed_proven(record) instead: {strict}"
