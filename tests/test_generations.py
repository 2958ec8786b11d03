"""The protocol-generation table, the renderer's use of it, and the proxy speaking each one."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from harness.errors import BadInput
from harness.judge.records import EXACT, LOGPROB_CLOSE, Verdict
from harness.judge.verdicts import not_applicable_case
from harness.outcomes.outcome import Outcome
from harness.preflight.vllm import served_generation
from harness.run.export.reference import rendered_commands
from harness.run.repro import Bundle
from harness.serve.proxy_protocol import (
    EncodedItem,
    EncoderAnswerError,
    EncoderAnswerUnfit,
    EncoderBatch,
    MediaRef,
    build_encoder_request,
    collect_media,
    index_encoder_response,
    merge_encoder_params,
    plan_encoder_batches,
    rewrite_for_consumer,
)
from harness.spec.generations import (
    FLOOR,
    GENERATIONS,
    GENERATIONS_BY_NAME,
    KNOWN_RELEASES,
    NEWEST,
    ProtocolGeneration,
    dotted,
    generation_for,
    known_failure,
    not_applicable,
    parse_version,
)
from harness.spec.instances import InstanceSpec
from harness.spec.platforms import CPU
from harness.spec.prompts import (
    SKELETON_PROMPTS,
    ImagePart,
    PromptSpec,
    TextPart,
    VideoFramesPart,
)
from harness.spec.settings import ServedVllm
from harness.spec.topology import TOPOLOGIES, Role, serving_for
from harness.testing.builders import outcome
from harness.testing.judging import judged

pytestmark = pytest.mark.unit

# Which generation each release on the package index speaks, and the two flags that decide
# whether its instances start at all.
EXPECTED = {
    "0.27.1": ("raw-media", False, False),
    "0.28.0": ("ec-items-report-only", False, True),
    "0.29.0": ("ec-items", False, True),
    "0.30.0": ("by-hash", False, False),
    "0.31.0": ("by-hash-indexed", True, False),
    "0.32.0": ("by-hash-indexed", True, False),
}
PROMPTS = {p.name: p for p in SKELETON_PROMPTS}


def instance(role: Role, generation_name: str) -> InstanceSpec:
    serving = serving_for(CPU, "/models/tiny", max_model_len=4096)
    return InstanceSpec(
        name=f"t/{role.value}0",
        role=role,
        port=20000,
        serving=serving,
        ec_storage=Path("/tmp/ec"),
        kv_storage=Path("/tmp/kv"),
        devices=(0,),
        generation=GENERATIONS_BY_NAME[generation_name],
    )


def test_every_known_release_has_exactly_the_expected_generation() -> None:
    assert {dotted(v) for v in KNOWN_RELEASES} == set(EXPECTED)
    for version, (name, _, _) in EXPECTED.items():
        choice = generation_for(f"{version}+cpu")
        assert choice.generation.name == name, version
        assert choice.warning is None, version
        assert [g.name for g in GENERATIONS if g.covers(parse_version(version))] == [name]


@pytest.mark.parametrize("version", sorted(EXPECTED))
@pytest.mark.parametrize("role", list(Role))
def test_rendered_flags_follow_the_generation(version: str, role: Role) -> None:
    name, has_trust_flag, needs_mm_embeds = EXPECTED[version]
    argv = instance(role, name).argv()
    assert ("--trust-request-mm-kwargs" in argv) == has_trust_flag
    expects_embeds_flag = needs_mm_embeds and role.accepts_metadata_only_embeds
    assert ("--enable-mm-embeds" in argv) == expects_embeds_flag, (version, role, argv)


def test_a_flag_older_releases_lack_is_never_rendered_for_them() -> None:
    """The start-up killer measured on 0.27.1 / 0.28.0: --trust-request-mm-kwargs (0.31+)."""
    for generation in GENERATIONS:
        if generation.first < (0, 31, 0):
            for role in Role:
                assert "--trust-request-mm-kwargs" not in instance(role, generation.name).argv()


def test_newer_release_speaks_the_newest_generation_with_a_warning() -> None:
    choice = generation_for("0.35.1")
    assert choice.generation is NEWEST
    assert (
        choice.warning
        and "newer than any release" in choice.warning
        and "--protocol" in choice.warning
    )
    assert generation_for("0.32.7").warning is None  # a patch of the newest known series
    assert "(up to 0.34.0)" in choice.warning  # vLLM's newer releases, read for GPU nights
    assert generation_for("0.34.0").warning is None
    assert generation_for("0.33.1").generation is NEWEST


def test_older_release_gets_the_oldest_generation_with_a_warning() -> None:
    choice = generation_for("0.20.0")
    assert choice.generation is GENERATIONS[0]
    assert choice.warning and "older than every" in choice.warning


def test_protocol_override_wins_over_the_version() -> None:
    assert generation_for("0.32.0", "ec-items").generation.name == "ec-items"
    with pytest.raises(BadInput, match="protocol generation"):
        generation_for("0.32.0", "no-such-generation")


def test_protocol_override_wins_for_a_vllm_whose_version_is_unknown() -> None:
    """The warning for a vLLM of unknown version says "pass --protocol NAME to choose": the
    generation so chosen is the one spoken, not the newest the warning was about."""
    unknown = ServedVllm("/opt/vllm/bin/vllm", "unknown")
    assert served_generation(unknown, None).generation is NEWEST
    choice = served_generation(unknown, "ec-items")
    assert (choice.generation.name, choice.warning) == ("ec-items", None)


def test_a_version_without_a_patch_number_is_the_series_first_release() -> None:
    """`versions 0.28..0.30` and `--golden 0.31` name releases by their series: a missing
    patch number counts as 0, or the range would leave out 0.28.0 and the golden be looked
    up as 0.31.1 (a mutant reading it as 1 survived review)."""
    assert parse_version("0.31") == (0, 31, 0)
    assert parse_version("0.28+cpu") == (0, 28, 0)
    assert parse_version("0.30.2") == (0, 30, 2)


def test_unreadable_version_is_bad_input() -> None:
    with pytest.raises(BadInput, match="cannot read a vLLM version"):
        parse_version("dev")


def test_not_applicable_cases_per_generation() -> None:
    def applies(generation: str, topology: str, prompt: str) -> bool:
        return (
            not_applicable(GENERATIONS_BY_NAME[generation], TOPOLOGIES[topology], PROMPTS[prompt])
            is None
        )

    # Without encoders, every generation runs every prompt.
    for generation in GENERATIONS:
        for prompt in PROMPTS:
            assert applies(generation.name, "1P+1D", prompt)
    # Text never touches an encoder.
    assert all(applies(g.name, "1E+1PD", "text") for g in GENERATIONS)
    # raw-media: no metadata, no encoder case with media proves anything.
    assert not applies("raw-media", "1E+1PD", "image")
    assert not applies("raw-media", "2E+1PD", "two_images")
    # ec-items-report-only (0.28): metadata, but no consumer serves a metadata-only part.
    assert not applies("ec-items-report-only", "1E+1PD", "image")
    assert not applies("ec-items-report-only", "1E+1P+1D", "video")
    assert applies("ec-items-report-only", "1E+1PD", "text")
    # ec-items (0.29) and newer: everything the sweep sends.
    for name in ("ec-items", "by-hash", "by-hash-indexed"):
        assert all(applies(name, t, p) for t in ("1E+1PD", "2E+1PD") for p in PROMPTS)


def test_0_30_per_request_kwargs_reach_the_encoders_cache_key() -> None:
    """Read in 0.30.0: `ProcessorInputs.get_mm_hashes` hashes the uuid with media_io_kwargs and
    mm_processor_kwargs (`has_hash_factors`), the chat request accepts both with no trust flag
    (that flag arrives in 0.31), and 0.30's own proxy forwards both to the encoder. So a
    prompt with kwargs applies on 0.30 (scenarios ec-per-request-media-kwargs,
    ec-video-jpeg-frames-at-2-fps, ec-same-image-across-kwargs), as on 0.31+."""
    prompt = PromptSpec(
        "kw",
        (ImagePart(seed=24), TextPart("x")),
        extra=(("mm_processor_kwargs", {"max_pixels": 12544}),),
    )
    for name in ("by-hash", "by-hash-indexed"):
        assert not_applicable(GENERATIONS_BY_NAME[name], TOPOLOGIES["1E+1PD"], prompt) is None
    assert not GENERATIONS_BY_NAME["by-hash"].has_trust_request_mm_kwargs_flag


def test_only_releases_with_the_trust_flag_refuse_untrusted_media_kwargs() -> None:
    """0.31+ answer per-request media kwargs with a 400 unless started trusted; older releases
    have no such check (0.30 keys the encoder's cache with them all the same)."""
    for generation in GENERATIONS:
        assert generation.accepts_request_media_kwargs(trusted=True), generation.name
        untrusted = generation.accepts_request_media_kwargs(trusted=False)
        assert untrusted is not generation.has_trust_request_mm_kwargs_flag, generation.name


def test_extra_fields_that_are_not_media_kwargs_apply_on_every_generation() -> None:
    """Only mm_processor_kwargs / media_io_kwargs depend on `per_request_media_kwargs`: a
    prompt whose extra fields are a cache salt or a token count (a fuzz-saved scenario, a
    salted follow-up) applies on 0.29 as one without them, while one with media kwargs does
    not (found in review)."""
    image = (ImagePart(seed=24), TextPart("x"))
    plain = PromptSpec("plain", image, extra=(("cache_salt", "s"), ("max_tokens", 4)))
    kwargs = PromptSpec("kw", image, extra=(("media_io_kwargs", {"image": {}}),))
    generation = GENERATIONS_BY_NAME["ec-items"]
    assert not generation.per_request_media_kwargs
    assert not_applicable(generation, TOPOLOGIES["1E+1PD"], plain) is None
    assert "per-request media kwargs" in (
        not_applicable(generation, TOPOLOGIES["1E+1PD"], kwargs) or ""
    )


def test_the_runs_protocol_record_names_every_field_of_its_generation() -> None:
    """summary.json and a fuzz bundle keep `to_json()` as the protocol the run spoke: each
    field of the generation is in it, so a record says all the run assumed of its release."""
    for generation in GENERATIONS:
        record = generation.to_json()
        fields = {f.name for f in dataclasses.fields(ProtocolGeneration)} - {"first", "until"}
        assert fields <= set(record), (generation.name, fields - set(record))
        assert record["versions"] == generation.version_range
        for name in fields - {"encoder_answer", "known_failures"}:
            assert record[name] == getattr(generation, name), (generation.name, name)


def test_not_applicable_never_passes_any_policy() -> None:
    record = not_applicable_case("1E+1PD", "video", "baseline", "video is not encoded")
    assert record.verdict is Verdict.NOT_APPLICABLE and not record.policy_passed
    assert not EXACT.passes(Verdict.NOT_APPLICABLE) and not LOGPROB_CLOSE.passes(
        Verdict.NOT_APPLICABLE
    )
    assert "video is not encoded" in record.detail


# -- failures a release is declared to have --------------------------------------------------


def test_0_29_and_0_30_declare_the_video_timing_failure_and_only_through_an_encoder() -> None:
    declaring = {"ec-items", "by-hash"}
    for name in declaring:
        generation = GENERATIONS_BY_NAME[name]
        for topology in ("1E+1PD", "1E+1P+1D", "2E+1PD"):
            failure = known_failure(generation, TOPOLOGIES[topology], PROMPTS["video"])
            assert failure is not None and failure.verdict == "MISMATCH", (name, topology)
        assert known_failure(generation, TOPOLOGIES["1P+1D"], PROMPTS["video"]) is None
        assert known_failure(generation, TOPOLOGIES["baseline"], PROMPTS["video"]) is None
        for prompt in ("text", "image", "two_images"):
            assert known_failure(generation, TOPOLOGIES["1E+1PD"], PROMPTS[prompt]) is None
        assert generation.to_json()["known_failures"][0]["media"] == "video"
    for generation in GENERATIONS:
        if generation.name not in declaring:
            assert generation.known_failures == (), generation.name


def test_a_video_sent_as_jpeg_frames_is_not_applicable_for_the_reason_an_mp4_is() -> None:
    """A release whose encoder never gets video (0.27.1's proxy sends it image and audio only)
    says so of a video however it is sent: JPEG frames are a video too (a mutant counting only
    mp4 parts gave them the image's reason, the encoder's missing metadata, and survived)."""
    frames = PromptSpec("frames", (VideoFramesPart(seed=3), TextPart("what happens?")))
    raw = GENERATIONS_BY_NAME["raw-media"]
    reason = not_applicable(raw, TOPOLOGIES["1E+1PD"], frames)
    assert reason == not_applicable(raw, TOPOLOGIES["1E+1PD"], PROMPTS["video"])
    assert reason is not None and "video does not go through the encoder" in reason


def test_a_video_sent_as_jpeg_frames_is_declared_as_a_video() -> None:
    """The video-timing declaration covers a video however it is sent: a list of JPEG frames
    is a video to the processor as an mp4 is (a fuzz-drawn or saved prompt carries one).
    Without it such a case on 0.29 / 0.30 would fail undeclared, red for a known cause."""
    frames = PromptSpec("frames", (VideoFramesPart(seed=3), TextPart("what happens?")))
    for name in ("ec-items", "by-hash"):
        failure = known_failure(GENERATIONS_BY_NAME[name], TOPOLOGIES["1E+1PD"], frames)
        assert failure is not None and failure.media == "video", name
    assert known_failure(GENERATIONS_BY_NAME["by-hash"], TOPOLOGIES["1P+1D"], frames) is None


def test_the_floor_is_the_first_generation_whose_consumers_serve_metadata_only_parts() -> None:
    assert FLOOR.name == "ec-items" and FLOOR.first == (0, 29, 0)
    older = [g for g in GENERATIONS if g.first < FLOOR.first]
    assert older and not any(g.consumer_takes_metadata_only for g in older)
    assert all(g.consumer_takes_metadata_only for g in GENERATIONS if g.first >= FLOOR.first)


def test_a_declared_failure_passes_only_when_it_fails_exactly_as_declared() -> None:
    failure = GENERATIONS_BY_NAME["by-hash"].known_failures[0]

    def as_declared_by(candidate: Outcome) -> object:
        return judged(
            "1E+1PD", "baseline", outcome("video", [5, 6, 7]), candidate, declared=failure
        )

    as_declared = as_declared_by(outcome("video", [9, 6, 7]))
    assert as_declared.verdict is Verdict.MISMATCH and as_declared.policy_passed
    assert failure.reason in as_declared.detail
    # Any other outcome fails, and says what was declared.
    for candidate in (
        outcome("video", [5, 6, 7]),  # the failure is gone: MATCH
        outcome("video", [9, 6, 7], prompt_ids=(1, 2, 4)),  # placeholders sized differently
        Outcome(prompt="video", error="HTTP 500"),  # another failure altogether
    ):
        record = as_declared_by(candidate)
        assert not record.policy_passed, record.detail
        assert "NOT the declared MISMATCH" in record.detail
        # and names the declaration it was held to, as a pass does (summary.json's record)
        assert record.declared_failure == failure.name, record


def test_the_sweep_judges_a_declared_case_by_its_declaration(tmp_path: Path) -> None:
    """A 0.30 sweep: 1E+1PD video failing as declared passes; 1P+1D video is judged as usual
    (its MISMATCH would fail); outcomes are planted, nothing is served."""
    from harness.judge.verdicts import Stability
    from harness.run.judging import Observed
    from harness.run.sweep import Sweep, SweepSpec
    from harness.spec.settings import RunSettings, ServedVllm

    settings = RunSettings(
        serving=serving_for(CPU, "/not-a-dir-model", max_model_len=4096),
        run_dir=tmp_path / "run",
        vllm=ServedVllm("vllm", "0.30.0+cpu", "2.13.0"),
        protocol=GENERATIONS_BY_NAME["by-hash"],
    )
    spec = SweepSpec(
        topologies=(TOPOLOGIES["1E+1PD"], TOPOLOGIES["1P+1D"]), prompts=(PROMPTS["video"],)
    )
    sweep = Sweep(spec, settings)
    sweep.baseline.outcomes["video"] = outcome("video", [5, 6, 7])
    sweep.baseline.stability["video"] = Stability(True, "planted", 0.0)
    different = Observed(outcome("video", [9, 6, 7]), ())
    served = {"1E+1PD": {"video": different}, "1P+1D": {"video": different}}
    sweep.serve_topology = lambda name: served[name]  # type: ignore[method-assign]
    (encoder,) = sweep.judge("1E+1PD", "video")
    (no_encoder,) = sweep.judge("1P+1D", "video")
    assert encoder.verdict is Verdict.MISMATCH and encoder.policy_passed
    assert "declared upstream failure" in encoder.detail
    # The record names the failure it was judged against, for the version table and bisect.
    assert encoder.to_json()["declared_failure"] == "video-timing-before-0.31"
    assert no_encoder.verdict is Verdict.MISMATCH and not no_encoder.policy_passed
    assert "declared" not in no_encoder.detail
    assert no_encoder.to_json()["declared_failure"] == ""


@pytest.mark.parametrize(
    "version, protocol", [("0.30.0+cpu", "by-hash"), ("0.32.0+cpu", NEWEST.name)]
)
def test_a_scenarios_declaration_is_not_replaced_by_the_releases(
    tmp_path: Path, version: str, protocol: str
) -> None:
    """An attached deployment (or `repro`) sent a matrix scenario's prompt: the sweep judges
    it by the scenario's declaration (SweepSpec.declared), whether the served release declares
    a failure of its own for the prompt (0.30's video timing, a MISMATCH) or none (0.32).
    Found in review by a mutant that let the release's word (or its silence) stand in for the
    caller's, and no test went red."""
    from harness.judge.records import DeclaredFailure
    from harness.judge.verdicts import Stability
    from harness.run.judging import Observed
    from harness.run.sweep import Sweep, SweepSpec
    from harness.spec.settings import RunSettings, ServedVllm

    settings = RunSettings(
        serving=serving_for(CPU, "/not-a-dir-model", max_model_len=4096),
        run_dir=tmp_path / "run",
        vllm=ServedVllm("vllm", version, "2.13.0"),
        protocol=GENERATIONS_BY_NAME[protocol],
    )
    died = DeclaredFailure("ERROR", "encoder0 died", "the encoder crashes on it", "a-scenario")
    spec = SweepSpec(
        topologies=(TOPOLOGIES["1E+1PD"],),
        prompts=(PROMPTS["video"],),
        declared=(("video", died),),
    )
    sweep = Sweep(spec, settings)
    sweep.baseline.outcomes["video"] = outcome("video", [5, 6, 7])
    sweep.baseline.stability["video"] = Stability(True, "planted", 0.0)
    failed = Observed(outcome("video", error="upstream 500: encoder0 died"), ())
    sweep.serve_topology = lambda name: {"video": failed}  # type: ignore[method-assign]
    (record,) = sweep.judge("1E+1PD", "video")
    assert record.verdict is Verdict.ERROR and record.policy_passed, record.detail
    assert record.to_json()["declared_failure"] == "a-scenario"


# -- the proxy speaking older generations ----------------------------------------------------


def refs(*kinds: str) -> list[MediaRef]:
    return [MediaRef(i, 0, i, kind, f"u{i}") for i, kind in enumerate(kinds)]


def test_answers_without_positions_get_one_item_per_sub_request() -> None:
    media = refs("image_url", "image_url")
    indexed, _ = plan_encoder_batches(media, 1, 0, NEWEST)
    assert [b.positions for b in indexed] == [(0, 1)]
    for name in ("by-hash", "ec-items"):
        batches, _ = plan_encoder_batches(media, 1, 0, GENERATIONS_BY_NAME[name])
        assert [b.positions for b in batches] == [(0,), (1,)], name


def test_video_skips_the_encoder_where_the_generation_does_not_encode_it() -> None:
    media = refs("video_url", "image_url")
    batches, cursor = plan_encoder_batches(media, 2, 0, GENERATIONS_BY_NAME["raw-media"])
    assert [b.positions for b in batches] == [(1,)] and cursor == 1
    batches, _ = plan_encoder_batches(media, 2, 0, NEWEST)
    assert sorted(b.positions for b in batches) == [(0,), (1,)]


def test_audio_gets_a_sub_request_of_its_own_as_upstreams() -> None:
    """0.31 / 0.32's proxy groups only `image_url` items per encoder (`image_groups` in
    disagg_epd_proxy.py); an audio item, like a video, gets a sub-request of its own."""
    for kinds in (("image_url", "input_audio"), ("image_url", "audio_url", "image_url")):
        batches, _ = plan_encoder_batches(refs(*kinds), 1, 0, NEWEST)
        audio = [i for i, kind in enumerate(kinds) if kind != "image_url"]
        images = tuple(i for i, kind in enumerate(kinds) if kind == "image_url")
        assert sorted(b.positions for b in batches) == sorted([images, *((i,) for i in audio)])


def test_raw_media_reads_the_answer_a_0_27_encoder_gives() -> None:
    """0.27.1's ECExampleConnector has no request_finished: its encoder answers no
    ec_transfer_params at all (None, or nothing). Nothing to index, and no error."""
    raw = GENERATIONS_BY_NAME["raw-media"]
    assert index_encoder_response(EncoderBatch(0, (0,)), None, raw) == {}
    assert index_encoder_response(EncoderBatch(0, (2,)), {}, raw) == {}
    assert merge_encoder_params([None, None], raw) == {}


def test_raw_media_consumer_gets_the_key_the_encoder_used() -> None:
    """0.27.1's flow (its proxy): the encoder is sent each item as the client sent it, with NO
    uuid and max_tokens 1, the consumer the untouched request; the consumer's
    ECExampleConnector finds the encoder's file under the key both derive from the same part
    (`update_state_after_alloc` -> `has_cache_item(identifier)`). A uuid only the encoder got
    would make the keys differ, and the consumer would encode the image itself."""
    raw = GENERATIONS_BY_NAME["raw-media"]
    cat = {"type": "image_url", "image_url": {"url": "file:///media/cat.png"}}
    request = {"model": "m", "messages": [{"role": "user", "content": [cat, {"type": "text"}]}]}
    media = collect_media(request)
    (batch,) = plan_encoder_batches(media, 1, 0, raw)[0]
    body = build_encoder_request(request, media, batch, raw)
    consumer = rewrite_for_consumer(request, media, {}, {}, raw).body
    assert body["messages"][0]["content"] == [cat]
    assert consumer["messages"][0]["content"][0] == cat
    # from 0.28 on the encoder gets the item's uuid (the consumer gets it too, in the
    # metadata-only part), as those releases' proxies send it
    for generation in GENERATIONS[1:]:
        newer = build_encoder_request(request, media, batch, generation)
        assert newer["messages"][0]["content"] == [{**cat, "uuid": media[0].uuid}]


def test_the_encoder_gets_max_tokens_only_where_the_releases_proxy_sends_it() -> None:
    """0.27.1's proxy primes the encoder with max_tokens 1; from 0.28 vLLM's proxy sends none
    (an encoder-only instance stops once the prompt is consumed: the scheduler's
    is_encoder_only / is_mm_encoder_only branch, read in 0.28.0-0.32.0)."""
    request = {
        "model": "m",
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": "file:///media/cat.png"}}],
            }
        ],
    }
    media = collect_media(request)
    for generation in GENERATIONS:
        (batch,) = plan_encoder_batches(media, 1, 0, generation)[0]
        body = build_encoder_request(request, media, batch, generation)
        expected = 1 if generation.name == "raw-media" else None
        assert body.get("max_tokens") == expected, generation.name


