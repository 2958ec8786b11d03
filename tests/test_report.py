"""Verdict table, failure block and summary.json on hand-built records."""

from __future__ import annotations

import json
import re

import pytest

from harness.judge.compare import Verdict, compare_results
from harness.outcomes.chat import ChatResult
from harness.report.text import (
    drift_summary,
    format_failure,
    format_verdict_table,
    write_summary_json,
)
from harness.testing.builders import case_record, outcome
from harness.testing.judging import judged

pytestmark = pytest.mark.unit


RECORDS = [
    case_record(prompt="image-cat"),
    case_record(prompt="video-clip", verdict=Verdict.DRIFT, detail="x" * 200),
    case_record(topology="1P+1D", verdict=Verdict.MISMATCH, passed=False),
]


def test_table_has_header_one_row_per_record_and_totals():
    lines = format_verdict_table(RECORDS).splitlines()
    assert lines[0].split() == ["TOPOLOGY", "PROMPT", "REFERENCE", "VERDICT", "PASS", "DETAIL"]
    rows = lines[1:-1]
    assert len(rows) == len(RECORDS)
    assert rows[2].startswith("1P+1D") and " NO " in rows[2]
    assert all(" yes " in row for row in rows[:2])
    # Aligned: every row's VERDICT column starts where the header's does.
    column = lines[0].index("VERDICT")
    assert [row[column:].split()[0] for row in rows] == ["MATCH", "DRIFT", "MISMATCH"]
    assert len(rows[1]) < 150  # the 200-char detail was cut
    assert lines[-1] == "verdicts: 2 pass, 1 fail (MATCH 1, MISMATCH 1, DRIFT 1)"


def test_totals_line_is_not_a_test_runner_summary():
    text = format_verdict_table(RECORDS)
    assert not re.search(r"\d+ passed, \d+ failed", text)


def test_detail_newlines_do_not_break_rows():
    lines = format_verdict_table([case_record(detail="one\ntwo")]).splitlines()
    assert len(lines) == 3 and lines[1].endswith("one two")


def test_empty_table_still_reports_totals():
    assert format_verdict_table([]).splitlines()[-1] == "verdicts: 0 pass, 0 fail (none)"


def test_summary_round_trips(tmp_path):
    path = tmp_path / "run" / "summary.json"
    write_summary_json(path, RECORDS, {"model": "tiny", "seed": 1234})
    with open(path) as f:
        data = json.load(f)
    assert data["run"] == {"model": "tiny", "seed": 1234}
    assert data["passed"] is False
    assert data["totals"] == {"MATCH": 1, "DRIFT": 1, "MISMATCH": 1}
    assert [c["verdict"] for c in data["cases"]] == ["MATCH", "DRIFT", "MISMATCH"]
    assert data["cases"][0] == RECORDS[0].to_json()
    assert data["cases"][0]["guards"]["kv_transfer"]["ok"] is True
    assert [p.name for p in path.parent.iterdir()] == ["summary.json"]  # no temp file left


def test_summary_passes_only_when_every_record_passes(tmp_path):
    path = tmp_path / "summary.json"
    write_summary_json(path, RECORDS[:2], {})
    assert json.loads(path.read_text())["passed"] is True
    write_summary_json(path, [], {})  # overwrites in place
    assert json.loads(path.read_text())["passed"] is False  # nothing compared, nothing proved


def test_summary_is_sorted_and_indented(tmp_path):
    path = tmp_path / "summary.json"
    write_summary_json(path, RECORDS[:1], {"b": 1, "a": 2})
    text = path.read_text()
    assert text.index('"cases"') < text.index('"passed"') < text.index('"run"')
    assert '\n  "cases"' in text


def test_failure_block_carries_all_evidence():
    ref = ChatResult((1, 2), (10, 11, 12), "", "length")
    cand = ChatResult((1, 2), (10, 11, 99), "", "length")
    cmp = compare_results(ref, cand)
    rec = case_record(
        verdict=Verdict.MISMATCH,
        passed=False,
        detail=cmp.headline(),
        explanation=cmp.describe(),
        divergence=cmp.divergence.to_json(),
        guards={
            "kv_transfer": {"ok": False, "evidence": "cached_tokens=0, expected >= 96"},
            "ec_transfer": {"ok": True, "evidence": "1 embedding file read"},
        },
        error="proxy returned HTTP 500",
    )
    text = format_failure(rec)
    assert "1E+1P+1D" in text and "image-cat" in text and "baseline" in text
    assert "MISMATCH" in text and "FAILED" in text
    assert "generated tokens differ at position 2 of 3/3" in text
    assert "kv_transfer failed: cached_tokens=0, expected >= 96" in text
    assert "ec_transfer" not in text  # only failed guards
    assert "error: proxy returned HTTP 500" in text


