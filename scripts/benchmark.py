#!/usr/bin/env python
"""Benchmark the CPU EPD sweep: cold and warm wall time, per-instance start-up, request latency
per role, and the harness's own peak RSS. Prints a table (and writes JSON with --out).

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
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.run.baseline_cache import BaselineCache  # noqa: E402
from harness.cli.main import default_vllm_executable, resolve_model, select_prompts, split_names  # noqa: E402
from harness.serve.session import RunSettings  # noqa: E402
from harness.run.sweep import Sweep, SweepPlan, SweepResult  # noqa: E402
from harness.spec.topology import EPD_TOPOLOGY_NAMES, ServingConfig, get_topology  # noqa: E402


def run_once(plan: SweepPlan, model: Path, run_dir: Path, cache: BaselineCache) -> tuple[float, SweepResult]:
    settings = RunSettings(
        serving=ServingConfig(model=str(model)),
        run_dir=run_dir,
        vllm_executable=default_vllm_executable(),
    )
    started = time.monotonic()
    result = Sweep(plan, settings, log=lambda line: None, baseline_cache=cache).run_all()
    return time.monotonic() - started, result


def latencies_by_role(result: SweepResult) -> dict[str, list[float]]:
    """Seconds each role spent per request, from the proxy's traces."""
    by_role: dict[str, list[float]] = {"encoder": [], "prefill": [], "decode/pd": [], "end-to-end": []}
    for topology, outcomes in result.outcomes.items():
        for outcome in outcomes.values():
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
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    topologies = tuple(get_topology(n) for n in (split_names(args.topology) or EPD_TOPOLOGY_NAMES))
    plan = SweepPlan(topologies=topologies, prompts=select_prompts(split_names(args.prompt)))
    model = resolve_model(None)
    work = Path(tempfile.mkdtemp(prefix="epd-benchmark-"))
    cache = BaselineCache(work / "baseline-cache")

    cold_s, cold = run_once(plan, model, work / "cold", cache)
    warm_s, warm = run_once(plan, model, work / "warm", cache)

    rows = [("sweep wall time, cold (baseline computed)", f"{cold_s:.1f} s"),
            ("sweep wall time, warm (baseline cached)", f"{warm_s:.1f} s"),
            ("verdicts cold / warm", f"{'all pass' if cold.passed else 'FAIL'} / "
                                     f"{'all pass' if warm.passed else 'FAIL'}")]  # fmt: skip
    for stats in cold.instances:
        rows.append((f"start-up {stats.name}", f"{stats.startup_s or 0:.1f} s, "
                                               f"peak RSS {stats.peak_rss_bytes / 2**30:.2f} GiB"))
    for role, seconds in latencies_by_role(cold).items():
        if seconds:
            rows.append((f"request latency {role} (median / max of {len(seconds)})",
                         f"{statistics.median(seconds):.3f} / {max(seconds):.3f} s"))
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
