"""The one fake vLLM of the harness's tests: a `vllm` executable that serves like one, or refuses.

Serving (the default), it is a `vllm serve` look-alike on a real port (the package
`harness.testing.fake_vllm_server`, its entry module written out as the executable and its other
modules beside it): it reads the flags it needs, ignores the rest and rejects `--no-such-*`
flags with vLLM's parser error; it serves `/health`, `/metrics` and chat completions with token
ids (as server-sent events, the chunks vLLM 0.32 streams, for a `stream: true` body), and moves
embeddings and KV between its instances the way vLLM's connectors do, leaving the evidence the
transfer guards read only when the transfer really happened (that package says how); it
refuses a `*_embeds` part where vLLM 0.32 does (400, on an instance that is no EC or KV
consumer) and dies where it does (a consumer finding neither embeddings nor media); and it
misbehaves on cue. The cue is
the environment variable `FAKE_VLLM_MODE="<who>:<mode>[=<seconds>];..."`, where <who> is a role
(baseline, encoder, pd, prefill, decode), a served model name, or `*`; modes: slow-start,
die-start, slow, hang, hang-health (its `/health` never answers, as a stuck API server's),
ignore-term (SIGTERM ignored, as vLLM does while its engine starts),
fork-child (a child in the server's group, like vLLM's engine core), serve-anything (a request
it cannot serve, for want of embeddings, is answered with 200 from zeros instead of an HTTP 500)
die-request (the process exits on its first chat request, logging an assertion, as an engine
core that dies takes its API server down) and decode-step=<seconds> (how long one decode step
takes, by default 0.01 s on a decode instance and none elsewhere: an answer of n tokens is held
n-1 steps after its first, a stream sends a token a step, so a request stays in flight at D
while it decodes, as in vLLM) and prefix-cache (it keeps every prompt's full blocks under the
request's `cache_salt` and serves a repeat from them, as vLLM's prefix cache does). With
`FAKE_VLLM_START_LOG=<file>` every start appends a JSON line (role, argv without the port,
CUDA_*/VLLM_* env): what start-counting tests count. With `FAKE_VLLM_LIVE_DIR=<dir>` each fake holds
a lock per device of its CUDA_VISIBLE_DEVICES for as long as it lives (the kernel drops it when the
process dies, however it dies), and its start line lists as `shared` every device a live fake
already held: two live instances on one device, which a run without colocation must never show. An
environment a test builds from scratch (an export's run.sh,
`harness.testing.processes.run_export_script`) gets both from `observers`, or the servers started
there would go unseen.

With `serves=False` it only exits, saying a test got as far as starting a server: what
bad-input tests pass, so a check that wrongly lets a run through fails on that line instead of
costing a start.

What the harness reads of a served vLLM before starting it comes from the interpreter on the
executable's `#!` line (`harness.preflight.vllm`): by default this test's Python, so the
versions are this environment's; `vllm_version` / `torch_version` make that interpreter find
distributions of those versions first, and `missing_modules` make importing those modules fail
there as if they were not installed (the `--kv-connector nixl` probe).

Beside the fake is a `python` that runs that interpreter, where a virtualenv's `bin` keeps
vLLM's own Python: an export's scripts run vLLM's proxy with the Python beside `vllm` (its
httpx, fastapi, uvicorn); without one they fell back to the system's `python3`, which has none,
and `run.sh reference` under the fake died before its reference answered. Beside it too are
the server's modules and a copy of `harness/spec/video_sampling.py`, by whose rules the server
samples videos: where an export runs it, the harness itself may not be importable, so the
executable imports them as plain modules from its own directory (`SERVER_MODULES`).

Only for tests of process handling and pure logic: what an e2e scenario checks is real vLLM.
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from harness.spec import video_sampling
from harness.spec.settings import RunSettings, ServedVllm
from harness.spec.topology import ServingConfig
from harness.testing.fake_vllm_server import (
    engine,
    failures,
    handlers,
    media,
    model,
    serve,
    sse,
    tensors,
    video_timing,
)

MODE_ENV = "FAKE_VLLM_MODE"
START_LOG_ENV = "FAKE_VLLM_START_LOG"
LIVE_DIR_ENV = "FAKE_VLLM_LIVE_DIR"
# What a test observes fakes by: passed on into an environment a test builds from scratch.
OBSERVER_ENV = (START_LOG_ENV, LIVE_DIR_ENV)
REFUSAL = "refusing-vllm: a test got as far as starting a server"
# What the serving executable (`serve`'s source) imports from its own directory, standard
# library only: every other module of the server, and the video sampling rules it shares with
# the harness.
SERVER_MODULES = (
    video_sampling,
    failures,
    tensors,
    video_timing,
    media,
    model,
    sse,
    engine,
    handlers,
)

REFUSING_SCRIPT = f"""
import sys
print({REFUSAL!r}, file=sys.stderr)
sys.exit(2)
"""


def logged_starts(log: Path) -> list[dict[str, Any]]:
    """Every start the fake logged to `log` (FAKE_VLLM_START_LOG): role, launch argv, env."""
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines()]


def observers(environ: Mapping[str, str]) -> dict[str, str]:
    """The fakes' observation variables `environ` sets (`OBSERVER_ENV`): for an environment a
    test builds from scratch (an export's run.sh), so the fake servers started there are logged
    and hold their devices like every other; nothing when the session observes none, as under
    real vLLM."""
    return {name: environ[name] for name in OBSERVER_ENV if environ.get(name)}


def fake_run_settings(
    tmp_path: Path, fake: Path, serving: ServingConfig | None = None, **fields: Any
) -> RunSettings:
    """A run served by the fake vLLM `fake`: the model path under `tmp_path`, artifacts in
    `tmp_path / "run"`, 20 s to start; `fields` replace any other RunSettings field."""
    values: dict[str, Any] = {
        "serving": serving or ServingConfig(model=str(tmp_path / "model")),
        "run_dir": tmp_path / "run",
        "vllm": ServedVllm(str(fake), "unknown"),
        "startup_timeout_s": 20.0,
    }
    return RunSettings(**{**values, **fields})


def install_fake_vllm(
    directory: Path,
    *,
    serves: bool = True,
    vllm_version: str | None = None,
    torch_version: str | None = None,
    missing_modules: Sequence[str] = (),
    name: str = "vllm",
) -> Path:
    """Write the fake as an executable `name` in `directory` and return its path.

    `serves`: the `vllm serve` look-alike (True) or a vllm that refuses to start (False).
    `vllm_version`, `torch_version`: what the version probe reads (default: this environment's).
    `missing_modules`: modules whose import fails in the served interpreter.
    """
    directory.mkdir(parents=True, exist_ok=True)
    interpreter = sys.executable
    if vllm_version or torch_version or missing_modules:
        root = directory / f"{name}-python"
        interpreter = str(_interpreter(root, vllm_version, torch_version, missing_modules))
    path = directory / name
    script = Path(serve.__file__).read_text() if serves else REFUSING_SCRIPT
    path.write_text(f"#!{interpreter}\n{script}")
    # The server imports its modules (and the harness's video sampling rules) from beside it:
    # where it runs (an export's run.sh) the harness may not be importable.
    for module in SERVER_MODULES:
        source = Path(str(module.__file__))
        shutil.copyfile(source, directory / source.name)
    path.chmod(0o755)
    beside = directory / "python"
    beside.write_text(f'#!/bin/sh\nexec {shlex.quote(interpreter)} "$@"\n')
    beside.chmod(0o755)
    return path


def _interpreter(
    root: Path, vllm_version: str | None, torch_version: str | None, missing: Sequence[str]
) -> Path:
    """A `python` that runs this test's Python with `root/site` first on its path."""
    site = root / "site"
    site.mkdir(parents=True, exist_ok=True)
    for dist, version in (("vllm", vllm_version), ("torch", torch_version)):
        if version:
            info = site / f"{dist}-{version}.dist-info"
            info.mkdir(exist_ok=True)
            (info / "METADATA").write_text(
                f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
            )
    for module in missing:
        message = f"No module named {module!r}"
        (site / f"{module}.py").write_text(
            f"raise ModuleNotFoundError({message!r}, name={module!r})\n"
        )
    python = root / "python"
    python.write_text(
        f'#!/bin/sh\nPYTHONPATH={site}${{PYTHONPATH:+:$PYTHONPATH}} exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    return python
