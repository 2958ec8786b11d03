"""`epd-harness plan`: schedules that fit the devices, rendered commands, and one-line errors.

Plans are checked by their invariants (no device twice in a wave, no wave bigger than the host,
every topology exactly once, distinct ports) as well as by the exact 8-GPU layout.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from harness.cli.plan import (
    DEFAULT_TOPOLOGY_NAMES,
    Plan,
    PlanRequest,
    build_plan,
    format_plan,
)
from harness.spec.placement import available_memory_bytes, cpu_instance_budget, place_instances
from harness.spec.platforms import CPU, CUDA, XPU, DevicePlanError, PlatformProfile
from harness.spec.topology import TOPOLOGIES, ServingConfig, get_topology

pytestmark = pytest.mark.unit

MODEL = "/models/qwen"
VLLM = "/opt/venv/bin/vllm"
T4_BOX = "0, Tesla T4, 7.5\n1, Tesla T4, 7.5\n"  # nvidia-smi's compute-capability listing


@pytest.fixture(autouse=True)
def gpus_here(monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """This host's nvidia-smi, as `plan --platform cuda` reads it (`check_planned_gpus`):
    unreadable, as on a CPU host, unless a test lists GPUs (`gpus_here[0] = T4_BOX`). A unit
    test starts no process, and gives the same plans on a T4 box as anywhere."""
    from harness import devices

    listed: list[str | None] = [None]
    monkeypatch.setattr(devices, "run_nvidia_smi", lambda *args: listed[0])
    return listed


def request(
    platform: PlatformProfile,
    devices: tuple[int, ...],
    names: tuple[str, ...] = DEFAULT_TOPOLOGY_NAMES,
    colocate: bool = False,
) -> PlanRequest:
    return PlanRequest(
        platform=platform,
        devices=devices,
        topologies=tuple(get_topology(n) for n in names),
        model=MODEL,
        colocate=colocate,
        vllm_executable=VLLM,
        run_dir=Path("/runs/r1"),
    )


def assert_valid_gpu_plan(plan: Plan, devices: tuple[int, ...], names: tuple[str, ...]) -> None:
    """The invariants every GPU plan must keep, whatever its shape."""
    planned = [t.name for w in plan.waves for t in w.topologies]
    assert sorted(planned) == sorted(names), "every topology exactly once"
    for wave in plan.waves:
        used = [d for t in wave.topologies for d in t.devices]
        assert len(used) == len(set(used)), f"wave {wave.index} uses a device twice: {used}"
        assert len(used) <= len(devices), f"wave {wave.index} uses {used}, host has {devices}"
        assert set(used) <= set(devices), f"wave {wave.index} uses unknown devices: {used}"
        for topology in wave.topologies:
            for instance in topology.instances:
                assert set(instance.devices) <= set(topology.devices), instance.name
    ports = [p for i in plan.instances for p in (i.port, i.side_channel_port) if p is not None]
    assert len(ports) == len(set(ports)), f"a port is planned twice: {sorted(ports)}"


# --- the acceptance shapes -------------------------------------------------------------------


def test_eight_gpus_run_the_four_topologies_at_once_on_disjoint_gpus() -> None:
    devices = tuple(range(8))
    plan = build_plan(request(CUDA, devices))
    assert len(plan.waves) == 1
    layout = {t.name: t.devices for t in plan.waves[0].topologies}
    assert layout == {
        "baseline": (0,),
        "1E+1PD": (1, 2),
        "1P+1D": (3, 4),
        "1E+1P+1D": (5, 6, 7),
    }
    per_instance = [i.devices for i in plan.instances]
    assert sorted(d for ds in per_instance for d in ds) == list(devices)
    assert_valid_gpu_plan(plan, devices, DEFAULT_TOPOLOGY_NAMES)


def test_two_gpus_run_the_fitting_topologies_in_sequential_waves() -> None:
    names = ("baseline", "1E+1PD", "1P+1D")
    plan = build_plan(request(CUDA, (0, 1), names))
    assert [[t.name for t in w.topologies] for w in plan.waves] == [
        ["baseline"],
        ["1E+1PD"],
        ["1P+1D"],
    ]
    assert_valid_gpu_plan(plan, (0, 1), names)


def test_two_gpus_run_every_topology_in_sequence_with_the_encoder_sharing() -> None:
    plan = build_plan(request(CUDA, (0, 1)))
    assert len(plan.waves) == 4
    assert_valid_gpu_plan(plan, (0, 1), DEFAULT_TOPOLOGY_NAMES)
    epd = {i.name: i for i in plan.instances if i.name.startswith("1E+1P+1D/")}
    assert epd["1E+1P+1D/prefill0"].devices != epd["1E+1P+1D/decode0"].devices
    assert epd["1E+1P+1D/encoder0"].devices == epd["1E+1P+1D/prefill0"].devices
    # Upstream's own colocated layout (disagg_1e1p1d_example.sh): E 0.01 beside P 0.7.
    assert epd["1E+1P+1D/encoder0"].gpu_memory_fraction == 0.01
    assert epd["1E+1P+1D/prefill0"].gpu_memory_fraction == 0.7


def test_two_gpus_with_colocation_give_the_same_valid_plan() -> None:
    plan = build_plan(request(CUDA, (0, 1), colocate=True))
    assert len(plan.waves) == 4
    assert_valid_gpu_plan(plan, (0, 1), DEFAULT_TOPOLOGY_NAMES)
    epd = {i.name: i for i in plan.instances if i.name.startswith("1E+1P+1D/")}
    assert epd["1E+1P+1D/prefill0"].devices != epd["1E+1P+1D/decode0"].devices
    assert epd["1E+1P+1D/encoder0"].gpu_memory_fraction == 0.01
    assert epd["1E+1P+1D/decode0"].gpu_memory_fraction == 0.7


def test_one_gpu_is_an_error_for_every_multi_instance_topology_unless_colocated() -> None:
    with pytest.raises(DevicePlanError) as info:
        build_plan(request(CUDA, (0,)))
    assert "1E+1P+1D needs 2" in str(info.value)
    assert "1P+1D needs 2" in str(info.value)
    assert "1E+1PD needs" not in str(info.value), "E and PD share the one GPU"
    plan = build_plan(request(CUDA, (0,), colocate=True))
    assert_valid_gpu_plan(plan, (0,), DEFAULT_TOPOLOGY_NAMES)
    assert {i.devices for i in plan.instances} == {(0,)}
    for wave in plan.waves:
        shares = [i.gpu_memory_fraction for t in wave.topologies for i in t.instances]
        assert sum(shares) <= 0.9 + 1e-9, (wave.index, shares)


def test_a_bigger_host_than_needed_leaves_devices_unused_not_shared() -> None:
    plan = build_plan(request(CUDA, tuple(range(16)), ("1E+1P+1D",), colocate=True))
    assert [i.devices for i in plan.instances] == [(0,), (1,), (2,)]
    assert [i.gpu_memory_fraction for i in plan.instances] == [0.01, 0.7, 0.7]


# --- rendering -------------------------------------------------------------------------------


def test_cuda_plan_instances_carry_devices_nixl_ports_and_memory_flags() -> None:
    plan = build_plan(request(CUDA, tuple(range(8))))
    for instance in plan.instances:
        env = dict(instance.env)
        assert env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, instance.devices)), instance.name
        assert "--gpu-memory-utilization" in instance.argv
        assert instance.argv[:3] == (VLLM, "serve", MODEL)
        if instance.role in ("prefill", "decode"):
            assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(instance.side_channel_port)
        else:
            assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in env, instance.name


def test_cpu_plan_renders_what_a_run_launches() -> None:
    plan = build_plan(request(CPU, (0, 1), tuple(TOPOLOGIES)))
    assert sum(len(w.topologies) for w in plan.waves) == len(TOPOLOGIES)
    serving = ServingConfig(model=MODEL)
    for wave in plan.waves:
        for topology in wave.topologies:
            ports = [i.port for i in topology.instances]
            storage = Path("/runs/r1") / topology.name.replace("+", "-") / "storage"
            expected = place_instances(
                get_topology(topology.name), serving, CPU, ports, storage, topology.devices
            )
            assert [list(i.argv) for i in topology.instances] == [e.argv(VLLM) for e in expected]
            assert [dict(i.env) for i in topology.instances] == [e.env() for e in expected]


@pytest.mark.parametrize(
    "platform,devices,workers",
    [(CUDA, tuple(range(8)), 4), (CUDA, (0, 1), 1), (CPU, (0, 1), 1), (CPU, (0, 1), 2)],
)
def test_a_run_and_its_xdist_workers_use_the_devices_plan_prints(
    tmp_path: Path, platform: PlatformProfile, devices: tuple[int, ...], workers: int
) -> None:
    """Trap 6: `plan` once gave 1E+1P+1D three GPUs of 8 while each xdist worker got two.
    Now a run (and every worker) asks the same scheduler, with the same inputs."""
    from harness.run.sweep import Sweep, SweepSpec
    from harness.spec.settings import RunSettings
    from harness.spec.topology import EPD_TOPOLOGY_NAMES, serving_for

    budget = cpu_instance_budget(len(devices), available_memory_bytes(), workers)
    printed = build_plan(
        dataclasses.replace(
            request(platform, devices, DEFAULT_TOPOLOGY_NAMES, colocate=len(devices) < 3),
            cpu_budget=None if platform.exclusive_devices else budget,
        )
    )
    settings = RunSettings(
        serving_for(platform, MODEL),
        tmp_path / "run",
        platform=platform,
        devices=devices,
        colocate=len(devices) < 3,
        workers=workers,
    )
    spec = SweepSpec(tuple(TOPOLOGIES[n] for n in EPD_TOPOLOGY_NAMES), prompts=())
    sweep = Sweep(spec, settings)
    sweep.baseline.add({"text": {}})  # the baseline is not cached: it is scheduled too
    ran = {s.topology.name: s.devices for w in sweep.schedule().waves for s in w.slots}
    planned = {t.name: t.devices for w in printed.waves for t in w.topologies}
    assert ran == planned


def test_xpu_plan_pins_devices_with_ze_affinity_mask() -> None:
    plan = build_plan(request(XPU, (4, 5), ("1P+1D",)))
    envs = [dict(i.env) for i in plan.instances]
    assert [e["ZE_AFFINITY_MASK"] for e in envs] == ["4", "5"]
    assert not any("CUDA_VISIBLE_DEVICES" in e for e in envs)


def test_planning_reserves_no_port(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args, **_kwargs):
        raise AssertionError("plan must not reserve ports: they are placeholders")

    monkeypatch.setattr("harness.serve.ports.reserve_ports", refuse)
    monkeypatch.setattr("harness.serve.launcher.reserve_ports", refuse)
    plan = build_plan(request(CUDA, tuple(range(8))))
    assert plan.ports_are_placeholders
    assert [i.port for i in plan.instances][:3] == [20000, 20001, 20002]


def test_format_plan_shows_the_schedule_and_every_command() -> None:
    plan = build_plan(request(CUDA, tuple(range(8))))
    text = format_plan(plan)
    assert "  wave 1: baseline [0], 1E+1PD [1,2], 1P+1D [3,4], 1E+1P+1D [5,6,7]" in text
    assert "placeholders" in text
    for instance in plan.instances:
        assert f"argv: {instance.command_line}" in text
        assert f"CUDA_VISIBLE_DEVICES={instance.devices[0]}" in text


# --- command line ----------------------------------------------------------------------------


def test_cli_prints_the_eight_gpu_plan(epd_cli) -> None:
    code, out, err = epd_cli(
        "plan", "--platform", "cuda", "--devices", "0,1,2,3,4,5,6,7", "--vllm", "vllm"
    )
    assert code == 0, err
    assert "wave 1: baseline [0], 1E+1PD [1,2], 1P+1D [3,4], 1E+1P+1D [5,6,7]" in out
    assert "wave 2" not in out
    assert "Qwen/Qwen2.5-VL-3B-Instruct" in out


def test_cli_four_gpu_plan_shows_enforce_eager_and_upstreams_memory_shares(epd_cli) -> None:
    code, out, err = epd_cli("plan", "--platform", "cuda", "--devices", "0,1,2,3", "--vllm", "vllm")
    assert code == 0, err
    assert "eager: every instance runs --enforce-eager" in out
    assert "gpu memory shares (upstream's): baseline 0.9, encoder 0.01, pd 0.7" in out
    argvs = [line for line in out.splitlines() if line.startswith("    argv: ")]
    assert argvs and all("--enforce-eager" in line for line in argvs)
    shares = {
        line.split(" (", 1)[1].split(")", 1)[0]: line.split("gpu memory ", 1)[1].split(",")[0]
        for line in out.splitlines()
        if "gpu memory " in line and line.startswith("  ")
    }
    assert shares == {
        "baseline": "0.9",
        "encoder": "0.01",
        "pd": "0.7",
        "prefill": "0.7",
        "decode": "0.7",
    }
    code, out, err = epd_cli(
        "plan", "--platform", "cuda", "--devices", "0,1,2,3", "--no-enforce-eager", "--json"
    )
    assert code == 0, err
    data = json.loads(out)
    assert data["enforce_eager"] is False
    assert not any(
        "--enforce-eager" in i["argv"]
        for w in data["waves"]
        for t in w["topologies"]
        for i in t["instances"]
    )


def test_cli_plan_of_a_t4_box_shows_float16_on_every_instance(epd_cli) -> None:
    """`plan` shares run's --dtype: what a T4 / V100 box serves is what its plan shows."""
    argv = ("plan", "--platform", "cuda", "--devices", "0,1,2,3", "--vllm", "vllm")
    code, out, err = epd_cli(*argv, "--dtype", "float16")
    assert code == 0, err
    assert "dtype: every instance runs --dtype float16" in out
    code, out, err = epd_cli(*argv, "--dtype", "float16", "--json")
    data = json.loads(out)
    assert data["dtype"] == "float16"
    dtypes = {
        i["argv"][i["argv"].index("--dtype") + 1]
        for w in data["waves"]
        for t in w["topologies"]
        for i in t["instances"]
    }
    assert dtypes == {"float16"}
    code, out, err = epd_cli(*argv)
    assert "dtype: every instance runs --dtype bfloat16" in out


