"""The nightly GPU job selects only tests that apply to what it runs: NIXL for KV (the cuda
profile's default), so nothing that needs ExampleConnector's files.

The nightly's pytest line is read from .github/workflows/nightly-gpu.yml and collected with
`--collect-only` (nothing starts: no vLLM, no GPU needed). A plugin dumps every collected test
with its `kv_connector` marker and its source. Two nets: no collected test is marked for another
connector, and no collected test calls what only works with ExampleConnector (its KV files, its
block-aligned rule), marked or not. The same collection under ExampleConnector shows both nets
can catch something: there those tests are collected.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parent.parent
NIGHTLY = ROOT / ".github" / "workflows" / "nightly-gpu.yml"
SCENARIO_STEP = "EPD scenarios"
# What a module uses to run its instances on Ray: the launcher, or a cluster of its own.
RAY_USES = re.compile(r"\b(RAY_LAUNCHER|harness\.serve\.ray_cluster)\b")
# A module that drives the CLI in-process (`epd_cli(...)`, `main([...])`) may start topologies
# of its own beside the session's pool; these of its items start none, and why.
CLI_CALLS = re.compile(r"\b(epd_cli|main)\(")
CLI_IN_POOL = {
    "scenarios/test_attach.py::test_attach_judges_a_kept_up_topology_like_a_normal_run": (
        "run --attach judges the pool's kept-up topology, its baseline from a cache"
    ),
    "scenarios/test_fuzz.py::test_a_seeded_fuzz_of_1e_1pd_finds_no_new_failure": (
        "the fuzz engine on the session's pool, not the CLI"
    ),
    "scenarios/test_fuzz.py::test_a_streamed_fuzz_of_1e_1pd_streams_every_example_and_finds_"
    "no_new_failure": "the fuzz engine on the session's pool, streamed, not the CLI",
}
# Calls that work only with ExampleConnector: its KV files, or its block-aligned rule.
EXAMPLE_ONLY_CALLS = re.compile(
    r"(?<![\w.])(kv_noise|zero_kv_files|kv_file_stamps|expected_kv_prefix)\("
)

DUMP_PLUGIN = """
import inspect, json, os
from pathlib import Path

from harness.testing.groups import epd_group

def pytest_collection_finish(session):
    items = []
    for item in session.items:
        marker = item.get_closest_marker("kv_connector")
        function = getattr(item, "function", None)
        try:
            source = inspect.getsource(function) if function is not None else ""
        except (OSError, TypeError):
            source = ""
        module = getattr(item, "module", None)
        try:
            module_source = inspect.getsource(module) if module is not None else ""
        except (OSError, TypeError):
            module_source = ""
        items.append({"id": item.nodeid, "kv_connector": list(marker.args) if marker else None,
                      "source": source, "module_source": module_source,
                      "rehearsal": item.get_closest_marker("one_host_rehearsal") is not None,
                      "own": item.get_closest_marker("own_instances") is not None,
                      "topology": group.topology if (group := epd_group(item)) else None})
    Path(os.environ["EPD_SELECTION_DUMP"]).write_text(json.dumps(items))
