"""A default run directory belongs to one run: runs begun in the same second (two pytest
sessions started together, here) each get their own, instead of summing each other's starts."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from harness.files import fresh_run_dir

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
