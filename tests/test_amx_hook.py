"""The AMX start-up hook `scripts/cpu` installs (harness/amx.py): when it asks Linux for AMX, that
it runs in a fresh interpreter of the venv it was installed into, and where its result lands.

This host may lack AMX (the machine these tests were written on has none), so the request
itself is exercised with a recording stand-in for the system call, and for real only as far as
the host allows: the kernel's answer is whatever it is, but it must be read back correctly.
The SIGILL the hook prevents is `scenarios/test_amx.py`'s business (the vLLM kernel itself).
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import pytest

from harness import amx

pytestmark = pytest.mark.unit

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
    for value in ("0", "False", " no ", "OFF"):  # the spellings harness.amx.DISABLE_ENV names
        said = decide(tmp_path, FLAGS_WITH_AMX, call, environ={amx.DISABLE_ENV: value})
        assert said.startswith(amx.DISABLED), (value, said)
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


def test_the_hook_source_is_the_harness_module_and_imports_nothing_of_the_harness() -> None:
    source = Path(amx.__file__).read_text(encoding="utf-8")
    assert "from harness" not in source and "import harness" not in source
    assert amx.HOOK_PTH_LINE.startswith("import "), "site executes only lines starting so"
