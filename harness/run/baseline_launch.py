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
* the variables it inherits that pick kernels, threads or precision (`numerics_env`, whose rule
  lives in `harness.spec.inherited_env`, shared with each instance's recorded command), e.g.
  VLLM_ATTENTION_BACKEND, VLLM_CPU_*, ONEDNN_*, CUBLAS_WORKSPACE_CONFIG, ATEN_CPU_CAPABILITY,
  FBGEMM_ENABLE_INSTRUCTIONS. A baseline started on a Ray node inherits the node's (its
  raylet's, with OMP_NUM_THREADS=1 where Ray sets it), not this process's: what it computed is
  stored under those (`inherited`, from its agent's report), and looked up by those an agent
  placed on a node reports before any start (`harness.run.baseline`);
* the platform and the device model (the CPU's model and the features vLLM-CPU's kernels are
  picked by; the GPUs' model), for a cache directory shared between hosts. On a Ray cluster
  (`--ray-address`) the baseline runs on one of its nodes, whose device this host cannot read:
  the cluster's address stands in for it (the one-host rehearsal's nodes are this host).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass

from harness import devices
from harness.spec.inherited_env import numerics_env
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


@dataclass(frozen=True)
class BaselineLaunch:
    """The baseline's launch, as the cache key sees it (the module docstring says what and
    why). `device` is e.g. "cpu: AMD EPYC 7B13 (avx2)" or "cuda: NVIDIA H100 80GB HBM3"."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    device: str

    @classmethod
    def of(
        cls,
        settings: RunSettings,
        environ: Mapping[str, str] | None = None,
        *,
        inherited: Mapping[str, str] | None = None,
    ) -> BaselineLaunch:
        """The baseline of `settings`, launched from `environ` (default: this process's).
        `inherited`: what the baseline did inherit where it ran (its Reservation's, recorded
        in its `.cmd.json`) in place of `environ`'s: on a Ray node, the node's variables."""
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
            # No device index is part of the key (CPU cores are the affinity, a device
            # variable is rendered as a placeholder below), so a run that places nothing on
            # this host (attached, with --golden: no device) keys the goldens on a stand-in
            # one (found on real vLLM: "baseline: no cores to place it on").
            settings.devices or (0,),
            generation=settings.protocol,
        )
        rendered = spec.env()
        if settings.platform.device_env_var is not None:
            rendered[settings.platform.device_env_var] = PLACEHOLDER_DEVICE
        inherited = {
            **numerics_env(environ if inherited is None else inherited),
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
