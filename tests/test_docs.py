"""The documentation names what the code does: every environment variable, every linked file."""

from __future__ import annotations

import re
from pathlib import Path

from harness import environment

ROOT = Path(__file__).resolve().parent.parent


def variables_read_by_the_code() -> set[str]:
    names: set[str] = set()
    for source in [*(ROOT / "harness").rglob("*.py"), ROOT / "scripts" / "cpu"]:
        text = source.read_text(encoding="utf-8")
        names |= set(re.findall(r"""environ(?:\.get)?[(\[]\s*["']([A-Z][A-Z0-9_]+)["']""", text))
        names |= set(re.findall(r"""^[A-Z_]+_ENV = ["']([A-Z][A-Z0-9_]+)["']""", text, re.M))
        names |= set(re.findall(r"\$\{([A-Z][A-Z0-9_]+):-", text))
    return names


def test_every_environment_variable_is_documented() -> None:
    doc = (ROOT / "docs" / "environment.md").read_text(encoding="utf-8")
    read = variables_read_by_the_code() | set(environment.VARIABLES)
    assert {"EPD_HARNESS_CACHE", "EPD_HARNESS_PORT_RANGE", "HF_HUB_CACHE"} <= read, read
    missing = sorted(name for name in read if f"`{name}`" not in doc)
    assert not missing, f"docs/environment.md does not name {missing}"


def test_links_in_the_readme_and_docs_point_at_files_that_exist() -> None:
    broken = []
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken
