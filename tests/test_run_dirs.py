"""A default run directory belongs to one run: runs begun in the same second (two pytest
sessions started together, here) each get their own, instead of summing each other's starts."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from harness.files import empty_run_dirs_removed, fresh_run_dir, write_text_atomic

pytestmark = pytest.mark.unit


@pytest.fixture
def one_second(monkeypatch: pytest.MonkeyPatch) -> str:
    """Every run begins in the same second."""
    monkeypatch.setattr(time, "strftime", lambda fmt, *a: "20261204-225953")
    return "20261204-225953"


def test_runs_begun_in_the_same_second_get_directories_of_their_own(
    tmp_path: Path, one_second: str
) -> None:
    first, second, third = (fresh_run_dir(tmp_path / "runs", "pytest-") for _ in range(3))
    assert [p.name for p in (first, second, third)] == [
        f"pytest-{one_second}",
        f"pytest-{one_second}-2",
        f"pytest-{one_second}-3",
    ]
    assert all(p.is_dir() for p in (first, second, third))


def test_a_parent_that_cannot_be_made_gives_the_plain_name_for_the_write_check_to_refuse(
    tmp_path: Path, one_second: str
) -> None:
    (tmp_path / "file").write_text("")
    path = fresh_run_dir(tmp_path / "file" / "runs")
    assert path == tmp_path / "file" / "runs" / one_second and not path.exists()


def test_two_pytest_sessions_begun_together_have_two_run_roots(
    tmp_path: Path, one_second: str
) -> None:
    """Seen here: a unit-test session and an e2e session started in one second shared
    runs/pytest-<second>; the unit session's summary listed the other's instance starts."""
    from types import SimpleNamespace

    from harness.testing.session_account import RUN_ROOT_KEY, pytest_configure

    roots = []
    for _ in range(2):
        config = SimpleNamespace(rootpath=tmp_path, stash=pytest.Stash(), getoption=lambda *a: None)
        pytest_configure(config)  # type: ignore[arg-type]
        roots.append(config.stash[RUN_ROOT_KEY])
    assert roots[0] != roots[1], roots


def test_two_cli_runs_begun_together_have_two_run_directories(
    tmp_path: Path, one_second: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from harness.preflight.config import RunRequest, _run_dir

    monkeypatch.chdir(tmp_path)
    first, second = _run_dir(RunRequest()), _run_dir(RunRequest())
    assert first != second and first.is_dir() and second.is_dir(), (first, second)


def test_a_run_directory_left_empty_is_removed_and_one_written_to_stays(
    tmp_path: Path, one_second: str
) -> None:
    """Found walking the CLI: a refused `fuzz` and every unit-test session left an empty
    runs/<prefix><time> behind."""
    before = fresh_run_dir(tmp_path / "runs", "run-")  # made outside the block: not its own
    with pytest.raises(RuntimeError), empty_run_dirs_removed():
        empty = fresh_run_dir(tmp_path / "runs", "fuzz-")
        written = fresh_run_dir(tmp_path / "runs", "fuzz-")
        (written / "run.json").write_text("{}")
        raise RuntimeError("refused after the directory was made")
    assert not empty.exists() and (written / "run.json").is_file() and before.is_dir()


def plugin_session(rootpath: Path, writes: bool, run_dir: Path | None = None) -> Path:
    """The session plugin's configure and unconfigure on a stand-in config at `rootpath`
    (`--epd-run-dir` `run_dir`), writing into its run root in between if `writes`; returns
    the run root."""
    from types import SimpleNamespace

    from harness.testing.session_account import (
        RUN_ROOT_KEY,
        pytest_configure,
        pytest_unconfigure,
    )

    config = SimpleNamespace(rootpath=rootpath, stash=pytest.Stash(), getoption=lambda *a: run_dir)
    pytest_configure(config)  # type: ignore[arg-type]
    root = Path(config.stash[RUN_ROOT_KEY])
    if writes:
        (root / "gw0").mkdir()
    pytest_unconfigure(config)  # type: ignore[arg-type]
    return root


def test_a_pytest_session_that_wrote_nothing_leaves_no_run_root(
    tmp_path: Path, one_second: str
) -> None:
    roots = [plugin_session(tmp_path, writes).exists() for writes in (False, True)]
    assert roots == [False, True]
    given = tmp_path / "given"
    given.mkdir()
    plugin_session(tmp_path, writes=False, run_dir=given)
    assert given.is_dir()  # --epd-run-dir is the user's: never removed


@pytest.mark.parametrize("workers", [1, 2])
def test_an_xdist_workers_bundle_is_apart_from_the_root_pytests_junit_goes_to(
    tmp_path: Path, workers: int
) -> None:
    """The nightly's line gives pytest `--epd-run-dir ROOT --junitxml ROOT/junit.xml`. A lone
    worker (`-n 1`: the 2-GPU leg, the rehearsal on 4 GPUs, the Buildkite step) wrote its
    bundle into ROOT itself: pytest's junit.xml replaced the bundle's at the session's end, and
    the session's summary, reading gw*/verdicts.txt, showed no verdicts. Without xdist the
    bundle is the root's, as before."""
    from harness.preflight.config import _run_dir
    from harness.testing.session_options import session_request

    def option(name: str):
        return None

    root = tmp_path / "root"
    worker = _run_dir(session_request(option, str(root), ("gw0", workers)))
    assert worker == (root / "gw0").resolve()
    assert _run_dir(session_request(option, str(root), ("main", 1))) == root.resolve()


def test_the_runs_directory_a_refused_command_made_goes_with_its_empty_run_directory(
    tmp_path: Path, one_second: str
) -> None:
    """Found walking the CLI: `fuzz --topology nope` in a directory without runs/ removed its
    empty runs/fuzz-<time> but left the runs/ it had made for it. The runs/ goes too when this
    invocation made it and it is empty (with any parent made for it); one that was there
    before, or that holds a run's files, stays."""
    made = tmp_path / "made" / "runs"
    with pytest.raises(RuntimeError), empty_run_dirs_removed():
        fresh_run_dir(made, "fuzz-")
        fresh_run_dir(made, "fuzz-")  # a second run directory under the runs/ just made
        raise RuntimeError("refused after the directories were made")
    assert list(tmp_path.iterdir()) == [], "runs/ and the directory made for it are gone"
    there = tmp_path / "there" / "runs"
    there.mkdir(parents=True)
    with empty_run_dirs_removed():
        fresh_run_dir(there, "fuzz-")
    assert there.is_dir() and not any(there.iterdir())
    kept = tmp_path / "kept" / "runs"
    with empty_run_dirs_removed():
        (fresh_run_dir(kept, "fuzz-") / "run.json").write_text("{}")
    assert (kept / f"fuzz-{one_second}" / "run.json").is_file()


def test_a_fuzz_refused_in_a_fresh_directory_leaves_nothing_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CLI end to end, in process: a bad topology is refused after fuzz made its run
    directory; the working directory is left as it was."""
    from harness.cli.main import main
    from harness.errors import EXIT_BAD_INPUT

    monkeypatch.chdir(tmp_path)
    assert main(["fuzz", "--topology", "nope"]) == EXIT_BAD_INPUT
    assert "unknown topology 'nope'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


SESSION_CONFTEST = """
import pytest

pytest_plugins = ["harness.testing.plugin"]

def pytest_addoption(parser):
    parser.addoption("--epd-platform", default="cpu")
    parser.addoption("--epd-topology", default=None)
    parser.addoption("--refuse-at-configure", action="store_true")

def pytest_configure(config):
    # After the plugin's own (registered later, called first): the run root exists by now.
    if config.getoption("--refuse-at-configure"):
        raise pytest.UsageError("refused at configure")
