"""vLLM's own EPD proxy files, for the served release: from its sdist through the package index
the user's pip is configured with, or from a vLLM checkout (`--vllm-source`).

Wheels ship no EPD proxy; every release's sdist does (`disagg_epd_proxy.py`, and the toy proxy
its NIXL tests use for 1P+1D). The proxy changes every release, so it must be the served
release's own: the version comes from the served vLLM (a local suffix such as `+cpu` dropped).
The index is pip's (PIP_INDEX_URL, `pip config`, else pip's own default), read through the
standard simple API (PEP 691 JSON, or PEP 503 HTML), and the sdist's sha256 as the index gives
it is verified. Only the needed files are extracted, into the harness cache by version; the
sdist itself is not kept. No upstream file is ever part of this repository.
"""

from __future__ import annotations

import hashlib
import html.parser
import json
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
from harness.files import write_text_atomic
from harness.preflight.vllm import interpreter_of
from harness.serve.vllm_proxy import DYNAMIC_REGISTRATION_FLAG, EPD_PROXY_FILE, TOY_PROXY_FILE
from harness.spec.settings import (
    DYNAMIC_REGISTRATION,
    STATIC_REGISTRATION,
    VLLM_PROXY,
    ProxyChoice,
    ServedVllm,
)

PROXY_FILES = (EPD_PROXY_FILE, TOY_PROXY_FILE)
ORIGIN_FILE = "origin.json"
# pip's configuration scopes, strongest first (`pip config list` prefixes keys with them).
CONFIG_SCOPES = (":env:", "site", "user", "global", "install")
INDEX_TIMEOUT_S = 60.0
DOWNLOAD_TIMEOUT_S = 600.0
PEP691_ACCEPT = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"


@dataclass(frozen=True)
class ProxyFiles:
    directory: Path  # PROXY_FILES live under it at their repository paths
    origin: str


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
    if source:
        files = from_checkout(source)
    else:
        if not served.known:
            raise BadInput(
                "--proxy vllm needs the served vLLM's version to fetch its proxy; "
                "pass --vllm-source DIR"
            )
        files = cached_or_fetched(served.version, cache, interpreter)
    if registration == DYNAMIC_REGISTRATION:
        check_dynamic_registration(files.directory / EPD_PROXY_FILE, files.origin)
    return ProxyChoice(VLLM_PROXY, files.directory, files.origin, tuple(interpreter), registration)


def check_dynamic_registration(proxy_file: Path, origin: str) -> None:
    """Refuse --proxy-registration dynamic for a release whose EPD proxy lacks the mode (it
    appeared in vLLM's proxy later than EPD itself)."""
    if DYNAMIC_REGISTRATION_FLAG not in proxy_file.read_text(errors="replace"):
        raise BadInput(
            f"--proxy-registration dynamic: this release's {EPD_PROXY_FILE} ({origin}) has no "
            f"{DYNAMIC_REGISTRATION_FLAG}; use static registration"
        )


def release_version(version: str) -> str:
    """The release a served vLLM comes from: "0.32.0+cpu" -> "0.32.0"."""
    release = version.split("+", 1)[0].strip()
    if not re.fullmatch(r"\d+(\.\d+)*([a-z]+\d*)?(\.post\d+)?", release):
        raise BadInput(
            f"cannot tell the vLLM release of version {version!r} to fetch its proxy "
            "from; pass --vllm-source DIR (a vLLM checkout)"
        )
    return release


def from_checkout(source: str) -> ProxyFiles:
    directory = Path(source).expanduser().resolve()
    missing = [name for name in PROXY_FILES if not (directory / name).is_file()]
    if missing:
        raise BadInput(f"--vllm-source {directory} is not a vLLM checkout: no {missing[0]}")
    return ProxyFiles(directory, f"checkout {directory}")


