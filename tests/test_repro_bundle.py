"""Reading a run bundle for `epd-harness repro` (no vLLM: the rerun itself is e2e)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from harness.preflight.vllm_args import ArgvCheck
from harness.run.repro import Bundle, BundleError
from harness.spec.settings import LauncherChoice
from harness.spec.topology import ServingConfig

pytestmark = pytest.mark.unit


def write_bundle(root: Path, cases: list[dict], serving: dict | None = None) -> Path:
    root.mkdir(parents=True)
    serving = serving or {"model": "/m", "block_size": 32, "extra_args": [], "unknown_flag": 1}
    (root / "run.json").write_text(json.dumps({"serving": serving, "fault": "corrupt-ec"}))
    (root / "requests.json").write_text(json.dumps({"image": {"model": "epd-model"}}))
    (root / "summary.json").write_text(json.dumps({"cases": cases}))
    return root


def case(topology: str, prompt: str, verdict: str, passed: bool) -> dict:
    return {
        "topology": topology,
        "prompt": prompt,
        "verdict": verdict,
        "policy_passed": passed,
        "reference": "baseline",
    }


def test_picks_the_first_failing_case_and_cuts_scenario_labels(tmp_path: Path) -> None:
    bundle = Bundle.load(
        write_bundle(
            tmp_path / "b",
            [
                case("1E+1PD", "text", "MATCH", True),
                case("1E+1PD:ec-images-1-2-3", "image", "MISMATCH", False),
            ],
        )
    )
    picked = bundle.pick_case(None)
    assert (picked.topology, picked.prompt, picked.verdict) == ("1E+1PD", "image", "MISMATCH")


def test_a_named_case_can_be_a_passing_one(tmp_path: Path) -> None:
    bundle = Bundle.load(write_bundle(tmp_path / "b", [case("1P+1D", "text", "MATCH", True)]))
    assert bundle.pick_case("1P+1D:text").verdict == "MATCH"
    with pytest.raises(BundleError, match="no case '1P\\+1D:video'"):
        bundle.pick_case("1P+1D:video")


def test_all_passing_bundle_says_what_to_do(tmp_path: Path) -> None:
    bundle = Bundle.load(write_bundle(tmp_path / "b", [case("1P+1D", "text", "MATCH", True)]))
    with pytest.raises(BundleError, match="every case passed; name one with --case") as refused:
        bundle.pick_case(None)
    # `export` of a green run (real vLLM, 1E+1PD text) said to name one, not which there are
    assert str(refused.value).endswith("(its cases: 1P+1D:text)"), refused.value


def test_serving_config_is_rebuilt_ignoring_unknown_fields(tmp_path: Path) -> None:
    bundle = Bundle.load(write_bundle(tmp_path / "b", []))
    assert bundle.serving() == ServingConfig(model="/m", block_size=32)


def test_repro_of_a_directory_that_is_no_bundle_is_bad_input(tmp_path: Path, epd_cli) -> None:
    (tmp_path / "empty").mkdir()
    code, _, stderr = epd_cli("repro", tmp_path / "empty")
    assert code == 2
    err = stderr.strip().splitlines()
    assert (
        len(err) == 1 and "is not a run bundle: no run.json, requests.json, summary.json" in err[0]
    )


def test_repro_reruns_where_the_bundle_ran(tmp_path: Path) -> None:
    """A bundle of a Ray run is rerun on Ray (the same cluster address, placement, env);
    bundles of local runs, and those from before the launcher was recorded, locally."""
    local = Bundle.load(write_bundle(tmp_path / "local", [case("1P+1D", "text", "MATCH", True)]))
    assert local.launcher == LauncherChoice()
    root = write_bundle(tmp_path / "ray", [case("1P+1D", "text", "MATCH", True)])
    run = json.loads((root / "run.json").read_text())
    run["launcher"] = {
        "kind": "ray",
        "ray_address": "10.0.0.1:6379",
        "placement": "pack",
        "shared_dir": None,
        "instance_env": {"UCX_TLS": "tcp"},
    }
    (root / "run.json").write_text(json.dumps(run))
    assert Bundle.load(root).launcher == LauncherChoice(
        "ray", ray_address="10.0.0.1:6379", placement="pack", instance_env=(("UCX_TLS", "tcp"),)
    )


def rerun_settings(root: Path, monkeypatch: pytest.MonkeyPatch, served_version: str):
    """The settings `reproduce` serves the bundle's failing case with (nothing started)."""
    import harness.run.repro as repro
    from harness.spec.settings import ServedVllm

    seen = stub_the_rerun(monkeypatch)
    repro.reproduce(Bundle.load(root), root / "again", ServedVllm("vllm", served_version))
    return seen["settings"]


def stub_the_rerun(monkeypatch: pytest.MonkeyPatch) -> dict:
    """What `reproduce` hands its rerun, with the pool and the sweep standing in for servers
    (nothing starts): "settings", the settings it serves with, "on_event", whom the pool tells
    each server's state, "bodies" and "stage", what the sweep is to send, and per prompt the
    declaration the rerun is judged under."""
    import harness.run.repro as repro

    seen: dict = {}

    class NoPool:
        def __init__(self, settings, on_event=None):
            seen["settings"] = settings
            seen["on_event"] = on_event

        def close(self) -> None:
            pass

    class NoSweep:
        def __init__(self, spec, settings, bodies, pool, stage=None, **reference):
            seen["bodies"] = bodies
            seen["stage"] = stage
            seen["reference"] = reference

        def judge(self, topology, prompt, declared=None, exact_reference=True):
            seen[prompt] = declared
            seen["exact_reference"] = exact_reference
            return []

    monkeypatch.setattr(repro, "TopologyPool", NoPool)
    monkeypatch.setattr(repro, "Sweep", NoSweep)
    return seen


class ClosedSweep:
    """The sweep `reproduce` hands back, as `repro` reads it after judging: a stage that was
    set, and a pool to close."""

    stage_unset = None

    class pool:  # noqa: N801 - stands in for the sweep's pool
        @staticmethod
        def close() -> None:
            pass


def every_line_taken(*_args: object) -> ArgvCheck:
    """The served parser's check of a CLI test whose vLLM is only a name ("/v"), with no
    interpreter to parse with: every line taken (the check itself: test_bad_input.py)."""
    return ArgvCheck("vllm 0.32.0+cpu (stand-in)", (), judged=0, seconds=0.0)


def rerun_bundle(root: Path, label: str, **run: object) -> Path:
    root = write_bundle(root, [case(label, "image", "MISMATCH", False)])
    recorded = json.loads((root / "run.json").read_text())
    (root / "run.json").write_text(json.dumps({**recorded, **run, "fault": None}))
    return root


def with_model_here(root: Path) -> Path:
    """The bundle at `root`, its model a checkpoint directory on this host (repro checks it
    before anything starts)."""
    model = root.parent / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    run = json.loads((root / "run.json").read_text())
    run["serving"] = {**run["serving"], "model": str(model)}
    (root / "run.json").write_text(json.dumps(run))
    return root


@pytest.mark.parametrize(
    "label, run_streams, streams",
    [
        ("1E+1P+1D:epd-streamed", False, True),  # the scenario streams whatever the run says
        ("1E+1PD:ec-concurrent-requests", False, False),
        ("1E+1PD", True, True),  # the run's --stream
    ],
)
def test_repro_streams_what_the_run_streamed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, label: str, run_streams: bool, streams: bool
) -> None:
    """requests.json holds a body before streaming was added; a streamed scenario's case was
    rerun unstreamed (found in review)."""
    root = rerun_bundle(tmp_path / "b", label, stream=run_streams)
    assert rerun_settings(root, monkeypatch, "0.32.0+cpu").stream is streams


