"""The served vLLM's own `vllm serve` parser, started once for every test that needs its verdicts.

A probe of the parser (`harness.preflight.vllm_args._run_probe`) is one interpreter of the
served vLLM that imports vLLM's CLI, about 10 s on this 2-core host, and then parses each line
in a fraction of a second. So one probe, the harness's own and unchanged, judges at once every
line the parser tests read: each line the harness renders for any platform, KV connector,
protocol generation and eager mode (`every_rendered_argv`), the planted refusals
(`planted_refusals`), and the lines a run renders with a flag planted in the encoder's arguments
(`ENCODER_FLAG`). The tests that go through `prepare_run` or the CLI get those verdicts in place
of a probe of their own (`ServedParser.probe`); a line or an interpreter the batch did not judge
still gets a probe of its own, so nothing is judged by anything but vLLM's parser.

The tests sharing it are in one xdist group (`XDIST_GROUP`), so a session starts it once.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from harness.preflight import vllm_args
from harness.preflight.vllm_args import serve_argvs
from harness.spec import instances
from harness.spec.generations import GENERATIONS
from harness.spec.platforms import CPU, PLATFORMS
from harness.spec.topology import TOPOLOGIES, serving_for

XDIST_GROUP = "served-vllm-parser"
EIGHT = tuple(range(8))
# A flag vLLM 0.32.0 does not have, planted into the encoder's arguments by the tests that show
# a run refusing before anything starts.
ENCODER_FLAG = "--encoder-cache-turbo"
# The line the planted refusals are made from.
PLANTED_FROM = "cuda/NixlConnector/by-hash-indexed/eager=True/1P+1D/decode0"
Verdicts = dict[str, "str | None"]  # name -> vLLM's complaint, None for a line it accepts


def every_rendered_argv(media: str | None = "/media") -> dict[str, list[str]]:
    """Every platform, KV connector, protocol generation and eager mode, every topology."""
    argvs: dict[str, list[str]] = {}
    for platform in PLATFORMS.values():
        devices = EIGHT if platform.exclusive_devices else (0, 1)
        for kv in ("ExampleConnector", "NixlConnector"):
            for generation in GENERATIONS:
                for eager in {platform.enforce_eager, False} if platform is not CPU else {True}:
                    serving = serving_for(
                        platform,
                        "/models/m",
                        kv_connector=kv,
                        allowed_local_media_path=media,
                        enforce_eager=eager,
                    )
                    rendered = serve_argvs(
                        tuple(TOPOLOGIES.values()), serving, platform, devices, False, generation
                    )
                    tag = f"{platform.name}/{kv}/{generation.name}/eager={eager}"
                    argvs.update({f"{tag}/{name}": argv for name, argv in rendered.items()})
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


@dataclass
class ServedParser:
    """The verdicts of one probe, by interpreter and line; `probe` is a drop-in for
    `vllm_args._run_probe` that answers from them and probes only what they lack."""

    interpreter: tuple[str, ...]
    rendered: dict[str, list[str]]  # every_rendered_argv()
    planted: dict[str, list[str]]  # planted_refusals()
    by_line: dict[str, str | None] = field(default_factory=dict)  # argv as JSON -> verdict
    probes: int = 0  # probes run: the batch's, then one per call with lines it lacked

    def judge(self) -> None:
        """The one probe: every line the parser tests read."""
        first_name: dict[str, str] = {}  # each distinct line -> its first name
        for name, argv in {**self.rendered, **self.planted, **with_encoder_flag()}.items():
            first_name.setdefault(json.dumps(argv), name)
        batch = {name: json.loads(line) for line, name in first_name.items()}
        self._remember(batch, *self._real_probe(self.interpreter, batch))

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

    def _remember(self, argvs: dict[str, list[str]], results: Verdicts, _seconds: float) -> None:
        for name, argv in argvs.items():
            self.by_line[json.dumps(argv)] = results.get(name, "no verdict")

    def _real_probe(
        self, interpreter: Sequence[str], argvs: dict[str, list[str]]
    ) -> tuple[Verdicts, float]:
        self.probes += 1
        return REAL_PROBE(interpreter, argvs)


REAL_PROBE = vllm_args._run_probe  # before any test replaces it with `ServedParser.probe`


def served_parser(interpreter: Sequence[str]) -> ServedParser:
    """The parser of the served vLLM at `interpreter`, its batch judged."""
    rendered = every_rendered_argv()
    parser = ServedParser(tuple(interpreter), rendered, planted_refusals(rendered[PLANTED_FROM]))
    parser.judge()
    return parser
