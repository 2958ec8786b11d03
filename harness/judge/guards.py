"""Transfer guards: the evidence that a token-level MATCH is not vacuous.

A consumer that receives raw media encodes them itself and still matches the baseline, and a D
that skips the KV connector recomputes the prompt and still matches. So for every EPD request
we check, from the proxy's trace and the instances' storage:

- `encoder_output`: every media item got an entry with metadata from an encoder, and the EC
  storage holds `<mm_hash>/encoder_cache.safetensors` for it (a consumer that misses may leave
  an empty `<mm_hash>/` directory in 0.32, so the directory alone proves nothing);
- `consumer_embeds`: every media part reached the consumer as a metadata-only `*_embeds` part;
- `kv_transfer`: D reported `cached_tokens` reaching the block-aligned prompt prefix
  (align_down(prompt_tokens - 1, block_size)); a local prefix hit alone is smaller.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from harness.serve.client import ChatResult
from harness.serve.proxy import RequestTrace
from harness.serve.session import Outcome, TopologySession
from harness.spec.topology import Topology

EC_CACHE_FILE = "encoder_cache.safetensors"


@dataclass(frozen=True)
class GuardResult:
    name: str
    ok: bool
    evidence: str

    def to_json(self) -> dict:
        return {"ok": self.ok, "evidence": self.evidence}


def expected_kv_prefix(prompt_tokens: int, block_size: int) -> int:
    """Tokens D should load: the block-aligned prefix, leaving at least one token to compute."""
    return ((prompt_tokens - 1) // block_size) * block_size


def check_encoder_output(trace: RequestTrace, ec_storage: Path | None) -> GuardResult:
    # Counted per call: the same image sent to two encoders has one hash but two items.
    if any(call.indexed is not None for call in trace.encoder_calls):
        # What the proxy read with the served release's protocol (older answers carry no
        # item_indices, or are lists: harness.spec.generations).
        indexed = [h for call in trace.encoder_calls for h in (call.indexed or {}).values()]
        covered, hashes = len(indexed), sorted(set(indexed))
    else:
        with_metadata = [
            (mm_hash, entry)
            for call in trace.encoder_calls
            for mm_hash, entry in (call.ec_transfer_params or {}).items()
            if entry.get("metadata")
        ]
        covered = sum(len(entry.get("item_indices") or []) for _, entry in with_metadata)
        hashes = sorted({mm_hash for mm_hash, _ in with_metadata})
    missing_files = [
        h for h in hashes if ec_storage is None or not (ec_storage / h / EC_CACHE_FILE).is_file()
    ]
    ok = covered == trace.media_count and not missing_files
    evidence = (
        f"{trace.media_count} media item(s); encoders reported {covered} with metadata "
        f"in {len(trace.encoder_calls)} call(s)"
    )
    if missing_files:
        evidence += f"; no {EC_CACHE_FILE} for {', '.join(missing_files)} under {ec_storage}"
    return GuardResult("encoder_output", ok, evidence)


def check_consumer_embeds(trace: RequestTrace) -> GuardResult:
    ok = len(trace.metadata_only) == trace.media_count and all(trace.metadata_only)
    return GuardResult(
        "consumer_embeds",
        ok,
        f"parts forwarded to the consumer: {trace.forwarded_part_types or 'none'}",
    )


def check_kv_transfer(result: ChatResult, block_size: int) -> GuardResult:
    expected = expected_kv_prefix(len(result.prompt_token_ids), block_size)
    cached = result.cached_tokens
    ok = cached is not None and expected > 0 and cached >= expected
    return GuardResult(
        "kv_transfer",
        ok,
        f"D cached_tokens={cached}, expected >= {expected} "
        f"(prompt {len(result.prompt_token_ids)} tokens, block {block_size})",
    )


def check_transfers(
    topology: Topology,
    trace: RequestTrace | None,
    result: ChatResult,
    ec_storage: Path | None,
    block_size: int,
) -> list[GuardResult]:
    """Every guard that applies to this topology and request."""
    guards: list[GuardResult] = []
    if topology.has_ec_transfer and trace is not None and trace.media_count:
        guards.append(check_encoder_output(trace, ec_storage))
        guards.append(check_consumer_embeds(trace))
    if topology.has_kv_transfer:
        guards.append(check_kv_transfer(result, block_size))
    return guards


def session_guards(session: TopologySession, outcome: Outcome) -> list[GuardResult]:
    """The guards of one answered request, read now, while the session's storage is as the
    request left it (the sweep, the matrix and the self-test all judge through this)."""
    if outcome.result is None:
        return []
    return check_transfers(
        session.topology,
        outcome.trace,
        outcome.result,
        session.ec_storage,
        session.settings.serving.block_size,
    )
