"""The baseline cache: keys that change with anything numerics-relevant, corrupt entries refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from harness.outcomes.chat import ChatResult, PositionLogprobs
from harness.outcomes.outcome import Outcome
from harness.run.baseline_cache import BaselineCache, BaselineCacheError, baseline_key
from harness.spec.settings import ServedVllm
from harness.spec.topology import ServingConfig

pytestmark = pytest.mark.unit

SERVING = ServingConfig(model="/models/tiny")
SERVED = ServedVllm("/venv/bin/vllm", "0.32.0+cpu", "2.13.0+cpu")
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.0}
RESULT = ChatResult(
    prompt_token_ids=(1, 2, 3),
    token_ids=(7, 8),
    text="ab",
    finish_reason="length",
    logprobs=(PositionLogprobs(7, -0.5, ((7, -0.5), (9, -1.0))),),
)


def test_key_is_stable_and_changes_with_what_changes_tokens() -> None:
    key = baseline_key(SERVED, SERVING, "digest-a", BODY)
    assert key == baseline_key(SERVED, SERVING, "digest-a", dict(BODY))
    assert key != baseline_key(SERVED, SERVING, "digest-b", BODY), (
        "model content must be in the key"
    )
    assert key != baseline_key(
        SERVED, dataclasses.replace(SERVING, block_size=16), "digest-a", BODY
    )
    assert key != baseline_key(
        SERVED, dataclasses.replace(SERVING, cpu_threads_per_instance=2), "digest-a", BODY
    )
    assert key != baseline_key(SERVED, SERVING, "digest-a", {**BODY, "seed": 7})


def test_key_is_the_served_vllm_and_torch_not_the_harness_interpreters() -> None:
    """Trap: the key once read the vLLM version of the harness's own interpreter, so a
    baseline of one vLLM was reused for another served through --vllm."""
    key = baseline_key(SERVED, SERVING, "d", BODY)
    other_vllm = dataclasses.replace(SERVED, version="0.31.0+cpu")
    other_torch = dataclasses.replace(SERVED, torch_version="2.9.1+cpu")
    assert key != baseline_key(other_vllm, SERVING, "d", BODY)
    assert key != baseline_key(other_torch, SERVING, "d", BODY)
    moved = dataclasses.replace(SERVED, executable="/elsewhere/bin/vllm")
    assert key == baseline_key(moved, SERVING, "d", BODY), "the same version elsewhere is equal"


def test_unknown_served_version_is_never_cached() -> None:
    with pytest.raises(ValueError, match="unknown vLLM version"):
        baseline_key(ServedVllm("/opt/vllm", "unknown"), SERVING, "d", BODY)


def test_key_ignores_where_the_model_lives() -> None:
    moved = dataclasses.replace(SERVING, model="/elsewhere/tiny")
    assert baseline_key(SERVED, SERVING, "d", BODY) == baseline_key(SERVED, moved, "d", BODY)


def test_store_then_load_round_trips(tmp_path: Path) -> None:
    cache = BaselineCache(tmp_path)
    assert cache.load("k", "image") is None
    with cache.locked():
        cache.store("k", Outcome(prompt="image", result=RESULT), noise_floor_nats=0.25)
    loaded = cache.load("k", "image")
    assert loaded is not None and loaded.outcome.result == RESULT
    assert loaded.outcome.prompt == "image" and loaded.noise_floor_nats == 0.25


def test_failed_outcomes_are_not_stored(tmp_path: Path) -> None:
    cache = BaselineCache(tmp_path)
    cache.store("k", Outcome(prompt="image", error="boom"))
    assert cache.load("k", "image") is None


def test_corrupt_entry_is_an_error_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "k.json").write_text("{not json")
    with pytest.raises(BaselineCacheError, match=r"corrupt baseline cache entry .*k\.json"):
        BaselineCache(tmp_path).load("k", "image")
