"""`--dtype` (harness/preflight/dtype.py): a T4 or V100 box runs the harness in float16, and a
dtype the served vLLM would not compute in is refused before anything starts, in one line
naming the cause, never served as something else. The GPUs and the served interpreter are
given as data here; tests/test_devices.py reads them from a fake nvidia-smi, and
tests/test_bad_input.py shows the refusals as the CLI prints them."""

from __future__ import annotations

import dataclasses
import json

import pytest

from harness.cli import doctor
from harness.devices import GpuCapability
from harness.errors import BadInput
from harness.preflight import RunRequest
from harness.preflight.config import check_arguments
from harness.preflight.dtype import (
    bf16_refusal,
    check_bf16_devices,
    check_cpu_dtype,
    check_dtype_name,
)
from harness.run.export.reference import rendered_commands
from harness.run.repro import Bundle
from harness.spec.instances import InstanceSpec
from harness.spec.platforms import CPU, CUDA
from harness.spec.topology import DEFAULT_DTYPE, DTYPES, Role, serving_for
from harness.testing.session_options import session_request

pytestmark = pytest.mark.unit

A100 = GpuCapability(0, "NVIDIA A100-SXM4-80GB", (8, 0))
T4 = GpuCapability(1, "Tesla T4", (7, 5))
V100 = GpuCapability(2, "Tesla V100-SXM2-16GB", (7, 0))
ZEN = "vendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"
XEON = "vendor_id\t: GenuineIntel\nflags\t\t: fpu avx2 avx512f amx_tile\n"


def test_every_instance_serves_the_dtype_asked_and_bfloat16_by_default() -> None:
    assert DEFAULT_DTYPE == "bfloat16" == RunRequest().dtype
    for dtype in DTYPES:
        argv = InstanceSpec("b", Role.BASELINE, 20000, serving_for(CPU, "/m", dtype=dtype)).argv()
        assert argv[argv.index("--dtype") + 1] == dtype


def test_vllms_auto_is_refused_with_its_cause_and_an_unknown_name_with_the_known() -> None:
    assert [check_dtype_name(d) for d in DTYPES] == list(DTYPES)
    with pytest.raises(BadInput, match="^--dtype auto lets vLLM choose each instance's dtype"):
        check_dtype_name("auto")
    with pytest.raises(BadInput, match=r"^unknown dtype 'half' \(known: bfloat16, float16, "):
        check_dtype_name("half")
    # The preflight's first, cheapest checks hold it: a pytest session's --epd-dtype too.
    with pytest.raises(BadInput, match="^--dtype auto"):
        check_arguments(RunRequest(dtype="auto"), read_files=False)


def test_the_sessions_epd_dtype_is_the_runs_dtype() -> None:
    options = {"--epd-dtype": "float16", "--epd-platform": "cpu"}
    request = session_request(options.get, "runs", ("main", 1))
    assert request.dtype == "float16"


def test_bfloat16_is_refused_on_a_gpu_below_8_naming_it_and_float16() -> None:
    refusal = bf16_refusal("bfloat16", [A100, T4, V100])
    assert refusal == (
        "--dtype bfloat16 (the default) needs compute capability 8.0 or more, which vLLM "
        "checks only once an instance has started, and GPU 1 (Tesla T4, compute capability "
        "7.5), GPU 2 (Tesla V100-SXM2-16GB, compute capability 7.0) have less: pass --dtype "
        "float16"
    )
    assert bf16_refusal("float16", [T4]) is None
    assert bf16_refusal("float32", [V100]) is None
    assert bf16_refusal("bfloat16", [A100]) is None


def test_only_the_gpus_devices_names_are_judged_and_unread_ones_are_not() -> None:
    check_bf16_devices("bfloat16", (0,), [A100, T4])  # the T4 serves nothing here
    check_bf16_devices("bfloat16", (1,), None)  # nvidia-smi could not say: vLLM still checks
    with pytest.raises(BadInput, match=r"GPU 1 \(Tesla T4, compute capability 7.5\)"):
        check_bf16_devices("bfloat16", (0, 1), [A100, T4])


def test_float16_is_refused_where_vllm_cpu_serves_it_on_zen_cpu_platform() -> None:
    zentorch = {"zentorch": "5.1.0", "transformers": "4.57.1"}
    with pytest.raises(BadInput) as refused:
        check_cpu_dtype("float16", zentorch, ZEN)
    assert str(refused.value).startswith(
        "--dtype float16 on this AMD CPU with zentorch 5.1.0 installed: vLLM serves it on its "
        "ZenCpuPlatform"
    )
    assert str(refused.value).endswith(
        "pass --dtype bfloat16 or float32 (or serve a vLLM without zentorch)"
    )
    check_cpu_dtype("bfloat16", zentorch, ZEN)
    check_cpu_dtype("float32", zentorch, ZEN)
    check_cpu_dtype("float16", {"transformers": "4.57.1"}, ZEN)  # CpuPlatform: float16 runs
    check_cpu_dtype("float16", zentorch, XEON)  # not vLLM's Zen test: CpuPlatform


def test_doctor_names_the_gpu_bfloat16_cannot_run_on() -> None:
    failed = doctor.check_dtype_on_gpus("bfloat16", "cuda", [A100, T4])
    assert not failed.ok
    assert "GPU 1 (Tesla T4, compute capability 7.5)" in failed.detail
    assert failed.detail.endswith("run with --dtype float16 (pytest --epd-dtype float16)")
    assert doctor.check_dtype_on_gpus("float16", "cuda", [A100, T4]).ok
    fine = doctor.check_dtype_on_gpus("bfloat16", "cuda", [A100])
    assert (fine.ok, fine.detail) == (True, "compute capability: GPU 0 8.0")
    assert doctor.check_dtype_on_gpus("bfloat16", "cuda", None).ok
    assert doctor.check_dtype_on_gpus("bfloat16", "cpu", None).detail.startswith("not needed")


def test_a_bundle_replays_and_exports_the_dtype_it_recorded(tmp_path) -> None:
    """run.json's `serving` is the ServingConfig as data (harness/report/bundle.py); repro
    serves `Bundle.serving()` again, and an export renders from it the baseline the run took
    from its cache (no recorded command): a T4's float16 run must stay float16 there."""
    serving = serving_for(CUDA, "/models/qwen", dtype="float16")
    run = {
        "serving": json.loads(json.dumps(dataclasses.asdict(serving))),
        "platform_profile": "cuda",
        "devices": [0, 1],
        "served_vllm": {"version": "0.32.0"},
    }
    bundle = Bundle(path=tmp_path, run=run, requests={}, cases=[])
    assert bundle.serving() == serving
    [(_, command)] = rendered_commands(bundle, "baseline")
    assert command["argv"][command["argv"].index("--dtype") + 1] == "float16"