def test_cli_plan_of_bfloat16_on_this_hosts_t4s_is_refused_as_run_refuses_it(
    epd_cli, gpus_here: list[str | None]
) -> None:
    """`plan --platform cuda` on a T4 box printed a bfloat16 plan that `run` then refused
    (found walking a T4 box on fakes): where nvidia-smi lists the planned GPUs, the plan
    refuses in run's words (tests/test_bad_input.py shows both on a fake nvidia-smi)."""
    gpus_here[0] = T4_BOX
    argv = ("plan", "--platform", "cuda", "--devices", "0,1", "--vllm", "vllm")
    refusal = (
        "needs compute capability 8.0 or more, which vLLM checks only once an instance has "
        "started, and GPU 0 (Tesla T4, compute capability 7.5), GPU 1 (Tesla T4, compute "
        "capability 7.5) have less: pass --dtype float16"
    )
    code, out, err = epd_cli(*argv)
    assert (code, out) == (2, "")
    assert err == f"epd-harness: error: --dtype bfloat16 (the default) {refusal}\n"
    code, out, err = epd_cli(*argv, "--dtype", "bfloat16", "--json")
    assert (code, out, err) == (2, "", f"epd-harness: error: --dtype bfloat16 {refusal}\n")
    code, out, err = epd_cli(*argv, "--dtype", "float16")
    assert code == 0, err
    assert "dtype: every instance runs --dtype float16" in out


