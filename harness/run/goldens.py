"""Goldens: every release's baseline token ids for the same request, kept side by side.

The baseline cache (`harness.run.baseline_cache`) is keyed by the served vLLM version, so one
release never reuses another's baseline. Goldens are the deliberate exception: stored under a
key WITHOUT the version (model content, numerics flags, request), one file per release that
produced them, so that

* consecutive releases' baselines can be compared (`agreement`): do they give the same tokens?
* `epd-harness run --golden VERSION` judges a candidate's EPD outputs against VERSION's
  baseline without starting a baseline at all (only when asked: never implicitly).

Layout: `<cache>/goldens/<golden key>/<vllm version>.json`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.errors import BadInput
from harness.files import write_json_atomic
from harness.outcomes.chat import ChatResult
from harness.outcomes.outcome import Outcome
from harness.run.baseline_cache import NUMERICS_NEUTRAL_FIELDS
from harness.spec.generations import parse_version
from harness.spec.settings import ServedVllm
from harness.spec.topology import ServingConfig

GOLDEN_FORMAT = 1


def golden_key(serving: ServingConfig, model_digest: str, body: dict[str, Any]) -> str:
    """Like the baseline cache key, minus the vLLM and torch versions."""
    flags = {
        name: value
        for name, value in dataclasses.asdict(serving).items()
        if name not in NUMERICS_NEUTRAL_FIELDS and name != "model"
    }
    material = {
        "golden": GOLDEN_FORMAT,
        "model_digest": model_digest,
        "serving": flags,
        "request": body,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def release_of(version: str) -> str:
    """'0.31.0+cpu' -> '0.31.0': goldens are per release, whatever the local build suffix."""
    return ".".join(str(n) for n in parse_version(version))


@dataclass(frozen=True)
class Golden:
    prompt: str
    release: str
    torch_version: str
    result: ChatResult

    @property
    def token_ids(self) -> list[int]:
        return list(self.result.token_ids)


class GoldenStore:
    def __init__(self, directory: Path):
        self.directory = directory

    def _path(self, key: str, release: str) -> Path:
        return self.directory / key / f"{release}.json"

    def store(self, key: str, prompt: str, served: ServedVllm, outcome: Outcome) -> None:
        if outcome.result is None or not served.known:
            return
        write_json_atomic(
            self._path(key, release_of(served.version)),
            {
                "format": GOLDEN_FORMAT,
                "prompt": prompt,
                "vllm": served.version,
                "torch": served.torch_version,
                "result": outcome.result.to_json(),
            },
        )

    def load(self, key: str, release: str) -> Golden | None:
        path = self._path(key, release)
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        return Golden(
            data["prompt"],
            release,
            data.get("torch", "unknown"),
            ChatResult.from_json(data["result"]),
        )

    def outcome_for(self, key: str, prompt: str, release: str) -> Outcome:
        """`--golden`: VERSION's baseline answer to this request, or one clear line."""
        golden = self.load(key, release)
        if golden is None:
            raise BadInput(
                f"no golden of vLLM {release} for prompt {prompt!r} (same model, "
                f"flags and request) under {self.directory}; run that release's "
                "sweep once to store it"
            )
        return Outcome(prompt=prompt, result=golden.result)

    def all(self) -> dict[str, list[Golden]]:
        """key -> its goldens, oldest release first."""
        found: dict[str, list[Golden]] = {}
        for path in sorted(self.directory.glob("*/*.json")):
            golden = self.load(path.parent.name, path.stem)
            if golden is not None:
                found.setdefault(path.parent.name, []).append(golden)
        for goldens in found.values():
            goldens.sort(key=lambda g: parse_version(g.release))
        return found


@dataclass(frozen=True)
class Agreement:
    prompt: str
    older: str
    newer: str
    first_difference: int | None  # token index; None: identical token ids

    def describe(self) -> str:
        if self.first_difference is None:
            return f"{self.prompt}: {self.older} -> {self.newer}: identical"
        return f"{self.prompt}: {self.older} -> {self.newer}: differ from token {self.first_difference}"


def agreement(store: GoldenStore) -> list[Agreement]:
    """For every request with goldens of several releases: consecutive releases compared."""
    rows = []
    for goldens in store.all().values():
        for older, newer in zip(goldens, goldens[1:]):
            rows.append(
                Agreement(
                    newer.prompt,
                    older.release,
                    newer.release,
                    first_difference(older.token_ids, newer.token_ids),
                )
            )
    return sorted(rows, key=lambda a: (a.prompt, parse_version(a.older)))


def first_difference(a: list[int], b: list[int]) -> int | None:
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))
