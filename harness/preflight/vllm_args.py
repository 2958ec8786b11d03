"""Every `vllm serve` command line of a run, judged by the served vLLM's own parser before any
server starts.

A flag the served release does not know (or a malformed `--kv-transfer-config`) otherwise shows
up as an instance that dies at start-up, tens of seconds and often a baseline later; on a GPU
night, after a model load. So the run's command lines are rendered the way `epd-harness plan`
renders them and handed, all at once, to ONE subprocess in the served interpreter that runs
vLLM's own CLI entry point (`vllm.entrypoints.cli.main.main`, which builds the `serve` parser,
parses, and runs `ServeSubcommand.validate`; from the second line on, the parser and command it
built, `PROBE`) with the serve command itself replaced by a no-op: vLLM's parser and validation,
no server, no model load.

The parser treats ports, paths and the model name as opaque values, so they are rendered as
placeholders (one port for all): a line depends only on the serving flags and the instance's
role, so it is the same in every run that serves it. Each accepted line is cached by the served
interpreter, its vLLM version (an editable install's code state too) and the line
(`<cache>/argv-check/`, or $EPD_HARNESS_ARGV_CHECK_DIR: a session of the tests judges into a
directory of its own, never the user's), and only lines not seen before go to the
subprocess. Importing vLLM's CLI costs seconds (measured: docs/running.md); a run whose lines
were all judged before costs nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.environment import argv_check_dir
from harness.errors import BadInput
from harness.files import write_text_atomic
from harness.preflight.files import one_line
from harness.preflight.vllm import interpreter_of
from harness.spec.generations import ProtocolGeneration
from harness.spec.instances import (
    PLACEHOLDER_MEDIA,
    PLACEHOLDER_MODEL,
    PLACEHOLDER_PORT,
    PLACEHOLDER_RUN_DIR,
)
from harness.spec.placement import place_instances, schedule, side_channel_port_count
from harness.spec.platforms import PlatformProfile
from harness.spec.settings import ServedVllm
from harness.spec.topology import TOPOLOGIES, ServingConfig, Topology, ordered_topologies

PARSE_TIMEOUT_S = 600.0  # importing vLLM on a loaded 2-core machine took 40 s
CACHE_FORMAT = 2

# Runs in the served interpreter: argv of each instance (after `vllm`) on stdin as JSON,
# {name: problem or null} into the file OUT (set above it). Logs and usage go nowhere.
#
# vLLM's main() builds the parser of every subcommand again for each line, most of a line's
# cost (docs/running.md). So the first line goes through main(), which leaves behind the parser
# it parsed with (the one with subcommands) and the serve command it validated with; each later
# line repeats main()'s last steps with that pair: parse, validate, dispatch. The pair takes
# over only once it has judged the first line main() validated as main() did: a release whose
# main() judges that line some other way keeps main() for every line, as ONE_PARSER = False
# (set above it) does.
PROBE = r"""
import argparse, contextlib, io, json, sys
import vllm.entrypoints.cli.main as cli_main
import vllm.entrypoints.cli.serve as cli_serve
accepted = []
cli_serve.ServeSubcommand.cmd = staticmethod(lambda args: accepted.append(args))
kept = {}
parse_args, validate = argparse.ArgumentParser.parse_args, cli_serve.ServeSubcommand.validate
def keep_parser(self, *args, **kwargs):
    if getattr(self, "_subparsers", None) is not None:
        kept.setdefault("parser", self)
    return parse_args(self, *args, **kwargs)
def keep_serve(self, args):
    kept.setdefault("serve", self)
    return validate(self, args)
argparse.ArgumentParser.parse_args = keep_parser
cli_serve.ServeSubcommand.validate = keep_serve
def with_main():
    cli_main.main()
def with_kept():
    args = kept["parser"].parse_args(sys.argv[1:])
    if getattr(args, "subparser", None) == "serve":
        kept["serve"].validate(args)
        args.dispatch_function(args)
def judge(argv, run):
    sys.argv = ["vllm", *argv]
    before, err = len(accepted), io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            run()
        return None if len(accepted) > before else "parsed, but not as vllm serve"
    except SystemExit as exc:
        return err.getvalue() or f"exit {exc.code}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
one_parser = globals().get("ONE_PARSER", True)
run, results, lines = with_main, {}, json.load(sys.stdin)
for name, argv in lines.items():
    results[name] = judge(argv, run)
    if run is with_main and one_parser and {"parser", "serve"} <= kept.keys():
        one_parser = judge(argv, with_kept) == results[name]
        run = with_kept if one_parser else with_main
with open(OUT, "w") as out:
    json.dump(results, out)
