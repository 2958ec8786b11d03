"""Every prompt the harness knows survives its JSON form (run.json, found_scenarios.json, a
fuzz bundle): read back, it is the same spec, so it renders the same body and is declared and
judged as the one the run sent."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings

from harness.run import graded, self_test
from harness.run.fuzz.space import FuzzSpace
from harness.run.fuzz.strategies import fuzz_examples
from harness.run.scenarios import MATRIX, found_scenarios
from harness.spec.load import load_mix
from harness.spec.prompt_codec import part_from_json, prompt_from_json, prompt_to_json
from harness.spec.prompts import SKELETON_PROMPTS, PromptSpec

pytestmark = pytest.mark.unit


def known_prompts() -> list[PromptSpec]:
    prompts = [*SKELETON_PROMPTS, *load_mix(), *load_mix(12)]
    prompts += [p for scenario in (*MATRIX, *found_scenarios()) for p in scenario.prompts]
    for module in (self_test, graded):
        prompts += [v for v in vars(module).values() if isinstance(v, PromptSpec)]
    return prompts


def through_json(prompt: PromptSpec) -> PromptSpec:
    return prompt_from_json(json.loads(json.dumps(prompt_to_json(prompt))))


@pytest.mark.parametrize("prompt", known_prompts(), ids=lambda p: p.name)
def test_every_known_prompt_survives_json(prompt: PromptSpec) -> None:
    again = through_json(prompt)
    assert again == prompt
    hash(again.parts)  # media are rendered once per part (prompts._cached_media_url)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(fuzz_examples(FuzzSpace()))
def test_every_drawn_prompt_survives_json(examples) -> None:
    for example in examples:
        assert through_json(example.spec) == example.spec


@pytest.mark.parametrize("data", [{"kind": "AudioPart", "seed": 1}, {"seed": 1}])
def test_a_part_of_no_known_kind_is_refused_naming_the_kinds_known(data: dict) -> None:
    """A run.json or found scenario whose part names no kind this harness knows (a newer
    harness's, or none) is refused saying so, not with a bare KeyError of the kind."""
    with pytest.raises(ValueError, match="unknown prompt part kind .*known: ImagePart, "):
        part_from_json(data)
