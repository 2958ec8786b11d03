"""What a fuzz run leaves: a normal run bundle, one repro bundle per failure group, and the
fuzz report (minimal requests first).

The run directory is a bundle like any run's (run.json, requests.json, summary.json,
responses.json, verdicts.txt, diff.md, report.html), plus `examples.json` (the seed and every
drawn example, written before anything is sent), `fuzz.json` and `fuzz.md`. Each failure group
gets `failures/NN-new-<signature>/` (`NN-known-...` for a declared upstream failure), again a
normal bundle whose first failing case is the minimal request: `epd-harness repro` (and
anything that takes a run bundle) takes it as it is.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.files import write_json_atomic, write_text_atomic
from harness.judge.records import CaseRecord
from harness.judge.verdicts import held_as_declared
from harness.report.bundle import SENT_AFTER, Redactor, write_bundle, write_run_info
from harness.report.run_outputs import devices_line, write_verdicts
from harness.report.text import format_failure, write_summary_json
from harness.run.fuzz.consumer import block_aligned_kv
from harness.run.fuzz.records import Evaluation, FailureGroup, FuzzReport
from harness.serve.session import safe_name
from harness.spec.prompt_codec import prompt_to_json
from harness.spec.prompts import (
    CACHE_SALT,
    ImagePart,
    PromptSpec,
    TextPart,
    VideoFramesPart,
    VideoPart,
)
from harness.spec.settings import RunSettings
from harness.spec.topology import BASELINE, TOPOLOGIES, Topology

if TYPE_CHECKING:
    from harness.run.fuzz.strategies import FuzzExample

EXAMPLES_JSON = "examples.json"
FUZZ_JSON = "fuzz.json"
FUZZ_MD = "fuzz.md"
FAILURES_DIR = "failures"


def describe_part(part: object) -> str:
    if isinstance(part, TextPart):
        words = len(part.text.split())
        shown = part.text if len(part.text) <= 60 else part.text[:57] + "..."
        return f"text ({words} words): {shown.strip()!r}"
    if isinstance(part, ImagePart):
        return f"image seed {part.seed}, {part.size[0]}x{part.size[1]}"
    if isinstance(part, VideoPart):
        return (
            f"video (mp4) seed {part.seed}, {part.num_frames} frames at {part.fps:g} fps, "
            f"{part.size[0]}x{part.size[1]}"
        )
    if isinstance(part, VideoFramesPart):
        return (
            f"video (JPEG frames) seed {part.seed}, {part.num_frames} frames, "
            f"{part.size[0]}x{part.size[1]}"
        )
    return repr(part)


def describe_spec(spec: PromptSpec) -> list[str]:
    lines = [describe_part(p) for p in spec.parts]
    if spec.extra:
        lines.append(f"kwargs: {json.dumps(dict(spec.extra), sort_keys=True)}")
    lines.append(f"max_tokens {spec.max_tokens}")
    return lines


def write_examples(run_dir: Path, examples: list[FuzzExample], meta: dict[str, Any]) -> None:
    """The seed and every drawn example, before any is sent."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(
        run_dir / EXAMPLES_JSON,
        {"fuzz": meta, "examples": [{"name": e.name, **e.to_json()} for e in examples]},
    )


def _responses(evaluations: list[Evaluation], topology: str) -> dict[str, dict[str, Any]]:
    baseline = {e.spec.name: e.baseline.to_json() for e in evaluations}
    candidate = {e.spec.name: e.candidate.to_json() for e in evaluations if e.candidate}
    return {BASELINE.name: baseline, topology: candidate}


def _key_evaluations(group: FailureGroup) -> list[Evaluation]:
    """The minimal request first, then the smallest member it started from, then the first
    member found (each once)."""
    chosen: list[Evaluation] = []
    for evaluation in (group.minimal, group.start, group.members[0]):
        if evaluation is not None and evaluation.spec.name not in {e.spec.name for e in chosen}:
            chosen.append(evaluation)
    return chosen


