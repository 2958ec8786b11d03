"""What a run tells people and machines: a verdict table, failure blocks, and summary.json.

One `CaseRecord` per (topology, prompt, reference) carries everything needed to judge the case
without rerunning it: the verdict, whether the policy passed it, the comparison's evidence,
every guard's evidence, and timings.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from harness.compare import Verdict

DETAIL_WIDTH = 70
ARTIFACT_MODE = 0o644  # mkstemp creates 0600; artifacts are for everyone who reads the run
COLUMNS = ("TOPOLOGY", "PROMPT", "REFERENCE", "VERDICT", "PASS", "DETAIL")


@dataclass(frozen=True)
class CaseRecord:
    """The outcome of comparing one topology's answer to one prompt against one reference."""

    topology: str
    prompt: str
    reference: str  # name of the reference topology, e.g. "baseline"
    verdict: Verdict
    policy_passed: bool
    detail: str  # one line, e.g. TokenComparison.headline()
    divergence: dict[str, Any] | None  # Divergence.to_json()
    guards: dict[str, dict[str, Any]]  # name -> {"ok": bool, "evidence": str}
    timings: dict[str, float]
    error: str | None
    explanation: str = ""  # TokenComparison.describe(): the multi-line evidence

    def failed_guards(self) -> dict[str, dict[str, Any]]:
        return {name: g for name, g in self.guards.items() if not g.get("ok")}

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["verdict"] = self.verdict.value
        return data


def _one_line(text: str, width: int) -> str:
    """Collapse whitespace and cut to `width` so a table row stays one readable line."""
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _totals(records: Iterable[CaseRecord]) -> dict[str, int]:
    """Count per verdict, in the Verdict enum's order, omitting verdicts that never occurred."""
    counts = Counter(r.verdict for r in records)
    return {v.value: counts[v] for v in Verdict if counts[v]}


def format_verdict_table(records: Sequence[CaseRecord]) -> str:
    """An aligned plain-text table and a totals line.

    The totals line says "pass"/"fail", never "N passed, N failed": CI reads lines of that
    form as a test runner's summary.
    """
    rows = [
        (
            r.topology,
            r.prompt,
            r.reference,
            r.verdict.value,
            "yes" if r.policy_passed else "NO",
            _one_line(r.detail, DETAIL_WIDTH),
        )
        for r in records
    ]
    widths = [max(len(cell) for cell in column) for column in zip(COLUMNS, *rows)]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
        for row in (COLUMNS, *rows)
    ]
    passed = sum(r.policy_passed for r in records)
    counts = ", ".join(f"{v} {n}" for v, n in _totals(records).items()) or "none"
    lines.append(f"verdicts: {passed} pass, {len(records) - passed} fail ({counts})")
    return "\n".join(lines)


def write_summary_json(
    path: str | os.PathLike[str], records: Sequence[CaseRecord], run_info: dict[str, Any]
) -> None:
    """Write summary.json atomically, so a reader never sees half a file.

    `passed` is False for a run without cases: a run that compared nothing proved nothing.
    """
    target = Path(path)
    document = {
        "run": run_info,
        "cases": [r.to_json() for r in records],
        "totals": _totals(records),
        "passed": bool(records) and all(r.policy_passed for r in records),
    }
    write_text_atomic(target, json.dumps(document, sort_keys=True, indent=2) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """Write via a temporary file and a rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, ARTIFACT_MODE)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def format_failure(record: CaseRecord) -> str:
    """A multi-line block for the console or a pytest assertion message."""
    outcome = "passed" if record.policy_passed else "FAILED"
    lines = [
        f"{record.topology} vs {record.reference} on prompt {record.prompt!r}: "
        f"{record.verdict.value} (policy {outcome})",
    ]
    explanation = record.explanation or record.detail
    if explanation:
        lines += [f"  {line}" for line in explanation.splitlines()]
    for name, guard in record.failed_guards().items():
        lines.append(f"  guard {name} failed: {guard.get('evidence', '(no evidence)')}")
    if record.error:
        lines.append(f"  error: {record.error}")
    return "\n".join(lines)
