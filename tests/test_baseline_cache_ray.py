"""The baseline cache on a Ray cluster: the baseline runs on a node, under the node's
environment (its raylet's), not the harness's. What it computed is stored under the variables
it inherited there (its Reservation's, recorded in its `.cmd.json`), so an entry's key says
what computed it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from harness.outcomes.outcome import Outcome
from harness.run.baseline import BaselineAnswers
from harness.run.baseline_cache import BaselineCache
from harness.spec.platforms import CPU
from harness.spec.settings import RAY_LAUNCHER, LauncherChoice, RunSettings, ServedVllm
from harness.spec.topology import serving_for
from harness.testing.builders import chat

pytestmark = pytest.mark.unit

SERVED = ServedVllm("/venv/bin/vllm", "0.32.0+cpu", "2.13.0+cpu")
BODIES = {"a": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.0}}
# What the baseline's node gave it, set there, not on the harness's host. (The
# OMP_NUM_THREADS=1 Ray sets on its workers is rendered over on cpu: no part of this.)
NODE_ENV = {"VLLM_ATTENTION_BACKEND": "TORCH_SDPA", "ONEDNN_MAX_CPU_ISA": "AVX2"}


class BaselineOnANode:
    """A running baseline on a Ray node: answers every request alike; inherited `NODE_ENV`
    (`TopologySession.inherited_envs`, from its agent's `where`)."""

    inherited_envs = [NODE_ENV]

    def send(self, name: str, body: dict[str, Any]) -> Outcome:
        return Outcome(name.removesuffix("-partner"), chat((5, 6), top=lambda i, t: [(t, -0.5)]))


def ray_settings(tmp_path: Path) -> RunSettings:
    return RunSettings(
        serving=serving_for(CPU, "/not-a-dir-model", max_model_len=4096),
        run_dir=tmp_path / "run",
        vllm=SERVED,
        launcher=LauncherChoice(RAY_LAUNCHER, "head:6379"),
    )


def warm_run(tmp_path: Path, cache: BaselineCache) -> BaselineAnswers:
    answers = BaselineAnswers(ray_settings(tmp_path), cache)
    answers.add(BODIES)
    answers.load_stored()
    return answers


def test_a_baseline_on_a_ray_node_is_stored_under_the_nodes_variables_not_the_harnesss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Keyed by the harness's variables, an answer the node computed under
    VLLM_ATTENTION_BACKEND=TORCH_SDPA stood in for a run whose baseline inherits no such
    variable (and a harness exporting the nodes' variables missed it). Found in review."""
    for name in NODE_ENV:
        monkeypatch.delenv(name, raising=False)
    cache = BaselineCache(tmp_path / "cache")
    first = BaselineAnswers(ray_settings(tmp_path), cache)
    first.add(BODIES)
    with caplog.at_level(logging.WARNING, logger="harness.run.baseline"):
        first.answer_on(BaselineOnANode())  # type: ignore[arg-type]
    assert first.sources["a"]["source"] == "this run's baseline"

    assert warm_run(tmp_path, cache).missing() == ["a"], (
        "an answer computed under the node's VLLM_ATTENTION_BACKEND=TORCH_SDPA answered a run "
        "keyed without it"
    )
    with monkeypatch.context() as env:
        for name, value in NODE_ENV.items():
            env.setenv(name, value)
        assert warm_run(tmp_path, cache).missing() == [], "keyed as the node ran it: a hit"
    # The run says so, naming each variable, and what makes a later run hit it.
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "VLLM_ATTENTION_BACKEND=TORCH_SDPA" in warned and "ONEDNN_MAX_CPU_ISA=AVX2" in warned
