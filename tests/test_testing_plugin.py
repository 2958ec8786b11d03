"""The pytest plugin's ordering (harness/testing/collection.py, harness/testing/pool_hooks.py):
every e2e item of one running topology in one stretch, in the plan's order, items that end
their session last, and one xdist group per topology and the references its cases use on
devices, one for every e2e item on a CPU host."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit

MODULE = """
import pytest

pytestmark = pytest.mark.e2e

@pytest.mark.parametrize("topology", ["1E+1P+1D", "1E+1PD", "1P+1D"])
def test_sweep_case(topology):
    pass

@pytest.mark.epd_topology("1E+1PD")
@pytest.mark.epd_ends_session
def test_kills_the_encoder():
    pass

@pytest.mark.epd_topology("1E+1PD")
def test_fault_on_1e1pd():
    pass

@pytest.mark.epd_topology("1P+1D")
@pytest.mark.epd_variant("nixl")
def test_nixl():
    pass

@pytest.mark.epd_topology("1E+1PD")
@pytest.mark.epd_proxy("vllm")
def test_through_vllm_proxy():
    pass

def test_needs_only_the_baseline():
    pass
"""

UNIT = """
import pytest

def test_pure_logic():
    pass

@pytest.mark.wall_clock_bound
def test_noticed_within_a_second():
    pass

@pytest.mark.wall_clock_bound(on_e2e_worker=True)
def test_rehearsal_cluster_registered_within_30s():
    pass
"""


CONFTEST = """
pytest_plugins = ["harness.testing.plugin"]

def pytest_addoption(parser):
    parser.addoption("--epd-platform", default="cpu")
"""


def collected(pytester: pytest.Pytester, *args: str) -> list[pytest.Item]:
    pytester.makeconftest(CONFTEST)
    return collected_with_conftest(pytester, *args)


def collected_with_conftest(pytester: pytest.Pytester, *args: str) -> list[pytest.Item]:
    pytester.makeini("[pytest]\nmarkers =\n    e2e: real vLLM\n")
    pytester.makepyfile(test_a_e2e=MODULE, test_b_unit=UNIT)
    run = pytester.inline_run("--collect-only", "-p", "no:cacheprovider", *args)
    [finished] = run.getcalls("pytest_collection_finish")
    return finished.session.items


def xdist_groups(items: list[pytest.Item]) -> dict[str, str]:
    return {
        item.name: item.get_closest_marker("xdist_group").args[0]
        for item in items
        if item.get_closest_marker("xdist_group")
    }


def test_e2e_items_run_by_topology_with_session_enders_last(pytester: pytest.Pytester) -> None:
    items = collected(pytester, "--epd-platform", "cuda")
    order = [item.name for item in items]
    assert order == [
        "test_noticed_within_a_second",  # wall-clock bounds before any start
        "test_rehearsal_cluster_registered_within_30s",
        "test_pure_logic",  # then every other tier
        "test_needs_only_the_baseline",
        "test_sweep_case[1E+1PD]",
        "test_fault_on_1e1pd",
        "test_through_vllm_proxy",  # the same instances through vLLM's proxy, right after
        "test_kills_the_encoder",  # ends its session: last of everything on 1E+1PD
        "test_sweep_case[1P+1D]",
        "test_nixl",  # NIXL is cuda's own KV connector: the default 1P+1D instances
        "test_sweep_case[1E+1P+1D]",
    ], order
    groups = xdist_groups(items)
    assert groups["test_sweep_case[1E+1P+1D]"] == groups["test_sweep_case[1P+1D]"] == "1P+1D"
    assert groups["test_through_vllm_proxy"] == groups["test_kills_the_encoder"] == "1E+1PD"
    assert groups["test_nixl"] == "1P+1D"  # found in review: a group of its own started it twice
    assert "test_pure_logic" not in groups
    assert "test_noticed_within_a_second" not in groups  # devices: no cores shared with starts
    assert "test_rehearsal_cluster_registered_within_30s" not in groups


SCENARIOS = """
import dataclasses

import pytest

pytestmark = pytest.mark.e2e


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    topology: str
    ends_its_session: bool = False


@pytest.mark.parametrize(
    "scenario",
    [
        Scenario("kills-decode", "1P+1D", ends_its_session=True),
        Scenario("plain", "1P+1D"),
        Scenario("other", "1E+1PD"),
    ],
    ids=lambda s: s.name,
)
def test_scenario(scenario):
    pass
"""


def test_a_scenario_that_ends_its_session_runs_last_of_its_topology(
    pytester: pytest.Pytester,
) -> None:
    """A matrix scenario that ends its session (`Scenario.ends_its_session`: a kill, a rerun
    on kept storage) says so on its parameter, not with a marker: it runs after every other
    item of its topology, which would otherwise find its instances gone. Found in review by
    mutation: with the parameter's attribute ignored the unit tier stayed green."""
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    e2e: real vLLM\n")
    # A basename no module of the suite has: pytest imports both in one worker otherwise.
    pytester.makepyfile(test_scenario_order=SCENARIOS)
    run = pytester.inline_run("--collect-only", "-p", "no:cacheprovider")
    [finished] = run.getcalls("pytest_collection_finish")
    order = [item.name for item in finished.session.items]
    assert order == [
        "test_scenario[other]",
        "test_scenario[plain]",
        "test_scenario[kills-decode]",
    ], order


def test_a_variant_of_another_kv_connector_runs_after_every_default_group(
    pytester: pytest.Pytester,
) -> None:
    """cuda under ExampleConnector: the NIXL item needs other instances, started after every
    default one, in a group of their own."""
    pytester.makeconftest(CONFTEST + '    parser.addoption("--epd-kv-connector", default=None)\n')
    items = collected_with_conftest(
        pytester, "--epd-platform", "cuda", "--epd-kv-connector", "example"
    )
    assert [item.name for item in items][-1] == "test_nixl"
    assert xdist_groups(items)["test_nixl"] == "nixl:1P+1D"


