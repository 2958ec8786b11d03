"""Which NIXL a vLLM release declares (harness/preflight/upstream_requirements.py), on requirements
files written here in the forms pip reads; the real files of every release of the version
matrix are read in tests/test_upstream_requirements_releases.py (index tier)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.errors import BadInput
from harness.preflight.upstream_requirements import (
    KV_CONNECTORS_CU12_FILE,
    KV_CONNECTORS_FILE,
    declared_requirement,
    kv_connectors_file,
    logical_lines,
    pip_requirement,
    requirement_lines,
)

pytestmark = pytest.mark.unit

WHERE = "vLLM 9.9.9 (a test tree)"


def tree_with(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def nixl_for(tree: Path, cuda_major: int) -> tuple[str, ...]:
    return declared_requirement(tree, "nixl", cuda_major, WHERE).requirements


@pytest.mark.parametrize(
    "written, expected",
    [
        ("nixl == 1.5.0", "nixl==1.5.0"),
        ("nixl==1.5.0", "nixl==1.5.0"),
        ("nixl >= 1.4, < 2", "nixl>=1.4,<2"),
        ("nixl[cu12] == 1.5.0", "nixl[cu12]==1.5.0"),
        (
            'nixl == 1.5.0; platform_machine == "x86_64"',
            'nixl==1.5.0 ; platform_machine == "x86_64"',
        ),
        ("nixl == 1.5.0 --hash=sha256:abc", "nixl==1.5.0"),
        (
            "nixl @ https://host/nixl-1.5.0.whl#sha256=ab",
            "nixl @ https://host/nixl-1.5.0.whl#sha256=ab",
        ),
    ],
)
def test_a_requirement_becomes_one_pip_argument(written: str, expected: str) -> None:
    assert pip_requirement(written) == expected


def test_comments_blank_lines_and_continuations_are_read_as_pip_reads_them() -> None:
    text = (
        "# a comment naming nixl == 0.0.1\n"
        "\n"
        "lmcache >= 0.3.9  # trailing comment\n"
        "nixl \\\n"
        "  == 1.5.0\n"
        "mooncake @ https://host/m.whl#egg=mooncake\n"
    )
    assert logical_lines(text) == [
        (3, "lmcache >= 0.3.9"),
        (4, "nixl   == 1.5.0"),
        (6, "mooncake @ https://host/m.whl#egg=mooncake"),  # a `#` in a URL is no comment
    ]


def test_a_continuation_on_the_last_line_is_still_read() -> None:
    """pip reads a file whose last line ends in `\\` as if the line ended there: the
    requirement on it is declared, not dropped."""
    assert logical_lines("lmcache\nnixl == 1.5.0 \\\n") == [(1, "lmcache"), (2, "nixl == 1.5.0")]


def test_only_the_package_itself_is_declared_not_its_cuda_builds_or_commented_pins(
    tmp_path: Path,
) -> None:
    tree = tree_with(
        tmp_path,
        {
            KV_CONNECTORS_FILE: "# nixl == 0.0.1 was too old\n"
            "nixl-cu12 == 8.8.8\n"
            "cupy-cuda13x != 14.1.0\n"
            "NIXL == 9.9.9\n"
        },
    )
    assert nixl_for(tree, 13) == ("NIXL==9.9.9",)


def test_the_cuda_12_file_where_torch_is_cuda_12_and_the_release_has_one(tmp_path: Path) -> None:
    """vLLM's install-kv-connectors.sh: kv_connectors_cu12.txt on CUDA 12 (from 0.31), else
    kv_connectors.txt, which before 0.31 served CUDA 12 as well."""
    older = tree_with(tmp_path / "old", {KV_CONNECTORS_FILE: "nixl == 1.3.2\n"})
    assert kv_connectors_file(older, 12) == KV_CONNECTORS_FILE
    assert nixl_for(older, 12) == nixl_for(older, 13) == ("nixl==1.3.2",)
    newer = tree_with(
        tmp_path / "new",
        {KV_CONNECTORS_FILE: "nixl == 1.5.0\n", KV_CONNECTORS_CU12_FILE: "nixl == 1.4.1\n"},
    )
    assert kv_connectors_file(newer, 12) == KV_CONNECTORS_CU12_FILE
    assert nixl_for(newer, 12) == ("nixl==1.4.1",)
    assert nixl_for(newer, 13) == ("nixl==1.5.0",)
    assert kv_connectors_file(newer, 11) == KV_CONNECTORS_FILE


def test_an_include_is_read_relative_to_the_file_that_includes_it(tmp_path: Path) -> None:
    tree = tree_with(
        tmp_path,
        {
            KV_CONNECTORS_FILE: "lmcache\n-r common/kv.txt\n",
            "requirements/common/kv.txt": "--requirement=nixl.txt\n",
            "requirements/common/nixl.txt": "-c ../constraints.txt\nnixl == 9.9.9\n",
        },
    )
    lines = requirement_lines(tree, KV_CONNECTORS_FILE)
    assert [(line.requirement, line.file, line.line) for line in lines] == [
        ("lmcache", KV_CONNECTORS_FILE, 1),
        ("nixl==9.9.9", "requirements/common/nixl.txt", 2),
    ]
    assert nixl_for(tree, 13) == ("nixl==9.9.9",)


def test_every_line_of_the_package_is_kept_with_its_marker(tmp_path: Path) -> None:
    """Two pins for two platforms: the installer evaluates the markers where it installs."""
    tree = tree_with(
        tmp_path,
        {
            KV_CONNECTORS_FILE: 'nixl == 1.5.0; platform_machine == "x86_64"\n'
            'nixl == 1.4.1; platform_machine == "aarch64"\n'
        },
    )
    assert nixl_for(tree, 13) == (
        'nixl==1.5.0 ; platform_machine == "x86_64"',
        'nixl==1.4.1 ; platform_machine == "aarch64"',
    )


def test_a_release_without_the_file_is_one_line_naming_the_release_and_the_file(
    tmp_path: Path,
) -> None:
    with pytest.raises(BadInput) as raised:
        nixl_for(tree_with(tmp_path, {"requirements/common.txt": "nixl\n"}), 12)
    message = str(raised.value)
    assert "\n" not in message
    assert WHERE in message and KV_CONNECTORS_FILE in message and "CUDA 12" in message


def test_a_file_declaring_no_nixl_is_one_line_naming_the_file(tmp_path: Path) -> None:
    tree = tree_with(
        tmp_path,
        {KV_CONNECTORS_FILE: "nixl == 1.5.0\n", KV_CONNECTORS_CU12_FILE: "lmcache == 0.4.4\n"},
    )
    with pytest.raises(BadInput, match=r"kv_connectors_cu12\.txt \(for CUDA 12\) declares no nixl"):
        nixl_for(tree, 12)


def test_a_missing_include_and_a_cycle_are_named(tmp_path: Path) -> None:
    missing = tree_with(tmp_path / "missing", {KV_CONNECTORS_FILE: "-r gone.txt\n"})
    with pytest.raises(BadInput, match=r"kv_connectors\.txt line 1 includes gone\.txt"):
        nixl_for(missing, 13)
    cycle = tree_with(tmp_path / "cycle", {KV_CONNECTORS_FILE: "-r kv_connectors.txt\n"})
    with pytest.raises(BadInput, match="include each other"):
        nixl_for(cycle, 13)
