"""Platform profiles and device placement: the same topology, launched on CPU, CUDA or XPU.

`topology.py` decides *what* each instance is (its role and transfer configs); this module
decides *where* it runs and what that adds to its command line and environment:

* cpu (the default): what topology.py renders by itself. Instances bind their one OMP thread
  to a core (cores handed out in turn, so instances may share one), get a CPU KV cache
  (`VLLM_CPU_KVCACHE_SPACE`) and move KV through `ExampleConnector` (shared files).
* cuda: one GPU per instance through `CUDA_VISIBLE_DEVICES`, an explicit
  `--gpu-memory-utilization`, KV through `NixlConnector`, CUDA graphs on (no --enforce-eager),
  and the real default model Qwen/Qwen2.5-VL-3B-Instruct.
* xpu: as cuda, with `ZE_AFFINITY_MASK` selecting the device.

Device policy (GPU platforms). By default every instance gets a device of its own, because two
vLLM instances on one device race for its memory: each sizes its KV cache from what it sees
free at start-up, so co-located start-ups fail or come up with caches of unpredictable size.
A topology that needs more devices than the host has is an error naming it, unless `colocate`
is set: then its instances share the devices it is given (non-encoders spread first, encoders
fill in, since an encoder holds no KV cache) and every instance on a shared device gets an
equal slice of the memory budget. Topologies never share a device with each other: a wave runs
side by side only topologies whose device sets are disjoint.

NIXL side channel. Every instance that runs `NixlConnector` listens on
`VLLM_NIXL_SIDE_CHANNEL_PORT` (plus its data-parallel index; this harness runs data-parallel
size 1, so one port each). Two instances on one host with the same port fail in confusing ways,
so each gets its own, reserved through `harness.ports` (`reserve_side_channel_ports`) exactly
like the HTTP ports, which keeps parallel pytest workers and CI jobs apart too.

Nothing here starts a process or touches a device: these functions only compute.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

from harness.ports import PortLease, reserve_ports
from harness.topology import InstanceSpec, Role, ServingConfig, Topology, plan_instances

NIXL_CONNECTOR = "NixlConnector"
SIDE_CHANNEL_PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"
SIDE_CHANNEL_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
GPU_MEMORY_UTILIZATION_FLAG = "--gpu-memory-utilization"
# vLLM's own default; rendered explicitly so a log shows what each instance was allowed.
DEFAULT_GPU_MEMORY_FRACTION = 0.9
# What topology.py renders for CPU placement; meaningless (and misleading in logs) on a GPU.
CPU_ONLY_ENV_KEYS = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS")
# The CPU cores instances bind to when none are given: the harness's RunSettings default.
DEFAULT_CPU_CORES = (0, 1)
GPU_DEFAULT_MODEL = "Qwen/Qwen2.5-VL-3B-Instruct"


class DevicePlanError(ValueError):
    """Devices cannot hold the requested topologies, or the device list itself is invalid."""


@dataclass(frozen=True)
class PlatformProfile:
    """What launching on one kind of hardware changes; everything numerics-related stays shared."""

    name: str  # the --platform value: "cpu", "cuda" or "xpu"
    # Variable that pins an instance to its device (CUDA_VISIBLE_DEVICES, ZE_AFFINITY_MASK);
    # None on CPU, where placement is topology.py's OMP core binding instead.
    device_env_var: str | None
    # KV connector between P and D. ExampleConnector on CPU because the CPU wheel does not pull
    # in nixl; NixlConnector on GPUs because that is what upstream ships and tests there.
    kv_connector: str
    # `kv_buffer_device` written into a NixlConnector config (vLLM's supported pairs: cuda ->
    # cuda|cpu, xpu -> xpu|cpu, cpu -> cpu). Unused with ExampleConnector.
    nixl_kv_buffer_device: str
    # The model served when none is given; None means the locally built tiny model (CPU).
    default_model: str | None
    # CPU has no graphs to capture, so eager is the only mode; GPU runs test what users run.
    enforce_eager: bool
    # --gpu-memory-utilization of an instance that has its device alone; None on CPU, where
    # VLLM_CPU_KVCACHE_SPACE sizes the cache instead.
    gpu_memory_fraction: float | None
    # Whether instances own their devices (GPU) or take turns on shared cores (CPU). Decides
    # both the error for a topology that does not fit and whether topologies can run in waves.
    exclusive_devices: bool

    @property
    def device_kind(self) -> str:
        """How the --devices numbers are meant, for messages."""
        return "device" if self.exclusive_devices else "core"


CPU = PlatformProfile(
    name="cpu",
    device_env_var=None,
    kv_connector="ExampleConnector",
    nixl_kv_buffer_device="cpu",
    default_model=None,
    enforce_eager=True,
    gpu_memory_fraction=None,
    exclusive_devices=False,
)
CUDA = PlatformProfile(
    name="cuda",
    device_env_var="CUDA_VISIBLE_DEVICES",
    kv_connector=NIXL_CONNECTOR,
    nixl_kv_buffer_device="cuda",
    default_model=GPU_DEFAULT_MODEL,
    enforce_eager=False,
    gpu_memory_fraction=DEFAULT_GPU_MEMORY_FRACTION,
    exclusive_devices=True,
)
# Same as CUDA but for how an instance is pinned to its device and where NIXL buffers live.
XPU = replace(CUDA, name="xpu", device_env_var="ZE_AFFINITY_MASK", nixl_kv_buffer_device="xpu")
PLATFORMS: dict[str, PlatformProfile] = {p.name: p for p in (CPU, CUDA, XPU)}


def get_platform(name: str) -> PlatformProfile:
    """Look a platform up by name, or fail with the list of known names."""
    try:
        return PLATFORMS[name]
    except KeyError:
        raise ValueError(f"unknown platform {name!r} (known: {', '.join(PLATFORMS)})") from None


def parse_devices(text: str) -> tuple[int, ...]:
    """Read a device list like "0,1,2"; any malformed or repeated entry is one error line.

    Devices are physical indices as the host lists them (nvidia-smi, xpu-smi, or CPU core
    numbers): an instance's CUDA_VISIBLE_DEVICES replaces the harness's own, it does not
    index into it.
    """
    entries = [entry.strip() for entry in text.split(",")]
    if entries == [""]:
        raise DevicePlanError("no devices given (expected a list like 0,1,2)")
    devices: list[int] = []
    for entry in entries:
        if not entry:
            raise DevicePlanError(f"empty entry in device list {text!r}")
        if not entry.isdigit():
            raise DevicePlanError(
                f"device {entry!r} in {text!r} is not a non-negative integer index"
            )
        device = int(entry)
        if device in devices:
            raise DevicePlanError(f"device {device} is listed twice in {text!r}")
        devices.append(device)
    return tuple(devices)


def serving_for(profile: PlatformProfile, model: str, **overrides: object) -> ServingConfig:
    """The shared ServingConfig with the platform's connector and eager mode filled in."""
    settings: dict[str, object] = {
        "kv_connector": profile.kv_connector,
        "enforce_eager": profile.enforce_eager,
    }
    settings.update(overrides)
    return ServingConfig(model=model, **settings)  # type: ignore[arg-type]