def staged(
    evaluations: list[Evaluation],
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, list[str]]]]:
    """The bodies of the earlier requests these requests' outcomes need, with those of the
    requests that need them, and run.json's `sent_after` (request -> what `repro` and `export`
    send before it, in order; left out when nothing is): `harness.run.repro.Bundle.how_sent`
    reads it.

    A replay sends them to fresh servers, where whether P's prefix cache holds the case's
    leading blocks (so P loads nothing, and lives) rests on the salts alone: a shared salt
    puts the stage's prompt there, salts of their own keep it out. The run's P held them or
    not (`Evaluation.stage_in_prefill_cache`: a P revived since the stage held nothing, under
    any salt), and the salts are written so that the replay's P does the same: the unsalted
    bodies share one salt (`UNSALTED_IN_THE_RUN`, which the replays keep) where the run's P
    held the blocks, and the case is kept off its stage's salt where it did not. Giving
    every unsalted body a salt of its own turned a D death into a P death (found in review,
    read); giving them one salt always lost a P death whose P had been revived (seen on real
    vLLM: repro and the export's run.sh said NOT reproduced)."""
    bodies: dict[str, dict[str, Any]] = {}
    after: dict[str, list[str]] = {}
    for evaluation in evaluations:
        if not evaluation.stage:
            continue
        after[evaluation.spec.name] = [name for name, _ in evaluation.stage]
        # The first request to need an earlier one decides its salt: the minimal request,
        # which `repro` picks, comes first.
        if evaluation.stage_in_prefill_cache:
            for name, body in evaluation.stage:
                bodies.setdefault(name, salted_as_sent(body))
            bodies[evaluation.spec.name] = salted_as_sent(evaluation.body)
        else:
            for name, body in evaluation.stage:
                bodies.setdefault(name, body)
            stage_salts = {bodies[name].get(CACHE_SALT) for name, _ in evaluation.stage}
            bodies[evaluation.spec.name] = salt_apart(evaluation.body, stage_salts)
    return bodies, ({SENT_AFTER: after} if after else {})


# The salt of requests the run sent under none (one namespace: each other's prefix caches).
UNSALTED_IN_THE_RUN = "epd-fuzz-unsalted"


def salted_as_sent(body: dict[str, Any]) -> dict[str, Any]:
    """`body` with the salt it was sent under made explicit (`staged`)."""
    return body if body.get(CACHE_SALT) else {**body, CACHE_SALT: UNSALTED_IN_THE_RUN}


def salt_apart(body: dict[str, Any], taken: set[str | None]) -> dict[str, Any]:
    """`body` under a salt none of `taken` is: as it is when unsalted (a replay gives it a
    salt of its own) or salted apart already (`staged`)."""
    salt = body.get(CACHE_SALT)
    if not salt or salt not in taken:
        return body
    return {**body, CACHE_SALT: f"{salt}-after-a-restart"}


def _records(evaluations: list[Evaluation]) -> list[CaseRecord]:
    return [e.record for e in evaluations if e.record is not None]


def _run_records(evaluations: list[Evaluation], groups: list[FailureGroup]) -> list[CaseRecord]:
    """The run bundle's records: a known group's cases as the declared passes the exit code
    counts them (`held_as_declared`, as a matrix scenario's declared failure), so that
    summary.json, verdicts.txt, junit.xml and diff.md say what the exit code says (found in
    review: a run of known failures only exited 0 and its junit.xml had them failed). A
    group's own bundle keeps them failing: `repro` and `export` of it pick that case."""
    rules = {
        id(evaluation): group.recognition.rule
        for group in groups
        if group.recognition.rule is not None
        for evaluation in (*group.members, group.minimal)
        if evaluation is not None
    }
    return [
        held_as_declared(record, rules[id(e)]) if id(e) in rules else record
        for e in evaluations
        if (record := e.record) is not None
    ]