"""


def nightly_pytest_options() -> list[str]:
    """The nightly's scenario selection: its pytest arguments that choose tests or the KV
    connector (marker expression, platform, connector), as the workflow passes them, and the
    devices of its first matrix leg (the session refuses cuda without devices at collection)."""
    jobs = [
        job
        for job in yaml.safe_load(NIGHTLY.read_text())["jobs"].values()
        if any(step.get("name") == SCENARIO_STEP for step in job["steps"])
    ]
    assert len(jobs) == 1, f"one job with a step named {SCENARIO_STEP!r} in {NIGHTLY.name}"
    steps = [step for step in jobs[0]["steps"] if step.get("name") == SCENARIO_STEP]
    assert len(steps) == 1, f"one step named {SCENARIO_STEP!r} in {NIGHTLY.name}"
    args_line = re.search(r"args=\((.*?)\)", steps[0]["run"], re.S)
    assert args_line, steps[0]["run"]
    words = shlex.split(args_line.group(1))
    chosen = [words[0]]  # the test path
    for flag in ("-m", "--epd-platform", "--epd-kv-connector"):
        if flag in words:
            chosen += [flag, words[words.index(flag) + 1]]
    assert "-m" in chosen and "--epd-platform" in chosen, words
    assert words[words.index("--epd-devices") + 1] == "$DEVICES", words
    first_leg = jobs[0]["strategy"]["matrix"]["include"][0]
    return [*chosen, "--epd-devices", first_leg["devices"]]


def collect(options: list[str], tmp_path: Path) -> tuple[list[dict], str]:
    (tmp_path / "selection_dump.py").write_text(DUMP_PLUGIN)
    dump = tmp_path / "selection.json"
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
        + ["-p", "selection_dump", *options],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tmp_path), "EPD_SELECTION_DUMP": str(dump)},
        timeout=300,
        check=False,
    )
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]
    return json.loads(dump.read_text()), child.stdout


def needing_example(items: list[dict]) -> dict[str, str]:
    """Collected tests that need ExampleConnector, by marker or by what they call."""
    found = {}
    for item in items:
        if item["kv_connector"] is not None and "example" in item["kv_connector"]:
            if "nixl" not in item["kv_connector"]:
                found[item["id"]] = f"marked kv_connector{tuple(item['kv_connector'])}"
        match = EXAMPLE_ONLY_CALLS.search(item["source"])
        if match:
            found.setdefault(item["id"], f"calls {match.group(1)}()")
    return found


def test_the_nightly_selection_holds_nothing_that_needs_example_connector(tmp_path: Path):
    options = nightly_pytest_options()
    assert options[options.index("--epd-platform") + 1] == "cuda"
    assert options[options.index("-m") + 1] == "e2e"
    items, output = collect(options, tmp_path)
    ids = [item["id"] for item in items]
    assert any("test_nixl_kv_noise_ladder" in i for i in ids), "the NIXL KV ladder runs instead"
    assert any("test_nixl.py" in i for i in ids)
    assert not needing_example(items), needing_example(items)
    assert "deselected: they apply to another KV connector" in output, output[-2000:]


def test_the_same_nets_catch_those_tests_under_example_connector(tmp_path: Path):
    """Proof that the check above can fail: under ExampleConnector (the CPU default) the
    ExampleConnector-only tests are collected, and both nets name them."""
    options = [*nightly_pytest_options(), "--epd-kv-connector", "example"]
    items, _ = collect(options, tmp_path)
    found = needing_example(items)
    ladders = [i for i in found if i.endswith("::test_kv_noise_ladder")]
    assert len(ladders) == 2, found
    assert all("calls kv_noise()" in found[i] or "marked" in found[i] for i in ladders)
    by_source = {i for i, why in found.items() if why.startswith("calls")}
    by_marker = {
        item["id"] for item in items if item["kv_connector"] and "nixl" not in item["kv_connector"]
    }
    assert by_source <= by_marker, (
        f"a test calls ExampleConnector-only code unmarked: {by_source - by_marker}"
    )


def nightly_options_on_cpu() -> list[str]:
    """The nightly's selection with the cpu platform instead of cuda."""
    options = nightly_pytest_options()
    platform = options.index("--epd-platform")
    return [*options[:platform], "--epd-platform", "cpu", *options[platform + 2 :]]


def on_ray(items: list[dict]) -> dict[str, bool]:
    """Collected tests whose module runs instances on Ray -> whether they are marked as
    starting the one-host rehearsal."""
    return {i["id"]: i["rehearsal"] for i in items if RAY_USES.search(i["module_source"])}


def test_the_nightly_selection_starts_no_one_host_ray_rehearsal(tmp_path: Path):
    """The rehearsal's Ray nodes would share the GPU host's devices, and the nightly installs no
    Ray: its scenarios are deselected and listed there (run against a real cluster with
    --epd-ray-address)."""
    items, output = collect(nightly_pytest_options(), tmp_path)
    assert not on_ray(items), on_ray(items)
    assert "runs on the cpu platform only" in output, output[-2000:]
    # The address configures the Ray launcher: alone, the session refuses it at collection.
    with_cluster = [
        *nightly_pytest_options(),
        *("--epd-launcher", "ray", "--epd-ray-address", "10.0.0.1:6379"),
    ]
    items, _ = collect(with_cluster, tmp_path)
    assert on_ray(items) and all(on_ray(items).values()), on_ray(items)
    assert all("test_ray.py" in node for node in on_ray(items)), on_ray(items)


def test_every_scenario_on_ray_is_marked_and_runs_on_cpu(tmp_path: Path):
    """Proof the check above can fail: on the cpu platform the same tests are collected, and
    every one whose module runs instances on Ray carries the marker."""
    found = on_ray(collect(nightly_options_on_cpu(), tmp_path)[0])
    assert {n.split("::")[0] for n in found} == {
        "scenarios/test_ray.py",
        "scenarios/test_ray_netns.py",
    }, found
    assert all(found.values()), [n for n, marked in found.items() if not marked]


def driving_the_cli(items: list[dict]) -> dict[str, bool]:
    """Collected tests of modules that drive the CLI in-process, but for those known to start
    nothing of their own -> whether they are marked `own_instances`."""
    return {
        i["id"]: i["own"]
        for i in items
        if CLI_CALLS.search(i["module_source"]) and i["id"].split("[")[0] not in CLI_IN_POOL
    }


