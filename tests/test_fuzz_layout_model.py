"""The fuzzer's layout estimate against the tiny model's own processor: the aims at block
boundaries are only as good as this estimate (what an example really hit is read back from
the baseline's ids and reported either way)."""

from __future__ import annotations

import pytest

from fixtures.tiny_model import ensure_tiny_model
from harness.environment import cache_dir
from harness.preflight.tokens import estimate_prompt_tokens
from harness.run.fuzz.layout import TokenizerEstimator, estimate_positions
from harness.run.fuzz.space import FuzzSpace
from harness.run.fuzz.strategies import draw_examples
from harness.spec.prompts import ImagePart, render_request

pytestmark = pytest.mark.model


def test_the_estimate_counts_image_prompts_as_the_processor_does() -> None:
    model = ensure_tiny_model(cache_dir() / "models")
    estimator = TokenizerEstimator(model)
    space = FuzzSpace(videos=False, max_videos=0, media_kwargs=False)
    examples = draw_examples(space, 25, seed=2, estimator=estimator)
    bodies = {e.name: render_request(e.spec, "m") for e in examples}
    counted = estimate_prompt_tokens(model, bodies, cache_dir() / "prompt-tokens")
    estimated = {e.name: estimate_positions(e.spec, estimator)[1] for e in examples}
    assert any(isinstance(p, ImagePart) for e in examples for p in e.spec.parts)
    assert estimated == counted
