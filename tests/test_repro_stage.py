"""`repro` of a later case of a sequential matrix scenario, on the fake vLLM
(harness/testing/fake_vllm.py): the scenario's earlier requests are sent first, in its order,
to the same servers the case's request then goes to, as the run sent them; one that gets no
answer leaves the case unsent and the rerun NOT reproduced. The fake shows the order, the
bodies and the process handling; whether the stage makes real vLLM fail as recorded is e2e.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

import harness.run.judging as judging
import harness.run.sweep as sweep_module
from harness.run.repro import Bundle, reproduce
from harness.run.scenarios import get_scenario
from harness.spec.prompts import CACHE_SALT, render_request
from harness.spec.settings import ServedVllm
from harness.spec.topology import ServingConfig
from harness.testing.fake_vllm import MODE_ENV

pytestmark = pytest.mark.process

SCENARIO = get_scenario("ec-same-image-across-kwargs")  # 1E+1PD, three prompts in a row
LABEL = f"{SCENARIO.topology}:{SCENARIO.name}"
EARLIER = ("m-kwargs-image-plain", "m-kwargs-image-16-tokens")
CASE = "m-kwargs-image-36-tokens"


def scenario_bundle(root: Path, verdict: str, stream: bool = False) -> Path:
    """What a matrix run of the scenario on the fake records (`stream`: with --stream): its
    flags, every prompt's body (rendered once, as the run renders them) and the case of its
    last prompt."""
    root.mkdir(parents=True)
    (root.parent / "model").mkdir(exist_ok=True)  # a checkpoint here, as repro checks
    (root.parent / "model" / "config.json").write_text("{}")
    serving = ServingConfig(model=str(root.parent / "model"))
    run = {
        "serving": dataclasses.asdict(serving),
        "fault": None,
        "proxy": {"kind": "harness"},
        "stream": stream,
    }
    bodies = {p.name: render_request(p, serving.served_model_name) for p in SCENARIO.prompts}
    record = {
        "topology": LABEL,
        "prompt": CASE,
        "reference": "baseline",
        "verdict": verdict,
        "policy_passed": False,
    }
    (root / "run.json").write_text(json.dumps(run))
    (root / "requests.json").write_text(json.dumps(bodies))
    (root / "summary.json").write_text(json.dumps({"cases": [record]}))
    return root


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every request the rerun's sweep sends, in order: its topology, prompt, body as handed
    to `observe`, whether streamed and freshly salted, and the salt it went under."""
    calls: list[dict[str, Any]] = []
    observe, salted = sweep_module.observe, judging.fresh_prefix_request

    def observing(session, prompt, body, stream, *, fresh_prefix):
        calls.append(
            {"topology": session.topology.name, "prompt": prompt, "body": body,
             "stream": stream, "fresh_prefix": fresh_prefix, "salt": None}
        )  # fmt: skip
        return observe(session, prompt, body, stream, fresh_prefix=fresh_prefix)

    def salting(body: dict[str, Any]) -> dict[str, Any]:
        calls[-1]["salt"] = salted(body)[CACHE_SALT]
        return {**body, CACHE_SALT: calls[-1]["salt"]}

    monkeypatch.setattr(sweep_module, "observe", observing)
    monkeypatch.setattr(judging, "fresh_prefix_request", salting)
    return calls


@pytest.mark.parametrize("stream", [False, True])
def test_the_earlier_requests_go_first_to_the_same_servers_with_the_recorded_bodies(
    tmp_path: Path, fake_vllm: Path, port_locks: Path, sent: list[dict[str, Any]], stream: bool
) -> None:
    """1E+1PD is sent the scenario's first two prompts, then the case's, each with the body
    requests.json holds, streamed if the run streamed, and a cache salt of its own, as the
    matrix sent them; the baseline only the case's. Only the case is judged; the stage's
    answers are kept apart."""
    root = scenario_bundle(tmp_path / "run", "MISMATCH", stream)
    recorded = json.loads((root / "requests.json").read_text())
    served = ServedVllm(str(fake_vllm), "unknown")
    case, records, sweep = reproduce(Bundle.load(root), tmp_path / "again", served)
    try:
        on_topology = [c for c in sent if c["topology"] == SCENARIO.topology]
        assert [c["prompt"] for c in on_topology] == [*EARLIER, CASE]
        for call in on_topology:
            assert json.dumps(call["body"]) == json.dumps(recorded[call["prompt"]]), call["prompt"]
            assert (call["stream"], call["fresh_prefix"]) == (stream, True), call["prompt"]
        salts = [c["salt"] for c in on_topology]
        assert None not in salts and len(set(salts)) == len(salts), salts
        # The baseline answers the case's request alone, as the run's baseline did.
        assert list(sweep.baseline.outcomes) == [CASE]
        assert sweep.stage_unset is None
        assert [o.outcome.prompt for o in sweep.staged] == list(EARLIER)
        assert all(o.outcome.result is not None for o in sweep.staged)
        assert all((o.outcome.stream is not None) is stream for o in sweep.staged)
        assert [(r.prompt, r.verdict.value) for r in records] == [(CASE, "MATCH")], records
        responses = json.loads((tmp_path / "again/responses.json").read_text())
        assert set(responses[f"stage:{SCENARIO.topology}"]) == set(EARLIER)  # keys sorted
        requests = json.loads((tmp_path / "again/requests.json").read_text())
        assert requests == {name: recorded[name] for name in (*EARLIER, CASE)}
    finally:
        sweep.pool.close()


def test_an_earlier_request_without_an_answer_leaves_the_case_unsent_not_reproduced(
    tmp_path: Path,
    fake_vllm: Path,
    port_locks: Path,
    sent: list[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    epd_cli,
) -> None:
    """The PD dies on the scenario's first request: the stage is not the run's, so nothing
    more is sent, the case is an ERROR that was never sent, and the ERROR the bundle
    recorded is NOT reproduced by it (exit 1), the line naming the earlier request."""
    monkeypatch.setenv(MODE_ENV, "pd:die-request")
    root = scenario_bundle(tmp_path / "run", "ERROR")
    code, out, _ = epd_cli(
        "repro", root, "--vllm", fake_vllm, "--run-dir", tmp_path / "again"
    )  # fmt: skip
    assert code == 1, out
    assert [c["prompt"] for c in sent if c["topology"] == SCENARIO.topology] == [EARLIER[0]]
    assert (
        f"1E+1PD / {CASE} vs baseline: ERROR now, ERROR in the bundle: NOT reproduced: the "
        f"stage was not set: the earlier request {EARLIER[0]}, sent before it on the same "
        "servers, got no answer (" in out
    ), out
    assert "so the case's own request was not sent" in out
    summary = json.loads((tmp_path / "again/summary.json").read_text())
    [record] = summary["cases"]
    assert record["verdict"] == "ERROR"
    assert record["detail"] == (
        "request failed: not sent: the stage was not set: the earlier request "
        f"{EARLIER[0]} got no answer (its error is under stage:1E+1PD in responses.json)"
    )
    responses = json.loads((tmp_path / "again/responses.json").read_text())
    assert responses["stage:1E+1PD"][EARLIER[0]]["error"]
    # Its command lines were judged by the served vLLM's own parser first, recorded as `run`
    # records it.
    check = json.loads((tmp_path / "again/run.json").read_text())["argv_check"]
    assert check["instances"] == ["baseline/baseline0", "1E+1PD/encoder0", "1E+1PD/pd0"], check
