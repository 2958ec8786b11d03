"""Topologies and roles: the one place that decides how every vLLM instance is launched.

A comparison is only meaningful when the baseline and every EPD instance share the flags that
change numerics (model, dtype, max length, block size, eager mode, thread count). Those live in
one `ServingConfig`; a role adds only its transfer configuration on top. Nothing here starts a
process: `InstanceSpec.argv()` / `.env()` render what `launch` runs.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from pathlib import Path

LOOPBACK_HOST = "127.0.0.1"


class Role(str, enum.Enum):
    """What one vLLM instance does in a topology."""

    BASELINE = "baseline"  # monolithic: encodes, prefills and decodes itself; the reference
    ENCODER = "encoder"  # EC producer: runs only the vision encoder, writes embeddings
    PREFILL_DECODE = "pd"  # EC consumer: loads embeddings, prefills and decodes
    PREFILL = "prefill"  # EC consumer + KV producer: loads embeddings, prefills, writes KV
    DECODE = "decode"  # KV consumer: loads prompt KV, decodes

    @property
    def is_ec_producer(self) -> bool:
        return self is Role.ENCODER

    @property
    def is_ec_consumer(self) -> bool:
        return self in (Role.PREFILL_DECODE, Role.PREFILL)

    @property
    def is_kv_producer(self) -> bool:
        return self is Role.PREFILL

    @property
    def is_kv_consumer(self) -> bool:
        return self is Role.DECODE

    @property
    def accepts_metadata_only_embeds(self) -> bool:
        """vLLM derives allow_missing_mm_embeddings = EC consumer or KV consumer."""
        return self.is_ec_consumer or self.is_kv_consumer


@dataclass(frozen=True)
class Topology:
    """A named arrangement of roles; the proxy routes a request through them in order."""

    name: str
    roles: tuple[Role, ...]
    # The topology whose outputs this one must equal exactly (besides the monolithic baseline);
    # upstream compares 1E+1P+1D with 1P+1D because P/D disaggregation itself may drift on GPUs.
    exact_reference: str | None = None

    @property
    def encoders(self) -> int:
        return self.roles.count(Role.ENCODER)

    @property
    def is_baseline(self) -> bool:
        return self.roles == (Role.BASELINE,)

    @property
    def has_kv_transfer(self) -> bool:
        return Role.DECODE in self.roles

    @property
    def has_ec_transfer(self) -> bool:
        return Role.ENCODER in self.roles


TOPOLOGIES: dict[str, Topology] = {
    t.name: t
    for t in (
        Topology("baseline", (Role.BASELINE,)),
        Topology("1E+1PD", (Role.ENCODER, Role.PREFILL_DECODE)),
        Topology("1P+1D", (Role.PREFILL, Role.DECODE)),
        Topology("1E+1P+1D", (Role.ENCODER, Role.PREFILL, Role.DECODE), exact_reference="1P+1D"),
        Topology("2E+1PD", (Role.ENCODER, Role.ENCODER, Role.PREFILL_DECODE)),
    )
}
EPD_TOPOLOGY_NAMES = ("1E+1PD", "1P+1D", "1E+1P+1D")


def get_topology(name: str) -> Topology:
    """Look a topology up by name, or fail with the list of known names."""
    try:
        return TOPOLOGIES[name]
    except KeyError:
        known = ", ".join(TOPOLOGIES)
        raise ValueError(f"unknown topology {name!r} (known: {known})") from None


@dataclass(frozen=True)
class ServingConfig:
    """Flags every instance of one comparison shares (the numerics-relevant ones above all)."""

    model: str  # a local model directory (CPU) or a model name the GPU host has cached
    served_model_name: str = "epd-model"
    max_model_len: int = 4096
    # ExampleConnector transfers only a block-aligned prefix, and the CPU attention backend
    # wants multiples of 32: with 128 an 89-token prompt would transfer nothing.
    block_size: int = 32
    enforce_eager: bool = True
    max_num_seqs: int = 8
    dtype: str = "bfloat16"
    max_logprobs: int = 20
    # Media referenced as file:// must live under this directory.
    allowed_local_media_path: str | None = None
    # CPU only: KV cache per instance, and OMP threads per instance. The thread count changes
    # outputs on CPU, so every instance (baseline included) gets the same number.
    cpu_kvcache_space_gib: int = 1
    cpu_threads_per_instance: int = 1
    kv_connector: str = "ExampleConnector"
    ec_connector: str = "ECExampleConnector"
    # D's usage.prompt_tokens_details.cached_tokens is the evidence that KV moved.
    enable_prompt_tokens_details: bool = True
    # Per-request mm_processor_kwargs / media_io_kwargs are refused unless trusted; scenarios
    # send them on purpose (they must reach the encoder, vLLM #56786).
    trust_request_mm_kwargs: bool = True
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class InstanceSpec:
    """One vLLM server of a topology, fully determined: render it, launch it, log it."""

    name: str  # unique within a run, e.g. "1E+1P+1D/encoder0"; names log files
    role: Role
    port: int
    serving: ServingConfig
    ec_storage: Path | None = None  # shared EC directory of the topology (E writes, PD/P read)
    kv_storage: Path | None = None  # shared KV directory of the topology (P writes, D reads)
    cpu_cores: tuple[int, ...] = (0,)  # cores the instance's OMP threads are bound to
    host: str = LOOPBACK_HOST
    extra_env: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def argv(self, vllm_executable: str = "vllm") -> list[str]:
        """The `vllm serve` command line, as an argv list (never a shell string)."""
        s = self.serving
        argv = [
            vllm_executable, "serve", s.model,
            "--host", self.host,
            "--port", str(self.port),
            "--served-model-name", s.served_model_name,
            "--max-model-len", str(s.max_model_len),
            "--max-num-seqs", str(s.max_num_seqs),
            "--dtype", s.dtype,
            "--block-size", str(s.block_size),
            "--max-logprobs", str(s.max_logprobs),
        ]  # fmt: skip
        if s.enforce_eager:
            argv.append("--enforce-eager")
        if s.allowed_local_media_path:
            argv += ["--allowed-local-media-path", s.allowed_local_media_path]
        if s.enable_prompt_tokens_details:
            argv.append("--enable-prompt-tokens-details")
        if s.trust_request_mm_kwargs:
            argv.append("--trust-request-mm-kwargs")
        if self.role is Role.ENCODER:
            # Upstream's encoder flags: no prefix caching, and a token budget large enough to
            # admit a whole video (the budget bounds the encoder cache).
            argv += ["--no-enable-prefix-caching", "--max-num-batched-tokens", "114688"]
        ec_config = self.ec_transfer_config()
        if ec_config is not None:
            argv += ["--ec-transfer-config", json.dumps(ec_config, sort_keys=True)]
        kv_config = self.kv_transfer_config()
        if kv_config is not None:
            argv += ["--kv-transfer-config", json.dumps(kv_config, sort_keys=True)]
        argv += list(s.extra_args)
        return argv

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
        return config

    def env(self) -> dict[str, str]:
        """Environment additions for this instance (merged over the harness's environment)."""
        s = self.serving
        cores = ",".join(str(c) for c in self.cpu_cores[: s.cpu_threads_per_instance])
        env = {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(s.cpu_kvcache_space_gib),
            "VLLM_CPU_OMP_THREADS_BIND": cores,
            "OMP_NUM_THREADS": str(s.cpu_threads_per_instance),
        }
        env.update(dict(self.extra_env))
        return env


def plan_instances(
    topology: Topology,
    serving: ServingConfig,
    ports: list[int],
    storage_dir: Path,
    cpu_cores: tuple[int, ...] = (0, 1),
) -> list[InstanceSpec]:
    """Turn a topology into instance specs: one port each, fresh storage dirs, cores in turn.

    Storage is per topology run on purpose: both example connectors key what they store by
    content, so a reused directory would let a consumer load what an earlier run left there.
    """
    if len(ports) != len(topology.roles):
        raise ValueError(f"{topology.name} needs {len(topology.roles)} ports, got {len(ports)}")
    ec_storage = storage_dir / "ec" if topology.has_ec_transfer else None
    kv_storage = storage_dir / "kv" if topology.has_kv_transfer else None
    specs = []
    counts: dict[Role, int] = {}
    for index, (role, port) in enumerate(zip(topology.roles, ports)):
        n = counts.get(role, 0)
        counts[role] = n + 1
        core = cpu_cores[index % len(cpu_cores)]
        specs.append(
            InstanceSpec(
                name=f"{topology.name}/{role.value}{n}",
                role=role,
                port=port,
                serving=serving,
                ec_storage=ec_storage,
                kv_storage=kv_storage,
                cpu_cores=(core,),
            )
        )
    return specs
