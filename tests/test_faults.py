"""The planted faults on files laid out as vLLM 0.32's example connectors lay them out (no vLLM).

The self-test trusts these faults to change what a consumer loads and nothing else: a fault
that changed a shape or a key would make the consumer fail (ERROR) instead of computing with
wrong values (MISMATCH), and one that changed nothing would let the self-test pass vacuously.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import pytest

from harness.judge.guards import EC_CACHE_FILE
from harness.run.faults.ec_files import corrupt_ec_files, ec_noise, ec_zero_frame
from harness.run.faults.instance import kill_instance
from harness.run.faults.kv_files import drop_kv, kv_noise, zero_kv_files
from harness.run.faults.planted import PlantedFault, first_request_only, plant
from harness.run.faults.relayed import drop_encoder_metadata, duplicate_stream_chunk
from harness.serve.launch import ManagedServer
from harness.serve.proxy import ProxyFaults
from harness.serve.server_command import ServerCommand

if TYPE_CHECKING:
    import torch

# torch is imported inside the tests: the unit tier collects this module without it.
pytestmark = pytest.mark.model

MM_HASH = "epd-0123456789abcdef0123456789abcdef"
KV_LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
FILE_METADATA = {"written-by": "test_faults"}
EXIT_WAIT_S = 5.0


def write_ec_file(ec_storage: Path, mm_hash: str = MM_HASH) -> tuple[Path, torch.Tensor]:
    """An EC file as ECExampleConnector writes it: one `ec_cache` tensor per mm_hash.

    Includes exact zeros, which plain negation would leave unchanged.
    """
    import torch
    from safetensors.torch import save_file

    path = ec_storage / mm_hash / EC_CACHE_FILE
    path.parent.mkdir(parents=True)
    tensor = torch.randn(64, 128, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    tensor[0, :8] = 0
    save_file({"ec_cache": tensor}, str(path), metadata=FILE_METADATA)
    return path, tensor


def write_kv_files(kv_storage: Path, prompt_hash: str) -> list[Path]:
    """KV files as ExampleConnector writes them: `<prompt hash>/<layer>.safetensors`."""
    import torch
    from safetensors.torch import save_file

    folder = kv_storage / prompt_hash
    folder.mkdir(parents=True)
    paths = []
    for n, layer in enumerate(KV_LAYERS):
        path = folder / f"{layer}.safetensors"
        kv = torch.randn(2, 64, 2, 32, generator=torch.Generator().manual_seed(n))
        save_file({"kv_cache": kv.to(torch.bfloat16)}, str(path))
        paths.append(path)
    return paths


def read_pid(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text else None


def test_corrupt_ec_file_keeps_keys_shapes_dtypes_and_changes_every_value(tmp_path: Path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    path, original = write_ec_file(tmp_path)
    fault = corrupt_ec_files(tmp_path)
    assert fault.after_encode is not None, f"corrupt_ec_files planted no after_encode: {fault}"

    fault.after_encode("req-1", {MM_HASH: {"item_indices": [0], "metadata": {}}})

    assert fault.touched == [path] and not fault.problems, (fault.touched, fault.problems)
    corrupted = load_file(path)
    assert set(corrupted) == {"ec_cache"}, f"keys changed: {sorted(corrupted)}"
    tensor = corrupted["ec_cache"]
    assert (tensor.shape, tensor.dtype) == (original.shape, original.dtype), (
        f"{tuple(tensor.shape)} {tensor.dtype} != {tuple(original.shape)} {original.dtype}"
    )
    unchanged = int((tensor == original).sum())
    assert unchanged == 0, f"{unchanged} of {original.numel()} values unchanged (zeros included)"
    assert bool(((tensor >= 0) != (original >= 0)).all()), "some element kept its sign"
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata() == FILE_METADATA, f"file metadata lost: {handle.metadata()}"
    leftovers = [p.name for p in path.parent.iterdir() if p != path]
    assert not leftovers, f"temporary files left beside the EC file: {leftovers}"


def test_corrupt_ec_files_records_a_missing_file_instead_of_raising(tmp_path: Path):
    """Hooks run on the proxy thread: an exception would only be an opaque HTTP 500."""
    fault = corrupt_ec_files(tmp_path)
    fault.after_encode("req-2", {MM_HASH: {"item_indices": [0]}})
    fault.after_encode("req-3", {})
    assert not fault.touched, f"touched files that do not exist: {fault.touched}"
    assert len(fault.problems) == 2, f"expected two problems, got {fault.problems}"
    assert "does not exist" in fault.problems[0], fault.problems
    assert "no mm_hash" in fault.problems[1], fault.problems


def test_corrupt_ec_files_touches_only_the_reported_hashes(tmp_path: Path):
    """Another request's EC file must survive, or one fault would bleed into the next case."""
    import torch
    from safetensors.torch import load_file

    write_ec_file(tmp_path, MM_HASH)
    other_path, other = write_ec_file(tmp_path, "epd-other")
    corrupt_ec_files(tmp_path).after_encode("req-4", {MM_HASH: {"item_indices": [0]}})
    assert torch.equal(load_file(other_path)["ec_cache"], other), "an unreported hash was touched"


