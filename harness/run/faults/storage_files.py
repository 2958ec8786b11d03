"""The storage files the faults rewrite: ExampleConnector's EC and KV safetensors, read and
replaced whole, and which KV files P wrote since a fault last looked."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

KV_FILE_SUFFIX = ".safetensors"  # ExampleConnector: <kv_storage>/<prompt hash>/<layer>.safetensors


def kv_file_stamps(kv_storage: Path) -> dict[Path, tuple[int, int]]:
    """Every KV file under `kv_storage` with its (mtime_ns, size): what changed since."""
    stamps = {}
    for path in kv_storage.rglob(f"*{KV_FILE_SUFFIX}") if kv_storage.is_dir() else ():
        try:
            stat = path.stat()
        except FileNotFoundError:
            continue
        stamps[path] = (stat.st_mtime_ns, stat.st_size)
    return stamps


class KvFilesSince:
    """The KV files P wrote (new or rewritten) since this was made or last settled: what a
    fault acting on one request's KV may touch, earlier prompts' files left alone."""

    def __init__(self, kv_storage: Path):
        self.kv_storage = kv_storage
        self._seen = kv_file_stamps(kv_storage)

    def fresh(self) -> list[Path]:
        current = kv_file_stamps(self.kv_storage)
        return sorted(path for path, stamp in current.items() if self._seen.get(path) != stamp)

    def settle(self) -> None:
        """Take the storage as it is now (after the fault acted) as seen."""
        self._seen = kv_file_stamps(self.kv_storage)


def write_bytes_atomic(path: Path, content: bytes) -> None:
    """Replace a file whole (a reader never sees it half-written)."""
    temporary = path.with_name(f".{path.name}.planted")
    temporary.write_bytes(content)
    os.replace(temporary, path)


def swap_tensor_files(paths: list[Path]) -> None:
    """Rotate the contents of safetensors files by one (2 files: a swap); shapes must agree."""
    from safetensors.torch import load_file, save_file

    contents = [load_file(path) for path in paths]
    layouts = [{k: (tuple(t.shape), t.dtype) for k, t in c.items()} for c in contents]
    if any(layout != layouts[0] for layout in layouts):
        raise ValueError(f"the items' tensors differ in shape or dtype: {layouts}")
    for n, path in enumerate(paths):
        temporary = path.with_name(f".{path.name}.planted")
        save_file(contents[(n + 1) % len(paths)], str(temporary))
        os.replace(temporary, path)


def rewrite_tensors(path: Path, transform: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Apply `transform` to every tensor of a safetensors file, keeping keys and metadata.

    Written to a temporary file and renamed over the original, so a reader never sees a
    half-written file (a truncated file would fail to load: an ERROR, not the planted MISMATCH).
    """
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    originals = load_file(path)
    tensors = {name: transform(tensor).contiguous() for name, tensor in originals.items()}
    for name, tensor in tensors.items():
        before = originals[name]
        if tensor.shape != before.shape or tensor.dtype != before.dtype:
            raise ValueError(
                f"{path}: {name} would change from {tuple(before.shape)} {before.dtype} to "
                f"{tuple(tensor.shape)} {tensor.dtype}; the consumer would reject the file"
            )
    temporary = path.with_name(f".{path.name}.planted")
    save_file(tensors, str(temporary), metadata=metadata)
    os.replace(temporary, path)
