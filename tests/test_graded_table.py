"""`--plant-fault` values with strengths, and the detection table the graded self-test keeps
(pure logic: no torch, no vLLM)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.errors import BadInput
from harness.judge.records import Verdict
from harness.run.faults.spec import FaultSpec, parse_fault
from harness.run.graded import (
    DETECTION_PROMPTS,
    NOISE_LADDER,
    TINY_MODEL,
    DetectionTable,
    Rung,
    load_thresholds,
    measured_on,
    model_key,
    regressions,
    run_ladder,
    rung_from_record,
)
from harness.testing.builders import case_record

pytestmark = pytest.mark.unit

THRESHOLDS = Path(__file__).resolve().parents[1] / "scenarios" / "detection_thresholds.json"


@pytest.mark.parametrize(
    "text, spec",
    [
        ("corrupt-ec", FaultSpec("corrupt-ec")),
        ("ec-noise:0.05", FaultSpec("ec-noise", 0.05)),
        ("kv-noise:5e-3", FaultSpec("kv-noise", 0.005)),
        # the top of the range the refusal names, "(0, 100]"
        ("kv-noise:100", FaultSpec("kv-noise", 100.0)),
        ("ec-swap-items", FaultSpec("ec-swap-items")),
        ("ec-zero-frame", FaultSpec("ec-zero-frame")),
        ("ec-zero-frame:2", FaultSpec("ec-zero-frame", 2.0)),
        ("ec-zero-frame:9999", FaultSpec("ec-zero-frame", 9999.0)),
        ("ec-video-grid", FaultSpec("ec-video-grid")),
    ],
)
def test_fault_values_parse(text: str, spec: FaultSpec):
    assert parse_fault(text) == spec


@pytest.mark.parametrize(
    "text, cause",
    [
        ("ec-noise", "ec-noise needs a strength"),
        ("ec-noise:0", "in (0, 100]"),
        ("kv-noise:-0.1", "in (0, 100]"),
        ("ec-noise:nan", "in (0, 100]"),
        ("ec-noise:inf", "in (0, 100]"),
        ("ec-noise:100.5", "in (0, 100]"),
        ("ec-noise:lots", "e.g. ec-noise:0.05"),
        ("ec-zero-frame:-1", "takes a temporal frame index"),
        # Found in review: a ValueError and an OverflowError traceback, not one line.
        ("ec-zero-frame:²", "takes a temporal frame index"),
        ("ec-zero-frame:" + "9" * 400, "takes a temporal frame index"),
        ("ec-zero-frame:" + "9" * 5000, "takes a temporal frame index"),
        ("ec-zero-frame:10000", "(0, 1, ... 9999)"),
        ("ec-swap-items:2", "takes no strength"),
        ("corrupt-ec:0.5", "takes no strength"),
        ("ec-melt:0.5", "unknown fault 'ec-melt:0.5'"),
    ],
)
def test_bad_fault_values_are_one_bad_input_line(text: str, cause: str):
    with pytest.raises(BadInput) as raised:
        parse_fault(text)
    message = str(raised.value)
    assert cause in message and "\n" not in message, message


def test_cli_refuses_a_bad_strength_in_one_line(epd_cli):
    code, _, stderr = epd_cli("run", "--plant-fault", "ec-noise:zero")
    assert code == 2
    err = stderr.strip().splitlines()
    assert len(err) == 1 and "ec-noise needs a strength" in err[0], err


def test_list_shows_the_graded_faults(epd_cli):
    code, out, _ = epd_cli("list")
    assert code == 0
    for name in (
        "ec-noise:FRACTION",
        "kv-noise:FRACTION",
        "ec-swap-items",
        "ec-zero-frame",
        "ec-video-grid",
    ):
        assert name in out, out


def rung(strength: float, verdict: str, index: int | None = 0, topology="1E+1PD") -> Rung:
    caught = verdict in ("MISMATCH", "VACUOUS")
    return Rung(
        "ec-noise", strength, topology, f"p-{strength}", verdict, caught, index, True, "detail", 1
    )


def test_ladder_stops_after_the_first_miss():
    verdicts = {0.5: "MISMATCH", 0.05: "MISMATCH", 0.005: "MATCH", 0.0005: "MISMATCH"}
    asked = []

    def plant_and_judge(n: int, strength: float) -> Rung:
        asked.append((n, strength))
        return rung(strength, verdicts[strength])

    rungs = run_ladder(NOISE_LADDER, plant_and_judge)
    assert asked == [(0, 0.5), (1, 0.05), (2, 0.005)], asked
    cell = DetectionTable(rungs).cells()["ec-noise"]["1E+1PD"]
    assert cell["smallest_caught"] == 0.05 and cell["missed_at"] == 0.005, cell
    assert cell["missed_verdict"] == "MATCH", cell


def test_regressions_are_larger_thresholds_or_nothing_caught():
    committed = {"ec-noise": {"1E+1PD": 0.005, "1E+1P+1D": 0.05}}
    same = DetectionTable([rung(0.5, "MISMATCH"), rung(0.05, "MISMATCH"), rung(0.005, "MISMATCH")])
    assert regressions(same.cells(), committed) == []
    worse = DetectionTable([rung(0.5, "MISMATCH"), rung(0.05, "MISMATCH"), rung(0.005, "MATCH")])
    problems = regressions(worse.cells(), committed)
    assert len(problems) == 1 and "0.05, committed 0.005" in problems[0], problems
    blind = DetectionTable([rung(0.5, "DRIFT", topology="1E+1P+1D")])
    problems = regressions(blind.cells(), committed)
    assert len(problems) == 1 and "no longer caught at all" in problems[0], problems
    new_cell = DetectionTable([rung(0.5, "MISMATCH", topology="2E+1PD")])
    assert regressions(new_cell.cells(), committed) == [], "an uncommitted cell is not worse"


def test_table_is_written_as_json_and_markdown(tmp_path: Path):
    table = DetectionTable(
        [rung(0.5, "MISMATCH", 0), rung(0.05, "MISMATCH", 2), rung(0.005, "MATCH", None)]
    )
    table.write(tmp_path)
    data = json.loads((tmp_path / "detection.json").read_text())
    cell = data["thresholds"]["ec-noise"]["1E+1PD"]
    assert cell["smallest_caught"] == 0.05 and cell["first_token_index"] == 2, cell
    assert len(data["rungs"]) == 3
    markdown = (tmp_path / "detection.md").read_text()
    assert "| ec-noise | 1E+1PD | 0.05 | 2 | MISMATCH | 0.005 (MATCH) |" in markdown, markdown


def test_a_fault_the_strongest_rung_missed_reads_not_caught_in_the_markdown():
    """detection.md is what a person reads: a fault never caught must say so, not show the
    '-' of a column with nothing in it (a mutant writing '-' there survived review)."""
    markdown = DetectionTable([rung(0.5, "DRIFT")]).to_markdown()
    assert "| ec-noise | 1E+1PD | NOT CAUGHT | - | - | 0.5 (DRIFT) |" in markdown, markdown


def test_committed_thresholds_cover_the_acceptance_topologies():
    committed = load_thresholds(THRESHOLDS)
    for fault, topologies in (
        ("ec-noise", ("1E+1PD", "1E+1P+1D")),
        ("kv-noise", ("1P+1D", "1E+1P+1D")),
    ):
        for topology in topologies:
            assert committed[fault][topology] <= 0.05, (fault, topology, committed)


def test_detection_prompts_have_media_of_their_own():
    from harness.run.scenarios import matrix_prompts
    from harness.spec.prompts import SKELETON_PROMPTS

    def seeds(prompts) -> list[int]:
        return [p.seed for prompt in prompts for p in prompt.parts if hasattr(p, "seed")]

    own = seeds(DETECTION_PROMPTS)
    assert len(own) == len(set(own)), f"two detection rungs share media: {own}"
    shared = set(own) & set(seeds((*SKELETON_PROMPTS, *matrix_prompts())))
    assert not shared, f"detection media also used by the sweep or matrix: {shared}"


def test_thresholds_gate_only_the_platform_model_and_dtype_they_were_measured_on(tmp_path: Path):
    committed = load_thresholds(THRESHOLDS, "cpu", TINY_MODEL)
    assert committed is not None and committed["kv-noise"]["1P+1D"] == 0.05
    assert load_thresholds(THRESHOLDS, "cuda", TINY_MODEL) is None, "measured on CPU only"
    assert load_thresholds(THRESHOLDS, "cpu", "Qwen/Qwen2.5-VL-3B-Instruct") is None
    assert load_thresholds(THRESHOLDS, "cpu", TINY_MODEL, "bfloat16") == committed
    # Measured in bfloat16: a float16 or float32 run (--dtype) is reported, not gated.
    assert load_thresholds(THRESHOLDS, "cpu", TINY_MODEL, "float16") is None
    assert load_thresholds(THRESHOLDS, "cpu", TINY_MODEL, "float32") is None
    assert "cpu / tiny-qwen25vl generator 3 / bfloat16" in measured_on(THRESHOLDS)


def test_model_key_names_a_model_the_same_however_it_was_given(tmp_path: Path):
    assert model_key("/root/.cache/epd-harness/models/tiny-qwen25vl-1a7363f493f0") == TINY_MODEL
    snapshot = "/hf/hub/models--Qwen--Qwen2.5-VL-3B-Instruct/snapshots/0123abcd"
    assert model_key(snapshot) == "Qwen/Qwen2.5-VL-3B-Instruct"
    assert model_key("Qwen/Qwen2.5-VL-3B-Instruct") == "Qwen/Qwen2.5-VL-3B-Instruct"
    assert model_key(str(tmp_path / "my-model")) == "my-model"


def test_thresholds_of_another_tiny_model_generator_do_not_gate(tmp_path: Path):
    """The tiny model's generator shapes what a fault flips (generator 3's KV ballast made 5%
    KV noise flip a token at once): thresholds measured on one generator's checkpoint gated
    the next one's, whose detection nobody measured."""
    from fixtures.tiny_model import GENERATOR_VERSION

    data = json.loads(THRESHOLDS.read_text())
    [section] = [s for s in data["measured"] if s["model"] == TINY_MODEL]
    older = tmp_path / "thresholds.json"
    older.write_text(json.dumps({"measured": [{**section, "generator": "2"}]}))
    assert load_thresholds(older, "cpu", TINY_MODEL) is None
    assert "cpu / tiny-qwen25vl generator 2 / bfloat16" in measured_on(older)
    unsaid = {key: value for key, value in section.items() if key != "generator"}
    older.write_text(json.dumps({"measured": [unsaid]}))
    assert load_thresholds(older, "cpu", TINY_MODEL) is None
    assert section["generator"] == GENERATOR_VERSION, "the committed ones: the current generator"


