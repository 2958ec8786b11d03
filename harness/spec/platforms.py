"""Platform profiles: the same topology, launched on CPU, CUDA or XPU.

`topology.py` decides *what* each instance is (its role and transfer configs); a profile says
what running on one kind of hardware adds to its command line and environment (rendered by
`harness.spec.instances`), and `harness.spec.placement` decides *where* each instance runs:

* cpu (the default): each instance's processes may run on the run's cores (their CPU
  affinity, set at spawn), its worker runs inside its engine core as on a one-device GPU
  (below), it gets a CPU KV cache (`VLLM_CPU_KVCACHE_SPACE`) and moves KV through
  `ExampleConnector` (shared files).
* cuda: one GPU per instance through `CUDA_VISIBLE_DEVICES`, an explicit
  `--gpu-memory-utilization` (upstream's share per role, `harness.spec.placement`), KV through
  `NixlConnector`, `--enforce-eager` as every `vllm serve` line of upstream's own correctness
  script has it (`--no-enforce-eager` lets vLLM compile and capture CUDA graphs instead), and
  upstream's default model Qwen/Qwen2.5-VL-3B-Instruct.
* xpu: as cuda, with `ZE_AFFINITY_MASK` selecting the device (and XPU graphs where
  `--no-enforce-eager` asks for them and torch has them).

The device policy (one GPU per instance unless colocated; waves of disjoint devices) is
`harness.spec.placement`'s.

The worker in the engine core. With one device vLLM runs its worker inside the engine core
process on a GPU (the `uni` executor), but on CPU it switches to the `mp` executor and spawns a
third interpreter for it, unless `VLLM_ENABLE_V1_MULTIPROCESSING=0` (vLLM 0.27.1-0.32.0,
`platforms/cpu.py`; `vllm serve` still runs its engine core in a process of its own, that
variable only moves the offline `LLM` class in-process). The CPU profile asks for `uni` that way,
so a CPU run has the GPU night's process layout, and a start imports torch and vLLM twice, not
three times. Measured here (2 cores, the tiny model, alone): ready in 17.5 s and 17.4 CPU-s
instead of 27.5 s and 28.1 CPU-s; and the `mp` executor's worker polls its shared-memory queue
for a second after every request (`shm_broadcast.py`, 1.0 CPU-s after a 0.13 s request), which
`uni` has no queue for. What `mp` did besides, binding the worker's OMP threads to the cores in
`VLLM_CPU_OMP_THREADS_BIND`, `uni` does not do, so the harness renders no such variable and
confines the whole instance to its cores itself (`harness.serve.launch`). The serving
config's `extra_args` come last on the command line, so `--distributed-executor-backend mp`
there brings vLLM's CPU default back.

NIXL side channel. Every instance that runs `NixlConnector` listens on
`VLLM_NIXL_SIDE_CHANNEL_PORT` (plus its data-parallel index; this harness runs data-parallel
size 1, so one port each). Two instances on one host with the same port fail in confusing ways,
so each gets its own, reserved through `harness.serve.ports` exactly like the HTTP ports,
which keeps parallel pytest workers and CI jobs apart too.

Nothing here starts a process or touches a device: these functions only compute.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from harness.errors import BadInput, lookup

NIXL_CONNECTOR = "NixlConnector"
SIDE_CHANNEL_PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"
SIDE_CHANNEL_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
# The EC connectors' side channel (ECCPUConnector with NIXL listens there); vLLM's default is
# "localhost", like NIXL's, so it is rendered for every EC instance whichever connector runs.
EC_SIDE_CHANNEL_HOST_ENV = "VLLM_EC_SIDE_CHANNEL_HOST"
GPU_MEMORY_UTILIZATION_FLAG = "--gpu-memory-utilization"
# What the instances on one device may take of it together: vLLM's own default for an instance
# that has the device alone, which leaves the rest to CUDA contexts and allocator slack. Each
# role's share within it is `harness.spec.placement`'s.
DEFAULT_GPU_MEMORY_FRACTION = 0.9
# What topology.py renders for CPU placement; meaningless (and misleading in logs) on a GPU.
CPU_ONLY_ENV_KEYS = ("VLLM_CPU_KVCACHE_SPACE", "OMP_NUM_THREADS", "VLLM_ENABLE_V1_MULTIPROCESSING")
# The worker in the engine core process (module docstring): the flag, and what lets it hold on CPU.
IN_ENGINE_WORKER_ARGS = ("--distributed-executor-backend", "uni")
IN_ENGINE_WORKER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# The CPU cores instances run on when none are given: the harness's RunSettings default.
DEFAULT_CPU_CORES = (0, 1)
GPU_DEFAULT_MODEL = "Qwen/Qwen2.5-VL-3B-Instruct"


class DevicePlanError(BadInput):
    """Devices cannot hold the requested topologies, or the device list itself is invalid."""


@dataclass(frozen=True)
class PlatformProfile:
    """What launching on one kind of hardware changes; everything numerics-related stays shared."""

    name: str  # the --platform value: "cpu", "cuda" or "xpu"
    # Variable that pins an instance to its device (CUDA_VISIBLE_DEVICES, ZE_AFFINITY_MASK);
    # None on CPU, where the instance's processes are confined to its cores instead.
    device_env_var: str | None
    # KV connector between P and D. ExampleConnector on CPU because the CPU wheel does not pull
    # in nixl; NixlConnector on GPUs because that is what upstream ships and tests there.
    kv_connector: str
    # `kv_buffer_device` written into a NixlConnector config (vLLM's supported pairs: cuda ->
    # cuda|cpu, xpu -> xpu|cpu, cpu -> cpu). Unused with ExampleConnector.
    nixl_kv_buffer_device: str
    # The model served when none is given; None means the locally built tiny model (CPU).
    default_model: str | None
    # --enforce-eager by default. CPU: vLLM captures no graphs there, and every CPU figure of
    # this project was measured eager. GPUs: upstream's correctness script serves eager, so a
    # run is upstream's reference configuration and pays no compile or graph capture at each
    # start; `--no-enforce-eager` (GPU platforms only) lets vLLM compile and capture graphs.
    enforce_eager: bool
    # Render `--distributed-executor-backend uni` and what lets it hold (module docstring):
    # CPU only, since a one-device GPU instance runs its worker in the engine core already.
    worker_in_engine_core: bool
    # What the instances sharing one device may take of it together (their shares:
    # `harness.spec.placement.memory_fractions`); None on CPU, where VLLM_CPU_KVCACHE_SPACE sizes
    # the cache instead.
    gpu_memory_fraction: float | None
    # Whether instances own their devices (GPU) or take turns on shared cores (CPU). Decides
    # both the error for a topology that does not fit and whether topologies can run in waves.
    exclusive_devices: bool
    # Set beside device_env_var so that its numbers mean what --devices means. CUDA numbers
    # devices fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID, and nvidia-smi (whose indices
    # --devices takes, `parse_devices`) numbers them by PCI bus: on a host of mixed GPUs the two
    # differ, and an instance would run on another GPU than the plan, run.json and a leftover
    # check name.
    device_order_env: tuple[tuple[str, str], ...] = ()

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
    worker_in_engine_core=True,
    gpu_memory_fraction=None,
    exclusive_devices=False,
)
CUDA = PlatformProfile(
    name="cuda",
    device_env_var="CUDA_VISIBLE_DEVICES",
    kv_connector=NIXL_CONNECTOR,
    nixl_kv_buffer_device="cuda",
    default_model=GPU_DEFAULT_MODEL,
    enforce_eager=True,
    worker_in_engine_core=False,
    gpu_memory_fraction=DEFAULT_GPU_MEMORY_FRACTION,
    exclusive_devices=True,
    device_order_env=(("CUDA_DEVICE_ORDER", "PCI_BUS_ID"),),
)
# Same as CUDA but for how an instance is pinned to its device and where NIXL buffers live
# (Level Zero's affinity mask has no other order to choose).
XPU = replace(
    CUDA,
    name="xpu",
    device_env_var="ZE_AFFINITY_MASK",
    nixl_kv_buffer_device="xpu",
    device_order_env=(),
)
PLATFORMS: dict[str, PlatformProfile] = {p.name: p for p in (CPU, CUDA, XPU)}


def get_platform(name: str) -> PlatformProfile:
    """Look a platform up by name, or fail (BadInput) with the list of known names."""
    return lookup("platform", name, PLATFORMS)


def parse_devices(text: str) -> tuple[int, ...]:
    """Read a device list like "0,1,2"; any malformed or repeated entry is one error line.

    Devices are physical indices as the host lists them (nvidia-smi, xpu-smi, or CPU core
    numbers): an instance's CUDA_VISIBLE_DEVICES replaces the harness's own, it does not
    index into it (so an inherited one must hold them: `check_inherited_devices`).
    """
    entries = [entry.strip() for entry in text.split(",")]
    if entries == [""]:
        raise DevicePlanError("no devices given (expected a list like 0,1,2)")
    devices: list[int] = []
    for entry in entries:
        if not entry:
            raise DevicePlanError(f"empty entry in device list {text!r}")
        if not (entry.isascii() and entry.isdigit()):  # '²' is a digit to isdigit(), not int()
            raise DevicePlanError(
                f"device {entry!r} in {text!r} is not a non-negative integer index"
            )
        device = int(entry)
        if device in devices:
            raise DevicePlanError(f"device {device} is listed twice in {text!r}")
        devices.append(device)
    return tuple(devices)


def inherited_devices(platform: PlatformProfile, environ: Mapping[str, str]) -> str | None:
    """The device variable this process inherited (CUDA_VISIBLE_DEVICES on cuda), or None
    where it is not set or the platform places instances on cores."""
    if platform.device_env_var is None:
        return None
    return environ.get(platform.device_env_var)


def check_inherited_devices(
    platform: PlatformProfile,
    devices: tuple[int, ...],
    environ: Mapping[str, str],
    source: str = "--devices",
) -> None:
    """Refuse devices an inherited CUDA_VISIBLE_DEVICES (ZE_AFFINITY_MASK on xpu) did not give
    this process. Each instance's variable is rendered from --devices, physical indices as the
    host lists them (`parse_devices`), and replaces the inherited one: a job restricted to GPUs
    2,3 and run with --devices 0,1 would place its instances on GPUs it was not given. Devices
    within the inherited list mean the same either way, so they pass; a list of UUIDs or MIG
    ids names no index to compare with, so it is refused too."""
    inherited = inherited_devices(platform, environ)
    if inherited is None:
        return
    var = platform.device_env_var
    entries = [entry.strip() for entry in inherited.split(",") if entry.strip()]
    given = ",".join(map(str, devices))
    if not all(entry.isascii() and entry.isdigit() for entry in entries):
        raise DevicePlanError(
            f"{var}={inherited} names devices by something other than an index, and the "
            f"harness sets each instance's {var} from --devices ({given}, indices as the host "
            f"lists them): unset {var} and pass --devices with the indices this job may use"
        )
    allowed = {int(entry) for entry in entries}
    outside = [d for d in devices if d not in allowed]
    if outside:
        raise DevicePlanError(
            f"{source} {given}: {var}={inherited} gives this process no device "
            f"{','.join(map(str, outside))}, and the harness sets each instance's {var} from "
            f"--devices (indices as the host lists them, replacing the inherited value, not "
            f"indexing into it): "
            + (f"pass --devices within {inherited}, or unset {var}" if allowed else f"unset {var}")
        )


def check_host_devices(
    platform: PlatformProfile,
    devices: tuple[int, ...],
    listed: tuple[int, ...] | None,
    source: str = "--devices",
) -> None:
    """Refuse GPUs this host does not have: `listed` are the indices nvidia-smi lists
    (`harness.devices.smi_gpu_indices`), None where it could not say (nothing is refused on a
    guess). An instance whose CUDA_VISIBLE_DEVICES names a GPU the host lacks starts all the
    same, and dies with no CUDA device once its topology's other instances started. cuda only:
    cores are checked against this process's affinity, XPUs are not listed here. `source`:
    what named the devices, as for `check_inherited_devices`."""
    if platform.name != CUDA.name or listed is None:
        return
    missing = [device for device in devices if device not in listed]
    if missing:
        raise DevicePlanError(
            f"{source} {','.join(map(str, devices))}: this host has no GPU "
            f"{','.join(map(str, missing))} (nvidia-smi lists "
            + (f"GPUs {','.join(map(str, listed))})" if listed else "none)")
        )
