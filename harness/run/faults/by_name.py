"""A fault by its `--plant-fault` name (plain or graded), aimed at a running topology's storage:
what a run, a sweep, the fuzzer and the scenarios plant from a name alone."""

from __future__ import annotations

from pathlib import Path

from harness.errors import BadInput
from harness.run.faults.ec_files import corrupt_ec_files, ec_noise, ec_swap_items, ec_zero_frame
from harness.run.faults.kv_files import drop_kv, kv_noise, zero_kv_files
from harness.run.faults.nixl import misroute_nixl_blocks
from harness.run.faults.planted import PlantedFault
from harness.run.faults.relayed import drop_encoder_metadata, duplicate_stream_chunk, ec_video_grid
from harness.run.faults.spec import KV_FAULTS, parse_fault


def fault_for(
    name: str,
    ec_storage: Path | None,
    kv_storage: Path | None,
    kv_connector: str = "ExampleConnector",
) -> PlantedFault:
    """The named fault (plain or graded, see `parse_fault`), aimed at a running topology's
    storage; under NixlConnector zero-kv becomes `misroute_nixl_blocks` (there are no files)."""
    spec = parse_fault(name)
    if spec.kind in KV_FAULTS:
        if kv_storage is None:
            raise ValueError(f"fault {spec.kind} needs a topology with P and D")
        if spec.kind == "drop-kv":
            return drop_kv(kv_storage, kv_connector)
        if kv_connector == "NixlConnector":
            if spec.kind == "kv-noise":
                raise BadInput(
                    "kv-noise rewrites ExampleConnector's KV files; under "
                    "--kv-connector nixl the KV never leaves P's memory, and its noise needs "
                    "a plugin D is started with (the graded self-test, "
                    "scenarios/test_detection.py, plants it): use zero-kv, which misroutes "
                    "NIXL's block ids instead"
                )
            return misroute_nixl_blocks()
        return (
            zero_kv_files(kv_storage)
            if spec.kind == "zero-kv"
            else kv_noise(kv_storage, spec.strength or 0.0)
        )
    if spec.kind == "drop-metadata":
        return drop_encoder_metadata()
    if spec.kind == "stream-duplicate-chunk":
        return duplicate_stream_chunk()
    if ec_storage is None:
        raise ValueError(f"fault {spec.kind} needs a topology with an encoder")
    if spec.kind == "corrupt-ec":
        return corrupt_ec_files(ec_storage)
    if spec.kind == "ec-noise":
        return ec_noise(ec_storage, spec.strength or 0.0)
    if spec.kind == "ec-swap-items":
        return ec_swap_items(ec_storage)
    if spec.kind == "ec-zero-frame":
        return ec_zero_frame(ec_storage, int(spec.strength or 0))
    return ec_video_grid(ec_storage)
