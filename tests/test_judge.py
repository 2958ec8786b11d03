"""How outcomes and guards become a verdict (harness/judge/), without servers."""

from __future__ import annotations

import dataclasses

import pytest

from harness.judge.compare import Verdict
from harness.judge.guards import GuardResult
from harness.judge.policy import PD_DRIFT, ReferencePolicy
from harness.judge.verdicts import JudgingRules, baseline_stability
from harness.outcomes.outcome import Outcome
from harness.testing import builders
from harness.testing.judging import judged

pytestmark = pytest.mark.unit

PROMPT = (1, 2, 3)


def outcome(
    tokens: tuple[int, ...], top: tuple[int, ...] = (), error: str | None = None
) -> Outcome:
    """Each position: its token at -1.0, then `top`'s ids 0.1 nats apart."""

    def ranked(_position: int, token: int) -> list[tuple[int, float]]:
        return [(alt, -1.0 - i * 0.1) for i, alt in enumerate((token, *top))]

    return builders.outcome("image", tokens, error=error, prompt_ids=PROMPT, top=ranked)


HELD = GuardResult("kv_transfer", True, "cached 160 >= 160")
BROKEN = GuardResult("consumer_embeds", False, "parts forwarded to the consumer: ['image_url']")


def test_equal_tokens_and_held_guards_match() -> None:
    record = judged("1P+1D", "baseline", outcome((5, 6)), outcome((5, 6)), [HELD])
    assert record.verdict is Verdict.MATCH and record.policy_passed
    assert record.guards == {"kv_transfer": {"ok": True, "evidence": "cached 160 >= 160"}}


def test_equal_tokens_with_a_failed_guard_are_vacuous() -> None:
    record = judged("1E+1PD", "baseline", outcome((5, 6)), outcome((5, 6)), [HELD, BROKEN])
    assert record.verdict is Verdict.VACUOUS and not record.policy_passed
    assert "consumer_embeds" in record.detail and "image_url" in record.detail


def test_a_failed_request_is_an_error_whatever_the_guards() -> None:
    record = judged("1E+1PD", "baseline", outcome((5,)), outcome((), error="HTTP 500: boom"), [])
    assert record.verdict is Verdict.ERROR and record.error == "HTTP 500: boom"


def test_a_reference_without_result_is_an_error_naming_it() -> None:
    record = judged("1E+1P+1D", "1P+1D", outcome((), error="died"), outcome((5,)), [])
    assert record.verdict is Verdict.ERROR and "reference 1P+1D has no result" in record.detail


def test_an_empty_reference_answer_matches_nothing() -> None:
    """vLLM generates at least one id for every request the harness sends (max_tokens >= 1),
    so a reference with no generated ids is a broken answer, and equal to an empty candidate
    it compared nothing: a MATCH there proved nothing (found in review: it passed)."""
    record = judged("1E+1P+1D", "baseline", outcome(()), outcome(()), [HELD])
    assert record.verdict is Verdict.ERROR and not record.policy_passed
    assert "reference baseline generated no token ids" in record.detail
    shorter = judged("1E+1P+1D", "baseline", outcome((5,)), outcome(()), [HELD])
    assert shorter.verdict is Verdict.MISMATCH


def test_an_unstable_baseline_is_its_own_verdict() -> None:
    record = judged("1P+1D", "baseline", outcome((5,)), outcome((7,)), [], stable=False)
    assert record.verdict is Verdict.UNSTABLE_BASELINE and not record.policy_passed


def test_drift_needs_a_measured_floor_and_fails_exact_but_passes_logprob_close() -> None:
    """Near-tie (0.1 nats) at position 1 after an equal prefix."""
    reference, candidate = outcome((5, 6), top=(8,)), outcome((5, 8), top=(6,))
    exact = judged("1P+1D", "baseline", reference, candidate, [], tolerance=0.2)
    close = judged(
        "1P+1D", "baseline", reference, candidate, [], reference_policy=PD_DRIFT, tolerance=0.2
    )
    assert exact.verdict is close.verdict is Verdict.DRIFT
    assert not exact.policy_passed and close.policy_passed
    assert exact.divergence is not None and exact.divergence["index"] == 1
    on_cpu = judged("1P+1D", "baseline", reference, candidate, [], reference_policy=PD_DRIFT)
    assert on_cpu.verdict is Verdict.MISMATCH and not on_cpu.policy_passed