def write_group_bundle(
    directory: Path,
    settings: RunSettings,
    topology: Topology,
    group: FailureGroup,
    meta: dict[str, Any],
    fault: str | None,
) -> None:
    """A normal run bundle of one failure group; its first failing case is the minimal one."""
    directory.mkdir(parents=True, exist_ok=True)
    chosen = _key_evaluations(group)
    stage_bodies, sent_after = staged(chosen)
    group_settings = dataclasses.replace(settings, run_dir=directory)
    run_info = write_run_info(
        group_settings,
        (BASELINE, topology),
        [e.spec for e in chosen],
        fault=fault,
        protocol=settings.protocol.to_json(),
        fuzz={**meta, "group": group_json(group)},
        **sent_after,
    )
    bodies = {**{e.spec.name: e.body for e in chosen}, **stage_bodies}
    write_json_atomic(directory / "requests.json", bodies)
    scrub = Redactor.for_run(settings.run_dir)  # as the bundle's own files are
    records = [scrub.record(r) for r in _records(chosen)]
    summary = scrub.data({"fuzz_group": group_json(group)})
    write_summary_json(directory / "summary.json", records, summary)
    responses = scrub.data(_responses(chosen, topology.name))
    write_json_atomic(directory / "responses.json", responses)
    write_verdicts(directory, records, run_info)
    write_bundle(directory, records, responses, run_info)
    copy_instance_commands(settings.run_dir, directory, topology)


def copy_instance_commands(run_dir: Path, directory: Path, topology: Topology) -> None:
    """The baseline's and the topology's recorded commands (`<topology>/*.cmd.json`), copied
    from the run directory into a group's bundle: `epd-harness export` reads them from the
    bundle it is given, and without them a group's bundle could not be exported (only the run
    directory, whose first case is the first group's). The logs and storage stay in the run
    directory: an export needs the commands alone."""
    for served in (BASELINE, topology):
        source = run_dir / safe_name(served.name)
        for command in sorted(source.glob("*.cmd.json")):
            target = directory / safe_name(served.name) / command.name
            target.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(target, command.read_text(encoding="utf-8"))


def group_json(group: FailureGroup) -> dict[str, Any]:
    rule = group.recognition.rule
    outside = group.recognition.outside_trigger
    unseen = group.recognition.unseen_evidence
    return {
        "signature": group.signature.to_json(),
        "key": group.signature.key,
        "known": rule.to_json() if rule else None,
        "declared_signature_outside_its_trigger": outside.to_json() if outside else None,
        "declared_trigger_without_its_evidence": unseen.to_json() if unseen else None,
        "members": [e.spec.name for e in group.members],
        "start": group.start.spec.name,
        "minimal": prompt_to_json(group.minimal.spec) if group.minimal else None,
        "minimal_layout": group.minimal.layout.to_json()
        if group.minimal and group.minimal.layout
        else None,
        "shrink": group.shrink.to_json() if group.shrink else None,
        "note": group.note,
    }


def evaluation_json(evaluation: Evaluation) -> dict[str, Any]:
    record = evaluation.record
    return {
        "name": evaluation.spec.name,
        "status": evaluation.status,
        "verdict": record.verdict.value if record else None,
        "signature": evaluation.signature.key if evaluation.signature else None,
        "known": evaluation.recognition.rule.name
        if evaluation.recognition and evaluation.recognition.rule
        else None,
        "layout": evaluation.layout.to_json() if evaluation.layout else None,
        "note": evaluation.note,
        "fault": evaluation.fault,
        "seconds": round(evaluation.seconds, 3),
        "restart_seconds": round(evaluation.restart_seconds, 1),
    }


def coverage(report: FuzzReport, kv: bool = True) -> dict[str, int]:
    """What the examples really hit (exact layouts): boundary offsets, requests drawn to
    extend the one before, and, where `kv` (`moves_kv`: D loads block-aligned KV), D's tail, the
    k*block+1 prompts D keys apart from P, and those whose lookup found an earlier
    request's shorter folder (P loads one never written)."""
    counts = {"with media": 0, "ends -1": 0, "ends on": 0, "ends +1": 0, "in D's tail": 0}
    counts |= {"text only": 0, "k*block+1 tokens": 0, "P loads a folder never written": 0}
    follow_ups = {e.name for e in report.examples if e.aim.get("follows")}
    counts["follow-ups"] = sum(ev.spec.name in follow_ups for ev in report.evaluations)
    for evaluation in report.evaluations:
        layout = evaluation.layout
        if layout is None:
            continue
        counts["k*block+1 tokens"] += not layout.kv_keys_agree
        counts["P loads a folder never written"] += layout.prefill_loads_missing
        if layout.last_media_end is None:
            counts["text only"] += 1
            continue
        counts["with media"] += 1
        offset = layout.boundary_offset
        counts["ends -1"] += offset == -1
        counts["ends on"] += offset == 0
        counts["ends +1"] += offset == 1
        counts["in D's tail"] += layout.media_in_decode_tail
    if not kv:
        del counts["in D's tail"], counts["k*block+1 tokens"]
        del counts["P loads a folder never written"]
    return counts


