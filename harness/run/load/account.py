"""A load's account, load.md and load.json, rewritten whole as the load grows: the figures
over every request judged and every sample, and what is kept whole (`LoadResult`). Every
request's row, sample and KV account is a line of its .jsonl file, appended as it is taken.
What a request's error or the calibration quotes (an instance's log tail, an HTTP error's
body) is scrubbed of the run's secrets as the bundle's files are (`Redactor`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.files import append_json_lines, write_json_atomic, write_text_atomic
from harness.report.bundle import Redactor
from harness.report.load import (
    REQUESTS_FILE,
    RequestRow,
    format_load,
    kv_account_line,
    load_stats,
    stats_json,
)
from harness.report.resources import SAMPLES_FILE, SoakBounds
from harness.run.load.death import spared_by_the_kill
from harness.run.load.result import LoadResult
from harness.spec.load import LoadSpec


def account_notes(
    spec: LoadSpec, bounds: SoakBounds, planned: Sequence[str], result: LoadResult
) -> list[str]:
    """What the figures do not say: the plan's notes (`planned`), where the batch numerics
    came from, the kill, the deaths declared, what ended the load, the KV accounts, a soak's
    bounds, the problems."""
    notes = list(planned)
    if result.calibration is not None:
        notes.append(
            f"batch numerics: {result.calibration.describe()}; {result.calibration_source}"
        )
    if result.killed is not None and result.killed_at_s is not None:
        ends = [r.ended_s - result.killed_at_s for r in result.results if not r.not_sent]
        spared = [str(request.number) for request in spared_by_the_kill(result)]
        if result.problems:
            held = ""
        elif spared:
            held = (
                "; every request that reached it ended ERROR naming it, as it must; "
                f"request(s) {', '.join(spared)}, served whole by the other instances of "
                "its role, passed"
            )
        else:
            held = "; every request ended ERROR naming it, as it must"
        notes.append(
            f"killed {result.killed} at {result.killed_at_s:.1f}s (planted); the last "
            f"request in flight ended {max(ends, default=0.0):.2f}s later{held}"
        )
    notes += [f"as declared: {death}" for death in result.declared_deaths]
    if result.ended_by is not None:
        notes.append(f"the load ended early: {result.ended_by}")
    if result.kv.rounds:
        notes.append(result.kv.describe())
    if spec.duration_s is not None:
        notes.append(
            f"soak of {spec.duration_s:.0f}s, {result.rounds} round(s); bounds: storage "
            f"<= {bounds.storage_bytes / 2**20:.0f} MiB each, RSS growth <= "
            f"{bounds.rss_growth_bytes / 2**20:.0f} MiB and open files growth <= {bounds.fd_growth} "
            "per instance after the first round"
        )
    notes += [f"problem: {p}" for p in result.problems]
    return notes


def write_account(
    run_dir: Path,
    topology: str,
    spec: LoadSpec,
    bounds: SoakBounds,
    planned: Sequence[str],
    result: LoadResult,
) -> None:
    """load.md and load.json in `run_dir`, the statistics computed afresh."""
    result.stats = load_stats(result.tally, result.resources)
    notes = account_notes(spec, bounds, planned, result)
    title = (
        f"Load on {topology}: {spec.requests} request(s) per round, "
        f"concurrency {spec.concurrency}{', streamed' if spec.stream else ''}"
    )
    rows = [r.row() for r in result.results]
    redactor = Redactor.for_run(run_dir)
    write_text_atomic(
        run_dir / "load.md",
        redactor.text(
            format_load(
                title,
                result.stats,
                rows,
                result.resources,
                notes,
                result.unlisted,
                result.failed_unlisted,
            )
        ),
    )
    write_json_atomic(run_dir / "load.json", redactor.data(account_json(spec, result, notes)))


def append_request_rows(run_dir: Path, rows: Sequence[RequestRow]) -> None:
    """A round's requests, a line each of load-requests.jsonl, scrubbed of the run's secrets
    (a request's detail is its error's first line: an HTTP error's body may quote one)."""
    redactor = Redactor.for_run(run_dir)
    append_json_lines(run_dir / REQUESTS_FILE, [redactor.data(row.to_json()) for row in rows])


def account_json(spec: LoadSpec, result: LoadResult, notes: list[str]) -> dict[str, Any]:
    assert result.stats is not None
    return {
        "spec": dataclasses.asdict(spec),
        "passed": result.passed,
        "stats": stats_json(result.stats),
        "placements": {
            prompt: {**placement.__dict__, "region": placement.region.value}
            for prompt, placement in result.placements.items()
        },
        "calibration": None
        if result.calibration is None
        else {
            "concurrency": result.calibration.concurrency,
            "noise_floor_nats": result.calibration.noise_floor,
            "changed": [a.__dict__ for a in result.calibration.changed],
            "unanswered": [a.__dict__ for a in result.calibration.unanswered],
            "describe": result.calibration.describe(),
            "source": result.calibration_source,
        },
        "rounds": result.rounds,
        "ended_by": result.ended_by,
        "killed": result.killed,
        "killed_at_s": result.killed_at_s,
        "problems": result.problems,
        "kv_accounts": [kv_account_line(n, a) for n, a in result.kv.kept],
        "kv_accounts_counted": result.kv.to_json(),
        "notes": notes,
        # The first round's and the first failures of each prompt and verdict: a soak's
        # every request here made each round's rewrite cost the soak so far. Every request
        # judged is a line of load-requests.jsonl, and counted in the stats.
        "requests": [r.to_json() for r in result.results],
        "requests_unlisted": result.unlisted,
        "requests_failed_unlisted": [
            {"prompt": prompt, "verdict": verdict, "requests": n}
            for (prompt, verdict), n in sorted(result.failed_unlisted.items())
        ],
        "requests_file": REQUESTS_FILE,
        # Likewise the samples: those a reader needs whole; every one is a line of
        # load-samples.jsonl, and in the stats and the bounds.
        "samples": result.resources.listed_json(),
        "samples_taken": result.resources.count,
        "samples_file": SAMPLES_FILE,
    }
