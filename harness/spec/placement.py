"""Where each instance runs, and which topologies run side by side: the one scheduler.

`epd-harness plan`, `epd-harness run`, the pytest scenarios and their xdist workers all call
`schedule()` with the same inputs and so get the same waves and the same devices; what `plan`
prints is what runs.

GPU / XPU (exclusive devices). By default every instance gets a device of its own, because two
vLLM instances on one device race for its memory: each sizes its KV cache from what it sees
free at start-up, so co-located start-ups fail or come up with caches of unpredictable size.
A topology that needs more devices than the host has is an error naming it, unless `colocate`
is set: then its instances share the devices it is given (non-encoders spread first, encoders
fill in, since an encoder holds no KV cache). Topologies never share a device with each other: a
wave runs side by side only topologies whose device sets are disjoint. The baseline keeps the first
device to itself through every wave where that takes no other topology a device (4 GPUs and
more: `baseline_keeps_its_device`), since loads and fuzzing serve it beside the topology under
test. Parallel xdist workers hold a
lock per device while they serve (`harness.serve.ports.lease_devices`), so a worker that reaches
a later wave early waits for the devices instead of sharing them.

CPU (shared cores). Every instance may run on all of the run's cores (its processes' CPU
affinity, `harness.spec.platforms`), and the kernel spreads them: with one core each, the
instances of a 1E+1P+1D on 2 cores would start two to a core while the other core had one. The
cores also size the waves. Start-up is CPU-bound: measured on 2 cores (vLLM's `mp` executor
then), one or two instances starting together are ready in 26-27 s, three in 46-54 s. So
topologies share a wave only while the wave holds at most one instance per core (and what
memory holds at `CPU_INSTANCE_BYTES` each): on 2 cores every topology runs alone, on a 16-core
host the whole sweep starts at once. Under xdist every worker gets an equal part
of that budget.

Memory (`memory_fractions`). Each role gets upstream's `--gpu-memory-utilization`
(run_epd_correctness_test.sh and the disaggregated_encoder examples of vLLM 0.28-0.32): the
baseline 0.9, P, D and PD 0.7, an encoder 0.01. An EC producer that is not also a consumer
loads only the encoder and allocates no KV cache in 0.32 (`ECTransferConfig.is_encode_only`,
`VllmConfig._resolve_mm_encoder_only`), so its share only passes vLLM's start-up check that
that much memory is free; what it really holds (the vision tower's weights, its activation
peak) vLLM does not count against it. On a device that instances share, the shares of the
instances that hold a KV cache, plus `ENCODER_ROOM` for each encoder there, add up to at most
the device's budget (0.9, the rest is CUDA contexts and allocator slack): E beside P keeps P at
upstream's 0.7 (0.7 + 0.2 = 0.9, the layout of upstream's own disagg_1e1p1d_example.sh, E and
P on one GPU at 0.01 and 0.7); P beside D get 0.45 each; E, P and D on one device 0.35 each.
vLLM sizes each KV cache from its own share minus what its own process holds, and refuses to
start when less than its share is free, so these sums are what keeps co-located start-ups from
failing; and instances on one device start one after another (`start_after`), so none
profiles while another frees memory. None of this was measured on a GPU here: `epd-harness
plan` prints every share and the start order.

Nothing here starts a process or touches a device: these functions only compute.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from harness.spec.generations import NEWEST, ProtocolGeneration
from harness.spec.instances import InstanceSpec
from harness.spec.platforms import NIXL_CONNECTOR, DevicePlanError, PlatformProfile
from harness.spec.topology import Role, ServingConfig, Topology

# Peak RSS of one CPU instance of the tiny model (measured: 2.1 GB encoder, 3.0 GB others),
# with room to spare: the memory side of the CPU wave budget.
CPU_INSTANCE_BYTES = 3_500_000_000
CPU_INSTANCES_PER_CORE = 1  # start-up is CPU-bound: more per core only queues (see above)
# Leave this share of the available memory to everything else on the machine.
CPU_MEMORY_HEADROOM = 0.8

# Each role's --gpu-memory-utilization when it has its device alone: upstream's (module docstring).
UPSTREAM_MEMORY_SHARES: dict[Role, float] = {
    Role.BASELINE: 0.9,
    Role.ENCODER: 0.01,
    Role.PREFILL_DECODE: 0.7,
    Role.PREFILL: 0.7,
    Role.DECODE: 0.7,
}
# What an encoder really holds on a device it shares, which its 0.01 does not cover: the room
# upstream's own colocated example leaves it beside a 0.7 prefill (0.9 - 0.7).
ENCODER_ROOM = 0.2


# --- devices of one topology's instances --------------------------------------------------------


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

    CPU: all of the cores, for each. GPU: one device each while
    there are enough; otherwise non-encoders are spread first and encoders share the least
    loaded devices, since an encoder holds no KV cache (with `colocate`, non-encoders may
    share too).
    """
    if not devices:
        raise DevicePlanError(f"{topology.name}: no {profile.device_kind}s to place it on")
    if not profile.exclusive_devices:
        return tuple(tuple(sorted(devices)) for _ in topology.roles)
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
    roles: Sequence[Role],
    assignment: Sequence[tuple[int, ...]],
    profile: PlatformProfile,
) -> tuple[float | None, ...]:
    """Each instance's --gpu-memory-utilization (module docstring): upstream's share for its
    role, and on a shared device the KV-holding instances split what the device's budget leaves
    after `ENCODER_ROOM` per encoder, never more than upstream's share.

    Rounded down to hundredths, so a device's shares never add up past its budget. Raises
    DevicePlanError when the encoders on a device leave its KV holders nothing.
    """
    if profile.gpu_memory_fraction is None:
        return tuple(None for _ in assignment)
    budget = profile.gpu_memory_fraction
    holders: dict[int, int] = {}
    encoders: dict[int, int] = {}
    for role, devices in zip(roles, assignment, strict=True):
        for device in devices:
            counts = encoders if role is Role.ENCODER else holders
            counts[device] = counts.get(device, 0) + 1
    fractions: list[float | None] = []
    for role, devices in zip(roles, assignment, strict=True):
        share = min(UPSTREAM_MEMORY_SHARES[role], budget)
        if role is not Role.ENCODER:
            for device in devices:
                left = budget - ENCODER_ROOM * encoders.get(device, 0)
                if left <= 0:
                    raise DevicePlanError(
                        f"device {device}: {encoders[device]} encoders leave its KV-holding "
                        f"instances no memory ({ENCODER_ROOM:g} of it each); give the "
                        "topology more devices"
                    )
                share = min(share, left / holders[device])
        fractions.append(math.floor(round(share * 100, 6)) / 100)
    return tuple(fractions)


