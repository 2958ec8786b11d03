"""An export of a later case of a sequential matrix scenario sends the scenario's earlier
requests first (`before/`), as the run sent them to the same servers: check.py against a
recording stand-in (the order and the bytes on the wire, a failed earlier request), and
run.sh on the fake vLLM (harness/testing/fake_vllm.py: the servers really get them, a death
during one is named, nothing is left running). Whether the stage makes vLLM fail as recorded
is e2e.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from export_bundle import BASELINE_IDS, REPAIR, plan_for, write_scenario_bundle
from test_export_gpu import Answering, answering, chat_answer
from test_export_process import assert_nothing_left, environment, run_sh
from test_export_reference import check_against

from harness.run.export.files import write_export

pytestmark = pytest.mark.process
__all__ = ["answering"]  # the fixture, imported for this module's tests
TakePorts = Callable[[int], list[int]]

ACROSS_KWARGS = "ec-same-image-across-kwargs"
CASE = "m-kwargs-image-36-tokens"
BEFORE = ("before/01-m-kwargs-image-plain.json", "before/02-m-kwargs-image-16-tokens.json")
KILLS_PREFILL = "epd-kv-lookup-miss-kills-prefill"
# The fake's (and the recorded baseline's) answer to the case's body.
THE_ANSWER = chat_answer(BASELINE_IDS, [[(t, -0.5)] for t in BASELINE_IDS])


def export_of(tmp_path: Path, scenario: str, prompt: str, verdict: str) -> Path:
    from harness.run.scenarios import get_scenario

    root = write_scenario_bundle(tmp_path / "run", scenario, prompt, verdict)
    plan = plan_for(root, f"{get_scenario(scenario).topology}:{prompt}")
    out = tmp_path / "export"
    write_export(plan, out, REPAIR)
    return out


def test_check_sends_the_earlier_requests_first_in_order_then_the_case(
    tmp_path: Path, answering: Callable[..., Answering]
) -> None:
    out = export_of(tmp_path, ACROSS_KWARGS, CASE, "MATCH")
    server = answering(THE_ANSWER)
    done = check_against(out, server, None)
    assert done.returncode == 0, done.stdout + done.stderr
    files = [*BEFORE, "request.json"]
    assert [json.loads(b) for b in server.received] == [
        json.loads((out / f).read_text()) for f in files
    ]
    lines = done.stdout.splitlines()
    said = [n for n, line in enumerate(lines) if line.startswith("check.py: before ")]
    assert [lines[n].split(": HTTP")[0] for n in said] == [
        f"check.py: before 1/2: {BEFORE[0]}",
        f"check.py: before 2/2: {BEFORE[1]}",
    ]
    assert all("answered (sets the stage)" in lines[n] for n in said), lines
    case_post = lines.index(f"check.py: POST {server.url}/v1/chat/completions")
    assert said[-1] < case_post, lines
    assert "MATCH: the 4 generated" in done.stdout
    assert "recorded MATCH: reproduced" in done.stdout


def test_an_earlier_request_without_an_answer_stops_check_before_the_case(
    tmp_path: Path, answering: Callable[..., Answering]
) -> None:
    """The first earlier request kills the (stand-in) instance: the stage is not set, so
    nothing more is sent, the dead instance is named, exit 2, and the recorded ERROR is NOT
    reproduced by an error of another request."""
    out = export_of(tmp_path, ACROSS_KWARGS, CASE, "ERROR")
    server = answering(THE_ANSWER, fails_from=0)
    (out / "work/state").mkdir(parents=True)
    (out / "work/state/decode0.exit").write_text("0\n")  # serve.sh noted its exit
    done = check_against(out, server, None)
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(server.received) == 1, "sent on after an earlier request got no answer"
    assert json.loads(server.received[0]) == json.loads((out / BEFORE[0]).read_text())
    assert f"check.py: before 1/2: {BEFORE[0]}: no answer: POST {server.url}" in done.stdout
    assert "-> HTTP 500" in done.stdout
    assert (
        f"ERROR: the stage was not set: {BEFORE[0]} got no answer, so request.json was not sent"
    ) in done.stdout
    assert f"decode0 (decode, {server.url}) exited with code 0" in done.stdout
    assert (
        "recorded ERROR: NOT reproduced (the stage was not set, the case's request not sent)"
        in (done.stdout)
    )
    assert "check.py: POST" not in done.stdout


def test_the_reference_is_sent_the_case_request_alone(
    tmp_path: Path, answering: Callable[..., Answering]
) -> None:
    """The run's baseline answered the case's request alone (cold): so does the reference
    `run.sh reference` serves; the earlier requests set the case's stage only."""
    out = export_of(tmp_path, ACROSS_KWARGS, CASE, "MATCH")
    server = answering(THE_ANSWER)
    done = check_against(out, server, None, mode="reference")
    assert done.returncode == 0, done.stdout + done.stderr
    assert [json.loads(b) for b in server.received] == [
        json.loads((out / "request.json").read_text())
    ]
    assert "request.json alone, as the run's baseline answered it" in done.stdout


def test_run_sh_sends_the_stage_to_the_servers_it_serves_then_the_case(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    """On the fake vLLM: D is sent the earlier request, then the case's; the case matches."""
    out = export_of(tmp_path, KILLS_PREFILL, "m-text-at-block-plus-one", "MATCH")
    env = environment(leased_ports, tmp_path)
    done = run_sh(out, env)
    assert done.returncode == 0, done.stdout + done.stderr
    first = "check.py: before 1/1: before/01-m-text-stores-the-lookup-key.json: HTTP 200"
    assert first in done.stdout
    assert "recorded MATCH: reproduced" in done.stdout
    requests = [line for line in (out / "work/logs/decode0.log").read_text().splitlines()]
    assert len([line for line in requests if line.startswith("REQUEST")]) == 2, requests
    assert_nothing_left(out, env)


def test_run_sh_names_a_death_during_an_earlier_request_and_sends_no_more(
    tmp_path: Path, leased_ports: TakePorts
) -> None:
    """D dies on its first request, the earlier one: exit 2, D named with its log, the case's
    request never sent, NOT reproduced; nothing left running."""
    out = export_of(tmp_path, KILLS_PREFILL, "m-text-at-block-plus-one", "ERROR")
    env = environment(leased_ports, tmp_path, "decode:die-request")
    done = run_sh(out, env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "check.py: before 1/1: before/01-m-text-stores-the-lookup-key.json: no answer" in (
        done.stdout
    )
    assert "ERROR: the stage was not set" in done.stdout
    assert "decode0 (decode, " in done.stdout and "fake engine core died" in done.stdout
    assert (
        "recorded ERROR: NOT reproduced (the stage was not set, the case's request not sent)"
        in (done.stdout)
    )
    assert "check.py: POST" not in done.stdout
    assert_nothing_left(out, env)