def test_index_ec_items_answer() -> None:
    params = {"ec_items": [{"mm_hash": "h1", "image_grid_thw": [1, 4, 4]}]}  # as 0.28 answers
    found = index_encoder_response(EncoderBatch(0, (3,)), params, GENERATIONS_BY_NAME["ec-items"])
    assert found[3].mm_hash == "h1" and found[3].metadata == {"image_grid_thw": [1, 4, 4]}


@pytest.mark.parametrize("items", [["h1"], [{"mm_hash": "h1", "x": 1}, 7]], ids=["str", "int"])
def test_an_ec_items_list_whose_items_are_no_objects_is_the_generations_shape_error(
    items: list,
) -> None:
    """0.28 / 0.29 answer objects in `ec_items`; anything else in the list is no answer of
    the generation, said with the answer (the proxy's 502 naming the encoder), not an
    AttributeError of reading an item as one (the proxy's own 500)."""
    with pytest.raises(EncoderAnswerError, match="expected"):
        index_encoder_response(
            EncoderBatch(0, (0,)), {"ec_items": items}, GENERATIONS_BY_NAME["ec-items"]
        )


def test_index_by_hash_answer_without_item_indices() -> None:
    params = {"h2": {"metadata": {"image_grid_thw": [1, 2, 2]}}}
    found = index_encoder_response(EncoderBatch(0, (1,)), params, GENERATIONS_BY_NAME["by-hash"])
    assert found == {1: found[1]} and found[1].mm_hash == "h2"