def gpu_memory_policy(profile: PlatformProfile) -> dict[str, object] | None:
    """The shares and the shared-device rule as data (run.json, `plan`); None on CPU."""
    if profile.gpu_memory_fraction is None:
        return None
    return {
        "shares": {role.value: share for role, share in UPSTREAM_MEMORY_SHARES.items()},
        "device_budget": profile.gpu_memory_fraction,
        "encoder_room_on_a_shared_device": ENCODER_ROOM,
    }


# --- scheduling topologies into waves ----------------------------------------------------------


class TooFewDevices(DevicePlanError):
    """Topologies that need more devices than they were given, without `colocate`. The message
    states the need only: what to do about it is the command's to say, in its own flags (`run`
    can leave a topology out with --topology; `repro` reruns its bundle's one, and has no such
    flag), so each caller adds its remedy to `str(exc)`."""

    def __init__(self, needs: Mapping[str, int], devices: tuple[int, ...]) -> None:
        self.needs = dict(needs)  # topology name -> devices it needs
        self.devices = devices
        listed = ", ".join(f"{name} needs {count}" for name, count in needs.items())
        super().__init__(
            f"{listed} devices (one per instance besides encoders) but only {len(devices)} "
            f"given ({_join(devices)})"
        )


@dataclass(frozen=True)
class TopologySlot:
    """One topology's place in a wave."""

    topology: Topology
    # Devices the topology holds for the wave; on GPU disjoint from every other slot of the
    # wave, on CPU the shared cores.
    devices: tuple[int, ...]


