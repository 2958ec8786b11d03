"""The harness's own errors, each with the exit code the command line maps it to.

A user should never have to read a traceback to learn that a name was misspelt or a file is
missing: such problems are raised as a `HarnessError` whose message is one line naming the
cause, and `epd-harness` prints that line and exits with the error's `exit_code`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

EXIT_OK = 0
EXIT_FAILED = 1  # a comparison failed (a verdict its policy does not accept)
EXIT_BAD_INPUT = 2  # bad input, or an environment that cannot run
EXIT_INTERRUPTED = 130  # Ctrl-C / SIGTERM / SIGHUP, after every server was stopped

T = TypeVar("T")


class HarnessError(Exception):
    """A problem the harness explains in one line; `exit_code` is what the CLI returns."""

    exit_code = EXIT_BAD_INPUT


class BadInput(HarnessError, ValueError):
    """A user error or an environment that cannot run: one line, exit code 2."""


def lookup(kind: str, name: str, known: Mapping[str, T]) -> T:
    """`known[name]`, or BadInput "unknown <kind> 'name' (known: a, b, c)"."""
    try:
        return known[name]
    except KeyError:
        raise BadInput(f"unknown {kind} {name!r} (known: {', '.join(known)})") from None


def empty_value(flag: str, text: str) -> str:
    """The refusal of an option given an empty value, the CLI's and a pytest session's: every
    option's unset value means its default, so `--attach "$FILE"` with FILE unset would drop
    the flag and run something else."""
    return (
        f"{flag} {text!r} is empty: give a value, or leave {flag} out (an empty one is not "
        "taken for the default)"
    )
