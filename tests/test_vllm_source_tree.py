"""A development build's EPD files come only from the source tree it was built from
(harness/preflight/upstream_proxy.py): the tree's git commit is recorded and checked against
the build's +g<sha>. The trees here are stand-ins made with git in a temporary directory.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from harness.errors import BadInput
from harness.preflight import upstream_proxy
from harness.preflight.upstream_proxy import UPSTREAM_SCRIPT_FILE
from harness.serve.vllm_proxy import EPD_PROXY_FILE, TOY_PROXY_FILE
from harness.spec.settings import ServedVllm
from harness.testing.fake_vllm import install_fake_vllm

pytestmark = pytest.mark.process


def fake_dev_vllm(tmp_path: Path, version: str) -> ServedVllm:
    """A served vLLM as the version probe would report a development build of it."""
    return ServedVllm(str(install_fake_vllm(tmp_path / "bin", serves=False)), version)


def test_a_checkout_must_hold_both_files(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="not a vLLM checkout"):
        upstream_proxy.from_checkout(str(tmp_path))
    for name in (EPD_PROXY_FILE, TOY_PROXY_FILE):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("#")
    assert upstream_proxy.from_checkout(str(tmp_path)).directory == tmp_path.resolve()


def test_a_vllm_tree_whose_proxy_moved_says_where_it_went(tmp_path: Path) -> None:
    """A vLLM tree (its correctness script there) without the proxy where the harness looks
    is no "not a vLLM checkout": the refusal names what the tree has instead, its files of the
    proxy's name and what its own correctness script launches, so a night on a main that moved
    the proxy says what moved. The trees are stand-ins written here."""
    moved = tmp_path / "moved"
    old_home = "examples/online_serving/disaggregated_encoder/disagg_epd_proxy.py"
    script = (
        "#!/bin/bash\n"
        "run_epd_1e_1pd() {\n"
        "    vllm serve m --port 1 &\n"
        "    python -m vllm.distributed.ec_transfer.proxy.epd_proxy --port 2 &\n"
        "}\n"
        "run_epd_1e_1pd\n"
    )
    for name, text in (
        (old_home, "#"),
        (TOY_PROXY_FILE, "#"),
        (UPSTREAM_SCRIPT_FILE, script),
        ("vllm/distributed/ec_transfer/proxy/epd_proxy.py", "#"),
    ):
        (moved / name).parent.mkdir(parents=True, exist_ok=True)
        (moved / name).write_text(text)
    with pytest.raises(BadInput) as refused:
        upstream_proxy.from_checkout(str(moved))
    message = str(refused.value)
    assert "not a vLLM checkout" not in message, message
    assert f"has no {EPD_PROXY_FILE}" in message, message
    assert f"This tree has a disagg_epd_proxy.py at {old_home}." in message, message
    assert (
        f"Its {UPSTREAM_SCRIPT_FILE} launches 'python -m "
        "vllm.distributed.ec_transfer.proxy.epd_proxy' (line 4)."
    ) in message, message


def test_a_caller_reading_only_the_script_needs_no_proxy_in_the_tree(tmp_path: Path) -> None:
    """Upstream parity reads the tree's correctness script only: a tree whose proxy moved is
    still compared (and parity names what it launches instead), not refused."""
    (tmp_path / UPSTREAM_SCRIPT_FILE).parent.mkdir(parents=True)
    (tmp_path / UPSTREAM_SCRIPT_FILE).write_text("#!/bin/bash\n")
    files = upstream_proxy.from_checkout(str(tmp_path), required=(UPSTREAM_SCRIPT_FILE,))
    assert files.script == tmp_path.resolve() / UPSTREAM_SCRIPT_FILE
    with pytest.raises(BadInput, match=f"has no {EPD_PROXY_FILE}"):
        upstream_proxy.from_checkout(str(tmp_path))


def vllm_tree(path: Path, commit: bool) -> str | None:
    """A stand-in vLLM source tree (the proxy files only); a git checkout with one commit."""
    for name in (EPD_PROXY_FILE, TOY_PROXY_FILE, UPSTREAM_SCRIPT_FILE):
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text("# stand-in\n")
    if not commit:
        return None
    git = ["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "tree"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    return head.stdout.strip()


def test_a_tree_inside_another_git_checkout_has_no_commit_of_its_own(tmp_path: Path) -> None:
    """A vLLM tree unpacked (not cloned) inside some other repository, a user's project, is
    no checkout: git answers for it with the enclosing repository's HEAD, which is not the
    tree's commit. It is recorded as not checked, never refused as being at that commit."""
    outer = tmp_path / "project"
    outer_commit = vllm_tree(outer, commit=True)
    assert outer_commit is not None
    tree = outer / "third_party" / "vllm"
    vllm_tree(tree, commit=False)
    served = fake_dev_vllm(tmp_path, "0.33.0.dev12+gabc1234")
    files = upstream_proxy.from_checkout(str(tree), served)
    assert files.commit is None
    assert files.commit_check.startswith("not checked: ") and "not a git checkout" in (
        files.commit_check
    )
    assert upstream_proxy.from_checkout(str(outer), served=None).commit == outer_commit


def test_the_source_trees_commit_is_recorded_and_must_be_the_builds(tmp_path: Path) -> None:
    tree = tmp_path / "vllm"
    commit = vllm_tree(tree, commit=True)
    assert commit is not None
    served = fake_dev_vllm(tmp_path, f"0.33.0.dev12+g{commit[:9]}")
    choice = upstream_proxy.proxy_choice("vllm", str(tree), served, tmp_path / "cache")
    recorded = choice.to_json()
    assert recorded["source_commit"] == commit
    assert recorded["commit_check"] == f"matches the served vLLM's build (g{commit[:9]})"
    assert recorded["origin"] == f"checkout {tree.resolve()}"
    files = upstream_proxy.upstream_files(served, str(tree), tmp_path / "cache")
    assert files.script == tree.resolve() / UPSTREAM_SCRIPT_FILE
    other = fake_dev_vllm(tmp_path, "0.33.0.dev12+gabc1234")
    with pytest.raises(BadInput) as info:
        upstream_proxy.proxy_choice("vllm", str(tree), other, tmp_path / "cache")
    assert f"is at commit {commit[:12]}" in str(info.value)
    assert "was built from abc1234" in str(info.value)


def test_a_tree_without_git_or_a_build_without_a_commit_says_it_was_not_checked(
    tmp_path: Path,
) -> None:
    plain = tmp_path / "unpacked"
    vllm_tree(plain, commit=False)
    served = fake_dev_vllm(tmp_path, "0.33.0.dev12+gabc1234")
    files = upstream_proxy.from_checkout(str(plain), served)
    assert files.commit is None
    assert (
        files.commit_check.startswith("not checked: ")
        and "not a git checkout" in files.commit_check
    )
    tree = tmp_path / "vllm"
    commit = vllm_tree(tree, commit=True)
    release = fake_dev_vllm(tmp_path, "0.33.0")
    files = upstream_proxy.from_checkout(str(tree), release)
    assert files.commit == commit
    assert files.commit_check == "not checked: the served vLLM's version (0.33.0) names no commit"
