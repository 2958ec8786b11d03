"""harness/cli/nixl_variant.py: which NIXL CUDA variants the GPU jobs uninstall and which one they
install, from what is installed (nixl>=1.1 brings nixl-cu12 and nixl-cu13; vLLM's CI keeps only
torch's). tests/test_workflows.py and tests/test_buildkite_nightly.py run it by path, as the jobs
do, on dist-info metadata, with a stand-in uv.
"""

from __future__ import annotations

import importlib.metadata

import pytest

from harness.cli import nixl_variant
from harness.cli.nixl_variant import CannotKeep, Keep, decide, described, installed_nixl

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "installed, cuda_major, keep",
    [
        (
            {"nixl": "1.5.1", "nixl-cu12": "1.5.1", "nixl-cu13": "1.5.1"},
            13,
            Keep(("nixl-cu12", "nixl-cu13"), "nixl-cu13==1.5.1"),
        ),
        (
            {"nixl": "1.5.1", "nixl-cu13": "1.5.1", "nixl-cu12": "1.5.1"},
            12,
            Keep(("nixl-cu12", "nixl-cu13"), "nixl-cu12==1.5.1"),
        ),
        # the other variant alone: it goes, torch's comes
        ({"nixl": "1.5.1", "nixl-cu13": "1.5.1"}, 12, Keep(("nixl-cu13",), "nixl-cu12==1.5.1")),
        # torch's alone, at another version than nixl's: reinstalled at nixl's
        ({"nixl": "1.5.1", "nixl-cu12": "1.4.1"}, 12, Keep(("nixl-cu12",), "nixl-cu12==1.5.1")),
        # a CUDA major nothing was installed for: installed (or failing, in one line, if absent)
        (
            {"nixl": "1.5.1", "nixl-cu12": "1.5.1", "nixl-cu13": "1.5.1"},
            14,
            Keep(("nixl-cu12", "nixl-cu13"), "nixl-cu14==1.5.1"),
        ),
    ],
    ids=["both-keep-13", "both-keep-12", "other-alone", "kept-at-another-version", "unpublished"],
)
def test_every_installed_variant_goes_and_torchs_comes_at_nixls_version(
    installed: dict[str, str], cuda_major: int, keep: Keep
) -> None:
    """All of them are uninstalled, the kept one too: the variants install some files to the
    same paths, and uninstalling the other alone would take the kept one's with it."""
    assert decide(installed, cuda_major) == keep


def test_variants_are_ordered_by_their_cuda_major_not_as_text() -> None:
    installed = {"nixl": "2.0.0", "nixl-cu13": "2.0.0", "nixl-cu9": "2.0.0"}
    assert decide(installed, 13).uninstall == ("nixl-cu9", "nixl-cu13")


def test_nothing_is_done_where_no_variant_is_installed() -> None:
    """An older nixl has its libraries in its one wheel: no variant to keep, and it says so."""
    keep = decide({"nixl": "1.3.2"}, 12)
    assert keep.install is None and keep.uninstall == ()
    assert keep.note.startswith("nixl 1.3.2 brought no nixl-cuN variant")


def test_nothing_is_done_where_torchs_variant_alone_is_installed_at_nixls_version() -> None:
    keep = decide({"nixl": "1.5.1", "nixl-cu13": "1.5.1"}, 13)
    assert keep.install is None and keep.uninstall == ()


def test_no_nixl_installed_is_one_line_saying_so() -> None:
    with pytest.raises(CannotKeep, match="no nixl is installed for .*: no version to match"):
        decide({"nixl-cu12": "1.5.1"}, 12)


def test_the_log_line_names_nixl_and_both_variants_installed_or_not() -> None:
    assert described({"nixl": "1.5.1", "nixl-cu13": "1.5.1"}) == (
        "nixl 1.5.1, nixl-cu12 (not installed), nixl-cu13 1.5.1"
    )
    assert described({"nixl": "9.0.0", "nixl-cu14": "9.0.0"}) == (
        "nixl 9.0.0, nixl-cu12 (not installed), nixl-cu13 (not installed), nixl-cu14 9.0.0"
    )


class Distribution:
    def __init__(self, name: str, version: str) -> None:
        self.metadata = {"Name": name}
        self.version = version


def test_installed_names_are_read_normalized_and_the_first_on_the_path_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    found = [
        Distribution("NIXL", "1.5.1"),
        Distribution("nixl_cu12", "1.5.1"),
        Distribution("nixl-cu12", "1.0.0"),  # further down sys.path: shadowed, as for import
        Distribution("nixl-ep", "1.5.1"),  # not a CUDA variant
        Distribution("torch", "2.99.1"),
    ]
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: iter(found))
    assert installed_nixl() == {"nixl": "1.5.1", "nixl-cu12": "1.5.1"}


@pytest.mark.parametrize("text", ["", "12.9", "cu12", "None"])
def test_a_cuda_major_that_is_no_number_is_refused(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        nixl_variant.main(["--cuda-major", text])
    assert exit_.value.code == 2
    assert "expected the major version of the CUDA torch was built for" in capsys.readouterr().err
