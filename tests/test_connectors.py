"""KV connectors as a dimension of a run: the guard's rule per connector, the baseline cache key,
the rendered kv-transfer-config, and the one-line refusals of --kv-connector."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from harness.errors import BadInput
from harness.judge.guards import check_kv_transfer, check_transfers, kv_rule_for
from harness.preflight.connectors import check_kv_connector
from harness.run.baseline_cache import baseline_key
from harness.serve.client import ChatResult
from harness.spec.connectors import (
    EXAMPLE,
    NIXL,
    KvRule,
    expected_kv_tokens,
    get_kv_connector,
    kv_connector_for_class,
)
from harness.spec.instances import InstanceSpec
from harness.spec.settings import ServedVllm
from harness.spec.topology import Role, ServingConfig, get_topology

SERVED = ServedVllm("/venv/bin/vllm", "0.32.0+cpu", "2.13.0+cpu")
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def d_result(prompt_tokens: int, cached: int | None) -> ChatResult:
    return ChatResult(prompt_token_ids=tuple(range(prompt_tokens)), token_ids=(1,), text="",
                      finish_reason="length", cached_tokens=cached)  # fmt: skip


# --- the rule per connector -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rule", "prompt", "expected"),
    [
        (KvRule.BLOCK_ALIGNED_PREFIX, 89, 64),
        (KvRule.BLOCK_ALIGNED_PREFIX, 185, 160),
        (KvRule.BLOCK_ALIGNED_PREFIX, 32, 0),
        (KvRule.WHOLE_PROMPT, 89, 88),
        (KvRule.WHOLE_PROMPT, 185, 184),
        (KvRule.WHOLE_PROMPT, 32, 31),
    ],
)
def test_expected_tokens_per_rule(rule: KvRule, prompt: int, expected: int) -> None:
    assert expected_kv_tokens(rule, prompt, 32) == expected


def test_nixl_rule_refuses_what_the_example_rule_accepts() -> None:
    """64 of 89 is all ExampleConnector moves, but under NIXL it means the partial last block
    was recomputed: D did not get the whole prompt."""
    result = d_result(89, 64)
    example = check_kv_transfer(result, 32, KvRule.BLOCK_ALIGNED_PREFIX)
    nixl = check_kv_transfer(result, 32, KvRule.WHOLE_PROMPT)
    assert example.ok and not nixl.ok
    assert "block-aligned prefix rule" in example.evidence and "expected >= 64" in example.evidence
    assert "whole prompt rule" in nixl.evidence and "expected >= 88" in nixl.evidence


@pytest.mark.parametrize("cached", [None, 0, 32, 87])
def test_nixl_rule_fails_short_of_the_whole_prompt(cached: int | None) -> None:
    assert check_kv_transfer(d_result(89, cached), 32, KvRule.WHOLE_PROMPT).ok is False


@pytest.mark.parametrize("cached", [88, 89])
def test_nixl_rule_holds_for_the_whole_prompt(cached: int) -> None:
    assert check_kv_transfer(d_result(89, cached), 32, KvRule.WHOLE_PROMPT).ok is True


def test_rule_follows_the_serving_config_connector() -> None:
    assert kv_rule_for("ExampleConnector") is KvRule.BLOCK_ALIGNED_PREFIX
    assert kv_rule_for("NixlConnector") is KvRule.WHOLE_PROMPT
    # a connector given through extra_args: the weaker rule, which any connector meets
    assert kv_rule_for("SomeOtherConnector") is KvRule.BLOCK_ALIGNED_PREFIX


def test_check_transfers_applies_the_rule_it_is_given(tmp_path: Path) -> None:
    [guard] = check_transfers(get_topology("1P+1D"), None, d_result(89, 64), tmp_path, 32,
                              KvRule.WHOLE_PROMPT)  # fmt: skip
    assert not guard.ok and "whole prompt" in guard.evidence


# --- names and rendering ----------------------------------------------------------------------


def test_names_and_classes_round_trip() -> None:
    assert get_kv_connector("nixl") is NIXL and get_kv_connector("example") is EXAMPLE
    assert kv_connector_for_class("NixlConnector") is NIXL
    with pytest.raises(BadInput, match="KV connector"):
        get_kv_connector("mooncake")


def kv_config(role: Role, vllm_class: str, tmp_path: Path) -> dict:
    serving = ServingConfig(model="m", kv_connector=vllm_class)
    spec = InstanceSpec("t/x", role, 20000, serving, kv_storage=tmp_path, devices=(0,),
                        side_channel_port=20100)  # fmt: skip
    argv = spec.argv()
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE])
def test_nixl_instances_get_the_long_lease_and_cpu_buffers(role: Role, tmp_path: Path) -> None:
    config = kv_config(role, "NixlConnector", tmp_path)
    assert config["kv_connector_extra_config"] == {"kv_lease_duration": 300}
    assert config["kv_buffer_device"] == "cpu"


def test_example_instances_keep_only_their_storage(tmp_path: Path) -> None:
    config = kv_config(Role.DECODE, "ExampleConnector", tmp_path)
    assert config["kv_connector_extra_config"] == {"shared_storage_path": str(tmp_path)}


# --- the baseline cache key -------------------------------------------------------------------


def test_baseline_is_rendered_without_a_connector_so_its_key_ignores_it() -> None:
    """The decision behind NUMERICS_NEUTRAL_FIELDS: the baseline runs no KV connector, so its
    argv and env are the same under either, and so is its cache key. If the renderer ever gave
    the baseline a connector, the first assertion fails and the key must include it again."""
    example = ServingConfig(model="m", kv_connector="ExampleConnector")
    nixl = dataclasses.replace(example, kv_connector="NixlConnector")
    baselines = [InstanceSpec("b/baseline0", Role.BASELINE, 20000, s, devices=(0,))
                 for s in (example, nixl)]  # fmt: skip
    assert baselines[0].argv() == baselines[1].argv()
    assert baselines[0].env() == baselines[1].env()
    assert baseline_key(SERVED, example, "d", BODY) == baseline_key(SERVED, nixl, "d", BODY)


def test_baseline_key_still_changes_with_the_ec_connector_and_block_size() -> None:
    serving = ServingConfig(model="m")
    key = baseline_key(SERVED, serving, "d", BODY)
    assert key != baseline_key(SERVED, dataclasses.replace(serving, block_size=16), "d", BODY)


# --- the preflight refusal --------------------------------------------------------------------


def fake_vllm(tmp_path: Path, python: str) -> str:
    script = tmp_path / "vllm"
    script.write_text(f"#!{python}\n")
    script.chmod(0o755)
    return str(script)


@pytest.mark.process  # runs a stand-in interpreter
def test_nixl_refused_in_one_line_when_the_served_python_lacks_it(tmp_path: Path) -> None:
    interpreter = tmp_path / "python"
    interpreter.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'nixl'\" >&2\n"
                           "exit 1\n")  # fmt: skip
    interpreter.chmod(0o755)
    served = dataclasses.replace(SERVED, executable=fake_vllm(tmp_path, str(interpreter)))
    with pytest.raises(BadInput) as caught:
        check_kv_connector(served, NIXL)
    message = str(caught.value)
    assert "\n" not in message
    assert "--kv-connector nixl needs nixl" in message
    assert "No module named 'nixl'" in message
    assert "scripts/cpu setup --nixl" in message


def test_example_connector_needs_no_probe(tmp_path: Path) -> None:
    served = dataclasses.replace(SERVED, executable=str(tmp_path / "missing-vllm"))
    check_kv_connector(served, EXAMPLE)  # would fail if it probed anything


# --- the planted KV fault under NIXL ----------------------------------------------------------


def test_zero_kv_under_nixl_misroutes_the_block_ids_p_hands_to_d(tmp_path: Path) -> None:
    from harness.run.faults import fault_for

    fault = fault_for("zero-kv", None, tmp_path, "NixlConnector")
    response = {"kv_transfer_params": {"remote_block_ids": [[4, 5, 6]], "remote_port": 1}}
    fault.after_prefill("r1", response)
    assert response["kv_transfer_params"]["remote_block_ids"] == [[6, 5, 4]]
    assert fault.effects == ["r1: remote_block_ids [[4, 5, 6]] -> [[6, 5, 4]]"]
    assert fault.problems == []


@pytest.mark.parametrize(
    ("params", "problem"),
    [({}, "no remote_block_ids"), ({"remote_block_ids": [[7]]}, "nothing to misroute")],
)
def test_nixl_fault_that_cannot_act_says_so(params: dict, problem: str, tmp_path: Path) -> None:
    from harness.run.faults import fault_for

    fault = fault_for("zero-kv", None, tmp_path, "NixlConnector")
    fault.after_prefill("r1", {"kv_transfer_params": params})
    assert problem in fault.problems[0] and not fault.effects


def test_kv_noise_has_no_nixl_form(tmp_path: Path) -> None:
    from harness.run.faults import fault_for

    with pytest.raises(BadInput, match="KV never leaves P's memory"):
        fault_for("kv-noise:0.1", None, tmp_path, "NixlConnector")