def test_the_nightly_selection_holds_the_scenarios_that_start_their_own_topologies(
    tmp_path: Path,
):
    """The repro, the planted fuzz and the exports that apply to NIXL run on the GPU night too
    (they were deselected on every GPU platform: the night never checked that a red case
    exports, reproduces or shrinks there); each is marked, so it gets the session's options and
    devices and runs after the pool's items. The exports of the decode-tail case, red under
    ExampleConnector only, are deselected for the connector, and listed."""
    items, output = collect(nightly_pytest_options(), tmp_path)
    own = {i["id"] for i in items if i["own"]}
    assert own == {
        "scenarios/test_export_repro.py::test_the_export_reproduces_with_vllm_alone"
        "[1E+1PD:m-video-jpeg-frames]",
        "scenarios/test_export_repro.py::test_the_export_reproduces_with_vllm_alone"
        "[1E+1PD:m-video-jpeg-frames-2fps]",
        "scenarios/test_export_repro.py::test_run_sh_reference_serves_1p1d_there_and_judges_the"
        "_case_against_its_answer",
        "scenarios/test_fuzz.py::test_fuzzing_finds_and_shrinks_a_planted_shape_dependent_fault",
        "scenarios/test_repro.py::test_repro_of_a_planted_mismatch_reproduces_it",
    }, own
    assert all(driving_the_cli(items).values()), driving_the_cli(items)
    assert "[1E+1P+1D:m-image-short-text] (needs example)" in output, output[-3000:]
    assert "topologies of their own" not in output, output[-3000:]
    assert set(CLI_IN_POOL) <= {i["id"] for i in items}, "the in-pool ones still run"
    ids = [i["id"] for i in items]
    assert all(ids.index(i) > ids.index(j) for i in own for j in ids if j not in own), (
        "an item with instances of its own runs before one that uses the pool"
    )


def test_every_scenario_that_starts_its_own_topologies_is_marked(tmp_path: Path):
    """Proof the check above can fail: on cpu they are collected, each one marked."""
    found = driving_the_cli(collect(nightly_options_on_cpu(), tmp_path)[0])
    assert {n.split("::")[0] for n in found} == {
        "scenarios/test_export_repro.py",
        "scenarios/test_repro.py",
        "scenarios/test_fuzz.py",
    }, found
    assert all(found.values()), [n for n, marked in found.items() if not marked]


def test_the_nightly_plan_shows_every_topology_its_scenarios_serve(tmp_path: Path):
    """plan.txt is the night's record of what ran where, and its fit check fails the job fast:
    with no dispatch input the Plan step plans `plan`'s default (the sweep's topologies), while
    the scenarios also serve 2E+1PD (the matrix's round robin). Each matrix leg's Plan step,
    run with the dispatch inputs empty, plans exactly the topologies the collected scenarios
    serve."""
    from tests.test_workflows import gpu_job_envs, plan_step_request

    items, _ = collect(nightly_pytest_options(), tmp_path)
    served = {item["topology"] for item in items if item["topology"] is not None}
    assert "2E+1PD" in served, sorted(served)
    workflow = yaml.safe_load(NIGHTLY.read_text())
    legs = [env for env in gpu_job_envs(workflow, tmp_path) if not env["TOPOLOGIES"]]
    assert legs
    for index, env in enumerate(legs):
        request = plan_step_request(workflow, tmp_path / f"leg{index}", env)
        assert {t.name for t in request.topologies} == served, env["DEVICES"]


# What signals or reads an instance's processes from this host by its pid (a node's, on a Ray
# cluster named by --epd-ray-address).
BY_PID_CALLS = re.compile(
    r"\b(kill_instance|killpg|topology_processes|tree_usage|tree_pids)\(|psutil\.Process\("
)
ON_RAY = ["scenarios", "-m", "e2e", "--epd-launcher", "ray"]


def by_pid(items: list[dict]) -> set[str]:
    return {item["id"] for item in items if BY_PID_CALLS.search(item["source"])}


def test_no_scenario_kills_or_reads_an_instance_by_pid_on_a_named_cluster(tmp_path: Path):
    """Found in the audit of ignored flags: under `--epd-launcher ray --epd-ray-address ADDR`
    the instances' pids are their nodes', yet the self-test's kill and the attach test's
    SIGKILLed this host's process group of that number (`epd-harness load` refuses --kill
    there). Such scenarios are deselected and listed there; on the one-host rehearsal cluster
    (no address), whose nodes run here, they are collected, which shows the net catches them."""
    rehearsal = by_pid(collect(ON_RAY, tmp_path)[0])
    assert {n.split("::")[-1] for n in rehearsal} >= {
        "test_killed_encoder_fails_the_next_request_fast",
        "test_attach_judges_a_kept_up_topology_like_a_normal_run",
        "test_death_under_load_ends_every_request_naming_d",
    }, rehearsal
    items, output = collect([*ON_RAY, "--epd-ray-address", "10.0.0.1:6379"], tmp_path)
    assert not by_pid(items), by_pid(items)
    assert "deselected: they signal or read the instances' processes" in output, output[-2000:]
