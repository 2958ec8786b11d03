"""`run` options added for the matrix, platforms and self-tests: bad values are one line, exit 2."""

from __future__ import annotations

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
