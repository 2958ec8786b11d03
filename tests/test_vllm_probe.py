"""What the preflight reads of the served vLLM by running the interpreter on its `#!` line.

The served vLLM may live in another environment than the harness (`--vllm OTHER/bin/vllm`), so
its versions and its modules are read from its own interpreter, in a subprocess; the fake vLLM
(harness/testing/fake_vllm.py) stands in for such an environment.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from harness.errors import BadInput
from harness.preflight.connectors import check_kv_connector
from harness.preflight.vllm import probe_served_vllm
from harness.spec.connectors import NIXL
from harness.spec.settings import ServedVllm
from harness.testing.fake_vllm import install_fake_vllm

pytestmark = pytest.mark.process

SERVED = ServedVllm("/venv/bin/vllm", "0.32.0+cpu", "2.13.0+cpu")


def test_served_version_is_read_from_the_served_interpreter(tmp_path: Path) -> None:
    """Trap 2 of issue 8 (tests/test_traps.py): the served vLLM, not the harness's own, keys
    the baseline and the record."""
    vllm = install_fake_vllm(tmp_path, vllm_version="0.28.0", torch_version="2.9.1+cpu")
    served = probe_served_vllm(str(vllm))
    assert (served.version, served.torch_version) == ("0.28.0", "2.9.1+cpu")


def test_nixl_refused_in_one_line_when_the_served_python_lacks_it(tmp_path: Path) -> None:
    vllm = install_fake_vllm(tmp_path, missing_modules=["nixl"])
    served = dataclasses.replace(SERVED, executable=str(vllm))
    with pytest.raises(BadInput) as caught:
        check_kv_connector(served, NIXL)
    message = str(caught.value)
    assert "\n" not in message
    assert "--kv-connector nixl needs nixl" in message
    assert "No module named 'nixl'" in message
    assert "scripts/cpu setup --nixl" in message