def cached_or_fetched(
    version: str, cache: Path, interpreter: list[str] | None = None
) -> ProxyFiles:
    """The release's proxy files from the cache, fetched through the index the first time."""
    release = release_version(version)
    directory = cache / "vllm-proxy" / release
    origin_path = directory / ORIGIN_FILE
    if origin_path.is_file() and all((directory / name).is_file() for name in PROXY_FILES):
        return ProxyFiles(directory, json.loads(origin_path.read_text())["origin"])
    indexes = pip_indexes(interpreter)
    problems: list[str] = []
    for index in indexes:
        try:
            url, sha256 = find_sdist(index, release)
        except LookupError as exc:
            problems.append(str(exc))
            continue
        fetch_and_extract(url, sha256, directory)
        origin = f"{url.split('#', 1)[0]} sha256={sha256}"
        write_text_atomic(origin_path, json.dumps({"origin": origin, "release": release}))
        return ProxyFiles(directory, origin)
    raise BadInput(
        f"no sdist vllm-{release}.tar.gz on the package index "
        f"({'; '.join(problems) or 'no index configured'}); pass --vllm-source DIR"
    )


def pip_indexes(interpreter: list[str] | None = None) -> list[str]:
    """The index URLs pip would use, main index first (`pip config list`, which reports the
    PIP_INDEX_URL environment variable as `:env:.index-url` and wins over the files, as in pip),
    else pip's own default; then the extra indexes. Asked of pip: no host is named here."""
    values = _pip_config(interpreter)
    main = values.get("index-url") or _pip_default_index()
    extras = values.get("extra-index-url", "").split()
    return [url for url in [main, *extras] if url]


def _pip_config(interpreter: list[str] | None) -> dict[str, str]:
    command = [*(interpreter or ["python3"]), "-m", "pip", "config", "list"]
    try:
        listed = subprocess.run(command, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    values: dict[str, str] = {}
    ranked: dict[str, int] = {}
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        scope, _, name = key.rpartition(".")
        if name not in ("index-url", "extra-index-url"):
            continue
        rank = CONFIG_SCOPES.index(scope) if scope in CONFIG_SCOPES else len(CONFIG_SCOPES)
        if rank < ranked.get(name, len(CONFIG_SCOPES) + 1):
            ranked[name] = rank
            values[name] = value.strip().strip("'\"")
    return values


def _pip_default_index() -> str:
    try:
        from pip._internal.models.index import PyPI
    except ImportError:
        return ""
    return str(PyPI.simple_url)


class _Anchors(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []  # (text, href)
        self._href: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data: str) -> None:
        if self._href is not None:
            self.links.append((data.strip(), self._href))
            self._href = None


def find_sdist(index: str, release: str) -> tuple[str, str]:
    """The sdist's URL and sha256 from a simple-API project page (JSON or HTML)."""
    page_url = index.rstrip("/") + "/vllm/"
    filename = f"vllm-{release}.tar.gz"
    try:
        request = urllib.request.Request(page_url, headers={"Accept": PEP691_ACCEPT})
        with urllib.request.urlopen(request, timeout=INDEX_TIMEOUT_S) as response:
            content_type = response.headers.get("Content-Type", "")
            payload = response.read()
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise LookupError(f"{_safe(index)}: {exc}") from None
    if "json" in content_type:
        for entry in json.loads(payload).get("files", []):
            if entry.get("filename") == filename:
                sha256 = (entry.get("hashes") or {}).get("sha256")
                if not sha256:
                    raise LookupError(f"{_safe(index)}: {filename} has no sha256")
                return urllib.parse.urljoin(page_url, entry["url"]), sha256
        raise LookupError(f"{_safe(index)}: no {filename}")
    anchors = _Anchors()
    anchors.feed(payload.decode("utf-8", errors="replace"))
    for text, href in anchors.links:
        if text == filename:
            fragment = urllib.parse.urlparse(href).fragment
            if not fragment.startswith("sha256="):
                raise LookupError(f"{_safe(index)}: {filename} has no sha256")
            return urllib.parse.urljoin(page_url, href), fragment.split("=", 1)[1]
    raise LookupError(f"{_safe(index)}: no {filename}")


def fetch_and_extract(url: str, sha256: str, directory: Path) -> None:
    """Download the sdist to a temporary file, check its sha256, extract PROXY_FILES only."""
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
                if inner in PROXY_FILES and member.isfile():
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


def _safe(url: str) -> str:
    """An index URL without credentials, for messages."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, "", ""))
