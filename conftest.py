"""pytest options and the session-wide fixtures the scenarios share.

The e2e scenarios start real vLLM. They are never skipped for lack of vLLM: in an environment
without it they fail and say so (deselect them with `-m "not e2e"` instead). The baseline is
computed once per session and each topology is started once, serving every prompt, because a
start costs tens of seconds on CPU.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("epd-harness")
    group.addoption("--epd-model", help="model directory (default: the tiny model, built once)")
    group.addoption("--epd-run-dir", help="artifact directory (default: runs/pytest-<time>)")
    group.addoption("--epd-vllm", help="vllm executable (default: beside this Python)")


@pytest.fixture(scope="session")
def epd_run_dir(pytestconfig: pytest.Config) -> Path:
    given = pytestconfig.getoption("--epd-run-dir")
    root = Path(pytestconfig.rootpath)
    path = Path(given) if given else root / "runs" / f"pytest-{time.strftime('%Y%m%d-%H%M%S')}"
    path.mkdir(parents=True, exist_ok=True)
    return path.resolve()


@pytest.fixture(scope="session")
def epd_model(pytestconfig: pytest.Config) -> Path:
    from harness.cli import resolve_model

    return resolve_model(pytestconfig.getoption("--epd-model"))


@pytest.fixture(scope="session")
def epd_settings(pytestconfig: pytest.Config, epd_model: Path, epd_run_dir: Path):
    from harness.cli import default_vllm_executable
    from harness.runner import RunSettings
    from harness.topology import ServingConfig

    return RunSettings(
        serving=ServingConfig(model=str(epd_model)),
        run_dir=epd_run_dir,
        vllm_executable=pytestconfig.getoption("--epd-vllm") or default_vllm_executable(),
    )


SWEEP_KEY = pytest.StashKey[object]()


@pytest.fixture(scope="session")
def epd_sweep(pytestconfig: pytest.Config, epd_settings):
    """The shared sweep: baseline once, each topology once, judged case by case on demand."""
    from harness.prompts import SKELETON_PROMPTS
    from harness.sweep import Sweep, SweepPlan
    from harness.topology import EPD_TOPOLOGY_NAMES, TOPOLOGIES

    plan = SweepPlan(
        topologies=tuple(TOPOLOGIES[name] for name in EPD_TOPOLOGY_NAMES),
        prompts=SKELETON_PROMPTS,
    )
    started = time.monotonic()

    def on_event(name: str, state: str, elapsed_s: float) -> None:
        print(f"[{time.monotonic() - started:7.1f}s] {name}: {state} ({elapsed_s:.1f}s)")

    sweep = Sweep(plan, epd_settings, on_event=on_event)
    pytestconfig.stash[SWEEP_KEY] = sweep
    return sweep


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """The verdict table of whatever the scenarios judged, and where the artifacts are."""
    sweep = config.stash.get(SWEEP_KEY, None)
    if sweep is None:
        return
    from harness.report import format_verdict_table

    terminalreporter.section("EPD verdicts")
    terminalreporter.write_line(format_verdict_table(sweep.result.records))
    for stats in sweep.result.instances:
        terminalreporter.write_line(
            f"{stats.name}: ready in {stats.startup_s or 0:.1f}s, "
            f"peak RSS {stats.peak_rss_bytes / 2**30:.2f} GiB"
        )
    terminalreporter.write_line(f"artifacts: {sweep.settings.run_dir}")