@pytest.mark.parametrize(
    ("verdict", "caught", "prompt_ids_equal"),
    [
        (Verdict.MISMATCH, True, True),
        (Verdict.VACUOUS, True, True),
        (Verdict.MATCH, False, True),
        (Verdict.DRIFT, False, True),
        (Verdict.ERROR, False, None),
    ],
)
def test_a_rung_is_caught_by_a_mismatch_or_a_vacuous_match_only(
    verdict: Verdict, caught: bool, prompt_ids_equal: bool | None
):
    """VACUOUS (tokens equal, a transfer guard failed) catches a fault as a MISMATCH does, as
    the module says; an ERROR compared nothing, so it says nothing of the prompt ids. Found in
    review: a mutant that caught on MISMATCH alone survived every test (the table's tests build
    their rungs by hand)."""
    record = case_record("1E+1PD", "d-ec-noise-0", verdict, passed=False, detail="d")
    made = rung_from_record("ec-noise", 0.5, record, touched=1)
    assert (made.caught, made.prompt_ids_equal) == (caught, prompt_ids_equal)


def test_a_kv_or_stream_fault_acts_on_a_prompt_without_media() -> None:
    """zero-kv and stream-duplicate-chunk act on any request (P's KV, D's stream): a run of the
    text prompt alone is no run the fault cannot reach, and is not refused as one."""
    from harness.run.faults.spec import refuse_unreached_prompts
    from harness.spec.prompts import SKELETON_PROMPTS

    text = [p for p in SKELETON_PROMPTS if p.name == "text"]
    for fault in ("zero-kv", "drop-kv", "stream-duplicate-chunk"):
        refuse_unreached_prompts(fault, text)
    with pytest.raises(BadInput, match="needs a media item"):
        refuse_unreached_prompts("corrupt-ec", text)


