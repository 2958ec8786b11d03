"""`epd-harness`: the command line over the same library the pytest scenarios use.

Exit codes: 0 every case passed its policy; 1 a comparison failed (a verdict that the policy
does not accept); 2 bad input or an environment that cannot run (one line naming the cause,
checked before any server starts where possible; artifacts written so far are kept); 130
interrupted (Ctrl-C, SIGTERM, SIGHUP) after every server was stopped.
"""

from __future__ import annotations

import argparse
import errno
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from harness.cli import doctor
from harness.cli.compare import add_compare_parser
from harness.cli.export import add_export_parser
from harness.cli.fuzz import add_fuzz_parser
from harness.cli.load import add_load_parser
from harness.cli.plan import add_plan_parser
from harness.cli.serving_options import (
    add_baseline_cache_options,
    add_dtype_option,
    add_proxy_options,
    add_serving_options,
    proxy_fields,
    serving_fields,
)
from harness.cli.upstream_requirement import add_upstream_requirement_parser
from harness.cli.version import VersionAction
from harness.cli.versions import add_bisect_parser, add_goldens_parser, add_versions_parser
from harness.devices import host_cpuinfo
from harness.environment import cache_dir
from harness.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    BadInput,
    HarnessError,
    empty_value,
)
from harness.files import empty_run_dirs_removed
from harness.judge.records import CaseRecord, unproven_passes
from harness.preflight import RunRequest, names, prepare_run
from harness.preflight.config import (
    COLOCATE_ON_CPU,
    COLOCATE_ON_RAY,
    RunConfig,
    check_arguments,
    devices_here,
)
from harness.preflight.dtype import (
    REPRO_ASKED_BF16,
    REPRO_ASKED_FLOAT16,
    REPRO_BF16_REMEDY,
    REPRO_NOT_FLOAT16_REMEDY,
    check_bf16_here,
    check_cpu_dtype,
)
from harness.preflight.files import (
    ENVIRONMENT_ERRNOS,
    check_model_dir,
    check_run_dir,
    describe_os_error,
)
from harness.preflight.model import resolve_model
from harness.preflight.upstream_proxy import proxy_choice
from harness.preflight.vllm import default_vllm_executable, probe_served_vllm
from harness.preflight.vllm_args import ArgvCheck, check_served_argvs, serve_argvs
from harness.report.text import format_failure, format_verdict_table, purpose_line
from harness.run.faults.spec import FAULT_NAMES, FAULT_SYNTAX, GRADED_FAULTS
from harness.run.matrix import MatrixRun
from harness.run.repro import (
    Bundle,
    BundleError,
    another_failure,
    keep_up,
    killed_by_the_load,
    parted_elsewhere,
    repro_line,
    reproduce,
    serving_protocol,
)
from harness.run.scenarios import MATRIX, Scenario
from harness.run.sweep import Sweep, SweepSpec
from harness.serve.launch import ServerDied, ServerStopFailed, StartupTimeout
from harness.serve.launcher import end_launchers
from harness.serve.ports import NoFreePortError
from harness.serve.signal_handlers import install_signal_handlers, restore_signal_handlers
from harness.spec.placement import TooFewDevices, schedule
from harness.spec.platforms import DevicePlanError, get_platform, parse_devices
from harness.spec.prompts import SKELETON_PROMPTS, requested_tokens
from harness.spec.settings import ATTACH_PROXY, RAY_LAUNCHER, ServedVllm
from harness.spec.topology import TOPOLOGIES, get_topology

log = logging.getLogger("harness")


class DefaultsShown(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already names it: a user
    reading `fuzz --help` should not have to open the code to learn it draws 100 requests.
    Flags (default False), unset options (None) and empty repeatables say nothing."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default is None
            or default is False  # a flag
            or (isinstance(default, list | tuple) and not default)
            or default is argparse.SUPPRESS
            or not action.option_strings
        ):
            return action.help
        return f"{text} (default: %(default)s)".lstrip()


