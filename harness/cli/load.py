"""`epd-harness load`: many requests at once against one topology, every answer judged.

Exit codes as for `run`: 0 every request passed its policy (and a soak stayed under its
bounds; a planted kill ended every request in flight as it must), 1 otherwise, 2 bad input.
"""

from __future__ import annotations

import argparse
import math
import time

from harness.cli.serving_options import (
    add_baseline_cache_options,
    add_proxy_options,
    add_serving_options,
    proxy_fields,
    serving_fields,
)
from harness.errors import EXIT_FAILED, EXIT_OK, BadInput
from harness.preflight import RunRequest, prepare_run
from harness.preflight.config import check_arguments
from harness.report.load import REQUESTS_FILE
from harness.report.text import format_failure
from harness.run.load.run import LoadRun
from harness.run.pool import TopologyPool
from harness.run.sweep import Sweep, SweepSpec
from harness.spec.load import (
    DEFAULT_CONCURRENCY,
    DEFAULT_DISTINCT_MEDIA,
    DEFAULT_REQUESTS,
    MAX_CONCURRENCY,
    MAX_REQUESTS,
    MAX_SOAK_S,
    MIN_DISTINCT_MEDIA,
    LoadSpec,
    load_mix,
    mix_size,
    most_distinct_media,
)
from harness.spec.topology import TOPOLOGIES, Role

KILLABLE_ROLES = tuple(role.value for role in Role)
FAILURES_SHOWN = 5


def refuse_load_counts(args: argparse.Namespace) -> None:
    """--requests, --concurrency, --duration and --media within what a load can send (BadInput,
    one line): checked before the mix is built (a prompt per distinct medium, each rendered and
    counted before anything starts), whether the topology is named or attached."""
    for flag, count in (("--requests", args.requests), ("--concurrency", args.concurrency)):
        if count < 1:
            raise BadInput(f"{flag} {count}: must be at least 1")
    if args.requests > MAX_REQUESTS:
        raise BadInput(
            f"--requests {args.requests}: at most {MAX_REQUESTS} a round, each answer kept "
            "until the load ends; longer traffic is a soak: rounds of --requests (--duration)"
        )
    if args.concurrency > MAX_CONCURRENCY:
        raise BadInput(
            f"--concurrency {args.concurrency}: at most {MAX_CONCURRENCY} in flight; the "
            f"harness's client opens at most {MAX_CONCURRENCY} connections for unstreamed "
            "requests, so more would wait in the harness, never at vLLM"
        )
    if args.duration is not None and not (math.isfinite(args.duration) and args.duration > 0):
        raise BadInput("--duration is the soak's length in seconds: give a positive number")
    if args.duration is not None and args.duration > MAX_SOAK_S:
        raise BadInput(
            f"--duration {args.duration:g}: a soak is at most {MAX_SOAK_S} s (a day; the "
            "value is in seconds): it is judged when it ends and keeps every answer until then"
        )
    if args.media < MIN_DISTINCT_MEDIA:
        raise BadInput(f"--media: a load mix needs at least {MIN_DISTINCT_MEDIA} distinct media")
    most = most_distinct_media(args.requests)
    if args.media > most:
        raise BadInput(
            f"--media {args.media}: a mix of {args.media} distinct media has "
            f"{mix_size(args.media)} prompts and --requests {args.requests} sends "
            f"{args.requests} a round, so some media would never be sent: at most {most} "
            f"with --requests {args.requests}"
        )


def load_spec_from_args(args: argparse.Namespace, topology: str) -> LoadSpec:
    """The load asked for, its flags checked against each other (BadInput, one line)."""
    refuse_load_counts(args)
    if args.kill is not None:
        if args.duration is not None:
            raise BadInput("--kill ends the load at once, so there is no soak: drop --duration")
        roles = [role.value for role in TOPOLOGIES[topology].roles]
        if args.kill not in roles:
            raise BadInput(f"--kill {args.kill}: {topology} has {', '.join(roles)}")
    return LoadSpec(
        topology=topology,
        requests=args.requests,
        concurrency=args.concurrency,
        stream=args.stream,
        duration_s=args.duration,
        distinct_media=args.media,
        kill=args.kill,
    )


# Where a flag that reads or signals the instances' processes from this host is refused.
ON_CLUSTER_NODES = (
    "with --ray-address the instances run on the cluster's nodes, whose processes are not "
    "this host's"
)
REHEARSAL_RUNS_HERE = "the one-host rehearsal cluster runs them here"


def refuse_process_flags_on_a_cluster(args: argparse.Namespace) -> None:
    """`--kill` signals, and a soak (`--duration`) reads, an instance's process tree by its
    pid, on this host (`kill_instance`, `tree_usage`); a Ray cluster's node reports the pid on
    that node. The one-host rehearsal cluster (no --ray-address) runs its nodes' processes
    here; a cluster named by --ray-address is taken to be elsewhere, where that number is
    another process's or none (found in the audit of ignored flags)."""
    if args.ray_address is None:
        return
    if args.kill is not None:
        raise BadInput(
            f"--kill SIGKILLs an instance's processes from this host, and {ON_CLUSTER_NODES}: "
            f"drop --kill (or --ray-address: {REHEARSAL_RUNS_HERE})"
        )
    if args.duration is not None:
        raise BadInput(
            "--duration is a soak, held to RSS and open-file bounds read from the instances' "
            f"processes, and {ON_CLUSTER_NODES} to read: drop --duration (or --ray-address: "
            f"{REHEARSAL_RUNS_HERE})"
        )


