"""`epd-harness compare RUN_A RUN_B`: two runs of the same cases, tokens and instance calls.

Made for judging vLLM's own proxy against the harness's (`run --proxy harness` and `run --proxy
vllm` over the same cases, then compare), but any two bundles of the same cases will do.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from harness.errors import EXIT_FAILED, EXIT_OK, BadInput
from harness.report.proxy_diff import diff_runs, format_diff, unpaired_cases

RESPONSES_FILE = "responses.json"


def read_responses(run_dir: str) -> dict[str, Any]:
    """A run's responses.json, {group: {prompt: outcome}}, its shape checked: a list there
    compared as "no case in common", and an outcome that is not a mapping was a traceback
    (found in review)."""
    path = Path(run_dir) / RESPONSES_FILE
    try:
        responses = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadInput(f"{path} does not exist: not a run directory of 'epd-harness run'") from None
    except (OSError, ValueError) as exc:
        raise BadInput(f"{path} cannot be read: {exc}") from None
    if not isinstance(responses, dict):
        raise BadInput(f"{path}: expected a JSON object of {{group: {{prompt: outcome}}}}")
    for group, cases in responses.items():
        if not isinstance(cases, dict):
            raise BadInput(f"{path}: {group!r} is not a mapping of prompts to outcomes")
        for prompt, outcome in cases.items():
            if not isinstance(outcome, dict):
                raise BadInput(f"{path}: {group!r} / {prompt!r} is not an outcome (a JSON object)")
    return responses


def read_run_json(run_dir: str) -> dict[str, Any]:
    """The run's run.json, or {} when it is missing or not a mapping (the labels fall back on
    the directory's name)."""
    try:
        run = json.loads((Path(run_dir) / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return run if isinstance(run, dict) else {}


def served_version(run: dict[str, Any]) -> str | None:
    """The vLLM version the run served, as run.json records it."""
    served = run.get("served_vllm")
    version = served.get("version") if isinstance(served, dict) else None
    return str(version) if version else None


def launcher_of(run: dict[str, Any]) -> str:
    """Where the run's instances ran, as run.json records it: `local` (also a run recorded
    before launchers were), or `ray`."""
    launcher = run.get("launcher")
    kind = launcher.get("kind") if isinstance(launcher, dict) else None
    return str(kind) if kind else "local"


# Serving fields that name a run's own files, not how it computes.
RUN_LOCAL_SERVING_FIELDS = ("allowed_local_media_path",)


def serving_differences(first: dict[str, Any], second: dict[str, Any]) -> list[str]:
    """Each serving flag (run.json's `serving`: dtype, max model length, block size,
    connectors, ...) the two runs were served with differently, as `name: A vs B`. Tokens of a
    float32 run differed from a bfloat16 run's and compare said only where, as if one of them
    were wrong (found checking --dtype on real vLLM)."""
    served = [run.get("serving") for run in (first, second)]
    if not all(isinstance(s, dict) for s in served):
        return []
    a, b = served
    return [
        f"{name}: {a.get(name)!r} vs {b.get(name)!r}"
        for name in sorted(set(a) | set(b))
        if name not in RUN_LOCAL_SERVING_FIELDS and a.get(name) != b.get(name)
    ]


def proxy_label(run_dir: str, run: dict[str, Any], with_version: bool, with_launcher: bool) -> str:
    """The proxy under test of the run in `run_dir` (its run.json, `run`), to head the
    columns; the directory otherwise. `with_version`: the served vLLM's version too (the two
    runs served different ones); `with_launcher`: where its instances ran (the two runs ran
    them in different places)."""
    proxy = run.get("proxy")
    kind = proxy.get("kind") if isinstance(proxy, dict) else None
    name = Path(run_dir).name
    if with_version:
        name = f"{name}, vLLM {served_version(run) or 'not recorded'}"
    if with_launcher:
        name = f"{name}, {launcher_of(run)} launcher"
    return f"{kind} ({name})" if kind else name


def command_compare(args: argparse.Namespace) -> int:
    first, second = read_responses(args.first), read_responses(args.second)
    diffs = diff_runs(first, second)
    if not diffs:
        raise BadInput(f"{args.first} and {args.second} hold no case in common")
    # Comparing releases, or a Ray run with a local one: each column names the vLLM its run
    # served and where its instances ran, when they differ (real vLLM: a local run and a Ray
    # run were headed "harness (A)" and "harness (B)").
    runs = [read_run_json(d) for d in (args.first, args.second)]
    versions_differ = served_version(runs[0]) != served_version(runs[1])
    launchers_differ = launcher_of(runs[0]) != launcher_of(runs[1])
    labels = [
        proxy_label(d, run, versions_differ, launchers_differ)
        for d, run in zip((args.first, args.second), runs, strict=True)
    ]
    print(format_diff(diffs, *labels))
    for line in serving_differences(*runs):
        print(f"served differently (tokens may differ for this alone): {line}")
    for line in unpaired_cases(first, second):
        print(f"not compared: {line}")
    return EXIT_OK if all(diff.same for diff in diffs) else EXIT_FAILED


def add_compare_parser(sub: argparse._SubParsersAction) -> None:
    compare = sub.add_parser(
        "compare",
        help="two runs of the same cases (e.g. --proxy harness and --proxy vllm): tokens and "
        "what every instance was sent; exit 1 if anything differs",
    )
    compare.add_argument("first", help="a run directory")
    compare.add_argument("second", help="another run directory with the same cases")
    compare.set_defaults(func=command_compare)
