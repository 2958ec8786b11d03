"""The EPD scenario matrix: declarative scenarios, each a topology + prompts + how to send them
+ the verdict expected, covering the ways EPD has really broken (see failure-modes notes).

A scenario normally expects MATCH. Where vLLM itself is known to fail, the scenario says so:
`expect` names the verdict, `expect_evidence` a string the evidence must contain, `reason` the
upstream cause. Such a scenario passes only while the failure looks exactly like that, so a fix
upstream (or a different failure) turns it red instead of going unnoticed.

Scenarios of one topology share one running session, in order; a scenario after one that
killed an instance gets a fresh session, so one crash does not fail the rest of the run.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from harness.compare import EXACT, Policy, Verdict
from harness.guards import GuardResult
from harness.judge import judge_case
from harness.prompts import (
    SHORT_TEXT,
    TAIL_TEXT,
    ImagePart,
    PromptSpec,
    TextPart,
    VideoFramesPart,
    VideoPart,
)
from harness.report import CaseRecord
from harness.runner import Outcome, TopologySession
from harness.sweep import Sweep
from harness.topology import TOPOLOGIES

# vLLM closes idle keep-alive connections after 5 s (#41567): wait longer than that.
IDLE_GAP_S = 6.0
LONG_TEXT = " ".join([TAIL_TEXT] * 3)


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
    policy: Policy = EXACT
    # The verdicts this scenario may end with; anything but MATCH needs a reason.
    expect: tuple[Verdict, ...] = (Verdict.MATCH,)
    expect_evidence: str = ""  # must appear in the failing record's error / explanation
    reason: str = ""  # why a verdict other than MATCH is expected (the upstream cause)
    # Start a fresh session on the storage the previous one left (encoder-cache hits, #51222).
    rerun_on_kept_storage: bool = False
    # Every encoder must have received work (round-robin across requests, #52484).
    require_every_encoder: bool = False
    ci: bool = False  # part of CI's representative subset

    @property
    def effective_policy(self) -> Policy:
        """A documented upstream failure passes as its expected verdict (the evidence is
        checked separately); everything else is judged by the scenario's policy."""
        if self.expect == (Verdict.MATCH,):
            return self.policy
        return Policy(frozenset(self.expect))


@dataclass
class ScenarioResult:
    scenario: Scenario
    records: list[CaseRecord] = field(default_factory=list)
    checks: list[GuardResult] = field(default_factory=list)

    def problems(self) -> list[str]:
        """Why the scenario did not behave as declared; empty when it did."""
        found = []
        expected = self.scenario.expect
        wanted = "/".join(v.value for v in expected)
        for record in self.records:
            if record.verdict not in expected:
                found.append(f"{record.prompt}: expected {wanted}, got "
                             f"{record.verdict.value}: {record.detail}")  # fmt: skip
            elif record.verdict is Verdict.MATCH and not record.policy_passed:
                found.append(f"{record.prompt}: policy rejected {record.verdict.value}")
            elif self.scenario.expect_evidence:
                evidence = f"{record.error or ''}\n{record.explanation}"
                if self.scenario.expect_evidence not in evidence:
                    found.append(f"{record.prompt}: {record.verdict.value} as expected, but the "
                                 f"evidence lacks {self.scenario.expect_evidence!r}")  # fmt: skip
        found += [f"check {c.name} failed: {c.evidence}" for c in self.checks if not c.ok]
        return found


def image_prompt(name: str, *seeds: int, text: str = TAIL_TEXT, **extra) -> PromptSpec:
    parts = tuple(ImagePart(seed=s) for s in seeds) + (TextPart(text),)
    return PromptSpec(name, parts, extra=tuple(extra.items()))


