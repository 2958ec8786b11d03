"""Prompt specs to JSON and back, losslessly.

A fuzzed request is kept as its spec (media seeds and sizes, texts, kwargs), not only as its
rendered body: the spec is a few hundred bytes where the body is megabytes of base64, it says
what the request *is* (two 448x448 images, then 12 words), and rendering it again gives the
identical body. The shape is the one run.json already uses for its prompts (each part with its
`kind`), so either file can be read back.
"""

from __future__ import annotations

import json
from typing import Any

from harness.spec.prompts import (
    ImagePart,
    Part,
    PromptSpec,
    TextPart,
    VideoFramesPart,
    VideoPart,
)

PART_KINDS: dict[str, type] = {
    cls.__name__: cls for cls in (ImagePart, VideoPart, VideoFramesPart, TextPart)
}


def part_to_json(part: Part) -> dict[str, Any]:
    data: dict[str, Any] = {"kind": type(part).__name__}
    for name, value in vars(part).items():
        data[name] = list(value) if isinstance(value, tuple) else value
    return data


def part_from_json(data: dict[str, Any]) -> Part:
    fields = dict(data)
    kind = fields.pop("kind", None)
    if kind not in PART_KINDS:
        raise ValueError(f"unknown prompt part kind {kind!r} (known: {', '.join(PART_KINDS)})")
    if "size" in fields:
        fields["size"] = tuple(fields["size"])
    return PART_KINDS[kind](**fields)


def prompt_to_json(prompt: PromptSpec) -> dict[str, Any]:
    return {
        "name": prompt.name,
        "max_tokens": prompt.max_tokens,
        "parts": [part_to_json(p) for p in prompt.parts],
        "extra": dict(prompt.extra),
    }


def prompt_from_json(data: dict[str, Any]) -> PromptSpec:
    extra = data.get("extra") or {}
    return PromptSpec(
        name=data["name"],
        parts=tuple(part_from_json(p) for p in data["parts"]),
        max_tokens=int(data["max_tokens"]),
        # JSON round trip: the rendered body must not depend on where the spec came from.
        extra=tuple((k, json.loads(json.dumps(v))) for k, v in extra.items()),
    )
