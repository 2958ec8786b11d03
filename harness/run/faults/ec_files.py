"""Faults on the EC files between encoder and consumer (ExampleConnector's EC storage, one
`<mm_hash>/` directory per media item): corrupted, noised, swapped between items, a video
frame zeroed. Each acts after the encoders answered and before the consumer is asked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.judge.guards import EC_CACHE_FILE
from harness.run.faults.encoded import encoded_items
from harness.run.faults.planted import PlantedFault
from harness.run.faults.storage_files import swap_tensor_files, write_bytes_atomic
from harness.run.faults.tensors import (
    content_seeded_noise,
    flip_away_from_zero,
    zero_frame_transform,
)
from harness.run.faults.video_grid import video_grid

# Why the EC file faults cannot act on one request alone (`first_request_only`).
EC_FILE_OF_EVERY_REQUEST_WITH_ITS_ITEM = (
    "an EC file is the media item's (<mm_hash>/), not the request's, and the fault leaves it "
    "rewritten: every request with the same item, in flight or later (the encoder finds the "
    "file and writes it no more), would read it too"
)


def corrupt_ec_files(ec_storage: Path) -> PlantedFault:
    """After the encoders answered, corrupt the EC file of every mm_hash they reported.

    The file keeps its keys, shapes and dtypes, so the consumer loads it without complaint;
    only the values are wrong, as a broken transfer or a stale cache would make them.
    """
    fault = PlantedFault(not_one_request=EC_FILE_OF_EVERY_REQUEST_WITH_ITS_ITEM)

    def after_encode(request_id: str, ec_transfer_params: dict[str, Any]) -> None:
        hashes = list(encoded_items(ec_transfer_params))
        if not hashes:
            fault.problems.append(f"{request_id}: the encoders reported no mm_hash")
        for mm_hash in hashes:
            fault.rewrite(request_id, ec_storage / mm_hash / EC_CACHE_FILE, flip_away_from_zero)

    fault.after_encode = after_encode
    return fault


def ec_noise(ec_storage: Path, fraction: float, seed: int = 0) -> PlantedFault:
    """After the encoders answered, add Gaussian noise of `fraction` x each EC tensor's std.

    Seeded per tensor (`seed` and the embeddings' own bytes), so a rerun plants the very same
    noise, and the same image gets the same noise whatever key the EPD protocol gives its file:
    seeded by the mm_hash, the proxy's upstream cache key (the URL, not the URL and kwargs)
    re-rolled every rung, and 1E+1PD's 5% rung then first differed at token 3. Noise much
    below the dtype's resolution (bf16: ~0.4% of a value) is partly rounded away: `effects`
    records the relative std really added, file by file.
    """
    fault = PlantedFault(not_one_request=EC_FILE_OF_EVERY_REQUEST_WITH_ITS_ITEM)

    def after_encode(request_id: str, ec_transfer_params: dict[str, Any]) -> None:
        hashes = list(encoded_items(ec_transfer_params))
        if not hashes:
            fault.problems.append(f"{request_id}: the encoders reported no mm_hash")
        for mm_hash in hashes:
            path = ec_storage / mm_hash / EC_CACHE_FILE
            fault.rewrite(request_id, path, content_seeded_noise(fraction, seed, fault))

    fault.after_encode = after_encode
    return fault


# Why the swap cannot act on one request alone (`first_request_only`).
SWAP_PUT_BACK_BY_LATER_REQUESTS = (
    "ec-swap-items puts a swapped file back when a later request reports its item, and "
    "first_request_only runs no later request's hook: the swap would stay for every request "
    "with one of the items"
)


def ec_swap_items(ec_storage: Path) -> PlantedFault:
    """After the encoders answered, the EC files of the request's items swap places.

    With two images each gets the other's embedding (with more, every item gets the next one's).
    The items must have equal shapes (same image size): otherwise the consumer would reject the
    file (an ERROR, not the MISMATCH this fault is for), so a mismatch is reported as a problem.

    The fault belongs to the request: a swapped file stays in the storage, and a later request
    with one of those items (which the encoder need not write again) would read the other's
    embedding. So each item's original file is kept, and put back when a later request reports
    that item, before anything else. What this cannot undo: the consumer's own encoder cache
    (vLLM keeps a finished request's embeddings and reuses them by mm_hash), so a later request
    with one of the images may still get the swapped embedding from memory. Such a request,
    which the fault does not act on (one distinct item), is recorded as `outlived`.
    """
    fault = PlantedFault(not_one_request=SWAP_PUT_BACK_BY_LATER_REQUESTS)
    originals: dict[Path, bytes] = {}  # a swapped file's content before its first swap
    swapped: set[str] = set()  # the mm_hashes of every item swapped so far

    def after_encode(request_id: str, ec_transfer_params: dict[str, Any]) -> None:
        hashes = list(encoded_items(ec_transfer_params))
        for path in [ec_storage / h / EC_CACHE_FILE for h in hashes]:
            if path in originals:
                write_bytes_atomic(path, originals.pop(path))
        if len(hashes) < 2:
            problem = (
                f"{request_id}: {len(hashes)} distinct media item(s); swapping needs two or more"
            )
            if swapped & set(hashes):
                problem += (
                    "; swapped for an earlier request (the consumer's encoder cache may keep"
                    " that embedding)"
                )
                fault.outlived.append(problem)
            fault.problems.append(problem)
            return
        paths = [ec_storage / h / EC_CACHE_FILE for h in hashes]
        try:
            before = {path: path.read_bytes() for path in paths}
            swap_tensor_files(paths)
        except Exception as exc:  # noqa: BLE001 - reported through `problems`
            fault.problems.append(
                f"{request_id}: swapping {len(paths)} EC files: {type(exc).__name__}: {exc}"
            )
            return
        originals.update(before)
        swapped.update(hashes)
        fault.touched += paths
        fault.effects.append(f"rotated the EC files of {', '.join(hashes)} by one")

    fault.after_encode = after_encode
    return fault


def ec_zero_frame(ec_storage: Path, frame: int = 0) -> PlantedFault:
    """After the encoders answered, zero one temporal frame of every video's EC embedding.

    How rows map to frames (Qwen2.5-VL, checked against the published grid): the encoder output
    of a video is `[grid_t * (grid_h / m) * (grid_w / m), hidden]` with m the spatial merge size
    (2), rows ordered frame-major: `grid_t` blocks of `(grid_h / m) * (grid_w / m)` rows each.
    One grid_t step is one temporal patch, i.e. a pair of input frames (temporal_patch_size 2):
    an 8-frame 224x224 video has grid [4, 16, 16], 256 rows, 64 per frame pair. The encoder
    publishes the grid as `video_grid_thw` in its metadata, which is where it is read from; a
    row count that does not divide by grid_t is reported as a problem.
    """
    fault = PlantedFault(not_one_request=EC_FILE_OF_EVERY_REQUEST_WITH_ITS_ITEM)

    def after_encode(request_id: str, ec_transfer_params: dict[str, Any]) -> None:
        items = encoded_items(ec_transfer_params)
        videos = {h: video_grid(e) for h, e in items.items() if video_grid(e)}
        if not videos:
            fault.problems.append(
                f"{request_id}: no video among the encoded items ({len(items)} item(s))"
            )
        for mm_hash, grid in videos.items():
            path = ec_storage / mm_hash / EC_CACHE_FILE
            fault.rewrite(request_id, path, zero_frame_transform(grid[0], frame, fault))

    fault.after_encode = after_encode
    return fault
