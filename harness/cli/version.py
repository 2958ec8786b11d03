"""`epd-harness --version`: the version of the harness code that is running."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.preflight.vllm import editable_tree

DISTRIBUTION = "epd-harness"  # pyproject.toml's [project] name
# The source tree the running `harness` package sits in (its pyproject.toml beside it).
SOURCE_ROOT = Path(__file__).resolve().parents[2]
# pyproject.toml's [project] table (to the next table header) and its version key.
PROJECT_TABLE = re.compile(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", re.M | re.S)
VERSION_KEY = re.compile(r'^version\s*=\s*"([^"]+)"', re.M)


def harness_version(
    source_root: Path = SOURCE_ROOT, distribution: importlib.metadata.Distribution | None = None
) -> str:
    """The installed `epd-harness` distribution's version (importlib.metadata) when that
    distribution is the code running; else the version the running source tree's
    pyproject.toml declares, marked as such; else "unknown".

    Why not the metadata alone: the project's worktrees and CI run the harness from a checkout
    through PYTHONPATH, with the venv's `epd-harness` installed from another checkout (here an
    editable install of /work/main): its metadata would name that checkout's version, not the
    one running. The version the running tree declares is the one that answers "which harness
    is this?", and the source tree's path says which checkout it is. Nothing is fetched or
    imported to find out; an install neither of these can read says "unknown" rather than
    guess. `distribution` stands in for the installed one (tests)."""
    if distribution is None:
        try:
            distribution = importlib.metadata.distribution(DISTRIBUTION)
        except importlib.metadata.PackageNotFoundError:
            distribution = None
    if distribution is not None and _installs(distribution, source_root):
        return distribution.version
    declared = _declared_version(source_root / "pyproject.toml")
    if declared is not None:
        return f"{declared} (source tree {source_root}, not the installed distribution)"
    return "unknown (no installed epd-harness distribution runs this code)"


def _installs(distribution: importlib.metadata.Distribution, source_root: Path) -> bool:
    """Whether `distribution` is the running code: an editable install of `source_root`, or
    an install whose `harness` package is the one running."""
    direct_url = _direct_url(distribution)
    if (direct_url.get("dir_info") or {}).get("editable"):
        tree = editable_tree(direct_url)
        return tree is not None and tree.resolve() == source_root.resolve()
    installed = Path(str(distribution.locate_file("harness/__init__.py")))
    return installed.resolve() == (source_root / "harness" / "__init__.py").resolve()


def _direct_url(distribution: importlib.metadata.Distribution) -> dict[str, Any]:
    try:
        value = json.loads(distribution.read_text("direct_url.json") or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _declared_version(pyproject: Path) -> str | None:
    """[project] version from pyproject.toml, read without a TOML parser (tomllib is 3.11+)."""
    try:
        table = PROJECT_TABLE.search(pyproject.read_text())
    except OSError:
        return None
    version = VERSION_KEY.search(table[1]) if table else None
    return version[1] if version else None


class VersionAction(argparse.Action):
    """`--version`: prints "epd-harness VERSION" and exits 0, the version looked up only when
    asked (argparse's own action takes the string when the parser is built)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs):
        kwargs.setdefault("help", "print the harness's version and exit")
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # type: ignore[override]
        print(f"{parser.prog} {harness_version()}")
        parser.exit()