def test_an_answer_of_another_generation_is_an_error_with_the_answer() -> None:
    """0.28's list reaching a 0.32 proxy crashed it with an empty error; now it says why."""
    params = {"ec_items": [{"mm_hash": "h1", "metadata": {"x": 1}}]}
    with pytest.raises(EncoderAnswerError, match="ec_items.*h1"):
        index_encoder_response(EncoderBatch(0, (0,)), params, NEWEST)
    video = not_applicable(GENERATIONS_BY_NAME["raw-media"], TOPOLOGIES["1E+1PD"], PROMPTS["video"])
    assert video and "video does not go through the encoder" in video
    image = not_applicable(GENERATIONS_BY_NAME["raw-media"], TOPOLOGIES["1E+1PD"], PROMPTS["image"])
    assert image and "no guard can tell the load from the consumer encoding" in image
    assert "encodes it again" not in image  # the old, wrong reason: 0.27.1 loads the file
    with pytest.raises(EncoderAnswerError, match="expected"):
        index_encoder_response(EncoderBatch(0, (0,)), {"h": {}}, GENERATIONS_BY_NAME["ec-items"])


def test_merge_concatenates_item_lists_and_unions_hashes() -> None:
    a = {"ec_items": [{"mm_hash": "a"}]}
    b = {"ec_items": [{"mm_hash": "b"}]}
    merged = merge_encoder_params([a, None, b], GENERATIONS_BY_NAME["ec-items"])
    assert merged == {"ec_items": [{"mm_hash": "a"}, {"mm_hash": "b"}]}
    assert merge_encoder_params([{"x": {}}, {"y": {}}], NEWEST) == {"x": {}, "y": {}}


