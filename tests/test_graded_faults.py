"""The graded faults on files laid out as vLLM 0.32's example connectors lay them out (no vLLM).

A threshold is only as good as the fault's strength: noise asked for at 5% of std must be 5%
of std (after the dtype's rounding), the same seed must plant the same noise, and no fault may
change a key, shape or dtype (the consumer would fail: an ERROR, not the planted MISMATCH).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.judge.guards import EC_CACHE_FILE
from harness.run.faults.by_name import fault_for
from harness.run.faults.ec_files import ec_noise, ec_swap_items, ec_zero_frame
from harness.run.faults.kv_files import kv_noise
from harness.run.faults.relayed import ec_video_grid
from harness.run.faults.tensors import add_relative_noise, relative_change, zero_frame_rows
from harness.serve import proxy_protocol as protocol

pytestmark = pytest.mark.model

HASH_A = "epd-aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
HASH_B = "epd-bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
VIDEO_HASH = "epd-vvvvvvvvvvvvvvvvvvvvvvvvvvvvvvvv"
# 8 frames of 224x224: grid [4, 16, 16] in 14-px patches, 4*8*8 = 256 rows after the 2x2 merge.
VIDEO_GRID = [4, 16, 16]
VIDEO_ROWS = 256
HIDDEN = 64


def write_ec(storage: Path, mm_hash: str, tensor: torch.Tensor) -> Path:
    path = storage / mm_hash / EC_CACHE_FILE
    path.parent.mkdir(parents=True)
    save_file({"ec_cache": tensor}, str(path))
    return path


def random_tensor(*shape: int, seed: int = 0, dtype=torch.float32, scale: float = 3.0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale + 0.5).to(dtype)


@pytest.mark.parametrize("fraction", [0.5, 0.05, 0.005])
def test_noise_has_the_requested_relative_strength_in_float32(fraction: float):
    original = random_tensor(256, HIDDEN)
    noisy = add_relative_noise(original, fraction, seed=1)
    measured = relative_change(original, noisy)
    assert abs(measured - fraction) / fraction < 0.03, f"asked {fraction}, planted {measured}"


@pytest.mark.parametrize("fraction", [0.5, 0.05])
def test_noise_keeps_its_strength_through_bf16_rounding(fraction: float):
    """bf16 keeps ~8 bits of mantissa (a step of ~0.4-0.8% of a value): 5% survives it."""
    original = random_tensor(256, HIDDEN, dtype=torch.bfloat16)
    noisy = add_relative_noise(original, fraction, seed=1)
    assert noisy.dtype == torch.bfloat16 and noisy.shape == original.shape
    measured = relative_change(original, noisy)
    assert abs(measured - fraction) / fraction < 0.1, f"asked {fraction}, planted {measured}"


def test_noise_is_deterministic_for_a_seed_and_differs_across_seeds():
    original = random_tensor(64, HIDDEN)
    first = add_relative_noise(original, 0.05, seed=7)
    assert torch.equal(first, add_relative_noise(original, 0.05, seed=7)), "same seed, other noise"
    assert not torch.equal(first, add_relative_noise(original, 0.05, seed=8)), "seed ignored"
    assert not torch.equal(first, original), "no noise added"


def test_ec_noise_rewrites_each_reported_file_keeping_key_shape_dtype(tmp_path: Path):
    originals = {
        HASH_A: random_tensor(64, HIDDEN, seed=1, dtype=torch.bfloat16),
        HASH_B: random_tensor(64, HIDDEN, seed=2, dtype=torch.bfloat16),
    }
    paths = {h: write_ec(tmp_path, h, t) for h, t in originals.items()}
    fault = ec_noise(tmp_path, 0.05, seed=3)
    fault.after_encode("req-1", {h: {"item_indices": [n]} for n, h in enumerate(originals)})

    assert sorted(fault.touched) == sorted(paths.values()) and not fault.problems, fault
    assert len(fault.effects) == 2 and "0.05 of std asked" in fault.effects[0], fault.effects
    for mm_hash, original in originals.items():
        loaded = load_file(paths[mm_hash])
        assert set(loaded) == {"ec_cache"}, sorted(loaded)
        tensor = loaded["ec_cache"]
        assert (tensor.shape, tensor.dtype) == (original.shape, original.dtype)
        measured = relative_change(original, tensor)
        assert 0.045 < measured < 0.055, f"{mm_hash}: planted {measured}"

    # The same seed on the same files plants the same noise (per file: seed and mm_hash).
    again_dir = tmp_path / "again"
    again = {h: write_ec(again_dir, h, t) for h, t in originals.items()}
    ec_noise(again_dir, 0.05, seed=3).after_encode("req-2", {h: {} for h in originals})
    for mm_hash in originals:
        assert torch.equal(
            load_file(again[mm_hash])["ec_cache"], load_file(paths[mm_hash])["ec_cache"]
        ), mm_hash
    noised = [load_file(paths[h])["ec_cache"] - originals[h] for h in originals]
    assert not torch.equal(noised[0], noised[1]), "both files got the same noise"


def write_kv(kv_storage: Path, prompt_hash: str, seed: int) -> Path:
    folder = kv_storage / prompt_hash
    folder.mkdir(parents=True)
    path = folder / "model.layers.0.self_attn.attn.safetensors"
    save_file({"kv_cache": random_tensor(2, 64, 2, 32, seed=seed, dtype=torch.bfloat16)}, str(path))
    return path


def test_kv_noise_touches_only_files_written_for_this_request(tmp_path: Path):
    older = write_kv(tmp_path, "prompt-old", seed=1)
    before_old = load_file(older)["kv_cache"]
    fault = kv_noise(tmp_path, 0.05, seed=0)  # made before the request: "old" is not its own

    fresh = write_kv(tmp_path, "prompt-new", seed=2)  # what P writes for this request
    before_new = load_file(fresh)["kv_cache"]
    fault.after_prefill("req-1", {})

    assert fault.touched == [fresh] and not fault.problems, fault
    assert torch.equal(load_file(older)["kv_cache"], before_old), "an older prompt's KV changed"
    after_new = load_file(fresh)["kv_cache"]
    assert after_new.shape == before_new.shape and after_new.dtype == before_new.dtype
    assert 0.04 < relative_change(before_new, after_new) < 0.06

    fault.after_prefill("req-2", {})  # P wrote nothing new: reported, never a silent pass
    assert fault.touched == [fresh] and len(fault.problems) == 1, fault
    assert "wrote no new" in fault.problems[0], fault.problems


def test_kv_noise_is_seeded_by_each_files_key(tmp_path: Path):
    """The same file key gets the same noise on every run (a repro reruns what the run
    planted), and two files of equal KV under other keys get other noise (a review left the
    key's part of the seed untested: noise of the seed alone passed)."""
    noised = {}
    for run in ("first", "second"):
        storage = tmp_path / run
        fault = kv_noise(storage, 0.05, seed=0)
        paths = [write_kv(storage, prompt, seed=1) for prompt in ("prompt-a", "prompt-b")]
        before = load_file(paths[0])["kv_cache"]
        fault.after_prefill("req-1", {})
        noised[run] = [load_file(path)["kv_cache"] - before for path in paths]
    assert torch.equal(noised["first"][0], noised["second"][0]), "a key's noise changed"
    assert not torch.equal(noised["first"][0], noised["first"][1]), "two keys got one noise"


def test_kv_noise_acts_on_a_file_p_wrote_again_after_the_storage_was_cleaned(tmp_path: Path):
    """A load cleans the KV storage between rounds; P then writes a prompt's file again at the
    same path. Written since the fault last looked, it is this request's: noised, not taken
    for a file P found stored (a "leftover" miss the fuzzer accepts, with D reading clean KV)."""
    import os
    import shutil

    fault = kv_noise(tmp_path, 0.05, seed=0)
    path = write_kv(tmp_path, "prompt-a", seed=1)
    fault.after_prefill("req-1", {})
    shutil.rmtree(path.parent)  # the round's cleaning
    assert write_kv(tmp_path, "prompt-a", seed=3) == path  # P writes it again
    stamp = path.stat()
    os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 1_000_000))
    before = load_file(path)["kv_cache"]
    fault.after_prefill("req-2", {})
    assert fault.touched == [path, path] and not fault.problems, fault
    assert 0.04 < relative_change(before, load_file(path)["kv_cache"]) < 0.06