# --- device assignment -------------------------------------------------------------------------


def devices_needed(
    topology: Topology, profile: PlatformProfile, available: int, colocate: bool
) -> int:
    """How many devices `topology` takes out of `available`: one per instance when there are
    enough; when there are not, an encoder (it holds no KV cache) shares a device with another
    instance, while P, D and PD each keep their own unless `colocate` lets everything share.

    On CPU the answer is 0: cores are shared, so a topology never excludes another.
    """
    if not profile.exclusive_devices:
        return 0
    instances = len(topology.roles)
    if instances <= available:
        return instances
    if colocate:
        return available
    own_device = max(1, instances - topology.encoders)
    return own_device if own_device <= available else instances


def assign_devices(
    topology: Topology,
    devices: Sequence[int],
    profile: PlatformProfile,
    colocate: bool = False,
) -> tuple[tuple[int, ...], ...]:
    """The device(s) of each instance of `topology`, in role order, from `devices`.

    CPU: cores in turn, exactly as `plan_instances` hands them out. GPU: one device each while
    there are enough; otherwise non-encoders are spread first and encoders share the least
    loaded devices, since an encoder holds no KV cache (with `colocate`, non-encoders may
    share too).
    """
    if not devices:
        raise DevicePlanError(f"{topology.name}: no {profile.device_kind}s to place it on")
    if not profile.exclusive_devices:
        return tuple((devices[i % len(devices)],) for i in range(len(topology.roles)))
    instances = len(topology.roles)
    own_device = max(1, instances - topology.encoders)
    if own_device > len(devices) and not colocate:
        raise DevicePlanError(
            f"{topology.name} needs {own_device} devices (one per instance besides "
            f"encoders), got {len(devices)}: {_join(devices)}"
        )
    if instances <= len(devices):
        return tuple((device,) for device in devices[:instances])
    load = dict.fromkeys(devices, 0)
    chosen: dict[int, int] = {}
    order = sorted(range(instances), key=lambda i: topology.roles[i] is Role.ENCODER)
    for index in order:
        device = min(devices, key=lambda d: load[d])  # min keeps the first of equals: stable
        load[device] += 1
        chosen[index] = device
    return tuple((chosen[index],) for index in range(instances))


