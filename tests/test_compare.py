"""compare_results, token_verdict and Policy on hand-built results: no server involved."""

from __future__ import annotations

import dataclasses
import math

import pytest

from harness.judge.compare import (
    Verdict,
    compare_results,
    noise_floor,
    prefix_noise_floor,
    token_verdict,
    whose_answer,
)
from harness.judge.records import EXACT, LOGPROB_CLOSE, Policy
from harness.outcomes.chat import ChatResult, PositionLogprobs
from harness.testing.builders import chat

pytestmark = pytest.mark.unit

PROMPT = (1, 2, 3, 4)


def result(
    tokens: tuple[int, ...],
    prompt: tuple[int, ...] = PROMPT,
    tops: dict[int, tuple[int, ...]] | None = None,
    with_logprobs: bool = True,
) -> ChatResult:
    """A result whose position i has top-k `tops[i]` (default: just the generated token)."""
    tops = tops or {}

    def top(i: int, t: int) -> list[tuple[int, float]]:
        return [(tid, -0.5 - rank) for rank, tid in enumerate(tops.get(i, (t,)))]

    return chat(tokens, prompt_ids=prompt, top=top if with_logprobs else None)


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
    # Nothing to look up for the side that ended: no near-tie, so no drift at any tolerance.
    assert d.near_tie is None and not d.is_drift
    assert token_verdict(compare_results(ref, cand, tolerance=5.0)) is Verdict.MISMATCH
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


def near_tie(
    gap: float, prefix_lp: float = -0.5, candidate_gap: float | None = None
) -> tuple[ChatResult, ChatResult]:
    """Reference and candidate diverging at 5 between 105 and 555, each side preferring its own
    token by `gap` nats (the candidate by `candidate_gap` when given); the candidate's prefix
    log-probs are `prefix_lp` (the reference's -0.5)."""
    cand_tokens = SEQ[:5] + (555,) + SEQ[6:]

    def side(tokens: tuple[int, ...], own: int, other: int, lp: float, by: float) -> ChatResult:
        def top(i: int, t: int) -> tuple[tuple[int, float], ...]:
            if i == 5:
                return ((own, -0.5), (other, -0.5 - by))
            return ((t, lp if i < 5 else -0.5),)

        return chat(tokens, prompt_ids=PROMPT, top=top)

    theirs = gap if candidate_gap is None else candidate_gap
    return side(SEQ, 105, 555, -0.5, gap), side(cand_tokens, 555, 105, prefix_lp, theirs)


def test_a_near_tie_after_an_agreeing_prefix_within_the_tolerance_is_drift():
    reference, candidate = near_tie(gap=0.02, prefix_lp=-0.51)
    cmp = compare_results(reference, candidate, tolerance=0.05)
    d = cmp.divergence
    assert d.reference_gap == pytest.approx(0.02) and d.candidate_gap == pytest.approx(0.02)
    assert d.prefix_delta == pytest.approx(0.01)
    assert d.near_tie and d.is_drift
    assert token_verdict(cmp) is Verdict.DRIFT
    assert "drift: yes" in cmp.describe()


def test_a_near_tie_whose_log_probs_moved_beyond_the_floor_is_no_drift():
    """Numeric noise within the floor moves each log-prob by no more than the floor, at the
    divergence as before it. A candidate whose two tokens are still a near tie, but 2.5 nats
    below where the reference put them (a flattened distribution, as a corrupted embedding
    makes), did not drift (found in review: it was DRIFT, and passed under pd-drift)."""
    reference, candidate = near_tie(gap=0.02, prefix_lp=-0.51)
    moved = list(candidate.logprobs)
    moved[5] = PositionLogprobs(555, -3.0, ((555, -3.0), (105, -3.02)))
    candidate = dataclasses.replace(candidate, logprobs=tuple(moved))
    cmp = compare_results(reference, candidate, tolerance=0.05)
    d = cmp.divergence
    assert d.near_tie is True and d.prefix_delta <= d.tolerance
    assert token_verdict(cmp) is Verdict.MISMATCH and not d.is_drift
    assert d.divergence_delta == pytest.approx(2.52)
    assert "log-prob delta at the divergence 2.520" in cmp.describe()
    within = compare_results(*near_tie(gap=0.02, prefix_lp=-0.51), tolerance=0.05)
    assert within.divergence.divergence_delta == pytest.approx(0.02)
    assert token_verdict(within) is Verdict.DRIFT


