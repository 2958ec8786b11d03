"""`epd-harness doctor` on the optional extras: an absent one is said, with how to add it, and
is not a failure (a sweep needs neither NIXL nor Ray)."""

from __future__ import annotations

import pytest

from harness.cli import doctor

pytestmark = pytest.mark.process


def test_an_absent_optional_extra_is_said_with_its_setup_and_fails_nothing() -> None:
    check = doctor.check_optional_extra(
        "no-such-extra", "no_such_module_of_epd", "--kv-connector x", "scripts/cpu setup --x"
    )
    assert check.ok and check.optional_missing
    assert doctor.format_checks([check]).splitlines() == [
        "[--  ] no-such-extra (optional, for --kv-connector x): not installed",
        "       -> scripts/cpu setup --x",
    ]


def test_an_installed_optional_extra_shows_its_version() -> None:
    check = doctor.check_optional_extra("pytest", "pytest", "the tests", "pip install pytest")
    assert check.ok and not check.optional_missing
    assert check.detail == f"pytest {pytest.__version__}"
    assert doctor.format_checks([check]).startswith("[ok  ] pytest (optional, for the tests)")
