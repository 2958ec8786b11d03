"""The test tiers (harness/testing/tiers.py): every module declares one, `-m` imports only the
modules it can select, and a unit test that starts a process or listens on a socket fails.

The collection rules are shown on small test trees run by pytest in this process (pytester);
the unit tier's guard is shown on this module itself, which is unit.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from harness.testing.tiers import (
    TIERS,
    VIOLATIONS,
    TierError,
    TierViolation,
    declared_tier,
    may_select,
)

pytestmark = pytest.mark.unit

PLUGIN = ("-p", "harness.testing.tiers", "-p", "no:cacheprovider")


# -- reading a module's tier before importing it ---------------------------------------------------


@pytest.mark.parametrize(
    "declaration, tier",
    [
        ("pytestmark = pytest.mark.unit", "unit"),
        ("pytestmark = [pytest.mark.e2e, pytest.mark.epd_topology('1E+1PD')]", "e2e"),
        ("pytestmark = (pytest.mark.timeout(5), pytest.mark.process)", "process"),
        ("pytestmark: object = pytest.mark.check", "check"),
    ],
)
def test_a_declared_tier_is_read_from_the_source(
    tmp_path: Path, declaration: str, tier: str
) -> None:
    module = tmp_path / "test_m.py"
    module.write_text(f"import pytest\nimport no_such_module\n\n{declaration}\n")
    assert declared_tier(module) == tier


@pytest.mark.parametrize(
    "source, says",
    [
        ("import pytest\n\ndef test_x():\n    pass\n", "declares no test tier"),
        ("pytestmark = [pytest.mark.unit, pytest.mark.process]\n", "declares tiers unit, process"),
        ("pytestmark = pytest.mark.ci\n", "declares no test tier"),
        ("pytestmark = MARKS\n", "must be written as pytest.mark.NAME"),
        ("pytestmark = pytest.mark.unit\npytestmark = pytest.mark.e2e\n", "more than once"),
    ],
)
def test_a_module_without_exactly_one_readable_tier_is_refused(
    tmp_path: Path, source: str, says: str
) -> None:
    module = tmp_path / "test_m.py"
    module.write_text(source)
    with pytest.raises(TierError, match=says):
        declared_tier(module)


@pytest.mark.parametrize(
    "expression, selectable",
    [
        ("unit", {"unit"}),
        ("not e2e", set(TIERS) - {"e2e"}),
        ("(not e2e or ci)", set(TIERS)),  # an e2e module may hold `ci` tests
        ("e2e and ci", {"e2e"}),
        ("e2e and (ci or epd_topology) and not slow", {"e2e"}),  # several other markers
        ("unit or check", {"unit", "check"}),
        ("process", {"process"}),
        ("ci", set(TIERS)),  # `ci` outside e2e is refused later, per test
        ("", set(TIERS)),
        # Too many other markers to try every value of: every module is collected, and -m
        # deselects (a mutant that then skipped every module, never imported, survived).
        (" or ".join(f"m{n}" for n in range(9)), set(TIERS)),
    ],
)
def test_a_marker_expression_selects_the_tiers_it_can(
    expression: str, selectable: set[str]
) -> None:
    assert {tier for tier in TIERS if may_select(expression, tier)} == selectable


# -- collection, on small test trees ---------------------------------------------------------------


def test_a_module_without_a_tier_is_a_collection_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_bare="def test_x():\n    pass\n")
    result = pytester.runpytest(*PLUGIN)
    result.stdout.fnmatch_lines(["*test_bare.py declares no test tier; add at its top:*"])
    assert result.ret == pytest.ExitCode.INTERRUPTED


def test_a_test_of_another_tier_than_its_module_is_refused(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_mixed="""
        import pytest

        pytestmark = pytest.mark.process

        def test_fake_server():
            pass

        @pytest.mark.e2e
        def test_real_vllm():
            pass
        """
    )
    result = pytester.runpytest(*PLUGIN, "-m", "process")
    result.stderr.fnmatch_lines(
        ["*test_mixed.py::test_real_vllm: its module declares process, the test is marked e2e*"]
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR


def test_ci_outside_an_e2e_module_is_refused(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_u="import pytest\n\npytestmark = pytest.mark.unit\n\n"
        "@pytest.mark.ci\ndef test_x():\n    pass\n"
    )
    result = pytester.runpytest(*PLUGIN)
    result.stderr.fnmatch_lines(["*`ci` selects e2e tests; this one is unit*"])


def test_only_modules_the_expression_can_select_are_imported(pytester: pytest.Pytester) -> None:
    """What keeps `tox -e fast` (no torch, no vLLM) from importing a model or e2e module."""
    pytester.makepyfile(
        test_pure="import pytest\n\npytestmark = pytest.mark.unit\n\ndef test_x():\n    pass\n",
        test_needs_torch="import pytest\nimport no_torch_here\n\npytestmark = pytest.mark.model\n",
        test_vllm=(
            "import pytest\nimport no_vllm_here\n\npytestmark = pytest.mark.e2e\n\n"
            "@pytest.mark.ci\ndef test_y():\n    pass\n"
        ),
    )
    pytester.runpytest(*PLUGIN, "-m", "unit").assert_outcomes(passed=1)
    pytester.runpytest(*PLUGIN, "-m", "not e2e and not model").assert_outcomes(passed=1)
    # Where the expression can select them, they are imported, and fail loudly.
    pytester.runpytest(*PLUGIN, "-m", "not e2e").assert_outcomes(errors=1)
    pytester.runpytest(*PLUGIN, "-m", "ci").assert_outcomes(errors=2)


def test_an_unregistered_marker_is_an_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_typo="import pytest\n\npytestmark = pytest.mark.unit\n\n"
        "@pytest.mark.procces\ndef test_x():\n    pass\n"
    )
    result = pytester.runpytest(*PLUGIN, "--strict-markers")
    result.stdout.fnmatch_lines(["*'procces' not found in `markers` configuration option*"])


# -- the unit tier starts no process ---------------------------------------------------------------


UNIT_TEST_THAT_SPAWNS = """
import pytest
import subprocess

