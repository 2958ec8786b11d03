"""The fake vLLM refuses and dies where vLLM 0.32 does on a metadata-only media part
(scenarios/test_negative_checks.py pins those on real vLLM): an instance that is neither an
EC nor a KV consumer answers 400 naming `image_embeds`, and a consumer given a uuid no encoder
produced answers 500 and exits with code 0, its log holding the worker's assertion. Before,
the fake answered both with a 500 and lived on, so the negative checks failed on every fake GPU
night. Streamed, that consumer answers 200 and says the death in the stream, as vLLM's stream
generator does (before, the fake answered a streamed request with the unstreamed 500). Fakes
only: nothing here runs a model.
"""

from __future__ import annotations

import copy
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from harness.outcomes.stream import split_events
from harness.run.pool import TopologyPool
from harness.spec.platforms import CUDA
from harness.spec.prompts import SKELETON_PROMPTS, render_request
from harness.spec.topology import TOPOLOGIES, Role, ServingConfig
from harness.testing.fake_vllm import fake_run_settings

pytestmark = pytest.mark.process

# vLLM 0.32's worker assertion (vllm/v1/worker/utils.py) for an item with neither
# embeddings nor pixels: what scenarios/test_negative_checks.py looks for in the log.
MISSING_EMBEDDINGS_ASSERTION = "Expected number of multimodal embeddings to match number"
# EngineDeadError's message (vllm/v1/engine/exceptions.py).
ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."
DEATH_WAIT_S = 30.0


def nixl_pool(tmp_path: Path, fake: Path) -> TopologyPool:
    serving = ServingConfig(model=str(tmp_path / "model"), kv_connector="NixlConnector")
    settings = fake_run_settings(tmp_path, fake, serving, platform=CUDA, devices=(0, 1, 2))
    return TopologyPool(settings)


def metadata_only_image(uuid: str) -> dict:
    """The image prompt with its image as a metadata-only `image_embeds` part."""
    prompt = next(p for p in SKELETON_PROMPTS if p.name == "image")
    body = copy.deepcopy(render_request(prompt, "fake-model"))
    content = body["messages"][0]["content"]
    at = next(i for i, part in enumerate(content) if part.get("type") == "image_url")
    content[at] = {
        "type": "image_embeds",
        "image_embeds": {"image_grid_thw": [1, 16, 16]},
        "uuid": uuid,
    }
    return body


def post(url: str, body: dict) -> tuple[int | None, str]:
    status, _, text = post_reading_type(url, body)
    return status, text


def post_reading_type(url: str, body: dict) -> tuple[int | None, str, str]:
    """The answer's status, Content-Type and text (a connection that broke: None, "", why)."""
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.headers["Content-Type"], reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()
    except OSError as exc:
        return None, "", f"{type(exc).__name__}: {exc}"


def wait_for_exit(server) -> None:
    deadline = time.monotonic() + DEATH_WAIT_S
    while server.is_alive() and time.monotonic() < deadline:
        time.sleep(0.2)


def test_an_instance_that_is_no_consumer_refuses_a_metadata_only_image(
    tmp_path: Path, fake_vllm: Path, port_locks: Path
) -> None:
    """renderers/chat_utils.py: "You must set `--enable-mm-embeds` to input `image_embeds`",
    a VLLMValidationError, so HTTP 400; the instance serves on."""
    pool = nixl_pool(tmp_path, fake_vllm)
    try:
        session = pool.session(TOPOLOGIES["baseline"])
        url = next(i.url for i in session.instances if i.role is Role.BASELINE)
        status, text = post(url, metadata_only_image("never-encoded"))
        assert status == 400, text
        error = json.loads(text)["error"]
        assert error["message"] == (
            "You must set `--enable-mm-embeds` to input `image_embeds` (parameter=image_embeds)"
        )
        assert (error["type"], error["param"], error["code"]) == (
            "BadRequestError",
            "image_embeds",
            400,
        )
        assert session.dead_instance_report() is None
    finally:
        pool.close()


@pytest.mark.parametrize(
    "topology,role", [("1E+1PD", Role.PREFILL_DECODE), ("1E+1P+1D", Role.DECODE)]
)
def test_a_consumer_given_a_uuid_no_encoder_produced_answers_500_and_dies(
    tmp_path: Path, fake_vllm: Path, port_locks: Path, topology: str, role: Role
) -> None:
    """vLLM 0.32 accepts the part on an EC consumer (PD) or KV consumer (D), finds no
    embeddings and no pixels, and its engine core dies: the request's 500, then the API server
    exits with code 0."""
    pool = nixl_pool(tmp_path, fake_vllm)
    try:
        session = pool.session(TOPOLOGIES[topology])
        url = next(i.url for i in session.instances if i.role is role)
        status, text = post(url, metadata_only_image("never-encoded"))
        assert status == 500, text
        assert json.loads(text)["error"] == {
            "message": ENGINE_DEAD_MESSAGE,
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }  # EngineDeadError's, as create_error_response gives it
        server = session.server(role)
        wait_for_exit(server)
        assert not server.is_alive(), "the consumer lived on"
        assert server.exit_code == 0
        log = Path(server.command.log_path).read_text(errors="replace")
        assert MISSING_EMBEDDINGS_ASSERTION in log, log[-2000:]
    finally:
        pool.close()


def test_a_consumer_dying_on_a_streamed_request_answers_200_and_an_error_event(
    tmp_path: Path, fake_vllm: Path, port_locks: Path
) -> None:
    """The same death, the request streamed: vLLM 0.32's frontend answers 200 before the engine
    runs it (`create_chat_completion` returns the stream generator), and the generator turns the
    EngineDeadError into one error event (`chat_completion_stream_generator` in
    vllm/entrypoints/openai/chat_completion/serving.py, `create_streaming_error_response`), then
    `[DONE]`; the API server then exits with code 0. Before, the fake answered 500 as if the
    request were unstreamed."""
    pool = nixl_pool(tmp_path, fake_vllm)
    try:
        session = pool.session(TOPOLOGIES["1E+1P+1D"])
        url = next(i.url for i in session.instances if i.role is Role.DECODE)
        body = {**metadata_only_image("never-encoded"), "stream": True}
        status, content_type, text = post_reading_type(url, body)
        assert (status, content_type) == (200, "text/event-stream; charset=utf-8"), text
        events, rest = split_events(text.encode())
        assert rest == b"" and events[-1] == b"data: [DONE]", text
        assert [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]] == [
            {
                "error": {
                    "message": ENGINE_DEAD_MESSAGE,
                    "type": "InternalServerError",
                    "param": None,
                    "code": 500,
                }
            }
        ]
        server = session.server(Role.DECODE)
        wait_for_exit(server)
        assert not server.is_alive(), "the consumer lived on"
        assert server.exit_code == 0
    finally:
        pool.close()
