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
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from harness import doctor, validate
from harness.baseline_cache import BaselineCache, BaselineCacheError
from harness.launch import ServerDied, ServerStopFailed, StartupTimeout, install_signal_handlers
from harness.faults import FAULT_NAMES
from harness.matrix import MATRIX, MatrixRun, Scenario, get_scenario, matrix_prompts
from harness.plan import add_plan_parser
from harness.platforms import (
    CPU,
    DEFAULT_CPU_CORES,
    DevicePlanError,
    PlatformProfile,
    get_platform,
    parse_devices,
    serving_for,
)
from harness.ports import NoFreePortError
from harness.prompts import SKELETON_PROMPTS, PromptSpec, render_request
from harness.repro import Bundle, BundleError, keep_up, reproduce
from harness.report import CaseRecord, format_failure, format_verdict_table
from harness.runner import RunSettings
from harness.sweep import BASELINE, Sweep, SweepPlan
from harness.topology import EPD_TOPOLOGY_NAMES, TOPOLOGIES, Topology
from harness.validate import BadInput

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
DEFAULT_CACHE = Path(os.environ.get("EPD_HARNESS_CACHE", Path.home() / ".cache" / "epd-harness"))
TOKEN_COUNT_CACHE = DEFAULT_CACHE / "prompt-tokens"  # the pre-flight's counts, by request digest
SUPPORTED_SERIES = ".".join(map(str, validate.SUPPORTED_VLLM_SERIES))


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


def resolve_devices(text: str | None, platform: PlatformProfile = CPU) -> tuple[int, ...]:
    """--devices: CPU cores this process may use (the default cores are checked too), or the
    GPU / XPU indices to spread instances over (required there)."""
    if platform.exclusive_devices and text is None:
        raise BadInput(f"--platform {platform.name} needs --devices (e.g. --devices 0,1,2,3)")
    try:
        devices = parse_devices(text) if text is not None else DEFAULT_CPU_CORES
    except DevicePlanError as exc:
        raise BadInput(f"--devices: {exc}") from None
    if platform.exclusive_devices:
        return devices
    return validate.check_devices(devices, validate.available_cpu_cores(), given=text is not None)


def resolve_platform(name: str) -> PlatformProfile:
    try:
        return get_platform(name)
    except ValueError as exc:
        raise BadInput(str(exc)) from None


def resolve_scenarios(names: list[str]) -> tuple[Scenario, ...]:
    """--scenario: matrix scenarios by name, or 'all'."""
    if names == ["all"]:
        return MATRIX
    try:
        return tuple(get_scenario(name) for name in names)
    except ValueError as exc:
        raise BadInput(str(exc)) from None


def resolve_baseline_cache(value: str, refresh: bool) -> BaselineCache | None:
    if value == "off":
        return None
    directory = Path(value).expanduser().resolve()
    if directory.exists() and not directory.is_dir():
        raise BadInput(f"baseline cache {directory} is not a directory (pass a directory or 'off')")
    return BaselineCache(directory, refresh=refresh)


@dataclass(frozen=True)
class RunInputs:
    """What `run` resolved and checked before starting any server."""

    topologies: tuple[Topology, ...]
    prompts: tuple[PromptSpec, ...]
    scenarios: tuple[validate.Scenario, ...]  # when given, only these cases are judged
    matrix: tuple[Scenario, ...]  # --scenario: matrix scenarios, judged as declared
    settings: RunSettings
    baseline_cache: BaselineCache | None
    vllm_version: str
    prompt_tokens: dict[str, int]


