"""Platform profiles and device placement: what cpu / cuda / xpu instances render, nothing launched.

The GPU renderings are checked here because no GPU runs these tests: a wrong CUDA_VISIBLE_DEVICES
or a shared NIXL side-channel port would otherwise first show up as a confusing nightly failure.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.spec.instances import InstanceSpec
from harness.spec.placement import (
    ENCODER_ROOM,
    assign_devices,
    cpu_instance_budget,
    memory_fractions,
    place_instances,
    schedule,
    side_channel_port_count,
)
from harness.spec.platforms import (
    CPU,
    CPU_ONLY_ENV_KEYS,
    CUDA,
    DEFAULT_GPU_MEMORY_FRACTION,
    XPU,
    DevicePlanError,
    check_host_devices,
    check_inherited_devices,
    get_platform,
    inherited_devices,
    parse_devices,
)
from harness.spec.topology import (
    EPD_TOPOLOGY_NAMES,
    TOPOLOGIES,
    Role,
    ServingConfig,
    get_topology,
    serving_for,
)

pytestmark = pytest.mark.unit

MODEL = "/models/qwen"
EIGHT_GPUS = tuple(range(8))
DEFAULT_SET = tuple(get_topology(n) for n in ("baseline", *EPD_TOPOLOGY_NAMES))


def flag_value(argv: list[str], flag: str) -> str | None:
    assert argv.count(flag) <= 1, f"{flag} repeated in {argv}"
    return argv[argv.index(flag) + 1] if flag in argv else None


def place_all(profile, devices, tmp_path: Path, topologies=DEFAULT_SET, colocate=False):
    """Every instance of every topology, placed as the schedule says, with distinct fake ports."""
    serving = serving_for(profile, MODEL)
    ports = iter(range(21000, 22000))
    specs: list[InstanceSpec] = []
    for wave in schedule(topologies, devices, profile, colocate).waves:
        for slot in wave.slots:
            topology = slot.topology
            http = [next(ports) for _ in topology.roles]
            side = [next(ports) for _ in range(side_channel_port_count(topology, serving))]
            specs += place_instances(
                topology,
                serving,
                profile,
                http,
                tmp_path / topology.name,
                slot.devices,
                colocate=colocate,
                side_channel_ports=side,
            )
    return specs


# --- profiles --------------------------------------------------------------------------------


def test_platforms_are_looked_up_by_name_or_refused_naming_the_known_ones() -> None:
    assert get_platform("cuda") is CUDA
    with pytest.raises(ValueError, match=r"unknown platform 'tpu' \(known: cpu, cuda, xpu\)"):
        get_platform("tpu")


def test_serving_for_cpu_is_todays_default_and_cuda_uses_nixl_eager_like_upstream() -> None:
    assert serving_for(CPU, MODEL) == ServingConfig(model=MODEL)
    cuda = serving_for(CUDA, MODEL)
    assert cuda.kv_connector == "NixlConnector"
    assert cuda.enforce_eager is True, "upstream's correctness script serves eager"
    assert serving_for(CUDA, MODEL, enforce_eager=False).enforce_eager is False
    assert serving_for(CUDA, MODEL, max_model_len=2048).max_model_len == 2048


# --- cpu: exactly what topology.py renders ---------------------------------------------------


@pytest.mark.parametrize("name", list(TOPOLOGIES))
def test_cpu_placement_renders_exactly_what_topology_renders(name: str, tmp_path: Path) -> None:
    topology = get_topology(name)
    serving = ServingConfig(model=MODEL)
    ports = list(range(23000, 23000 + len(topology.roles)))
    cores = (3, 5)
    expected = place_instances(topology, serving, CPU, ports, tmp_path, cores)
    placed = place_instances(topology, serving, CPU, ports, tmp_path, cores)
    assert [p.argv("/v/vllm") for p in placed] == [e.argv("/v/vllm") for e in expected]
    assert [p.env() for p in placed] == [e.env() for e in expected]
    assert [p.devices for p in placed] == [e.devices for e in expected]
    assert all(p.side_channel_port is None and p.gpu_memory_fraction is None for p in placed)


# --- cuda ------------------------------------------------------------------------------------


def test_cuda_instances_get_distinct_devices_and_side_channel_ports(tmp_path: Path) -> None:
    specs = place_all(CUDA, EIGHT_GPUS, tmp_path)
    envs = {spec.name: spec.env() for spec in specs}
    visible = [env["CUDA_VISIBLE_DEVICES"] for env in envs.values()]
    assert sorted(visible) == [str(d) for d in EIGHT_GPUS], visible
    port_key = "VLLM_NIXL_SIDE_CHANNEL_PORT"
    nixl = {name: env[port_key] for name, env in envs.items() if port_key in env}
    kv_instances = {s.name for s in specs if s.role in (Role.PREFILL, Role.DECODE)}
    assert (
        set(nixl)
        == kv_instances
        == {
            "1P+1D/prefill0",
            "1P+1D/decode0",
            "1E+1P+1D/prefill0",
            "1E+1P+1D/decode0",
        }
    )
    assert len(set(nixl.values())) == len(nixl), nixl
    http_ports = {str(s.port) for s in specs}
    assert not http_ports & set(nixl.values()), "a side-channel port collides with an HTTP port"
    for name in nixl:
        assert envs[name]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    # nvidia-smi's numbering, which --devices and the plan use: CUDA's own differs on mixed GPUs.
    assert {env["CUDA_DEVICE_ORDER"] for env in envs.values()} == {"PCI_BUS_ID"}


def test_cuda_kv_config_is_nixl_with_a_cuda_buffer(tmp_path: Path) -> None:
    specs = {s.name: s for s in place_all(CUDA, EIGHT_GPUS, tmp_path)}
    for name, role in (("1E+1P+1D/prefill0", "kv_producer"), ("1E+1P+1D/decode0", "kv_consumer")):
        config = json.loads(flag_value(specs[name].argv(), "--kv-transfer-config"))
        assert config == {
            "kv_connector": "NixlConnector",
            "kv_role": role,
            "kv_buffer_device": "cuda",
        }, name
    assert flag_value(specs["1E+1PD/pd0"].argv(), "--kv-transfer-config") is None


def test_cuda_argv_sets_upstreams_memory_shares_and_eager_and_env_drops_cpu_keys(
    tmp_path: Path,
) -> None:
    upstream = {
        "baseline": "0.9",
        "encoder": "0.01",
        "pd": "0.7",
        "prefill": "0.7",
        "decode": "0.7",
    }
    for spec in place_all(CUDA, EIGHT_GPUS, tmp_path):
        argv, env = spec.argv(), spec.env()
        assert flag_value(argv, "--gpu-memory-utilization") == upstream[spec.role.value], spec.name
        assert "--enforce-eager" in argv, spec.name
        assert not set(CPU_ONLY_ENV_KEYS) & set(env), (spec.name, env)
        assert env["HF_HUB_OFFLINE"] == "1"
        assert "ZE_AFFINITY_MASK" not in env


def test_platform_flags_go_before_extra_args(tmp_path: Path) -> None:
    serving = serving_for(CUDA, MODEL, extra_args=("--seed", "0"))
    topology = get_topology("1P+1D")
    specs = place_instances(
        topology, serving, CUDA, [21000, 21001], tmp_path, (4, 6), side_channel_ports=[21002, 21003]
    )
    assert specs[0].argv()[-4:] == ["--gpu-memory-utilization", "0.7", "--seed", "0"]
    assert [s.devices for s in specs] == [(4,), (6,)]


def test_missing_device_or_side_channel_port_is_an_error_naming_the_instance() -> None:
    serving = serving_for(CUDA, MODEL)
    no_device = InstanceSpec("t/baseline0", Role.BASELINE, 21000, serving, platform=CUDA)
    with pytest.raises(ValueError, match="t/baseline0: cuda needs a device"):
        no_device.env()
    no_port = InstanceSpec("t/decode0", Role.DECODE, 21001, serving, platform=CUDA, devices=(0,))
    missing = "t/decode0: NixlConnector needs a VLLM_NIXL_SIDE_CHANNEL_PORT"
    with pytest.raises(ValueError, match=missing):
        no_port.env()


def test_place_instances_rejects_a_wrong_number_of_side_channel_ports(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"1P\+1D needs 2 NIXL side-channel ports, got 1"):
        place_instances(
            get_topology("1P+1D"),
            serving_for(CUDA, MODEL),
            CUDA,
            [21000, 21001],
            tmp_path,
            (0, 1),
            side_channel_ports=[21002],
        )


def test_side_channel_ports_only_for_nixl_kv_instances() -> None:
    nixl, example = serving_for(CUDA, MODEL), serving_for(CPU, MODEL)
    counts = {name: side_channel_port_count(t, nixl) for name, t in TOPOLOGIES.items()}
    assert counts == {"baseline": 0, "1E+1PD": 0, "1P+1D": 2, "1E+1P+1D": 2, "2E+1PD": 0}
    assert all(side_channel_port_count(t, example) == 0 for t in TOPOLOGIES.values())


def test_side_channel_ports_one_per_nixl_kv_instance() -> None:
    assert side_channel_port_count(get_topology("1E+1P+1D"), serving_for(CUDA, MODEL)) == 2
    assert side_channel_port_count(get_topology("1E+1PD"), serving_for(CUDA, MODEL)) == 0
    assert side_channel_port_count(get_topology("1P+1D"), serving_for(CPU, MODEL)) == 0


# --- xpu -------------------------------------------------------------------------------------


def test_xpu_uses_ze_affinity_mask_and_an_xpu_nixl_buffer(tmp_path: Path) -> None:
    specs = place_all(XPU, (2, 3, 4), tmp_path, topologies=(get_topology("1E+1P+1D"),))
    assert [s.env()["ZE_AFFINITY_MASK"] for s in specs] == ["2", "3", "4"]
    assert all(
        "CUDA_VISIBLE_DEVICES" not in s.env() and "CUDA_DEVICE_ORDER" not in s.env() for s in specs
    )
    decode = json.loads(flag_value(specs[2].argv(), "--kv-transfer-config"))
    assert decode["kv_buffer_device"] == "xpu"


# --- device lists ----------------------------------------------------------------------------


def test_parse_devices_accepts_a_comma_list() -> None:
    assert parse_devices("0,1, 7") == (0, 1, 7)
    assert parse_devices("3") == (3,)


@pytest.mark.parametrize(
    ("text", "cause"),
    [
        ("0,0", "device 0 is listed twice in '0,0'"),
        ("1,2,1", "device 1 is listed twice"),
        ("a", "device 'a' in 'a' is not a non-negative integer"),
        ("-1", "device '-1' in '-1' is not a non-negative integer"),
        ("1.5", "device '1.5'"),
        ("", "no devices given"),
        ("0,,1", "empty entry in device list '0,,1'"),
        # a digit to str.isdigit() that int() cannot read: refused, not a ValueError
        ("0,\u00b2", "device '\u00b2' in '0,\u00b2' is not a non-negative integer"),
        ("\u0661", "is not a non-negative integer"),  # Arabic-Indic one: int() reads it as 1
    ],
)
def test_parse_devices_rejects_bad_lists_in_one_line(text: str, cause: str) -> None:
    with pytest.raises(DevicePlanError) as info:
        parse_devices(text)
    assert cause in str(info.value)
    assert "\n" not in str(info.value)


# --- assignment and memory -------------------------------------------------------------------


def test_gpu_assignment_is_one_device_per_instance() -> None:
    topology = get_topology("1E+1P+1D")
    assert assign_devices(topology, (5, 6, 7, 8), CUDA) == ((5,), (6,), (7,))
    # Short of devices, the encoder shares; P and D still need one each.
    assert assign_devices(topology, (0, 1), CUDA) == ((0,), (0,), (1,))
    with pytest.raises(DevicePlanError, match=r"1E\+1P\+1D needs 2 devices .* got 1: 0"):
        assign_devices(topology, (0,), CUDA)


def test_colocation_spreads_prefill_and_decode_first_and_encoders_fill_in() -> None:
    roles_devices = assign_devices(get_topology("1E+1P+1D"), (0, 1), CUDA, colocate=True)
    encoder, prefill, decode = roles_devices
    assert prefill != decode, "P and D must not share when there is a device for each"
    assert encoder == prefill == (0,)
    assert assign_devices(get_topology("2E+1PD"), (0, 1), CUDA, colocate=True) == (
        (1,),
        (0,),
        (0,),
    )
    assert set(assign_devices(get_topology("1P+1D"), (3,), CUDA, colocate=True)) == {(3,)}


def test_memory_fractions_are_upstreams_shares_on_devices_of_their_own() -> None:
    roles = (Role.ENCODER, Role.PREFILL, Role.DECODE)
    assert memory_fractions(roles, ((0,), (1,), (2,)), CUDA) == (0.01, 0.7, 0.7)
    assert memory_fractions((Role.BASELINE,), ((0,),), CUDA) == (0.9,)
    assert memory_fractions((Role.ENCODER, Role.PREFILL_DECODE), ((0,), (1,)), CUDA) == (0.01, 0.7)
    assert memory_fractions(roles, ((0,), (1,), (2,)), CPU) == (None, None, None)


def test_an_encoder_beside_p_leaves_p_upstreams_share_and_kv_holders_split_the_rest() -> None:
    roles = (Role.ENCODER, Role.PREFILL, Role.DECODE)
    # Upstream's own disagg_1e1p1d_example.sh: E and P on one GPU at 0.01 and 0.7.
    assert memory_fractions(roles, ((0,), (0,), (1,)), CUDA) == (0.01, 0.7, 0.7)
    assert memory_fractions(roles, ((0,), (1,), (1,)), CUDA) == (0.01, 0.45, 0.45)
    assert memory_fractions(roles, ((0,), (0,), (0,)), CUDA) == (0.01, 0.35, 0.35)
    two_encoders = (Role.ENCODER, Role.ENCODER, Role.PREFILL_DECODE)
    assert memory_fractions(two_encoders, ((1,), (0,), (0,)), CUDA) == (0.01, 0.01, 0.7)
    assert memory_fractions(two_encoders, ((0,), (0,), (0,)), CUDA) == (0.01, 0.01, 0.5)
    # Rounded down, never to the nearest: 0.5 / 3 is 0.16 each (3 x 0.17 + 2 x 0.2 = 0.91 would
    # pass the device's 0.9).
    crowded = (*two_encoders, Role.PREFILL, Role.DECODE)
    assert memory_fractions(crowded, ((0,),) * 5, CUDA) == (0.01, 0.01, 0.16, 0.16, 0.16)


@pytest.mark.parametrize("name", list(TOPOLOGIES))
@pytest.mark.parametrize("devices", [1, 2, 3])
def test_a_shared_devices_shares_and_encoder_room_never_exceed_its_budget(
    name: str, devices: int
) -> None:
    topology = get_topology(name)
    assignment = assign_devices(topology, tuple(range(devices)), CUDA, colocate=True)
    fractions = memory_fractions(topology.roles, assignment, CUDA)
    for device in range(devices):
        on_it = [
            (role, share)
            for role, where, share in zip(topology.roles, assignment, fractions)
            if device in where
        ]
        holders = sum(share for role, share in on_it if role is not Role.ENCODER)
        room = ENCODER_ROOM * sum(1 for role, _ in on_it if role is Role.ENCODER)
        assert holders + room <= DEFAULT_GPU_MEMORY_FRACTION + 1e-9, (name, device, on_it)


def test_encoders_that_leave_no_room_are_one_error_naming_the_device() -> None:
    roles = (*(Role.ENCODER,) * 5, Role.PREFILL_DECODE)
    with pytest.raises(DevicePlanError, match="device 3: 5 encoders leave its KV-holding"):
        memory_fractions(roles, tuple((3,) for _ in roles), CUDA)


def test_colocated_instances_render_their_share(tmp_path: Path) -> None:
    specs = place_all(CUDA, (0,), tmp_path, topologies=(get_topology("1E+1P+1D"),), colocate=True)
    assert {s.env()["CUDA_VISIBLE_DEVICES"] for s in specs} == {"0"}
    assert [flag_value(s.argv(), "--gpu-memory-utilization") for s in specs] == [
        "0.01",
        "0.35",
        "0.35",
    ]


# --- schedule --------------------------------------------------------------------------------


def test_eight_gpus_run_the_default_set_in_one_wave_on_disjoint_devices() -> None:
    waves = schedule(DEFAULT_SET, EIGHT_GPUS, CUDA).waves
    assert len(waves) == 1
    assert sorted(waves[0].devices_in_use) == list(EIGHT_GPUS)
    assert {s.topology.name: s.devices for s in waves[0].slots} == {
        "baseline": (0,),
        "1E+1PD": (1, 2),
        "1P+1D": (3, 4),
        "1E+1P+1D": (5, 6, 7),
    }


def test_on_four_gpus_the_baseline_keeps_its_device_through_every_wave() -> None:
    """A load calibrates the baseline and fuzzing serves it beside the topology under test: on
    a device of 1P+1D's or 1E+1P+1D's slot (they had 0,1 and 0,1,2), each such use stopped
    that topology and started it again. The other three devices hold each of them whole."""
    with_2e = (*DEFAULT_SET, get_topology("2E+1PD"))
    waves = schedule(with_2e, (0, 1, 2, 3), CUDA).waves
    assert [{s.topology.name: s.devices for s in w.slots} for w in waves] == [
        {"baseline": (0,), "1E+1PD": (1, 2)},
        {"1P+1D": (1, 2)},
        {"1E+1P+1D": (1, 2, 3)},
        {"2E+1PD": (1, 2, 3)},
    ]


@pytest.mark.parametrize("colocate", [False, True])
def test_on_two_gpus_no_topology_is_squeezed_to_keep_the_baseline_apart(colocate: bool) -> None:
    """Kept apart on 2 GPUs, the baseline would leave 1P+1D one device: its P and D would
    share it at 0.45 each (or, without --colocate, not fit)."""
    waves = schedule(DEFAULT_SET, (0, 1), CUDA, colocate=colocate).waves
    slots = {s.topology.name: s.devices for w in waves for s in w.slots}
    assert slots == {"baseline": (0,), "1E+1PD": (0, 1), "1P+1D": (0, 1), "1E+1P+1D": (0, 1)}


def test_too_few_gpus_is_one_error_naming_every_topology_that_cannot_fit() -> None:
    with pytest.raises(DevicePlanError) as info:
        schedule(DEFAULT_SET, (0,), CUDA)
    message = str(info.value)
    assert "\n" not in message
    for expected in ("1P+1D needs 2", "1E+1P+1D needs 2"):
        assert expected in message
    # The remedy is in each command's own flags (`run` may leave one out with --topology,
    # `repro` has no such flag): its caller adds it.
    assert "--" not in message and info.value.needs == {"1P+1D": 2, "1E+1P+1D": 2}
    assert "baseline" not in message
    assert "1E+1PD needs" not in message, "an encoder may share the PD's device"


def test_cpu_waves_fill_the_instance_budget_first_fit_in_order() -> None:
    """Trap 6: the baseline (one instance) no longer starts alone with a core idle."""
    waves = schedule(DEFAULT_SET, (0, 1), CPU, cpu_budget=4).waves
    assert [[s.topology.name for s in w.slots] for w in waves] == [
        ["baseline", "1E+1PD"],
        ["1P+1D"],
        ["1E+1P+1D"],
    ]
    # Every topology of a wave runs on all of the cores (their processes' affinity).
    assert [s.devices for s in waves[0].slots] == [(0, 1), (0, 1)]


def test_cpu_budget_of_one_runs_topologies_one_at_a_time() -> None:
    waves = schedule(DEFAULT_SET, (0, 1), CPU, cpu_budget=1).waves
    assert [len(w.slots) for w in waves] == [1, 1, 1, 1]


def test_cpu_budget_is_one_instance_per_core_within_memory_and_shared_by_workers() -> None:
    gib = 2**30
    assert cpu_instance_budget(cores=2, memory_bytes=24 * gib) == 2
    assert cpu_instance_budget(cores=2, memory_bytes=4 * gib) == 1  # 3.5 GB per instance
    assert cpu_instance_budget(cores=16, memory_bytes=24 * gib) == 5  # memory decides
    assert cpu_instance_budget(cores=8, memory_bytes=64 * gib, workers=2) == 4
    assert cpu_instance_budget(cores=1, memory_bytes=1 * gib, workers=4) == 1


@pytest.mark.parametrize("profile", [CPU, CUDA], ids=["cpu", "cuda"])
def test_nothing_to_start_needs_no_device(profile) -> None:
    """Attached with --golden nothing starts on this host and no device is the run's: its
    schedule has no wave, not "no cores given" (found on real vLLM: the run failed so, exit 2).
    A topology to start still needs devices."""
    assert schedule([], (), profile).waves == ()
    with pytest.raises(DevicePlanError, match=r"^no \w+s given$"):
        schedule(DEFAULT_SET, (), profile)


def test_schedule_rejects_a_repeated_device() -> None:
    with pytest.raises(DevicePlanError, match="repeats a device"):
        schedule(DEFAULT_SET, (0, 0), CUDA)


# -- an inherited device variable -------------------------------------------------------------


@pytest.mark.parametrize(
    ("profile", "inherited", "devices"),
    [
        (CUDA, None, (0, 1)),  # nothing inherited: every index is the host's
        (CUDA, "0,1,2,3", (0, 1, 2, 3)),  # the agent's whole host
        (CUDA, "2,3", (2, 3)),  # the job's GPUs, named as the host lists them
        (CUDA, "3, 2", (2,)),
        (XPU, "1,2", (1,)),
        (CPU, "2,3", (0, 1)),  # cores: no device variable is rendered
    ],
)
def test_devices_an_inherited_device_variable_gives_pass(profile, inherited, devices) -> None:
    environ = {} if inherited is None else {"CUDA_VISIBLE_DEVICES": inherited}
    if profile is XPU:
        environ = {"ZE_AFFINITY_MASK": inherited}
    check_inherited_devices(profile, devices, environ)  # raises nothing
    assert inherited_devices(profile, environ) == (None if profile is CPU else inherited)


@pytest.mark.parametrize(
    ("inherited", "devices", "says"),
    [
        ("2,3", (0, 1), "CUDA_VISIBLE_DEVICES=2,3 gives this process no device 0,1"),
        ("2,3", (2, 3, 4), "gives this process no device 4"),
        ("", (0,), "CUDA_VISIBLE_DEVICES= gives this process no device 0"),
        ("GPU-5f2c1e-aa", (0,), "CUDA_VISIBLE_DEVICES=GPU-5f2c1e-aa names devices by"),
    ],
)
def test_devices_an_inherited_cuda_visible_devices_did_not_give_are_refused(
    inherited: str, devices: tuple[int, ...], says: str
) -> None:
    """Each instance's CUDA_VISIBLE_DEVICES is rendered from --devices and replaces the one
    the harness inherited: an agent given GPUs 2,3 and run with --devices 0,1 put its
    instances on GPUs 0 and 1, another job's. Refused, naming the variable."""
    with pytest.raises(DevicePlanError) as refused:
        check_inherited_devices(CUDA, devices, {"CUDA_VISIBLE_DEVICES": inherited})
    message = str(refused.value)
    assert says in message, message
    assert "unset CUDA_VISIBLE_DEVICES" in message and "\n" not in message, message


