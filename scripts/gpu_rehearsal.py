"""The first GPU night as one command: doctor, plan, the nightly's pytest line, and what it showed.

    python scripts/gpu_rehearsal.py [--devices 0,1,2,3] [--workers N] [--model NAME|DIR]
        [--colocate] [--topology T,...] [-k EXPR] [--no-enforce-eager] [--vllm-source DIR]
        [--dtype bfloat16|float16|float32] [--run-name NAME] [--dry-run]

1. Refuses, exit 2, without a GPU (`nvidia-smi` lists none), or with --devices it does not list
   or an inherited CUDA_VISIBLE_DEVICES did not give (by default: the GPUs it gave).
   Refuses too, before anything is fetched, where this Python lacks the harness's test extra
   (pytest-xdist, hypothesis: what the nightly's pytest line needs), or where one of its GPUs
   lacks the --dtype (bfloat16, the default, below compute capability 8.0: a T4 or V100 needs
   --dtype float16).
2. A model given by name is fetched into the Hugging Face cache, as the nightly does.
3. `epd-harness doctor --model DIR`, then `epd-harness plan --platform cuda ...` (kept as
   runs/NAME/plan.txt); either failing stops the rehearsal.
4. Runs the nightly's own pytest line: the "EPD scenarios" step of
   .github/workflows/nightly-gpu.yml, run by bash with these inputs and a stand-in for python
   that records its arguments and environment, so the rehearsal can never drift from the
   workflow: pytest runs with those arguments and what the step exports for it
   (EPD_VLLM_SOURCE, the --vllm-source tree).
5. Prints each instance's start-up, the makespan (pytest's wall time, and each wave's serving
   time) and every verdict, from the run's summary.json files (a bundle's failing cases that
   its test made red on purpose counted apart).
6. Keeps nvidia-smi's view before pytest (runs/NAME/nvidia-smi-before.txt) and, after it,
   lists every process still holding one of its GPUs that was not there before: the harness
   must leave nothing running, and a server it lost would hold the GPU into the next job.

Workers default to how many xdist groups the plan serves side by side beside the baseline
(`useful_workers`: more would only queue on the same GPUs). `--dry-run`
prints the three commands and exits, GPU or not (then --devices is required). Exit code: the
nightly pytest's (1 when it passed and a process was left on a GPU), or 2 when the rehearsal
refused or a step before it failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORKFLOW = ROOT / ".github" / "workflows" / "nightly-gpu.yml"
PYTEST_STEP = "EPD scenarios"
DEFAULT_MODEL = "Qwen/Qwen2.5-VL-3B-Instruct"
EXIT_REFUSED = 2


class Refused(Exception):
    """A reason not to start: printed as one line, exit code 2."""


class Unlisted(Exception):
    """nvidia-smi did not list the GPUs' processes: what the night left running is unknown."""


# What the nightly's pytest line needs in this Python beyond the harness's own dependencies:
# the `test` extra's pytest, xdist (`-n`), hypothesis (the fuzz scenario) and PyYAML (the
# workflow's step, read here). Module: distribution.
TEST_EXTRA_MODULES = {
    "pytest": "pytest",
    "xdist": "pytest-xdist",
    "hypothesis": "hypothesis",
    "yaml": "pyyaml",
}


def check_test_extra(find: Callable[[str], object] = importlib.util.find_spec) -> None:
    """Refused, before the model is fetched, where this Python lacks what the nightly's pytest
    line needs: a vLLM developer's own environment had vLLM and not the harness's test extra,
    and the rehearsal fetched the model and ran doctor and plan before pytest stopped at `-n`
    (found walking the first GPU run)."""
    missing = [dist for module, dist in TEST_EXTRA_MODULES.items() if find(module) is None]
    if missing:
        raise Refused(
            f"this Python ({sys.executable}) lacks {', '.join(missing)}, which the nightly's "
            "pytest line needs: install the harness with its test extra beside the served vLLM "
            "(pip install -e '.[test]' with this Python; docs/running.md)"
        )


