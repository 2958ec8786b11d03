"""The start-up timeline read from a vLLM log (harness/outcomes/startup.py)."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest

from harness.outcomes.startup import (
    PHASES,
    describe_startup_cpu,
    describe_timeline,
    startup_timeline,
)

pytestmark = pytest.mark.unit

SPAWNED = datetime.datetime(2026, 12, 1, 15, 29, 25)
CPU_LOG = """\
# epd-harness: 1E+1P+1D/decode0: vllm serve ...
Triton is installed, but doesn't include CPU backend. Disabling Triton.
(APIServer pid=8656) INFO 12-01 15:29:28 [api_utils.py:347] version 0.32.0
(APIServer pid=8656) INFO 12-01 15:29:31 [base.py:280] Multi-modal warmup completed in 0.706s
(EngineCore pid=9090) INFO 12-01 15:29:56 [core.py:133] Initializing a V1 LLM engine (v0.32.0)
(VllmWorker-0 pid=9428) WARNING 12-01 15:30:29 [vllm.py:725] Model Runner V2 requires Triton
(Worker pid=9428) INFO 12-01 15:30:30 [default_loader.py:501] Loading weights took 0.03 seconds
(EngineCore pid=9090) INFO 12-01 15:30:36 [core.py:402] init engine (profile, create kv cache, warmup model) took 2.48 s
(APIServer pid=8656) INFO 12-01 15:30:40 [entry.py:140] Starting vLLM server on http://127.0.0.1:20335
"""
# On GPUs the worker runs inside the engine core: no worker line.
GPU_LOG = """\
(APIServer pid=1) INFO 12-01 15:29:30 [api_utils.py:347] version 0.32.0
(EngineCore pid=2) INFO 12-01 15:29:35 [core.py:133] Initializing a V1 LLM engine (v0.32.0)
(EngineCore pid=2) INFO 12-01 15:29:50 [gpu_model_runner.py:1] Model loading took 6.9 GiB and 12.1 seconds
(EngineCore pid=2) INFO 12-01 15:30:05 [core.py:402] init engine (profile, create kv cache, warmup model) took 14.80 s
(APIServer pid=1) INFO 12-01 15:30:07 [entry.py:140] Starting vLLM API server on http://127.0.0.1:8000
"""


def timeline_of(tmp_path: Path, text: str, ready_s: float | None = 76.0) -> dict:
    log = tmp_path / "instance.log"
    log.write_text(text)
    return startup_timeline(log, SPAWNED.timestamp(), ready_s)


def test_every_phase_of_a_cpu_start_is_read_from_the_log(tmp_path: Path) -> None:
    timeline = timeline_of(tmp_path, CPU_LOG)
    assert timeline == {
        "api_server": 3.0,
        "engine_core": 31.0,
        "worker": 64.0,
        "model_loaded": 65.0,
        "kv_cache": 71.0,
        "serving": 75.0,
        "ready": 76.0,
    }
    assert describe_timeline(timeline).startswith("api_server 3s, engine_core 31s, worker 64s")


def test_a_phase_the_log_never_shows_is_none(tmp_path: Path) -> None:
    timeline = timeline_of(tmp_path, GPU_LOG, ready_s=None)
    assert timeline["worker"] is None and timeline["ready"] is None
    assert timeline["model_loaded"] == 25.0 and timeline["serving"] == 42.0
    assert list(timeline)[: len(PHASES)] == list(PHASES)


def test_a_missing_log_gives_an_empty_timeline(tmp_path: Path) -> None:
    timeline = startup_timeline(tmp_path / "absent.log", SPAWNED.timestamp(), None)
    assert set(timeline.values()) == {None}
    assert describe_timeline(timeline) == "no phases in the log"


def test_startup_cpu_is_shown_per_process_with_its_sum() -> None:
    cpu = {"server": 8.63, "python": 0.02, "EngineCore": 7.65, "Worker": 9.40}
    assert describe_startup_cpu(cpu) == "CPU 25.7 s (server 8.6, EngineCore 7.7, Worker 9.4)"
    assert describe_startup_cpu({}) == "CPU not sampled"


def test_each_phase_is_its_first_sign_and_a_log_may_cross_new_year(tmp_path: Path) -> None:
    """A second worker loading its weights later does not move model_loaded; vLLM's stamps
    carry no year, so a start spawned on 31 December reads January's lines as after it."""
    log = tmp_path / "instance.log"
    log.write_text(
        "(APIServer pid=1) INFO 12-31 23:59:58 [api_utils.py:347] version 0.32.0\n"
        "(Worker pid=3) INFO 01-01 00:00:10 [loader.py:501] Loading weights took 0.03 seconds\n"
        "(Worker pid=4) INFO 01-01 00:00:20 [loader.py:501] Loading weights took 0.03 seconds\n"
    )
    spawned = datetime.datetime(2026, 12, 31, 23, 59, 55).timestamp()
    timeline = startup_timeline(log, spawned, None)
    assert (timeline["api_server"], timeline["model_loaded"]) == (3.0, 15.0)
