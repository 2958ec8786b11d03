"""The chat client's unstreamed requests: the body goes out as rendered, the answer is kept as the
server sent it, and an answer of another status than 200 raises with that status and body.

The server is a stand-in in this process (`harness.testing.fake_instance`); what real vLLM
answers is checked by the e2e scenarios.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from harness.serve.client import ChatClient, ChatHTTPError, RequestRefusedError, ServerFailedError
from harness.spec.prompts import sampling_fields
from harness.testing.fake_instance import FakeInstance, LoopThread, Reply

pytestmark = pytest.mark.process

BODY = {
    "model": "epd-model",
    "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    **sampling_fields(max_tokens=2),
}
# vLLM 0.32's answer, trimmed to what the parser reads and one field it does not: nothing more.
ANSWER = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "model": "epd-model",
    "prompt_token_ids": [1, 2, 3],
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "ab"},
            "finish_reason": "length",
            "token_ids": [7, 8],
            "logprobs": {
                "content": [
                    {"token": "token_id:7", "logprob": -0.1, "top_logprobs": []},
                    {"token": "token_id:8", "logprob": -0.2, "top_logprobs": []},
                ]
            },
        }
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    "kv_transfer_params": None,
}


class Instance:
    """One stand-in instance answering `reply` to every request."""

    def __init__(self) -> None:
        self.reply: Reply = Reply(ANSWER)
        self.fake = FakeInstance(lambda _body: self.reply, name="pd")


@pytest.fixture
def instance() -> Iterator[Instance]:
    loop = LoopThread()
    served = Instance()
    loop.run(served.fake.start())
    yield served
    loop.run(served.fake.stop())
    loop.close()


def send(url: str, body: dict[str, Any] = BODY) -> Any:
    client = ChatClient(url, timeout_s=10)
    try:
        return client.send(body, request_id="req-7")
    finally:
        client.close()


def test_the_body_goes_out_as_rendered_with_the_request_id(instance: Instance) -> None:
    body = {**BODY, "return_token_ids": True, "cache_salt": "s1"}
    send(instance.fake.url, body)
    assert instance.fake.bodies == [body]
    assert instance.fake.request_ids == ["req-7"]


def test_the_answer_is_kept_as_the_server_sent_it(instance: Instance) -> None:
    """Found when the openai client went: its models filled every field the server left out
    with null and dropped none, so the answer kept was not the server's."""
    reply = send(instance.fake.url)
    assert reply.result.raw == ANSWER
    assert (reply.result.prompt_token_ids, reply.result.token_ids) == ((1, 2, 3), (7, 8))
    assert reply.stream is None


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (400, RequestRefusedError),
        (404, RequestRefusedError),
        (500, ServerFailedError),
        (302, ServerFailedError),
    ],
)
def test_another_status_raises_with_it_and_the_body(
    instance: Instance, status: int, error: type[ChatHTTPError]
) -> None:
    """A refusal (4xx: the body says why) and a failure (5xx: the cause is in the body or the
    instance's log, so the fuzzer's signatures look past it) are told apart by their names.
    Any other status than 200 is no answer: a redirect (a proxy in the way, which httpx does
    not follow) is not parsed as one."""
    instance.reply = Reply({"error": {"message": "no such thing"}}, status=status)
    with pytest.raises(error) as raised:
        send(instance.fake.url)
    assert raised.value.status == status
    assert str(raised.value) == (
        f"Error code: {status} - " + json.dumps({"error": {"message": "no such thing"}})
    )


def test_an_answer_that_is_not_json_raises(instance: Instance) -> None:
    instance.reply = Reply(b"<html>proxy error</html>")
    with pytest.raises(ValueError):
        send(instance.fake.url)


def test_a_refused_stream_raises_like_an_unstreamed_request(instance: Instance) -> None:
    instance.reply = Reply({"message": "D exploded"}, status=503)
    with pytest.raises(ServerFailedError, match="Error code: 503"):
        send(instance.fake.url, {**BODY, "stream": True})


def test_a_client_does_not_import_the_openai_package() -> None:
    """Importing `openai` cost 1.6 CPU-s in every process that opened a client (an xdist
    worker, each CLI run), measured on a 2-core host; the client needs only httpx."""
    code = (
        "import sys; from harness.serve.client import ChatClient; "
        "ChatClient('http://127.0.0.1:9').close(); print('openai' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
