"""Everything a run has produced so far, written to its run directory after every step.

responses.json (every answer and its evidence), summary.json (every case, the totals and the
run's facts), verdicts.txt (the table) and the bundle (run.json, diff.md, junit.xml,
report.html). Rewritten whole each time, atomically: a run that fails or is interrupted keeps
what it had.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from harness.devices import describe_devices
from harness.files import write_json_atomic, write_text_atomic
from harness.judge.records import CaseRecord
from harness.outcomes.outcome import Outcome
from harness.report.bundle import Redactor, write_bundle
from harness.report.text import (  # PURPOSE_LINE, purpose_line: read from here too
    PURPOSE_LINE,
    describe_baseline_sources,
    format_verdict_table,
    purpose_line,
    run_problems,
    write_summary_json,
)

__all__ = ["PURPOSE_LINE", "purpose_line", "write_run_outputs", "write_verdicts"]

VERDICTS_FILE = "verdicts.txt"  # the verdict table as the terminal shows it
# verdicts.txt's first line (its second under a `red on purpose:` line): what computed the ids
# (another GPU model can change them).
DEVICES_LINE = "ran on: "
DTYPE_PART = "; dtype "  # after the devices: the dtype every instance computed in


def write_run_outputs(
    run_dir: Path,
    records: Sequence[CaseRecord],
    outcomes: Mapping[str, Mapping[str, Outcome]],
    summary: dict[str, Any],
    run_info: dict[str, Any],
) -> None:
    """`outcomes` by topology (or scenario label) and prompt; `summary` goes into
    summary.json's run section; `run_info` is what `write_run_info` returned. Every file is
    scrubbed of the run's secrets as the bundle's are: an error's log tail or an answer may
    carry one, and no artifact may."""
    redactor = Redactor.for_run(run_dir)
    responses = redactor.data(
        {
            topology: {prompt: outcome.to_json() for prompt, outcome in by_prompt.items()}
            for topology, by_prompt in outcomes.items()
        }
    )
    clean_records = [redactor.record(r) for r in records]
    problems = redactor.data(run_info.get("problems") or [])
    write_json_atomic(run_dir / "responses.json", responses)
    write_summary_json(run_dir / "summary.json", clean_records, redactor.data(summary), problems)
    write_verdicts(run_dir, clean_records, redactor.data(run_info))
    write_bundle(run_dir, records, responses, run_info)


def write_verdicts(
    run_dir: Path, records: Sequence[CaseRecord], run_info: Mapping[str, Any]
) -> None:
    """verdicts.txt: whether the run is red on purpose (`purpose_line`), the devices that
    computed the ids and the dtype they computed in (`ran on: ...; dtype ...`, from run.json's
    `devices_used` and `serving`), the verdict table, and where the baseline came from. Every
    bundle writes it here: a matrix run's, a fuzz run's and each of its failure groups'."""
    table = "\n".join([format_verdict_table(records), *run_problems(run_info)])
    sources = describe_baseline_sources(run_info.get("baseline_sources") or {})
    head = "".join(f"{line}\n" for line in (purpose_line(run_info), devices_line(run_info)) if line)
    tail = f"\n{sources}" if sources else ""
    write_text_atomic(run_dir / VERDICTS_FILE, head + table + tail + "\n")


def devices_line(run_info: Mapping[str, Any]) -> str | None:
    """`ran on: <devices>; dtype <dtype>` of a run's facts: what computed the ids, and in
    which dtype (run.json's `serving`; left out for a run that did not record it), as the
    console's header and report.html say it; None for a run that recorded no devices."""
    devices = describe_devices(run_info.get("devices_used"))
    if not devices:
        return None
    dtype = (run_info.get("serving") or {}).get("dtype")
    return f"{DEVICES_LINE}{devices}" + (f"{DTYPE_PART}{dtype}" if dtype else "")
