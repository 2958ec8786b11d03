"""The e2e scenarios' fixtures: the run as `epd-harness run` prepares it (`epd_config`), the
session's pool of running topologies (`epd_pool`), the shared sweep (`epd_sweep`), a running
topology to send to and judge (`epd_live`), what an item's own CLI commands are given
(`epd_own_instances`), and a load's spec (`epd_load_spec`).

A fixture that keeps state across a topology's items (a sweep, a table of results) must be
session-scoped: one module's items can fall into several groups, and pytest builds a
module-scoped fixture again each time the module comes back.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from harness.testing.before_stop import (
    calibrate_loads_before,
    make_later_sweeps_before,
    marked_load,
)
from harness.testing.collection import PROMPTS_KEY, SESSION_TOPOLOGIES_KEY
from harness.testing.groups import EpdGroup, epd_group
from harness.testing.pool_hooks import POOL_KEY, begin_item
from harness.testing.session_account import RUN_ROOT_KEY, SWEEP_KEY
from harness.testing.session_options import session_option_values, session_request

if TYPE_CHECKING:
    from harness.run.sweep import SweepSpec
    from harness.spec.prompts import PromptSpec


@pytest.fixture(scope="session")
def epd_worker(request: pytest.FixtureRequest) -> tuple[str, int]:
    """(xdist worker id, worker count); ("main", 1) without xdist."""
    workerinput = getattr(request.config, "workerinput", {})
    return workerinput.get("workerid", "main"), int(workerinput.get("workercount", 1))


@pytest.fixture(scope="session")
def epd_config(
    request: pytest.FixtureRequest, pytestconfig: pytest.Config, epd_worker: tuple[str, int]
):
    """The run, checked and assembled exactly as `epd-harness run` does (the same preflight:
    names, model, served-vLLM version gate, ports, token counts). What it refuses fails the
    item that asked first and stops the session: every e2e item would fail the same way."""
    from harness.errors import BadInput
    from harness.preflight import prepare_run
    from harness.testing.own_instances import in_session_terms

    run = session_request(
        pytestconfig.getoption,
        pytestconfig.stash[RUN_ROOT_KEY],
        epd_worker,
        served=pytestconfig.stash.get(SESSION_TOPOLOGIES_KEY, ()),
    )
    try:
        return prepare_run(run)
    except BadInput as exc:
        message = f"epd-harness: {in_session_terms(str(exc))}"
    # Outside the handler: pytest shows a failure raised inside it after the CLI's own message
    # ("During handling of the above exception"), its flags not the session's.
    request.session.shouldstop = message
    pytest.fail(message, pytrace=False)


@pytest.fixture(scope="session")
def epd_settings(epd_config):
    return epd_config.settings


@pytest.fixture(scope="session")
def epd_run_dir(epd_settings) -> Path:
    return epd_settings.run_dir


@pytest.fixture(scope="session")
def epd_events():
    """Progress lines for server state changes, with the time since the session began."""
    started = time.monotonic()

    def on_event(name: str, state: str, elapsed_s: float) -> None:
        print(f"[{time.monotonic() - started:7.1f}s] {name}: {state} ({elapsed_s:.1f}s)")

    return on_event


@pytest.fixture(scope="session")
def epd_pool(pytestconfig: pytest.Config, epd_settings, epd_events):
    """Every running topology of this pytest process; what it started is written to the run
    directory at the end, for the session's summary."""
    from harness.run.pool import TopologyPool

    pool = TopologyPool(epd_settings, epd_events)
    begin_item(pytestconfig, pool)  # made in the first item's setup, after pytest_runtest_setup
    pytestconfig.stash[POOL_KEY] = pool
    try:
        yield pool
    finally:
        pool.close()
        pool.write_starts(epd_settings.run_dir)


@pytest.fixture(scope="session")
def epd_sweep(pytestconfig: pytest.Config, epd_config, epd_pool, epd_events):
    """The shared sweep: its baseline answers the prompts of every selected scenario module
    (their `EPD_BASELINE_PROMPTS`: one baseline start for all), its cases are judged on
    demand, each topology served once from the pool. Its plan holds the topologies the
    selected items run and the references they are judged against, no more (`--epd-topology`
    shrinks it), and those the sweep does not judge (the matrix's 2E+1PD) have their place
    too: with none, one leased every device."""
    from harness.run.sweep import Sweep
    from harness.spec.topology import EPD_TOPOLOGY_NAMES

    spec = session_sweep_spec(
        pytestconfig.stash.get(SESSION_TOPOLOGIES_KEY, EPD_TOPOLOGY_NAMES),
        pytestconfig.stash.get(PROMPTS_KEY, ()),
    )
    sweep = Sweep(
        spec,
        epd_config.settings,
        on_event=epd_events,
        baseline_cache=epd_config.baseline_cache,
        pool=epd_pool,
    )
    pytestconfig.stash[SWEEP_KEY] = sweep
    epd_pool.before_stop(make_later_sweeps_before(pytestconfig, sweep, epd_events))
    epd_pool.before_stop(calibrate_loads_before(pytestconfig, sweep))
    # The plan, placed in the pool now: a scenario that asks the pool for its topology
    # directly (a load's, a live one's) may come before any that the sweep serves.
    sweep.schedule()
    return sweep


