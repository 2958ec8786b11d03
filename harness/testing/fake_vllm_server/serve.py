"""The fake vLLM's entry: `vllm serve`'s command line, the modes it plays (FAKE_VLLM_MODE), what
it leaves for the tests that watch it (FAKE_VLLM_START_LOG, FAKE_VLLM_LIVE_DIR), and its
servers. `harness.testing.fake_vllm` writes this module behind a `#!` line as the executable
`vllm`, the package's other modules beside it (the package's docstring says why and how;
`harness.testing.fake_vllm` lists the flags and modes).
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import signal
import sys
import threading
import time

if __package__:  # imported, by the tests of its pure functions
    from harness.testing.fake_vllm_server.engine import Engine
    from harness.testing.fake_vllm_server.handlers import make_handler, make_side_channel
else:  # the executable: harness.testing.fake_vllm wrote these modules beside it
    from engine import Engine  # type: ignore[no-redef]
    from handlers import make_handler, make_side_channel  # type: ignore[no-redef]

DEFAULT_BLOCK_SIZE = 16  # vLLM's default


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The flags the fake reads; any other is ignored, but a `--no-such-*` flag is refused with
    vLLM's parser error (what tests of a rejected flag plant)."""
    parser = argparse.ArgumentParser(prog="vllm")
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("model")
    for flag in ("--host", "--served-model-name", "--ec-transfer-config", "--kv-transfer-config"):
        parser.add_argument(flag, default="")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    parser.add_argument("--enable-mm-embeds", action="store_true")
    args, unknown = parser.parse_known_args(argv)
    rejected = [arg for arg in unknown if arg.startswith("--no-such-")]
    if rejected:
        parser.error(f"unrecognized arguments: {' '.join(rejected)}")
    return args


def parse_modes(role: str, served_name: str) -> dict[str, float]:
    """The modes FAKE_VLLM_MODE gives this instance (by its role, its served name, or `*`),
    each with its seconds (0 when it names none)."""
    modes = {}
    for item in filter(None, os.environ.get("FAKE_VLLM_MODE", "").split(";")):
        who, _, mode = item.partition(":")
        if who in (role, served_name, "*"):
            name, _, seconds = mode.partition("=")
            modes[name] = float(seconds or 0)
    return modes


def hold_devices() -> tuple[list[str], list[int]]:
    """FAKE_VLLM_LIVE_DIR: a lock per device for as long as this process lives; the devices
    another live fake already held."""
    import fcntl

    shared, held = [], []
    for device in filter(None, os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")):
        path = os.path.join(os.environ["FAKE_VLLM_LIVE_DIR"], f"device-{device}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            shared.append(device)
        held.append(fd)
    return shared, held


def main() -> None:
    """Start as vLLM does, misbehaving where the modes say, and serve until killed."""
    args = parse_args(sys.argv[1:])
    engine = Engine(args, {})
    engine.modes.update(parse_modes(engine.role, args.served_model_name))
    modes = engine.modes
    print(
        f"fake vllm pid {os.getpid()} role {engine.role} port {args.port} modes {modes}", flush=True
    )
    shared: list[str] = []
    if os.environ.get("FAKE_VLLM_LIVE_DIR"):
        shared, _held = hold_devices()
    if os.environ.get("FAKE_VLLM_START_LOG"):  # one line per start: what tests count
        with open(os.environ["FAKE_VLLM_START_LOG"], "a") as start_log:
            launch = [a for a in sys.argv[1:] if a != str(args.port)]
            env = {k: v for k, v in os.environ.items() if k.startswith(("CUDA_", "VLLM_"))}
            start_log.write(
                json.dumps({"role": engine.role, "launch": launch, "shared": shared, "env": env})
                + "\n"
            )
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
    if engine.nixl and engine.role == "prefill" and engine.side_port:
        side = http.server.ThreadingHTTPServer(
            (engine.side_host, engine.side_port), make_side_channel(engine)
        )
        side.daemon_threads = True
        threading.Thread(target=side.serve_forever, daemon=True).start()
    server = http.server.ThreadingHTTPServer(
        (args.host or "127.0.0.1", args.port), make_handler(engine)
    )
    server.daemon_threads = True
    print(f"listening on {args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