def test_zero_kv_files_zeroes_every_layer_p_wrote_for_the_request_and_no_earlier_prompt(
    tmp_path: Path,
):
    """Zeroing every file under the storage zeroed earlier prompts' too: on real vLLM the
    streamed sweep after the self-test read the sweep prompts' zeroed KV and went red for a
    fault no longer planted (1P+1D and 1E+1P+1D, every prompt)."""
    import torch
    from safetensors.torch import load_file

    earlier = write_kv_files(tmp_path, "prompt-earlier")
    kept = {path: load_file(path)["kv_cache"] for path in earlier}
    fault = zero_kv_files(tmp_path)
    assert fault.after_prefill is not None, f"zero_kv_files planted no after_prefill: {fault}"
    paths = write_kv_files(tmp_path, "prompt-a")  # what P writes for the faulted request
    originals = {path: load_file(path)["kv_cache"] for path in paths}

    fault.after_prefill("req-5", {"kv_transfer_params": None})

    assert sorted(fault.touched) == sorted(paths) and not fault.problems, (
        fault.touched,
        fault.problems,
    )
    for path, original in originals.items():
        zeroed = load_file(path)
        assert set(zeroed) == {"kv_cache"}, f"{path}: keys changed: {sorted(zeroed)}"
        tensor = zeroed["kv_cache"]
        assert (tensor.shape, tensor.dtype) == (original.shape, original.dtype), path
        assert int(tensor.count_nonzero()) == 0, f"{path}: {int(tensor.count_nonzero())} nonzero"
    for path, original in kept.items():
        assert torch.equal(load_file(path)["kv_cache"], original), f"{path}: an earlier prompt's"


def test_zero_kv_files_reports_an_empty_storage(tmp_path: Path):
    fault = zero_kv_files(tmp_path)
    fault.after_prefill("req-6", {})
    assert not fault.touched and len(fault.problems) == 1, (fault.touched, fault.problems)


def test_drop_kv_removes_only_the_directories_p_wrote_since_it_was_made(tmp_path: Path):
    """ExampleConnector finds D's KV by the prompt's directory: removing it makes D compute
    the prompt itself. An earlier prompt's directory stays."""
    earlier = write_kv_files(tmp_path, "prompt-earlier")
    fault = drop_kv(tmp_path)
    fresh = write_kv_files(tmp_path, "prompt-now")
    fault.after_prefill("req-7", {"kv_transfer_params": None})
    assert not (tmp_path / "prompt-now").exists() and all(p.is_file() for p in earlier)
    assert sorted(fault.touched) == sorted(fresh) and not fault.problems, fault
    assert fault.effects == ["req-7: removed prompt-now/ (2 files)"], fault.effects


def test_drop_kv_calls_a_directory_it_could_not_remove_a_problem_not_an_effect(
    tmp_path: Path, monkeypatch
):
    """rmtree ignores its errors: a directory that stayed (a file another user owns, a busy
    mount) is KV D still reads, so the fault did not act; recorded as removed, the self-test
    counted a fault planted that was not."""
    from harness.run.faults import kv_files

    fault = drop_kv(tmp_path)
    write_kv_files(tmp_path, "prompt-now")
    monkeypatch.setattr(kv_files.shutil, "rmtree", lambda path, ignore_errors: None)
    fault.after_prefill("req-7", {"kv_transfer_params": None})
    assert (tmp_path / "prompt-now").is_dir()
    assert not fault.effects and not fault.touched, fault
    assert fault.problems == [f"req-7: {tmp_path / 'prompt-now'} could not be removed"], fault


