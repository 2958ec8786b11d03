"""`fuzz --save`: a new failure's minimal request, written as a matrix scenario in one step.

The scenario is declared the way the matrix declares an upstream failure (`Scenario.expect`,
`expect_evidence`, `reason`), so from then on it passes only while vLLM fails exactly so, and
a fix upstream turns it red. Found scenarios live in `harness/run/found_scenarios.json`, which
`harness.run.scenarios` appends to the matrix; a known failure is already declared and is not
written again.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from harness.files import write_text_atomic
from harness.run.fuzz.records import FailureGroup
from harness.run.fuzz.signature import BLANKED
from harness.run.scenarios import FOUND_SCENARIOS_FILE
from harness.spec.prompt_codec import prompt_to_json
from harness.spec.prompts import CACHE_SALT, PromptSpec

_GUARD_FAILED = re.compile(r"tokens [^;:]*? but guard failed: [\w-]+")


def evidence_of(group: FailureGroup) -> str:
    """The part of the evidence a rerun must show: the cause line up to the first part its
    signature blanked for a crash (a number, a digest, a path's directories: cut at the
    first number alone, a path before any went in as '.../', which no error shows), the
    comparison's headline for a mismatch, the guard for VACUOUS."""
    signature = group.signature
    if signature.verdict == "ERROR":
        return BLANKED.split(signature.cause, maxsplit=1)[0].rstrip(" :,=('\"") or signature.where
    if signature.verdict == "VACUOUS":
        # As its own detail says it: 'tokens equal' or, for a DRIFT, 'tokens within the noise
        # floor' (a detail must start with the evidence), and the guard it names first.
        record = (group.minimal or group.start).record
        said = _GUARD_FAILED.match(record.detail) if record is not None else None
        if said is not None:
            return said[0]
        return "tokens equal but guard failed: " + signature.where.removeprefix("guard ")
    if signature.where.startswith("prompt ids"):
        return "prompt ids differ"
    return "generated tokens differ"


def unsaved_reason(group: FailureGroup) -> str | None:
    """Why --save does not write this group (None: it does). A minimal request whose failure
    needs what earlier requests left (`Evaluation.stage`: the folder P's lookup finds, the
    prefix D holds) fails only after them: its bundle replays them first, but a saved
    scenario is the request alone, sent cold, and would be declared a failure it cannot show."""
    minimal = group.minimal or group.start
    if not minimal.stage:
        return None
    earlier = ", ".join(name for name, _ in minimal.stage)
    return (
        f"{minimal.spec.name} fails only after {earlier}, which a matrix scenario does not "
        "send: replay its bundle (epd-harness repro)"
    )


def scenario_entry(
    group: FailureGroup, topology: str, meta: dict[str, Any], reason: str | None
) -> dict[str, Any]:
    minimal = (group.minimal or group.start).spec
    # Less the cache salt its example drew (another tenant's turn): the matrix keeps a body's
    # own salt, so the scenario went under that one salt at every send, and a topology that
    # had served it once held its prompt in its prefix caches (found in review). A saved
    # scenario fails on its own (`unsaved_reason`): sent cold, under a salt of each send's.
    extra = tuple((key, value) for key, value in minimal.extra if key != CACHE_SALT)
    minimal = PromptSpec(minimal.name, minimal.parts, minimal.max_tokens, extra)
    digest = hashlib.sha256(
        json.dumps(prompt_to_json(minimal), sort_keys=True).encode()
    ).hexdigest()[:10]
    name = f"fuzz-{group.signature.slug[:40]}-{digest}"
    spec = PromptSpec(f"{name}-request", minimal.parts, minimal.max_tokens, minimal.extra)
    found = f"epd-harness fuzz --topology {topology} --seed {meta['seed']} (vLLM {meta['vllm']})"
    entry = {
        "name": name,
        "topology": topology,
        "prompts": [prompt_to_json(spec)],
        "expect": [group.signature.verdict],
        "expect_evidence": evidence_of(group),
        "reason": reason or f"found by {found}; cause not investigated yet",
        "found_by": {**meta, "signature": group.signature.key},
    }
    if meta.get("stream"):
        # Found streamed (`fuzz --stream`): the scenario streams whatever the matrix run's
        # --stream says, or a failure of the stream alone would MATCH there.
        entry["stream"] = True
    return entry


def save_scenarios(
    groups: list[FailureGroup],
    topology: str,
    meta: dict[str, Any],
    reason: str | None = None,
    path: Path = FOUND_SCENARIOS_FILE,
) -> list[str]:
    """Append one scenario per new failure group (replacing one of the same name), but for
    one that fails only after earlier requests (`unsaved_reason`); returns the names
    written."""
    try:
        entries = json.loads(path.read_text()) if path.exists() else []
    except ValueError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    written = []
    for group in groups:
        if group.known or unsaved_reason(group) is not None:
            continue
        entry = scenario_entry(group, topology, meta, reason)
        entries = [e for e in entries if e.get("name") != entry["name"]] + [entry]
        written.append(entry["name"])
    if written:
        write_text_atomic(path, json.dumps(entries, indent=2, sort_keys=True) + "\n")
    return written
