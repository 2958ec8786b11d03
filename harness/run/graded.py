"""The graded self-test: how small a planted fault the harness still catches, per fault kind.

A self-test that only plants gross faults (every EC value negated, KV zeroed) shows that the
harness can fail, not how much it misses. Here each fault kind runs a ladder of decreasing
strengths on a started topology, each rung on a prompt with media of its own (EC files are
keyed by content hash: a corrupted entry must not bleed into the next rung), and the table
keeps, per fault kind and topology, the smallest strength still caught, where the tokens first
differed, and the verdict. "Caught" means MISMATCH, or VACUOUS (tokens equal but a transfer
guard failed); anything else at a rung ends the ladder.

The table goes into the run directory (`detection.json`, `detection.md`), and is compared with
the thresholds committed in `scenarios/detection_thresholds.json` for the platform, model and
dtype they were measured on: a larger smallest-caught strength, or a fault kind no longer caught at
all, is a regression (docs/self-test.md). Elsewhere the table is reported, not gated.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fixtures.tiny_model import GENERATOR_VERSION
from harness.files import write_json_atomic, write_text_atomic
from harness.judge.records import CaseRecord, Verdict
from harness.spec.prompts import TAIL_TEXT, ImagePart, PromptSpec, TextPart, VideoPart
from harness.spec.topology import DEFAULT_DTYPE

CAUGHT = (Verdict.MISMATCH, Verdict.VACUOUS)
DETECTION_JSON = "detection.json"
DETECTION_MD = "detection.md"

# Strengths (fraction of each tensor's std), strongest first.
NOISE_LADDER = (0.5, 0.05, 0.005, 0.0005)
# Single-strength faults: one rung, strength 1 (present) by convention.
PRESENT = 1.0


def noise_prompts(kind: str, first_seed: int) -> tuple[PromptSpec, ...]:
    """One single-image prompt per ladder rung, each image its own (distinct mm_hash)."""
    return tuple(
        PromptSpec(f"d-{kind}-{n}", (ImagePart(seed=first_seed + n), TextPart(TAIL_TEXT)))
        for n in range(len(NOISE_LADDER))
    )


# The prompts of the graded self-test; none shares media with another or with the sweep and
# the matrix (seeds 1-52), so no EC file of one rung is ever read by another.
CLEAN_PROMPT = PromptSpec("d-clean", (ImagePart(seed=200), TextPart(TAIL_TEXT)))
EC_NOISE_PROMPTS = noise_prompts("ec-noise", 201)
KV_NOISE_PROMPTS = noise_prompts("kv-noise", 211)
SWAP_PROMPT = PromptSpec(
    "d-swap-items", (ImagePart(seed=221), ImagePart(seed=222), TextPart(TAIL_TEXT))
)
ZERO_FRAME_PROMPT = PromptSpec("d-zero-frame", (VideoPart(seed=223), TextPart(TAIL_TEXT)))
VIDEO_GRID_PROMPT = PromptSpec("d-video-grid", (VideoPart(seed=224), TextPart(TAIL_TEXT)))
DETECTION_PROMPTS = (
    CLEAN_PROMPT,
    *EC_NOISE_PROMPTS,
    *KV_NOISE_PROMPTS,
    SWAP_PROMPT,
    ZERO_FRAME_PROMPT,
    VIDEO_GRID_PROMPT,
)


@dataclass(frozen=True)
class Rung:
    """One planted fault at one strength on one topology, as judged."""

    fault: str  # fault kind, e.g. "ec-noise"
    strength: float
    topology: str
    prompt: str
    verdict: str
    caught: bool
    first_token_index: int | None  # first differing generated token; None if equal
    prompt_ids_equal: bool | None
    detail: str
    touched: int  # files (or items) the fault rewrote
    effects: tuple[str, ...] = ()
    seconds: float = 0.0


def rung_from_record(
    fault: str,
    strength: float,
    record: CaseRecord,
    touched: int,
    effects: Iterable[str] = (),
    seconds: float = 0.0,
) -> Rung:
    divergence = record.divergence or {}
    prompt_equal = None
    if record.verdict not in (Verdict.ERROR, Verdict.UNSTABLE_BASELINE):
        prompt_equal = "prompt ids differ" not in record.detail
    return Rung(
        fault=fault,
        strength=strength,
        topology=record.topology,
        prompt=record.prompt,
        verdict=record.verdict.value,
        caught=record.verdict in CAUGHT,
        first_token_index=divergence.get("index"),
        prompt_ids_equal=prompt_equal,
        detail=record.detail,
        touched=touched,
        effects=tuple(effects),
        seconds=round(seconds, 2),
    )


def run_ladder(
    strengths: Iterable[float], plant_and_judge: Callable[[int, float], Rung]
) -> list[Rung]:
    """Rungs from the strongest down, stopping after the first one not caught (the ones below
    it would cost requests and say nothing the threshold does not)."""
    rungs: list[Rung] = []
    for n, strength in enumerate(sorted(strengths, reverse=True)):
        rung = plant_and_judge(n, strength)
        rungs.append(rung)
        if not rung.caught:
            break
    return rungs


@dataclass
class DetectionTable:
    """Every rung run in a session, and per (fault, topology) the smallest strength caught."""

    rungs: list[Rung] = field(default_factory=list)

    def add(self, rungs: Iterable[Rung]) -> None:
        self.rungs.extend(rungs)

    def cells(self) -> dict[str, dict[str, dict[str, Any]]]:
        """fault -> topology -> {smallest_caught, first_token_index, verdict, missed_at, tried}.

        `smallest_caught` is None when the strongest rung was not caught: the fault went
        undetected. `missed_at` is the strength of the first rung that was not caught (None:
        every rung was caught)."""
        table: dict[str, dict[str, dict[str, Any]]] = {}
        for rung in self.rungs:
            cell = table.setdefault(rung.fault, {}).setdefault(
                rung.topology,
                {
                    "smallest_caught": None,
                    "first_token_index": None,
                    "verdict": None,
                    "missed_at": None,
                    "missed_verdict": None,
                    "tried": [],
                },
            )
            cell["tried"].append(rung.strength)
            if rung.caught and cell["missed_at"] is None:
                if cell["smallest_caught"] is None or rung.strength < cell["smallest_caught"]:
                    cell["smallest_caught"] = rung.strength
                    cell["first_token_index"] = rung.first_token_index
                    cell["verdict"] = rung.verdict
            elif not rung.caught and cell["missed_at"] is None:
                cell["missed_at"] = rung.strength
                cell["missed_verdict"] = rung.verdict
        return table

    def to_json(self) -> dict[str, Any]:
        return {"thresholds": self.cells(), "rungs": [asdict(r) for r in self.rungs]}

    def to_markdown(self) -> str:
        lines = [
            "| fault | topology | smallest strength caught | first differing token | verdict "
            "| first strength missed |",
            "|---|---|---|---|---|---|",
        ]
        for fault, by_topology in self.cells().items():
            for topology, cell in by_topology.items():
                caught = cell["smallest_caught"]
                missed = cell["missed_at"]
                index = cell["first_token_index"]
                missed_text = "-" if missed is None else f"{missed:g} ({cell['missed_verdict']})"
                lines.append(
                    f"| {fault} | {topology} | {'NOT CAUGHT' if caught is None else f'{caught:g}'} "
                    f"| {'-' if index is None else index} | {cell['verdict'] or '-'} "
                    f"| {missed_text} |"
                )
        return "\n".join(lines)

    def write(self, run_dir: Path) -> None:
        """detection.json + detection.md in the run directory (rewritten after every ladder, so
        an interrupted self-test keeps what it measured)."""
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(run_dir / DETECTION_JSON, self.to_json())
        write_text_atomic(
            run_dir / DETECTION_MD,
            "# Detection thresholds measured by the graded self-test\n\n"
            "Smallest planted-fault strength still caught (MISMATCH, or VACUOUS), per fault "
            "kind and topology. Noise strengths are fractions of each tensor's std; 1 means "
            "a fault without strength, present.\n\n" + self.to_markdown() + "\n",
        )


# The tiny model's cache directory is `tiny-qwen25vl-<content key>`; its thresholds hold for
# every build of the same generator, so they are committed under the family name.
TINY_MODEL = "tiny-qwen25vl"


def model_key(model: str) -> str:
    """The name a model's thresholds are committed under: the tiny model by family, a Hugging
    Face cache snapshot (`.../models--ORG--NAME/snapshots/REV`) or a name as `ORG/NAME`, any
    other directory by its own name."""
    path = Path(model)
    if path.name.startswith(f"{TINY_MODEL}-"):
        return TINY_MODEL
    for part in path.parts:
        if part.startswith("models--"):
            return part.removeprefix("models--").replace("--", "/", 1)
    if not path.is_absolute() and len(path.parts) == 2 and not path.exists():
        return model  # ORG/NAME as given to --model
    return path.name


def load_thresholds(
    path: Path, platform: str = "cpu", model: str = TINY_MODEL, dtype: str = DEFAULT_DTYPE
) -> dict[str, dict[str, float]] | None:
    """fault -> topology -> the committed smallest strength caught, as measured on `platform`
    with `model` computing in `dtype` (the tiny model: built by this generator); None where nothing
    was measured there (report, do not gate: the tiny CPU model's thresholds say nothing about a 3B
    model on a GPU, and bfloat16's say nothing about a float16 run, whose rounding keeps other
    noise)."""
    data = json.loads(path.read_text())
    for section in data["measured"]:
        if (section["platform"], section["model"], section["dtype"]) != (platform, model, dtype):
            continue
        # The tiny model's generator shapes what a fault flips (generator 3's KV ballast made
        # 5% KV noise flip a token at once): another generator's thresholds say nothing of
        # this one's checkpoint, and a section that does not say which is nobody's.
        if model == TINY_MODEL and str(section.get("generator")) != GENERATOR_VERSION:
            continue
        return {
            fault: {topology: float(value) for topology, value in by_topology.items()}
            for fault, by_topology in section["thresholds"].items()
        }
    return None


def measured_on(path: Path) -> list[str]:
    """Each platform / model / dtype the thresholds were measured on, for a "not gated" line
    (the tiny model's with its generator)."""
    return [
        f"{s['platform']} / {s['model']}"
        + (f" generator {s.get('generator')}" if s["model"] == TINY_MODEL else "")
        + f" / {s['dtype']}"
        for s in json.loads(path.read_text())["measured"]
    ]


def regressions(
    measured: dict[str, dict[str, dict[str, Any]]], committed: dict[str, dict[str, float]]
) -> list[str]:
    """What got worse than committed, for the cells that were measured: a larger smallest
    strength caught, or a fault kind not caught at all. Cells without a committed value are
    not regressions (they are new; commit them)."""
    problems = []
    for fault, by_topology in measured.items():
        for topology, cell in by_topology.items():
            limit = committed.get(fault, {}).get(topology)
            if limit is None:
                continue
            caught = cell["smallest_caught"]
            if caught is None:
                problems.append(
                    f"{fault} on {topology}: no longer caught at all (committed: caught down to "
                    f"{limit:g}; strongest rung ended {cell['missed_verdict']})"
                )
            elif caught > limit * (1 + 1e-9):
                problems.append(
                    f"{fault} on {topology}: smallest strength caught is {caught:g}, committed "
                    f"{limit:g} ({cell['missed_at']:g} ended {cell['missed_verdict']})"
                )
    return problems
