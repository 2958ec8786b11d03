"""Streamed answers: server-sent events read into token ids, and their framing checked; the
planted fault that relays a chunk twice; how a framing problem is judged; what `compare` shows
of two proxies' streams."""

from __future__ import annotations

import copy
import gzip
import re

import httpx
import pytest
from sse_stream import PROMPT_IDS, TOKENS, encode, logprob_entry, timed, vllm_chunks

from harness.judge.records import Verdict
from harness.judge.verdicts import STREAM_CHECK
from harness.outcomes.outcome import Outcome
from harness.outcomes.stream import (
    EVENT_STREAM,
    StreamFailed,
    event_data,
    parse_stream,
    split_events,
)
from harness.report.proxy_diff import STREAMS_ALIKE, diff_runs, format_diff
from harness.serve.client import ChatClient
from harness.serve.proxy import FirstTokenChunkTwice, carries_tokens
from harness.spec.prompts import streaming_request
from harness.testing.judging import judged

pytestmark = pytest.mark.unit


def parse(events: list[bytes], content_type: str = EVENT_STREAM, complete: bool = True):
    return parse_stream(timed(events), content_type, complete)


def test_a_vllm_stream_gives_the_ids_logprobs_and_usage_of_the_answer() -> None:
    result, record = parse(encode(vllm_chunks(cached=4)))
    assert result.prompt_token_ids == tuple(PROMPT_IDS)
    assert result.token_ids == tuple(TOKENS)
    assert [p.token_id for p in result.logprobs] == TOKENS
    assert result.logprobs[0].top[1] == (TOKENS[0] + 100, -4.0)
    assert result.finish_reason == "length"
    assert result.text == "".join(f"t{t}" for t in TOKENS)
    assert result.cached_tokens == 4
    assert record.ok, record.problems
    assert (record.role_chunks, record.token_chunks, record.ids_counted) == (1, 3, 3)
    assert record.usage_completion_tokens == 3 and record.done_last
    assert record.first_token_s == pytest.approx(0.02)  # the second event: the first token


def test_a_chunk_relayed_twice_is_read_as_sent_and_breaks_the_usage_count() -> None:
    events = encode(vllm_chunks())
    result, record = parse([events[0], events[1], events[1], *events[2:]])
    assert result.token_ids == (TOKENS[0], TOKENS[0], *TOKENS[1:])
    assert "usage counts 3 completion tokens, the stream carried 4 token ids" in record.problems


@pytest.mark.parametrize(
    "mangle, problem",
    [
        (lambda e: [e[0], *e], "2 role chunks (one expected)"),
        (lambda e: e[:-1], "no [DONE] event"),
        (lambda e: [*e, e[1]], "1 event(s) after [DONE]"),
        (lambda e: [e[0], b"data: {not json\n\n", *e[1:]], "event 2 does not parse"),
        (lambda e: [*e[:-2], e[-1]], "no usage chunk"),
        (lambda e: [e[0], *e[2:]], "usage counts 3 completion tokens, the stream carried 2"),
        (lambda e: [e[0], e[-2], *e[1:-2], e[-1]], "comes after the usage chunk"),
    ],
    ids=["two-roles", "no-done", "after-done", "unparsable", "no-usage", "dropped", "usage-early"],
)
def test_each_framing_rule_broken_is_a_problem(mangle, problem: str) -> None:
    _, record = parse(mangle(encode(vllm_chunks())))
    assert any(problem in p for p in record.problems), record.problems


def first_token_chunk(**fields: object) -> list[dict]:
    """vLLM's stream with `fields` of its first token chunk (event 2) replaced."""
    chunks = copy.deepcopy(vllm_chunks())
    chunks[1].update(fields)
    return chunks


def first_token_choice(**fields: object) -> list[dict]:
    """vLLM's stream with `fields` of its first token chunk's (event 2's) choice replaced."""
    chunks = copy.deepcopy(vllm_chunks())
    chunks[1]["choices"][0].update(fields)
    return chunks