def test_a_near_tie_between_answers_to_other_prompt_ids_is_no_drift_and_says_why():
    """Drift is noise between two answers to one prompt; answers to other prompt ids are
    answers to another question, so a near-tie where they part excuses nothing. The verdict
    was MISMATCH already, but the evidence read "drift: yes" beside it (found in review)."""
    reference, candidate = near_tie(gap=0.02, prefix_lp=-0.51)
    other_prompt = dataclasses.replace(candidate, prompt_token_ids=PROMPT[:-1] + (9,))
    cmp = compare_results(reference, other_prompt, tolerance=0.05)
    d = cmp.divergence
    assert d.near_tie is True and d.prefix_delta <= d.tolerance
    assert not d.is_drift and d.to_json()["drift"] is False
    assert token_verdict(cmp) is Verdict.MISMATCH
    text = cmp.describe()
    assert "drift: no (not applicable: the prompt ids differ" in text
    assert "drift: yes" not in text


def test_a_side_that_ended_says_why_drift_does_not_apply():
    cmp = compare_results(result(SEQ), result(SEQ[:5]), tolerance=10.0)
    assert cmp.divergence.drift_not_applicable == (
        "one side ended: a length difference is no near-tie"
    )
    assert "drift: no (one side ended" in cmp.describe()


def test_a_zero_noise_floor_leaves_no_room_for_drift():
    """On CPU the measured floor is 0: even an exact tie that resolved differently is MISMATCH."""
    reference, candidate = near_tie(gap=0.0)
    cmp = compare_results(reference, candidate, tolerance=0.0)
    assert cmp.divergence.near_tie is True and not cmp.divergence.is_drift
    assert token_verdict(cmp) is Verdict.MISMATCH


@pytest.mark.parametrize(
    "gap, prefix_lp, why",
    [
        (3.0, -0.5, "a decisive token flipped: no near-tie"),
        (0.02, -0.9, "the prefix log-probs disagreed beyond the tolerance"),
    ],
)
def test_top_k_membership_alone_is_no_longer_drift(gap, prefix_lp, why):
    """Upstream's rule (each token in the other's top-k) holds in both cases; the new rule says
    MISMATCH, which is what a corrupted embedding looks like."""
    reference, candidate = near_tie(gap=gap, prefix_lp=prefix_lp)
    cmp = compare_results(reference, candidate, tolerance=0.05)
    assert 555 in dict(cmp.divergence.reference_top) and 105 in dict(cmp.divergence.candidate_top)
    assert token_verdict(cmp) is Verdict.MISMATCH, why
    assert "drift: no" in cmp.describe()


@pytest.mark.parametrize(
    "candidate_gap, why",
    [
        (-3.0, "the candidate's own log-probs put the reference's token 3 nats above its own"),
        (math.nan, "a NaN log-prob is evidence of nothing"),
    ],
)
def test_a_gap_far_below_zero_or_nan_is_no_near_tie(candidate_gap, why):
    """The rule takes a gap by its size: `max(0.02, -3.0)` or `max(0.02, nan)` alone would call
    either a near-tie (found in review; both were DRIFT)."""
    reference, candidate = near_tie(gap=0.02, candidate_gap=candidate_gap)
    cmp = compare_results(reference, candidate, tolerance=0.05)
    assert cmp.divergence.reference_gap == pytest.approx(0.02)
    assert not cmp.divergence.near_tie and not cmp.divergence.is_drift, why
    assert token_verdict(cmp) is Verdict.MISMATCH, why


def test_a_slightly_negative_gap_is_still_a_near_tie():
    """A side whose own token sits a hair below the other's (rounding of reported log-probs)
    is as near a tie as one a hair above."""
    reference, candidate = near_tie(gap=0.02, prefix_lp=-0.51, candidate_gap=-0.01)
    cmp = compare_results(reference, candidate, tolerance=0.05)
    assert cmp.divergence.near_tie is True and token_verdict(cmp) is Verdict.DRIFT