def test_on_a_cpu_host_one_xdist_group_takes_every_e2e_item(pytester: pytest.Pytester) -> None:
    """The CPU host is one slot: one worker starts every topology once, the other workers run
    the harness's own tests beside it; the wall-clock bounds open the session on two workers."""
    items = collected(pytester)  # the default platform: cpu
    groups = xdist_groups(items)
    assert set(groups.values()) == {"epd-host", "epd-wall-clock"}
    assert len(groups) == len(items) - 1  # every item but the unit test
    assert "test_pure_logic" not in groups
    assert groups["test_noticed_within_a_second"] == "epd-wall-clock"
    # One marked for the e2e worker runs there, before its first topology starts.
    host = [item.name for item in items if groups.get(item.name) == "epd-host"]
    assert host[0] == "test_rehearsal_cluster_registered_within_30s", host
    assert len(host) == len(items) - 2


@pytest.mark.parametrize(
    ("arguments", "named"),
    [('on_e2e_worker="yes"', "'yes'"), ("True", "True"), ("on_worker=True", "on_worker")],
)
def test_a_wall_clock_bound_refuses_what_it_does_not_know(
    pytester: pytest.Pytester, arguments: str, named: str
) -> None:
    """A positional True or a misspelt keyword is refused, never dropped: dropped, the item
    would leave the e2e worker it asked for (a mutant that checked only the value survived)."""
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        test_c_bad=f"""
import pytest

@pytest.mark.wall_clock_bound({arguments})
def test_bad_value():
    pass
"""
    )
    run = pytester.runpytest("--collect-only", "-p", "no:cacheprovider")
    assert run.ret != 0
    run.stderr.fnmatch_lines(
        [f"*test_bad_value: wall_clock_bound takes only on_e2e_worker=True or False, not {named}*"]
    )


@pytest.mark.parametrize(
    "platform, workers, released",
    [("cpu", 1, []), ("cuda", 1, []), ("cuda", 4, ["baseline"])],
)
def test_the_end_of_the_baseline_group_stops_it_where_workers_share_devices(
    platform: str, workers: int, released: list[str]
) -> None:
    """Kept up, the baseline keeps its GPU from every other worker for this worker's whole
    session (found in review); alone on a host, it is small and load or fuzzing may still use
    it."""
    from types import SimpleNamespace

    from harness.spec.platforms import get_platform
    from harness.testing import pool_hooks

    stopped: list[str] = []
    pool = SimpleNamespace(
        settings=SimpleNamespace(
            workers_share_devices=get_platform(platform).exclusive_devices and workers > 1
        ),
        release=stopped.append,
        running=list,  # nothing else running: only the ending group's topology is stopped
    )
    item = teardown_items(pool, platform)
    pool_hooks.pytest_runtest_teardown(item("baseline"), item("1E+1PD"))
    assert stopped == released
    pool_hooks.pytest_runtest_teardown(item("1E+1PD"), item("1P+1D"))
    assert stopped == [*released, "1E+1PD"]


def test_a_worker_without_the_baseline_group_stops_the_baseline_it_started() -> None:
    """Found in review: on GPUs under xdist the first worker to judge anything computes the
    baseline (`Sweep.serve_baseline`, under the cache's lock), whichever group it holds; the
    teardown releases only the ending group's own topology, so a worker whose items are
    1E+1PD's keeps the baseline's GPU until its session ends, and the baseline group's worker
    (`epd_live("baseline")`) and every load's calibration on other workers wait on that device."""
    from types import SimpleNamespace

    from harness.testing import pool_hooks

    stopped: list[str] = []
    pool = SimpleNamespace(
        settings=SimpleNamespace(workers_share_devices=True),  # cuda, 4 workers
        release=stopped.append,
        running=lambda: [SimpleNamespace(topology="baseline"), SimpleNamespace(topology="1E+1PD")],
    )
    item = teardown_items(pool, "cuda")
    # This worker's items: 1E+1PD's group, then 2E+1PD's; the baseline was started by the
    # first 1E+1PD item's judging and nothing here needs it again.
    pool_hooks.pytest_runtest_teardown(item("1E+1PD"), item("2E+1PD"))
    assert "baseline" in stopped, stopped


def test_an_unknown_name_in_epd_topology_is_refused(pytester: pytest.Pytester) -> None:
    """Found in review: `--epd-topology 1P+1D,1E+1P+1d` (a typo) keeps only 1P+1D's items and
    drops every other e2e item as deselected, never saying a name matched nothing: the
    1E+1P+1D scenarios the user asked for silently do not run (with every name misspelt, no e2e
    test runs at all). A name the harness does not know must be refused, as `epd-harness run
    --topology` refuses it."""
    pytester.makeconftest(CONFTEST + '    parser.addoption("--epd-topology", default=None)\n')
    pytester.makeini("[pytest]\nmarkers =\n    e2e: real vLLM\n")
    pytester.makepyfile(test_a_e2e=MODULE)
    run = pytester.runpytest(
        "--collect-only", "-p", "no:cacheprovider", "--epd-topology", "1P+1D,1E+1P+1d"
    )
    assert run.ret not in (0, 5), run.stdout.str()
    assert "1E+1P+1d" in run.stdout.str() + run.stderr.str()


@pytest.mark.parametrize("value", ["", ","])
def test_an_empty_epd_topology_is_refused(pytester: pytest.Pytester, value: str) -> None:
    """Found in review: `--epd-topology "$T"` with T unset (or `,`) kept every e2e item, as
    if the option were not given: the session ran every topology, the user's choice dropped."""
    pytester.makeconftest(CONFTEST + '    parser.addoption("--epd-topology", default=None)\n')
    pytester.makeini("[pytest]\nmarkers =\n    e2e: real vLLM\n")
    pytester.makepyfile(test_a_e2e=MODULE)
    run = pytester.runpytest("--collect-only", "-p", "no:cacheprovider", f"--epd-topology={value}")
    assert run.ret not in (0, 5), run.stdout.str()
    assert f"--epd-topology {value!r} names no topology" in run.stdout.str() + run.stderr.str()