@pytest.mark.parametrize(
    ("devices", "listed", "says"),
    [
        ((0, 1, 2), (0, 1), "--devices 0,1,2: this host has no GPU 2 (nvidia-smi lists GPUs 0,1)"),
        (
            (4, 7),
            (0, 1, 2, 3),
            "--devices 4,7: this host has no GPU 4,7 (nvidia-smi lists GPUs 0,1,2,3)",
        ),
        ((1,), (), "--devices 1: this host has no GPU 1 (nvidia-smi lists none)"),
    ],
)
def test_gpus_the_host_does_not_list_are_refused_naming_them(devices, listed, says) -> None:
    """An instance's CUDA_VISIBLE_DEVICES naming a GPU the host lacks starts, and dies with no
    CUDA device once its topology's others started: refused first, in one line."""
    with pytest.raises(DevicePlanError) as refused:
        check_host_devices(CUDA, devices, listed)
    assert str(refused.value) == says


def test_gpus_the_host_lists_or_cannot_say_pass() -> None:
    check_host_devices(CUDA, (0, 1), (0, 1, 2, 3))  # raises nothing
    check_host_devices(CUDA, (5,), None)  # nvidia-smi could not say: never refused on a guess
    check_host_devices(CPU, (7,), (0,))  # cores are checked against the affinity instead