def test_drop_kv_says_so_when_p_wrote_nothing_new(tmp_path: Path):
    write_kv_files(tmp_path, "prompt-earlier")
    fault = drop_kv(tmp_path)
    fault.after_prefill("req-8", {})
    assert not fault.touched and len(fault.problems) == 1, fault
    assert "nothing to withhold from D" in fault.problems[0]


def test_drop_kv_under_nixl_withholds_ps_params_from_d(tmp_path: Path):
    fault = drop_kv(tmp_path, "NixlConnector")
    response = {"kv_transfer_params": {"remote_block_ids": [[1, 2]], "do_remote_prefill": True}}
    fault.after_prefill("req-9", response)
    assert "kv_transfer_params" not in response and not fault.problems, fault
    assert fault.effects and fault.effects[0].startswith("req-9: kv_transfer_params withheld")
    fault.after_prefill("req-10", {"kv_transfer_params": None})
    assert fault.problems == ["req-10: P returned no kv_transfer_params to drop"], fault.problems


def test_first_request_only_acts_on_one_request_of_many(tmp_path: Path):
    fault = first_request_only(drop_kv(tmp_path, "NixlConnector"))
    responses = [{"kv_transfer_params": {"remote_block_ids": [[n]]}} for n in range(3)]
    for n, response in enumerate(responses):
        fault.after_prefill(f"req-{n}", response)
    fault.after_prefill("req-0", {"kv_transfer_params": {"remote_block_ids": [[9]]}})
    assert ["kv_transfer_params" in r for r in responses] == [False, True, True], responses
    assert len(fault.effects) == 2 and all(e.startswith("req-0:") for e in fault.effects)
    assert fault.after_encode is None, "a hook the fault did not have was added"


def test_first_request_only_can_pick_the_request_by_a_part_of_its_id(tmp_path: Path):
    fault = first_request_only(drop_kv(tmp_path, "NixlConnector"), id_contains="-ld-text-")
    ids = ["1P-1D-ld-shared-a-01", "1P-1D-ld-text-02", "1P-1D-ld-text-03"]
    responses = [{"kv_transfer_params": {"remote_block_ids": [[n]]}} for n in range(3)]
    for request_id, response in zip(ids, responses):
        fault.after_prefill(request_id, response)
    assert ["kv_transfer_params" in r for r in responses] == [True, False, True], responses


@pytest.mark.parametrize(
    "make_fault",
    [zero_kv_files, lambda storage: kv_noise(storage, 0.5), drop_kv],
    ids=["zero-kv", "kv-noise", "drop-kv"],
)
def test_first_request_only_never_acts_on_another_in_flight_requests_kv_files(
    tmp_path: Path, make_fault
):
    """Under a load, P writes the KV files of every request in flight, and the first one's
    `after_prefill` may run after a neighbour's P answered too. The ExampleConnector KV faults
    take every file P wrote since their previous request, so narrowed to the first request
    they broke its neighbours as well: the fault must either stay on the first request's files
    or be refused, saying why."""
    try:
        fault = first_request_only(make_fault(tmp_path))
    except ValueError as refused:
        assert "in flight" in str(refused), refused
        return
    write_kv_files(tmp_path, "prompt-of-the-first-request")
    neighbour = write_kv_files(tmp_path, "prompt-of-a-request-in-flight")
    before = {path: path.read_bytes() for path in neighbour}
    fault.after_prefill("req-first", {})
    fault.after_prefill("req-neighbour", {})
    changed = [p.name for p in neighbour if not p.is_file() or p.read_bytes() != before[p]]
    assert not changed, f"the neighbour's KV files were changed: {changed}; {fault.effects}"


