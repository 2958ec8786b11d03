"""Instances of a topology that share a GPU start one after another (`start_after` in
`harness.spec.placement`): vLLM's memory profiling asserts when another process on its device
frees memory meanwhile, and an encoder frees a large profiling transient. The fake vLLM
(harness/testing/fake_vllm.py) stands in for every instance under the cuda profile; nothing here
ran on a GPU. On CPU nothing changes: every instance starts at once.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest

from harness.serve.launch import ManagedServer, ServerDied, StartupTimeout
from harness.serve.server_command import ServerCommand
from harness.serve.server_group import ServerGroup
from harness.serve.session import TopologySession
from harness.spec.placement import (
    place_instances,
    side_channel_port_count,
    start_after,
    start_stages,
)
from harness.spec.platforms import CPU, CUDA
from harness.spec.settings import RunSettings
from harness.spec.topology import TOPOLOGIES, ServingConfig
from harness.testing.fake_vllm import MODE_ENV, fake_run_settings, logged_starts

pytestmark = pytest.mark.process

# How long the fake encoder takes to answer /health: long enough that an instance spawned
# beside it, not after it, shows as spawned well before it was ready.
ENCODER_START_S = 1.5


def spawned_before_ready(server: ManagedServer, first: ManagedServer) -> str | None:
    """Why `server` was not spawned beside `first` (None if it was): spawned before `first`
    answered /health, its spawn not waiting for it. Not a fixed gap between the two spawns:
    each spawn forks the test's large process and runs Python in the child before exec, and
    on a loaded host 0.806 s separated them where 0.8 s was allowed (the unit suite, -n 2,
    beside other jobs); `first`'s own start, at least ENCODER_START_S, grows with the load
    too. Staggered, `server` spawns only once `first` is healthy, which this tells apart."""
    ready_wall = first.spawned_wall_s + first.startup_seconds
    if server.spawned_wall_s < ready_wall:
        return None
    return (
        f"{server.name} spawned {server.spawned_wall_s - ready_wall:.2f} s after {first.name} "
        f"was healthy ({server.spawned_wall_s - first.spawned_wall_s:.2f} s after its spawn)"
    )


def specs(name: str, platform, devices: tuple[int, ...], colocate: bool = True, hosts=()):
    topology = TOPOLOGIES[name]
    serving = ServingConfig(model="m", kv_connector=platform.kv_connector)
    ports = list(range(30000, 30000 + len(topology.roles)))
    sides = list(range(31000, 31010))
    return place_instances(
        topology,
        serving,
        platform,
        ports,
        Path("/s"),
        devices,
        colocate=colocate,
        side_channel_ports=sides[: side_channel_port_count(topology, serving)],
        hosts=hosts,
    )


# --- the rule ----------------------------------------------------------------------------------


def test_on_one_gpu_the_encoder_starts_first_and_the_others_one_after_another() -> None:
    assert start_after(specs("1E+1P+1D", CUDA, (0,))) == {
        "1E+1P+1D/prefill0": ("1E+1P+1D/encoder0",),
        "1E+1P+1D/decode0": ("1E+1P+1D/prefill0",),
    }
    assert start_after(specs("1E+1PD", CUDA, (0,))) == {"1E+1PD/pd0": ("1E+1PD/encoder0",)}


def test_the_encoder_starts_first_on_its_device_wherever_it_is_listed() -> None:
    """The encoder's profiling transient must be over before a KV holder takes its memory
    snapshot, whatever order the instances come in (every topology lists its encoders first
    today; one that did not would start its encoder last, beside a profiling KV holder)."""
    encoder, prefill, decode = specs("1E+1P+1D", CUDA, (0,))
    assert start_after([prefill, decode, encoder]) == {
        "1E+1P+1D/prefill0": ("1E+1P+1D/encoder0",),
        "1E+1P+1D/decode0": ("1E+1P+1D/prefill0",),
    }


def test_on_two_gpus_only_the_instances_of_the_shared_device_wait() -> None:
    placed = specs("1E+1P+1D", CUDA, (0, 1))
    shared = {spec.name for spec in placed if spec.devices == (0,)}
    assert shared == {"1E+1P+1D/encoder0", "1E+1P+1D/prefill0"}, placed
    assert start_after(placed) == {"1E+1P+1D/prefill0": ("1E+1P+1D/encoder0",)}


def test_nothing_waits_on_cpu_on_devices_of_their_own_or_on_other_hosts() -> None:
    assert start_after(specs("1E+1P+1D", CPU, (0, 1), colocate=False)) == {}
    assert start_after(specs("1E+1P+1D", CUDA, (0, 1, 2))) == {}
    # Ray: accelerator ids are per node, so device 0 on two nodes is two devices.
    placed = specs("1E+1PD", CUDA, (0,), hosts=("10.0.0.1", "10.0.0.2"))
    assert start_after(placed) == {}


def test_the_startup_timeout_counts_once_per_instance_of_the_longest_chain() -> None:
    """A chain of three on one GPU is three starts end to end; a timeout sized for one start
    must be given three times, and once where nothing waits."""
    assert start_stages(start_after(specs("1E+1P+1D", CUDA, (0,)))) == 3
    assert start_stages(start_after(specs("1E+1P+1D", CUDA, (0, 1)))) == 2
    assert start_stages(start_after(specs("1E+1P+1D", CUDA, (0, 1, 2)))) == 1
    assert start_stages(start_after(specs("1E+1P+1D", CPU, (0, 1), colocate=False))) == 1
    assert start_stages({"c": ("a", "b"), "b": ("a",), "d": ("c",)}) == 4


def test_a_start_order_no_server_could_follow_is_refused(tmp_path: Path) -> None:
    servers = [
        ManagedServer(ServerCommand(name, ["true"], "http://127.0.0.1:1/health", tmp_path / name))
        for name in ("a", "b")
    ]
    with pytest.raises(ValueError, match="no order"):
        ServerGroup(servers, start_after={"a": ["b"], "b": ["a"]})
    with pytest.raises(ValueError, match="not in the group"):
        ServerGroup(servers, start_after={"a": ["c"]})


# --- the fake vLLM under the cuda profile ------------------------------------------------------


def cuda_settings(tmp_path: Path, fake_vllm: Path, devices: tuple[int, ...]) -> RunSettings:
    serving = ServingConfig(model=str(tmp_path / "model"), kv_connector=CUDA.kv_connector)
    return fake_run_settings(
        tmp_path, fake_vllm, serving, platform=CUDA, devices=devices, colocate=True
    )


def cpu_settings(tmp_path: Path, fake_vllm: Path) -> RunSettings:
    return fake_run_settings(tmp_path, fake_vllm)


class Events:
    """Every server state change, with the group's clock (`ServerGroup`'s on_event)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, float]] = []

    def __call__(self, name: str, state: str, elapsed_s: float) -> None:
        self.seen.append((name, state, elapsed_s))

    def at(self, name: str, state: str) -> float:
        return next(t for n, s, t in self.seen if n.endswith(name) and s == state)

    def states(self, name: str) -> list[str]:
        return [s for n, s, _ in self.seen if n.endswith(name)]