@pytest.mark.parametrize(
    "chunks, problem",
    [
        (first_token_chunk(choices=[None]), "choices[0] is null, not an object"),
        (first_token_chunk(choices={}), "choices is {}, not a list"),
        (first_token_choice(delta="t40"), 'choices[0].delta is "t40", not an object'),
        (first_token_choice(delta=["t40"]), 'choices[0].delta is ["t40"], not an object'),
        (first_token_choice(delta={"content": 40}), "choices[0].delta.content is 40, not a"),
        (first_token_choice(token_ids=40), "choices[0].token_ids is 40, not a list of integers"),
        (first_token_choice(token_ids=["40"]), 'choices[0].token_ids is ["40"], not a list of'),
        (first_token_choice(token_ids=[40.0]), "choices[0].token_ids is [40.0], not a list of"),
        (first_token_choice(token_ids=[True]), "choices[0].token_ids is [true], not a list of"),
        (first_token_choice(logprobs=[None]), "choices[0].logprobs is [null], not an object"),
        (first_token_choice(logprobs={"content": 1}), "choices[0].logprobs.content is 1, not a"),
        (first_token_choice(logprobs={"content": [None]}), "choices[0].logprobs.content[0] is"),
        (first_token_choice(finish_reason=1), "choices[0].finish_reason is 1, not a string"),
        (first_token_choice(index=1), "choices[0].index is 1, not 0 (one choice was asked)"),
    ],
    ids=[
        "choice-null",
        "choices-object",
        "delta-string",
        "delta-list",
        "content-number",
        "ids-number",
        "ids-strings",
        "ids-floats",
        "ids-booleans",
        "logprobs-list",
        "logprob-entries-number",
        "logprob-entry-null",
        "finish-number",
        "another-choice",
    ],
)
def test_a_malformed_choice_is_a_problem_of_its_event_not_a_crash(chunks, problem: str) -> None:
    """A proxy that mangles a chunk made the reader raise (AttributeError, TypeError,
    ValueError), an ERROR reading like the harness's own crash (found in review); it is a
    stream problem naming the event, and the chunk's tokens are not read from it."""
    result, record = parse(encode(chunks))
    assert f"event 2: {problem}" in "\n".join(record.problems), record.problems
    assert TOKENS[0] not in result.token_ids


def test_a_stream_of_another_choice_than_the_one_asked_is_a_problem() -> None:
    """The run asks for one choice, which vLLM streams as index 0: a stream of index 1 (or
    of two indices interleaved) is another completion's, or two completions' ids mixed.
    Found in review: the index was not read, and such a stream whole in every other rule
    passed."""
    chunks = vllm_chunks()
    for chunk in chunks:
        for choice in chunk["choices"]:
            choice["index"] = 1
    _, record = parse(encode(chunks))
    assert any("choices[0].index is 1, not 0" in p for p in record.problems), record.problems


def test_log_probs_of_another_token_than_their_chunks_id_are_a_problem() -> None:
    """Found in review: only their count was checked, and the drift rule reads a position's
    log-probs at a divergence: another token's near-tie must not excuse it."""
    chunks = first_token_choice(logprobs={"content": [logprob_entry(TOKENS[1], -0.1)]})
    _, record = parse(encode(chunks))
    expected = f"chunk 2: log-prob entry 0 is of token {TOKENS[1]}, its id is {TOKENS[0]}"
    assert expected in record.problems, record.problems


def test_a_malformed_chunk_among_whole_ones_is_a_mismatch_not_a_match() -> None:
    """The ids the other chunks carried equal the baseline's; the stream is still broken."""
    events = encode(vllm_chunks())
    extra = encode(first_token_chunk(choices=[None]), done=False)[1]
    candidate = streamed_outcome([events[0], extra, *events[1:]])
    assert candidate.result == baseline_outcome().result
    record = judged("1E+1PD", "baseline", baseline_outcome(), candidate)
    assert record.verdict is Verdict.MISMATCH and not record.policy_passed
    assert "event 2: choices[0] is null, not an object" in record.detail