def test_a_drift_with_a_failed_guard_is_vacuous_not_a_pass() -> None:
    """Under pd-drift (the GPU policy) a D that got no KV and computed the prompt itself may
    drift within the noise: within it, the answer proves no transfer, as equal ids would not
    (found in review; it was DRIFT and passed)."""
    reference, candidate = outcome((5, 6), top=(8,)), outcome((5, 8), top=(6,))
    no_kv = GuardResult("kv_transfer", False, "D cached_tokens=0, expected >= 160")
    record = judged(
        "1P+1D", "baseline", reference, candidate, [no_kv], reference_policy=PD_DRIFT, tolerance=0.2
    )
    assert record.verdict is Verdict.VACUOUS and not record.policy_passed
    assert record.detail.startswith("tokens within the noise floor but guard failed: kv_transfer")
    held = judged(
        "1P+1D", "baseline", reference, candidate, [HELD], reference_policy=PD_DRIFT, tolerance=0.2
    )
    assert held.verdict is Verdict.DRIFT and held.policy_passed


def test_baseline_control_compares_the_two_answers() -> None:
    assert baseline_stability(outcome((5, 6)), outcome((5, 6))).stable is True
    unstable = baseline_stability(outcome((5, 6)), outcome((5, 9)))
    assert unstable.stable is False and "position 1" in unstable.detail
    assert unstable.noise_floor is None
    failed = baseline_stability(outcome((5,)), outcome((), error="timeout"))
    assert (failed.stable, failed.detail, failed.noise_floor) == (False, "timeout", None)


def test_a_clean_case_passes_as_a_match_or_as_a_drift_its_policy_allows() -> None:
    """What scenarios assert of a request without a fault: on GPUs a P->D topology may DRIFT
    from the monolithic baseline within the measured noise (found in review: scenarios of the
    GPU nightly asserted MATCH alone)."""
    from harness.testing.judging import passed_clean

    reference, candidate = outcome((5, 6), top=(8,)), outcome((5, 8), top=(6,))
    drift_allowed = judged(
        "1P+1D", "baseline", reference, candidate, [], reference_policy=PD_DRIFT, tolerance=0.2
    )
    drift_refused = judged("1P+1D", "baseline", reference, candidate, [], tolerance=0.2)
    assert drift_allowed.verdict is drift_refused.verdict is Verdict.DRIFT
    assert passed_clean(drift_allowed) and not passed_clean(drift_refused)
    assert passed_clean(judged("1P+1D", "baseline", outcome((5, 6)), outcome((5, 6)), [HELD]))
    vacuous = judged("1E+1PD", "baseline", outcome((5, 6)), outcome((5, 6)), [BROKEN])
    assert not passed_clean(vacuous)


def test_a_clean_case_is_proven_only_when_every_guard_was_decided() -> None:
    """A MATCH whose KV guard nothing could check (D held the prompt) passes a load's rule, not
    the scenarios' rule: each of their requests went under a salt of its own."""
    from harness.judge.guards import not_checkable
    from harness.testing.judging import passed_clean, passed_proven

    unchecked = not_checkable("kv_transfer", "D held the whole prompt")
    warm = judged("1P+1D", "baseline", outcome((5, 6)), outcome((5, 6)), [unchecked])
    proven = judged("1P+1D", "baseline", outcome((5, 6)), outcome((5, 6)), [HELD])
    assert warm.verdict is Verdict.MATCH and passed_clean(warm) and not passed_proven(warm)
    assert passed_proven(proven)


def test_a_fresh_prefix_request_has_a_salt_of_its_own_and_keeps_a_given_one() -> None:
    from harness.spec.prompts import CACHE_SALT, fresh_prefix_request

    body = {"model": "m", "messages": []}
    first, second = fresh_prefix_request(body), fresh_prefix_request(body)
    assert CACHE_SALT not in body, "the rendered body is sent to the baseline as it is"
    assert first[CACHE_SALT] != second[CACHE_SALT] and {**first, CACHE_SALT: None} == {
        **body,
        CACHE_SALT: None,
    }
    given = {**body, CACHE_SALT: "the-users-own"}
    assert fresh_prefix_request(given) == given


def test_a_failed_request_is_an_error_even_with_an_answer() -> None:
    """ "A failed request is ERROR whatever else holds": an error beside an answer (one read
    before the request failed) leaves no answer to compare."""
    answered = outcome((5, 6))
    failed = dataclasses.replace(answered, error="HTTP 500: boom")
    record = judged("1E+1PD", "baseline", answered, failed, [HELD])
    assert record.verdict is Verdict.ERROR and record.error == "HTTP 500: boom"
    assert not record.policy_passed


def test_a_reference_that_failed_is_an_error_even_with_an_answer() -> None:
    """A reference whose request failed is no answer to hold a case to, whatever it carries."""
    answered = outcome((5, 6))
    failed = dataclasses.replace(answered, error="HTTP 500: boom")
    record = judged("1E+1PD", "baseline", failed, answered, [HELD])
    assert record.verdict is Verdict.ERROR and not record.policy_passed
    assert "reference baseline has no result" in record.detail


