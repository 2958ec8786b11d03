"""`epd-harness upstream-requirement nixl --cuda-major N`: the requirement the served vLLM
declares for a KV connector's library, one pip argument per line on stdout.

The GPU workflows install NIXL with it, so a night of any release or commit serves the NIXL
that release was tested with (harness/preflight/upstream_requirements.py says how it is read).
Stdout carries the requirements only, for `$(...)`; where they were read goes to stderr. A
release that declares none is an error (exit 2, one line): installing some other NIXL instead
would test a pairing vLLM never shipped.
"""

from __future__ import annotations

import argparse
import logging
import sys

from harness.environment import cache_dir
from harness.errors import EXIT_OK
from harness.preflight.upstream_proxy import upstream_files
from harness.preflight.upstream_requirements import declared_requirement
from harness.preflight.vllm import default_vllm_executable, interpreter_of, probe_served_vllm


def command_upstream_requirement(args: argparse.Namespace) -> int:
    for handler in logging.getLogger("harness").handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(sys.stderr)  # stdout is the requirements, for the workflow
    served = probe_served_vllm(args.vllm or default_vllm_executable())
    # Only requirements/ is read: a tree whose EPD proxy moved still declares its NIXL.
    files = upstream_files(
        served, args.vllm_source, cache_dir(), interpreter_of(served.executable), required=()
    )
    where = f"vLLM {served.version} ({files.origin})"
    found = declared_requirement(files.directory, args.package, args.cuda_major, where)
    for requirement in found.requirements:
        print(requirement)
    print(
        f"epd-harness: {'; '.join(found.requirements)}: what {where} declares in "
        f"{found.file} for CUDA {args.cuda_major}",
        file=sys.stderr,
    )
    return EXIT_OK


def cuda_major(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected the major version of the CUDA torch was built "
            "for, e.g. 12 (torch.version.cuda 12.9); a torch without CUDA declares none"
        )
    return int(text)


def add_upstream_requirement_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "upstream-requirement",
        help="print the requirement the served vLLM declares for a KV connector library "
        "(e.g. nixl) with a torch of the given CUDA major: its release's sdist, or its "
        "--vllm-source tree",
    )
    parser.add_argument("package", help="the library, e.g. nixl")
    parser.add_argument(
        "--cuda-major",
        type=cuda_major,
        required=True,
        help="the CUDA major torch was built for (12 picks kv_connectors_cu12.txt where the "
        "release has it, as vLLM's CI does)",
    )
    parser.add_argument("--vllm", help="vllm executable (default: the one beside this Python)")
    parser.add_argument(
        "--vllm-source",
        metavar="DIR",
        help="the vLLM source tree the served build was built from (a development build "
        "has no sdist)",
    )
    parser.set_defaults(func=command_upstream_requirement)