def test_unreadable_prompt_ids_fail_the_stream_saying_so() -> None:
    chunks = copy.deepcopy(vllm_chunks())
    chunks[0]["prompt_token_ids"] = ["1", "2"]
    with pytest.raises(StreamFailed, match=re.escape('event 1: prompt_token_ids is ["1", "2"]')):
        parse(encode(chunks))


@pytest.mark.parametrize(
    "moved_to, other",
    [(2, False), (2, True), (4, True)],
    ids=["same-ids-later", "other-ids-later", "other-ids-last"],
)
def test_prompt_ids_on_a_later_chunk_than_the_first_are_a_problem(
    moved_to: int, other: bool
) -> None:
    """Found in review: prompt_token_ids were taken from whichever chunk carried them first;
    vLLM sends them on the first chunk alone, so on a later one (another request's, say) they
    are a framing problem, not the answer's prompt taken silently."""
    chunks = copy.deepcopy(vllm_chunks())
    ids = chunks[0].pop("prompt_token_ids")
    chunks[moved_to - 1]["prompt_token_ids"] = [i + 1 for i in ids] if other else ids
    _, record = parse(encode(chunks))
    assert f"chunk {moved_to} carries prompt_token_ids, not the first chunk" in record.problems


@pytest.mark.parametrize(
    "details, problem",
    [
        (4, "usage.prompt_tokens_details is 4, not an object"),
        ({"cached_tokens": "4"}, 'usage.prompt_tokens_details.cached_tokens is "4", not an'),
    ],
    ids=["details-number", "cached-string"],
)
def test_unreadable_usage_details_are_a_problem_not_a_crash(details, problem: str) -> None:
    """The cached count is the kv_transfer guard's evidence: of another shape it is none."""
    chunks = copy.deepcopy(vllm_chunks())
    chunks[-1]["usage"]["prompt_tokens_details"] = details
    result, record = parse(encode(chunks))
    assert f"event 5: {problem}" in "\n".join(record.problems), record.problems
    assert result.cached_tokens is None


def test_two_completions_interleaved_are_a_problem() -> None:
    chunks = vllm_chunks()
    chunks[2] = copy.deepcopy(chunks[2])
    chunks[2]["id"] = "chatcmpl-other"
    _, record = parse(encode(chunks))
    assert any("chunks of 2 completions" in p for p in record.problems), record.problems


def test_a_stream_served_as_json_is_a_problem() -> None:
    _, record = parse(encode(vllm_chunks()), content_type="application/json")
    assert record.problems == [f"served as application/json, not {EVENT_STREAM}"]


@pytest.mark.parametrize(
    "events, complete, cause",
    [
        (encode([{"error": {"message": "engine died", "code": 500}}]), True, "reported an error"),
        (encode(vllm_chunks())[:2], False, "broke off after 2 event(s)"),
        (encode(vllm_chunks()[1:]), True, "no prompt_token_ids"),
    ],
    ids=["error-event", "broken-off", "no-prompt-ids"],
)
def test_a_stream_without_an_answer_fails(events, complete: bool, cause: str) -> None:
    with pytest.raises(StreamFailed, match=re.escape(cause)) as failure:
        parse(events, complete=complete)
    assert failure.value.record.events >= 1


@pytest.mark.parametrize("finish", ["abort", "error"])
def test_a_stream_that_did_not_finish_fails_saying_why(finish: str) -> None:
    """Found in review: a stream ended by an abort or an engine error was read as an answer,
    its ids as short as the abort made them: a MISMATCH (or a MATCH of a prefix) where it is
    an ERROR naming why it ended."""
    chunks = copy.deepcopy(vllm_chunks())
    chunks[-2]["choices"][0]["finish_reason"] = finish
    with pytest.raises(StreamFailed, match=f'finish_reason "{finish}"'):
        parse(encode(chunks))


def test_events_split_across_reads_and_crlf() -> None:
    first, rest = split_events(b"data: a\r\n\r\ndata: b\n\ndata: c")
    assert first == [b"data: a", b"data: b"] and rest == b"data: c"
    assert event_data(b": a comment\ndata: x\ndata: y") == "x\ny"
    assert event_data(b": only a comment") is None


