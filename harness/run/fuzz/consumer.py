"""What a block-aligned KV consumer (D under ExampleConnector) already holds when a request
arrives: the part of the prompt it does not compute itself whatever P sends.

vLLM 0.32's ExampleConnector keys the KV it stores by a hash of prompt token ids plus the
request's multimodal identifiers, with two different lengths:

* P stores the first `align(n) = (n - 1) // block * block` tokens of an n-token prompt
  (`ReqMeta.make_meta`), unless a folder under the lookup key below already exists;
* D looks up the first `align(n - 1) = (n - 2) // block * block` tokens
  (`get_num_new_matched_tokens`, `_found_match_for_prompt`).

The two agree unless n = k * block + 1. Then P stores k blocks and D looks for k - 1: D finds
nothing of P's (only a folder an *earlier* request of the same storage left under that shorter
key), and computes the prompt itself from whatever its own prefix cache holds. Media there
need embeddings D never received, so its engine dies on the same assertion as the decode-tail
bug; a text-only prompt is answered right, with no KV moved (the kv_transfer guard's VACUOUS).

P runs D's lookup too, and on a hit loads rather than stores, from the folder of `align(n)`
tokens (`make_meta` aligns the whole prompt): at n = k * block + 1 an earlier request that
stored the shorter key makes P open a folder nobody wrote (it creates it, empty, on the way)
and P's engine dies in start_load_kv. `prefill_loads_missing` predicts that.

Whether such a request kills D, or P, therefore depends on what came before it: the storage's
folders and D's prefix cache. `ConsumerState` follows both from the requests the topology was
sent, so the fuzzer's prediction of that crash stays exact across examples (and a repeated
prefix is not mistaken for a wrong trigger). It is a model of vLLM's code read at 0.32, and
the engine still checks every prediction it sends against what happened.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from harness.spec.prompt_codec import part_to_json
from harness.spec.prompts import MEDIA_PARTS, PromptSpec

# The request fields that change what a media item is (the harness proxy's uuid covers them
# too: harness.serve.proxy_protocol.media_uuid).
MEDIA_KWARGS = ("mm_processor_kwargs", "media_io_kwargs")


def stored_tokens(prompt_tokens: int, block: int) -> int:
    """Tokens P's ExampleConnector stores: align_to_block_size(n) in vLLM 0.32."""
    return max(0, (prompt_tokens - 1) // block * block)


def looked_up_tokens(prompt_tokens: int, block: int) -> int:
    """Tokens D's ExampleConnector looks for: align_to_block_size(n - 1)."""
    return max(0, (prompt_tokens - 2) // block * block)


def media_identities(spec: PromptSpec) -> tuple[str, ...]:
    """One identity per media item, in prompt order: equal exactly when vLLM's multimodal
    identifier is (the same part and the same per-request media kwargs)."""
    extra = dict(spec.extra)
    kwargs = {k: extra[k] for k in MEDIA_KWARGS if k in extra}
    found = []
    for part in spec.parts:
        if isinstance(part, MEDIA_PARTS):
            found.append(json.dumps({"part": part_to_json(part), **kwargs}, sort_keys=True))
    return tuple(found)


@dataclass(frozen=True)
class Served:
    """One prompt the consumer computed or loaded (its full blocks are in its prefix cache)."""

    ids: tuple[int, ...]
    media: tuple[str, ...]
    run_starts: tuple[int, ...]  # where each media item's placeholders start


@dataclass
class ConsumerState:
    """The ExampleConnector storage's keys and D's prefix cache, as far as the requests sent
    to one topology determine them. `storage_reset` when the topology starts afresh (a new
    session directory), `consumer_restarted` when only D starts again (same storage)."""

    block: int
    stored: set[tuple[tuple[int, ...], tuple[str, ...]]] = field(default_factory=set)
    # Folders a failed load created with no file in them (`prefill_loads_missing`): found by a
    # lookup all the same.
    hollow: set[tuple[tuple[int, ...], tuple[str, ...]]] = field(default_factory=set)
    cached: list[Served] = field(default_factory=list)

    def prefill_loads_missing(
        self, ids: list[int] | tuple[int, ...], media: tuple[str, ...]
    ) -> bool:
        """Whether P's lookup finds a folder while the one it then loads holds no KV: P's
        engine dies (FileNotFoundError) before D is asked anything."""
        lookup, load = self._keys(ids, media)
        return (lookup in self.stored or lookup in self.hollow) and load not in self.stored

    def _keys(
        self, ids: list[int] | tuple[int, ...], media: tuple[str, ...]
    ) -> tuple[tuple, tuple]:
        """The lookup key (both instances) and the key P stores under and loads from."""
        n = len(ids)
        return (
            (tuple(ids[: looked_up_tokens(n, self.block)]), media),
            (tuple(ids[: stored_tokens(n, self.block)]), media),
        )

    def holds(
        self, ids: list[int] | tuple[int, ...], media: tuple[str, ...], run_starts: tuple[int, ...]
    ) -> int:
        """Tokens of this prompt D has before P's transfer: its prefix-cache hit, or an
        earlier request's folder under its lookup key, whichever is longer."""
        n = len(ids)
        lookup, _ = self._keys(ids, media)
        from_storage = len(lookup[0]) if lookup in self.stored else 0
        best = 0
        for earlier in self.cached:
            common = _common_prefix(ids, earlier.ids)
            for start, here, there in zip(run_starts, media, earlier.media):
                if start < common and here != there:  # same placeholders, another item
                    common = start
                    break
            full_blocks = len(earlier.ids) // self.block
            best = max(best, min(common // self.block, full_blocks) * self.block)
        # vLLM leaves at least one prompt token to compute (max_cache_hit_length = n - 1).
        from_cache = min(best, (n - 1) // self.block * self.block)
        return max(from_storage, from_cache)

    def served(
        self,
        ids: list[int] | tuple[int, ...],
        media: tuple[str, ...],
        run_starts: tuple[int, ...],
        consumer_alive: bool,
    ) -> None:
        """A request the topology was sent: P stored its KV unless its lookup found a
        folder (then it loaded instead, and a load from a folder with no KV left that folder
        behind, empty), and D, if it survived, cached its full blocks."""
        lookup, load = self._keys(ids, media)
        if lookup in self.stored or lookup in self.hollow:
            if load not in self.stored:
                self.hollow.add(load)
        else:
            self.stored.add(load)
        if consumer_alive:
            self.cached.append(Served(tuple(ids), media, run_starts))

    def consumer_restarted(self) -> None:
        self.cached.clear()

    def storage_reset(self) -> None:
        self.stored.clear()
        self.hollow.clear()
        self.cached.clear()


def _common_prefix(a: list[int] | tuple[int, ...], b: tuple[int, ...]) -> int:
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return min(len(a), len(b))