def test_encoder_output_guard_reads_every_generations_answer_shape() -> None:
    """0.30 answers carry no item_indices (one item per encoder request) and 0.28-0.29 answer
    {"ec_items": [...]}: the guard counts an item per entry with metadata in either shape
    (measured: every 0.30 image case was VACUOUS while the guard expected the 0.32 shape, and
    every 0.29 one while it looked for a "metadata" key 0.29's flattened items do not have)."""
    from harness.judge.guards import TransferEvidence, check_encoder_output

    by_hash = {"h0": {"metadata": {"image_grid_thw": [1, 2, 2]}}}
    # As 0.29.0's encoder answered (its taps, 1E+1PD image): metadata next to mm_hash.
    ec_items = {"ec_items": [{"image_grid_thw": [1, 16, 16], "mm_hash": "h1"}]}
    evidence = TransferEvidence(media_count=2, encoder_answers=(by_hash, ec_items))
    assert "reported 2 with metadata" in check_encoder_output(evidence, None).evidence
    without_metadata = {"ec_items": [{"mm_hash": "h1"}]}
    evidence = TransferEvidence(media_count=2, encoder_answers=(by_hash, without_metadata))
    result = check_encoder_output(evidence, None)
    assert not result.ok and "reported 1 with metadata" in result.evidence
    indexed = {"h2": {"metadata": {"x": 1}, "item_indices": [0, 1]}}
    evidence = TransferEvidence(media_count=2, encoder_answers=(indexed,))
    assert "reported 2 with metadata" in check_encoder_output(evidence, None).evidence


