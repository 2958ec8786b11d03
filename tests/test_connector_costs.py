"""scripts/connector_costs.py's CPU accounting, on a small process tree of its own (no vLLM)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.outcomes.chat import ChatResult
from harness.outcomes.outcome import Outcome

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


def test_a_request_that_got_no_answer_is_not_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request that failed (at once, say) is an error, not a latency: timed, it would show a
    broken connector as a fast one."""
    costs = load_connector_costs()
    answered = Outcome(prompt="image", result=ChatResult((1,), (2,), "x", "length"), seconds=1.5)
    failed = Outcome(prompt="image", error="decode answered 500", seconds=0.004)
    sent = iter([answered, failed])

    class FakeSession:
        def __init__(self, topology, settings) -> None:
            self.stats, self.instances, self.servers = {}, [], []

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

        def send(self, prompt, body):
            return next(sent)

    serving = SimpleNamespace(served_model_name="m")
    config = SimpleNamespace(settings=SimpleNamespace(serving=serving))
    monkeypatch.setattr(costs, "prepare_run", lambda request: config)
    monkeypatch.setattr(costs, "TopologySession", FakeSession)
    monkeypatch.setattr(costs.time, "sleep", lambda seconds: None)
    figures = costs.measure("example", "1P+1D", 2, 0.0, Path("unused"))
    assert figures["request_s"] == [1.5]
    assert figures["errors"] == ["decode answered 500"]
