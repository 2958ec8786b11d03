"""The repository's test tiers: declared by every test module, checked, and kept apart.

A tier says what a test may use, so that `-m unit` runs where neither torch nor vLLM is
installed (`tox -e fast`) and `-m process` never starts real vLLM. Every test module declares
exactly one tier, at its top, where a reader sees it first::

    pytestmark = pytest.mark.process      # or [pytest.mark.e2e, pytest.mark.epd_topology(...)]

The tier is a property of the module, not of a test: a module's imports are what a tier's
environment must have, so a test of another tier goes to a module of its tier. What this plugin
checks:

* a test module that declares no tier, or two, is a collection error naming the fix;
* a test carrying a tier marker other than its module's, or `ci` outside an `e2e` module, is
  a usage error (a test of two tiers is selected by both: `-m process` once ran real vLLM);
* a module whose tier the `-m` expression cannot select is not imported at all (the tier is
  read from the module's source before import): `-m unit` imports no module that needs
  torch, and `-m "not e2e"` none of the scenarios;
* a `unit` test that starts a process (subprocess, fork, spawn) or listens on a socket fails
  with a message naming what it started: such a test belongs to the `process` tier; a `check`
  test may run the repository's tools (ruff, lint-imports, actionlint, git) but listens on
  no socket either.

Registered by the repository's conftest.py (not by `harness.testing.plugin`, whose fixtures
other projects may use without adopting these tiers). docs/testing.md says how to run each.
"""

from __future__ import annotations

import ast
import contextlib
import itertools
import os
import platform
import re
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

# Cheapest first. Every test module declares exactly one.
TIERS: dict[str, str] = {
    "unit": "pure logic: no torch, no vLLM, no browser; starts no process and listens on no "
    "socket (checked) (tox -e fast)",
    "check": "checks of the repository itself (style, layering, docs, workflows): may run the "
    "project's tools to completion, listens on no socket (checked) (tox -e fast)",
    "process": "real small subprocesses and fake servers (launcher, proxy, watchdog, chaos); "
    "starts no real vLLM",
    "model": "needs torch and transformers (the CPU vLLM environment); starts no vLLM server",
    "index": "reads the package index: vLLM release sdists (cached in the harness cache after "
    "the first fetch)",
    "browser": "renders the HTML report in headless Chromium (opt-in: scripts/cpu test --browser)",
    "e2e": "starts real vLLM instances (needs the CPU vLLM environment or a GPU; hold the "
    "machine's vLLM lock)",
}
# Not a tier: the subset of e2e tests CI runs within its time budget.
CI_MARKER = "ci"
CI_DESCRIPTION = "the subset of e2e tests CI runs within its time budget (only in e2e modules)"
EXAMPLE = (
    "pytestmark = pytest.mark.unit  # or check, process, model, index, browser, e2e "
    "(docs/testing.md)"
)

MODULE_TIER = pytest.StashKey[dict[Path, str]]()


class TierError(Exception):
    """A test module whose tier cannot be read from its source."""


def declared_tier(path: Path) -> str:
    """The tier a test module declares in its top-level `pytestmark`, read without importing it.

    Accepted: `pytestmark = pytest.mark.T`, a call of such a marker, or a list or tuple of
    them, with exactly one of them a tier.
    """
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except SyntaxError:
        raise TierError(f"{path.name} does not parse") from None
    declarations = [
        node.value
        for node in tree.body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        and node.value is not None
        and any(
            isinstance(target, ast.Name) and target.id == "pytestmark"
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        )
    ]
    if not declarations:
        raise TierError(f"{path.name} declares no test tier; add at its top: {EXAMPLE}")
    if len(declarations) > 1:
        raise TierError(f"{path.name} assigns pytestmark more than once: declare it once")
    value = declarations[0]
    elements = value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]
    names = [_marker_name(element) for element in elements]
    if None in names:
        raise TierError(
            f"{path.name}: pytestmark must be written as pytest.mark.NAME (or a list of them) "
            f"so that its tier can be read before the module is imported; {EXAMPLE}"
        )
    tiers = [name for name in names if name in TIERS]
    if len(tiers) != 1:
        found = f"declares tiers {', '.join(tiers)}" if tiers else "declares no test tier"
        raise TierError(f"{path.name} {found}: exactly one, please; {EXAMPLE}")
    return tiers[0]


def _marker_name(node: ast.expr) -> str | None:
    """NAME of `pytest.mark.NAME` or `pytest.mark.NAME(...)`; None for anything else."""
    if isinstance(node, ast.Call):
        node = node.func
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "mark"
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "pytest"
    ):
        return node.attr
    return None


_IDENT = re.compile(r"(?::?\w|:|\+|-|\.|\[|\]|\\|/)+")  # pytest's identifier in -m expressions
_NOT_NAMES = {"and", "or", "not", "True", "False", "None"}
_MAX_FREE_NAMES = 8


def may_select(markexpr: str, tier: str) -> bool:
    """Whether `-m markexpr` can select a test of `tier`: True unless it is false for every
    value the markers other than tiers (ci, epd_topology, ...) may have. A test has its
    module's tier and no other."""
    if not markexpr.strip():
        return True
    from _pytest.mark.expression import Expression  # pytest's own -m parser (pytest < 9.2)

    expression = Expression.compile(markexpr)
    free = sorted(
        {name for name in _IDENT.findall(markexpr) if name not in _NOT_NAMES and name not in TIERS}
    )
    if len(free) > _MAX_FREE_NAMES:
        return True  # too many to enumerate: collect, and let -m deselect
    for values in itertools.product((False, True), repeat=len(free)):
        if expression.evaluate(_Matcher(tier, dict(zip(free, values)))):
            return True
    return False