def read_by_client(stream: bytes, headers: dict[str, str] | None = None):
    """The chat client's read of `stream` served in 5-byte pieces, over an in-memory
    transport: what a stream from a socket goes through, without one."""

    def answer(_request: httpx.Request) -> httpx.Response:
        pieces = [stream[i : i + 5] for i in range(0, len(stream), 5)]
        return httpx.Response(
            200, headers={"content-type": EVENT_STREAM, **(headers or {})}, stream=_Pieces(pieces)
        )

    client = ChatClient("http://fake")
    client._http = httpx.Client(transport=httpx.MockTransport(answer))
    try:
        return client.send(streaming_request({"model": "m", "messages": []}))
    finally:
        client.close()


class _Pieces(httpx.SyncByteStream):
    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def __iter__(self):
        yield from self.pieces


def test_a_last_event_without_its_blank_line_is_a_problem() -> None:
    """Found in review: the bytes left at the end were read as one more event, so a stream
    whose `[DONE]` lacked its blank line held its framing; an SSE client (the openai one
    among them) drops such an event, never seeing that `[DONE]`."""
    stream = b"".join(encode(vllm_chunks()))
    assert read_by_client(stream).stream.ok
    for cut in (stream[:-2], stream[:-1], stream.replace(b"\n", b"\r\n")[:-2]):
        reply = read_by_client(cut)
        assert reply.result.token_ids == tuple(TOKENS)
        assert reply.stream.problems == [
            "event 6 ends the stream without the blank line that ends an event "
            "(an SSE client drops it)"
        ]
    assert read_by_client(stream + b": bye").stream.ok  # a comment left open carries nothing


def test_a_json_error_answered_to_a_stream_fails_showing_it() -> None:
    """Found in review: an HTTP 200 whose body is an error object, not events, failed blaming
    return_token_ids (no prompt_token_ids), the server's own message dropped."""
    body = b'{"error": {"message": "KV load failed for chatcmpl-1", "code": 500}}'
    with pytest.raises(StreamFailed, match="KV load failed for chatcmpl-1") as failure:
        read_by_client(body, {"content-type": "application/json"})
    assert "return_token_ids" not in str(failure.value)


def test_a_compressed_stream_is_read_as_a_client_reads_it() -> None:
    """Found in review: the client read the raw bytes, so a stream a proxy served gzipped
    (`content-encoding: gzip`, which httpx asks for) was read as no events at all, an ERROR
    blaming return_token_ids; every HTTP client decodes it first."""
    stream = b"".join(encode(vllm_chunks()))
    reply = read_by_client(gzip.compress(stream), {"content-encoding": "gzip"})
    assert reply.result.token_ids == tuple(TOKENS) and reply.stream.ok, reply.stream.problems


def test_the_planted_fault_relays_the_first_token_chunk_twice_and_nothing_else() -> None:
    events = encode(vllm_chunks())
    stream = b"".join(events)
    rewriter = FirstTokenChunkTwice()
    # fed in awkward pieces: an event split across reads must still be found whole
    out = b"".join(rewriter.feed(stream[i : i + 7]) for i in range(0, len(stream), 7))
    out += rewriter.flush()
    assert out == b"".join([events[0], events[1], events[1], *events[2:]])
    assert rewriter.duplicated is not None and rewriter.duplicated.startswith("event 2")
    assert carries_tokens(events[1].rstrip()) and not carries_tokens(events[0].rstrip())


@pytest.mark.parametrize(
    "choices",
    [{"0": {"token_ids": [40]}}, {"a": 1}, "t40", 40, [None], [[40]]],
    ids=["object-keyed-0", "object", "string", "number", "null-choice", "list-choice"],
)
def test_the_planted_fault_relays_a_malformed_chunk_once_and_doubles_the_next_token_chunk(
    choices: object,
) -> None:
    """A chunk whose `choices` is a non-empty object made carries_tokens raise KeyError
    (`choices[0]`), breaking the proxy's relay mid-stream (found in review): such a chunk
    carries no tokens a client reads, so it is relayed once and the fault doubles the first
    chunk that does."""
    events = encode(vllm_chunks())
    odd = encode([{"choices": choices}], done=False)[0]
    assert not carries_tokens(odd.rstrip())
    stream = b"".join([events[0], odd, *events[1:]])
    rewriter = FirstTokenChunkTwice()
    out = rewriter.feed(stream) + rewriter.flush()
    assert out == b"".join([events[0], odd, events[1], events[1], *events[2:]])


