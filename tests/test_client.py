"""parse_chat_response / ChatResult on recorded-style vLLM bodies, and the transfer guards."""

from __future__ import annotations

import ast
import copy
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest

from harness.judge.guards import (
    EC_CACHE_FILE,
    check_consumer_embeds,
    check_encoder_output,
    check_kv_transfer,
    check_transfers,
    expected_kv_prefix,
)
from harness.outcomes.chat import ChatResult, PositionLogprobs, parse_chat_response
from harness.outcomes.trace import EncoderCall, RequestTrace
from harness.spec.prompts import sampling_fields
from harness.spec.topology import get_topology
from harness.testing.builders import cached_answer

pytestmark = pytest.mark.unit

# A vLLM chat completion as served with return_token_ids, logprobs, top_logprobs=2 and
# return_tokens_as_token_ids, plus --enable-prompt-tokens-details.
RECORDED_BODY = {
    "id": "chatcmpl-9b2e8f",
    "object": "chat.completion",
    "created": 1760000000,
    "model": "epd-model",
    "prompt_token_ids": [151644, 872, 198, 151652, 151655, 151653, 3838, 374],
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "A red", "tool_calls": []},
            "logprobs": {
                "content": [
                    {
                        "token": "token_id:32",
                        "logprob": -0.0123,
                        "bytes": [65],
                        "top_logprobs": [
                            {"token": "token_id:32", "logprob": -0.0123, "bytes": [65]},
                            {"token": "token_id:785", "logprob": -4.5, "bytes": [84]},
                        ],
                    },
                    {
                        "token": "token_id:2518",
                        "logprob": -1.25,
                        "bytes": None,
                        "top_logprobs": [
                            {"token": "token_id:2518", "logprob": -1.25, "bytes": None},
                            {"token": "token_id:6303", "logprob": -1.5, "bytes": None},
                        ],
                    },
                ]
            },
            "finish_reason": "length",
            "stop_reason": None,
            "token_ids": [32, 2518],
        }
    ],
    "usage": {
        "prompt_tokens": 8,
        "total_tokens": 10,
        "completion_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 0},
    },
    "kv_transfer_params": None,
}


def body_with(**changes) -> dict:
    body = copy.deepcopy(RECORDED_BODY)
    body.update(changes)
    return body


# --- parse_chat_response ---------------------------------------------------------------------


def test_parse_recorded_body() -> None:
    result = parse_chat_response(RECORDED_BODY)
    assert result.token_ids == (32, 2518)
    assert result.prompt_token_ids == (151644, 872, 198, 151652, 151655, 151653, 3838, 374)
    assert result.text == "A red"
    assert result.finish_reason == "length"
    assert result.cached_tokens == 0
    assert result.logprobs == (
        PositionLogprobs(32, -0.0123, ((32, -0.0123), (785, -4.5))),
        PositionLogprobs(2518, -1.25, ((2518, -1.25), (6303, -1.5))),
    )
    assert [p.top_ids() for p in result.logprobs] == [{32, 785}, {2518, 6303}]
    assert result.raw is RECORDED_BODY


def test_parse_cached_tokens_from_prompt_tokens_details() -> None:
    body = body_with(
        usage={
            "prompt_tokens": 89,
            "completion_tokens": 2,
            "prompt_tokens_details": {"cached_tokens": 64},
        }
    )
    assert parse_chat_response(body).cached_tokens == 64
    not_reported = {"prompt_tokens": 8, "completion_tokens": 2}
    assert parse_chat_response(body_with(usage=not_reported)).cached_tokens is None


def test_parse_without_logprobs() -> None:
    body = copy.deepcopy(RECORDED_BODY)
    body["choices"][0]["logprobs"] = None
    body["choices"][0]["message"]["content"] = None
    result = parse_chat_response(body)
    assert result.logprobs == ()
    assert result.text == ""
    assert result.token_ids == (32, 2518)


def test_missing_token_ids_mentions_return_token_ids() -> None:
    body = copy.deepcopy(RECORDED_BODY)
    del body["choices"][0]["token_ids"]
    with pytest.raises(ValueError, match="return_token_ids"):
        parse_chat_response(body)


def test_missing_prompt_token_ids_mentions_return_token_ids() -> None:
    body = copy.deepcopy(RECORDED_BODY)
    del body["prompt_token_ids"]
    with pytest.raises(ValueError, match="return_token_ids"):
        parse_chat_response(body)


def test_null_token_ids_mentions_return_token_ids() -> None:
    body = copy.deepcopy(RECORDED_BODY)
    body["choices"][0]["token_ids"] = None
    with pytest.raises(ValueError, match="return_token_ids"):
        parse_chat_response(body)


