"""The one fake vLLM of the process tests: a `vllm serve` look-alike on a real port.

It reads the flags it needs, ignores the rest and rejects `--no-such-*` flags with vLLM's parser
error; it serves `/health` and chat completions with token ids (and kv_transfer_params from a
prefill instance), and misbehaves on cue. The cue is the environment variable
`FAKE_VLLM_MODE="<who>:<mode>[=<seconds>];..."`, where <who> is a role (baseline, encoder, pd,
prefill, decode), a served model name, or `*`; modes: slow-start, die-start, slow, hang,
ignore-term (SIGTERM ignored, as vLLM does while its engine starts) and fork-child (a child in
the server's group, like vLLM's engine core).

Only for tests of process handling and pure logic: what an e2e scenario checks is real vLLM.
"""

from __future__ import annotations

import sys
from pathlib import Path

MODE_ENV = "FAKE_VLLM_MODE"

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


def install_fake_vllm(directory: Path) -> Path:
    """Write the fake as an executable `vllm` in `directory` (run by this test's Python)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "vllm"
    path.write_text(f"#!{sys.executable}\n{SCRIPT}")
    path.chmod(0o755)
    return path