def test_cli_plan_for_gpus_this_host_does_not_list_plans_as_before(
    epd_cli, gpus_here: list[str | None]
) -> None:
    """A plan for another machine: nvidia-smi unreadable (a CPU host), or listing none of
    the planned GPUs, refuses nothing; a CPU plan reads no GPU. `check_plan_arguments` (a
    command line only shown, tests/test_docs_commands.py) never reads this host's GPUs."""
    from harness.cli.main import check_command_line

    argv = ("plan", "--platform", "cuda", "--devices", "2,3", "--vllm", "vllm")
    for listing in (None, T4_BOX):
        gpus_here[0] = listing
        code, out, err = epd_cli(*argv)
        assert code == 0, err
        assert "dtype: every instance runs --dtype bfloat16" in out
    gpus_here[0] = T4_BOX
    check_command_line(["plan", "--platform", "cuda", "--devices", "0,1"])
    code, out, err = epd_cli("plan", "--devices", "0,1", "--vllm", "vllm")
    assert code == 0, err


def test_cli_refuses_no_enforce_eager_on_cpu(epd_cli) -> None:
    code, out, err = epd_cli("plan", "--no-enforce-eager", "--model", MODEL, "--vllm", "vllm")
    assert (code, out) == (2, "")
    assert err.startswith("epd-harness: error: --no-enforce-eager lets vLLM capture GPU graphs")
    assert err.count("\n") == 1