def test_streaming_request_asks_for_usage() -> None:
    body = streaming_request({"model": "m", "messages": []})
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def streamed_outcome(events: list[bytes]) -> Outcome:
    result, record = parse(events)
    return Outcome(prompt="image", result=result, stream=record)


def baseline_outcome() -> Outcome:
    result, _ = parse(encode(vllm_chunks()))
    return Outcome(prompt="image", result=result)


def test_a_broken_framing_fails_the_case_even_with_equal_ids() -> None:
    events = encode(vllm_chunks())
    candidate = streamed_outcome([events[0], *events])  # two role chunks, ids untouched
    assert candidate.result == baseline_outcome().result
    record = judged("1E+1PD", "baseline", baseline_outcome(), candidate)
    assert record.verdict is Verdict.MISMATCH and not record.policy_passed
    assert record.detail.startswith("stream framing broken: "), record.detail
    assert "2 role chunks (one expected)" in record.detail
    assert record.guards[STREAM_CHECK]["ok"] is False


def test_a_well_framed_stream_matches_and_records_its_framing() -> None:
    record = judged(
        "1E+1PD", "baseline", baseline_outcome(), streamed_outcome(encode(vllm_chunks()))
    )
    assert record.verdict is Verdict.MATCH and record.policy_passed
    assert record.guards[STREAM_CHECK]["evidence"].startswith("stream framing held")


def test_the_duplicated_chunk_is_a_mismatch_on_tokens_and_framing() -> None:
    events = encode(vllm_chunks())
    candidate = streamed_outcome([events[0], events[1], events[1], *events[2:]])
    record = judged("1E+1P+1D", "baseline", baseline_outcome(), candidate)
    assert record.verdict is Verdict.MISMATCH
    assert "usage counts 3" in record.detail
    assert "generated tokens differ at position 1" in record.detail


def test_compare_reports_a_difference_between_two_proxies_streams() -> None:
    ok = streamed_outcome(encode(vllm_chunks())).to_json()
    _, as_json = parse(encode(vllm_chunks()), content_type="application/json")
    other = {**ok, "stream": as_json.to_json()}
    diffs = diff_runs({"1P+1D": {"text": ok}}, {"1P+1D": {"text": other}})
    [diff] = diffs
    assert not diff.same
    assert "text/event-stream" in diff.stream and "application/json" in diff.stream
    assert "stream |" in format_diff(diffs, "harness", "vllm")
    [alike] = diff_runs({"1P+1D": {"text": ok}}, {"1P+1D": {"text": ok}})
    assert alike.same and alike.stream == STREAMS_ALIKE


def test_the_toy_proxys_json_stream_is_a_declared_failure_only_there(tmp_path) -> None:
    from harness.run.judging import TOY_PROXY_JSON_STREAM, proxy_failure
    from harness.spec.settings import ProxyChoice, RunSettings
    from harness.spec.topology import TOPOLOGIES, ServingConfig

    vllm = RunSettings(ServingConfig(model="m"), tmp_path, proxy=ProxyChoice("vllm"))
    harness = RunSettings(ServingConfig(model="m"), tmp_path)
    _, as_json = parse(encode(vllm_chunks()), content_type="application/json")
    streamed = Outcome("text", result=baseline_outcome().result, stream=as_json)
    assert proxy_failure(vllm, TOPOLOGIES["1P+1D"], streamed) is TOY_PROXY_JSON_STREAM
    assert proxy_failure(vllm, TOPOLOGIES["1E+1P+1D"], streamed) is None  # vLLM's EPD proxy
    assert proxy_failure(harness, TOPOLOGIES["1P+1D"], streamed) is None
    assert proxy_failure(vllm, TOPOLOGIES["1P+1D"], baseline_outcome()) is None  # not streamed
    record = judged(
        "1P+1D", "baseline", baseline_outcome(), streamed, declared=TOY_PROXY_JSON_STREAM
    )
    assert record.verdict is Verdict.MISMATCH and record.policy_passed, record.detail
    fixed = judged(
        "1P+1D",
        "baseline",
        baseline_outcome(),
        streamed_outcome(encode(vllm_chunks())),
        declared=TOY_PROXY_JSON_STREAM,
    )
    assert fixed.verdict is Verdict.MATCH and not fixed.policy_passed  # a fix turns it red


