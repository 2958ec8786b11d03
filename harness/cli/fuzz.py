"""`epd-harness fuzz`: differential fuzzing of one EPD topology against the baseline.

Draws `--examples` requests from the strategies (`harness.run.fuzz.strategies`) with
`--seed`, keeps the baseline and the topology (or an `--attach`ed deployment) up side by side,
judges every example with the harness's verdicts and guards, groups failures by signature,
shrinks each to a minimal request and writes a repro bundle per group. Exit 0 when no new
failure was found (declared upstream failures are reported as known), 1 when one was, 2 on
bad input.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import math
import time
from pathlib import Path
from typing import Any

from harness.cli.serving_options import (
    add_proxy_options,
    add_serving_options,
    proxy_fields,
    serving_fields,
)
from harness.errors import EXIT_FAILED, EXIT_OK, BadInput
from harness.files import fresh_run_dir
from harness.preflight import RunRequest, prepare_run
from harness.preflight.config import check_arguments
from harness.run.faults.spec import FAULT_NAMES, FAULT_SYNTAX, STREAM_FAULTS, parse_fault
from harness.run.fuzz.run_budget import RunBudget
from harness.run.fuzz.shrink import ShrinkBudget

log = logging.getLogger("harness")

DEFAULT_EXAMPLES = 100
# The most examples of one run. Every example is drawn, held and written to the bundle before
# the first is sent (measured on a loaded 2-core host: 3,000 in 62 s, 10,000 in 149 s and
# 300 MiB, the time per example growing with the count), and each is a request pair to real
# vLLM, judged and perhaps shrunk: 10,000 is hours of a GPU night. Wider coverage is more
# runs with other --seed values, each a list (and a bundle) of its own.
MAX_EXAMPLES = 10_000


def add_fuzz_parser(sub: Any) -> None:
    fuzz = sub.add_parser(
        "fuzz",
        help="generated requests against one topology and the baseline, failures shrunk",
    )
    fuzz.add_argument("--topology", required=True, help="one EPD topology, e.g. 1E+1P+1D")
    fuzz.add_argument("--examples", type=int, default=DEFAULT_EXAMPLES, help="requests to draw")
    fuzz.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the draw's seed (the same seed and --examples give the same list; another "
        "--examples draws another list, not a prefix of it)",
    )
    fuzz.add_argument("--run-dir", help="artifact directory (default: runs/fuzz-<timestamp>)")
    fuzz.add_argument(
        "--save",
        action="store_true",
        help="write each new failure's minimal request as a matrix scenario "
        "(harness/run/found_scenarios.json)",
    )
    fuzz.add_argument("--reason", help="with --save: the upstream cause to declare")
    fuzz.add_argument(
        "--plant-fault",
        metavar="FAULT",
        help=f"self-test: plant a fault ({', '.join(FAULT_NAMES)}) or a graded one "
        f"({FAULT_SYNTAX}) in the topology; the fuzz must find failures",
    )
    fuzz.add_argument(
        "--stream",
        action="store_true",
        help="send every example to the topology streamed (stream: true, with usage), its "
        "framing judged too; the baseline answers unstreamed, as for 'run --stream'",
    )
    fuzz.add_argument(
        "--confirm-known",
        type=int,
        default=2,
        help="send this many examples a known crash's trigger predicts before trusting it "
        "(later ones are counted, not sent: each would kill an instance)",
    )
    fuzz.add_argument("--max-shrink-trials", type=int, default=80, help="per failure group")
    # The two restart budgets default to None, so that one given with --attach (whose
    # deployment the harness never restarts) is told from its default and refused.
    fuzz.add_argument(
        "--max-restarts",
        type=int,
        help=f"per failure group's shrink (default: {ShrinkBudget.max_restarts})",
    )
    fuzz.add_argument(
        "--max-run-restarts",
        type=int,
        help="restarts of the topology in the whole run; once spent, what needs one is "
        f"counted as not sent (default: {RunBudget.max_restarts})",
    )
    fuzz.add_argument(
        "--budget-s",
        type=float,
        default=RunBudget.max_seconds,
        help="wall time of the run from the servers' start; examples and shrinks left when "
        "it is spent are counted as not sent / not shrunk",
    )
    add_serving_options(fuzz)
    add_proxy_options(fuzz, attach_help="fuzz a running deployment (attach file)")
    fuzz.set_defaults(func=command_fuzz, check_arguments=check_fuzz_arguments)


def _refuse(args: argparse.Namespace) -> None:
    if args.examples < 1:
        raise BadInput(f"--examples {args.examples}: must be at least 1")
    if args.examples > MAX_EXAMPLES:
        raise BadInput(
            f"--examples {args.examples}: at most {MAX_EXAMPLES} per run; each example is a "
            "request pair to real vLLM, all drawn before the first is sent: use several "
            "--seed runs"
        )
    if args.reason and not args.save:
        raise BadInput("--reason declares the cause of what --save writes; add --save")
    if args.save and args.plant_fault:
        raise BadInput(
            "--save declares upstream failures; a planted fault is the harness's own, and "
            "the scenario would run without it: drop --save (or --plant-fault)"
        )
    if args.plant_fault and parse_fault(args.plant_fault).kind in STREAM_FAULTS and not args.stream:
        raise BadInput(
            f"--plant-fault {args.plant_fault} acts on streamed answers, and fuzz sends its "
            "requests unstreamed unless asked: add --stream"
        )
    if "," in args.topology:
        raise BadInput(f"--topology {args.topology}: fuzz runs one topology at a time")
    if args.topology == "baseline":
        raise BadInput("--topology baseline: the baseline is the reference; name an EPD topology")
    restart_budgets = [
        flag
        for flag, value in (
            ("--max-restarts", args.max_restarts),
            ("--max-run-restarts", args.max_run_restarts),
        )
        if value is not None
    ]
    if args.attach and restart_budgets:
        given = " and ".join(restart_budgets)
        raise BadInput(
            f"{given} budget{'' if len(restart_budgets) > 1 else 's'} restarts of the topology "
            "the harness launched; an attached deployment is never restarted (once it is "
            f"down nothing more is sent to it): drop {given}"
        )
    if args.max_shrink_trials == 0 and args.max_restarts is not None:
        raise BadInput(
            f"--max-restarts {args.max_restarts} budgets restarts while a failure group is "
            "shrunk, and --max-shrink-trials 0 shrinks nothing: drop one of them"
        )
    budgets = shrink_budget(args), run_budget(args)
    counts = (
        ("--confirm-known", args.confirm_known),
        ("--max-shrink-trials", args.max_shrink_trials),
        ("--max-restarts", budgets[0].max_restarts),
        ("--max-run-restarts", budgets[1].max_restarts),
    )
    # The flag and the value given, as every other refusal names them (found walking the CLI:
    # `--budget-s 0` got a line listing all five budgets).
    for flag, count in counts:
        if count < 0:
            raise BadInput(f"{flag} {count}: must be at least 0")
    if not (math.isfinite(args.budget_s) and args.budget_s > 0):
        raise BadInput(f"--budget-s {args.budget_s:g}: must be a positive number of seconds")


def shrink_budget(args: argparse.Namespace) -> ShrinkBudget:
    restarts = ShrinkBudget.max_restarts if args.max_restarts is None else args.max_restarts
    return ShrinkBudget(max_trials=args.max_shrink_trials, max_restarts=restarts)


def run_budget(args: argparse.Namespace) -> RunBudget:
    restarts = RunBudget.max_restarts if args.max_run_restarts is None else args.max_run_restarts
    return RunBudget(max_restarts=restarts, max_seconds=args.budget_s)


def fuzz_request(args: argparse.Namespace, run_dir: str | None = None) -> RunRequest:
    """The run a fuzz needs: its topology (or the attached deployment) and the baseline; its
    run directory `--run-dir`, else `run_dir` (the command's fresh one; the checks before the
    command read none)."""
    return RunRequest(
        topologies=() if args.attach else (args.topology,),
        run_dir=args.run_dir or run_dir,
        baseline_cache="off",
        plant_fault=args.plant_fault,
        stream=args.stream,
        draws_own_requests=True,
        baseline_beside=True,
        **serving_fields(args),
        **proxy_fields(args),
    )


def check_fuzz_arguments(args: argparse.Namespace) -> None:
    """`fuzz`'s arguments, checked as the command checks them first (its files named only)."""
    _refuse(args)
    check_arguments(fuzz_request(args), read_files=False)


