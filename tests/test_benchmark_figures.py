"""scripts/benchmark.py's figures, computed from a sweep's records without starting anything:
what each statistic is taken over."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from harness.outcomes.chat import ChatResult
from harness.outcomes.outcome import Outcome
from harness.outcomes.trace import EncoderCall, RequestTrace
from harness.run.sweep import SweepResult

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
