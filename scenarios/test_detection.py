"""The graded self-test: the smallest planted fault the harness still catches, per fault kind.

test_self_test.py shows the harness can fail; this shows how much it can miss. Each fault kind
(harness.run.faults: EC noise, KV noise, swapped items, a zeroed video frame, a wrong video
grid) runs at decreasing strengths on a started topology, each strength on media of its own,
judged against the monolithic baseline. Per fault kind and topology the smallest strength still
caught (MISMATCH, or VACUOUS) goes into the run directory (detection.json, detection.md) and
must be no worse than scenarios/detection_thresholds.json; EC and KV noise at 5% of std must be
a MISMATCH within the first three generated tokens on every topology that carries them.

Each topology is the session's running one (harness.testing.collection: started once for every
scenario that needs it) and serves a clean request first. The shared baseline answers this
module's prompts (harness.run.graded.DETECTION_PROMPTS) with every other scenario's.

The KV ladder follows the session's KV connector (`--epd-kv-connector`, or the platform's
default): noise on ExampleConnector's files, or under NIXL noise planted inside D by a vLLM
plugin that only this module's D is started with (harness.run.faults.nixl_kv_noise_plugin). Each is
marked `kv_connector(...)` and deselected, with a line saying so, under the other connector.
Thresholds gate only on the platform and model they were measured on; elsewhere the table is
reported.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.judge.records import CaseRecord, Verdict
from harness.report.text import format_failure
from harness.run.faults.ec_files import ec_noise, ec_swap_items, ec_zero_frame
from harness.run.faults.kv_files import kv_noise
from harness.run.faults.nixl import (
    NixlKvNoise,
    NixlKvNoiseSite,
    install_nixl_kv_noise_plugin,
    nixl_kv_noise,
)
from harness.run.faults.planted import PlantedFault
from harness.run.faults.relayed import ec_video_grid
from harness.run.graded import (
    CLEAN_PROMPT,
    DETECTION_PROMPTS,
    EC_NOISE_PROMPTS,
    KV_NOISE_PROMPTS,
    NOISE_LADDER,
    PRESENT,
    SWAP_PROMPT,
    VIDEO_GRID_PROMPT,
    ZERO_FRAME_PROMPT,
    DetectionTable,
    Rung,
    load_thresholds,
    measured_on,
    model_key,
    regressions,
    run_ladder,
    rung_from_record,
)
from harness.serve.session import safe_name
from harness.spec.connectors import NIXL
from harness.spec.prompts import PromptSpec
from harness.spec.topology import TOPOLOGIES, Role
from harness.testing.judging import fault_inaction, passed_proven
from harness.testing.live import LiveTopology

pytestmark = pytest.mark.e2e
EPD_BASELINE_PROMPTS = DETECTION_PROMPTS

THRESHOLDS = Path(__file__).with_name("detection_thresholds.json")
# Issue 10's acceptance: 5% noise is a MISMATCH within the first three generated tokens.
ACCEPTANCE_STRENGTH = 0.05
ACCEPTANCE_MAX_INDEX = 2
NOISE_SEED = 10


@dataclass
class Live:
    """A running topology of the session, sending this module's prompts."""

    topology: LiveTopology
    # Under NixlConnector: where D's KV-noise plugin takes its orders (None: not planted).
    nixl_kv_noise: NixlKvNoiseSite | None = None

    @property
    def name(self) -> str:
        return self.topology.name

    @property
    def session(self):
        return self.topology.session

    def judge(self, prompt: PromptSpec, fault: PlantedFault | None) -> tuple[CaseRecord, float]:
        """One request (with `fault` planted, if any), its guards read at once, judged."""
        started = time.monotonic()
        if fault is None:
            observed = self.topology.send(prompt.name)
        else:
            observed = self.topology.send_with_fault(fault, prompt.name)
        seconds = time.monotonic() - started
        record = self.topology.judge(observed)
        print(f"[detection] {self.name} {prompt.name}: {record.verdict.value} in {seconds:.1f}s")
        return record, seconds

    def rung(self, kind: str, strength: float, prompt: PromptSpec, fault: PlantedFault) -> Rung:
        record, seconds = self.judge(prompt, fault)
        assert fault.touched and not fault.problems, fault_inaction(
            f"{kind} {strength:g} on {self.name}", fault, record
        )
        rung = rung_from_record(kind, strength, record, len(fault.touched), fault.effects, seconds)
        if not rung.caught:
            print(format_failure(record))
        print(
            f"[detection]   {kind} {strength:g}: {rung.verdict}, first differing token "
            f"{rung.first_token_index}; {'; '.join(fault.effects[:2])}"
        )
        return rung


@pytest.fixture(scope="session")
def detection_baseline(epd_sweep):
    """The baseline answered this module's prompts, each stable, before any rung is judged."""
    epd_sweep.serve_baseline()
    for prompt in DETECTION_PROMPTS:
        stability = epd_sweep.baseline.stability[prompt.name]
        assert stability.stable, (
            f"the baseline disagreed with itself on {prompt.name}: no threshold means anything"
        )


