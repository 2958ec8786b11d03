"""`epd-harness`: the command line over the same library the pytest scenarios use.

Exit codes: 0 every case passed its policy; 1 a comparison failed (a verdict that the policy
does not accept); 2 bad input or an environment that cannot run (one line naming the cause,
checked before any server starts where possible; artifacts written so far are kept); 130
interrupted (Ctrl-C, SIGTERM, SIGHUP) after every server was stopped.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import NoReturn

from harness import doctor, validate
from harness.baseline_cache import BaselineCache, BaselineCacheError
from harness.launch import ServerDied, ServerStopFailed, StartupTimeout, install_signal_handlers
from harness.platforms import DEFAULT_CPU_CORES, DevicePlanError, parse_devices
from harness.ports import NoFreePortError
from harness.prompts import SKELETON_PROMPTS, PromptSpec, render_request
from harness.report import format_failure, format_verdict_table
from harness.runner import RunSettings
from harness.sweep import BASELINE, Sweep, SweepPlan
from harness.topology import EPD_TOPOLOGY_NAMES, TOPOLOGIES, ServingConfig
from harness.validate import BadInput

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
DEFAULT_CACHE = Path(os.environ.get("EPD_HARNESS_CACHE", Path.home() / ".cache" / "epd-harness"))


class Parser(argparse.ArgumentParser):
    """argparse, with its usage errors in the harness's one-line form (exit 2 either way)."""

    def error(self, message: str) -> NoReturn:
        raise BadInput(f"{message} (see '{self.prog} --help')")


