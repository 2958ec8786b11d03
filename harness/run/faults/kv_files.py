"""Faults on the KV that P hands D under ExampleConnector (one `<prompt hash>/` directory of
`<layer>.safetensors` files): zeroed, withheld, noised. Each acts after P answered and before D
is asked; `drop_kv` also has a NixlConnector form, as the same fault in both."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.run.faults.planted import PlantedFault
from harness.run.faults.storage_files import KV_FILE_SUFFIX, KvFilesSince, kv_file_stamps
from harness.run.faults.tensors import file_seed, noise_transform, zeros

if TYPE_CHECKING:
    import torch

# Why the ExampleConnector KV faults cannot act on one request alone (`first_request_only`).
KV_FILES_OF_ANY_REQUEST = (
    "the ExampleConnector KV faults act on every KV file P wrote since their previous request "
    "(a prompt's directory is a hash of its tokens and media, which the proxy does not see), "
    "so with other requests in flight they would act on those requests' files too; plant "
    "them with one request at a time, or under NixlConnector, whose KV faults act on the "
    "request's own kv_transfer_params"
)


def zero_kv_files(kv_storage: Path) -> PlantedFault:
    """After P answered, zero the KV files P wrote for this request (shapes and dtypes kept).

    Only files new or rewritten since the fault was made (or since its previous request), as
    `kv_noise` and `drop_kv` do: zeroing every file under the storage zeroed earlier prompts'
    too, and the next request of such a prompt (a streamed sweep after the self-test, on real
    vLLM) read zeroed KV and failed for a fault no longer planted.
    """
    fault = PlantedFault(not_one_request=KV_FILES_OF_ANY_REQUEST)
    fault.after_prefill = rewrite_fresh_kv_files(kv_storage, fault, lambda key: zeros)
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
    fault.not_one_request = KV_FILES_OF_ANY_REQUEST
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
    P wrote for this request (seeded by the file's key: the same file gets the same noise)."""
    fault = PlantedFault(not_one_request=KV_FILES_OF_ANY_REQUEST)
    fault.after_prefill = rewrite_fresh_kv_files(
        kv_storage, fault, lambda key: noise_transform(fraction, file_seed(seed, key), fault)
    )
    return fault


def rewrite_fresh_kv_files(
    kv_storage: Path,
    fault: PlantedFault,
    transform_for: Callable[[str], Callable[[torch.Tensor], torch.Tensor]],
) -> Callable[[str, dict[str, Any]], None]:
    """An `after_prefill` that rewrites, each with `transform_for(its key under the storage)`,
    the KV files P wrote since the fault was made (or since its previous request).

    Only those: a fault must not pile up on earlier prompts' files, and a request whose KV
    files already existed (nothing new written) is reported as a problem, not silently passed.
    It is marked as a leftover miss (`PlantedFault.leftover`) while every KV file in the
    storage is one P wrote after the fault was made, so one it rewrote (as it would rewrite it
    for this request): with files from before (a storage the fault found filled) it cannot
    tell which file D read, and the miss stays one of shape.
    """
    written = KvFilesSince(kv_storage)
    older = set(kv_file_stamps(kv_storage))  # files the fault found, and never rewrote

    def after_prefill(request_id: str, prefill_response: dict[str, Any]) -> None:
        fresh = written.fresh()
        if not fresh:
            # LEFTOVER, not the request's shape: P writes nothing only when it finds the
            # folder its prompt's block-aligned prefix (and media hashes) key already stored,
            # i.e. an earlier request with that prefix wrote it, and this fault rewrote it then
            # (it rewrites every file P writes). Causal attention makes that KV a function of
            # the prefix alone, and the rewrite depends on the file's key alone, so D reads the
            # very file fresh servers would write and rewrite for this request.
            problem = (
                f"{request_id}: P wrote no new *{KV_FILE_SUFFIX} under {kv_storage} "
                f"({len(kv_file_stamps(kv_storage))} older file(s) left alone)"
            )
            fault.problems.append(problem)
            if not older & set(kv_file_stamps(kv_storage)):
                fault.leftover.append(problem)
        for path in fresh:
            fault.rewrite(request_id, path, transform_for(str(path.relative_to(kv_storage))))
        written.settle()

    return after_prefill
