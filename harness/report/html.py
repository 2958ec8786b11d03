"""The run as one self-contained HTML page: verdicts first, then the evidence of every case.

One file, inline CSS, no scripts and no external assets, so it opens the same from a CI
artifact download, a mail attachment or an air-gapped machine. Failing cases come expanded
(`<details open>`), passing ones collapsed: the page leads with what needs a person's eyes.
Every piece of run data goes through `html.escape`: prompts, responses and error texts are
untrusted and may hold markup.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any

from harness.devices import describe_devices
from harness.files import write_text_atomic
from harness.judge.records import CaseRecord, Verdict
from harness.report.text import (
    describe_baseline_sources,
    drift_summary,
    purpose_line,
    run_problems,
)

REPORT_HTML = "report.html"
# Terminal escape sequences: vLLM colours its log lines, and error texts carry log tails.
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

BADGE_COLORS = {
    Verdict.MATCH: "#1a7f37",
    Verdict.DRIFT: "#9a6700",
    Verdict.MISMATCH: "#cf222e",
    Verdict.VACUOUS: "#8250df",
    Verdict.UNSTABLE_BASELINE: "#bc4c00",
    Verdict.ERROR: "#82071e",
    Verdict.NOT_APPLICABLE: "#656d76",
}

CSS = """
:root { --fg: #1f2328; --muted: #656d76; --line: #d0d7de; --soft: #f6f8fa;
        --bad: #cf222e; --bad-bg: #ffebe9; --good: #1a7f37; --good-bg: #dafbe1; }
* { box-sizing: border-box; }
body { margin: 0; padding: 24px 32px 48px; color: var(--fg); background: #fff;
       font: 14px/1.5 system-ui, -apple-system, "Segoe UI", "DejaVu Sans", sans-serif; }
h1 { font-size: 22px; margin: 0 0 6px; }
h2 { font-size: 17px; margin: 28px 0 10px; padding-bottom: 4px;
     border-bottom: 1px solid var(--line); }
h3 { font-size: 13px; margin: 0 0 6px; color: var(--muted); font-weight: 600; }
h4 { font-size: 13px; margin: 14px 0 6px; }
code, pre, .ids { font-family: ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace;
                  font-size: 12.5px; }
pre { margin: 0; padding: 10px 12px; background: var(--soft); border: 1px solid var(--line);
      border-radius: 6px; white-space: pre-wrap; overflow-wrap: anywhere; }
pre.error { background: var(--bad-bg); border-color: #ffcecb; }
.muted { color: var(--muted); }
.status { display: inline-block; padding: 2px 12px; border-radius: 6px; color: #fff;
          font-weight: 700; letter-spacing: .04em; margin-right: 8px; }
.status.pass { background: var(--good); } .status.fail { background: var(--bad); }
.summary-line { font-size: 15px; margin: 8px 0 4px; }
.meta { color: var(--muted); font-size: 12.5px; margin: 0; }
.meta code { color: var(--fg); }
table { border-collapse: collapse; }
table.verdicts { width: 100%; }
table.verdicts th, table.verdicts td { text-align: left; padding: 6px 10px;
    border-bottom: 1px solid var(--line); vertical-align: top; }
table.verdicts th { background: var(--soft); font-size: 12px; text-transform: uppercase;
    letter-spacing: .04em; color: var(--muted); }
table.verdicts tr.fail td { background: #fff8f7; }
table.verdicts a { color: inherit; }
td.detail { color: var(--muted); overflow-wrap: anywhere; }
.badge { display: inline-block; min-width: 84px; text-align: center; padding: 1px 8px;
         border-radius: 10px; color: #fff; font-size: 11.5px; font-weight: 700;
         letter-spacing: .03em; }
.no { color: var(--bad); font-weight: 700; }
details.case { border: 1px solid var(--line); border-radius: 8px; margin: 0 0 14px; }
details.case.fail { border-color: #ffaba8; }
details.case > summary { cursor: pointer; padding: 10px 14px; background: var(--soft);
    border-radius: 8px; list-style-position: inside; }
details.case.fail > summary { background: var(--bad-bg); }
details.case[open] > summary { border-bottom: 1px solid var(--line);
    border-radius: 8px 8px 0 0; }
.case-body { padding: 14px; }
.sides { display: grid; grid-template-columns: 1fr 1fr; gap: 14px; }
.side { border: 1px solid var(--line); border-radius: 6px; padding: 10px 12px; min-width: 0; }
.ids { line-height: 1.9; overflow-wrap: anywhere; }
.t { display: inline-block; min-width: calc(var(--id-chars, 4) * 1ch + 6px); padding: 0 3px;
      margin: 0 1px; border-radius: 3px; text-align: right; }
.legend .t { min-width: 0; }
.t.after { color: #8c959f; }
.t.diverge { background: var(--bad); color: #fff; font-weight: 700;
             outline: 2px solid #82071e; outline-offset: 1px; }
.t.end { font-style: italic; }
.side .text { margin-top: 8px; }
.legend { font-size: 12px; color: var(--muted); margin: 8px 0 0; }
.legend .t { font-size: 11.5px; }
.topk { display: flex; gap: 18px; flex-wrap: wrap; align-items: flex-start; }
.topk table { font-size: 12.5px; border: 1px solid var(--line); }
.topk caption { text-align: left; font-size: 12px; color: var(--muted); padding-bottom: 2px; }
.topk th, .topk td { padding: 2px 10px; border-bottom: 1px solid var(--line); text-align: right; }
.topk th { background: var(--soft); font-weight: 600; }
.topk tr.own td { font-weight: 700; }
.topk tr.other td { background: #fff8c5; }
ul.guards { margin: 0; padding-left: 0; list-style: none; }
ul.guards li { padding: 3px 0; }
ul.guards li.failed { color: var(--bad); }
ul.guards li.unchecked { color: var(--muted); font-style: italic; }
ul.guards .mark { display: inline-block; width: 1.4em; font-weight: 700; }
table.kv td, table.kv th { padding: 3px 12px 3px 0; vertical-align: top; text-align: left;
    font-size: 12.5px; border-bottom: 1px solid var(--soft); }
table.kv th { color: var(--muted); font-weight: 600; white-space: nowrap; }
"""


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def _badge(verdict: Verdict) -> str:
    return (
        f'<span class="badge verdict-{escape(verdict.value.lower())}" '
        f'style="background:{BADGE_COLORS[verdict]}">{escape(verdict.value)}</span>'
    )


def _served(run_info: Mapping[str, Any]) -> list[str]:
    """The served vLLM, its torch and the dtype every instance computed in: what the numbers
    depend on (not the harness's own). The dtype was only in the serving table further down,
    where a T4's float16 run was not told from a bfloat16 one at a glance."""
    served = run_info.get("served_vllm") or {}
    dtype = (run_info.get("serving") or {}).get("dtype")
    return [
        *(
            [
                f"vLLM {escape(str(served.get('version')))}",
                f"torch {escape(str(served.get('torch_version')))}",
            ]
            if served
            else []
        ),
        *([f"dtype {escape(str(dtype))}"] if dtype else []),
    ]


def _header(records: Sequence[CaseRecord], run_info: Mapping[str, Any]) -> str:
    failed = sum(not r.policy_passed for r in records)
    problems = run_problems(run_info)
    passed = bool(records) and not failed and not problems
    counts = " · ".join(
        f"{v.value} {n}" for v in Verdict if (n := sum(r.verdict is v for r in records))
    )
    if not records:
        line = "no cases were judged: this run proves nothing"
    elif failed:
        line = f"{failed} of {len(records)} case(s) failed their policy"
    else:
        line = f"all {len(records)} case(s) passed their policy"
    if problems:
        line += f"; the run failed by {len(problems)} problem(s)"
    purpose = purpose_line(run_info)  # a self-test's planted fault, a death under load
    said = (
        f"<p class=purpose><strong>{escape(purpose)}</strong>: not failures of vLLM</p>\n"
        if purpose
        else ""
    )
    return (
        "<header>\n<h1>EPD correctness report</h1>\n"
        f'<p class="summary-line"><span class="status {"pass" if passed else "fail"}">'
        f"{'PASS' if passed else 'FAIL'}</span>{escape(line)}"
        f"{f' <span class=muted>({escape(counts)})</span>' if counts else ''}</p>\n"
        f"{said}"
        + "".join(f"<p class=problem><strong>{escape(p)}</strong></p>\n" for p in problems)
        + f"{_meta_line(run_info)}\n</header>"
    )


def _meta_line(run_info: Mapping[str, Any]) -> str:
    """Model, versions and host in one line; what the run did not record is left out."""
    model = run_info.get("model") or {}
    meta = []
    if model:
        digest = model.get("digest")
        meta.append(
            f"model <code>{escape(str(model.get('dir')))}</code>"
            + (f" (sha256 <code>{escape(digest[:12])}</code>)" if digest else "")
        )
    meta += _served(run_info)
    devices = describe_devices(run_info.get("devices_used"))
    if devices:
        meta.append(f"ran on {escape(devices)}")
    meta += [escape(str(run_info[key])) for key in ("hostname", "created") if run_info.get(key)]
    return f'<p class="meta">{" · ".join(meta)}</p>' if meta else ""


def _verdict_table(records: Sequence[CaseRecord]) -> str:
    rows = []
    for i, r in enumerate(records):
        rows.append(
            f'<tr class="{"pass" if r.policy_passed else "fail"}">'
            f'<td><a href="#case-{i}">{escape(r.topology)}</a></td>'
            f"<td><code>{escape(r.prompt)}</code></td><td>{escape(r.reference)}</td>"
            f"<td>{_badge(r.verdict)}</td>"
            f"<td>{'yes' if r.policy_passed else '<span class=no>NO</span>'}</td>"
            f'<td class="detail">{escape(r.detail)}</td></tr>'
        )
    head = "".join(
        f"<th>{c}</th>" for c in ("Topology", "Prompt", "Reference", "Verdict", "Pass", "Detail")
    )
    return (
        '<h2>Verdicts</h2>\n<table class="verdicts">\n'
        f"<thead><tr>{head}</tr></thead>\n<tbody>\n" + "\n".join(rows) + "\n</tbody>\n</table>"
    )


def _token_ids(ids: Sequence[int], divergence: int | None, anchor: str) -> str:
    """Ids as spans: the first divergence highlighted (an `end` marker if this side had
    stopped by then), the ids after it dimmed since they no longer compare position by
    position."""
    spans = []
    for position, tid in enumerate(ids):
        if divergence is not None and position == divergence:
            spans.append(
                f'<span class="t diverge" id="{anchor}" title="position {position}: first '
                f'divergence">{escape(str(tid))}</span>'
            )
        else:
            after = divergence is not None and position > divergence
            spans.append(
                f'<span class="t{" after" if after else ""}" title="position {position}">'
                f"{escape(str(tid))}</span>"
            )
    if divergence is not None and divergence >= len(ids):
        spans.append(
            f'<span class="t diverge end" id="{anchor}" title="position {divergence}: this side '
            'had already ended">end</span>'
        )
    return '<div class="ids">' + " ".join(spans) + "</div>"


def _side(
    label: str,
    name: str,
    outcome: Mapping[str, Any] | None,
    divergence: Mapping[str, Any] | None,
    anchor: str,
) -> str:
    """One column of the side-by-side view, from the responses.json entry of that side."""
    title = f"<h3>{escape(label)} · {escape(name)}"
    result = (outcome or {}).get("result")
    if result is None:
        why = "no response recorded" if outcome is None else "no result (the request failed)"
        return f'<div class="side">{title}</h3><p class="muted">{escape(why)}</p></div>'
    ids = result.get("token_ids") or []
    index = divergence["index"] if divergence else None
    stats = f"{len(ids)} generated ids, finish {result.get('finish_reason')}"
    text = result.get("text") or ""
    return (
        f'<div class="side">{title} '
        f'<span class="muted">· {escape(stats)}</span></h3>\n'
        f"{_token_ids(ids, index, anchor)}\n"
        f'<div class="text"><h3>decoded text</h3><pre>{escape(text) or "&nbsp;"}</pre></div>'
        "</div>"
    )


def _windows_only(divergence: Mapping[str, Any], anchor: str) -> str:
    """Both divergence windows' columns, when responses.json lacks the full sequences."""
    index, start = divergence["index"], divergence["window_start"]
    sides = []
    for side in ("reference", "candidate"):
        window = divergence[f"{side}_window"]
        ids = _token_ids(window, index - start, f"{anchor}-{side[:3]}-div")
        sides.append(f'<div class="side"><h3>{side} · ids from position {start}</h3>{ids}</div>')
    return "".join(sides)


def _id_chars(
    outcomes: Sequence[Mapping[str, Any] | None], divergence: Mapping[str, Any] | None
) -> int:
    """Digits of the widest id shown: every id gets that width, so both columns wrap alike
    and position n sits at the same place on both sides."""
    sequences = [((o or {}).get("result") or {}).get("token_ids") or [] for o in outcomes]
    if divergence:
        sequences += [divergence["reference_window"], divergence["candidate_window"]]
    return max((len(str(t)) for ids in sequences for t in ids), default=3)


def _topk_table(
    caption: str, top: Sequence[Sequence[Any]] | None, own: int | None, other: int | None
) -> str:
    if not top:
        return f"<table><caption>{escape(caption)}</caption><tr><td>none</td></tr></table>"
    rows = []
    for rank, (tid, logprob) in enumerate(top, start=1):
        cls = "own" if tid == own else "other" if tid == other else ""
        rows.append(
            f'<tr class="{cls}"><td>{rank}</td><td>{escape(str(tid))}</td>'
            f"<td>{float(logprob):.4f}</td></tr>"
        )
    return (
        f"<table><caption>{escape(caption)}</caption>"
        "<tr><th>rank</th><th>id</th><th>logprob</th></tr>" + "".join(rows) + "</table>"
    )


def _topk(divergence: Mapping[str, Any]) -> str:
    ref, cand = divergence.get("reference_token"), divergence.get("candidate_token")
    close = drift_summary(divergence)
    return (
        f'<h4>Top-k logprobs at position {divergence["index"]}</h4>\n<div class="topk">'
        + _topk_table("reference", divergence.get("reference_top"), ref, cand)
        + _topk_table("candidate", divergence.get("candidate_top"), cand, ref)
        + "</div>\n"
        '<p class="legend">bold: the token this side generated · highlighted: the token the '
        f"other side generated · drift: {escape(close)}</p>"
    )


def _guards(guards: Mapping[str, Mapping[str, Any]]) -> str:
    if not guards:
        return ""
    items = []
    for name, guard in guards.items():
        ok, unchecked = bool(guard.get("ok")), bool(guard.get("not_checkable"))
        css, mark = ("unchecked", "?") if unchecked else ("ok", "✓") if ok else ("failed", "✗")
        items.append(
            f'<li class="{css}"><span class="mark">{mark}'
            f"</span><code>{escape(name)}</code>: {escape(str(guard.get('evidence', '')))}</li>"
        )
    failed = sum(not g.get("ok") and not g.get("not_checkable") for g in guards.values())
    unchecked_count = sum(bool(g.get("not_checkable")) for g in guards.values())
    notes = [f"{failed} failed"] if failed else []
    notes += [f"{unchecked_count} not checkable"] if unchecked_count else []
    title = f"Transfer guards ({', '.join(notes)})" if notes else "Transfer guards"
    return f'<h4>{title}</h4>\n<ul class="guards">' + "".join(items) + "</ul>"


def _answer_of(
    responses: Mapping[str, Mapping[str, Any]], label: str, prompt: str
) -> Mapping[str, Any] | None:
    """The responses.json entry of a case labelled `label`: under the label itself, or where
    the matrix (`TOPOLOGY:SCENARIO` under `matrix:SCENARIO`) and a load (`TOPOLOGY:load#N`
    under `load:TOPOLOGY:N`) keep their answers."""
    topology, _, rest = label.partition(":")
    keys = [label]
    if rest.startswith("load#"):
        keys.append(f"load:{topology}:{rest.removeprefix('load#')}")
    elif rest:
        keys.append(f"matrix:{rest}")
    return next((responses[k][prompt] for k in keys if prompt in responses.get(k, {})), None)


def _case(i: int, record: CaseRecord, responses: Mapping[str, Mapping[str, Any]]) -> str:
    anchor = f"case-{i}"
    d = record.divergence
    reference = responses.get(record.reference, {}).get(record.prompt)
    candidate = _answer_of(responses, record.topology, record.prompt)
    if reference is None and candidate is None and d:
        columns = _windows_only(d, anchor)
    else:
        columns = _side("reference", record.reference, reference, d, f"{anchor}-ref-div")
        columns += _side("candidate", record.topology, candidate, d, f"{anchor}-can-div")
    width = _id_chars([reference, candidate], d)
    sides = f'<div class="sides" style="--id-chars: {width}">{columns}</div>'
    if d:
        sides += (
            '<p class="legend"><span class="t diverge">id</span> first divergence (position '
            f'{d["index"]}) · <span class="t after">id</span> after it</p>'
        )
    parts = [sides]
    if d:
        parts.append(_topk(d))
    parts.append(_guards(record.guards))
    if record.error:
        error = escape(strip_ansi(record.error))
        parts.append(f'<h4>Error</h4>\n<pre class="error">{error}</pre>')
    explanation = record.explanation or record.detail
    if explanation and not record.error:
        parts.append(f"<h4>Evidence</h4>\n<pre>{escape(explanation)}</pre>")
    state = "pass" if record.policy_passed else "fail"
    return (
        f'<details class="case {state}" id="{anchor}"{"" if record.policy_passed else " open"}>'
        f"<summary>{_badge(record.verdict)} <strong>{escape(record.topology)}</strong> vs "
        f"{escape(record.reference)} · prompt <code>{escape(record.prompt)}</code> "
        f'<span class="muted">— {escape(record.detail)}</span></summary>\n'
        '<div class="case-body">\n' + "\n".join(p for p in parts if p) + "\n</div></details>"
    )


def _kv_table(rows: Mapping[str, Any]) -> str:
    cells = []
    for key, value in rows.items():
        shown = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        cells.append(f"<tr><th>{escape(str(key))}</th><td><code>{escape(shown)}</code></td></tr>")
    return '<table class="kv">' + "".join(cells) + "</table>"


def _run_section(run_info: Mapping[str, Any]) -> str:
    """Where, on what and how the run ran: the facts of run.json, for whoever reproduces it."""
    model = run_info.get("model") or {}
    facts = {
        "model": model.get("dir"),
        "model sha256": model.get("digest"),
        "served vLLM": (run_info.get("served_vllm") or {}).get("version"),
        "served torch": (run_info.get("served_vllm") or {}).get("torch_version"),
        "vllm executable": (run_info.get("served_vllm") or {}).get("executable"),
        # A baseline this run did not serve (a cache entry, a golden): whose, and from when.
        "baseline": describe_baseline_sources(run_info.get("baseline_sources") or {}),
        **{key: run_info.get(key) for key in ("python", "platform", "hostname", "created")},
        "command": " ".join(run_info.get("harness_argv") or []),
    }
    facts = {key: value for key, value in facts.items() if value}
    instances = run_info.get("instances") or {}
    if not (facts or run_info.get("serving") or instances):
        return ""
    parts = ["<h2>Run</h2>", _kv_table(facts) if facts else ""]
    if run_info.get("serving"):
        parts += ["<h4>Serving config</h4>", _kv_table(run_info["serving"])]
    if instances:
        commands = "\n\n".join(
            f"# {name}{_node_note(command)}\n{' '.join(command.get('argv', []))}"
            for name, command in instances.items()
        )
        parts.append(
            f"<details><summary>Instance commands ({len(instances)})</summary>"
            f"<pre>{escape(commands)}</pre></details>"
        )
    return "\n".join(parts)


def _node_note(command: Mapping[str, Any]) -> str:
    """' (on node 10.0.0.3, host-b)' for an instance a launcher placed on a cluster."""
    node = command.get("node") or {}
    if not node.get("address"):
        return ""
    host = f", {node['hostname']}" if node.get("hostname") else ""
    return f" (on node {node['address']}{host})"


def render_report_html(
    records: Sequence[CaseRecord],
    responses: Mapping[str, Mapping[str, Any]],
    run_info: Mapping[str, Any],
) -> str:
    """The whole page. `responses` is responses.json's content: {topology: {prompt: outcome}}."""
    failed = sum(not r.policy_passed for r in records)
    passed = records and not failed and not run_problems(run_info)
    title = f"EPD report: {'PASS' if passed else 'FAIL'}"
    # Failing cases first: they are what the reader came for. Anchors keep the table's order.
    numbered = sorted(enumerate(records), key=lambda item: item[1].policy_passed)
    cases = "\n".join(_case(i, r, responses) for i, r in numbered)
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{escape(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n"
        f"{_header(records, run_info)}\n{_verdict_table(records)}\n"
        f"<h2>Cases</h2>\n{cases or '<p class=muted>No cases.</p>'}\n"
        f"{_run_section(run_info)}\n</body>\n</html>\n"
    )


def write_report_html(
    run_dir: str | os.PathLike[str],
    records: Sequence[CaseRecord],
    responses: Mapping[str, Mapping[str, Any]],
    run_info: Mapping[str, Any],
) -> None:
    write_text_atomic(Path(run_dir) / REPORT_HTML, render_report_html(records, responses, run_info))