class Progress:
    """The last state of every server, so an interruption can say what it interrupted."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.states: dict[str, str] = {}  # name -> last state
        # name -> state it was in when stopped, since the latest start: unwinding after an
        # interruption stops every server before the message can be printed.
        self.stopped_from: dict[str, str] = {}
        self.run_dir: Path | None = None

    def on_event(self, name: str, state: str, elapsed_s: float) -> None:
        if state == "starting" and self.stopped_from:
            self.stopped_from = {}
        if state == "stopped":
            self.stopped_from[name] = self.states.get(name, "starting")
        self.states[name] = state
        print(f"[{time.monotonic() - self.started:7.1f}s] {name}: {state} ({elapsed_s:.1f}s)",
              flush=True)  # fmt: skip

    def describe(self) -> str:
        """'while baseline/baseline0 was starting': what the interruption cut short."""
        current = {**self.states, **self.stopped_from}
        busy = [f"{name} was {state}" for name, state in current.items()
                if state in ("starting", "ready")]  # fmt: skip
        return "while " + ", ".join(busy) if busy else "before any server was running"


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
    return validate.check_prompts(names) if names else SKELETON_PROMPTS


def resolve_model(model: str | None) -> Path:
    """A given model directory (checked), or the tiny model built once into the cache."""
    if model:
        return validate.check_model_dir(model)
    from fixtures.tiny_model import ensure_tiny_model

    return ensure_tiny_model(DEFAULT_CACHE / "models")


def resolve_devices(text: str | None) -> tuple[int, ...]:
    """--devices as CPU cores this process may use (the default cores are checked too)."""
    try:
        devices = parse_devices(text) if text is not None else DEFAULT_CPU_CORES
    except DevicePlanError as exc:
        raise BadInput(f"--devices: {exc}") from None
    return validate.check_devices(devices, validate.available_cpu_cores(), given=text is not None)


def resolve_baseline_cache(value: str, refresh: bool) -> BaselineCache | None:
    if value == "off":
        return None
    directory = Path(value).expanduser().resolve()
    if directory.exists() and not directory.is_dir():
        raise BadInput(f"baseline cache {directory} is not a directory (pass a directory or 'off')")
    return BaselineCache(directory, refresh=refresh)


def command_run(args: argparse.Namespace) -> int:
    # Cheap checks first: names and arguments, then files, then the vLLM version, the ports,
    # and last the token count (it loads the model's processor).
    if args.scenario_file and (args.topology or args.prompt):
        raise BadInput("--scenario-file names the cases itself; drop --topology and --prompt")
    scenarios = validate.load_scenario_file(args.scenario_file) if args.scenario_file else ()
    if scenarios:
        topology_names = list(dict.fromkeys(s.topology for s in scenarios))
        prompt_names = list(dict.fromkeys(s.prompt for s in scenarios))
    else:
        topology_names = split_names(args.topology) or list(EPD_TOPOLOGY_NAMES)
        prompt_names = split_names(args.prompt)
    topologies = validate.check_topologies(topology_names)
    prompts = select_prompts(prompt_names)
    devices = resolve_devices(args.devices)
    validate.check_host(args.host, args.allow_non_loopback)
    port_range = validate.port_range_from_env()

    model_dir = resolve_model(args.model)
    media_dir = validate.check_media_dir(args.media_dir) if args.media_dir else None
    run_dir = Path(args.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")).resolve()
    args.progress.run_dir = run_dir
    validate.check_run_dir(run_dir)
    baseline_cache = resolve_baseline_cache(args.baseline_cache, args.refresh_baseline)
    vllm = args.vllm or default_vllm_executable()
    vllm_version = validate.check_vllm(vllm, args.allow_untested_vllm)
    validate.check_free_ports(max(len(t.roles) for t in (BASELINE, *topologies)), port_range)
    validate.check_model_limit(args.max_model_len, validate.max_position_tokens(model_dir))

    serving = ServingConfig(
        model=str(model_dir),
        max_model_len=args.max_model_len,
        allowed_local_media_path=str(media_dir) if media_dir else None,
    )
    bodies = {p.name: render_request(p, serving.served_model_name) for p in prompts}
    validate.check_media_references(bodies, media_dir)
    prompt_tokens = validate.estimate_prompt_tokens(model_dir, bodies, DEFAULT_CACHE / "prompt-tokens")
    validate.check_prompts_fit(args.max_model_len, prompts, prompt_tokens)

    settings = RunSettings(serving=serving, run_dir=run_dir, vllm_executable=vllm, devices=devices)
    counts = ", ".join(f"{name} {n}" for name, n in prompt_tokens.items())
    print(f"epd-harness: model {model_dir}\n"
          f"epd-harness: vLLM {vllm_version} ({vllm}); devices {','.join(map(str, devices))}\n"
          f"epd-harness: prompt tokens: {counts} (max model len {args.max_model_len})\n"
          f"epd-harness: artifacts in {run_dir}", flush=True)  # fmt: skip
    sweep = Sweep(
        SweepPlan(topologies=topologies, prompts=prompts),
        settings,
        log=lambda line: print(line, flush=True),
        on_event=args.progress.on_event,
        baseline_cache=baseline_cache,
    )
    if scenarios:
        for scenario in scenarios:
            sweep.judge(scenario.topology, scenario.prompt)
        result = sweep.result
    else:
        result = sweep.run_all()
    print()
    print(format_verdict_table(result.records))
    for record in result.records:
        if not record.policy_passed:
            print()
            print(format_failure(record))
    elapsed_s = time.monotonic() - args.progress.started
    print(f"\nepd-harness: {elapsed_s:.0f}s; artifacts in {run_dir}")
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
    parser = Parser(prog="epd-harness", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="start real vLLM topologies and compare with the baseline")
    run.add_argument("--topology", action="append", help="repeatable or comma-separated")
    run.add_argument("--prompt", action="append", help="repeatable or comma-separated")
    run.add_argument("--scenario-file", help="JSON/YAML list of {topology, prompt} cases to run")
    run.add_argument("--model", help="model directory (default: the tiny model, built once)")
    run.add_argument("--run-dir", help="artifact directory (default: runs/<timestamp>)")
    run.add_argument("--vllm", help="vllm executable (default: the one beside this Python)")
    run.add_argument("--allow-untested-vllm", action="store_true",
                     help=f"run a vLLM other than {'.'.join(map(str, validate.SUPPORTED_VLLM_SERIES))}.x")  # fmt: skip
    run.add_argument("--max-model-len", type=int, default=4096)
    run.add_argument("--devices", help="CPU cores the instances bind to, e.g. 0,1 (default: 0,1)")
    run.add_argument("--host", default=validate.RUNNER_HOST, help="address servers listen on")
    run.add_argument("--allow-non-loopback", action="store_true",
                     help="allow a --host other servers on the network can reach")  # fmt: skip
    run.add_argument("--media-dir", help="directory file:// media may come from")
    run.add_argument("--baseline-cache", default=str(DEFAULT_CACHE / "baseline"),
                     help="baseline cache directory, or 'off' (default: %(default)s)")  # fmt: skip
    run.add_argument("--refresh-baseline", action="store_true",
                     help="recompute the baseline and overwrite its cache entries")  # fmt: skip
    run.set_defaults(func=command_run)

    listing = sub.add_parser("list", help="known topologies and prompts")
    listing.set_defaults(func=command_list)

    check = sub.add_parser("doctor", help="check that this environment can run vLLM EPD")
    check.add_argument("--model", help="model directory (default: the tiny model)")
    check.add_argument("--vllm", help="vllm executable")
    check.set_defaults(func=command_doctor)

    # More subcommands register here, each through an add_*_parser(sub) of its own module
    # (e.g. harness.plan.add_plan_parser); parse errors of theirs also end as one line, exit 2.
    return parser


def main(argv: list[str] | None = None) -> int:
    progress = Progress()
    try:
        args = build_parser().parse_args(argv)
        args.progress = progress
        install_signal_handlers()
        return args.func(args)
    except (BadInput, BaselineCacheError) as exc:
        return fail(str(exc))
    except NoFreePortError as exc:
        return fail(f"no free port: {exc}")
    except OSError as exc:
        if exc.errno not in validate.ENVIRONMENT_ERRNOS:
            raise
        where = f" while writing under {progress.run_dir}" if progress.run_dir else ""
        described = validate.describe_os_error(exc)
        detail = described if exc.filename else f"{described}{where}"
        return fail(f"{detail}; artifacts written so far are kept")
    except (ServerDied, StartupTimeout, ServerStopFailed) as exc:
        # The baseline could not start (or stop): the environment, not a comparison, failed.
        # The first line is the cause; the log tail that follows is its evidence.
        return fail(str(exc))
    except KeyboardInterrupt as exc:
        cause = f" ({exc})" if str(exc) else ""
        artifacts = f"; artifacts in {progress.run_dir}" if progress.run_dir else ""
        print(f"epd-harness: interrupted{cause} {progress.describe()}; every server was stopped"
              f"{artifacts}", file=sys.stderr)  # fmt: skip
        return EXIT_INTERRUPTED


def fail(cause: str) -> int:
    print(f"epd-harness: error: {cause}", file=sys.stderr)
    return EXIT_BAD_INPUT


if __name__ == "__main__":
    raise SystemExit(main())
