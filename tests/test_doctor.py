"""`epd-harness doctor`'s hints, for the environment it checks: a GPU box is told what a GPU
box needs, never the CPU setup (its checks' subprocesses stood in: no process)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from harness.cli import doctor

pytestmark = pytest.mark.unit


def test_doctor_on_a_cuda_vllm_hints_nixl_as_the_gpu_workflows_install_it() -> None:
    on_cuda = {extra.distribution: extra for extra in doctor.extras_for("cuda")}
    assert "the cuda default" in on_cuda["nixl"].needed_for
    assert "upstream-requirement nixl" in on_cuda["nixl"].setup
    assert "scripts/cpu setup" not in on_cuda["ray"].setup
    assert doctor.extras_for("cpu") == doctor.EXTRAS
    assert doctor.extras_for(None) == doctor.EXTRAS


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


def test_a_directory_without_config_json_is_said_so_without_loading_it(monkeypatch, tmp_path):
    """No config.json is not a model directory: said so in one line, no interpreter started
    to load it (whose traceback would blame transformers or the tiny model)."""

    def started(code, python):
        raise AssertionError(f"a check ran in {python}")

    monkeypatch.setattr(doctor, "_run_python", started)
    assert doctor.check_model(tmp_path) == doctor.Check(
        "model loads", False, f"{tmp_path} has no config.json", "is this a model directory?"
    )


def test_the_amx_permission_is_not_needed_by_a_gpu_vllm_on_an_amx_cpu(monkeypatch) -> None:
    """A CUDA build never runs vLLM-CPU's AMX kernel: a Sapphire Rapids GPU host passes
    without the CPU repairs' hook, its served interpreter not even asked."""

    def started(code, python):
        raise AssertionError(f"the AMX probe ran in {python}")

    monkeypatch.setattr(doctor, "_run_python", started)
    check = doctor.check_amx_permission(cpu_has_amx=True, device_type="cuda")
    assert check.ok and check.detail.startswith("not needed: the served vLLM runs on cuda")


def test_a_failed_vllm_import_says_no_platform_whatever_its_last_line() -> None:
    """The platform is read from the import's own output ("vllm VERSION DEVICE") only: the
    last line of a failed import's traceback is not a platform, however many words it has."""
    imports = doctor.Check("vllm imports", True, "vllm 0.32.0+cpu cpu")
    assert doctor.served_device_type(imports) == "cpu"
    failed = doctor.Check("vllm imports", False, "ImportError: libcudart.so.12 cuda")
    assert doctor.served_device_type(failed) is None


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


