#!/usr/bin/env python
"""Benchmark the CPU EPD sweep: cold and warm wall time, per-instance start-up and where it went
(the start-up timeline read from each instance's log), the share of the run spent starting,
request latency per role, and the harness's own peak RSS. Prints a table (and writes JSON with
--out).

Cold: the baseline cache is empty, so the baseline starts and answers every prompt twice.
Warm: the same sweep again on the filled cache, so the baseline topology is skipped.
Speed is reported here, never asserted in tests: one noisy 2-core machine is no oracle.

    .venv/bin/python scripts/benchmark.py [--topology 1E+1P+1D] [--prompt image,video]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from harness.outcomes.startup import PHASES, describe_startup_cpu
from harness.preflight import RunRequest, prepare_run
from harness.preflight.names import split_names
from harness.run.pool import StartRecord
from harness.run.sweep import Sweep, SweepResult, SweepSpec
from harness.spec.placement import Wave
from harness.spec.topology import BASELINE


class SweepRun(NamedTuple):
    """One timed sweep."""

    wall_s: float
    result: SweepResult
    waves: int
    starting_s: float  # `seconds_starting`
    baseline_started: bool  # False: every baseline answer came from the cache


def run_once(request: RunRequest) -> SweepRun:
    """One sweep as `epd-harness run` would do it: its wall time, result, waves, the wall
    seconds it waited for its topologies to start, and whether it started the baseline (a warm
    sweep does again when an answer was not stored: unstable, or none)."""
    config = prepare_run(request)
    spec = SweepSpec(topologies=config.topologies, prompts=config.prompts)
    started = time.monotonic()
    sweep = Sweep(spec, config.settings, baseline_cache=config.baseline_cache)
    waves = sweep.schedule().waves
    result = sweep.run_all()
    starts = sweep.pool.starts
    return SweepRun(
        wall_s=time.monotonic() - started,
        result=result,
        waves=len(waves),
        starting_s=seconds_starting(waves, starts),
        baseline_started=any(start.key.topology == BASELINE.name for start in starts),
    )


def seconds_starting(waves: Sequence[Wave], starts: Sequence[StartRecord]) -> float:
    """Wall seconds a sweep waited for its topologies to serve: per wave, its slowest start.
    A wave's topologies start side by side and each start counts from the wave's start, so
    their sum would count the same seconds once per topology (and could exceed the sweep's
    wall time). A start that never came up has no seconds and counts none."""
    wave_of = {slot.topology.name: wave.index for wave in waves for slot in wave.slots}
    slowest: dict[int | None, float] = {}
    for start in starts:
        if start.seconds is not None:
            index = wave_of.get(start.key.topology)
            slowest[index] = max(slowest.get(index, 0.0), start.seconds)
    return sum(slowest.values())


def timeline_by_role(result: SweepResult) -> dict[str, dict[str, float]]:
    """Per role, the median seconds from spawn to each start-up phase over its instances."""
    by_role: dict[str, dict[str, list[float]]] = {}
    for stats in result.instances:
        phases = by_role.setdefault(stats.role, {})
        for phase, at in stats.timeline.items():
            if at is not None:
                phases.setdefault(phase, []).append(at)
    return {
        role: {phase: statistics.median(values) for phase, values in phases.items()}
        for role, phases in by_role.items()
    }


def latencies_by_role(result: SweepResult) -> dict[str, list[float]]:
    """Seconds each role spent per answered request, from the proxy's traces. A request that
    got no answer is left out: it often failed at once, and timed it would read as fast."""
    by_role: dict[str, list[float]] = {
        "encoder": [],
        "prefill": [],
        "decode/pd": [],
        "end-to-end": [],
    }
    for topology, outcomes in result.outcomes.items():
        for outcome in outcomes.values():
            if outcome.result is None:
                continue
            if topology != "baseline":
                by_role["end-to-end"].append(outcome.seconds)
            trace = outcome.trace
            if trace is None:
                continue
            by_role["encoder"] += [call.seconds for call in trace.encoder_calls]
            if trace.prefill_url:
                by_role["prefill"].append(trace.prefill_seconds)
            by_role["decode/pd"].append(trace.decode_seconds)
    return by_role


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", action="append")
    parser.add_argument("--prompt", action="append")
    parser.add_argument("--devices", help="CPU cores (default: as epd-harness run)")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="epd-benchmark-"))

    def request(name: str) -> RunRequest:
        return RunRequest(
            topologies=split_names(args.topology),
            prompts=split_names(args.prompt),
            devices=args.devices,
            run_dir=str(work / name),
            baseline_cache=str(work / "baseline-cache"),
        )

    cold_run, warm_run = run_once(request("cold")), run_once(request("warm"))
    cold_s, cold, cold_waves, cold_starting_s = cold_run[:4]
    warm_s, warm, warm_waves, warm_starting_s = warm_run[:4]
    # Not warm at all when the cold sweep stored no answer to reuse: say so beside its time.
    warm_baseline = (
        "baseline started again: answers not cached"
        if warm_run.baseline_started
        else "baseline cached"
    )

    rows = [
        (f"sweep wall time, cold (baseline computed; {cold_waves} waves)", f"{cold_s:.1f} s"),
        (f"sweep wall time, warm ({warm_baseline}; {warm_waves} waves)", f"{warm_s:.1f} s"),
        (
            "verdicts cold / warm",
            f"{'all pass' if cold.passed else 'FAIL'} / {'all pass' if warm.passed else 'FAIL'}",
        ),
    ]
    for name, wall_s, starting_s in (
        ("cold", cold_s, cold_starting_s),
        ("warm", warm_s, warm_starting_s),
    ):
        rows.append(
            (
                f"share of the {name} sweep spent starting topologies",
                f"{starting_s:.1f} of {wall_s:.1f} s ({100 * starting_s / wall_s:.0f}%)",
            )
        )
    for role, phases in timeline_by_role(cold).items():
        order = [*PHASES, "ready"]
        shown = ", ".join(f"{p} {phases[p]:.0f}" for p in order if p in phases)
        rows.append((f"start-up timeline {role} (median s since spawn)", shown))
    for stats in cold.instances:
        rows.append(
            (
                f"start-up {stats.name}",
                f"{stats.startup_s or 0:.1f} s, {describe_startup_cpu(stats.startup_cpu_s)}, "
                f"peak RSS {stats.peak_rss_bytes / 2**30:.2f} GiB",
            )
        )
    for role, seconds in latencies_by_role(cold).items():
        if seconds:
            rows.append(
                (
                    f"request latency {role} (median / max of {len(seconds)})",
                    f"{statistics.median(seconds):.3f} / {max(seconds):.3f} s",
                )
            )
    harness_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rows.append(("harness peak RSS (this process)", f"{harness_rss_mib:.0f} MiB"))

    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print(f"artifacts: {work}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(rows), indent=2))
    return 0 if cold.passed and warm.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
