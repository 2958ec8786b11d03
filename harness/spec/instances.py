"""One vLLM server, fully determined, and the one place that renders it into argv and env.

An `InstanceSpec` knows its role, port, the shared `ServingConfig`, its storage, its platform
and device(s); `argv()` and `env()` render exactly what the launcher runs (an argv list, never
a shell string) and what `epd-harness plan` prints. Flags that vary by platform (GPU memory
share, NIXL side channel, device pin) are rendered here too, so no other module splices flags
into a command line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from harness.environment import LOOPBACK_HOST
from harness.spec.connectors import kv_connector_for_class
from harness.spec.generations import NEWEST, ProtocolGeneration
from harness.spec.platforms import (
    CPU,
    EC_SIDE_CHANNEL_HOST_ENV,
    GPU_MEMORY_UTILIZATION_FLAG,
    IN_ENGINE_WORKER_ARGS,
    IN_ENGINE_WORKER_ENV,
    NIXL_CONNECTOR,
    SIDE_CHANNEL_HOST_ENV,
    SIDE_CHANNEL_PORT_ENV,
    PlatformProfile,
)
from harness.spec.topology import Role, ServingConfig

# Upstream's encoder flags: no prefix caching, and a token budget large enough to admit a whole
# video (the budget bounds the encoder cache).
ENCODER_ARGS = ("--no-enable-prefix-caching", "--max-num-batched-tokens", "114688")
# Upstream starts every disaggregated instance (not the baseline) with it: answers carry the
# X-Request-Id they were sent, which ties a proxy's sub-requests together in the instances' logs.
REQUEST_ID_HEADERS_FLAG = "--enable-request-id-headers"
# What an instance renders where a value differs from run to run but not in what it computes:
# for a command line judged once for every run (harness.preflight.vllm_args) and for the
# baseline cache key (harness.run.baseline_launch).
PLACEHOLDER_MODEL = "MODEL"
PLACEHOLDER_MEDIA = "/MEDIA"
PLACEHOLDER_RUN_DIR = Path("/RUN")
PLACEHOLDER_PORT = 20000
PLACEHOLDER_DEVICE = "DEVICE"


@dataclass(frozen=True)
class InstanceSpec:
    """One vLLM server of a topology: render it, launch it, log it."""

    name: str  # unique within a run, e.g. "1E+1P+1D/encoder0"; names log files
    role: Role
    port: int
    serving: ServingConfig
    ec_storage: Path | None = None  # shared EC directory of the topology (E writes, PD/P read)
    kv_storage: Path | None = None  # shared KV directory of the topology (P writes, D reads)
    platform: PlatformProfile = CPU
    # CPU: the cores its processes may run on; GPU / XPU: the device indices it sees.
    devices: tuple[int, ...] = ()
    # --gpu-memory-utilization: the full budget alone, a slice of it when colocated; None on CPU.
    gpu_memory_fraction: float | None = None
    # VLLM_NIXL_SIDE_CHANNEL_PORT, only for instances running NixlConnector; unique per host.
    side_channel_port: int | None = None
    # What the served release understands: flags it lacks are never rendered.
    generation: ProtocolGeneration = NEWEST
    # The address it binds and every peer reaches it at: loopback when the harness launches it
    # on this host; its node's address when a Ray launcher placed it on a node of a cluster.
    host: str = LOOPBACK_HOST

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def uses_nixl(self) -> bool:
        """True when this instance runs NixlConnector, and so needs a side-channel port."""
        has_kv = self.role.is_kv_producer or self.role.is_kv_consumer
        return has_kv and self.serving.kv_connector == NIXL_CONNECTOR

    def argv(self, vllm_executable: str = "vllm") -> list[str]:
        """The `vllm serve` command line. The user's extra_args come last, so that a flag given
        there still wins (argparse keeps the last)."""
        s = self.serving
        argv = [
            vllm_executable,
            "serve",
            s.model,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--served-model-name",
            s.served_model_name,
            "--max-model-len",
            str(s.max_model_len),
            "--max-num-seqs",
            str(s.max_num_seqs),
            "--dtype",
            s.dtype,
            "--block-size",
            str(s.block_size),
            "--max-logprobs",
            str(s.max_logprobs),
        ]
        if s.enforce_eager:
            argv.append("--enforce-eager")
        if self.platform.worker_in_engine_core:
            argv += IN_ENGINE_WORKER_ARGS
        if s.allowed_local_media_path:
            argv += ["--allowed-local-media-path", s.allowed_local_media_path]
        if s.enable_prompt_tokens_details:
            argv.append("--enable-prompt-tokens-details")
        if self.role is not Role.BASELINE:
            argv.append(REQUEST_ID_HEADERS_FLAG)
        if s.trust_request_mm_kwargs and self.generation.has_trust_request_mm_kwargs_flag:
            argv.append("--trust-request-mm-kwargs")
        if (
            self.role.accepts_metadata_only_embeds
            and self.generation.consumers_need_enable_mm_embeds
        ):
            argv.append("--enable-mm-embeds")
        if self.role is Role.ENCODER:
            argv += ENCODER_ARGS
        ec_config = self.ec_transfer_config()
        if ec_config is not None:
            argv += ["--ec-transfer-config", json.dumps(ec_config, sort_keys=True)]
        kv_config = self.kv_transfer_config()
        if kv_config is not None:
            argv += ["--kv-transfer-config", json.dumps(kv_config, sort_keys=True)]
        if self.gpu_memory_fraction is not None:
            argv += [GPU_MEMORY_UTILIZATION_FLAG, f"{self.gpu_memory_fraction:g}"]
        return argv + list(s.extra_args)

    def ec_transfer_config(self) -> dict | None:
        if not (self.role.is_ec_producer or self.role.is_ec_consumer):
            return None
        if self.ec_storage is None:
            if self.role is Role.PREFILL:
                return None  # a P without encoders (1P+1D) is a plain KV producer
            raise ValueError(f"{self.name}: role {self.role.value} needs an EC storage directory")
        return {
            "ec_connector": self.serving.ec_connector,
            "ec_role": "ec_producer" if self.role.is_ec_producer else "ec_consumer",
            "ec_connector_extra_config": {"shared_storage_path": str(self.ec_storage)},
        }

    def kv_transfer_config(self) -> dict | None:
        if not (self.role.is_kv_producer or self.role.is_kv_consumer):
            return None
        config: dict = {
            "kv_connector": self.serving.kv_connector,
            "kv_role": "kv_producer" if self.role.is_kv_producer else "kv_consumer",
        }
        if self.serving.kv_connector == "ExampleConnector":
            if self.kv_storage is None:
                raise ValueError(f"{self.name}: ExampleConnector needs a KV storage directory")
            config["kv_connector_extra_config"] = {"shared_storage_path": str(self.kv_storage)}
        if self.serving.kv_connector == NIXL_CONNECTOR:
            config["kv_buffer_device"] = self.platform.nixl_kv_buffer_device
        known = kv_connector_for_class(self.serving.kv_connector)
        if known is not None and known.cpu_extra_config and self.platform.device_env_var is None:
            extra = config.setdefault("kv_connector_extra_config", {})
            extra.update(known.cpu_extra_config)
        return config

    def shared_storage(self) -> dict[str, Path]:
        """The directories its connectors share with other instances ("EC storage", "KV
        storage"), as its transfer configs name them: only the example connectors have one."""
        found: dict[str, Path] = {}
        for label, config, extra in (
            ("EC storage", self.ec_transfer_config(), "ec_connector_extra_config"),
            ("KV storage", self.kv_transfer_config(), "kv_connector_extra_config"),
        ):
            path = ((config or {}).get(extra) or {}).get("shared_storage_path")
            if path:
                found[label] = Path(path)
        return found

    def env(self) -> dict[str, str]:
        """Environment additions for this instance (merged over the harness's environment)."""
        s = self.serving
        env = {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        if not self.devices:
            raise ValueError(f"{self.name}: {self.platform.name} needs a device")
        if self.platform.device_env_var is None:
            env.update(
                {
                    "VLLM_CPU_KVCACHE_SPACE": str(s.cpu_kvcache_space_gib),
                    "OMP_NUM_THREADS": str(s.cpu_threads_per_instance),
                }
            )
        else:
            env[self.platform.device_env_var] = ",".join(str(d) for d in self.devices)
            env.update(self.platform.device_order_env)
        if self.uses_nixl:
            if self.side_channel_port is None:
                raise ValueError(f"{self.name}: {NIXL_CONNECTOR} needs a {SIDE_CHANNEL_PORT_ENV}")
            env[SIDE_CHANNEL_PORT_ENV] = str(self.side_channel_port)
            # Pinned to the host the port was reserved on: "localhost" may resolve elsewhere,
            # and on another machine it is another machine (harness.spec.network).
            env[SIDE_CHANNEL_HOST_ENV] = self.host
        if self.ec_transfer_config() is not None:
            env[EC_SIDE_CHANNEL_HOST_ENV] = self.host
        if self.platform.worker_in_engine_core:
            env.update(IN_ENGINE_WORKER_ENV)
        return env

    @property
    def cpu_affinity(self) -> tuple[int, ...]:
        """The cores the launcher confines all of the instance's processes to (CPU), or ()
        where a device variable places it instead (GPU / XPU)."""
        return () if self.platform.device_env_var is not None else self.devices
