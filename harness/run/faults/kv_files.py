"""Faults on the KV that P hands D under ExampleConnector (one `<prompt hash>/` directory of
`<layer>.safetensors` files): zeroed, withheld, noised. Each acts after P answered and before D
is asked; `drop_kv` also has a NixlConnector form, as the same fault in both."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from harness.run.faults.planted import PlantedFault
from harness.run.faults.storage_files import KV_FILE_SUFFIX, KvFilesSince, kv_file_stamps
from harness.run.faults.tensors import file_seed, noise_transform, zeros


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


def drop_kv(kv_storage: Path, kv_connector: str = "ExampleConnector") -> PlantedFault:
    """After P answered, make sure none of its KV reaches D: D computes the whole prompt itself.

    This is the KV side of the silent fallback `drop_encoder_metadata` plants: D answers right
    from its own prefill, so the tokens still equal the baseline's and only the `kv_transfer`
    guard can turn the case red (VACUOUS). Under NixlConnector the proxy hands D no
    `kv_transfer_params` (D then treats the request as its own; P keeps the blocks until
    vLLM's abort timeout frees them). Under ExampleConnector D finds its KV by the prompt's
    directory in the shared storage, whatever the proxy says, so the directories P wrote since
    the fault was made (or since its previous request) are removed: one request at a time, or
    a concurrent request's directory goes too. A request after which nothing was dropped is
    recorded as a problem, not passed off as planted.
    """
    fault = PlantedFault()
    if kv_connector == "NixlConnector":

        def drop_params(request_id: str, prefill_response: dict[str, Any]) -> None:
            params = prefill_response.pop("kv_transfer_params", None)
            if not params:
                fault.problems.append(f"{request_id}: P returned no kv_transfer_params to drop")
                return
            fault.effects.append(f"{request_id}: kv_transfer_params withheld from D: {params}")

        fault.after_prefill = drop_params
        return fault
    written = KvFilesSince(kv_storage)

    def remove_directories(request_id: str, prefill_response: dict[str, Any]) -> None:
        fresh = sorted({path.parent for path in written.fresh()})
        if not fresh:
            fault.problems.append(
                f"{request_id}: P wrote no new *{KV_FILE_SUFFIX} under {kv_storage}: "
                "nothing to withhold from D"
            )
        for directory in fresh:
            files = sorted(directory.glob(f"*{KV_FILE_SUFFIX}"))
            shutil.rmtree(directory, ignore_errors=True)
            if directory.exists():
                fault.problems.append(f"{request_id}: {directory} could not be removed")
                continue
            fault.touched += files
            fault.effects.append(f"{request_id}: removed {directory.name}/ ({len(files)} files)")
        written.settle()

    fault.after_prefill = remove_directories
    return fault


def kv_noise(kv_storage: Path, fraction: float, seed: int = 0) -> PlantedFault:
    """After P answered, add Gaussian noise of `fraction` x each tensor's std to the KV files
    P wrote for this request.

    Unlike `zero_kv_files`, only files new or rewritten since the fault was made (or since its
    previous request) are touched: noise must not pile up on earlier prompts' files, and a
    request whose KV files already existed (nothing new written) is reported as a problem, not
    silently passed. It is marked as a leftover miss (`PlantedFault.leftover`) while every KV
    file in the storage is one P wrote after the fault was made, so one it noised (as it would
    noise it for this request): with files from before (a storage the fault found filled) it
    cannot tell which file D read, and the miss stays one of shape.
    """
    fault = PlantedFault()
    written = KvFilesSince(kv_storage)
    older = set(kv_file_stamps(kv_storage))  # files the fault found, and never noised

    def after_prefill(request_id: str, prefill_response: dict[str, Any]) -> None:
        fresh = written.fresh()
        if not fresh:
            # LEFTOVER, not the request's shape: P writes nothing only when it finds the
            # folder its prompt's block-aligned prefix (and media hashes) key already stored,
            # i.e. an earlier request with that prefix wrote it, and this fault noised it then
            # (it noises every file P writes). Causal attention makes that KV a function of
            # the prefix alone, and the noise is seeded by the file's key, so D reads the very
            # file fresh servers would write and noise for this request.
            problem = (
                f"{request_id}: P wrote no new *{KV_FILE_SUFFIX} under {kv_storage} "
                f"({len(kv_file_stamps(kv_storage))} older file(s) left alone)"
            )
            fault.problems.append(problem)
            if not older & set(kv_file_stamps(kv_storage)):
                fault.leftover.append(problem)
        for path in fresh:
            key = str(path.relative_to(kv_storage))
            fault.rewrite(request_id, path, noise_transform(fraction, file_seed(seed, key), fault))
        written.settle()

    fault.after_prefill = after_prefill
    return fault