"""
SESSION_MODULE = """
import pytest

pytestmark = pytest.mark.e2e

def test_sweep_case():
    pass
"""


@pytest.mark.parametrize(
    ("args", "refused"),
    [
        (("--collect-only",), False),
        (("--refuse-at-configure",), True),
        (("--collect-only", "--epd-topology", "9E"), True),  # refused once collected
    ],
)
def test_a_pytest_session_that_wrote_nothing_leaves_no_runs_directory(
    pytester: pytest.Pytester, args: tuple[str, ...], refused: bool
) -> None:
    """Found walking the sessions: a session that wrote nothing under its run root (collected
    only, refused at configure or once collected) removed its empty runs/pytest-<time> but
    left the runs/ it had made for it at the session root, as the `run` CLI did before it
    removed the runs/ it made (`empty_run_dirs_removed`)."""
    pytester.makeconftest(SESSION_CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    e2e: real vLLM\n")
    pytester.makepyfile(test_a_e2e=SESSION_MODULE)
    run = pytester.runpytest("-p", "no:cacheprovider", *args)
    assert (run.ret not in (0, 5)) is refused, run.stdout.str()
    assert not (pytester.path / "runs").exists(), sorted(pytester.path.iterdir())


def test_a_runs_directory_there_before_the_session_or_written_to_stays(
    tmp_path: Path, one_second: str
) -> None:
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    plugin_session(fresh, writes=False)
    assert list(fresh.iterdir()) == []  # runs/ made for the session went with its root
    (tmp_path / "before" / "runs").mkdir(parents=True)
    plugin_session(tmp_path / "before", writes=False)
    assert (tmp_path / "before" / "runs").is_dir()  # there before: the user's
    written = plugin_session(tmp_path / "written", writes=True)
    assert (written / "gw0").is_dir()


def test_a_reused_run_root_is_cleared_of_what_the_summary_sums_and_keeps_the_rest(
    tmp_path: Path,
) -> None:
    """A rerun into the same `--epd-run-dir` (`--lf`): the summary sums every pool's starts
    and shows every worker's verdict table found under the root by name, so the earlier
    session's were counted as this one's; and a baseline refresh recorded in the directory
    the session's processes share stood for this session's. The controller removes those as
    it configures; the earlier session's logs and run records stay."""
    root = tmp_path / "given"
    cleared = [
        "session-shared/baseline-refresh.json",
        "topology-starts.json",
        "instance-starts.txt",
        "gw0/topology-starts.json",
        "gw0/instance-starts.txt",
        "gw0/verdicts.txt",
        "gw0/planted-corrupt-ec/topology-starts.json",
    ]
    kept = ["verdicts.txt", "gw0/run.json", "gw0/logs/encode0.log", "gw0/planted-corrupt-ec/x"]
    for name in cleared + kept:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("earlier session\n")
    plugin_session(tmp_path, writes=False, run_dir=root)
    left = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
    assert left == set(kept)


def test_an_artifact_is_readable_by_everyone_who_reads_the_run(tmp_path: Path) -> None:
    """write_text_atomic writes through mkstemp, which makes its file 0600: renamed as it is,
    run.json or report.md of a CI job's run was unreadable to anyone but the user who ran it."""
    path = tmp_path / "run.json"
    write_text_atomic(path, "{}\n")
    assert (path.read_text(), path.stat().st_mode & 0o777) == ("{}\n", 0o644)


def test_a_failed_artifact_write_names_the_artifact_and_leaves_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk fails write() with no file name: the error said "No space left on device"
    and not which artifact (a failing rename stands in for it here); it names the target now,
    and the temporary file is gone."""
    import errno

    from harness import files

    def full(*_args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "replace", full)
    path = tmp_path / "run.json"
    with pytest.raises(OSError) as failed:
        write_text_atomic(path, "{}")
    assert (failed.value.filename, list(tmp_path.iterdir())) == (str(path), [])
