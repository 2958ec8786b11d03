"""The EPD scenario matrix, declared: each scenario a topology + prompts + how to send them +
the verdict expected, covering the ways EPD has really broken (see docs/scenarios.md).

A scenario normally expects MATCH. Where vLLM itself is known to fail, the scenario says so:
`expect` names the verdict, `expect_evidence` a string the evidence must contain, `reason` the
upstream cause. Such a scenario passes only while the failure looks exactly like that, so a fix
upstream (or a different failure) turns it red instead of going unnoticed.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass
from pathlib import Path

from harness.errors import BadInput, lookup
from harness.judge.records import DeclaredFailure, Verdict
from harness.spec.connectors import KV_CONNECTORS
from harness.spec.prompt_codec import prompt_from_json
from harness.spec.prompts import (
    SHORT_TEXT,
    TAIL_TEXT,
    ImagePart,
    PromptSpec,
    TextPart,
    VideoFramesPart,
    VideoPart,
)
from harness.spec.topology import TOPOLOGIES

# vLLM closes idle keep-alive connections after 5 s (#41567): wait longer than that.
IDLE_GAP_S = 6.0
LONG_TEXT = " ".join([TAIL_TEXT] * 3)
KV_LOOKUP_MISS = (
    "vLLM 0.32 ExampleConnector: P stores the KV of align_to_block_size(n) tokens, D looks it "
    "up under align_to_block_size(n - 1); at n = k*block + 1 the keys differ and D loads none "
    "of P's KV (no 'External Cache Hit!' in D's log)"
)

KV_PREFILL_LOAD_MISS = (
    "vLLM 0.32 ExampleConnector: P runs the lookup D runs, under align_to_block_size(n - 1), "
    "and on a hit loads the folder of align_to_block_size(n) tokens; at n = k*block + 1 a "
    "folder an earlier request of the same prefix stored under the shorter key is a hit, the "
    "longer one was never written, and P's engine dies in start_load_kv"
)


class SendMode(str, enum.Enum):
    SEQUENTIAL = "sequential"  # one request after another
    CONCURRENT = "concurrent"  # all of the scenario's requests in flight at once
    IDLE_GAPS = "idle_gaps"  # a pause longer than the servers' keep-alive between requests


@dataclass(frozen=True)
class Scenario:
    name: str
    topology: str
    prompts: tuple[PromptSpec, ...]
    mode: SendMode = SendMode.SEQUENTIAL
    # The verdicts this scenario may end with; anything but MATCH needs a reason.
    expect: tuple[Verdict, ...] = (Verdict.MATCH,)
    expect_evidence: str = ""  # must appear in the failing record's error / explanation
    reason: str = ""  # why a verdict other than MATCH is expected (the upstream cause)
    # Start a fresh session on the storage the previous one left (encoder-cache hits, #51222).
    rerun_on_kept_storage: bool = False
    # Every encoder must have received work (round-robin across requests, #52484).
    require_every_encoder: bool = False
    ci: bool = False  # part of CI's representative subset
    # What to expect instead under another KV connector (vLLM class name -> verdicts), where
    # the upstream failure belongs to one connector only; `for_kv_connector` applies it.
    expect_by_kv_connector: tuple[tuple[str, tuple[Verdict, ...]], ...] = ()
    # Streamed requests (stream: true, with usage; harness.outcomes.stream), whatever the run's
    # --stream says: the ids read from the stream, and its framing, are judged.
    stream: bool = False
    # The prompts the declared failure is of (empty: every prompt). The others set the stage
    # (an earlier request whose stored KV the failing one finds) and must MATCH.
    declared_for: tuple[str, ...] = ()
    # The declaration holds on a KV storage with nothing in it, as a topology starts with: the
    # matrix empties the shared session's KV storage before sending. ExampleConnector finds KV
    # by the prompt's token prefix alone (a cache salt does not change the key), so what an
    # earlier scenario, the sweep or a load stored under the same prefix changes what P and D
    # find (found on real vLLM: after the sweep's text prompt, a prompt one block longer
    # killed P instead of being answered with no KV moved).
    empty_kv_storage: bool = False

    def for_kv_connector(self, kv_connector: str) -> Scenario:
        """This scenario as judged under `kv_connector` (the run's ServingConfig.kv_connector):
        an override to MATCH drops the failure's evidence and reason, which no longer apply."""
        for name, expect in self.expect_by_kv_connector:
            if name == kv_connector:
                matches = expect == (Verdict.MATCH,)
                return dataclasses.replace(
                    self,
                    expect=expect,
                    expect_evidence="" if matches else self.expect_evidence,
                    reason="" if matches else self.reason,
                )
        return self

    @property
    def declared(self) -> DeclaredFailure | None:
        """The upstream failure this scenario is declared to have (None: it must pass as the
        run's reference policy says, MATCH on CPU)."""
        if self.expect == (Verdict.MATCH,):
            return None
        if len(self.expect) != 1:
            raise ValueError(f"{self.name}: a declared failure names one verdict: {self.expect}")
        return DeclaredFailure(self.expect[0].value, self.expect_evidence, self.reason, self.name)

    def declared_of(self, prompt: str) -> DeclaredFailure | None:
        """The declared failure of one of the scenario's prompts: None for a prompt that only
        sets the stage (`declared_for`), which must pass as any other."""
        if self.declared_for and prompt not in self.declared_for:
            return None
        return self.declared

    @property
    def ends_its_session(self) -> bool:
        """An expected ERROR is an instance dying, and a rerun on kept storage stops the shared
        session: run such a scenario after the others of its topology (the pool starts the
        topology again for anything later, and says why)."""
        return Verdict.ERROR in self.expect or self.rerun_on_kept_storage


def image_prompt(name: str, *seeds: int, text: str = TAIL_TEXT, **extra) -> PromptSpec:
    parts = tuple(ImagePart(seed=s) for s in seeds) + (TextPart(text),)
    return PromptSpec(name, parts, extra=tuple(extra.items()))


# Sent all at once, unstreamed and streamed: four requests of every media kind in flight.
CONCURRENT_PROMPTS = (
    image_prompt("m-concurrent-a", 31),
    image_prompt("m-concurrent-b", 32, 33),
    PromptSpec("m-concurrent-c", (VideoPart(seed=34), TextPart(TAIL_TEXT))),
    PromptSpec("m-concurrent-text", (TextPart(LONG_TEXT),)),
)

MATRIX: tuple[Scenario, ...] = (
    # -- 1E+1PD: EC transfer alone ------------------------------------------------------------
    Scenario(
        "ec-images-1-2-3",
        "1E+1PD",
        (
            image_prompt("m-one-image", 11),
            image_prompt("m-two-images", 12, 13),
            image_prompt("m-three-images", 14, 15, 16),
        ),
        ci=True,
    ),
    Scenario(
        "ec-same-image-twice-in-request", "1E+1PD", (image_prompt("m-same-image-twice", 17, 17),)
    ),
    Scenario(
        "ec-same-image-across-requests",
        "1E+1PD",
        (
            image_prompt("m-repeat-a", 18),
            PromptSpec("m-repeat-b", (ImagePart(seed=18), TextPart(TAIL_TEXT + " Again."))),
        ),
    ),
    Scenario(
        "ec-video-mp4",
        "1E+1PD",
        (PromptSpec("m-video-mp4", (VideoPart(seed=21), TextPart(TAIL_TEXT))),),
    ),
    Scenario(
        "ec-video-jpeg-frames-default-fps",
        "1E+1PD",
        (PromptSpec("m-video-jpeg-frames", (VideoFramesPart(seed=22), TextPart(TAIL_TEXT))),),
        expect=(Verdict.MISMATCH,),
        expect_evidence="generated tokens differ",
        reason="Qwen2.5-VL video positions use second_per_grid_ts, which the encoder does not "
        "publish as metadata: the consumer assumes 1.0 (qwen2_5_vl.py), while the baseline "
        "derives 2.0 from JPEG frames' default 1 fps. Prompt ids still match; the tokens differ "
        "because the positions are wrong, not by numeric noise: a MISMATCH, never a DRIFT.",
    ),
    Scenario(
        "ec-video-jpeg-frames-at-2-fps",
        "1E+1PD",
        (
            PromptSpec(
                "m-video-jpeg-frames-2fps",
                (VideoFramesPart(seed=22), TextPart(TAIL_TEXT)),
                extra=(("media_io_kwargs", {"video": {"fps": 2.0}}),),
            ),
        ),
    ),  # the control: at 2 fps second_per_grid_ts is 1.0 on both sides
    Scenario(
        "ec-video-mp4-not-at-2-fps",
        "1E+1PD",
        (
            PromptSpec(
                "m-video-mp4-1fps", (VideoPart(seed=26, num_frames=8, fps=1.0), TextPart(TAIL_TEXT))
            ),
        ),
        expect=(Verdict.MISMATCH,),
        expect_evidence="generated tokens differ",
        reason="the JPEG frames' cause (found by epd-harness fuzz): an mp4 whose frames "
        "cannot be sampled to 2 fps (recorded at 1 fps; or 4 frames at 3 fps, which the "
        "loader's minimum of 4 frames keeps) gives the baseline second_per_grid_ts 2 / fps, "
        "while the consumer, which the encoder does not tell, assumes 1.0: the video's "
        "temporal positions differ (harness/run/fuzz/video_timing.py)",
    ),
    Scenario(
        "ec-video-fps-4",
        "1E+1PD",
        (
            PromptSpec(
                "m-video-fps4", (VideoPart(seed=23, num_frames=16, fps=4.0), TextPart(TAIL_TEXT))
            ),
        ),
    ),
    Scenario(
        "ec-per-request-media-kwargs",
        "1E+1PD",
        (
            # 224x224 is 28*28*64 pixels: a cap of 28*28*16 makes the grid [1, 8, 8], so the
            # kwarg visibly changes the prompt (its ids are compared with the baseline's).
            image_prompt("m-max-pixels", 24, mm_processor_kwargs={"max_pixels": 28 * 28 * 16}),
            PromptSpec(
                "m-video-fps-kwarg",
                (VideoPart(seed=25, num_frames=8), TextPart(TAIL_TEXT)),
                extra=(("mm_processor_kwargs", {"fps": 1.0}),),
            ),
        ),
    ),
    # One image under three kwarg sets, one request after another on one session: the proxy's
    # key is the item's URL (as upstream's), so only the engine's own derivation (uuid hashed
    # with the kwargs) keeps the sets apart. An engine that left a kwarg out of the key (#56786)
    # would hand the later requests the first one's embeddings (the 224x224 image is 64 image
    # tokens plain, 16 under a cap of 28*28*16 pixels, 36 under 28*28*36): ERROR or MISMATCH
    # here, through the harness's proxy and vLLM's alike.
    Scenario(
        "ec-same-image-across-kwargs",
        "1E+1PD",
        (
            image_prompt("m-kwargs-image-plain", 27),
            image_prompt(
                "m-kwargs-image-16-tokens", 27, mm_processor_kwargs={"max_pixels": 28 * 28 * 16}
            ),
            image_prompt(
                "m-kwargs-image-36-tokens", 27, mm_processor_kwargs={"max_pixels": 28 * 28 * 36}
            ),
        ),
    ),
    Scenario(
        "ec-concurrent-requests",
        "1E+1PD",
        CONCURRENT_PROMPTS,
        mode=SendMode.CONCURRENT,
    ),
    Scenario(
        "ec-streamed-concurrent",
        "1E+1PD",
        CONCURRENT_PROMPTS,
        mode=SendMode.CONCURRENT,
        stream=True,
    ),
    Scenario(
        "ec-idle-over-keepalive",
        "1E+1PD",
        (
            image_prompt("m-idle-a", 35),
            image_prompt("m-idle-b", 36),
        ),
        mode=SendMode.IDLE_GAPS,
    ),
    Scenario(
        "ec-rerun-on-kept-storage",
        "1E+1PD",
        (image_prompt("m-one-image", 11),),
        rerun_on_kept_storage=True,
    ),
    # -- 2E+1PD: round-robin fan-out ----------------------------------------------------------
    Scenario(
        "ec-two-encoders-round-robin",
        "2E+1PD",
        (
            image_prompt("m-rr-a", 41),
            image_prompt("m-rr-b", 42),
            image_prompt("m-rr-c", 43),
            image_prompt("m-rr-two", 44, 45),
        ),
        require_every_encoder=True,
    ),
    # -- 1E+1P+1D: EC then KV -----------------------------------------------------------------
    Scenario(
        "epd-images-video-long-text",
        "1E+1P+1D",
        (
            image_prompt("m-one-image", 11),
            image_prompt("m-image-long-text", 51, text=LONG_TEXT),
            PromptSpec("m-video-mp4", (VideoPart(seed=21), TextPart(TAIL_TEXT))),
            PromptSpec("m-text-only", (TextPart(LONG_TEXT),)),
        ),
        ci=True,
    ),
    Scenario(
        "epd-streamed",
        "1E+1P+1D",
        (
            image_prompt("m-one-image", 11),
            PromptSpec("m-video-mp4", (VideoPart(seed=21), TextPart(TAIL_TEXT))),
            PromptSpec("m-text-only", (TextPart(LONG_TEXT),)),
        ),
        ci=True,
        stream=True,
    ),
    Scenario(
        "epd-media-in-decode-tail",
        "1E+1P+1D",
        (image_prompt("m-image-short-text", 52, text=SHORT_TEXT),),
        expect=(Verdict.ERROR,),
        expect_evidence="Expected number of multimodal embeddings to match",
        reason="vLLM 0.32: with ExampleConnector D recomputes the last partial block; media "
        "placeholders there need embeddings D never received (metadata-only rewrite), and "
        "D's engine dies",
        ci=True,
        # NIXL hands D the whole prompt's KV, so D computes only the last (text) token
        # (docs/connectors.md, measured with --kv-connector nixl).
        expect_by_kv_connector=(("NixlConnector", (Verdict.MATCH,)),),
    ),
    # Found by `epd-harness fuzz` (docs/fuzzing.md): at n = k*32 + 1 prompt tokens (block 32;
    # the texts are sized on the tiny model) ExampleConnector's P stores k blocks and D looks
    # up k - 1 (harness/run/fuzz/consumer.py). D finds none of P's KV and computes the prompt
    # itself: media kill it, text is answered right with no KV moved.
    Scenario(
        "epd-kv-lookup-miss-media",
        "1E+1P+1D",
        (image_prompt("m-image-at-block-plus-one", 53, text=TAIL_TEXT + " Thanks."),),
        expect=(Verdict.ERROR,),
        expect_evidence="Expected number of multimodal embeddings to match",
        reason=KV_LOOKUP_MISS
        + "; the image lies in the part D computes itself, with no embeddings, and D's "
        "engine dies (the decode-tail assertion, with the image far from D's tail)",
        expect_by_kv_connector=(("NixlConnector", (Verdict.MATCH,)),),
    ),
    Scenario(
        "epd-kv-lookup-miss-text",
        "1E+1P+1D",
        (PromptSpec("m-text-at-block-plus-one", (TextPart(TAIL_TEXT + " Please be brief."),)),),
        expect=(Verdict.VACUOUS,),
        expect_evidence="tokens equal but guard failed: kv_transfer",
        reason=KV_LOOKUP_MISS
        + "; D computes the text itself and answers right, but no KV reached it: D's "
        "cached_tokens stays below the block-aligned prefix",
        expect_by_kv_connector=(("NixlConnector", (Verdict.MATCH,)),),
        empty_kv_storage=True,
    ),
    # The same prompt after one that stored the shorter key (the sweep's text prompt, 121
    # tokens: P stores its first 96): P runs D's lookup too, finds that folder, and loads the
    # folder of the longer key, which nobody wrote. Found on real vLLM, when the sweep had run
    # on the matrix's 1E+1P+1D before epd-kv-lookup-miss-text.
    Scenario(
        "epd-kv-lookup-miss-kills-prefill",
        "1E+1P+1D",
        (
            PromptSpec("m-text-stores-the-lookup-key", (TextPart(TAIL_TEXT),)),
            PromptSpec("m-text-at-block-plus-one", (TextPart(TAIL_TEXT + " Please be brief."),)),
        ),
        expect=(Verdict.ERROR,),
        declared_for=("m-text-at-block-plus-one",),
        expect_evidence="FileNotFoundError: No such file or directory",
        reason=KV_PREFILL_LOAD_MISS,
        expect_by_kv_connector=(("NixlConnector", (Verdict.MATCH,)),),
        empty_kv_storage=True,
    ),
)


# Scenarios `epd-harness fuzz --save` wrote: each a minimal request a fuzz run found failing,
# declared with its verdict, evidence and cause (harness.run.fuzz.save); appended to MATRIX.
FOUND_SCENARIOS_FILE = Path(__file__).with_name("found_scenarios.json")


def found_scenarios(path: Path = FOUND_SCENARIOS_FILE) -> tuple[Scenario, ...]:
    """The saved scenarios; an unreadable file is an error, never an empty matrix."""
    if not path.exists():
        return ()
    entries = json.loads(path.read_text())
    return tuple(
        Scenario(
            name=entry["name"],
            topology=entry["topology"],
            prompts=tuple(prompt_from_json(p) for p in entry["prompts"]),
            expect=tuple(Verdict(v) for v in entry["expect"]),
            expect_evidence=entry.get("expect_evidence", ""),
            reason=entry.get("reason", ""),
            expect_by_kv_connector=elsewhere_expected(entry),
            stream=bool(entry.get("stream", False)),
        )
        for entry in entries
    )


def elsewhere_expected(entry: dict) -> tuple[tuple[str, tuple[Verdict, ...]], ...]:
    """A saved failure of a topology with a P->D hop is declared under the KV connector it
    was found under (`found_by`, as `fuzz --save` records it), and expected to MATCH under
    the others, as the built-in scenarios say with `expect_by_kv_connector`: declared under
    every connector, an ExampleConnector failure failed a NixlConnector run's matrix as
    'NOT as declared' (found in review). An entry that does not say, or a topology without
    a P->D hop, keeps its declaration under every connector."""
    found_under = (entry.get("found_by") or {}).get("kv_connector")
    topology = TOPOLOGIES.get(entry["topology"])
    if not found_under or topology is None or not topology.has_kv_transfer:
        return ()
    return tuple(
        (connector.vllm_class, (Verdict.MATCH,))
        for connector in KV_CONNECTORS.values()
        if connector.vllm_class != found_under
    )


MATRIX = MATRIX + found_scenarios()


def matrix_prompts(scenarios: tuple[Scenario, ...] = MATRIX) -> tuple[PromptSpec, ...]:
    """Every distinct prompt of the scenarios, for the baseline to answer once."""
    by_name: dict[str, PromptSpec] = {}
    for scenario in scenarios:
        for prompt in scenario.prompts:
            if by_name.setdefault(prompt.name, prompt) != prompt:
                raise ValueError(f"prompt name {prompt.name!r} is used for two different prompts")
    return tuple(by_name.values())


def attached_prompt(
    name: str, topology: str, kv_connector: str, stream: bool
) -> tuple[PromptSpec, DeclaredFailure | None] | None:
    """A matrix scenario's prompt named with `--prompt` on an attached deployment of
    `topology` (`run --attach FILE`, as `repro --keep-up` leaves one): its spec, and the failure
    its scenario declares (under `kv_connector`, a vLLM class name), which the case is judged
    under as the scenario's run judged it. None: no scenario's prompt.

    Only where one request alone is the scenario (on its topology, sent alone, streamed as it
    streams, on whatever KV storage the deployment holds) is the declaration the same claim;
    elsewhere a declared failure judged without it reads as a new one, and is refused in favour
    of running the scenario itself."""
    owners = [s for s in MATRIX if any(p.name == name for p in s.prompts)]
    if not owners:
        return None
    spec = next(p for p in owners[0].prompts if p.name == name)
    for scenario in (s.for_kv_connector(kv_connector) for s in owners):
        declared = scenario.declared_of(name)
        if declared is None:
            continue
        alone = (
            len(scenario.prompts) == 1
            and scenario.mode is SendMode.SEQUENTIAL
            and not scenario.rerun_on_kept_storage
            and not scenario.require_every_encoder
            # On an emptied KV storage: the matrix empties it first, an attached
            # deployment's is not the harness's to empty (found in review).
            and not scenario.empty_kv_storage
            and (stream or not scenario.stream)
        )
        if alone and scenario.topology == topology:
            return spec, declared
        raise BadInput(
            f"--prompt {name}: matrix scenario {scenario.name} declares it fails "
            f"({declared.verdict}) on {scenario.topology} as the scenario sends it, which one "
            f"request to this {topology} is not: run 'epd-harness run --scenario "
            f"{scenario.name}' instead"
        )
    return spec, None


def get_scenario(name: str) -> Scenario:
    return lookup("scenario", name, {s.name: s for s in MATRIX})