@pytest.fixture(scope="session")
def detection_table(epd_settings):
    """Every rung of the module; written into the run directory after each ladder and at the
    end, where the bundle carries it, and printed."""
    table = DetectionTable()
    yield table
    if table.rungs:
        table.write(epd_settings.run_dir)
        print("\n[detection] smallest strength caught per fault kind and topology:")
        print(table.to_markdown())
        print(f"[detection] written to {epd_settings.run_dir / 'detection.md'}")


@pytest.fixture
def live(request, epd_live, epd_settings, detection_baseline) -> Live:
    """The session's running topology; under NixlConnector its D gets the KV-noise plugin on
    its PYTHONPATH (it acts only on requests the harness orders it to): other instances than
    the session's plain ones, so the pool starts them as a topology of their own."""
    name = request.cls.TOPOLOGY
    site = None
    if epd_settings.serving.kv_connector == NIXL.vllm_class and TOPOLOGIES[name].has_kv_transfer:
        site = install_nixl_kv_noise_plugin(
            epd_settings.run_dir / f"nixl-kv-noise-{safe_name(name)}"
        )
    role_env = {Role.DECODE: site.env()} if site is not None else None
    return Live(epd_live(name, role_env=role_env), nixl_kv_noise=site)


def committed_thresholds(live: Live) -> dict[str, dict[str, float]] | None:
    """The thresholds measured on this session's platform, model and dtype; None: nothing was
    measured there, so the table is reported and not gated (said so once per ladder)."""
    settings = live.session.settings
    platform, model = settings.platform.name, model_key(settings.serving.model)
    dtype = settings.serving.dtype
    committed = load_thresholds(THRESHOLDS, platform, model, dtype)
    if committed is None:
        print(
            f"[detection] not gated: no thresholds measured on {platform} / {model} / {dtype} "
            f"(measured: {', '.join(measured_on(THRESHOLDS))}); see detection.md"
        )
    return committed


def record_and_check(
    table: DetectionTable, run_dir: Path, kind: str, live: Live, rungs: list[Rung]
) -> None:
    """Into the table (and the run directory), then against the committed thresholds."""
    table.add(rungs)
    table.write(run_dir)
    committed = committed_thresholds(live)
    if committed is None:
        return
    measured = {kind: {live.name: DetectionTable(rungs).cells()[kind][live.name]}}
    worse = regressions(measured, committed)
    assert not worse, "detection got worse than scenarios/detection_thresholds.json:\n" + "\n".join(
        worse
    )


def noise_ladder(
    live: Live, kind: str, prompts: tuple[PromptSpec, ...], make: Callable[[float], PlantedFault]
) -> list[Rung]:
    return run_ladder(NOISE_LADDER, lambda n, s: live.rung(kind, s, prompts[n], make(s)))


def assert_acceptance(kind: str, live: Live, rungs: list[Rung]) -> None:
    """5% of std: a MISMATCH within the first three generated tokens (where measured). Where
    nothing was measured, the strongest noise (half the std) must still be caught, on any
    model: ungated, a harness that judged MATCH under it passed (found in review)."""
    if committed_thresholds(live) is None:
        strongest = max(NOISE_LADDER)
        assert rungs and rungs[0].strength == strongest and rungs[0].caught, (
            f"{kind} on {live.name}: the strongest noise ({strongest:g} of std) must be caught "
            f"on any model, thresholds or not: {rungs[:1]}"
        )
        return
    at = [r for r in rungs if r.strength == ACCEPTANCE_STRENGTH]
    assert at, f"{kind} on {live.name}: the ladder stopped before {ACCEPTANCE_STRENGTH}: {rungs}"
    rung = at[0]
    assert rung.verdict == Verdict.MISMATCH.value, (
        f"{kind} {ACCEPTANCE_STRENGTH} on {live.name} must be a MISMATCH: {rung}"
    )
    index = rung.first_token_index
    assert index is not None and index <= ACCEPTANCE_MAX_INDEX, (
        f"{kind} {ACCEPTANCE_STRENGTH} on {live.name} must differ by generated token "
        f"{ACCEPTANCE_MAX_INDEX}: {rung}"
    )


def single_rung(
    table: DetectionTable,
    run_dir: Path,
    kind: str,
    live: Live,
    prompt: PromptSpec,
    fault: PlantedFault,
) -> Rung:
    rung = live.rung(kind, PRESENT, prompt, fault)
    record_and_check(table, run_dir, kind, live, [rung])
    return rung


class Ladders:
    """A topology's clean request, collected first in every class below (base tests first)."""

    TOPOLOGY = ""

    def test_clean_request_matches(self, live: Live):
        """MATCH, or the DRIFT the run's policy allows (pd-drift on GPUs: a P->D topology
        against the monolithic baseline), every guard decided: as scenarios/test_self_test.py."""
        record, _ = live.judge(CLEAN_PROMPT, None)
        assert passed_proven(record), (
            "the clean request must pass before any fault means anything:\n"
            + format_failure(record)
        )


