"""scripts/connector_costs.py's CPU accounting, on a small process tree of its own (no vLLM)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "connector_costs.py"

# A parent that starts a child burning 0.5 CPU-s, then on each line of its stdin: lets the
# child end and reaps it; exits.
PARENT = """
import subprocess, sys
BURN = "import sys, time\\nwhile time.process_time() < 0.5: pass\\nprint('burnt', flush=True)\\nsys.stdin.read()"
child = subprocess.Popen([sys.executable, "-c", BURN], stdin=subprocess.PIPE)
sys.stdin.readline()
child.stdin.close()
child.wait()
print("reaped", flush=True)
sys.stdin.readline()
"""


def load_connector_costs():
    spec = importlib.util.spec_from_file_location("connector_costs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_child_that_ends_between_two_samples_keeps_the_cpu_it_used() -> None:
    """An instance's tree changes while it is measured (a helper process comes and goes): the
    CPU of a child that ended and was reaped must not leave the tree's total, or the CPU used
    between two samples comes out short, even negative."""
    costs = load_connector_costs()
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout.readline() == "burnt\n"
        before = costs.tree_cpu_seconds(parent.pid)
        assert before >= 0.4
        parent.stdin.write("\n")
        parent.stdin.flush()
        assert parent.stdout.readline() == "reaped\n"
        after = costs.tree_cpu_seconds(parent.pid)
        assert after >= before, f"{before:.2f} CPU-s before the child ended, {after:.2f} after"
    finally:
        parent.kill()
        parent.wait(timeout=30)
