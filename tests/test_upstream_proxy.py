"""vLLM's own proxy files: found through a package index's simple API, verified, extracted,
cached (harness/preflight/upstream_proxy.py); and the command that runs them
(harness/serve/vllm_proxy.py).

The index here is a fake on loopback serving a made-up sdist that holds stand-in files at the
release's paths (no upstream code is involved); it counts its downloads so the cache shows.
"""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import subprocess
import sys
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.errors import BadInput
from harness.preflight import upstream_proxy
from harness.preflight.config import RunRequest, prepare_run
from harness.preflight.upstream_proxy import UPSTREAM_SCRIPT_FILE
from harness.serve.vllm_proxy import (
    ADMIN_KEY_ENV,
    DYNAMIC_REGISTRATION_FLAG,
    EPD_PROXY_FILE,
    TOY_PROXY_FILE,
    Registration,
    register_instances,
    registrations,
    vllm_proxy_launch,
)
from harness.spec.settings import ServedVllm

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


@pytest.mark.process
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


@pytest.mark.process
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


@pytest.mark.process
def test_a_release_the_index_lacks_is_one_clear_line(index: FakeIndex, tmp_path: Path) -> None:
    with pytest.raises(BadInput, match=r"no sdist vllm-1\.2\.3\.tar\.gz.*--vllm-source"):
        upstream_proxy.cached_or_fetched("1.2.3", tmp_path)


def test_release_version_drops_the_local_suffix() -> None:
    assert upstream_proxy.release_version("0.32.0+cpu") == "0.32.0"
    assert upstream_proxy.release_version("0.33.0") == "0.33.0"
    with pytest.raises(BadInput):
        upstream_proxy.release_version("unknown")


def test_a_checkout_must_hold_both_files(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="not a vLLM checkout"):
        upstream_proxy.from_checkout(str(tmp_path))
    for name in (EPD_PROXY_FILE, TOY_PROXY_FILE):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("#")
    assert upstream_proxy.from_checkout(str(tmp_path)).directory == tmp_path.resolve()


def test_pip_config_scopes_rank_like_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    listed = (
        "global.index-url='http://g/simple'\n:env:.index-url='http://e/simple'\n"
        "global.extra-index-url='file:///a file:///b'\n"
    )

    class Done:
        stdout = listed

    monkeypatch.setattr(upstream_proxy.subprocess, "run", lambda *a, **k: Done())
    assert upstream_proxy.pip_indexes(["python"]) == ["http://e/simple", "file:///a", "file:///b"]


def test_vllm_source_without_the_vllm_proxy_is_refused() -> None:
    with pytest.raises(BadInput, match="--vllm-source .* --proxy vllm"):
        prepare_run(RunRequest(vllm_source="/somewhere", count_tokens=False))
    with pytest.raises(BadInput, match="--proxy nginx"):
        prepare_run(RunRequest(proxy="nginx", count_tokens=False))


def test_encoder_topologies_get_the_epd_proxy_with_static_urls(tmp_path: Path) -> None:
    launch = vllm_proxy_launch(
        ("py",), tmp_path, "127.0.0.1", 9000, ["http://127.0.0.1:1"], [], ["http://127.0.0.1:3"]
    )
    argv = list(launch.argv)
    assert argv[:2] == ["py", str(tmp_path / EPD_PROXY_FILE)]
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--prefill-servers-urls") + 1] == "disable"
    assert argv[argv.index("--decode-servers-urls") + 1] == "http://127.0.0.1:3"
    assert launch.health_path == "/health"
    epd = list(
        vllm_proxy_launch(
            ("py",),
            tmp_path,
            "127.0.0.1",
            9000,
            ["http://127.0.0.1:1"],
            ["http://127.0.0.1:2"],
            ["http://127.0.0.1:3"],
        ).argv
    )
    assert epd[epd.index("--prefill-servers-urls") + 1] == "http://127.0.0.1:2"