MATRIX: tuple[Scenario, ...] = (
    # -- 1E+1PD: EC transfer alone ------------------------------------------------------------
    Scenario("ec-images-1-2-3", "1E+1PD", (
        image_prompt("m-one-image", 11),
        image_prompt("m-two-images", 12, 13),
        image_prompt("m-three-images", 14, 15, 16),
    ), ci=True),  # fmt: skip
    Scenario("ec-same-image-twice-in-request", "1E+1PD",
             (image_prompt("m-same-image-twice", 17, 17),)),  # fmt: skip
    Scenario("ec-same-image-across-requests", "1E+1PD", (
        image_prompt("m-repeat-a", 18),
        PromptSpec("m-repeat-b", (ImagePart(seed=18), TextPart(TAIL_TEXT + " Again."))),
    )),  # fmt: skip
    Scenario("ec-video-mp4", "1E+1PD", (
        PromptSpec("m-video-mp4", (VideoPart(seed=21), TextPart(TAIL_TEXT))),
    )),  # fmt: skip
    Scenario(
        "ec-video-jpeg-frames-default-fps",
        "1E+1PD",
        (PromptSpec("m-video-jpeg-frames", (VideoFramesPart(seed=22), TextPart(TAIL_TEXT))),),
        expect=(Verdict.DRIFT, Verdict.MISMATCH),
        expect_evidence="generated tokens differ",
        reason="Qwen2.5-VL video positions use second_per_grid_ts, which the encoder does not "
        "publish as metadata: the consumer assumes 1.0 (qwen2_5_vl.py), while the baseline "
        "derives 2.0 from JPEG frames' default 1 fps. Prompt ids still match; tokens drift.",
    ),
    Scenario("ec-video-jpeg-frames-at-2-fps", "1E+1PD", (
        PromptSpec("m-video-jpeg-frames-2fps", (VideoFramesPart(seed=22), TextPart(TAIL_TEXT)),
                   extra=(("media_io_kwargs", {"video": {"fps": 2.0}}),)),
    )),  # fmt: skip  (the control: at 2 fps second_per_grid_ts is 1.0 on both sides)
    Scenario("ec-video-fps-4", "1E+1PD", (
        PromptSpec("m-video-fps4", (VideoPart(seed=23, num_frames=16, fps=4.0),
                                    TextPart(TAIL_TEXT))),
    )),  # fmt: skip
    Scenario("ec-per-request-media-kwargs", "1E+1PD", (
        # 224x224 is 28*28*64 pixels: a cap of 28*28*16 makes the grid [1, 8, 8], so the
        # kwarg visibly changes the prompt (its ids are compared with the baseline's).
        image_prompt("m-max-pixels", 24, mm_processor_kwargs={"max_pixels": 28 * 28 * 16}),
        PromptSpec("m-video-fps-kwarg", (VideoPart(seed=25, num_frames=8), TextPart(TAIL_TEXT)),
                   extra=(("mm_processor_kwargs", {"fps": 1.0}),)),
    )),  # fmt: skip
    Scenario("ec-concurrent-requests", "1E+1PD", (
        image_prompt("m-concurrent-a", 31),
        image_prompt("m-concurrent-b", 32, 33),
        PromptSpec("m-concurrent-c", (VideoPart(seed=34), TextPart(TAIL_TEXT))),
        PromptSpec("m-concurrent-text", (TextPart(LONG_TEXT),)),
    ), mode=SendMode.CONCURRENT),  # fmt: skip
    Scenario("ec-idle-over-keepalive", "1E+1PD", (
        image_prompt("m-idle-a", 35),
        image_prompt("m-idle-b", 36),
    ), mode=SendMode.IDLE_GAPS),  # fmt: skip
    Scenario("ec-rerun-on-kept-storage", "1E+1PD", (image_prompt("m-one-image", 11),),
             rerun_on_kept_storage=True),  # fmt: skip
    # -- 2E+1PD: round-robin fan-out ----------------------------------------------------------
    Scenario("ec-two-encoders-round-robin", "2E+1PD", (
        image_prompt("m-rr-a", 41),
        image_prompt("m-rr-b", 42),
        image_prompt("m-rr-c", 43),
        image_prompt("m-rr-two", 44, 45),
    ), require_every_encoder=True),  # fmt: skip
    # -- 1E+1P+1D: EC then KV -----------------------------------------------------------------
    Scenario("epd-images-video-long-text", "1E+1P+1D", (
        image_prompt("m-one-image", 11),
        image_prompt("m-image-long-text", 51, text=LONG_TEXT),
        PromptSpec("m-video-mp4", (VideoPart(seed=21), TextPart(TAIL_TEXT))),
        PromptSpec("m-text-only", (TextPart(LONG_TEXT),)),
    ), ci=True),  # fmt: skip
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
    ),
)


def matrix_prompts(scenarios: tuple[Scenario, ...] = MATRIX) -> tuple[PromptSpec, ...]:
    """Every distinct prompt of the scenarios, for the baseline to answer once."""
    by_name: dict[str, PromptSpec] = {}
    for scenario in scenarios:
        for prompt in scenario.prompts:
            if by_name.setdefault(prompt.name, prompt) != prompt:
                raise ValueError(f"prompt name {prompt.name!r} is used for two different prompts")
    return tuple(by_name.values())


