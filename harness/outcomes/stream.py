"""A streamed chat completion: its server-sent events, read into the answer and its framing.

A stream reaches the client through a proxy that relays D's events (and, in P/D, after P has
answered the prompt's first token itself), so a stream can carry the right ids and still be
broken for a client: an event that does not parse, a chunk of another shape than vLLM's (a
null choice, token ids that are not integers), a second role chunk, a token relayed twice,
`[DONE]` missing or not last, a final usage that counts other tokens than were streamed, two
requests' events (or two choices' chunks) interleaved. The ids are read from the stream as vLLM 0.32
sends them with `return_token_ids` (the first chunk carries `prompt_token_ids`, each later chunk its
`choices[0].token_ids` and their log-probs; with `stream_options.include_usage` a last chunk
with no choices carries `usage`), so they are compared with the baseline's like any answer's,
and every framing rule broken is kept as a problem: evidence that fails the case
(`harness.judge.verdicts`), never a note that passes silently.

A stream that reports an error (vLLM's `data: {"error": ...}` event), carries no event at all
(an error object answered with 200: its body is the message), or whose transport broke is no
answer: `StreamFailed`, which the session turns into an ERROR.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from harness.outcomes.chat import (
    ChatResult,
    PositionLogprobs,
    integer_ids,
    position_logprobs,
    unfinished,
)

DONE = "[DONE]"
EVENT_STREAM = "text/event-stream"


@dataclass
class StreamRecord:
    """How one streamed answer was framed, as the client received it."""

    content_type: str = ""
    events: int = 0  # `data:` events, [DONE] included
    chunks: int = 0  # events that parsed as JSON objects
    role_chunks: int = 0
    token_chunks: int = 0  # chunks that carried generated token ids
    ids_counted: int = 0  # generated ids read from the chunks
    usage_completion_tokens: int | None = None  # the final usage chunk's count
    usage_prompt_tokens: int | None = None
    done_last: bool = False
    finish_reasons: int = 0
    chunk_ids: list[str] = field(default_factory=list)  # distinct `id`s, in order
    # seconds from sending the request to the first event, the first token, the last event
    first_event_s: float | None = None
    first_token_s: float | None = None
    last_event_s: float | None = None
    problems: list[str] = field(default_factory=list)  # framing rules broken: fail the case

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        """One line: what a comparison of two proxies' streams looks at."""
        done = "[DONE] last" if self.done_last else "no [DONE] last"
        return (
            f"{self.content_type or 'no content-type'}; {self.events} events, "
            f"{self.role_chunks} role, {self.token_chunks} with tokens, {done}, usage "
            f"{self.usage_completion_tokens}/{self.ids_counted} ids"
        )

    def describe(self) -> str:
        head = "stream framing held" if self.ok else "stream framing broken"
        text = f"{head}: {self.summary()}"
        return text + ("; " + "; ".join(self.problems) if self.problems else "")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StreamRecord:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


class StreamFailed(Exception):
    """The stream carries no answer: the server reported an error in it, or it broke off."""

    def __init__(self, message: str, record: StreamRecord):
        super().__init__(message)
        self.record = record