def test_the_ray_variant_is_the_default_group_when_the_session_itself_runs_on_ray(
    pytester: pytest.Pytester,
) -> None:
    """Found in review (the same defect as the NIXL variant's, fixed for KV connectors only):
    under the documented `pytest scenarios -m e2e --epd-launcher ray`, scenarios/test_ray.py's
    `ray-epd` item asks the pool for exactly the session's own 1E+1P+1D (`ray_settings` builds
    `LauncherChoice("ray", address)`, what the preflight builds from the same options), yet its
    `epd_variant("ray")` puts it in a group of its own, sorted after every default group: the
    teardown between them stops 1E+1P+1D, and the Ray cluster starts it again."""
    from harness.testing import groups

    pytester.makeconftest(CONFTEST + '    parser.addoption("--epd-launcher", default="local")\n')
    pytester.makeini("[pytest]\nmarkers =\n    e2e: real vLLM\n")
    pytester.makepyfile(
        test_a_e2e=MODULE,
        test_c_ray="""
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.epd_topology("1E+1P+1D"), pytest.mark.epd_variant("ray")]

def test_epd_on_three_nodes():
    pass
""",
    )
    run = pytester.inline_run("--collect-only", "-p", "no:cacheprovider", "--epd-launcher", "ray")
    [finished] = run.getcalls("pytest_collection_finish")
    items = {item.name: item for item in finished.session.items}
    on_ray, default = items["test_epd_on_three_nodes"], items["test_sweep_case[1E+1P+1D]"]
    assert groups.epd_group(on_ray).instances == groups.epd_group(default).instances, [
        item.name for item in finished.session.items
    ]


def teardown_items(pool: object, platform: str):
    """item(topology) -> a stand-in e2e item of that topology's group, in a session on
    `platform` whose pool is `pool`: what `pytest_runtest_teardown` reads of an item."""
    from types import SimpleNamespace

    from harness.testing import pool_hooks

    options = {"--epd-platform": platform}
    config = SimpleNamespace(
        stash={pool_hooks.POOL_KEY: pool}, getoption=lambda name, default=None: options.get(name)
    )
    e2e = pytest.mark.e2e.mark
    # Every stand-in declared in one module, no class: none ends a class's variants.
    module = SimpleNamespace(nodeid="the stand-ins module")
    parents = {pytest.Module: module, pytest.Class: None}

    def item(topology: str) -> SimpleNamespace:
        marks = {"e2e": e2e, "epd_topology": pytest.mark.epd_topology(topology).mark}
        return SimpleNamespace(config=config, get_closest_marker=marks.get, getparent=parents.get)

    return item


OWN = """
import pytest

pytestmark = pytest.mark.e2e

@pytest.fixture
def epd_own_instances():
    return None

@pytest.mark.epd_topology("1E+1PD")
@pytest.mark.own_instances("run", "repro")
def test_own_repro(epd_own_instances):
    pass

@pytest.mark.epd_topology("1E+1PD")
@pytest.mark.own_instances("fuzz")
def test_own_fuzz(epd_own_instances):
    pass

@pytest.mark.epd_topology("1E+1PD")
def test_pool_case():
    pass

@pytest.mark.epd_topology("1P+1D")
def test_other_pool_case():
    pass
"""


@pytest.mark.parametrize("platform", ["cuda", "cpu"])
def test_items_with_instances_of_their_own_run_after_every_item_of_the_pool(
    pytester: pytest.Pytester, platform: str
) -> None:
    """Before them their worker's pool is stopped (the CLI they drive leases the devices in
    this very process): every item that uses the pool runs first, in its xdist group, and none
    of the pool's topologies is kept up for them. They were deselected on GPUs."""
    from harness.testing import groups

    pytester.makeconftest(CONFTEST + '    parser.addoption("--epd-stream", action="store_true")\n')
    pytester.makeini("[pytest]\nmarkers =\n    e2e: real vLLM\n")
    pytester.makepyfile(test_a_e2e=OWN)
    run = pytester.inline_run(
        "--collect-only", "-p", "no:cacheprovider", "--epd-platform", platform
    )
    [finished] = run.getcalls("pytest_collection_finish")
    items = finished.session.items
    order = [item.name for item in items]
    assert order[-2:] == ["test_own_repro", "test_own_fuzz"], order
    last_of_pool = next(i for i in items if i.name == "test_other_pool_case")
    queue = items[0].config.stash[groups.E2E_QUEUE_KEY]
    assert queue.needed_after(last_of_pool.nodeid) == set(), "1E+1PD kept up for its own items"
    # What the pool keeps for this worker from that item on, whoever waits for its devices:
    # that item's own topology, nothing of the items with instances of their own.
    assert {topology for topology, _ in queue.needed_from(last_of_pool.nodeid)} == {"1P+1D"}
    if platform == "cuda":
        groups = xdist_groups(items)
        assert groups["test_own_repro"] == groups["test_pool_case"] == "1E+1PD"


def test_an_item_whose_command_would_ignore_a_session_option_is_deselected_and_listed(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeconftest(CONFTEST + '    parser.addoption("--epd-launcher", default="local")\n')
    pytester.makeini("[pytest]\nmarkers =\n    e2e: real vLLM\n")
    pytester.makepyfile(test_a_e2e=OWN)
    run = pytester.runpytest("--collect-only", "-p", "no:cacheprovider", "--epd-launcher", "ray")
    run.stdout.fnmatch_lines(
        [
            "*1 test(s) deselected: the session's --epd-launcher cannot reach `epd-harness run`*",
            "*test_own_repro*",
            "*1 test(s) deselected: the session's --epd-launcher cannot reach `epd-harness fuzz`*",
            "*test_own_fuzz*",
        ]
    )


def test_a_streamed_session_keeps_the_items_whose_commands_stream(
    pytester: pytest.Pytester,
) -> None:
    """run, fuzz (`fuzz --stream`) and repro (the bundle's own) take `--epd-stream`: the
    planted-fault fuzz was deselected as a command that "has no --stream" (found walking the
    docs)."""
    pytester.makeconftest(CONFTEST + '    parser.addoption("--epd-stream", action="store_true")\n')
    pytester.makeini("[pytest]\nmarkers =\n    e2e: real vLLM\n")
    pytester.makepyfile(test_a_e2e=OWN)
    run = pytester.inline_run("--collect-only", "-p", "no:cacheprovider", "--epd-stream")
    [finished] = run.getcalls("pytest_collection_finish")
    names = {item.name for item in finished.session.items}
    assert {"test_own_repro", "test_own_fuzz"} <= names, names


KV_CONNECTORS = """
import pytest

@pytest.mark.kv_connector("nixl")
def test_nixl_only():
    pass

@pytest.mark.kv_connector("example", "nixl")
def test_either_connector():
    pass

def test_any_connector():
    pass
"""


def test_an_item_of_another_kv_connector_is_deselected_counted_and_listed(
    pytester: pytest.Pytester,
) -> None:
    """Without xdist too (tests/test_plugin_xdist.py has the workers' case): on cpu
    (ExampleConnector) an item marked kv_connector("nixl") does not run, and is neither gone
    silently nor counted a pass: pytest counts it deselected, the plugin names it with the
    connectors it needs; one naming the session's connector among others runs. Found in
    review by mutation: the unit tier stayed green with the items dropped but not reported
    to pytest ("2 passed", no "1 deselected"), with the listing empty, and with the
    connector test inverted."""
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_kv_marked=KV_CONNECTORS)
    run = pytester.runpytest("-p", "no:cacheprovider", "-rA")
    run.assert_outcomes(passed=2, deselected=1)
    run.stdout.fnmatch_lines(
        [
            "epd-harness: 1 test(s) deselected: they apply to another KV connector than this "
            "session's (example):",
            "  test_kv_marked.py::test_nixl_only (needs nixl)",
        ]
    )
    assert "PASSED test_kv_marked.py::test_nixl_only" not in run.stdout.str()


