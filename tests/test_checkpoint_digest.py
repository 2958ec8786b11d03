"""The checkpoint digest streams the weights and hashes a checkpoint once per process, without
ever serving a digest for files that changed; its value is the whole-file computation's.

The checkpoints here are laid out like the Hugging Face cache (the snapshot's files symlinks to
blobs), with sparse weights: large on disk, cheap to write.
"""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import pytest
from digest_reference import whole_file_digest

from fixtures.checkpoint_digest import model_digest

pytestmark = pytest.mark.unit

WEIGHTS_BYTES = 64 << 20
MEMORY_BOUND_BYTES = 8 << 20


def hf_cache_checkpoint(root: Path, weights_bytes: int = 4096) -> Path:
    """A snapshot directory of symlinks to blobs, as huggingface_hub's snapshot_download leaves."""
    blobs, snapshot = root / "blobs", root / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (blobs / "config").write_text(
        json.dumps({"model_type": "qwen2_5_vl", "transformers_version": "5.19.0"})
    )
    with open(blobs / "weights", "wb") as weights:
        weights.truncate(weights_bytes)
    (snapshot / "config.json").symlink_to(blobs / "config")
    (snapshot / "model.safetensors").symlink_to(blobs / "weights")
    return snapshot


def test_weights_are_hashed_in_chunks_to_the_same_digest(tmp_path: Path) -> None:
    snapshot = hf_cache_checkpoint(tmp_path, WEIGHTS_BYTES)
    expected = whole_file_digest(snapshot)

    tracemalloc.start()
    try:
        digest = model_digest(snapshot)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert digest == expected
    assert peak < MEMORY_BOUND_BYTES, f"{peak} bytes allocated for {WEIGHTS_BYTES} of weights"


def test_an_unchanged_checkpoint_is_not_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snapshot = hf_cache_checkpoint(tmp_path)
    first = model_digest(snapshot)
    opened: list[Path] = []
    real_open = Path.open

    def spying_open(self: Path, *args, **kwargs):
        opened.append(self)
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", spying_open)
    assert model_digest(snapshot) == first
    assert opened == []


def test_a_rewritten_file_is_hashed_again(tmp_path: Path) -> None:
    snapshot = hf_cache_checkpoint(tmp_path)
    before = model_digest(snapshot)
    weights = tmp_path / "blobs" / "weights"
    status = weights.stat()
    with open(weights, "r+b") as handle:
        handle.write(b"\x01")  # same size, same inode
    # Two writes within one tick of the file system's clock share an mtime: a later one stands
    # for the write a cached digest must notice.
    os.utime(weights, ns=(status.st_atime_ns, status.st_mtime_ns + 1_000_000_000))

    after = model_digest(snapshot)
    assert after != before
    assert after == whole_file_digest(snapshot)


def test_a_replaced_file_is_hashed_again_even_with_its_size_and_mtime(tmp_path: Path) -> None:
    snapshot = hf_cache_checkpoint(tmp_path)
    before = model_digest(snapshot)
    config = tmp_path / "blobs" / "config"
    status = config.stat()
    replacement = tmp_path / "blobs" / "config.new"
    replacement.write_text(config.read_text().replace("qwen2_5_vl", "qwen2_5_VL"))
    os.utime(replacement, ns=(status.st_atime_ns, status.st_mtime_ns))
    os.replace(replacement, config)  # a new inode, as a download that finishes writes it

    after = model_digest(snapshot)
    assert after != before
    assert after == whole_file_digest(snapshot)


def test_a_symlink_pointed_at_another_blob_is_hashed_again(tmp_path: Path) -> None:
    snapshot = hf_cache_checkpoint(tmp_path)
    before = model_digest(snapshot)
    weights = tmp_path / "blobs" / "weights"
    other = tmp_path / "blobs" / "other-weights"
    other.write_bytes(b"\x02" * weights.stat().st_size)
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(other)

    after = model_digest(snapshot)
    assert after != before
    assert after == whole_file_digest(snapshot)