def test_on_one_gpu_the_second_instance_is_spawned_only_once_the_first_is_healthy(
    tmp_path: Path, fake_vllm: Path, fake_vllm_start_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(MODE_ENV, f"encoder:slow-start={ENCODER_START_S}")
    events = Events()
    settings = cuda_settings(tmp_path, fake_vllm, (0,))
    with TopologySession(TOPOLOGIES["1E+1PD"], settings, on_event=events) as session:
        encoder, pd = session.servers
        encoder_ready_wall = encoder.spawned_wall_s + encoder.startup_seconds
        assert pd.spawned_wall_s >= encoder_ready_wall, (
            f"pd spawned {encoder_ready_wall - pd.spawned_wall_s:.2f} s before the encoder "
            "sharing its GPU was healthy"
        )
        assert events.at("pd0", "starting") >= events.at("encoder0", "ready"), events.seen
        assert session.stats["1E+1PD/pd0"].started_after == ["1E+1PD/encoder0"]
        assert session.stats["1E+1PD/encoder0"].started_after == []
        recorded = json.loads(pd.command.log_path.with_suffix(".cmd.json").read_text())
        assert recorded["start_after"] == ["1E+1PD/encoder0"]
    assert [s["role"] for s in logged_starts(fake_vllm_start_log)] == ["encoder", "pd"]


def test_instances_on_other_gpus_start_at_once(
    tmp_path: Path, fake_vllm: Path, fake_vllm_start_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2 GPUs, 1E+1P+1D: E and P share device 0, D has device 1 and starts with E."""
    monkeypatch.setenv(MODE_ENV, f"encoder:slow-start={ENCODER_START_S}")
    events = Events()
    settings = cuda_settings(tmp_path, fake_vllm, (0, 1))
    with TopologySession(TOPOLOGIES["1E+1P+1D"], settings, on_event=events) as session:
        by_role = {
            spec.role.value: server for spec, server in zip(session.instances, session.servers)
        }
        assert session.instances[0].devices == session.instances[1].devices == (0,)
        spawned = {role: server.spawned_wall_s for role, server in by_role.items()}
        encoder = by_role["encoder"]
        late = spawned_before_ready(by_role["decode"], encoder)
        assert late is None, late
        assert spawned["prefill"] >= encoder.spawned_wall_s + encoder.startup_seconds, spawned
        assert events.at("decode0", "starting") < events.at("encoder0", "ready"), events.seen


def test_a_death_of_the_first_fails_the_start_at_once_naming_it_and_the_second_never_starts(
    tmp_path: Path, fake_vllm: Path, fake_vllm_start_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(MODE_ENV, "encoder:slow-start=0.5;encoder:die-start")
    events = Events()
    settings = cuda_settings(tmp_path, fake_vllm, (0,))  # startup timeout 20 s
    began = time.monotonic()
    with pytest.raises(ServerDied) as info:
        with TopologySession(TOPOLOGIES["1E+1PD"], settings, on_event=events):
            pass
    assert time.monotonic() - began < 10, "the death was noticed late"
    assert info.value.name == "1E+1PD/encoder0"
    assert "1E+1PD/encoder0" in str(info.value) and "chaos-7c1d" in str(info.value)
    assert [s["role"] for s in logged_starts(fake_vllm_start_log)] == ["encoder"]
    assert events.states("pd0") == [], "the waiting pd was started, or reported stopped"
    assert events.states("encoder0") == ["starting", "died", "stopped"]


def test_a_first_that_never_answers_times_out_naming_it_and_the_one_never_started(
    tmp_path: Path, fake_vllm: Path, fake_vllm_start_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The startup timeout is the whole group's (once per stage), the waiting instance's
    start included."""
    monkeypatch.setenv(MODE_ENV, "encoder:hang-health")
    settings = cuda_settings(tmp_path, fake_vllm, (0,))
    settings = dataclasses.replace(settings, startup_timeout_s=3.0)
    with pytest.raises(StartupTimeout) as info:
        with TopologySession(TOPOLOGIES["1E+1PD"], settings):
            pass
    assert info.value.names == ("1E+1PD/encoder0",)
    assert "1E+1PD/pd0 was never started: it starts once 1E+1PD/encoder0 is healthy" in str(
        info.value
    )
    assert [s["role"] for s in logged_starts(fake_vllm_start_log)] == ["encoder"]


def test_a_chain_whose_starts_each_fit_the_timeout_is_not_cut_short(
    tmp_path: Path, fake_vllm: Path, fake_vllm_start_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each start takes 4 s of a 6 s timeout; end to end they take more than 6 s, which a
    timeout given once for the whole chain would cut."""
    monkeypatch.setenv(MODE_ENV, "encoder:slow-start=4;pd:slow-start=4")
    settings = cuda_settings(tmp_path, fake_vllm, (0,))
    settings = dataclasses.replace(settings, startup_timeout_s=6.0)
    with TopologySession(TOPOLOGIES["1E+1PD"], settings) as session:
        encoder, pd = session.servers
        end_to_end = pd.spawned_wall_s + pd.startup_seconds - encoder.spawned_wall_s
        assert end_to_end > settings.startup_timeout_s, end_to_end
    assert [s["role"] for s in logged_starts(fake_vllm_start_log)] == ["encoder", "pd"]


def test_on_cpu_every_instance_still_starts_at_once(
    tmp_path: Path, fake_vllm: Path, fake_vllm_start_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(MODE_ENV, f"encoder:slow-start={ENCODER_START_S}")
    events = Events()
    with TopologySession(
        TOPOLOGIES["1E+1PD"], cpu_settings(tmp_path, fake_vllm), on_event=events
    ) as session:
        encoder, pd = session.servers
        late = spawned_before_ready(pd, encoder)
        assert late is None, late
        assert events.at("pd0", "starting") < events.at("encoder0", "ready"), events.seen
        assert session.stats["1E+1PD/pd0"].started_after == []
        recorded = json.loads(pd.command.log_path.with_suffix(".cmd.json").read_text())
        assert "start_after" not in recorded
