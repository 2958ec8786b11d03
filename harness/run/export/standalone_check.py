#!/usr/bin/env python3
"""check.py of an exported repro: send the recorded request once, compare the answer's token ids
with the expected ones, and name any instance that died.

`epd-harness export` copies this file into the export as `check.py`; there it runs without the
harness, on the Python standard library alone, while `serve.sh` serves (`run.sh` does both):

    python3 check.py [--state DIR] [--save-reference FILE | --reference FILE]

It reads `request.json` (the body exactly as the harness sent it, media inlined; a streamed
one's answer is read from its events) and
`expected.json` (the case's reference's ids, or for a probe what the instance should do)
beside it, and `DIR/endpoints.tsv`, which `serve.sh` writes once everything is healthy (the
entry URL, every instance's URL, process id and log) and removes when it stops.

A later case of a sequential matrix scenario was sent after the scenario's earlier requests,
on the same servers, and its failure may need what they left (the KV an earlier prompt
stored under the key the case's request looks up). Their bodies are `before/NN-<prompt>.json`
beside it: while `serve.sh` serves the case, check.py sends each first, in name order, to the
same entry point, and prints one line each; they are not judged. One that gets no answer (an
HTTP error, no answer at all, a stream that reports an error) leaves the stage unset:
check.py then sends no more, names any instance that died, and exits 2 without sending the
case's request (an ERROR there would read as the recorded one), NOT reproduced. The reference
answers request.json alone, as the run's baseline did. Without `before/` the case is sent alone.

`run.sh reference` runs it twice. While `serve.sh reference` serves the case's reference
(the monolithic baseline, or an exact reference such as 1P+1D), `--save-reference FILE`
keeps that answer's ids and log-probs in FILE (and says whether the recorded ids hold here).
While `serve.sh` serves the case, `--reference FILE` judges the case against the answer in
FILE, under the run's policy and noise floor from expected.json, and exits with that
judgment's code; it also says how the case compares with the recorded ids. On another machine
(GPU model, driver or CUDA; CPU model, build or thread count) the recorded ids may not hold;
the reference served here does.

Token ids are judged as the harness judges them (its harness/judge/compare.py, restated here
in a few lines): a first difference in the generated ids is DRIFT, numeric noise, when the
run measured a noise floor above zero (`noise_floor_nats`), both sides' log-prob gaps between
the two tokens at that position are within it, both sides put each of the two tokens at the
same log-prob within it, and every earlier position's log-prob agreed within it too; any other
difference is a MISMATCH. Whether a DRIFT passes is the case's
policy (`drift_passes`: under pd-drift, a P->D topology against the monolithic baseline).

It says whether the case's recorded failure is reproduced as `epd-harness repro` does: the
same verdict, shown where it was recorded (the same instance died; the same ids parted, at
whatever position; a stream's framing broke); the verdict showing elsewhere is NOT
reproduced, the difference named.
The exit code says what happened here, reproduced or not.

Exit codes:

- 0: the answer equals the expected one, or drifts from it as the case's policy allows (a
  probe: the instance refused the request and kept serving);
- 1: a difference: other token ids (the first divergence is printed; a DRIFT the policy does
  not pass included), or a probe answered;
- 2: an error: an HTTP error, a timeout, an answer without token ids, an unstreamed answer
  the harness refuses as broken (several choices, no finish_reason, log-probs not of its
  ids, a usage counting other ids or none), an instance that died
  (named, with the error lines of its log and its last lines), an earlier request
  (`before/`) that got no answer, the case's request then not sent, or check.py could not
  run at all (an expected.json whose `noise_floor_nats` is no measured floor among the
  causes, named in one line).
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import math
import os
import re
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EXIT_MATCH = 0
EXIT_DIFFERENCE = 1
EXIT_ERROR = 2
HEALTH_TIMEOUT_S = 5.0
# After a failed request: how long a dying engine may take to bring its server down.
DEATH_GRACE_S = 15.0
EXIT_WAIT_S = 10.0
WINDOW = 5  # ids shown on each side of a divergence
LOG_ERROR_LINES = 30
LOG_TAIL_LINES = 12
ENDPOINTS_FILE = "endpoints.tsv"
# Written once the case's request went to the servers serve.sh started (its start clears the
# state directory): sent again, D finds the prompt in its own prefix cache.
CASE_SENT_FILE = "case-sent"
# The scenario's earlier requests, sent first in name order (01-..., 02-...): `read_before`.
BEFORE_DIR = "before"
EXCEPTION_LINE = re.compile(r"\b\w*(?:Error|Exception): (?P<message>.+)$")
SERVER_ERROR_LINE = re.compile(r'HTTP/1\.1" 5\d\d')
# nanobind's report of what Triton's bindings leaked, printed as every vLLM process exits where
# Triton is installed: it filled a dead server's last lines (the harness's
# harness/serve/server_log.py NANOBIND_LEAK_LINE; this file imports nothing of the harness).
NANOBIND_LEAK_LINE = re.compile(
    r"^(nanobind: | +- leaked | +- \.\.\. skipped remainder|See https://nanobind\.readthedocs)"
)
# Straight to 127.0.0.1: an HTTP(S)_PROXY in the environment must not relay these requests.
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
# What a streamed answer must be served as (harness/outcomes/stream.py's EVENT_STREAM).
EVENT_STREAM = "text/event-stream"
# finish_reasons of an answer that did not finish, as the harness's harness/outcomes/chat.py
# `UNFINISHED` (vLLM: the request was aborted, or failed in the engine): an ERROR.
UNFINISHED = ("abort", "error")
# Where a failure of a stream whose framing broke showed, as the harness's failure signature
# names it (harness/run/fuzz/signature.py STREAM_FRAMING): `reproduction`.
STREAM_FRAMING = "stream framing"


@dataclass(frozen=True)
class Answer:
    """One HTTP exchange; `status` None means no HTTP answer (refused, reset, timed out).
    `content_type` is the answer's Content-Type header ('' when it had none), None when not
    known (no HTTP answer)."""

    url: str
    status: int | None
    text: str
    seconds: float
    content_type: str | None = None

    def headline(self) -> str:
        got = "no answer" if self.status is None else f"HTTP {self.status}"
        return f"POST {self.url} -> {got} after {self.seconds:.1f}s: {self.text[:600]}"


@dataclass(frozen=True)
class Instance:
    name: str
    role: str
    url: str
    pid: int | None
    log: str


def post_json(url: str, body: dict[str, Any], timeout_s: float) -> Answer:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    started = time.monotonic()
    content_type: str | None = None
    try:
        with DIRECT.open(request, timeout=timeout_s) as response:
            status, text = response.status, response.read().decode("utf-8", errors="replace")
            content_type = response.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        try:
            status, text = exc.code, exc.read().decode("utf-8", errors="replace")
        except (OSError, http.client.HTTPException) as cut:
            status, text = None, f"HTTP {exc.code}, then {type(cut).__name__}: {cut}"
    # Refused, reset, timed out; or cut off mid-body by a server that died while it answered
    # (IncompleteRead, no OSError: it ended check.py in a traceback, exit 1, "a difference").
    except (OSError, http.client.HTTPException) as exc:
        status, text = None, f"{type(exc).__name__}: {exc}"
    return Answer(url, status, text, time.monotonic() - started, content_type)


def healthy(url: str) -> bool:
    try:
        with DIRECT.open(f"{url}/health", timeout=HEALTH_TIMEOUT_S) as response:
            return response.status == 200
    # HTTPException: a port answered by something that speaks no HTTP (BadStatusLine)
    except (OSError, ValueError, http.client.HTTPException):
        return False


def process_alive(pid: int | None) -> bool | None:
    """None when unknown (no pid, or not ours to signal)."""
    if pid is None:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return None
    return True


def evidence(log_text: str) -> str:
    """A log cut to what says why: each exception message once (not the traceback frames that
    precede it), 5xx answers, then the log's last lines but nanobind's leak report."""
    lines = log_text.splitlines()
    picked: list[str] = []
    seen: set[str] = set()
    for line in lines:
        exception = EXCEPTION_LINE.search(line)
        if exception and "Traceback" not in line and exception["message"] not in seen:
            seen.add(exception["message"])
            picked.append(line)
        elif SERVER_ERROR_LINE.search(line):
            picked.append(line)
    picked = picked[:LOG_ERROR_LINES]
    kept = [line for line in lines if not NANOBIND_LEAK_LINE.match(line)]
    tail = [line for line in kept[-LOG_TAIL_LINES:] if line not in picked]
    if len(kept) < len(lines):
        tail.append(f"[{len(lines) - len(kept)} lines of nanobind's leak report at exit left out]")
    return "\n".join(picked + (["..."] if picked and tail else []) + tail)


def down_report(instance: Instance, state_dir: Path) -> str | None:
    """Why `instance` no longer serves (None: it does), with its log's evidence. A server
    whose engine died answers no /health while its API server shuts down: give it EXIT_WAIT_S
    to exit, and serve.sh a moment to note its exit code."""
    if healthy(instance.url):
        return None
    exit_file = state_dir / f"{instance.name}.exit"
    deadline = time.monotonic() + EXIT_WAIT_S
    while not exit_file.is_file() and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = process_alive(instance.pid)
    if exit_file.is_file():
        state = f"exited with code {exit_file.read_text().strip()}"
    elif alive is False:
        state = "exited"
    else:
        state = "is running but its /health does not answer 200"
    try:
        log_text = Path(instance.log).read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        log_text = f"(its log {instance.log} cannot be read: {exc})"
    return (
        f"{instance.name} ({instance.role}, {instance.url}) {state}; evidence from "
        f"{instance.log}:\n{indent(evidence(log_text))}"
    )


def dead_instances(instances: list[Instance], state_dir: Path, grace_s: float) -> list[str]:
    """Reports of the instances that are down, giving a dying one `grace_s` to go down."""
    deadline = time.monotonic() + grace_s
    while True:
        reports = [r for r in (down_report(i, state_dir) for i in instances) if r]
        if reports or time.monotonic() >= deadline:
            return reports
        time.sleep(0.5)


def indent(text: str) -> str:
    return "\n".join(f"    {line}" for line in text.splitlines())


def first_difference(expected: list[int], got: list[int]) -> int | None:
    """The first position where the sequences differ (a length difference counts), or None."""
    for index, (want, have) in enumerate(zip(expected, got)):
        if want != have:
            return index
    if len(expected) != len(got):
        return min(len(expected), len(got))
    return None


def window(ids: list[int], index: int) -> str:
    start = max(0, index - WINDOW)
    shown = [
        f"[{t}]" if start + i == index else str(t)
        for i, t in enumerate(ids[start : index + WINDOW + 1])
    ]
    return f"{'... ' if start else ''}{' '.join(shown)}"


def logprob_entry(response: dict[str, Any], index: int) -> dict[str, Any]:
    """The answer's log-prob entry at generated position `index`, only if it is the entry of
    the id generated there (as the harness's `_logprob_at` and `_top_at`): log-probs
    misaligned with the ids (a batched answer handed another request's) are no evidence of
    closeness, and read as if they were they made any flipped near tie DRIFT. KeyError when
    it is another token's, as when there is none."""
    choice = response["choices"][0]
    entry = choice["logprobs"]["content"][index]
    if str(entry["token"]) != f"token_id:{int(choice['token_ids'][index])}":
        raise KeyError(f"the log-prob entry at {index} is another token's")
    return entry


def top_logprobs(response: dict[str, Any], index: int) -> list[tuple[int, float]] | None:
    """The answer's top-k (token id, log-prob) at generated position `index` (`logprob_entry`)."""
    try:
        entry = logprob_entry(response, index)
        return [
            (int(str(t["token"]).split(":", 1)[1]), float(t["logprob"]))
            for t in entry["top_logprobs"]
        ]
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def format_top(top: list[Any] | None) -> str:
    if not top:
        return "(not recorded)"
    return ", ".join(f"{int(t)}: {float(lp):.3f}" for t, lp in top)


def describe_difference(
    what: str, expected: list[int], got: list[int], index: int, tops: tuple[Any, Any] = (None, None)
) -> str:
    want = expected[index] if index < len(expected) else "(ended)"
    have = got[index] if index < len(got) else "(ended)"
    lines = [
        f"{what} token ids differ at position {index} of {len(expected)} expected "
        f"({len(got)} received): expected {want}, got {have}",
        f"  expected: {window(expected, index)}",
        f"  received: {window(got, index)}",
    ]
    if tops != (None, None):
        lines.append(f"  expected top-k there: {format_top(tops[0])}")
        lines.append(f"  received top-k there: {format_top(tops[1])}")
    return "\n".join(lines)


# Why a stream with broken framing is no drift, as harness/judge/compare.py says it.
FRAMING_BROKEN = (
    "no (not applicable: the stream framing is broken, so its ids are no answer a client "
    "could read)"
)


def compare_tokens(
    expected: dict[str, Any], response: dict[str, Any], broken: bool = False
) -> tuple[str, str | None]:
    """("MATCH", None) when prompt and generated ids equal the expected ones, else the verdict
    ("MISMATCH", or "DRIFT": `drift`) and the first divergence; `broken`: the ids came in a
    stream whose framing is broken, so no difference is drift. An answer without ids is no
    answer to compare ("ERROR"), as the harness's parse_chat_response fails it."""
    try:
        prompt_ids = response["prompt_token_ids"]
        token_ids = response["choices"][0]["token_ids"]
    except (KeyError, IndexError, TypeError):
        prompt_ids = token_ids = None
    if prompt_ids is None or token_ids is None:
        return "ERROR", "the answer carries no token ids (was return_token_ids honoured?)"
    try:  # as the harness's integer_ids: 7.0 (or true) would equal id 7 (or 1)
        prompt_ids = integers(prompt_ids, "prompt_token_ids")
        token_ids = integers(token_ids, "choices[0].token_ids")
    except Unreadable as exc:
        return "ERROR", f"the answer's {exc}"
    finish = response["choices"][0].get("finish_reason")
    if finish in UNFINISHED:  # its ids are as short as the abort or the error made them
        return "ERROR", f"the answer did not finish: finish_reason {json.dumps(finish)}"
    index = first_difference(expected["prompt_token_ids"], prompt_ids)
    if index is not None:
        return "MISMATCH", describe_difference(
            "prompt", expected["prompt_token_ids"], prompt_ids, index
        ) + ("\n  (the prompts differ: the media placeholders were sized differently)")
    index = first_difference(expected["token_ids"], token_ids)
    if index is None:
        return "MATCH", None
    expected_top = (expected.get("top_logprobs") or [])[index : index + 1]
    tops = (expected_top[0] if expected_top else None, top_logprobs(response, index))
    detail = describe_difference("generated", expected["token_ids"], token_ids, index, tops)
    noise = FRAMING_BROKEN if broken else drift(expected, response, token_ids, index, tops)
    return ("DRIFT" if noise.startswith("yes") else "MISMATCH"), f"{detail}\n  drift: {noise}"


def gap(top: list[Any] | None, own: int | None, other: int | None) -> float | None:
    """log p(own) - log p(other) from one side's top-k; None if either is not in it."""
    logprobs = {int(t): float(lp) for t, lp in top or []}
    if own is None or other is None or own not in logprobs or other not in logprobs:
        return None
    return logprobs[own] - logprobs[other]


def chosen_logprob(response: dict[str, Any], index: int) -> float | None:
    """The generated id's log-prob at position `index` (`logprob_entry`), None without one."""
    try:
        return float(logprob_entry(response, index)["logprob"])
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def drift(
    expected: dict[str, Any],
    response: dict[str, Any],
    got: list[int],
    index: int,
    tops: tuple[Any, Any],
) -> str:
    """'yes (...)' when the difference at `index` is numeric noise by the harness's rule (the
    module docstring), else 'no (why)'."""
    floor = float(expected.get("noise_floor_nats") or 0.0)
    ids = expected["token_ids"]
    want = ids[index] if index < len(ids) else None
    have = got[index] if index < len(got) else None
    gaps = (gap(tops[0], want, have), gap(tops[1], have, want))
    # Each of the two tokens at the same log-prob on both sides, within the floor (as the
    # harness's `_divergence_delta`): a near tie moved far from where the other side put it
    # is no noise.
    sides = [{int(t): float(lp) for t, lp in top or []} for top in tops]
    moves = [
        abs(sides[0][t] - sides[1][t]) if all(t in side for side in sides) else None
        for t in (want, have)
    ]
    at = max(moves) if all(m is not None and math.isfinite(m) for m in moves) else None
    recorded = expected.get("token_logprobs") or []
    deltas = []
    for position in range(index):
        mine = chosen_logprob(response, position)
        theirs = recorded[position] if position < len(recorded) else None
        delta = None if mine is None or theirs is None else abs(mine - float(theirs))
        # Not finite (a NaN, -inf on both sides): no agreement, which `max` would take a NaN
        # after a finite delta for (as the harness's `_prefix_delta`).
        deltas.append(delta if delta is not None and math.isfinite(delta) else None)
    prefix = None if None in deltas else max(deltas, default=0.0)
    shown = ", ".join(
        f"{side} gap {'n/a' if g is None else f'{g:.3f}'}"
        for side, g in zip(("expected", "received"), gaps)
    )
    shown += f", log-prob delta at the divergence {'n/a' if at is None else f'{at:.3f}'}"
    shown += f", prefix log-prob delta {'n/a' if prefix is None else f'{prefix:.3f}'}"
    where = f"the run's noise floor {floor:g} nats"
    if floor <= 0:
        return f"no ({shown}; {where}: no room for drift)"
    near = all(g is not None and math.isfinite(g) and abs(g) <= floor for g in gaps)
    if near and at is not None and at <= floor and prefix is not None and prefix <= floor:
        return f"yes, a near-tie within {where} after an agreeing prefix ({shown})"
    return f"no ({shown}; {where})"


class Unreadable(Exception):
    """A field of a streamed chunk has another shape than vLLM sends; the message says which."""


def shown(value: Any) -> str:
    return json.dumps(value)[:120]


def an_object(value: Any, where: str) -> dict[str, Any]:
    """An optional object field: {} when absent (null)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise Unreadable(f"{where} is {shown(value)}, not an object")
    return value


def integers(value: Any, where: str) -> list[int]:
    """Token ids: a list of integers (a boolean is none: True would equal id 1)."""
    if not isinstance(value, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in value
    ):
        raise Unreadable(f"{where} is {shown(value)}, not a list of integers")
    return value


def readable_logprob(entry: Any) -> bool:
    """A log-prob entry of `token_id:N` tokens, as top_logprobs and chosen_logprob read it."""
    try:
        for item in (entry, *(entry.get("top_logprobs") or [])):
            prefix, _, number = str(item["token"]).partition(":")
            if prefix != "token_id" or not number.lstrip("-").isdigit():
                return False
            float(item["logprob"])
    except (AttributeError, KeyError, TypeError, ValueError):
        return False
    return True


def read_choice(choice: Any, where: str) -> tuple[list[int], list[Any], str | None]:
    """One streamed choice's generated ids, log-prob entries and finish_reason, or Unreadable
    naming its first
    field of another shape (as the harness's harness/outcomes/stream.py reads a chunk)."""
    if not isinstance(choice, dict):
        raise Unreadable(f"{where} is {shown(choice)}, not an object")
    index = choice.get("index", 0)  # vLLM streams the one choice asked for as index 0
    if index != 0 or isinstance(index, bool):
        raise Unreadable(
            f"{where}.index is {shown(index)}, not 0 (one choice was asked): another "
            "completion's chunk"
        )
    content = an_object(choice.get("delta"), f"{where}.delta").get("content")
    if content is not None and not isinstance(content, str):
        raise Unreadable(f"{where}.delta.content is {shown(content)}, not a string")
    ids = choice.get("token_ids")
    token_ids = [] if ids is None else integers(ids, f"{where}.token_ids")
    entries = an_object(choice.get("logprobs"), f"{where}.logprobs").get("content")
    if entries is not None and not isinstance(entries, list):
        raise Unreadable(f"{where}.logprobs.content is {shown(entries)}, not a list")
    for n, entry in enumerate(entries or []):
        if not readable_logprob(entry):
            raise Unreadable(
                f"{where}.logprobs.content[{n}] is {shown(entry)}, not a log-prob entry of "
                "token_id:N tokens"
            )
    finish = choice.get("finish_reason")
    if finish is not None and not isinstance(finish, str):
        raise Unreadable(f"{where}.finish_reason is {shown(finish)}, not a string")
    return token_ids, entries or [], finish


def event_data(text: str) -> list[str]:
    """Each event's data, as an SSE client reads it and the harness does: events end with a
    blank line, and an event's `data:` lines are one datum joined by newlines (two chunks
    sent in one event do not parse; read line by line they passed as two). Comment-only
    events carry none."""
    found = []
    for event in text.replace("\r\n", "\n").split("\n\n"):
        data = [line[5:].removeprefix(" ") for line in event.split("\n") if line[:5] == "data:"]
        if data:
            found.append("\n".join(data))
    return found


def read_stream(text: str) -> tuple[dict[str, Any] | None, str | None]:
    """A streamed answer (`stream: true` in request.json, as the run sent it) read into the
    shape of an unstreamed one: the first chunk's `prompt_token_ids`, every chunk's generated
    `token_ids` and log-probs in order. (None, why) for a stream that reported an error, or
    whose prompt ids cannot be read or are not there (an ERROR); (answer, why) for one whose
    framing is broken (a MISMATCH: a client would wait or fail): `[DONE]` not last, a chunk
    of another shape than vLLM sends (a null choice, ids that are not integers, other than
    one choice, a choice index other than 0), which is named by its event and not read, as the
    harness's reader does, log-probs not of a chunk's ids, other than one finish_reason, no usage
    chunk or one counting other ids or another prompt, a chunk after the usage chunk or a second
    one, a chunk after the finish_reason, chunks of several completions (`id`s), a cached_tokens
    that is no integer, prompt ids or the role on another chunk than the first, other than
    one role chunk, a last event without its blank line; (answer, None) for a whole one."""
    prompt_ids: list[int] | None = None
    token_ids: list[int] = []
    content: list[Any] = []
    finish_reason: str | None = None
    finishes = 0  # chunks that carried a finish_reason
    roles = 0  # chunks whose delta carried a role
    completions: list[str] = []  # the chunks' distinct `id`s: one completion's, in vLLM
    prompt_counted: Any = None  # the usage chunk's prompt_tokens
    counted: list[Any] = []  # the usage chunks' completion_tokens
    usage: dict[str, Any] = {}  # the last usage chunk
    objects = 0  # events read as JSON objects: chunks
    problems: list[str] = []
    done = False
    event = 0
    for data in event_data(text):
        event += 1
        data = data.strip()
        # Framing problems of a stream that carried its answer, as the harness keeps them
        # (harness/outcomes/stream.py): a MISMATCH, not the ERROR of a stream without one.
        if done:
            problems.append(f"an event after [DONE]: {data[:200]}")
            continue
        if data == "[DONE]":
            done = True
            continue
        try:
            chunk = json.loads(data)
        except ValueError:
            problems.append(f"event {event} is not JSON: {data[:200]}")
            continue
        if not isinstance(chunk, dict):
            problems.append(f"event {event} is not a JSON object: {data[:200]}")
            continue
        if "error" in chunk:
            return None, f"the stream reported an error: {json.dumps(chunk['error'])[:600]}"
        objects += 1
        if isinstance(chunk.get("id"), str) and chunk["id"] not in completions:
            completions.append(chunk["id"])
        try:
            if chunk.get("prompt_token_ids") is not None:
                if prompt_ids is not None:
                    problems.append(f"event {event} carries prompt_token_ids again")
                elif objects != 1:  # vLLM sends them on the first chunk alone
                    problems.append(f"event {event} carries prompt_token_ids, not the first chunk")
            if chunk.get("prompt_token_ids") is not None and prompt_ids is None:
                try:
                    prompt_ids = integers(chunk["prompt_token_ids"], "prompt_token_ids")
                except Unreadable as exc:
                    return (
                        None,
                        f"the stream's prompt_token_ids are unreadable: event {event}: {exc}",
                    )
            choices = chunk.get("choices")
            if choices is not None and not isinstance(choices, list):
                raise Unreadable(f"choices is {shown(choices)}, not a list")
            if isinstance(chunk.get("usage"), dict) and not choices:
                if counted:
                    problems.append(f"event {event} is a second usage chunk")
                counted.append(chunk["usage"].get("completion_tokens"))
                prompt_counted = chunk["usage"].get("prompt_tokens")
                usage = chunk["usage"]
                problems += usage_shape_problems(event, chunk["usage"])
                continue
            if counted:  # vLLM sends the usage chunk last, just before [DONE]
                problems.append(f"event {event} comes after the usage chunk")
            if len(choices or []) != 1:
                problems.append(f"event {event} has {len(choices or [])} choices (one expected)")
                continue
            ids, entries, finish = read_choice(choices[0], "choices[0]")
        except Unreadable as exc:
            problems.append(f"event {event}: {exc} (its chunk is not read)")
            continue
        if (choices[0].get("delta") or {}).get("role") is not None:
            roles += 1
            if objects != 1:  # vLLM sends the role once, on the first chunk
                problems.append(f"event {event} carries the role, not the first chunk")
        if finishes:  # vLLM ends a choice's chunks with its finish_reason
            problems.append(f"event {event} comes after finish_reason")
        problems += chunk_log_prob_problems(event, ids, entries)
        token_ids += ids
        content += entries
        finishes += finish is not None
        finish_reason = finish or finish_reason
    if prompt_ids is None:  # as the harness's StreamFailed: no prompt ids, no answer
        return None, "the stream carried no prompt_token_ids: was return_token_ids honoured?"
    answer: dict[str, Any] = {
        "prompt_token_ids": prompt_ids,
        "choices": [
            {
                "token_ids": token_ids,
                "logprobs": {"content": content},
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage,  # the last usage chunk's: the KV guard's cached_tokens
    }
    if not done:
        problems.append("the stream ended without [DONE]")
    if roles != 1:
        problems.append(f"{roles} role chunks (one expected)")
    if len(completions) > 1:
        problems.append(f"chunks of {len(completions)} completions: {completions[:4]}")
    if counted and prompt_counted != len(prompt_ids):
        problems.append(
            f"usage counts {prompt_counted} prompt tokens, the stream's prompt_token_ids "
            f"{len(prompt_ids)}"
        )
    unterminated = text.replace("\r\n", "\n").split("\n\n")[-1]
    if any(line.startswith("data:") for line in unterminated.split("\n")):
        problems.append(
            "the stream's last event ends without the blank line that ends an event (an SSE "
            "client drops it)"
        )
    if finishes != 1:
        problems.append(f"{finishes} finish_reason(s) (one expected)")
    if not counted:
        problems.append("no usage chunk (stream_options.include_usage was asked)")
    elif counted[-1] != len(token_ids):
        problems.append(
            f"usage counts {counted[-1]} completion tokens, the stream carried "
            f"{len(token_ids)} token ids"
        )
    return answer, "; ".join(problems) or None


def usage_shape_problems(event: int, usage: dict[str, Any]) -> list[str]:
    """The usage chunk's cached_tokens must be an integer, as the harness's stream reader
    requires (the KV guard's evidence)."""
    problem = cached_tokens_problem(usage)
    return [f"event {event}: {problem}"] if problem else []


def cached_tokens_in(usage: dict[str, Any]) -> Any:
    """D's `cached_tokens` in an answer's usage, as it is there; None where it is not."""
    details = usage.get("prompt_tokens_details")
    return details.get("cached_tokens") if isinstance(details, dict) else None


def cached_tokens_problem(usage: dict[str, Any]) -> str | None:
    """What makes a usage's cached_tokens of another shape than vLLM's, or None."""
    details = usage.get("prompt_tokens_details")
    if details is not None and not isinstance(details, dict):
        return f"usage.prompt_tokens_details is {shown(details)}, not an object"
    cached = cached_tokens_in(usage)
    if cached is not None and (not isinstance(cached, int) or isinstance(cached, bool)):
        return f"usage.prompt_tokens_details.cached_tokens is {shown(cached)}, not an integer"
    return None


def chunk_log_prob_problems(event: int, ids: list[int], entries: list[Any]) -> list[str]:
    """A streamed chunk's log-probs must be one entry per id it carried, each of that id (as
    the harness's stream reader requires; the drift rule reads them at a divergence)."""
    if len(entries) != len(ids):
        return [f"event {event}: {len(ids)} token id(s) but {len(entries)} log-prob entries"]
    for index, (entry, token_id) in enumerate(zip(entries, ids)):
        if str(entry["token"]) != f"token_id:{token_id}":
            token = str(entry["token"]).partition(":")[2]
            return [
                f"event {event}: log-prob entry {index} is of token {token}, its id is {token_id}"
            ]
    return []


@dataclass(frozen=True)
class Endpoints:
    mode: str  # "case", or "baseline": the monolithic reference serves the request
    entry: str
    instances: list[Instance]


def read_endpoints(state_dir: Path) -> Endpoints:
    """serve.sh's endpoints.tsv: `mode M`, `entry URL`, then `instance NAME ROLE URL PID LOG`."""
    mode, entry, instances = "case", "", []
    for line in (state_dir / ENDPOINTS_FILE).read_text(encoding="utf-8").splitlines():
        fields = line.split("\t")
        if fields[0] in ("mode", "entry") and len(fields) == 2:
            mode, entry = (fields[1], entry) if fields[0] == "mode" else (mode, fields[1])
        elif fields[0] == "instance" and len(fields) == 6:
            name, role, url, pid, log = fields[1:]
            instances.append(Instance(name, role, url, int(pid) if pid.isdigit() else None, log))
    if not entry or not instances:
        raise ValueError(f"{state_dir / ENDPOINTS_FILE} names no entry or no instance")
    return Endpoints(mode, entry, instances)


@dataclass(frozen=True)
class Judgment:
    """One answer judged: the verdict, check.py's exit code, the evidence, and the answer read
    (None where it could not be: an error, a probe)."""

    verdict: str
    code: int
    detail: str
    response: dict[str, Any] | None = None
    broken: str | None = None  # what was wrong with a streamed answer's framing
    died: tuple[str, ...] = ()  # the instances that died during the request, by name


def judgment(
    expected: dict[str, Any],
    answer: Answer,
    instances: list[Instance],
    state_dir: Path,
    streamed: bool = False,
    kv_guard: dict[str, Any] | None = None,
) -> Judgment:
    """(verdict, exit code, evidence) for one answer (`streamed`: server-sent events), the
    instances checked afterwards, the KV guard judged where `kv_guard` is expected.json's
    (`guarded`); with the answer read, which `--save-reference` stores and `--reference`
    compares a second time (with the recorded ids)."""
    grace = DEATH_GRACE_S if answer.status != 200 else 0.0
    dead = dead_instances(instances, state_dir, grace)
    if dead:
        cause = f"{answer.headline()}\n" + "\n".join(dead)
        died = tuple(r.split(" ", 1)[0] for r in dead)
        detail = f"{', '.join(died)} died during the request\n{cause}"
        return Judgment("ERROR", EXIT_ERROR, detail, died=died)
    if expected["check"] == "refused-and-alive":
        target = expected["send_to"]
        if answer.status is not None and 400 <= answer.status < 500:
            return Judgment(
                "MATCH",
                EXIT_MATCH,
                f"{target} refused the request and keeps serving: {answer.headline()}",
            )
        if answer.status == 200:
            return Judgment(
                "MISMATCH",
                EXIT_DIFFERENCE,
                f"{target} answered a request it cannot serve: {answer.headline()}",
            )
        return Judgment("ERROR", EXIT_ERROR, answer.headline())
    if answer.status != 200:
        return Judgment("ERROR", EXIT_ERROR, answer.headline())
    broken = None
    if streamed:
        response, broken = read_stream(answer.text)
        if response is None:
            return Judgment("ERROR", EXIT_ERROR, f"{broken}; {answer.headline()}")
        if answer.content_type is not None and EVENT_STREAM not in answer.content_type:
            # As the harness's harness/outcomes/stream.py: an event-stream client refuses
            # another content type, whatever the events hold (vLLM's toy P/D proxy streams as
            # application/json; found in review: its export's run.sh said MATCH).
            served = f"served as {answer.content_type or 'no content-type'}, not {EVENT_STREAM}"
            broken = "; ".join(filter(None, (served, broken)))
    else:
        try:
            response = json.loads(answer.text)
        except ValueError:
            return Judgment("ERROR", EXIT_ERROR, f"the answer is not JSON: {answer.text[:300]}")
        refused = unstreamed_refusal(response)
        if refused is not None:
            return Judgment("ERROR", EXIT_ERROR, f"{refused}; {answer.headline()}")
    verdict, code, detail = tokens_verdict(expected, response, broken)
    if kv_guard is not None:
        verdict, code, detail = guarded(kv_guard, expected, response, verdict, code, detail)
    return Judgment(verdict, code, detail, response, broken)


def guarded(
    guard: dict[str, Any],
    expected: dict[str, Any],
    response: dict[str, Any],
    verdict: str,
    code: int,
    detail: str,
) -> tuple[str, int, str]:
    """The harness's VACUOUS: ids equal (or a DRIFT the policy passes), and yet D says in its
    answer's usage that it loaded less of the prompt's KV than the connector moves (its
    harness/judge/guards.py check_kv_transfer, ExampleConnector's block-aligned prefix rule):
    D computed the prompt itself and the match proves nothing about the transfer."""
    if code != EXIT_MATCH:
        return verdict, code, detail
    cached = cached_tokens_in(response.get("usage") or {})
    minimum = guard["min_cached_tokens"]
    said = (
        f"D cached_tokens={cached} (the answer's usage), expected >= {minimum} by the "
        f"{guard['rule']} rule (prompt {len(expected['prompt_token_ids'])} tokens, block "
        f"{guard['block_size']})"
    )
    if isinstance(cached, int) and not isinstance(cached, bool) and 0 < minimum <= cached:
        return verdict, code, f"{detail}; the KV guard held: {said}"
    return (
        "VACUOUS",
        EXIT_DIFFERENCE,
        f"tokens equal but the KV guard failed: {said}: D did not load the KV P stored",
    )


def unstreamed_refusal(response: Any) -> str | None:
    """Why the harness refuses this unstreamed answer as broken, where its ids alone would be
    judged (its harness/outcomes/chat.py parse_chat_response: an ERROR), or None: several
    choices (one would be judged for all), no finish_reason (vLLM always ends an answer with
    one), log-probs that are not one per generated id, each of that id, or a usage that
    counts other ids than the answer's or none (vLLM always counts them). What
    compare_tokens reads (the ids) it judges."""
    try:
        choices = response["choices"]
        choice = choices[0]
        token_ids = integers(choice["token_ids"], "choices[0].token_ids")
    except (KeyError, IndexError, TypeError, Unreadable):
        return None  # compare_tokens says what is wrong with the ids
    if not isinstance(choice, dict):
        return None
    if len(choices) != 1:
        return f"the answer has {len(choices)} choices (one expected)"
    if "finish_reason" not in choice or choice["finish_reason"] is None:
        return "the answer did not finish: finish_reason null (none given)"
    entries = (choice.get("logprobs") or {}).get("content") or []
    if entries and len(entries) != len(token_ids):
        return (
            f"the answer's log-probs are not of its ids: {len(token_ids)} token ids, "
            f"{len(entries)} log-prob entries"
        )
    for index, (entry, token_id) in enumerate(zip(entries, token_ids)):
        if isinstance(entry, dict) and entry.get("token") and not readable_logprob(entry):
            return (
                f"the answer's choices[0].logprobs.content[{index}] is {shown(entry)}, not a "
                "log-prob entry of token_id:N tokens"
            )
        token = entry.get("token") if isinstance(entry, dict) else None
        if token != f"token_id:{token_id}":
            return (
                f"the answer's log-probs are not of its ids: entry {index} is of token "
                f"{str(token).removeprefix('token_id:')}, its position's id is {token_id}"
            )
    usage = response.get("usage")
    counted = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if counted is None:  # vLLM always counts them: ids lost on the way would go unseen
        return (
            "the answer's usage has no completion_tokens (vLLM always counts the generated "
            "ids there): its ids cannot be checked whole"
        )
    if counted != len(token_ids):
        return (
            f"the answer's usage counts {counted} completion tokens, its token_ids {len(token_ids)}"
        )
    return unstreamed_shape_refusal(choice, usage)


def unstreamed_shape_refusal(choice: dict[str, Any], usage: dict[str, Any]) -> str | None:
    """Why the harness refuses an unstreamed answer whose fields beside the ids have another
    shape than vLLM's (its parse_chat_response and cached_tokens: a message that is no
    object, a content or finish_reason that is no string, a cached_tokens count that is no
    integer), or None. Found in review: check.py judged the ids alone, a MATCH where the
    harness says ERROR."""
    message = choice.get("message")
    if message is not None and not isinstance(message, dict):
        return f"the answer's choices[0].message is {shown(message)}, not an object"
    for name, value in (
        ("message.content", (message or {}).get("content")),
        ("finish_reason", choice.get("finish_reason")),
    ):
        if value is not None and not isinstance(value, str):
            return f"the answer's choices[0].{name} is {shown(value)}, not a string"
    problem = cached_tokens_problem(usage)
    return f"the answer's {problem}" if problem else None


def tokens_verdict(
    expected: dict[str, Any], response: dict[str, Any], broken: str | None = None
) -> tuple[str, int, str]:
    """(verdict, exit code, evidence) of an answer's ids against `expected`'s, DRIFT passing
    or not as its policy says; `broken`: a streamed answer's framing was wrong (a MISMATCH)."""
    verdict, difference = compare_tokens(expected, response, broken is not None)
    if verdict == "ERROR":
        return "ERROR", EXIT_ERROR, "; ".join(filter(None, (difference, broken)))
    if broken is not None:
        return "MISMATCH", EXIT_DIFFERENCE, "; ".join(filter(None, (broken, difference)))
    if verdict == "DRIFT":
        passes = bool(expected.get("drift_passes"))
        policy = expected.get("policy") or "the run's"
        said = "passes" if passes else "does not pass"
        code = EXIT_MATCH if passes else EXIT_DIFFERENCE
        return "DRIFT", code, f"{difference}\n  (numeric noise; {policy} policy {said} it here)"
    if difference is not None:
        return "MISMATCH", EXIT_DIFFERENCE, difference
    generated = len(expected["token_ids"])
    prompt = len(expected["prompt_token_ids"])
    return (
        "MATCH",
        EXIT_MATCH,
        f"the {generated} generated and {prompt} prompt token ids equal the expected ones",
    )


def parting(expected: dict[str, Any], response: dict[str, Any]) -> tuple[str, int] | None:
    """Which ids of the answer part from `expected`'s, named as the harness names them (its
    failure signature's `ids_kind`: "prompt ids, same count", "prompt ids, another count",
    "generated ids"), and the first position where; None when none part or none are readable."""
    try:
        prompt_ids = integers(response["prompt_token_ids"], "prompt_token_ids")
        token_ids = integers(response["choices"][0]["token_ids"], "choices[0].token_ids")
    except (KeyError, IndexError, TypeError, Unreadable):
        return None
    index = first_difference(expected["prompt_token_ids"], prompt_ids)
    if index is not None:
        same = len(prompt_ids) == len(expected["prompt_token_ids"])
        return f"prompt ids, {'same count' if same else 'another count'}", index
    index = first_difference(expected["token_ids"], token_ids)
    return None if index is None else ("generated ids", index)


def reproduction(
    recorded: dict[str, Any],
    verdict: str,
    died: tuple[str, ...],
    parted: tuple[str, int] | None,
    broken: bool = False,
) -> str:
    """Whether the answer here reproduces the recorded failure, as `epd-harness repro` says it
    (its `another_failure` and `parted_elsewhere`): the same verdict showing elsewhere is
    another failure, NOT reproduced (another instance died; prompt ids parted where
    generated ids had; `broken`, a stream's framing broke, where ids had parted in a whole
    one, or the other way round); ids parting at another position are still the failure,
    reproduced, with the position said. The verdict alone said "reproduced" of all of them
    (found in review). What the recording holds of where (`died`, `ids`, `position`) is the
    exporter's; an export without it is judged on the verdict."""
    if recorded["verdict"] != verdict:
        unseen = recorded.get("unjudged_guards")
        if recorded["verdict"] == "VACUOUS" and unseen:
            return (
                f"NOT reproduced, and check.py cannot show it: the recorded VACUOUS rests on "
                f"{', '.join(unseen)}, which the harness read from the instances (its taps "
                "between them and the proxy, D's /metrics); check.py sees only the answer"
            )
        return "NOT reproduced"
    if verdict == "ERROR" and "died" in recorded:
        then = recorded["died"]
        if (then is None and died) or (then is not None and then not in died):
            now = ", ".join(died) or "no instance"
            return f"NOT reproduced ({now} died now, {then or 'no instance'} in the recording)"
    if verdict in ("MISMATCH", "DRIFT") and recorded.get("ids"):
        # A stream whose framing broke is that failure whatever its ids did, as the harness's
        # signature names it (its fuzz/signature.py STREAM_FRAMING).
        kind, index = parted or ("generated ids", None)
        kind = STREAM_FRAMING if broken else kind
        then = str(recorded["ids"])
        if kind != then and not (then == "prompt ids" and kind.startswith(then)):
            return f"NOT reproduced ({kind} now, {then} in the recording)"
        position = recorded.get("position")
        if index is not None and isinstance(position, int) and index != position:
            return (
                f"reproduced (the ids part at position {index} now, at position {position} "
                "in the recording)"
            )
    return "reproduced"


def read_before(here: Path) -> list[tuple[str, dict[str, Any]]]:
    """The earlier requests `before/*.json` beside check.py, in name order: (the file, relative
    to the export, its body). None there: []. ValueError naming a file that holds no JSON
    object."""
    directory = here / BEFORE_DIR
    if not directory.is_dir():
        return []
    bodies = []
    for path in sorted(directory.glob("*.json")):
        body = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(body, dict):
            raise ValueError(f"{path} holds no JSON object (a request body)")
        bodies.append((f"{BEFORE_DIR}/{path.name}", body))
    return bodies


def unanswered(answer: Answer, streamed: bool) -> str | None:
    """Why an earlier request got no answer a client could read (None: it got one): an HTTP
    error, no answer at all, an unstreamed answer that is not JSON, a stream that reported an
    error or whose prompt ids are unreadable. What the answer says is not judged."""
    if answer.status != 200:
        return answer.headline()
    if streamed:
        response, problem = read_stream(answer.text)
        return None if response is not None else f"{problem}; {answer.headline()}"
    try:
        json.loads(answer.text)
    except ValueError:
        return f"the answer is not JSON: {answer.headline()}"
    return None


def send_before(
    before: list[tuple[str, dict[str, Any]]],
    url: str,
    timeout_s: float,
    instances: list[Instance],
    state_dir: Path,
) -> str | None:
    """Send the earlier requests to `url` in order, printing one line each; None when every
    one was answered, else why the stage is not set (the instances that died named, with
    their logs' evidence), after which nothing more is sent."""
    for number, (name, body) in enumerate(before, start=1):
        answer = post_json(url, body, timeout_s)
        why = unanswered(answer, bool(body.get("stream")))
        said = f"check.py: before {number}/{len(before)}: {name}"
        if why is None:
            print(f"{said}: HTTP 200 after {answer.seconds:.1f}s, answered (sets the stage)")
            continue
        print(f"{said}: no answer: {why}")
        dead = dead_instances(instances, state_dir, DEATH_GRACE_S)
        return "\n".join(
            [
                f"the stage was not set: {name} got no answer, so request.json was not sent",
                *dead,
            ]
        )
    return None


REFERENCE_FIELDS = ("prompt_token_ids", "token_ids", "top_logprobs", "token_logprobs")


def request_digest(body: dict[str, Any]) -> str:
    """Which request an answer is to: the sha256 of request.json's body (keys sorted), so
    the same body digests alike however its file is laid out."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def reference_answer(
    response: dict[str, Any], name: str, body: dict[str, Any]
) -> dict[str, Any] | None:
    """What `--save-reference` keeps of the reference's answer to `body`: its ids and
    log-probs in expected.json's shape, and which request it answers (`request_sha256`:
    the reference's name alone would let another case's answer, or an answer to this case's
    prompt with other sampling, be judged against); None for an answer without ids."""
    try:  # integers as compare_tokens reads them: int() made a float id 7.9 the id 7
        prompt_ids = integers(response["prompt_token_ids"], "prompt_token_ids")
        token_ids = integers(response["choices"][0]["token_ids"], "choices[0].token_ids")
    except (KeyError, IndexError, TypeError, Unreadable):
        return None
    return {
        "reference": name,
        "request_sha256": request_digest(body),
        "prompt_token_ids": prompt_ids,
        "token_ids": token_ids,
        "top_logprobs": [top_logprobs(response, i) for i in range(len(token_ids))],
        "token_logprobs": [chosen_logprob(response, i) for i in range(len(token_ids))],
    }


def read_reference(path: Path, expected: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """expected.json with the ids and log-probs of the reference answer `path` holds (its
    policy, noise floor and what it judges kept): what `--reference` judges the case by.
    The answer must be the case's reference's, to this request (`body`). ValueError naming
    what is wrong."""
    saved = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(saved, dict) or any(
        not isinstance(saved.get(key), list) for key in REFERENCE_FIELDS
    ):
        raise ValueError(f"{path} holds no reference answer ({', '.join(REFERENCE_FIELDS)})")
    if saved.get("reference") != expected.get("reference"):
        raise ValueError(
            f"{path} is {saved.get('reference')!r}'s answer, the case's reference is "
            f"{expected.get('reference')!r}"
        )
    if saved.get("request_sha256") != request_digest(body):
        raise ValueError(
            f"{path} answers another request than this export's request.json (another "
            "case's or export's, or made before request.json changed); `bash run.sh "
            "reference` serves this one's reference and keeps its answer"
        )
    return {**expected, **{key: saved[key] for key in REFERENCE_FIELDS}}


def read_expected(path: Path) -> dict[str, Any]:
    """expected.json, its `noise_floor_nats` (absent: 0) a floor the run measured: a finite
    number of nats, 0 or more. It is the drift rule's tolerance, so any other value (an
    Infinity, which Python's json reads, made every near tie DRIFT) is ValueError naming the
    field and the file, as the harness's baseline cache refuses such a floor."""
    expected = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(expected, dict):
        raise ValueError(f"{path} holds no JSON object")
    if "noise_floor_nats" in expected:
        floor = expected["noise_floor_nats"]
        if (
            not isinstance(floor, (int, float))
            or isinstance(floor, bool)
            or not math.isfinite(floor)
            or floor < 0
        ):
            raise ValueError(
                f"{path}: noise_floor_nats is {json.dumps(floor)}, not a measured noise floor "
                "(a finite number of nats, 0 or more)"
            )
    return expected


def reference_name(expected: dict[str, Any]) -> str:
    reference = expected.get("reference") or "the reference"
    return "the monolithic baseline" if reference == "baseline" else str(reference)


def main(argv: list[str] | None = None) -> int:
    here = Path(__file__).resolve().parent
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    work = Path(os.environ.get("WORK") or here / "work")
    parser.add_argument(
        "--state", type=Path, default=work / "state", help="serve.sh's state directory"
    )
    keep = parser.add_mutually_exclusive_group()
    keep.add_argument(
        "--save-reference",
        type=Path,
        metavar="FILE",
        help="(serve.sh reference serving) keep the reference's answer in FILE",
    )
    keep.add_argument(
        "--reference",
        type=Path,
        metavar="FILE",
        help="(serve.sh serving the case) judge the case against the answer FILE holds",
    )
    args = parser.parse_args(argv)
    try:
        body = json.loads((here / "request.json").read_text(encoding="utf-8"))
        expected = read_expected(here / "expected.json")
        before = read_before(here)
    except (OSError, ValueError) as exc:
        print(f"check.py: error: cannot run: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if (args.save_reference or args.reference) and expected.get("check") != "tokens":
        # Said before serve.sh's state is read, which would send the user to start it first.
        print(
            "check.py: error: this export checks no token ids: it has no reference to keep "
            "or judge against; drop --save-reference / --reference",
            file=sys.stderr,
        )
        return EXIT_ERROR
    try:
        endpoints = read_endpoints(args.state)
        serving_reference = endpoints.mode in ("reference", "baseline")
        if args.save_reference and not serving_reference:
            raise ValueError("--save-reference: serve.sh serves the case, not the reference")
        if args.reference and serving_reference:
            raise ValueError("--reference: serve.sh serves the reference, not the case")
        fresh = read_reference(args.reference, expected, body) if args.reference else None
    except (OSError, ValueError, KeyError) as exc:
        print(f"check.py: error: cannot run: {exc} (is serve.sh serving?)", file=sys.stderr)
        return EXIT_ERROR
    target = endpoints.entry
    if expected.get("send_to"):
        named = [i.url for i in endpoints.instances if i.name == expected["send_to"]]
        if not named:
            print(f"check.py: error: {expected['send_to']!r} is not serving", file=sys.stderr)
            return EXIT_ERROR
        target = named[0]
    url = f"{target}/v1/chat/completions"
    reference = reference_name(expected)
    timeout_s = float(expected.get("timeout_s", 600))
    recorded = expected.get("recorded") or {}
    print(f"check.py: {expected['what']}")
    if serving_reference:
        print(f"check.py: sent to {reference}, served here: do the expected ids hold here?")
        if before:  # the run's baseline answered the request cold, alone
            print(
                f"check.py: request.json alone, as the run's baseline answered it (the "
                f"requests in {BEFORE_DIR}/ set the case's stage only)"
            )
    elif before:
        print(f"check.py: first what the run sent these servers before the case ({BEFORE_DIR}/)")
        unset = send_before(before, url, timeout_s, endpoints.instances, args.state)
        if unset is not None:
            print(f"ERROR: {unset}")
            if recorded.get("verdict"):
                source = recorded.get("source", "the harness")
                print(
                    f"check.py: {source} recorded {recorded['verdict']}: NOT reproduced (the "
                    "stage was not set, the case's request not sent)"
                )
            return EXIT_ERROR
    print(f"check.py: POST {url}")
    # The KV guard is the case's (P->D); the reference served alone moves no KV.
    kv_guard = None if serving_reference else expected.get("kv_transfer")
    sent_before = args.state / CASE_SENT_FILE
    if kv_guard is not None and sent_before.exists():
        # request.json keeps its cache_salt, so D counts its own prefix-cache hit in
        # cached_tokens: the guard would hold whatever P moved (found in review).
        print(
            "check.py: the KV guard is not judged: these servers answered request.json "
            "before, and D counts what its own prefix cache holds of the prompt (the "
            "harness's guard is not checkable then); start serve.sh again to judge it"
        )
        kv_guard = None
    answer = post_json(url, body, timeout_s)
    if not serving_reference:
        sent_before.touch()
    streamed = bool(body.get("stream"))
    judged = judgment(
        fresh or expected, answer, endpoints.instances, args.state, streamed, kv_guard
    )
    verdict, code = judged.verdict, judged.code
    against = f"against {reference}'s answer produced here: " if fresh else ""
    print(f"{against}{verdict}: {judged.detail}")
    if fresh is not None and judged.response is not None:
        own, _, detail = tokens_verdict(expected, judged.response, judged.broken)
        print(f"against the recorded ids of {reference}: {own}: {detail}")
    if serving_reference:
        holds = "hold" if code == EXIT_MATCH else "do NOT hold"
        where = "monolithic vLLM" if expected.get("reference") == "baseline" else reference
        print(f"check.py: the expected ids {holds} on this machine's {where}")
        if args.save_reference:
            # An ERROR (an answer that did not finish, broken ids) is no reference answer:
            # kept, `--reference` judged the case against it (found in review).
            kept = (
                verdict != "ERROR"
                and judged.response
                and reference_answer(judged.response, expected["reference"], body)
            )
            if not kept:
                why = "its answer is an ERROR" if verdict == "ERROR" else "it gave no ids"
                print(f"check.py: {reference}: {why}, nothing kept", file=sys.stderr)
                return EXIT_ERROR
            args.save_reference.write_text(json.dumps(kept) + "\n", encoding="utf-8")
            print(f"check.py: {reference}'s answer kept in {args.save_reference}")
    elif recorded.get("verdict"):
        parted = parting(fresh or expected, judged.response) if judged.response else None
        same = reproduction(recorded, verdict, judged.died, parted, judged.broken is not None)
        source = recorded.get("source", "the harness")
        vs = f" (against {reference} served here)" if fresh else ""
        print(f"check.py: {source} recorded {recorded['verdict']}: {same}{vs}")
    if recorded.get("where") and verdict != "ERROR" and fresh is None:
        here = " (`bash run.sh reference` checks the case against it served here)"
        if serving_reference:
            here = ""
        print(
            f"check.py: the expected ids were recorded on {recorded['where']}; "
            f"{recorded.get('ids_vary_with', 'another machine')} can give other ids{here}"
        )
    return code


if __name__ == "__main__":
    raise SystemExit(main())
