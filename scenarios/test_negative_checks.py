"""Only EC and KV consumers accept image parts that carry no embedding tensor.

The proxy's rewrite sends consumers `{"type": "image_embeds", "image_embeds": {<grid
metadata>}, "uuid": mm_hash}`: placeholder sizes, no tensor. vLLM 0.32 accepts that only where
it derives `allow_missing_mm_embeddings` (EC consumer or KV consumer); D rejecting it was a real
bug (failure mode 1, fixed by #52697), and an instance that accepted it everywhere would make a
harness blind to embeddings that never arrived. So, with plain HTTP straight to one instance:

- the monolithic baseline must answer 4xx, naming the missing embedding field;
- a PD (EC consumer) and a D (KV consumer) must answer 200, and - so that acceptance means
  something - with the prompt ids and tokens of the proxied flow whose encoder produced the
  uuid (equal prompt ids: the placeholders were sized right; equal tokens: the embeddings or
  KV behind the uuid were really used);
- a uuid no encoder ever produced is accepted too (no 4xx), and then, in vLLM 0.32, kills the
  consumer: its worker asserts `Expected number of multimodal embeddings to match number of
  input items: 1, but got len(mm_embeddings)=0`, the request gets HTTP 500 and the API server
  exits (with code 0). One bad request takes a PD or a D down. Pinned, so that a change in
  vLLM shows up here; the same assertion as failure mode 14 (media in D's recomputed tail).

Every class runs on the session's running topology (harness.testing.collection); the checks that
kill an instance run last in their topology's group. None of this is marked `ci`.
"""

from __future__ import annotations

import copy
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harness.judge.compare import compare_results
from harness.judge.guards import EC_CACHE_FILE, expected_kv_prefix
from harness.outcomes.chat import ChatResult, parse_chat_response
from harness.outcomes.outcome import Outcome
from harness.serve.proxy_protocol import (
    EncoderBatch,
    build_encoder_request,
    build_prefill_request,
    collect_media,
)
from harness.serve.session import TopologySession
from harness.spec.topology import Role

pytestmark = pytest.mark.e2e

PROMPT = "image"  # one 224x224 image, then more than a KV block of text
GRID_224 = [1, 16, 16]  # image_grid_thw of a 224x224 image (patch 14)
NEVER_ENCODED_UUID = "negative-check-never-encoded-0000000000000000"
DIRECT_TIMEOUT_S = 120.0
# vLLM 0.32's worker assertion when an item has neither embeddings nor pixels.
MISSING_EMBEDDINGS_ASSERTION = "Expected number of multimodal embeddings to match number"
DEATH_WAIT_S = 30.0
# Requests go to 127.0.0.1 directly: a CI runner's HTTP(S)_PROXY must not relay them.
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True)
class Answer:
    """One HTTP exchange with one instance, kept whole for assertion messages."""

    url: str
    status: int | None  # None: no HTTP answer at all (refused, reset, timed out)
    text: str
    seconds: float

    def json(self) -> dict[str, Any]:
        return json.loads(self.text)

    def __str__(self) -> str:
        return f"POST {self.url} -> {self.status} in {self.seconds:.1f}s: {self.text[:1500]}"


def post_chat(base_url: str, body: dict[str, Any], timeout_s: float = DIRECT_TIMEOUT_S) -> Answer:
    """POST a chat body to one instance; never raises for an HTTP or network failure."""
    url = f"{base_url}/v1/chat/completions"
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    started = time.monotonic()
    try:
        with DIRECT.open(request, timeout=timeout_s) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode(errors="replace")
    except OSError as exc:  # refused, reset, timed out
        status, text = None, f"{type(exc).__name__}: {exc}"
    return Answer(url, status, text, time.monotonic() - started)


def metadata_only(body: dict[str, Any], uuid: str, metadata: dict[str, Any]) -> dict[str, Any]:
    """The rendered body with its image replaced by a metadata-only `image_embeds` part.

    Written here, not taken from the proxy, so the check does not depend on the code it guards.
    """
    body = copy.deepcopy(body)
    content = body["messages"][0]["content"]
    images = [i for i, part in enumerate(content) if part.get("type") == "image_url"]
    assert len(images) == 1, f"expected one image part in the prompt, got {content}"
    content[images[0]] = {"type": "image_embeds", "image_embeds": metadata, "uuid": uuid}
    return body


def assert_same_answer(reference: ChatResult, answer: Answer, what: str) -> ChatResult:
    """`answer` is a 200 whose prompt ids and tokens equal the proxied flow's."""
    assert answer.status == 200, f"{what} was not accepted: {answer}"
    result = parse_chat_response(answer.json())
    comparison = compare_results(reference, result)
    assert comparison.exact, f"{what} answered differently from the proxied flow:\n" + (
        comparison.describe()
    )
    return result