def command_fuzz(args: argparse.Namespace) -> int:
    _refuse(args)
    try:
        import hypothesis
    except ImportError:
        raise BadInput(
            "epd-harness fuzz needs Hypothesis: pip install 'epd-harness[fuzz]'"
        ) from None
    from harness.run.fuzz.bundle import fault_effect_line, write_examples, write_fuzz_bundle
    from harness.run.fuzz.engine import FuzzEngine
    from harness.run.fuzz.layout import TokenizerEstimator
    from harness.run.fuzz.records import FuzzReport
    from harness.run.fuzz.save import save_scenarios, unsaved_reason
    from harness.run.fuzz.space import fault_refusal, space_for
    from harness.run.fuzz.strategies import draw_examples

    fresh = None if args.run_dir else str(fresh_run_dir(Path("runs"), "fuzz-"))
    config = prepare_run(fuzz_request(args, fresh))
    settings = config.settings
    args.progress.run_dir = settings.run_dir
    topology = config.topologies[0]
    if topology.name != args.topology:
        raise BadInput(
            f"--topology {args.topology}: the attach file describes {topology.name}; name that one"
        )
    model_dir = Path(settings.serving.model)
    estimator = TokenizerEstimator(model_dir) if (model_dir / "tokenizer.json").is_file() else None
    space = space_for(settings.protocol, topology, settings.serving)
    refusal = fault_refusal(args.plant_fault, space, topology) if args.plant_fault else None
    if refusal is not None:
        raise BadInput(refusal)
    for note in space.notes:
        log.warning("epd-harness fuzz: %s", note)
    budget = shrink_budget(args)
    whole_run_budget = run_budget(args)
    began = time.monotonic()
    examples = draw_examples(space, args.examples, args.seed, estimator)
    meta = {
        "topology": topology.name,
        "seed": args.seed,
        "examples_asked": args.examples,
        "examples_drawn": len(examples),
        "draw_s": round(time.monotonic() - began, 2),
        "hypothesis": hypothesis.__version__,
        "harness": importlib.metadata.version("epd-harness"),
        "vllm": settings.vllm.version,
        "platform": settings.platform.name,
        "devices": list(settings.devices),
        "kv_connector": settings.serving.kv_connector,
        "reference_policy": settings.reference_policy,
        "launcher": settings.launcher.kind,
        "proxy": settings.proxy.kind,
        "protocol": settings.protocol.name,
        "fault": args.plant_fault,
        "stream": settings.stream,
        "attached": bool(args.attach),
        "space": space.to_json(),
        "layout_estimator": type(estimator).__name__ if estimator else None,
        "shrink_budget": budget.to_json(),
        "run_budget": whole_run_budget.to_json(),
        "confirm_known": args.confirm_known,
    }
    write_examples(settings.run_dir, examples, meta)
    log.info(
        "epd-harness fuzz: %d examples (seed %d) on %s; artifacts in %s",
        len(examples),
        args.seed,
        topology.name,
        settings.run_dir,
    )
    began = time.monotonic()
    report = FuzzReport(examples=examples)
    written: list[Path] = []

    def write(report: FuzzReport) -> None:
        written[:] = write_fuzz_bundle(settings, topology, report, meta, args.plant_fault)

    with FuzzEngine(
        settings,
        topology,
        fault=args.plant_fault,
        attached=bool(args.attach),
        on_event=args.progress.on_event,
        confirm_known=args.confirm_known,
        budget=budget,
        run_budget=whole_run_budget,
        min_prompt_tokens=space.min_prompt_tokens,
    ) as engine:
        report.startup_seconds = time.monotonic() - began
        engine.run(examples, report, on_progress=write)
    group_dirs = written
    print()
    print((settings.run_dir / "fuzz.md").read_text())
    if args.save:
        written = save_scenarios(report.groups, topology.name, meta, args.reason)
        nothing = "none" if report.new_groups else "none (no new failure)"
        print(f"saved scenario(s): {', '.join(written) or nothing}")
        for group in report.new_groups:
            if (why := unsaved_reason(group)) is not None:
                print(f"not saved: {group.signature.key}: {why}")
    timing = report.timing()
    unstable = report.unstable_baseline_line()
    print(
        f"epd-harness fuzz: {len(report.new_groups)} new, "
        f"{len(report.groups) - len(report.new_groups)} known failure group(s); "
        + (f"{unstable}; " if unstable else "")
        + f"{len(examples)} examples, {timing['total_s']} s; artifacts in {settings.run_dir}"
        + (f"; first repro bundle: {group_dirs[0]}" if group_dirs else "")
    )
    if args.plant_fault:
        print(f"epd-harness fuzz: {fault_effect_line(args.plant_fault, report)}")
    if not report.judged_any:
        # Found in review: a run that tested nothing ended green. No record: counted by status.
        counts = ", ".join(f"{n} {status}" for status, n in sorted(report.counts().items()))
        print(f"epd-harness fuzz: no example was judged ({counts}): the run tested nothing")
        return EXIT_FAILED
    return EXIT_OK if report.passed else EXIT_FAILED
