"""What a run tells people and machines as text: a verdict table, failure blocks, summary.json."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from harness.files import write_text_atomic
from harness.judge.records import CaseRecord, Verdict

DETAIL_WIDTH = 70
# Before a bundle's verdicts, for a run whose red cases are what its test wanted (a self-test's
# planted fault, a death under load): a green night leaves such bundles, and the cherry-pick
# workflow's summary shows every verdicts.txt, where they read as failures of the vLLM under
# test; diff.md, report.html and the console say it too, read before verdicts.txt.
PURPOSE_LINE = "red on purpose: "
COLUMNS = ("TOPOLOGY", "PROMPT", "REFERENCE", "VERDICT", "PASS", "DETAIL")


def purpose_line(run_info: Mapping[str, Any]) -> str | None:
    """`red on purpose: ...` for a run that planted a fault (run.json's `fault`) or killed an
    instance under load (`killed`); None for any other."""
    if run_info.get("fault"):
        return f"{PURPOSE_LINE}the run planted the fault {run_info['fault']}"
    if run_info.get("killed"):
        return f"{PURPOSE_LINE}the load killed {run_info['killed']} with its requests in flight"
    return None


def run_problems(run_info: Mapping[str, Any]) -> list[str]:
    """What failed the run beyond its cases' verdicts (run.json's `problems`: a matrix
    scenario's check, a pass whose guard nothing could check), each as the console says it:
    a run every case of which passed is red by them, and every report must say so."""
    return [f"problem: {problem}" for problem in run_info.get("problems") or ()]


def _one_line(text: str, width: int) -> str:
    """Collapse whitespace and cut to `width` so a table row stays one readable line."""
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _passed_cell(record: CaseRecord) -> str:
    """`yes`, `NO`, or `yes (declared: NAME)` for a case that passed only as a declared
    upstream failure: its detail says so at its end, which the table cuts, and a MISMATCH
    marked `yes` with no reason would read as a harness that passes mismatches."""
    if not record.policy_passed:
        return "NO"
    return f"yes (declared: {record.declared_failure})" if record.declared_failure else "yes"


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
            _passed_cell(r),
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
    unchecked = Counter(name for r in records for name in r.unchecked_guards())
    if unchecked:
        named = ", ".join(f"{name} in {n} case(s)" for name, n in unchecked.items())
        lines.append(f"guards NOT CHECKED (no evidence where this run stands): {named}")
    return "\n".join(lines)


def describe_baseline_sources(sources: Mapping[str, Mapping[str, Any]]) -> str | None:
    """One line saying which baseline answers this run's baseline did not serve (read from
    the baseline cache, or goldens) and who computed them when; None when it served them all.
    A MISMATCH judged against a weeks-old entry from another host must say so where it is
    read (verdicts.txt, report.html), not only in run.json."""
    cached = {p: s for p, s in sources.items() if s.get("source") == "baseline cache"}
    goldens = sorted(p for p, s in sources.items() if s.get("source") == "golden")
    parts = []
    if cached:
        entries = [s.get("entry") or {} for s in cached.values()]
        builds = sorted({f"vLLM {e.get('vllm')}, torch {e.get('torch')}" for e in entries})
        hosts = sorted({str(e.get("host")) for e in entries})
        dates = sorted(str(e.get("created")) for e in entries)
        when = dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}"
        directories = sorted({str(s.get("cache_dir")) for s in cached.values()})
        parts.append(
            f"{len(cached)} of {len(sources)} answer(s) from the baseline cache "
            f"{', '.join(directories)} ({', '.join(sorted(cached))}): computed by "
            f"{'; '.join(builds)} on {', '.join(hosts)}, {when} (keys in run.json "
            "baseline_sources)"
        )
    if goldens:
        releases = sorted({str(sources[p].get("release")) for p in goldens})
        parts.append(f"{len(goldens)} from the goldens of vLLM {', '.join(releases)}")
    return "baseline: " + "; ".join(parts) if parts else None


def write_summary_json(
    path: str | os.PathLike[str],
    records: Sequence[CaseRecord],
    run_info: dict[str, Any],
    problems: Sequence[str] = (),
) -> None:
    """Write summary.json atomically, so a reader never sees half a file.

    `passed` is False for a run without cases: a run that compared nothing proved nothing; and
    for one its `problems` failed beyond the cases' verdicts (a pass whose guard nothing could
    check, a matrix scenario not as declared), as the exit code says, for a CI job that reads
    the file instead.
    """
    target = Path(path)
    document = {
        "run": run_info,
        "cases": [r.to_json() for r in records],
        "totals": _totals(records),
        "passed": bool(records) and all(r.policy_passed for r in records) and not problems,
    }
    if problems:
        document["problems"] = list(problems)
    write_text_atomic(target, json.dumps(document, sort_keys=True, indent=2) + "\n")


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
    for name, guard in record.unchecked_guards().items():
        lines.append(f"  guard {name} {guard.get('evidence', 'not checkable')}")
    # A failed request's error is its explanation already (`judge_case`): said once, its log
    # slices are long enough.
    if record.error and record.error not in (explanation or ""):
        lines.append(f"  error: {record.error}")
    return "\n".join(lines)


def drift_summary(d: Mapping[str, Any]) -> str:
    """'no (gaps 3.10 / 2.95 nats, delta at the divergence 0.150, prefix delta 0.000; tolerance
    0 nats)' from Divergence.to_json,
    or 'no (why)' where the drift rule does not apply (`Divergence.drift_not_applicable`)."""

    def nats(value: object) -> str:
        return "n/a" if value is None else f"{value:.3f}"

    if d.get("drift_not_applicable"):
        return f"no ({d['drift_not_applicable']})"
    return (
        f"{'yes' if d.get('drift') else 'no'} (gaps {nats(d.get('reference_gap'))} / "
        f"{nats(d.get('candidate_gap'))} nats, delta at the divergence "
        f"{nats(d.get('divergence_delta'))}, prefix delta {nats(d.get('prefix_delta'))}; "
        f"tolerance {d.get('tolerance', 0):g} nats)"
    )
