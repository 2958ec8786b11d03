"""Rendering of every role's `vllm serve` argv and environment, and instance planning.

Nothing is launched: these tests read what `InstanceSpec.argv()` / `.env()` would hand to the
launcher and check that every role differs from the baseline only in its transfer setup.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.environment import LOOPBACK_HOST
from harness.spec.instances import InstanceSpec
from harness.spec.placement import place_instances
from harness.spec.platforms import CPU, CUDA
from harness.spec.topology import TOPOLOGIES, Role, ServingConfig, get_topology

pytestmark = pytest.mark.unit

SERVING = ServingConfig(model="/models/tiny-qwen2-vl", max_model_len=2048, max_num_seqs=4)
# Flags whose values change numerics: every role must carry the baseline's value.
NUMERICS_VALUE_FLAGS = ("--block-size", "--max-model-len", "--dtype", "--max-num-seqs")
NUMERICS_SWITCH_FLAGS = ("--enforce-eager",)


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value following `flag`, or None when the flag is absent; fail on a repeated flag."""
    assert argv.count(flag) <= 1, f"{flag} appears {argv.count(flag)} times in {argv}"
    if flag not in argv:
        return None
    index = argv.index(flag)
    assert index + 1 < len(argv), f"{flag} is the last element of {argv}"
    return argv[index + 1]


def json_flag(argv: list[str], flag: str) -> dict | None:
    value = flag_value(argv, flag)
    return None if value is None else json.loads(value)


def specs_by_role(topology_name: str, tmp_path: Path) -> dict[Role, InstanceSpec]:
    topology = get_topology(topology_name)
    ports = [21000 + i for i in range(len(topology.roles))]
    return {
        s.role: s
        for s in place_instances(topology, SERVING, CPU, ports, tmp_path / "storage", (0, 1))
    }


@pytest.fixture
def rendered(tmp_path: Path) -> dict[Role, InstanceSpec]:
    """One spec per role, each taken from the topology that runs it."""
    specs: dict[Role, InstanceSpec] = {}
    specs[Role.BASELINE] = specs_by_role("baseline", tmp_path / "b")[Role.BASELINE]
    e_pd = specs_by_role("1E+1PD", tmp_path / "epd")
    specs[Role.ENCODER] = e_pd[Role.ENCODER]
    specs[Role.PREFILL_DECODE] = e_pd[Role.PREFILL_DECODE]
    e_p_d = specs_by_role("1E+1P+1D", tmp_path / "epd3")
    specs[Role.PREFILL] = e_p_d[Role.PREFILL]
    specs[Role.DECODE] = e_p_d[Role.DECODE]
    return specs


# --- per-role transfer configuration ---------------------------------------------------------


def test_baseline_has_no_transfer_config_and_no_encoder_flags(rendered) -> None:
    argv = rendered[Role.BASELINE].argv()
    assert argv[:3] == ["vllm", "serve", "/models/tiny-qwen2-vl"]
    assert "--ec-transfer-config" not in argv
    assert "--kv-transfer-config" not in argv
    assert "--no-enable-prefix-caching" not in argv
    assert "--max-num-batched-tokens" not in argv


def test_encoder_is_ec_producer_without_prefix_caching(rendered, tmp_path: Path) -> None:
    argv = rendered[Role.ENCODER].argv()
    assert json_flag(argv, "--ec-transfer-config") == {
        "ec_connector": "ECExampleConnector",
        "ec_role": "ec_producer",
        "ec_connector_extra_config": {"shared_storage_path": str(tmp_path / "epd/storage/ec")},
    }
    assert "--kv-transfer-config" not in argv
    assert "--no-enable-prefix-caching" in argv
    assert flag_value(argv, "--max-num-batched-tokens") == "114688"


def test_pd_is_ec_consumer_only(rendered, tmp_path: Path) -> None:
    argv = rendered[Role.PREFILL_DECODE].argv()
    assert json_flag(argv, "--ec-transfer-config") == {
        "ec_connector": "ECExampleConnector",
        "ec_role": "ec_consumer",
        "ec_connector_extra_config": {"shared_storage_path": str(tmp_path / "epd/storage/ec")},
    }
    assert "--kv-transfer-config" not in argv
    assert "--no-enable-prefix-caching" not in argv


def test_prefill_is_ec_consumer_and_kv_producer(rendered, tmp_path: Path) -> None:
    argv = rendered[Role.PREFILL].argv()
    storage = tmp_path / "epd3/storage"
    assert json_flag(argv, "--ec-transfer-config") == {
        "ec_connector": "ECExampleConnector",
        "ec_role": "ec_consumer",
        "ec_connector_extra_config": {"shared_storage_path": str(storage / "ec")},
    }
    assert json_flag(argv, "--kv-transfer-config") == {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(storage / "kv")},
    }


def test_decode_is_kv_consumer_only(rendered, tmp_path: Path) -> None:
    argv = rendered[Role.DECODE].argv()
    assert "--ec-transfer-config" not in argv
    assert json_flag(argv, "--kv-transfer-config") == {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "epd3/storage/kv")},
    }


