"""What the baseline is launched with, as far as it can change its answers: part of the
baseline cache key (`harness.run.baseline_cache.baseline_key`).

Every instance, the baseline included, runs with the harness's environment plus what the spec
renders (`harness.serve.launch`: `{**os.environ, **command.env}`), on whatever device the host
has. So besides the served build and the serving flags, a baseline's answers follow:

* its rendered command line and environment additions, with the protocol generation the run
  speaks (`--protocol` decides, e.g., whether `--trust-request-mm-kwargs` is rendered).
  Ports, paths, the model's location and the device index are placeholders, and the fields the
  cache declares numerics-neutral (`NUMERICS_NEUTRAL_FIELDS`) are rendered at their defaults,
  so a line depends only on what changes numerics. Rendered for the baseline alone on its
  device: the GPU memory share of a colocated run sizes the KV pool, not a kernel;
* the variables it inherits that pick kernels, threads or precision (`numerics_env`, the rule
  below), e.g. VLLM_ATTENTION_BACKEND, VLLM_CPU_*, ONEDNN_*, CUBLAS_WORKSPACE_CONFIG,
  ATEN_CPU_CAPABILITY, FBGEMM_ENABLE_INSTRUCTIONS;
* the platform and the device model (the CPU's model and the features vLLM-CPU's kernels are
  picked by; the GPUs' model), for a cache directory shared between hosts. On a Ray cluster
  (`--ray-address`) the baseline runs on one of its nodes, whose device this host cannot read:
  the cluster's address stands in for it (the one-host rehearsal's nodes are this host).

The inherited rule: a variable counts when its name starts with one of
`NUMERICS_ENV_PREFIXES` (or is one of `NUMERICS_ENV_NAMES`), unless one of the words of its
name (split on '_') is in `NEUTRAL_ENV_WORDS` (where, who, how loudly, how long: ports, hosts,
paths, caches, logging, usage statistics, timeouts, credentials) or it is one of
`NEUTRAL_ENV_NAMES`. Those differ from run to run for no numeric reason; keyed, the cache would
never hit. A variable outside the prefixes does not count: it is not read by what computes.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from harness import devices
from harness.spec.instances import (
    PLACEHOLDER_DEVICE,
    PLACEHOLDER_MODEL,
    PLACEHOLDER_PORT,
    PLACEHOLDER_RUN_DIR,
)
from harness.spec.placement import place_instances
from harness.spec.platforms import PlatformProfile
from harness.spec.settings import RunSettings
from harness.spec.topology import TOPOLOGIES, ServingConfig

# Flags that cannot change a baseline's tokens (where files are, what is reported; and the KV
# connector, which the monolithic baseline does not run: its argv and env are rendered without
# one, so a baseline computed for an ExampleConnector run serves a NixlConnector run as well).
NUMERICS_NEUTRAL_FIELDS = (
    "allowed_local_media_path",
    "enable_prompt_tokens_details",
    "kv_connector",
)

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


@dataclass(frozen=True)
class BaselineLaunch:
    """The baseline's launch, as the cache key sees it (the module docstring says what and
    why). `device` is e.g. "cpu: AMD EPYC 7B13 (avx2)" or "cuda: NVIDIA H100 80GB HBM3"."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    device: str

    @classmethod
    def of(cls, settings: RunSettings, environ: Mapping[str, str] | None = None) -> BaselineLaunch:
        """The baseline of `settings`, launched from `environ` (default: this process's)."""
        environ = os.environ if environ is None else environ
        neutral = {
            field.name: field.default
            for field in dataclasses.fields(ServingConfig)
            if field.name in NUMERICS_NEUTRAL_FIELDS
        }
        serving = dataclasses.replace(settings.serving, model=PLACEHOLDER_MODEL, **neutral)
        (spec,) = place_instances(
            TOPOLOGIES["baseline"],
            serving,
            settings.platform,
            [PLACEHOLDER_PORT],
            PLACEHOLDER_RUN_DIR / "baseline",
            settings.devices,
            generation=settings.protocol,
        )
        rendered = spec.env()
        if settings.platform.device_env_var is not None:
            rendered[settings.platform.device_env_var] = PLACEHOLDER_DEVICE
        inherited = {
            **numerics_env(environ),
            **numerics_env(dict(settings.launcher.instance_env)),
        }
        env = {**inherited, **rendered}
        launcher = settings.launcher
        on_a_cluster = not launcher.is_local and not launcher.rehearses_on_this_host
        return cls(
            argv=tuple(spec.argv("vllm")[1:]),
            env=tuple(sorted(env.items())),
            device=(
                f"{settings.platform.name}: a node of the Ray cluster at {launcher.ray_address}"
                if on_a_cluster
                else device_model(settings.platform)
            ),
        )

    def to_json(self) -> dict[str, object]:
        return {"argv": list(self.argv), "env": dict(self.env), "device": self.device}


@functools.cache
def device_model(platform: PlatformProfile) -> str:
    """The platform and this host's device model (`harness.devices.device_model`, the one
    reader run.json's `devices_used` shares); "<platform>: unknown" where it cannot be read
    (two hosts that both cannot then share entries, as before this was keyed)."""
    return devices.device_model(platform.name, platform.device_env_var is not None)
