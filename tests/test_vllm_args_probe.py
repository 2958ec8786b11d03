"""The parser probe's own logic (harness/preflight/vllm_args.py, `PROBE`), run on a stand-in for
vLLM's CLI modules: main() builds its parser once for a batch of lines, and every line is
judged as main() judges it; where the kept parser and serve command cannot stand in for main()
(a main() that judges beyond them, or never validates), main() judges every line.

The stand-in is a `vllm` package put first on the probe's path, shaped as vLLM's CLI is (main()
builds an argparse parser with a `subparser` destination and calls the serve command's
`validate`, then its `dispatch_function`), and counting main()'s parser builds in a file. That
the real parser judges alike both ways is `tests/test_vllm_args_model.py`'s.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from harness.errors import BadInput
from harness.preflight import vllm_args

pytestmark = pytest.mark.check

SERVE = """
class ServeSubcommand:
    name = "serve"

    @staticmethod
    def cmd(args):
        raise SystemExit("a server would start here")

    def validate(self, args):
        if args.max_model_len is not None and args.max_model_len < 16:
            raise ValueError("max_model_len must be at least 16")
"""

MAIN = """
import argparse, os, sys
from vllm.entrypoints.cli import serve

def main():
    with open(os.environ["FAKE_CLI_BUILDS"], "a") as builds:
        builds.write("built\\n")
    parser = argparse.ArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    command = serve.ServeSubcommand()
    serve_parser = subparsers.add_parser("serve")
    serve_parser.add_argument("model_tag")
    serve_parser.add_argument("--port", type=int)
    serve_parser.add_argument("--max-model-len", type=int)
    serve_parser.set_defaults(dispatch_function=command.cmd)
    subparsers.add_parser("bench").add_argument("--rate", type=float)
    args = parser.parse_args()
    if args.subparser == "serve" and not os.environ.get("FAKE_CLI_NO_VALIDATE"):
        command.validate(args)
    if os.environ.get("FAKE_CLI_MAIN_RULE") and "--port" in sys.argv:
        raise ValueError("main() refuses --port itself")
    if hasattr(args, "dispatch_function"):
        args.dispatch_function(args)
"""

LINES = {
    "good/a": ["serve", "MODEL", "--port", "20000"],
    "unknown-flag": ["serve", "MODEL", "--port", "20000", "--no-such-flag"],
    "good/b": ["serve", "MODEL", "--port", "20000", "--max-model-len", "4096"],
    "bad-int": ["serve", "MODEL", "--port", "twenty"],
    "validate": ["serve", "MODEL", "--max-model-len", "8"],
    "not-serve": ["bench", "--rate", "2"],
    "good/c": ["serve", "MODEL", "--max-model-len", "64"],
}


@pytest.fixture
def fake_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The stand-in `vllm` package first on the probe's path; the file counting main()'s builds."""
    cli = tmp_path / "path" / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    for package in (cli, cli.parent, cli.parent.parent):
        (package / "__init__.py").write_text("")
    (cli / "serve.py").write_text(textwrap.dedent(SERVE))
    (cli / "main.py").write_text(textwrap.dedent(MAIN))
    builds = tmp_path / "builds"
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "path"))
    monkeypatch.setenv("FAKE_CLI_BUILDS", str(builds))
    return builds


def probe(builds: Path, monkeypatch: pytest.MonkeyPatch, *, one_parser: bool = True):
    """The verdicts on LINES, and how many parsers main() built for them."""
    builds.unlink(missing_ok=True)
    with monkeypatch.context() as patch:
        if not one_parser:
            patch.setattr(vllm_args, "PROBE", f"ONE_PARSER = False\n{vllm_args.PROBE}")
        results, _seconds = vllm_args._run_probe(["python3"], LINES)
    return results, len(builds.read_text().splitlines())


def test_main_builds_its_parser_once_and_each_line_is_judged_as_main_judges_it(
    fake_cli: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept, kept_builds = probe(fake_cli, monkeypatch)
    by_main, main_builds = probe(fake_cli, monkeypatch, one_parser=False)
    assert (kept_builds, main_builds) == (1, len(LINES))
    assert kept == by_main
    assert [name for name, verdict in kept.items() if verdict is None] == [
        "good/a",
        "good/b",
        "good/c",
    ]
    assert "unrecognized arguments: --no-such-flag" in kept["unknown-flag"]
    assert "invalid int value: 'twenty'" in kept["bad-int"]
    assert kept["validate"] == "ValueError: max_model_len must be at least 16"
    assert kept["not-serve"] == "parsed, but not as vllm serve"


def test_a_main_that_judges_beyond_its_parser_and_validate_judges_every_line(
    fake_cli: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """main() refuses the first line by a rule of its own, after validating it: the kept pair,
    which accepts that line, is never used. (A rule that spares the first line a pair judged
    is not caught this way: that both ways agree on vLLM's own lines is the model test's.)"""
    monkeypatch.setenv("FAKE_CLI_MAIN_RULE", "1")
    results, builds = probe(fake_cli, monkeypatch)
    assert builds == len(LINES)
    assert results["good/a"] == results["good/b"] == "ValueError: main() refuses --port itself"
    assert results["good/c"] is None


def test_a_main_that_never_validates_judges_every_line(
    fake_cli: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_CLI_NO_VALIDATE", "1")
    results, builds = probe(fake_cli, monkeypatch)
    assert builds == len(LINES)
    assert results["validate"] is None  # this main() does not validate, so neither may the probe


def test_a_probe_killed_while_writing_its_verdicts_is_one_line_not_a_traceback(
    tmp_path: Path,
) -> None:
    """The served interpreter killed (the OOM killer on a loaded machine) after it opened the
    verdicts file and before it finished it: what it left is no verdict of any line. Refused
    in one line by its exit status, not read: read, it was a JSONDecodeError's traceback."""
    killed = tmp_path / "killed.py"
    killed.write_text(
        textwrap.dedent(
            """
            import os, sys
            program = sys.argv[2]
            out = program.split("\\n", 1)[0].split("=", 1)[1].strip().strip("'")
            with open(out, "w") as verdicts:
                verdicts.write('{"good/a": nu')
            sys.stderr.write("Killed\\n")
            sys.stderr.flush()
            os._exit(137)
            """
        )
    )
    with pytest.raises(BadInput) as refused:
        vllm_args._run_probe(["python3", str(killed)], LINES)
    assert str(refused.value) == (f"cannot run the served vLLM's parser (python3 {killed}): Killed")
