"""Known upstream failures, as the fuzzer recognises them.

The declarations are the matrix's (a scenario expecting a verdict other than MATCH, as judged
under the run's KV connector) and the protocol generations' (`KnownFailure`, per release). A
failing example is known when its verdict and evidence are the declared ones *and* the request
has the declared trigger: a MISMATCH on an image-only request is not the video-timing bug,
whatever its verdict. A declared signature seen without its trigger is reported as new, with
that said, since the declaration then no longer describes what happened.

A trigger is read from the request and its exact prompt layout (the baseline's ids), before
the topology is sent anything: for a crash that is what lets the fuzzer skip examples it
knows will kill D again (each kill costs a restart) once the prediction has been confirmed.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass

from harness.judge.records import CaseRecord, Verdict
from harness.judge.verdicts import excuses_guard, shows_declared
from harness.run.fuzz.layout import PromptLayout
from harness.run.fuzz.video_timing import video_positions_differ
from harness.run.scenarios import MATRIX, Scenario
from harness.spec.generations import KnownFailure, ProtocolGeneration, known_failure
from harness.spec.prompts import CACHE_SALT, PromptSpec, VideoFramesPart, VideoPart
from harness.spec.topology import TOPOLOGIES, Topology

Trigger = Callable[[PromptSpec, PromptLayout | None], bool]


def media_in_decode_tail(spec: PromptSpec, layout: PromptLayout | None) -> bool:
    """A placeholder in the partial block a block-aligned KV consumer recomputes."""
    return layout is not None and layout.media_in_decode_tail


def media_past_kv_miss(spec: PromptSpec, layout: PromptLayout | None) -> bool:
    """n = k * block + 1 tokens (D misses P's KV) and a placeholder past what D holds."""
    return layout is not None and layout.media_past_kv_miss


def kv_short_without_media(spec: PromptSpec, layout: PromptLayout | None) -> bool:
    """n = k * block + 1 tokens, D holds less than the transfer, and computes the rest: no
    placeholder past what it holds, or the media itself at hand (1P+1D's D gets them raw)."""
    return (
        layout is not None
        and layout.kv_short_of_transfer
        and (layout.decode_has_media or not layout.media_past_kv_miss)
    )


def prefill_loads_missing_kv(spec: PromptSpec, layout: PromptLayout | None) -> bool:
    """P's lookup finds a folder an earlier request stored, and the folder it then loads was
    never written (the requests sent to the topology before decide it)."""
    return layout is not None and layout.prefill_loads_missing


def frames_timing_differs(spec: PromptSpec, layout: PromptLayout | None) -> bool:
    """A video given as JPEG frames whose temporal positions a consumer gets wrong (read at
    another rate than 2 fps: by default 1)."""
    return any(
        isinstance(p, VideoFramesPart) and video_positions_differ(p, spec) for p in spec.parts
    )


def mp4_timing_differs(spec: PromptSpec, layout: PromptLayout | None) -> bool:
    """An mp4 video whose sampled rate moves a temporal position (recorded below 2 fps)."""
    return any(isinstance(p, VideoPart) and video_positions_differ(p, spec) for p in spec.parts)


# The trigger of each declared scenario, by name; a scenario without one is recognised by its
# verdict and evidence alone.
SCENARIO_TRIGGERS: dict[str, tuple[str, Trigger]] = {
    "epd-media-in-decode-tail": (
        "a placeholder in D's recomputed tail (prompt layout from the baseline's ids)",
        media_in_decode_tail,
    ),
    "epd-kv-lookup-miss-media": (
        "n = k*block+1 prompt tokens (D looks up one block less than P stored) and a "
        "placeholder past what D holds",
        media_past_kv_miss,
    ),
    "epd-kv-lookup-miss-text": (
        "n = k*block+1 prompt tokens and no placeholder past what D holds (or D has the media)",
        kv_short_without_media,
    ),
    "epd-kv-lookup-miss-kills-prefill": (
        "P's lookup (align(n-1)) finds a folder an earlier request stored and the folder of "
        "align(n) tokens it loads was never written",
        prefill_loads_missing_kv,
    ),
    "ec-video-jpeg-frames-default-fps": (
        "a video as JPEG frames whose temporal positions move at its rate (not 2 fps)",
        frames_timing_differs,
    ),
    "ec-video-mp4-not-at-2-fps": (
        "an mp4 sampled at a rate that moves a temporal position (not 2 fps)",
        mp4_timing_differs,
    ),
}


@dataclass(frozen=True)
class KnownRule:
    name: str  # "scenario NAME" or "release GENERATION"
    verdict: str
    evidence: str
    reason: str
    trigger_text: str = ""
    trigger: Trigger | None = None

    @property
    def crash(self) -> bool:
        return self.verdict == Verdict.ERROR.value

    def predicts(self, spec: PromptSpec, layout: PromptLayout | None) -> bool:
        return self.trigger is not None and self.trigger(spec, layout)

    def signature_matches(self, record: CaseRecord) -> bool:
        """The declared verdict, and the evidence where the matrix reads it (`_as_declared`):
        the start of the case's detail, or inside the topology's own error. Anywhere in the
        detail, a prompt-ids MISMATCH ('prompt ids differ ...; generated tokens differ ...')
        was the video-timing declaration, whose prompt ids match (found in review). And no
        failed guard the declaration does not excuse (`excuses_guard`, the matrix's rule):
        one beside it is another failure, new (found in review: a known MISMATCH with its
        EC guard failed exited 0)."""
        unexcused = [g for g in record.failed_guards() if not excuses_guard(self, g)]
        return shows_declared(record, self, record.error) and not unexcused

    def to_json(self) -> dict[str, str]:
        return {
            "name": self.name,
            "verdict": self.verdict,
            "evidence": self.evidence,
            "reason": self.reason,
            "trigger": self.trigger_text or "(none declared: by verdict and evidence alone)",
        }


def rules_for(
    topology: Topology, kv_connector: str, generation: ProtocolGeneration
) -> list[KnownRule]:
    """Every declared failure that applies to `topology` under this connector and release."""
    rules = [
        _scenario_rule(s.for_kv_connector(kv_connector))
        for s in MATRIX
        if declared_for(
            TOPOLOGIES[s.topology], topology, text_only=not any(p.media_count for p in s.prompts)
        )
    ]
    rules = [r for r in rules if r is not None]
    if topology.encoders:  # a release's failures are of its encoder path (`known_failure`)
        for failure in generation.known_failures:
            rules.append(_generation_rule(generation, topology, failure))
    return rules


def declared_for(declared: Topology, fuzzed: Topology, text_only: bool = False) -> bool:
    """A scenario's failure applies to its own topology; one declared on an encoder topology
    without KV transfer (the EC path alone: 1E+1PD) applies to every encoder topology, since
    the same encoder and consumer code serve them (1E+1P+1D's P is that consumer); and one
    whose requests are all text, declared on a topology that moves KV, applies to every
    topology that moves KV: no encoder takes part in them, only P's and D's KV connector (a
    1P+1D fuzz met epd-kv-lookup-miss-text's VACUOUS and called it new)."""
    if declared.name == fuzzed.name:
        return True
    ec_only = declared.has_ec_transfer and not declared.has_kv_transfer
    if ec_only and fuzzed.has_ec_transfer:
        return True
    return text_only and declared.has_kv_transfer and fuzzed.has_kv_transfer


def _scenario_rule(scenario: Scenario) -> KnownRule | None:
    if Verdict.MATCH in scenario.expect:
        return None
    text, trigger = SCENARIO_TRIGGERS.get(scenario.name, ("", None))
    if trigger is None:
        # A scenario `fuzz --save` wrote: its evidence is as broad as "generated tokens
        # differ", so by verdict and evidence alone it would call every later failure of its
        # verdict known (found in review). It stands for its own request: the same parts and
        # request fields (media kwargs), any media seeds or cache salt.
        text, trigger = (
            "a request of its shape (the same parts and request fields, any media seeds or salt)",
            _same_shape(scenario),
        )
    return KnownRule(
        name=f"scenario {scenario.name}",
        verdict=scenario.expect[0].value,
        evidence=scenario.expect_evidence,
        reason=scenario.reason,
        trigger_text=text,
        trigger=trigger,
    )


def _shape(spec: PromptSpec) -> tuple:
    """Its parts, any media seeds, and its extra fields but the cache salt (a saved
    scenario drops it): media kwargs can be a failure's whole cause."""
    parts = tuple(
        dataclasses.replace(part, seed=0) if hasattr(part, "seed") else part for part in spec.parts
    )
    extra = sorted(json.dumps([k, v], sort_keys=True) for k, v in spec.extra if k != CACHE_SALT)
    return parts, tuple(extra)


def _same_shape(scenario: Scenario) -> Trigger:
    shapes = {_shape(prompt) for prompt in scenario.prompts}

    def trigger(spec: PromptSpec, layout: PromptLayout | None) -> bool:
        return _shape(spec) in shapes

    return trigger


def _generation_rule(
    generation: ProtocolGeneration, topology: Topology, failure: KnownFailure
) -> KnownRule:
    def trigger(spec: PromptSpec, layout: PromptLayout | None) -> bool:
        return known_failure(generation, topology, spec) == failure

    return KnownRule(
        name=f"release {generation.name}",
        verdict=failure.verdict,
        evidence=failure.evidence,
        reason=failure.reason,
        trigger_text=f"{failure.media} through an encoder on {generation.version_range}",
        trigger=trigger,
    )


@dataclass(frozen=True)
class Recognition:
    """How a failing example relates to the declarations."""

    rule: KnownRule | None  # the declaration it is (None: new)
    outside_trigger: KnownRule | None = None  # a declaration whose signature it has, untriggered
    # A declaration whose trigger holds and whose verdict it has, its evidence not in the error
    # (an attached deployment shows no log, where vLLM writes it): new, and said to be likely it.
    unseen_evidence: KnownRule | None = None

    @property
    def known(self) -> bool:
        return self.rule is not None


def recognise(
    rules: list[KnownRule], record: CaseRecord, spec: PromptSpec, layout: PromptLayout | None
) -> Recognition:
    outside = unseen = None
    for rule in rules:
        if not rule.signature_matches(record):
            if record.verdict.value == rule.verdict and rule.predicts(spec, layout):
                unseen = unseen or rule
            continue
        if rule.trigger is None or rule.predicts(spec, layout):
            return Recognition(rule)
        outside = outside or rule
    return Recognition(None, outside, unseen)
