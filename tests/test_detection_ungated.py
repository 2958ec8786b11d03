"""The graded self-test's noise ladders where no thresholds were measured (a GPU night's 3B
model, another dtype): scenarios/test_detection.py's acceptance, run here on stand-ins (no
vLLM, no process).

There the table is reported and not gated, and the ladders passed whatever they saw: a harness
that judged MATCH under noise of half the embeddings' std passed on every platform but the one
the thresholds came from. The strongest rung must be caught on any model.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from harness.run.graded import NOISE_LADDER, Rung
from scenarios.test_detection import assert_acceptance

pytestmark = pytest.mark.unit


def unmeasured_live() -> SimpleNamespace:
    """A topology served where scenarios/detection_thresholds.json measured nothing."""
    settings = SimpleNamespace(
        platform=SimpleNamespace(name="cuda"),
        serving=SimpleNamespace(model="Qwen/Qwen2.5-VL-3B-Instruct", dtype="bfloat16"),
    )
    return SimpleNamespace(name="1E+1PD", session=SimpleNamespace(settings=settings))


def rung(strength: float, caught: bool) -> Rung:
    return Rung(
        fault="ec-noise",
        strength=strength,
        topology="1E+1PD",
        prompt="d-ec-noise-0",
        verdict="MISMATCH" if caught else "MATCH",
        caught=caught,
        first_token_index=0 if caught else None,
        prompt_ids_equal=True,
        detail="",
        touched=1,
    )


def test_an_ungated_ladder_that_caught_not_even_its_strongest_noise_fails() -> None:
    strongest = max(NOISE_LADDER)
    with pytest.raises(AssertionError, match="strongest"):
        assert_acceptance("ec-noise", unmeasured_live(), [rung(strongest, caught=False)])


def test_an_ungated_ladder_that_caught_its_strongest_noise_passes_whatever_follows() -> None:
    strongest, next_one = sorted(NOISE_LADDER, reverse=True)[:2]
    assert_acceptance(
        "ec-noise", unmeasured_live(), [rung(strongest, caught=True), rung(next_one, False)]
    )