def test_kv_noise_calls_a_miss_leftover_only_on_storage_it_noised_all_of(tmp_path: Path):
    """The fuzzer's shrink accepts a candidate kv-noise missed for leftover state (P found its
    prompt's KV stored), since D then read a file the fault noised as it would for this request
    on fresh servers. That holds only where the fault noised every stored file: with a file
    from before the fault, which it never touched, D may have read clean KV."""
    own = tmp_path / "own"
    fault = kv_noise(own, 0.05)
    write_kv(own, "prompt-a", seed=1)
    fault.after_prefill("req-1", {})
    fault.after_prefill("req-2", {})  # the same prefix: nothing new
    assert len(fault.problems) == 1 and fault.leftover == fault.problems, fault

    found = tmp_path / "found"
    write_kv(found, "prompt-old", seed=1)
    fault = kv_noise(found, 0.05)  # the storage was filled before the fault
    write_kv(found, "prompt-a", seed=2)
    fault.after_prefill("req-1", {})
    fault.after_prefill("req-2", {})
    assert len(fault.problems) == 1 and not fault.leftover, fault


def test_swap_items_really_swaps(tmp_path: Path):
    a = random_tensor(64, HIDDEN, seed=1, dtype=torch.bfloat16)
    b = random_tensor(64, HIDDEN, seed=2, dtype=torch.bfloat16)
    path_a, path_b = write_ec(tmp_path, HASH_A, a), write_ec(tmp_path, HASH_B, b)
    fault = ec_swap_items(tmp_path)
    fault.after_encode("req-1", {HASH_A: {"item_indices": [0]}, HASH_B: {"item_indices": [1]}})
    assert fault.touched == [path_a, path_b] and not fault.problems, fault
    assert torch.equal(load_file(path_a)["ec_cache"], b), "item A did not get B's embedding"
    assert torch.equal(load_file(path_b)["ec_cache"], a), "item B did not get A's embedding"
    assert not [p.name for p in path_a.parent.iterdir() if p != path_a], "temporary files left"