def test_one_p_one_d_gets_the_toy_proxy(tmp_path: Path) -> None:
    launch = vllm_proxy_launch(
        ("py",), tmp_path, "127.0.0.1", 9000, [], ["http://127.0.0.1:2"], ["http://127.0.0.1:3"]
    )
    argv = list(launch.argv)
    assert argv[1] == str(tmp_path / TOY_PROXY_FILE)
    assert argv[argv.index("--prefiller-ports") + 1] == "2"
    assert argv[argv.index("--decoder-hosts") + 1] == "127.0.0.1"
    assert launch.health_path == "/healthcheck"


# -- dynamic registration ------------------------------------------------------------------------


def test_dynamic_registration_starts_the_epd_proxy_empty_with_its_admin_key(
    tmp_path: Path,
) -> None:
    launch = vllm_proxy_launch(
        ("py",),
        tmp_path,
        "127.0.0.1",
        9000,
        ["http://127.0.0.1:1"],
        [],
        ["http://127.0.0.1:3"],
        admin_key="k" * 32,
    )
    argv = list(launch.argv)
    assert DYNAMIC_REGISTRATION_FLAG in argv
    assert not [a for a in argv if a.endswith("-servers-urls")], argv
    assert launch.env == {ADMIN_KEY_ENV: "k" * 32}
    with pytest.raises(ValueError, match="toy proxy"):
        vllm_proxy_launch(
            ("py",), tmp_path, "h", 1, [], ["http://127.0.0.1:2"], ["http://127.0.0.1:3"], "k"
        )


def test_registrations_name_the_proxys_roles() -> None:
    e, p, d = "http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"
    assert registrations([e], [], [d]) == [
        Registration("encode", e),
        Registration("prefill_decode", d),
    ]
    assert registrations([e, e + "0"], [p], [d]) == [
        Registration("encode", e),
        Registration("encode", e + "0"),
        Registration("prefill", p),
        Registration("decode", d),
    ]


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


def test_a_refused_registration_names_the_instance(admin_api: str) -> None:
    with pytest.raises(RuntimeError, match=r"refused to register encode http://127.0.0.1:1: 403"):
        register_instances(admin_api, "wrong-key", [Registration("encode", "http://127.0.0.1:1")])


def test_an_instance_missing_from_the_roster_is_an_error(admin_api: str) -> None:
    FakeAdminApi.drop = {"http://127.0.0.1:3"}
    wanted = registrations(["http://127.0.0.1:1"], [], ["http://127.0.0.1:3"])
    with pytest.raises(RuntimeError, match="not list as live: prefill_decode http://127.0.0.1:3"):
        register_instances(admin_api, FakeAdminApi.key, wanted)


def test_dynamic_registration_is_refused_where_it_would_be_ignored(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="only --proxy vllm runs"):
        prepare_run(RunRequest(proxy_registration="dynamic", count_tokens=False))
    with pytest.raises(BadInput, match="--proxy-registration sometimes"):
        prepare_run(RunRequest(proxy_registration="sometimes", count_tokens=False))
    with pytest.raises(BadInput, match="none of 1P\\+1D has an encoder"):
        prepare_run(
            RunRequest(
                proxy="vllm",
                proxy_registration="dynamic",
                topologies=("1P+1D",),
                count_tokens=False,
            )
        )
    old = tmp_path / EPD_PROXY_FILE
    old.parent.mkdir(parents=True)
    old.write_text("parser.add_argument('--encode-servers-urls')\n")
    with pytest.raises(BadInput, match="has no --dynamic-registration"):
        upstream_proxy.check_dynamic_registration(old, "vllm-0.31.0.tar.gz")
    old.write_text(f"parser.add_argument('{DYNAMIC_REGISTRATION_FLAG}')\n")
    upstream_proxy.check_dynamic_registration(old, "vllm-0.32.0.tar.gz")


# --- the upstream script, and development builds ------------------------------------------------


@pytest.mark.process
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


@pytest.mark.process
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


@pytest.mark.parametrize(
    ("version", "dev", "commit"),
    [
        ("0.32.0+cpu", False, None),
        ("0.33.0", False, None),
        ("0.33.0rc1", False, None),
        ("0.32.0.post1", False, None),
        ("0.33.0.dev12+gabc1234", True, "abc1234"),
        ("0.32.1.dev0+g0123abcd.cu129", True, "0123abcd"),
        ("0.33.0.dev3", True, None),
        ("0.32.0+g89abcdef0", True, "89abcdef0"),
    ],
)
def test_a_development_build_is_told_by_its_version(
    version: str, dev: bool, commit: str | None
) -> None:
    assert upstream_proxy.is_dev_build(version) is dev
    assert upstream_proxy.build_commit(version) == commit