@dataclass
class DirectChecks:
    """Requests straight to one instance of a running topology, beside its proxied flow."""

    session: TopologySession

    def url(self, role: Role) -> str:
        return next(spec.url for spec in self.session.instances if spec.role is role)

    def proxied(self, body: dict[str, Any]) -> tuple[Outcome, str, dict[str, Any]]:
        """The full proxied flow for one single-image body: outcome, mm_hash, its metadata."""
        outcome = self.session.send(PROMPT, body)
        assert outcome.result is not None and outcome.taps is not None, (
            f"the proxied flow failed, nothing to compare with: {outcome.error}"
        )
        # What the encoders answered, as their taps saw it (whichever proxy served).
        encoders = [r for r in outcome.taps if r.role == Role.ENCODER.value]
        entries = {
            mm_hash: entry
            for record in encoders
            for mm_hash, entry in (record.ec_transfer_params or {}).items()
        }
        assert len(entries) == 1 and all(e.get("metadata") for e in entries.values()), (
            f"expected one encoded image with metadata: {[r.to_json() for r in encoders]}"
        )
        [(mm_hash, entry)] = entries.items()
        return outcome, mm_hash, entry["metadata"]

    def death_after(self, answer: Answer) -> str | None:
        """The first dead instance's report, waiting up to DEATH_WAIT_S for one to die.

        An EngineCore that failed takes its API server down a moment after the 500.
        """
        deadline = time.monotonic() + DEATH_WAIT_S
        while (dead := self.session.dead_instance_report()) is None:
            if time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        print(f"[negative] {answer}\n[negative] afterwards: {dead or 'every instance alive'}")
        return dead


def assert_killed_by_missing_embeddings(live: DirectChecks, role: Role, answer: Answer) -> None:
    """Accepted by the frontend (no 4xx), then fatal to the engine: vLLM 0.32's behaviour."""
    spec = next(s for s in live.session.instances if s.role is role)
    dead = live.death_after(answer)
    changed = "vLLM's handling of a uuid nothing was stored for changed: update notes and test"
    assert answer.status is None or not 400 <= answer.status < 500, (
        f"{spec.name} rejected a metadata-only part as invalid: {answer}"
    )
    assert answer.status == 500, f"{changed}; {spec.name} answered {answer}"
    assert dead is not None and spec.name in dead, (
        f"{changed}; expected {spec.name} to die, dead instance report: {dead}"
    )
    log = Path(live.session.stats[spec.name].log_path).read_text(errors="replace")
    assert MISSING_EMBEDDINGS_ASSERTION in log, (
        f"{changed}; {spec.name} died without the missing-embeddings assertion:\n{dead}"
    )


@pytest.fixture
def baseline_topology(epd_live) -> DirectChecks:
    return DirectChecks(epd_live("baseline").session)


@pytest.fixture
def pd_topology(epd_live) -> DirectChecks:
    return DirectChecks(epd_live("1E+1PD").session)


@pytest.fixture
def epd_topology(epd_live) -> DirectChecks:
    return DirectChecks(epd_live("1E+1P+1D").session)


@pytest.mark.epd_topology("baseline")
class TestBaselineRejects:
    def test_baseline_rejects_a_metadata_only_image(self, epd_sweep, baseline_topology):
        """vLLM 0.32 answers 400 "You must set `--enable-mm-embeds` to input `image_embeds`".

        A baseline refuses embedding parts altogether; one started with --enable-mm-embeds
        would refuse the missing tensor instead ("The data should contain the fields: ...").
        Either message names `image_embeds`.
        """
        body = metadata_only(
            epd_sweep.bodies[PROMPT], NEVER_ENCODED_UUID, {"image_grid_thw": GRID_224}
        )
        answer = post_chat(baseline_topology.url(Role.BASELINE), body)
        print(f"[negative] baseline: {answer}")
        assert answer.status is not None and 400 <= answer.status < 500, (
            f"the monolithic baseline must reject an image without embeddings: {answer}"
        )
        assert "image_embeds" in answer.text, (
            f"the rejection does not name the missing embedding field: {answer}"
        )