def test_the_judging_path_judges_a_toy_proxy_stream_as_declared(tmp_path) -> None:
    """`CaseJudge.judge` applies the proxy's declared failure where the caller declares none:
    a `--proxy vllm` 1P+1D streamed case passes as declared, named so. Found in review: a
    mutant that never asked `proxy_failure` (every such case a failing MISMATCH) survived
    every test, which asked `proxy_failure` itself."""
    from types import SimpleNamespace

    from harness.judge.verdicts import Reference
    from harness.run.judging import CaseJudge, Observed
    from harness.spec.settings import ProxyChoice, RunSettings
    from harness.spec.topology import TOPOLOGIES, ServingConfig

    vllm = RunSettings(ServingConfig(model="m"), tmp_path, proxy=ProxyChoice("vllm"))
    baseline = SimpleNamespace(
        label="baseline",
        noise_floor=0.0,
        reference=lambda prompt: Reference("baseline", baseline_outcome(), True),
    )
    _, as_json = parse(encode(vllm_chunks()), content_type="application/json")
    streamed = Outcome("text", result=baseline_outcome().result, stream=as_json)
    judging = CaseJudge(vllm, baseline)  # type: ignore[arg-type]
    [record] = judging.judge(TOPOLOGIES["1P+1D"], Observed(streamed, ()))
    assert record.verdict is Verdict.MISMATCH and record.policy_passed, record.detail
    assert record.declared_failure == "toy-proxy-json-stream"


def test_the_toy_proxys_declaration_holds_the_content_type_alone_and_identical_ids() -> None:
    """Found in review: with the content type alone as evidence, whatever else was broken
    behind it (a chunk relayed twice, another request's ids, a transfer that did not happen)
    passed as the declared failure."""
    from harness.judge.guards import GuardResult
    from harness.run.judging import TOY_PROXY_JSON_STREAM

    def declared(events: list[bytes], guards=()) -> tuple[Verdict, bool]:
        _, record = parse(events, content_type="application/json")
        result, _ = parse(events)
        candidate = Outcome("text", result=result, stream=record)
        case = judged(
            "1P+1D",
            "baseline",
            baseline_outcome(),
            candidate,
            guards,
            declared=TOY_PROXY_JSON_STREAM,
        )
        return case.verdict, case.policy_passed

    events = encode(vllm_chunks())
    assert declared(events) == (Verdict.MISMATCH, True)  # the declared failure alone
    assert declared([events[0], events[1], *events[1:]]) == (Verdict.MISMATCH, False)
    other_ids = encode(vllm_chunks(tokens=[token + 7 for token in TOKENS]))
    assert declared(other_ids) == (Verdict.MISMATCH, False)
    no_kv = GuardResult("kv_transfer", False, "D cached_tokens=0, expected >= 160")
    assert declared(events, [no_kv]) == (Verdict.MISMATCH, False)


def without_role() -> list[dict]:
    chunks = copy.deepcopy(vllm_chunks())
    del chunks[0]["choices"][0]["delta"]["role"]
    return chunks


def role_on_the_first_token_chunk() -> list[dict]:
    chunks = without_role()
    chunks[1]["choices"][0]["delta"]["role"] = "assistant"
    return chunks


def usage_details(**details: object) -> list[dict]:
    chunks = copy.deepcopy(vllm_chunks())
    chunks[-1]["usage"]["prompt_tokens_details"] = details
    return chunks