@dataclass(frozen=True)
class Wave:
    """Topologies that run at the same time; waves run one after another."""

    index: int  # 1-based, for people reading the plan
    slots: tuple[TopologySlot, ...]

    @property
    def devices_in_use(self) -> tuple[int, ...]:
        return tuple(device for slot in self.slots for device in slot.devices)


@dataclass(frozen=True)
class Schedule:
    waves: tuple[Wave, ...]

    def slot_of(self, topology_name: str) -> TopologySlot:
        for wave in self.waves:
            for slot in wave.slots:
                if slot.topology.name == topology_name:
                    return slot
        raise KeyError(f"{topology_name} is not in the schedule")

    def wave_of(self, topology_name: str) -> Wave:
        return next(w for w in self.waves if any(s.topology.name == topology_name for s in w.slots))


MEMINFO = Path("/proc/meminfo")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")  # where cgroup v2 is mounted


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (the physical total where that is missing), or less
    where this process's cgroup leaves less (`cgroup_memory_room`): /proc/meminfo is the
    host's, and a container's limit is not in it (found in review: a job limited to 8 GB on a
    64 GB host was given waves sized for 64)."""
    host = None
    try:
        with MEMINFO.open(encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    host = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if host is None:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    room = cgroup_memory_room()
    return host if room is None else min(host, room)


def cgroup_memory_room() -> int | None:
    """What the cgroup v2 hierarchy still lets this process's cgroup allocate: the least, over
    its cgroup and each one above it, of memory.max less what it uses; None where no limit is
    set or cgroup v2 cannot be read. What it uses is memory.current less its inactive file
    pages: page cache the kernel reclaims before it would refuse an allocation (MemAvailable
    counts it available too; a CI job that just installed its wheels holds gigabytes)."""
    try:
        lines = PROC_SELF_CGROUP.read_text(encoding="ascii").splitlines()
    except OSError:
        return None
    own = next((line[len("0::") :] for line in lines if line.startswith("0::")), None)
    if own is None:
        return None
    room = None
    directory = CGROUP_ROOT / own.strip().lstrip("/")
    while directory.is_relative_to(CGROUP_ROOT):
        try:
            limit = (directory / "memory.max").read_text(encoding="ascii").strip()
            if limit != "max":
                used = int((directory / "memory.current").read_text(encoding="ascii"))
                used -= reclaimable_bytes(directory / "memory.stat")
                left = max(0, int(limit) - used)
                room = left if room is None else min(room, left)
        except (OSError, ValueError):
            pass  # the root has no memory.max; a controller not enabled here has neither
        if directory == CGROUP_ROOT:
            break
        directory = directory.parent
    return room


def reclaimable_bytes(memory_stat: Path) -> int:
    """A cgroup's inactive file pages (memory.stat's `inactive_file`), 0 where unread."""
    try:
        for line in memory_stat.read_text(encoding="ascii").splitlines():
            key, _, value = line.partition(" ")
            if key == "inactive_file":
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def cpu_instance_budget(cores: int, memory_bytes: int, workers: int = 1) -> int:
    """How many CPU instances one wave may run: one per core, within memory, shared among
    `workers` parallel xdist workers; at least one (a topology always runs, if alone)."""
    by_memory = int(memory_bytes * CPU_MEMORY_HEADROOM) // CPU_INSTANCE_BYTES
    return max(1, min(cores * CPU_INSTANCES_PER_CORE, by_memory) // max(1, workers))


def schedule(
    topologies: Sequence[Topology],
    devices: Sequence[int],
    profile: PlatformProfile,
    colocate: bool = False,
    cpu_budget: int | None = None,
    one_a_wave: bool = False,
) -> Schedule:
    """Pack topologies into waves, first fit in the given order.

    The given order is kept where possible (baseline and exact references first), so a
    sequential plan runs references before the topologies compared with them. GPU: waves of
    disjoint device sets. CPU: waves within `cpu_budget` instances (default: this machine's
    `cpu_instance_budget`). `one_a_wave`: each topology a wave of its own, on either (Ray: each
    instance takes a node's bundle, so the cluster's room, not the devices listed here, is what
    a wave fills, and the pool stops the cluster's topology before the next). Raises
    DevicePlanError naming every topology that cannot fit.
    """
    if not topologies:  # attached with --golden: nothing starts here, on no device
        return Schedule(())
    if not devices:
        raise DevicePlanError(f"no {profile.device_kind}s given")
    if len(set(devices)) != len(devices):
        raise DevicePlanError(f"device list {_join(devices)} repeats a device")
    if not profile.exclusive_devices:
        cores = tuple(sorted(devices))
        if one_a_wave:
            return _pack(topologies, lambda t: 1, 1, lambda t, used: cores)
        budget = cpu_budget or cpu_instance_budget(len(devices), available_memory_bytes())
        return _pack(topologies, lambda t: len(t.roles), budget, lambda t, used: cores)
    available = len(devices)
    too_big = [t for t in topologies if devices_needed(t, profile, available, colocate) > available]
    if too_big:
        raise TooFewDevices(
            {t.name: max(1, len(t.roles) - t.encoders) for t in too_big}, tuple(devices)
        )
    need = {t.name: devices_needed(t, profile, available, colocate) for t in topologies}
    if one_a_wave:
        return _pack(topologies, lambda t: 1, 1, lambda t, used: tuple(devices[: need[t.name]]))
    if baseline_keeps_its_device(topologies, devices, profile, colocate):
        baseline = next(t for t in topologies if t.is_baseline)
        others = _pack_on_devices([t for t in topologies if t is not baseline], devices[1:], need)
        first = (TopologySlot(baseline, tuple(devices[:1])), *(others[0].slots if others else ()))
        return Schedule((Wave(1, first), *others[1:]))
    return Schedule(_pack_on_devices(topologies, devices, need))


def baseline_keeps_its_device(
    topologies: Sequence[Topology],
    devices: Sequence[int],
    profile: PlatformProfile,
    colocate: bool = False,
) -> bool:
    """Whether the baseline keeps the first device to itself in every wave: where every other
    topology gets as many devices from the rest as from all of them (4 GPUs: 1E+1P+1D on
    1-3). A load calibrates the baseline and fuzzing serves it beside the topology under test;
    on a device of a later wave's topology, each such use stopped that topology and started
    it again (seen with the fake vLLM on 4 devices: 1E+1P+1D started 7 times). Where the rest
    would squeeze a topology (2 GPUs: 1P+1D onto one device) the topologies take the
    baseline's device in their own waves, as before."""
    if not profile.exclusive_devices or len(devices) < 2:
        return False
    if not any(t.is_baseline for t in topologies):
        return False
    rest = len(devices) - 1
    for topology in topologies:
        if topology.is_baseline:
            continue
        needed = devices_needed(topology, profile, rest, colocate)
        if needed > rest or needed != devices_needed(topology, profile, len(devices), colocate):
            return False
    return True


def _pack_on_devices(
    topologies: Sequence[Topology], devices: Sequence[int], need: dict[str, int]
) -> tuple[Wave, ...]:
    """Waves of disjoint device sets out of `devices`, first fit in the given order."""
    order = {device: i for i, device in enumerate(devices)}
    return _pack(
        topologies,
        lambda t: need[t.name],
        len(devices),
        lambda t, used: tuple(sorted(set(devices) - set(used), key=order.get)[: need[t.name]]),
    ).waves


def side_by_side(
    topologies: Sequence[Topology],
    devices: Sequence[int],
    profile: PlatformProfile,
    colocate: bool = False,
) -> dict[str, tuple[int, ...]]:
    """Each topology's devices when all of them must serve at once (fuzzing sends every
    example to the baseline and to the topology, so both stay up). On GPUs they are one wave
    of disjoint devices: a session given no slot would lease every device of the run and
    place its first instance on the first of them, beside the other session's. With
    `colocate`, topologies that cannot each have a device per instance share the devices the
    others leave (the baseline keeps one of its own): on 2 GPUs the baseline on one, the
    topology's instances on the other. Raises DevicePlanError naming the count when the
    devices cannot hold them together; on CPU they share the cores, as every topology does."""
    if not profile.exclusive_devices:
        return {t.name: tuple(devices) for t in topologies}
    waves = schedule(topologies, devices, profile, colocate).waves
    if len(waves) == 1:
        return {slot.topology.name: slot.devices for slot in waves[0].slots}
    if colocate and len(topologies) <= len(devices):
        return _colocated_side_by_side(topologies, devices)
    needed = (
        len(topologies)
        if colocate
        else sum(devices_needed(t, profile, len(devices), colocate) for t in topologies)
    )
    share = "" if colocate else ", or let instances share with --colocate"
    raise DevicePlanError(
        f"{' and '.join(t.name for t in topologies)} serve side by side: together they "
        f"need {needed} {profile.device_kind}s, but only {len(devices)} given "
        f"({_join(devices)}); give more with --devices{share}"
    )


def _colocated_side_by_side(
    topologies: Sequence[Topology], devices: Sequence[int]
) -> dict[str, tuple[int, ...]]:
    """A device for each topology, then the rest handed out in order, each topology taking
    no more than one per instance; each its own run of `devices`."""
    counts = [1] * len(topologies)
    left = len(devices) - len(topologies)
    for index, topology in enumerate(topologies):
        more = min(left, len(topology.roles) - 1)
        counts[index] += more
        left -= more
    slots, first = {}, 0
    for topology, count in zip(topologies, counts, strict=True):
        slots[topology.name] = tuple(devices[first : first + count])
        first += count
    return slots


def _pack(topologies, size, capacity: int, take) -> Schedule:
    waves: list[list[TopologySlot]] = []
    room: list[int] = []
    for topology in topologies:
        target = next((i for i, left in enumerate(room) if left >= size(topology)), None)
        if target is None:
            waves.append([])
            room.append(capacity)
            target = len(waves) - 1
        used = [d for slot in waves[target] for d in slot.devices]
        waves[target].append(TopologySlot(topology, take(topology, used)))
        room[target] -= size(topology)
    return Schedule(tuple(Wave(i, tuple(slots)) for i, slots in enumerate(waves, start=1)))


# --- placing one topology's instances ------------------------------------------------------------


def needs_side_channel(role: Role, serving: ServingConfig) -> bool:
    """Whether an instance of `role` runs NIXL, and so needs a side-channel port."""
    has_kv = role.is_kv_producer or role.is_kv_consumer
    return has_kv and serving.kv_connector == NIXL_CONNECTOR


def side_channel_port_count(topology: Topology, serving: ServingConfig) -> int:
    """How many NIXL side-channel ports `topology` needs: one per KV producer or consumer."""
    return sum(1 for role in topology.roles if needs_side_channel(role, serving))


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
    generation: ProtocolGeneration = NEWEST,
    hosts: Sequence[str] = (),
) -> list[InstanceSpec]:
    """Every instance of `topology`: name, port, fresh storage, device(s), memory share and
    side-channel port. `devices` are the topology's slot devices (its cores on CPU). `hosts`
    are the addresses the instances bind, in role order (default: loopback, this host).

    Storage is per topology run on purpose: both example connectors key what they store by
    content, so a reused directory would let a consumer load what an earlier run left there.
    """
    if len(ports) != len(topology.roles):
        raise ValueError(f"{topology.name} needs {len(topology.roles)} ports, got {len(ports)}")
    needed = side_channel_port_count(topology, serving)
    if len(side_channel_ports) != needed:
        raise ValueError(
            f"{topology.name} needs {needed} NIXL side-channel ports, got {len(side_channel_ports)}"
        )
    if hosts and len(hosts) != len(topology.roles):
        raise ValueError(f"{topology.name} needs {len(topology.roles)} hosts, got {len(hosts)}")
    assignment = assign_devices(topology, devices, profile, colocate)
    fractions = memory_fractions(topology.roles, assignment, profile)
    ec_storage = storage_dir / "ec" if topology.has_ec_transfer else None
    kv_storage = storage_dir / "kv" if topology.has_kv_transfer else None
    side_ports = iter(side_channel_ports)
    counts: dict[Role, int] = {}
    placed = []
    for role, port, instance_devices, fraction in zip(
        topology.roles, ports, assignment, fractions, strict=True
    ):
        n = counts.get(role, 0)
        counts[role] = n + 1
        instance = InstanceSpec(
            name=f"{topology.name}/{role.value}{n}",
            role=role,
            port=port,
            serving=serving,
            ec_storage=ec_storage,
            kv_storage=kv_storage,
            platform=profile,
            devices=instance_devices,
            gpu_memory_fraction=fraction,
            generation=generation,
        )
        if hosts:
            instance = replace(instance, host=hosts[len(placed)])
        if instance.uses_nixl:
            instance = replace(instance, side_channel_port=next(side_ports))
        placed.append(instance)
    return placed