def test_a_divergence_whose_every_measure_equals_the_floor_is_within_it():
    """The floor is the largest difference the baseline showed against itself, so a difference
    of exactly that size is noise the platform makes: the gaps, the log-prob delta at the
    divergence and the prefix's delta each at the floor (0.25 nats, exact in binary) is DRIFT;
    a hair above it, in the prefix or in the tie, is not."""
    reference, candidate = near_tie(gap=0.25, prefix_lp=-0.75)
    cmp = compare_results(reference, candidate, tolerance=0.25)
    d = cmp.divergence
    assert (d.reference_gap, d.candidate_gap) == (0.25, 0.25)
    assert (d.divergence_delta, d.prefix_delta) == (0.25, 0.25)
    assert d.is_drift and token_verdict(cmp) is Verdict.DRIFT
    for above in (near_tie(gap=0.25, prefix_lp=-0.7500001), near_tie(gap=0.2500001)):
        over = compare_results(*above, tolerance=0.25)
        assert token_verdict(over) is Verdict.MISMATCH, over.describe()


def test_the_prefix_must_agree_up_to_the_position_before_the_divergence():
    """The prefix's agreement is read at every position before the divergence, the last one
    included: a candidate whose log-prob moved beyond the floor just before it parted is no
    drift, however near the tie where it parted."""
    reference, candidate = near_tie(gap=0.02, prefix_lp=-0.51)
    moved = list(candidate.logprobs)
    moved[4] = PositionLogprobs(SEQ[4], -2.0, ((SEQ[4], -2.0),))
    candidate = dataclasses.replace(candidate, logprobs=tuple(moved))
    cmp = compare_results(reference, candidate, tolerance=0.05)
    assert cmp.divergence.prefix_delta == pytest.approx(1.5)
    assert token_verdict(cmp) is Verdict.MISMATCH


def test_a_near_tie_at_the_first_token_is_drift_with_nothing_before_it():
    """A divergence at position 0 has no prefix to disagree: its prefix delta is 0, not
    unknown, so a near tie within the floor at the first generated token is DRIFT as anywhere
    else, and its window starts at the sequence's start."""
    cand_tokens = (555,) + SEQ[1:]

    def top(own: int, other: int):
        return lambda i, t: ((own, -0.5), (other, -0.52)) if i == 0 else ((t, -0.5),)

    reference = chat(SEQ, prompt_ids=PROMPT, top=top(SEQ[0], 555))
    candidate = chat(cand_tokens, prompt_ids=PROMPT, top=top(555, SEQ[0]))
    cmp = compare_results(reference, candidate, window=2, tolerance=0.05)
    d = cmp.divergence
    assert (d.index, d.window_start, d.prefix_delta) == (0, 0, 0.0)
    assert d.reference_window == SEQ[:3] and d.candidate_window == cand_tokens[:3]
    assert d.is_drift and token_verdict(cmp) is Verdict.DRIFT


def test_a_nan_log_prob_in_the_prefix_proves_no_agreement():
    reference, candidate = near_tie(gap=0.02, prefix_lp=math.nan)
    cmp = compare_results(reference, candidate, tolerance=0.05)
    assert cmp.divergence.prefix_delta is None and not cmp.divergence.is_drift
    assert token_verdict(cmp) is Verdict.MISMATCH


@pytest.mark.parametrize(
    "ref_top, cand_top",
    [
        ((105, 7), (555, 105)),  # candidate's token missing from the reference's top-k
        ((105, 555), (555, 8)),  # reference's token missing from the candidate's top-k
    ],
)
def test_a_token_outside_the_other_sides_top_k_has_no_gap(ref_top, cand_top):
    cand = SEQ[:5] + (555,) + SEQ[6:]
    cmp = compare_results(
        result(SEQ, tops={5: ref_top}), result(cand, tops={5: cand_top}), tolerance=10.0
    )
    assert cmp.divergence.near_tie is None
    assert token_verdict(cmp) is Verdict.MISMATCH
    assert "n/a (other token not in its top-k)" in cmp.describe()


