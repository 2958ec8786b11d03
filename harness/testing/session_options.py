"""The session's `--epd-*` options (conftest.py), read as `epd-harness run` reads its own: the
KV connector and launcher the session runs, the topologies it selects, the run they ask for
(`session_request`), checked once before any item runs (`check_session_options`), why an
item cannot run under them (`platform_refusal`, `cluster_process_refusal`), and the refusal
of one no selected item reads (`unread_option_refusal`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from harness.testing.session_account import SESSION_SHARED_DIR

if TYPE_CHECKING:
    from harness.preflight import RunRequest


def wanted_topologies(config: pytest.Config) -> set[str]:
    """The topologies `--epd-topology` names (empty: every one). A name the harness does not
    know is refused here, as `epd-harness run --topology` refuses it: kept, it would match no
    item, and the topologies the user meant would be dropped as deselected while the session
    passes (found in review: `1P+1D,1E+1P+1d` ran only 1P+1D and exited 0)."""
    return topology_option(config.getoption("--epd-topology", None))


def topology_option(value: str | None) -> set[str]:
    """`--epd-topology`'s names, each one the harness knows (pytest.UsageError otherwise)."""
    from harness.errors import BadInput
    from harness.preflight.names import check_topologies, split_names

    names = split_names([value or ""])
    if value is not None and not names:  # as if not given: every topology, the choice dropped
        raise pytest.UsageError(
            f"--epd-topology {value!r} names no topology: name one, or leave --epd-topology out"
        )
    try:
        check_topologies(names)
    except BadInput as exc:
        raise pytest.UsageError(f"--epd-topology: {exc}") from None
    return set(names)


def session_kv_connector(config: pytest.Config) -> str | None:
    """The KV connector this session runs (`--epd-kv-connector`, else the platform's default),
    by its --kv-connector name; None when the options name none the harness knows (the
    preflight then says what is wrong)."""
    from harness.errors import BadInput
    from harness.spec.connectors import get_kv_connector, kv_connector_for_class
    from harness.spec.platforms import get_platform

    try:
        name = config.getoption("--epd-kv-connector", None)
        if name:
            return get_kv_connector(name).name
        default = kv_connector_for_class(
            get_platform(config.getoption("--epd-platform", "cpu")).kv_connector
        )
    except BadInput:
        return None
    return default.name if default is not None else None


def session_launcher(config: pytest.Config) -> str | None:
    """The launcher this session's instances run on when it is not this host's (`ray`), by the
    name `epd_variant` gives it; None for the local launcher."""
    from harness.spec.settings import LOCAL_LAUNCHER

    name = config.getoption("--epd-launcher", None)
    return name if name and name != LOCAL_LAUNCHER else None


def platform_refusal(config: pytest.Config, item: pytest.Item) -> str | None:
    """Why an item cannot run in the session, or None: one marked `one_host_rehearsal` gets
    the Ray launcher's own refusal (`LauncherChoice.refusal_on`), one marked `own_instances`
    the first session option a command it runs would ignore (`own_instances.refusal`)."""
    rehearsal = item.get_closest_marker("one_host_rehearsal")
    own = item.get_closest_marker("own_instances")
    if rehearsal is None and own is None:
        return None
    from harness.errors import BadInput
    from harness.spec.platforms import get_platform
    from harness.spec.settings import RAY_LAUNCHER, LauncherChoice

    if own is not None:
        why = own_instances_refusal(config, item, own)
        if why is not None:
            return why
    try:
        platform = get_platform(config.getoption("--epd-platform", "cpu"))
    except BadInput:
        return None  # the preflight says what is wrong with the platform
    if rehearsal is None:
        return None
    address = config.getoption("--epd-ray-address", None)
    if not rehearsal.kwargs.get("unless_ray_address", False):
        address = None
    return LauncherChoice(RAY_LAUNCHER, ray_address=address).refusal_on(platform)


# Why an item that signals or reads its instances' processes by pid is not run on a cluster
# named by --epd-ray-address (`epd-harness load` refuses --kill and --duration there alike).
READS_PROCESSES_ON_A_CLUSTER = (
    "they signal or read the instances' processes from this host by pid (a kill, a soak's "
    "RSS and open files), and with --epd-ray-address the instances run on the cluster's "
    "nodes, whose processes are not this host's (the one-host rehearsal cluster, without "
    "--epd-ray-address, runs them here)"
)


def cluster_process_refusal(config: pytest.Config, item: pytest.Item, load: Any) -> str | None:
    """Why an item cannot run on the session's Ray cluster, or None: one marked
    `reads_instance_processes`, or whose load (`load`: its `epd_load` LoadSpec, or None) kills
    an instance or soaks, takes a node's pid for this host's. Found in the audit of ignored
    flags: the CLI refused `load --kill` and `--duration` with --ray-address, while the death
    scenario under `--epd-ray-address` SIGKILLed this host's process group of that number."""
    if session_launcher(config) is None or config.getoption("--epd-ray-address", None) is None:
        return None
    marked = item.get_closest_marker("reads_instance_processes") is not None
    loads = load is not None and (load.kill is not None or load.duration_s is not None)
    return READS_PROCESSES_ON_A_CLUSTER if marked or loads else None


def session_option_values(config: pytest.Config) -> dict[str, object]:
    """The session's options that say what is served and how, as given
    (`own_instances.SESSION_OPTIONS`)."""
    from harness.testing.own_instances import SESSION_OPTIONS

    return {o.option: config.getoption(o.option, o.default) for o in SESSION_OPTIONS}


