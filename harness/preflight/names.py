"""Names the user typed (topologies, prompts, the cases file), checked before anything starts.

A misspelt key is refused rather than ignored: it would otherwise silently run a different
case than the one the user wrote.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from harness.errors import BadInput, lookup
from harness.preflight.files import kind_of, load_json_or_yaml
from harness.spec.prompts import SKELETON_PROMPTS, PromptSpec
from harness.spec.topology import TOPOLOGIES, Topology


def split_names(values: list[str] | None) -> tuple[str, ...]:
    """Repeated, comma-separated options (`--topology 1E+1PD,1P+1D --topology 1E+1P+1D`) as
    one tuple of names."""
    found: list[str] = []
    for value in values or []:
        found += [v.strip() for v in value.split(",") if v.strip()]
    return tuple(found)


def check_topologies(names: Iterable[str]) -> tuple[Topology, ...]:
    """Look every name up; the first unknown one is the error, with the known names, and a
    name given twice is one too (`refuse_repeats`)."""
    given = tuple(names)
    refuse_repeats("topology", given)
    return tuple(lookup("topology", name, TOPOLOGIES) for name in given)


def refuse_repeats(flag: str, names: tuple[str, ...]) -> None:
    """A name given twice (`--prompt text,text`) is refused, as a cases file's repeated entry
    is: the sweep sent the case twice and judged it once, the repeat's verdict dropped (found
    in the audit of ignored flags). `flag`: the option's, or the kind of name where the caller
    does not know the option (`versions` forwards its --topology to each release's run)."""
    for index, name in enumerate(names):
        if name in names[:index]:
            raise BadInput(
                f"{flag} {','.join(names)}: {name} is named twice, and each case is judged "
                "once: name it once"
            )


def check_prompts(names: Iterable[str]) -> tuple[PromptSpec, ...]:
    given = tuple(names)
    refuse_repeats("prompt", given)
    by_name = {p.name: p for p in SKELETON_PROMPTS}
    return tuple(lookup("prompt", name, by_name) for name in given)


@dataclass(frozen=True)
class RequestedCase:
    """One case a cases file asks for: this EPD topology, on this prompt."""

    topology: str
    prompt: str


CASE_FIELDS = ("topology", "prompt")


def load_cases_file(path: str | os.PathLike[str]) -> tuple[RequestedCase, ...]:
    """Read a JSON or YAML list of {topology, prompt} mappings, checking every field.

    YAML is read when the name ends in .yaml/.yml (PyYAML must be installed); anything else
    must be JSON. Unknown fields are refused rather than ignored: a misspelt key would
    otherwise silently run a different case than the one the user wrote.
    """
    source = Path(path)
    where = f"cases file {source}"
    data = load_json_or_yaml(source, where)
    if not isinstance(data, list):
        raise BadInput(f"{where}: expected a list of {{topology, prompt}}, got {kind_of(data)}")
    if not data:
        raise BadInput(f"{where}: lists no cases")
    scenarios: list[RequestedCase] = []
    for number, entry in enumerate(data, start=1):
        at = f"{where}: entry {number}"
        fields = ", ".join(CASE_FIELDS)
        if not isinstance(entry, dict):
            raise BadInput(f"{at}: expected a mapping with {fields}, got {kind_of(entry)}")
        unknown = sorted(set(entry) - set(CASE_FIELDS), key=str)
        if unknown:
            raise BadInput(f"{at}: unknown field {unknown[0]!r} (fields: {fields})")
        for field_name in CASE_FIELDS:
            if not isinstance(entry.get(field_name), str):
                got = "nothing" if field_name not in entry else kind_of(entry[field_name])
                raise BadInput(f"{at}: {field_name!r} must be a name (a string), got {got}")
        try:
            (topology,) = check_topologies([entry["topology"]])
            check_prompts([entry["prompt"]])
        except BadInput as exc:
            raise BadInput(f"{at}: {exc}") from None
        if topology.is_baseline:
            raise BadInput(
                f"{at}: 'baseline' is the reference every case is compared with; "
                "name an EPD topology"
            )
        scenario = RequestedCase(entry["topology"], entry["prompt"])
        if scenario in scenarios:
            first = scenarios.index(scenario) + 1
            case = f"{scenario.topology} / {scenario.prompt}"
            raise BadInput(f"{at}: repeats entry {first} ({case})")
        scenarios.append(scenario)
    return tuple(scenarios)