def test_an_item_with_instances_of_its_own_must_take_their_fixture(
    pytester: pytest.Pytester,
) -> None:
    """Without `epd_own_instances` its pool is not stopped and its commands get the CLI's
    defaults: refused at collection, naming the fix."""
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    e2e: real vLLM\n")
    pytester.makepyfile(
        test_a_e2e="""
import pytest

@pytest.mark.e2e
@pytest.mark.own_instances("run")
def test_bare():
    pass
"""
    )
    run = pytester.runpytest("--collect-only", "-p", "no:cacheprovider")
    assert run.ret != 0
    run.stderr.fnmatch_lines(
        ["*test_bare: marked own_instances, it must take the epd_own_instances*"]
    )


ROUND_ROBIN = """
import pytest

pytestmark = pytest.mark.e2e

@pytest.mark.parametrize("topology", ["1E+1PD", "1P+1D", "1E+1P+1D"])
def test_sweep_case(topology):
    pass

@pytest.mark.epd_topology("2E+1PD")
def test_two_encoders_round_robin():
    pass
"""


def session_plan(pytester: pytest.Pytester, devices: tuple[int, ...], *args: str) -> list[dict]:
    """The session sweep's waves on a cuda run of `devices`, for the items these options
    select: {topology: devices} per wave."""
    from harness.run.pool import TopologyPool
    from harness.run.sweep import Sweep
    from harness.spec.platforms import CUDA
    from harness.spec.settings import RunSettings
    from harness.spec.topology import serving_for
    from harness.testing.collection import SESSION_TOPOLOGIES_KEY
    from harness.testing.e2e_fixtures import session_sweep_spec

    pytester.makeconftest(CONFTEST + '    parser.addoption("--epd-topology", default=None)\n')
    pytester.makeini("[pytest]\nmarkers =\n    e2e: real vLLM\n")
    pytester.makepyfile(test_round_robin=ROUND_ROBIN)
    run = pytester.inline_run("--collect-only", "-p", "no:cacheprovider", *args)
    [finished] = run.getcalls("pytest_collection_finish")
    selected = finished.session.config.stash[SESSION_TOPOLOGIES_KEY]
    settings = RunSettings(
        serving_for(CUDA, "model"), pytester.path / "run", platform=CUDA, devices=devices
    )
    sweep = Sweep(session_sweep_spec(selected, ()), settings, pool=TopologyPool(settings))
    return [{s.topology.name: s.devices for s in w.slots} for w in sweep.schedule().waves]


def test_the_session_plan_gives_every_topology_its_items_run_a_place(
    pytester: pytest.Pytester,
) -> None:
    """2E+1PD (the matrix's round robin) had no place in the GPU session's plan: it leased
    every device, stopping whatever else its worker served and waiting for every other
    worker's devices. On 8 GPUs it is a second wave on devices of the first wave's topologies;
    the baseline keeps its own."""
    waves = session_plan(pytester, tuple(range(8)), "--epd-platform", "cuda")
    assert waves == [
        {"baseline": (0,), "1E+1PD": (1, 2), "1P+1D": (3, 4), "1E+1P+1D": (5, 6, 7)},
        {"2E+1PD": (1, 2, 3)},
    ]


@pytest.mark.parametrize(
    ("wanted", "planned"),
    [
        ("1E+1PD", {"baseline": (0,), "1E+1PD": (1, 2)}),
        ("1E+1P+1D", {"baseline": (0,), "1P+1D": (1, 2), "1E+1P+1D": (1, 2, 3)}),
        ("2E+1PD", {"baseline": (0,), "2E+1PD": (1, 2, 3)}),
    ],
)
def test_epd_topology_shrinks_the_session_plan_to_what_was_asked_and_its_references(
    pytester: pytest.Pytester, wanted: str, planned: dict
) -> None:
    """The plan held every topology whatever `--epd-topology` asked for; now what the
    selected items run, the baseline, and 1P+1D for 1E+1P+1D (its exact reference)."""
    waves = session_plan(pytester, (0, 1, 2, 3), "--epd-platform", "cuda", "--epd-topology", wanted)
    assert {name: devices for wave in waves for name, devices in wave.items()} == planned


def test_the_session_sweep_lists_each_prompt_once() -> None:
    """The modules' prompts the skeleton has not go to the baseline alone, besides the
    skeleton's: a module's copy of a skeleton prompt among them listed it twice in the
    session's run.json."""
    from harness.spec.prompts import SKELETON_PROMPTS, PromptSpec, TextPart
    from harness.testing.e2e_fixtures import session_sweep_spec

    extra = PromptSpec("extra", (TextPart("x"),))
    spec = session_sweep_spec(("2E+1PD", "1P+1D"), (*SKELETON_PROMPTS[:2], extra))
    assert [t.name for t in spec.topologies] == ["1P+1D"]
    assert [t.name for t in spec.placed_only] == ["2E+1PD"]
    assert spec.prompts == SKELETON_PROMPTS and spec.baseline_only_prompts == (extra,)


