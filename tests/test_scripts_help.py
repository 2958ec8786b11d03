"""Every Python script under scripts/ answers `--help` at once: it imports, and starts nothing.

The README quotes their figures and docs tell users to run them, yet nothing else imports them:
a moved function (split_names) once left scripts/benchmark.py failing on its first line while
every test passed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))
HELP_TIMEOUT_S = 60  # an import of torch at most; a script that starts vLLM would take longer


def test_there_are_scripts_to_check() -> None:
    assert len(SCRIPTS) >= 4, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_a_script_answers_help_and_starts_nothing(script: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(script), "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HELP_TIMEOUT_S,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, f"{script.name} --help exited {done.returncode}:\n{done.stderr}"
    first_line = (script.read_text().split('"""')[1]).strip().splitlines()[0]
    assert first_line[:40] in done.stdout, done.stdout[:2000]
    assert "Traceback" not in done.stderr, done.stderr