def test_the_threshold_is_the_ladders_down_to_its_first_miss_whatever_is_caught_below() -> None:
    """A cell's rungs below its first miss (a second ladder of the same fault and topology in
    one session, or strengths given by hand) do not move it: a catch below a miss is no
    threshold (else a regression at 0.05 hid behind a lucky 0.005), and the miss it reports
    is the first."""
    table = DetectionTable(
        [
            rung(0.5, "MISMATCH"),
            rung(0.05, "MATCH"),
            rung(0.005, "MISMATCH"),
            rung(0.0005, "DRIFT"),
        ]
    )
    cell = table.cells()["ec-noise"]["1E+1PD"]
    assert (cell["smallest_caught"], cell["missed_at"], cell["missed_verdict"]) == (
        0.5,
        0.05,
        "MATCH",
    ), cell
    assert cell["tried"] == [0.5, 0.05, 0.005, 0.0005]


def test_a_rung_says_whether_the_fault_moved_the_prompt_ids() -> None:
    """detection.json's prompt_ids_equal is read from the verdict's detail: a fault caught by
    prompt ids that differ (an EC fault that changed what the consumer tokenized) is told apart
    from one caught by the generated tokens alone."""
    moved = case_record(
        "1E+1PD",
        "d-video-grid",
        Verdict.MISMATCH,
        passed=False,
        detail="prompt ids differ at position 12; generated tokens differ at 0",
    )
    assert rung_from_record("ec-video-grid", 1.0, moved, touched=1).prompt_ids_equal is False
    kept = case_record(
        "1E+1PD", "d-ec-noise-0", Verdict.MISMATCH, passed=False, detail="tokens differ at 3"
    )
    assert rung_from_record("ec-noise", 0.5, kept, touched=1).prompt_ids_equal is True


def test_a_model_directory_given_by_a_relative_path_is_named_by_its_own_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--model models/my-vl` where that directory exists here is a local model, not the hub's
    `models/my-vl`: its thresholds are committed under my-vl, as an absolute path's are."""
    (tmp_path / "models" / "my-vl").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert model_key("models/my-vl") == "my-vl"
    assert model_key(str(tmp_path / "models" / "my-vl")) == "my-vl"
