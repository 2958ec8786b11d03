"""compare_results, token_verdict and Policy on hand-built results: no server involved."""

from __future__ import annotations

import pytest

from harness.judge.compare import Verdict, compare_results, token_verdict
from harness.judge.records import EXACT, LOGPROB_CLOSE, Policy
from harness.serve.client import ChatResult, PositionLogprobs

PROMPT = (1, 2, 3, 4)


def result(
    tokens: tuple[int, ...],
    prompt: tuple[int, ...] = PROMPT,
    tops: dict[int, tuple[int, ...]] | None = None,
    with_logprobs: bool = True,
) -> ChatResult:
    """A result whose position i has top-k `tops[i]` (default: just the generated token)."""
    tops = tops or {}
    logprobs = tuple(
        PositionLogprobs(
            token_id=t,
            logprob=-0.5,
            top=tuple((tid, -0.5 - rank) for rank, tid in enumerate(tops.get(i, (t,)))),
        )
        for i, t in enumerate(tokens)
    )
    return ChatResult(
        prompt_token_ids=prompt,
        token_ids=tokens,
        text="",
        finish_reason="length",
        logprobs=logprobs if with_logprobs else (),
    )


SEQ = tuple(range(100, 120))  # 20 tokens


def test_identical_is_exact_match():
    cmp = compare_results(result(SEQ), result(SEQ))
    assert cmp.exact and cmp.prompt_ids_equal and cmp.tokens_equal
    assert cmp.divergence is None and cmp.prompt_divergence_index is None
    assert (cmp.reference_len, cmp.candidate_len) == (20, 20)
    assert token_verdict(cmp) is Verdict.MATCH
    assert cmp.describe().startswith("identical")


def test_differs_at_position_zero():
    cand = (999,) + SEQ[1:]
    cmp = compare_results(result(SEQ), result(cand), window=3)
    d = cmp.divergence
    assert not cmp.exact and not cmp.tokens_equal and cmp.prompt_ids_equal
    assert d is not None and d.index == 0 and d.window_start == 0
    assert (d.reference_token, d.candidate_token) == (100, 999)
    assert d.reference_window == SEQ[:4]
    assert d.candidate_window == (999, 101, 102, 103)


def test_differs_mid_sequence_with_windows():
    cand = SEQ[:10] + (555,) + SEQ[11:]
    cmp = compare_results(result(SEQ), result(cand), window=2)
    d = cmp.divergence
    assert d is not None and d.index == 10 and d.window_start == 8
    assert d.reference_window == (108, 109, 110, 111, 112)
    assert d.candidate_window == (108, 109, 555, 111, 112)
    assert (d.reference_token, d.candidate_token) == (110, 555)
    assert d.reference_top == ((110, -0.5),)


def test_only_the_first_difference_counts():
    cand = SEQ[:3] + (7,) + SEQ[4:8] + (8,) + SEQ[9:]
    assert compare_results(result(SEQ), result(cand)).divergence.index == 3


@pytest.mark.parametrize("shorter", ["reference", "candidate"])
def test_prefix_diverges_at_shorter_length(shorter):
    short, full = result(SEQ[:12]), result(SEQ)
    ref, cand = (short, full) if shorter == "reference" else (full, short)
    cmp = compare_results(ref, cand, window=2)
    d = cmp.divergence
    assert not cmp.tokens_equal and not cmp.exact
    assert d is not None and d.index == 12
    ended, going = (
        (d.reference_token, d.candidate_token)
        if shorter == "reference"
        else (d.candidate_token, d.reference_token)
    )
    assert ended is None and going == 112
    short_window, long_window = (
        (d.reference_window, d.candidate_window)
        if shorter == "reference"
        else (d.candidate_window, d.reference_window)
    )
    assert short_window == (110, 111)
    assert long_window == (110, 111, 112, 113, 114)
    # Nothing to look up for the side that ended: closeness cannot be proved.
    assert d.logprob_close is None
    assert token_verdict(cmp) is Verdict.MISMATCH
    assert "(ended)" in cmp.describe()


def test_prompt_ids_differ_even_with_equal_tokens_is_mismatch():
    ref = result(SEQ, prompt=(1, 2, 3, 4, 5, 6))
    cand = result(SEQ, prompt=(1, 2, 3, 9, 9))
    cmp = compare_results(ref, cand)
    assert cmp.tokens_equal and not cmp.prompt_ids_equal and not cmp.exact
    assert cmp.prompt_divergence_index == 3
    assert token_verdict(cmp) is Verdict.MISMATCH
    text = cmp.describe()
    assert "prompt ids differ at position 3" in text
    assert "6 ids" in text and "5 ids" in text


