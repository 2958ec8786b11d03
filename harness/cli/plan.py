"""`epd-harness plan`: every instance's exact command, environment, port and device, and the
schedule of which topologies run together, computed without starting anything.

Why: on a GPU host the expensive mistakes (two instances on one GPU, a shared NIXL side-channel
port, a topology that needs more devices than exist) should be visible before a single model
loads, and CI needs the same answer as data to split topologies across workers.

Ports are placeholders, on purpose. A real run reserves its ports (HTTP and NIXL side channel)
when each topology starts and holds them until it stops; ports reserved now and released right
after printing would be stale by then and would only suggest a promise the plan cannot keep.
The placeholders are distinct across the whole plan, as a run's real ports are, and drawn from
the same range, so the plan stays deterministic (diffable, testable). The storage directories
sit under a placeholder run directory unless --run-dir is given. Everything else in an argv is
what the run would execute.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from harness.cli.serving_options import add_connector_options, add_dtype_option
from harness.environment import DEFAULT_PORT_RANGE, cache_dir
from harness.errors import EXIT_BAD_INPUT, EXIT_OK, BadInput
from harness.preflight.config import COLOCATE_ON_CPU, NO_ENFORCE_EAGER_ON_CPU
from harness.preflight.connectors import ec_connector_for, kv_connector_for
from harness.preflight.dtype import check_bf16_here, dtype_or_default
from harness.preflight.model import cached_snapshot, hf_hub_cache
from harness.preflight.resources import too_few_devices
from harness.preflight.vllm import default_vllm_executable
from harness.serve.session import safe_name
from harness.spec.placement import (
    TooFewDevices,
    available_memory_bytes,
    cpu_instance_budget,
    gpu_memory_policy,
    place_instances,
    schedule,
    side_channel_port_count,
    start_after,
)
from harness.spec.platforms import (
    DEFAULT_CPU_CORES,
    PLATFORMS,
    DevicePlanError,
    PlatformProfile,
    get_platform,
    parse_devices,
)
from harness.spec.topology import (
    DEFAULT_DTYPE,
    EPD_TOPOLOGY_NAMES,
    ServingConfig,
    Topology,
    get_topology,
    ordered_topologies,
    serving_for,
)

DEFAULT_TOPOLOGY_NAMES = ("baseline", *EPD_TOPOLOGY_NAMES)
PLACEHOLDER_PORT_START = DEFAULT_PORT_RANGE.start
PLACEHOLDER_RUN_DIR = Path("runs/<run-id>")
TINY_MODEL_PLACEHOLDER = "<tiny model, built on first run>"


@dataclass(frozen=True)
class PlanRequest:
    """Everything a plan depends on; the CLI fills it from flags, tests build it directly."""

    platform: PlatformProfile
    devices: tuple[int, ...]  # GPU/XPU indices, or CPU cores to bind to
    topologies: tuple[Topology, ...]  # in the order they should start
    model: str  # as passed to `vllm serve`
    colocate: bool = False  # let a topology's instances share devices when there are too few
    vllm_executable: str = "vllm"  # argv[0] of every instance
    run_dir: Path = PLACEHOLDER_RUN_DIR  # where storage directories would live
    workers: int = 1  # parallel pytest-xdist workers (CPU waves shrink with them)
    cpu_budget: int | None = None  # instances per CPU wave; None: this machine's
    no_enforce_eager: bool = False  # GPU: let vLLM compile and capture graphs (run's flag)
    dtype: str = DEFAULT_DTYPE  # every instance's --dtype (run's flag)
    kv_connector: str | None = None  # --kv-connector's name; None: the platform's
    ec_connector: str | None = None  # --ec-connector's name; None: example


@dataclass(frozen=True)
class PlannedInstance:
    """One instance as the run would launch it."""

    name: str  # e.g. "1E+1P+1D/encoder0"
    role: str
    port: int  # placeholder HTTP port
    devices: tuple[int, ...]  # GPU/XPU indices (CPU: the cores its threads bind to)
    argv: tuple[str, ...]  # exactly what would be executed, never a shell string
    env: tuple[tuple[str, str], ...]  # additions over the harness's environment, sorted
    gpu_memory_fraction: float | None  # --gpu-memory-utilization, None on CPU
    side_channel_port: int | None  # placeholder VLLM_NIXL_SIDE_CHANNEL_PORT, NIXL only
    # The instances that must be healthy before it is spawned: those before it on a GPU it
    # shares (`harness.spec.placement.start_after`); empty: it starts with its topology.
    start_after: tuple[str, ...] = ()

    @property
    def command_line(self) -> str:
        """The argv shell-quoted, for reading and pasting; the run never goes through a shell."""
        return shlex.join(self.argv)


@dataclass(frozen=True)
class PlannedTopology:
    name: str
    devices: tuple[int, ...]  # what the topology holds for its wave (shared cores on CPU)
    instances: tuple[PlannedInstance, ...]


@dataclass(frozen=True)
class PlannedWave:
    index: int  # 1-based; waves run one after another
    topologies: tuple[PlannedTopology, ...]  # these run at the same time


@dataclass(frozen=True)
class Plan:
    platform: str
    model: str
    devices: tuple[int, ...]
    colocate: bool
    waves: tuple[PlannedWave, ...]
    ports_are_placeholders: bool = True  # see the module docstring
    enforce_eager: bool = True  # every instance runs --enforce-eager
    dtype: str = DEFAULT_DTYPE  # every instance's --dtype
    kv_connector: str = ""  # the vLLM class P and D move KV with
    ec_connector: str = ""  # the vLLM class encoders and their consumers move embeddings with
    # Each role's --gpu-memory-utilization and the shared-device rule; None on CPU.
    gpu_memory_shares: dict | None = None

    @property
    def instances(self) -> tuple[PlannedInstance, ...]:
        return tuple(i for w in self.waves for t in w.topologies for i in t.instances)

    def to_json(self) -> dict:
        return asdict(self)


def build_plan(request: PlanRequest) -> Plan:
    """Schedule the topologies into waves, then render every instance for the platform.

    Raises DevicePlanError (a ValueError) naming the cause when the devices cannot hold them.
    """
    budget = request.cpu_budget
    if budget is None and not request.platform.exclusive_devices:
        budget = cpu_instance_budget(
            len(request.devices), available_memory_bytes(), request.workers
        )
    try:
        waves = schedule(
            request.topologies, request.devices, request.platform, request.colocate, budget
        ).waves
    except TooFewDevices as exc:
        raise too_few_devices(exc, request.topologies) from None
    # The connector checks name the topologies asked for, as `run` does: the baseline planned
    # beside them has no D and no E, and named it read as if it had been asked for (found in
    # review). Only `--topology baseline` plans it alone.
    asked = tuple(t for t in request.topologies if not t.is_baseline) or request.topologies
    serving = serving_for(
        request.platform,
        request.model,
        enforce_eager=request.platform.enforce_eager and not request.no_enforce_eager,
        dtype=request.dtype,
        kv_connector=kv_connector_for(request.kv_connector, asked, request.platform).vllm_class,
        ec_connector=ec_connector_for(request.ec_connector, asked).vllm_class,
    )
    ports = itertools.count(PLACEHOLDER_PORT_START)
    planned_waves = []
    for wave in waves:
        planned = tuple(
            plan_topology(request, serving, slot.topology, slot.devices, ports)
            for slot in wave.slots
        )
        planned_waves.append(PlannedWave(wave.index, planned))
    return Plan(
        platform=request.platform.name,
        model=request.model,
        devices=request.devices,
        colocate=request.colocate,
        waves=tuple(planned_waves),
        enforce_eager=serving.enforce_eager,
        dtype=serving.dtype,
        kv_connector=serving.kv_connector,
        ec_connector=serving.ec_connector,
        gpu_memory_shares=gpu_memory_policy(request.platform),
    )


def plan_topology(
    request: PlanRequest,
    serving: ServingConfig,
    topology: Topology,
    devices: tuple[int, ...],
    ports: Iterator[int],
) -> PlannedTopology:
    http_ports = [next(ports) for _ in topology.roles]
    side_ports = [next(ports) for _ in range(side_channel_port_count(topology, serving))]
    specs = place_instances(
        topology,
        serving,
        request.platform,
        http_ports,
        request.run_dir / safe_name(topology.name) / "storage",
        devices,
        colocate=request.colocate,
        side_channel_ports=side_ports,
    )
    order = start_after(specs)
    instances = tuple(
        PlannedInstance(
            name=spec.name,
            role=spec.role.value,
            port=spec.port,
            devices=spec.devices,
            argv=tuple(spec.argv(request.vllm_executable)),
            env=tuple(sorted(spec.env().items())),
            gpu_memory_fraction=spec.gpu_memory_fraction,
            side_channel_port=spec.side_channel_port,
            start_after=order.get(spec.name, ()),
        )
        for spec in specs
    )
    return PlannedTopology(topology.name, devices, instances)


# --- text rendering ----------------------------------------------------------------------------


def format_plan(plan: Plan) -> str:
    """The plan for people: schedule first, then each instance's device, port, env and argv."""
    platform = PLATFORMS[plan.platform]
    kind = platform.device_kind
    lines = [
        f"plan: platform {plan.platform}, model {plan.model}, {kind}s {_join(plan.devices)}"
        + (", colocation allowed" if plan.colocate else ""),
        "ports are placeholders: a run reserves its own when each topology starts. "
        "Nothing was started.",
    ]
    if platform.exclusive_devices:
        lines.append(
            f"schedule: {len(plan.waves)} wave(s); the topologies of a wave run at the same "
            f"time on disjoint {kind}s, waves one after another"
        )
    else:
        lines.append(
            f"schedule: {len(plan.waves)} wave(s); the topologies of a wave run at the same "
            f"time, every instance on the cores {_join(plan.devices)}; a cached "
            "baseline is not started"
        )
    for wave in plan.waves:
        slots = ", ".join(f"{t.name} [{_join(t.devices)}]" for t in wave.topologies)
        lines.append(f"  wave {wave.index}: {slots}")
    lines.append(sharing_line(plan.instances))
    if platform.gpu_memory_fraction is not None:
        lines.append(start_order_line(plan))
    lines.append(
        "eager: every instance runs --enforce-eager, as upstream's correctness script does"
        if plan.enforce_eager
        else "eager: off (--no-enforce-eager): vLLM compiles and captures graphs at each start"
    )
    lines.append(f"dtype: every instance runs --dtype {plan.dtype}")
    lines.append(f"connectors: KV {plan.kv_connector}, EC {plan.ec_connector}")
    if platform.worker_in_engine_core:
        lines.append(
            "worker: inside each instance's engine core (--distributed-executor-backend uni, "
            "as on a one-device GPU), each instance's processes confined to the cores "
            + _join(plan.devices)
        )
    if plan.gpu_memory_shares is not None:
        policy = plan.gpu_memory_shares
        shares = ", ".join(f"{role} {share:g}" for role, share in policy["shares"].items())
        lines.append(
            f"gpu memory shares (upstream's): {shares}; on a shared device the KV holders "
            f"split {policy['device_budget']:g} minus "
            f"{policy['encoder_room_on_a_shared_device']:g} per encoder there"
        )
    common = common_env(plan.instances)
    lines.append("environment of every instance: " + _env_text(common))
    for wave in plan.waves:
        for topology in wave.topologies:
            lines.append("")
            lines.append(f"wave {wave.index} / {topology.name}")
            for instance in topology.instances:
                lines += _instance_lines(instance, kind, common)
    return "\n".join(lines)


