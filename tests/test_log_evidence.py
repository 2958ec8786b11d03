"""What a failed request's evidence keeps of an instance's log (harness.serve.session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.serve.session import (
    LOG_SLICE_LINES,
    LOG_TAIL_SLICE_LINES,
    prepare_session_dir,
    select_evidence,
)

pytestmark = pytest.mark.unit

CAUSE = "AssertionError: Expected number of multimodal embeddings to match number of input items"
PREFIX = "(EngineCore pid=7) ERROR 12-02 06:47:08 [core.py:1512]"


def engine_core_death(frames: int) -> list[str]:
    """An engine core dying in its in-process worker: every frame an ERROR line, the cause
    last, then the API server's error and its shutdown noise."""
    return [
        "(APIServer pid=6) INFO 12-02 06:47:07 [logger.py:1] Received request r1",
        f"{PREFIX} Traceback (most recent call last):",
        *(f'{PREFIX}   File "/site/vllm/frame{n}.py", line {n}, in f{n}' for n in range(frames)),
        f"{PREFIX} {CAUSE}: 1, but got len(mm_embeddings)=0 instead.",
        "(APIServer pid=6) ERROR 12-02 06:47:08 [async_llm.py:906] vllm.v1.engine.exceptions."
        "EngineDeadError: EngineCore encountered an issue.",
        *(f"INFO:     shutdown step {n}" for n in range(20)),
    ]


def test_the_cause_of_a_long_traceback_is_kept() -> None:
    lines = engine_core_death(frames=2 * LOG_SLICE_LINES)
    evidence = select_evidence(lines).splitlines()
    assert any(CAUSE in line for line in evidence), evidence
    assert any("EngineDeadError: EngineCore encountered an issue" in line for line in evidence)
    assert len([line for line in evidence if "ERROR" in line]) == LOG_SLICE_LINES
    shown = [line for line in evidence if line != "..."]
    assert shown == sorted(shown, key=lines.index), "the log's order is kept"
    assert evidence[-LOG_TAIL_SLICE_LINES:] == lines[-LOG_TAIL_SLICE_LINES:]


def test_a_short_traceback_is_kept_whole_and_in_order() -> None:
    lines = engine_core_death(frames=3)
    evidence = select_evidence(lines).splitlines()
    errors = [line for line in lines if "ERROR" in line]
    assert evidence[: len(errors)] == errors
    assert evidence[len(errors)] == "..."


def test_a_log_without_errors_gives_its_last_lines() -> None:
    lines = [f"INFO line {n}" for n in range(30)]
    assert select_evidence(lines).splitlines() == lines[-LOG_TAIL_SLICE_LINES:]


def test_an_error_line_among_the_last_lines_is_shown_once() -> None:
    """A log that ends on its error (the engine died at once): the error line is in the tail
    too, and is shown once, first, the rest of the tail after it."""
    lines = [f"INFO line {n}" for n in range(3)] + [f"{PREFIX} {CAUSE}"]
    assert select_evidence(lines).splitlines() == [lines[-1], "...", *lines[:3]]


def test_a_restart_keeps_the_earlier_logs_and_clears_everything_else(tmp_path: Path) -> None:
    """A topology started again in its directory: the log of the start it replaces holds the
    restart's cause and is kept beside the ones kept before (they stay as they are); storage
    and command files of the earlier start are gone."""
    (tmp_path / "1P-1D__decode0.log").write_text("died")
    (tmp_path / "1P-1D__decode0.1.log").write_text("died before")
    (tmp_path / "1P-1D__decode0.cmd.json").write_text("{}")
    (tmp_path / "storage").mkdir()
    (tmp_path / "storage" / "kv.bin").write_text("stale")
    kept = prepare_session_dir(tmp_path)
    assert kept == {tmp_path / "1P-1D__decode0.log": tmp_path / "1P-1D__decode0.2.log"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "1P-1D__decode0.1.log",
        "1P-1D__decode0.2.log",
    ]
    assert (tmp_path / "1P-1D__decode0.1.log").read_text() == "died before"
    assert (tmp_path / "1P-1D__decode0.2.log").read_text() == "died"
