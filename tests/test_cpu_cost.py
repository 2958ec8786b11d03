"""scripts/cpu_cost.py: the host's busy CPU during a command, and the wall time that work needs
on a number of cores."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "cpu_cost.py"
BURN = "import sys, time\nwhile time.process_time() < 0.6: pass\nsys.exit(3)"


def test_counts_at_least_the_cpu_the_command_burnt_and_passes_its_exit_on() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--cores", "1", "--", sys.executable, "-c", BURN],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    found = re.search(r"host busy ([\d.]+) CPU-s .* needs >= ([\d.]+) s on 1 cores", done.stderr)
    assert found, done.stderr
    busy, needs = float(found[1]), float(found[2])
    # 0.6 s burnt (the kernel's tick accounting can lag a little); on one core, all of it.
    assert busy >= 0.5 and needs == busy, done.stderr


def test_without_a_command_it_says_so() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2
    assert "no command given" in done.stderr