class Parser(argparse.ArgumentParser):
    """argparse, with its usage errors in the harness's one-line form (exit 2 either way), and
    its options' defaults shown (`DefaultsShown`), in every subcommand."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsShown)
        super().__init__(*args, **kwargs)
        # Each subcommand's parser, by name (`build_parser` fills the top parser's): what
        # tests read each command's help and flags from, without argparse's private parts.
        self.subcommands: dict[str, argparse.ArgumentParser] = {}

    def error(self, message: str) -> NoReturn:
        raise BadInput(f"{message} (see '{self.prog} --help')")

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        """argparse's, but an unrecognized flag points at the help of the subcommand it was
        given to: the top parser reports them, and `plan --launcher ray` said "(see
        'epd-harness --help')", whose text lists no subcommand's flags (found in review)."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            chosen = self.subcommands.get(getattr(parsed, "command", None) or "", self)
            raise BadInput(
                f"unrecognized arguments: {' '.join(extras)} (see '{chosen.prog} --help')"
            )
        return parsed

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """argparse's, then an option given an empty value (`--topology ,` too) is refused
        (`harness.errors.empty_value` says why). Each subcommand's parser checks its own."""
        parsed, extras = super().parse_known_args(args, namespace)
        for action in self._actions:
            if not action.option_strings or action.dest == argparse.SUPPRESS:
                continue
            value = getattr(parsed, action.dest, None)
            given = value if isinstance(value, list) else [value]
            lists = action.__class__ is argparse._AppendAction  # comma-separated names
            for text in given:
                if isinstance(text, str) and not (text.replace(",", "") if lists else text).strip():
                    flag = max(action.option_strings, key=len)
                    raise BadInput(empty_value(flag, text))
        return parsed, extras


class Progress:
    """The last state of every server, so an interruption can say what it interrupted."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.states: dict[str, str] = {}  # name -> last state
        # name -> state it was in when stopped, since the latest start: unwinding after an
        # interruption stops every server before the message can be printed.
        self.stopped_from: dict[str, str] = {}
        self.run_dir: Path | None = None
        # A run in a process of its own (versions, bisect: a release's), as an interruption
        # names it: that process reports its servers, not this one.
        self.child_run: str | None = None

    def on_event(self, name: str, state: str, elapsed_s: float) -> None:
        if state == "starting" and self.stopped_from:
            self.stopped_from = {}
        if state == "stopped":
            self.stopped_from[name] = self.states.get(name, "starting")
        self.states[name] = state
        log.info("[%7.1fs] %s: %s (%.1fs)", time.monotonic() - self.started, name, state, elapsed_s)

    def running(self, child_run: str | None) -> None:
        """What runs in a process of its own now (None: nothing), for `describe`."""
        self.child_run = child_run

    def settled(self) -> None:
        """The servers stopped so far were stopped on purpose (repro --keep-up stops the
        baseline before it waits), not by an interruption's unwinding: forgotten, or the
        interruption said it cut short a baseline stopped a minute before (real vLLM)."""
        self.stopped_from = {}

    def describe(self) -> str:
        """'while baseline/baseline0 was starting': what the interruption cut short."""
        current = {**self.states, **self.stopped_from}
        busy = [
            f"{name} was {state}"
            for name, state in current.items()
            if state in ("starting", "ready")
        ]
        if busy:
            return "while " + ", ".join(busy)
        if self.child_run is not None:
            return f"during {self.child_run}"
        return "before any server was running"


def request_from_args(args: argparse.Namespace) -> RunRequest:
    return RunRequest(
        topologies=names.split_names(args.topology),
        prompts=names.split_names(args.prompt),
        cases_file=args.cases_file,
        scenarios=names.split_names(args.scenario),
        run_dir=args.run_dir,
        golden=args.golden,
        media_dir=args.media_dir,
        baseline_cache=args.baseline_cache,
        refresh_baseline=args.refresh_baseline,
        plant_fault=args.plant_fault,
        stream=args.stream,
        **serving_fields(args),
        **proxy_fields(args),
    )


def command_run(args: argparse.Namespace) -> int:
    return run_config(args, prepare_run(request_from_args(args)))


def check_run_arguments(args: argparse.Namespace) -> None:
    """`run`'s arguments, checked as its preflight checks them first (its files named only)."""
    check_arguments(request_from_args(args), read_files=False)


