"""Seven places where the harness once quietly did the wrong thing (issue 8), each pinned.

Each test here failed on the code before the fix. The tests that need more than the unit tier
allows live with their kind: trap 2's probe of the served interpreter in test_vllm_probe.py,
trap 3 (--host) in test_bad_input.py, trap 5 (every script named exists) in test_docs.py, trap
6 (one scheduler) in test_plan.py, trap 7 (orphans of a SIGKILLed harness) in test_watchdog.py
and, with real vLLM, in test_chaos_vllm.py
(test_real_vllm_left_starting_by_a_sigkilled_harness_is_stopped).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import devices
from harness.errors import BadInput
from harness.outcomes.chat import ChatResult
from harness.outcomes.outcome import Outcome
from harness.preflight.model import resolve_model, resolve_named_model
from harness.run.baseline_cache import BaselineCache, baseline_key
from harness.run.baseline_launch import BaselineLaunch
from harness.spec.settings import ServedVllm
from harness.spec.topology import ServingConfig

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = BaselineLaunch(("serve", "MODEL"), (), "cpu: test")
MODEL_NAME = "Qwen/Qwen2.5-VL-3B-Instruct"


# -- 1: a flag a code path ignores is refused ------------------------------------------------


@pytest.mark.parametrize(
    "args,cause",
    [
        (
            ("--scenario", "ec-images-1-2-3", "--plant-fault", "corrupt-ec"),
            "--plant-fault plants its fault in the sweep's topologies, not in matrix scenarios",
        ),
        (
            ("--baseline-cache", "off", "--refresh-baseline"),
            "--refresh-baseline refreshes the baseline cache, which --baseline-cache off",
        ),
        (("--colocate",), "--colocate shares GPUs within a topology; on cpu"),
    ],
)
def test_an_ignored_flag_is_refused_before_anything_starts(epd_cli, args, cause) -> None:
    """`--scenario X --plant-fault corrupt-ec` once dropped the fault and exited 0: a self-test
    that came out green."""
    code, _, err = epd_cli("run", *args)
    assert code == 2, err
    assert err.startswith(f"epd-harness: error: {cause}"), err
    assert err.count("\n") == 1, err


# -- 2: the served vLLM, not the harness's own, keys the baseline and the record -------------


def test_a_baseline_of_another_served_vllm_is_not_reused(tmp_path: Path) -> None:
    serving = ServingConfig(model="/m")
    body = {"messages": [{"role": "user", "content": "hi"}]}
    cache = BaselineCache(tmp_path / "cache")
    stored = Outcome("text", ChatResult((1,), (2,), "x", "length", ()))
    cache.store(
        baseline_key(ServedVllm("a", "0.32.0+cpu", "2.13.0"), serving, "d", body, launch=LAUNCH),
        stored,
    )
    other = ServedVllm("b", "0.28.0", "2.13.0")
    assert cache.load(baseline_key(other, serving, "d", body, launch=LAUNCH), "text") is None
    same = ServedVllm("c", "0.32.0+cpu", "2.13.0")
    assert cache.load(baseline_key(same, serving, "d", body, launch=LAUNCH), "text") is not None


# -- 4: a model given by name is on disk before any start-up timeout begins ------------------


def test_a_hub_model_missing_from_the_cache_is_one_error_before_any_start(
    tmp_path: Path, monkeypatch, epd_cli
) -> None:
    """`--platform cuda` once started every instance with HF_HUB_OFFLINE=1 and a model name
    nothing had fetched: a fresh GPU host died at baseline start-up."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = epd_cli(
        "run",
        "--platform",
        "cuda",
        "--devices",
        "0,1,2,3,4,5,6,7",
        "--run-dir",
        str(tmp_path / "run"),
    )
    assert code == 2, err
    assert err.startswith(
        f"epd-harness: error: model {MODEL_NAME} is not in the Hugging Face "
        f"cache ({tmp_path / 'hub'})"
    ), err
    assert "hf download" in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists(), "nothing may start (or be written) before the model"


def test_a_hub_model_in_the_cache_is_served_from_its_local_snapshot(
    tmp_path: Path, monkeypatch
) -> None:
    repo = tmp_path / "hub" / "models--Qwen--Qwen2.5-VL-3B-Instruct"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text('{"model_type": "qwen2_5_vl"}')
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_named_model(MODEL_NAME) == snapshot
    assert resolve_model(None, MODEL_NAME, tmp_path) == snapshot


def test_a_model_path_that_does_not_exist_is_not_taken_for_a_hub_name(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="does not exist"):
        resolve_model(str(tmp_path / "no-model"), None, tmp_path)


@pytest.mark.parametrize("given", ["./no-model", "~/no-model", "/no-model-here"])
def test_a_path_of_one_slash_is_a_path_not_a_hub_name(
    given: str, tmp_path: Path, monkeypatch
) -> None:
    """`./qwen`, `~/qwen` and `/qwen` have one slash, as `org/name` has: spelled as a path,
    a missing one is a missing directory, never looked up in the hub cache or fetched."""
    from harness.preflight import model

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(model, "fetch_snapshot", lambda name: pytest.fail(f"fetched {name}"))
    with pytest.raises(BadInput) as refused:
        resolve_model(given, None, tmp_path)
    missing = (tmp_path / "no-model") if given != "/no-model-here" else Path(given)
    assert str(refused.value) == f"model directory {missing} does not exist"


# -- 5: every script the project points at exists (the scan of the tree: tests/test_docs.py) ---


def test_doctor_names_the_setup_command_that_exists() -> None:
    from harness.cli import doctor

    text = Path(doctor.__file__).read_text(encoding="utf-8")
    assert "scripts/cpu setup" in text
    assert (ROOT / "scripts" / "cpu").exists()


def test_plan_shows_the_snapshot_a_run_will_serve(tmp_path: Path, monkeypatch, epd_cli) -> None:
    """What `plan` prints is what runs: the hub name resolved to its cached snapshot."""
    repo = tmp_path / "hub" / "models--Qwen--Qwen2.5-VL-3B-Instruct"
    (repo / "snapshots" / "rev1").mkdir(parents=True)
    (repo / "snapshots" / "rev1" / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("rev1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(devices, "run_nvidia_smi", lambda *args: None)  # no GPU read here
    code, out, _ = epd_cli("plan", "--platform", "cuda", "--devices", "0,1", "--colocate")
    assert code == 0
    assert f"serve {repo / 'snapshots' / 'rev1'} " in out, out[:2000]
