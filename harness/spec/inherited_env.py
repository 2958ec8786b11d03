"""Which variables an instance inherits from the harness's environment can change what it
computes: one rule, for the baseline cache's key (`harness.run.baseline_launch`) and for each
instance's recorded command (`.cmd.json`'s `inherited_env`, `harness.serve.entry.command_json`)
that `export` sets again in serve.sh.

Every instance runs with the environment of the process that starts it plus what the spec
renders (`harness.serve.launch`: `{**os.environ, **command.env}`). A variable counts when its
name starts with one of `NUMERICS_ENV_PREFIXES` (or is one of `NUMERICS_ENV_NAMES`), unless one
of the words of its name (split on '_') is in `NEUTRAL_ENV_WORDS` (where, who, how loudly, how
long: ports, hosts, paths, caches, logging, usage statistics, timeouts, credentials) or it is
one of `NEUTRAL_ENV_NAMES`. Those differ from run to run for no numeric reason; keyed, the cache
would never hit. A variable outside the prefixes does not count: it is not read by what
computes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

# Read by vLLM, torch and the libraries beneath them that compute: kernel and backend choice,
# threads and their binding, precision, determinism, allocator (vLLM-CPU preloads tcmalloc and
# Intel's OpenMP through LD_PRELOAD).
NUMERICS_ENV_PREFIXES = (
    "VLLM_",
    "TORCH",
    "PYTORCH_",
    "CUDA_",
    "CUBLAS",
    "CUDNN_",
    "NCCL_",
    "NVIDIA_TF32",
    "TRITON_",
    "FLASHINFER_",
    "XFORMERS_",
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "ONEDNN_",
    "DNNL_",
    "FBGEMM_",  # FBGEMM_ENABLE_INSTRUCTIONS: torch's int8 / fp16-weight GEMMs of another ISA
    "OPENBLAS_",
    "ZE_",
    "SYCL_",
    "IPEX_",
    "HIP_",
    "ROCBLAS_",
    "HIPBLASLT_",
    "MIOPEN_",
)
# ATEN_CPU_CAPABILITY: torch runs the kernels of the named ISA (default, avx2, avx512) instead of
# the CPU's best, and they round differently; /proc/cpuinfo (the key's device) cannot show it.
NUMERICS_ENV_NAMES = ("LD_PRELOAD", "ATEN_CPU_CAPABILITY")
# A word of a name that says it is about places, peers, reporting or secrets, not computing.
NEUTRAL_ENV_WORDS = frozenset(
    {
        "PORT",
        "PORTS",
        "HOST",
        "IP",
        "ADDR",
        "ADDRESS",
        "PATH",
        "DIR",
        "ROOT",
        "HOME",
        "CACHE",
        "LOG",
        "LOGS",
        "LOGGING",
        "VERBOSE",
        "DEBUG",
        "TRACE",
        "DISPLAY",
        "WARNINGS",
        "STACKTRACES",
        "PROFILER",
        "USAGE",
        "STATS",
        "TRACK",
        "TIMEOUT",
        "INTERVAL",
        "KEY",
        "TOKEN",
        "SECRET",
        "PASSWORD",
        "PID",
    }
)
NEUTRAL_ENV_NAMES = frozenset(
    {
        "VLLM_SERVER_DEV_MODE",  # debugging endpoints
        "VLLM_RPC_BASE_PATH",
        "VLLM_WORKER_MULTIPROC_METHOD",  # fork or spawn: how processes start, not what they compute
        "CUDA_VISIBLE_DEVICES",  # which device: the harness renders it; the model is keyed
        "ZE_AFFINITY_MASK",
    }
)


def numerics_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of `environ` that can change what an instance computes (module rule)."""
    return {
        name: value
        for name, value in environ.items()
        if (name.startswith(NUMERICS_ENV_PREFIXES) or name in NUMERICS_ENV_NAMES)
        and name not in NEUTRAL_ENV_NAMES
        and NEUTRAL_ENV_WORDS.isdisjoint(re.split(r"_+", name.upper()))
    }
