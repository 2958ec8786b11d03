"""The harness's own tests' fixtures: `epd_cli` (the CLI in-process), `fake_vllm` (the fake
`vllm` executable) and the log of its starts, `port_locks` and `leased_ports` (port leases of
one test), and the served vLLM's parser judged once for the session, with every test's
accepted command lines kept out of the user's cache. The record builders, the in-process fake
instance and the process watchers are plain modules of this package (builders, fake_instance,
processes)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest


@pytest.fixture
def epd_cli(capsys: pytest.CaptureFixture[str]):
    """`epd_cli("run", ...)`: the CLI in this process -> CliResult(code, out, err)
    (harness.testing.cli)."""
    from harness.testing.cli import CliRunner

    return CliRunner(capsys)


@pytest.fixture
def fake_vllm(tmp_path: Path) -> Path:
    """The fake `vllm serve` look-alike (harness.testing.fake_vllm), installed for this test;
    misbehaving on cue through FAKE_VLLM_MODE."""
    from harness.testing.fake_vllm import install_fake_vllm

    return install_fake_vllm(tmp_path / "bin")


@pytest.fixture(scope="session")
def epd_session_root(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory of this session's that its xdist workers share (their common base)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if hasattr(pytestconfig, "workerinput") else base


@pytest.fixture(scope="session")
def epd_argv_check_dir(epd_session_root: Path) -> Path:
    """Where this session's runs keep the command lines the served vLLM's parser accepted
    (EPD_HARNESS_ARGV_CHECK_DIR), in place of the user's cache (`epd_own_argv_checks`)."""
    return epd_session_root / "argv-check"


@pytest.fixture(scope="session")
def served_vllm_parser(epd_session_root: Path, epd_argv_check_dir: Path):
    """The served vLLM's own `vllm serve` parser (this Python's vLLM), its verdicts on every
    line the parser tests read and the tests' runs render judged by one probe for the session
    (harness.testing.served_parser), its accepted lines marked in `epd_argv_check_dir`. A test
    whose runs are subprocesses (a CLI, a pytest session) asks for it first, so that they find
    their lines judged; in-process runs ask for it themselves (`epd_own_argv_checks`)."""
    from harness.testing.served_parser import served_parser, served_version

    parser = served_parser([sys.executable], epd_session_root)
    parser.keep_accepted(epd_argv_check_dir, served_version())
    return parser


@pytest.fixture(autouse=True)
def epd_own_import_checks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test's runs, in this process and in those it starts (a fake GPU night's pytest
    session, a CLI), keep the served interpreter's imports that succeeded in the session's
    directory (harness.preflight.connectors): each probe of `nixl` costs 3.5 CPU-s, and the
    session's runs probe one interpreter dozens of times. The e2e items are runs of the harness
    like the user's, and probe every time."""
    if request.node.get_closest_marker("e2e") is not None:
        return
    from harness.environment import IMPORT_CHECK_DIR_ENV

    root = request.getfixturevalue("epd_session_root")
    monkeypatch.setenv(IMPORT_CHECK_DIR_ENV, str(root / "import-check"))


@pytest.fixture(autouse=True)
def epd_own_argv_checks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test's runs, in this process and in those it starts, keep their accepted command
    lines in the session's directory, never in the user's cache: a line marked accepted there
    (by a session whose parser took it, or by hand) decided whether a test saw a refusal. A
    probe of this Python's vLLM is answered by the session's one batch (`served_vllm_parser`).
    The e2e items are runs of the harness like the user's, and keep the user's cache."""
    if request.node.get_closest_marker("e2e") is not None:
        return
    from harness.environment import ARGV_CHECK_DIR_ENV
    from harness.preflight import vllm_args
    from harness.testing.served_parser import REAL_PROBE

    monkeypatch.setenv(ARGV_CHECK_DIR_ENV, str(request.getfixturevalue("epd_argv_check_dir")))

    def probe(interpreter: Sequence[str], argvs: dict[str, list[str]]):
        if list(interpreter) != [sys.executable]:
            return REAL_PROBE(interpreter, argvs)
        return request.getfixturevalue("served_vllm_parser").probe(interpreter, argvs)

    monkeypatch.setattr(vllm_args, "_run_probe", probe)


@pytest.fixture
def fake_vllm_start_log(tmp_path: Path, port_locks: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The file every fake vLLM started in this test logs its start to (read it with
    `harness.testing.fake_vllm.logged_starts`); the test's own port leases come with it."""
    from harness.testing.fake_vllm import START_LOG_ENV

    log = tmp_path / "starts.jsonl"
    monkeypatch.setenv(START_LOG_ENV, str(log))
    return log


@pytest.fixture
def port_locks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Port leases of this test only (EPD_HARNESS_PORT_DIR), for the harness in this process
    and in the processes it starts: what a test leaves held is its own."""
    from harness.environment import PORT_LOCK_DIR_ENV

    directory = tmp_path / "port-locks"
    monkeypatch.setenv(PORT_LOCK_DIR_ENV, str(directory))
    return directory


@pytest.fixture
def leased_ports() -> Iterator[Callable[[int], list[int]]]:
    """`take(n)`: n ports for servers a test starts outside the harness (an export's `run.sh`),
    leased like the harness's own (locked under the shared lock directory, so no harness run
    picks them) and handed over for binding; released when the test ends."""
    from harness.serve.ports import reserve_ports

    leases = []

    def take(count: int) -> list[int]:
        taken = reserve_ports(count)
        leases.extend(taken)
        return [lease.hand_over() for lease in taken]

    yield take
    for lease in leases:
        lease.release()