"""


@dataclass(frozen=True)
class ArgvCheck:
    """What the check judged, for run.json."""

    parser: str  # whose parser: "vllm 0.32.0+cpu (/venv/bin/python)"
    instances: tuple[str, ...]  # the instances whose lines were checked
    judged: int  # distinct lines the subprocess parsed now (0: all accepted in earlier runs)
    seconds: float  # the subprocess's wall time (0 when it was not needed)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def serve_argvs(
    topologies: Sequence[Topology],
    serving: ServingConfig,
    platform: PlatformProfile,
    devices: Sequence[int],
    colocate: bool,
    generation: ProtocolGeneration,
    *,
    baseline_starts: bool = True,
) -> dict[str, list[str]]:
    """Each instance's `vllm serve` arguments (after the executable), as a run of these
    topologies (and the baseline, and the exact references they are judged against: a run
    starts those too) renders them, with placeholder ports, paths and model.

    `baseline_starts`: False where stored answers stand in for the baseline (`--golden`), which
    then never starts, so its line is not one of the run's. Where instances own devices it
    keeps its slot all the same, as the sweep keeps it (`Sweep.schedule`), so the others are
    placed as they will run; with no topology either (attached), nothing is rendered."""
    opaque = dataclasses.replace(
        serving,
        model=PLACEHOLDER_MODEL,
        allowed_local_media_path=PLACEHOLDER_MEDIA if serving.allowed_local_media_path else None,
    )
    launched = ordered_topologies(tuple(topologies))
    placed = baseline_starts or (bool(launched) and platform.exclusive_devices)
    wanted = [TOPOLOGIES["baseline"], *launched] if placed else launched
    argvs: dict[str, list[str]] = {}
    if not wanted:
        return argvs
    for wave in schedule(wanted, devices, platform, colocate, cpu_budget=len(devices)).waves:
        for slot in wave.slots:
            topology = slot.topology
            if topology.is_baseline and not baseline_starts:
                continue
            specs = place_instances(
                topology,
                opaque,
                platform,
                [PLACEHOLDER_PORT] * len(topology.roles),
                PLACEHOLDER_RUN_DIR / topology.name,
                slot.devices,
                colocate=colocate,
                side_channel_ports=[PLACEHOLDER_PORT] * side_channel_port_count(topology, opaque),
                generation=generation,
            )
            argvs.update({spec.name: spec.argv("vllm")[1:] for spec in specs})
    return argvs


def check_served_argvs(argvs: dict[str, list[str]], served: ServedVllm) -> ArgvCheck:
    """`check_serve_argvs` by `served`'s own parser (the interpreter on its `#!` line), its
    accepted lines kept where every command keeps them (`argv_check_dir`); an editable install
    whose code cannot be identified keeps none. One place for `run` (and load, fuzz) and
    `repro`, so that a line one accepted is never judged otherwise by the other."""
    return check_serve_argvs(
        argvs,
        interpreter_of(served.executable),
        served.version,
        None if served.cache_refusal else argv_check_dir(),
        code=served.source_state,
    )


def check_serve_argvs(
    argvs: dict[str, list[str]],
    interpreter: Sequence[str] | None,
    version: str,
    directory: Path | None,
    code: str = "",
) -> ArgvCheck:
    """Parse every argv with the served vLLM's own parser; the first refused one is a
    BadInput naming the instance and vLLM's complaint (which names the flag). `directory`
    keeps the accepted lines (None: nothing is kept); `code`: an editable install's state
    (`ServedVllm.source_state`), whose parser changes while its version stays."""
    if interpreter is None:
        raise BadInput(
            f"cannot check the vllm serve command lines: the served vLLM ({version}) names "
            "no Python interpreter (#! line) to run its own parser with"
        )
    parser = f"vllm {version} ({' '.join(interpreter)})"
    first_name: dict[str, str] = {}  # each distinct line (as JSON) -> its first instance
    for name, argv in argvs.items():
        first_name.setdefault(json.dumps(argv), name)
    marker = {
        line: directory / f"{_cache_key(interpreter, version, line, code)}.json"
        if directory
        else None
        for line in first_name
    }
    unseen = {line for line, path in marker.items() if path is None or not path.is_file()}
    if not unseen:
        return ArgvCheck(parser, tuple(argvs), judged=0, seconds=0.0)
    results, seconds = _run_probe(
        interpreter, {first_name[line]: json.loads(line) for line in unseen}
    )
    for name, argv in argvs.items():
        line = json.dumps(argv)
        problem = results.get(first_name[line], "no verdict") if line in unseen else None
        if problem is not None:
            raise BadInput(
                f"{name}: the served vLLM's own parser refuses its command line: "
                f"{describe_refusal(problem)}"
            )
    for line in unseen:
        if marker[line] is not None:
            write_text_atomic(
                marker[line], json.dumps({"parser": parser, "argv": json.loads(line)})
            )
    return ArgvCheck(parser, tuple(argvs), judged=len(unseen), seconds=round(seconds, 1))


def describe_refusal(text: str) -> str:
    """vLLM's refusal in one line: argparse's "error:" message without usage, pydantic's
    error types and links."""
    if "error:" in text:
        text = text.split("error:", 1)[1]
    lines = [
        line.strip()
        for line in text.splitlines()
        if line.strip() and not line.strip().startswith(("For further information", "usage:"))
    ]
    joined = re.sub(r"\s*\[type=[^\]]*\]", "", " ".join(lines))
    return one_line(joined)[:400]


def _cache_key(interpreter: Sequence[str], version: str, line: str, code: str = "") -> str:
    material = {"format": CACHE_FORMAT, "interpreter": list(interpreter), "vllm": version}
    material["argv"] = line
    if code:
        material["code"] = code
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def _run_probe(
    interpreter: Sequence[str], argvs: dict[str, list[str]]
) -> tuple[dict[str, str | None], float]:
    with tempfile.TemporaryDirectory(prefix="epd-argv-check-") as scratch:
        out = Path(scratch) / "verdicts.json"
        program = f"OUT = {str(out)!r}\n{PROBE}"
        started = time.monotonic()
        try:
            done = subprocess.run(
                [*interpreter, "-c", program],
                input=json.dumps(argvs),
                capture_output=True,
                text=True,
                timeout=PARSE_TIMEOUT_S,
                cwd=scratch,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BadInput(f"cannot run the served vLLM's parser: {exc}") from None
        seconds = time.monotonic() - started
        if done.returncode != 0 or not out.is_file():
            tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
            raise BadInput(
                f"cannot run the served vLLM's parser ({' '.join(interpreter)}): "
                f"{one_line(tail[0])}"
            )
        return json.loads(out.read_text()), seconds
