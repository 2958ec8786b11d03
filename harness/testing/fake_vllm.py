"""The one fake vLLM of the harness's tests: a `vllm` executable that serves like one, or refuses.

Serving (the default), it is a `vllm serve` look-alike on a real port: it reads the flags it
needs, ignores the rest and rejects `--no-such-*` flags with vLLM's parser error; it serves
`/health` and chat completions with token ids (and kv_transfer_params from a prefill instance),
and misbehaves on cue. The cue is the environment variable
`FAKE_VLLM_MODE="<who>:<mode>[=<seconds>];..."`, where <who> is a role (baseline, encoder, pd,
prefill, decode), a served model name, or `*`; modes: slow-start, die-start, slow, hang,
ignore-term (SIGTERM ignored, as vLLM does while its engine starts), fork-child (a child in
the server's group, like vLLM's engine core) and die-request (the process exits on its first
chat request, logging an assertion, as an engine core that dies takes its API server down).
With `FAKE_VLLM_START_LOG=<file>` every start
appends a JSON line (role, argv without the port, CUDA_*/VLLM_* env): what start-counting tests
count. With `FAKE_VLLM_LIVE_DIR=<dir>` each fake holds a lock per device of its
CUDA_VISIBLE_DEVICES for as long as it lives (the kernel drops it when the process dies, however
it dies), and its start line lists as `shared` every device a live fake already held: two live
instances on one device, which a run without colocation must never show.

With `serves=False` it only exits, saying a test got as far as starting a server: what
bad-input tests pass, so a check that wrongly lets a run through fails on that line instead of
costing a start.

What the harness reads of a served vLLM before starting it comes from the interpreter on the
executable's `#!` line (`harness.preflight.vllm`): by default this test's Python, so the
versions are this environment's; `vllm_version` / `torch_version` make that interpreter find
distributions of those versions first, and `missing_modules` make importing those modules fail
there as if they were not installed (the `--kv-connector nixl` probe).

Only for tests of process handling and pure logic: what an e2e scenario checks is real vLLM.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.spec.settings import RunSettings, ServedVllm
from harness.spec.topology import ServingConfig

MODE_ENV = "FAKE_VLLM_MODE"
START_LOG_ENV = "FAKE_VLLM_START_LOG"
LIVE_DIR_ENV = "FAKE_VLLM_LIVE_DIR"
REFUSAL = "refusing-vllm: a test got as far as starting a server"

REFUSING_SCRIPT = f"""
import sys
print({REFUSAL!r}, file=sys.stderr)
sys.exit(2)
"""

SCRIPT = r"""
import argparse, http.server, json, os, signal, sys, time
parser = argparse.ArgumentParser(prog="vllm")
parser.add_argument("command", choices=["serve"])
parser.add_argument("model")
for flag in ("--host", "--served-model-name", "--ec-transfer-config", "--kv-transfer-config"):
    parser.add_argument(flag, default="")
parser.add_argument("--port", type=int, required=True)
args, unknown = parser.parse_known_args()
rejected = [arg for arg in unknown if arg.startswith("--no-such-")]
if rejected:
    parser.error(f"unrecognized arguments: {' '.join(rejected)}")
ec = json.loads(args.ec_transfer_config or "{}").get("ec_role", "")
kv = json.loads(args.kv_transfer_config or "{}").get("kv_role", "")
role = ("encoder" if ec == "ec_producer" else "prefill" if kv == "kv_producer"
        else "decode" if kv == "kv_consumer" else "pd" if ec else "baseline")
modes = {}
for item in filter(None, os.environ.get("FAKE_VLLM_MODE", "").split(";")):
    who, _, mode = item.partition(":")
    if who in (role, args.served_model_name, "*"):
        name, _, seconds = mode.partition("=")
        modes[name] = float(seconds or 0)
print(f"fake vllm pid {os.getpid()} role {role} port {args.port} modes {modes}", flush=True)
shared = []  # devices another live fake holds (FAKE_VLLM_LIVE_DIR)
if os.environ.get("FAKE_VLLM_LIVE_DIR"):  # hold a lock per device for as long as this lives
    import fcntl
    held = []
    for device in filter(None, os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")):
        fd = os.open(os.path.join(os.environ["FAKE_VLLM_LIVE_DIR"], f"device-{device}"),
                     os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            shared.append(device)
        held.append(fd)
if os.environ.get("FAKE_VLLM_START_LOG"):  # one line per start: what tests count
    with open(os.environ["FAKE_VLLM_START_LOG"], "a") as start_log:
        launch = [a for a in sys.argv[1:] if a != str(args.port)]
        start_log.write(json.dumps({"role": role, "launch": launch, "shared": shared, "env": {
            k: v for k, v in os.environ.items() if k.startswith(("CUDA_", "VLLM_"))}}) + "\n")
if "ignore-term" in modes:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if "fork-child" in modes:  # like vLLM's engine core: a child in the server's process group
    child = os.fork()
    if child == 0:
        time.sleep(3600)
        os._exit(0)
    print(f"CHILD {child}", flush=True)
time.sleep(modes.get("slow-start", 0))
if "die-start" in modes:
    print("FATAL: fake engine core failed to start (chaos-7c1d)", flush=True)
    sys.exit(3)

def top(token_id):
    return {"token": f"token_id:{token_id}", "logprob": -0.5, "bytes": None}

class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        self.reply(200 if self.path in ("/health", "/v1/models") else 404, {})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        print(f"REQUEST {self.headers.get('x-request-id')}", flush=True)
        if "die-request" in modes:
            print("ERROR AssertionError: fake engine core died on a request (chaos-9e2a)", flush=True)
            os._exit(0)
        time.sleep(3600 if "hang" in modes else modes.get("slow", 0))
        ids = [7 + i for i in range(int(body.get("max_tokens") or 4))]
        logprobs = [{**top(t), "top_logprobs": [top(t)]} for t in ids]
        usage = {"prompt_tokens": 3, "completion_tokens": len(ids), "total_tokens": 3 + len(ids),
                 "prompt_tokens_details": {"cached_tokens": 0}}
        self.reply(200, {
            "id": "chatcmpl-fake", "object": "chat.completion", "created": 0,
            "model": body.get("model"), "prompt_token_ids": [1, 2, 3], "usage": usage,
            "kv_transfer_params": {"fake": True} if role == "prefill" else None,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "fake"},
                         "finish_reason": "length", "token_ids": ids,
                         "logprobs": {"content": logprobs}}],
        })

    def reply(self, status, payload):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass

server = http.server.ThreadingHTTPServer((args.host or "127.0.0.1", args.port), Handler)
server.daemon_threads = True
print(f"listening on {args.port}", flush=True)
server.serve_forever()
"""


def logged_starts(log: Path) -> list[dict[str, Any]]:
    """Every start the fake logged to `log` (FAKE_VLLM_START_LOG): role, launch argv, env."""
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines()]


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
    path.write_text(f"#!{interpreter}\n{SCRIPT if serves else REFUSING_SCRIPT}")
    path.chmod(0o755)
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
