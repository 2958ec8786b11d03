"""A vLLM general plugin that plants Gaussian noise on the KV blocks D received over NIXL.

Under NixlConnector P's KV never touches a file: D reads it from P's memory over UCX into its own
KV cache, so the graded KV fault of ExampleConnector (noise on the files between P and D) has no
NIXL form from outside vLLM. This plugin does it from inside D: loaded by vLLM's plugin loader
(entry point group `vllm.general_plugins`) in each of D's processes, it wraps the NIXL pull
worker's `get_transfer_results`, and when the read of a request the harness named completes,
adds noise of a given fraction of each layer's std to the blocks just received, before D's
first step reads them. vLLM's files are not changed, and nothing is installed: the harness
writes this file as a package into a directory of its own and puts that directory (which also
holds the package's `*.dist-info/entry_points.txt`) on D's PYTHONPATH, for the self-test's D
only (`harness.run.faults.nixl.install_nixl_kv_noise_plugin`).

The conversation with the harness goes through the directory named by EPD_HARNESS_NIXL_KV_NOISE:

- `fault.json` (written by the harness after P answered, before D is asked): `fraction`,
  `seed` and `key` (the noise is seeded by them and the layer's name, so a rerun plants the same
  noise), `label` (the harness's request id) and `remote_request_id` (P's request id, which D's
  receive metadata carries): only that request is perturbed, so a clean request before or after
  never is;
- `effects.jsonl` (appended here, one line per perturbed request): blocks, layers, the relative
  std really planted (after rounding to the cache's dtype), the cache's shape;
- `loaded.jsonl` (appended here, one line per process that loaded the plugin): whether the
  worker class could be wrapped, or why not.

Self-contained (stdlib, plus torch and vLLM in D's process): it must not import the harness.
Tested on vLLM 0.32.0's `NixlPullConnectorWorker`; another release whose worker lacks the
attributes used here reports that in `loaded.jsonl` or `effects.jsonl`, never silently.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from pathlib import Path
from typing import Any

CONTROL_ENV = "EPD_HARNESS_NIXL_KV_NOISE"  # the directory holding fault.json and the logs
PACKAGE = "epd_harness_nixl_kv_noise"
ENTRY_POINT_GROUP = "vllm.general_plugins"
FAULT_FILE = "fault.json"
EFFECTS_FILE = "effects.jsonl"
LOADED_FILE = "loaded.jsonl"
WORKER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker"
WORKER_CLASS = "NixlPullConnectorWorker"
PATCHED_FLAG = "_epd_harness_nixl_kv_noise"


def append_line(directory: Path, name: str, record: dict[str, Any]) -> None:
    """One JSON line, appended in a single write (D's processes may write concurrently)."""
    with open(directory / name, "a", encoding="utf-8") as log:
        log.write(json.dumps({"pid": os.getpid(), "time": time.time(), **record}) + "\n")


def read_fault(directory: Path) -> dict[str, Any] | None:
    """The current order, or None (no file, or one being replaced: the harness renames it in)."""
    try:
        return json.loads((directory / FAULT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def block_dim(shape: tuple[int, ...], num_blocks: int) -> int:
    """The dimension of a layer's KV cache that indexes blocks: the first of size num_blocks."""
    for dim, size in enumerate(shape):
        if size == num_blocks:
            return dim
    raise ValueError(f"no dimension of {tuple(shape)} has the cache's {num_blocks} blocks")


def layer_seed(seed: int, key: str, layer: str) -> int:
    """The same noise for the same (seed, key, layer) on every run."""
    return zlib.crc32(f"{seed}:{key}:{layer}".encode())


def perturb_blocks(cache: Any, dim: int, block_ids: list[int], fraction: float, seed: int) -> float:
    """Add N(0, (fraction * std)^2) to `cache`'s blocks `block_ids` (along `dim`), in place.

    The std is taken over the received blocks but the last (a prompt's last block is partly
    unused, and unused slots hold whatever an earlier request left there); a one-block request
    uses its block. Noise is drawn on the CPU (seeded), computed in float32 and cast back to the
    cache's dtype. Returns the relative std really added, after that rounding.
    """
    import torch

    index = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
    original = cache.index_select(dim, index).float()
    reference = original.narrow(dim, 0, max(len(block_ids) - 1, 1))
    std = float(reference.std())
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(original.shape, generator=generator, dtype=torch.float32)
    noisy = (original + noise.to(original.device) * (fraction * std)).to(cache.dtype)
    cache.index_copy_(dim, index, noisy)
    return float((noisy.float() - original).std()) / std if std else float("inf")


def perturb_request(worker: Any, meta: Any, fault: dict[str, Any]) -> dict[str, Any]:
    """Noise on every layer's blocks of one received request; what was done, for effects.jsonl."""
    groups = getattr(meta, "local_physical_block_ids", None) or meta.local_block_ids
    block_ids = [block for group in groups for block in group]
    if not block_ids:
        return {"problem": "the request received no blocks"}
    planted, shape, layers = [], None, 0
    for layer, cache in worker.device_kv_caches.items():
        if not hasattr(cache, "index_select"):
            continue  # a (conv, ssm) state tuple of a hybrid model: not attention KV
        dim = block_dim(tuple(cache.shape), worker.num_blocks)
        seed = layer_seed(int(fault["seed"]), str(fault.get("key", fault["label"])), layer)
        planted.append(perturb_blocks(cache, dim, block_ids, float(fault["fraction"]), seed))
        shape, layers = list(cache.shape), layers + 1
    if not planted:
        return {"problem": "D's KV cache has no tensor layers to perturb"}
    return {
        "blocks": len(block_ids),
        "layers": layers,
        "planted": sum(planted) / len(planted),
        "cache_shape": shape,
    }


def wrap(worker_class: type, directory: Path) -> None:
    """Make `worker_class.get_transfer_results` perturb the ordered request once it arrived."""
    original = worker_class.get_transfer_results

    def get_transfer_results(self: Any) -> Any:
        receiving = dict(self._recving_metadata)  # the original pops finished requests
        results = original(self)
        fault = read_fault(directory)
        if fault is None:
            return results
        failed = set(getattr(results, "failed_recving", ()) or ())
        for req_id in set(results.finished_recving) - failed:
            meta = receiving.get(req_id)
            remote = getattr(meta, "remote", None)
            if remote is None or remote.request_id != fault.get("remote_request_id"):
                continue
            record = {"label": fault.get("label"), "remote_request_id": remote.request_id}
            try:
                record.update(perturb_request(self, meta, fault))
            except Exception as exc:  # noqa: BLE001 - reported to the harness, D keeps serving
                record["problem"] = f"{type(exc).__name__}: {exc}"
            append_line(directory, EFFECTS_FILE, {"req_id": req_id, **record})
        return results

    worker_class.get_transfer_results = get_transfer_results
    setattr(worker_class, PATCHED_FLAG, True)


def register() -> None:
    """The entry point vLLM calls in each of its processes; does nothing without the variable."""
    control = os.environ.get(CONTROL_ENV)
    if not control:
        return
    directory = Path(control)
    try:
        import importlib

        worker_class = getattr(importlib.import_module(WORKER_MODULE), WORKER_CLASS)
        if not getattr(worker_class, PATCHED_FLAG, False):
            wrap(worker_class, directory)
        append_line(directory, LOADED_FILE, {"patched": f"{WORKER_MODULE}.{WORKER_CLASS}"})
    except Exception as exc:  # noqa: BLE001 - vLLM would only log it; the harness must know
        append_line(directory, LOADED_FILE, {"problem": f"{type(exc).__name__}: {exc}"})