def test_a_topology_whose_every_case_is_not_applicable_is_not_started(tmp_path: Path) -> None:
    """On 0.28 an encoder topology sent only media prompts has nothing to run: the sweep
    judges its cases NOT_APPLICABLE without starting it (measured: a bisect try on 0.28.0 spent
    50 s starting 1E+1PD for one NOT_APPLICABLE case); with a text prompt it starts."""
    from harness.run.sweep import Sweep, SweepSpec
    from harness.spec.settings import RunSettings, ServedVllm

    settings = RunSettings(
        serving=serving_for(CPU, "/not-a-dir-model", max_model_len=4096),
        run_dir=tmp_path / "run",
        vllm=ServedVllm("vllm", "0.28.0+cpu", "2.13.0"),
        protocol=GENERATIONS_BY_NAME["ec-items-report-only"],
    )

    def started(*prompts: str) -> set[str]:
        spec = SweepSpec(
            topologies=(TOPOLOGIES["1E+1PD"], TOPOLOGIES["1E+1P+1D"], TOPOLOGIES["1P+1D"]),
            prompts=tuple(PROMPTS[p] for p in prompts),
        )
        waves = Sweep(spec, settings).schedule().waves
        return {slot.topology.name for wave in waves for slot in wave.slots}

    assert started("image", "video") >= {"1P+1D"}
    assert not started("image", "video") & {"1E+1PD", "1E+1P+1D"}
    assert started("text", "image") >= {"1E+1PD", "1E+1P+1D", "1P+1D"}