def memory_fractions(
    assignment: Sequence[tuple[int, ...]], profile: PlatformProfile
) -> tuple[float | None, ...]:
    """Each instance's --gpu-memory-utilization: the budget split evenly among its device's sharers.

    Rounded down to hundredths so that the shares of one device never add up past the budget.
    """
    if profile.gpu_memory_fraction is None:
        return tuple(None for _ in assignment)
    sharers: dict[int, int] = {}
    for devices in assignment:
        for device in devices:
            sharers[device] = sharers.get(device, 0) + 1
    fractions = []
    for devices in assignment:
        most = max(sharers[device] for device in devices)
        hundredths = math.floor(round(profile.gpu_memory_fraction * 100 / most, 6))
        fractions.append(hundredths / 100)
    return tuple(fractions)


# --- scheduling topologies onto devices ------------------------------------------------------


@dataclass(frozen=True)
class TopologySlot:
    """One topology's place in a wave."""

    topology: Topology
    # Devices the topology holds for the wave; on GPU disjoint from every other slot of the
    # wave, on CPU the shared core list. An xdist worker running this topology uses exactly
    # these.
    devices: tuple[int, ...]


@dataclass(frozen=True)
class Wave:
    """Topologies that run at the same time; waves run one after another."""

    index: int  # 1-based, for people reading the plan
    slots: tuple[TopologySlot, ...]

    @property
    def devices_in_use(self) -> tuple[int, ...]:
        return tuple(device for slot in self.slots for device in slot.devices)


def schedule_waves(
    topologies: Sequence[Topology],
    devices: Sequence[int],
    profile: PlatformProfile,
    colocate: bool = False,
) -> tuple[Wave, ...]:
    """Pack topologies into waves of disjoint device sets, first fit in the given order.

    The given order is kept where possible (baseline and exact references first), so a
    sequential plan runs references before the topologies compared with them. On CPU every
    topology gets a wave of its own: their instances would share the same cores. Raises
    DevicePlanError naming every topology that cannot fit even alone.
    """
    if not devices:
        raise DevicePlanError(f"no {profile.device_kind}s given")
    if len(set(devices)) != len(devices):
        raise DevicePlanError(f"device list {_join(devices)} repeats a device")
    if not profile.exclusive_devices:
        return tuple(
            Wave(index, (TopologySlot(topology, tuple(devices)),))
            for index, topology in enumerate(topologies, start=1)
        )
    available = len(devices)
    too_big = [t for t in topologies if devices_needed(t, profile, available, colocate) > available]
    if too_big:
        needs = ", ".join(
            f"{t.name} needs {max(1, len(t.roles) - t.encoders)}" for t in too_big
        )
        raise DevicePlanError(
            f"{needs} devices (one per instance besides encoders) but only {len(devices)} given "
            f"({_join(devices)}); use --colocate to share devices within a topology, "
            f"or leave {'it' if len(too_big) == 1 else 'them'} out with --topology"
        )
    waves: list[list[TopologySlot]] = []
    free: list[list[int]] = []
    for topology in topologies:
        need = devices_needed(topology, profile, len(devices), colocate)
        target = next((i for i, left in enumerate(free) if len(left) >= need), None)
        if target is None:
            waves.append([])
            free.append(list(devices))
            target = len(waves) - 1
        taken, free[target] = free[target][:need], free[target][need:]
        waves[target].append(TopologySlot(topology, tuple(taken)))
    return tuple(Wave(index, tuple(slots)) for index, slots in enumerate(waves, start=1))


# --- rendering instances for a platform ------------------------------------------------------