def test_failure_block_falls_back_to_detail():
    text = format_failure(case_record(verdict=Verdict.ERROR, passed=False, detail="timed out"))
    assert "timed out" in text and "ERROR" in text


def test_failure_block_of_a_failed_request_says_its_error_once():
    """A request that failed is judged ERROR with its error as the explanation: the block said
    it twice (the explanation, then `error:`), every instance's log slice and the entry's last
    lines printed two times over in a pytest assertion (seen on a NIXL handshake that timed
    out under Ray)."""
    error = (
        "ServerFailedError: Error code: 500\n"
        "--- 1E+1P+1D/decode0 logged during the request ---\n"
        "NIXL transfer failure: handshake_failed"
    )
    record = judged("1E+1P+1D", "baseline", outcome("image", (1, 2)), outcome("image", error=error))
    assert record.verdict is Verdict.ERROR and record.error == error
    text = format_failure(record)
    assert text.count("NIXL transfer failure: handshake_failed") == 1, text
    assert text.count("ServerFailedError: Error code: 500") == 1, text


def test_drift_summary_of_a_side_that_ended_says_why_drift_does_not_apply():
    """diff.md and report.html say it as the console does, not "no (gaps n/a / n/a ...)"."""
    ref = ChatResult((1, 2), (10, 11, 12), "", "length")
    ended = ChatResult((1, 2), (10, 11), "", "length")
    d = compare_results(ref, ended, tolerance=1.0).divergence.to_json()
    assert drift_summary(d) == "no (one side ended: a length difference is no near-tie)"


def test_the_report_header_names_the_dtype_beside_vllm_and_torch():
    """A T4's float16 run was told from a bfloat16 one only in the serving table far below."""
    from harness.report.html import render_report_html

    run_info = {
        "served_vllm": {"version": "0.32.0", "torch_version": "2.13.0"},
        "serving": {"dtype": "float16"},
    }
    page = render_report_html([case_record()], {}, run_info)
    meta = page.split('<p class="meta">', 1)[1].split("</p>", 1)[0]
    assert meta == "vLLM 0.32.0 · torch 2.13.0 · dtype float16", meta
    assert "dtype" not in render_report_html([case_record()], {}, {})


def test_drift_summary_names_the_log_prob_delta_at_the_divergence():
    """A near tie with an agreeing prefix whose two tokens moved beyond the floor is no drift:
    the summary shows the number that says why."""
    d = {"drift": False, "reference_gap": 0.02, "candidate_gap": 0.02, "prefix_delta": 0.01}
    d |= {"divergence_delta": 2.52, "tolerance": 0.05}
    assert "delta at the divergence 2.520" in drift_summary(d)


def test_drift_summary_says_yes_for_a_divergence_the_drift_rule_took():
    """A DRIFT verdict's evidence: every report's `drift:` line says yes, with the gaps."""
    d = {"drift": True, "reference_gap": 0.01, "candidate_gap": 0.02, "prefix_delta": 0.0}
    d |= {"divergence_delta": 0.01, "tolerance": 0.05}
    assert drift_summary(d).startswith("yes (gaps 0.010 / 0.020 nats")


def test_the_table_says_a_pass_was_a_declared_failure_however_long_its_detail():
    """Found in review: a case that passed only as a declared upstream failure said so at the
    end of its detail alone, which the table cuts to 70 characters; a prompt-ids MISMATCH
    read `MISMATCH  yes` in verdicts.txt and on the console, with nothing saying why."""
    detail = (
        "prompt ids differ at position 14 (reference 120 ids, candidate 110 ids); generated "
        "tokens differ at position 0 of 8/8; declared upstream failure: vllm#12345"
    )
    declared = case_record(
        verdict=Verdict.MISMATCH, detail=detail, declared_failure="ec-placeholder-size"
    )
    row = format_verdict_table([declared]).splitlines()[1]
    assert "declared: ec-placeholder-size" in row