def write_fuzz_bundle(
    settings: RunSettings,
    topology: Topology,
    report: FuzzReport,
    meta: dict[str, Any],
    fault: str | None,
) -> list[Path]:
    """Everything; returns the failure groups' bundle directories, in report order."""
    run_dir = settings.run_dir
    group_dirs: list[Path] = []
    for number, group in enumerate(report.groups, 1):
        kind = "known" if group.known else "new"
        directory = run_dir / FAILURES_DIR / f"{number:02d}-{kind}-{group.signature.slug}"
        write_group_bundle(directory, settings, topology, group, meta, fault)
        group_dirs.append(directory)
    key = [e for g in report.groups for e in _key_evaluations(g)]
    minimal = [g.minimal for g in report.groups if g.minimal is not None]
    # Minimal requests first: `repro RUN_DIR` picks the first failing case.
    judged = [e for e in report.evaluations if e.record is not None]
    ordered = minimal + [e for e in judged if not any(e is m for m in minimal)]
    scrub = Redactor.for_run(run_dir)  # as the bundle's own files are
    records = [scrub.record(r) for r in _run_records(ordered, report.groups)]
    stage_bodies, sent_after = staged(key)
    bodies = {**{e.spec.name: e.body for e in key}, **stage_bodies}
    # As `run` fails a planted fault that acted on nothing, with every report saying why.
    problems = [fault_effect_line(fault, report)] if fault and report.fault_acted_on_nothing else []
    run_info = write_run_info(
        settings,
        (BASELINE, topology),
        [e.spec for e in key],
        fault=fault,
        protocol=settings.protocol.to_json(),
        fuzz=meta,
        **({"problems": problems} if problems else {}),
        **sent_after,
    )
    write_json_atomic(run_dir / "requests.json", bodies)
    summary = scrub.data(fuzz_summary(report, meta, group_dirs))
    write_summary_json(run_dir / "summary.json", records, {"fuzz": summary}, scrub.data(problems))
    responses = scrub.data(
        _responses([*key, *(e for e in judged if not any(e is k for k in key))], topology.name)
    )
    write_json_atomic(run_dir / "responses.json", responses)
    write_verdicts(run_dir, records, run_info)
    write_json_atomic(
        run_dir / FUZZ_JSON,
        scrub.data(
            {
                **summary,
                "examples": [evaluation_json(e) for e in report.evaluations],
                "groups": [group_json(g) for g in report.groups],
            }
        ),
    )
    fuzz_md = render_fuzz_md(report, meta, group_dirs, run_dir, devices_line(run_info))
    write_text_atomic(run_dir / FUZZ_MD, scrub.text(fuzz_md))
    write_bundle(run_dir, records, responses, run_info)
    return group_dirs


def fuzz_summary(
    report: FuzzReport, meta: dict[str, Any], group_dirs: list[Path]
) -> dict[str, Any]:
    return {
        **meta,
        "counts": report.counts(),
        "coverage": coverage(report, moves_kv(meta)),
        "timing": report.timing(),
        "restarts": report.restarts,
        "predictions": report.predictions,
        "new_failures": len(report.new_groups),
        "known_failures": len(report.groups) - len(report.new_groups),
        "unstable_baseline": len(report.unstable_baseline),
        "failure_bundles": [str(d) for d in group_dirs],
        "fault_effect": report.fault_effect() if meta.get("fault") else None,
    }