@pytest.mark.epd_topology("1E+1PD")
class TestPrefillDecodeAccepts:
    """1E+1PD: the PD is an EC consumer."""

    def test_pd_answers_a_metadata_only_image_like_the_proxied_flow(
        self, epd_sweep, pd_topology: DirectChecks
    ):
        live = pd_topology
        outcome, mm_hash, grid = live.proxied(epd_sweep.bodies[PROMPT])
        pd_url = live.url(Role.PREFILL_DECODE)

        direct = post_chat(pd_url, metadata_only(epd_sweep.bodies[PROMPT], mm_hash, grid))
        assert_same_answer(outcome.result, direct, f"PD with the proxied flow's uuid {mm_hash}")

        # The PD has now served that uuid twice and may answer from its own caches. A uuid the
        # encoder produced for a direct request is one the PD has never seen: it can only
        # answer right by loading the encoder's file.
        fresh = f"negative-check-{time.time_ns()}"
        encoder_body = encoder_request(epd_sweep.bodies[PROMPT], fresh)
        encoder = post_chat(live.url(Role.ENCODER), encoder_body)
        assert encoder.status == 200, f"the encoder did not encode {fresh}: {encoder}"
        params = encoder.json().get("ec_transfer_params") or {}
        ec_file = live.session.ec_storage / fresh / EC_CACHE_FILE
        assert fresh in params and ec_file.is_file(), (
            f"no EC entry/file for {fresh}: params {params}, file exists {ec_file.is_file()}"
        )
        direct = post_chat(pd_url, metadata_only(epd_sweep.bodies[PROMPT], fresh, grid))
        assert_same_answer(outcome.result, direct, f"PD with the never-seen uuid {fresh}")

    @pytest.mark.epd_ends_session
    def test_pd_accepts_then_dies_on_a_uuid_no_encoder_produced(
        self, epd_sweep, pd_topology: DirectChecks
    ):
        """Last in its group (it kills the PD): no EC file to load and no pixels to encode."""
        body = metadata_only(
            epd_sweep.bodies[PROMPT], NEVER_ENCODED_UUID, {"image_grid_thw": GRID_224}
        )
        answer = post_chat(pd_topology.url(Role.PREFILL_DECODE), body)
        assert_killed_by_missing_embeddings(pd_topology, Role.PREFILL_DECODE, answer)


@pytest.mark.epd_topology("1E+1P+1D")
class TestDecodeAccepts:
    """1E+1P+1D: D is a KV consumer without any EC configuration."""

    # Drives D without P's kv_transfer_params: only ExampleConnector's shared files reach it so.
    @pytest.mark.kv_connector("example")
    def test_d_answers_a_metadata_only_image_like_the_proxied_flow(
        self, epd_sweep, epd_topology: DirectChecks
    ):
        live = epd_topology
        body = epd_sweep.bodies[PROMPT]
        outcome, mm_hash, grid = live.proxied(body)
        direct = post_chat(live.url(Role.DECODE), metadata_only(body, mm_hash, grid))
        result = assert_same_answer(outcome.result, direct, f"D with the flow's uuid {mm_hash}")
        print(
            f"[negative] D, flow's uuid: cached_tokens={result.cached_tokens} "
            f"of {len(result.prompt_token_ids)} prompt tokens"
        )

        # D has just served that prompt and may answer from its local prefix cache. Under a
        # fresh uuid, driven E -> P -> D by hand, D can only answer right through the connector.
        fresh = f"negative-check-{time.time_ns()}"
        encoder = post_chat(live.url(Role.ENCODER), encoder_request(body, fresh))
        assert encoder.status == 200, f"the encoder did not encode {fresh}: {encoder}"
        consumer_body = metadata_only(body, fresh, grid)
        prefill = post_chat(live.url(Role.PREFILL), build_prefill_request(consumer_body))
        assert prefill.status == 200, f"P did not prefill {fresh}: {prefill}"
        direct = post_chat(live.url(Role.DECODE), consumer_body)
        result = assert_same_answer(outcome.result, direct, f"D with the fresh uuid {fresh}")
        block_size = live.session.settings.serving.block_size
        expected = expected_kv_prefix(len(result.prompt_token_ids), block_size)
        assert result.cached_tokens is not None and result.cached_tokens >= expected, (
            f"D reported cached_tokens={result.cached_tokens}, expected >= {expected}: "
            "did it load P's KV at all?"
        )
        print(
            f"[negative] D, fresh uuid: cached_tokens={result.cached_tokens} "
            f"of {len(result.prompt_token_ids)} prompt tokens"
        )

    @pytest.mark.epd_ends_session
    def test_d_accepts_then_dies_on_a_uuid_no_encoder_produced(
        self, epd_sweep, epd_topology: DirectChecks
    ):
        """Last in its group (it kills D): no KV for this prompt, no embeddings, no pixels."""
        body = metadata_only(
            epd_sweep.bodies[PROMPT], NEVER_ENCODED_UUID, {"image_grid_thw": GRID_224}
        )
        answer = post_chat(epd_topology.url(Role.DECODE), body)
        assert_killed_by_missing_embeddings(epd_topology, Role.DECODE, answer)


def encoder_request(body: dict[str, Any], uuid: str) -> dict[str, Any]:
    """What the proxy would send an encoder for the body's image, under a uuid of our choice."""
    tagged = copy.deepcopy(body)
    [image] = [p for p in tagged["messages"][0]["content"] if p.get("type") == "image_url"]
    image["uuid"] = uuid  # a client-given uuid is what the encoder keys the item by
    media = collect_media(tagged)
    return build_encoder_request(tagged, media, EncoderBatch(0, (0,)))
