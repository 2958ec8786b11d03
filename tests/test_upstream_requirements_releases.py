"""The NIXL every release of the version matrix declares, read from its own sdist (fetched through
the package index once, then cached in the harness cache), against the table in
docs/connectors.md: the figures there are what these files say, and a new release needs its
row. The parser itself is tested in tests/test_upstream_requirements.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness.environment import cache_dir
from harness.preflight import upstream_proxy
from harness.preflight.upstream_requirements import declared_requirement
from harness.spec.generations import KNOWN_RELEASES, dotted

pytestmark = pytest.mark.index

ROOT = Path(__file__).resolve().parent.parent
RELEASES = tuple(dotted(v) for v in KNOWN_RELEASES)
# | 0.32.0 | `nixl==1.5.0` | `nixl==1.4.1` | `kv_connectors_cu12.txt` ... |
ROW = re.compile(r"^\| (\d+\.\d+\.\d+) \| `([^`]+)` \| `([^`]+)` \| `([^`]+)`", re.M)


def documented() -> dict[str, tuple[str, str, str]]:
    text = (ROOT / "docs" / "connectors.md").read_text(encoding="utf-8")
    return {m[1]: (m[2], m[3], f"requirements/{m[4]}") for m in ROW.finditer(text)}


def read_from_sdist(release: str) -> tuple[str, str, str]:
    files = upstream_proxy.cached_or_fetched(release, cache_dir())
    where = f"vLLM {release} ({files.origin})"
    cuda13 = declared_requirement(files.directory, "nixl", 13, where)
    cuda12 = declared_requirement(files.directory, "nixl", 12, where)
    (for13,), (for12,) = cuda13.requirements, cuda12.requirements
    return for13, for12, cuda12.file


def test_the_table_has_a_row_for_every_release_of_the_matrix() -> None:
    assert sorted(documented()) == sorted(RELEASES)


@pytest.mark.parametrize("release", RELEASES)
def test_each_releases_sdist_declares_the_nixl_the_table_shows(release: str) -> None:
    assert read_from_sdist(release) == documented()[release]