def check_run_inputs(args: argparse.Namespace) -> RunInputs:
    """Every pre-flight check of `run`, cheapest first: arguments and names, then files, then
    the vLLM version (a subprocess), the ports, and last the token count (loads the model's
    processor unless cached). The first problem raises BadInput."""
    if args.scenario_file and (args.topology or args.prompt):
        raise BadInput("--scenario-file names the cases itself; drop --topology and --prompt")
    if args.scenario and (args.topology or args.prompt or args.scenario_file):
        raise BadInput("--scenario names its topology and prompts; drop --topology, --prompt "
                       "and --scenario-file")  # fmt: skip
    platform = resolve_platform(args.platform)
    matrix = resolve_scenarios(split_names(args.scenario)) if args.scenario else ()
    scenarios = validate.load_scenario_file(args.scenario_file) if args.scenario_file else ()
    if matrix:
        topology_names = list(dict.fromkeys(s.topology for s in matrix))
        prompt_names = []
    elif scenarios:
        topology_names = list(dict.fromkeys(s.topology for s in scenarios))
        prompt_names = list(dict.fromkeys(s.prompt for s in scenarios))
    else:
        topology_names = split_names(args.topology) or list(EPD_TOPOLOGY_NAMES)
        prompt_names = split_names(args.prompt)
    topologies = validate.check_topologies(topology_names)
    prompts = matrix_prompts(matrix) if matrix else select_prompts(prompt_names)
    devices = resolve_devices(args.devices, platform)
    if args.plant_fault and args.plant_fault not in FAULT_NAMES:
        raise BadInput(f"unknown fault {args.plant_fault!r} (known: {', '.join(FAULT_NAMES)})")
    validate.check_host(args.host, args.allow_non_loopback)
    port_range = validate.port_range_from_env()

    if platform.default_model and not (args.model and Path(args.model).exists()):
        # A model name the GPU host resolves from its own cache: nothing local to check.
        model = args.model or platform.default_model
        model_dir = None
    else:
        model_dir = resolve_model(args.model)
        model = str(model_dir)
        validate.check_model_limit(args.max_model_len, validate.max_position_tokens(model_dir))
    media_dir = validate.check_media_dir(args.media_dir) if args.media_dir else None
    run_dir = Path(args.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")).resolve()
    args.progress.run_dir = run_dir
    validate.check_run_dir(run_dir)
    baseline_cache = resolve_baseline_cache(args.baseline_cache, args.refresh_baseline)

    vllm = args.vllm or default_vllm_executable()
    vllm_version = validate.check_vllm(vllm, args.allow_untested_vllm)
    validate.check_free_ports(max(len(t.roles) for t in (BASELINE, *topologies)), port_range)

    serving = serving_for(
        platform,
        model,
        max_model_len=args.max_model_len,
        allowed_local_media_path=str(media_dir) if media_dir else None,
    )
    bodies = {p.name: render_request(p, serving.served_model_name) for p in prompts}
    validate.check_media_references(bodies, media_dir)
    prompt_tokens: dict[str, int] = {}
    if model_dir is not None:
        prompt_tokens = validate.estimate_prompt_tokens(model_dir, bodies, TOKEN_COUNT_CACHE)
        validate.check_prompts_fit(args.max_model_len, prompts, prompt_tokens)
    return RunInputs(
        topologies=topologies,
        prompts=prompts,
        scenarios=scenarios,
        matrix=matrix,
        settings=RunSettings(serving=serving, run_dir=run_dir, vllm_executable=vllm,
                             platform=platform, devices=devices, colocate=args.colocate),  # fmt: skip
        baseline_cache=baseline_cache,
        vllm_version=vllm_version,
        prompt_tokens=prompt_tokens,
    )


def command_run(args: argparse.Namespace) -> int:
    inputs = check_run_inputs(args)
    settings = inputs.settings
    counts = ", ".join(f"{name} {n}" for name, n in inputs.prompt_tokens.items())
    print(f"epd-harness: model {settings.serving.model}\n"
          f"epd-harness: vLLM {inputs.vllm_version} ({settings.vllm_executable}); "
          f"devices {','.join(map(str, settings.devices))}\n"
          f"epd-harness: prompt tokens: {counts} (max model len {args.max_model_len})\n"
          f"epd-harness: artifacts in {settings.run_dir}", flush=True)  # fmt: skip
    log = lambda line: print(line, flush=True)  # noqa: E731
    if inputs.matrix:
        plan = SweepPlan(topologies=(), prompts=(), baseline_only_prompts=inputs.prompts)
    else:
        plan = SweepPlan(topologies=inputs.topologies, prompts=inputs.prompts,
                         fault=args.plant_fault)  # fmt: skip
    sweep = Sweep(plan, settings, log=log, on_event=args.progress.on_event,
                  baseline_cache=inputs.baseline_cache)  # fmt: skip
    if inputs.matrix:
        return finish_run(args, settings, run_matrix(sweep, inputs.matrix, log), sweep.result)
    if inputs.scenarios:
        for scenario in inputs.scenarios:
            sweep.judge(scenario.topology, scenario.prompt)
        result = sweep.result
    else:
        result = sweep.run_all()
    return finish_run(args, settings, [], result)


def run_matrix(sweep: Sweep, scenarios: tuple[Scenario, ...], log) -> list[str]:
    """Every scenario as declared; returns the problems (empty: all behaved as declared)."""
    matrix = MatrixRun(sweep, log=log)
    problems: list[str] = []
    try:
        for scenario in scenarios:
            problems += [f"{scenario.name}: {p}" for p in matrix.run(scenario).problems()]
    finally:
        matrix.close()
    return problems


def finish_run(args: argparse.Namespace, settings: RunSettings, problems: list[str],
               result) -> int:  # fmt: skip
    print()
    print(format_verdict_table(result.records))
    failed: list[CaseRecord] = [r for r in result.records if not r.policy_passed]
    for record in failed:
        print()
        print(format_failure(record))
    for problem in problems:
        print(f"scenario problem: {problem}")
    elapsed_s = time.monotonic() - args.progress.started
    print(f"\nepd-harness: {elapsed_s:.0f}s; artifacts in {settings.run_dir}")
    ok = bool(result.records) and not failed and not problems
    return EXIT_OK if ok else EXIT_FAILED


def command_repro(args: argparse.Namespace) -> int:
    """Rerun a bundle's failing case (or --case) with its recorded flags, body and fault."""
    try:
        bundle = Bundle.load(Path(args.bundle).resolve())
        run_dir = Path(args.run_dir or bundle.path.parent / f"{bundle.path.name}-repro").resolve()
        validate.check_run_dir(run_dir)
        case, records, sweep = reproduce(
            bundle, run_dir, args.vllm or default_vllm_executable(), args.case
        )
    except BundleError as exc:
        raise BadInput(str(exc)) from None
    print()
    print(format_verdict_table(records))
    own = next((r for r in records if r.reference == case.reference), records[0])
    same = own.verdict.value == case.verdict
    print(f"\nepd-harness: {case.topology} / {case.prompt} vs {case.reference}: "
          f"{own.verdict.value} now, {case.verdict} in the bundle: "
          f"{'reproduced' if same else 'NOT reproduced'}; artifacts in {run_dir}")  # fmt: skip
    if args.keep_up:
        keep_up(sweep, case.topology)
    return EXIT_OK if same else EXIT_FAILED


def command_list(_args: argparse.Namespace) -> int:
    print("topologies:")
    for topology in TOPOLOGIES.values():
        roles = " -> ".join(r.value for r in topology.roles)
        print(f"  {topology.name:10s} {roles}")
    print("prompts:")
    for prompt in SKELETON_PROMPTS:
        print(f"  {prompt.name:10s} {prompt.media_count} media item(s), {prompt.max_tokens} tokens")
    print("scenarios (run --scenario NAME|all):")
    for scenario in MATRIX:
        expect = "/".join(v.value for v in scenario.expect)
        print(f"  {scenario.name:36s} {scenario.topology:9s} expects {expect}")
    print(f"faults (run --plant-fault NAME): {', '.join(FAULT_NAMES)}")
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
                     help=f"run a vLLM other than {SUPPORTED_SERIES}.x")  # fmt: skip
    run.add_argument("--max-model-len", type=int, default=4096)
    run.add_argument("--devices", help="CPU cores the instances bind to, e.g. 0,1 (default: "
                     f"{','.join(map(str, DEFAULT_CPU_CORES))})")  # fmt: skip
    run.add_argument("--host", default=validate.RUNNER_HOST, help="address servers listen on")
    run.add_argument("--allow-non-loopback", action="store_true",
                     help="allow a --host that other machines can reach")  # fmt: skip
    run.add_argument("--media-dir", help="directory file:// media may come from")
    run.add_argument("--baseline-cache", default=str(DEFAULT_CACHE / "baseline"),
                     help="baseline cache directory, or 'off' (default: %(default)s)")  # fmt: skip
    run.add_argument("--refresh-baseline", action="store_true",
                     help="recompute the baseline and overwrite its cache entries")  # fmt: skip
    run.add_argument("--scenario", action="append",
                     help="matrix scenarios to run as declared (repeatable, comma-separated, "
                     "or 'all'; see 'epd-harness list')")  # fmt: skip
    run.add_argument("--platform", default="cpu", help="cpu (default), cuda or xpu")
    run.add_argument("--colocate", action="store_true",
                     help="let a topology's instances share GPUs when there are too few")  # fmt: skip
    run.add_argument("--plant-fault", metavar="FAULT",
                     help=f"self-test: plant a fault ({', '.join(FAULT_NAMES)}); the run must "
                     "turn red")  # fmt: skip
    run.set_defaults(func=command_run)

    repro = sub.add_parser("repro", help="rerun a bundle's failing case with identical config")
    repro.add_argument("bundle", help="a run directory written by 'epd-harness run'")
    repro.add_argument("--case", help="TOPOLOGY:PROMPT (default: the first failing case)")
    repro.add_argument("--run-dir", help="artifact directory (default: <bundle>-repro)")
    repro.add_argument("--vllm", help="vllm executable (default: the one beside this Python)")
    repro.add_argument("--keep-up", action="store_true",
                       help="afterwards leave the topology serving and print its URLs and "
                       "launch commands (Ctrl-C stops it)")  # fmt: skip
    repro.set_defaults(func=command_repro)

    listing = sub.add_parser("list", help="known topologies and prompts")
    listing.set_defaults(func=command_list)

    check = sub.add_parser("doctor", help="check that this environment can run vLLM EPD")
    check.add_argument("--model", help="model directory (default: the tiny model)")
    check.add_argument("--vllm", help="vllm executable")
    check.set_defaults(func=command_doctor)

    add_plan_parser(sub)  # parse errors of its own also end as one line, exit 2
    return parser


def main(argv: list[str] | None = None) -> int:
    progress = Progress()
    try:
        args = build_parser().parse_args(argv)
        args.progress = progress  # `run` reports server states into it; read on interruption
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
