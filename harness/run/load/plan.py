"""A load's plan: where each prompt's media end (from the model's placeholder ids and the
baseline's prompt tokens), the failure each is declared to have there, and the requests."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.judge.records import DeclaredFailure
from harness.run.baseline import BaselineAnswers
from harness.run.scenarios import get_scenario
from harness.spec.load import (
    LoadSpec,
    MediaPlacement,
    PlannedRequest,
    Region,
    media_placement,
    plan_requests,
)
from harness.spec.topology import TOPOLOGIES, ServingConfig, Topology

DECODE_TAIL_SCENARIO = "epd-media-in-decode-tail"


def media_token_ids(model: str) -> frozenset[int]:
    """The placeholder ids media expand to, from the model's config (Qwen2/2.5-VL:
    `image_token_id`, `video_token_id`); empty when the model is not a local directory."""
    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return frozenset()
    found = set()
    for source in (config, config.get("text_config") or {}):
        for key in ("image_token_id", "video_token_id"):
            if isinstance(source.get(key), int):
                found.add(source[key])
    return frozenset(found)


def decode_tail_failure(topology: Topology, kv_connector: str) -> DeclaredFailure | None:
    """The failure a request whose media end in D's recomputed tail is declared to have on
    `topology` under `kv_connector`: the matrix's declaration, the one place it is made."""
    if not topology.has_kv_transfer:
        return None
    return get_scenario(DECODE_TAIL_SCENARIO).for_kv_connector(kv_connector).declared


@dataclass(frozen=True)
class LoadPlan:
    """What a load sends, decided from the baseline's answers before anything is sent: where
    each prompt's media end, the failure each is declared to have on the topology, the
    requests (those declared to end an instance last, alone) and why a prompt was left out."""

    placements: dict[str, MediaPlacement]
    declared: dict[str, DeclaredFailure | None]
    requests: tuple[PlannedRequest, ...]
    notes: tuple[str, ...]

    @property
    def regular(self) -> list[PlannedRequest]:
        """The requests of a round (what the baseline's calibration sends too)."""
        return [r for r in self.requests if not r.alone]


def plan_load(
    spec: LoadSpec, prompts: Sequence[str], baseline: BaselineAnswers, serving: ServingConfig
) -> LoadPlan:
    """The plan of `spec` over `prompts` (each answered by `baseline`), under `serving`'s
    model, block size and KV connector: the one place a load's requests are decided, so a
    calibration computed ahead of a load (`calibrate_ahead`) is of the requests it sends."""
    topology = TOPOLOGIES[spec.topology]
    media_ids = media_token_ids(serving.model)
    placements = {}
    for prompt in prompts:
        answer = baseline.outcomes[prompt].result
        if answer is not None and media_ids:
            placements[prompt] = media_placement(
                answer.prompt_token_ids, media_ids, serving.block_size
            )
    declared = {
        prompt: decode_tail_failure(topology, serving.kv_connector)
        if prompt in placements and placements[prompt].region is Region.DECODE_TAIL
        else None
        for prompt in prompts
    }
    ending = {p for p, d in declared.items() if d is not None and d.verdict == "ERROR"}
    sent = list(prompts)
    notes = []
    left_out = spec.duration_s is not None or spec.kill is not None
    too_few = spec.requests < len(ending) + 1
    if ending and (left_out or too_few or not spec.ending):
        # A soak measures resources over time and a planted death its own cause: a request
        # that ends D by a declared failure would cut either short. Too few requests to send
        # it last as well as one of the others: the others come first.
        sent = [p for p in sent if p not in ending]
        why = (
            f"{spec.requests} request(s) leave no room for it"
            if too_few and not left_out
            else "a plain load sends it last"
        )
        notes.append(
            f"not in this load: {', '.join(sorted(ending))} (declared to end an instance "
            f"on {topology.name}; {why})"
        )
        ending = set()
    requests = plan_requests(sent, spec.requests, frozenset(ending))
    return LoadPlan(placements, declared, tuple(requests), tuple(notes))
