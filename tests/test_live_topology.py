"""What every e2e scenario does with a running topology of the pool (`harness.testing.live`):
send a prompt with or without a planted fault, and judge it on the run's one judging path. No
process, no socket: the session, the sweep and the request are stand-ins."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

import harness.testing.live as live_module
from harness.run.faults.planted import PlantedFault
from harness.serve.proxy import ProxyFaults
from harness.spec.topology import TOPOLOGIES, Role
from harness.testing.live import LiveTopology

pytestmark = pytest.mark.unit


def live_topology(judged: list[dict[str, Any]] | None = None) -> LiveTopology:
    """1E+1P+1D as stand-ins: its session's proxy faults, its instances' URLs, and a sweep whose
    judge records what it was asked."""
    topology = TOPOLOGIES["1E+1P+1D"]
    instances = [
        SimpleNamespace(role=Role.ENCODER, url="http://e"),
        SimpleNamespace(role=Role.PREFILL, url="http://p"),
        SimpleNamespace(role=Role.DECODE, url="http://d"),
    ]
    session = SimpleNamespace(topology=topology, faults=ProxyFaults(), instances=instances)

    def judge(topology_, observed, *, spec, declared):
        (judged if judged is not None else []).append(
            {"topology": topology_, "observed": observed, "spec": spec, "declared": declared}
        )
        return ["record"]

    sweep = SimpleNamespace(
        bodies={"text": {"messages": []}},
        settings=SimpleNamespace(stream=True),
        specs={"text": "text's spec"},
        judging=SimpleNamespace(judge=judge),
    )
    return LiveTopology(session, sweep)  # type: ignore[arg-type]


def test_a_fault_is_planted_for_its_request_and_cleared_after_it_whatever_happened(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The next request must start from a clean proxy even when the faulted one raised (a
    topology that died under the fault): a hook left behind would fault every later scenario
    on the shared topology."""
    live = live_topology()
    fault = PlantedFault(drop_encoder_metadata=True)
    seen: list[bool] = []

    def failing(session, prompt, body, stream, *, fresh_prefix):
        seen.append(session.faults.drop_encoder_metadata)
        raise RuntimeError("the topology died")

    monkeypatch.setattr(live_module, "observe", failing)
    with pytest.raises(RuntimeError, match="died"):
        live.send_with_fault(fault, "text")
    assert seen == [True], "the fault was not planted for its request"
    assert live.session.faults == ProxyFaults(), live.session.faults


def test_a_prompt_is_sent_as_the_sweeps_body_under_a_fresh_prefix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A scenario's request carries the sweep's rendered body and streaming, under a cache salt
    of its own: an earlier scenario's cached prefix on the shared topology must not answer it."""
    live = live_topology()
    asked: list[tuple[Any, ...]] = []

    def observed(session, prompt, body, stream, *, fresh_prefix):
        asked.append((prompt, body, stream, fresh_prefix))
        return "observed"

    monkeypatch.setattr(live_module, "observe", observed)
    assert live.send("text") == "observed"
    assert asked == [("text", {"messages": []}, True, True)]


def test_an_instances_url_is_its_roles_and_a_case_is_judged_with_the_prompts_spec() -> None:
    """`url(role)` is that role's instance, not the topology's first; the judge is given the
    prompt's spec and the scenario's declared failure."""
    judged: list[dict[str, Any]] = []
    live = live_topology(judged)
    assert [live.url(r) for r in (Role.ENCODER, Role.PREFILL, Role.DECODE)] == [
        "http://e",
        "http://p",
        "http://d",
    ]
    observed = SimpleNamespace(outcome=SimpleNamespace(prompt="text"))
    assert live.judge(observed, declared="declared") == "record"  # type: ignore[arg-type]
    assert judged == [
        {
            "topology": TOPOLOGIES["1E+1P+1D"],
            "observed": observed,
            "spec": "text's spec",
            "declared": "declared",
        }
    ]
