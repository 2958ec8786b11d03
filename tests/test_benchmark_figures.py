"""scripts/benchmark.py's figures, computed from a sweep's records without starting anything:
what each statistic is taken over."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.outcomes.chat import ChatResult
from harness.outcomes.outcome import Outcome
from harness.outcomes.trace import EncoderCall, RequestTrace
from harness.run.pool import StartRecord
from harness.run.sweep import SweepResult
from harness.spec.placement import Schedule, TopologySlot, Wave
from harness.spec.topology import get_topology

pytestmark = pytest.mark.unit

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "benchmark.py"


def load_benchmark():
    spec = importlib.util.spec_from_file_location("benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _answered(prompt: str, seconds: float) -> Outcome:
    trace = RequestTrace(
        request_id=prompt,
        encoder_calls=[EncoderCall("http://e", (0,), status=200, seconds=seconds / 4)],
        prefill_url="http://p",
        prefill_status=200,
        prefill_seconds=seconds / 4,
        decode_url="http://d",
        decode_status=200,
        decode_seconds=seconds / 2,
    )
    result = ChatResult(prompt_token_ids=(1, 2), token_ids=(3,), text="x", finish_reason="length")
    return Outcome(prompt=prompt, result=result, trace=trace, seconds=seconds)


def test_a_request_that_got_no_answer_is_not_timed() -> None:
    """A request that failed at once (a 500 from the encoder) took no time to serve: counted,
    it would pull every role's median latency down and show a broken topology as fast."""
    benchmark = load_benchmark()
    failed_trace = RequestTrace(
        request_id="broken",
        encoder_calls=[EncoderCall("http://e", (0,), status=500, seconds=0.001)],
        error="encoder answered 500",
    )
    failed = Outcome(
        prompt="broken", error="encoder answered 500", trace=failed_trace, seconds=0.002
    )
    result = SweepResult(
        run_dir=Path("unused"),
        outcomes={"1E+1P+1D": {"good": _answered("good", 2.0), "broken": failed}},
    )
    latencies = benchmark.latencies_by_role(result)
    assert latencies == {
        "encoder": [0.5],
        "prefill": [0.5],
        "decode/pd": [1.0],
        "end-to-end": [2.0],
    }


def test_topologies_started_together_count_once_in_the_time_spent_starting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A wave's topologies start side by side and each start counts from the wave's start: the
    sweep waited for the slowest of them, not for their sum (which made the "share of the sweep
    spent starting" exceed the sweep's wall time on a host that fits two topologies a wave)."""
    benchmark = load_benchmark()
    baseline, epd, pd = (get_topology(name) for name in ("baseline", "1E+1P+1D", "1P+1D"))
    waves = (
        Wave(1, (TopologySlot(baseline, (0,)), TopologySlot(epd, (0,)))),
        Wave(2, (TopologySlot(pd, (0,)),)),
    )

    def start(topology, seconds):
        return StartRecord(SimpleNamespace(topology=topology.name), "first use", seconds)

    class FakeSweep:
        def __init__(self, spec, settings, baseline_cache=None) -> None:
            self.pool = SimpleNamespace(starts=[])

        def schedule(self) -> Schedule:
            return Schedule(waves)

        def run_all(self) -> SweepResult:
            self.pool.starts += [start(baseline, 50.0), start(epd, 60.0), start(pd, 40.0)]
            return SweepResult(run_dir=Path("unused"))

    config = SimpleNamespace(topologies=(epd, pd), prompts=(), settings=None, baseline_cache=None)
    monkeypatch.setattr(benchmark, "prepare_run", lambda request: config)
    monkeypatch.setattr(benchmark, "Sweep", FakeSweep)
    run = benchmark.run_once(request=None)
    assert run.waves == 2
    assert run.starting_s == 60.0 + 40.0


def test_a_warm_sweep_that_started_the_baseline_again_is_not_called_cached(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """An answer the baseline gave unstably (or not at all) is not stored: the warm sweep then
    starts the baseline again, and its wall time is no warm figure."""
    benchmark = load_benchmark()
    baseline, epd = get_topology("baseline"), get_topology("1E+1P+1D")

    class FakeSweep:
        def __init__(self, spec, settings, baseline_cache=None) -> None:
            self.pool = SimpleNamespace(starts=[])

        def schedule(self) -> Schedule:
            return Schedule((Wave(1, (TopologySlot(baseline, (0,)),)),))

        def run_all(self) -> SweepResult:
            for topology in (baseline, epd):  # every time: nothing was cached
                key = SimpleNamespace(topology=topology.name)
                self.pool.starts.append(StartRecord(key, "first use", 10.0))
            return SweepResult(run_dir=Path("unused"))

    config = SimpleNamespace(topologies=(epd,), prompts=(), settings=None, baseline_cache=None)
    monkeypatch.setattr(benchmark, "prepare_run", lambda request: config)
    monkeypatch.setattr(benchmark, "Sweep", FakeSweep)
    monkeypatch.setattr(benchmark.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["benchmark.py"])
    benchmark.main()
    warm_row = next(line for line in capsys.readouterr().out.splitlines() if "warm (" in line)
    assert "baseline cached" not in warm_row, warm_row
