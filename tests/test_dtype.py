"""`--dtype` (harness/preflight/dtype.py): a T4 or V100 box runs the harness in float16, and a
dtype the served vLLM would not compute in is refused before anything starts, in one line
naming the cause, never served as something else. The GPUs and the served interpreter are
given as data here; tests/test_devices.py reads them from a fake nvidia-smi, and
tests/test_bad_input.py shows the refusals as the CLI prints them."""

from __future__ import annotations

import dataclasses
import json
import subprocess

import pytest

from harness import devices
from harness.cli import doctor
from harness.cli.main import build_parser, request_from_args
from harness.devices import GpuCapability, bf16_refusal
from harness.errors import BadInput
from harness.preflight import RunRequest
from harness.preflight.config import check_arguments
from harness.preflight.dtype import (
    asked_bf16,
    check_bf16_devices,
    check_bf16_here,
    check_cpu_dtype,
    check_dtype_name,
    dtype_or_default,
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
    assert RunRequest().dtype is None  # not given: served as the default
    assert DEFAULT_DTYPE == "bfloat16" == dtype_or_default(None)
    assert [dtype_or_default(d) for d in DTYPES] == list(DTYPES)
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


@pytest.mark.parametrize("given", [[], ["--dtype", "bfloat16"], ["--dtype", "float16"]])
@pytest.mark.parametrize("command", ["run", "load", "fuzz"])
def test_a_dtype_not_given_reaches_the_preflight_as_not_given(
    command: str, given: list[str]
) -> None:
    """`--dtype bfloat16` typed and `--dtype` left out were one request (argparse's default
    was bfloat16), so the refusal called a typed bfloat16 "the default" (found walking a T4
    box). Left out, the request's dtype is None (served as DEFAULT_DTYPE); a session's
    --epd-dtype likewise (tests/test_plugin_xdist.py holds a real session to it)."""
    from harness.cli import fuzz, load

    topology = [] if command == "run" else ["--topology", "1P+1D"]
    args = build_parser().parse_args([command, *topology, *given])
    to_request = {"run": request_from_args, "load": load.load_request, "fuzz": fuzz.fuzz_request}
    assert to_request[command](args).dtype == (given[1] if given else None)
    options = {"--epd-platform": "cpu", **({"--epd-dtype": given[1]} if given else {})}
    assert session_request(options.get, "runs", ("main", 1)).dtype == (given[1] if given else None)


def test_bfloat16_is_refused_on_a_gpu_below_8_naming_it_and_float16() -> None:
    refusal = bf16_refusal("bfloat16", [A100, T4, V100], asked=asked_bf16(None))
    assert refusal == (
        "--dtype bfloat16 (the default) needs compute capability 8.0 or more, which vLLM "
        "checks only once an instance has started, and GPU 1 (Tesla T4, compute capability "
        "7.5), GPU 2 (Tesla V100-SXM2-16GB, compute capability 7.0) have less: pass --dtype "
        "float16"
    )
    assert bf16_refusal("float16", [T4]) is None
    assert bf16_refusal("float32", [V100]) is None
    assert bf16_refusal("bfloat16", [A100]) is None


def test_a_bfloat16_given_is_not_called_the_default() -> None:
    """`--dtype bfloat16` typed was refused as "--dtype bfloat16 (the default)" (found walking
    a T4 box): "the default" only where no dtype was given (None, `asked_bf16`); a caller
    that cannot tell (the Ray launcher, `harness.devices.bf16_refusal`'s own words) names it
    as asked, and one naming it its own way (repro: the bundle's) still does."""
    assert bf16_refusal("bfloat16", [T4]) == (
        "--dtype bfloat16 needs compute capability 8.0 or more, which vLLM checks only once "
        "an instance has started, and GPU 1 (Tesla T4, compute capability 7.5) has less: "
        "pass --dtype float16"
    )
    with pytest.raises(BadInput, match=r"^--dtype bfloat16 needs compute capability 8\.0"):
        check_bf16_devices("bfloat16", (1,), [T4])
    with pytest.raises(BadInput, match=r"^--dtype bfloat16 \(the default\) needs"):
        check_bf16_devices(None, (1,), [T4])
    assert str(bf16_refusal("bfloat16", [T4], "fix it", "it")).startswith("it needs ")
    assert str(bf16_refusal("bfloat16", [T4], "fix it", "it")).endswith(": fix it")


def test_this_hosts_gpus_are_read_by_one_helper_only_for_bfloat16(monkeypatch) -> None:
    """run, repro, plan and the GPU rehearsal read nvidia-smi through `check_bf16_here`; a
    dtype other than bfloat16 needs no GPU read, and an unreadable nvidia-smi refuses
    nothing (vLLM still checks)."""
    asked: list[tuple[str, ...]] = []

    def smi(*args: str) -> str | None:
        asked.append(args)
        return "0, NVIDIA A100-SXM4-80GB, 8.0\n1, Tesla T4, 7.5\n"

    monkeypatch.setattr(devices, "run_nvidia_smi", smi)
    check_bf16_here(None, (0,))
    with pytest.raises(BadInput, match=r"^--dtype bfloat16 \(the default\) needs .* GPU 1 "):
        check_bf16_here(None, (0, 1))
    with pytest.raises(BadInput, match=r"^repro's needs .*: another remedy$"):
        check_bf16_here("bfloat16", (1,), remedy="another remedy", asked="repro's")
    assert len(asked) == 3
    check_bf16_here("float16", (0, 1))
    check_bf16_here("float32", (0, 1))
    assert len(asked) == 3, "nvidia-smi is read only where bfloat16 is asked"
    monkeypatch.setattr(devices, "run_nvidia_smi", lambda *args: None)
    check_bf16_here("bfloat16", (0, 1))


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
    assert failed.name == "--dtype bfloat16 on this host's GPUs"
    assert failed.detail.startswith("--dtype bfloat16 needs compute capability 8.0")
    defaulted = doctor.check_dtype_on_gpus(None, "cuda", [A100, T4])
    assert defaulted.name == "--dtype bfloat16 on this host's GPUs"
    assert defaulted.detail.startswith("--dtype bfloat16 (the default) needs")
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


def test_doctors_dtype_fix_is_on_its_hint_line_as_every_other_checks() -> None:
    """The remedy was the end of the check's detail, where every other check puts its fix on
    the `-> ` line below (`Check.hint`, found walking a T4 box)."""
    failed = doctor.check_dtype_on_gpus(None, "cuda", [A100, T4])
    assert failed.hint == "run with --dtype float16 (pytest --epd-dtype float16)"
    assert failed.detail == (
        "--dtype bfloat16 (the default) needs compute capability 8.0 or more, which vLLM "
        "checks only once an instance has started, and GPU 1 (Tesla T4, compute capability "
        "7.5) has less"
    )
    assert doctor.format_checks([failed]).splitlines() == [
        f"[FAIL] --dtype bfloat16 on this host's GPUs: {failed.detail}",
        "       -> run with --dtype float16 (pytest --epd-dtype float16)",
    ]
    assert doctor.check_dtype_on_gpus("bfloat16", "cuda", [A100]).hint == ""


def doctor_on_a_cpu_vllm(monkeypatch, tmp_path, dtype, cpuinfo, zentorch="5.1.0"):
    """`doctor --dtype DTYPE` on a vllm-cpu whose interpreter has `zentorch` (None: not
    installed), on a host whose /proc/cpuinfo says `cpuinfo`: its dtype check."""
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")  # never run: `served` answers
    python.chmod(0o755)
    vllm = python.parent / "vllm"
    vllm.write_text(f"#!{python}\n")
    vllm.chmod(0o755)

    def served(code: str, interpreter) -> subprocess.CompletedProcess:
        if "current_platform" in code:
            return subprocess.CompletedProcess([], 0, "0.32.0+cpu cpu\n", "")
        if "zentorch" in code:
            found = zentorch is not None
            out = f"{zentorch}\n" if found else ""
            err = "" if found else "PackageNotFoundError: zentorch"
            return subprocess.CompletedProcess([], 0 if found else 1, out, err)
        return subprocess.CompletedProcess([], 0, "1.0\n", "")

    monkeypatch.setattr(doctor, "_run_python", served)
    monkeypatch.setattr(doctor, "host_cpuinfo", lambda: cpuinfo)
    monkeypatch.setattr(
        doctor, "check_vllm_cli", lambda executable: doctor.Check("vllm CLI runs", True, "0.32.0")
    )
    checks = doctor.run_checks(str(vllm), None, dtype=dtype)
    return next(c for c in checks if c.name.startswith("--dtype"))


def test_doctor_checks_the_dtype_on_a_cpu_vllm_as_run_does(monkeypatch, tmp_path) -> None:
    """Found in the audit of ignored flags: on a CPU build `doctor --dtype float16` said
    "[ok] not needed" where `run --dtype float16` is refused (vllm-cpu serves it on its
    ZenCpuPlatform, which has no float16 compute): doctor's --dtype was read on GPUs only."""
    failed = doctor_on_a_cpu_vllm(monkeypatch, tmp_path / "zen", "float16", ZEN)
    assert not failed.ok, failed
    assert failed.name == "--dtype float16 on this host's CPU", failed.name
    assert failed.detail.startswith("--dtype float16 on this AMD CPU with zentorch 5.1.0"), failed
    assert failed.hint == doctor.DOCTOR_CPU_FLOAT16_REMEDY, failed.hint
    for dtype, cpuinfo, zentorch in (
        ("bfloat16", ZEN, "5.1.0"),
        (None, ZEN, "5.1.0"),
        ("float16", XEON, "5.1.0"),
        ("float16", ZEN, None),
    ):
        where = tmp_path / f"{dtype}-{cpuinfo[12:16]}-{zentorch}"
        fine = doctor_on_a_cpu_vllm(monkeypatch, where, dtype, cpuinfo, zentorch)
        assert fine.ok, (dtype, zentorch, fine)


def test_doctor_on_a_cuda_vllm_checks_the_gpus_nvidia_smi_lists(monkeypatch) -> None:
    """On a CUDA build the dtype check reads this host's GPUs (`smi_compute_capabilities`): a
    T4 box asked for the default bfloat16 fails doctor, not "not checked", and passes with
    float16."""
    monkeypatch.setattr(doctor, "smi_compute_capabilities", lambda: [A100, T4])
    failed = doctor.check_dtype(None, "cuda", doctor.THIS_PYTHON)
    assert not failed.ok and "GPU 1 (Tesla T4" in failed.detail, failed
    assert doctor.check_dtype("float16", "cuda", doctor.THIS_PYTHON).ok
