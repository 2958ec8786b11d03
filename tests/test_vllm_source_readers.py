"""`--epd-vllm-source` is refused where no selected test reads it (harness/testing/vllm_source.py),
so every test that reads it must be declared a reader, and the nightly's command lines, which
pass it on a commit's build, must stay accepted.

The collections here are real (`pytest --collect-only` in a subprocess, nothing started); the
rule itself, on small test trees, is in tests/test_testing_plugin.py.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness.testing.vllm_source import ENV, OPTION, READER_MODULES
from tests.test_nightly_selection import NIGHTLY, nightly_pytest_options

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parent.parent
TEST_DIRS = ("scenarios", "tests")
OWN_INSTANCES = "own_instances"
SOURCE = "/src/vllm"

DUMP_PLUGIN = """
import json, os
from pathlib import Path

from harness.testing.vllm_source import reads_vllm_source

def pytest_collection_finish(session):
    readers = {item.nodeid: reads_vllm_source(item, "harness") for item in session.items}
    Path(os.environ["EPD_READERS_DUMP"]).write_text(json.dumps(readers))
"""


def reads_the_option(source: str) -> bool:
    """Whether a module's code (not its strings: a test tree written for pytester) reads the
    option: `getoption("--epd-vllm-source")`, `.epd_vllm_source`, or an `own_instances` mark
    naming `export` (`OwnInstances.args` gives an export the source)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "epd_vllm_source":
            return True
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute | ast.Name):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
        constants = {a.value for a in node.args if isinstance(a, ast.Constant)}
        if (name == "getoption" and OPTION in constants) or (
            name == OWN_INSTANCES and "export" in constants
        ):
            return True
    return False


def reading_modules(root: Path) -> set[str]:
    """The test modules under `root` whose code reads the option, as paths from `root`."""
    return {
        path.relative_to(root).as_posix()
        for directory in TEST_DIRS
        for path in sorted((root / directory).glob("test_*.py"))
        if reads_the_option(path.read_text(encoding="utf-8"))
    }


def pytest_run(
    args: list[str], cwd: Path = ROOT, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
        check=False,
    )


def test_every_module_that_reads_the_option_declares_a_reader(tmp_path: Path) -> None:
    """A module that reads `--epd-vllm-source` without a declared reader among its tests
    would have the flag refused when it is all that is selected: each one, collected, holds
    one, and the refusal names each of them."""
    found = reading_modules(ROOT)
    assert found == set(READER_MODULES), "the refusal's list (READER_MODULES) is stale"
    (tmp_path / "readers_dump.py").write_text(DUMP_PLUGIN)
    dump = tmp_path / "readers.json"
    done = pytest_run(
        ["--collect-only", "-q", "-p", "readers_dump", *sorted(found)],
        env={"PYTHONPATH": str(tmp_path), "EPD_READERS_DUMP": str(dump)},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    readers = json.loads(dump.read_text())
    undeclared = {m for m in found if not any(readers[n] for n in readers if n.startswith(m))}
    assert not undeclared, f"read {OPTION} with no test declared a reader: {undeclared}"


def test_a_module_that_reads_the_option_undeclared_is_found_and_refused(tmp_path: Path) -> None:
    """Proof the check above can fail: a new scenario reading the option, unmarked."""
    scenario = tmp_path / "scenarios" / "test_new.py"
    scenario.parent.mkdir()
    scenario.write_text(
        "import pytest\n\npytestmark = pytest.mark.e2e\n\n"
        "def test_new(pytestconfig):\n"
        '    assert pytestconfig.getoption("--epd-vllm-source")\n'
    )
    (tmp_path / "tests").mkdir()
    assert reading_modules(tmp_path) == {f"scenarios/{scenario.name}"}
    (tmp_path / "conftest.py").write_text((ROOT / "conftest.py").read_text(encoding="utf-8"))
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = --strict-markers\n")
    done = pytest_run(
        ["--collect-only", "-q", "scenarios", OPTION, SOURCE],
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT)},  # this checkout's plugin, not an installed one
    )
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, done.stdout[-3000:]
    assert f"ERROR: {OPTION}: no selected test reads it" in done.stderr, done.stderr


def nightly_parity_options() -> list[str]:
    """The nightly's upstream parity step's pytest arguments, without its junit file."""
    (step,) = [
        step
        for job in yaml.safe_load(NIGHTLY.read_text())["jobs"].values()
        for step in job["steps"]
        if "parity" in step.get("name", "")
    ]
    words = shlex.split(re.search(r"args=\((.*?)\)", step["run"], re.S).group(1))
    junit = words.index("--junitxml")
    return words[:junit] + words[junit + 2 :]


@pytest.mark.parametrize("step", ["scenarios", "parity"])
def test_the_nightlys_command_lines_with_a_vllm_source_are_accepted(step: str) -> None:
    """The nightly (and the Buildkite step, which runs the same lines) gives a commit's build
    its tree: the flag to the served vLLM's parity, the job's setting to its e2e selection."""
    if step == "scenarios":
        done = pytest_run(["--collect-only", "-q", *nightly_pytest_options()], env={ENV: SOURCE})
    else:
        done = pytest_run(["--collect-only", "-q", *nightly_parity_options(), OPTION, SOURCE])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_a_narrowed_nightly_is_not_refused_for_its_jobs_setting() -> None:
    """A dispatch narrowed to cases that read nothing of the tree (-k, --epd-topology) on a
    commit's build: the source is the job's setting ($EPD_VLLM_SOURCE), which the workflow
    exports whatever the selection, so it is not refused; the same tree typed as the flag is.
    Found in review: with the flag in the workflow, such a dispatch ended at collection, red for
    the harness's own reasons."""
    narrowed = ["--collect-only", "-q", "-m", "e2e", "scenarios/test_matrix.py"]
    done = pytest_run(narrowed, env={ENV: SOURCE})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    typed = pytest_run([*narrowed, OPTION, SOURCE], env={ENV: SOURCE})
    assert typed.returncode == pytest.ExitCode.USAGE_ERROR, typed.stdout[-3000:]


def test_the_jobs_setting_is_the_options_value(tmp_path: Path) -> None:
    """$EPD_VLLM_SOURCE reaches the tests that read the option, as the flag would."""
    (tmp_path / "test_probe.py").write_text(
        "import pytest\n\npytestmark = pytest.mark.unit\n\n\ndef test_reads(pytestconfig):\n"
        f"    print('SOURCE=' + str(pytestconfig.getoption({OPTION!r})))\n"
    )
    seen = {}
    for name, env in (("env", {ENV: SOURCE}), ("unset", {ENV: ""})):
        done = pytest_run(
            ["-p", "conftest", "-q", "-s", "test_probe.py"],
            cwd=tmp_path,
            env={**env, "PYTHONPATH": str(ROOT)},  # this checkout's conftest, as a plugin
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        seen[name] = re.search(r"SOURCE=(\S+)", done.stdout).group(1)
    assert seen == {"env": SOURCE, "unset": "None"}, seen