def test_a_swap_is_undone_before_a_later_request_reads_one_of_its_items(tmp_path: Path):
    a = random_tensor(64, HIDDEN, seed=1, dtype=torch.bfloat16)
    b = random_tensor(64, HIDDEN, seed=2, dtype=torch.bfloat16)
    path_a, path_b = write_ec(tmp_path, HASH_A, a), write_ec(tmp_path, HASH_B, b)
    fault = ec_swap_items(tmp_path)
    fault.after_encode("req-1", {HASH_A: {}, HASH_B: {}})
    fault.after_encode("req-2", {HASH_A: {}})  # image A alone: nothing to swap it with
    assert torch.equal(load_file(path_a)["ec_cache"], a), "A alone read B's swapped-in embedding"
    # Not acted on, yet the consumer's encoder cache may keep A's swapped embedding: outlived.
    assert fault.outlived == fault.problems and len(fault.problems) == 1, fault
    assert torch.equal(load_file(path_b)["ec_cache"], a), "B, not in req-2, was touched"
    fault.after_encode("req-3", {HASH_A: {}, HASH_B: {}})  # the pair again: swapped once, not back
    assert torch.equal(load_file(path_a)["ec_cache"], b) and torch.equal(
        load_file(path_b)["ec_cache"], a
    ), "the pair's second request did not see a single swap"
    assert not [p.name for p in path_a.parent.iterdir() if p != path_a], "temporary files left"


def test_a_swap_narrowed_to_the_first_request_is_undone_or_refused(tmp_path: Path):
    """`first_request_only` hands a later request's hook nothing, and the swap is put back by
    that hook: the swapped files stayed for every later request with one of the items, the
    fault acting beyond its request (found in review). Refused, or undone all the same."""
    from harness.run.faults.planted import first_request_only

    a = random_tensor(64, HIDDEN, seed=1, dtype=torch.bfloat16)
    b = random_tensor(64, HIDDEN, seed=2, dtype=torch.bfloat16)
    path_a = write_ec(tmp_path, HASH_A, a)
    write_ec(tmp_path, HASH_B, b)
    try:
        fault = first_request_only(ec_swap_items(tmp_path))
    except ValueError as refused:
        assert "back when a later request" in str(refused), refused
        return
    fault.after_encode("req-1", {HASH_A: {}, HASH_B: {}})
    fault.after_encode("req-2", {HASH_A: {}})  # a later request with image A
    assert torch.equal(load_file(path_a)["ec_cache"], a), "req-2 read B's swapped-in embedding"


