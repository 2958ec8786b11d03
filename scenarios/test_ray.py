"""E, P and D on three nodes of a Ray cluster, judged exactly as on one host.

Without `--epd-ray-address` the harness starts a one-host rehearsal cluster of three nodes
(127.0.0.2-4) at the first Ray topology and stops it, with the Ray topologies of the session's
pool, once the session's tests are done. The instances
land on distinct nodes (read back from Ray, recorded per instance), bind their node's address,
and every guard reads its evidence across nodes: the taps in front of each instance, D's
`/metrics` for the NIXL rule, the shared EC storage. A planted misconfiguration, a NIXL side
channel left at `localhost`, is refused before any instance starts and comes out ERROR naming
the instance and the variable: never MATCH. (Storage the nodes do not share is refused the
same way, before vLLM starts: `tests/test_ray_launcher.py`.)

Needs Ray (`scripts/cpu setup --ray`) and, for the NIXL cases, NIXL (`--nixl`); without them
these tests fail with that one line, never skip.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import pytest

from harness.errors import BadInput
from harness.judge.records import CaseRecord, Verdict
from harness.preflight.connectors import check_kv_connector
from harness.preflight.launcher import check_launcher_here, launcher_choice
from harness.report.text import format_failure
from harness.run.sweep import Sweep, SweepSpec
from harness.serve.launcher import end_launchers
from harness.serve.session import TopologySession
from harness.spec.connectors import NIXL
from harness.spec.prompts import SKELETON_PROMPTS
from harness.spec.settings import RAY_LAUNCHER, LauncherChoice, RunSettings
from harness.spec.topology import TOPOLOGIES
from harness.testing.judging import passed_proven
from harness.testing.live import LiveTopology

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.epd_topology("1E+1P+1D"),
    pytest.mark.epd_variant("ray"),
    # On a GPU platform only against a real cluster (--epd-ray-address): the rehearsal is CPU's.
    pytest.mark.one_host_rehearsal(unless_ray_address=True),
]

IMAGE = next(p for p in SKELETON_PROMPTS if p.name == "image")


@dataclasses.dataclass
class RayRequest:
    launcher: str = RAY_LAUNCHER
    proxy: str = "harness"
    ray_address: str | None = None
    ray_placement: str | None = None
    ray_shared_dir: str | None = None
    ray_instance_env: tuple[str, ...] = ()


def ray_settings(
    base: RunSettings, label: str, kv_class: str | None = None, **launcher
) -> RunSettings:
    """The session's settings on Ray: the same cluster as the session's, if it runs on one."""
    try:
        # Ray installed here, or one line saying how
        check_launcher_here(launcher_choice(RayRequest()))
    except BadInput as exc:
        pytest.fail(f"epd-harness: {exc}", pytrace=False)
    serving = base.serving
    if kv_class is not None:
        serving = dataclasses.replace(serving, kv_connector=kv_class)
    address = base.launcher.ray_address
    return dataclasses.replace(
        base,
        serving=serving,
        run_dir=base.run_dir / label,
        launcher=LauncherChoice(RAY_LAUNCHER, ray_address=address, **launcher),
    )


@pytest.fixture(scope="session")
def on_ray(epd_pool, epd_sweep, epd_settings) -> Iterator:
    """`on_ray(label, kv_class=None)`: 1E+1P+1D on the Ray cluster, from the session's pool
    (the baseline served first: never two starts at once). At the end the Ray sessions are
    stopped and the cluster with them, before the rest of the pool."""
    used: list[LauncherChoice] = []

    def live(label: str, kv_class: str | None = None) -> LiveTopology:
        epd_sweep.serve_baseline()
        settings = ray_settings(epd_settings, label, kv_class)
        used.append(settings.launcher)
        session = epd_pool.session(TOPOLOGIES["1E+1P+1D"], settings)
        assert isinstance(session, TopologySession), session
        return LiveTopology(session, epd_sweep)

    yield live
    for launcher in dict.fromkeys(used):
        epd_pool.release(launcher=launcher)
    end_launchers()  # the Ray connection, and the rehearsal cluster it started


def judged(live: LiveTopology, prompt: str) -> CaseRecord:
    """One request, judged against the shared baseline on the run's one judging path."""
    record = live.judge(live.send(prompt))
    print(format_failure(record))
    return record


