"""Every environment variable the harness reads, its default, and the one loopback address.

Kept in one leaf module so that `docs/environment.md` can list them and no second parser of
the same variable can drift from the first.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from harness.errors import BadInput

# Every server and the proxy bind here. vLLM servers have no authentication: on a shared CI
# runner anything wider lets anyone on the network use (or crash) them.
LOOPBACK_HOST = "127.0.0.1"

CACHE_ENV = "EPD_HARNESS_CACHE"  # tiny model, baseline cache, prompt token counts, proxies
PORT_RANGE_ENV = "EPD_HARNESS_PORT_RANGE"  # "LOW-HIGH" inclusive: confine a job's ports
PORT_LOCK_DIR_ENV = "EPD_HARNESS_PORT_DIR"  # lock files that keep harnesses off each other's ports
WATCHDOG_ENV = "EPD_HARNESS_WATCHDOG"  # "off" / "0" disables the orphan watchdog
# "off" / "0" skips the multi-node network checks of --launcher ray (to show what they catch)
NETWORK_CHECKS_ENV = "EPD_HARNESS_NETWORK_CHECKS"
# The command lines the served vLLM's own parser accepted (harness.preflight.vllm_args); the
# test suite points each of its sessions at a directory of their own.
ARGV_CHECK_DIR_ENV = "EPD_HARNESS_ARGV_CHECK_DIR"
# The served interpreter's imports that succeeded (harness.preflight.connectors); unset, every
# run probes. The test suite points each of its sessions at a directory of their own.
IMPORT_CHECK_DIR_ENV = "EPD_HARNESS_IMPORT_CHECK_DIR"

DEFAULT_PORT_RANGE = range(20000, 30000)
DEFAULT_PORT_LOCK_DIR = Path("/tmp/epd-harness-ports")
LOWEST_PORT = 1024  # below it, binding needs privileges the harness should not have

# name -> (default, what it does), for the documentation (tests/test_docs.py holds
# docs/environment.md to it).
VARIABLES: dict[str, tuple[str, str]] = {
    CACHE_ENV: ("~/.cache/epd-harness", "the tiny model, the baseline cache, token counts"),
    PORT_RANGE_ENV: (
        f"{DEFAULT_PORT_RANGE.start}-{DEFAULT_PORT_RANGE.stop - 1}",
        "ports the harness may reserve for servers and NIXL side channels",
    ),
    PORT_LOCK_DIR_ENV: (str(DEFAULT_PORT_LOCK_DIR), "port lock files shared by every harness"),
    WATCHDOG_ENV: ("on", "off (or 0) turns the orphan watchdog off (only for testing it)"),
    NETWORK_CHECKS_ENV: (
        "on",
        "off (or 0) skips the network checks of --launcher ray (only for showing what they catch)",
    ),
    ARGV_CHECK_DIR_ENV: (
        "<cache>/argv-check",
        "the vllm serve command lines the served vLLM's parser accepted (a session of the tests "
        "sets its own)",
    ),
    IMPORT_CHECK_DIR_ENV: (
        "unset",
        "where the served interpreter's imports that succeeded are kept (unset: every run probes; "
        "a session of the tests sets its own)",
    ),
}


def cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    return Path(environ.get(CACHE_ENV) or Path.home() / ".cache" / "epd-harness")


def argv_check_dir(environ: Mapping[str, str] = os.environ) -> Path:
    return Path(environ.get(ARGV_CHECK_DIR_ENV) or cache_dir(environ) / "argv-check")


def import_check_dir(environ: Mapping[str, str] = os.environ) -> Path | None:
    text = environ.get(IMPORT_CHECK_DIR_ENV)
    return Path(text) if text else None


def parse_port_range(text: str, source: str = PORT_RANGE_ENV) -> range:
    """'24000-24099' (inclusive) -> range(24000, 24100)."""
    match = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", text)
    if match is None:
        raise BadInput(f"{source}={text!r}: expected LOW-HIGH, e.g. 24000-24099")
    low, high = int(match[1]), int(match[2])
    if not LOWEST_PORT <= low <= high <= 65535:
        raise BadInput(f"{source}={text!r}: need {LOWEST_PORT} <= LOW <= HIGH <= 65535")
    return range(low, high + 1)


def port_range(environ: Mapping[str, str] = os.environ) -> range:
    text = environ.get(PORT_RANGE_ENV)
    return parse_port_range(text) if text else DEFAULT_PORT_RANGE


def port_lock_dir(environ: Mapping[str, str] = os.environ) -> Path:
    return Path(environ.get(PORT_LOCK_DIR_ENV) or DEFAULT_PORT_LOCK_DIR)


def watchdog_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    return _switched_on(environ.get(WATCHDOG_ENV, ""))


def network_checks_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    return _switched_on(environ.get(NETWORK_CHECKS_ENV, ""))


def _switched_on(value: str) -> bool:
    return value.strip().lower() not in ("off", "0", "false", "no")
