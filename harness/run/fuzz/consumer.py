"""What a block-aligned KV consumer (D under ExampleConnector) already holds when a request
arrives, and whether P's or D's connector then loads KV nobody wrote.

vLLM 0.32's ExampleConnector keys the KV it stores by a hash of prompt token ids plus the
request's multimodal identifiers, with two different lengths:

* P stores the first `align(n) = (n - 1) // block * block` tokens of an n-token prompt
  (`ReqMeta.make_meta`), unless a folder under the lookup key below already exists;
* both instances look up the first `align(n - 1) = (n - 2) // block * block` tokens
  (`get_num_new_matched_tokens`, `_found_match_for_prompt`), and on a hit load the folder of
  `align(n)` tokens (`make_meta` aligns the whole prompt) for what their own prefix cache
  lacks: `get_num_new_matched_tokens` returns the lookup's tokens minus the instance's local
  prefix-cache hit, and at zero the instance neither loads nor stores.

The two lengths agree unless n = k * block + 1. Then P stores k blocks and D looks for k - 1:
D finds nothing of P's (only a folder an *earlier* request of the same storage left under that
shorter key), and computes the prompt itself from whatever its own prefix cache holds. Media
there need embeddings D never received, so its engine dies on the same assertion as the
decode-tail bug; a text-only prompt is answered right, with no KV moved (the kv_transfer
guard's VACUOUS).

When an earlier request did store that shorter key, the instance whose prefix cache does not
cover it loads the k-block folder: P, unless its cache holds the earlier request (then P
neither loads nor stores, and the k-block folder stays unwritten), else D. The folder was
never written (the loader creates it, empty, on the way), and that instance's engine dies in
start_load_kv (`prefill_loads_missing`, `decode_loads_missing`). A request that extends an
earlier one under another `cache_salt` (another tenant's turn) misses P's prefix cache and
kills P; the same turn under the same salt is a cache hit on both and moves no KV.

Whether such a request kills D, or P, therefore depends on what came before it: the storage's
folders and both instances' prefix caches (a salt's blocks only serve requests of that salt).
`ConsumerState` follows them from the requests the topology was sent, so the fuzzer's
prediction of those crashes stays exact across examples (and a repeated prefix is not mistaken
for a wrong trigger). It is a model of vLLM's code read at 0.32 (its cache never evicts here),
and the engine still checks every prediction it sends against what happened.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from harness.judge.guards import kv_rule_for
from harness.spec.connectors import KvRule
from harness.spec.prompt_codec import part_to_json
from harness.spec.prompts import MEDIA_PARTS, PromptSpec
from harness.spec.topology import Topology

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
class SentPrompt:
    """One prompt as the storage model sees it: its ids, its media items' identities and
    where each one's placeholders start, and the request's cache salt (an instance's prefix
    cache serves only requests of the same salt; ExampleConnector's keys ignore it)."""

    ids: tuple[int, ...]
    media: tuple[str, ...] = ()
    run_starts: tuple[int, ...] = ()
    salt: str | None = None
    # The request that sent it, in an instance's cache (`served`): who left a prefix there.
    name: str = field(default="", compare=False)


Key = tuple[tuple[int, ...], tuple[str, ...]]


def block_aligned_kv(topology: Topology, kv_connector: str) -> bool:
    """Whether this model, and the layout words built on it (D's recomputed tail, the k*block+1
    keys D looks up apart from P, a folder P loads unwritten), say what D gets on `topology`
    under `kv_connector`: a topology that moves KV under a block-aligned connector
    (ExampleConnector; an unknown class is held to that rule too). Under NIXL D gets the whole
    prompt's KV: real vLLM 0.32 (fuzz --kv-connector nixl, 1E+1P+1D, seed 42) MATCHed every
    request whose media ended in what would be ExampleConnector's tail, which there kills D."""
    return topology.has_kv_transfer and kv_rule_for(kv_connector) is KvRule.BLOCK_ALIGNED_PREFIX


@dataclass
class ConsumerState:
    """The ExampleConnector storage's keys and P's and D's prefix caches, as far as the
    requests sent to one topology determine them. `storage_reset` when the topology starts
    afresh (a new session directory), `restarted` when instances start again in place (same
    storage, empty caches)."""

    block: int
    stored: set[Key] = field(default_factory=set)
    # Folders a failed load created with no file in them (`prefill_loads_missing`,
    # `decode_loads_missing`): found by a lookup all the same.
    hollow: set[Key] = field(default_factory=set)
    cached: list[SentPrompt] = field(default_factory=list)  # D's prefix cache
    prefill_cached: list[SentPrompt] = field(default_factory=list)  # P's prefix cache
    # Each folder's making: the requests that, sent in this order to fresh servers, leave
    # it as it is (the one that stored it; for a hollow one, what its failed load found,
    # then that load's request). What `repro` and `export` replay before a request whose
    # failure needs the folder (`stage_of`).
    made_by: dict[Key, tuple[str, ...]] = field(default_factory=dict)

    def stage_of(self, prompt: SentPrompt) -> tuple[str, ...]:
        """The requests that made the folder this prompt's lookup finds (none: it finds
        none, or the folder's making is unknown)."""
        lookup, _ = self.keys_of(prompt)
        return self.made_by.get(lookup, ()) if self._found(lookup) else ()

    def prefill_loads_missing(self, prompt: SentPrompt) -> bool:
        """Whether P's lookup finds a folder, its prefix cache holds less than that, and the
        folder it then loads holds no KV: P's engine dies (FileNotFoundError) before D is
        asked anything."""
        _, load = self.keys_of(prompt)
        return self._prefill_loads(prompt) and load not in self.stored

    def decode_loads_missing(self, prompt: SentPrompt) -> bool:
        """Whether P, its own cache covering the lookup, left the folder unwritten that D,
        its cache covering less, then loads: D's engine dies as P's would."""
        lookup, load = self.keys_of(prompt)
        if not self._found(lookup) or load in self.stored:
            return False
        if self._prefill_loads(prompt):
            return False  # P loads (and dies) first
        return self._hit(self.cached, prompt) < len(lookup[0])

    def prefill_hit(self, prompt: SentPrompt) -> int:
        """Tokens of this prompt P's prefix cache holds (under its salt)."""
        return self._hit(self.prefill_cached, prompt)

    def holds(self, prompt: SentPrompt) -> int:
        """Tokens of this prompt D has before P's transfer: its prefix-cache hit, or an
        earlier request's folder under its lookup key (a hollow one too: the lookup tests
        only that it exists, and D computes past it), whichever is longer."""
        from_storage, hit, _ = self._decode_sources(prompt)
        return max(from_storage, hit)

    def holds_stage(self, prompt: SentPrompt) -> tuple[str, ...]:
        """The earlier requests whose leftovers give D what it `holds` of this prompt: the
        folder's making, or the request whose prompt D's prefix cache serves it from. What
        D holds decides whether a transfer is short and media lie past it (VACUOUS, or D's
        death): sent alone, the request finds D holding nothing (found in review)."""
        from_storage, hit, source = self._decode_sources(prompt)
        if from_storage and from_storage >= hit:
            lookup, load = self.keys_of(prompt)
            if lookup in self.stored:
                return self.made_by.get(lookup, ())
            # A hollow lookup folder gives D tokens only when the folder D then loads holds
            # KV: its writer goes first, or the replay's load finds nothing and dies.
            return tuple(
                dict.fromkeys((*self.made_by.get(load, ()), *self.made_by.get(lookup, ())))
            )
        return (source.name,) if hit and source is not None and source.name else ()

    def _decode_sources(self, prompt: SentPrompt) -> tuple[int, int, SentPrompt | None]:
        """What D could take of this prompt: the tokens of an earlier request's folder under
        its lookup key (stored or hollow: found all the same), its prefix-cache hit, and the
        earlier prompt that gives the hit."""
        lookup, _ = self.keys_of(prompt)
        from_storage = len(lookup[0]) if self._found(lookup) else 0
        return (from_storage, *self._best_hit(self.cached, prompt))

    def served(
        self,
        prompt: SentPrompt,
        *,
        reached_prefill: bool = True,
        prefill_alive: bool = True,
        consumer_alive: bool = True,
        decode_reaches_load: bool = True,
        name: str = "",
    ) -> None:
        """A request the topology was sent. Unless it ended before P (the encoder died on
        it): P stored its KV unless its lookup found a folder (then it loaded what its cache
        lacked, or nothing) or it died on the request (a death the model did not foresee:
        it stores as its forward pass runs, and a death before that, such as one loading
        the encoder's output, writes nothing); a load from a folder with no KV left that
        folder behind, empty (D's only if it got that far: `decode_reaches_load`, false when
        its media killed it first); P, if it survived, cached the prompt's full blocks, and
        D, if it was asked (P survived) and survived, did too."""
        if not reached_prefill:
            return
        lookup, load = self.keys_of(prompt)
        if not self._found(lookup):
            if prefill_alive:
                self.stored.add(load)
                self.made_by[load] = (name,)
        elif load not in self.stored and (
            self._prefill_loads(prompt)
            or (decode_reaches_load and self.decode_loads_missing(prompt))
        ):
            self.hollow.add(load)
            self.made_by.setdefault(load, (*self.made_by.get(lookup, ()), name))
        if not prefill_alive:
            return
        prompt = dataclasses.replace(prompt, name=name) if name else prompt
        self.prefill_cached.append(prompt)
        if consumer_alive:
            self.cached.append(prompt)

    def restarted(self, *, prefill: bool = False, consumer: bool = False) -> None:
        """Instances started again in place: their prefix caches are empty."""
        if prefill:
            self.prefill_cached.clear()
        if consumer:
            self.cached.clear()

    def storage_reset(self) -> None:
        self.stored.clear()
        self.hollow.clear()
        self.made_by.clear()
        self.cached.clear()
        self.prefill_cached.clear()

    def keys_of(self, prompt: SentPrompt) -> tuple[Key, Key]:
        """The lookup key (both instances) and the key P stores under and loads from."""
        n = len(prompt.ids)
        return (
            (prompt.ids[: looked_up_tokens(n, self.block)], prompt.media),
            (prompt.ids[: stored_tokens(n, self.block)], prompt.media),
        )

    def _found(self, key: Key) -> bool:
        return key in self.stored or key in self.hollow

    def _prefill_loads(self, prompt: SentPrompt) -> bool:
        """P's connector loads: its lookup finds a folder and P's prefix cache covers less."""
        lookup, _ = self.keys_of(prompt)
        return self._found(lookup) and self._hit(self.prefill_cached, prompt) < len(lookup[0])

    def _hit(self, cache: list[SentPrompt], prompt: SentPrompt) -> int:
        return self._best_hit(cache, prompt)[0]

    def _best_hit(
        self, cache: list[SentPrompt], prompt: SentPrompt
    ) -> tuple[int, SentPrompt | None]:
        """An instance's prefix-cache hit for this prompt: whole blocks shared with an
        earlier prompt of the same salt, up to the first media item that differs; and the
        first earlier prompt that gives it."""
        best, source = 0, None
        for earlier in cache:
            if earlier.salt != prompt.salt:
                continue
            common = _common_prefix(prompt.ids, earlier.ids)
            for start, here, there in zip(prompt.run_starts, prompt.media, earlier.media):
                if start < common and here != there:  # same placeholders, another item
                    common = start
                    break
            full_blocks = len(earlier.ids) // self.block
            hit = min(common // self.block, full_blocks) * self.block
            if hit > best:
                best, source = hit, earlier
        # vLLM leaves at least one prompt token to compute (max_cache_hit_length = n - 1).
        return min(best, (len(prompt.ids) - 1) // self.block * self.block), source


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return min(len(a), len(b))