def refuse_load_flags(args: argparse.Namespace) -> None:
    """The load's own flags, checked before anything starts."""
    if args.attach and args.kill is not None:  # before the topology: the file names it
        raise BadInput(
            "--kill SIGKILLs an instance the harness launched; an attached deployment's "
            "are not the harness's to kill: drop --kill (or --attach)"
        )
    refuse_process_flags_on_a_cluster(args)
    if not args.attach and not args.topology:
        raise BadInput("load needs --topology (or --attach FILE: the deployment is the topology)")
    if args.topology and "," in args.topology:
        raise BadInput(f"--topology {args.topology}: load runs one topology at a time")
    if args.topology and args.topology not in TOPOLOGIES:
        raise BadInput(f"unknown topology {args.topology!r} (known: {', '.join(TOPOLOGIES)})")
    if args.topology and TOPOLOGIES[args.topology].is_baseline:
        raise BadInput("the baseline is what a load is judged against: pick an EPD topology")
    if args.topology:
        load_spec_from_args(args, args.topology)
    else:  # attached: the topology is the attach file's, read later; the counts are not
        refuse_load_counts(args)
        if args.duration is not None:
            raise BadInput(
                "--duration is a soak, held to RSS and open-file bounds read from the "
                "instances' processes; an attached deployment's are not the harness's to "
                "read: drop --duration (or --attach)"
            )


def load_request(args: argparse.Namespace) -> RunRequest:
    """The run a load needs: its topology and the baseline, over the load's mix of prompts."""
    return RunRequest(
        topologies=(args.topology,) if args.topology else (),
        prompt_specs=load_mix(max(args.media, MIN_DISTINCT_MEDIA)),
        run_dir=args.run_dir,
        baseline_cache=args.baseline_cache,
        refresh_baseline=args.refresh_baseline,
        stream=args.stream,
        **serving_fields(args),
        **proxy_fields(args),
    )


def check_load_arguments(args: argparse.Namespace) -> None:
    """`load`'s arguments, checked as the command checks them first (its files named only)."""
    refuse_load_flags(args)
    check_arguments(load_request(args), read_files=False)


def command_load(args: argparse.Namespace) -> int:
    refuse_load_flags(args)
    config = prepare_run(load_request(args))
    settings = config.settings
    spec = load_spec_from_args(args, config.topologies[0].name)
    args.progress.run_dir = settings.run_dir
    pool = TopologyPool(settings, args.progress.on_event)
    sweep = Sweep(
        SweepSpec(topologies=(), prompts=(), baseline_only_prompts=config.prompts),
        settings,
        on_event=args.progress.on_event,
        baseline_cache=config.baseline_cache,
        goldens=config.goldens,
        pool=pool,
    )
    sweep.run_info["load"] = {
        "topology": spec.topology,
        "requests": spec.requests,
        "concurrency": spec.concurrency,
        "stream": spec.stream,
        "duration_s": spec.duration_s,
        "distinct_media": spec.distinct_media,
        "kill": spec.kill,
    }
    load = LoadRun(spec, sweep)
    try:
        result = load.run()
    finally:
        pool.close()
        sweep.run_info["topology_starts"] = pool.summary()
        sweep.write_outputs()
    print()
    print((settings.run_dir / "load.md").read_text().split("\n## Requests")[0].rstrip())
    failed = [r.record for r in result.results if not r.record.policy_passed]
    if not result.killed:
        for record in failed[:FAILURES_SHOWN]:
            print()
            print(format_failure(record))
        if len(failed) > FAILURES_SHOWN:
            print(f"\n... {len(failed) - FAILURES_SHOWN} more failing request(s) in load.md")
    not_kept = sum(result.failed_unlisted.values())
    if not_kept:
        print(
            f"\n... and {not_kept} more that did not pass, beyond the first of their prompt and "
            f"verdict: counted in load.md, each a line of {REQUESTS_FILE}"
        )
    print(f"\n{pool.summary()}")
    elapsed = time.monotonic() - args.progress.started
    print(
        f"epd-harness: {elapsed:.0f}s; artifacts in {settings.run_dir} (load.md, load.json, {REQUESTS_FILE})"
    )
    return EXIT_OK if result.passed else EXIT_FAILED


def add_load_parser(sub: argparse._SubParsersAction) -> None:
    load = sub.add_parser(
        "load",
        help="many requests at once against one topology over a mix of prompts and media, "
        "every answer judged against the baseline's answer to its own prompt",
    )
    load.add_argument("--topology", help="the EPD topology to load, e.g. 1E+1P+1D")
    load.add_argument("--requests", type=int, default=DEFAULT_REQUESTS, help="per round")
    load.add_argument(
        "--concurrency", type=int, default=DEFAULT_CONCURRENCY, help="requests in flight at most"
    )
    load.add_argument("--stream", action="store_true", help="stream every answer (with usage)")
    load.add_argument(
        "--duration",
        type=float,
        metavar="SECONDS",
        help="a soak: rounds of --requests until SECONDS have passed; RSS, open files and "
        "storage sampled between rounds and held to bounds",
    )
    load.add_argument(
        "--media",
        type=int,
        default=DEFAULT_DISTINCT_MEDIA,
        help=f"distinct media items in the mix (default {DEFAULT_DISTINCT_MEDIA})",
    )
    load.add_argument(
        "--kill",
        choices=KILLABLE_ROLES,
        metavar="ROLE",
        help="death under load: SIGKILL the topology's instance of ROLE (e.g. decode) once "
        "every request is in flight; each must end ERROR naming it",
    )
    load.add_argument("--run-dir", help="artifact directory (default: runs/<timestamp>)")
    add_baseline_cache_options(load)
    add_serving_options(load)
    add_proxy_options(load, attach_help="load a running deployment (attach file) instead")
    load.set_defaults(func=command_load, check_arguments=check_load_arguments)
