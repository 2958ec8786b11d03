"""The network invariants of multi-node runs (harness.spec.network), on rendered instances.

Nothing is launched: these tests read what `InstanceSpec.argv()` / `.env()` hand to a launcher,
with hosts as a Ray launcher places them, and what `violations()` says about them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from harness.spec.instances import InstanceSpec
from harness.spec.network import side_channels, violations
from harness.spec.placement import place_instances, side_channel_port_count
from harness.spec.platforms import (
    CPU,
    EC_SIDE_CHANNEL_HOST_ENV,
    NIXL_CONNECTOR,
    SIDE_CHANNEL_HOST_ENV,
)
from harness.spec.topology import EPD_TOPOLOGY_NAMES, TOPOLOGIES, serving_for

pytestmark = pytest.mark.unit

NODES = ("10.0.0.2", "10.0.0.3", "10.0.0.4")


def placed(topology_name: str, kv_connector: str, tmp_path: Path, hosts=NODES) -> list:
    topology = TOPOLOGIES[topology_name]
    serving = serving_for(CPU, "/models/tiny", kv_connector=kv_connector)
    n = len(topology.roles)
    side = list(range(24000, 24000 + side_channel_port_count(topology, serving)))
    return place_instances(
        topology,
        serving,
        CPU,
        list(range(23000, 23000 + n)),
        tmp_path,
        (0, 1),
        side_channel_ports=side,
        hosts=list(hosts[:n]) if hosts else (),
    )


def found(spec: InstanceSpec, env: dict | None = None, argv=None, multi_node=True) -> list[str]:
    rendered_argv = spec.argv() if argv is None else argv
    rendered_env = spec.env() if env is None else env
    return [str(v) for v in violations(spec, rendered_argv, rendered_env, multi_node)]


@pytest.mark.parametrize("kv", ["ExampleConnector", NIXL_CONNECTOR])
@pytest.mark.parametrize("name", EPD_TOPOLOGY_NAMES)
def test_instances_placed_on_nodes_render_their_node_address_everywhere(
    name: str, kv: str, tmp_path: Path
) -> None:
    for spec in placed(name, kv, tmp_path):
        argv, env = spec.argv(), spec.env()
        assert spec.host in NODES and spec.url == f"http://{spec.host}:{spec.port}"
        assert argv[argv.index("--host") + 1] == spec.host
        if spec.uses_nixl:
            assert env[SIDE_CHANNEL_HOST_ENV] == spec.host
            assert side_channels(spec) == [(spec.host, spec.side_channel_port)]
        if spec.ec_transfer_config() is not None:
            assert env[EC_SIDE_CHANNEL_HOST_ENV] == spec.host
        assert found(spec) == [], spec.name


@pytest.mark.parametrize("name", EPD_TOPOLOGY_NAMES)
def test_local_instances_keep_loopback_and_break_nothing_on_one_host(
    name: str, tmp_path: Path
) -> None:
    for spec in placed(name, NIXL_CONNECTOR, tmp_path, hosts=()):
        assert spec.host == "127.0.0.1"
        assert found(spec, multi_node=False) == []
        # the same on several nodes would be wrong: no peer elsewhere reaches 127.0.0.1
        assert any("node address" in v for v in found(spec, multi_node=True))


@pytest.mark.parametrize("address", ["LOCALHOST", "Localhost", "IP6-LOCALHOST"])
def test_a_name_for_this_machine_in_capitals_is_one_all_the_same(
    address: str, tmp_path: Path
) -> None:
    """Host names are case-insensitive: 'LOCALHOST' resolves to this machine as 'localhost'
    does, so a node given by it is refused on several nodes like the lower-case one."""
    spec = dataclasses.replace(placed("1E+1PD", "ExampleConnector", tmp_path)[0], host=address)
    assert any("node address" in v for v in found(spec, multi_node=True))
    assert found(spec, multi_node=False) == []


def test_a_side_channel_host_left_at_localhost_is_named(tmp_path: Path) -> None:
    prefill = placed("1P+1D", NIXL_CONNECTOR, tmp_path)[0]
    problems = found(prefill, env={**prefill.env(), SIDE_CHANNEL_HOST_ENV: "localhost"})
    assert problems == [
        f"1P+1D/prefill0: {SIDE_CHANNEL_HOST_ENV} is 'localhost', but its node's address is "
        "10.0.0.2: a peer on another node connects to the host announced here"
    ]


def test_an_unset_nixl_side_channel_host_is_vllms_localhost(tmp_path: Path) -> None:
    decode = placed("1P+1D", NIXL_CONNECTOR, tmp_path)[1]
    env = {k: v for k, v in decode.env().items() if k != SIDE_CHANNEL_HOST_ENV}
    (problem,) = found(decode, env=env)
    assert problem.startswith(f"1P+1D/decode0: {SIDE_CHANNEL_HOST_ENV} is unset")
    assert "'localhost'" in problem


def test_an_ec_side_channel_host_elsewhere_is_named(tmp_path: Path) -> None:
    encoder = placed("1E+1PD", "ExampleConnector", tmp_path)[0]
    (problem,) = found(encoder, env={**encoder.env(), EC_SIDE_CHANNEL_HOST_ENV: "127.0.0.1"})
    assert problem.startswith(f"1E+1PD/encoder0: {EC_SIDE_CHANNEL_HOST_ENV} is '127.0.0.1'")


def test_the_last_host_flag_counts_as_argparse_reads_it(tmp_path: Path) -> None:
    spec = placed("1P+1D", NIXL_CONNECTOR, tmp_path)[0]
    spec = dataclasses.replace(
        spec, serving=dataclasses.replace(spec.serving, extra_args=("--host=0.0.0.0",))
    )
    (problem,) = found(spec)
    assert problem.startswith("1P+1D/prefill0: --host is '0.0.0.0', but its node's address")


def test_place_instances_refuses_a_host_list_of_the_wrong_length(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs 3 hosts, got 2"):
        placed("1E+1P+1D", NIXL_CONNECTOR, tmp_path, hosts=NODES[:2])