class _Matcher:
    """A test of `tier` (and no other) whose other markers are `assigned` (absent: False)."""

    def __init__(self, tier: str, assigned: dict[str, bool]) -> None:
        self.tier, self.assigned = tier, assigned

    def __call__(self, name: str, /, **_kwargs: object) -> bool:
        return name == self.tier if name in TIERS else self.assigned.get(name, False)


class _TierDeclarationError(pytest.File):
    """Stands for a test module whose tier cannot be read: collecting it reports why."""

    message = ""

    def collect(self) -> list:
        raise self.CollectError(self.message)


class _NotSelected(pytest.File):
    """Stands for a test module of a tier `-m` cannot select: it is never imported."""

    def collect(self) -> list:
        return []


def pytest_configure(config: pytest.Config) -> None:
    for name, description in TIERS.items():
        config.addinivalue_line("markers", f"{name}: tier: {description}")
    config.addinivalue_line("markers", f"{CI_MARKER}: {CI_DESCRIPTION}")
    config.stash[MODULE_TIER] = {}
    # The standard library runs `uname -p` the first time anyone asks for the processor
    # (run.json records it): asked here, once, so that no unit test is blamed for it.
    platform.uname().processor  # noqa: B018


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector):
    """Read the module's tier before importing it; import it only if `-m` may select it."""
    try:
        tier = declared_tier(module_path)
    except TierError as exc:
        node = _TierDeclarationError.from_parent(parent, path=module_path)
        node.message = str(exc)
        return node
    parent.config.stash[MODULE_TIER][module_path] = tier
    if not may_select(parent.config.getoption("markexpr") or "", tier):
        return _NotSelected.from_parent(parent, path=module_path)
    return None  # pytest's own Module


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Before `-m` deselects anything: every test has its module's tier and only that one."""
    tiers = config.stash[MODULE_TIER]
    problems = []
    for item in items:
        declared = tiers.get(item.path)
        marked = {mark.name for mark in item.iter_markers() if mark.name in TIERS}
        if declared is None:
            continue  # not collected through a test module (a doctest, a custom collector)
        if marked != {declared}:
            seen = ", ".join(sorted(marked)) or "no tier"
            problems.append(
                f"{item.nodeid}: its module declares {declared}, the test is marked {seen}; a "
                "module holds one tier: move the test to a module of its tier"
            )
        elif declared != "e2e" and item.get_closest_marker(CI_MARKER) is not None:
            problems.append(
                f"{item.nodeid}: `{CI_MARKER}` selects e2e tests; this one is {declared}"
            )
    if problems:
        raise pytest.UsageError(
            "test tiers (harness/testing/tiers.py):\n  " + "\n  ".join(problems)
        )


# -- what unit and check tests may not start ------------------------------------------------------


class TierViolation(Exception):
    """Raised where a unit test starts a process, or a unit or check test listens on a socket."""


# What each guarded tier may not do; other tiers are not guarded.
FORBIDDEN = {"unit": ("processes", "listening"), "check": ("listening",)}
VIOLATIONS = pytest.StashKey[list[str]]()


@contextlib.contextmanager
def forbidden(tier: str, seen: list[str]) -> Iterator[None]:
    """Within the block, what `tier` may not do raises TierViolation (and is noted in `seen`):
    starting a process (subprocess, asyncio and multiprocessing included, os.fork,
    posix_spawn, os.system), listening on a socket."""
    import _posixsubprocess

    def refusal(what: str):
        def refuse(*args: object, **_kwargs: object) -> None:
            detail = " ".join(part for part in (what, _argv_of(args)) if part)
            message = (
                f"a {tier} test may not {'start a process or ' if tier == 'unit' else ''}"
                f"listen on a socket: {detail}; move it to a module of the `process` tier "
                "(pytestmark = pytest.mark.process, docs/testing.md)"
            )
            seen.append(message)
            raise TierViolation(message)

        return refuse

    with pytest.MonkeyPatch.context() as patch:
        if "processes" in FORBIDDEN[tier]:
            patch.setattr(subprocess.Popen, "_execute_child", refusal("subprocess"))
            patch.setattr(_posixsubprocess, "fork_exec", refusal("fork_exec"))
            for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
                if hasattr(os, name):
                    patch.setattr(os, name, refusal(f"os.{name}"))
        if "listening" in FORBIDDEN[tier]:
            patch.setattr(socket.socket, "listen", refusal("socket.listen"))
        yield


def _argv_of(args: tuple[object, ...]) -> str:
    """The command line among a refused call's arguments, shortened ("" if none)."""
    for arg in args:
        if isinstance(arg, (str, bytes)):
            return os.fsdecode(arg)[:200]
        if isinstance(arg, (list, tuple)) and arg:
            if all(isinstance(part, (str, bytes, os.PathLike)) for part in arg):
                return " ".join(os.fsdecode(part) for part in arg)[:200]
    return ""


def tier_of(item: pytest.Item) -> str | None:
    marked = [name for name in TIERS if item.get_closest_marker(name) is not None]
    return marked[0] if len(marked) == 1 else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """A unit or check test runs (set-up, call, tear-down) where what its tier may not do
    raises."""
    tier = tier_of(item)
    if tier not in FORBIDDEN:
        return (yield)
    seen = item.stash[VIOLATIONS] = []
    with forbidden(tier, seen):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A refusal the code under test caught (an `except Exception`) still fails the test."""
    report = yield
    seen = item.stash.get(VIOLATIONS, None)
    if seen:
        if report.passed:
            report.outcome = "failed"
            report.longrepr = seen[0]
        seen.clear()
    return report
