"""A load against an attached deployment (fake processes: tests/test_attach_process.py's), the
harness launching nothing of it but its baseline (the fake `vllm`): every answer judged, the
deployment's EC storage sampled; and an instance of it that is down ends the load with its name.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from test_attach_process import MODEL, Deployment, attach_settings
from test_attach_process import deployment as deployment  # the fixture

from harness.judge.records import Verdict
from harness.outcomes.chat import parse_chat_response
from harness.outcomes.outcome import Outcome
from harness.run.baseline_cache import BaselineCache, baseline_key
from harness.run.baseline_launch import BaselineLaunch
from harness.run.load.run import LoadRun
from harness.run.sweep import Sweep, SweepSpec
from harness.spec.load import LoadSpec, load_mix
from harness.spec.prompts import render_request
from harness.spec.settings import ServedVllm
from harness.testing.fake_vllm import install_fake_vllm

pytestmark = pytest.mark.process

MIX = load_mix(3)


def fake_answer(max_tokens: int) -> dict:
    """What the fake pd (and the fake baseline) answer, token for token."""
    top = [{"token": f"token_id:{7 + i}", "logprob": -0.5} for i in range(max_tokens)]
    return {
        "prompt_token_ids": [1, 2, 3],
        "usage": {"prompt_tokens": 3, "completion_tokens": max_tokens},
        "choices": [
            {
                "finish_reason": "length",
                "token_ids": [7 + i for i in range(max_tokens)],
                "message": {"content": "fake"},
                "logprobs": {"content": [{**t, "top_logprobs": [t]} for t in top]},
            }
        ],
    }


def load_on(tmp_path: Path, fake: Deployment, requests: int, concurrency: int, **kwargs) -> LoadRun:
    settings = attach_settings(tmp_path, fake.spec, "load")
    vllm = install_fake_vllm(tmp_path / "bin")
    settings = dataclasses.replace(settings, vllm=ServedVllm(str(vllm), settings.vllm.version))
    cache = BaselineCache(tmp_path / "baseline-cache")
    for prompt in MIX:
        body = render_request(prompt, settings.serving.served_model_name)
        key = baseline_key(
            settings.vllm, settings.serving, MODEL, body, launch=BaselineLaunch.of(settings)
        )
        result = parse_chat_response(fake_answer(prompt.max_tokens))
        cache.store(key, Outcome(prompt.name, result=result), batched=True)
    sweep = Sweep(SweepSpec((), (), baseline_only_prompts=MIX), settings, baseline_cache=cache)
    spec = LoadSpec("1E+1PD", requests=requests, concurrency=concurrency, distinct_media=3)
    return LoadRun(spec, sweep, **kwargs)


def test_a_load_on_an_attached_deployment_judges_every_answer(
    tmp_path: Path,
    deployment: Deployment,  # noqa: F811
) -> None:
    load = load_on(tmp_path, deployment, 9, 3, on_progress=print)
    try:
        result = load.run()
    finally:
        load.sweep.pool.close()
    assert [r.record.verdict for r in result.results] == [Verdict.MATCH] * 9
    assert result.passed and result.calibration is not None
    media = [r for r in result.results if r.outcome.media_count]
    # Sent 3 at a time, a request's EC files and encoder count are partly the others': the
    # guard is then not checkable, never held on them (and never failed).
    guards = [r.record.guards["encoder_output"] for r in media]
    assert media and all(g["ok"] or g.get("not_checkable") for g in guards), guards
    assert any(g.get("not_checkable") for g in guards), guards
    last = result.resources.last
    assert last is not None and last.storage["ec"].files > 0  # the deployment's storage, sampled
    assert not last.instances  # nothing of it was launched: no process to read


def test_an_attached_instance_that_dies_ends_the_load_naming_it(
    tmp_path: Path,
    deployment: Deployment,  # noqa: F811
) -> None:
    def kill_as_the_round_starts(line: str) -> None:
        print(line)
        if "at a time" in line:
            deployment.kill("pd")

    load = load_on(tmp_path, deployment, 6, 1, on_progress=kill_as_the_round_starts)
    try:
        result = load.run()
    finally:
        load.sweep.pool.close()
    assert all(r.record.verdict is Verdict.ERROR for r in result.results)
    assert result.ended_by is not None and "1E+1PD/pd0" in result.ended_by, result.ended_by
    assert all("1E+1PD/pd0" in r.record.detail for r in result.results)
    assert sum(r.not_sent for r in result.results) == 5  # the first found it down; no more sent
    assert not result.passed


def test_an_attached_deployment_down_at_the_start_sends_nothing(
    tmp_path: Path,
    deployment: Deployment,  # noqa: F811
) -> None:
    load = load_on(tmp_path, deployment, 4, 1, on_progress=print)
    deployment.kill("pd")
    try:
        result = load.run()
    finally:
        load.sweep.pool.close()
    assert [r.not_sent for r in result.results] == [True] * 4
    assert all("1E+1PD/pd0" in r.record.detail for r in result.results)
    # Of the load's one round, though none was sent: no round 0 in load-requests.jsonl.
    assert [r.round_number for r in result.results] == [1] * 4


def test_an_attached_deployment_serving_otherwise_sends_nothing(
    tmp_path: Path, port_locks: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deployment whose instances report another max_model_len than the baseline's ends the
    load as one that is down does: nothing sent, every request naming the instance (not a
    traceback of the session's refusal)."""
    monkeypatch.setenv("FAKE_DEPLOYMENT_MAX_MODEL_LEN", "2048")
    fake = Deployment(tmp_path)
    fake.start()
    try:
        load = load_on(tmp_path, fake, 2, 1, on_progress=print)
        try:
            result = load.run()
        finally:
            load.sweep.pool.close()
    finally:
        fake.stop()
    assert [r.not_sent for r in result.results] == [True] * 2
    assert result.ended_by is not None and "max_model_len 2048" in result.ended_by