def served_cuda_vllm_without(
    missing: set[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> list:
    """doctor's checks of a served CUDA vLLM whose interpreter lacks the modules `missing`
    (each check's subprocess stood in: what it would print there)."""
    python = tmp_path / "gpu-venv" / "bin" / "python"
    vllm = python.parent / "vllm"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")  # there, as a GPU venv's is; never run (`served` answers)
    python.chmod(0o755)
    vllm.write_text(f"#!{python}\n")
    vllm.chmod(0o755)

    def served(code: str, interpreter) -> subprocess.CompletedProcess:
        assert list(interpreter) == [str(python)], interpreter
        if "current_platform" in code:
            return subprocess.CompletedProcess([], 0, "0.32.0 cuda\n", "")
        for module in missing:
            if f"import importlib.metadata, {module};" in code:
                error = f"ModuleNotFoundError: No module named '{module}'"
                return subprocess.CompletedProcess([], 1, "", error)
        return subprocess.CompletedProcess([], 0, "1.0\n", "")

    monkeypatch.setattr(doctor, "_run_python", served)
    monkeypatch.setattr(
        doctor, "check_vllm_cli", lambda executable: doctor.Check("vllm CLI runs", True, "0.32.0")
    )
    return doctor.run_checks(str(vllm), None)


def test_a_cuda_vllm_without_nixl_fails_naming_the_nixl_it_declares(monkeypatch, tmp_path):
    """NIXL is a CUDA build's default KV connector: every P->D topology of a run or of the GPU
    night needs it, and the run refuses without it. doctor (the GPU rehearsal's first step)
    said it only as an optional extra ("[--  ]") and exited 0."""
    checks = served_cuda_vllm_without({"nixl", "ray"}, monkeypatch, tmp_path)
    nixl = next(c for c in checks if c.name.startswith("nixl"))
    assert not nixl.ok and not nixl.optional_missing, nixl
    assert "epd-harness upstream-requirement nixl" in nixl.hint, nixl.hint
    shown = doctor.format_checks([nixl]).splitlines()
    assert shown[0].startswith("[FAIL] nixl (for --kv-connector nixl, the cuda default)"), shown
    ray = next(c for c in checks if c.name.startswith("ray"))
    assert ray.ok and ray.optional_missing, "Ray stays optional on cuda"
    installed = served_cuda_vllm_without({"ray"}, monkeypatch, tmp_path / "with-nixl")
    assert all(c.ok for c in installed), [c for c in installed if not c.ok]


def test_an_installed_extra_that_fails_to_import_is_a_failure_not_absent(monkeypatch) -> None:
    """An optional extra is optional to install, not to break: a NIXL that is installed and
    cannot load its UCX library was reported "[--  ] ... not installed" with `scripts/cpu setup
    --nixl` (which finds it installed and changes nothing), and doctor passed (found in review).
    Absent still passes; installed and broken fails with the import's own error."""
    extra = doctor.EXTRAS[0]

    def importing(stderr: str):
        failed = subprocess.CompletedProcess([], 1, "", stderr)
        monkeypatch.setattr(doctor, "_run_python", lambda code, python: failed)
        return doctor.check_extra(extra)

    broken = importing("ImportError: libucs.so.0: cannot open shared object file")
    assert not broken.ok and not broken.optional_missing, broken
    assert broken.detail == "ImportError: libucs.so.0: cannot open shared object file", broken
    absent = importing(f"ModuleNotFoundError: No module named '{extra.module}'")
    assert absent.ok and absent.optional_missing and absent.detail == "not installed", absent


@pytest.mark.parametrize(
    "oks, exit_code", [((True, True), 0), ((True, False), 1), ((False, False), 1)]
)
def test_doctor_exits_0_only_when_every_check_passed(
    monkeypatch, tmp_path: Path, capsys, oks: tuple[bool, ...], exit_code: int
) -> None:
    """One failed check fails `doctor` (exit 1), whatever the others say. Found in
    review: a mutant that passed doctor when any check did survived every test."""
    import argparse

    from harness.cli import main

    checks = [doctor.Check(f"check {n}", ok, "detail") for n, ok in enumerate(oks)]
    monkeypatch.setattr(main, "resolve_model", lambda *args: tmp_path)
    monkeypatch.setattr(main.doctor, "run_checks", lambda *args, **kwargs: checks)
    args = argparse.Namespace(model=str(tmp_path), vllm="/no/vllm", dtype=None)
    assert main.command_doctor(args) == exit_code
    assert "check 1" in capsys.readouterr().out


def test_doctor_given_a_model_fails_when_it_does_not_load(monkeypatch, tmp_path: Path) -> None:
    """`doctor --model DIR` (the GPU rehearsal's first step, with its checkpoint) checks that
    the served environment loads DIR: every other check passing, a DIR that is no model fails
    doctor."""
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")  # never run: every check's subprocess is answered here
    python.chmod(0o755)
    vllm = python.parent / "vllm"
    vllm.write_text(f"#!{python}\n")
    vllm.chmod(0o755)
    answers = subprocess.CompletedProcess([], 0, "0.32.0 cuda\n", "")
    monkeypatch.setattr(doctor, "_run_python", lambda code, interpreter: answers)
    monkeypatch.setattr(doctor, "check_vllm_cli", lambda vllm: doctor.Check("vllm CLI", True, ""))
    monkeypatch.setattr(doctor, "smi_compute_capabilities", lambda: None)
    assert all(check.ok for check in doctor.run_checks(str(vllm), None))
    checks = doctor.run_checks(str(vllm), tmp_path / "no-model", tiny=False)
    [model] = [check for check in checks if check.name == "model loads"] or [None]
    assert model is not None, "no model check"
    assert not model.ok and model.detail.endswith("no-model has no config.json"), model


def test_a_vllm_that_detects_no_platform_fails_its_import_check(monkeypatch) -> None:
    """A vLLM that imports but detects no platform (its `current_platform` is vLLM's
    UnspecifiedPlatform, device_type "": vllm-cpu whose `vllm` metadata lacks `+cpu`, a CUDA
    build without a GPU) cannot serve: `vllm serve` fails to infer a device. doctor said
    "[ok  ] vllm imports: vllm 0.32.0" and ran every platform check as if on CPU (found in
    review)."""
    answered = subprocess.CompletedProcess([], 0, "0.32.0 \n", "")
    monkeypatch.setattr(doctor, "_run_python", lambda code, python: answered)
    check = doctor.check_vllm_import()
    assert not check.ok, check
    assert "no platform" in check.detail and "cpu_env" in check.hint, check
    assert doctor.served_device_type(check) is None


def test_a_cpu_whose_flags_cannot_be_read_is_taken_to_have_no_amx(monkeypatch) -> None:
    """Where /proc/cpuinfo cannot be read (a container that hides it), nothing says the CPU
    has AMX: the AMX check passes saying "CPU has no AMX", instead of failing every such host
    for a grant no AMX kernel was shown to need."""

    def unreadable() -> bool:
        raise PermissionError(13, "Permission denied", "/proc/cpuinfo")

    no_hook = subprocess.CompletedProcess([], 0, "no hook: not imported\n", "")
    monkeypatch.setattr(doctor.amx, "cpu_has_amx", unreadable)
    monkeypatch.setattr(doctor, "_run_python", lambda code, python: no_hook)
    check = doctor.check_amx_permission(device_type="cpu")
    assert check.ok and check.detail == "CPU has no AMX; no hook: not imported", check


def test_doctor_on_a_cuda_vllm_asks_no_amx_grant_of_an_amx_cpu(monkeypatch, tmp_path) -> None:
    """run_checks hands the AMX check the platform the served vLLM imported with: a CUDA
    vLLM on a Sapphire Rapids host (most H100 servers') passes it, never told to install
    vLLM-CPU's hook."""
    monkeypatch.setattr(doctor.amx, "cpu_has_amx", lambda: True)
    checks = served_cuda_vllm_without(set(), monkeypatch, tmp_path)
    [amx_check] = [c for c in checks if c.name == "AMX permission at start-up"]
    assert amx_check.ok, amx_check
    assert amx_check.detail.startswith("not needed: the served vLLM runs on cuda"), amx_check


def test_doctor_given_a_checkpoint_that_fails_to_load_blames_no_tiny_model(
    monkeypatch, tmp_path
) -> None:
    """`doctor --model DIR` hands its check that DIR is not the tiny model: the GPU
    rehearsal's checkpoint failing to load is not told to rebuild the tiny model."""
    served_cuda_vllm_without(set(), monkeypatch, tmp_path)
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    answered = doctor._run_python

    def served(code: str, interpreter) -> subprocess.CompletedProcess:
        if "AutoConfig" in code:
            return subprocess.CompletedProcess([], 1, "", "ValueError: unrecognized model type")
        return answered(code, interpreter)

    monkeypatch.setattr(doctor, "_run_python", served)
    vllm = tmp_path / "gpu-venv" / "bin" / "vllm"
    checks = doctor.run_checks(str(vllm), checkpoint, tiny=False)
    [model] = [c for c in checks if c.name == "model loads"]
    assert not model.ok and "tiny" not in model.hint, model