def test_repro_speaks_the_protocol_the_run_spoke_on_the_same_vllm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A run given `--protocol` is rerun speaking it (found in review: the served release's
    own was taken, with other flags); another vLLM speaks its own, and says so."""
    from harness.spec.generations import GENERATIONS_BY_NAME

    spoke = GENERATIONS_BY_NAME["by-hash"].to_json()
    root = rerun_bundle(
        tmp_path / "b", "1E+1PD", protocol=spoke, served_vllm={"version": "0.32.0+cpu"}
    )
    assert rerun_settings(root, monkeypatch, "0.32.0+cpu").protocol.name == "by-hash"
    assert rerun_settings(root, monkeypatch, "0.31.0+cpu").protocol.name == "by-hash-indexed"
    assert "the bundle's run spoke protocol by-hash (vLLM 0.32.0+cpu)" in caplog.text


@pytest.mark.parametrize(
    "served, names_versions",
    [("0.32.0+cpu", False), ("0.31.0+cpu", True)],
)
def test_the_verdict_line_names_both_vllms_when_repro_serves_another(
    tmp_path: Path, served: str, names_versions: bool
) -> None:
    """`repro --vllm OTHER` on a bundle: "reproduced" then claims something else than on the
    bundle's own vLLM, which only a log warning used to say (found in review)."""
    from harness.run.repro import repro_line
    from harness.spec.settings import ServedVllm

    root = rerun_bundle(tmp_path / "b", "1E+1PD", served_vllm={"version": "0.32.0+cpu"})
    bundle = Bundle.load(root)
    line = repro_line(bundle.pick_case(None), "MISMATCH", bundle, ServedVllm("/v", served))
    assert line.startswith("1E+1PD / image vs baseline: MISMATCH now, MISMATCH in the bundle: ")
    assert "reproduced" in line
    assert ("the bundle served vLLM 0.32.0+cpu, this run 0.31.0+cpu" in line) is names_versions


def test_repro_tells_the_cli_each_servers_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM to `repro --keep-up` with its topology serving said "interrupted before any
    server was running" (real vLLM): repro's pool never reported the states `run`'s does."""
    import harness.run.repro as repro
    from harness.spec.settings import ServedVllm

    def told(name: str, state: str, elapsed_s: float) -> None:
        pass

    seen = stub_the_rerun(monkeypatch)
    root = rerun_bundle(tmp_path / "b", "1E+1PD")
    repro.reproduce(Bundle.load(root), root / "again", ServedVllm("v", "0.32.0"), on_event=told)
    assert seen["on_event"] is told


def test_repro_refuses_colocation_on_cpu_and_a_bad_device_list_in_one_line(
    tmp_path: Path, epd_cli
) -> None:
    root = write_bundle(tmp_path / "b", [case("1P+1D", "text", "MISMATCH", False)])
    for argv, named in (
        (("--colocate",), "--colocate shares GPUs within a topology"),
        (("--devices", "0,0"), "--devices: device 0 is listed twice"),
    ):
        code, _, err = epd_cli("repro", root, *argv)
        assert code == 2 and err.count("\n") == 1 and named in err, (argv, err)


def test_repro_rerun_settings_take_the_hosts_devices_and_the_runs_colocation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    colocated = rerun_bundle(
        tmp_path / "one", "1P+1D", platform_profile="cuda", devices=[0], colocate=True
    )
    settings = rerun_settings(colocated, monkeypatch, "0.32.0")
    assert (settings.devices, settings.colocate) == ((0,), True)
    night = rerun_bundle(tmp_path / "night", "1P+1D", platform_profile="cuda", devices=[0, 3, 4])
    assert rerun_settings(night, monkeypatch, "0.32.0").colocate is False


@pytest.mark.parametrize("fault", ["ec-noise:0.05", None])
def test_the_verdict_line_says_a_planted_fault_was_planted_again(
    tmp_path: Path, fault: str | None
) -> None:
    """repro replants the bundle's `--plant-fault`, and its one line said only "MISMATCH now,
    MISMATCH in the bundle: reproduced" (real vLLM, 1E+1PD ec-noise:0.05): a developer handed the
    bundle reads a reproduced vLLM failure where the harness made it red on purpose."""
    from harness.run.repro import repro_line
    from harness.spec.settings import ServedVllm

    root = rerun_bundle(tmp_path / "b", "1E+1PD")
    recorded = json.loads((root / "run.json").read_text())
    (root / "run.json").write_text(json.dumps({**recorded, "fault": fault}))
    bundle = Bundle.load(root)
    line = repro_line(bundle.pick_case(None), "MISMATCH", bundle, ServedVllm("/v", "0.32.0+cpu"))
    planted = "red on purpose: the bundle's planted fault ec-noise:0.05 was planted again"
    assert (planted in line) is (fault is not None), line
    assert "reproduced" in line


def test_a_case_the_bundle_lacks_is_refused_naming_those_it_has(tmp_path: Path) -> None:
    """`export RUN --case 1E+1PD:ec-video-jpeg-frames-at-2-fps:m-video-jpeg-frames-2fps` (the
    TOPOLOGY column of the verdict table, then the prompt) was refused as "no case ..." alone
    (real run of two matrix scenarios): the spelling that works, the topology proper and the
    prompt, was nowhere to be read."""
    bundle = Bundle.load(
        write_bundle(
            tmp_path / "b",
            [
                case(
                    "1E+1PD:ec-video-jpeg-frames-default-fps",
                    "m-video-jpeg-frames",
                    "MISMATCH",
                    True,
                ),
                case(
                    "1E+1PD:ec-video-jpeg-frames-at-2-fps",
                    "m-video-jpeg-frames-2fps",
                    "MATCH",
                    True,
                ),
            ],
        )
    )
    wanted = "1E+1PD:ec-video-jpeg-frames-at-2-fps:m-video-jpeg-frames-2fps"
    with pytest.raises(BundleError) as refused:
        bundle.pick_case(wanted)
    assert str(refused.value) == (
        f"{bundle.path}: no case {wanted!r}; its cases: 1E+1PD:m-video-jpeg-frames "
        "(scenario ec-video-jpeg-frames-default-fps), 1E+1PD:m-video-jpeg-frames-2fps "
        "(scenario ec-video-jpeg-frames-at-2-fps)"
    )
    assert bundle.pick_case("1E+1PD:m-video-jpeg-frames-2fps").verdict == "MATCH"


def test_the_verdict_tables_scenario_cell_names_its_case_when_the_scenario_has_one(
    tmp_path: Path,
) -> None:
    """Real vLLM: `export RUN --case 1E+1PD:ec-video-mp4-not-at-2-fps`, the TOPOLOGY cell of
    the run's verdict table, was refused though that scenario judged one prompt. It names that
    case now; a scenario of several prompts is refused naming each."""
    bundle = Bundle.load(
        write_bundle(
            tmp_path / "b",
            [
                case("1E+1PD:ec-video-mp4-not-at-2-fps", "m-video-mp4-1fps", "MISMATCH", True),
                case("1E+1PD:ec-images-1-2-3", "m-one-image", "MATCH", True),
                case("1E+1PD:ec-images-1-2-3", "m-two-images", "MATCH", True),
            ],
        )
    )
    picked = bundle.pick_case("1E+1PD:ec-video-mp4-not-at-2-fps")
    assert (picked.prompt, picked.verdict) == ("m-video-mp4-1fps", "MISMATCH"), picked
    with pytest.raises(BundleError) as refused:
        bundle.pick_case("1E+1PD:ec-images-1-2-3")
    assert str(refused.value) == (
        f"{bundle.path}: scenario '1E+1PD:ec-images-1-2-3' has 2 cases; name one with --case: "
        "1E+1PD:m-one-image (scenario ec-images-1-2-3), 1E+1PD:m-two-images (scenario "
        "ec-images-1-2-3)"
    )