def without_finish_reason() -> list[dict]:
    chunks = copy.deepcopy(vllm_chunks())
    chunks[-2]["choices"][0]["finish_reason"] = None
    return chunks


def a_token_after_the_finish() -> list[dict]:
    """vLLM's stream whose finish_reason comes a token chunk early: its last token follows
    the end of the answer, every count still right."""
    chunks = copy.deepcopy(vllm_chunks())
    chunks[-3]["choices"][0]["finish_reason"] = chunks[-2]["choices"][0]["finish_reason"]
    chunks[-2]["choices"][0]["finish_reason"] = None
    return chunks


def usage_of(**fields: object) -> list[dict]:
    chunks = copy.deepcopy(vllm_chunks())
    chunks[-1]["usage"].update(fields)
    return chunks


def an_empty_chunk() -> list[dict]:
    """vLLM's stream with a chunk of no choices and no usage after its first token chunk: a
    relay's keep-alive, say, shaped like the usage chunk without its usage."""
    chunks = copy.deepcopy(vllm_chunks())
    empty = {key: value for key, value in chunks[1].items() if key != "usage"}
    return [*chunks[:2], {**empty, "choices": []}, *chunks[2:]]


def two_choices() -> list[dict]:
    chunks = copy.deepcopy(vllm_chunks())
    chunks[1]["choices"] = [chunks[1]["choices"][0], chunks[1]["choices"][0]]
    return chunks


@pytest.mark.parametrize(
    "chunks, problem",
    [
        (first_token_chunk(prompt_token_ids=PROMPT_IDS), "chunk 2 carries prompt_token_ids again"),
        ([*vllm_chunks(), vllm_chunks()[-1]], "chunk 6 is a second usage chunk"),
        (usage_details(cached_tokens=True), "cached_tokens is true, not an integer"),
        (two_choices(), "chunk 2 has 2 choices (one expected)"),
        (an_empty_chunk(), "chunk 3 has 0 choices (one expected)"),
        (without_role(), "0 role chunks (one expected)"),
        (role_on_the_first_token_chunk(), "role chunk at chunk 2, not first"),
        (first_token_choice(logprobs={"content": []}), "chunk 2: 1 token id(s) but 0 log-prob"),
        (first_token_choice(index=False), "choices[0].index is false, not 0"),
        (without_finish_reason(), "0 finish_reason(s) (one expected)"),
        (a_token_after_the_finish(), "chunk 4 comes after finish_reason"),
        (usage_of(prompt_tokens=5), "usage counts 5 prompt tokens"),
    ],
    ids=[
        "prompt-ids-again",
        "second-usage",
        "cached-boolean",
        "two-choices",
        "no-choices",
        "no-role",
        "role-late",
        "logprobs-missing",
        "index-boolean",
        "no-finish",
        "token-after-finish",
        "prompt-miscounted",
    ],
)
def test_each_chunk_rule_broken_is_a_problem_of_an_otherwise_whole_stream(
    chunks: list[dict], problem: str
) -> None:
    """Each stream breaks one rule, the rest of it whole: the problem is the one thing that
    fails it, so a rule not kept would pass the stream."""
    _, record = parse(encode(chunks))
    assert any(problem in p for p in record.problems), record.problems


def test_usage_on_token_chunks_is_not_the_usage_chunk() -> None:
    """vLLM's `continuous_usage_stats` puts a usage on every chunk that has choices: those are
    token chunks still, read as such; only the last chunk, with no choices, is the usage one."""
    chunks = copy.deepcopy(vllm_chunks())
    for index, token_chunk in enumerate(chunks[1:-1], start=1):
        token_chunk["usage"] = {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": index}
    result, record = parse(encode(chunks))
    assert result.token_ids == tuple(TOKENS)
    assert record.ok, record.problems


def test_done_is_not_last_when_an_event_follows_it() -> None:
    """`done_last`, which `compare` shows of each proxy's stream, is false when an event comes
    after [DONE], as after none."""
    events = encode(vllm_chunks())
    _, record = parse([*events, events[1]])
    assert not record.done_last