def own_instances_refusal(
    config: pytest.Config, item: pytest.Item, marker: pytest.Mark
) -> str | None:
    """Why the commands an `own_instances` item runs cannot take the session as it is set;
    a marker naming no command, or one the harness does not have, is a usage error."""
    from harness.testing.own_instances import commands_of, refusal

    try:
        commands = commands_of(marker.args, item.nodeid)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    return refusal(session_option_values(config), commands)


def session_request(
    option: Callable[[str], Any],
    run_root: str,
    worker: tuple[str, int],
    served: Sequence[str] = (),
) -> RunRequest:
    """The run the session's `--epd-*` options ask for (`option` reads one, as
    `pytest.Config.getoption` does): what `epd_config` prepares, and what
    `check_session_options` checks. `served`: the topologies the selected items run, which
    the instances' plan is made for (one GPU serves a session of 1E+1PD's items; the plan of
    every topology wanted two for 1P+1D and refused it)."""
    from harness.preflight import RunRequest

    return RunRequest(
        served_topologies=tuple(served),
        model=option("--epd-model"),
        run_dir=run_root,
        vllm=option("--epd-vllm"),
        allow_untested_vllm=option("--epd-allow-untested-vllm"),
        devices=option("--epd-devices"),
        baseline_cache=option("--epd-baseline-cache"),
        refresh_baseline=option("--epd-refresh-baseline"),
        platform=option("--epd-platform"),
        colocate=option("--epd-colocate"),
        worker_id=None if worker[0] == "main" else worker[0],  # ("main", 1): no xdist
        workers=worker[1],
        session_dir=str(Path(run_root) / SESSION_SHARED_DIR),
        kv_connector=option("--epd-kv-connector"),
        ec_connector=option("--epd-ec-connector"),
        proxy=option("--epd-proxy"),
        # The scenarios that run vLLM's own files read --epd-vllm-source themselves; the run's
        # proxy takes it only when it is vLLM's.
        vllm_source=option("--epd-vllm-source") if option("--epd-proxy") == "vllm" else None,
        # None when not given (static with --epd-proxy vllm); given without it, `static`
        # too, it is refused as the CLI refuses it. Its default was static, which could not
        # be told from static given: the session ran the harness's proxy (found in the audit
        # of ignored flags).
        proxy_registration=option("--epd-proxy-registration"),
        launcher=option("--epd-launcher"),
        ray_address=option("--epd-ray-address"),
        reference_policy=option("--epd-reference-policy"),
        stream=option("--epd-stream"),
        no_enforce_eager=option("--epd-no-enforce-eager"),
        dtype=option("--epd-dtype"),
    )


def check_session_options(option: Callable[[str], Any]) -> None:
    """The session's options checked as its first e2e item would check them, by the same
    preflight as `epd-harness run` (names, values, flags that contradict each other), its
    files named only: all that can be checked before any item runs, or where a pytest command
    line is only shown (tests/test_docs_commands.py). pytest.UsageError, one line, naming the
    session's options (`--epd-platform`, not the CLI's `--platform`)."""
    from harness.errors import BadInput, empty_value
    from harness.preflight.config import check_arguments
    from harness.testing.own_instances import SESSION_OPTIONS, in_session_terms

    # An empty value is refused, as the CLI's parser refuses one: read as unset, `--epd-model
    # ""` served the tiny model and `--epd-run-dir ""` wrote to runs/pytest-<time> (found in
    # review). `--epd-topology` refuses its own, naming the topologies.
    for name in (*(o.option for o in SESSION_OPTIONS), "--epd-run-dir"):
        value = option(name)
        if isinstance(value, str) and not value.strip():
            raise pytest.UsageError(f"epd-harness: {empty_value(name, value)}")
    topology_option(option("--epd-topology"))
    try:
        check_arguments(session_request(option, "runs", ("main", 1)), read_files=False)
    except BadInput as exc:
        raise pytest.UsageError(f"epd-harness: {in_session_terms(str(exc))}") from None


# Read by every session, whatever it selects: its run root (harness.testing.session_account).
READ_BY_EVERY_SESSION = frozenset({"--epd-run-dir"})
# Read by a test marked reads_vllm_source besides the source (which has its own refusal,
# harness.testing.vllm_source): tests/test_upstream_parity.py probes the served vLLM and
# compares on the session's platform.
READ_WITH_VLLM_SOURCE = frozenset({"--epd-vllm", "--epd-platform"})


def unread_option_refusal(args: Sequence[str], items: Sequence[pytest.Item]) -> str:
    """Why a `--epd-*` option on the command line (`args`) is refused, or "": the options
    configure what the e2e tests serve and which of them run, so given where no e2e test is
    selected (`pytest tests -m unit --epd-dtype float16`) one changed nothing and the session
    was green all the same (found in review). Those a selected test reads otherwise are kept."""
    from harness.testing.vllm_source import MARK, OPTION

    if any(item.get_closest_marker("e2e") is not None for item in items):
        return ""
    read = READ_BY_EVERY_SESSION | {OPTION}  # the source: refused by its own rule
    if any(item.get_closest_marker(MARK) is not None for item in items):
        read |= READ_WITH_VLLM_SOURCE
    for arg in args:
        name = arg.partition("=")[0]
        if name.startswith("--epd-") and name not in read:
            return (
                f"{name}: no selected test reads it; the --epd-* options configure what the "
                "e2e tests serve, and none is selected: select one (-m e2e) or drop the flag"
            )
    return ""
