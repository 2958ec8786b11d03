"""E, P and D on three nodes of a Ray cluster, judged exactly as on one host.

Without `--epd-ray-address` the harness starts a one-host rehearsal cluster of three nodes
(127.0.0.2-4) at the first Ray topology and stops it at the end of the module. The instances
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
from harness.judge.guards import session_guards
from harness.judge.records import CaseRecord, Verdict
from harness.judge.verdicts import judge_case
from harness.preflight.connectors import check_kv_connector
from harness.preflight.launcher import check_launcher
from harness.report.text import format_failure
from harness.run.sweep import Sweep, SweepSpec
from harness.serve.launcher import end_launchers
from harness.serve.session import TopologySession
from harness.spec.connectors import NIXL
from harness.spec.prompts import SKELETON_PROMPTS
from harness.spec.settings import RAY_LAUNCHER, LauncherChoice, RunSettings
from harness.spec.topology import TOPOLOGIES

pytestmark = pytest.mark.e2e

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
        check_launcher(RayRequest())  # Ray installed here, or one line saying how
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


@pytest.fixture(scope="module", autouse=True)
def one_cluster_for_the_module() -> Iterator[None]:
    yield
    end_launchers()  # the Ray connection, and the rehearsal cluster it started


def judged(epd_sweep, session: TopologySession, prompt: str) -> CaseRecord:
    """One request on `session`, judged against the shared baseline as every case is."""
    outcome = session.send(prompt, epd_sweep.bodies[prompt])
    record = judge_case(
        session.topology.name,
        "baseline",
        epd_sweep.serve_baseline()[prompt],
        outcome,
        session_guards(session, outcome),
        baseline_stable=epd_sweep.stability[prompt][0],
    )
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


@pytest.mark.ci
def test_epd_on_three_nodes_matches_the_baseline(epd_sweep, epd_settings) -> None:
    """1E+1P+1D, E, P and D each on a node of its own (the run's KV connector), an image."""
    epd_sweep.serve_baseline()
    settings = ray_settings(epd_settings, "ray-epd")
    with TopologySession(TOPOLOGIES["1E+1P+1D"], settings) as session:
        assert_on_distinct_nodes(session)
        record = judged(epd_sweep, session, IMAGE.name)
    assert record.verdict is Verdict.MATCH and record.policy_passed, format_failure(record)
    assert set(record.guards) == {"encoder_output", "consumer_embeds", "kv_transfer"}
    assert all(guard["ok"] for guard in record.guards.values()), record.guards


def test_epd_on_three_nodes_with_kv_over_nixl_matches(epd_sweep, epd_settings) -> None:
    """The same, the KV moving from P's node to D's over NIXL (the whole-prompt rule, read
    from D's /metrics across nodes)."""
    try:
        check_kv_connector(epd_settings.vllm, NIXL)
    except BadInput as exc:
        pytest.fail(f"epd-harness: {exc}", pytrace=False)
    epd_sweep.serve_baseline()
    settings = ray_settings(epd_settings, "ray-nixl", kv_class=NIXL.vllm_class)
    with TopologySession(TOPOLOGIES["1E+1P+1D"], settings) as session:
        assert_on_distinct_nodes(session)
        record = judged(epd_sweep, session, IMAGE.name)
    assert record.verdict is Verdict.MATCH and record.policy_passed, format_failure(record)
    evidence = record.guards["kv_transfer"]["evidence"]
    assert "whole prompt rule" in evidence and record.guards["kv_transfer"]["ok"], evidence


def test_a_side_channel_left_at_localhost_is_an_error_naming_it(epd_config, epd_settings) -> None:
    """Planted: every instance told VLLM_NIXL_SIDE_CHANNEL_HOST=localhost. The topology is
    refused before any instance starts; its cases are ERROR and name instance and variable."""
    settings = ray_settings(
        epd_settings,
        "ray-planted-localhost",
        kv_class=NIXL.vllm_class,
        instance_env=(("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost"),),
    )
    spec = SweepSpec(topologies=(TOPOLOGIES["1P+1D"],), prompts=(IMAGE,))
    sweep = Sweep(spec, settings, baseline_cache=epd_config.baseline_cache)
    (record,) = sweep.judge("1P+1D", IMAGE.name)
    assert record.verdict is Verdict.ERROR and not record.policy_passed, format_failure(record)
    assert "1P+1D could not start: LaunchRefused: 1P+1D/prefill0: VLLM_NIXL_SIDE_CHANNEL_HOST " in (
        record.error or ""
    ), record.error
    assert "is 'localhost', but its node's address is 127.0.0." in (record.error or "")
    assert not (settings.run_dir / "1P-1D" / "1P-1D__prefill0.log").exists()  # never started
