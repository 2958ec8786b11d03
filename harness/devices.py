"""What devices this host has, read once for everything that records or keys them.

Two readers need the same facts and must not disagree: the baseline cache key
(`harness.run.baseline_launch.device_model`: a cache directory shared between hosts must not
hand one GPU model's answers to another) and run.json's `devices_used` (`run_devices`: a
reader of a red night's bundle, or of an export's ISSUE.md, must see which GPU model, driver
and CUDA computed the ids, since another GPU can give other ids by itself). Both read here.

Where the facts come from: on CPU `/proc/cpuinfo` (the first processor's model name and the
features vLLM-CPU's kernels are picked by, `amx_tile` among them: an AMX host takes another
attention kernel); on cuda the driver's `/proc/driver/nvidia` files, else `nvidia-smi`; on xpu
each display device's PCI ids in sysfs. What cannot be read is None, never guessed. The
preflight's dtype checks read here too: each GPU's compute capability (bfloat16 needs 8.0) and
the CPU vendor and features vLLM picks its CPU platform by. bfloat16's refusal on a GPU below
8.0 is worded here too (`bf16_refusal`), below every stage, because two stages refuse it: the
preflight on this host's GPUs, and the Ray launcher (`harness.serve`, which may not import the
preflight) on each node's, before an instance starts there.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CPUINFO = Path("/proc/cpuinfo")
# CPU features that pick vLLM-CPU's kernels, so two runs on "the same kind" of machine can be
# told apart: on AMX hosts the attention kernel takes its AMX path, whose first use in a process
# dies with SIGILL unless something already asked the kernel for AMX tile permission
# (docs/connectors.md, NIXL on an AMX host).
CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")
AMX_FLAG = "amx_tile"
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")
NVIDIA_VERSION = Path("/proc/driver/nvidia/version")
DRM_CARDS = Path("/sys/class/drm")
DEVICE_PROBE_TIMEOUT_S = 10.0
NVIDIA_SMI = "nvidia-smi"
# `NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 ...`
KERNEL_MODULE_VERSION = re.compile(r"Kernel Module\s+(?P<version>[0-9][0-9.]*)")
# nvidia-smi's header: `| NVIDIA-SMI 550.54.15   Driver Version: 550.54.15   CUDA Version: 12.4 |`
CUDA_VERSION = re.compile(r"CUDA Version:\s*(?P<version>[0-9][0-9.]*)")


def cpu_description(cpuinfo: str) -> dict[str, Any]:
    """The first processor's model name and which of CPU_FEATURES it has, from /proc/cpuinfo."""
    model, flags = None, set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return {"model": model, "features": [f for f in CPU_FEATURES if f in flags]}