def test_repro_prints_the_first_divergence_of_the_case_it_reran(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """`repro` of a kv-noise bundle (real vLLM, 1P+1D) printed the verdict table and
    "MISMATCH now, MISMATCH in the bundle: reproduced", but not where the ids parted, nor the
    top-k there, which `run` prints: whether the rerun parted where the bundle did could not be
    read from it."""
    import harness.cli.main as cli
    from harness.outcomes.outcome import Outcome
    from harness.spec.settings import ServedVllm
    from harness.testing.builders import chat
    from harness.testing.judging import judged

    root = with_model_here(rerun_bundle(tmp_path / "b", "1P+1D"))
    record = judged(
        "1P+1D",
        "baseline",
        Outcome("image", chat([5, 6, 7, 8])),
        Outcome("image", chat([5, 6, 9, 8])),
    )

    def rerun(bundle, *args, **kwargs):
        return bundle.pick_case(None), [record], ClosedSweep()

    monkeypatch.setattr(cli, "probe_served_vllm", lambda vllm: ServedVllm(vllm, "0.32.0+cpu"))
    monkeypatch.setattr(cli, "proxy_choice", lambda *args: None)
    monkeypatch.setattr(cli, "check_repro_argvs", every_line_taken)
    monkeypatch.setattr(cli, "reproduce", rerun)
    assert cli.main(["repro", str(root), "--vllm", "/v"]) == 0
    out = capsys.readouterr().out
    assert "generated tokens differ at position 2" in out
    assert "reference ⟶ 7        5 6 [7] 8" in out and "candidate ⟶ 9        5 6 [9] 8" in out, out
    assert "reference top-k at 2" in out and "candidate top-k at 2" in out, out


def test_repro_serves_the_exact_reference_only_for_a_case_judged_against_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real vLLM: `repro` of a fuzz bundle (1E+1P+1D judged against the baseline alone)
    started 1P+1D too, and judged a comparison the bundle never made. The exact reference is
    served only for the case against it."""
    import harness.run.repro as repro
    from harness.spec.settings import ServedVllm

    seen = stub_the_rerun(monkeypatch)
    fuzzed = rerun_bundle(tmp_path / "fuzz", "1E+1P+1D")
    repro.reproduce(Bundle.load(fuzzed), tmp_path / "again", ServedVllm("vllm", "0.32.0+cpu"))
    assert seen["exact_reference"] is False
    swept = rerun_bundle(tmp_path / "sweep", "1E+1P+1D")
    summary = json.loads((swept / "summary.json").read_text())
    against_1p1d = {**summary["cases"][0], "reference": "1P+1D"}
    (swept / "summary.json").write_text(json.dumps({"cases": [*summary["cases"], against_1p1d]}))
    served = ServedVllm("vllm", "0.32.0+cpu")
    repro.reproduce(Bundle.load(swept), tmp_path / "again2", served, "1E+1P+1D:image@1P+1D")
    assert seen["exact_reference"] is True
    # Real vLLM: `repro --case 1E+1P+1D:image@baseline` of a sweep's bundle started 1P+1D
    # (40 s more on two cores) and judged the case against it too, though the verdict line
    # names the baseline alone. The case names its reference: only that one is served.
    repro.reproduce(Bundle.load(swept), tmp_path / "again3", served, "1E+1P+1D:image@baseline")
    assert seen["exact_reference"] is False


DECLARED_LABEL = "1E+1PD:ec-video-jpeg-frames-default-fps"


def test_repro_judges_a_declared_failure_as_the_bundle_did(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`repro --case` of a matrix scenario's declared MISMATCH printed "policy FAILED": the
    scenario's declaration was not carried into the rerun, while the bundle had passed it
    (real vLLM 0.32.0). The rerun is judged under the scenario's declaration; a case no
    scenario declares, under none."""
    import harness.run.repro as repro
    from harness.spec.settings import ServedVllm

    judged = stub_the_rerun(monkeypatch)
    root = write_bundle(
        tmp_path / "b",
        [case(DECLARED_LABEL, "image", "MISMATCH", True), case("1E+1PD", "text", "MATCH", True)],
    )
    run = json.loads((root / "run.json").read_text())
    (root / "run.json").write_text(json.dumps({**run, "fault": None}))
    (root / "requests.json").write_text(json.dumps({"image": {}, "text": {}}))
    bundle = Bundle.load(root)
    repro.reproduce(bundle, root / "again", ServedVllm("vllm", "0.32.0+cpu"), "1E+1PD:image")
    repro.reproduce(bundle, root / "again2", ServedVllm("vllm", "0.32.0+cpu"), "1E+1PD:text")
    declared = judged["image"]
    assert declared is not None, "the scenario's declaration was not carried into the rerun"
    assert (declared.verdict, declared.evidence) == ("MISMATCH", "generated tokens differ")
    assert judged["text"] is None


@pytest.mark.parametrize(
    "held, says",
    [
        (
            True,
            "; a known vLLM failure, declared by matrix scenario "
            "ec-video-jpeg-frames-default-fps (expects MISMATCH)",
        ),
        (
            False,
            "; NOT as matrix scenario ec-video-jpeg-frames-default-fps declares (expects MISMATCH)",
        ),
    ],
)
def test_the_verdict_line_names_the_declaration(tmp_path: Path, held: bool, says: str) -> None:
    """A reproduced declared failure reads as the known failure it is, naming the scenario
    that declares it; one that no longer fails as declared says so."""
    from harness.run.repro import repro_line
    from harness.spec.settings import ServedVllm

    root = rerun_bundle(tmp_path / "b", DECLARED_LABEL, served_vllm={"version": "0.32.0+cpu"})
    bundle = Bundle.load(root)
    case_ = bundle.pick_case(None)
    line = repro_line(case_, "MISMATCH", bundle, ServedVllm("/v", "0.32.0+cpu"), held)
    assert line.endswith(f"in the bundle: reproduced{says}"), line
    plain = rerun_bundle(tmp_path / "p", "1E+1PD", served_vllm={"version": "0.32.0+cpu"})
    bundle = Bundle.load(plain)
    assert "declare" not in repro_line(
        bundle.pick_case(None), "MISMATCH", bundle, ServedVllm("/v", "0.32.0+cpu"), held
    )


def test_a_green_bundle_with_a_declared_failure_names_it(tmp_path: Path) -> None:
    """`repro` of a green run of ec-video-jpeg-frames-default-fps said "every case passed"
    and nothing of the declared MISMATCH it holds (real vLLM 0.32.0): it names that case."""
    bundle = Bundle.load(
        write_bundle(
            tmp_path / "b",
            [
                case("1E+1PD", "text", "MATCH", True),
                case(DECLARED_LABEL, "m-video-jpeg-frames", "MISMATCH", True),
            ],
        )
    )
    with pytest.raises(BundleError, match="every case passed") as refused:
        bundle.pick_case(None)
    assert str(refused.value).endswith(
        "; 1E+1PD:m-video-jpeg-frames (scenario ec-video-jpeg-frames-default-fps) failed as "
        "declared, a known vLLM failure: --case 1E+1PD:m-video-jpeg-frames reruns it"
    ), refused.value


def release_bundle(root: Path, served: str, protocol: str, verdict: str = "MISMATCH") -> Path:
    """A bundle of `run` on vLLM `served` (speaking `protocol`) whose 1E+1PD video case was
    judged `verdict`: run.json keeps the prompt's spec, requests.json its body."""
    from harness.report.bundle import _prompt_json
    from harness.spec.generations import GENERATIONS_BY_NAME
    from harness.spec.prompts import SKELETON_PROMPTS

    video = next(p for p in SKELETON_PROMPTS if p.name == "video")
    root = write_bundle(root, [case("1E+1PD", "video", verdict, True)])
    run = json.loads((root / "run.json").read_text())
    (root / "run.json").write_text(
        json.dumps(
            {
                **run,
                "fault": None,
                "served_vllm": {"version": served},
                "protocol": GENERATIONS_BY_NAME[protocol].to_json(),
                "prompts": [_prompt_json(video)],
            }
        )
    )
    (root / "requests.json").write_text(json.dumps({"video": {"model": "epd-model"}}))
    return root


def judged_under(root: Path, served: str, monkeypatch: pytest.MonkeyPatch):
    """The declaration `reproduce` has the rerun of the bundle's video case judged under, on
    vLLM `served` (nothing started)."""
    import harness.run.repro as repro
    from harness.spec.settings import ServedVllm

    judged = stub_the_rerun(monkeypatch)
    repro.reproduce(Bundle.load(root), root / "again", ServedVllm("vllm", served), "1E+1PD:video")
    return judged["video"]


def test_repro_judges_a_releases_declared_failure_as_the_bundle_did(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 0.30.0 run passes 1E+1PD video's MISMATCH as the release's declared failure (video
    timing before 0.31); its rerun replays the recorded body with no prompt spec, where the
    release's declaration is looked up, so it was judged under none: "policy FAILED" while
    the bundle had passed it. Rerun on 0.30.0 it is judged under 0.30's declaration; on 0.32.0,
    which declares none, under none (a MATCH there is the fix upstream)."""
    from harness.spec.generations import VIDEO_TIMING_BEFORE_0_31

    root = release_bundle(tmp_path / "b", "0.30.0+cpu", "by-hash")
    assert judged_under(root, "0.30.0+cpu", monkeypatch) == VIDEO_TIMING_BEFORE_0_31
    assert judged_under(root, "0.32.0+cpu", monkeypatch) is None


@pytest.mark.parametrize(
    "served, now, held, says",
    [
        (
            "0.30.0+cpu",
            "MISMATCH",
            True,
            "MISMATCH in the bundle: reproduced; a known vLLM failure, declared by protocol "
            "generation by-hash (vLLM >= 0.30.0 < 0.31.0) (expects MISMATCH)",
        ),
        (
            "0.32.0+cpu",
            "MATCH",
            True,
            "MISMATCH in the bundle: NOT reproduced (the bundle served vLLM 0.30.0+cpu, this "
            "run 0.32.0+cpu); declared by protocol generation by-hash (vLLM >= 0.30.0 < 0.31.0) "
            "for the bundle's vLLM 0.30.0+cpu, not for vLLM 0.32.0+cpu: it passes now, fixed "
            "upstream",
        ),
        (
            "0.32.0+cpu",
            "MISMATCH",
            False,
            "for the bundle's vLLM 0.30.0+cpu, not for vLLM 0.32.0+cpu: it still fails, "
            "judged undeclared",
        ),
    ],
)
def test_the_verdict_line_names_a_releases_declaration(
    tmp_path: Path, served: str, now: str, held: bool, says: str
) -> None:
    """A 0.30.0 bundle's video case rerun on 0.30.0 reads as the release's known failure; on
    0.32.0, which declares none, a pass is said plainly to be the fix upstream, not a failure
    to reproduce a bug."""
    from harness.run.repro import repro_line
    from harness.spec.settings import ServedVllm

    bundle = Bundle.load(release_bundle(tmp_path / "b", "0.30.0+cpu", "by-hash"))
    case_ = bundle.pick_case("1E+1PD:video")
    line = repro_line(case_, now, bundle, ServedVllm("/v", served), held)
    assert line.endswith(says), line


@pytest.mark.parametrize("golden, held", [("0.31.0", False), ("0.29.0", True)])
def test_a_golden_judged_bundle_is_rerun_under_the_golden_rule_of_its_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog, golden: str, held: bool
) -> None:
    """Real vLLM: `run --vllm <0.30.0> --golden 0.31.0 --prompt video` MATCHed golden-0.31.0,
    0.30.0's declared video timing set aside (0.31.0 declares none); its repro judged the
    rerun under that declaration ("repro: judged as protocol generation by-hash declares
    it"), so the same MATCH failed it. Against the golden of 0.29.0, which declares it too,
    the declaration holds, as in the run."""
    from harness.run.repro import repro_line
    from harness.spec.generations import VIDEO_TIMING_BEFORE_0_31
    from harness.spec.settings import ServedVllm

    root = release_bundle(tmp_path / "b", "0.30.0+cpu", "by-hash", verdict="MATCH")
    run = json.loads((root / "run.json").read_text())
    (root / "run.json").write_text(json.dumps({**run, "golden_release": golden}))
    with caplog.at_level(logging.WARNING, logger="harness.run.repro"):
        declared = judged_under(root, "0.30.0+cpu", monkeypatch)
    assert declared == (VIDEO_TIMING_BEFORE_0_31 if held else None)
    said = [r.getMessage() for r in caplog.records if "its own baseline" in r.getMessage()]
    assert said == (
        []
        if held
        else [
            "repro: vLLM 0.30.0+cpu declares video-timing-before-0.31 against its own "
            "baseline; vLLM 0.31.0, whose golden judges this run, does not: its cases are "
            "judged as any case is"
        ]
    )
    bundle = Bundle.load(root)
    line = repro_line(
        bundle.pick_case("1E+1PD:video"), "MATCH", bundle, ServedVllm("/v", "0.30.0+cpu")
    )
    assert line.endswith("MATCH in the bundle: reproduced") != held, line


def test_a_bundle_prompt_that_is_no_spec_is_refused_naming_it(tmp_path: Path) -> None:
    """run.json's prompt entry is where a release's declaration is read from; a broken one is
    one error naming the file and the prompt, not a KeyError from deep in the rerun."""
    root = release_bundle(tmp_path / "b", "0.30.0+cpu", "by-hash")
    run = json.loads((root / "run.json").read_text())
    del run["prompts"][0]["parts"]
    (root / "run.json").write_text(json.dumps(run))
    with pytest.raises(BundleError, match=r"run.json: prompt 'video' is not a prompt's spec: no "):
        Bundle.load(root).prompt_spec("video")


def test_a_scenario_expected_to_match_has_its_releases_declaration_in_the_rerun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The matrix judges ec-video-mp4 (expected to MATCH) under the served release's declared
    failures too (0.30's video timing), from the scenario's own prompt spec, which run.json
    does not keep: its rerun on 0.30.0 is judged under 0.30's declaration as well."""
    from harness.spec.generations import VIDEO_TIMING_BEFORE_0_31

    root = release_bundle(tmp_path / "b", "0.30.0+cpu", "by-hash")
    summary = {"cases": [case("1E+1PD:ec-video-mp4", "m-video-mp4", "MISMATCH", True)]}
    (root / "summary.json").write_text(json.dumps(summary))
    (root / "requests.json").write_text(json.dumps({"m-video-mp4": {"model": "epd-model"}}))
    import harness.run.repro as repro
    from harness.spec.settings import ServedVllm

    judged = stub_the_rerun(monkeypatch)
    bundle = Bundle.load(root)
    repro.reproduce(bundle, root / "again", ServedVllm("vllm", "0.30.0+cpu"), "1E+1PD:m-video-mp4")
    assert judged["m-video-mp4"] == VIDEO_TIMING_BEFORE_0_31


# -- a scenario's earlier requests, replayed first -----------------------------------------------

KILLS_PREFILL = "1E+1P+1D:epd-kv-lookup-miss-kills-prefill"
ACROSS_KWARGS = "1E+1PD:ec-same-image-across-kwargs"


def scenario_bundle(root: Path, label: str, prompt: str, verdict: str = "ERROR") -> Path:
    """A bundle of one case of a matrix scenario (`label`: TOPOLOGY:SCENARIO) whose
    requests.json holds a body of each of the scenario's prompts, each told apart (its
    own text, keys in an order of their own), as a matrix run records them."""
    from harness.run.scenarios import get_scenario

    root = write_bundle(root, [case(label, prompt, verdict, False)])
    run = json.loads((root / "run.json").read_text())
    (root / "run.json").write_text(json.dumps({**run, "fault": None}))
    scenario = get_scenario(label.partition(":")[2])
    bodies = {
        p.name: {
            "messages": [{"role": "user", "content": [{"type": "text", "text": f"{p.name} é"}]}],
            "model": "epd-model",
            "max_tokens": 8 + n,
        }
        for n, p in enumerate(scenario.prompts)
    }
    (root / "requests.json").write_text(json.dumps(bodies))
    return root


@pytest.mark.parametrize(
    "label, prompt, earlier",
    [
        (KILLS_PREFILL, "m-text-at-block-plus-one", ("m-text-stores-the-lookup-key",)),
        (
            ACROSS_KWARGS,
            "m-kwargs-image-36-tokens",
            ("m-kwargs-image-plain", "m-kwargs-image-16-tokens"),
        ),
        (ACROSS_KWARGS, "m-kwargs-image-16-tokens", ("m-kwargs-image-plain",)),
        ("1E+1PD:ec-same-image-across-requests", "m-repeat-b", ("m-repeat-a",)),
    ],
)
def test_a_later_case_of_a_sequential_scenario_is_sent_after_its_earlier_requests(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    label: str,
    prompt: str,
    earlier: tuple[str, ...],
) -> None:
    """`repro` of epd-kv-lookup-miss-kills-prefill's second case sent it alone, to servers
    with nothing stored, where P finds no folder of the shorter key and lives: the recorded
    ERROR could not reproduce, and the warning said only that it was sent alone. The
    scenario's earlier requests go first, to the same topology, in the scenario's order, with
    the bodies requests.json holds (not re-rendered: the very objects, keys in their order);
    the case's own body alone is judged (and answered by the baseline)."""
    import harness.run.repro as repro
    from harness.run.sweep import Stage
    from harness.spec.settings import ServedVllm

    caplog.set_level(logging.INFO, logger="harness.run.repro")  # repro says how it sent it
    seen = stub_the_rerun(monkeypatch)
    root = scenario_bundle(tmp_path / "b", label, prompt)
    recorded = json.loads((root / "requests.json").read_text())
    bundle = Bundle.load(root)
    sending = bundle.how_sent(label, prompt)
    assert (sending.earlier, sending.unlike) == (earlier, None)
    repro.reproduce(bundle, root / "again", ServedVllm("vllm", "0.32.0+cpu"))
    topology = label.split(":")[0]
    assert seen["stage"] == Stage(topology, tuple((name, recorded[name]) for name in earlier))
    for (name, body), again in zip(seen["stage"].requests, earlier):
        assert name == again and json.dumps(body) == json.dumps(recorded[name])
    assert seen["bodies"] == {prompt: recorded[prompt]}
    said = [r.getMessage() for r in caplog.records if r.name == "harness.run.repro"]
    scenario = label.split(":")[1]
    assert any(
        f"sent after scenario {scenario}'s earlier request" in m and ", ".join(earlier) in m
        for m in said
    ), said
    assert not any("sends it alone" in m for m in said), said


def test_the_first_prompt_of_a_scenario_replays_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The scenario sent its first prompt first: alone, as the rerun sends it, and nothing is
    said to be unlike (it used to be "after the scenario's earlier requests")."""
    import harness.run.repro as repro
    from harness.spec.settings import ServedVllm

    seen = stub_the_rerun(monkeypatch)
    root = scenario_bundle(tmp_path / "b", KILLS_PREFILL, "m-text-stores-the-lookup-key")
    bundle = Bundle.load(root)
    sending = bundle.how_sent(KILLS_PREFILL, "m-text-stores-the-lookup-key")
    assert (sending.earlier, sending.unlike, sending.replayed) == ((), None, None)
    repro.reproduce(bundle, root / "again", ServedVllm("vllm", "0.32.0+cpu"))
    assert seen["stage"] is None
    assert "earlier" not in caplog.text


@pytest.mark.parametrize(
    "label, prompt, unlike",
    [
        (
            "1E+1PD:ec-concurrent-requests",
            "m-concurrent-b",
            "scenario ec-concurrent-requests sent it in flight together with its other "
            "requests; this sends it alone to servers started for it",
        ),
        (
            "1E+1PD:ec-idle-over-keepalive",
            "m-idle-b",
            "scenario ec-idle-over-keepalive sent it with idle gaps longer than the servers' "
            "keep-alive between requests; this sends it alone to servers started for it",
        ),
    ],
)
def test_a_concurrent_or_idle_gap_scenario_replays_nothing_and_says_what_is_unlike(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    label: str,
    prompt: str,
    unlike: str,
) -> None:
    """Requests in flight together, or apart by more than the keep-alive, are not redone by
    sending the others first: the case goes alone, as before, and the warning says so."""
    import harness.run.repro as repro
    from harness.spec.settings import ServedVllm

    seen = stub_the_rerun(monkeypatch)
    root = scenario_bundle(tmp_path / "b", label, prompt)
    bundle = Bundle.load(root)
    sending = bundle.how_sent(label, prompt)
    assert (sending.earlier, sending.unlike) == ((), unlike)
    repro.reproduce(bundle, root / "again", ServedVllm("vllm", "0.32.0+cpu"))
    assert seen["stage"] is None
    assert f"repro: {unlike}" in caplog.text


def test_an_earlier_body_the_bundle_lacks_is_refused_naming_it(tmp_path: Path) -> None:
    """Without the earlier request's body the stage cannot be set: refused in one line, not
    rerun alone as if it had been."""
    root = scenario_bundle(tmp_path / "b", KILLS_PREFILL, "m-text-at-block-plus-one")
    requests = json.loads((root / "requests.json").read_text())
    del requests["m-text-stores-the-lookup-key"]
    (root / "requests.json").write_text(json.dumps(requests))
    bundle = Bundle.load(root)
    with pytest.raises(BundleError) as refused:
        bundle.earlier_bodies(bundle.how_sent(KILLS_PREFILL, "m-text-at-block-plus-one"))
    assert str(refused.value) == (
        f"{root}: requests.json has no body for 'm-text-stores-the-lookup-key', which "
        "scenario epd-kv-lookup-miss-kills-prefill sent before the case on the same servers: "
        "the stage the case was sent on cannot be set again"
    )


def stage_unset():
    """The first earlier request of epd-kv-lookup-miss-kills-prefill got no answer."""
    from harness.run.sweep import StageUnset

    return StageUnset("m-text-stores-the-lookup-key", "APIError: Internal Server Error")


UNSET = (
    "the earlier request m-text-stores-the-lookup-key, sent before it on the same servers, "
    "got no answer (APIError: Internal Server Error)"
)


def test_the_verdict_line_of_a_stage_not_set_says_nothing_was_reproduced(tmp_path: Path) -> None:
    """An earlier request that got no answer left the case unsent (an ERROR of its own):
    against the bundle's recorded ERROR that read "reproduced, a known vLLM failure". The
    line says the stage was not set, and claims no declaration."""
    from harness.run.repro import repro_line
    from harness.spec.settings import ServedVllm

    root = scenario_bundle(tmp_path / "b", KILLS_PREFILL, "m-text-at-block-plus-one")
    run = json.loads((root / "run.json").read_text())
    (root / "run.json").write_text(json.dumps({**run, "served_vllm": {"version": "0.32.0+cpu"}}))
    bundle = Bundle.load(root)
    case_ = bundle.pick_case(None)
    served = ServedVllm("/v", "0.32.0+cpu")
    assert str(stage_unset()) == UNSET
    line = repro_line(case_, "ERROR", bundle, served, False, stage_unset())
    assert line == (
        "1E+1P+1D / m-text-at-block-plus-one vs baseline: ERROR now, ERROR in the bundle: NOT "
        f"reproduced: the stage was not set: {UNSET}, so the case's own request was not sent"
    )
    set_ = repro_line(case_, "ERROR", bundle, served, True)
    assert set_.endswith(
        "ERROR in the bundle: reproduced; a known vLLM failure, declared by matrix scenario "
        "epd-kv-lookup-miss-kills-prefill (expects ERROR)"
    ), set_


def test_a_stage_the_run_could_not_set_either_names_its_first_failure(tmp_path: Path) -> None:
    """When the bundle recorded the earlier request failing too, the run's stage was as
    broken, and the case's ERROR a consequence: the line names the earlier case to rerun;
    recorded passing, it names none."""
    from harness.run.repro import repro_line
    from harness.spec.settings import ServedVllm

    root = scenario_bundle(tmp_path / "b", KILLS_PREFILL, "m-text-at-block-plus-one")
    summary = json.loads((root / "summary.json").read_text())
    earlier = case(KILLS_PREFILL, "m-text-stores-the-lookup-key", "ERROR", False)
    summary["cases"].append(earlier)
    (root / "summary.json").write_text(json.dumps(summary))
    bundle = Bundle.load(root)
    case_ = bundle.pick_case("1E+1P+1D:m-text-at-block-plus-one")
    line = repro_line(case_, "ERROR", bundle, ServedVllm("/v", "unknown"), False, stage_unset())
    assert line.endswith(
        "so the case's own request was not sent; the bundle recorded "
        "m-text-stores-the-lookup-key ERROR too: --case 1E+1P+1D:m-text-stores-the-lookup-key "
        "reruns that earlier failure"
    ), line
    # Recorded passing, it set the run's stage: no earlier failure to name.
    summary["cases"][-1] = case(KILLS_PREFILL, "m-text-stores-the-lookup-key", "MATCH", True)
    (root / "summary.json").write_text(json.dumps(summary))
    bundle = Bundle.load(root)
    case_ = bundle.pick_case("1E+1P+1D:m-text-at-block-plus-one")
    line = repro_line(case_, "ERROR", bundle, ServedVllm("/v", "unknown"), False, stage_unset())
    assert line.endswith("so the case's own request was not sent"), line


@pytest.mark.parametrize("unset, code", [(False, 0), (True, 1)])
def test_repro_exits_1_when_the_stage_was_not_set(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    unset: bool,
    code: int,
) -> None:
    """The same verdict as the bundle's is no reproduction when the case was never sent."""
    import harness.cli.main as cli
    from harness.outcomes.outcome import Outcome
    from harness.spec.settings import ServedVllm
    from harness.testing.judging import judged

    root = with_model_here(
        scenario_bundle(tmp_path / "b", KILLS_PREFILL, "m-text-at-block-plus-one")
    )
    record = judged(
        "1E+1P+1D",
        "baseline",
        Outcome("m-text-at-block-plus-one", error="not sent: the stage was not set"),
        Outcome("m-text-at-block-plus-one", error="not sent: the stage was not set"),
    )

    class Rerun:
        stage_unset = stage_unset() if unset else None

        class pool:  # noqa: N801 - stands in for the sweep's pool
            @staticmethod
            def close() -> None:
                pass

    def rerun(bundle, *args, **kwargs):
        return bundle.pick_case(None), [record], Rerun()

    monkeypatch.setattr(cli, "probe_served_vllm", lambda vllm: ServedVllm(vllm, "0.32.0+cpu"))
    monkeypatch.setattr(cli, "proxy_choice", lambda *args: None)
    monkeypatch.setattr(cli, "check_repro_argvs", every_line_taken)
    monkeypatch.setattr(cli, "reproduce", rerun)
    assert record.verdict.value == "ERROR"
    assert cli.main(["repro", str(root), "--vllm", "/v"]) == code
    out = capsys.readouterr().out
    assert ("NOT reproduced: the stage was not set" in out) is unset, out


def rerun_against(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    then: tuple[str, object],
    now: tuple[str, object],
):
    """`repro` of a 1P+1D bundle whose case was judged `then` (the candidate's ids, or its
    error), rerun to `now`: its exit code."""
    import harness.cli.main as cli
    from harness.outcomes.outcome import Outcome
    from harness.spec.settings import ServedVllm
    from harness.testing.builders import chat
    from harness.testing.judging import judged

    def record(kind: str, value: object):
        candidate = (
            Outcome("image", chat(value)) if kind == "ids" else Outcome("image", error=value)
        )
        return judged("1P+1D", "baseline", Outcome("image", chat([5, 6, 7, 8])), candidate)

    recorded = record(*then)
    root = with_model_here(rerun_bundle(tmp_path / "b", "1P+1D"))
    (root / "summary.json").write_text(json.dumps({"cases": [recorded.to_json()]}))

    def rerun(bundle, *args, **kwargs):
        return bundle.pick_case(None), [record(*now)], ClosedSweep()

    monkeypatch.setattr(cli, "probe_served_vllm", lambda vllm: ServedVllm(vllm, "0.32.0+cpu"))
    monkeypatch.setattr(cli, "proxy_choice", lambda *args: None)
    monkeypatch.setattr(cli, "check_repro_argvs", every_line_taken)
    monkeypatch.setattr(cli, "reproduce", rerun)
    code = cli.main(["repro", str(root), "--vllm", "/v"])
    return code


PREFILL_DIED = "1P+1D/prefill0 (pid 11) died while serving: killed by SIGKILL, noticed 3.0 s"
DECODE_DIED = "1P+1D/decode0 (pid 12) died while serving: killed by SIGKILL, noticed 3.0 s"


@pytest.mark.parametrize(
    "then, now, says",
    [
        # Another instance died.
        (("error", PREFILL_DIED), ("error", DECODE_DIED), "decode died now"),
    ],
)
def test_repro_of_another_failure_of_the_same_verdict_is_not_reproduced(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    then: tuple[str, object],
    now: tuple[str, object],
    says: str,
) -> None:
    """The rerun's verdict alone was compared: a MISMATCH parting at another token, or the
    ERROR of another instance's death, read "reproduced" (exit 0) for a failure the bundle
    did not record."""
    code = rerun_against(tmp_path, monkeypatch, then, now)
    out = capsys.readouterr().out
    assert "NOT reproduced" in out and says in out, out
    assert code == 1


@pytest.mark.parametrize(
    "then",
    [("ids", [5, 6, 9, 8]), ("error", PREFILL_DIED)],
)
def test_repro_of_the_same_failure_is_reproduced(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    then: tuple[str, object],
) -> None:
    """The same failure again (another pid, another time) is reproduced, and says no other
    position of parting (its ids part where they did)."""
    kind, value = then
    now = (
        (kind, value.replace("pid 11", "pid 97").replace("3.0 s", "4.2 s"))
        if kind == "error"
        else then
    )
    code = rerun_against(tmp_path, monkeypatch, then, now)
    out = capsys.readouterr().out
    assert ": reproduced" in out and code == 0, out
    assert "the ids part at position" not in out, out


def test_a_case_judged_against_a_golden_is_rerun_against_that_golden(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `run --golden 0.31.0` bundle's case (`vs golden-0.31.0`) was rerun against a fresh
    baseline of the vLLM serving now, and its verdict there compared with the one against
    the golden: "reproduced" (or not) of another comparison than the bundle's."""
    import harness.run.repro as repro
    from harness.spec.settings import ServedVllm

    root = write_bundle(tmp_path / "b", [])
    goldens = tmp_path / "cache" / "goldens"
    record = {**case("1P+1D", "image", "MISMATCH", False), "reference": "golden-0.31.0"}
    (root / "summary.json").write_text(json.dumps({"cases": [record]}))
    run = json.loads((root / "run.json").read_text())
    run["golden_release"] = "0.31.0"
    run["baseline_sources"] = {
        "image": {"source": "golden", "release": "0.31.0", "goldens_dir": str(goldens)}
    }
    (root / "run.json").write_text(json.dumps({**run, "fault": None}))
    seen = stub_the_rerun(monkeypatch)
    repro.reproduce(Bundle.load(root), tmp_path / "again", ServedVllm("vllm", "0.32.0+cpu"))
    reference = seen["reference"]
    assert reference.get("golden_release") == "0.31.0", reference
    assert reference["goldens"].directory == goldens


def test_the_rerun_of_a_golden_case_judges_no_baseline_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rerun of a case judged against a golden starts no baseline (`reproduce` reads the
    golden), yet the served vLLM's parser judged the baseline's line and run.json listed it
    among the lines checked (found in review). A case judged against a baseline still has it
    judged."""
    from harness.cli.main import check_repro_argvs
    from harness.environment import ARGV_CHECK_DIR_ENV
    from harness.preflight import vllm_args
    from harness.spec.settings import ServedVllm

    probed: list[str] = []

    def probe(_interpreter, argvs):
        probed.extend(argvs)
        return dict.fromkeys(argvs), 0.0

    monkeypatch.setattr(vllm_args, "_run_probe", probe)
    monkeypatch.setattr(vllm_args, "interpreter_of", lambda _: ["python3"])
    monkeypatch.setenv(ARGV_CHECK_DIR_ENV, str(tmp_path / "argv-check"))
    served = ServedVllm("vllm", "0.32.0+cpu")
    golden = rerun_bundle(tmp_path / "golden", "1P+1D", golden_release="0.31.0")
    run = json.loads((golden / "run.json").read_text())
    run["baseline_sources"] = {"image": {"source": "golden", "release": "0.31.0"}}
    (golden / "run.json").write_text(json.dumps(run))
    check = check_repro_argvs(Bundle.load(golden), None, served, None, False)
    assert {name.split("/")[0] for name in check.instances} == {"1P+1D"}, check.instances
    assert {name.split("/")[0] for name in probed} == {"1P+1D"}, probed
    plain = rerun_bundle(tmp_path / "plain", "1P+1D")
    check = check_repro_argvs(Bundle.load(plain), None, served, None, False)
    assert {name.split("/")[0] for name in check.instances} == {"baseline", "1P+1D"}


def test_repro_judges_under_the_runs_reference_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CPU run under `--reference-policy pd-drift` passed a 1P+1D DRIFT; its repro judged
    under the platform's default (exact) and printed that DRIFT as a failed policy."""
    root = rerun_bundle(tmp_path / "b", "1P+1D")
    summary = json.loads((root / "summary.json").read_text())
    (root / "summary.json").write_text(
        json.dumps({**summary, "run": {"reference_policy": "pd-drift"}})
    )
    assert rerun_settings(root, monkeypatch, "0.32.0+cpu").reference_policy == "pd-drift"
    plain = rerun_bundle(tmp_path / "plain", "1P+1D")
    assert rerun_settings(plain, monkeypatch, "0.32.0+cpu").reference_policy == ""


def test_repro_of_a_bundle_whose_model_is_not_here_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, epd_cli
) -> None:
    """The bundle's model directory (another host's, a tiny model built elsewhere) was not
    checked: the rerun probed vLLM and started the baseline, which died during start-up
    with the reason in its log. `run` checks its model first; repro says it in one line."""
    import harness.cli.main as cli

    root = rerun_bundle(tmp_path / "b", "1P+1D")  # serving.model /m: not on this host
    monkeypatch.setattr(cli, "probe_served_vllm", lambda vllm: pytest.fail("vLLM probed"))
    code, _, stderr = epd_cli("repro", root, "--vllm", tmp_path / "no-vllm")
    err = stderr.strip().splitlines()
    assert code == 2 and len(err) == 1, stderr
    assert "the bundle's model: model directory /m does not exist" in err[0], err


def test_the_verdict_line_names_another_checkpoint_than_the_bundles(tmp_path: Path) -> None:
    """run.json records the digest of the model files the run served (a tiny model built on
    another CPU differs in a few bfloat16 steps under the same directory name): a rerun on
    other files said "NOT reproduced" (or "reproduced") as if it had served the same."""
    from fixtures.checkpoint_digest import model_digest
    from harness.run.repro import repro_line
    from harness.spec.settings import ServedVllm

    root = with_model_here(rerun_bundle(tmp_path / "b", "1P+1D"))
    run = json.loads((root / "run.json").read_text())
    here = model_digest(Path(run["serving"]["model"]))
    served = ServedVllm("/v", "0.32.0+cpu")
    for digest, named in ((here, False), ("0" * 64, True)):
        run["model"] = {"dir": run["serving"]["model"], "digest": digest}
        (root / "run.json").write_text(json.dumps(run))
        bundle = Bundle.load(root)
        line = repro_line(bundle.pick_case(None), "MISMATCH", bundle, served)
        said = f"the bundle served model files of digest {'0' * 12}, this run {here[:12]}"
        assert (said in line) is named, line


def test_a_load_case_is_said_to_be_sent_alone(tmp_path: Path) -> None:
    """A `load` case (`1E+1PD:load#3`) was sent in flight with the load's other requests,
    and judged as batched against the load's calibrated floor; repro sent it alone and
    said nothing of it: a failure only concurrency makes (another request's answer) read
    "NOT reproduced" as if the same had been sent."""
    root = write_bundle(tmp_path / "b", [case("1E+1PD:load#3", "image", "MISMATCH", False)])
    (root / "load.json").write_text(json.dumps({"spec": {"concurrency": 16}}))
    sending = Bundle.load(root).how_sent("1E+1PD:load#3", "image")
    assert sending.unlike == (
        "the load sent it among its other requests, 16 at a time (or alone after them, one "
        "declared to end an instance); this sends it alone to servers started for it"
    ), sending
    (root / "load.json").unlink()  # a bundle without its account: the concurrency unsaid
    assert "among its other requests (or alone after them" in str(
        Bundle.load(root).how_sent("1E+1PD:load#3", "image").unlike
    )


def test_repro_of_a_mismatch_parting_elsewhere_is_reproduced_and_says_where(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The same fault may part another token (GPU noise, another batch): still there, so
    reproduced (exit 0, never read as fixed), the line saying where the ids part now."""
    code = rerun_against(tmp_path, monkeypatch, ("ids", [5, 6, 9, 8]), ("ids", [5, 6, 7, 1]))
    out = capsys.readouterr().out
    assert ": reproduced" in out and "the ids part at position 3 now" in out, out
    assert code == 0


def test_a_faulted_runs_earlier_requests_are_sent_again_with_the_fault_planted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: a fuzz run plants its fault for every request, so the earlier requests
    its bundle carries (run.json's `sent_after`) were sent faulted; repro sent them again with
    no fault, planting it only for the case. A case that failed on what the fault did to an
    earlier request (kv-noise on the KV folder an earlier request wrote, which P then loads and
    writes no more) read that folder clean in the rerun: MATCH, and the fault "acted on
    nothing"."""
    from types import SimpleNamespace

    import harness.run.sweep as sweep_module
    from harness.outcomes.outcome import Outcome
    from harness.run.judging import Observed
    from harness.serve.proxy import ProxyFaults
    from harness.spec.settings import RunSettings, ServedVllm
    from harness.spec.topology import TOPOLOGIES

    settings = RunSettings(
        serving=ServingConfig(model="/m"),
        run_dir=tmp_path / "run",
        vllm=ServedVllm("vllm", "0.32.0+cpu", "2.13.0"),
    )
    body = {"model": "epd-model", "messages": [{"role": "user", "content": "hi"}]}
    topology = TOPOLOGIES["1P+1D"]
    sweep = sweep_module.Sweep(
        sweep_module.SweepSpec((topology,), prompts=(), fault="kv-noise:0.05"),
        settings,
        bodies={"case": body},
        stage=sweep_module.Stage(topology.name, (("earlier", body),)),
    )
    (tmp_path / "kv").mkdir()
    session = SimpleNamespace(
        topology=topology,
        settings=settings,
        faults=ProxyFaults(),
        ec_storage=None,
        kv_storage=tmp_path / "kv",
    )
    planted_when_sent: dict[str, bool] = {}

    def observe(session, prompt, body, stream, *, fresh_prefix):
        planted_when_sent[prompt] = session.faults.after_prefill is not None
        return Observed(Outcome(prompt=prompt, result=object()), ())

    monkeypatch.setattr(sweep_module, "observe", observe)
    sweep._serve_prompts(session)
    assert planted_when_sent == {"earlier": True, "case": True}, planted_when_sent
    assert session.faults.after_prefill is None, "the session is handed back unfaulted"


def test_another_instance_of_the_same_role_dying_is_another_failure() -> None:
    """2E+1PD runs two encoders: encode1 dying where the bundle recorded encode0's death is
    the same role's ERROR, but another instance's, so not the failure the bundle holds (as
    check.py's `reproduction` names the instance too); the same instance again is."""
    from harness.outcomes.outcome import Outcome
    from harness.run.repro import another_failure
    from harness.testing.builders import chat
    from harness.testing.judging import judged

    def died(name: str):
        error = f"2E+1PD/{name} (pid 11) died while serving: killed by SIGKILL, noticed 3.0 s"
        baseline = Outcome("image", chat([5, 6, 7, 8]))
        return judged("2E+1PD", "baseline", baseline, Outcome("image", error=error))

    recorded = died("encode0").to_json()
    assert another_failure(recorded, died("encode0")) is None
    assert another_failure(recorded, died("encode1")) == (
        "2E+1PD/encode1 died now, 2E+1PD/encode0 in the bundle"
    )


def test_a_case_without_its_body_in_requests_json_is_refused_before_anything_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """requests.json holds no body for the case's prompt (a bundle cut by hand, or written
    by a run that died mid-way): refused in one line naming the prompt, before a server
    starts, not a KeyError after the topology was set up."""
    import harness.run.repro as repro
    from harness.spec.settings import ServedVllm

    root = write_bundle(tmp_path / "b", [case("1P+1D", "video", "MISMATCH", False)])
    seen = stub_the_rerun(monkeypatch)
    with pytest.raises(BundleError, match=r"requests\.json has no body for 'video'$"):
        repro.reproduce(Bundle.load(root), tmp_path / "again", ServedVllm("vllm", "0.32.0+cpu"))
    assert "settings" not in seen


def test_the_stage_goes_once_to_its_own_topology_never_to_its_exact_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A staged 1E+1P+1D case is judged against 1P+1D too: 1P+1D, served first (a
    reference), answers the case's request alone, cold, as the run's reference did; the stage
    goes to 1E+1P+1D, before its case, and once, however often its prompts are served."""
    from types import SimpleNamespace

    import harness.run.sweep as sweep_module
    from harness.outcomes.outcome import Outcome
    from harness.run.judging import Observed
    from harness.serve.proxy import ProxyFaults
    from harness.spec.settings import RunSettings, ServedVllm
    from harness.spec.topology import TOPOLOGIES

    settings = RunSettings(
        serving=ServingConfig(model="/m"),
        run_dir=tmp_path / "run",
        vllm=ServedVllm("vllm", "0.32.0+cpu", "2.13.0"),
    )
    body = {"model": "epd-model", "messages": [{"role": "user", "content": "hi"}]}
    staged, reference = TOPOLOGIES["1E+1P+1D"], TOPOLOGIES["1P+1D"]
    sweep = sweep_module.Sweep(
        sweep_module.SweepSpec((staged,), prompts=()),
        settings,
        bodies={"case": body},
        stage=sweep_module.Stage(staged.name, (("earlier", body),)),
    )
    sent: list[tuple[str, str]] = []

    def observe(session, prompt, body, stream, *, fresh_prefix):
        sent.append((session.topology.name, prompt))
        return Observed(Outcome(prompt=prompt, result=object()), ())

    def session_of(topology):
        return SimpleNamespace(topology=topology, settings=settings, faults=ProxyFaults())

    monkeypatch.setattr(sweep_module, "observe", observe)
    sweep._serve_prompts(session_of(reference))
    sweep._serve_prompts(session_of(staged))
    sweep._serve_prompts(session_of(staged))  # served again: the stage is set already
    assert sent == [
        ("1P+1D", "case"),
        ("1E+1P+1D", "earlier"),
        ("1E+1P+1D", "case"),
        ("1E+1P+1D", "case"),
    ], sent