def test_cli_json_is_the_plan_as_data(epd_cli) -> None:
    argv = ["--platform", "cuda", "--devices", "0,1", "--topology", "1P+1D", "--model", MODEL]
    code, out, _ = epd_cli("plan", *argv, "--vllm", VLLM, "--json")
    assert code == 0
    data = json.loads(out)
    assert data["platform"] == "cuda"
    assert data["ports_are_placeholders"] is True
    (instance, _decode) = data["waves"][-1]["topologies"][0]["instances"]  # after the baseline
    assert instance["name"] == "1P+1D/prefill0"
    assert instance["argv"][:3] == [VLLM, "serve", MODEL]


@pytest.mark.parametrize(
    ("asked", "waves"),
    [
        ("1E+1P+1D", [["baseline", "1P+1D"], ["1E+1P+1D"]]),
        ("1E+1PD", [["baseline", "1E+1PD"]]),
        ("2E+1PD", [["baseline", "2E+1PD"]]),
    ],
)
def test_cli_plan_of_some_topologies_adds_what_their_run_starts_besides(
    epd_cli, asked: str, waves: list
) -> None:
    """`plan --topology 1E+1P+1D` printed 1E+1P+1D alone, on devices 0-2: the run serves the
    baseline and 1P+1D (its exact reference) too, and puts 1E+1P+1D elsewhere."""
    argv = ["--platform", "cuda", "--devices", "0,1,2,3", "--topology", asked]
    code, out, err = epd_cli("plan", *argv, "--vllm", "vllm", "--json")
    assert code == 0, err
    planned = json.loads(out)["waves"]
    assert [[t["name"] for t in w["topologies"]] for w in planned] == waves