def run_config(args: argparse.Namespace, config: RunConfig) -> int:
    settings = config.settings
    args.progress.run_dir = settings.run_dir
    counts = ", ".join(f"{name} {n}" for name, n in config.prompt_tokens.items())
    log.info("epd-harness: model %s", settings.serving.model)
    log.info(
        "epd-harness: vLLM %s, torch %s (%s); %s %s; dtype %s",
        settings.vllm.version,
        settings.vllm.torch_version,
        settings.vllm.executable,
        settings.platform.device_kind,
        ",".join(map(str, settings.devices)) or "none (nothing starts here)",
        settings.serving.dtype,
    )
    log.info("epd-harness: prompt tokens: %s (max model len %d)", counts, args.max_model_len)
    log.info("epd-harness: artifacts in %s", settings.run_dir)
    if config.matrix:
        spec = SweepSpec(topologies=(), prompts=(), baseline_only_prompts=config.prompts)
    else:
        spec = SweepSpec(
            topologies=config.topologies,
            prompts=config.prompts,
            fault=config.fault,
            declared=config.declared,
        )
    sweep = Sweep(
        spec,
        settings,
        on_event=args.progress.on_event,
        baseline_cache=config.baseline_cache,
        goldens=config.goldens,
        golden_release=config.golden_release,
    )
    try:
        if config.matrix:
            return finish_run(args, run_matrix(sweep, config.matrix), sweep)
        if config.cases:
            for case in config.cases:
                sweep.judge(case.topology, case.prompt)
        else:
            sweep.run_all()
        return finish_run(args, served_unproven(sweep) + sweep.fault_misses, sweep)
    finally:
        sweep.pool.close()


def served_unproven(sweep: Sweep) -> list[str]:
    """The passes whose guard nothing could check, when this run served its topologies: a
    problem, as in the matrix and the pytest sweep. An attached deployment may have seen the
    prompt, and some of its guards have no evidence outside it: the verdict table says which,
    and they fail nothing."""
    return [] if sweep.attached is not None else unproven_passes(sweep.result.records)


def run_matrix(sweep: Sweep, scenarios: tuple[Scenario, ...]) -> list[str]:
    """Every scenario as declared, grouped by topology so each starts once (those that end
    their session last in their group); returns the problems (empty: all as declared)."""
    matrix = MatrixRun(sweep)
    first_seen = {s.topology: i for i, s in reversed(list(enumerate(scenarios)))}
    ordered = sorted(scenarios, key=lambda s: (first_seen[s.topology], s.ends_its_session))
    problems: list[str] = []
    for index, scenario in enumerate(ordered):
        problems += [f"scenario {scenario.name}: {p}" for p in matrix.run(scenario).problems()]
        following = ordered[index + 1] if index + 1 < len(ordered) else None
        if following is None or following.topology != scenario.topology:
            sweep.pool.release(scenario.topology)
    return problems


def finish_run(args: argparse.Namespace, problems: list[str], sweep: Sweep) -> int:
    result = sweep.result
    print()
    print(format_verdict_table(result.records))
    failed: list[CaseRecord] = [r for r in result.records if not r.policy_passed]
    for record in failed:
        print()
        print(format_failure(record))
    for problem in problems:
        print(f"problem: {problem}")
    if problems:  # summary.json, verdicts.txt, diff.md and report.html say them too (run.json too)
        sweep.run_info["problems"] = problems
        sweep.write_outputs()
    purpose = purpose_line(sweep.run_info)  # as verdicts.txt, diff.md and report.html say it
    if purpose and failed:
        print(f"\n{purpose}: not failures of vLLM")
    elapsed_s = time.monotonic() - args.progress.started
    print(f"\n{sweep.pool.summary()}")
    print(f"epd-harness: {elapsed_s:.0f}s; artifacts in {result.run_dir}")
    ok = bool(result.records) and not failed and not problems
    return EXIT_OK if ok else EXIT_FAILED


