"""`epd-harness`: the command line over the same library the pytest scenarios use.

Exit codes: 0 every case passed its policy; 1 a comparison failed (a verdict that the policy
does not accept); 2 bad input or an environment that cannot run (one line naming the cause).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from harness import doctor
from harness.launch import install_signal_handlers
from harness.prompts import SKELETON_PROMPTS, PromptSpec
from harness.report import format_failure, format_verdict_table
from harness.runner import RunSettings
from harness.sweep import Sweep, SweepPlan
from harness.topology import EPD_TOPOLOGY_NAMES, TOPOLOGIES, ServingConfig, get_topology

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
DEFAULT_CACHE = Path(os.environ.get("EPD_HARNESS_CACHE", Path.home() / ".cache" / "epd-harness"))


class BadInput(Exception):
    """A user error: reported as one line, exit code 2."""


def default_vllm_executable() -> str:
    """The `vllm` next to this interpreter (the project's venv), else the one on PATH."""
    beside = Path(sys.executable).parent / "vllm"
    return str(beside) if beside.exists() else "vllm"


def split_names(values: list[str] | None) -> list[str]:
    names: list[str] = []
    for value in values or []:
        names += [v.strip() for v in value.split(",") if v.strip()]
    return names


def select_prompts(names: list[str]) -> tuple[PromptSpec, ...]:
    by_name = {p.name: p for p in SKELETON_PROMPTS}
    if not names:
        return SKELETON_PROMPTS
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise BadInput(f"unknown prompt {unknown[0]!r} (known: {', '.join(by_name)})")
    return tuple(by_name[n] for n in names)


def resolve_model(model: str | None) -> Path:
    """A given model directory (checked), or the tiny model built once into the cache."""
    if model:
        path = Path(model).expanduser().resolve()
        if not (path / "config.json").is_file():
            raise BadInput(f"model directory {path} does not exist or has no config.json")
        return path
    from fixtures.tiny_model import ensure_tiny_model

    return ensure_tiny_model(DEFAULT_CACHE / "models")


def print_event(started: float):
    def on_event(name: str, state: str, elapsed_s: float) -> None:
        print(f"[{time.monotonic() - started:7.1f}s] {name}: {state} ({elapsed_s:.1f}s)", flush=True)

    return on_event


def command_run(args: argparse.Namespace) -> int:
    topology_names = split_names(args.topology) or list(EPD_TOPOLOGY_NAMES)
    try:
        topologies = tuple(get_topology(n) for n in topology_names)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    prompts = select_prompts(split_names(args.prompt))
    model_dir = resolve_model(args.model)
    run_dir = Path(args.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")).resolve()
    settings = RunSettings(
        serving=ServingConfig(model=str(model_dir), max_model_len=args.max_model_len),
        run_dir=run_dir,
        vllm_executable=args.vllm or default_vllm_executable(),
    )
    started = time.monotonic()
    print(f"epd-harness: model {model_dir}\nepd-harness: artifacts in {run_dir}", flush=True)
    result = Sweep(
        SweepPlan(topologies=topologies, prompts=prompts),
        settings,
        log=lambda line: print(line, flush=True),
        on_event=print_event(started),
    ).run_all()
    print()
    print(format_verdict_table(result.records))
    for record in result.records:
        if not record.policy_passed:
            print()
            print(format_failure(record))
    print(f"\nepd-harness: {time.monotonic() - started:.0f}s; artifacts in {run_dir}")
    return EXIT_OK if result.passed else EXIT_FAILED


def command_list(_args: argparse.Namespace) -> int:
    print("topologies:")
    for topology in TOPOLOGIES.values():
        roles = " -> ".join(r.value for r in topology.roles)
        print(f"  {topology.name:10s} {roles}")
    print("prompts:")
    for prompt in SKELETON_PROMPTS:
        print(f"  {prompt.name:10s} {prompt.media_count} media item(s), {prompt.max_tokens} tokens")
    return EXIT_OK


def command_doctor(args: argparse.Namespace) -> int:
    model_dir = resolve_model(args.model)
    checks = doctor.run_checks(args.vllm or default_vllm_executable(), model_dir)
    print(doctor.format_checks(checks))
    return EXIT_OK if all(c.ok for c in checks) else EXIT_FAILED


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epd-harness", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="start real vLLM topologies and compare with the baseline")
    run.add_argument("--topology", action="append", help="repeatable or comma-separated")
    run.add_argument("--prompt", action="append", help="repeatable or comma-separated")
    run.add_argument("--model", help="model directory (default: the tiny model, built once)")
    run.add_argument("--run-dir", help="artifact directory (default: runs/<timestamp>)")
    run.add_argument("--vllm", help="vllm executable (default: the one beside this Python)")
    run.add_argument("--max-model-len", type=int, default=4096)
    run.set_defaults(func=command_run)

    listing = sub.add_parser("list", help="known topologies and prompts")
    listing.set_defaults(func=command_list)

    check = sub.add_parser("doctor", help="check that this environment can run vLLM EPD")
    check.add_argument("--model", help="model directory (default: the tiny model)")
    check.add_argument("--vllm", help="vllm executable")
    check.set_defaults(func=command_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    install_signal_handlers()
    try:
        return args.func(args)
    except BadInput as exc:
        print(f"epd-harness: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("epd-harness: interrupted; every server was stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
