"""The one reader of the host's devices (`harness.devices`): what run.json's `devices_used`
records (model, count, driver, CUDA; on CPU the model and AMX) and the baseline cache key's
device model, read the same way. A GPU is faked as the rest of the suite fakes one: an
`nvidia-smi` on PATH that answers the queries the reader makes (a process: this module runs
tools, so it is a `check` test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import devices
from harness.run import baseline_launch
from harness.spec.platforms import CUDA
from harness.testing.fake_nvidia_smi import A100, T4, V100, install_fake_nvidia_smi

pytestmark = pytest.mark.check

LISTING = "0, NVIDIA A100-SXM4-80GB, 550.54.15\n1, NVIDIA H100 80GB HBM3, 550.54.15\n"
HEADER = (
    "+-----------------------------------------------------------------------------+\n"
    "| NVIDIA-SMI 550.54.15   Driver Version: 550.54.15   CUDA Version: 12.4      |\n"
)

UUIDS = "0, GPU-aaaa\n1, GPU-bbbb\n"
# A vLLM engine core on GPU 1, and a line of another shape nvidia-smi might print.
APPS = "4242, VLLM::EngineCore, GPU-bbbb, 70123 MiB\n[Not Supported]\n"


@pytest.fixture
def fake_gpu_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An nvidia-smi on PATH listing two GPUs of two models; no driver /proc files."""
    tool = tmp_path / "bin" / "nvidia-smi"
    tool.parent.mkdir()
    calls = tmp_path / "calls"
    tool.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {calls}\n'
        'case "$1" in\n'
        f"  --query-gpu=index,name,driver_version) printf '{LISTING}' ;;\n"
        "  --query-gpu=name) printf 'NVIDIA A100-SXM4-80GB\\nNVIDIA H100 80GB HBM3\\n' ;;\n"
        f"  '') printf '{HEADER}' ;;\n"
        f"  --query-gpu=index,uuid) printf '{UUIDS}' ;;\n"
        f"  --query-compute-apps=pid,process_name,gpu_uuid,used_memory) printf '{APPS}' ;;\n"
        "  *) exit 6 ;;\n"
        "esac\n"
    )
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tool.parent}:/usr/bin:/bin")
    monkeypatch.setattr(devices, "NVIDIA_GPUS", tmp_path / "no-driver-files")
    monkeypatch.setattr(devices, "NVIDIA_VERSION", tmp_path / "no-driver-version")
    return calls


def test_a_cuda_run_records_the_model_count_driver_and_cuda_of_its_gpus(fake_gpu_host):
    used = devices.run_devices("cuda", True, (1,))
    assert used.to_json() == {
        "platform": "cuda",
        "model": "NVIDIA H100 80GB HBM3",  # GPU 1's, not GPU 0's
        "count": 1,
        "indices": [1],
        "source": "nvidia-smi",
        "driver": "550.54.15",
        "cuda": "12.4",
        "amx": None,
        "features": [],
    }
    assert used.describe() == (
        "cuda: 1 x NVIDIA H100 80GB HBM3 (GPUs 1; driver 550.54.15, CUDA 12.4)"
    )
    both = devices.run_devices("cuda", True, (0, 1))
    assert (both.count, both.model) == (2, "NVIDIA A100-SXM4-80GB; NVIDIA H100 80GB HBM3")


def test_the_cache_key_reads_the_same_gpus_through_the_same_reader(fake_gpu_host):
    baseline_launch.device_model.cache_clear()
    try:
        key = baseline_launch.device_model(CUDA)
    finally:
        baseline_launch.device_model.cache_clear()
    assert key == "cuda: NVIDIA A100-SXM4-80GB; NVIDIA H100 80GB HBM3"


def test_without_nvidia_smi_the_driver_files_give_model_and_driver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    gpus = tmp_path / "nvidia" / "gpus"
    (gpus / "0000:01:00.0").mkdir(parents=True)
    (gpus / "0000:01:00.0" / "information").write_text("Model: \t\t NVIDIA L4\nIRQ: 1\n")
    version = tmp_path / "nvidia" / "version"
    version.write_text(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.161.08  Sat Feb 17 2024\n"
    )
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(devices, "NVIDIA_GPUS", gpus)
    monkeypatch.setattr(devices, "NVIDIA_VERSION", version)
    used = devices.run_devices("cuda", True, (0,))
    assert (used.model, used.driver, used.cuda) == ("NVIDIA L4", "535.161.08", None)
    assert used.describe() == "cuda: 1 x NVIDIA L4 (GPUs 0; driver 535.161.08)"
    monkeypatch.setattr(devices, "NVIDIA_GPUS", tmp_path / "none")
    monkeypatch.setattr(devices, "NVIDIA_VERSION", tmp_path / "none")
    assert devices.run_devices("cuda", True, (0,)).describe() == (
        "cuda: 1 x GPU model unknown (GPUs 0)"
    )


