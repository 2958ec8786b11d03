"""The options that say what is served and where, defined once for every command that starts
vLLM instances (`run`, `load`, `fuzz`).

A developer who reproduces a nightly failure on a GPU box runs `fuzz` or `load` with the same
`--platform cuda --devices ...` as the `run` that went red; when each command declared its own
copy of these flags, `load` and `fuzz` had no `--platform` at all and served the CPU profile
wherever they ran. Each option here fills the `RunRequest` field of its name, so the preflight
checks it the same way for every command; `tests/test_serving_options.py` holds every command
that starts instances to this one list.
"""

from __future__ import annotations

import argparse
from typing import Any

from harness.environment import cache_dir
from harness.judge.policy import REFERENCE_POLICIES
from harness.preflight.config import DEFAULT_MAX_MODEL_LEN
from harness.spec.connectors import EC_CONNECTORS, KV_CONNECTORS
from harness.spec.generations import GENERATIONS_BY_NAME
from harness.spec.platforms import DEFAULT_CPU_CORES
from harness.spec.settings import (
    ATTACH_PROXY,
    HARNESS_PROXY,
    LAUNCHER_KINDS,
    LOCAL_LAUNCHER,
    PLACEMENTS,
    PROXY_KINDS,
)
from harness.spec.topology import DEFAULT_DTYPE, DTYPES

# The RunRequest fields `add_serving_options` fills (argparse dest == field name).
SERVING_FIELDS = (
    "model",
    "vllm",
    "allow_untested_vllm",
    "protocol",
    "max_model_len",
    "platform",
    "devices",
    "colocate",
    "no_enforce_eager",
    "dtype",
    "kv_connector",
    "ec_connector",
    "reference_policy",
    "launcher",
    "ray_address",
    "ray_placement",
    "ray_shared_dir",
    "ray_instance_env",
)
# The RunRequest fields `add_proxy_options` fills, for commands that can put vLLM's own proxy
# (or an attached deployment's) in front of the instances.
PROXY_FIELDS = ("proxy", "attach", "vllm_source", "proxy_registration")


def add_baseline_cache_options(parser: argparse.ArgumentParser) -> None:
    """Where the baseline's answers are cached, for the commands that read the cache (`run`,
    `load`): one help, so that neither hides the default (`load`'s said nothing of it)."""
    parser.add_argument(
        "--baseline-cache",
        help=f"baseline cache directory, or 'off' (default: {cache_dir() / 'baseline'})",
    )
    parser.add_argument(
        "--refresh-baseline",
        action="store_true",
        help="recompute the baseline and overwrite its cache entries",
    )


def add_serving_options(parser: argparse.ArgumentParser) -> None:
    """What every instance serves (model, vLLM, protocol), on which platform and devices, with
    which connectors and launcher, and how its answers are judged against their references."""
    group = parser.add_argument_group("what is served, where, and how it is judged")
    group.add_argument(
        "--model",
        help="model directory or hub name (default: the tiny model on cpu, built once; the "
        "platform's model on GPUs)",
    )
    group.add_argument("--vllm", help="vllm executable (default: the one beside this Python)")
    group.add_argument(
        "--allow-untested-vllm",
        action="store_true",
        help="run a vLLM older than every known EPD protocol generation",
    )
    group.add_argument(
        "--protocol",
        choices=sorted(GENERATIONS_BY_NAME),
        help="EPD protocol generation to speak (default: by the served vLLM's version; see "
        "docs/versions.md)",
    )
    group.add_argument(
        "--max-model-len",
        type=int,
        default=DEFAULT_MAX_MODEL_LEN,
        help="every instance's --max-model-len (the baseline's too)",
    )
    group.add_argument("--platform", default="cpu", help="cpu (default), cuda or xpu")
    group.add_argument(
        "--devices",
        help="CPU cores the instances bind to, e.g. 0,1 (default: "
        f"{','.join(map(str, DEFAULT_CPU_CORES))}); GPU / XPU indices there (required)",
    )
    group.add_argument(
        "--colocate",
        action="store_true",
        help="GPU: let a topology's instances share devices when there are too few",
    )
    group.add_argument(
        "--no-enforce-eager",
        action="store_true",
        help="GPU: let vLLM compile and capture graphs (the default, like upstream's "
        "correctness script, is --enforce-eager); refused on cpu",
    )
    add_dtype_option(group)
    add_connector_options(group)
    group.add_argument(
        "--reference-policy",
        choices=REFERENCE_POLICIES,
        help="how each topology is judged against its references: exact (every comparison "
        "must MATCH; the cpu default) or pd-drift (a P->D topology against the monolithic "
        "baseline may DRIFT within the measured noise floor; the GPU default, as upstream)",
    )
    group.add_argument(
        "--launcher",
        default=LOCAL_LAUNCHER,
        choices=LAUNCHER_KINDS,
        help="where the instances run: subprocesses on this host (local, default) or Ray "
        "actors on the nodes of a cluster (ray; docs/multi-node.md)",
    )
    group.add_argument(
        "--ray-address",
        metavar="HOST:PORT",
        help="with --launcher ray: the cluster's head (GCS); default: start a one-host "
        "cluster of three nodes (127.0.0.2-4) for the run and stop it afterwards",
    )
    group.add_argument(
        "--ray-placement",
        choices=PLACEMENTS,
        help="with --launcher ray: each instance of a topology on a node of its own "
        "(spread, default) or wherever they fit (pack)",
    )
    group.add_argument(
        "--ray-shared-dir",
        metavar="DIR",
        help="with --launcher ray: where ExampleConnector storage goes, a directory every "
        "node and the harness see (default: the run directory); checked before any start",
    )
    group.add_argument(
        "--ray-instance-env",
        action="append",
        metavar="NAME=VALUE",
        help="with --launcher ray: environment for every instance (e.g. a cluster's UCX "
        "settings); repeatable; the network invariants still apply to it",
    )