def sharing_line(instances: Sequence[PlannedInstance]) -> str:
    """What is started once and shared: each topology once per run, whatever judges it and
    through whichever proxy (harness.run.pool); an instance whose launch (argv but its port,
    env) another topology has too would be shared as well. None is, today: each topology's EC
    and KV storage is its own, because both example connectors key what they store by content
    and a shared producer would let a guard hold for a transfer that did not happen.

    Only launches of different topologies count: 2E+1PD's two encoders launch identically
    (one topology, one storage) and are two processes, yet were printed as "shared between
    topologies: 2E+1PD/encoder0 = 2E+1PD/encoder1" (found in review)."""
    launches: dict[tuple[str, tuple[tuple[str, str], ...]], list[str]] = {}
    for instance in instances:
        argv = instance.command_line.replace(f"--port {instance.port}", "--port PORT")
        launches.setdefault((argv, tuple(instance.env)), []).append(instance.name)
    shared = [names for names in launches.values() if len({_topology_name(n) for n in names}) > 1]
    text = (
        "sharing: each topology starts once per run and serves every scenario that judges "
        "it, through any proxy; instances shared between topologies: "
    )
    if not shared:
        return text + "none (each topology's EC and KV storage is its own)"
    return text + "; ".join(" = ".join(names) for names in shared)