@pytest.mark.parametrize(
    "make_fault",
    [
        corrupt_ec_files,
        lambda storage: ec_noise(storage, 0.5),
        lambda storage: ec_zero_frame(storage, 0),
    ],
    ids=["corrupt-ec", "ec-noise", "ec-zero-frame"],
)
def test_first_request_only_never_leaves_an_ec_file_rewritten_for_other_requests(
    tmp_path: Path, make_fault
):
    """An EC file is the item's (`<mm_hash>/`), not the request's: narrowed to the first
    request, the EC file faults rewrote it for that request and left it so, and every other
    request with the same image or video, in flight or later (the encoder finds the file and
    writes it no more), read it too (found in review). Refused, saying why, or left as it was
    for the other request."""
    try:
        fault = first_request_only(make_fault(tmp_path))
    except ValueError as refused:
        assert "every request with" in str(refused), refused
        return
    path, _ = write_ec_file(tmp_path)
    before = path.read_bytes()
    params = {MM_HASH: {"metadata": {"video_grid_thw": [[4, 4, 4]]}}}
    fault.after_encode("req-first", params)
    fault.after_encode("req-neighbour", params)  # the same image: it reads the same file
    assert path.read_bytes() == before, f"the neighbour read a rewritten file: {fault.effects}"


@pytest.mark.parametrize("make_fault", [drop_encoder_metadata, duplicate_stream_chunk])
def test_first_request_only_never_leaves_a_proxy_flag_on_for_every_request(make_fault):
    """The flag faults have no hook to narrow: the proxy reads the flag on every request, so
    `first_request_only` must refuse them, not hand them back acting on all."""
    try:
        fault = first_request_only(make_fault())
    except ValueError as refused:
        assert "every request" in str(refused), refused
        return
    flags = {"drop": fault.drop_encoder_metadata, "dup": fault.duplicate_first_token_chunk}
    assert not any(flags.values()), f"a flag stays on for every request: {flags}"


def test_drop_encoder_metadata_sets_only_the_drop_flag():
    fault = drop_encoder_metadata()
    assert fault.drop_encoder_metadata is True, fault
    assert fault.after_encode is None and fault.after_prefill is None, fault


def test_plant_swaps_the_hooks_on_the_live_object_and_clears_them():
    """The proxy keeps the session's ProxyFaults object: planting must mutate that object."""
    live = ProxyFaults()
    fault = PlantedFault(drop_encoder_metadata=True, after_prefill=lambda rid, resp: None)
    plant(live, fault)
    assert live.drop_encoder_metadata and live.after_prefill is fault.after_prefill, live
    plant(live, None)
    assert live == ProxyFaults(), f"plant(live, None) left hooks behind: {live}"


def test_kill_instance_sigkills_the_whole_process_group(tmp_path: Path):
    child_pid_file = tmp_path / "child.pid"
    script = (
        "import subprocess, sys, time; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(child_pid_file)!r}, 'w').write(str(c.pid)); time.sleep(60)"
    )
    server = ManagedServer(
        ServerCommand(
            name="victim",
            argv=[sys.executable, "-c", script],
            health_url="http://127.0.0.1:9/health",
            log_path=tmp_path / "victim.log",
        )
    )
    server.start()
    try:
        deadline = time.monotonic() + EXIT_WAIT_S
        while not read_pid(child_pid_file) and time.monotonic() < deadline:
            time.sleep(0.05)
        child_pid = read_pid(child_pid_file)
        assert child_pid, f"the victim wrote no child pid; log: {server.log_tail()}"
        kill_instance(server)
        while server.is_alive() and time.monotonic() < deadline + EXIT_WAIT_S:
            time.sleep(0.05)
        assert server.exit_code == -signal.SIGKILL, f"exit code {server.exit_code}"
        with pytest.raises(RuntimeError, match="not running"):
            kill_instance(server)
    finally:
        server.stop()
    assert not psutil.pid_exists(child_pid) or psutil.Process(child_pid).status() == "zombie", (
        f"the group's child {child_pid} survived the kill"
    )


def test_corrupt_ec_files_finds_the_files_of_an_ec_items_answer(tmp_path: Path):
    """vLLM 0.29 (the floor of the version matrix) answers `{"ec_items": [{"mm_hash": h, ...}]}`;
    the fault must corrupt h's file, not look for a file under `ec_items/` and act on nothing
    (found in review: `--plant-fault corrupt-ec` on 0.29 touched no file)."""
    path, original = write_ec_file(tmp_path)
    fault = corrupt_ec_files(tmp_path)
    fault.after_encode("req-1", {"ec_items": [{"mm_hash": MM_HASH, "image_grid_thw": [[1, 8, 8]]}]})
    assert fault.touched == [path] and not fault.problems, (fault.touched, fault.problems)