def get_scenario(name: str) -> Scenario:
    for scenario in MATRIX:
        if scenario.name == name:
            return scenario
    raise ValueError(f"unknown scenario {name!r} (known: {', '.join(s.name for s in MATRIX)})")


class MatrixRun:
    """Runs scenarios against a shared sweep's baseline, one topology session at a time."""

    def __init__(self, sweep: Sweep, log: Callable[[str], None] = print):
        self.sweep = sweep
        self.log = log
        self.results: dict[str, ScenarioResult] = {}
        self._session: TopologySession | None = None

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    def run(self, scenario: Scenario) -> ScenarioResult:
        if scenario.name not in self.results:
            self.results[scenario.name] = self._run(scenario)
        return self.results[scenario.name]

    def _session_for(self, topology_name: str) -> TopologySession:
        """The open session of this topology, or a new one (closing any other first: memory)."""
        session = self._session
        healthy = session is not None and session.dead_instance_report() is None
        if session is not None and (session.topology.name != topology_name or not healthy):
            self.close()
        if self._session is None:
            self.log(f"[matrix] starting {topology_name}")
            self._session = TopologySession(
                TOPOLOGIES[topology_name],
                self.sweep.settings,
                on_event=self.sweep.on_event,
                label=f"matrix-{topology_name}",
            ).__enter__()
        return self._session

    def _run(self, scenario: Scenario) -> ScenarioResult:
        baseline = self.sweep.baseline()
        session = self._session_for(scenario.topology)
        outcomes = self._send(session, scenario)
        result = self._judge(scenario, session, outcomes, baseline)
        if scenario.rerun_on_kept_storage:
            kept = session.storage_dir
            self.close()
            self.log(f"[matrix] {scenario.name}: rerun on the storage the last session left")
            with TopologySession(
                TOPOLOGIES[scenario.topology],
                self.sweep.settings,
                on_event=self.sweep.on_event,
                label=f"matrix-{scenario.topology}-rerun",
                reuse_storage=kept,
            ) as rerun:
                rerun_result = self._judge(scenario, rerun, self._send(rerun, scenario), baseline)
            result.records += rerun_result.records
            result.checks += rerun_result.checks
        for record in result.records:
            self.log(f"[matrix] {scenario.name} {record.prompt}: {record.verdict.value} "
                     f"({record.detail})")  # fmt: skip
        return result

    def _send(self, session: TopologySession, scenario: Scenario) -> list[Outcome]:
        bodies = [(p.name, self.sweep.bodies[p.name]) for p in scenario.prompts]
        if scenario.mode is SendMode.CONCURRENT:
            with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
                return list(pool.map(lambda item: session.send(*item), bodies))
        outcomes = []
        for index, (name, body) in enumerate(bodies):
            if scenario.mode is SendMode.IDLE_GAPS and index:
                time.sleep(IDLE_GAP_S)
            outcomes.append(session.send(name, body))
        return outcomes

    def _judge(
        self,
        scenario: Scenario,
        session: TopologySession,
        outcomes: list[Outcome],
        baseline: dict[str, Outcome],
    ) -> ScenarioResult:
        result = ScenarioResult(scenario)
        for outcome in outcomes:
            guards = session.transfer_guards(outcome)
            result.records.append(
                judge_case(
                    f"{scenario.topology}:{scenario.name}",
                    "baseline",
                    baseline[outcome.prompt],
                    outcome,
                    guards,
                    policy=scenario.effective_policy,
                    baseline_stable=self.sweep.stability[outcome.prompt][0],
                )
            )
        if scenario.require_every_encoder:
            result.checks.append(check_every_encoder_used(session, outcomes))
        self._record(scenario, outcomes, result)
        return result

    def _record(self, scenario: Scenario, outcomes: list[Outcome], result: ScenarioResult) -> None:
        """Into the sweep's artifacts (responses.json, summary.json, report) as they come."""
        key = f"matrix:{scenario.name}"
        self.sweep.result.outcomes.setdefault(key, {}).update({o.prompt: o for o in outcomes})
        self.sweep.result.records.extend(result.records)
        self.sweep.write_outputs()


def check_every_encoder_used(session: TopologySession, outcomes: list[Outcome]) -> GuardResult:
    encoders = {spec.url for spec in session.instances if spec.role.is_ec_producer}
    used = {
        call.url
        for outcome in outcomes
        if outcome.trace is not None
        for call in outcome.trace.encoder_calls
    }
    return GuardResult(
        "every_encoder_used",
        encoders <= used,
        f"encoders {sorted(encoders)}; received work: {sorted(used)}",
    )