def command_repro(args: argparse.Namespace) -> int:
    """Rerun a bundle's failing case (or --case) with its recorded flags, body, fault and
    launcher."""
    try:
        bundle = Bundle.load(Path(args.bundle).resolve())
        if bundle.proxy_kind == ATTACH_PROXY:
            raise BadInput(
                f"{bundle.path} judged an attached deployment, which repro cannot start; "
                "rerun 'epd-harness run --attach FILE' against it"
            )
        killed = killed_by_the_load(bundle)
        if killed:
            raise BadInput(killed)
        if args.colocate and not get_platform(bundle.platform).exclusive_devices:
            raise BadInput(COLOCATE_ON_CPU)
        if args.colocate and bundle.launcher.kind == RAY_LAUNCHER:
            raise BadInput(COLOCATE_ON_RAY)
        try:
            devices = parse_devices(args.devices) if args.devices is not None else None
        except DevicePlanError as exc:
            raise BadInput(f"--devices: {exc}") from None
        # As `run` checks them: `repro --devices 7` on a two-core host was a ValueError
        # traceback from the baseline's spawn, exit 1 (found in review).
        devices_here(
            devices or bundle.devices,
            get_platform(bundle.platform),
            "--devices" if devices is not None else "the bundle's devices",
            places_here=bundle.launcher.kind != RAY_LAUNCHER,
        )
        refuse_too_few_devices(bundle, args.case, devices, args.colocate)
        # A Ray bundle's GPUs are its nodes': the launcher refuses there, as for `run`.
        if bundle.platform == "cuda" and bundle.launcher.kind != RAY_LAUNCHER:
            check_bf16_here(
                bundle.serving().dtype,
                devices or bundle.devices,
                remedy=REPRO_BF16_REMEDY,
                asked=REPRO_ASKED_BF16,
            )
        run_dir = Path(args.run_dir or bundle.path.parent / f"{bundle.path.name}-repro").resolve()
        if run_dir == bundle.path.resolve():
            # The rerun's instance logs and EC / KV storage went into the bundle's own
            # <topology>/ directories, over the evidence it reproduces (found walking the CLI).
            raise BadInput(
                f"--run-dir {args.run_dir} is the bundle itself: the rerun's logs and storage "
                "would overwrite what it reproduces; give another directory (default: "
                "<bundle>-repro)"
            )
        check_run_dir(run_dir)
        try:  # as `run` checks its own, before vLLM is probed or a baseline started
            check_model_dir(bundle.serving().model)
        except BadInput as exc:
            raise BadInput(f"the bundle's model: {exc}") from None
        served = probe_served_vllm(args.vllm or default_vllm_executable())
        # As `run` checks it on this host's CPU (a bundle from another host replays here).
        if bundle.platform == "cpu" and bundle.launcher.kind != RAY_LAUNCHER:
            check_cpu_dtype(
                bundle.serving().dtype,
                dict(served.libraries),
                host_cpuinfo(),
                asked=REPRO_ASKED_FLOAT16,
                remedy=REPRO_NOT_FLOAT16_REMEDY,
            )
        argv_check = check_repro_argvs(bundle, args.case, served, devices, args.colocate)
        proxy = proxy_choice(
            bundle.proxy_kind,
            bundle.vllm_source,
            served,
            cache_dir(),
            bundle.proxy_registration,
        )
        args.progress.run_dir = run_dir
        case, records, sweep = reproduce(
            bundle,
            run_dir,
            served,
            args.case,
            proxy,
            args.progress.on_event,
            devices=devices,
            colocate=args.colocate,
            argv_check=argv_check.to_json(),
        )
    except BundleError as exc:
        raise BadInput(str(exc)) from None
    try:
        print()
        print(format_verdict_table(records))
        for record in records:  # where the rerun parted, as `run` prints it
            if not record.policy_passed:
                print()
                print(format_failure(record))
        own = next((r for r in records if r.reference == case.reference), records[0])
        # A scenario's earlier request that got no answer left the case unsent: nothing of
        # the run's stage, so nothing reproduced (`repro_line`).
        unset = sweep.stage_unset
        another = another_failure(bundle.recorded(case.label, case.prompt, case.reference), own)
        same = own.verdict.value == case.verdict and unset is None and another is None
        line = repro_line(
            case, own.verdict.value, bundle, served, own.policy_passed, unset, another
        )
        elsewhere = parted_elsewhere(bundle.recorded(case.label, case.prompt, case.reference), own)
        if same and elsewhere is not None:
            line += f" ({elsewhere})"
        print(f"\nepd-harness: {line}; artifacts in {run_dir}")
        if args.keep_up:
            died = keep_up(sweep, case.topology, settled=args.progress.settled)
            if died is not None:
                print(
                    f"\nepd-harness: {case.topology}, kept up, lost an instance; stopping every "
                    f"server: {died}",
                    file=sys.stderr,
                )
                return EXIT_FAILED
    finally:
        sweep.pool.close()
    return EXIT_OK if same else EXIT_FAILED