@pytest.mark.parametrize("missing", ["reference", "candidate"])
def test_missing_logprobs_cannot_prove_drift(missing):
    cand = SEQ[:5] + (555,) + SEQ[6:]
    ref_r = result(SEQ, tops={5: (105, 555)}, with_logprobs=missing != "reference")
    cand_r = result(cand, tops={5: (555, 105)}, with_logprobs=missing != "candidate")
    cmp = compare_results(ref_r, cand_r, tolerance=10.0)
    assert cmp.divergence.near_tie is None and cmp.divergence.prefix_delta is None
    assert token_verdict(cmp) is Verdict.MISMATCH


def test_misaligned_logprobs_are_not_evidence():
    """A logprob entry for another token than the one generated cannot vouch for drift. The
    entry at the divergence lists both tokens as a near tie: labelled with the token generated
    there it is a DRIFT, labelled with another token's id (the reference's, as a batched
    answer's entry may be) it is no evidence. (Found in review: the off-by-one shift this test
    made left an entry that named neither token, so its gap was None whatever `_top_at` did.)"""
    cand = SEQ[:5] + (555,) + SEQ[6:]
    ref_r = result(SEQ, tops={5: (105, 555)})
    aligned = result(cand, tops={5: (555, 105)})
    assert compare_results(ref_r, aligned, tolerance=10.0).divergence.is_drift
    entry = aligned.logprobs[5]
    logprobs = list(aligned.logprobs)
    logprobs[5] = dataclasses.replace(entry, token_id=105)
    misaligned = dataclasses.replace(aligned, logprobs=tuple(logprobs))
    cmp = compare_results(ref_r, misaligned, tolerance=10.0)
    d = cmp.divergence
    assert d.candidate_top is None and d.candidate_gap is None, d
    assert d.prefix_delta == 0.0 and not d.is_drift
    assert token_verdict(cmp) is Verdict.MISMATCH
    shifted = dataclasses.replace(aligned, logprobs=aligned.logprobs[1:])  # off by one
    d = compare_results(ref_r, shifted, tolerance=10.0).divergence
    assert d.candidate_gap is None and d.prefix_delta is None and not d.is_drift


def test_negative_tolerance_is_refused():
    with pytest.raises(ValueError, match="tolerance"):
        compare_results(result(SEQ), result(SEQ), tolerance=-0.1)


def test_noise_floor_is_the_largest_logprob_difference_of_equal_answers():
    a, b = near_tie(gap=0.5, prefix_lp=-0.53)
    assert noise_floor(a, a) == 0.0
    assert noise_floor(b, b) == 0.0
    same_tokens = ChatResult(
        PROMPT,
        SEQ,
        "",
        "length",
        tuple(PositionLogprobs(p.token_id, p.logprob - 0.125, p.top) for p in a.logprobs),
    )
    assert noise_floor(a, same_tokens) == pytest.approx(0.125)
    assert noise_floor(a, b) is None, "different tokens: no floor can be read"
    # Every top-k entry both sides list counts too, not the chosen token's alone (found in
    # review: with the top-k left out of the floor, every unit test still passed).
    entries = list(a.logprobs)
    entries[5] = dataclasses.replace(entries[5], top=((105, -0.5), (555, -1.25)))
    runner_up_moved = dataclasses.replace(a, logprobs=tuple(entries))
    assert noise_floor(a, runner_up_moved) == pytest.approx(0.25)


@pytest.mark.parametrize("other", [-math.inf, math.nan])
def test_a_non_finite_log_prob_reads_no_noise_floor(other):
    """A log-prob of -inf against a finite one is no measure of noise: read as a floor of inf
    it became every comparison's tolerance, and any divergence whose tokens sat in each other's
    top-k passed as DRIFT, however decisive (found in review: gaps of 20 nats were DRIFT). A
    NaN, dropped by `max`, read as a floor measured over a position nothing was measured at."""
    finite = chat((5, 6), top=lambda i, t: [(t, -0.5)])
    odd = chat((5, 6), top=lambda i, t: [(t, other if i == 1 else -0.5)])
    assert noise_floor(finite, odd) is None
    assert prefix_noise_floor(odd, finite) is None