@dataclass(frozen=True)
class PlacedInstanceSpec(InstanceSpec):
    """An InstanceSpec that also knows its platform and device: renders the per-platform extras.

    `argv()` / `env()` keep InstanceSpec's contract, so the launcher needs no change. On CPU
    both render exactly what InstanceSpec does.
    """

    platform: PlatformProfile = CPU  # decides which extras argv()/env() add
    devices: tuple[int, ...] = ()  # the GPUs/XPUs this instance sees (cores on CPU, for the plan)
    # --gpu-memory-utilization: the full budget alone, a slice of it when colocated.
    gpu_memory_fraction: float | None = None
    # VLLM_NIXL_SIDE_CHANNEL_PORT, only for instances running NixlConnector; unique per host.
    side_channel_port: int | None = None

    @property
    def uses_nixl(self) -> bool:
        """True when this instance runs NixlConnector, and so needs a side-channel port."""
        has_kv = self.role.is_kv_producer or self.role.is_kv_consumer
        return has_kv and self.serving.kv_connector == NIXL_CONNECTOR

    def argv(self, vllm_executable: str = "vllm") -> list[str]:
        """InstanceSpec's argv with the platform's flags before the user's extra_args.

        extra_args stay last so that a flag given there still wins (argparse keeps the last).
        """
        argv = super().argv(vllm_executable)
        user_args_at = len(argv) - len(self.serving.extra_args)
        return argv[:user_args_at] + self.platform_args() + argv[user_args_at:]

    def platform_args(self) -> list[str]:
        if self.gpu_memory_fraction is None:
            return []
        return [GPU_MEMORY_UTILIZATION_FLAG, f"{self.gpu_memory_fraction:g}"]

    def kv_transfer_config(self) -> dict | None:
        config = super().kv_transfer_config()
        if config is not None and self.serving.kv_connector == NIXL_CONNECTOR:
            config["kv_buffer_device"] = self.platform.nixl_kv_buffer_device
        return config

    def env(self) -> dict[str, str]:
        """InstanceSpec's env, with CPU-only keys swapped for the device pin on GPU platforms."""
        env = super().env()
        if self.platform.device_env_var is not None:
            if not self.devices:
                raise ValueError(f"{self.name}: {self.platform.name} needs a device")
            for key in CPU_ONLY_ENV_KEYS:
                env.pop(key, None)
            env[self.platform.device_env_var] = ",".join(str(d) for d in self.devices)
        if self.uses_nixl:
            if self.side_channel_port is None:
                raise ValueError(f"{self.name}: {NIXL_CONNECTOR} needs a {SIDE_CHANNEL_PORT_ENV}")
            env[SIDE_CHANNEL_PORT_ENV] = str(self.side_channel_port)
            # Pinned to the host the port was reserved on: "localhost" may resolve elsewhere.
            env[SIDE_CHANNEL_HOST_ENV] = self.host
        env.update(dict(self.extra_env))  # explicit additions win, as in InstanceSpec
        return env


def side_channel_port_count(topology: Topology, serving: ServingConfig) -> int:
    """How many NIXL side-channel ports `topology` needs: one per KV producer or consumer."""
    if serving.kv_connector != NIXL_CONNECTOR:
        return 0
    return sum(1 for role in topology.roles if role.is_kv_producer or role.is_kv_consumer)


def reserve_side_channel_ports(
    topology: Topology, serving: ServingConfig, **reserve_kwargs: object
) -> list[PortLease]:
    """Reserve the topology's side-channel ports (none without NIXL) with `reserve_ports`.

    Hold the leases while the servers run and `hand_over()` each right before spawning, as
    for HTTP ports; release them at teardown.
    """
    count = side_channel_port_count(topology, serving)
    return reserve_ports(count, **reserve_kwargs) if count else []  # type: ignore[arg-type]


def place_instances(
    topology: Topology,
    serving: ServingConfig,
    profile: PlatformProfile,
    ports: Sequence[int],
    storage_dir: Path,
    devices: Sequence[int],
    *,
    colocate: bool = False,
    side_channel_ports: Sequence[int] = (),
) -> list[PlacedInstanceSpec]:
    """`plan_instances`, then each instance's device, memory share and side-channel port.

    `devices` are the topology's own (a wave slot's devices on GPU, the cores on CPU).
    """
    needed = side_channel_port_count(topology, serving)
    if len(side_channel_ports) != needed:
        raise ValueError(
            f"{topology.name} needs {needed} NIXL side-channel ports, got {len(side_channel_ports)}"
        )
    assignment = assign_devices(topology, devices, profile, colocate)
    fractions = memory_fractions(assignment, profile)
    cores = tuple(devices) if not profile.exclusive_devices else DEFAULT_CPU_CORES
    specs = plan_instances(topology, serving, list(ports), storage_dir, cpu_cores=cores)
    side_ports = iter(side_channel_ports)
    placed = []
    for spec, instance_devices, fraction in zip(specs, assignment, fractions, strict=True):
        base = {f.name: getattr(spec, f.name) for f in fields(InstanceSpec)}
        instance = PlacedInstanceSpec(
            **base, platform=profile, devices=instance_devices, gpu_memory_fraction=fraction
        )
        if instance.uses_nixl:
            instance = replace(instance, side_channel_port=next(side_ports))
        placed.append(instance)
    return placed


def _join(devices: Sequence[int]) -> str:
    return ",".join(str(d) for d in devices)