class EncoderLadders(Ladders):
    """The EC ladder, for every topology with an encoder."""

    def test_ec_noise_ladder(self, live: Live, detection_table, epd_settings):
        storage = live.session.ec_storage
        assert storage is not None
        rungs = noise_ladder(
            live, "ec-noise", EC_NOISE_PROMPTS, lambda s: ec_noise(storage, s, NOISE_SEED)
        )
        record_and_check(detection_table, epd_settings.run_dir, "ec-noise", live, rungs)
        assert_acceptance("ec-noise", live, rungs)


def nixl_rung(live: Live, strength: float, prompt: PromptSpec, fault: NixlKvNoise) -> Rung:
    """`Live.rung` for the fault D's plugin plants: what D did is read back after D answered."""
    record, seconds = live.judge(prompt, fault)
    fault.collect()
    assert fault.touched and not fault.problems, fault_inaction(
        f"nixl-kv-noise {strength:g} on {live.name}", fault, record
    )
    rung = rung_from_record(
        "nixl-kv-noise", strength, record, len(fault.touched), fault.effects, seconds
    )
    if not rung.caught:
        print(format_failure(record))
    print(
        f"[detection]   nixl-kv-noise {strength:g}: {rung.verdict}, first differing token "
        f"{rung.first_token_index}; {'; '.join(fault.effects[:2])}"
    )
    return rung


class KvLadders(Ladders):
    """The KV ladder, for every topology with P and D, in the session's KV connector's form."""

    @pytest.mark.kv_connector("example")
    def test_kv_noise_ladder(self, live: Live, detection_table, epd_settings):
        storage = live.session.kv_storage
        assert storage is not None
        rungs = noise_ladder(
            live, "kv-noise", KV_NOISE_PROMPTS, lambda s: kv_noise(storage, s, NOISE_SEED)
        )
        record_and_check(detection_table, epd_settings.run_dir, "kv-noise", live, rungs)
        assert_acceptance("kv-noise", live, rungs)

    @pytest.mark.kv_connector("nixl")
    def test_nixl_kv_noise_ladder(self, live: Live, detection_table, epd_settings):
        site = live.nixl_kv_noise
        assert site is not None, "under NixlConnector D must have been started with the plugin"
        rungs = run_ladder(
            NOISE_LADDER,
            lambda n, s: nixl_rung(
                live,
                s,
                KV_NOISE_PROMPTS[n],
                nixl_kv_noise(site, s, NOISE_SEED, key=KV_NOISE_PROMPTS[n].name),
            ),
        )
        record_and_check(detection_table, epd_settings.run_dir, "nixl-kv-noise", live, rungs)
        assert_acceptance("nixl-kv-noise", live, rungs)


@pytest.mark.ci
@pytest.mark.epd_topology("1E+1PD")
class TestEncoderPrefillDecode(EncoderLadders):
    """1E+1PD: the EC ladder, then swapped items, a zeroed frame and a wrong video grid."""

    TOPOLOGY = "1E+1PD"

    def test_swapped_items_are_caught(self, live: Live, detection_table, epd_settings):
        fault = ec_swap_items(live.session.ec_storage)
        rung = single_rung(
            detection_table, epd_settings.run_dir, "ec-swap-items", live, SWAP_PROMPT, fault
        )
        assert len(fault.touched) == 2, f"two images, two EC files expected: {fault.touched}"
        assert rung.caught, f"swapped embeddings went unnoticed: {rung}"

    def test_zeroed_video_frame_is_caught(self, live: Live, detection_table, epd_settings):
        fault = ec_zero_frame(live.session.ec_storage, frame=0)
        rung = single_rung(
            detection_table, epd_settings.run_dir, "ec-zero-frame", live, ZERO_FRAME_PROMPT, fault
        )
        assert rung.caught, f"a zeroed video frame went unnoticed: {rung}"

    def test_wrong_video_grid_is_caught(self, live: Live, detection_table, epd_settings):
        fault = ec_video_grid(live.session.ec_storage)
        rung = single_rung(
            detection_table, epd_settings.run_dir, "ec-video-grid", live, VIDEO_GRID_PROMPT, fault
        )
        assert rung.caught, f"wrong video positions went unnoticed: {rung}"
        assert rung.prompt_ids_equal, (
            f"the grid keeps its size, so the prompt ids must stay equal (only positions "
            f"change): {rung}"
        )


@pytest.mark.ci
@pytest.mark.epd_topology("1P+1D")
class TestPrefillDecode(KvLadders):
    """1P+1D: the KV ladder."""

    TOPOLOGY = "1P+1D"


@pytest.mark.epd_topology("1E+1P+1D")
class TestEncoderPrefillThenDecode(EncoderLadders, KvLadders):
    """1E+1P+1D: both ladders on one topology (their prompts differ)."""

    TOPOLOGY = "1E+1P+1D"