def test_swap_items_refuses_unequal_shapes_and_single_items(tmp_path: Path):
    a = random_tensor(64, HIDDEN, seed=1)
    path_a = write_ec(tmp_path, HASH_A, a)
    write_ec(tmp_path, HASH_B, random_tensor(16, HIDDEN, seed=2))
    fault = ec_swap_items(tmp_path)
    fault.after_encode("req-1", {HASH_A: {}, HASH_B: {}})
    fault.after_encode("req-2", {HASH_A: {}})
    assert not fault.touched and len(fault.problems) == 2, fault
    assert "differ in shape" in fault.problems[0] and "swapping needs two" in fault.problems[1]
    assert not fault.outlived, "A was never swapped: nothing of the fault's can reach req-2"
    assert torch.equal(load_file(path_a)["ec_cache"], a), "a refused swap changed a file"


def test_zero_frame_zeroes_exactly_one_frames_rows():
    tensor = random_tensor(VIDEO_ROWS, HIDDEN, seed=4) + 10  # no zeros of its own
    for frame in range(VIDEO_GRID[0]):
        zeroed = zero_frame_rows(tensor, VIDEO_GRID[0], frame)
        zero_rows = (zeroed == 0).all(dim=1).nonzero().flatten().tolist()
        per_frame = VIDEO_ROWS // VIDEO_GRID[0]
        assert zero_rows == list(range(frame * per_frame, (frame + 1) * per_frame)), zero_rows
        kept = torch.ones(VIDEO_ROWS, dtype=torch.bool)
        kept[frame * per_frame : (frame + 1) * per_frame] = False
        assert torch.equal(zeroed[kept], tensor[kept]), "rows of other frames changed"
    with pytest.raises(ValueError, match="outside"):
        zero_frame_rows(tensor, VIDEO_GRID[0], VIDEO_GRID[0])
    with pytest.raises(ValueError, match="do not split"):
        zero_frame_rows(tensor[:255], VIDEO_GRID[0], 0)


def test_ec_zero_frame_reads_the_grid_from_the_encoders_metadata(tmp_path: Path):
    video = random_tensor(VIDEO_ROWS, HIDDEN, seed=5, dtype=torch.bfloat16) + 10
    path = write_ec(tmp_path, VIDEO_HASH, video)
    image_path = write_ec(tmp_path, HASH_A, random_tensor(64, HIDDEN))
    fault = ec_zero_frame(tmp_path, frame=2)
    fault.after_encode(
        "req-1",
        {
            VIDEO_HASH: {"item_indices": [0], "metadata": {"video_grid_thw": [VIDEO_GRID]}},
            HASH_A: {"item_indices": [0], "metadata": {"image_grid_thw": [[1, 16, 16]]}},
        },
    )
    assert fault.touched == [path] and not fault.problems, fault
    assert fault.effects == [f"zeroed rows 128-191 (frame 2 of 4) of ({VIDEO_ROWS}, {HIDDEN})"]
    zeroed = load_file(path)["ec_cache"]
    assert zeroed.dtype == video.dtype and zeroed.shape == video.shape
    assert (zeroed == 0).all(dim=1).nonzero().flatten().tolist() == list(range(128, 192))
    assert image_path not in fault.touched

    no_video = ec_zero_frame(tmp_path)
    no_video.after_encode("req-2", {HASH_A: {"metadata": {"image_grid_thw": [[1, 16, 16]]}}})
    assert not no_video.touched and "no video" in no_video.problems[0], no_video


def one_video_request() -> dict:
    """A chat request of one video and a line of text, as the proxy reads it."""
    return {
        "model": "m",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
                    {"type": "text", "text": "Describe."},
                ],
            }
        ],
    }


def test_video_grid_fault_reaches_the_consumer_body_with_the_same_size():
    """Planted in after_encode, the wrong grid is what the proxy's rewrite forwards."""
    request = one_video_request()
    media = protocol.collect_media(request)
    batches, _ = protocol.plan_encoder_batches(media, 1, 0)
    params = {VIDEO_HASH: {"item_indices": [0], "metadata": {"video_grid_thw": [VIDEO_GRID]}}}
    encoded = protocol.index_encoder_response(batches[0], params)  # before after_encode
    fault = ec_video_grid()
    fault.after_encode("req-1", params)  # as the proxy calls it
    assert not fault.problems and len(fault.touched) == 1, fault

    body = protocol.rewrite_for_consumer(request, media, encoded, params).body
    grid = body["messages"][0]["content"][0]["video_embeds"]["video_grid_thw"]
    assert grid == [[8, 8, 16]], grid
    t, h, w = grid[0]
    assert t * h * w == VIDEO_GRID[0] * VIDEO_GRID[1] * VIDEO_GRID[2], "the size changed"


