"""Which selected tests read `--epd-vllm-source`, and the refusal of a session where none does.

The flag gives vLLM's own files (its EPD proxy, toy proxy and correctness script) from a source
tree instead of the release's sdist. The session's proxy takes it only when it is vLLM's
(`--epd-proxy vllm`); otherwise only the tests that run those files read it. Given to a
selection where nothing reads it, it changed nothing and the run was green all the same: "a
flag a code path ignores is refused, never dropped", so the collection refuses it.

A test reads it when (`reads_vllm_source`):
- it is an e2e test and the session's proxy is vLLM's (`--epd-proxy vllm`): its topologies are
  served through that proxy, and the commands of an `own_instances` item are given it too;
- it is marked `reads_vllm_source`: it runs vLLM's own files whatever `--epd-proxy` says
  (scenarios/test_vllm_proxy.py, the streamed sweeps of scenarios/test_stream.py, the served
  vLLM's parity in tests/test_upstream_parity.py);
- it is marked `own_instances(...)` with `export`: `OwnInstances.args` gives the export the
  source for the proxy files it writes.
`READER_MODULES` names the modules that hold such tests, for the refusal's message;
tests/test_vllm_source_readers.py holds it, and the marks, to what the sources read.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

OPTION = "--epd-vllm-source"
# The option's default: where a job (the nightly on a commit's build) says the served vLLM's
# source tree is. A setting of the environment, not of this command line: a selection narrowed
# by -k or --epd-topology that reads nothing of it is not refused for it.
ENV = "EPD_VLLM_SOURCE"
MARK = "reads_vllm_source"
VLLM_PROXY = "vllm"
# The commands of an `own_instances` item that take the source whatever the proxy
# (`own_instances.SESSION_OPTIONS`).
READING_COMMANDS = frozenset({"export"})
READER_MODULES = (
    "scenarios/test_vllm_proxy.py",
    "scenarios/test_stream.py",
    "scenarios/test_export_repro.py",
    "tests/test_upstream_parity.py",
)


def reads_vllm_source(item: pytest.Item, session_proxy: str | None) -> bool:
    """Whether `item` reads `--epd-vllm-source` in a session whose proxy is `session_proxy`."""
    if item.get_closest_marker(MARK) is not None:
        return True
    own = item.get_closest_marker("own_instances")
    if own is not None and READING_COMMANDS & set(own.args):
        return True
    return session_proxy == VLLM_PROXY and item.get_closest_marker("e2e") is not None


def refusal(source: str | None, session_proxy: str | None, items: Sequence[pytest.Item]) -> str:
    """Why the session's `--epd-vllm-source` is refused, or "" when a selected test reads it
    (or it is not given)."""
    if not source or any(reads_vllm_source(item, session_proxy) for item in items):
        return ""
    return (
        f"{OPTION}: no selected test reads it; it gives vLLM's own files to "
        f"--epd-proxy {VLLM_PROXY} and to the tests of {', '.join(READER_MODULES)} "
        f"(those marked {MARK} or exporting): select one or drop the flag"
    )


def given_on_the_command_line(args: Sequence[str]) -> bool:
    """Whether the session's arguments name the option (else its value, if any, is $ENV's)."""
    return any(arg == OPTION or arg.startswith(f"{OPTION}=") for arg in args)
