"""Roles, topologies, and the serving flags every instance of one comparison shares.

A comparison is only meaningful when the baseline and every EPD instance share the flags that
change numerics (model, dtype, max length, block size, eager mode, thread count). Those live in
one `ServingConfig`; a role adds only its transfer configuration on top
(`harness.spec.instances` renders both into a command line).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from harness.errors import lookup
from harness.spec.platforms import PlatformProfile


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
# The monolithic reference every run serves beside what it checks (sweep, fuzz, export).
BASELINE = TOPOLOGIES["baseline"]


def get_topology(name: str) -> Topology:
    """Look a topology up by name, or fail (BadInput) with the list of known names."""
    return lookup("topology", name, TOPOLOGIES)


# The dtypes `--dtype` may name, the first the default. vLLM's own "auto" is left out on purpose:
# it picks per platform, falling back with only a warning (`harness.preflight.dtype`), and every
# instance of a comparison must compute in the one dtype run.json records. bfloat16 needs a GPU
# of compute capability 8.0 or more (T4 and V100 take float16).
DTYPES = ("bfloat16", "float16", "float32")
DEFAULT_DTYPE = DTYPES[0]


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
    dtype: str = DEFAULT_DTYPE  # one of DTYPES; --dtype
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


def serving_for(profile: PlatformProfile, model: str, **overrides: object) -> ServingConfig:
    """The shared ServingConfig with the platform's connector and eager mode filled in."""
    settings: dict[str, object] = {
        "kv_connector": profile.kv_connector,
        "enforce_eager": profile.enforce_eager,
    }
    settings.update(overrides)
    return ServingConfig(model=model, **settings)  # type: ignore[arg-type]


def ordered_topologies(topologies: tuple[Topology, ...]) -> list[Topology]:
    """EPD topologies in run order: each exact reference before the topology using it."""
    pending = [t for t in topologies if not t.is_baseline]
    for topology in list(pending):
        reference = topology.exact_reference
        if reference and reference not in {t.name for t in pending}:
            pending.append(TOPOLOGIES[reference])
    names = {t.name for t in pending}
    ordered: list[Topology] = []
    while pending:
        done = {o.name for o in ordered}
        ready = [t for t in pending if t.exact_reference not in names - done] or pending[:1]
        ordered.append(ready[0])
        pending.remove(ready[0])
    return ordered