def test_video_grid_fault_refuses_a_height_it_cannot_halve_keeping_the_merge_size():
    """Halving a grid height of 6 gives 3, which no 2x2 merge covers: the consumer would
    reject the grid (an ERROR, not the position error planted). Recorded as a problem."""
    params = {VIDEO_HASH: {"metadata": {"video_grid_thw": [[4, 6, 16]]}}}
    fault = ec_video_grid()
    fault.after_encode("req-1", params)
    assert not fault.touched and "not a multiple of 4" in fault.problems[0], fault
    assert params[VIDEO_HASH]["metadata"]["video_grid_thw"] == [[4, 6, 16]]


def test_fault_for_builds_the_graded_faults(tmp_path: Path):
    assert fault_for("ec-noise:0.05", tmp_path, None).after_encode is not None
    assert fault_for("kv-noise:0.5", None, tmp_path).after_prefill is not None
    assert fault_for("ec-swap-items", tmp_path, None).after_encode is not None
    assert fault_for("ec-zero-frame:1", tmp_path, None).after_encode is not None
    assert fault_for("ec-video-grid", tmp_path, None).after_encode is not None
    with pytest.raises(ValueError, match="needs a topology with P and D"):
        fault_for("kv-noise:0.05", tmp_path, None)
    with pytest.raises(ValueError, match="needs a topology with an encoder"):
        fault_for("ec-noise:0.05", None, tmp_path)


def test_fault_for_plants_the_strength_its_name_gives(tmp_path: Path):
    """`--plant-fault kv-noise:0.5` must plant 0.5, not some default: the graded self-test's
    ladder reads a threshold off the strength each rung names."""
    ec, kv = tmp_path / "ec", tmp_path / "kv"
    kv_fault = fault_for("kv-noise:0.5", None, kv)
    write_kv(kv, "prompt-new", seed=2)
    kv_fault.after_prefill("req-1", {})
    assert kv_fault.effects[0].startswith("noise 0.5 of std asked"), kv_fault.effects

    write_ec(ec, HASH_A, random_tensor(64, HIDDEN, seed=1))
    ec_fault = fault_for("ec-noise:0.3", ec, None)
    ec_fault.after_encode("req-1", {HASH_A: {}})
    assert ec_fault.effects[0].startswith("noise 0.3 of std asked"), ec_fault.effects

    write_ec(ec, VIDEO_HASH, random_tensor(VIDEO_ROWS, HIDDEN, seed=5) + 10)
    frame = fault_for("ec-zero-frame:2", ec, None)
    frame.after_encode("req-1", {VIDEO_HASH: {"metadata": {"video_grid_thw": [VIDEO_GRID]}}})
    assert frame.effects == [f"zeroed rows 128-191 (frame 2 of 4) of ({VIDEO_ROWS}, {HIDDEN})"]


def test_video_faults_act_on_an_ec_items_answer(tmp_path: Path):
    """vLLM 0.29 answers `{"ec_items": [{"mm_hash": h, "video_grid_thw": ...}]}` (the grid
    beside the key, no "metadata"): ec-zero-frame must find the video's grid and file, and
    ec-video-grid's wrong grid must reach the consumer's body through the proxy's reading of
    that answer (found in review: both acted on nothing on 0.29)."""
    from harness.spec.generations import GENERATIONS_BY_NAME

    ec_items = GENERATIONS_BY_NAME["ec-items"]
    path = write_ec(tmp_path, VIDEO_HASH, random_tensor(VIDEO_ROWS, HIDDEN, seed=5) + 10)
    zero = ec_zero_frame(tmp_path, frame=1)
    zero.after_encode(
        "req-1", {"ec_items": [{"mm_hash": VIDEO_HASH, "video_grid_thw": VIDEO_GRID}]}
    )
    assert zero.touched == [path] and not zero.problems, zero

    request = one_video_request()
    media = protocol.collect_media(request)
    batches, _ = protocol.plan_encoder_batches(media, 1, 0, ec_items)
    answer = {"ec_items": [{"mm_hash": VIDEO_HASH, "video_grid_thw": [VIDEO_GRID]}]}
    merged = protocol.merge_encoder_params([answer], ec_items)
    grid = ec_video_grid()
    grid.after_encode("req-2", merged)  # as the proxy calls it, before reading the answer
    assert not grid.problems and len(grid.touched) == 1, grid
    encoded = protocol.index_encoder_response(batches[0], answer, ec_items)
    assert encoded[0].metadata["video_grid_thw"] == [[8, 8, 16]], encoded