def start_order_line(plan: Plan) -> str:
    """Which instances start one after another because they share a GPU
    (`harness.spec.placement.start_after`), topology by topology."""
    staggered = []
    for wave in plan.waves:
        for topology in wave.topologies:
            after = [
                f"{_role_name(i.name)} after {' and '.join(map(_role_name, i.start_after))}"
                for i in topology.instances
                if i.start_after
            ]
            if after:
                staggered.append(f"{topology.name}: {', '.join(after)}")
    text = (
        "start order: instances of a topology on one device start one after another, "
        "encoders first, each once the one before it answers /health (vLLM's memory "
        "profiling fails when another process on its device frees memory meanwhile), "
        "the others at once; "
    )
    return text + ("; ".join(staggered) if staggered else "no device is shared")


def _topology_name(name: str) -> str:
    """`1E+1P+1D/encoder0` -> `1E+1P+1D`."""
    return name.partition("/")[0]


def _role_name(name: str) -> str:
    """`1E+1P+1D/encoder0` -> `encoder0`: the topology is named once, before its instances."""
    return name.rpartition("/")[2]


def common_env(instances: Sequence[PlannedInstance]) -> tuple[tuple[str, str], ...]:
    """The environment entries every instance shares, printed once instead of per instance."""
    if not instances:
        return ()
    shared = set(instances[0].env)
    for instance in instances[1:]:
        shared &= set(instance.env)
    return tuple(sorted(shared))