@pytest.mark.parametrize(
    "field, value",
    [
        ("token_ids", ["<img src=x onerror=alert(1)>"]),
        ("token_ids", [1.5]),
        ("token_ids", [True]),
        ("prompt_token_ids", "1 2 3"),
        ("prompt_token_ids", [{"id": 1}]),
    ],
)
def test_ids_that_are_not_integers_are_a_broken_answer(field: str, value: object) -> None:
    """Found in review: markup in an answer's ids reached report.html as markup (and a float
    would have been truncated in a stream)."""
    body = copy.deepcopy(RECORDED_BODY)
    if field == "token_ids":
        body["choices"][0]["token_ids"] = value
    else:
        body["prompt_token_ids"] = value
    with pytest.raises(ValueError, match=f"the answer's {field} are not a list of integers"):
        parse_chat_response(body)


@pytest.mark.parametrize(
    "usage, problem",
    [
        (
            {"prompt_tokens_details": {"cached_tokens": "64"}},
            'usage.prompt_tokens_details.cached_tokens is "64", not an',
        ),
        (
            {"prompt_tokens_details": {"cached_tokens": 64.0}},
            "usage.prompt_tokens_details.cached_tokens is 64.0, not an",
        ),
        (
            {"prompt_tokens_details": {"cached_tokens": True}},
            "usage.prompt_tokens_details.cached_tokens is true, not an",
        ),
        (
            {"prompt_tokens_details": {"cached_tokens": [64]}},
            "usage.prompt_tokens_details.cached_tokens is [64], not an",
        ),
        ({"prompt_tokens_details": [64]}, "usage.prompt_tokens_details is [64], not an object"),
        ("64 cached", 'usage is "64 cached", not an object'),
    ],
    ids=["string", "float", "boolean", "list", "details-list", "usage-string"],
)
def test_cached_tokens_of_another_shape_are_a_broken_answer(usage: object, problem: str) -> None:
    """cached_tokens is the KV guard's evidence that KV reached D: a string "64" was carried
    as it was (to a TypeError in the guard), a float or a boolean compared as a count (True
    as 1), a list of details raised AttributeError, read like the harness's own crash. As
    the stream reader (harness/outcomes/stream.py): a broken answer naming the field."""
    if isinstance(usage, dict):
        usage = {"completion_tokens": 2, **usage}  # the count vLLM always reports
    with pytest.raises(ValueError, match=re.escape(f"the answer's {problem}")):
        parse_chat_response(body_with(usage=usage))


@pytest.mark.parametrize(
    "field, value, problem",
    [
        ("content", 5, "choices[0].message.content is 5, not a string"),
        ("content", ["A red"], 'choices[0].message.content is ["A red"], not a string'),
        ("message", "A red", 'choices[0].message is "A red", not an object'),
        ("finish_reason", 1, "choices[0].finish_reason is 1, not a string"),
    ],
)
def test_text_of_another_shape_is_a_broken_answer(field: str, value: object, problem: str) -> None:
    """Found in review: a non-streamed answer's message.content was carried as it came (the
    stream reader refuses it), and a number there crashed report.html's writer (html.escape)
    after every case, the run's outputs with it; a message that was a string raised
    AttributeError, read like the harness's own crash."""
    body = copy.deepcopy(RECORDED_BODY)
    if field == "content":
        body["choices"][0]["message"]["content"] = value
    else:
        body["choices"][0][field] = value
    with pytest.raises(ValueError, match=re.escape(f"the answer's {problem}")):
        parse_chat_response(body)


def test_no_choices_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="return_token_ids"):
        parse_chat_response(body_with(choices=[]))


def test_an_answer_of_several_choices_is_refused() -> None:
    """Found in review: only choices[0] was read, so an answer of n>1 choices was judged by its
    first alone; vLLM answers the harness's requests with one choice."""
    body = copy.deepcopy(RECORDED_BODY)
    body["choices"].append(copy.deepcopy(body["choices"][0]) | {"index": 1})
    with pytest.raises(ValueError, match="2 choices"):
        parse_chat_response(body)


@pytest.mark.parametrize(
    "entries, problem",
    [
        (lambda c: c[:1], "log-probs are not of its ids: 2 token ids, 1 log-prob entries"),
        (
            lambda c: c[::-1],
            "log-probs are not of its ids: entry 0 is of token 2518, its position's id is 32",
        ),
    ],
)
def test_logprobs_that_are_not_of_the_ids_are_a_broken_answer(entries, problem: str) -> None:
    """Found in review: log-probs were kept whatever ids they were of, and the drift rule reads
    them at the divergence's position: another position's near-tie could excuse it."""
    body = copy.deepcopy(RECORDED_BODY)
    logprobs = body["choices"][0]["logprobs"]
    logprobs["content"] = entries(logprobs["content"])
    with pytest.raises(ValueError, match=re.escape(f"the answer's {problem}")):
        parse_chat_response(body)


