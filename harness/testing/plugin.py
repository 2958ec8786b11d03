"""The pytest plugin of the harness's scenarios: session-wide fixtures, and one start per topology.

A topology start is the whole cost of an e2e session on CPU, so every scenario gets its
topology from one pool per pytest process (`harness.run.pool`), and the e2e items are ordered
so that each (topology, variant) group runs in one stretch: the baseline's first, then each
topology in the plan's order (exact references before the topologies judged against them), then
variants (another KV connector). Items reaching a topology through another proxy (vLLM's own)
share its instances and run right after its group. When a group ends its topology is stopped
(memory, and NIXL's spinning progress threads), after every sweep that will need its answers as
an exact reference has had them (`TopologyPool.before_stop`); where a class ends, the variants its
fixtures started with environment added to a role (`TopologyPool.release_variants`). Items that
end their session (an expected instance death, a rerun on kept storage, a kill) run last in their
group. Under xdist, one worker takes a group and the groups its cases reference (`xdist_group`),
so no two workers start the same topology; on a CPU host one worker takes every e2e item
(`shares_one_host`).

The harness's own tests get their helpers here too: `epd_cli` (the CLI in-process),
`fake_vllm` (the fake `vllm` executable) and `port_locks` (port leases of one test); the
record builders, the in-process fake instance and the process watchers are plain modules of
this package (builders, fake_instance, processes).

A fixture that keeps state across a topology's items (a sweep, a table of results) must be
session-scoped: one module's items can fall into several groups, and pytest builds a
module-scoped fixture again each time the module comes back.

Markers: `epd_topology(name)` for items whose topology is not a `topology`/`scenario` parameter,
`epd_variant(name)` for items that run under other settings, `epd_ends_session` for items that
stop or break their session, `epd_load(spec)` for items that run a load (the fixture
`epd_load_spec` hands the test its mark's spec). Options are in the repository's conftest.py.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from harness.preflight import RunRequest
    from harness.run.sweep import SweepSpec
    from harness.spec.prompts import PromptSpec

TOPOLOGY_ORDER = ("baseline", "1E+1PD", "2E+1PD", "1P+1D", "1E+1P+1D")
DEFAULT_VARIANT = ""
POOL_KEY = pytest.StashKey[object]()
SWEEP_KEY = pytest.StashKey[object]()
PROMPTS_KEY = pytest.StashKey[tuple]()
# The topologies the session's selected e2e items run (their groups'), in collection order.
SESSION_TOPOLOGIES_KEY = pytest.StashKey[tuple]()
KV_CONNECTOR_DESELECTED = pytest.StashKey[list]()
PLATFORM_DESELECTED = pytest.StashKey[dict]()  # why -> the node ids deselected for it
# A scenario module lists the prompts its tests send (besides the sweep's) under this name.
BASELINE_PROMPTS = "EPD_BASELINE_PROMPTS"
# A scenario module whose session-scoped sweeps judge a topology against its exact reference
# names here the function that makes them, `(config, epd_sweep, epd_events) -> sweeps`: the
# plugin makes them when the reference is about to stop, if nothing has yet (`later_sweeps`).
LATER_SWEEPS = "EPD_LATER_SWEEPS"
# module name -> (its LATER_SWEEPS function, the references its selected items are judged
# against); module name -> what that function made (or raised), once per session.
LATER_SWEEP_MAKERS_KEY = pytest.StashKey[dict]()
LATER_SWEEPS_KEY = pytest.StashKey[dict]()
# Node id -> the LoadSpec of every selected item marked `epd_load(spec)`; the node id of the
# item running now (what is still to come is read from the queue after it).
LOAD_SPECS_KEY = pytest.StashKey[dict]()
CURRENT_ITEM_KEY = pytest.StashKey[str]()
RUN_ROOT_KEY = pytest.StashKey[str]()
E2E_QUEUE_KEY = pytest.StashKey["E2eQueue"]()
# Instances (topology, variant) a group's end left running for a later item of its xdist group.
KEPT_FOR_LATER_KEY = pytest.StashKey[set]()
WORKER_RUN_ROOT = "epd_run_root"  # how xdist hands the controller's run root to workers
WORKER_USAGE_ERROR = "epd_usage_error"  # how a worker hands its collection's refusal back
# Under the run root: what every process of one session shares (`RunRequest.session_dir`: the
# baseline refresh's record, `--epd-baseline-cache off`'s shared baseline). The controller
# empties it as the session begins, so nothing in it is an earlier session's.
SESSION_SHARED_DIR = "session-shared"


@dataclasses.dataclass(frozen=True)
class EpdGroup:
    """The running topology an e2e item needs: its name, the variant of its instances (another
    KV connector: other instances), and the proxy it goes through (same instances)."""

    topology: str
    variant: str = DEFAULT_VARIANT
    proxy: str = ""  # "" for the run's own proxy

    @property
    def instances(self) -> tuple[str, str]:
        """What decides which instances run: items sharing it share one start."""
        return (self.topology, self.variant)

    def order(self) -> tuple:
        """Default instances first, then variants; within them, the plan's topology order."""
        rank = TOPOLOGY_ORDER.index(self.topology) if self.topology in TOPOLOGY_ORDER else 99
        return (self.variant != DEFAULT_VARIANT, self.variant, rank, self.topology)

    def xdist_name(self) -> str:
        """A topology and the references its cases are judged against share a worker, through
        whichever proxy."""
        from harness.spec.topology import TOPOLOGIES

        root = self.topology
        while root in TOPOLOGIES and TOPOLOGIES[root].exact_reference:
            root = TOPOLOGIES[root].exact_reference
        return f"{self.variant}:{root}" if self.variant else root


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "epd_topology(name): the running topology an e2e item needs (harness.testing)"
    )
    config.addinivalue_line(
        "markers", "epd_variant(name): the item runs its topology's instances under other settings"
    )
    config.addinivalue_line(
        "markers", "epd_proxy(name): the item reaches its topology through another proxy"
    )
    config.addinivalue_line(
        "markers", "epd_ends_session: the item stops or breaks its session: run it last"
    )
    config.addinivalue_line(
        "markers",
        "epd_load(spec): the item runs this load (harness.spec.load.LoadSpec) on the session's "
        "pool: its batch calibration is measured while the session's baseline serves",
    )
    config.addinivalue_line(
        "markers",
        f"{WALL_CLOCK_BOUND}(on_e2e_worker=False): the item is under a wall-clock bound (a "
        "death noticed within a second, a Ray node registered within Ray's 30 s): it runs "
        "before any topology starts; on a CPU host under xdist first on a worker of its own, or "
        "with on_e2e_worker=True first on the e2e items' worker",
    )
    config.addinivalue_line(
        "markers",
        "kv_connector(*names): the item applies only to sessions running one of these KV "
        "connectors (example, nixl); deselected and listed otherwise",
    )
    config.addinivalue_line(
        "markers",
        "one_host_rehearsal(unless_ray_address=False): the item starts the one-host Ray "
        "rehearsal cluster (with unless_ray_address=True: only without --epd-ray-address), "
        "which runs on the cpu platform only; deselected and listed on another",
    )
    config.addinivalue_line(
        "markers",
        "own_instances(*commands): the item runs these epd-harness commands (run, repro, fuzz, "
        "export), which start topologies of their own: given the session's options and its "
        "group's devices (fixture epd_own_instances), run after every other e2e item of its "
        "xdist group with its worker's pool stopped; deselected and listed where a session "
        "option cannot reach a command",
    )
    config.addinivalue_line(
        "markers",
        "reads_vllm_source: the item runs vLLM's own files whatever --epd-proxy says, from "
        "--epd-vllm-source when given (harness.testing.vllm_source: a session given the flag "
        "where no selected item reads it is refused)",
    )
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        config.stash[RUN_ROOT_KEY] = workerinput.get(WORKER_RUN_ROOT)
    else:
        given = config.getoption("--epd-run-dir", None)
        config.stash[RUN_ROOT_KEY] = given or str(
            Path(config.rootpath) / "runs" / f"pytest-{time.strftime('%Y%m%d-%H%M%S')}"
        )
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