def test_cli_topologies_are_repeatable_and_comma_separated(epd_cli) -> None:
    argv = ["--platform", "cuda", "--devices", "0,1,2", "--topology", "baseline,1P+1D"]
    code, out, _ = epd_cli("plan", *argv, "--topology", "1E+1P+1D", "--vllm", "vllm", "--json")
    assert code == 0
    waves = json.loads(out)["waves"]
    assert [[t["name"] for t in w["topologies"]] for w in waves] == [
        ["baseline", "1P+1D"],
        ["1E+1P+1D"],
    ]


@pytest.mark.parametrize(
    ("argv", "cause"),
    [
        (["--platform", "cuda", "--devices", "0,0"], "device 0 is listed twice"),
        (["--platform", "cuda", "--devices", "a"], "device 'a'"),
        (["--platform", "cuda", "--devices", "-1"], "device '-1'"),
        (["--platform", "cuda", "--devices", "0"], "1E+1P+1D needs 2"),
        (["--platform", "cuda"], "--devices is required with --platform cuda"),
        (["--platform", "cuda", "--devices", "0,1,2", "--topology", "nope"], "unknown topology"),
        (["--topology", "1P+1D,1P+1D"], "topology 1P+1D is listed twice"),
        (["--colocate"], "--colocate shares GPUs within a topology; on cpu"),
    ],
)
def test_cli_bad_input_is_exit_2_with_one_line_naming_the_cause(
    argv: list[str], cause: str, epd_cli
) -> None:
    code, out, err = epd_cli("plan", *argv, "--model", MODEL, "--vllm", "vllm")
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1, err
    assert err.startswith("epd-harness: error: ")
    assert cause in err


def test_the_common_environment_is_only_what_every_instance_has(epd_cli) -> None:
    """Printed once as every instance's, an entry must be every instance's: each GPU
    instance's own device is printed with it, never in the common line."""
    argv = ["--platform", "cuda", "--devices", "0,1,2", "--topology", "1E+1P+1D"]
    code, out, err = epd_cli("plan", *argv, "--model", MODEL, "--vllm", "vllm")
    assert code == 0, err
    common = next(line for line in out.splitlines() if line.startswith("environment of every"))
    assert "CUDA_VISIBLE_DEVICES" not in common, common
    own = [line for line in out.splitlines() if line.startswith("    env: ")]
    assert own and all("CUDA_VISIBLE_DEVICES=" in line for line in own), own