def test_a_not_applicable_case_of_a_started_topology_is_never_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On 0.28 1E+1PD runs the text prompt, so it starts; its image case, NOT_APPLICABLE
    there, is judged so without a request: sent, it would only cost time, and whatever it did
    to the encoder would be there for the cases after it."""
    from types import SimpleNamespace

    import harness.run.sweep as sweep_module
    from harness.run.judging import Observed
    from harness.serve.proxy import ProxyFaults
    from harness.spec.settings import RunSettings, ServedVllm

    settings = RunSettings(
        serving=serving_for(CPU, "/not-a-dir-model", max_model_len=4096),
        run_dir=tmp_path / "run",
        vllm=ServedVllm("vllm", "0.28.0+cpu", "2.13.0"),
        protocol=GENERATIONS_BY_NAME["ec-items-report-only"],
    )
    topology = TOPOLOGIES["1E+1PD"]
    spec = sweep_module.SweepSpec((topology,), prompts=(PROMPTS["image"], PROMPTS["text"]))
    sweep = sweep_module.Sweep(spec, settings)
    sent: list[str] = []

    def observe(session, prompt, body, stream, *, fresh_prefix):
        sent.append(prompt)
        return Observed(Outcome(prompt=prompt, error="unsent in this test"), ())

    monkeypatch.setattr(sweep_module, "observe", observe)
    session = SimpleNamespace(topology=topology, settings=settings, faults=ProxyFaults())
    sweep._serve_prompts(session)
    assert sent == ["text"]
    assert [r.verdict.value for r in sweep.judge(topology.name, "image")] == ["NOT_APPLICABLE"]


@pytest.mark.parametrize("version", ["0.32.0+cpu", "unknown"])
def test_an_export_renders_the_reference_in_the_protocol_the_run_spoke(
    tmp_path: Path, version: str
) -> None:
    """An export renders the commands of a reference the run recorded none of (a baseline from
    the cache) for the run's release; under `--protocol ec-items` (or an unreadable version,
    which speaks the newest) the run's instances had 0.29's flags, and the reference must too:
    rendered by the served version instead, it had 0.31's --trust-request-mm-kwargs and no
    --enable-mm-embeds, and a version of "unknown" failed the export (found in review)."""
    serving = serving_for(CPU, "/models/tiny")
    run = {
        "serving": json.loads(json.dumps(dataclasses.asdict(serving))),
        "platform_profile": "cpu",
        "devices": [0, 1],
        "served_vllm": {"version": version},
        "protocol": GENERATIONS_BY_NAME["ec-items"].to_json(),
    }
    bundle = Bundle(path=tmp_path, run=run, requests={}, cases=[])
    for name, command in rendered_commands(bundle, "1P+1D"):
        assert "--trust-request-mm-kwargs" not in command["argv"], name
        assert "--enable-mm-embeds" in command["argv"], name


def test_an_ec_items_answer_is_the_proxys_generation_error_not_a_broken_encoder() -> None:
    """An `ec_items` list reaching a by-hash proxy says the served release speaks another
    generation: EncoderAnswerError, which the proxy reports as its own failure; read as an
    entry by hash it became EncoderAnswerUnfit, which the proxy blames on the encoder."""
    params = {"ec_items": [{"mm_hash": "h1", "metadata": {"x": 1}}]}
    for generation in (NEWEST, GENERATIONS_BY_NAME["by-hash"]):
        with pytest.raises(EncoderAnswerError, match="does not speak") as raised:
            index_encoder_response(EncoderBatch(0, (0,)), params, generation)
        assert not isinstance(raised.value, EncoderAnswerUnfit), generation.name


@pytest.mark.parametrize(
    ("params", "problem"),
    [
        ({"h": {"metadata": [1, 2, 2]}}, "metadata no object"),
        (
            {"h1": {"metadata": {"image_grid_thw": [1, 2, 2]}}, "h2": {"metadata": {"x": 1}}},
            "2 entries with metadata for one item",
        ),
    ],
)
def test_a_broken_answer_without_positions_is_the_encoders(
    params: dict[str, object], problem: str
) -> None:
    """Metadata that is no object, or two entries' metadata for the one item: a broken answer
    of that encoder, not metadata to hand the consumers."""
    with pytest.raises(EncoderAnswerUnfit, match=problem):
        index_encoder_response(EncoderBatch(0, (0,)), params, GENERATIONS_BY_NAME["by-hash"])


def test_an_answer_without_positions_fits_only_a_one_item_sub_request() -> None:
    """A by-hash answer names no item: for a sub-request of two it cannot say which item its
    metadata is of, so it is refused rather than given to the first."""
    params = {"h": {"metadata": {"image_grid_thw": [1, 2, 2]}}}
    with pytest.raises(ValueError, match="one item per sub-request, got 2"):
        index_encoder_response(EncoderBatch(0, (0, 1)), params, GENERATIONS_BY_NAME["by-hash"])


def test_raw_media_ignores_whatever_a_0_27_encoder_answers() -> None:
    """0.27's consumer finds the EC file by its own key and is sent the media raw: entries in
    its encoder's answer are neither indexed nor forwarded."""
    raw = GENERATIONS_BY_NAME["raw-media"]
    params = {"h": {"item_indices": [0], "metadata": {"image_grid_thw": [1, 2, 2]}}}
    assert index_encoder_response(EncoderBatch(0, (0,)), params, raw) == {}
    assert merge_encoder_params([params], raw) == {}


def test_0_28_and_0_29_consumers_get_each_metadata_value_as_a_saved_tensor() -> None:
    """vLLM 0.28 / 0.29 read every value of a metadata-only part as base64 of
    `torch.save(tensor)`: handed the encoder's plain lists, their consumers cannot load them."""
    import base64
    import io

    torch = pytest.importorskip("torch")
    request = {
        "model": "m",
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///c"}}]}
        ],
    }
    media = collect_media(request)
    encoded = {0: EncodedItem("h", {"image_grid_thw": [1, 2, 2]})}
    for name in ("ec-items-report-only", "ec-items"):
        body = rewrite_for_consumer(request, media, encoded, {}, GENERATIONS_BY_NAME[name]).body
        value = body["messages"][0]["content"][0]["image_embeds"]["image_grid_thw"]
        tensor = torch.load(io.BytesIO(base64.b64decode(value)))
        assert tensor.tolist() == [1, 2, 2], name