def refuse_too_few_devices(
    bundle: Bundle, wanted: str | None, devices: tuple[int, ...] | None, colocate: bool
) -> None:
    """The rerun's schedule (the baseline and the case's topology, as `reproduce` serves them)
    computed before the served vLLM is probed, its refusal in repro's own flags: the
    scheduler's remedy for `run` said "leave it out with --topology", which repro has not
    (found in the audit of ignored flags)."""
    topology = get_topology(bundle.pick_case(wanted).topology)
    try:
        schedule(
            (TOPOLOGIES["baseline"], topology),
            devices or bundle.devices,
            get_platform(bundle.platform),
            colocate or bundle.colocate,
        )
    except TooFewDevices as exc:
        raise BadInput(
            f"{exc}; rerun it on more with --devices, or let its instances share them "
            "with --colocate"
        ) from None


def check_repro_argvs(
    bundle: Bundle,
    wanted: str | None,
    served: ServedVllm,
    devices: tuple[int, ...] | None,
    colocate: bool,
) -> ArgvCheck:
    """The rerun's command lines (the baseline's, the case's topology's and its exact
    reference's, the bundle's `extra_args` last), judged by the served vLLM's own parser before
    anything starts, as `run` judges its own: a bundle made under another --vllm, or edited,
    started its instances unjudged, and a flag the release serving now lacks was an instance
    that died at start-up, a baseline later (found in review). A case judged against a golden
    is rerun against it, starting no baseline: its line is not judged."""
    case = bundle.pick_case(wanted)
    argvs = serve_argvs(
        (get_topology(case.topology),),
        bundle.serving(),
        get_platform(bundle.platform),
        devices or bundle.devices,
        colocate or bundle.colocate,
        serving_protocol(bundle, served),
        baseline_starts=bundle.goldens(case.prompt) is None,
    )
    return check_served_argvs(argvs, served)


def command_list(_args: argparse.Namespace) -> int:
    print("topologies:")
    for topology in TOPOLOGIES.values():
        roles = " -> ".join(r.value for r in topology.roles)
        print(f"  {topology.name:10s} {roles}")
    # The tokens a prompt asks vLLM to generate, not its prompt tokens: those depend on the
    # model's processor, and `run` prints them as it starts (a user read this column as the
    # same quantity and found the numbers differ; found walking the CLI).
    print("prompts (prompt tokens depend on the model: 'run' counts and prints them):")
    for prompt in SKELETON_PROMPTS:
        print(
            f"  {prompt.name:10s} {prompt.media_count} media item(s), "
            f"max new tokens {requested_tokens(prompt)}"
        )
    print("scenarios (run --scenario NAME|all):")
    for scenario in MATRIX:
        expect = "/".join(v.value for v in scenario.expect)
        print(f"  {scenario.name:36s} {scenario.topology:9s} expects {expect}")
    print(f"faults (run --plant-fault NAME): {', '.join(FAULT_NAMES)}")
    print("graded faults (run --plant-fault NAME[:STRENGTH]; see docs/self-test.md):")
    for description in GRADED_FAULTS.values():
        print(f"  {description}")
    return EXIT_OK