def host_cpuinfo() -> str:
    """This host's /proc/cpuinfo ("" where there is none: not Linux)."""
    try:
        return CPUINFO.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def host_cpu() -> dict[str, Any] | None:
    """`cpu_description` of this host; None where there is no /proc/cpuinfo (not Linux)."""
    try:
        return cpu_description(CPUINFO.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return None


@dataclass(frozen=True)
class Gpu:
    """One NVIDIA GPU as nvidia-smi lists it (index None: read from the driver's files, which
    do not say which index it has)."""

    index: int | None
    model: str
    driver: str | None = None


def run_nvidia_smi(*args: str) -> str | None:
    """nvidia-smi's output, or None where it is absent, fails or hangs."""
    if shutil.which(NVIDIA_SMI) is None:
        return None
    try:
        done = subprocess.run(
            [NVIDIA_SMI, *args],
            capture_output=True,
            text=True,
            timeout=DEVICE_PROBE_TIMEOUT_S,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def proc_nvidia_models() -> list[str]:
    """Every NVIDIA GPU's model as the driver's /proc files name them ([] without them)."""
    models = []
    for information in sorted(NVIDIA_GPUS.glob("*/information")):
        for line in information.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model":
                models.append(value.strip())
    return models


def smi_gpus() -> list[Gpu]:
    """Every GPU nvidia-smi lists, with its index, model and driver version."""
    listed = run_nvidia_smi("--query-gpu=index,name,driver_version", "--format=csv,noheader")
    gpus = []
    for line in (listed or "").splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) == 3 and fields[0].isdigit() and fields[1]:
            gpus.append(Gpu(int(fields[0]), fields[1], fields[2] or None))
    return gpus


def smi_gpu_indices() -> tuple[int, ...] | None:
    """The index of every GPU nvidia-smi lists (the numbering --devices uses; nvidia-smi
    ignores CUDA_VISIBLE_DEVICES); None where nvidia-smi cannot say, so that "cannot tell" is
    never read as "no GPU"."""
    listed = run_nvidia_smi("--query-gpu=index", "--format=csv,noheader")
    if listed is None:
        return None
    return tuple(int(line.strip()) for line in listed.splitlines() if line.strip().isdigit())


@dataclass(frozen=True)
class GpuCapability:
    """One NVIDIA GPU's CUDA compute capability, as nvidia-smi lists it: what decides whether
    it computes in bfloat16 (8.0 and up; a T4 is 7.5, a V100 7.0)."""

    index: int  # the index nvidia-smi lists, the numbering --devices uses
    model: str
    capability: tuple[int, int]  # (major, minor)

    @property
    def dotted(self) -> str:
        return f"{self.capability[0]}.{self.capability[1]}"


def smi_compute_capabilities() -> list[GpuCapability] | None:
    """Every GPU nvidia-smi lists with its compute capability; None where nvidia-smi cannot
    say (absent, failing, or a driver too old for the `compute_cap` field), so that "cannot
    tell" is never read as "capable"."""
    listed = run_nvidia_smi("--query-gpu=index,name,compute_cap", "--format=csv,noheader")
    if listed is None:
        return None
    gpus = []
    for line in listed.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 3 or not fields[0].isdigit():
            continue
        major, dot, minor = fields[2].partition(".")
        if not (major.isdigit() and dot and minor.isdigit()):
            continue
        gpus.append(GpuCapability(int(fields[0]), fields[1], (int(major), int(minor))))
    return gpus


BF16_MIN_CAPABILITY = (8, 0)
# `run`'s words for what was asked and what to do; repro and the Ray launcher pass their own.
# Named as asked, true whether or not --dtype was given: "(the default)" is said only by a
# caller that knows none was (`harness.preflight.dtype.asked_bf16`).
PASS_FLOAT16 = "pass --dtype float16"
ASKED_BF16 = "--dtype bfloat16"


def bf16_shortfall(
    dtype: str, used: Sequence[GpuCapability], asked: str = ASKED_BF16
) -> str | None:
    """What `bf16_refusal` says but its remedy (doctor gives the remedy a line of its own,
    its hint), or None."""
    if dtype != "bfloat16":
        return None
    short = [gpu for gpu in used if gpu.capability < BF16_MIN_CAPABILITY]
    if not short:
        return None
    named = ", ".join(
        f"GPU {gpu.index} ({gpu.model}, compute capability {gpu.dotted})" for gpu in short
    )
    return (
        f"{asked} needs compute capability "
        f"{BF16_MIN_CAPABILITY[0]}.{BF16_MIN_CAPABILITY[1]} or more, which vLLM checks only "
        f"once an instance has started, and {named} {'has' if len(short) == 1 else 'have'} "
        "less"
    )


def bf16_refusal(
    dtype: str,
    used: Sequence[GpuCapability],
    remedy: str = PASS_FLOAT16,
    asked: str = ASKED_BF16,
) -> str | None:
    """Why `dtype` cannot run on the GPUs `used` (bfloat16 below compute capability 8.0), or
    None. GPUs nvidia-smi could not describe are not judged: vLLM still refuses them."""
    shortfall = bf16_shortfall(dtype, used, asked)
    return None if shortfall is None else f"{shortfall}: {remedy}"


@dataclass(frozen=True)
class GpuProcess:
    """A process holding GPU memory, as nvidia-smi's compute-apps list shows it."""

    pid: int
    name: str
    gpu: int  # the index nvidia-smi lists, the numbering --devices uses
    used_mib: int | None

    def describe(self) -> str:
        used = f", {self.used_mib} MiB" if self.used_mib is not None else ""
        return f"pid {self.pid} ({self.name}) on GPU {self.gpu}{used}"


def smi_compute_processes() -> list[GpuProcess] | None:
    """Every process holding memory on a GPU nvidia-smi lists, by the GPU's index (the
    compute-apps list names GPUs by UUID only); None where nvidia-smi cannot say, so that
    "cannot tell" is never read as "none left"."""
    gpus = run_nvidia_smi("--query-gpu=index,uuid", "--format=csv,noheader")
    apps = run_nvidia_smi(
        "--query-compute-apps=pid,process_name,gpu_uuid,used_memory", "--format=csv,noheader"
    )
    if gpus is None or apps is None:
        return None
    index_of = {}
    for line in gpus.splitlines():
        index, _, uuid = (field.strip() for field in line.partition(","))
        if index.isdigit() and uuid:
            index_of[uuid] = int(index)
    processes = []
    for line in apps.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 4 or not fields[0].isdigit() or fields[2] not in index_of:
            continue
        used = fields[3].removesuffix("MiB").strip()
        processes.append(
            GpuProcess(
                pid=int(fields[0]),
                name=fields[1],
                gpu=index_of[fields[2]],
                used_mib=int(used) if used.isdigit() else None,
            )
        )
    return processes


def nvidia_models() -> list[str]:
    """Every NVIDIA GPU model on this host: the driver's /proc files, else nvidia-smi."""
    models = proc_nvidia_models()
    if models:
        return sorted(set(models))
    return sorted({gpu.model for gpu in smi_gpus()})


def drm_devices() -> list[str]:
    """Every display device's PCI vendor:device id (an XPU's model), from sysfs."""
    found = set()
    for card in DRM_CARDS.glob("card[0-9]*/device"):
        try:
            vendor = (card / "vendor").read_text().strip()
            device = (card / "device").read_text().strip()
        except OSError:
            continue
        found.add(f"{vendor}:{device}")
    return sorted(found)


def device_model(platform: str, pins_devices: bool) -> str:
    """The platform and this host's device model, as the baseline cache key holds it:
    "cpu: AMD EPYC 7B13 (avx2)", "cuda: NVIDIA H100 80GB HBM3"; "<platform>: unknown" where it
    cannot be read. `pins_devices`: the platform pins instances to devices (not CPU)."""
    if not pins_devices:
        cpu = host_cpu()
        if cpu is None:
            return f"{platform}: unknown"
        features = ", ".join(cpu["features"]) or "none of the kernel features"
        return f"{platform}: {cpu['model'] or 'unknown'} ({features})"
    models = nvidia_models() if platform == "cuda" else drm_devices()
    return f"{platform}: {'; '.join(models) if models else 'unknown'}"


@dataclass(frozen=True)
class DevicesUsed:
    """The devices a run used, as run.json records them (`devices_used`): the model (several
    joined by '; ' when they differ), how many, which, and what the platform tells of its
    driver and CUDA (GPUs) or of AMX (CPUs). None where the host does not say."""

    platform: str
    model: str | None
    count: int
    indices: tuple[int, ...]
    source: str  # where it was read: "nvidia-smi", "/proc/driver/nvidia", "/proc/cpuinfo", ...
    driver: str | None = None
    cuda: str | None = None
    amx: bool | None = None
    features: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "platform": self.platform,
            "model": self.model,
            "count": self.count,
            "indices": list(self.indices),
            "source": self.source,
            "driver": self.driver,
            "cuda": self.cuda,
            "amx": self.amx,
            "features": list(self.features),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DevicesUsed:
        return cls(
            platform=str(data.get("platform", "?")),
            model=data.get("model"),
            count=int(data.get("count") or 0),
            indices=tuple(data.get("indices") or ()),
            source=str(data.get("source", "?")),
            driver=data.get("driver"),
            cuda=data.get("cuda"),
            amx=data.get("amx"),
            features=tuple(data.get("features") or ()),
        )

    def describe(self) -> str:
        """One line: "cuda: 2 x NVIDIA H100 80GB HBM3 (GPUs 4,5; driver 550.54.15, CUDA
        12.4)", "cpu: AMD EPYC 7B13, 2 cores (0,1), no AMX"."""
        which = ",".join(str(i) for i in self.indices) or "?"
        if self.source.startswith(NOT_READ):
            return f"{self.platform}: {self.count} x ? ({which}; {self.source})"
        if self.platform == "cpu":
            amx = {True: "AMX", False: "no AMX", None: "AMX unknown"}[self.amx]
            cores = "core" if self.count == 1 else "cores"
            model = self.model or "CPU model unknown"
            return f"cpu: {model}, {self.count} {cores} ({which}), {amx}"
        kind = "GPU" if self.platform == "cuda" else "device"
        model = self.model or f"{kind} model unknown"
        versions = [f"driver {self.driver}"] if self.driver else []
        versions += [f"CUDA {self.cuda}"] if self.cuda else []
        detail = f"{kind}s {which}" + (f"; {', '.join(versions)}" if versions else "")
        return f"{self.platform}: {self.count} x {model} ({detail})"


def describe_devices(recorded: Mapping[str, Any] | None) -> str | None:
    """`DevicesUsed.describe` of run.json's `devices_used`; None for a run that did not record
    it (bundles written before it was)."""
    if not isinstance(recorded, Mapping):
        return None
    return DevicesUsed.from_json(recorded).describe()


NOT_READ = "not read here: "  # a `source` saying the devices are on another host


def run_devices(
    platform: str, pins_devices: bool, indices: Sequence[int], elsewhere: str | None = None
) -> DevicesUsed:
    """The devices a run on `platform` uses (`indices`: its --devices; CPU cores on CPU).
    `elsewhere`: where the instances ran when not on this host (a Ray cluster's nodes); then
    nothing is read, since this host's CPU or GPUs computed none of the ids."""
    indices = tuple(indices)
    if not indices:  # attached with --golden: no device of this host computed anything
        return DevicesUsed(platform, None, 0, (), f"{NOT_READ}nothing of the run ran on this host")
    if elsewhere is not None:
        return DevicesUsed(platform, None, len(indices), indices, f"{NOT_READ}{elsewhere}")
    if not pins_devices:
        cpu = host_cpu()
        if cpu is None:
            return DevicesUsed(platform, None, len(indices), indices, f"none (no {CPUINFO})")
        features = tuple(cpu["features"])
        return DevicesUsed(
            platform,
            cpu["model"],
            len(indices),
            indices,
            str(CPUINFO),
            amx=AMX_FLAG in features,
            features=features,
        )
    if platform == "cuda":
        return _cuda_devices(indices)
    models = drm_devices()
    return DevicesUsed(
        platform, "; ".join(models) or None, len(indices), indices, f"{DRM_CARDS} (PCI ids)"
    )


def _cuda_devices(indices: tuple[int, ...]) -> DevicesUsed:
    """nvidia-smi's listing of the GPUs at `indices` (its index is what --devices names), and
    its CUDA version; else the driver's /proc files, which name every GPU's model without
    its index."""
    listed = smi_gpus()
    used = [gpu for gpu in listed if gpu.index in indices]
    if used:
        header = run_nvidia_smi() or ""
        cuda = CUDA_VERSION.search(header)
        drivers = sorted({gpu.driver for gpu in used if gpu.driver})
        return DevicesUsed(
            "cuda",
            "; ".join(sorted({gpu.model for gpu in used})),
            len(indices),
            indices,
            NVIDIA_SMI,
            driver="; ".join(drivers) or None,
            cuda=cuda["version"] if cuda else None,
        )
    models = proc_nvidia_models()
    driver = None
    try:
        found = KERNEL_MODULE_VERSION.search(NVIDIA_VERSION.read_text(errors="replace"))
        driver = found["version"] if found else None
    except OSError:
        pass
    source = str(NVIDIA_GPUS.parent) if models else "none (no nvidia-smi, no driver files)"
    return DevicesUsed(
        "cuda",
        "; ".join(sorted(set(models))) or None,
        len(indices),
        indices,
        source,
        driver=driver,
    )
