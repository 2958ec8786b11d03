"""Which items a session runs, in which order, on which xdist worker; the markers that say so.

A topology start is the whole cost of an e2e session on CPU, so every scenario gets its
topology from one pool per pytest process (`harness.run.pool`), and the e2e items are ordered
so that each (topology, variant) group runs in one stretch: the baseline's first, then each
topology in the plan's order (exact references before the topologies judged against them), then
variants (another KV connector). Items reaching a topology through another proxy (vLLM's own)
share its instances and run right after its group; the pool stops a group's topology as the
group ends (harness.testing.pool_hooks). Items that end their session (an expected instance
death, a rerun on kept storage, a kill) run last in their group. Under xdist, one worker takes
a group and the groups its cases reference (`xdist_group`), so no two workers start the same
topology; on a CPU host one worker takes every e2e item (`shares_one_host`).

Markers: `epd_topology(name)` for items whose topology is not a `topology`/`scenario` parameter,
`epd_variant(name)` for items that run under other settings, `epd_ends_session` for items that
stop or break their session, `epd_load(spec)` for items that run a load (the fixture
`epd_load_spec` hands the test its mark's spec); the others are described where they are
registered (`pytest_configure`).
"""

from __future__ import annotations

import os
import shlex

import pytest

from harness.testing.before_stop import (
    LATER_SWEEP_MAKERS_KEY,
    LOAD_SPECS_KEY,
    later_sweep_makers,
    load_specs,
    marked_load,
)
from harness.testing.groups import E2E_QUEUE_KEY, E2eQueue, ends_session, epd_group, owns_instances
from harness.testing.session_options import (
    check_session_options,
    cluster_process_refusal,
    platform_refusal,
    session_kv_connector,
    unread_option_refusal,
    wanted_topologies,
)

PROMPTS_KEY = pytest.StashKey[tuple]()
# The topologies the session's selected e2e items run (their groups'), in collection order.
SESSION_TOPOLOGIES_KEY = pytest.StashKey[tuple]()
KV_CONNECTOR_DESELECTED = pytest.StashKey[list]()
PLATFORM_DESELECTED = pytest.StashKey[dict]()  # why -> the node ids deselected for it
# A scenario module lists the prompts its tests send (besides the sweep's) under this name.
BASELINE_PROMPTS = "EPD_BASELINE_PROMPTS"
WORKER_USAGE_ERROR = "epd_usage_error"  # how a worker hands its collection's refusal back
WORKER_DESELECTED = "epd_deselected"  # how a worker hands its deselection lines back
# On the xdist controller: each distinct list of deselection lines its workers handed back.
WORKERS_DESELECTED_KEY = pytest.StashKey[dict]()

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
        "reads_instance_processes: the item signals or reads its instances' processes from "
        "this host by pid (a kill, their process trees); so does an epd_load with a kill or a "
        "duration: deselected and listed under --epd-ray-address, whose nodes' pids are not "
        "this host's",
    )
    config.addinivalue_line(
        "markers",
        "reads_vllm_source: the item runs vLLM's own files whatever --epd-proxy says, from "
        "--epd-vllm-source when given (harness.testing.vllm_source: a session given the flag "
        "where no selected item reads it is refused)",
    )


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
    output = getattr(node, "workeroutput", None) or {}
    message = output.get(WORKER_USAGE_ERROR)
    if message:
        raise pytest.UsageError(message)
    lines = tuple(output.get(WORKER_DESELECTED) or ())
    if lines:
        node.config.stash.setdefault(WORKERS_DESELECTED_KEY, {})[lines] = None


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
        refusal = platform_refusal(config, item) or cluster_process_refusal(
            config, item, marked_load(item)
        )
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
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:  # for the controller to list (`pytest_terminal_summary`)
        workeroutput[WORKER_DESELECTED] = deselection_lines(config)
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
    modules = dict.fromkeys(getattr(item, "module", None) for item in items)
    config.stash[PROMPTS_KEY] = baseline_prompts_of(modules)
    config.stash[LATER_SWEEP_MAKERS_KEY] = later_sweep_makers(items)
    config.stash[LOAD_SPECS_KEY] = load_specs(items)


@pytest.hookimpl(tryfirst=True)  # before --collect-only lists what it refuses
def pytest_collection_finish(session: pytest.Session) -> None:
    """The session's options are checked once when a selected item serves them, and
    `--epd-vllm-source`, or another `--epd-*` option, given where no selected item reads it is
    refused, once every deselection (-k, -m, `--epd-topology`, the session's refusals) is
    done."""
    from harness.testing.vllm_source import OPTION, given_on_the_command_line, refusal

    config = session.config
    if any("epd_config" in getattr(item, "fixturenames", ()) for item in session.items):
        # Once, before any item: a bad value failed every e2e item, each with the same error.
        check_session_options(config.getoption)
    args = given_arguments(config)
    source = config.getoption(OPTION, None) if given_on_the_command_line(args) else None
    why = refusal(source, config.getoption("--epd-proxy", None), session.items)
    why = why or unread_option_refusal(args, session.items)
    if why:
        raise pytest.UsageError(why)


def given_arguments(config: pytest.Config) -> list[str]:
    """The arguments the session was given, as pytest parses them: the ini's `addopts`,
    $PYTEST_ADDOPTS, then the command line's own. Found in review: only the command line's
    were read, so an `--epd-*` flag in $PYTEST_ADDOPTS that no selected test reads was never
    refused (every e2e item dropped by its `--epd-topology`, the session green)."""
    return [
        *config.getini("addopts"),
        *shlex.split(os.environ.get("PYTEST_ADDOPTS", "")),
        *config.invocation_params.args,
    ]


def pytest_report_collectionfinish(config: pytest.Config) -> list[str]:
    """Tests that do not apply to the session (another KV connector; on a GPU platform, the
    one-host Ray rehearsal; a command a test runs that a session option cannot reach; a kill
    or a process read by pid on a cluster named by --epd-ray-address) are
    deselected, never silently."""
    return deselection_lines(config)


def deselection_lines(config: pytest.Config) -> list[str]:
    """The lines that list the tests this process's collection deselected, and why."""
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


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Under xdist, the deselections the workers listed: the controller collects nothing, and
    the workers' collection lines are printed nowhere (found in review: an item of another KV
    connector was gone from a `-n 2` session without a line). Every worker collects the same
    items, so each distinct list is printed once."""
    for lines in config.stash.get(WORKERS_DESELECTED_KEY, {}):
        terminalreporter.section("EPD deselected")
        for line in lines:
            terminalreporter.write_line(line)


def baseline_prompts_of(modules) -> tuple:
    """The prompts the modules' `BASELINE_PROMPTS` ask the one baseline to answer, each name
    once. A name given to two different prompts (two modules', or a module's and one of the
    sweep's own) is refused: one baseline answer stands for a name, so one of them would be
    judged against the other's answer, or silently not sent."""
    from harness.spec.prompts import SKELETON_PROMPTS

    owner = {prompt.name: (prompt, "the sweep's own prompts") for prompt in SKELETON_PROMPTS}
    needed: dict[str, object] = {}
    for module in modules:
        for prompt in getattr(module, BASELINE_PROMPTS, ()):
            where = getattr(module, "__name__", str(module))
            seen, first = owner.setdefault(prompt.name, (prompt, where))
            if seen != prompt:
                raise pytest.UsageError(
                    f"prompt name {prompt.name!r} names two different prompts: in {first} "
                    f"and in {where} ({BASELINE_PROMPTS}); give one of them another name"
                )
            needed.setdefault(prompt.name, prompt)
    return tuple(needed.values())