def assert_on_distinct_nodes(session: TopologySession) -> None:
    nodes = {spec.name: spec.host for spec in session.instances}
    assert len(set(nodes.values())) == len(nodes), nodes
    for spec in session.instances:
        command = json.loads(
            (session.dir / f"{spec.name.replace('+', '-').replace('/', '__')}.cmd.json")
            .read_text(encoding="utf-8")
        )  # fmt: skip
        assert command["node"]["address"] == spec.host, command
        assert session.stats[spec.name].node == spec.host


def test_epd_on_three_nodes_matches_the_baseline(on_ray) -> None:
    """1E+1P+1D, E, P and D each on a node of its own (the run's KV connector), an image."""
    live = on_ray("ray-epd")
    assert_on_distinct_nodes(live.session)
    record = judged(live, IMAGE.name)
    assert passed_proven(record), format_failure(record)
    assert set(record.guards) == {"encoder_output", "consumer_embeds", "kv_transfer"}
    assert all(guard["ok"] for guard in record.guards.values()), record.guards


# Under `--epd-launcher ray` this module's items join the session's own 1E+1P+1D group (the
# `ray` variant is the session's own instances there: harness.testing.groups). These two take
# the cluster's nodes from it (other instances on the same three nodes; a release of every
# session on the cluster), so they run after everything else that group serves.
@pytest.mark.ci
@pytest.mark.epd_ends_session
def test_epd_on_three_nodes_with_kv_over_nixl_matches(on_ray, epd_settings) -> None:
    """The same, the KV moving from P's node to D's over NIXL (the whole-prompt rule, read
    from D's /metrics across nodes). CI's one NIXL case and its one Ray case at once: across
    nodes KV moves over NIXL (ExampleConnector needs storage every node shares), and on 2 cores
    each topology under NIXL costs about two cores while it is up (its progress threads spin,
    docs/connectors.md), so one start covers both."""
    try:
        check_kv_connector(epd_settings.vllm, NIXL)
    except BadInput as exc:
        pytest.fail(f"epd-harness: {exc}", pytrace=False)
    live = on_ray("ray-nixl", kv_class=NIXL.vllm_class)
    assert_on_distinct_nodes(live.session)
    record = judged(live, IMAGE.name)
    assert passed_proven(record), format_failure(record)
    evidence = record.guards["kv_transfer"]["evidence"]
    assert "whole prompt rule" in evidence and record.guards["kv_transfer"]["ok"], evidence


@pytest.mark.epd_ends_session
def test_a_side_channel_left_at_localhost_is_an_error_naming_it(
    on_ray, epd_pool, epd_config, epd_settings
) -> None:
    """Planted: every instance told VLLM_NIXL_SIDE_CHANNEL_HOST=localhost. The topology is
    refused before any instance starts; its cases are ERROR and name instance and variable.
    (A sweep of its own: the refusal is the sweep's account of a topology that cannot start.)"""
    settings = ray_settings(
        epd_settings,
        "ray-planted-localhost",
        kv_class=NIXL.vllm_class,
        instance_env=(("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost"),),
    )
    for key in epd_pool.running():  # this sweep's pool is its own: free the cluster's nodes
        if not key.launcher.is_local:
            epd_pool.release(key.topology, key.launcher)
    spec = SweepSpec(topologies=(TOPOLOGIES["1P+1D"],), prompts=(IMAGE,))
    sweep = Sweep(spec, settings, baseline_cache=epd_config.baseline_cache)
    (record,) = sweep.judge("1P+1D", IMAGE.name)
    assert record.verdict is Verdict.ERROR and not record.policy_passed, format_failure(record)
    assert "1P+1D could not start: LaunchRefused: 1P+1D/prefill0: VLLM_NIXL_SIDE_CHANNEL_HOST " in (
        record.error or ""
    ), record.error
    assert "is 'localhost', but its node's address is 127.0.0." in (record.error or "")
    assert not list(settings.run_dir.rglob("*prefill0.log"))  # never started