def fault_effect_line(fault: str, report: FuzzReport) -> str:
    """One line: how many examples the planted fault acted on, and why not on the others. A
    fault acts on some shapes only (ec-swap-items on items of one shape), so a self-test that
    found nothing says whether the fault ever acted."""
    effect = report.fault_effect()
    sent = effect["acted"] + effect["not_acted"]
    if not sent and report.judged_any:
        # A fault with no hook of its own (drop-metadata's flag, stream-duplicate-chunk in the
        # proxy) records nothing per request: "acted on 0 of the 0 example(s) sent" (real
        # vLLM, fuzz --stream --plant-fault stream-duplicate-chunk) read as a fault idle. A
        # run that sent nothing is told as such, whatever the fault.
        return (
            f"planted fault {fault} acts on every request sent and records no effect per "
            "request: the failures found are the self-test's evidence"
        )
    line = f"planted fault {fault} acted on {effect['acted']} of the {sent} example(s) sent"
    if effect["reasons"]:
        reasons = sorted(effect["reasons"].items(), key=lambda item: -item[1])
        line += "; not on " + "; ".join(f"{n}: {reason}" for reason, n in reasons)
    if report.fault_acted_on_nothing:
        line += " (the self-test tested nothing: no example had a shape the fault acts on)"
    return line


def render_fault_effect(fault: str, report: FuzzReport) -> list[str]:
    return ["## Planted fault", "", fault_effect_line(fault, report), ""]


def render_fuzz_md(
    report: FuzzReport,
    meta: dict[str, Any],
    group_dirs: list[Path],
    run_dir: Path,
    ran_on: str | None = None,
) -> str:
    """fuzz.md, which the command prints at its end; `ran_on`: verdicts.txt's devices line."""
    timing = report.timing()
    lines = [
        f"# Fuzz: {meta['topology']}, seed {meta['seed']}, {len(report.examples)} examples"
        + (", streamed" if meta.get("stream") else ""),
        "",
        f"vLLM {meta.get('vllm')}, KV connector {meta.get('kv_connector')}"
        + (f", planted fault {meta['fault']}" if meta.get("fault") else ""),
        "",
    ]
    if ran_on:
        lines += [ran_on, ""]
    new = report.new_groups
    lines.append(
        f"**{len(new)} new failure(s), {len(report.groups) - len(new)} known**; "
        f"examples by outcome: {json.dumps(report.counts(), sort_keys=True)}"
    )
    lines.append("")
    if unstable := report.unstable_baseline_line():
        lines += [f"**{unstable}**: the run fails on it, as `epd-harness run` does", ""]
    if meta.get("fault"):
        lines += render_fault_effect(meta["fault"], report)
    for number, (group, directory) in enumerate(zip(report.groups, group_dirs), 1):
        lines += render_group(
            number, group, directory, run_dir, moves_kv(meta), bool(meta.get("attached"))
        )
    lines += [
        "## Cost",
        "",
        f"- start-up (baseline and {meta['topology']} side by side): {timing['startup_s']} s",
        f"- examples: {timing['examples_s']} s; per judged example: mean "
        f"{timing['per_judged_example_mean_s']} s, median {timing['per_judged_example_median_s']} s",
        f"- shrinking: {timing['shrink_s']} s",
        f"- restarts: {timing['restarts']}, {timing['restart_s']} s in all"
        + (f" ({', '.join(restarts_by_kind(report))})" if report.restarts else ""),
        f"- total: {timing['total_s']} s",
        "",
        "## What the examples hit (exact layouts from the baseline's prompt ids)",
        "",
        json.dumps(coverage(report, moves_kv(meta)), sort_keys=True),
        "",
    ]
    unsent = [e for e in report.evaluations if e.status in ("not-sent", "known-predicted")]
    if unsent:
        reasons: dict[str, int] = {}
        for e in unsent:
            reasons[f"{e.status}: {e.note}"] = reasons.get(f"{e.status}: {e.note}", 0) + 1
        lines += ["## Not sent to the topology (counted, not judged)", ""]
        lines += [f"- {n} x {reason}" for reason, n in sorted(reasons.items())]
        lines.append("")
    rejected = [e for e in report.evaluations if e.status == "baseline-rejected"]
    if rejected:
        lines += ["## Rejected by the baseline (skipped, never judged)", ""]
        lines += [f"- {e.spec.name}: {e.note}" for e in rejected]
        lines.append("")
    return "\n".join(lines)