def command_doctor(args: argparse.Namespace) -> int:
    model_dir = resolve_model(args.model, get_platform("cpu").default_model, cache_dir())
    checks = doctor.run_checks(
        args.vllm or default_vllm_executable(), model_dir, tiny=args.model is None, dtype=args.dtype
    )
    print(doctor.format_checks(checks))
    return EXIT_OK if all(c.ok for c in checks) else EXIT_FAILED


def build_parser() -> Parser:
    parser = Parser(prog="epd-harness", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="start real vLLM topologies and compare with the baseline")
    run.add_argument("--topology", action="append", help="repeatable or comma-separated")
    run.add_argument("--prompt", action="append", help="repeatable or comma-separated")
    run.add_argument("--cases-file", help="JSON/YAML list of {topology, prompt} cases to run")
    run.add_argument(
        "--scenario",
        action="append",
        help="matrix scenarios to run as declared (repeatable, comma-separated, "
        "or 'all'; see 'epd-harness list')",
    )
    run.add_argument("--run-dir", help="artifact directory (default: runs/<timestamp>)")
    run.add_argument(
        "--golden",
        metavar="VERSION",
        help="judge against VERSION's stored baseline (its goldens) instead of "
        "starting one; see docs/versions.md",
    )
    run.add_argument(
        "--media-dir",
        help="directory file:// media may come from (refused when no prompt names one: the "
        "built-in prompts carry their media inline)",
    )
    add_baseline_cache_options(run)
    run.add_argument(
        "--plant-fault",
        metavar="FAULT",
        help=f"self-test: plant a fault ({', '.join(FAULT_NAMES)}) or a graded "
        f"one ({FAULT_SYNTAX}) in the sweep's topologies; the run must turn red",
    )
    run.add_argument(
        "--stream",
        action="store_true",
        help="send every EPD topology streamed requests (stream: true, with usage): the "
        "token ids are read from the stream and its framing checked (the baseline answers "
        "unstreamed)",
    )
    add_serving_options(run)
    add_proxy_options(
        run,
        attach_help="judge a running deployment, launching nothing of it: FILE (JSON/YAML) "
        "names its proxy URL and each instance's role and URL; implies --proxy attach "
        "(repro --keep-up writes one)",
    )
    run.set_defaults(func=command_run, check_arguments=check_run_arguments)

    repro = sub.add_parser(
        "repro",
        help="rerun a bundle's failing case with its recorded flags, body and protocol (on the "
        "vLLM given by --vllm; a version other than the bundle's is named in the verdict line)",
        # Its exit code answers "did it reproduce?", not "did it pass?": a reproduced failure
        # exits 0 (a new user expected run's 1 there; found walking the CLI).
        epilog="exit codes: 0 the case reproduced (the bundle's verdict again), 1 it did not, "
        "2 bad input or an environment that cannot run, 130 interrupted",
    )
    repro.add_argument("bundle", help="a run directory written by 'epd-harness run'")
    repro.add_argument(
        "--case",
        help="TOPOLOGY:PROMPT[@REFERENCE], or a one-prompt scenario's TOPOLOGY:SCENARIO as "
        "the verdict table names it (default: the first case that failed its policy; "
        "@REFERENCE picks one of a case's references, e.g. @1P+1D)",
    )
    repro.add_argument("--run-dir", help="artifact directory (default: <bundle>-repro)")
    repro.add_argument("--vllm", help="vllm executable (default: the one beside this Python)")
    repro.add_argument(
        "--devices",
        help="this host's GPU / XPU indices (CPU cores on cpu) to rerun on, e.g. 0 on a "
        "one-GPU box (default: the devices the bundle's run was given)",
    )
    repro.add_argument(
        "--colocate",
        action="store_true",
        help="GPU: let the topology's instances share devices when there are too few "
        "(default: as the bundle's run did)",
    )
    repro.add_argument(
        "--keep-up",
        action="store_true",
        help="afterwards leave the topology serving and print its URLs and "
        "launch commands (Ctrl-C stops it)",
    )
    repro.set_defaults(func=command_repro)

    listing = sub.add_parser(
        "list", help="known topologies, prompts, matrix scenarios and faults (graded faults too)"
    )
    listing.set_defaults(func=command_list)

    check = sub.add_parser("doctor", help="check that this environment can run vLLM EPD")
    check.add_argument("--model", help="model directory (default: the tiny model)")
    check.add_argument("--vllm", help="vllm executable (default: the one beside this Python)")
    add_dtype_option(
        check,
        "the dtype the runs will serve, checked against this host's GPUs (its CPU, for a "
        "CPU build of vLLM)",
    )
    check.set_defaults(func=command_doctor)

    add_plan_parser(sub)
    add_versions_parser(sub)
    add_goldens_parser(sub)
    add_bisect_parser(sub)
    add_compare_parser(sub)
    add_load_parser(sub)
    add_fuzz_parser(sub)
    add_export_parser(sub)
    add_upstream_requirement_parser(sub)
    parser.subcommands = dict(sub.choices)
    return parser


def subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    """Each subcommand's parser, by name, as `epd-harness` builds them."""
    return build_parser().subcommands


def install_log_handler() -> None:
    """The library logs through `logging`; the CLI shows INFO and up on stdout, as it runs."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger("harness")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    root.propagate = False


def check_command_line(argv: list[str]) -> argparse.Namespace:
    """What a command makes of its arguments before it reads a file, runs a subprocess or
    starts anything: argparse's usage checks, then the subcommand's own checks of names, values
    and flags that contradict each other (its `check_arguments`, where it has more than
    argparse's; BadInput, one line). Where a command line is only shown, as in the
    documentation (tests/test_docs_commands.py), this is all that can be checked of it."""
    args = build_parser().parse_args(argv)
    check = getattr(args, "check_arguments", None)
    if check is not None:
        check(args)
    return args


def main(argv: list[str] | None = None) -> int:
    progress = Progress()
    try:
        args = build_parser().parse_args(argv)
        args.progress = progress  # `run` reports server states into it; read on interruption
        install_log_handler()
        replaced = install_signal_handlers()
        try:
            with empty_run_dirs_removed():
                return args.func(args)
        finally:
            # A Ray connection, and the rehearsal cluster a command started (run, repro, load,
            # fuzz with --launcher ray); a no-op when Ray was never used.
            end_launchers()
            restore_signal_handlers(replaced)
    except NoFreePortError as exc:
        return fail(f"no free port: {exc}")
    except HarnessError as exc:
        return fail(str(exc), exc.exit_code)
    except OSError as exc:
        # mkdir of a path a file holds (a directory option or variable naming a file).
        in_the_way = (
            exc.errno == errno.EEXIST
            and exc.filename is not None
            and Path(exc.filename).exists()
            and not Path(exc.filename).is_dir()
        )
        if exc.errno not in ENVIRONMENT_ERRNOS and not in_the_way:
            raise
        where = f" while writing under {progress.run_dir}" if progress.run_dir else ""
        described = f"not a directory: {exc.filename}" if in_the_way else describe_os_error(exc)
        detail = described if exc.filename else f"{described}{where}"
        return fail(f"{detail}; artifacts written so far are kept")
    except (ServerDied, StartupTimeout, ServerStopFailed) as exc:
        # The baseline could not start (or stop): the environment, not a comparison, failed.
        # The first line is the cause; the log tail that follows is its evidence.
        return fail(str(exc))
    except KeyboardInterrupt as exc:
        cause = f" ({exc})" if str(exc) else ""
        # An empty run directory was removed on the way out (empty_run_dirs_removed).
        kept = progress.run_dir and Path(progress.run_dir).is_dir()
        artifacts = f"; artifacts in {progress.run_dir}" if kept else ""
        print(
            f"epd-harness: interrupted{cause} {progress.describe()}; every server was stopped"
            f"{artifacts}",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED


def fail(cause: str, code: int = EXIT_BAD_INPUT) -> int:
    print(f"epd-harness: error: {cause}", file=sys.stderr)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
