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
    group.addoption(
        "--epd-baseline-cache",
        help="baseline cache directory (default: ~/.cache/epd-harness/baseline; 'off' disables)",
    )
    group.addoption(
        "--epd-refresh-baseline", action="store_true", help="recompute and overwrite the baseline"
    )
    group.addoption("--epd-platform", default="cpu", help="cpu (default), cuda or xpu")
    group.addoption(
        "--epd-devices",
        help="devices this session may use: GPU ids on cuda/xpu, cores on cpu (default: 0,1); "
        "pytest-xdist workers split them into disjoint contiguous shares",
    )
    group.addoption("--epd-colocate", action="store_true", help="let instances share a device")
    group.addoption(
        "--epd-topology",
        help="comma list: run only scenarios of these topologies (names contain '+', so -k "
        "cannot select them)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`--epd-topology` filter, and one xdist group per topology (its sessions stay on one
    worker under `--dist loadgroup`)."""
    wanted = {n.strip() for n in (config.getoption("--epd-topology") or "").split(",") if n.strip()}
    kept, dropped = [], []
    for item in items:
        topology = epd_topology_of(item)
        if topology is not None:
            item.add_marker(pytest.mark.xdist_group(topology))
        (dropped if wanted and topology not in wanted else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def epd_topology_of(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return None
    topology = callspec.params.get("topology")
    scenario = callspec.params.get("scenario")
    return topology if isinstance(topology, str) else getattr(scenario, "topology", None)


def worker_share(devices: tuple[int, ...], worker_id: str, worker_count: int) -> tuple[int, ...]:
    """This xdist worker's contiguous, disjoint share of the devices (all of them without xdist)."""
    if worker_count <= 1 or not worker_id.startswith("gw"):
        return devices
    index = int(worker_id[2:])
    share = len(devices) // worker_count
    if share == 0:
        raise pytest.UsageError(
            f"{worker_count} xdist workers cannot share {len(devices)} device(s) disjointly"
        )
    return devices[index * share : (index + 1) * share]


@pytest.fixture(scope="session")
def epd_worker(request: pytest.FixtureRequest) -> tuple[str, int]:
    """(xdist worker id, worker count); ("main", 1) without xdist."""
    worker_id = getattr(request.config, "workerinput", {}).get("workerid", "main")
    return worker_id, int(getattr(request.config, "workerinput", {}).get("workercount", 1))


@pytest.fixture(scope="session")
def epd_run_dir(pytestconfig: pytest.Config, epd_worker: tuple[str, int]) -> Path:
    given = pytestconfig.getoption("--epd-run-dir")
    root = Path(pytestconfig.rootpath)
    path = Path(given) if given else root / "runs" / f"pytest-{time.strftime('%Y%m%d-%H%M%S')}"
    if epd_worker[1] > 1:
        path = path / epd_worker[0]  # workers never write into each other's artifacts
    path.mkdir(parents=True, exist_ok=True)
    return path.resolve()


@pytest.fixture(scope="session")
def epd_platform(pytestconfig: pytest.Config):
    from harness.spec.platforms import get_platform

    return get_platform(pytestconfig.getoption("--epd-platform"))


@pytest.fixture(scope="session")
def epd_model(pytestconfig: pytest.Config, epd_platform) -> str:
    """A local model directory (the tiny model by default on CPU) or a GPU host's model name."""
    from harness.cli.main import resolve_model

    given = pytestconfig.getoption("--epd-model") or epd_platform.default_model
    if given and not Path(given).exists() and epd_platform.default_model:
        return given  # a model name the GPU host resolves from its own cache
    return str(resolve_model(given))


@pytest.fixture(scope="session")
def epd_settings(
    pytestconfig: pytest.Config, epd_platform, epd_model: str, epd_run_dir: Path, epd_worker
):
    from harness.cli.main import default_vllm_executable
    from harness.spec.platforms import DEFAULT_CPU_CORES, parse_devices, serving_for
    from harness.serve.session import RunSettings

    given = pytestconfig.getoption("--epd-devices")
    devices = parse_devices(given) if given else DEFAULT_CPU_CORES
    return RunSettings(
        serving=serving_for(epd_platform, epd_model),
        run_dir=epd_run_dir,
        vllm_executable=pytestconfig.getoption("--epd-vllm") or default_vllm_executable(),
        platform=epd_platform,
        devices=worker_share(devices, *epd_worker),
        colocate=pytestconfig.getoption("--epd-colocate"),
    )


SWEEP_KEY = pytest.StashKey[object]()


def baseline_cache(pytestconfig: pytest.Config):
    from harness.run.baseline_cache import BaselineCache
    from harness.cli.main import DEFAULT_CACHE

    given = pytestconfig.getoption("--epd-baseline-cache")
    if given == "off":
        return None
    directory = Path(given) if given else DEFAULT_CACHE / "baseline"
    return BaselineCache(directory, refresh=pytestconfig.getoption("--epd-refresh-baseline"))


@pytest.fixture(scope="session")
def epd_sweep(pytestconfig: pytest.Config, epd_settings):
    """The shared sweep: baseline once, each topology once, judged case by case on demand."""
    from harness.run.matrix import matrix_prompts
    from harness.spec.prompts import SKELETON_PROMPTS
    from harness.run.sweep import Sweep, SweepPlan
    from harness.spec.topology import EPD_TOPOLOGY_NAMES, TOPOLOGIES

    plan = SweepPlan(
        topologies=tuple(TOPOLOGIES[name] for name in EPD_TOPOLOGY_NAMES),
        prompts=SKELETON_PROMPTS,
        baseline_only_prompts=matrix_prompts(),
    )
    started = time.monotonic()

    def on_event(name: str, state: str, elapsed_s: float) -> None:
        print(f"[{time.monotonic() - started:7.1f}s] {name}: {state} ({elapsed_s:.1f}s)")

    sweep = Sweep(plan, epd_settings, on_event=on_event, baseline_cache=baseline_cache(pytestconfig))
    pytestconfig.stash[SWEEP_KEY] = sweep
    return sweep


@pytest.fixture(scope="module")
def epd_matrix(epd_sweep):
    """The scenario matrix on the shared baseline; one topology session open at a time, and
    none left open once the module's scenarios are done (the next module starts its own)."""
    from harness.run.matrix import MatrixRun

    matrix = MatrixRun(epd_sweep)
    yield matrix
    matrix.close()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """The verdict table of whatever the scenarios judged, and where the artifacts are."""
    sweep = config.stash.get(SWEEP_KEY, None)
    if sweep is None:
        return
    from harness.report.text import format_verdict_table

    terminalreporter.section("EPD verdicts")
    terminalreporter.write_line(format_verdict_table(sweep.result.records))
    for stats in sweep.result.instances:
        terminalreporter.write_line(
            f"{stats.name}: ready in {stats.startup_s or 0:.1f}s, "
            f"peak RSS {stats.peak_rss_bytes / 2**30:.2f} GiB"
        )
    terminalreporter.write_line(f"artifacts: {sweep.settings.run_dir}")
