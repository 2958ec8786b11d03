"""Planted faults for the harness's self-test: each one must turn a run red with a known verdict.

A harness that cannot fail proves nothing (upstream's bash harness stayed green while every
comparison failed, vLLM failure mode 13). Each fault here breaks one link of the EPD chain on
purpose, and the self-test checks that the judge names the right verdict:

- `corrupt_ec_files`: the consumer loads wrong embeddings            -> MISMATCH
- `zero_kv_files`: D decodes from zeroed KV                          -> MISMATCH
- `drop_encoder_metadata`: raw media reach the consumer, which encodes them itself; the tokens
  still equal the baseline's, so only the transfer guards can tell   -> VACUOUS
- `kill_instance`: an instance dies mid-run                          -> ERROR, at once

Graded faults (issue 10) find how small a break the harness still catches, so a loss of
sensitivity shows up as a number (docs/self-test.md; the search is in `harness.run.graded`):

- `ec_noise`: seeded Gaussian noise, a given fraction of each EC tensor's std, added to the
  encoder outputs between encoder and consumer
- `kv_noise`: the same on the KV ExampleConnector files between P and D
- `ec_swap_items`: the EC files of a request's media items swap places (two images: each image
  gets the other's embedding)
- `ec_zero_frame`: the rows of one temporal frame (pair) of a video's EC embedding are zeroed
- `ec_video_grid`: the consumer is told a video grid of the same size but another shape, so
  its M-RoPE positions are wrong while embeddings and prompt ids stay right (the
  `second_per_grid_ts` error itself cannot be planted from outside vLLM: see `ec_video_grid`)

Faults act only through the proxy's `ProxyFaults` hooks and on the files in the run's own
storage directories; vLLM's installed files are never touched. Only the self-tests and an
explicit `--plant-fault` use them; a normal run never does.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.errors import BadInput
from harness.judge.guards import EC_CACHE_FILE
from harness.serve.launch import ManagedServer
from harness.serve.proxy import ProxyFaults

if TYPE_CHECKING:
    import torch

KV_FILE_SUFFIX = ".safetensors"  # ExampleConnector: <kv_storage>/<prompt hash>/<layer>.safetensors


@dataclass
class PlantedFault(ProxyFaults):
    """ProxyFaults that also record what they did.

    A fault that silently touched nothing would make the self-test vacuous in turn (the run
    would be "red" for some other reason, or green by luck), so the tests assert on `touched`
    and `problems` as well as on the verdict. Hooks run on the proxy's thread, where an
    exception would only surface as an opaque HTTP 500: they record their problems instead.
    """

    touched: list[Path] = field(default_factory=list)  # files rewritten, in order
    problems: list[str] = field(default_factory=list)  # what the fault could not do, and why
    # What the fault measurably did, one line per file or item (e.g. the relative std of the
    # noise really added, after rounding to the file's dtype): evidence for the report.
    effects: list[str] = field(default_factory=list)

    def rewrite(
        self, request_id: str, path: Path, transform: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """Rewrite one file, recording it as touched or recording why it could not be."""
        if not path.is_file():
            self.problems.append(f"{request_id}: {path} does not exist")
            return
        try:
            rewrite_tensors(path, transform)
        except Exception as exc:  # noqa: BLE001 - reported through `problems`, see above
            self.problems.append(f"{request_id}: rewriting {path}: {type(exc).__name__}: {exc}")
            return
        self.touched.append(path)


def plant(live: ProxyFaults, fault: ProxyFaults | None = None) -> None:
    """Make a running proxy behave as `fault` prescribes (None: no fault) from its next request.

    A TopologySession hands its ProxyFaults object to the proxy once, at start, and the proxy
    reads the hooks on every request. Swapping the hooks on that same object lets one started
    topology serve a clean request and several planted faults in turn, instead of one start
    (~40 s on CPU) per fault.
    """
    source = fault if fault is not None else ProxyFaults()
    for hook in dataclasses.fields(ProxyFaults):
        setattr(live, hook.name, getattr(source, hook.name))


def corrupt_ec_files(ec_storage: Path) -> PlantedFault:
    """After the encoders answered, corrupt the EC file of every mm_hash they reported.

    The file keeps its keys, shapes and dtypes, so the consumer loads it without complaint;
    only the values are wrong, as a broken transfer or a stale cache would make them.
    """
    fault = PlantedFault()

    def after_encode(request_id: str, ec_transfer_params: dict[str, Any]) -> None:
        if not ec_transfer_params:
            fault.problems.append(f"{request_id}: the encoders reported no mm_hash")
        for mm_hash in ec_transfer_params:
            fault.rewrite(request_id, ec_storage / mm_hash / EC_CACHE_FILE, flip_away_from_zero)

    fault.after_encode = after_encode
    return fault


def zero_kv_files(kv_storage: Path) -> PlantedFault:
    """After P answered, zero every KV file under `kv_storage` (shapes and dtypes kept).

    ExampleConnector writes one `<layer>.safetensors` per layer into a directory named after a
    hash of the prompt, so "every file" includes those of earlier requests: send a faulted
    request with a prompt of its own, and do not expect earlier prompts to survive it.
    """
    fault = PlantedFault()

    def after_prefill(request_id: str, prefill_response: dict[str, Any]) -> None:
        paths = sorted(kv_storage.rglob(f"*{KV_FILE_SUFFIX}"))
        if not paths:
            fault.problems.append(f"{request_id}: no *{KV_FILE_SUFFIX} under {kv_storage}")
        for path in paths:
            fault.rewrite(request_id, path, zeros)

    fault.after_prefill = after_prefill
    return fault


def drop_encoder_metadata() -> PlantedFault:
    """The proxy ignores what the encoders returned, so the consumer gets raw media.

    This is the silent raw-media fallback (failure mode 8): the consumer encodes locally and
    the tokens still match; only the transfer guards can turn it red.
    """
    return PlantedFault(drop_encoder_metadata=True)


def kill_instance(server: ManagedServer) -> None:
    """SIGKILL a running server's whole process group, as a crash or the OOM killer would.

    The group holds the API server and the EngineCore it forked, so nothing of the instance is
    left to answer. The server is not stopped or reaped here: noticing the death is the job of
    the code under test, and the session's exit still cleans up.
    """
    if server.pgid is None or not server.is_alive():
        raise RuntimeError(f"{server.name} is not running (exit code {server.exit_code})")
    os.killpg(server.pgid, signal.SIGKILL)


def flip_away_from_zero(tensor: torch.Tensor) -> torch.Tensor:
    """Every element changes sign and lands at least 1 from zero: x >= 0 -> -x-1, x < 0 -> -x+1.

    Unlike plain negation (which keeps zeros) or small noise (which bf16 rounding may absorb),
    this changes every element, so a unit test can prove the file was really corrupted.
    """
    import torch

    return torch.where(tensor >= 0, -tensor - 1, -tensor + 1).to(tensor.dtype)


def zeros(tensor: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.zeros_like(tensor)


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


# Faults a whole run can be started with (`epd-harness run --plant-fault NAME`), so that a
# bundle from a planted failure can be replayed by `epd-harness repro` with the same fault.
FAULT_NAMES = ("corrupt-ec", "zero-kv", "drop-metadata")


def fault_for(name: str, ec_storage: Path | None, kv_storage: Path | None) -> PlantedFault:
    """The named fault, aimed at a running topology's storage."""
    if name == "corrupt-ec":
        if ec_storage is None:
            raise ValueError("fault corrupt-ec needs a topology with an encoder")
        return corrupt_ec_files(ec_storage)
    if name == "zero-kv":
        if kv_storage is None:
            raise ValueError("fault zero-kv needs a topology with P and D")
        return zero_kv_files(kv_storage)
    if name == "drop-metadata":
        return drop_encoder_metadata()
    raise ValueError(f"unknown fault {name!r} (known: {', '.join(FAULT_NAMES)})")