def test_a_development_build_never_gets_a_release_sdist(tmp_path: Path) -> None:
    with pytest.raises(BadInput) as info:
        upstream_proxy.cached_or_fetched("0.33.0.dev12+gabc1234", tmp_path)
    message = str(info.value)
    assert "development build" in message and "--vllm-source DIR" in message
    assert "--epd-vllm-source" in message and "abc1234" in message
    assert "\n" not in message
    assert not (tmp_path / "vllm-proxy").exists(), "nothing fetched"


def fake_dev_vllm(tmp_path: Path, version: str) -> ServedVllm:
    """A served vLLM as the version probe would report a development build of it."""
    executable = tmp_path / "bin" / "vllm"
    executable.parent.mkdir(parents=True, exist_ok=True)
    executable.write_text(f"#!{sys.executable}\n")
    executable.chmod(0o755)
    return ServedVllm(str(executable), version)


def vllm_tree(path: Path, commit: bool) -> str | None:
    """A stand-in vLLM source tree (the proxy files only); a git checkout with one commit."""
    for name in (EPD_PROXY_FILE, TOY_PROXY_FILE, UPSTREAM_SCRIPT_FILE):
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text("# stand-in\n")
    if not commit:
        return None
    git = ["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "tree"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    return head.stdout.strip()


def test_without_the_source_tree_a_development_build_is_one_error_naming_the_option(
    tmp_path: Path,
) -> None:
    served = fake_dev_vllm(tmp_path, "0.33.0.dev12+gabc1234")
    with pytest.raises(BadInput, match=r"development build.*pass --vllm-source DIR"):
        upstream_proxy.proxy_choice("vllm", None, served, tmp_path / "cache")
    with pytest.raises(BadInput, match=r"development build.*--epd-vllm-source"):
        upstream_proxy.upstream_files(served, None, tmp_path / "cache")


@pytest.mark.process
def test_the_source_trees_commit_is_recorded_and_must_be_the_builds(tmp_path: Path) -> None:
    tree = tmp_path / "vllm"
    commit = vllm_tree(tree, commit=True)
    assert commit is not None
    served = fake_dev_vllm(tmp_path, f"0.33.0.dev12+g{commit[:9]}")
    choice = upstream_proxy.proxy_choice("vllm", str(tree), served, tmp_path / "cache")
    recorded = choice.to_json()
    assert recorded["source_commit"] == commit
    assert recorded["commit_check"] == f"matches the served vLLM's build (g{commit[:9]})"
    assert recorded["origin"] == f"checkout {tree.resolve()}"
    files = upstream_proxy.upstream_files(served, str(tree), tmp_path / "cache")
    assert files.script == tree.resolve() / UPSTREAM_SCRIPT_FILE
    other = fake_dev_vllm(tmp_path, "0.33.0.dev12+gabc1234")
    with pytest.raises(BadInput) as info:
        upstream_proxy.proxy_choice("vllm", str(tree), other, tmp_path / "cache")
    assert f"is at commit {commit[:12]}" in str(info.value)
    assert "was built from abc1234" in str(info.value)


@pytest.mark.process
def test_a_tree_without_git_or_a_build_without_a_commit_says_it_was_not_checked(
    tmp_path: Path,
) -> None:
    plain = tmp_path / "unpacked"
    vllm_tree(plain, commit=False)
    served = fake_dev_vllm(tmp_path, "0.33.0.dev12+gabc1234")
    files = upstream_proxy.from_checkout(str(plain), served)
    assert files.commit is None
    assert (
        files.commit_check.startswith("not checked: ")
        and "not a git checkout" in files.commit_check
    )
    tree = tmp_path / "vllm"
    commit = vllm_tree(tree, commit=True)
    release = fake_dev_vllm(tmp_path, "0.33.0")
    files = upstream_proxy.from_checkout(str(tree), release)
    assert files.commit == commit
    assert files.commit_check == "not checked: the served vLLM's version (0.33.0) names no commit"