def test_log_probs_of_other_tokens_read_no_noise_floor():
    """The floor is the drift rule's tolerance: log-prob entries of other tokens than the ids
    generated (a batched answer handed another request's log-probs) measure no noise of these
    tokens, as they are no evidence of closeness at a divergence (`_top_at`). Compared as if
    they were, they made a floor of 3.5 nats here, and every near tie within it a DRIFT."""
    alone = chat((5, 6, 7), top=lambda i, t: [(t, -0.5)])
    others = tuple(PositionLogprobs(t + 100, -4.0, ((t + 100, -4.0),)) for t in (5, 6, 7))
    batched = dataclasses.replace(alone, logprobs=others)
    assert prefix_noise_floor(alone, batched) is None
    assert prefix_noise_floor(batched, alone) is None
    assert noise_floor(alone, batched) is None
    assert noise_floor(alone, alone) == 0.0


def test_answers_to_other_prompt_ids_read_no_noise_floor():
    """The floor is noise between answers to one request. A batched answer to other prompt ids
    (a request handed another's prompt) that happens to generate the same ids measures no
    noise of this request: read as one, its 1.5-nat log-prob differences became the run's
    tolerance, and every near tie within them a DRIFT (found in review)."""
    alone = chat((5, 6, 7), prompt_ids=PROMPT, top=lambda i, t: [(t, -0.5)])
    other_prompt = chat((5, 6, 7), prompt_ids=(9, 9, 9), top=lambda i, t: [(t, -2.0)])
    assert prefix_noise_floor(alone, other_prompt) is None
    assert noise_floor(alone, other_prompt) is None
    assert noise_floor(alone, alone) == 0.0


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
    assert "drift: no" in text and "tolerance 0 nats" in text


@pytest.mark.parametrize(
    "reference, candidate, shown",
    [
        (SEQ, SEQ[:10] + (555,) + SEQ[11:], ("…108 109 [110] 111 112…", "…108 109 [555] 111 112…")),
        (SEQ, (555,) + SEQ[1:], ("[100] 101 102…", "[555] 101 102…")),
        (SEQ, SEQ[:19] + (555,), ("…117 118 [119]", "…117 118 [555]")),
        (SEQ, SEQ[:19], ("…117 118 [119]", "…117 118 [end]")),
    ],
    ids=["mid", "first-token", "last-token", "candidate-ended"],
)
def test_the_windows_show_the_ids_around_the_divergence_and_whether_more_lie_beyond(
    reference, candidate, shown
):
    """Each side's window is printed with every id before the divergence in it, the one at it
    bracketed, and an ellipsis only on a side where the sequence goes on past the window: at
    the first or the last token there is none on that side."""
    text = compare_results(result(reference), result(candidate), window=2).describe()
    lines = {line.split()[0]: line for line in text.splitlines()[1:3]}
    assert lines["reference"].endswith(" " + shown[0]), text
    assert lines["candidate"].endswith(" " + shown[1]), text


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


def test_an_answer_without_log_probs_reads_no_noise_floor():
    """The floor is read from both answers' log-probs: one side without them (a batched answer
    whose server sent none) measured nothing, so no floor, never a floor of 0 read from the
    other side alone (which says batching moved nothing)."""
    alone = chat((5, 6, 7), top=lambda i, t: [(t, -0.5)])
    bare = chat((5, 6, 7))
    assert prefix_noise_floor(alone, bare) is None
    assert prefix_noise_floor(bare, alone) is None


def test_answers_that_part_at_the_first_token_read_a_floor_of_zero():
    """The batch floor is read over the tokens two answers agree on; answers that part at the
    first generated token agree on none, so nothing moved: a floor of 0 (no drift excused),
    not a crash of the run's baseline pass."""
    alone = chat((5, 6, 7), top=lambda i, t: [(t, -0.5)])
    batched = chat((8, 6, 7), top=lambda i, t: [(t, -3.0)])
    assert prefix_noise_floor(alone, batched) == 0.0
    assert noise_floor(alone, batched) is None


def test_an_empty_answer_is_nobody_elses():
    """Naming whose answer a candidate is needs ids to compare: an empty answer equals every
    other empty one, and "received request 4's answer" would blame a swap for a request that
    generated nothing."""
    empty = chat(())
    assert whose_answer(empty, [("request 4", chat(()))]) is None
    assert whose_answer(chat((5,)), [("request 4", chat((5,)))]) == "received request 4's answer"
