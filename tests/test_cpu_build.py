"""A CPU plan is refused for a vLLM that vLLM itself would not run on the CPU."""

from __future__ import annotations

import pytest

from harness.errors import BadInput
from harness.preflight.vllm import check_cpu_build
from harness.spec.settings import ServedVllm

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "version", ["0.32.0+cpu", "0.27.1+cpu", "0.33.0.dev4+gabc1234.cpu", "unknown"]
)
def test_a_cpu_build_or_an_unread_version_passes_on_cpu(version: str) -> None:
    check_cpu_build(ServedVllm("/venv/bin/vllm", version), "cpu", host_os="linux")


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cu128", "0.33.0.dev4+gabc1234"])
def test_a_gpu_build_is_refused_on_cpu_naming_the_platforms_to_pass(version: str) -> None:
    with pytest.raises(BadInput) as caught:
        check_cpu_build(ServedVllm("/venv/bin/vllm", version), "cpu", host_os="linux")
    message = str(caught.value)
    assert f"vLLM {version} (/venv/bin/vllm) is not a CPU build" in message
    assert "--platform cuda or xpu" in message and "\n" not in message


def test_gpu_platforms_and_macos_take_any_build() -> None:
    """vLLM runs on the CPU on macOS whatever its version; a GPU plan is the GPU's to judge."""
    gpu_build = ServedVllm("/venv/bin/vllm", "0.32.0")
    check_cpu_build(gpu_build, "cpu", host_os="darwin")
    check_cpu_build(gpu_build, "cuda", host_os="linux")
    check_cpu_build(ServedVllm("/venv/bin/vllm", "0.32.0+cpu"), "xpu", host_os="linux")
