"""The documentation names what the code does: every environment variable, every linked file."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from harness import environment

pytestmark = pytest.mark.check

ROOT = Path(__file__).resolve().parent.parent


def variables_read_by_the_code() -> set[str]:
    names: set[str] = set()
    for source in [*(ROOT / "harness").rglob("*.py"), ROOT / "scripts" / "cpu"]:
        text = source.read_text(encoding="utf-8")
        names |= set(re.findall(r"""environ(?:\.get)?[(\[]\s*["']([A-Z][A-Z0-9_]+)["']""", text))
        names |= set(re.findall(r"""^[A-Z_]+_ENV = ["']([A-Z][A-Z0-9_]+)["']""", text, re.M))
        names |= set(re.findall(r"\$\{([A-Z][A-Z0-9_]+):-", text))
    return names


def test_every_environment_variable_is_documented() -> None:
    doc = (ROOT / "docs" / "environment.md").read_text(encoding="utf-8")
    read = variables_read_by_the_code() | set(environment.VARIABLES)
    assert {"EPD_HARNESS_CACHE", "EPD_HARNESS_PORT_RANGE", "HF_HUB_CACHE"} <= read, read
    missing = sorted(name for name in read if f"`{name}`" not in doc)
    assert not missing, f"docs/environment.md does not name {missing}"


def test_links_in_the_readme_and_docs_point_at_files_that_exist() -> None:
    broken = []
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


# Paths inside a vLLM sdist that the harness names (it fetches them; they are not ours).
VLLM_SDIST_PREFIXES = ("tests/v1/", "examples/")
# A repository path: starts at one of our top-level folders, not inside another word or path
# (e.g. `~/.cache/epd-harness/baseline` is no reference to a `harness/baseline`).
REPO_PATH = re.compile(
    r"(?<![\w./~-])((?:harness|scenarios|tests|docs|scripts|fixtures|\.github)/[\w./-]*\w)"
)


def test_every_repository_path_named_in_code_and_docs_exists() -> None:
    """A docstring or page pointing at a module that moved is how a newcomer gets lost."""
    sources = [
        ROOT / "README.md",
        ROOT / "conftest.py",
        ROOT / "pyproject.toml",
        ROOT / "tox.ini",
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "scripts").iterdir(),
        *(
            p
            for d in ("harness", "scenarios", "tests", "fixtures")
            for p in (ROOT / d).rglob("*.py")
        ),
    ]
    missing = set()
    for source in sources:
        if not source.is_file() or source == Path(__file__):  # this file names examples
            continue
        for path in REPO_PATH.findall(source.read_text(encoding="utf-8")):
            if not path.startswith(VLLM_SDIST_PREFIXES) and not (ROOT / path).exists():
                missing.add(f"{source.relative_to(ROOT)} -> {path}")
    assert not missing, sorted(missing)


def test_every_script_the_project_names_exists() -> None:
    """`doctor` and pyproject.toml once pointed at a setup script that never existed (trap 5 of
    issue 8; tests/test_traps.py pins the others)."""
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    sources = [
        p
        for p in tracked
        if p.endswith((".py", ".toml", ".md", ".ini", ".yml", ".yaml"))
        or p in (".ci/run", "scripts/cpu")
    ]
    named: dict[str, str] = {}
    for source in sources:
        text = (ROOT / source).read_text(encoding="utf-8")
        for match in re.finditer(r"\bscripts/([A-Za-z0-9_.-]+[A-Za-z0-9_])", text):
            named.setdefault(f"scripts/{match[1]}", source)
    missing = {script: where for script, where in named.items() if not (ROOT / script).exists()}
    assert named, "the scan found no reference at all: it would pass vacuously"
    assert not missing, f"named but missing (script: where): {missing}"


def test_every_module_the_project_tells_python_to_run_exists() -> None:
    """The export's refusal for a model directory that is gone told users to rebuild the tiny
    model with the module `harness.fixtures.tiny_model`, which never existed (fixtures/ is a
    top-level package): following the advice ended on 'No module named harness.fixtures'."""
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    named: dict[str, str] = {}
    for source in tracked:
        if not (
            source.endswith((".py", ".md", ".toml", ".ini", ".yml", ".yaml", ".sh"))
            or source in (".ci/run", "scripts/cpu")
        ):
            continue
        text = (ROOT / source).read_text(encoding="utf-8")
        for match in re.finditer(r"\bpython3? -m ((?:harness|fixtures)(?:\.\w+)+)", text):
            named.setdefault(match[1], source)
    missing = {
        module: where
        for module, where in named.items()
        if not (ROOT / f"{module.replace('.', '/')}.py").is_file()
        and not (ROOT / module.replace(".", "/") / "__main__.py").is_file()
    }
    assert named, "the scan found no reference at all: it would pass vacuously"
    assert not missing, f"named but missing (module: where): {missing}"