def gpus_here() -> list[int]:
    """The GPU indices nvidia-smi lists; Refused when there is no nvidia-smi or no GPU."""
    nvidia_smi = shutil.which("nvidia-smi")
    if nvidia_smi is None:
        raise Refused(
            "no GPU here (no nvidia-smi on PATH): this rehearses the first GPU night; on CPU "
            "run scripts/cpu sweep"
        )
    listed = subprocess.run(
        [nvidia_smi, "--query-gpu=index", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    indices = [int(line) for line in listed.stdout.split() if line.strip().isdigit()]
    if listed.returncode != 0 or not indices:
        detail = (listed.stderr.strip().splitlines() or ["it lists none"])[-1]
        raise Refused(f"no GPU here (nvidia-smi: {detail}); on CPU run scripts/cpu sweep")
    return indices


# What bash and sh export of their own into every command they run: no setting of the step.
SHELL_OWN_VARIABLES = frozenset({"PWD", "OLDPWD", "SHLVL", "_"})


class NightlyPytest(NamedTuple):
    """How the nightly's "EPD scenarios" step runs pytest: its arguments, and the variables the
    step exports for it beyond its inputs (EPD_VLLM_SOURCE: the tests that read vLLM's own
    files take the tree from there, not from a flag)."""

    args: list[str]
    env: dict[str, str]


def given_here(present: list[int], environ: Mapping[str, str]) -> list[int]:
    """The GPUs nvidia-smi lists that this process was given: nvidia-smi ignores an inherited
    CUDA_VISIBLE_DEVICES, and the harness sets each instance's own from --devices, so a job
    restricted to some GPUs defaults to those (indices as nvidia-smi lists them)."""
    from harness.spec.platforms import CUDA, inherited_devices

    inherited = inherited_devices(CUDA, environ)
    if inherited is None:
        return present
    named = {entry.strip() for entry in inherited.split(",")}
    given = [index for index in present if str(index) in named]
    if not given:
        raise Refused(
            f"CUDA_VISIBLE_DEVICES={inherited} names none of the GPUs nvidia-smi lists "
            f"({','.join(map(str, present))}): pass --devices, or unset CUDA_VISIBLE_DEVICES"
        )
    return given


def nightly_pytest(inputs: dict[str, str], workflow: Path = WORKFLOW) -> NightlyPytest:
    """The nightly's "EPD scenarios" step, for these inputs (the workflow's environment
    variables: DEVICES, WORKERS, COLOCATE, ...), run by bash with a stand-in python that records
    its arguments and environment."""
    import yaml

    data = yaml.safe_load(workflow.read_text(encoding="utf-8"))
    steps = [
        step
        for job in data["jobs"].values()
        for step in job.get("steps", [])
        if step.get("name") == PYTEST_STEP
    ]
    if len(steps) != 1:
        raise Refused(f"{workflow} has {len(steps)} steps named {PYTEST_STEP!r}, expected one")
    with tempfile.TemporaryDirectory(prefix="epd-rehearsal-") as scratch:
        venv = Path(scratch) / "venv"
        (venv / "bin").mkdir(parents=True)
        stand_in = venv / "bin" / "python"
        stand_in.write_text(
            '#!/bin/sh\nprintf "%s\\0" "$@" > "$EPD_REHEARSAL_ARGV"\n'
            'env -0 > "$EPD_REHEARSAL_ENV"\n'
        )
        stand_in.chmod(0o755)
        recorded = Path(scratch) / "argv"
        recorded_env = Path(scratch) / "env"
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            **inputs,
            "VENV": str(venv),
            "EPD_REHEARSAL_ARGV": str(recorded),
            "EPD_REHEARSAL_ENV": str(recorded_env),
        }
        done = subprocess.run(
            ["bash", "-e", "-c", steps[0]["run"]], env=env, cwd=scratch, capture_output=True
        )
        if done.returncode != 0 or not recorded.is_file() or not recorded_env.is_file():
            raise Refused(f"cannot read the nightly's pytest line: {done.stderr.decode()[-300:]}")
        argv = [a.decode() for a in recorded.read_bytes().split(b"\0")[:-1]]
        seen = dict(
            entry.decode().partition("=")[::2]
            for entry in recorded_env.read_bytes().split(b"\0")
            if entry
        )
    if argv[:2] != ["-m", "pytest"]:
        raise Refused(f"the nightly's {PYTEST_STEP!r} step runs python {argv[:2]}, not pytest")
    exported = {
        name: value
        for name, value in seen.items()
        if env.get(name) != value and name not in SHELL_OWN_VARIABLES
    }
    return NightlyPytest(argv[2:], exported)


def workflow_inputs(args: argparse.Namespace, devices: str, workers: int, model: str) -> dict:
    from harness.preflight.dtype import dtype_or_default

    return {
        "RUN_NAME": args.run_name,
        "DEVICES": devices,
        "WORKERS": str(workers),
        "COLOCATE": "true" if args.colocate else "false",
        "TOPOLOGIES": args.topology or "",
        "SCENARIOS": args.k or "",
        "GRAPHS": "true" if args.no_enforce_eager else "false",
        "DTYPE": dtype_or_default(args.dtype),
        "EPD_MODEL_DIR": model,
        "VLLM_SOURCE": args.vllm_source or "",
    }


def useful_workers(devices: str, args: argparse.Namespace) -> int:
    """How many xdist groups (a topology and the references its cases use: 1E+1P+1D goes with
    1P+1D) the plan serves side by side beside the baseline, at least one. Every group's
    worker needs the baseline now and then (a load's calibration), and where workers share
    devices none keeps it up, so each such use starts it again: on 4 GPUs, where no two
    groups serve side by side, a second worker only waited for the first one's devices, and
    the baseline started 8 times where one worker starts it 3 (seen with the fake vLLM on the
    nightly's selection). On 8 GPUs: 2, 1E+1PD's and 1P+1D's."""
    from harness.cli.plan import PlanRequest, build_plan, parse_topologies
    from harness.spec.platforms import CUDA, parse_devices
    from harness.spec.topology import TOPOLOGIES

    def group(name: str) -> str:
        while TOPOLOGIES[name].exact_reference:
            name = TOPOLOGIES[name].exact_reference
        return name

    plan = build_plan(
        PlanRequest(
            platform=CUDA,
            devices=parse_devices(devices),
            topologies=parse_topologies([args.topology] if args.topology else None),
            model="model",
            colocate=args.colocate,
        )
    )
    side_by_side = (
        {group(t.name) for t in wave.topologies if t.name != "baseline"} for wave in plan.waves
    )
    return max(1, *(len(groups) for groups in side_by_side))


def fetch_model(name: str) -> str:
    if Path(name).is_dir():
        return str(Path(name).resolve())
    from huggingface_hub import snapshot_download

    print(f"[rehearsal] fetching {name} into the Hugging Face cache", flush=True)
    return snapshot_download(name)


def shown_with_env(command: list[str], env: dict[str, str]) -> str:
    """`command` as a shell line, the variables it runs with first (NAME=value ...)."""
    assignments = [f"{name}={shlex.quote(value)}" for name, value in sorted(env.items())]
    return " ".join([*assignments, shlex.join(command)])


def harness_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "harness.cli.main", *args]