def test_memory_for_cpu_waves_is_what_this_process_cgroup_leaves(
    tmp_path: Path, monkeypatch
) -> None:
    """A container's memory limit (cgroup v2 memory.max) is not in /proc/meminfo, which shows
    the host's: a 16-core job limited to 8 GB on a 64 GB host was given waves of 14 instances
    at 3.5 GB each (found in review). What is available is the least the host and every cgroup
    from this process's up to the root leave (each one's limit less its use)."""
    from harness.spec import placement

    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {80 * 10**6} kB\nMemAvailable: {64 * 10**6} kB\n")
    (tmp_path / "self-cgroup").write_text("0::/jobs/job1\n")
    root = tmp_path / "cgroup"
    for directory, limit, current in (
        (root / "jobs", "max", 9 * 10**9),
        (root / "jobs" / "job1", str(8 * 10**9), 10**9),
    ):
        directory.mkdir(parents=True)
        (directory / "memory.max").write_text(f"{limit}\n")
        (directory / "memory.current").write_text(f"{current}\n")
    monkeypatch.setattr(placement, "MEMINFO", meminfo)
    monkeypatch.setattr(placement, "PROC_SELF_CGROUP", tmp_path / "self-cgroup")
    monkeypatch.setattr(placement, "CGROUP_ROOT", root)
    assert placement.available_memory_bytes() == 7 * 10**9
    (root / "jobs" / "memory.max").write_text(f"{12 * 10**9}\n")  # the parent leaves less
    assert placement.available_memory_bytes() == 3 * 10**9
    (tmp_path / "self-cgroup").write_text("0::/\n")  # no limit on the way: the host's
    (root / "memory.max").write_text("max\n")
    (root / "memory.current").write_text("0\n")
    monkeypatch.setattr(placement, "PROC_SELF_CGROUP", tmp_path / "self-cgroup")
    assert placement.available_memory_bytes() == 64 * 10**9 * 1024 // 1000


def test_a_cgroups_reclaimable_page_cache_is_room(tmp_path: Path, monkeypatch) -> None:
    """memory.current counts the page cache, most of which the kernel reclaims on demand (as
    MemAvailable counts it available): a CI container that had just installed 3 GB of wheels
    would have been given waves sized for what its cache left. Its inactive file pages are
    room, as a container's working set leaves them out."""
    from harness.spec import placement

    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemAvailable: {64 * 10**6} kB\n")
    (tmp_path / "self-cgroup").write_text("0::/job\n")
    job = tmp_path / "cgroup" / "job"
    job.mkdir(parents=True)
    (job / "memory.max").write_text(f"{8 * 10**9}\n")
    (job / "memory.current").write_text(f"{7 * 10**9}\n")
    (job / "memory.stat").write_text(f"anon {10**9}\nfile {6 * 10**9}\ninactive_file {5 * 10**9}\n")
    monkeypatch.setattr(placement, "MEMINFO", meminfo)
    monkeypatch.setattr(placement, "PROC_SELF_CGROUP", tmp_path / "self-cgroup")
    monkeypatch.setattr(placement, "CGROUP_ROOT", tmp_path / "cgroup")
    assert placement.available_memory_bytes() == 6 * 10**9