def test_producer_and_consumer_share_the_same_storage(rendered) -> None:
    def storage(spec: InstanceSpec, flag: str, key: str) -> str:
        return json_flag(spec.argv(), flag)[key]["shared_storage_path"]

    ec = "--ec-transfer-config", "ec_connector_extra_config"
    kv = "--kv-transfer-config", "kv_connector_extra_config"
    assert storage(rendered[Role.ENCODER], *ec) == storage(rendered[Role.PREFILL_DECODE], *ec)
    assert storage(rendered[Role.PREFILL], *kv) == storage(rendered[Role.DECODE], *kv)
    # The two topologies must not share a directory (content-keyed stores would leak).
    assert storage(rendered[Role.ENCODER], *ec) != storage(rendered[Role.PREFILL], *ec)


def test_kv_connector_without_example_storage_has_no_extra_config(tmp_path: Path) -> None:
    serving = ServingConfig(model="m", kv_connector="NixlConnector")
    spec = InstanceSpec("x/decode0", Role.DECODE, 21001, serving)
    assert json_flag(spec.argv(), "--kv-transfer-config") == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_consumer",
        "kv_buffer_device": "cpu",  # the CPU platform's NIXL buffers
        # a lease long enough for a slow first handshake on shared cores (spec/connectors.py)
        "kv_connector_extra_config": {"kv_lease_duration": 300},
    }


@pytest.mark.parametrize(
    ("role", "missing"),
    [
        (Role.ENCODER, "EC storage"),
        (Role.PREFILL_DECODE, "EC storage"),
        (Role.DECODE, "KV storage"),
    ],
)
def test_missing_storage_is_an_error_naming_the_instance(role: Role, missing: str) -> None:
    spec = InstanceSpec("t/inst0", role, 21002, SERVING)
    with pytest.raises(ValueError, match=f"t/inst0.*{missing}"):
        spec.argv()


# --- shared numerics flags, argv shape, host -------------------------------------------------


def test_every_role_shares_the_numerics_flags_with_the_baseline(rendered) -> None:
    baseline = rendered[Role.BASELINE].argv()
    expected = {flag: flag_value(baseline, flag) for flag in NUMERICS_VALUE_FLAGS}
    assert expected == {
        "--block-size": "32",
        "--max-model-len": "2048",
        "--dtype": "bfloat16",
        "--max-num-seqs": "4",
    }
    assert "--enforce-eager" in baseline
    for role, spec in rendered.items():
        argv = spec.argv()
        got = {flag: flag_value(argv, flag) for flag in NUMERICS_VALUE_FLAGS}
        assert got == expected, role
        for switch in NUMERICS_SWITCH_FLAGS:
            assert (switch in argv) == (switch in baseline), (role, switch)
        assert argv[2] == baseline[2], role  # the model itself


def test_extra_args_reach_every_role_at_the_end(tmp_path: Path) -> None:
    serving = ServingConfig(model="m", extra_args=("--seed", "0"))
    for name in ("baseline", "1E+1P+1D"):
        topology = get_topology(name)
        ports = list(range(21100, 21100 + len(topology.roles)))
        for spec in place_instances(topology, serving, CPU, ports, tmp_path / name, (0, 1)):
            assert spec.argv()[-2:] == ["--seed", "0"]


def test_argv_is_a_flat_list_of_strings(rendered) -> None:
    for role, spec in rendered.items():
        argv = spec.argv("/opt/venv/bin/vllm")
        assert isinstance(argv, list)
        assert all(isinstance(a, str) for a in argv), role
        assert argv[:2] == ["/opt/venv/bin/vllm", "serve"]
        for element in argv:
            if element.startswith("--"):
                # a flag on its own: never "--flag value" or "--flag=value" in one element
                assert " " not in element and "=" not in element, element
            elif " " in element:
                # the only values with spaces are the JSON transfer configs
                assert isinstance(json.loads(element), dict), element
        assert "vllm serve" not in " | ".join(argv)


def test_host_defaults_to_loopback(rendered) -> None:
    for role, spec in rendered.items():
        assert LOOPBACK_HOST == "127.0.0.1"
        assert flag_value(spec.argv(), "--host") == "127.0.0.1", role
        assert spec.url == f"http://127.0.0.1:{spec.port}"
        assert flag_value(spec.argv(), "--port") == str(spec.port)


# --- environment -----------------------------------------------------------------------------