def test_a_batched_answer_keeps_the_noise_the_control_showed() -> None:
    """A batched answer runs under the control's run-to-run noise as well as the batch's: its
    tolerance is the larger floor, never the batch's alone (a batch floor of 0 would make a
    near tie within the control's noise a MISMATCH only because it was batched)."""
    reference, candidate = outcome((5, 6), top=(8,)), outcome((5, 8), top=(6,))
    rules = JudgingRules(ReferencePolicy(PD_DRIFT), 0.2, batched_noise_floor_nats=0.0)
    assert rules.tolerance(batched=True) == 0.2
    record = judged("1E+1P+1D", "baseline", reference, candidate, rules=rules, batched=True)
    assert record.verdict is Verdict.DRIFT and record.policy_passed


def test_an_unbatched_answer_is_held_to_the_noise_of_the_request_alone() -> None:
    """The batch floor is the noise of answers computed in flight with others; an answer that
    was computed alone is held to the control's floor alone, however much a batch moved the
    baseline: a near tie of 0.1 nats passes batched under a batch floor of 0.2, and fails
    alone under a control floor of 0.05."""
    reference, candidate = outcome((5, 6), top=(8,)), outcome((5, 8), top=(6,))
    rules = JudgingRules(ReferencePolicy(PD_DRIFT), 0.05, batched_noise_floor_nats=0.2)
    assert (rules.tolerance(batched=False), rules.tolerance(batched=True)) == (0.05, 0.2)
    alone = judged("1P+1D", "baseline", reference, candidate, rules=rules)
    assert alone.verdict is Verdict.MISMATCH and not alone.policy_passed
    batched = judged("1P+1D", "baseline", reference, candidate, rules=rules, batched=True)
    assert batched.verdict is Verdict.DRIFT and batched.policy_passed


def test_an_answer_equal_to_its_reference_is_its_own_whoever_else_gave_it() -> None:
    """Whose answer a candidate is gets named only when it is not its reference's: a VACUOUS
    whose ids equal the baseline's is its own answer, however many requests in flight with it
    (a load repeats prompts) answered alike, and its detail begins with its guard's failure,
    the evidence a declared VACUOUS is held to."""
    reference = outcome((5, 6))
    twin = [("request 4", outcome((5, 6)))]
    record = judged("1E+1PD", "baseline", reference, outcome((5, 6)), [BROKEN], others=twin)
    assert record.verdict is Verdict.VACUOUS
    assert record.detail.startswith("tokens equal but guard failed: consumer_embeds"), record
    assert "request 4" not in record.detail


def test_a_control_answered_from_other_prompt_ids_is_unstable() -> None:
    """The control asks the same request twice: prompt ids that differ between the two (a
    placeholder sized otherwise the second time) are a baseline that disagreed with itself,
    even when the generated ids came out equal."""
    again = builders.outcome("image", (5, 6), prompt_ids=(1, 2, 4))
    unstable = baseline_stability(outcome((5, 6)), again)
    assert unstable.stable is False and "prompt ids differ" in unstable.detail


def test_a_fault_that_acted_on_nothing_because_its_request_failed_says_why() -> None:
    """A fault acts on what its request leaves (files, D's blocks): a request that failed first
    (found on real vLLM: D's NIXL handshake timed out under load) leaves it nothing, and the
    assertion said only "D's plugin reported nothing". The request's failure is the cause, so
    the message carries it; a request that was answered adds nothing to the message."""
    from harness.run.faults.planted import PlantedFault
    from harness.testing.judging import fault_inaction

    fault = PlantedFault(problems=["d-kv-noise-0: D's plugin reported nothing for this request"])
    handshake = "1E+1P+1D/decode0: NIXL handshake with P timed out"
    failed = judged("1E+1P+1D", "baseline", outcome((5, 6)), outcome((), error=handshake))
    message = fault_inaction("nixl-kv-noise 0.5 on 1E+1P+1D", fault, failed)
    assert message.startswith("nixl-kv-noise 0.5 on 1E+1P+1D did not do its job")
    assert "D's plugin reported nothing" in message and "touched []" in message
    assert message.count("NIXL handshake with P timed out") == 1
    assert "ERROR" in message
    answered = judged("1E+1P+1D", "baseline", outcome((5, 6)), outcome((5, 6)), [HELD])
    assert "\n" not in fault_inaction("nixl-kv-noise 0.5 on 1E+1P+1D", fault, answered)