@pytest.mark.parametrize(
    "completion_tokens, problem",
    [
        (3, "usage counts 3 completion tokens, its token_ids 2"),
        (1, "usage counts 1 completion tokens, its token_ids 2"),
        ("2", 'usage.completion_tokens is "2", not an integer'),
    ],
)
def test_usage_that_counts_other_ids_is_a_broken_answer(
    completion_tokens: object, problem: str
) -> None:
    """Found in review: a stream's usage was checked against the ids it carried, an unstreamed
    answer's was not; vLLM counts every generated id (EOS included) in usage.completion_tokens,
    so another count means ids lost or added on the way."""
    body = copy.deepcopy(RECORDED_BODY)
    body["usage"]["completion_tokens"] = completion_tokens
    with pytest.raises(ValueError, match=re.escape(f"the answer's {problem}")):
        parse_chat_response(body)


def test_a_boolean_usage_count_is_no_count_even_where_it_equals_one() -> None:
    """`true == 1` in Python: a one-id answer whose usage.completion_tokens is `true` would
    pass the count check, though it counts nothing (as the stream reader flags a boolean)."""
    body = copy.deepcopy(RECORDED_BODY)
    choice = body["choices"][0]
    choice["token_ids"] = choice["token_ids"][:1]
    choice["logprobs"]["content"] = choice["logprobs"]["content"][:1]
    body["usage"]["completion_tokens"] = True
    problem = "the answer's usage.completion_tokens is true, not an integer"
    with pytest.raises(ValueError, match=re.escape(problem)):
        parse_chat_response(body)


@pytest.mark.parametrize(
    "usage",
    [None, {"prompt_tokens": 8}, {"prompt_tokens": 8, "completion_tokens": None}],
    ids=["no-usage", "no-count", "null-count"],
)
def test_an_answer_without_its_usage_count_is_a_broken_answer(usage: object) -> None:
    """vLLM's unstreamed answer always carries usage with completion_tokens, an integer (its
    ChatCompletionResponse requires usage; serving.py counts the generated ids into it), and
    the count is what finds ids lost or added on the way. Found in review: an answer without
    it (a relay that dropped it) was accepted unchecked."""
    body = body_with(usage=usage)
    if usage is None:
        del body["usage"]
    with pytest.raises(ValueError, match=re.escape("the answer's usage has no completion_tokens")):
        parse_chat_response(body)


@pytest.mark.parametrize("finish", [None, "abort", "error"])
def test_an_unfinished_answer_is_refused(finish: str | None) -> None:
    """Found in review: an answer that did not finish (aborted, failed in the engine, or with
    no finish_reason) was compared as if complete: a short answer, a MISMATCH or a MATCH of a
    prefix, where it is an ERROR naming why it ended."""
    body = copy.deepcopy(RECORDED_BODY)
    body["choices"][0]["finish_reason"] = finish
    with pytest.raises(ValueError, match=f"finish_reason {json.dumps(finish)}"):
        parse_chat_response(body)


@pytest.mark.parametrize("label", ["A", "token_id:", "token_id:abc", "tok:12"])
def test_logprob_token_must_be_a_token_id(label: str) -> None:
    body = copy.deepcopy(RECORDED_BODY)
    body["choices"][0]["logprobs"]["content"][1]["top_logprobs"][1]["token"] = label
    with pytest.raises(ValueError, match="token_id:N"):
        parse_chat_response(body)