def _instance_lines(
    instance: PlannedInstance, kind: str, common: tuple[tuple[str, str], ...]
) -> list[str]:
    plural = "s" if len(instance.devices) > 1 else ""
    facts = [f"port {instance.port}", f"{kind}{plural} {_join(instance.devices)}"]
    if instance.gpu_memory_fraction is not None:
        facts.append(f"gpu memory {instance.gpu_memory_fraction:g}")
    if instance.side_channel_port is not None:
        facts.append(f"nixl side channel {instance.side_channel_port}")
    if instance.start_after:
        facts.append(f"spawned once {' and '.join(instance.start_after)} is healthy")
    own_env = tuple(item for item in instance.env if item not in common)
    return [
        f"  {instance.name} ({instance.role}): " + ", ".join(facts),
        f"    env: {_env_text(own_env) or '(none beyond the common environment)'}",
        f"    argv: {instance.command_line}",
    ]


def _env_text(env: Sequence[tuple[str, str]]) -> str:
    return " ".join(f"{key}={shlex.quote(value)}" for key, value in env)


def _join(values: Sequence[int]) -> str:
    return ",".join(str(v) for v in values)


# --- command line ------------------------------------------------------------------------------


class PlanInputError(BadInput):
    """Bad flags for `plan`: reported as one line, exit code 2."""


def parse_topologies(values: Sequence[str] | None) -> tuple[Topology, ...]:
    """Repeatable, comma-separated --topology values (default: the EPD set), with what a run of
    them starts besides: the baseline and each one's exact reference (1P+1D for 1E+1P+1D),
    references first. Printed without them, `plan --topology 1E+1P+1D` showed one topology on
    devices 0-2 where the run serves three (baseline 0, then 1P+1D and 1E+1P+1D on 1-3)."""
    names = [n.strip() for v in values or () for n in v.split(",") if n.strip()]
    if not names:
        names = list(DEFAULT_TOPOLOGY_NAMES)
    for name in names:
        if names.count(name) > 1:
            raise PlanInputError(f"topology {name} is listed twice")
    asked = tuple(get_topology(name) for name in names)
    return (get_topology("baseline"), *ordered_topologies(asked))


def planned_model(given: str | None, platform: PlatformProfile) -> str:
    """What `vllm serve` will be given: a hub name as the snapshot directory a run resolves it
    to (looked up, never fetched, here), the tiny model's cache path on CPU (computed, not
    built), or the name itself when its snapshot is not cached yet."""
    name = given or platform.default_model
    if name is not None:
        snapshot = cached_snapshot(name, hf_hub_cache()) if name.count("/") == 1 else None
        return str(snapshot) if snapshot is not None else name
    try:
        from fixtures.tiny_model import CACHE_DIR_PREFIX, CACHE_KEY_CHARS, cache_key

        return str(cache_dir() / "models" / f"{CACHE_DIR_PREFIX}{cache_key()[:CACHE_KEY_CHARS]}")
    except Exception:  # noqa: BLE001 - torch/transformers absent: the path cannot be known yet
        return TINY_MODEL_PLACEHOLDER


