"""vLLM-CPU's AMX attention and the permission Linux wants first: the upstream failure, declared,
and the repair `scripts/cpu` makes (harness/amx.py, docs/connectors.md).

D's first step under NIXL is one query token over the received prompt. On a CPU with AMX,
vllm-cpu 0.32.0 runs it with its AMX kernel, and a process that never asked Linux for AMX dies
with SIGILL there: vLLM never asks (oneDNN asks in passing, on paths D's first step does not
take). This module runs that very kernel call (`scripts/amx_attention_sigill.py`, the ISA vLLM
picks on this host) in fresh interpreters of the served environment:

- unrepaired (the start-up hook switched off): on an AMX host, SIGILL is the expected, declared
  upstream failure, with the faulthandler's trace as evidence; if it ever completes there, vLLM
  changed and the declaration (and perhaps the repair) must go. On a host without AMX vLLM picks
  another kernel: the test checks and says that instead, in its id and its output;
- repaired (the hook as installed): the kernel completes on every host, and the hook reports
  what it did: granted where the CPU has AMX, no system call where it has none.

No server starts (the `model` tier), so CI runs it on whatever host it gets.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from harness import amx
from harness.preflight.vllm import default_vllm_executable, interpreter_of

pytestmark = pytest.mark.model

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "amx_attention_sigill.py"
KERNEL_TIMEOUT_S = 300.0
HOST_HAS_AMX = amx.cpu_has_amx()
# The test ids say which host kind a result is about, so a pass on a host without AMX never
# reads as "the SIGILL was checked".
HOST = "amx-host" if HOST_HAS_AMX else "host-without-amx"
UPSTREAM_FAILURE = (
    "declared upstream failure (vllm-cpu 0.32.0): its AMX attention kernel runs in a process "
    "that never asked Linux for AMX (arch_prctl ARCH_REQ_XCOMP_PERM), which raises SIGILL"
)


def served_python() -> str:
    """The served vLLM's interpreter (its `#!` line), else this one."""
    interpreter = interpreter_of(default_vllm_executable())
    return interpreter[-1] if interpreter else sys.executable


def attention_step(mode: str) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    """D's first attention step on the ISA vLLM picks here, in a fresh served interpreter;
    the child's report line (`isa=... permitted_before_kernel=... hook=...`) as a dict."""
    env_off = {amx.DISABLE_ENV: "off"} if mode == "no-permission" else {}
    child = subprocess.run(
        [served_python(), str(SCRIPT), "auto", mode],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONFAULTHANDLER": "1", **env_off},
        timeout=KERNEL_TIMEOUT_S,
        check=False,
    )
    line = next((ln for ln in child.stdout.splitlines() if ln.startswith("isa=")), "")
    report = dict(part.split("=", 1) for part in line.split(" ", 2) if "=" in part)
    return child, report


def evidence(child: subprocess.CompletedProcess) -> str:
    return (
        f"exit {child.returncode}\nstdout:\n{child.stdout[-2000:]}\nstderr:\n{child.stderr[-3000:]}"
    )


@pytest.mark.parametrize("host", [HOST])
def test_unrepaired_first_attention_step(host: str, record_property) -> None:
    child, report = attention_step("no-permission")
    assert report, f"the child never reached the kernel call:\n{evidence(child)}"
    assert report["hook"].startswith((amx.DISABLED, amx.NO_HOOK)), report
    if HOST_HAS_AMX:
        assert report["isa"] == "amx", f"on an AMX host vLLM picked {report['isa']}: {report}"
        assert child.returncode == -signal.SIGILL, (
            f"{UPSTREAM_FAILURE}; expected, but the step ended otherwise. If it completed, vLLM "
            f"now asks for AMX itself: drop this declaration.\n{evidence(child)}"
        )
        assert "cpu_attention_with_kv_cache" in child.stderr, evidence(child)
        checked = (
            f"{UPSTREAM_FAILURE}: killed by SIGILL in cpu_attention_with_kv_cache, as declared"
        )
    else:
        assert report["isa"] != "amx", report
        assert child.returncode == 0 and "completed" in child.stdout, evidence(child)
        checked = (
            f"this CPU has no amx_tile: vLLM picked the {report['isa']!r} attention kernel, which "
            "completed without AMX permission; the SIGILL (AMX hosts only) was NOT checked here"
        )
        warnings.warn(checked, stacklevel=1)  # in the warnings summary, not only with -s
    record_property("checked", checked)
    print(f"\n[amx] {host}: {checked}")


@pytest.mark.parametrize("host", [HOST])
def test_repaired_first_attention_step(host: str, record_property) -> None:
    child, report = attention_step("hook")
    assert report, f"the child never reached the kernel call:\n{evidence(child)}"
    assert child.returncode == 0 and "completed" in child.stdout, evidence(child)
    status = report["hook"]
    if HOST_HAS_AMX:
        assert status.startswith(amx.GRANTED), f"the start-up hook did not get AMX: {status}"
        assert report["permitted_before_kernel"] == "True", report
    else:
        assert status.startswith(amx.NOT_NEEDED), (
            f"on a CPU without AMX the hook must make no request: {status} (if it reports "
            f"'{amx.NO_HOOK}', run python -m harness.cli.cpu_env)"
        )
    checked = f"isa {report['isa']}, completed; start-up hook: {status}"
    record_property("checked", checked)
    print(f"\n[amx] {host}: {checked}")