@pytest.mark.parametrize("flags, amx", [("avx2 avx512f amx_bf16 amx_tile", True), ("avx2", False)])
def test_a_cpu_run_records_the_cpu_model_and_whether_it_has_amx(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: str, amx: bool
):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: Some Xeon\nflags\t\t: fpu {flags}\n")
    monkeypatch.setattr(devices, "CPUINFO", cpuinfo)
    used = devices.run_devices("cpu", False, (0, 1))
    assert (used.model, used.count, used.amx) == ("Some Xeon", 2, amx)
    assert used.describe() == f"cpu: Some Xeon, 2 cores (0,1), {'AMX' if amx else 'no AMX'}"
    assert ("amx_tile" in used.features) is amx
    again = devices.DevicesUsed.from_json(json.loads(json.dumps(used.to_json())))
    assert again == used


def test_gpu_processes_are_named_by_the_index_nvidia_smi_lists(fake_gpu_host):
    """The compute-apps list names GPUs by UUID; --devices and the plan use indices."""
    assert devices.smi_compute_processes() == [
        devices.GpuProcess(pid=4242, name="VLLM::EngineCore", gpu=1, used_mib=70123)
    ]


def test_a_process_on_a_gpu_the_gpu_list_does_not_name_is_left_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The two nvidia-smi queries are read one after the other: a GPU the compute-apps list
    names by a UUID the GPU list did not give (reset or hidden between the two) has no index
    to report it under; looked up all the same, the lookup raised KeyError."""
    answers = {
        "--query-gpu=index,uuid": "0, GPU-aaa\n",
        "--query-compute-apps=pid,process_name,gpu_uuid,used_memory": (
            "111, python, GPU-gone, 10 MiB\n222, VLLM::EngineCore, GPU-aaa, 20 MiB\n"
        ),
    }
    monkeypatch.setattr(devices, "run_nvidia_smi", lambda query, _fmt: answers[query])
    assert devices.smi_compute_processes() == [
        devices.GpuProcess(pid=222, name="VLLM::EngineCore", gpu=0, used_mib=20)
    ]


def test_gpu_processes_nvidia_smi_cannot_list_are_unknown_not_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    assert devices.smi_compute_processes() is None


def test_compute_capabilities_are_read_by_the_index_devices_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bfloat16 needs 8.0: the preflight and doctor read each GPU's capability here."""
    tools = install_fake_nvidia_smi(tmp_path / "bin", [A100, T4, V100])
    monkeypatch.setenv("PATH", f"{tools}:/usr/bin:/bin")
    listed = devices.smi_compute_capabilities()
    assert listed == [
        devices.GpuCapability(0, "NVIDIA A100-SXM4-80GB", (8, 0)),
        devices.GpuCapability(1, "Tesla T4", (7, 5)),
        devices.GpuCapability(2, "Tesla V100-SXM2-16GB", (7, 0)),
    ]
    assert [gpu.dotted for gpu in listed] == ["8.0", "7.5", "7.0"]
    # A driver without the field prints "[N/A]": that GPU is not described, never guessed.
    install_fake_nvidia_smi(tools, [T4, ("Tesla K80", "[N/A]")])
    assert devices.smi_compute_capabilities() == [devices.GpuCapability(0, "Tesla T4", (7, 5))]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert devices.smi_compute_capabilities() is None


def test_gpu_indices_are_what_nvidia_smi_lists_and_none_where_it_cannot_say(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `--devices` may name on cuda: the indices nvidia-smi lists (it ignores
    CUDA_VISIBLE_DEVICES); None where it cannot be read, so nothing is refused on a guess."""
    tools = install_fake_nvidia_smi(tmp_path / "bin", [A100, T4, V100])
    monkeypatch.setenv("PATH", f"{tools}:/usr/bin:/bin")
    assert devices.smi_gpu_indices() == (0, 1, 2)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert devices.smi_gpu_indices() is None
