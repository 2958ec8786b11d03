"""Every deliberate difference between the harness's command lines and those of vLLM's own
`run_epd_correctness_test.sh`, each with its reason: ONE table.

Upstream parity (`harness.preflight.upstream_parity`) reads the served release's script into
per-role `vllm serve` flags, environment and proxy command lines, renders the same roles the
way the harness launches them on a GPU platform, and compares item by item. A difference this
table does not list, for that instance and that release's protocol generation, fails naming
the item; an entry that no release uses is stale and fails too. docs/upstream-parity.md shows
the table (`render_markdown`, checked by tests/test_upstream_parity_rules.py).

An item is a `vllm serve` flag (`--max-num-seqs`), a key inside a JSON-valued flag
(`--kv-transfer-config kv_buffer_device`), the served `model`, an environment variable
(`env CUDA_VISIBLE_DEVICES`), or, for a proxy, its flags and its `interpreter`. Where an entry
applies is a role (`baseline`, `encoder`, `pd`, `prefill`, `decode`, `epd-proxy`,
`toy-proxy`) or one role in one topology (`1P+1D/decode`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from harness.spec.generations import GENERATIONS_BY_NAME


class Kind(str, enum.Enum):
    HARNESS_ONLY = "harness only"  # the harness passes it, upstream does not
    UPSTREAM_ONLY = "upstream only"  # upstream passes it, the harness does not
    VALUE = "another value"  # both pass it, with different values


@dataclass(frozen=True)
class Difference:
    item: str
    kind: Kind
    where: tuple[str, ...]  # roles, or "TOPOLOGY/role"
    reason: str
    # Protocol generations (harness.spec.generations) it applies to; empty: every release.
    generations: tuple[str, ...] = ()

    def applies_to(self, instance: str, generation: str) -> bool:
        """`instance` is "TOPOLOGY/role" (a proxy's role: "epd-proxy" or "toy-proxy")."""
        role = instance.rsplit("/", 1)[-1]
        placed = instance in self.where or role in self.where
        return placed and (not self.generations or generation in self.generations)


SERVE_ROLES = ("baseline", "encoder", "pd", "prefill", "decode")
DISAGGREGATED_ROLES = ("encoder", "pd", "prefill", "decode")
KV_ROLES = ("prefill", "decode")
PROXY_ROLES = ("epd-proxy", "toy-proxy")
EPD_CONSUMERS_UPSTREAM_FLAGS = ("1E+1PD/pd", "1E+1P+1D/prefill", "1E+1P+1D/decode")

DIFFERENCES: tuple[Difference, ...] = (
    # -- every vllm serve line ----------------------------------------------------------------
    Difference(
        "--host",
        Kind.HARNESS_ONLY,
        SERVE_ROLES,
        "Servers bind the loopback address (127.0.0.1), never every interface; upstream leaves "
        "vLLM's default (all interfaces).",
    ),
    Difference(
        "--port",
        Kind.VALUE,
        SERVE_ROLES,
        "Ports are reserved from the harness's range and held while a topology runs, so parallel "
        "runs, xdist workers and CI jobs never collide; upstream's are fixed (19534-19537).",
    ),
    Difference(
        "--served-model-name",
        Kind.HARNESS_ONLY,
        SERVE_ROLES,
        "Requests name one model (epd-model) whatever path it was loaded from: a snapshot "
        "directory on GPUs, the generated tiny model on CPU.",
    ),
    Difference(
        "--max-model-len",
        Kind.VALUE,
        SERVE_ROLES,
        "A run option (--max-model-len, default 4096), the same for every instance of a "
        "comparison; the preflight counts every prompt with the model's own processor and "
        "refuses one that does not fit (the longest, the video, is 379 + 32 tokens). "
        "Upstream's 10240 fits its own prompts.",
    ),
    Difference(
        "--max-num-seqs",
        Kind.VALUE,
        SERVE_ROLES,
        "The same for every instance of a comparison; the harness has at most 4 requests in "
        "flight (scenario ec-concurrent-requests), so 8 admits them all and keeps warm-up "
        "small on CPU. Upstream's 128 sizes its own client's concurrency.",
    ),
    Difference(
        "--dtype",
        Kind.HARNESS_ONLY,
        SERVE_ROLES,
        "A run option (--dtype, default bfloat16), the same on every instance of a comparison "
        "and named, never auto: bfloat16 is Qwen2.5-VL-3B's own dtype, which upstream's "
        "instances load by default, but on a GPU below compute capability 8.0 (T4, V100) "
        "vLLM's auto falls back to float16 with only a warning. There the harness refuses "
        "bfloat16 and the user names --dtype float16: a deliberate choice, run.json says it.",
    ),
    Difference(
        "--block-size",
        Kind.HARNESS_ONLY,
        SERVE_ROLES,
        "One block size everywhere (32): the KV guard computes the prefix D must have received "
        "from it, ExampleConnector moves block-aligned prefixes, and the CPU attention backend "
        "wants multiples of 32.",
    ),
    Difference(
        "--max-logprobs",
        Kind.HARNESS_ONLY,
        SERVE_ROLES,
        "The comparison reads the top log-probs at every step (the drift rule's evidence); "
        "upstream compares text only.",
    ),
    Difference(
        "--enable-prompt-tokens-details",
        Kind.HARNESS_ONLY,
        SERVE_ROLES,
        "D's usage.prompt_tokens_details.cached_tokens is the KV guard's evidence that KV moved.",
    ),
    Difference(
        "--trust-request-mm-kwargs",
        Kind.HARNESS_ONLY,
        SERVE_ROLES,
        "Scenarios send per-request mm_processor_kwargs / media_io_kwargs, which must reach the "
        "encoder (vLLM #56786); from 0.31 vLLM refuses them with a 400 unless trusted.",
        generations=("by-hash-indexed",),
    ),
    Difference(
        "--allowed-local-media-path",
        Kind.UPSTREAM_ONLY,
        SERVE_ROLES,
        "Upstream's client reads hato.jpg from its tests directory; the harness sends generated "
        "media inline and passes the flag only with --media-dir.",
    ),
    # -- per role -------------------------------------------------------------------------------
    Difference(
        "--enable-mm-embeds",
        Kind.UPSTREAM_ONLY,
        EPD_CONSUMERS_UPSTREAM_FLAGS,
        "From 0.30 vLLM turns it on by itself for every EC and KV consumer "
        "(VllmConfig._resolve_mm_embedding_inputs), so the harness renders it only for the "
        "releases that need it (generations.consumers_need_enable_mm_embeds).",
        generations=("by-hash", "by-hash-indexed"),
    ),
    Difference(
        "--enable-mm-embeds",
        Kind.HARNESS_ONLY,
        ("1P+1D/prefill", "1P+1D/decode"),
        "0.28 and 0.29 refuse metadata-only *_embeds parts without it; the harness renders it by "
        "role (P is an EC consumer, D a KV consumer), and in 1P+1D, where no encoder answers, "
        "nothing sends them such parts: inert there.",
        generations=("ec-items-report-only", "ec-items"),
    ),
    Difference(
        "--ec-transfer-config ec_connector_extra_config.shared_storage_path",
        Kind.VALUE,
        ("encoder", "pd", "prefill"),
        "A fresh directory per topology run under the run directory: both example connectors "
        "key what they store by content, so a reused directory (upstream's /tmp/ec_cache_test) "
        "would feed a consumer what an earlier run stored.",
    ),
    Difference(
        "--kv-transfer-config kv_buffer_device",
        Kind.HARNESS_ONLY,
        KV_ROLES,
        "The platform's device (cuda, xpu), which is vLLM's default there; rendered because "
        "NIXL on CPU needs 'cpu', so the value is always visible in the command line.",
    ),
    # -- environment ------------------------------------------------------------------------
    Difference(
        "env CUDA_VISIBLE_DEVICES",
        Kind.VALUE,
        SERVE_ROLES,
        "Devices come from the one scheduler (harness/spec/placement.py): one per instance, "
        "topologies side by side on disjoint devices; upstream pins E to 0, P (and PD, the "
        "baseline) to 1 and D to 2.",
    ),
    Difference(
        "env CUDA_DEVICE_ORDER",
        Kind.HARNESS_ONLY,
        SERVE_ROLES,
        "PCI_BUS_ID, so CUDA_VISIBLE_DEVICES numbers GPUs as nvidia-smi does, the numbers "
        "--devices, the plan and run.json use; CUDA's default order (fastest first) differs "
        "on a host of mixed GPUs.",
    ),
    Difference(
        "env ZE_AFFINITY_MASK",
        Kind.VALUE,
        SERVE_ROLES,
        "As CUDA_VISIBLE_DEVICES, on xpu.",
    ),
    Difference(
        "env VLLM_NIXL_SIDE_CHANNEL_PORT",
        Kind.VALUE,
        KV_ROLES,
        "Reserved per instance like the HTTP ports (two KV instances on one host need "
        "distinct ones); upstream's are 5559 and 6000.",
    ),
    Difference(
        "env VLLM_NIXL_SIDE_CHANNEL_HOST",
        Kind.HARNESS_ONLY,
        KV_ROLES,
        "Pinned to the loopback address the port was reserved on: vLLM's default 'localhost' "
        "may resolve elsewhere.",
    ),
    Difference(
        "env VLLM_EC_SIDE_CHANNEL_HOST",
        Kind.HARNESS_ONLY,
        ("encoder", "1E+1PD/pd", "1E+1P+1D/prefill"),
        "Pinned to the instance's own address, as the NIXL one: vLLM's default 'localhost' is "
        "another machine once E and its consumer run on different nodes "
        "(harness/spec/network.py).",
    ),
    Difference(
        "env HF_HUB_OFFLINE",
        Kind.HARNESS_ONLY,
        SERVE_ROLES,
        "The model is resolved to a local snapshot before the run; instances never reach the "
        "hub (a run must not depend on the network).",
    ),
    Difference(
        "env TRANSFORMERS_OFFLINE",
        Kind.HARNESS_ONLY,
        SERVE_ROLES,
        "As HF_HUB_OFFLINE, for transformers.",
    ),
    Difference(
        "env VLLM_NO_USAGE_STATS",
        Kind.HARNESS_ONLY,
        SERVE_ROLES,
        "Test instances report no usage statistics.",
    ),
    Difference(
        "env DO_NOT_TRACK",
        Kind.HARNESS_ONLY,
        SERVE_ROLES,
        "As VLLM_NO_USAGE_STATS.",
    ),
    # -- the proxies ------------------------------------------------------------------------
    Difference(
        "interpreter",
        Kind.VALUE,
        PROXY_ROLES,
        "vLLM's proxies run with the served vLLM's own interpreter (their dependencies are "
        "vLLM's), not whatever `python` is first on PATH.",
    ),
    Difference(
        "--host",
        Kind.VALUE,
        PROXY_ROLES,
        "Bound to the loopback address; upstream binds the EPD proxy to 0.0.0.0.",
    ),
    Difference(
        "--port",
        Kind.VALUE,
        PROXY_ROLES,
        "Reserved like every other port; upstream's is 10001.",
    ),
    Difference(
        "env NO_PROXY",
        Kind.HARNESS_ONLY,
        PROXY_ROLES,
        "127.0.0.1, localhost and the hosts it relays to, appended to the environment's own "
        "list (serve.sh: to the user's): the toy proxy's httpx clients follow HTTP_PROXY and, "
        "as urllib does on Linux, bypass no proxy for loopback unless NO_PROXY names it, so on "
        "a runner with HTTP_PROXY set every call to P and D went to that proxy and failed. The "
        "EPD proxy's "
        "aiohttp ignores the environment; it gets the same list should a release change that.",
    ),
    Difference(
        "env no_proxy",
        Kind.HARNESS_ONLY,
        PROXY_ROLES,
        "As env NO_PROXY: the lower-case spelling, which wins where both are set.",
    ),
    Difference(
        "--encode-servers-urls",
        Kind.VALUE,
        ("epd-proxy",),
        "The proxy talks to each instance through its recording tap (harness/serve/tap.py), "
        "the guards' evidence, on loopback and reserved ports.",
    ),
    Difference(
        "--prefill-servers-urls",
        Kind.VALUE,
        ("1E+1P+1D/epd-proxy",),
        "As --encode-servers-urls.",
    ),
    Difference(
        "--decode-servers-urls",
        Kind.VALUE,
        ("epd-proxy",),
        "As --encode-servers-urls.",
    ),
    Difference(
        "--prefiller-ports",
        Kind.VALUE,
        ("toy-proxy",),
        "As --encode-servers-urls: the taps' ports.",
    ),
    Difference(
        "--decoder-ports",
        Kind.VALUE,
        ("toy-proxy",),
        "As --encode-servers-urls: the taps' ports.",
    ),
    Difference(
        "--prefiller-hosts",
        Kind.HARNESS_ONLY,
        ("toy-proxy",),
        "The taps listen on 127.0.0.1; the toy proxy's default 'localhost' may resolve to "
        "IPv6 first.",
    ),
    Difference(
        "--decoder-hosts",
        Kind.HARNESS_ONLY,
        ("toy-proxy",),
        "As --prefiller-hosts.",
    ),
)


def render_markdown() -> str:
    """The table as docs/upstream-parity.md shows it."""
    lines = [
        "| item | difference | where | releases | why |",
        "|---|---|---|---|---|",
    ]
    for entry in DIFFERENCES:
        where = ", ".join(f"`{w}`" for w in entry.where) or "nowhere"
        releases = ", ".join(
            f"{name} ({GENERATIONS_BY_NAME[name].version_range})" for name in entry.generations
        )
        lines.append(
            f"| `{entry.item}` | {entry.kind.value} | {where} | {releases or 'all'} | "
            f"{entry.reason} |"
        )
    return "\n".join(lines) + "\n"