def start_after(instances: Sequence[InstanceSpec]) -> dict[str, tuple[str, ...]]:
    """Which instances of one topology must be healthy before another is spawned: instance
    name -> the instances it waits for (an instance not named starts with the topology).

    Why: vLLM (0.32, `v1/worker/gpu_worker.py` `determine_available_memory`; XPU's worker
    inherits it) asserts "Error in memory profiling" when another process on its device
    frees memory while it profiles, and refuses to start when less than its share is free at
    its first snapshot (`v1/worker/utils.py` `request_memory`). An encoder profiles with a
    transient of its large `--max-num-batched-tokens` and frees it. So on a platform that
    accounts device memory (`gpu_memory_fraction`: cuda, xpu) the instances on one device of
    one host start one after another: encoders first (their transient is over, and its
    memory back, before a KV holder takes its snapshot), the others in role order, each after
    the one before it on every device it has. Instances on other devices start at once, and
    on CPU every instance does: cores are shared, not accounted, and staggering would only
    slow the start. Read in vLLM's source, not measured on a GPU.
    """
    if not instances or instances[0].platform.gpu_memory_fraction is None:
        return {}
    order = sorted(instances, key=lambda spec: spec.role is not Role.ENCODER)  # stable
    last_on: dict[tuple[str, int], str] = {}
    waits: dict[str, tuple[str, ...]] = {}
    for spec in order:
        before = [last_on[(spec.host, d)] for d in spec.devices if (spec.host, d) in last_on]
        if before:
            waits[spec.name] = tuple(dict.fromkeys(before))
        for device in spec.devices:
            last_on[(spec.host, device)] = spec.name
    return waits


def start_stages(order: Mapping[str, Sequence[str]]) -> int:
    """How many instances the longest `start_after` chain starts one after another (1 when
    every instance starts at once). The startup timeout is given once per stage: it was sized
    for one vLLM start (weights, profiling, a KV cache), and a chain of three on one GPU is
    three starts end to end, which a timeout sized for one would cut short."""
    depth: dict[str, int] = {}

    def stage(name: str) -> int:
        if name not in depth:
            depth[name] = 1 + max((stage(before) for before in order.get(name, ())), default=0)
        return depth[name]

    return max((stage(name) for name in order), default=1)


def _join(devices: Sequence[int]) -> str:
    return ",".join(str(d) for d in devices)
