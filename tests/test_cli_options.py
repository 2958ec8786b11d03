"""`run` options added for the matrix, platforms and self-tests: bad values are one line, exit 2."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "argv, cause",
    [
        (["--scenario", "nope"], "unknown scenario 'nope' (known: ec-images-1-2-3"),
        (["--scenario", "ec-video-mp4", "--topology", "1P+1D"], "--scenario names its topology"),
        (["--platform", "cuda"], "--platform cuda needs --devices"),
        (["--platform", "tpu"], "unknown platform 'tpu' (known: cpu, cuda, xpu)"),
        (
            ["--plant-fault", "melt"],
            "unknown fault 'melt' (known: corrupt-ec, zero-kv, drop-kv, drop-metadata, stream-duplicate-chunk)",
        ),
    ],
)
def test_bad_run_options_are_one_line_exit_2(argv: list[str], cause: str, epd_cli) -> None:
    code, _, stderr = epd_cli("run", *argv)
    assert code == 2
    err = stderr.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("epd-harness: error: ") and cause in err[0], err[0]


def test_list_names_scenarios_and_faults(epd_cli) -> None:
    code, out, _ = epd_cli("list")
    assert code == 0
    assert "epd-media-in-decode-tail" in out and "expects ERROR" in out
    assert "corrupt-ec, zero-kv, drop-kv, drop-metadata" in out


def subcommand_helps() -> dict[str, str]:
    from harness.cli.main import subcommand_parsers

    return {name: sub.format_help() for name, sub in subcommand_parsers().items()}


def test_the_subcommand_parsers_are_every_command_the_usage_lists() -> None:
    """What the help test below reads is every command `epd-harness --help` offers."""
    from harness.cli.main import build_parser, subcommand_parsers

    usage = " ".join(build_parser().format_usage().split())
    listed = re.search(r"\{([a-z,-]+)\}", usage)
    assert listed, usage
    assert list(subcommand_parsers()) == listed.group(1).split(","), usage


def test_every_subcommand_shows_its_defaults_and_no_empty_ones() -> None:
    """Found in review: `fuzz --help` hid that it draws 100 requests with seed 0 and stops at
    780 s; `load` hid 64 requests at concurrency 16. A default is shown unless the help already
    names it; a flag's False or an unset None is never shown."""
    helps = subcommand_helps()
    flat = {name: " ".join(text.split()) for name, text in helps.items()}
    assert "requests to draw (default: 100)" in flat["fuzz"]
    assert "(same seed, same list) (default: 0)" in flat["fuzz"]
    assert "(default: 780.0)" in flat["fuzz"]
    assert "per round (default: 64)" in flat["load"]
    assert "(default: 4096)" in flat["run"]  # --max-model-len, which had no help at all
    for name, text in flat.items():
        assert "(default: None)" not in text, name
        assert "(default: False)" not in text, name
        assert "(default: [])" not in text, name
