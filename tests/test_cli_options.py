"""`run` options added for the matrix, platforms and self-tests: bad values are one line, exit 2."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from harness.errors import BadInput
from harness.serve.attached import AttachedDown

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
    # `epd-harness --help` said list shows "known topologies and prompts" (found walking the
    # docs): every section it prints is named there.
    from harness.cli.main import build_parser

    usage = " ".join(build_parser().format_help().split())
    said = re.search(r" list (.*?) doctor ", usage)
    assert said, usage
    sections = re.findall(r"^([a-z]+(?: [a-z]+)?)(?: \(|:)", out, re.M)
    assert sections == ["topologies", "prompts", "scenarios", "faults", "graded faults"], out
    assert all(section.split()[-1] in said[1] for section in sections), said[1]


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
    assert "not a prefix of it) (default: 0)" in flat["fuzz"]
    assert "(default: 780.0)" in flat["fuzz"]
    assert "per round (default: 64)" in flat["load"]
    assert "(default: 4096)" in flat["run"]  # --max-model-len, which had no help at all
    for name, text in flat.items():
        assert "(default: None)" not in text, name
        assert "(default: False)" not in text, name
        assert "(default: [])" not in text, name


def test_every_option_of_every_subcommand_says_what_it_does() -> None:
    """Found walking the docs: `load --refresh-baseline` had no help at all, and `load
    --baseline-cache` hid the cache it defaults to, which `run --help` names; the two
    commands read both options alike."""
    from harness.cli.main import subcommand_parsers

    silent = [
        f"{name} {max(action.option_strings, key=len)}"
        for name, sub in subcommand_parsers().items()
        for action in sub._actions
        if action.option_strings and not (action.help or "").strip()
    ]
    assert not silent, silent
    flat = {name: " ".join(text.split()) for name, text in subcommand_helps().items()}
    from harness.cli.main import check_command_line, request_from_args
    from harness.preflight.config import _baseline_cache

    read = _baseline_cache(request_from_args(check_command_line(["run"])))
    assert read is not None
    for name in ("run", "load"):
        # The default named is the directory the command reads (a mutant naming the cache's
        # parent survived).
        assert f"baseline cache directory, or 'off' (default: {read.directory})" in flat[name]
        assert "--refresh-baseline recompute the baseline and overwrite" in flat[name], name


RAY_CUDA = ["--launcher", "ray", "--ray-address", "10.0.0.1:6379", "--platform", "cuda"]


@pytest.mark.parametrize(
    "argv, cause",
    [
        # Ray gives each instance a GPU of its own: nothing shares a device there.
        (["run", *RAY_CUDA, "--devices", "0,1,2", "--colocate"], "--colocate lets a topology's"),
        (
            ["load", "--topology", "1P+1D", *RAY_CUDA, "--devices", "0", "--colocate"],
            "--launcher ray gives each instance a GPU of its own",
        ),
        # No topology writes connector files: the shared directory would hold nothing.
        (
            ["run", "--launcher", "ray", "--ray-shared-dir", "/tmp", "--kv-connector", "nixl"]
            + ["--topology", "1P+1D"],
            "--ray-shared-dir holds the connectors' files (ExampleConnector's), and none of "
            "1P+1D writes any (no encoder; KV by nixl): drop --ray-shared-dir",
        ),
        (
            ["fuzz", "--topology", "1P+1D", *RAY_CUDA, "--devices", "0,1,2"]
            + ["--ray-shared-dir", "/tmp"],
            "none of 1P+1D writes any (no encoder; KV by nixl)",
        ),
    ],
)
def test_flags_the_ray_launcher_would_ignore_are_refused_before_anything_starts(
    argv: list[str], cause: str
) -> None:
    """Checked as the commands check their arguments first (no cluster is contacted); each
    was accepted and ignored."""
    from harness.cli.main import check_command_line
    from harness.errors import BadInput

    with pytest.raises(BadInput) as refused:
        check_command_line(argv)
    assert cause in str(refused.value), refused.value


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--launcher", "ray", "--ray-shared-dir", "/tmp", "--topology", "1P+1D"],
        ["run", "--launcher", "ray", "--ray-shared-dir", "/tmp", "--kv-connector", "nixl"],
        ["run", *RAY_CUDA, "--devices", "0,1,2", "--ray-shared-dir", "/tmp"],
        ["run", *RAY_CUDA, "--devices", "0,1,2"],
    ],
)
def test_the_ray_launchers_flags_where_they_are_used_pass(argv: list[str]) -> None:
    """ExampleConnector's KV files (1P+1D on cpu), an encoder's embeddings (the default
    topologies include 1E+1PD): the shared directory holds them."""
    from harness.cli.main import check_command_line

    check_command_line(argv)


def test_list_names_what_each_prompt_asks_to_generate_not_its_prompt_tokens(epd_cli) -> None:
    """Found walking the CLI: `list` printed "32 tokens" per prompt where `run` prints each
    prompt's prompt tokens (187 for the image): a user compared the two and was confused. The
    column is the max new tokens of the rendered request; prompt tokens are `run`'s to count."""
    from harness.spec.prompts import SKELETON_PROMPTS, requested_tokens

    code, out, _ = epd_cli("list")
    assert code == 0
    prompts = out.split("prompts", 1)[1].split("scenarios", 1)[0]
    assert "prompt tokens depend on the model: 'run' counts and prints them" in prompts
    for prompt in SKELETON_PROMPTS:
        line = next(x for x in prompts.splitlines() if x.split()[:1] == [prompt.name])
        assert line.endswith(f"max new tokens {requested_tokens(prompt)}"), line