def restarts_by_kind(report: FuzzReport) -> list[str]:
    """'4 revived (38-52 s)', '1 restarted (80 s)': the instance alone, or the topology."""
    kinds: dict[str, list[float]] = {}
    for restart in report.restarts:
        kinds.setdefault(restart.get("how", "restarted"), []).append(restart["seconds"])
    return [
        f"{len(seconds)} {how} ({min(seconds):.0f}-{max(seconds):.0f} s)"
        for how, seconds in sorted(kinds.items())
    ]


def moves_kv(meta: dict[str, Any]) -> bool:
    """The fuzzed topology has a D that loads block-aligned KV (where "D loads" and "D's tail"
    mean something: `block_aligned_kv`, by the run's KV connector); True for a topology the
    harness does not know, which says more, not less."""
    topology = TOPOLOGIES.get(meta.get("topology", ""))
    return topology is None or block_aligned_kv(topology, meta.get("kv_connector", ""))


def render_group(
    number: int,
    group: FailureGroup,
    directory: Path,
    run_dir: Path,
    kv: bool = True,
    attached: bool = False,
) -> list[str]:
    rule = group.recognition.rule
    status = f"known ({rule.name})" if rule else "NEW"
    minimal = group.minimal or group.start
    lines = [f"## {number}. {status}: {group.signature.key}", ""]
    lines.append(f"Minimal request ({minimal.spec.name}):")
    lines += [f"- {line}" for line in describe_spec(minimal.spec)]
    if minimal.layout is not None:
        layout = minimal.layout
        line = (
            f"- layout: {layout.prompt_tokens} prompt tokens; last media run ends at "
            f"{layout.last_media_end}"
        )
        if kv:
            line += (
                f"; D loads {layout.kv_prefix} (block {layout.block_size}); media in D's "
                f"tail: {layout.media_in_decode_tail}"
            )
        lines.append(line)
    lines.append("")
    if rule:
        lines += [f"Declared cause: {rule.reason}", ""]
    outside = group.recognition.outside_trigger
    if outside:
        lines += [
            f"Its verdict and evidence are those of {outside.name}, but without that "
            f"declaration's trigger ({outside.trigger_text}): reported as new.",
            "",
        ]
    unseen = group.recognition.unseen_evidence
    if unseen:
        lines += [
            f"Its verdict is that of {unseen.name}, whose trigger holds ({unseen.trigger_text}), "
            f"but its error does not show that declaration's evidence ('{unseen.evidence}'): "
            "reported as new."
            + (
                " An attached deployment shows the harness no instance's log, where vLLM "
                "writes that evidence: look for it there."
                if attached
                else ""
            ),
            "",
        ]
    shrink = group.shrink
    if shrink is not None:
        # A predicted shrink's confirmation (`confirm_predicted`) is kept among its trials,
        # but is no trial of the budget: "81 trial(s) ... ended by trial budget (80)" read as
        # the budget overrun.
        confirmation = shrink.confirmed is not None
        lines.append(
            f"Shrunk from {shrink.start.name} ({len(group.members)} example(s) failed so) in "
            f"{shrink.accepted} step(s), {len(shrink.trials) - confirmation} trial(s)"
            + (" and 1 sent to confirm it" if confirmation else "")
            + f", {shrink.restarts} restart(s), {shrink.seconds:.0f} s; mode {shrink.mode}"
            + (f", confirmed: {shrink.confirmed}" if shrink.confirmed is not None else "")
            + (f"; {shrink.skipped} candidate(s) skipped as too short" if shrink.skipped else "")
            + f"; ended by {shrink.stopped_by}."
        )
    if group.note:
        lines.append(group.note)
    if minimal.record is not None:
        lines += ["", "```", format_failure(minimal.record)[:3000], "```"]
    lines += [
        "",
        f"Repro bundle: `{directory.relative_to(run_dir)}` (`epd-harness repro {directory}`)",
        "",
    ]
    return lines