def request_from_args(args: argparse.Namespace) -> PlanRequest:
    platform = get_platform(args.platform)
    if args.no_enforce_eager and not platform.exclusive_devices:
        raise PlanInputError(NO_ENFORCE_EAGER_ON_CPU)
    if args.colocate and not platform.exclusive_devices:  # `run` refuses it; so does its plan
        raise PlanInputError(COLOCATE_ON_CPU)
    if args.devices is None:
        if platform.exclusive_devices:
            raise PlanInputError(
                f"--devices is required with --platform {platform.name} (e.g. --devices 0,1)"
            )
        devices = DEFAULT_CPU_CORES
    else:
        try:
            devices = parse_devices(args.devices)
        except DevicePlanError as exc:  # named as `run` names it
            raise PlanInputError(f"--devices: {exc}") from None
    return PlanRequest(
        platform=platform,
        devices=devices,
        topologies=parse_topologies(args.topology),
        model=planned_model(args.model, platform),
        colocate=args.colocate,
        vllm_executable=args.vllm or default_vllm_executable(),
        run_dir=Path(args.run_dir).resolve() if args.run_dir else PLACEHOLDER_RUN_DIR,
        no_enforce_eager=args.no_enforce_eager,
        dtype=dtype_or_default(args.dtype),
        kv_connector=args.kv_connector,
        ec_connector=args.ec_connector,
    )


def command_plan(args: argparse.Namespace) -> int:
    """Print the plan (text, or JSON with --json); exit 2 with one line naming a bad input."""
    try:
        request = request_from_args(args)
        check_planned_gpus(request, args.dtype)
        plan = build_plan(request)
    except BadInput as exc:  # PlanInputError, DevicePlanError, unknown names
        print(f"epd-harness: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(plan.to_json(), indent=2) if args.json else format_plan(plan))
    return EXIT_OK


def check_planned_gpus(request: PlanRequest, dtype: str | None) -> None:
    """Refuse, as `run` refuses it, a dtype the planned GPUs lack (bfloat16 below compute
    capability 8.0) when they are this host's: a plan's instances start where `run` starts
    them, on this host (a plan has no Ray launcher). Where nvidia-smi cannot be read, or lists
    none of the planned GPUs, the plan is for another machine and nothing is refused. `dtype`:
    `--dtype` as given (None: the default). `plan --platform cuda` on a T4 box printed a
    bfloat16 plan that `run` then refused (found walking a T4 box on fakes)."""
    if request.platform.name == "cuda":
        check_bf16_here(dtype, request.devices)


def check_plan_arguments(args: argparse.Namespace) -> None:
    """`plan` starts nothing: computing the plan is all there is to check of its arguments
    (this host's GPUs are read by `command_plan` only: a command line shown may be for
    another machine)."""
    build_plan(request_from_args(args))


def add_plan_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `plan` on the CLI's subparsers; its `func` returns the exit code."""
    parser = subparsers.add_parser(
        "plan",
        help="show every instance's command, env, port and device, and the schedule; start nothing",
        description=" ".join(__doc__.split("\n\n")[0].split()),
    )
    parser.add_argument(
        "--platform",
        choices=sorted(PLATFORMS),
        default="cpu",
        help="the hardware to plan for, this host's or not (default cpu)",
    )
    parser.add_argument(
        "--devices",
        help="comma-separated device indices (GPU/XPU; required there) or CPU cores "
        f"(default {_join(DEFAULT_CPU_CORES)})",
    )
    parser.add_argument(
        "--topology",
        action="append",
        help=f"repeatable or comma-separated (default: {','.join(DEFAULT_TOPOLOGY_NAMES)})",
    )
    parser.add_argument("--model", help="model name or directory (default: per platform)")
    parser.add_argument(
        "--colocate",
        action="store_true",
        help="let a topology's instances share devices (splitting the memory budget) when "
        "there are fewer devices than instances",
    )
    parser.add_argument(
        "--no-enforce-eager",
        action="store_true",
        help="GPU: plan instances without --enforce-eager (vLLM compiles and captures graphs)",
    )
    add_dtype_option(parser)
    add_connector_options(parser)
    parser.add_argument("--vllm", help="vllm executable (default: the one beside this Python)")
    parser.add_argument("--run-dir", help="artifact directory (default: a placeholder)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(func=command_plan, check_arguments=check_plan_arguments)
    return parser