def red_on_purpose(bundle: Path) -> str | None:
    """Why a bundle's failing cases are what the test that wrote it wanted, as its
    verdicts.txt says it (`purpose_line`: a planted fault, an instance killed under load);
    None for any other run."""
    from harness.report.run_outputs import purpose_line

    try:
        run = json.loads((bundle / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return purpose_line(run) if isinstance(run, dict) else None


def summarize(run_dir: Path, wall_s: float) -> list[str]:
    """Start-up per instance, makespan and verdicts from every summary.json under run_dir; a
    failing case of a bundle red on purpose (`red_on_purpose`) is counted apart, since a green
    night holds them. A fuzz failure group's bundle (harness/run/fuzz/bundle.py) is skipped:
    its cases are its fuzz run's, already counted from that run's summary. A run's `problems`
    (summary.json's: a pass whose guard nothing could check, a planted fault missed) are listed
    and counted: they fail a run whose every case passed, and every report must say so."""
    lines = ["", "start-up per instance (s):"]
    verdicts: list[tuple[str, str, str, str, str, str]] = []
    problems: list[str] = []
    waves: list[str] = []
    for summary_path in sorted(run_dir.rglob("summary.json")):
        where = summary_path.parent.relative_to(run_dir).as_posix()
        where = "" if where == "." else f" [{where}]"
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
        run = summary.get("run", {})
        if "fuzz_group" in run:  # a fuzz failure group's bundle: its fuzz run lists its cases
            continue
        for instance in run.get("instances", []):
            started = instance.get("startup_s")
            shown = f"{started:7.1f}" if started is not None else "    n/a"
            lines.append(f"  {shown}  {instance['name']}{where}")
        for wave, seconds in (run.get("seconds_by_wave") or {}).items():
            waves.append(f"{wave}{where} {seconds:.0f} s")  # keyed "wave N" by the sweep
        problems += [f"  problem: {p}{where}" for p in summary.get("problems") or ()]
        purpose = red_on_purpose(summary_path.parent)
        for case in summary.get("cases", []):
            passed = bool(case["policy_passed"])
            mark = "pass" if passed else purpose or "FAIL"
            verdicts.append(
                (
                    case["topology"],
                    case["prompt"],
                    case["reference"],
                    case["verdict"],
                    mark,
                    where.strip(),
                )
            )
    lines.append(
        f"makespan: {wall_s:.0f} s of pytest" + (f" ({', '.join(waves)})" if waves else "")
    )
    lines.append("verdicts:")
    for topology, prompt, reference, verdict, mark, where in verdicts:
        lines.append(
            f"  {topology:10s} {prompt:14s} vs {reference:9s} {verdict:18s} {mark} {where}"
        )
    passed = sum(1 for v in verdicts if v[4] == "pass")
    failed = sum(1 for v in verdicts if v[4] == "FAIL")
    on_purpose = len(verdicts) - passed - failed  # marked with their `purpose_line`
    lines += problems
    lines.append(
        f"{passed} pass, {failed} fail"
        + (f", {on_purpose} red on purpose" if on_purpose else "")
        + (f", {len(problems)} problem{'s' * (len(problems) != 1)}" if problems else "")
        + f" ({len(verdicts)} cases)"
    )
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from harness.spec.topology import DEFAULT_DTYPE, DTYPES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", help="GPU indices (default: every GPU nvidia-smi lists)")
    parser.add_argument(
        "--workers",
        type=int,
        help="xdist workers (default: the xdist groups the plan serves side by side)",
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model name or directory")
    parser.add_argument("--colocate", action="store_true", help="share GPUs within a topology")
    parser.add_argument("--topology", help="comma-separated topologies (default: all)")
    parser.add_argument("-k", help="pytest -k expression over scenario ids")
    parser.add_argument(
        "--no-enforce-eager", action="store_true", help="compile and capture graphs"
    )
    parser.add_argument("--vllm-source", help="the vLLM tree a development build was built from")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        help=f"every instance's dtype, the nightly's dtype input (default {DEFAULT_DTYPE}; "
        "float16 on a T4 or V100)",
    )
    parser.add_argument("--run-name", default=f"rehearsal-{time.strftime('%Y%m%d-%H%M%S')}")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    return parser.parse_args(argv)


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse, in one line, what the rehearsal would otherwise take for its default or hand on
    broken (found in review): an empty --topology, -k or --devices meant every topology, every
    scenario or every GPU (the harness refuses an empty value, never reads it as unset), an
    empty --run-name wrote into runs/ itself and `../x` outside it, --workers 0 ran one worker
    and --workers -3 reached pytest as `-n -3`."""
    from harness.errors import empty_value

    for flag in ("--devices", "--model", "--topology", "--run-name", "--vllm-source", "-k"):
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None and not value.replace(",", " ").strip():
            raise Refused(empty_value(flag, value))
    if args.run_name in (".", "..") or "/" in args.run_name:
        raise Refused(
            f"--run-name {args.run_name!r}: a name, not a path (the rehearsal writes runs/NAME)"
        )
    if args.workers is not None and args.workers < 1:
        raise Refused(
            f"--workers {args.workers}: give 1 or more xdist workers, or leave --workers out "
            "(the xdist groups the plan serves side by side)"
        )


def rehearse(args: argparse.Namespace) -> int:
    from harness.preflight.dtype import check_bf16_here, dtype_or_default
    from harness.spec.platforms import CUDA, check_inherited_devices, parse_devices

    check_arguments(args)
    if args.dry_run:
        if not args.devices:
            raise Refused("--dry-run needs --devices (it does not look for GPUs)")
        devices = args.devices
    else:
        present = gpus_here()
        check_test_extra()
        devices = args.devices or ",".join(map(str, given_here(present, os.environ)))
        missing = [d for d in devices.split(",") if d.strip().isdigit() and int(d) not in present]
        if missing:
            raise Refused(f"--devices {devices}: nvidia-smi lists no GPU {', '.join(missing)}")
    check_inherited_devices(CUDA, parse_devices(devices), os.environ)  # BadInput: one line
    if not args.dry_run:
        # Before the model is fetched, as `run` refuses it: the rehearsal fetched the model
        # (7.5 GB by default) and only then stopped at doctor, whose output named the cause
        # among its other checks (found walking a T4 box on fakes).
        check_bf16_here(args.dtype, parse_devices(devices))  # BadInput: one line
    dtype = dtype_or_default(args.dtype)
    workers = args.workers or useful_workers(devices, args)
    model = args.model if args.dry_run else fetch_model(args.model)
    run_dir = ROOT / "runs" / args.run_name
    plan = ["plan", "--platform", "cuda", "--devices", devices, "--model", model]
    plan += ["--colocate"] if args.colocate else []
    plan += ["--no-enforce-eager"] if args.no_enforce_eager else []
    plan += ["--dtype", dtype]
    plan += ["--topology", args.topology] if args.topology else []
    nightly = nightly_pytest(workflow_inputs(args, devices, workers, model))
    pytest = [sys.executable, "-m", "pytest", *nightly.args]
    doctor = harness_command("doctor", "--model", model, "--dtype", dtype)
    commands = [doctor, harness_command(*plan), pytest]
    if args.dry_run:
        for command in commands[:2]:
            print(shlex.join(command))
        print(shown_with_env(pytest, nightly.env))
        return 0
    run_dir.mkdir(parents=True, exist_ok=True)
    for command, keep in zip(commands[:2], ("doctor.txt", "plan.txt")):
        print(f"[rehearsal] {shlex.join(command)}", flush=True)
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        (run_dir / keep).write_text(done.stdout + done.stderr, encoding="utf-8")
        print(done.stdout + done.stderr, flush=True)
        if done.returncode != 0:
            print(f"[rehearsal] stopped: {command[3]} exited {done.returncode}", file=sys.stderr)
            return EXIT_REFUSED
    from harness.devices import run_nvidia_smi, smi_compute_processes

    snapshot = run_nvidia_smi() or "nvidia-smi failed, hung or printed nothing\n"
    (run_dir / "nvidia-smi-before.txt").write_text(snapshot)
    before = smi_compute_processes()
    print(f"[rehearsal] {shown_with_env(pytest, nightly.env)}", flush=True)
    started = time.monotonic()
    code = subprocess.run(pytest, cwd=ROOT, env={**os.environ, **nightly.env}).returncode
    print("\n".join(summarize(run_dir, time.monotonic() - started)))
    try:
        left = left_on_gpus(before, smi_compute_processes(), parse_devices(devices))
        lines = [f"left running: {p.describe()}" for p in left]
    except Unlisted as exc:  # told, not failed: the run itself may be green
        left, lines = [], [f"{exc}: that nothing was left running is unproven"]
    (run_dir / "gpu-processes-after.txt").write_text("".join(f"{line}\n" for line in lines))
    for line in lines:
        print(f"[rehearsal] {line}", file=sys.stderr)
    print(f"[rehearsal] pytest exited {code}; artifacts in {run_dir}")
    return code or (1 if left else 0)


def left_on_gpus(before: list | None, after: list | None, devices: tuple[int, ...]) -> list:
    """The processes (harness.devices.GpuProcess) holding one of the rehearsal's GPUs after
    pytest that did not before (those are another job's). Unlisted where nvidia-smi could not
    list them, so that "cannot tell" is never read as "none"."""
    if before is None or after is None:
        raise Unlisted("nvidia-smi could not list the GPUs' processes")
    earlier = {(p.pid, p.gpu) for p in before}
    return [p for p in after if p.gpu in devices and (p.pid, p.gpu) not in earlier]


def main(argv: list[str] | None = None) -> int:
    from harness.errors import BadInput

    try:
        return rehearse(parse_args(argv))
    except (Refused, BadInput) as exc:  # BadInput: the plan's, e.g. too few devices
        print(f"gpu-rehearsal: {exc}", file=sys.stderr)
        return EXIT_REFUSED


if __name__ == "__main__":
    raise SystemExit(main())