def test_chat_result_json_round_trip() -> None:
    result = parse_chat_response(
        body_with(usage={"completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 5}})
    )
    data = result.to_json()
    assert data == {
        "prompt_token_ids": [151644, 872, 198, 151652, 151655, 151653, 3838, 374],
        "token_ids": [32, 2518],
        "text": "A red",
        "finish_reason": "length",
        "cached_tokens": 5,
        "logprobs": [
            {"token_id": 32, "logprob": -0.0123, "top": [[32, -0.0123], [785, -4.5]]},
            {"token_id": 2518, "logprob": -1.25, "top": [[2518, -1.25], [6303, -1.5]]},
        ],
    }
    back = ChatResult.from_json(json.loads(json.dumps(data)))
    assert back == result
    assert back.logprobs == result.logprobs
    assert back.cached_tokens == 5
    assert back.raw == {}


def test_sampling_fields_ask_for_token_ids() -> None:
    fields = sampling_fields(max_tokens=7, top_logprobs=3, seed=9)
    assert fields == {
        "temperature": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "seed": 9,
        "max_tokens": 7,
        "logprobs": True,
        "top_logprobs": 3,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }


GREEDY_TEST = "self.temperature < _SAMPLING_EPS"


def _assigned_literal(tree: ast.AST, name: str) -> Any:
    """The literal value assigned to `name` (`name = ...` or `name: T = ...`) in `tree`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return ast.literal_eval(node.value)
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == name:
            return ast.literal_eval(node.value)
    raise AssertionError(f"{name} not found")


def _greedy_resets(sampling_params: ast.AST) -> set[str]:
    """The SamplingParams fields `__post_init__` resets for a greedy request (the body of its
    `if self.temperature < _SAMPLING_EPS:`)."""
    for node in ast.walk(sampling_params):
        greedy = isinstance(node, ast.If) and ast.unparse(node.test) == GREEDY_TEST
        if greedy:
            return {
                target.attr
                for statement in node.body
                if isinstance(statement, ast.Assign)
                for target in statement.targets
                if isinstance(target, ast.Attribute)
            }
    raise AssertionError("no greedy branch in SamplingParams")


def test_every_default_a_checkpoint_can_give_a_greedy_request_is_pinned() -> None:
    """vLLM serves with `--generation-config auto`: a chat request's unset sampling fields take
    the checkpoint's generation_config.json (`ModelConfig.get_diff_sampling_param`), and a
    greedy request resets only top_p, top_k and min_p. Qwen2.5-VL's ships
    `repetition_penalty: 1.05`, so on the real checkpoints the greedy choice was penalised
    while the drift rule read vLLM's raw, unpenalised log-probs (found in review). Read in
    the installed vLLM: every such field that reaches a greedy choice is pinned, to the chat
    request's own neutral default."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed in this interpreter")
    root = Path(spec.origin).parent
    chat_protocol = root / "entrypoints/openai/chat_completion/protocol.py"
    if not chat_protocol.is_file():
        pytest.skip(f"vLLM {root} keeps its chat protocol elsewhere (read for 0.32)")
    checkpoint = set(
        _assigned_literal(ast.parse((root / "config/model.py").read_text()), "available_params")
    )
    neutral = _assigned_literal(ast.parse(chat_protocol.read_text()), "_DEFAULT_SAMPLING_PARAMS")
    greedy_resets = _greedy_resets(ast.parse((root / "sampling_params.py").read_text()))
    assert {"top_p", "top_k", "min_p"} <= greedy_resets
    reaching = {
        name: value
        for name, value in neutral.items()
        if name in checkpoint and name not in greedy_resets and name != "temperature"
    }
    assert "repetition_penalty" in reaching
    fields = sampling_fields(max_tokens=7)
    assert {name: fields.get(name) for name in reaching} == reaching
    assert fields["temperature"] == 0.0


# --- guards: kv_transfer ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt_tokens", "block_size", "expected"),
    [(89, 32, 64), (185, 32, 160), (33, 32, 32), (32, 32, 0), (65, 32, 64), (1, 32, 0)],
)
def test_expected_kv_prefix(prompt_tokens: int, block_size: int, expected: int) -> None:
    assert expected_kv_prefix(prompt_tokens, block_size) == expected


@pytest.mark.parametrize("cached", [None, 0, 32])  # 32: a local prefix hit, not the transfer
def test_kv_transfer_fails_below_expected_prefix(cached: int | None) -> None:
    guard = check_kv_transfer(cached_answer(89, cached), block_size=32)
    assert guard.name == "kv_transfer"
    assert guard.ok is False
    assert f"cached_tokens={cached}" in guard.evidence
    assert "expected >= 64" in guard.evidence


@pytest.mark.parametrize(("prompt_tokens", "cached"), [(89, 64), (185, 160), (185, 184)])
def test_kv_transfer_passes_at_expected_prefix(prompt_tokens: int, cached: int) -> None:
    guard = check_kv_transfer(cached_answer(prompt_tokens, cached), block_size=32)
    assert guard.ok is True
    assert guard.to_json() == {"ok": True, "evidence": guard.evidence}


def test_kv_transfer_fails_when_nothing_could_transfer() -> None:
    # a 32-token prompt leaves no whole block to load: the guard cannot prove a transfer
    assert check_kv_transfer(cached_answer(32, 0), block_size=32).ok is False


# --- guards: encoder_output / consumer_embeds ------------------------------------------------

HASH = "epd-e456d13150a50187998c5d612c086e23"


def encoded_trace(media_count: int = 1, metadata: dict | None = None) -> RequestTrace:
    metadata = {"image_grid_thw": [1, 16, 16]} if metadata is None else metadata
    return RequestTrace(
        request_id="r1",
        media_count=media_count,
        encoder_calls=[
            EncoderCall(
                url="http://127.0.0.1:1",
                positions=(0,),
                status=200,
                ec_transfer_params={HASH: {"item_indices": [0], "metadata": metadata}},
            )
        ],
        forwarded_part_types=["image_embeds"],
        metadata_only=[True],
    )


def test_encoder_output_fails_on_empty_hash_directory(tmp_path: Path) -> None:
    (tmp_path / HASH).mkdir()  # what a 0.32 consumer leaves behind on a miss
    guard = check_encoder_output(encoded_trace(), tmp_path)
    assert guard.ok is False
    assert f"no {EC_CACHE_FILE} for {HASH}" in guard.evidence


def test_encoder_output_fails_without_storage(tmp_path: Path) -> None:
    assert check_encoder_output(encoded_trace(), None).ok is False
    assert check_encoder_output(encoded_trace(), tmp_path / "missing").ok is False


def test_encoder_output_passes_when_cache_file_exists(tmp_path: Path) -> None:
    (tmp_path / HASH).mkdir()
    safetensors_header = b"\x02\x00\x00\x00\x00\x00\x00\x00{}"
    (tmp_path / HASH / "encoder_cache.safetensors").write_bytes(safetensors_header)
    guard = check_encoder_output(encoded_trace(), tmp_path)
    assert guard.ok is True
    assert guard.evidence == "1 media item(s); encoders reported 1 with metadata in 1 call(s)"


def test_encoder_output_fails_when_metadata_is_missing(tmp_path: Path) -> None:
    (tmp_path / HASH).mkdir()
    (tmp_path / HASH / EC_CACHE_FILE).write_bytes(b"x")
    guard = check_encoder_output(encoded_trace(metadata={}), tmp_path)
    assert guard.ok is False
    assert "encoders reported 0 with metadata" in guard.evidence


def test_encoder_output_fails_when_an_item_was_not_encoded(tmp_path: Path) -> None:
    (tmp_path / HASH).mkdir()
    (tmp_path / HASH / EC_CACHE_FILE).write_bytes(b"x")
    guard = check_encoder_output(encoded_trace(media_count=2), tmp_path)
    assert guard.ok is False
    assert guard.evidence.startswith("2 media item(s); encoders reported 1")


def test_encoder_output_counts_the_same_image_on_two_encoders(tmp_path: Path) -> None:
    (tmp_path / HASH).mkdir()
    (tmp_path / HASH / EC_CACHE_FILE).write_bytes(b"x")
    entry = {HASH: {"item_indices": [0], "metadata": {"image_grid_thw": [1, 16, 16]}}}
    trace = RequestTrace(
        request_id="r2",
        media_count=2,
        encoder_calls=[
            EncoderCall("http://127.0.0.1:1", (0,), 200, copy.deepcopy(entry)),
            EncoderCall("http://127.0.0.1:2", (1,), 200, copy.deepcopy(entry)),
        ],
        forwarded_part_types=["image_embeds", "image_embeds"],
        metadata_only=[True, True],
    )
    assert check_encoder_output(trace, tmp_path).ok is True


def test_consumer_embeds_guard() -> None:
    assert check_consumer_embeds(encoded_trace()).ok is True
    raw = encoded_trace()
    raw.forwarded_part_types, raw.metadata_only = ["image_url"], [False]
    guard = check_consumer_embeds(raw)
    assert guard.ok is False
    assert "image_url" in guard.evidence
    short = encoded_trace(media_count=2)
    assert check_consumer_embeds(short).ok is False


def test_check_transfers_picks_guards_per_topology(tmp_path: Path) -> None:
    trace = encoded_trace()
    result = cached_answer(89, 64)
    names = {
        name: [g.name for g in check_transfers(get_topology(name), trace, result, tmp_path, 32)]
        for name in ("baseline", "1E+1PD", "1P+1D", "1E+1P+1D")
    }
    assert names == {
        "baseline": [],
        "1E+1PD": ["encoder_output", "consumer_embeds"],
        "1P+1D": ["kv_transfer"],
        "1E+1P+1D": ["encoder_output", "consumer_embeds", "kv_transfer"],
    }
    text_only = RequestTrace(request_id="t", media_count=0)
    assert check_transfers(get_topology("1E+1PD"), text_only, result, tmp_path, 32) == []
