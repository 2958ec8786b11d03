"""`epd-harness ARGS` run in the test's own process: its exit code and what it printed.

The one CLI runner of the tests. In-process, because most CLI tests check a refusal made
before anything starts (exit 2, one line), and a subprocess per case would cost a second of
imports each; tests of signals and of a SIGKILLed harness start `python -m harness.cli.main`
themselves (tests/test_chaos.py).

In a test, take the `epd_cli` fixture (harness.testing.harness_test_fixtures)::

    def test_unknown_topology(epd_cli) -> None:
        result = epd_cli("run", "--topology", "9Z")
        assert (result.code, result.err) == (2, "epd-harness: error: ...\\n")
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest


class CliResult(NamedTuple):
    """Unpacks as `code, out, err`."""

    code: int
    out: str
    err: str


class CliRunner:
    """Calls `harness.cli.main.main(argv)`; stdout and stderr are read through pytest's
    capsys, so each call returns only what that call printed."""

    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self.capsys = capsys

    def __call__(self, *argv: str | Path) -> CliResult:
        from harness.cli.main import main

        self.capsys.readouterr()  # what the test printed before is not the CLI's
        code = main([str(arg) for arg in argv])
        captured = self.capsys.readouterr()
        return CliResult(code, captured.out, captured.err)


def run_argv(vllm: str | Path, run_dir: Path, *args: str) -> list[str]:
    """`run` on `vllm` (a fake, usually) into `run_dir`, without the shared baseline cache:
    what a test run of the whole CLI needs so that it touches nothing outside the test."""
    return ["run", "--vllm", str(vllm), "--baseline-cache", "off", "--run-dir", str(run_dir), *args]