def pytest_configure_node(node) -> None:  # xdist: every worker writes under the same root
    node.workerinput[WORKER_RUN_ROOT] = node.config.stash[RUN_ROOT_KEY]


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session):
    """Under xdist a worker's collection refused (pytest.UsageError) ended that worker, its
    message on a stderr nobody reads, and the controller stopped on "Unexpectedly no active
    workers available": the worker hands the message back (xdist's `workeroutput`), and the
    controller raises it as its own (`pytest_testnodedown`)."""
    try:
        return (yield)
    except pytest.UsageError as exc:
        workeroutput = getattr(session.config, "workeroutput", None)
        if workeroutput is not None:
            workeroutput[WORKER_USAGE_ERROR] = str(exc)
        raise


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # xdist, on the controller
    message = (getattr(node, "workeroutput", None) or {}).get(WORKER_USAGE_ERROR)
    if message:
        raise pytest.UsageError(message)


def epd_group(item: pytest.Item) -> EpdGroup | None:
    """The group of an e2e item (None for every other tier)."""
    if item.get_closest_marker("e2e") is None:
        return None
    variant_marker = item.get_closest_marker("epd_variant")
    variant = variant_marker.args[0] if variant_marker else DEFAULT_VARIANT
    if variant in (session_kv_connector(item.config), session_launcher(item.config)):
        # A variant naming the session's own KV connector (NIXL on cuda), or its own launcher
        # (`ray` under `--epd-launcher ray`), asks for the very instances the default group
        # runs: in a group of its own they would start twice (found in review: the 3B P+D
        # again every GPU night; 1E+1P+1D again for scenarios/test_ray.py's first item).
        variant = DEFAULT_VARIANT
    proxy_marker = item.get_closest_marker("epd_proxy")
    proxy = proxy_marker.args[0] if proxy_marker else ""
    marker = item.get_closest_marker("epd_topology")
    params = getattr(getattr(item, "callspec", None), "params", {})
    topology = params.get("topology")
    scenario = params.get("scenario")
    if marker is not None:
        name = marker.args[0]
    elif isinstance(topology, str):
        name = topology
    elif scenario is not None and hasattr(scenario, "topology"):
        name = scenario.topology
    else:
        name = "baseline"
    return EpdGroup(name, variant, proxy)


