"""The session's `--epd-*` options refused where the session would ignore them, as
`epd-harness run` refuses its own flags (`check_session_options`)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from harness.testing.session_options import check_session_options

pytestmark = pytest.mark.unit


def option_reader(parser: pytest.Parser, argv: list[str]) -> Callable[[str], object]:
    """`pytest.Config.getoption` of a session given `argv`, as `pytest argv` parses it."""
    options, _ = parser.parse_known_and_unknown_args(argv)
    return lambda name: getattr(options, name.lstrip("-").replace("-", "_"))


def test_proxy_registration_given_without_vllm_proxy_is_refused(
    session_option_parser: pytest.Parser,
) -> None:
    """`run --proxy-registration static` without `--proxy vllm` is refused; the session took
    `--epd-proxy-registration static` as not given and ran the harness's proxy, judging no
    proxy of vLLM's (found in the audit of ignored flags)."""
    option = option_reader(session_option_parser, ["--epd-proxy-registration", "static"])
    with pytest.raises(pytest.UsageError) as refused:
        check_session_options(option)
    message = str(refused.value)
    assert "--epd-proxy-registration static" in message, message
    assert "only --epd-proxy vllm runs" in message, message


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--epd-proxy", "vllm"],
        ["--epd-proxy", "vllm", "--epd-proxy-registration", "static"],
        ["--epd-proxy", "vllm", "--epd-proxy-registration", "dynamic"],
    ],
)
def test_proxy_registration_with_vllm_proxy_or_not_given_is_accepted(
    session_option_parser: pytest.Parser, argv: list[str]
) -> None:
    check_session_options(option_reader(session_option_parser, argv))


@pytest.mark.parametrize(
    "argv", [["--epd-model", ""], ["--epd-model", " "], ["--epd-run-dir", "  "]]
)
def test_an_empty_or_blank_value_is_refused_as_the_cli_refuses_it(
    session_option_parser: pytest.Parser, argv: list[str]
) -> None:
    """`epd-harness run -k ' '` is refused as empty (tests/test_gpu_rehearsal.py); so is a
    session's blank `--epd-*` value, never read as unset and served as the default. Found in
    review by mutation: with only `""` refused, the quick tier stayed green."""
    with pytest.raises(pytest.UsageError) as refused:
        check_session_options(option_reader(session_option_parser, argv))
    assert f"{argv[0]} {argv[1]!r} is empty" in str(refused.value), str(refused.value)
