"""An `nvidia-smi` for tests of what the harness reads of a GPU host without one: a shell script
that answers the compute-capability query (`harness.devices.smi_compute_capabilities`) and the
index query (`harness.devices.smi_gpu_indices`) with the GPUs it is given, the way a T4 or V100
box answers them, and fails every other query."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

CAPABILITY_QUERY = "--query-gpu=index,name,compute_cap"
INDEX_QUERY = "--query-gpu=index"
T4 = ("Tesla T4", "7.5")
V100 = ("Tesla V100-SXM2-16GB", "7.0")
A100 = ("NVIDIA A100-SXM4-80GB", "8.0")


def install_fake_nvidia_smi(directory: Path, gpus: Sequence[tuple[str, str]]) -> Path:
    """Write `directory/nvidia-smi` listing `gpus` ((name, capability), indexed from 0);
    returns the directory, to put first on PATH."""
    directory.mkdir(parents=True, exist_ok=True)
    listing = "".join(f"{i}, {name}, {cap}\\n" for i, (name, cap) in enumerate(gpus))
    indices = "".join(f"{i}\\n" for i in range(len(gpus)))
    tool = directory / "nvidia-smi"
    tool.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = "{CAPABILITY_QUERY}" ]; then printf \'{listing}\'; exit 0; fi\n'
        f'if [ "$1" = "{INDEX_QUERY}" ]; then printf \'{indices}\'; exit 0; fi\n'
        "exit 6\n"
    )
    tool.chmod(0o755)
    return directory
