"""What an attached instance's `/metrics` page tells of its role, so that a URL listed under the
wrong role is refused before any request instead of judged by the other role's evidence.

vLLM exposes no role as such: its only config labels are `vllm:cache_config_info`'s (the
CacheConfig fields), and /v1/models and /version say nothing of transfer configs. Two things on
the page follow from the role all the same (read in vLLM 0.27.1-0.32.0's source):

- **whether it holds a KV cache.** An EC producer that consumes nothing (an encoder) has an
  empty KV cache spec (`GPUModelRunner.get_kv_cache_spec` returns {} when the EC transfer is no
  consumer; the CPU runner inherits it), and an empty spec gets one block, the null block
  (`kv_cache_utils`: "BlockPool always needs a null_block"); the front end sums it over engines
  into `num_gpu_blocks`. Every instance that runs the language model must fit max_model_len
  tokens of KV, or vLLM refuses to start. So `num_gpu_blocks * block_size < max_model_len` is
  an encoder, and anything else runs the language model: a plain vLLM, a PD, a P or a D.
- **whether it is a KV consumer** (vLLM 0.32.0 on): `vllm:num_requests_kv_fetch_by_stage` is
  registered only when `kv_transfer_config.is_kv_consumer` (kv_role kv_consumer or kv_both).

What they cannot tell is said, never taken as verified: an EC consumer (PD, P) from a plain
vLLM; a P from a D when both run kv_both (NIXL deployments often do); and, before 0.32.0, a D
from any other instance that runs the language model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from harness.spec.attach import AttachedInstance
from harness.spec.topology import Role

_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{(?P<labels>[^}]*)\}", re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')
KV_CONSUMER_METRIC = "vllm:num_requests_kv_fetch_by_stage"
KV_CONSUMER_METRIC_SINCE = (0, 32)  # the first release that registers it
_ARTICLE = {Role.ENCODER: "an", Role.PREFILL_DECODE: "a", Role.PREFILL: "a", Role.DECODE: "a"}


@dataclass
class RoleReading:
    """What an instance's page says of its declared role."""

    mismatch: str | None = None  # the page contradicts the role: refuse, naming both
    unverified: list[str] = field(default_factory=list)  # what it cannot tell, in words


def cache_config_labels(page: str) -> dict[str, str]:
    """The labels of `vllm:cache_config_info` (engine 0's line; empty: the page has none)."""
    found = _CACHE_INFO.search(page)
    return dict(_LABEL.findall(found["labels"])) if found else {}


def release_of(version: str) -> tuple[int, int] | None:
    """(major, minor) of a /version answer such as "0.32.0+cpu" (None: "unknown" or other)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found[1]), int(found[2])) if found else None


def read_role(
    instance: AttachedInstance,
    page: str | None,
    version: str,
    max_model_len: int,
    has_encoders: bool,
) -> RoleReading:
    """Check `instance`'s declared role against its /metrics `page` (None: unreadable) and the
    release it reports at /version."""
    role = instance.role
    declared = f"{instance.describe()} is declared {_ARTICLE[role]} {role.value}"
    if page is None:
        return RoleReading(unverified=["its /metrics cannot be read"])
    reading = RoleReading()
    labels = cache_config_labels(page)
    blocks, block_size = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
    if blocks.isdigit() and block_size.isdigit():
        kv_tokens = int(blocks) * int(block_size)
        holds = f"a KV cache of {blocks} block{'s' if blocks != '1' else ''} of {block_size}"
        encode_only = kv_tokens < max_model_len
        if role is Role.ENCODER and not encode_only:
            reading.mismatch = (
                f"{declared}, but its /metrics reports {holds} tokens (vllm:cache_config_info "
                f"num_gpu_blocks), at least max_model_len {max_model_len}: it runs the "
                "language model, which an encoder (ec_role ec_producer) does not. List the "
                "encoder's own URL, or this one under its role"
            )
            return reading
        if role is not Role.ENCODER and encode_only:
            reading.mismatch = (
                f"{declared}, but its /metrics reports {holds} tokens (vllm:cache_config_info "
                f"num_gpu_blocks), less than max_model_len {max_model_len}: vLLM gives that "
                "only to an encoder (ec_role ec_producer), which runs no language model. List "
                f"the {role.value}'s own URL, or this one as an encoder"
            )
            return reading
    else:
        reading.unverified.append("its /metrics has no vllm:cache_config_info num_gpu_blocks")
    if role is Role.DECODE:
        release = release_of(version)
        if release is None or release < KV_CONSUMER_METRIC_SINCE:
            reading.unverified.append(
                f"that it is a KV consumer cannot be told from vLLM {version} (vLLM 0.32 "
                f"shows {KV_CONSUMER_METRIC} on one)"
            )
        elif not labels:  # no stat logger (--disable-log-stats) or no vLLM page: it says nothing
            reading.unverified.append(
                "that it is a KV consumer cannot be told: its /metrics has none of vLLM's "
                "engine metrics (vllm:cache_config_info)"
            )
        elif not re.search(rf"^{KV_CONSUMER_METRIC}\b", page, re.M):
            reading.mismatch = (
                f"{declared}, but its /metrics has no {KV_CONSUMER_METRIC}, which vLLM "
                f"{version} shows on every KV consumer (kv_transfer_config kv_role kv_consumer "
                "or kv_both): it receives no KV from a P. Is it the prefill (P and D swapped), "
                "or an instance without a kv_transfer_config?"
            )
            return reading
    if role is Role.PREFILL:
        reading.unverified.append(
            "that it is the KV producer, not a D, cannot be told from outside"
        )
    if has_encoders and role in (Role.PREFILL_DECODE, Role.PREFILL):
        reading.unverified.append(
            "that it consumes the encoders' embeddings (ec_role ec_consumer) cannot be told "
            "from outside"
        )
    return reading
