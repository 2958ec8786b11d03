"""scripts/cpu installs what each job needs: the README's Quick start runs it on a fresh machine.

`scripts/cpu test --browser` is both the README's test command and what CI runs, and one of
the tests it selects runs NIXL (scenarios/test_nixl.py, a `ci` case that fails without the
nixl extra, never skips). A fresh machine once failed that command while CI passed, because
only CI set EPD_CPU_NIXL=1. So these tests run the real script against a stand-in virtualenv
whose `python` records every call, and read which extras each job asked pip for.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "cpu"

# Stands in for the venv's python: records its argv; `-` (the installed-version check, which
# reads its program on stdin) answers "already installed", so no vLLM is installed.
RECORDING_PYTHON = """#!/usr/bin/env bash
printf '%s\\n' "$*" >> "$CALLS"
if [[ ${1:-} == - ]]; then cat > /dev/null; fi
exit 0
"""


def run_script(tmp_path: Path, *args: str, **env: str) -> list[str]:
    """The calls scripts/cpu made to the stand-in venv's python and epd-harness."""
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    for name in ("python", "epd-harness"):
        (venv / name).write_text(RECORDING_PYTHON)
        (venv / name).chmod(0o755)
    calls = tmp_path / "calls.txt"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("EPD_CPU_")}
    result = subprocess.run(
        [str(SCRIPT), *args],
        env={**clean, "EPD_VENV": str(tmp_path / "venv"), "CALLS": str(calls), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return calls.read_text().splitlines()


def installed_extras(calls: list[str]) -> set[str]:
    (install,) = [c for c in calls if c.startswith("-m pip install") and " -e " in c]
    extras = install.rsplit("[", 1)[1].rstrip("]")
    return set(extras.split(","))


def test_the_test_job_installs_every_extra_its_tests_need(tmp_path: Path) -> None:
    calls = run_script(tmp_path, "test", "--browser")
    assert installed_extras(calls) == {"test", "nixl", "ray"}
    assert calls[-1].startswith("-m pytest tests scenarios -m (not e2e or ci)")


def test_the_sweep_installs_only_the_test_extra_unless_asked(tmp_path: Path) -> None:
    assert installed_extras(run_script(tmp_path, "sweep")) == {"test"}


def test_the_nixl_switch_reaches_every_job(tmp_path: Path) -> None:
    calls = run_script(tmp_path, "sweep", EPD_CPU_NIXL="1")
    assert installed_extras(calls) == {"test", "nixl"}
    assert calls[-1] == "run"


def test_ci_runs_the_readme_test_command_as_it_is() -> None:
    """No environment of CI's own: a fresh machine running the README's command gets CI's run."""
    run = (ROOT / ".ci" / "run").read_text()
    assert run.rstrip().splitlines()[-1] == "exec scripts/cpu test --browser"
    assert "export" not in run
    assert "scripts/cpu test --browser" in (ROOT / "README.md").read_text()