LOADS = """
import pytest

from harness.spec.load import LoadSpec

pytestmark = pytest.mark.e2e

SOAK = LoadSpec("1E+1PD", 16, 8, duration_s=90.0)
SMALL = LoadSpec("1E+1P+1D", 16, 8)
DEATH = LoadSpec("1E+1P+1D", 32, 32, kill="decode")

@pytest.mark.parametrize("topology", ["1E+1PD", "1P+1D"])
def test_sweep_case(topology):
    pass

@pytest.mark.epd_topology("1E+1P+1D")
@pytest.mark.epd_load(DEATH)
@pytest.mark.epd_ends_session
def test_death():
    pass

@pytest.mark.epd_topology("1E+1P+1D")
@pytest.mark.epd_load(SMALL)
def test_small():
    pass

@pytest.mark.epd_topology("1E+1PD")
@pytest.mark.epd_load(SOAK)
def test_soak():
    pass
"""


def test_the_loads_to_come_are_known_from_any_item_on_in_the_order_they_run(
    pytester: pytest.Pytester,
) -> None:
    """What the session's baseline measures before it stops (`calibrate_loads_before`): the
    loads from the item running on; under several xdist workers only its xdist group's, whose
    items this worker runs (another worker's loads are measured in their own process)."""
    from harness.testing import before_stop, groups

    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    e2e: real vLLM\n")
    pytester.makepyfile(test_loads=LOADS)
    run = pytester.inline_run("--collect-only", "-p", "no:cacheprovider", "--epd-platform", "cuda")
    [finished] = run.getcalls("pytest_collection_finish")
    items = {item.name: item for item in finished.session.items}
    config = items["test_soak"].config

    def to_come(current: str, workers: int) -> list[tuple[str, int]]:
        config.stash[groups.CURRENT_ITEM_KEY] = items[current].nodeid
        return [(s.topology, s.requests) for s in before_stop.loads_to_come(config, workers)]

    every = [("1E+1PD", 16), ("1E+1P+1D", 16), ("1E+1P+1D", 32)]  # death ends its session
    assert to_come("test_sweep_case[1E+1PD]", 1) == every
    assert to_come("test_soak", 1) == every
    assert to_come("test_sweep_case[1P+1D]", 1) == every[1:]
    assert to_come("test_death", 1) == every[2:]
    assert to_come("test_sweep_case[1E+1PD]", 2) == every[:1]  # 1P+1D's group: another worker
    assert to_come("test_sweep_case[1P+1D]", 2) == every[1:]