def test_cpu_instances_run_on_every_core_with_the_worker_in_the_engine_core(
    tmp_path: Path,
) -> None:
    topology = get_topology("1E+1P+1D")
    specs = place_instances(topology, SERVING, CPU, [21200, 21201, 21202], tmp_path, (7, 4))
    envs = [s.env() for s in specs]
    assert [s.cpu_affinity for s in specs] == [(4, 7)] * 3
    for spec, env in zip(specs, envs):
        # vLLM's `uni` executor binds no OMP threads: a binding variable would be ignored.
        assert "VLLM_CPU_OMP_THREADS_BIND" not in env
        assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        assert flag_value(spec.argv(), "--distributed-executor-backend") == "uni"
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
        assert env["HF_HUB_OFFLINE"] == "1"
    baseline_env = place_instances(
        get_topology("baseline"), SERVING, CPU, [21203], tmp_path, (0, 1)
    )[0].env()
    thread_counts = {e["OMP_NUM_THREADS"] for e in [*envs, baseline_env]}
    assert thread_counts == {"1"}


def test_gpu_instances_keep_vllms_own_executor_and_no_cpu_affinity(tmp_path: Path) -> None:
    specs = place_instances(
        get_topology("1E+1P+1D"), SERVING, CUDA, [21200, 21201, 21202], tmp_path, (0, 1, 2)
    )
    for spec in specs:
        assert spec.cpu_affinity == ()
        assert "--distributed-executor-backend" not in spec.argv()
        assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in spec.env()


# --- place_instances -------------------------------------------------------------------------


def test_plan_instances_names_ports_and_cores(tmp_path: Path) -> None:
    specs = place_instances(
        get_topology("2E+1PD"), SERVING, CPU, [22001, 22002, 22003], tmp_path, (0, 1)
    )
    assert [s.name for s in specs] == ["2E+1PD/encoder0", "2E+1PD/encoder1", "2E+1PD/pd0"]
    assert len({s.name for s in specs}) == 3
    assert [s.role for s in specs] == [Role.ENCODER, Role.ENCODER, Role.PREFILL_DECODE]
    assert [s.port for s in specs] == [22001, 22002, 22003]
    assert [s.devices for s in specs] == [(0, 1)] * 3
    assert all(s.serving is SERVING for s in specs)


@pytest.mark.parametrize(
    ("name", "has_ec", "has_kv"),
    [
        ("baseline", False, False),
        ("1E+1PD", True, False),
        ("1P+1D", False, True),
        ("1E+1P+1D", True, True),
        ("2E+1PD", True, False),
    ],
)
def test_plan_instances_storage_dirs_per_topology(
    tmp_path: Path, name: str, has_ec: bool, has_kv: bool
) -> None:
    topology = get_topology(name)
    ports = list(range(23000, 23000 + len(topology.roles)))
    specs = place_instances(topology, SERVING, CPU, ports, tmp_path / "run", (0, 1))
    assert {s.ec_storage for s in specs} == {tmp_path / "run/ec" if has_ec else None}
    assert {s.kv_storage for s in specs} == {tmp_path / "run/kv" if has_kv else None}


def test_every_planned_topology_renders(tmp_path: Path) -> None:
    for name, topology in TOPOLOGIES.items():
        ports = list(range(24000, 24000 + len(topology.roles)))
        for spec in place_instances(topology, SERVING, CPU, ports, tmp_path / name, (0, 1)):
            argv = spec.argv()
            assert argv[:2] == ["vllm", "serve"]
            if spec.role is Role.PREFILL:
                assert json_flag(argv, "--kv-transfer-config")["kv_role"] == "kv_producer"
                # P is an EC consumer only where there are encoders to consume from.
                assert ("--ec-transfer-config" in argv) == topology.has_ec_transfer


@pytest.mark.parametrize("count", [1, 3])
def test_plan_instances_rejects_wrong_number_of_ports(tmp_path: Path, count: int) -> None:
    ports = list(range(25000, 25000 + count))
    with pytest.raises(ValueError, match=r"1E\+1PD needs 2 ports, got " + str(count)):
        place_instances(get_topology("1E+1PD"), SERVING, CPU, ports, tmp_path, (0, 1))


# --- lookup and roles ------------------------------------------------------------------------


def test_get_topology_unknown_names_the_known_ones() -> None:
    with pytest.raises(ValueError) as info:
        get_topology("nope")
    message = str(info.value)
    assert "'nope'" in message
    for name in ("baseline", "1E+1PD", "1P+1D", "1E+1P+1D", "2E+1PD"):
        assert name in message


def test_get_topology_known() -> None:
    topology = get_topology("1E+1P+1D")
    assert topology.roles == (Role.ENCODER, Role.PREFILL, Role.DECODE)
    assert topology.exact_reference == "1P+1D"
    assert topology.exact_reference in TOPOLOGIES
    assert get_topology("2E+1PD").encoders == 2
    assert get_topology("baseline").is_baseline
    assert not get_topology("1P+1D").has_ec_transfer


def test_accepts_metadata_only_embeds_exactly_for_consumers() -> None:
    accepting = {role for role in Role if role.accepts_metadata_only_embeds}
    assert accepting == {Role.PREFILL_DECODE, Role.PREFILL, Role.DECODE}
    for role in Role:
        # vLLM: allow_missing_mm_embeddings = EC consumer or KV consumer
        assert role.accepts_metadata_only_embeds == (role.is_ec_consumer or role.is_kv_consumer)
