"""A pass whose transfer guard nothing could check, on a topology the harness served, fails
the run as it fails the matrix and the pytest sweep (no vLLM, no process)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from harness.cli.main import served_unproven
from harness.judge.compare import Verdict
from harness.judge.records import unproven_passes
from harness.report.run_outputs import write_run_outputs
from harness.spec.platforms import CPU
from harness.spec.settings import RunSettings
from harness.spec.topology import serving_for
from harness.testing.builders import case_record

pytestmark = pytest.mark.unit

HELD = {"kv_transfer": {"ok": True, "evidence": "cached_tokens=96 of 120"}}
UNCHECKED = {
    "kv_transfer": {
        "ok": False,
        "evidence": "not checkable: D took 96 prompt tokens from its own prefix cache",
        "not_checkable": True,
    }
}


def sweep_of(records, attached=None) -> SimpleNamespace:
    return SimpleNamespace(attached=attached, result=SimpleNamespace(records=records))


def test_an_unchecked_guard_of_a_pass_is_named_with_its_case_and_evidence() -> None:
    records = [
        case_record("1P+1D", "image", guards=HELD),
        case_record("1E+1P+1D", "video", guards=UNCHECKED),
        # Failed already: its failure is said, not its guard again.
        case_record("1E+1P+1D", "text", Verdict.MISMATCH, False, guards=UNCHECKED),
    ]
    assert unproven_passes(records) == [
        "1E+1P+1D:video (against baseline): guard kv_transfer not checkable on a topology "
        "the harness served: not checkable: D took 96 prompt tokens from its own prefix cache"
    ]


def test_a_run_that_served_its_topologies_fails_an_unproven_pass() -> None:
    """Every request of a run goes under a cache salt of its own, so no instance it started
    held the prompt: `run` exited 0 on such a MATCH (only a line said the guard was not
    checked), while the pytest sweep and the matrix failed it."""
    records = [case_record("1E+1P+1D", "video", guards=UNCHECKED)]
    assert len(served_unproven(sweep_of(records))) == 1
    assert served_unproven(sweep_of([case_record(guards=HELD)])) == []


def test_an_attached_deployment_reports_its_unchecked_guards_without_failing() -> None:
    """A deployment somebody else started may have seen the prompt, and some guards have no
    evidence outside it (what the consumers were sent): said, not failed (docs/proxies.md)."""
    records = [case_record("1E+1P+1D", "video", guards=UNCHECKED)]
    assert served_unproven(sweep_of(records, attached=object())) == []


def finished_sweep(tmp_path, records) -> SimpleNamespace:
    """A sweep whose run judged `records`, for `finish_run`: its write_outputs does what
    Sweep.write_outputs does with the run's records and run.json's fields, into `tmp_path`."""
    sweep = SimpleNamespace(
        attached=None,
        result=SimpleNamespace(records=records, run_dir=tmp_path),
        run_info={},
        pool=SimpleNamespace(summary=lambda: "pool: 1 start"),
    )
    sweep.write_outputs = lambda: write_run_outputs(tmp_path, records, {}, {}, sweep.run_info)
    return sweep


def test_summary_json_says_a_run_failed_by_its_problems_did_not_pass(tmp_path, capsys) -> None:
    """`run` exits 1 on an unproven pass (a problem); summary.json, which a CI job reads
    instead of the exit code, said `passed: true` for the same run (found in review). It says
    false now, with the problems."""
    import json

    from harness.cli.main import EXIT_FAILED, finish_run
    from harness.report.text import write_summary_json

    records = [case_record("1E+1P+1D", "video", guards=UNCHECKED)]
    write_summary_json(tmp_path / "summary.json", records, {})
    assert json.loads((tmp_path / "summary.json").read_text())["passed"] is True
    sweep = finished_sweep(tmp_path, records)
    args = SimpleNamespace(progress=SimpleNamespace(started=time.monotonic()))
    assert finish_run(args, served_unproven(sweep), sweep) == EXIT_FAILED
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["passed"] is False
    assert summary["problems"] == served_unproven(sweep)


def test_the_reports_of_a_run_failed_by_its_problems_say_so(tmp_path, capsys) -> None:
    """Found in review: a run failed by its problems alone (a matrix scenario's check, an
    unproven pass) exited 1 and summary.json said so, while report.html led with PASS, "all 1
    case(s) passed their policy", verdicts.txt (what the cherry-pick workflow shows) with
    "1 pass, 0 fail", and diff.md "All 1 case(s) passed", none naming the problem."""
    from harness.cli.main import EXIT_FAILED, finish_run

    records = [case_record("1E+1PD", "video", guards=HELD)]
    problem = "scenario ec-x: check <encoder_calls> failed: the encoder was called twice"
    sweep = finished_sweep(tmp_path, records)
    sweep.write_outputs()
    args = SimpleNamespace(progress=SimpleNamespace(started=time.monotonic()))
    assert finish_run(args, [problem], sweep) == EXIT_FAILED
    page = (tmp_path / "report.html").read_text()
    assert '<span class="status fail">FAIL</span>' in page
    assert "scenario ec-x: check &lt;encoder_calls&gt; failed" in page
    verdicts = (tmp_path / "verdicts.txt").read_text()
    assert f"problem: {problem}" in verdicts
    diff = (tmp_path / "diff.md").read_text()
    assert diff.startswith("# EPD diff\n\n## The run failed by 1 problem(s)\n\n- problem: ")
    assert "check &lt;encoder_calls&gt; failed" in diff


@pytest.mark.parametrize("cases, exit_code", [(0, 1), (1, 0)])
def test_a_run_without_cases_exits_1_as_its_reports_say(
    tmp_path, capsys, cases: int, exit_code: int
) -> None:
    """A run that judged nothing proved nothing: summary.json says `passed: false` and
    junit.xml a failing case (NO_CASES), and `run` exits 1 with them. Found in review: a
    mutant that exited 0 for a run without cases survived every test."""
    import json

    from harness.cli.main import finish_run

    records = [case_record("1E+1PD", "video", guards=HELD)][:cases]
    sweep = finished_sweep(tmp_path, records)
    sweep.write_outputs()
    args = SimpleNamespace(progress=SimpleNamespace(started=time.monotonic()))
    assert finish_run(args, served_unproven(sweep), sweep) == exit_code
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["passed"] is (exit_code == 0)


def sweep_class_of(tmp_path, records) -> type:
    """A stand-in for `main.Sweep` whose run judged `records` and writes its reports to
    `tmp_path`: what `run_config` does after the sweep is what these tests look at."""

    class RecordedSweep:
        def __init__(self, spec, settings, **_kwargs) -> None:
            self.attached, self.run_info, self.fault_misses = None, {}, []
            self.result = SimpleNamespace(records=records, run_dir=settings.run_dir)
            self.pool = SimpleNamespace(summary=lambda: "pool: 1 start", close=lambda: None)

        def write_outputs(self) -> None:
            write_run_outputs(tmp_path, records, {}, {}, self.run_info)

    return RecordedSweep


def cpu_settings(tmp_path) -> RunSettings:
    """Settings of a CPU run whose model is never loaded (the sweep is a stand-in)."""
    return RunSettings(
        serving=serving_for(CPU, "/not-a-dir-model", max_model_len=4096), run_dir=tmp_path
    )


def run_args() -> SimpleNamespace:
    """The parsed arguments `run_config` reads: its progress and --max-model-len."""
    progress = SimpleNamespace(started=time.monotonic(), on_event=None, run_dir=None)
    return SimpleNamespace(progress=progress, max_model_len=4096)


def test_a_planted_fault_that_acted_on_nothing_fails_run_with_every_case_a_match(
    tmp_path, monkeypatch, capsys
) -> None:
    """`run --plant-fault` whose fault acted on nothing proved nothing of the harness: the
    sweep's fault misses are problems of the run, which exits 1 and says them, every case a
    MATCH notwithstanding. Found in review: a mutant that left the misses out of `run`'s
    problems survived every unit test (test_fake_transfers reads the sweep's list only)."""
    import json

    from harness.cli import main
    from harness.preflight.config import RunConfig
    from harness.spec.prompts import SKELETON_PROMPTS
    from harness.spec.topology import TOPOLOGIES

    miss = "1E+1PD: the planted fault corrupt-ec acted on nothing (no EC file): its cases prove"
    records = [case_record("1E+1PD", "image", guards=HELD)]

    class FaultMissedSweep(sweep_class_of(tmp_path, records)):
        def run_all(self) -> None:
            self.fault_misses.append(miss)

    monkeypatch.setattr(main, "Sweep", FaultMissedSweep)
    settings = cpu_settings(tmp_path)
    image = next(p for p in SKELETON_PROMPTS if p.name == "image")
    config = RunConfig(
        (TOPOLOGIES["1E+1PD"],), (image,), (), (), settings, None, fault="corrupt-ec"
    )
    assert main.run_config(run_args(), config) == main.EXIT_FAILED
    assert f"problem: {miss}" in capsys.readouterr().out
    assert json.loads((tmp_path / "summary.json").read_text())["problems"] == [miss]


def test_a_matrix_scenarios_problem_fails_run_scenario(tmp_path, monkeypatch, capsys) -> None:
    """`run --scenario` fails on what its scenarios' problems say (a check that failed, a
    verdict other than declared), though every record passed. Found in review: a mutant that
    finished the matrix run without its problems survived every unit test."""
    from harness.cli import main
    from harness.preflight.config import RunConfig
    from harness.run.scenarios import get_scenario

    problem = "scenario ec-x: check <encoder_calls> failed: the encoder was called twice"
    records = [case_record("1E+1PD", "image", guards=HELD)]

    monkeypatch.setattr(main, "Sweep", sweep_class_of(tmp_path, records))
    monkeypatch.setattr(main, "run_matrix", lambda sweep, scenarios: [problem])
    settings = cpu_settings(tmp_path)
    scenario = get_scenario("ec-images-1-2-3")
    config = RunConfig((), scenario.prompts, (), (scenario,), settings, None, fault=None)
    assert main.run_config(run_args(), config) == main.EXIT_FAILED
    assert f"problem: {problem}" in capsys.readouterr().out


def test_a_matrix_scenarios_unproven_pass_is_one_of_its_problems() -> None:
    """The matrix's pytest items (scenarios/test_matrix.py) fail on a scenario's problems
    alone, with no run-wide check after them: a pass whose guard nothing could check must be
    among them, as in `run`, though every record passed. Found in review: a mutant that left
    the unproven passes out of ScenarioResult.problems survived every test."""
    from harness.run.matrix import ScenarioResult
    from harness.run.scenarios import Scenario

    unproven = case_record("1E+1P+1D", "video", guards=UNCHECKED)
    result = ScenarioResult(Scenario("s", "1E+1P+1D", ()), [unproven])
    assert result.problems() == unproven_passes([unproven]) != []
    assert (
        ScenarioResult(Scenario("s", "1E+1P+1D", ()), [case_record(guards=HELD)]).problems() == []
    )
