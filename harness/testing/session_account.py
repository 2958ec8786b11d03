"""The session's run directory and its account: one run root for the controller and every
xdist worker (`--epd-run-dir`, else runs/pytest-<time>), cleared of what an earlier session
left there for the summary, and at the end the summary itself (the verdict table, every
instance and topology start, where the artifacts are)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from harness.files import fresh_run_dir, remove_empty_run_dirs, run_dirs_made

RUN_ROOT_KEY = pytest.StashKey[str]()
# What the controller made for its run root: runs/pytest-<time>, and runs/ when there was none.
MADE_RUN_DIRS_KEY = pytest.StashKey[list[Path]]()
SWEEP_KEY = pytest.StashKey[object]()  # the session's sweep (epd_sweep): its verdicts, summed
WORKER_RUN_ROOT = "epd_run_root"  # how xdist hands the controller's run root to workers
# Under the run root: what every process of one session shares (`RunRequest.session_dir`: the
# baseline refresh's record, `--epd-baseline-cache off`'s shared baseline). The controller
# empties it as the session begins, so nothing in it is an earlier session's.
SESSION_SHARED_DIR = "session-shared"


def pytest_configure(config: pytest.Config) -> None:
    """The run root: a worker's is the controller's (`pytest_configure_node`)."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        config.stash[RUN_ROOT_KEY] = workerinput.get(WORKER_RUN_ROOT)
    else:
        given = config.getoption("--epd-run-dir", None)
        with run_dirs_made() as made:
            root = given or str(fresh_run_dir(Path(config.rootpath) / "runs", "pytest-"))
        config.stash[RUN_ROOT_KEY] = root
        config.stash[MADE_RUN_DIRS_KEY] = made
        forget_earlier_accounts(Path(config.stash[RUN_ROOT_KEY]))


def forget_earlier_accounts(root: Path) -> None:
    """Remove what an earlier session in the same run root (a reused `--epd-run-dir`: a rerun,
    `--lf`) left for the summary to sum: every pool's starts, every worker's verdict table. The
    summary reads them by name under the root, so kept they would be counted as this session's
    (found in review: an earlier `-n 2` run's two workers' starts added to a `-n 0` run's four).
    Only the controller does this, in `pytest_configure`, before any xdist worker starts; the
    earlier session's logs and run records stay. The directory the session's processes share
    (SESSION_SHARED_DIR) is emptied too: a baseline refresh recorded there by an earlier session
    would stand for this one's."""
    if not root.is_dir():
        return
    shutil.rmtree(root / SESSION_SHARED_DIR, ignore_errors=True)
    from harness.report.run_outputs import VERDICTS_FILE
    from harness.run.pool import INSTANCE_STARTS_FILE, STARTS_FILE

    for pattern in (f"**/{STARTS_FILE}", f"**/{INSTANCE_STARTS_FILE}", f"gw*/{VERDICTS_FILE}"):
        for path in root.glob(pattern):
            path.unlink(missing_ok=True)


def pytest_unconfigure(config: pytest.Config) -> None:
    """A run root this session made and left empty (it ran no scenario: every unit-test run,
    a session refused or only collected) is removed, rather than piling up under runs/, and
    so is the runs/ it made for it when that is left empty too (a fresh clone's first session
    left an empty runs/ at the session root); one with anything in it stays, as do
    `--epd-run-dir` and a runs/ that was there before."""
    remove_empty_run_dirs(config.stash.get(MADE_RUN_DIRS_KEY, []))


def pytest_configure_node(node) -> None:  # xdist: every worker writes under the same root
    node.workerinput[WORKER_RUN_ROOT] = node.config.stash[RUN_ROOT_KEY]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """End what a launcher holds beyond its topologies (with --epd-launcher ray: the Ray
    connection and the rehearsal cluster the session started), after the pool closed them."""
    from harness.serve.launcher import end_launchers

    end_launchers()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """The verdict table of whatever the scenarios judged (under xdist, each worker's, as it
    wrote it), every instance and topology start of the session (all workers), and where the
    artifacts are."""
    root = Path(config.stash.get(RUN_ROOT_KEY, ""))
    sweep = config.stash.get(SWEEP_KEY, None)
    if sweep is not None:
        from harness.report.text import format_verdict_table

        terminalreporter.section("EPD verdicts")
        terminalreporter.write_line(format_verdict_table(sweep.result.records))
    elif root.is_dir():
        from harness.report.run_outputs import VERDICTS_FILE

        for table in sorted(root.glob(f"gw*/{VERDICTS_FILE}")):
            terminalreporter.section(f"EPD verdicts ({table.parent.name})")
            terminalreporter.write_line(table.read_text().rstrip())
    from harness.run.pool import INSTANCE_STARTS_FILE, STARTS_FILE

    files = sorted(root.glob(f"**/{STARTS_FILE}")) if root.is_dir() else []
    if not files:
        return
    terminalreporter.section("EPD instance starts")
    for lines in sorted(root.glob(f"**/{INSTANCE_STARTS_FILE}")):
        terminalreporter.write_line(lines.read_text().rstrip())
    pools = [path for path in files if is_a_session_pools(root, path.parent)]
    starts = [start for path in pools for start in json.loads(path.read_text())]
    distinct = {start["topology"] for start in starts}
    terminalreporter.section("EPD topology starts")
    terminalreporter.write_line(
        f"topology starts: {len(starts)} for {len(distinct)} distinct (topology, connectors)"
    )
    for start in starts:
        terminalreporter.write_line(f"  {describe_start(start)}")
    for path in files:
        if path not in pools:  # an `epd-harness` command a test ran, with a pool of its own
            where = path.parent.relative_to(root)
            for start in json.loads(path.read_text()):
                terminalreporter.write_line(f"  in its own run {where}: {describe_start(start)}")
    terminalreporter.write_line(f"artifacts: {root}")


def is_a_session_pools(root: Path, run_dir: Path) -> bool:
    """Whether `run_dir` is where one of the session's pools wrote its starts: the run root,
    or an xdist worker's directory in it (`epd_pool`). Found in review: the account summed
    every `topology-starts.json` under the root, the runs an `own_instances` item's
    `epd-harness run` wrote there too, so a topology it started counted as the session's
    pool starting it again, each a "first use" ("2 for 1 distinct")."""
    return run_dir == root or (run_dir.parent == root and run_dir.name.startswith("gw"))


def describe_start(start: dict) -> str:
    took = "did not come up" if start["seconds"] is None else f"{start['seconds']:.1f}s"
    return f"{start['topology']}: {start['reason']} ({took})"
