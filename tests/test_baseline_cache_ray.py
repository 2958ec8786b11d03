"""The baseline cache on a Ray cluster: the baseline runs on a node, under the node's
environment (its raylet's), not the harness's. What it computed is stored under the variables
it inherited there (its Reservation's, recorded in its `.cmd.json`), so an entry's key says
what computed it."""

from __future__ import annotations

import dataclasses
import logging
import os
import types
from pathlib import Path
from typing import Any

import pytest

from harness.outcomes.outcome import Outcome
from harness.run.baseline import BaselineAnswers
from harness.run.baseline_cache import BaselineCache
from harness.run.baseline_launch import BaselineLaunch
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
    fake_cluster(monkeypatch, {})  # the node asked gave none; the baseline's node did
    with caplog.at_level(logging.WARNING, logger="harness.run.baseline"):
        first.answer_on(BaselineOnANode())  # type: ignore[arg-type]
    assert first.sources["a"]["source"] == "this run's baseline"

    fake_cluster(monkeypatch, {})  # a later run's nodes give no such variable
    assert warm_run(tmp_path, cache).missing() == ["a"], (
        "an answer computed under the node's VLLM_ATTENTION_BACKEND=TORCH_SDPA answered a run "
        "keyed without it"
    )
    fake_cluster(monkeypatch, NODE_ENV)
    assert warm_run(tmp_path, cache).missing() == [], "keyed as the node ran it: a hit"
    # The run says so, naming each variable.
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "VLLM_ATTENTION_BACKEND=TORCH_SDPA" in warned and "ONEDNN_MAX_CPU_ISA=AVX2" in warned


def test_what_the_launcher_gives_every_instance_is_in_the_baseline_key(
    tmp_path: Path,
) -> None:
    """`--ray-instance-env` is given to every instance on the cluster, the baseline included,
    over what its node gives it: a baseline served with VLLM_ATTENTION_BACKEND set there must
    not answer a run without it (nor the other way), whatever the nodes inherit."""
    plain = BaselineLaunch.of(ray_settings(tmp_path), environ={}, inherited={})
    keys = {plain}
    for given in ("TORCH_SDPA", "FLASH_ATTN"):
        launcher = LauncherChoice(
            RAY_LAUNCHER, "head:6379", instance_env=(("VLLM_ATTENTION_BACKEND", given),)
        )
        settings = dataclasses.replace(ray_settings(tmp_path), launcher=launcher)
        launch = BaselineLaunch.of(settings, environ={}, inherited={})
        assert ("VLLM_ATTENTION_BACKEND", given) in launch.env, launch.env
        keys.add(launch)
    assert len(keys) == 3, "a baseline served under one --ray-instance-env answers another"


def fake_cluster(monkeypatch: pytest.MonkeyPatch, node_env: dict[str, str]) -> list[str]:
    """A fake Ray whose every node has `node_env`: an agent placed there answers the real
    `InstanceAgent.where` under it. Returns the list of what was done with agents."""
    from harness.serve import ray_agent, ray_launcher

    done: list[str] = []
    context = types.SimpleNamespace(
        get_node_id=lambda: "n" * 56, get_accelerator_ids=lambda: {"GPU": []}
    )
    monkeypatch.setattr(ray_agent.ray, "get_runtime_context", lambda: context)
    monkeypatch.setattr(ray_agent.ray.util, "get_node_ip_address", lambda: "10.0.0.2")

    def where_on_the_node() -> dict[str, Any]:
        done.append("where")
        with monkeypatch.context() as node:
            node.setattr(os, "environ", {**node_env, **ray_agent.AGENT_ENV})
            return ray_agent.InstanceAgent().where()

    agent = types.SimpleNamespace(where=types.SimpleNamespace(remote=where_on_the_node))
    options = types.SimpleNamespace(remote=lambda: agent)
    monkeypatch.setattr(
        ray_launcher, "RemoteAgent", types.SimpleNamespace(options=lambda **_: options)
    )
    monkeypatch.setattr(
        ray_launcher, "runtime", lambda: types.SimpleNamespace(connect=lambda *_: None)
    )
    monkeypatch.setattr(ray_launcher, "get_or_refuse", lambda answer, doing: answer)
    monkeypatch.setattr(ray_launcher.ray, "kill", lambda _: done.append("kill"))
    return done


def test_a_warm_run_on_a_ray_cluster_looks_the_baseline_up_by_its_nodes_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lookup, before any start, was keyed by the harness's variables, which reach no node:
    a second run on the same cluster, its nodes unchanged, missed the entry its baseline had
    stored and served the baseline again. It now asks an agent on a node of the cluster what
    an instance inherits there (and ends it). Found in review."""
    for name in NODE_ENV:
        monkeypatch.delenv(name, raising=False)
    cache = BaselineCache(tmp_path / "cache")
    first = BaselineAnswers(ray_settings(tmp_path), cache)
    first.add(BODIES)
    fake_cluster(monkeypatch, NODE_ENV)
    first.answer_on(BaselineOnANode())  # type: ignore[arg-type]

    done = fake_cluster(monkeypatch, NODE_ENV)
    warm = warm_run(tmp_path, cache)
    assert warm.missing() == [], "the same cluster's entry missed: keyed by the harness's env"
    assert done == ["where", "kill"]
    warm.load_stored(again=True)
    assert done == ["where", "kill"], "the cluster is asked once per run"

    other = fake_cluster(monkeypatch, {"VLLM_ATTENTION_BACKEND": "FLASH_ATTN"})
    assert warm_run(tmp_path, cache).missing() == ["a"] and other == ["where", "kill"], (
        "nodes that give another backend hit the entry computed under TORCH_SDPA"
    )


def test_goldens_a_ray_run_stored_answer_golden_on_the_same_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The goldens are stored under the variables the baseline's node gave it (as the cache's
    entries); `--golden` looked them up by the harness's, so a run on the same cluster found
    no golden its own earlier run had stored there (found in review)."""
    from harness.run.goldens import GoldenStore

    for name in NODE_ENV:
        monkeypatch.delenv(name, raising=False)
    goldens = GoldenStore(tmp_path / "goldens")
    fake_cluster(monkeypatch, NODE_ENV)
    first = BaselineAnswers(ray_settings(tmp_path), None, goldens)
    first.add(BODIES)
    first.answer_on(BaselineOnANode())  # type: ignore[arg-type]

    fake_cluster(monkeypatch, NODE_ENV)
    golden = BaselineAnswers(ray_settings(tmp_path), None, goldens, "0.32.0")
    golden.add(BODIES)
    golden.load_stored()
    assert golden.missing() == [] and golden.sources["a"]["source"] == "golden"