def split_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Complete server-sent events in `buffer` (each without its blank-line terminator), and
    the incomplete rest. Events end with a blank line (`\\n\\n`, or `\\r\\n\\r\\n`)."""
    normalized = buffer.replace(b"\r\n", b"\n")
    *events, rest = normalized.split(b"\n\n")
    return [e for e in events if e.strip()], rest


def event_data(event: bytes) -> str | None:
    """The data of one event (its `data:` lines joined), None for a comment-only event."""
    lines = event.decode("utf-8", errors="replace").split("\n")
    data = [line[5:].removeprefix(" ") for line in lines if line.startswith("data:")]
    return "\n".join(data) if data else None


@dataclass
class _Reading:
    """What the chunks said so far, while they are read in order."""

    prompt_token_ids: list[int] | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    logprob_entries: int = 0
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int | None = None
    after_done: int = 0
    usage_seen: bool = False
    unreadable_prompt: str | None = None  # the problem of prompt_token_ids of another shape


def parse_stream(
    events: list[tuple[float, bytes]],
    content_type: str,
    complete: bool,
    unterminated: bool = False,
) -> tuple[ChatResult, StreamRecord]:
    """Read a stream's events ((seconds since the request was sent, event bytes), in arrival
    order) into the answer and its framing record. `complete`: the transport ended cleanly
    (else the stream broke off). `unterminated`: the last of `events` is what the stream left
    after its last blank line; it is read, but a complete stream's is a problem, since an SSE
    client (the openai one among them) drops it. Raises StreamFailed when the stream carries no
    answer."""
    record = StreamRecord(content_type=content_type)
    if EVENT_STREAM not in content_type:
        record.problems.append(f"served as {content_type or 'no content-type'}, not {EVENT_STREAM}")
    reading = _Reading()
    for seconds, raw in events:
        data = event_data(raw)
        if data is None:
            continue  # an SSE comment: allowed, carries nothing
        record.events += 1
        record.first_event_s = seconds if record.first_event_s is None else record.first_event_s
        record.last_event_s = seconds
        if reading.after_done or data.strip() == DONE:
            reading.after_done += 1
            continue
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError as exc:
            record.problems.append(f"event {record.events} does not parse: {exc}: {data[:120]!r}")
            continue
        if not isinstance(chunk, dict):
            record.problems.append(f"event {record.events} is not a JSON object: {data[:120]!r}")
            continue
        if "error" in chunk:
            raise StreamFailed(f"the stream reported an error: {json.dumps(chunk)[:1000]}", record)
        record.chunks += 1
        _read_chunk(chunk, record, reading, seconds)
    record.done_last = reading.after_done == 1
    if unterminated and complete and event_data(events[-1][1]) is not None:
        record.problems.append(
            f"event {record.events} ends the stream without the blank line that ends an "
            "event (an SSE client drops it)"
        )
    _check_framing(record, reading, complete)
    if not complete:
        raise StreamFailed(
            f"the stream broke off after {record.events} event(s) "
            f"({record.ids_counted} token id(s) read)",
            record,
        )
    if record.events == 0:
        held = b"".join(raw for _, raw in events).decode("utf-8", errors="replace").strip()
        raise StreamFailed(
            f"the answer carried no event: {held[:1000] if held else 'an empty body'}", record
        )
    if reading.unreadable_prompt is not None:
        raise StreamFailed(
            f"the stream's prompt_token_ids are unreadable: {reading.unreadable_prompt}", record
        )
    if reading.prompt_token_ids is None:
        raise StreamFailed(
            "the stream carried no prompt_token_ids: was return_token_ids honoured?", record
        )
    why = unfinished(reading.finish_reason) if record.finish_reasons else None
    if why is not None:  # none at all is a framing problem: the ids may be whole
        raise StreamFailed(f"the stream's answer did not finish: {why}", record)
    result = ChatResult(
        prompt_token_ids=tuple(reading.prompt_token_ids),
        token_ids=tuple(reading.token_ids),
        text="".join(reading.text),
        finish_reason=reading.finish_reason,
        logprobs=tuple(reading.logprobs),
        cached_tokens=reading.cached_tokens,
    )
    return result, record


class _Unreadable(Exception):
    """A field of a chunk has another shape than vLLM sends; the message says which and what."""


@dataclass(frozen=True)
class _Choice:
    """The fields read from one chunk's `choices[0]`, each of the shape vLLM sends."""

    role: Any
    content: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs]
    finish_reason: str | None


def _shown(value: Any) -> str:
    return json.dumps(value)[:120]