def session_sweep_spec(
    selected: Sequence[str], baseline_prompts: Sequence[PromptSpec]
) -> SweepSpec:
    """The session sweep's spec: the sweep's topologies among those the selected items run
    (`SESSION_TOPOLOGIES_KEY`), the others they run placed only (2E+1PD), the skeleton prompts
    and, for the baseline alone, the modules' other prompts."""
    from harness.run.sweep import SweepSpec
    from harness.spec.prompts import SKELETON_PROMPTS
    from harness.spec.topology import EPD_TOPOLOGY_NAMES, TOPOLOGIES

    sweep_names = {p.name for p in SKELETON_PROMPTS}
    others = [p for p in baseline_prompts if p.name not in sweep_names]
    placed = [n for n in TOPOLOGIES if n in selected and n not in EPD_TOPOLOGY_NAMES]
    return SweepSpec(
        topologies=tuple(TOPOLOGIES[name] for name in EPD_TOPOLOGY_NAMES if name in selected),
        prompts=SKELETON_PROMPTS,
        baseline_only_prompts=tuple(others),
        placed_only=tuple(TOPOLOGIES[name] for name in placed if name != "baseline"),
    )


@pytest.fixture(scope="session")
def epd_matrix(epd_sweep):
    """The scenario matrix on the shared baseline and pool."""
    from harness.run.matrix import MatrixRun

    return MatrixRun(epd_sweep)


@pytest.fixture(scope="session")
def epd_live(epd_sweep, epd_pool, epd_settings):
    """`epd_live("1E+1PD")` (or with ServingConfig overrides, e.g. kv_connector=..., and an
    environment added to a role's instances, `role_env`): the session's running topology,
    started on first use, judged by the shared sweep."""
    from harness.spec.topology import TOPOLOGIES
    from harness.testing.live import LiveTopology

    def live(name: str, role_env=None, **serving: object) -> LiveTopology:
        epd_sweep.serve_baseline()  # before any topology of ours: never two starts at once
        settings = epd_settings
        if serving:
            settings = dataclasses.replace(
                settings, serving=dataclasses.replace(settings.serving, **serving)
            )
        session = epd_pool.session(TOPOLOGIES[name], settings, role_env=role_env)
        return LiveTopology(session, epd_sweep)

    return live


@pytest.fixture
def epd_own_instances(request: pytest.FixtureRequest, epd_config, epd_sweep, epd_pool):
    """For an item marked `own_instances(*commands)`: what those commands must be given to
    serve what the session serves, where its plan lets this item (`OwnInstances`: `args(cmd)`,
    `devices`, `held_devices()`). Its worker's pool is stopped first: the CLI runs in this
    process, and a device lease this process holds through the pool would be waited for by
    the CLI's own for ever (flock). The item runs after every other e2e item of its xdist
    group (`pytest_collection_modifyitems`), so nothing stopped here is needed again."""
    from harness.testing.own_instances import OwnInstances, commands_of

    item = request.node
    marker = item.get_closest_marker("own_instances")
    if marker is None:
        pytest.fail(
            f"{item.nodeid}: epd_own_instances is for items marked own_instances(...), which "
            "run after every item that uses the pool",
            pytrace=False,
        )
    settings = epd_config.settings
    epd_pool.release()
    given = bool(request.config.getoption("--epd-devices", None))
    devices = own_devices(epd_sweep, epd_group(item), settings, given)
    cache = None
    if request.config.getoption("--epd-baseline-cache", None):
        resolved = epd_config.baseline_cache
        cache = str(resolved.directory) if resolved is not None else "off"
    return OwnInstances(
        values=session_option_values(request.config),
        commands=commands_of(marker.args, item.nodeid),
        platform=settings.platform.name,
        exclusive_devices=settings.platform.exclusive_devices,
        devices=devices,
        baseline_cache=cache,
    )


def own_devices(
    sweep, group: EpdGroup | None, settings, devices_given: bool
) -> tuple[int, ...] | None:
    """The devices an `own_instances` item's commands may use. On GPUs: the slots the session's
    plan gives the topologies of its xdist group, and the baseline's, in the session's device
    order; no other worker serves a topology there, and a worker that holds the baseline's
    device waits for nothing of this group's (so no two workers wait on each other). On CPU:
    the session's cores, as given (None: the CLI's default, the session's too)."""
    if not settings.platform.exclusive_devices:
        return tuple(settings.devices) if devices_given else None
    assert group is not None, "own_instances items are e2e items"
    slots = {s.topology.name: s.devices for w in sweep.schedule().waves for s in w.slots}
    root = group.xdist_name()
    mine = {
        name
        for name in slots
        if name == "baseline" or EpdGroup(name, group.variant).xdist_name() == root
    }
    if mine <= {"baseline"}:
        pytest.fail(
            f"the session's plan places no topology of {root}'s group "
            f"({', '.join(f'{n}: {d}' for n, d in slots.items())})",
            pytrace=False,
        )
    used = {device for name in mine for device in slots[name]}
    return tuple(device for device in settings.devices if device in used)


@pytest.fixture
def epd_load_spec(request: pytest.FixtureRequest):
    """The LoadSpec of the test's own `epd_load(spec)` mark: the one place a load scenario
    names its load, which the session also reads to calibrate the load ahead. Under
    `--epd-stream` every load streams: the unstreamed loads ran unstreamed, the option
    silently dropped for them (found in an audit of ignored flags)."""
    spec = marked_load(request.node)
    if spec is None:  # refused at collection too (`load_specs`)
        pytest.fail(
            f"{request.node.nodeid}: it takes epd_load_spec, so it must be marked "
            "epd_load(LoadSpec(...))",
            pytrace=False,
        )
    if request.config.getoption("--epd-stream", default=False):
        return dataclasses.replace(spec, stream=True)
    return spec