def owns_instances(item: pytest.Item) -> bool:
    """Whether the item starts topologies of its own through the CLI (`own_instances`): it
    needs nothing of the pool, and runs after every item that does."""
    return item.get_closest_marker("own_instances") is not None


def ends_session(item: pytest.Item) -> bool:
    scenario = getattr(getattr(item, "callspec", None), "params", {}).get("scenario")
    return item.get_closest_marker("epd_ends_session") is not None or bool(
        getattr(scenario, "ends_its_session", False)
    )


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`--epd-topology` keeps the e2e items of those topologies, a `kv_connector(...)` marker
    keeps an item only for a session that runs one of those connectors (listed, never
    silently); then the wall-clock bounds, every other tier in collection order, and the e2e
    items by group."""
    wanted = wanted_topologies(config)
    connector = session_kv_connector(config)
    dropped, other_connector = [], []
    not_here: dict[str, list[str]] = {}
    for item in items:
        group = epd_group(item)
        if owns_instances(item) and "epd_own_instances" not in item.fixturenames:
            raise pytest.UsageError(
                f"{item.nodeid}: marked own_instances, it must take the epd_own_instances "
                "fixture (the session's options and devices for its commands; its worker's "
                "pool stopped first)"
            )
        needs = item.get_closest_marker("kv_connector")
        refusal = platform_refusal(config, item)
        if connector is not None and needs is not None and connector not in needs.args:
            other_connector.append(f"{item.nodeid} (needs {', '.join(needs.args)})")
            dropped.append(item)
        elif refusal is not None:
            not_here.setdefault(refusal, []).append(item.nodeid)
            dropped.append(item)
        elif wanted and group is not None and group.topology not in wanted:
            dropped.append(item)
    config.stash[KV_CONNECTOR_DESELECTED] = other_connector
    config.stash[PLATFORM_DESELECTED] = not_here
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [i for i in items if i not in dropped]
    position = {id(item): n for n, item in enumerate(items)}

    def key(item: pytest.Item) -> tuple:
        """The wall-clock bounds, every other tier, then the e2e items (within one running
        topology: every proxy's items, then those that end it), those with instances of their
        own after every other: before them their worker's pool is stopped, so nothing it
        serves would be left for a later item."""
        group = epd_group(item)
        if group is None:
            tier = 0 if item.get_closest_marker(WALL_CLOCK_BOUND) else 1
            return (tier, False, (), False, "", position[id(item)])
        own = owns_instances(item)
        return (2, own, group.order(), ends_session(item), group.proxy, position[id(item)])

    items.sort(key=key)
    config.stash[E2E_QUEUE_KEY] = E2eQueue.of(items)
    groups = (epd_group(item) for item in items)
    config.stash[SESSION_TOPOLOGIES_KEY] = tuple(
        dict.fromkeys(group.topology for group in groups if group is not None)
    )
    # The prompts the selected scenario modules need the baseline to answer: one baseline
    # start answers all of them.
    needed: dict[str, object] = {}
    for module in dict.fromkeys(getattr(item, "module", None) for item in items):
        for prompt in getattr(module, BASELINE_PROMPTS, ()):
            needed.setdefault(prompt.name, prompt)
    config.stash[PROMPTS_KEY] = tuple(needed.values())
    config.stash[LATER_SWEEP_MAKERS_KEY] = later_sweep_makers(items)
    config.stash[LOAD_SPECS_KEY] = load_specs(items)


@pytest.hookimpl(tryfirst=True)  # before --collect-only lists what it refuses
def pytest_collection_finish(session: pytest.Session) -> None:
    """The session's options are checked once when a selected item serves them, and
    `--epd-vllm-source` given where no selected item reads it is refused, once every
    deselection (-k, -m, `--epd-topology`, the session's refusals) is done."""
    from harness.testing.vllm_source import OPTION, given_on_the_command_line, refusal

    config = session.config
    if any("epd_config" in getattr(item, "fixturenames", ()) for item in session.items):
        # Once, before any item: a bad value failed every e2e item, each with the same error.
        check_session_options(config.getoption)
    given = given_on_the_command_line(config.invocation_params.args)
    source = config.getoption(OPTION, None) if given else None
    why = refusal(source, config.getoption("--epd-proxy", None), session.items)
    if why:
        raise pytest.UsageError(why)


def marked_load(item: pytest.Item) -> Any:
    """The LoadSpec of the item's `epd_load(spec)` mark, None without one; a mark without one
    LoadSpec is a usage error."""
    from harness.spec.load import LoadSpec

    marker = item.get_closest_marker("epd_load")
    if marker is None:
        return None
    spec = marker.args[0] if len(marker.args) == 1 and not marker.kwargs else None
    if not isinstance(spec, LoadSpec):
        raise pytest.UsageError(f"{item.nodeid}: epd_load takes one LoadSpec")
    return spec


def load_specs(items: list[pytest.Item]) -> dict[str, Any]:
    """The LoadSpec of each item marked `epd_load(spec)`, by node id; a mark without one, or
    whose topology is not the item's, is a usage error (its calibration would be of another
    load's requests, or of none), and so is an item that takes `epd_load_spec` unmarked."""
    specs = {}
    for item in items:
        spec = marked_load(item)
        if spec is None:
            if "epd_load_spec" in getattr(item, "fixturenames", ()):
                raise pytest.UsageError(
                    f"{item.nodeid}: it takes epd_load_spec, so it must be marked "
                    "epd_load(LoadSpec(...)): the mark is where its load is named"
                )
            continue
        group = epd_group(item)
        if group is None or group.topology != spec.topology:
            raise pytest.UsageError(
                f"{item.nodeid}: epd_load's load runs on {spec.topology}, the item on "
                f"{group.topology if group else 'no topology (not e2e)'}"
            )
        specs[item.nodeid] = spec
    return specs


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """The item running now, from its fixtures' setup on (one may stop the baseline); the
    pool's sessions it asks for are in use until the next item (`TopologyPool.item_begins`)."""
    item.config.stash[CURRENT_ITEM_KEY] = item.nodeid
    pool = item.config.stash.get(POOL_KEY, None)
    if pool is not None:
        begin_item(item.config, pool)


def begin_item(config: pytest.Config, pool: Any) -> None:
    """Tell the pool an item begins, and which topologies it and the later items of its
    xdist group need: those it keeps for them, whoever waits for their devices."""
    queue = config.stash.get(E2E_QUEUE_KEY, None)
    current = config.stash.get(CURRENT_ITEM_KEY, None)
    needed = queue.needed_from(current) if queue is not None and current is not None else set()
    pool.item_begins({topology for topology, _ in needed})


def loads_to_come(config: pytest.Config, workers: int) -> list[Any]:
    """The LoadSpecs of the selected loads from the item running now on, in the order they
    run. Under several xdist workers only its xdist group's: which groups a worker gets next
    is not known here, and another worker's loads are measured in its own process."""
    queue = config.stash.get(E2E_QUEUE_KEY, None)
    specs = config.stash.get(LOAD_SPECS_KEY, {})
    current = config.stash.get(CURRENT_ITEM_KEY, None)
    if queue is None or current is None or not specs:
        return []
    return [specs[node] for node in queue.from_item(current, workers > 1) if node in specs]


def calibrate_loads_before(config: pytest.Config, sweep) -> Callable:
    """The pool's before-stop callback that, as the session's baseline is about to stop,
    measures the batch calibrations of the loads still to come (`calibrate_ahead`), so that
    none serves the baseline again for its own. Where every device the baseline could take is
    a topology's (2 GPUs, 1), each load stopped its topology to serve the baseline, then
    started the topology again: on the GitHub nightly's small rows 1E+1P+1D six times and the
    baseline eight (seen with the fake vLLM). A calibration that fails here is left to its
    load to measure (and fail there, where it is judged); the stop goes on."""

    def before_stop(session) -> None:
        if (
            not session.topology.is_baseline
            or session.settings.serving != sweep.settings.serving
            or session.settings.launcher != sweep.settings.launcher
        ):
            return
        specs = loads_to_come(config, sweep.settings.workers)
        if not specs:
            return
        from harness.run.load import calibrate_ahead

        try:
            calibrate_ahead(specs, sweep.baseline, sweep.settings.serving, session, say=print)
        except Exception as exc:  # noqa: BLE001 - each load measures its own instead
            print(f"[load] calibrating ahead of the loads failed ({exc}); each measures its own")

    return before_stop


def later_sweep_makers(items: list[pytest.Item]) -> dict[str, tuple[Callable, frozenset]]:
    """Each selected module's `EPD_LATER_SWEEPS`, with the exact references its items'
    topologies are judged against (those at whose stop its sweeps must exist)."""
    from harness.spec.topology import TOPOLOGIES

    references: dict[str, set[str]] = {}
    makers: dict[str, Callable] = {}
    for item in items:
        module = getattr(item, "module", None)
        maker = getattr(module, LATER_SWEEPS, None)
        group = epd_group(item)
        if module is None or maker is None or group is None:
            continue
        makers[module.__name__] = maker
        topology = TOPOLOGIES.get(group.topology)
        if topology is not None and topology.exact_reference:
            references.setdefault(module.__name__, set()).add(topology.exact_reference)
    return {name: (maker, frozenset(references.get(name, ()))) for name, maker in makers.items()}


def later_sweeps(config: pytest.Config, module_name: str, epd_sweep, epd_events) -> Any:
    """What the module's `EPD_LATER_SWEEPS` made, made now if nothing has yet; what making
    them raised is raised again, to the module's own items."""
    made = config.stash.setdefault(LATER_SWEEPS_KEY, {})
    if module_name not in made:
        maker, _ = config.stash.get(LATER_SWEEP_MAKERS_KEY, {})[module_name]
        made[module_name] = maker(config, epd_sweep, epd_events)
    if isinstance(made[module_name], BaseException):
        raise made[module_name]
    return made[module_name]


def make_later_sweeps_before(config: pytest.Config, epd_sweep, epd_events) -> Callable:
    """The pool's before-stop callback that makes a module's later sweeps when a reference
    they need is about to stop, so that they answer their prompts on it now. Made at their
    module's first item, they came too late where the reference and its topology cannot serve
    side by side (GPUs up to 5): 1E+1P+1D's first start had stopped 1P+1D, and vLLM's proxy
    module started 1P+1D again, then 1E+1P+1D again (seen with the fake vLLM on 2 and 4
    devices). What making them raises is kept for their own items (`later_sweeps`)."""

    def before_stop(session) -> None:
        made = config.stash.setdefault(LATER_SWEEPS_KEY, {})
        for name, (maker, references) in config.stash.get(LATER_SWEEP_MAKERS_KEY, {}).items():
            if name in made or session.topology.name not in references:
                continue
            try:
                made[name] = maker(config, epd_sweep, epd_events)
            except (Exception, pytest.fail.Exception) as exc:  # noqa: BLE001 - raised to its items
                made[name] = exc

    return before_stop


def wanted_topologies(config: pytest.Config) -> set[str]:
    """The topologies `--epd-topology` names (empty: every one). A name the harness does not
    know is refused here, as `epd-harness run --topology` refuses it: kept, it would match no
    item, and the topologies the user meant would be dropped as deselected while the session
    passes (found in review: `1P+1D,1E+1P+1d` ran only 1P+1D and exited 0)."""
    return topology_option(config.getoption("--epd-topology", None))


def topology_option(value: str | None) -> set[str]:
    """`--epd-topology`'s names, each one the harness knows (pytest.UsageError otherwise)."""
    from harness.errors import BadInput
    from harness.preflight.names import check_topologies, split_names

    names = split_names([value or ""])
    if value is not None and not names:  # as if not given: every topology, the choice dropped
        raise pytest.UsageError(
            f"--epd-topology {value!r} names no topology: name one, or leave --epd-topology out"
        )
    try:
        check_topologies(names)
    except BadInput as exc:
        raise pytest.UsageError(f"--epd-topology: {exc}") from None
    return set(names)


@dataclasses.dataclass(frozen=True)
class E2eQueue:
    """The e2e items in the order they run, each with its xdist group and its group: what the
    items after one still need running. An xdist group runs on one worker in this order, and an
    exact reference is always in its topology's xdist group (`EpdGroup.xdist_name`), so the
    later items of an item's xdist group are those that can still need what it ran."""

    order: tuple[tuple[str, str, EpdGroup], ...]  # (node id, xdist group, group)

    @classmethod
    def of(cls, items: list[pytest.Item]) -> E2eQueue:
        order = []
        for item in items:
            group = epd_group(item)
            marker = item.get_closest_marker("xdist_group")
            if group is not None and not owns_instances(item):  # it needs nothing running
                order.append((item.nodeid, marker.args[0] if marker else "", group))
        return cls(tuple(order))

    def from_item(self, nodeid: str, same_xdist_group: bool) -> list[str]:
        """The node ids from `nodeid` on, itself first, in the order they run (only its xdist
        group's with `same_xdist_group`); none when `nodeid` is not an e2e item of the pool."""
        position = next((n for n, (node, _, _) in enumerate(self.order) if node == nodeid), None)
        if position is None:
            return []
        xdist_group = self.order[position][1]
        return [
            node
            for node, later_xdist_group, _ in self.order[position:]
            if not same_xdist_group or later_xdist_group == xdist_group
        ]

    def needed_after(self, nodeid: str) -> set[tuple[str, str]]:
        """The instances (topology, variant) that the items after `nodeid` in its xdist group
        need running: their own, and their topology's exact reference."""
        return self._needed(nodeid, 1)

    def needed_from(self, nodeid: str) -> set[tuple[str, str]]:
        """`needed_after`, with what `nodeid` itself needs."""
        return self._needed(nodeid, 0)

    def _needed(self, nodeid: str, skip: int) -> set[tuple[str, str]]:
        from harness.spec.topology import TOPOLOGIES

        position = next((n for n, (node, _, _) in enumerate(self.order) if node == nodeid), None)
        if position is None:
            return set()
        xdist_group = self.order[position][1]
        needed: set[tuple[str, str]] = set()
        for _, later_xdist_group, group in self.order[position + skip :]:
            if later_xdist_group != xdist_group:
                continue
            needed.add(group.instances)
            topology = TOPOLOGIES.get(group.topology)
            if topology is not None and topology.exact_reference:
                needed.add((topology.exact_reference, group.variant))
        return needed


def session_kv_connector(config: pytest.Config) -> str | None:
    """The KV connector this session runs (`--epd-kv-connector`, else the platform's default),
    by its --kv-connector name; None when the options name none the harness knows (the
    preflight then says what is wrong)."""
    from harness.errors import BadInput
    from harness.spec.connectors import get_kv_connector, kv_connector_for_class
    from harness.spec.platforms import get_platform

    try:
        name = config.getoption("--epd-kv-connector", None)
        if name:
            return get_kv_connector(name).name
        default = kv_connector_for_class(
            get_platform(config.getoption("--epd-platform", "cpu")).kv_connector
        )
    except BadInput:
        return None
    return default.name if default is not None else None


def session_launcher(config: pytest.Config) -> str | None:
    """The launcher this session's instances run on when it is not this host's (`ray`), by the
    name `epd_variant` gives it; None for the local launcher."""
    from harness.spec.settings import LOCAL_LAUNCHER

    name = config.getoption("--epd-launcher", None)
    return name if name and name != LOCAL_LAUNCHER else None


def platform_refusal(config: pytest.Config, item: pytest.Item) -> str | None:
    """Why an item cannot run in the session, or None: one marked `one_host_rehearsal` gets
    the Ray launcher's own refusal (`LauncherChoice.refusal_on`), one marked `own_instances`
    the first session option a command it runs would ignore (`own_instances.refusal`)."""
    rehearsal = item.get_closest_marker("one_host_rehearsal")
    own = item.get_closest_marker("own_instances")
    if rehearsal is None and own is None:
        return None
    from harness.errors import BadInput
    from harness.spec.platforms import get_platform
    from harness.spec.settings import RAY_LAUNCHER, LauncherChoice

    if own is not None:
        why = own_instances_refusal(config, item, own)
        if why is not None:
            return why
    try:
        platform = get_platform(config.getoption("--epd-platform", "cpu"))
    except BadInput:
        return None  # the preflight says what is wrong with the platform
    if rehearsal is None:
        return None
    address = config.getoption("--epd-ray-address", None)
    if not rehearsal.kwargs.get("unless_ray_address", False):
        address = None
    return LauncherChoice(RAY_LAUNCHER, ray_address=address).refusal_on(platform)


def session_option_values(config: pytest.Config) -> dict[str, object]:
    """The session's options that say what is served and how, as given
    (`own_instances.SESSION_OPTIONS`)."""
    from harness.testing.own_instances import SESSION_OPTIONS

    return {o.option: config.getoption(o.option, o.default) for o in SESSION_OPTIONS}


def own_instances_refusal(
    config: pytest.Config, item: pytest.Item, marker: pytest.Mark
) -> str | None:
    """Why the commands an `own_instances` item runs cannot take the session as it is set;
    a marker naming no command, or one the harness does not have, is a usage error."""
    from harness.testing.own_instances import commands_of, refusal

    try:
        commands = commands_of(marker.args, item.nodeid)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    return refusal(session_option_values(config), commands)


def pytest_report_collectionfinish(config: pytest.Config) -> list[str]:
    """Tests that do not apply to the session (another KV connector; on a GPU platform, the
    one-host Ray rehearsal; a command a test runs that a session option cannot reach) are
    deselected, never silently."""
    lines = []
    deselected = config.stash.get(KV_CONNECTOR_DESELECTED, [])
    if deselected:
        lines += [
            f"epd-harness: {len(deselected)} test(s) deselected: they apply to another KV "
            f"connector than this session's ({session_kv_connector(config)}):",
            *(f"  {line}" for line in deselected),
        ]
    for why, nodes in config.stash.get(PLATFORM_DESELECTED, {}).items():
        lines += [
            f"epd-harness: {len(nodes)} test(s) deselected: {why}:",
            *(f"  {node}" for node in nodes),
        ]
    return lines


# The xdist group of every e2e item on a platform whose instances share the host's cores.
HOST_GROUP = "epd-host"
# Items under a wall-clock bound (their own assertion's, or one inside what they start: Ray
# gives a node's raylet 30 s to register) sort first, so they run before any vLLM instance
# starts: beside three vLLM interpreters importing on two cores a watchdog took 4.25 s to exit,
# a fake server had not logged its first line within a second, and a Ray node's raylet did not
# register within Ray's 30 s (docs/testing.md). On such a host under xdist they are split over
# two workers so that neither idles while the other waits on timeouts: those marked
# `on_e2e_worker=True` join HOST_GROUP (that worker runs them before its first topology), the
# others form CLOCK_GROUP. xdist's `--dist loadgroup` hands the largest groups out first, one per
# worker, so both run from the session's start, side by side with no vLLM instance running.
WALL_CLOCK_BOUND = "wall_clock_bound"
CLOCK_GROUP = "epd-wall-clock"


def shares_one_host(config: pytest.Config) -> bool:
    """Whether the session's platform runs every instance on the host's shared cores (CPU):
    then its topologies cannot run side by side for speed (they split the same cores and
    memory, and each worker would start a baseline of its own), so one worker takes every e2e
    item and the other workers the harness's own tests."""
    from harness.errors import BadInput
    from harness.spec.platforms import get_platform

    try:
        return not get_platform(config.getoption("--epd-platform", "cpu")).exclusive_devices
    except BadInput:
        return False  # the preflight names the unknown platform


@pytest.hookimpl(tryfirst=True)
def pytest_itemcollected(item: pytest.Item) -> None:
    """The xdist group of an e2e item, marked as it is collected (before xdist's `--dist
    loadgroup` reads the marks): on devices, one group per topology and the references its
    cases use; on a shared host, one group for every e2e item (and the wall-clock bounds marked
    to run on its worker) and one for the other wall-clock bounds."""
    group = epd_group(item)
    bound = item.get_closest_marker(WALL_CLOCK_BOUND)
    if group is not None:
        name = HOST_GROUP if shares_one_host(item.config) else group.xdist_name()
        item.add_marker(pytest.mark.xdist_group(name))
    elif bound is not None and shares_one_host(item.config):
        name = HOST_GROUP if on_e2e_worker(item, bound) else CLOCK_GROUP
        item.add_marker(pytest.mark.xdist_group(name))


def on_e2e_worker(item: pytest.Item, bound: pytest.Mark) -> bool:
    """The `on_e2e_worker` of a `wall_clock_bound` mark; anything else on the mark is refused,
    never dropped."""
    extra = [repr(a) for a in bound.args] + [k for k in bound.kwargs if k != "on_e2e_worker"]
    value = bound.kwargs.get("on_e2e_worker", False)
    if extra or not isinstance(value, bool):
        raise pytest.UsageError(
            f"{item.nodeid}: {WALL_CLOCK_BOUND} takes only on_e2e_worker=True or False, "
            f"not {', '.join(extra) or repr(value)}"
        )
    return value


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """At the end of a group, stop its topology, unless a later item of its xdist group needs
    it running (as its own, or as the exact reference of its topology): then it is stopped at
    the end of the first group after which nothing does. Where workers share devices, the
    baseline too, whichever group started it. Where a class (or module) ends, the variants
    its fixtures started with added environment, whatever their group."""
    config = item.config
    pool = config.stash.get(POOL_KEY, None)
    here = epd_group(item)
    if pool is None or here is None or nextitem is None:
        return  # at the very end the pool's fixture stops everything
    if declaring_scope(nextitem) != declaring_scope(item):
        pool.release_variants()  # a class's own instances (`TopologyPool.release_variants`)
    after = epd_group(nextitem)
    if after is not None and after.instances == here.instances:
        return
    share_devices = pool.settings.workers_share_devices
    if here.topology == "baseline" and not share_devices:
        return  # small; stopped when memory is needed, and fuzzing or load may still use it
    # Where workers share devices, a baseline kept up would keep the others' calibrations off
    # its device for this worker's whole session (found in review).
    queue = config.stash.get(E2E_QUEUE_KEY, None)
    needed = queue.needed_after(item.nodeid) if queue is not None else set()
    kept = config.stash.setdefault(KEPT_FOR_LATER_KEY, set())
    for instances in sorted({here.instances} | kept):
        if instances in needed:
            # A sweep made later (scenarios/test_vllm_proxy.py's, at its module's first item)
            # judges its topology against this one: the pool's before-stop hook serves only
            # the sweeps that exist, so stopped now it would start again there (found in
            # review: 1P+1D twice on the GPU nightly).
            kept.add(instances)
            continue
        kept.discard(instances)
        pool.release(instances[0])
    if share_devices and not (after is not None and after.topology == "baseline"):
        # Not only the baseline group's worker serves it: the first worker to judge anything
        # computes it (`Sweep.serve_baseline`, under the cache's lock), whatever group it holds.
        # Its group's end is where it is no longer needed here (found in review).
        if any(key.topology == "baseline" for key in pool.running()):
            pool.release("baseline")


def declaring_scope(item: pytest.Item) -> str:
    """The node id of the class that declares `item`, else of its module: the items that can
    share a variant of a topology that the class's own fixture starts."""
    parent = item.getparent(pytest.Class) or item.getparent(pytest.Module)
    return parent.nodeid if parent is not None else item.nodeid


def session_request(
    option: Callable[[str], Any],
    run_root: str,
    worker: tuple[str, int],
    served: Sequence[str] = (),
) -> RunRequest:
    """The run the session's `--epd-*` options ask for (`option` reads one, as
    `pytest.Config.getoption` does): what `epd_config` prepares, and what
    `check_session_options` checks. `served`: the topologies the selected items run, which
    the instances' plan is made for (one GPU serves a session of 1E+1PD's items; the plan of
    every topology wanted two for 1P+1D and refused it)."""
    from harness.preflight import RunRequest

    return RunRequest(
        served_topologies=tuple(served),
        model=option("--epd-model"),
        run_dir=run_root,
        vllm=option("--epd-vllm"),
        allow_untested_vllm=option("--epd-allow-untested-vllm"),
        devices=option("--epd-devices"),
        baseline_cache=option("--epd-baseline-cache"),
        refresh_baseline=option("--epd-refresh-baseline"),
        platform=option("--epd-platform"),
        colocate=option("--epd-colocate"),
        worker_id=worker[0],
        workers=worker[1],
        session_dir=str(Path(run_root) / SESSION_SHARED_DIR),
        kv_connector=option("--epd-kv-connector"),
        ec_connector=option("--epd-ec-connector"),
        proxy=option("--epd-proxy"),
        # The scenarios that run vLLM's own files read --epd-vllm-source themselves; the run's
        # proxy takes it only when it is vLLM's.
        vllm_source=option("--epd-vllm-source") if option("--epd-proxy") == "vllm" else None,
        proxy_registration=option("--epd-proxy-registration"),
        launcher=option("--epd-launcher"),
        ray_address=option("--epd-ray-address"),
        reference_policy=option("--epd-reference-policy"),
        stream=option("--epd-stream"),
        no_enforce_eager=option("--epd-no-enforce-eager"),
    )


def check_session_options(option: Callable[[str], Any]) -> None:
    """The session's options checked as its first e2e item would check them, by the same
    preflight as `epd-harness run` (names, values, flags that contradict each other), its
    files named only: all that can be checked before any item runs, or where a pytest command
    line is only shown (tests/test_docs_commands.py). pytest.UsageError, one line, naming the
    session's options (`--epd-platform`, not the CLI's `--platform`)."""
    from harness.errors import BadInput, empty_value
    from harness.preflight.config import check_arguments
    from harness.testing.own_instances import SESSION_OPTIONS, in_session_terms

    # An empty value is refused, as the CLI's parser refuses one: read as unset, `--epd-model
    # ""` served the tiny model and `--epd-run-dir ""` wrote to runs/pytest-<time> (found in
    # review). `--epd-topology` refuses its own, naming the topologies.
    for name in (*(o.option for o in SESSION_OPTIONS), "--epd-run-dir"):
        value = option(name)
        if isinstance(value, str) and not value.strip():
            raise pytest.UsageError(f"epd-harness: {empty_value(name, value)}")
    topology_option(option("--epd-topology"))
    try:
        check_arguments(session_request(option, "runs", ("main", 1)), read_files=False)
    except BadInput as exc:
        raise pytest.UsageError(f"epd-harness: {in_session_terms(str(exc))}") from None


# -- fixtures ---------------------------------------------------------------------------------


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


# -- helpers of the harness's own tests ---------------------------------------------------------


@pytest.fixture
def epd_load_spec(request: pytest.FixtureRequest):
    """The LoadSpec of the test's own `epd_load(spec)` mark: the one place a load scenario
    names its load, which the session also reads to calibrate the load ahead."""
    spec = marked_load(request.node)
    if spec is None:  # refused at collection too (`load_specs`)
        pytest.fail(
            f"{request.node.nodeid}: it takes epd_load_spec, so it must be marked "
            "epd_load(LoadSpec(...))",
            pytrace=False,
        )
    return spec


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


# -- the session's account ---------------------------------------------------------------------


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
    starts = [start for path in files for start in json.loads(path.read_text())]
    distinct = {start["topology"] for start in starts}
    terminalreporter.section("EPD topology starts")
    terminalreporter.write_line(
        f"topology starts: {len(starts)} for {len(distinct)} distinct (topology, connectors)"
    )
    for start in starts:
        took = "did not come up" if start["seconds"] is None else f"{start['seconds']:.1f}s"
        terminalreporter.write_line(f"  {start['topology']}: {start['reason']} ({took})")
    terminalreporter.write_line(f"artifacts: {root}")
