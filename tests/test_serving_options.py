"""Every command that starts vLLM instances takes the same options for what is served, where,
and how it is judged (`harness.cli.serving_options`), and hands each one to the preflight:
`load` and `fuzz` once had no `--platform`, so on a GPU box they served the CPU profile."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from harness.cli import fuzz, load, main
from harness.cli.serving_options import (
    PROXY_FIELDS,
    SERVING_FIELDS,
    add_connector_options,
    add_dtype_option,
    add_proxy_options,
    add_serving_options,
)
from harness.preflight import RunRequest

pytestmark = pytest.mark.unit

# The commands that start instances, and the module whose `prepare_run` each calls.
INSTANCE_COMMANDS = {"run": main, "load": load, "fuzz": fuzz}
REQUIRED = {"run": [], "load": ["--topology", "1P+1D"], "fuzz": ["--topology", "1P+1D"]}
# Every serving and proxy option away from its default: each must reach the RunRequest.
GIVEN = [
    "--model", "/models/m", "--vllm", "/bin/vllm", "--allow-untested-vllm",
    "--protocol", "ec-items", "--max-model-len", "1234", "--platform", "cuda",
    "--devices", "4,5,6", "--colocate", "--no-enforce-eager", "--dtype", "float16",
    "--kv-connector", "example",
    "--ec-connector", "example", "--reference-policy", "exact", "--launcher", "ray",
    "--ray-address", "127.0.0.2:6379", "--ray-placement", "pack", "--ray-shared-dir", "/shared",
    "--ray-instance-env", "A=1", "--ray-instance-env", "B=2",
    "--proxy", "vllm", "--vllm-source", "/src/vllm", "--proxy-registration", "dynamic",
]  # fmt: skip
EXPECTED = {
    "model": "/models/m",
    "vllm": "/bin/vllm",
    "allow_untested_vllm": True,
    "protocol": "ec-items",
    "max_model_len": 1234,
    "platform": "cuda",
    "devices": "4,5,6",
    "colocate": True,
    "no_enforce_eager": True,
    "dtype": "float16",
    "kv_connector": "example",
    "ec_connector": "example",
    "reference_policy": "exact",
    "launcher": "ray",
    "ray_address": "127.0.0.2:6379",
    "ray_placement": "pack",
    "ray_shared_dir": "/shared",
    "ray_instance_env": ("A=1", "B=2"),
    "proxy": "vllm",
    "attach": None,
    "vllm_source": "/src/vllm",
    "proxy_registration": "dynamic",
}


class Asked(Exception):
    """What a command asked the preflight for; raised so that nothing starts."""

    def __init__(self, request: RunRequest) -> None:
        self.request = request


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def test_the_shared_options_fill_run_request_fields_of_their_names() -> None:
    fields = {f.name for f in dataclasses.fields(RunRequest)}
    assert set(SERVING_FIELDS + PROXY_FIELDS) <= fields
    assert set(EXPECTED) == set(SERVING_FIELDS + PROXY_FIELDS)


@pytest.mark.parametrize("command", sorted(INSTANCE_COMMANDS))
def test_every_command_that_starts_instances_has_every_shared_option(command: str) -> None:
    shared = argparse.ArgumentParser()
    add_serving_options(shared)
    add_proxy_options(shared, attach_help="")
    subparsers = next(
        a for a in main.build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    missing = option_strings(shared) - option_strings(subparsers.choices[command])
    assert not missing, f"{command} lacks {sorted(missing)}"


@pytest.mark.parametrize("command", sorted(INSTANCE_COMMANDS))
def test_every_shared_option_reaches_the_preflight(
    command: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def asked(request: RunRequest) -> None:
        raise Asked(request)

    monkeypatch.setattr(INSTANCE_COMMANDS[command], "prepare_run", asked)
    argv = [command, *REQUIRED[command], *GIVEN, "--run-dir", str(tmp_path / "run")]
    with pytest.raises(Asked) as got:
        main.main(argv)
    request = got.value.request
    given = {name: getattr(request, name) for name in EXPECTED}
    assert given == EXPECTED


def test_plan_takes_the_connector_and_dtype_options_run_takes() -> None:
    """They change every P, D and encoder line (the dtype every line), so `plan` must be able
    to show them."""
    connectors = argparse.ArgumentParser()
    add_connector_options(connectors)
    add_dtype_option(connectors)
    subparsers = next(
        a for a in main.build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    missing = option_strings(connectors) - option_strings(subparsers.choices["plan"])
    assert not missing, f"plan lacks {sorted(missing)}"
