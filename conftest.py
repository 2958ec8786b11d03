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
        "pytest-xdist workers run each topology on the devices `epd-harness plan` gives it",
    )
    group.addoption("--epd-colocate", action="store_true", help="let instances share a device")
    group.addoption(
        "--epd-allow-untested-vllm",
        action="store_true",
        help="run a vLLM outside the tested series (the version gate applies to pytest too)",
    )
    group.addoption(
        "--epd-kv-connector",
        help="KV connector between P and D: example (cpu default) or nixl (GPU default); "
        "see docs/connectors.md",
    )
    group.addoption(
        "--epd-ec-connector",
        help="EC connector between E and its consumer: example (the only one that runs; "
        "cpu and mooncake are refused with their cause); see docs/connectors.md",
    )
    group.addoption(
        "--epd-proxy",
        default="harness",
        help="the EPD proxy under test: harness (default) or vllm (the served release's own, "
        "fetched from its sdist; docs/proxies.md)",
    )
    group.addoption("--epd-vllm-source", help="with --epd-proxy vllm: a vLLM checkout")
    group.addoption(
        "--epd-proxy-registration",
        default="static",
        help="with --epd-proxy vllm: static (URLs on its command line) or dynamic (registered "
        "through its admin API)",
    )
    group.addoption(
        "--epd-launcher",
        default="local",
        help="where instances run: local (default) or ray (Ray actors on a cluster's nodes; "
        "docs/multi-node.md)",
    )
    group.addoption(
        "--epd-ray-address",
        help="with --epd-launcher ray: the cluster's HOST:PORT (default: a one-host cluster "
        "of three nodes, started for the session and stopped after it)",
    )
    group.addoption(
        "--epd-topology",
        help="comma list: run only scenarios of these topologies (names contain '+', so -k "
        "cannot select them)",
    )


# A test without one of these markers is `unit`: pure logic, no torch, no vLLM, no browser.
TIER_MARKERS = ("process", "model", "browser", "e2e")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """With `-m unit` (tox -e fast: no torch, no vLLM installed), a module whose tier marker is
    another one is not even imported: its top-level imports need what the unit tier lacks. Any
    other selection collects everything (a missing dependency then fails loudly)."""
    if config.getoption("markexpr") != "unit" or collection_path.suffix != ".py":
        return None
    text = collection_path.read_text(encoding="utf-8", errors="replace")
    if any(f"pytestmark = pytest.mark.{tier}" in text for tier in TIER_MARKERS):
        return True
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The `unit` tier for unmarked tests, the `--epd-topology` filter, and one xdist group per
    topology (its sessions stay on one worker under `--dist loadgroup`)."""
    wanted = {n.strip() for n in (config.getoption("--epd-topology") or "").split(",") if n.strip()}
    kept, dropped = [], []
    for item in items:
        if not any(item.get_closest_marker(m) for m in TIER_MARKERS):
            item.add_marker(pytest.mark.unit)
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


@pytest.fixture(scope="session")
def epd_worker(request: pytest.FixtureRequest) -> tuple[str, int]:
    """(xdist worker id, worker count); ("main", 1) without xdist."""
    worker_id = getattr(request.config, "workerinput", {}).get("workerid", "main")
    return worker_id, int(getattr(request.config, "workerinput", {}).get("workercount", 1))


@pytest.fixture(scope="session")
def epd_config(pytestconfig: pytest.Config, epd_worker: tuple[str, int]):
    """The run, checked and assembled exactly as `epd-harness run` does (the same preflight:
    names, model, served-vLLM version gate, ports, token counts)."""
    from harness.errors import BadInput
    from harness.preflight import RunRequest, prepare_run

    given_dir = pytestconfig.getoption("--epd-run-dir")
    run_dir = given_dir or str(
        Path(pytestconfig.rootpath) / "runs" / f"pytest-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    request = RunRequest(
        model=pytestconfig.getoption("--epd-model"),
        run_dir=run_dir,
        vllm=pytestconfig.getoption("--epd-vllm"),
        allow_untested_vllm=pytestconfig.getoption("--epd-allow-untested-vllm"),
        devices=pytestconfig.getoption("--epd-devices"),
        baseline_cache=pytestconfig.getoption("--epd-baseline-cache"),
        refresh_baseline=pytestconfig.getoption("--epd-refresh-baseline"),
        platform=pytestconfig.getoption("--epd-platform"),
        colocate=pytestconfig.getoption("--epd-colocate"),
        worker_id=epd_worker[0],
        workers=epd_worker[1],
        kv_connector=pytestconfig.getoption("--epd-kv-connector"),
        ec_connector=pytestconfig.getoption("--epd-ec-connector"),
        proxy=pytestconfig.getoption("--epd-proxy"),
        vllm_source=pytestconfig.getoption("--epd-vllm-source"),
        proxy_registration=pytestconfig.getoption("--epd-proxy-registration"),
        launcher=pytestconfig.getoption("--epd-launcher"),
        ray_address=pytestconfig.getoption("--epd-ray-address"),
    )
    try:
        return prepare_run(request)
    except BadInput as exc:
        pytest.fail(f"epd-harness: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def epd_settings(epd_config):
    return epd_config.settings


@pytest.fixture(scope="session")
def epd_run_dir(epd_settings) -> Path:
    return epd_settings.run_dir


SWEEP_KEY = pytest.StashKey[object]()


@pytest.fixture(scope="session")
def epd_sweep(pytestconfig: pytest.Config, epd_config):
    """The shared sweep: baseline once, each wave once, judged case by case on demand."""
    from harness.run.scenarios import matrix_prompts
    from harness.run.sweep import Sweep, SweepSpec
    from harness.spec.prompts import SKELETON_PROMPTS
    from harness.spec.topology import EPD_TOPOLOGY_NAMES, TOPOLOGIES

    spec = SweepSpec(
        topologies=tuple(TOPOLOGIES[name] for name in EPD_TOPOLOGY_NAMES),
        prompts=SKELETON_PROMPTS,
        baseline_only_prompts=matrix_prompts(),
    )
    started = time.monotonic()

    def on_event(name: str, state: str, elapsed_s: float) -> None:
        print(f"[{time.monotonic() - started:7.1f}s] {name}: {state} ({elapsed_s:.1f}s)")

    sweep = Sweep(
        spec, epd_config.settings, on_event=on_event, baseline_cache=epd_config.baseline_cache
    )
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


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """End what a launcher holds beyond its topologies (with --epd-launcher ray: the Ray
    connection and the rehearsal cluster the session started)."""
    from harness.serve.launcher import end_launchers

    end_launchers()


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