def add_dtype_option(group: argparse._ActionsContainer, what: str | None = None) -> None:
    """The dtype every instance computes in (`plan` takes it too: it is on every line; so
    does `doctor`, which checks this host's GPUs for it). Not given, it is None, served as
    DEFAULT_DTYPE (`harness.preflight.dtype.dtype_or_default`): a refusal calls bfloat16 the
    default only when it was not named."""
    what = what or "every instance's --dtype, the baseline's too"
    group.add_argument(
        "--dtype",
        choices=DTYPES,
        help=f"{what} (default: {DEFAULT_DTYPE}; a GPU below compute capability 8.0, such as "
        "a T4 or V100, needs float16)",
    )


def add_connector_options(group: argparse._ActionsContainer) -> None:
    """How KV and embeddings move between instances (`plan` takes these too: they change
    every P, D and encoder command line)."""
    group.add_argument(
        "--kv-connector",
        metavar="|".join(KV_CONNECTORS),
        help="how P's KV reaches D: example (files; cpu default) or nixl (GPU default; on cpu "
        "needs scripts/cpu setup --nixl); docs/connectors.md",
    )
    group.add_argument(
        "--ec-connector",
        metavar="|".join(EC_CONNECTORS),
        help="how E's embeddings reach their consumer: example (files; the only one that "
        "runs: cpu and mooncake are refused with their measured cause); docs/connectors.md",
    )


def add_proxy_options(parser: argparse.ArgumentParser, attach_help: str) -> None:
    """The EPD proxy under test, and the running deployment `--attach` names instead of
    starting one."""
    group = parser.add_argument_group("the proxy under test")
    group.add_argument(
        "--proxy",
        choices=PROXY_KINDS,
        help="the EPD proxy under test: the harness's own (default), the served vLLM "
        "release's, or attach: a running deployment's (docs/proxies.md)",
    )
    group.add_argument("--attach", metavar="FILE", help=attach_help)
    group.add_argument(
        "--vllm-source",
        metavar="DIR",
        help="with --proxy vllm: take vLLM's proxy files from this checkout instead of the "
        "release's sdist on the package index (a development build's only source: the tree "
        "it was built from)",
    )
    group.add_argument(
        "--proxy-registration",
        choices=("static", "dynamic"),
        help="with --proxy vllm: give vLLM's EPD proxy the instances' URLs on its command line "
        "(static, default) or start it empty and register each through its admin API "
        "(dynamic, as an external launcher would)",
    )


def serving_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The RunRequest fields of `add_serving_options`, as given."""
    fields = {name: getattr(args, name) for name in SERVING_FIELDS}
    fields["ray_instance_env"] = tuple(args.ray_instance_env or ())
    return fields


def proxy_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The RunRequest fields of `add_proxy_options`: `--attach` alone means `--proxy attach`
    (with another `--proxy` the preflight refuses the pair)."""
    fields = {name: getattr(args, name) for name in PROXY_FIELDS}
    fields["proxy"] = args.proxy or (ATTACH_PROXY if args.attach else HARNESS_PROXY)
    return fields