def test_a_load_mark_on_an_item_of_another_topology_is_refused(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    e2e: real vLLM\n")
    pytester.makepyfile(test_loads=LOADS.replace('@pytest.mark.epd_topology("1E+1PD")\n', ""))
    run = pytester.runpytest("--collect-only", "-p", "no:cacheprovider")
    assert run.ret == pytest.ExitCode.USAGE_ERROR
    run.stderr.fnmatch_lines(["*test_soak: epd_load's load runs on 1E+1PD, the item on baseline*"])


def test_a_load_test_gets_its_spec_from_its_own_mark(pytester: pytest.Pytester) -> None:
    """The mark is the one place a load scenario names its load (`epd_load_spec`): each test
    gets its own mark's spec, the one the session calibrates ahead."""
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    e2e: real vLLM\n")
    checks = """
@pytest.mark.epd_topology("1E+1P+1D")
@pytest.mark.epd_load(LoadSpec("1E+1P+1D", 4, 2, stream=True))
def test_marked_here(epd_load_spec):
    assert epd_load_spec == LoadSpec("1E+1P+1D", 4, 2, stream=True)

@pytest.mark.epd_topology("1E+1P+1D")
@pytest.mark.epd_load(DEATH)
def test_marked_by_name(epd_load_spec):
    assert epd_load_spec is DEATH
"""
    pytester.makepyfile(test_loads=LOADS + checks)
    run = pytester.runpytest("-p", "no:cacheprovider", "-k", "marked")
    run.assert_outcomes(passed=2)


def test_under_epd_stream_every_load_streams(pytester: pytest.Pytester) -> None:
    """`--epd-stream` reaches the loads too: an unstreamed load's mark ran it unstreamed
    under the option, which was silently dropped for it."""
    pytester.makeconftest(CONFTEST + '    parser.addoption("--epd-stream", action="store_true")\n')
    pytester.makeini("[pytest]\nmarkers =\n    e2e: real vLLM\n")
    checks = """
@pytest.mark.epd_topology("1E+1P+1D")
@pytest.mark.epd_load(LoadSpec("1E+1P+1D", 4, 2))
def test_marked_unstreamed(epd_load_spec):
    assert epd_load_spec == LoadSpec("1E+1P+1D", 4, 2, stream=True)
"""
    pytester.makepyfile(test_loads=LOADS + checks)
    run = pytester.runpytest("-p", "no:cacheprovider", "-k", "unstreamed", "--epd-stream")
    run.assert_outcomes(passed=1)


ON_A_CLUSTER = (
    '    parser.addoption("--epd-launcher", default="local")\n'
    '    parser.addoption("--epd-ray-address")\n'
)
KILLS = """
@pytest.mark.epd_topology("1E+1PD")
@pytest.mark.reads_instance_processes
def test_kills_the_encoder():
    pass
"""


@pytest.mark.parametrize("address", [("--epd-ray-address", "10.0.0.1:6379"), ()])
def test_items_that_kill_or_read_instances_by_pid_are_deselected_on_a_named_cluster(
    pytester: pytest.Pytester, address: tuple[str, ...]
) -> None:
    """Found in the audit of ignored flags: `epd-harness load --kill` and `--duration` with
    --ray-address are refused (a node's pids are not this host's), but under `pytest
    --epd-launcher ray --epd-ray-address ADDR` the death-under-load test SIGKILLed this host's
    process group by D's pid on its node, and the soak read this host's process trees: another
    process killed, or an instance read as gone. Those items (a load with a kill or a
    duration, or marked reads_instance_processes) are deselected and listed, never passed;
    the one-host rehearsal cluster (no address) runs its nodes' processes here and keeps
    them."""
    pytester.makeconftest(CONFTEST + ON_A_CLUSTER)
    pytester.makeini("[pytest]\nmarkers =\n    e2e: real vLLM\n")
    pytester.makepyfile(test_loads=LOADS + KILLS)
    run = pytester.runpytest(
        "--collect-only", "-p", "no:cacheprovider", "--epd-launcher", "ray", *address
    )
    assert run.ret == pytest.ExitCode.OK, run.stdout.str()
    out = run.stdout.str()
    if not address:
        assert "test(s) deselected" not in out and "test_death" in out and "test_soak" in out, out
        return
    run.stdout.fnmatch_lines(
        [
            "*3 test(s) deselected: they signal or read the instances' processes from this host "
            "by pid * with --epd-ray-address the instances run on the cluster's nodes*",
            "*test_death*",
            "*test_soak*",
            "*test_kills_the_encoder*",
        ]
    )
    assert "<Function test_small>" in out and "<Function test_death>" not in out, out


def test_a_test_taking_the_load_spec_without_a_mark_is_refused(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    e2e: real vLLM\n")
    unmarked = """
@pytest.mark.epd_topology("1E+1P+1D")
def test_unmarked(epd_load_spec):
    pass
"""
    pytester.makepyfile(test_loads=LOADS + unmarked)
    run = pytester.runpytest("--collect-only", "-p", "no:cacheprovider")
    assert run.ret == pytest.ExitCode.USAGE_ERROR
    run.stderr.fnmatch_lines(
        ["*test_unmarked: it takes epd_load_spec, so it must be marked epd_load(LoadSpec(...))*"]
    )


SOURCE_READERS = """
import pytest

pytestmark = pytest.mark.e2e

@pytest.mark.epd_topology("1E+1PD")
def test_sweep_case():
    pass

@pytest.mark.epd_topology("1E+1PD")
@pytest.mark.reads_vllm_source
def test_through_vllms_own_files():
    pass

@pytest.fixture
def epd_own_instances():
    return None

@pytest.mark.epd_topology("1E+1PD")
@pytest.mark.own_instances("run", "export")
def test_own_export(epd_own_instances):
    pass

@pytest.mark.epd_topology("1E+1PD")
@pytest.mark.own_instances("run", "repro")
def test_own_repro(epd_own_instances):
    pass
"""


@pytest.mark.parametrize(
    ("selection", "accepted"),
    [
        (("-k", "sweep_case"), False),  # the harness's proxy: nothing selected reads it
        (("-k", "sweep_case or own_repro"), False),  # a repro takes what its bundle recorded
        (("-k", "sweep_case", "--epd-proxy", "vllm"), True),  # the session's proxy reads it
        (("-k", "own_repro", "--epd-proxy", "vllm"), True),  # its run gets vLLM's proxy too
        (("-k", "own_files"), True),  # marked reads_vllm_source
        (("-k", "own_export"), True),  # an export takes it (OwnInstances.args)
        ((), True),
    ],
)
def test_a_vllm_source_that_no_selected_test_reads_is_refused(
    pytester: pytest.Pytester, selection: tuple[str, ...], accepted: bool
) -> None:
    """`pytest scenarios/test_matrix.py --epd-vllm-source ~/vllm` ran green with the flag
    changing nothing: only vLLM's proxy as the session's, and the tests that run vLLM's own
    files, read it. A flag nothing selected reads is refused at collection, naming what would
    read it."""
    pytester.makeconftest(
        CONFTEST
        + '    parser.addoption("--epd-vllm-source", default=None)\n'
        + '    parser.addoption("--epd-proxy", default="harness")\n'
    )
    pytester.makeini("[pytest]\nmarkers =\n    e2e: real vLLM\n")
    pytester.makepyfile(test_a_e2e=SOURCE_READERS)
    options = ("--collect-only", "-p", "no:cacheprovider", *selection)
    run = pytester.runpytest(*options, "--epd-vllm-source", "/src/vllm")
    if accepted:
        assert run.ret == pytest.ExitCode.OK, run.stdout.str() + run.stderr.str()
        return
    assert run.ret == pytest.ExitCode.USAGE_ERROR, run.stdout.str()
    run.stderr.fnmatch_lines(
        ["ERROR: --epd-vllm-source: no selected test reads it*--epd-proxy vllm*"]
    )
    assert len(run.stderr.str().strip().splitlines()) == 1, run.stderr.str()
    assert pytester.runpytest(*options).ret == pytest.ExitCode.OK, "without the flag: as before"


def make_options_session(pytester: pytest.Pytester, *options: str) -> None:
    """A session whose conftest declares `options` (each defaulting to None), with an e2e
    test and a unit test (UNREAD_OPTIONS) to select from."""
    pytester.makeconftest(
        CONFTEST + "".join(f'    parser.addoption("{name}", default=None)\n' for name in options)
    )
    pytester.makeini("[pytest]\nmarkers =\n    e2e: real vLLM\n")
    pytester.makepyfile(test_options=UNREAD_OPTIONS)


def assert_refused_or_ok(run: pytest.RunResult, refused: str | None) -> None:
    """`run` collected (refused None), or was refused for the option `refused` names."""
    if refused is None:
        assert run.ret == pytest.ExitCode.OK, run.stdout.str() + run.stderr.str()
        return
    assert run.ret == pytest.ExitCode.USAGE_ERROR, run.stdout.str()
    run.stderr.fnmatch_lines([f"ERROR: {refused}: no selected test reads it*"])


UNREAD_OPTIONS = """
import pytest

def test_pure_logic():
    pass

@pytest.mark.e2e
@pytest.mark.epd_topology("1E+1PD")
def test_sweep_case():
    pass

@pytest.mark.reads_vllm_source
def test_served_vllms_own_script():
    pass
"""


@pytest.mark.parametrize(
    ("selection", "refused"),
    [
        (("-k", "pure_logic", "--epd-dtype", "float16"), "--epd-dtype"),
        (("-k", "pure_logic", "--epd-topology=1P+1D"), "--epd-topology"),
        (("-k", "pure_logic", "--epd-platform", "cuda"), "--epd-platform"),
        (("-k", "pure_logic or sweep_case", "--epd-dtype", "float16"), None),  # e2e: read
        (("-k", "served_vllms_own", "--epd-platform", "cuda"), None),  # parity reads it
        (("-k", "served_vllms_own", "--epd-dtype", "float16"), "--epd-dtype"),
        (("-k", "pure_logic", "--epd-run-dir", "elsewhere"), None),  # every session's
    ],
)
def test_a_session_option_that_no_selected_test_reads_is_refused(
    pytester: pytest.Pytester, selection: tuple[str, ...], refused: str | None
) -> None:
    """`pytest tests -m unit --epd-dtype float16` ran green, the flag changing nothing: the
    `--epd-*` options configure what the e2e tests serve, and none was selected. A flag nothing
    selected reads is refused at collection, naming it (a flag a code path ignores is refused,
    never dropped)."""
    make_options_session(pytester, "--epd-dtype", "--epd-topology", "--epd-run-dir")
    run = pytester.runpytest("--collect-only", "-p", "no:cacheprovider", *selection)
    assert_refused_or_ok(run, refused)
    if refused is not None:
        assert len(run.stderr.str().strip().splitlines()) == 1, run.stderr.str()


def listed_after_what_they_import(modules: list[str]) -> list[str]:
    """The plugin modules of `modules` (a `pytest_plugins` list) that import a module listed
    after them: pytest would find that one imported already and could not rewrite its asserts
    (it warns "Module already imported so cannot be rewritten")."""
    import ast
    import importlib.util
    from pathlib import Path

    wrong = []
    for position, name in enumerate(modules):
        source = Path(importlib.util.find_spec(name).origin).read_text()
        imported = {
            node.module
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and node.module
        }
        wrong += [
            f"{name} imports {later}" for later in modules[position + 1 :] if later in imported
        ]
    return wrong


def test_each_plugin_module_is_listed_after_those_it_imports() -> None:
    from harness.testing import plugin

    assert listed_after_what_they_import(plugin.pytest_plugins) == []
    assert listed_after_what_they_import(plugin.pytest_plugins[::-1]) != []  # can go red


def test_one_prompt_name_given_to_two_different_prompts_is_refused() -> None:
    """The modules' BASELINE_PROMPTS are answered by one baseline, one answer per name: a name
    given to two different prompts kept the first module's silently, and the other module's
    cases were judged against an answer to another request (found in review). The same
    prompt named in two modules is asked once."""
    from types import SimpleNamespace

    from harness.spec.prompts import SKELETON_PROMPTS, PromptSpec, TextPart
    from harness.testing.collection import baseline_prompts_of

    one = PromptSpec("m-shared", (TextPart("one"),))
    other = PromptSpec("m-shared", (TextPart("other"),))
    first = SimpleNamespace(__name__="scenarios.test_a", EPD_BASELINE_PROMPTS=(one,))
    again = SimpleNamespace(__name__="scenarios.test_b", EPD_BASELINE_PROMPTS=(one,))
    clash = SimpleNamespace(__name__="scenarios.test_c", EPD_BASELINE_PROMPTS=(other,))
    assert baseline_prompts_of([first, again]) == (one,)
    with pytest.raises(pytest.UsageError, match=r"'m-shared'.*test_a and in scenarios\.test_c"):
        baseline_prompts_of([first, clash])
    skeleton = SKELETON_PROMPTS[0]
    renamed = PromptSpec(skeleton.name, (TextPart("not the sweep's"),))
    clash_with_sweep = SimpleNamespace(__name__="scenarios.test_d", EPD_BASELINE_PROMPTS=(renamed,))
    with pytest.raises(pytest.UsageError, match="the sweep's own prompts"):
        baseline_prompts_of([clash_with_sweep])


@pytest.mark.parametrize(
    ("selection", "addopts", "refused"),
    [
        (("-k", "pure_logic"), "--epd-dtype float16", "--epd-dtype"),
        (("-k", "pure_logic"), "--epd-topology=1P+1D", "--epd-topology"),
        (("-k", "pure_logic or sweep_case"), "--epd-dtype float16", None),  # e2e: read
    ],
)
def test_a_session_option_given_in_pytest_addopts_that_no_selected_test_reads_is_refused(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    selection: tuple[str, ...],
    addopts: str,
    refused: str | None,
) -> None:
    """Found in review: only the command line's own arguments were read, so a flag given in
    $PYTEST_ADDOPTS (a job's setting) that no selected test reads changed nothing, and the
    session was green all the same (every e2e item dropped by an `--epd-topology` there)."""
    import os

    make_options_session(pytester, "--epd-dtype", "--epd-topology")
    monkeypatch.setenv("PYTEST_ADDOPTS", f"{os.environ.get('PYTEST_ADDOPTS', '')} {addopts}")
    run = pytester.runpytest("--collect-only", "-p", "no:cacheprovider", *selection)
    assert_refused_or_ok(run, refused)


def test_a_session_option_given_in_the_ini_addopts_that_no_selected_test_reads_is_refused(
    pytester: pytest.Pytester,
) -> None:
    """The ini's `addopts` are given arguments as $PYTEST_ADDOPTS' are (a mutant that read
    only the latter survived): a project's pytest.ini fixing `--epd-topology` would otherwise
    drop every e2e item of a unit-only selection without a word."""
    make_options_session(pytester, "--epd-dtype", "--epd-topology")
    pytester.makeini("[pytest]\naddopts = --epd-topology=1P+1D\nmarkers =\n    e2e: real vLLM\n")
    run = pytester.runpytest("--collect-only", "-p", "no:cacheprovider", "-k", "pure_logic")
    assert_refused_or_ok(run, "--epd-topology")


ACCOUNT_TEST = """
import json
from pathlib import Path

def test_writes_the_starts(request):
    root = Path(request.config.getoption("--epd-run-dir"))
    start = [{"topology": "1E+1PD", "reason": "first use", "seconds": 12.0}]
    for run_dir in (root / "gw0", root / "gw0" / "planted-corrupt-ec"):
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "topology-starts.json").write_text(json.dumps(start))
"""


def account_session(pytester: pytest.Pytester, test: str) -> pytest.RunResult:
    """A session under --epd-run-dir whose one test (`test`) passed, its account printed."""
    pytester.makeconftest(CONFTEST + '    parser.addoption("--epd-run-dir", default=None)\n')
    pytester.makepyfile(test_account=test)
    run = pytester.runpytest("-p", "no:cacheprovider", "--epd-run-dir", str(pytester.path / "run"))
    run.assert_outcomes(passed=1)
    return run


def test_the_starts_of_a_run_of_its_own_are_not_counted_as_the_sessions(
    pytester: pytest.Pytester,
) -> None:
    """Found in review: the account summed every `topology-starts.json` under the run root,
    the runs an `own_instances` item's `epd-harness run` wrote there too (scenarios/
    test_repro.py's planted-corrupt-ec): "topology starts: 2 for 1 distinct", 1E+1PD started
    twice, each a first use, as if the session's pool had started it again with no reason.
    The session's pools' starts are counted; a run of its own's are listed as its."""
    run = account_session(pytester, ACCOUNT_TEST)
    out = run.stdout.str()
    assert "topology starts: 1 for 1 distinct (topology, connectors)" in out, out
    assert "  1E+1PD: first use (12.0s)" in out, out
    run.stdout.fnmatch_lines(["*gw0/planted-corrupt-ec*1E+1PD: first use (12.0s)*"])


ROOT_POOL_TEST = """
import json
from pathlib import Path

def test_writes_the_starts(request):
    root = Path(request.config.getoption("--epd-run-dir"))
    start = [{"topology": "1P+1D", "reason": "first use", "seconds": None}]
    root.mkdir(parents=True, exist_ok=True)
    (root / "topology-starts.json").write_text(json.dumps(start))
"""


def test_the_starts_of_the_pool_of_a_session_without_xdist_are_the_sessions(
    pytester: pytest.Pytester,
) -> None:
    """Without xdist the session's pool writes its starts into the run root itself, not a
    gw* directory: they are the session's, not a run of its own's."""
    out = account_session(pytester, ROOT_POOL_TEST).stdout.str()
    assert "topology starts: 1 for 1 distinct (topology, connectors)" in out, out
    assert "  1P+1D: first use (did not come up)" in out, out
    assert "in its own run" not in out, out


WORKER_TABLES_TEST = """
from pathlib import Path

def test_writes_the_tables(request):
    root = Path(request.config.getoption("--epd-run-dir"))
    for worker, verdict in (("gw0", "MATCH"), ("gw1", "MISMATCH")):
        (root / worker).mkdir(parents=True)
        (root / worker / "verdicts.txt").write_text(f"1E+1PD  text  {verdict}\\n")
"""


def test_the_summary_shows_each_workers_verdict_table(pytester: pytest.Pytester) -> None:
    """Under xdist the controller has no sweep of its own: the verdicts it shows are the
    tables each worker wrote (gw*/verdicts.txt), each under its worker's name."""
    pytester.makeconftest(CONFTEST + '    parser.addoption("--epd-run-dir", default=None)\n')
    pytester.makepyfile(test_account=WORKER_TABLES_TEST)
    run = pytester.runpytest("-p", "no:cacheprovider", "--epd-run-dir", str(pytester.path / "run"))
    run.assert_outcomes(passed=1)
    run.stdout.fnmatch_lines(
        [
            "*EPD verdicts (gw0)*",
            "1E+1PD  text  MATCH",
            "*EPD verdicts (gw1)*",
            "1E+1PD  text  MISMATCH",
        ]
    )


def stub_session(plan: dict[str, tuple[int, ...]], devices: tuple[int, ...], exclusive: bool):
    """A sweep whose plan places `plan` (topology: devices) and the settings of a session on
    `devices`, as `own_devices` reads them."""
    from types import SimpleNamespace

    slots = [SimpleNamespace(topology=SimpleNamespace(name=n), devices=d) for n, d in plan.items()]
    schedule = SimpleNamespace(waves=[SimpleNamespace(slots=slots)])
    sweep = SimpleNamespace(schedule=lambda: schedule)
    platform = SimpleNamespace(exclusive_devices=exclusive)
    return sweep, SimpleNamespace(platform=platform, devices=devices)


def test_an_own_instances_item_gets_its_groups_slots_and_the_baselines_in_the_sessions_order():
    """On GPUs the commands of an `own_instances` item use the devices the session's plan
    gives its xdist group's topologies (1E+1P+1D goes with its reference 1P+1D) and the
    baseline's, in the session's device order; no other group's. A group the plan places
    nowhere fails the item, naming the plan; on CPU the session's cores, only if given."""
    from harness.testing.e2e_fixtures import own_devices
    from harness.testing.groups import EpdGroup

    plan = {"baseline": (0,), "1E+1PD": (1, 2), "1P+1D": (3, 4), "1E+1P+1D": (5, 6, 7)}
    order = (7, 6, 5, 4, 3, 2, 1, 0)
    sweep, gpus = stub_session(plan, order, exclusive=True)
    assert own_devices(sweep, EpdGroup("1E+1P+1D"), gpus, True) == (7, 6, 5, 4, 3, 0)
    assert own_devices(sweep, EpdGroup("1E+1PD"), gpus, True) == (2, 1, 0)
    with pytest.raises(pytest.fail.Exception, match="places no topology of 2E\\+1PD's group"):
        own_devices(sweep, EpdGroup("2E+1PD"), gpus, True)
    sweep, cores = stub_session(plan, (2, 3), exclusive=False)
    assert own_devices(sweep, EpdGroup("1E+1PD"), cores, True) == (2, 3)
    assert own_devices(sweep, EpdGroup("1E+1PD"), cores, False) is None


def test_a_vllm_source_is_read_by_what_runs_vllms_files_and_given_in_either_spelling() -> None:
    """Under `--epd-proxy vllm` the e2e items read the source (served through vLLM's proxy),
    a unit or process test does not unless marked a reader: `-m unit --epd-proxy vllm
    --epd-vllm-source X` reads nothing of it and is refused. `--epd-vllm-source=X` is the
    option given as much as `--epd-vllm-source X` (only a given one is refused)."""
    from types import SimpleNamespace

    from harness.testing.vllm_source import given_on_the_command_line, reads_vllm_source

    def item(**markers: tuple) -> SimpleNamespace:
        marks = {name: SimpleNamespace(args=args) for name, args in markers.items()}
        return SimpleNamespace(get_closest_marker=marks.get)

    assert reads_vllm_source(item(e2e=()), "vllm")
    assert not reads_vllm_source(item(e2e=()), "harness")
    assert not reads_vllm_source(item(unit=()), "vllm")
    assert reads_vllm_source(item(process=(), reads_vllm_source=()), "harness")
    assert reads_vllm_source(item(e2e=(), own_instances=("run", "export")), "harness")
    assert not reads_vllm_source(item(e2e=(), own_instances=("run", "repro")), "harness")
    assert given_on_the_command_line(["-m", "e2e", "--epd-vllm-source", "/src/vllm"])
    assert given_on_the_command_line(["-m", "e2e", "--epd-vllm-source=/src/vllm"])
    assert not given_on_the_command_line(["-m", "e2e", "--epd-vllm-sources=/src/vllm"])