def test_version_prints_the_running_harness_version(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`epd-harness --version` was absent (found walking the CLI)."""
    from harness.cli.main import main
    from harness.cli.version import SOURCE_ROOT, _declared_version

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"epd-harness {_declared_version(SOURCE_ROOT / 'pyproject.toml')}"), out
    assert len(out.splitlines()) == 1, out


class FakeDistribution:
    """An installed `epd-harness` as importlib.metadata shows it (its version, its
    direct_url.json, where its files are)."""

    def __init__(self, version: str, site: Path, direct_url: dict | None = None) -> None:
        self.version = version
        self.site = site
        self.direct_url = direct_url

    def read_text(self, name: str) -> str | None:
        return (
            json.dumps(self.direct_url) if name == "direct_url.json" and self.direct_url else None
        )

    def locate_file(self, path: str) -> Path:
        return self.site / path


def test_the_version_is_the_installed_one_only_when_it_is_the_code_running(
    tmp_path: Path,
) -> None:
    from harness.cli.version import harness_version

    tree = tmp_path / "checkout"
    (tree / "harness").mkdir(parents=True)
    (tree / "harness" / "__init__.py").write_text("")
    (tree / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["x"]\n\n[project]\nname = "epd-harness"\n'
        'version = "0.2.0"\ndependencies = [\n    "a",\n]\n\n[tool.x]\nversion = "9"\n'
    )
    editable = {"url": tree.as_uri(), "dir_info": {"editable": True}}
    assert harness_version(tree, FakeDistribution("0.2.0", tmp_path / "site", editable)) == "0.2.0"
    # A wheel install whose `harness` is the one running (site-packages/harness).
    assert harness_version(tree, FakeDistribution("0.2.0", tmp_path / "checkout")) == "0.2.0"
    # A wheel of another version in site-packages, this checkout run through PYTHONPATH.
    assert harness_version(tree, FakeDistribution("0.1.0", tmp_path / "site")) == (
        f"0.2.0 (source tree {tree}, not the installed distribution)"
    )
    # Another checkout installed (editable), this one run through PYTHONPATH: its version.
    other = {"url": (tmp_path / "main").as_uri(), "dir_info": {"editable": True}}
    assert harness_version(tree, FakeDistribution("0.1.0", tmp_path / "site", other)) == (
        f"0.2.0 (source tree {tree}, not the installed distribution)"
    )
    (tree / "pyproject.toml").unlink()
    assert harness_version(tree, FakeDistribution("0.1.0", tmp_path / "site", other)).startswith(
        "unknown"
    )


@pytest.mark.parametrize(
    "raised, exit_code",
    [
        # A fuzz run's start meeting a deployment that is not serving: exit 1, not bad input.
        (AttachedDown("the proxy http://127.0.0.1:1 is not reachable"), 1),
        (BadInput("unknown topology 'nope'"), 2),
    ],
)
def test_a_harness_error_reaching_the_command_line_exits_with_its_own_code(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    raised: Exception,
    exit_code: int,
) -> None:
    """Each HarnessError says its exit code (harness.errors); `main` exits with it. Found in
    review: a mutant that exited 2 for every one of them survived every test."""
    from harness.cli import main as cli

    def raising(_args: object) -> int:
        raise raised

    monkeypatch.setattr(cli, "command_list", raising)
    assert cli.main(["list"]) == exit_code
    assert capsys.readouterr().err == f"epd-harness: error: {raised}\n"


def test_the_cli_runner_returns_only_what_its_call_printed(epd_cli) -> None:
    """A test's own prints before the call are not the CLI's: a refusal compared whole
    (`(code, err) == (2, "epd-harness: error: ...")`) must not fail on them, nor pass on them.
    Found in review: a mutant of the runner that kept them survived the CLI tests."""
    import sys

    print("the test's own line")
    print("the test's own error", file=sys.stderr)
    result = epd_cli("run", "--topology", "9Z")
    assert result.code == 2
    assert "the test's own" not in result.out + result.err, result
    assert result.err.startswith("epd-harness: error:"), result.err
