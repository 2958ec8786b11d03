"""The AMX start-up hook `scripts/cpu` installs (harness/amx.py): when it asks Linux for AMX, that
it runs in a fresh interpreter of the venv it was installed into, and where its result lands.

This host may lack AMX (the machine these tests were written on has none), so the request
itself is exercised with a recording stand-in for the system call, and for real only as far as
the host allows: the kernel's answer is whatever it is, but it must be read back correctly.
The SIGILL the hook prevents is `scenarios/test_amx.py`'s business (the vLLM kernel itself).
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

from harness import amx
from harness.cli import cpu_env, doctor
from harness.preflight.vllm import probe_served_vllm

FLAGS_WITH_AMX = "fpu sse2 avx2 avx512f amx_bf16 amx_tile amx_int8"
FLAGS_WITHOUT_AMX = "fpu sse2 avx2 avx512f avx512_bf16"


def cpuinfo(tmp_path: Path, flags: str) -> str:
    path = tmp_path / "cpuinfo"
    path.write_text(
        "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Some Xeon\n"
        f"flags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: fpu\n"
    )
    return str(path)


class RecordingArchPrctl:
    """Stands in for the system call: records each call, answers like a kernel that grants."""

    def __init__(self, request_result: tuple[int, int] = (0, 0), grant: bool = True):
        self.calls: list[int] = []
        self.request_result = request_result
        self.grant = grant

    def __call__(self, code: int, argument: object) -> tuple[int, int]:
        self.calls.append(code)
        if code == amx.ARCH_GET_XCOMP_PERM:
            value = (1 << amx.XFEATURE_XTILEDATA) if self.grant else 0b111
            ctypes.cast(argument, ctypes.POINTER(ctypes.c_uint64)).contents.value = value
            return 0, 0
        return self.request_result


def decide(tmp_path: Path, flags: str, call: RecordingArchPrctl, **kwargs) -> str:
    return amx.decide(
        environ=kwargs.pop("environ", {}),
        machine=kwargs.pop("machine", "x86_64"),
        system=kwargs.pop("system", "Linux"),
        cpuinfo=cpuinfo(tmp_path, flags),
        arch_prctl=call,
    )


# --- when it asks ------------------------------------------------------------------------------


def test_asks_for_xtiledata_only_where_the_cpu_has_amx(tmp_path: Path) -> None:
    call = RecordingArchPrctl()
    status = decide(tmp_path, FLAGS_WITH_AMX, call)
    assert status.startswith(amx.GRANTED), status
    assert call.calls == [amx.ARCH_REQ_XCOMP_PERM, amx.ARCH_GET_XCOMP_PERM], "asked, checked back"

    call = RecordingArchPrctl()
    status = decide(tmp_path, FLAGS_WITHOUT_AMX, call)
    assert status.startswith(amx.NOT_NEEDED) and "no system call" in status, status
    assert call.calls == [], "no system call where the CPU has no AMX"


def test_only_the_first_processors_flags_count_and_amx_bf16_alone_is_not_amx(tmp_path) -> None:
    assert amx.cpu_has_amx(cpuinfo(tmp_path, FLAGS_WITH_AMX))
    assert not amx.cpu_has_amx(cpuinfo(tmp_path, "avx512f amx_bf16"))


def test_a_refusal_or_a_grant_that_does_not_show_is_reported_not_raised(tmp_path: Path) -> None:
    refused = decide(tmp_path, FLAGS_WITH_AMX, RecordingArchPrctl(request_result=(-1, 95)))
    assert refused.startswith(amx.REFUSED) and "errno 95" in refused, refused
    unseen = decide(tmp_path, FLAGS_WITH_AMX, RecordingArchPrctl(grant=False))
    assert unseen.startswith(amx.REFUSED) and "ARCH_GET_XCOMP_PERM" in unseen, unseen


def test_switched_off_or_off_x86_linux_it_makes_no_call(tmp_path: Path) -> None:
    call = RecordingArchPrctl()
    off = decide(tmp_path, FLAGS_WITH_AMX, call, environ={amx.DISABLE_ENV: "off"})
    assert off.startswith(amx.DISABLED), off
    arm = decide(tmp_path, FLAGS_WITH_AMX, call, machine="aarch64")
    assert arm.startswith(amx.NOT_NEEDED), arm
    assert call.calls == []


def test_at_startup_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> str:
        raise RuntimeError("boom")

    monkeypatch.setattr(amx, "decide", broken)
    monkeypatch.setattr(amx, "STATUS", amx.NOT_RUN)
    amx.at_startup()
    assert amx.STATUS == f"{amx.FAILED}: RuntimeError: boom"


def test_needs_repair_only_on_an_amx_cpu_without_a_grant() -> None:
    assert amx.needs_repair(None, cpu_has_amx_now=True)
    assert amx.needs_repair(f"{amx.DISABLED}: x", cpu_has_amx_now=True)
    assert not amx.needs_repair(f"{amx.GRANTED}: x", cpu_has_amx_now=True)
    assert not amx.needs_repair(None, cpu_has_amx_now=False)


@pytest.mark.skipif(sys.platform != "linux", reason="arch_prctl is Linux's")
def test_the_real_system_call_is_read_back_on_this_host() -> None:
    """The ctypes plumbing against the real kernel: where the CPU has AMX the request is
    granted and visible; elsewhere the kernel refuses it and the hook says so with its errno."""
    status = amx.request_permission()
    if amx.cpu_has_amx():
        assert status.startswith(amx.GRANTED), status
        assert amx.amx_permitted()
    else:
        assert status.startswith(amx.REFUSED) and "errno" in status, status
        assert not amx.amx_permitted()


# --- in a fresh interpreter of the venv ----------------------------------------------------------


@pytest.fixture(scope="module")
def hooked_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bare virtualenv with the hook installed the way `scripts/cpu` installs it."""
    venv = tmp_path_factory.mktemp("hooked") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    first = cpu_env.install_amx_permission_hook(Path(site), str(python))
    again = cpu_env.install_amx_permission_hook(Path(site), str(python))
    assert first.startswith("fixed: wrote"), first
    assert again.startswith("ok: AMX permission hook present"), "idempotent: " + again
    return python


def fresh_status(python: Path, env: dict[str, str] | None = None) -> str:
    return subprocess.run(
        [str(python), "-c", amx.PROBE], capture_output=True, text=True, env=env, check=True
    ).stdout.strip()


def expected_here() -> str:
    return amx.GRANTED if amx.cpu_has_amx() else amx.NOT_NEEDED


@pytest.mark.process
def test_a_fresh_interpreter_of_the_venv_runs_the_hook_at_startup(hooked_venv: Path) -> None:
    assert fresh_status(hooked_venv).startswith(expected_here())
    off = fresh_status(hooked_venv, env={amx.DISABLE_ENV: "off", "PATH": "/usr/bin:/bin"})
    assert off.startswith(amx.DISABLED), off


@pytest.mark.process
def test_an_interpreter_without_the_hook_says_so() -> None:
    bare = subprocess.run(
        [sys.executable, "-S", "-c", amx.PROBE], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert bare == amx.NO_HOOK_STATUS, "-S skips site, hence every .pth"


@pytest.mark.process
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


@pytest.mark.process
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


@pytest.mark.process
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


def test_the_hook_source_is_the_harness_module_and_imports_nothing_of_the_harness() -> None:
    source = Path(amx.__file__).read_text(encoding="utf-8")
    assert "from harness" not in source and "import harness" not in source
    assert amx.HOOK_PTH_LINE.startswith("import "), "site executes only lines starting so"
