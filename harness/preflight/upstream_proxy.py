"""vLLM's own EPD files for the served vLLM: its proxy, the toy proxy and its correctness script,
from the release's sdist through the package index the user's pip is configured with, or from
the vLLM source tree it was built from (`--vllm-source`).

Wheels ship no EPD proxy; every release's sdist does (`disagg_epd_proxy.py`, the toy proxy its
NIXL tests use for 1P+1D, and `run_epd_correctness_test.sh`, which upstream parity reads:
`harness.preflight.upstream_parity`), and its `requirements/` files, which declare the KV
connectors' libraries (NIXL) the release was tested with
(`harness.preflight.upstream_requirements`). They change every release, so they must be the served
release's own: the version comes from the served vLLM (a local suffix such as `+cpu` dropped). The
index is pip's (PIP_INDEX_URL, `pip config`, else pip's own default), read through the standard
simple API (PEP 691 JSON, or PEP 503 HTML), and the sdist's sha256 as the index gives it is
verified. Only the needed files are extracted, into the harness cache by version; the sdist itself
is not kept. No upstream file is ever part of this repository.

A development build (`0.33.0.dev12+gabc1234`, what vLLM's main branch installs) has no sdist,
and a release's files would be another version's: its files come only from `--vllm-source DIR`,
the tree it was built from. The tree's git commit is recorded, and checked against the build's
`+g<sha>` when the version carries one.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from harness.errors import BadInput
from harness.files import open_lock_file, write_text_atomic
from harness.preflight.package_index import pip_indexes, project_files, safe_url
from harness.preflight.vllm import interpreter_of
from harness.serve.vllm_proxy import DYNAMIC_REGISTRATION_FLAG, EPD_PROXY_FILE, TOY_PROXY_FILE
from harness.spec.generations import build_commit, is_dev_build
from harness.spec.settings import (
    DYNAMIC_REGISTRATION,
    STATIC_REGISTRATION,
    VLLM_PROXY,
    ProxyChoice,
    ServedVllm,
)

PROXY_FILES = (EPD_PROXY_FILE, TOY_PROXY_FILE)
UPSTREAM_SCRIPT_FILE = "tests/v1/ec_connector/integration/run_epd_correctness_test.sh"
# Extracted when the sdist has them; the proxies are required, the script is read by parity.
UPSTREAM_FILES = (*PROXY_FILES, UPSTREAM_SCRIPT_FILE)
# Every requirements file under it is extracted too (small text; one may include another).
REQUIREMENTS_DIR = "requirements"
# What a fetch looks for, recorded in the cache: a cache written while less was sought (before
# the requirements were) is fetched again once, rather than answer that a file is not there.
SOUGHT = (*UPSTREAM_FILES, f"{REQUIREMENTS_DIR}/**/*.txt")
ORIGIN_FILE = "origin.json"
GIT_TIMEOUT_S = 30.0
log = logging.getLogger(__name__)
DOWNLOAD_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ProxyFiles:
    directory: Path  # UPSTREAM_FILES live under it at their repository paths
    origin: str
    commit: str | None = None  # a source tree's git commit (None: a sdist, or not a checkout)
    commit_check: str = ""  # what the commit was checked against, and how that went

    @property
    def script(self) -> Path | None:
        """The correctness script, where the sdist or tree has it."""
        path = self.directory / UPSTREAM_SCRIPT_FILE
        return path if path.is_file() else None


def proxy_choice(
    kind: str,
    source: str | None,
    served: ServedVllm,
    cache: Path,
    registration: str = STATIC_REGISTRATION,
) -> ProxyChoice:
    """The proxy under test, its files in place (fetched once per release) for `vllm`."""
    if kind != VLLM_PROXY:
        return ProxyChoice(kind)
    interpreter = interpreter_of(served.executable)
    if interpreter is None:
        raise BadInput(
            f"--proxy vllm runs vLLM's proxy with the served vLLM's Python, and "
            f"{served.executable} names none (#! line)"
        )
    files = upstream_files(served, source, cache, interpreter)
    if registration == DYNAMIC_REGISTRATION:
        check_dynamic_registration(files.directory / EPD_PROXY_FILE, files.origin)
    return ProxyChoice(
        VLLM_PROXY,
        files.directory,
        files.origin,
        tuple(interpreter),
        registration,
        source_commit=files.commit,
        commit_check=files.commit_check,
    )


def upstream_files(
    served: ServedVllm,
    source: str | None,
    cache: Path,
    interpreter: list[str] | None = None,
    required: tuple[str, ...] = PROXY_FILES,
) -> ProxyFiles:
    """The served vLLM's own EPD files: from `source` (its tree) when given, which a
    development build requires, else from its release's sdist (cached). `required`: the files
    a source tree must have for the caller (a caller reading only requirements/ or the script
    needs no proxy; a sdist always has them all)."""
    if source:
        return from_checkout(source, served, required)
    if not served.known:
        raise BadInput(
            "vLLM's own EPD files need the served vLLM's version to fetch its sdist; "
            f"pass {SOURCE_OPTION}"
        )
    return cached_or_fetched(served.version, cache, interpreter)


# The option that names a vLLM source tree, as the CLI and pytest spell it.
SOURCE_OPTION = "--vllm-source DIR (pytest: --epd-vllm-source DIR)"


def check_dynamic_registration(proxy_file: Path, origin: str) -> None:
    """Refuse --proxy-registration dynamic for a release whose EPD proxy lacks the mode (it
    appeared in vLLM's proxy later than EPD itself)."""
    if DYNAMIC_REGISTRATION_FLAG not in proxy_file.read_text(errors="replace"):
        raise BadInput(
            f"--proxy-registration dynamic: this release's {EPD_PROXY_FILE} ({origin}) has no "
            f"{DYNAMIC_REGISTRATION_FLAG}; use static registration"
        )


def release_version(version: str) -> str:
    """The release a served vLLM comes from: "0.32.0+cpu" -> "0.32.0". A development build
    has none: its files are its source tree's, never another version's sdist."""
    if is_dev_build(version):
        commit = build_commit(version)
        tree = f"a checkout of {commit}" if commit else "the tree it was built from"
        raise BadInput(
            f"vLLM {version} is a development build: its EPD proxy and scripts come from "
            f"its own source tree, not a release's sdist; pass {SOURCE_OPTION} ({tree})"
        )
    release = version.split("+", 1)[0].strip()
    if not re.fullmatch(r"\d+(\.\d+)*([a-z]+\d*)?(\.post\d+)?", release):
        raise BadInput(
            f"cannot tell the vLLM release of version {version!r} to fetch its EPD files "
            f"from; pass {SOURCE_OPTION} (a vLLM checkout)"
        )
    return release


def from_checkout(
    source: str, served: ServedVllm | None = None, required: tuple[str, ...] = PROXY_FILES
) -> ProxyFiles:
    """The files of a vLLM source tree, its git commit, and that commit checked against the
    served build's `+g<sha>` (a mismatch is refused: that tree's proxy is another version's).
    The tree must have `required` (the proxies, unless the caller reads none of them)."""
    directory = Path(source).expanduser().resolve()
    if not directory.is_dir():
        raise BadInput(f"--vllm-source {directory} is not a vLLM checkout: no such directory")
    missing = [name for name in required if not (directory / name).is_file()]
    if missing:
        raise BadInput(missing_proxy(directory, missing[0]))
    commit = git_commit(directory)
    built_from = build_commit(served.version) if served is not None else None
    if built_from is None:
        version = served.version if served is not None else "unknown"
        check = f"not checked: the served vLLM's version ({version}) names no commit"
    elif commit is None:
        check = (
            f"not checked: {directory} is not a git checkout, the served vLLM was built "
            f"from g{built_from}"
        )
    elif commit.startswith(built_from):
        check = f"matches the served vLLM's build (g{built_from})"
    else:
        assert served is not None
        raise BadInput(
            f"--vllm-source {directory} is at commit {commit[:12]}, and the served vLLM "
            f"{served.version} was built from {built_from}: check out that commit (its proxy "
            "and scripts are that build's)"
        )
    log.info("epd-harness: vLLM files from %s at %s: %s", directory, commit or "?", check)
    return ProxyFiles(directory, f"checkout {directory}", commit, check)


def missing_proxy(directory: Path, missing: str) -> str:
    """Why a --vllm-source without `missing` (a proxy file) is refused. A directory with no
    vLLM tree's marks is "not a vLLM checkout"; a vLLM tree whose proxy is elsewhere (moved, or
    turned into a module, as vLLM's main may do between releases) is told what it has instead:
    its files of the proxy's name and what its own correctness script launches."""
    script = directory / UPSTREAM_SCRIPT_FILE
    if not script.is_file() and not (directory / "vllm").is_dir():
        return f"--vllm-source {directory} is not a vLLM checkout: no {missing}"
    name = Path(missing).name
    same_name = sorted(
        str(path.relative_to(directory))
        for path in directory.rglob(name)
        if path.is_file() and ".git" not in path.relative_to(directory).parts
    )
    told = [f"--vllm-source {directory} has no {missing}, the proxy the harness launches."]
    if same_name:
        told.append(f"This tree has a {name} at {', '.join(same_name[:3])}.")
    if script.is_file():
        from harness.preflight.shell_script import ScriptError
        from harness.preflight.upstream_parity import proxy_programs

        try:
            launched = proxy_programs(script.read_text(encoding="utf-8", errors="replace"))
        except ScriptError as exc:
            told.append(f"Its {UPSTREAM_SCRIPT_FILE} could not be read: {exc}.")
        else:
            lines: dict[str, list[str]] = {}
            for line, program in launched:
                lines.setdefault(program, []).append(str(line))
            shown = ", ".join(
                f"{program!r} (line{'s' if len(at) > 1 else ''} {', '.join(at)})"
                for program, at in lines.items()
            )
            told.append(f"Its {UPSTREAM_SCRIPT_FILE} launches {shown or 'no proxy'}.")
    told.append("The harness does not know this tree's layout: see docs/upstream-parity.md")
    return " ".join(told)


def git_commit(directory: Path) -> str | None:
    """The commit a checkout has checked out (HEAD), or None: not a git checkout, no git. A
    tree that is no checkout's top, one unpacked inside another repository, is none: git would
    answer with that repository's HEAD, another tree's commit."""
    try:
        done = subprocess.run(
            ["git", "-C", str(directory), "rev-parse", "--show-toplevel", "HEAD"],
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.splitlines()
    if done.returncode != 0 or len(lines) != 2:
        return None
    top, commit = Path(lines[0]).resolve(), lines[1].strip()
    if top != directory.resolve() or not re.fullmatch(r"[0-9a-f]{40,64}", commit):
        return None
    return commit


def cached_or_fetched(
    version: str, cache: Path, interpreter: list[str] | None = None
) -> ProxyFiles:
    """The release's proxy files from the cache, fetched through the index the first time."""
    release = release_version(version)
    directory = cache / "vllm-proxy" / release
    cached = _cached(directory)
    if cached is not None:
        return cached
    # Two runs on a fresh cache (pytest workers: an index test and a --proxy vllm scenario)
    # both found nothing, and the second copy into the directory failed: one fetches, the
    # other waits for it and reads the cache.
    directory.parent.mkdir(parents=True, exist_ok=True)
    lock = open_lock_file(directory.parent / f".{release}.lock")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cached = _cached(directory)
        if cached is not None:
            return cached
        return _fetch(release, directory, interpreter)
    finally:
        os.close(lock)  # closing the only descriptor drops the flock


def _fetch(release: str, directory: Path, interpreter: list[str] | None) -> ProxyFiles:
    indexes = pip_indexes(interpreter)
    problems: list[str] = []
    for index in indexes:
        try:
            url, sha256 = find_sdist(index, release)
        except LookupError as exc:
            problems.append(str(exc))
            continue
        present = fetch_and_extract(url, sha256, directory)
        origin = f"{url.split('#', 1)[0]} sha256={sha256}"
        record = {"origin": origin, "release": release, "files": present, "sought": SOUGHT}
        write_text_atomic(directory / ORIGIN_FILE, json.dumps(record))
        return ProxyFiles(directory, origin)
    raise BadInput(
        f"no sdist vllm-{release}.tar.gz on the package index "
        f"({'; '.join(problems) or 'no index configured'}); pass --vllm-source DIR"
    )


def _cached(directory: Path) -> ProxyFiles | None:
    """A release's files as an earlier fetch left them; None when incomplete, or when written
    before the cache listed which files the sdist had or while it sought fewer (then it is
    fetched again, once)."""
    origin_path = directory / ORIGIN_FILE
    if not origin_path.is_file():
        return None
    try:
        record = json.loads(origin_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None  # renamed into place without an fsync: a power loss can leave it empty
    if not isinstance(record, dict) or record.get("sought") != list(SOUGHT):
        return None
    listed = record.get("files")
    if not isinstance(listed, list) or not set(PROXY_FILES) <= set(listed):
        return None
    if not all((directory / name).is_file() for name in listed):
        return None
    return ProxyFiles(directory, record["origin"])


def find_sdist(index: str, release: str) -> tuple[str, str]:
    """The sdist's URL and sha256 from a simple-API project page (JSON or HTML)."""
    filename = f"vllm-{release}.tar.gz"
    for name, url, sha256 in project_files(index, "vllm"):
        if name == filename:
            if not sha256:
                raise LookupError(f"{safe_url(index)}: {filename} has no sha256")
            return url, sha256
    raise LookupError(f"{safe_url(index)}: no {filename}")


def fetch_and_extract(url: str, sha256: str, directory: Path) -> list[str]:
    """Download the sdist to a temporary file, check its sha256, extract UPSTREAM_FILES and the
    requirements files only (the proxies must be there); returns the files it had."""
    with tempfile.TemporaryDirectory() as scratch:
        sdist = Path(scratch) / "sdist.tar.gz"
        digest = hashlib.sha256()
        try:
            with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
                with open(sdist, "wb") as out:
                    while chunk := response.read(1 << 20):
                        digest.update(chunk)
                        out.write(chunk)
        except (urllib.error.URLError, OSError) as exc:
            raise BadInput(f"cannot download the vLLM sdist: {exc}") from None
        if digest.hexdigest() != sha256:
            raise BadInput(
                f"the vLLM sdist's sha256 is {digest.hexdigest()}, the index says "
                f"{sha256}: refusing it"
            )
        staging = Path(scratch) / "files"
        with tarfile.open(sdist, "r:gz") as archive:
            for member in archive.getmembers():
                inner = member.name.split("/", 1)[-1]
                if is_sought(inner) and member.isfile():
                    source = archive.extractfile(member)
                    assert source is not None
                    target = staging / inner
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(source.read())
        missing = [name for name in PROXY_FILES if not (staging / name).is_file()]
        if missing:
            raise BadInput(f"the vLLM sdist has no {missing[0]}; pass --vllm-source DIR")
        if directory.exists():
            shutil.rmtree(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(staging, directory)
        return sorted(
            str(path.relative_to(staging)) for path in staging.rglob("*") if path.is_file()
        )


def is_sought(inner: str) -> bool:
    """A path inside the sdist the harness extracts: UPSTREAM_FILES and requirements files."""
    parts = inner.split("/")
    if ".." in parts or inner.startswith("/"):
        return False
    return inner in UPSTREAM_FILES or (
        parts[0] == REQUIREMENTS_DIR and len(parts) > 1 and inner.endswith(".txt")
    )