def test_cli_too_few_gpus_for_the_one_topology_named_offers_only_colocate(epd_cli) -> None:
    """The baseline plan adds beside the topology named is no topology the user chose: leaving
    the one named out would plan the whole sweep, so it is not offered (`run` too)."""
    argv = ["--platform", "cuda", "--devices", "0", "--topology", "1P+1D", "--vllm", "vllm"]
    code, out, err = epd_cli("plan", *argv)
    assert (code, out) == (2, "")
    assert err.rstrip().endswith("; use --colocate to share devices within a topology"), err


def test_cli_one_gpu_with_colocate_is_a_valid_plan(epd_cli) -> None:
    argv = ["--platform", "cuda", "--devices", "0", "--colocate", "--vllm", "vllm"]
    code, out, err = epd_cli("plan", *argv)
    assert code == 0, err
    assert "  wave 4: 1E+1P+1D [0]" in out
    assert "gpu memory 0.35," in out, "P and D split what the device leaves beside E"


def test_cli_cpu_defaults_to_the_runner_cores(epd_cli) -> None:
    code, out, _ = epd_cli("plan", "--model", MODEL, "--vllm", "vllm", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["platform"] == "cpu"
    assert data["devices"] == [0, 1]
    names = [t["name"] for w in data["waves"] for t in w["topologies"]]
    assert names == list(DEFAULT_TOPOLOGY_NAMES)


def test_cli_cpu_plan_says_where_the_worker_runs_and_on_which_cores(epd_cli) -> None:
    argv = ["--topology", "1P+1D", "--devices", "0,1", "--model", MODEL, "--vllm", "vllm"]
    code, out, err = epd_cli("plan", *argv)
    assert code == 0, err
    assert (
        "worker: inside each instance's engine core (--distributed-executor-backend uni, as on "
        "a one-device GPU), each instance's processes confined to the cores 0,1" in out
    )
    assert "1P+1D/decode0 (decode): port " in out and ", cores 0,1" in out
    code, out, err = epd_cli("plan", "--platform", "cuda", "--devices", "0,1", "--vllm", "vllm")
    assert code == 0, err
    assert "worker: inside" not in out and "--distributed-executor-backend" not in out


def test_the_plan_says_what_is_shared() -> None:
    from harness.cli.plan import PlannedInstance, sharing_line

    def instance(name: str, port: int, storage: str) -> PlannedInstance:
        argv = ("vllm", "serve", "m", "--port", str(port), "--ec", storage)
        return PlannedInstance(name, "encoder", port, (0,), argv, (("A", "1"),), None, None)

    separate = sharing_line(
        [instance("1E+1PD/e0", 1, "/a/ec"), instance("1E+1P+1D/e0", 2, "/b/ec")]
    )
    assert separate.endswith(
        "instances shared between topologies: none (each topology's EC and KV storage is its own)"
    )
    same = sharing_line([instance("1E+1PD/e0", 1, "/s/ec"), instance("1E+1P+1D/e0", 2, "/s/ec")])
    assert same.endswith("1E+1PD/e0 = 1E+1P+1D/e0"), same
    plan = format_plan(build_plan(request(CUDA, tuple(range(8)))))
    assert "instances shared between topologies: none" in plan
    # Two instances of one topology launched alike (2E+1PD's encoders) are two processes.
    twins = sharing_line([instance("2E+1PD/e0", 1, "/s/ec"), instance("2E+1PD/e1", 2, "/s/ec")])
    assert twins.endswith(
        "instances shared between topologies: none (each topology's EC and KV storage is its own)"
    ), twins


def test_cli_plans_the_kv_connector_run_would_serve(epd_cli) -> None:
    """`run --platform cuda --kv-connector example` serves ExampleConnector where the GPU
    default is NIXL: the plan shows the lines that run will start, not the default's."""
    argv = ["--platform", "cuda", "--devices", "0,1", "--topology", "1P+1D", "--model", MODEL]
    code, out, err = epd_cli("plan", *argv, "--vllm", VLLM, "--json")
    assert code == 0, err
    default = json.loads(out)
    assert default["kv_connector"] == "NixlConnector"
    code, out, err = epd_cli("plan", *argv, "--kv-connector", "example", "--vllm", VLLM, "--json")
    assert code == 0, err
    chosen = json.loads(out)
    assert chosen["kv_connector"] == "ExampleConnector"
    argvs = [" ".join(i["argv"]) for i in chosen["waves"][-1]["topologies"][0]["instances"]]
    assert all("ExampleConnector" in a and "NixlConnector" not in a for a in argvs), argvs


@pytest.mark.parametrize(
    ("argv", "cause"),
    [
        (["--topology", "baseline", "--kv-connector", "nixl"], "none of baseline has a D"),
        # As `run` says it: the topologies asked for, not the baseline planned beside them.
        (["--topology", "1E+1PD", "--kv-connector", "nixl"], "and none of 1E+1PD has a D;"),
        (["--topology", "1P+1D", "--ec-connector", "example"], "and none of 1P+1D has an E;"),
        (["--kv-connector", "lmcache"], "lmcache"),
        (["--ec-connector", "mooncake"], "cannot run"),
    ],
)
def test_cli_refuses_a_connector_the_plan_would_ignore_or_cannot_serve(
    argv: list[str], cause: str, epd_cli
) -> None:
    code, out, err = epd_cli("plan", *argv, "--model", MODEL, "--vllm", VLLM)
    assert (code, out) == (2, "")
    assert err.startswith("epd-harness: error: ") and cause in err and err.count("\n") == 1, err


def test_side_by_side_with_colocation_shares_the_devices_the_baseline_leaves() -> None:
    """Fuzzing serves the baseline and its topology at once. On 2 GPUs with --colocate (the
    2-GPU nightly's shape) the topology was refused ("together they need 3 devices, but only
    2 given (0,1); ... let instances share with --colocate"), colocation given: it only
    shrank a topology that could not fit at all, so the nightly's planted-fuzz scenario
    failed there (seen with the fake vLLM)."""
    from harness.spec.placement import side_by_side

    baseline = get_topology("baseline")
    for name in ("1E+1PD", "1P+1D", "1E+1P+1D"):
        together = side_by_side((baseline, get_topology(name)), (0, 1), CUDA, colocate=True)
        assert together == {"baseline": (0,), name: (1,)}, together
    wide = side_by_side((baseline, get_topology("1E+1P+1D")), (0, 1, 2), CUDA, colocate=True)
    assert wide == {"baseline": (0,), "1E+1P+1D": (1, 2)}, wide
    roomy = side_by_side((baseline, get_topology("1E+1PD")), (0, 1, 2, 3), CUDA, colocate=True)
    assert roomy == {"baseline": (0,), "1E+1PD": (1, 2)}, roomy  # shares only for want of room
    with pytest.raises(DevicePlanError, match="only 2 given"):
        side_by_side((baseline, get_topology("1E+1PD")), (0, 1), CUDA)
    with pytest.raises(DevicePlanError, match="only 1 given"):
        side_by_side((baseline, get_topology("1E+1PD")), (0,), CUDA, colocate=True)


def test_the_plan_prints_which_instances_sharing_a_gpu_start_one_after_another() -> None:
    """Instances on one GPU are spawned one after another (harness.spec.placement.start_after):
    the plan says so, per topology and per instance; on CPU it says nothing of it."""
    one = build_plan(request(CUDA, (0,), colocate=True))
    text = format_plan(one)
    assert "1E+1P+1D: prefill0 after encoder0, decode0 after prefill0" in text, text
    assert "1E+1PD: pd0 after encoder0" in text and "1P+1D: decode0 after prefill0" in text
    assert "spawned once 1E+1PD/encoder0 is healthy" in text
    epd = {i.name: i for i in one.instances}
    assert epd["1E+1P+1D/decode0"].start_after == ("1E+1P+1D/prefill0",)
    assert one.to_json()["waves"][3]["topologies"][0]["instances"][2]["start_after"] == (
        "1E+1P+1D/prefill0",
    )
    two = format_plan(build_plan(request(CUDA, (0, 1), colocate=True)))
    assert "start order:" in two and "1E+1P+1D: prefill0 after encoder0" in two
    assert "decode0 after" not in two, "decode0 has a GPU of its own: it starts at once"
    eight = format_plan(build_plan(request(CUDA, tuple(range(8)))))
    assert "no device is shared" in eight
    assert "start order" not in format_plan(build_plan(request(CPU, (0, 1))))


def test_cli_plan_names_a_relative_run_dirs_storage_from_the_working_directory(
    epd_cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative --run-dir is the directory it names from where `plan` was run, as `run`
    resolves it: the plan's EC / KV storage paths are absolute there, not `r1/...` that an
    instance started from another directory would read as another place."""
    monkeypatch.chdir(tmp_path)
    argv = ("plan", "--platform", "cuda", "--devices", "0,1,2,3", "--vllm", "vllm", "--json")
    code, out, err = epd_cli(*argv, "--run-dir", "r1")
    assert code == 0, err
    argvs = [
        " ".join(i["argv"])
        for w in json.loads(out)["waves"]
        for t in w["topologies"]
        for i in t["instances"]
    ]
    assert any(str(tmp_path / "r1") in line for line in argvs), argvs
    assert not any(" r1/" in line or "'r1/" in line or '"r1/' in line for line in argvs), argvs


def test_a_cpu_plan_without_a_budget_shares_this_machine_among_its_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A CPU plan given no budget packs its waves within what this machine gives each of its
    `workers` xdist workers (`cpu_instance_budget`), as each worker's run packs them: planned
    for the machine whole, two workers' plan put twice the instances in a wave."""
    from harness.cli import plan as plan_module

    memory = 64 * 1024**3  # more than four cores' instances need: the cores decide
    monkeypatch.setattr(plan_module, "available_memory_bytes", lambda: memory)
    alone = request(CPU, (0, 1, 2, 3))
    shared = dataclasses.replace(alone, workers=2)

    def waves(plan: Plan) -> list[list[str]]:
        return [[t.name for t in w.topologies] for w in plan.waves]

    given = dataclasses.replace(alone, cpu_budget=cpu_instance_budget(4, memory, workers=2))
    assert waves(build_plan(shared)) == waves(build_plan(given))
    assert waves(build_plan(shared)) != waves(build_plan(alone))


def test_the_text_plan_names_each_kv_instances_nixl_side_channel_port() -> None:
    """A shared NIXL side-channel port is one of the mistakes a plan is read for: the text
    names each P's and D's port, as the JSON does."""
    plan = build_plan(request(CUDA, tuple(range(8))))
    text = format_plan(plan)
    holders = [i for i in plan.instances if i.side_channel_port is not None]
    assert holders, "a NIXL plan has side-channel ports"
    for instance in holders:
        assert f"nixl side channel {instance.side_channel_port}" in text, instance.name


def test_an_instances_env_line_holds_only_what_the_common_environment_lacks(epd_cli) -> None:
    """The common environment is printed once: each instance's env line adds its own entries
    only (each repeating the common ones buried the one that differs, its device)."""
    argv = ["--platform", "cuda", "--devices", "0,1,2", "--topology", "1E+1P+1D"]
    code, out, err = epd_cli("plan", *argv, "--model", MODEL, "--vllm", "vllm")
    assert code == 0, err
    common_line = next(line for line in out.splitlines() if line.startswith("environment of"))
    common = common_line.partition(": ")[2].split()
    own = [line for line in out.splitlines() if line.startswith("    env: ")]
    assert common and own, out
    for line in own:
        assert not set(line.partition(": ")[2].split()) & set(common), line


def test_a_colocated_plan_says_colocation_is_allowed(epd_cli) -> None:
    argv = ["--platform", "cuda", "--devices", "0", "--vllm", "vllm"]
    code, out, err = epd_cli("plan", *argv, "--colocate")
    assert code == 0 and out.splitlines()[0].endswith(", colocation allowed"), out + err
    code, out, err = epd_cli("plan", *argv[:3], "0,1,2,3,4,5,6,7", *argv[4:])
    assert code == 0 and "colocation" not in out.splitlines()[0], out + err
