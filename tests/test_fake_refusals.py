"""The fake vLLM refuses and dies where vLLM 0.32 does on a metadata-only media part
(scenarios/test_negative_checks.py pins those on real vLLM): an instance that is neither an
EC nor a KV consumer answers 400 naming `image_embeds`, and a consumer given a uuid no encoder
produced answers 500 and exits with code 0, its log holding the worker's assertion. Before,
the fake answered both with a 500 and lived on, so the negative checks failed on every fake GPU
night. Fakes only: nothing here runs a model.
"""

from __future__ import annotations

import copy
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from harness.run.pool import TopologyPool
from harness.spec.platforms import CUDA
from harness.spec.prompts import SKELETON_PROMPTS, render_request
from harness.spec.topology import TOPOLOGIES, Role, ServingConfig
from harness.testing.fake_vllm import fake_run_settings

pytestmark = pytest.mark.process

# vLLM 0.32's worker assertion (vllm/v1/worker/utils.py) for an item with neither
# embeddings nor pixels: what scenarios/test_negative_checks.py looks for in the log.
MISSING_EMBEDDINGS_ASSERTION = "Expected number of multimodal embeddings to match number"
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
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return None, f"{type(exc).__name__}: {exc}"


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
            "message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }  # EngineDeadError's, as create_error_response gives it
        server = session.server(role)
        deadline = time.monotonic() + DEATH_WAIT_S
        while server.is_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not server.is_alive(), "the consumer lived on"
        assert server.exit_code == 0
        log = Path(server.command.log_path).read_text(errors="replace")
        assert MISSING_EMBEDDINGS_ASSERTION in log, log[-2000:]
    finally:
        pool.close()