def test_prompt_prefix_differs_at_shorter_length():
    cmp = compare_results(result(SEQ, prompt=(1, 2, 3)), result(SEQ, prompt=(1, 2, 3, 4)))
    assert cmp.prompt_divergence_index == 3 and not cmp.exact


def test_logprob_close_is_drift():
    cand = SEQ[:5] + (555,) + SEQ[6:]
    ref_r = result(SEQ, tops={5: (105, 555, 7)})
    cand_r = result(cand, tops={5: (555, 105, 8)})
    cmp = compare_results(ref_r, cand_r)
    assert cmp.divergence.logprob_close is True
    assert token_verdict(cmp) is Verdict.DRIFT


@pytest.mark.parametrize(
    "ref_top, cand_top",
    [
        ((105, 7), (555, 105)),  # candidate's token missing from the reference's top-k
        ((105, 555), (555, 8)),  # reference's token missing from the candidate's top-k
    ],
)
def test_not_logprob_close_is_mismatch(ref_top, cand_top):
    cand = SEQ[:5] + (555,) + SEQ[6:]
    cmp = compare_results(result(SEQ, tops={5: ref_top}), result(cand, tops={5: cand_top}))
    assert cmp.divergence.logprob_close is False
    assert token_verdict(cmp) is Verdict.MISMATCH
    assert "logprob-close: no" in cmp.describe()


@pytest.mark.parametrize("missing", ["reference", "candidate"])
def test_missing_logprobs_cannot_prove_closeness(missing):
    cand = SEQ[:5] + (555,) + SEQ[6:]
    ref_r = result(SEQ, tops={5: (105, 555)}, with_logprobs=missing != "reference")
    cand_r = result(cand, tops={5: (555, 105)}, with_logprobs=missing != "candidate")
    cmp = compare_results(ref_r, cand_r)
    assert cmp.divergence.logprob_close is None
    assert token_verdict(cmp) is Verdict.MISMATCH
    assert f"no logprobs at 5 on the {missing}" in cmp.describe()


def test_misaligned_logprobs_are_not_evidence():
    """A logprob entry for another token than the one generated cannot vouch for closeness."""
    cand = SEQ[:5] + (555,) + SEQ[6:]
    ref_r = result(SEQ, tops={5: (105, 555)})
    shifted = result(cand, tops={5: (555, 105)})
    misaligned = ChatResult(
        prompt_token_ids=shifted.prompt_token_ids,
        token_ids=shifted.token_ids,
        text="",
        finish_reason="length",
        logprobs=shifted.logprobs[1:],  # off by one
    )
    assert compare_results(ref_r, misaligned).divergence.logprob_close is None


def test_describe_names_index_both_tokens_and_tops():
    cand = SEQ[:7] + (455,) + SEQ[8:]
    ref_r = result(SEQ, tops={7: (107, 455)})
    cand_r = result(cand, tops={7: (455, 107)})
    text = compare_results(ref_r, cand_r).describe()
    lines = text.splitlines()
    assert lines[0] == "generated tokens differ at position 7 of 20/20"
    reference_line = next(line for line in lines if line.lstrip().startswith("reference ⟶"))
    candidate_line = next(line for line in lines if line.lstrip().startswith("candidate ⟶"))
    assert "107" in reference_line and "[107]" in reference_line
    assert "455" in candidate_line and "[455]" in candidate_line
    assert "reference top-2 at 7: 107(-0.50) 455(-1.50)" in text
    assert "candidate top-2 at 7: 455(-0.50) 107(-1.50)" in text
    assert "logprob-close: yes" in text


def test_negative_window_is_refused():
    with pytest.raises(ValueError, match="window"):
        compare_results(result(SEQ), result(SEQ), window=-1)


def test_divergence_to_json_is_plain():
    cand = SEQ[:5] + (555,) + SEQ[6:]
    d = compare_results(result(SEQ, tops={5: (105, 555)}), result(cand)).divergence
    data = d.to_json()
    assert data["index"] == 5 and data["candidate_token"] == 555
    assert data["reference_top"] == [[105, -0.5], [555, -1.5]]
    assert isinstance(data["reference_window"], list)


def test_policies():
    assert EXACT.passes(Verdict.MATCH)
    assert not EXACT.passes(Verdict.DRIFT)
    assert LOGPROB_CLOSE.passes(Verdict.MATCH) and LOGPROB_CLOSE.passes(Verdict.DRIFT)
    for failing in (Verdict.MISMATCH, Verdict.VACUOUS, Verdict.UNSTABLE_BASELINE, Verdict.ERROR):
        assert not EXACT.passes(failing) and not LOGPROB_CLOSE.passes(failing)
    assert Policy(frozenset({Verdict.VACUOUS})).passes(Verdict.VACUOUS)