pytestmark = pytest.mark.{tier}

def test_spawns():
    subprocess.run(["true"], check=True)

def test_spawns_and_swallows_the_error():
    try:
        subprocess.run(["true"], check=True)
    except Exception:
        pass
"""


def test_a_unit_test_that_starts_a_process_fails_naming_it(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_spawn=UNIT_TEST_THAT_SPAWNS.format(tier="unit"))
    result = pytester.runpytest(*PLUGIN)
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        ["*a unit test may not start a process or listen on a socket: subprocess true; move it*"]
    )


def test_a_check_test_may_run_a_tool_but_not_listen(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_check="""
        import socket
        import pytest

        pytestmark = pytest.mark.check

        def test_listens():
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                sock.listen()
        """
    )
    result = pytester.runpytest(*PLUGIN)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*a check test may not listen on a socket: socket.listen*"])


@pytest.fixture
def refusals(request: pytest.FixtureRequest) -> list[str]:
    """What the guard refused in this test; the tests below clear it, since they provoke it on
    purpose (anything left would fail them)."""
    return request.node.stash[VIOLATIONS]


@pytest.mark.parametrize(
    "start",
    [
        lambda: subprocess.run([sys.executable, "-c", "pass"]),
        lambda: subprocess.Popen(["true"]),
        lambda: os.system("true"),
        lambda: os.fork(),
        lambda: os.posix_spawn("/bin/true", ["true"], {}),
        lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
        lambda: multiprocessing.get_context("fork").Process(target=print).start(),
    ],
    ids=["subprocess.run", "Popen", "os.system", "os.fork", "posix_spawn", "mp-spawn", "mp-fork"],
)
def test_this_unit_test_cannot_start_a_process(start, refusals: list[str]) -> None:
    with pytest.raises(TierViolation, match="a unit test may not start a process"):
        start()
    assert len(refusals) == 1, refusals
    refusals.clear()


def test_this_unit_test_cannot_listen_on_a_socket(refusals: list[str]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        with pytest.raises(TierViolation, match="socket.listen"):
            sock.listen()
    assert len(refusals) == 1, refusals
    refusals.clear()


def test_what_the_guard_refused_is_reported_even_when_caught(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_spawn=UNIT_TEST_THAT_SPAWNS.format(tier="unit"))
    result = pytester.runpytest(*PLUGIN, "-k", "swallows")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*a unit test may not start a process*: subprocess true;*"])
