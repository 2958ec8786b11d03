"""`epd-harness export RUN_DIR [--case TOPOLOGY:PROMPT[@REFERENCE]] [--out DIR]
[--vllm-source DIR]`: one case of a run as a directory that reproduces it with vLLM alone
(`harness.run.export.plan`; docs/found-in-vllm.md).

The command line resolves what the exporter is handed: vLLM's proxy files of the served
release (`--vllm-source`'s checkout, checked as `run` checks it; else the run's own when it ran
`--proxy vllm`; else the release's sdist through the package index, cached, as `--proxy vllm`
fetches them; a development build has no sdist, so it needs `--vllm-source`) and the CPU
repairs the export carries (`harness.cli.cpu_env`, with the AMX start-up hook it installs,
`harness.amx`, beside it).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harness import amx
from harness.cli import cpu_env
from harness.environment import cache_dir
from harness.errors import EXIT_OK, BadInput
from harness.preflight.files import describe_os_error
from harness.preflight.upstream_proxy import PROXY_FILES, cached_or_fetched, from_checkout
from harness.preflight.vllm import interpreter_of
from harness.run.export.files import write_export
from harness.run.export.issue import title
from harness.run.export.plan import plan_export
from harness.run.export.probe import PROBES
from harness.run.export.proxy import UpstreamProxy
from harness.run.repro import Bundle, BundleError
from harness.spec.settings import VLLM_PROXY, ServedVllm

EXPORTS_DIR = "exports"
AMX_IMPORT = "from harness import amx\n"
AMX_COPY = "epd_amx"  # harness/amx.py as the export's module, beside cpu_repair.py


def cpu_repair_files() -> dict[str, str]:
    """The export's repairs: `cpu_repair.py` is harness/cli/cpu_env.py, whose one harness import
    (the AMX hook it installs) is pointed at a copy shipped beside it, so that nothing of the
    export imports the harness."""
    source = Path(cpu_env.__file__).read_text(encoding="utf-8")
    if source.count(AMX_IMPORT) != 1:
        raise RuntimeError(f"{cpu_env.__file__}: expected one line {AMX_IMPORT!r} to repoint")
    local = f"import {AMX_COPY} as amx  # harness/amx.py, copied beside this file\n"
    return {
        "cpu_repair.py": source.replace(AMX_IMPORT, local),
        f"{AMX_COPY}.py": Path(amx.__file__).read_text(encoding="utf-8"),
    }


def upstream_proxy(bundle: Bundle, source: str | None = None) -> UpstreamProxy:
    """The files of `source` (`--vllm-source`: a vLLM checkout, checked as `run` checks it:
    it holds the proxy files, and its commit is the served build's), else of the proxy the run
    used when it was vLLM's, else the served release's (a development build has none: its
    source tree is needed)."""
    served = bundle.run.get("served_vllm") or {}
    if source:
        version = str(served.get("version") or "unknown")
        files = from_checkout(source, ServedVllm(str(served.get("executable", "")), version))
        return UpstreamProxy(files.directory, files.origin)
    recorded = bundle.run.get("proxy") or {}
    files_dir = recorded.get("files_dir")
    if (
        recorded.get("kind") == VLLM_PROXY
        and files_dir
        and all((Path(files_dir) / name).is_file() for name in PROXY_FILES)
    ):
        return UpstreamProxy(Path(files_dir), recorded.get("origin") or files_dir)
    interpreter = interpreter_of(served.get("executable", "")) if served.get("executable") else None
    files = cached_or_fetched(served.get("version", "unknown"), cache_dir(), interpreter)
    return UpstreamProxy(files.directory, files.origin)


def command_export(args: argparse.Namespace) -> int:
    if args.probe and args.vllm_source:
        raise BadInput(
            f"--vllm-source gives vLLM's proxy files, and --probe {args.probe} sends its "
            "request to one instance directly, without a proxy: drop --vllm-source"
        )
    try:
        bundle = Bundle.load(Path(args.run_dir).resolve())
    except BundleError as exc:
        raise BadInput(str(exc)) from None
    plan = plan_export(
        bundle, args.case, lambda: upstream_proxy(bundle, args.vllm_source), args.probe
    )
    out = Path(args.out) if args.out else bundle.path / EXPORTS_DIR / plan.name
    try:
        # Made here to name it: `--out /proc/x` was a FileNotFoundError traceback, exit 1,
        # and a file in the way "not a directory" without saying of what (found in review).
        out.resolve().mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BadInput(
            f"export directory {out} cannot be made: {describe_os_error(exc)}; choose another --out"
        ) from None
    written = write_export(plan, out.resolve(), cpu_repair_files())
    size = sum(path.stat().st_size for path in written)
    print(f"epd-harness export: {title(plan)}")
    print(f"epd-harness export: {out} ({len(written)} files, {size / 1e6:.1f} MB)")
    print(f"epd-harness export: reproduce with: bash {out}/run.sh (report draft: ISSUE.md)")
    if plan.reference is not None:
        name = "the monolithic baseline" if plan.baseline else plan.reference.name
        print(
            f"epd-harness export: on another machine: bash {out}/run.sh reference (serves "
            f"{name} there first and judges the case against its answer)"
        )
    return EXIT_OK


def add_export_parser(sub: argparse._SubParsersAction) -> None:
    export = sub.add_parser(
        "export",
        help="one case of a run as a directory that reproduces it with vLLM alone "
        "(serve.sh, run.sh, check.py, the request, vLLM's proxy, the model, ISSUE.md)",
    )
    export.add_argument("run_dir", help="a run directory written by 'epd-harness run'")
    export.add_argument(
        "--case",
        help="TOPOLOGY:PROMPT[@REFERENCE], or a one-prompt scenario's TOPOLOGY:SCENARIO as "
        "the verdict table names it (default: the first case that failed its policy, else "
        "the first failure the harness declares; @REFERENCE picks one of a case's "
        "references, e.g. @1P+1D, and is needed when more than one failed)",
    )
    export.add_argument("--out", help=f"export directory (default: RUN_DIR/{EXPORTS_DIR}/<name>)")
    export.add_argument(
        "--vllm-source",
        metavar="DIR",
        help="take vLLM's proxy files from this checkout instead of the run's or the "
        "release's sdist on the package index (as run's --vllm-source: a development build's "
        "only source, the tree it was built from, its commit checked against the build's)",
    )
    export.add_argument(
        "--probe",
        choices=PROBES,
        help="instead of the case's request, send its consumer (D, or PD) the request with "
        "its image as a metadata-only part under a uuid no encoder produced",
    )
    export.set_defaults(func=command_export)
