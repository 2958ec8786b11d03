"""A scenario that drives `epd-harness` with topologies of its own gets the session's options
as the CLI's flags, its group's devices, and a refusal for what a command would ignore
(harness/testing/own_instances.py). Before, those commands ran on the CLI's defaults: the cpu
profile, whatever the session served."""

from __future__ import annotations

import fcntl
import os
import re
from pathlib import Path

import pytest

from harness.cli.main import build_parser
from harness.testing.own_instances import (
    COMMANDS,
    NOT_SERVING,
    OPTION_BY_NAME,
    RAY_WHY,
    OwnInstances,
    commands_of,
    in_session_terms,
    refusal,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
NIGHT = {
    "--epd-platform": "cuda",
    "--epd-model": "/models/qwen",
    "--epd-vllm": "/venv/bin/vllm",
    "--epd-colocate": True,
    "--epd-no-enforce-eager": True,
    "--epd-kv-connector": "nixl",
    "--epd-reference-policy": "pd-drift",
    "--epd-proxy": "harness",
    "--epd-proxy-registration": None,  # not given (its default): static with --proxy vllm
    "--epd-vllm-source": "/src/vllm",
    "--epd-launcher": "local",
    "--epd-stream": False,
}


def own(values=NIGHT, devices=(0, 3, 4), commands=("run", "repro", "fuzz", "export"), **kw):
    return OwnInstances(
        values=values,
        commands=commands,
        platform="cuda",
        exclusive_devices=True,
        devices=devices,
        **kw,
    )


def test_every_session_option_reaches_the_cli_or_chooses_only_tests() -> None:
    """A new `--epd-*` option in conftest.py must say how it reaches the commands: without
    this net it would be dropped on their way, the defect this module removes."""
    declared = set(
        re.findall(r'addoption\(\s*"(--epd-[a-z-]+)"', (ROOT / "conftest.py").read_text())
    )
    assert declared == set(OPTION_BY_NAME) | set(NOT_SERVING), declared ^ (
        set(OPTION_BY_NAME) | set(NOT_SERVING)
    )


def test_run_and_fuzz_serve_the_sessions_platform_model_and_devices() -> None:
    """Each flag is the CLI's own (parsed by its parser) and carries the session's value."""
    given = own()
    for command in ("run", "fuzz"):
        required = ["--topology", "1E+1PD"] if command == "fuzz" else []
        args = build_parser().parse_args([command, *required, *given.args(command)])
        assert (args.platform, args.devices, args.model) == ("cuda", "0,3,4", "/models/qwen")
        assert (args.vllm, args.colocate, args.no_enforce_eager) == ("/venv/bin/vllm", True, True)
        assert (args.kv_connector, args.reference_policy) == ("nixl", "pd-drift")
        assert args.vllm_source is None, "the harness's proxy takes no vLLM source"
    assert "--proxy" not in given.args("run"), "the session's default proxy is the CLI's"


def test_repro_and_export_take_what_their_bundle_recorded() -> None:
    given = own()
    assert given.args("repro") == ["--vllm", "/venv/bin/vllm"]
    assert given.args("export") == ["--vllm-source", "/src/vllm"]


def test_a_test_that_runs_vllms_proxy_gives_it_the_sessions_vllm_source() -> None:
    args = build_parser().parse_args(["run", *own().args("run", proxy="vllm")])
    assert (args.proxy, args.vllm_source) == ("vllm", "/src/vllm")


def test_the_sessions_baseline_cache_as_resolved_goes_to_run_only() -> None:
    given = own(baseline_cache="/run/session-shared/baseline")
    args = build_parser().parse_args(["run", *given.args("run")])
    assert args.baseline_cache == "/run/session-shared/baseline"
    assert "--baseline-cache" not in given.args("fuzz")


def test_on_cpu_the_defaults_pass_nothing() -> None:
    """CPU CI's commands keep their argv: a session at its defaults adds no flag."""
    cpu = OwnInstances(
        values={}, commands=("run", "fuzz"), platform="cpu", exclusive_devices=False, devices=None
    )
    assert cpu.args("run") == cpu.args("fuzz") == []


def test_a_command_the_marker_does_not_declare_is_refused() -> None:
    with pytest.raises(ValueError, match="'fuzz' is not among the commands"):
        own(commands=("run",)).args("fuzz")
    with pytest.raises(ValueError, match="not 'serve'"):
        commands_of(("run", "serve"), "test_x.py::test_y")
    with pytest.raises(ValueError, match="not none"):
        commands_of((), "test_x.py::test_y")


def test_a_session_option_a_command_would_ignore_refuses_the_item() -> None:
    on_ray = {**NIGHT, "--epd-launcher": "ray", "--epd-ray-address": "10.0.0.1:6379"}
    for command in ("run", "repro", "fuzz", "export"):
        why = refusal(on_ray, (command,))
        assert why is not None and "Ray connection" in why, command
    assert refusal(NIGHT, ("run", "repro", "fuzz", "export")) is None


def test_a_streamed_session_streams_the_fuzz_it_runs() -> None:
    """`fuzz --stream` exists (docs/fuzzing.md), yet a session's `--epd-stream` deselected the
    planted-fault fuzz as a command that "has no --stream" (found walking the docs:
    docs/testing.md said the same): now it reaches fuzz as it reaches run."""
    streamed = {**NIGHT, "--epd-stream": True}
    assert refusal(streamed, ("run", "repro", "fuzz", "export")) is None
    args = build_parser().parse_args(["fuzz", "--topology", "1E+1PD", *own(streamed).args("fuzz")])
    assert args.stream is True


def test_only_ray_refuses_a_command_whose_parser_has_the_flag() -> None:
    """A command refused a session option while its own parser has the flag: fuzz gained
    --stream and `--epd-stream` still deselected it as lacking one. Only the Ray options are
    refused so, for a reason of their own (`RAY_WHY`); any other such option must reach the
    command (its `takes`)."""
    parsers = build_parser().subcommands
    refused = {
        (option.option, command)
        for option in OPTION_BY_NAME.values()
        for command in COMMANDS
        if command not in option.takes | option.moot
        and option.flag in parsers[command]._option_string_actions
    }
    assert refused, "no option is refused where its flag exists: the check would pass vacuously"
    wrongly = sorted((o, c) for o, c in refused if OPTION_BY_NAME[o].why != RAY_WHY)
    assert not wrongly, f"refused though the command has the flag: {wrongly}"


def test_held_devices_are_leased_as_the_pool_leases_them(tmp_path: Path) -> None:
    """An export's run.sh starts vLLM outside the harness: while it runs the test holds the
    group's devices under the pool's locks, so no worker's instance starts there."""
    given = own(devices=(1, 2), lock_dir=tmp_path)
    with given.held_devices() as devices:
        assert devices == "1,2"
        for device in (1, 2):
            fd = os.open(tmp_path / f"cuda-device-{device}.lock", os.O_RDWR)
            try:
                with pytest.raises(BlockingIOError):
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            finally:
                os.close(fd)
    fd = os.open(tmp_path / "cuda-device-1.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released afterwards
    finally:
        os.close(fd)
    for cores in (None, (0, 1)):  # on CPU the cores the session was given lease nothing
        cpu = OwnInstances(
            values={},
            commands=("export",),
            platform="cpu",
            exclusive_devices=False,
            devices=cores,
            lock_dir=tmp_path / "cpu",
        )
        with cpu.held_devices() as devices:
            assert devices is None
            assert not (tmp_path / "cpu").exists(), sorted((tmp_path / "cpu").iterdir())


@pytest.mark.parametrize(
    "command,topologies,kept",
    [
        ("run", ("1E+1PD",), {"--ec-connector"}),
        ("fuzz", ("1E+1PD",), {"--ec-connector"}),
        ("run", ("1P+1D",), {"--kv-connector"}),
        ("run", ("1P+1D", "1E+1P+1D"), {"--kv-connector", "--ec-connector"}),
    ],
)
def test_a_connector_reaches_only_a_command_whose_topologies_move_it(
    command: str, topologies: tuple[str, ...], kept: set[str]
) -> None:
    """The GPU night rehearsed on the fake vLLM with `--epd-kv-connector nixl` (as the CPU
    night of the GPU judging runs it): the planted repro's and the planted fuzz's 1E+1PD, and
    the video exports' recorded run, were refused by the CLI ("--kv-connector moves KV from P
    to D, and none of 1E+1PD has a D"), four items red for the harness's own reason. Now the
    test names its topologies and a connector none of them moves stays out; the CLI's own
    preflight accepts what is left."""
    from harness.preflight.connectors import ec_connector_for, kv_connector_for
    from harness.spec.platforms import CUDA
    from harness.spec.topology import TOPOLOGIES

    given = own({**NIGHT, "--epd-ec-connector": "example"})
    argv = given.args(command, topologies=topologies)
    assert {"--kv-connector", "--ec-connector"} & set(argv) == kept, argv
    args = build_parser().parse_args([command, "--topology", ",".join(topologies), *argv])
    served = tuple(TOPOLOGIES[name] for name in topologies)
    assert kv_connector_for(args.kv_connector, served, CUDA).name == "nixl"
    ec_connector_for(args.ec_connector, served)


@pytest.mark.parametrize(
    "command,topologies,kept",
    [
        ("run", ("1E+1PD",), False),
        ("fuzz", ("1E+1PD",), False),
        ("run", ("1P+1D",), True),
        ("fuzz", ("1E+1P+1D",), True),
    ],
)
def test_a_reference_policy_reaches_only_a_command_whose_topologies_have_a_p_to_d_hop(
    command: str, topologies: tuple[str, ...], kept: bool
) -> None:
    """The CPU night of the GPU judging runs `--epd-reference-policy pd-drift`, and the planted
    repro's and the planted fuzz's 1E+1PD were refused by the CLI (a policy that judges 1E+1PD
    as the other does): left out there, as a connector it does not move; the CLI's own checks
    accept what is left."""
    from harness.cli.main import check_command_line

    argv = own().args(command, topologies=topologies)
    assert ("--reference-policy" in argv) == kept, argv
    check_command_line([command, "--topology", ",".join(topologies), *argv])


def test_a_preflight_message_names_the_session_options_not_the_clis_flags() -> None:
    """The session's preflight is the CLI's: its refusal named `--platform` or `--topology`,
    flags a pytest command line does not have; each is written as the session option that
    sets it, and a longer flag is not taken for a shorter one it begins with."""
    message = (
        "--platform tpu: unknown; leave 1P+1D out with --topology (or use --colocate); "
        "--proxy-registration dynamic needs --proxy vllm and --vllm-source; --run-dir x"
    )
    assert in_session_terms(message) == (
        "--epd-platform tpu: unknown; leave 1P+1D out with --epd-topology (or use "
        "--epd-colocate); --epd-proxy-registration dynamic needs --epd-proxy vllm and "
        "--epd-vllm-source; --epd-run-dir x"
    )
    # vLLM's own flags that begin with one of the CLI's are vLLM's, not the session's.
    vllms = "unrecognized arguments: --model-impl x --kv-connector-extra-config {}"
    assert in_session_terms(vllms) == vllms