def _object(value: Any, where: str) -> dict[str, Any]:
    """An optional object field: {} when absent (null)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _Unreadable(f"{where} is {_shown(value)}, not an object")
    return value


def _integers(value: Any, where: str) -> list[int]:
    try:
        return list(integer_ids(value, where))
    except ValueError:
        raise _Unreadable(f"{where} is {_shown(value)}, not a list of integers") from None


def _read_choice(choice: Any) -> _Choice:
    """`choices[0]` read, or _Unreadable naming its first field of another shape."""
    if not isinstance(choice, dict):
        raise _Unreadable(f"choices[0] is {_shown(choice)}, not an object")
    index = choice.get("index", 0)  # vLLM streams the one choice asked for as index 0
    if index != 0 or isinstance(index, bool):
        raise _Unreadable(
            f"choices[0].index is {_shown(index)}, not 0 (one choice was asked): another "
            "completion's chunk"
        )
    delta = _object(choice.get("delta"), "choices[0].delta")
    content = delta.get("content")
    if content is not None and not isinstance(content, str):
        raise _Unreadable(f"choices[0].delta.content is {_shown(content)}, not a string")
    ids = choice.get("token_ids")
    token_ids = [] if ids is None else _integers(ids, "choices[0].token_ids")
    entries = _object(choice.get("logprobs"), "choices[0].logprobs").get("content")
    if entries is not None and not isinstance(entries, list):
        raise _Unreadable(f"choices[0].logprobs.content is {_shown(entries)}, not a list")
    logprobs = []
    for n, entry in enumerate(entries or []):
        try:
            logprobs.append(position_logprobs(entry))
        except (AttributeError, KeyError, TypeError, ValueError):
            raise _Unreadable(
                f"choices[0].logprobs.content[{n}] is {_shown(entry)}, not a log-prob entry "
                "of token_id:N tokens"
            ) from None
    finish = choice.get("finish_reason")
    if finish is not None and not isinstance(finish, str):
        raise _Unreadable(f"choices[0].finish_reason is {_shown(finish)}, not a string")
    return _Choice(delta.get("role"), content or "", token_ids, logprobs, finish)


def _read_chunk(
    chunk: dict[str, Any], record: StreamRecord, reading: _Reading, seconds: float
) -> None:
    chunk_id = chunk.get("id")
    if isinstance(chunk_id, str) and chunk_id not in record.chunk_ids:
        record.chunk_ids.append(chunk_id)
    if chunk.get("prompt_token_ids") is not None:
        if reading.prompt_token_ids is not None:
            record.problems.append(f"chunk {record.chunks} carries prompt_token_ids again")
        else:
            if record.chunks != 1:  # vLLM sends them on the first chunk alone
                record.problems.append(
                    f"chunk {record.chunks} carries prompt_token_ids, not the first chunk"
                )
            try:
                reading.prompt_token_ids = _integers(chunk["prompt_token_ids"], "prompt_token_ids")
            except _Unreadable as exc:
                reading.unreadable_prompt = f"event {record.events}: {exc}"
                record.problems.append(reading.unreadable_prompt)
    usage = chunk.get("usage")
    if isinstance(usage, dict) and not chunk.get("choices"):
        if reading.usage_seen:
            record.problems.append(f"chunk {record.chunks} is a second usage chunk")
        reading.usage_seen = True
        record.usage_completion_tokens = usage.get("completion_tokens")
        record.usage_prompt_tokens = usage.get("prompt_tokens")
        try:
            details = _object(usage.get("prompt_tokens_details"), "usage.prompt_tokens_details")
            cached = details.get("cached_tokens")
            if cached is not None and (not isinstance(cached, int) or isinstance(cached, bool)):
                raise _Unreadable(
                    f"usage.prompt_tokens_details.cached_tokens is {_shown(cached)}, not an integer"
                )
            reading.cached_tokens = cached
        except _Unreadable as exc:
            record.problems.append(f"event {record.events}: {exc}")
        return
    if reading.usage_seen:
        record.problems.append(f"chunk {record.chunks} comes after the usage chunk")
    choices = chunk.get("choices")
    if choices is not None and not isinstance(choices, list):
        record.problems.append(f"event {record.events}: choices is {_shown(choices)}, not a list")
        return
    if choices is None or len(choices) != 1:
        record.problems.append(
            f"chunk {record.chunks} has {'no' if choices is None else len(choices)} "
            "choices (one expected)"
        )
        return
    try:
        choice = _read_choice(choices[0])
    except _Unreadable as exc:
        record.problems.append(f"event {record.events}: {exc} (its chunk is not read)")
        return
    if choice.role is not None:
        record.role_chunks += 1
        if record.chunks != 1:
            record.problems.append(f"role chunk at chunk {record.chunks}, not first")
    if reading.finish_reason is not None:
        record.problems.append(f"chunk {record.chunks} comes after finish_reason")
    if choice.content:
        reading.text.append(choice.content)
    ids = choice.token_ids
    if ids:
        record.token_chunks += 1
        record.first_token_s = seconds if record.first_token_s is None else record.first_token_s
        reading.token_ids += ids
        record.ids_counted += len(ids)
    entries = choice.logprobs
    reading.logprob_entries += len(entries)
    if len(entries) != len(ids):
        record.problems.append(
            f"chunk {record.chunks}: {len(ids)} token id(s) but {len(entries)} log-prob entries"
        )
    for index, (entry, token_id) in enumerate(zip(entries, ids)):
        if entry.token_id != token_id:
            record.problems.append(
                f"chunk {record.chunks}: log-prob entry {index} is of token {entry.token_id}, "
                f"its id is {token_id}"
            )
            break
    reading.logprobs += entries
    if choice.finish_reason is not None:
        record.finish_reasons += 1
        reading.finish_reason = choice.finish_reason


def _check_framing(record: StreamRecord, reading: _Reading, complete: bool) -> None:
    """The rules a whole stream must keep (those of single chunks were checked as read)."""
    problems = record.problems
    if record.role_chunks != 1:
        problems.append(f"{record.role_chunks} role chunks (one expected)")
    if len(record.chunk_ids) > 1:
        problems.append(f"chunks of {len(record.chunk_ids)} completions: {record.chunk_ids[:4]}")
    if not complete:
        return  # a broken-off stream is an ERROR; what it lacks at its end is no framing fault
    if reading.after_done == 0:
        problems.append("no [DONE] event")
    elif reading.after_done > 1:
        problems.append(f"{reading.after_done - 1} event(s) after [DONE]")
    if record.finish_reasons != 1:
        problems.append(f"{record.finish_reasons} finish_reason(s) (one expected)")
    if not reading.usage_seen:
        problems.append("no usage chunk (stream_options.include_usage was asked)")
    elif record.usage_completion_tokens != record.ids_counted:
        problems.append(
            f"usage counts {record.usage_completion_tokens} completion tokens, the stream "
            f"carried {record.ids_counted} token ids"
        )
    if (
        reading.usage_seen
        and reading.prompt_token_ids is not None
        and record.usage_prompt_tokens != len(reading.prompt_token_ids)
    ):
        problems.append(
            f"usage counts {record.usage_prompt_tokens} prompt tokens, the stream's "
            f"prompt_token_ids {len(reading.prompt_token_ids)}"
        )
