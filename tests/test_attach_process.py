"""Attach mode against a fake deployment of real processes: a sweep that launches nothing judges
it, and an instance that is down (before the run, or while a request is in flight) is an ERROR
naming it, within seconds.

FAKE_DEPLOYMENT stands in for a deployment somebody else started: one script, one role per
process. Every process serves `/health`, `/version` and a `/metrics` page with vLLM's finished
request counter. The encoder writes `<hash>/encoder_cache.safetensors` into the EC storage for
every media part it is sent; the pd answers with fixed token ids; the proxy sends the request to
the encoder (when it has media), then to the pd, and passes the pd's answer on. The cue
`FAKE_DEPLOYMENT_MODE=<role>:hang` makes that role hold every chat request.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.judge.records import Verdict
from harness.outcomes.chat import parse_chat_response
from harness.outcomes.outcome import Outcome
from harness.report.text import format_verdict_table
from harness.run.baseline_cache import BaselineCache, baseline_key
from harness.run.baseline_launch import BaselineLaunch
from harness.run.sweep import Sweep, SweepSpec
from harness.serve.attached import AttachedMismatch, AttachedSession
from harness.serve.client import ChatReply
from harness.serve.launch import ManagedServer
from harness.serve.ports import reserve_ports
from harness.serve.server_command import ServerCommand
from harness.serve.server_log import log_path_for
from harness.spec.attach import AttachedInstance, AttachSpec, attached_instances
from harness.spec.prompts import SKELETON_PROMPTS, render_request
from harness.spec.settings import ATTACH_PROXY, ProxyChoice, RunSettings, ServedVllm
from harness.spec.topology import Role, ServingConfig, get_topology
from harness.testing.builders import cached_answer
from harness.testing.fake_vllm import fake_run_settings

pytestmark = [pytest.mark.process, pytest.mark.wall_clock_bound]

MODE_ENV = "FAKE_DEPLOYMENT_MODE"
REPORTED_WITHIN_S = 6.0  # two missed health checks a second apart, plus slack on 2 busy cores

FAKE_DEPLOYMENT = r"""
import hashlib, http.server, json, os, sys, time, urllib.request
role, port, peer_a, peer_b = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
hang = f"{role}:hang" in os.environ.get("FAKE_DEPLOYMENT_MODE", "")
finished = 0
print(f"fake {role} pid {os.getpid()} port {port}", flush=True)

def chat_answer(body):
    ids = [7 + i for i in range(int(body.get("max_tokens") or 4))]
    top = lambda t: {"token": f"token_id:{t}", "logprob": -0.5, "bytes": None}
    return {"id": "x", "object": "chat.completion", "created": 0, "model": body.get("model"),
            "prompt_token_ids": [1, 2, 3],
            "usage": {"prompt_tokens": 3, "completion_tokens": len(ids), "total_tokens": 3 + len(ids),
                      "prompt_tokens_details": {"cached_tokens": 0}},
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "fake"},
                         "finish_reason": "length", "token_ids": ids,
                         "logprobs": {"content": [{**top(t), "top_logprobs": [top(t)]} for t in ids]}}]}

def media_parts(body):
    return [p for m in body.get("messages") or [] for p in (m.get("content") or [])
            if isinstance(p, dict) and p.get("type") not in (None, "text")]

def post(url, body):
    request = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())

class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        if self.path == "/metrics":
            text = f'vllm:request_success_total{{finished_reason="length"}} {finished}\n'
            block = os.environ.get("FAKE_DEPLOYMENT_BLOCK_SIZE")
            # "encoder=4096,pd=1": the KV blocks each role's engine allocated
            kv_blocks = dict(pair.split("=") for pair in
                             os.environ.get("FAKE_DEPLOYMENT_KV_BLOCKS", "").split(",") if pair)
            labels = [f'block_size="{block}"'] if block else []
            labels += [f'num_gpu_blocks="{kv_blocks[role]}"'] if role in kv_blocks else []
            if role in os.environ.get("FAKE_DEPLOYMENT_KV_CONSUMERS", "").split(","):
                text += 'vllm:num_requests_kv_fetch_by_stage{engine="0",stage="in_progress"} 0.0\n'
            if labels and role != "proxy":  # vLLM's cache config, one label per field
                text += f'vllm:cache_config_info{{{",".join(labels)},cache_dtype="auto"}} 1.0\n'
            return self.reply(200, text.encode(), "text/plain")
        if self.path == "/version":
            return self.reply(200, b'{"version": "0.32.0+cpu"}')
        if self.path == "/v1/models" and role != "proxy":  # as vLLM's ModelCard says it
            max_len = int(os.environ.get("FAKE_DEPLOYMENT_MAX_MODEL_LEN", "4096"))
            card = {"id": "epd-model", "object": "model", "max_model_len": max_len}
            return self.reply(200, json.dumps({"object": "list", "data": [card]}).encode())
        self.reply(200 if self.path == "/health" and role != "proxy" else 404, b"{}")

    def do_POST(self):
        global finished
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        time.sleep(3600 if hang else 0)
        if role == "encoder":
            for part in media_parts(body):
                digest = hashlib.sha256(json.dumps(part, sort_keys=True).encode()).hexdigest()
                os.makedirs(os.path.join(peer_a, digest), exist_ok=True)
                with open(os.path.join(peer_a, digest, "encoder_cache.safetensors"), "wb") as f:
                    f.write(b"ec")
            answer = {"ec_transfer_params": {}}
        elif role == "pd":
            answer = chat_answer(body)
        else:
            try:
                if media_parts(body):
                    post(peer_a, {**body, "max_tokens": 1})
                answer = post(peer_b, body)
            except OSError as exc:
                return self.reply(502, json.dumps({"error": str(exc)}).encode())
        finished += 1
        self.reply(200, json.dumps(answer).encode())

    def reply(self, status, data, kind="application/json"):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass

server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
server.daemon_threads = True
server.serve_forever()
"""

PROMPTS = tuple(p for p in SKELETON_PROMPTS if p.name in ("text", "image"))
MODEL = "fake-model-dir"  # not a directory: the baseline key uses the name as it is


class Deployment:
    """Encoder, pd and proxy processes (each its own process group), and the attach spec."""

    def __init__(self, tmp_path: Path) -> None:
        self.ec_storage = tmp_path / "ec"
        self.ec_storage.mkdir()
        self.logs = tmp_path / "deployment"
        leases = reserve_ports(3)
        urls = [f"http://127.0.0.1:{lease.port}" for lease in leases]
        encoder_url, pd_url, proxy_url = urls
        peers = {
            "encoder": (str(self.ec_storage), "-"),
            "pd": ("-", "-"),
            "proxy": (encoder_url, pd_url),
        }
        script = tmp_path / "fake_deployment.py"
        script.write_text(FAKE_DEPLOYMENT)
        self.servers: dict[str, ManagedServer] = {}
        for (role, (peer_a, peer_b)), lease, url in zip(peers.items(), leases, urls):
            argv = [sys.executable, str(script), role, str(lease.port), peer_a, peer_b]
            command = ServerCommand(
                name=f"fake/{role}",
                argv=argv,
                health_url=f"{url}/{'metrics' if role == 'proxy' else 'health'}",
                log_path=log_path_for(self.logs, f"fake/{role}"),
            )
            self.servers[role] = ManagedServer(command, port_lease=lease)
        topology = get_topology("1E+1PD")
        self.spec = AttachSpec(
            source=tmp_path / "attach.json",
            topology=topology,
            proxy_url=proxy_url,
            instances=attached_instances(
                topology, [(Role.ENCODER, encoder_url), (Role.PREFILL_DECODE, pd_url)]
            ),
            ec_storage=self.ec_storage,
        )

    def start(self) -> None:
        for server in self.servers.values():
            server.start()
        for server in self.servers.values():
            server.wait_until_ready(20.0)

    def kill(self, role: str) -> None:
        """SIGKILL the role's process group, as the e2e scenario does to real vLLM."""
        pgid = self.servers[role].pgid
        assert pgid is not None
        os.killpg(pgid, signal.SIGKILL)

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop(grace_s=2.0)


@pytest.fixture
def deployment(tmp_path: Path, port_locks: Path) -> Iterator[Deployment]:
    fake = Deployment(tmp_path)
    try:
        fake.start()
        yield fake
    finally:
        fake.stop()


def attach_settings(tmp_path: Path, spec: AttachSpec, name: str) -> RunSettings:
    return RunSettings(
        serving=ServingConfig(model=MODEL),
        run_dir=tmp_path / name,
        vllm=ServedVllm("vllm", "0.32.0+cpu"),
        proxy=ProxyChoice(ATTACH_PROXY, origin=str(spec.source), attach=spec),
        request_timeout_s=30.0,
    )


def cached_baseline(tmp_path: Path, settings: RunSettings) -> BaselineCache:
    """The baseline's answers, as a normal run would have cached them: the fake pd's."""
    cache = BaselineCache(tmp_path / "baseline-cache")
    for prompt in PROMPTS:
        body = render_request(prompt, settings.serving.served_model_name)
        key = baseline_key(
            settings.vllm, settings.serving, MODEL, body, launch=BaselineLaunch.of(settings)
        )
        answer = {  # what the fake pd answers, token for token
            "prompt_token_ids": [1, 2, 3],
            "usage": {"prompt_tokens": 3, "completion_tokens": prompt.max_tokens},
            "choices": [
                {
                    "finish_reason": "length",
                    "token_ids": [7 + i for i in range(prompt.max_tokens)],
                    "message": {"content": "fake"},
                    "logprobs": {
                        "content": [
                            {
                                "token": f"token_id:{7 + i}",
                                "logprob": -0.5,
                                "top_logprobs": [{"token": f"token_id:{7 + i}", "logprob": -0.5}],
                            }
                            for i in range(prompt.max_tokens)
                        ]
                    },
                }
            ],
        }
        cache.store(key, Outcome(prompt.name, result=parse_chat_response(answer)), batched=True)
    return cache


def attach_sweep(tmp_path: Path, spec: AttachSpec, name: str) -> Sweep:
    settings = attach_settings(tmp_path, spec, name)
    return Sweep(
        SweepSpec(topologies=(spec.topology,), prompts=PROMPTS),
        settings,
        baseline_cache=cached_baseline(tmp_path, settings),
    )


def test_a_sweep_judges_the_attached_deployment_and_launches_nothing(
    tmp_path: Path, deployment: Deployment
) -> None:
    sweep = attach_sweep(tmp_path, deployment.spec, "attach-run")
    records = sweep.run_all().records
    assert [(r.prompt, r.reference, r.verdict) for r in records] == [
        ("text", "baseline", Verdict.MATCH),
        ("image", "baseline", Verdict.MATCH),
    ], format_verdict_table(records)
    image = records[1]
    encoder = image.guards["encoder_output"]
    assert encoder["ok"] and "1 EC file(s) written" in encoder["evidence"], encoder
    assert "the encoders finished 1 request(s)" in encoder["evidence"], encoder
    assert image.guards["consumer_embeds"]["not_checkable"], image.guards
    assert "NOT CHECKED" in format_verdict_table(records)
    # Nothing launched: no server's command file, no instance in the summary.
    run_dir = sweep.settings.run_dir
    assert not list(run_dir.rglob("*.cmd.json")), list(run_dir.rglob("*.cmd.json"))
    assert json.loads((run_dir / "summary.json").read_text())["run"]["instances"] == []
    proxy = json.loads((run_dir / "run.json").read_text())["proxy"]
    assert proxy["kind"] == "attach" and proxy["attach"]["proxy"] == deployment.spec.proxy_url
    assert sweep.run_info["attached_versions"] == {
        "1E+1PD/encoder0": "0.32.0+cpu",
        "1E+1PD/pd0": "0.32.0+cpu",
    }


def test_roles_the_metrics_cannot_tell_are_said_in_the_run_not_taken_as_verified(
    tmp_path: Path, deployment: Deployment, caplog
) -> None:
    """The fake's pages carry no cache config line: no instance's role can be told from them,
    and the run says so for each (run.json, and a warning) instead of judging silently as if
    the attach file's roles were verified."""
    sweep = attach_sweep(tmp_path, deployment.spec, "attach-unverified")
    with caplog.at_level("WARNING"):
        sweep.run_all()
    unverified = sweep.run_info["attached_roles_unverified"]
    assert unverified["1E+1PD/encoder0"] == [
        "its /metrics has no vllm:cache_config_info num_gpu_blocks"
    ], unverified
    assert "ec_consumer" in unverified["1E+1PD/pd0"][-1], unverified
    run = json.loads((sweep.settings.run_dir / "run.json").read_text())
    assert run["attached_roles_unverified"] == unverified
    assert "1E+1PD/encoder0's role (encoder) is not verified" in caplog.text, caplog.text


def test_a_scenarios_prompt_sent_to_an_attached_deployment_is_judged_as_declared(
    tmp_path: Path, deployment: Deployment
) -> None:
    """`run --attach FILE --prompt m-video-jpeg-frames` carries the failure its scenario
    declares (`SweepSpec.declared`) into the judging: here the fake deployment answers as the
    baseline does, so the declared MISMATCH does not hold, and the case fails saying so, as
    the scenario's own run would."""
    from harness.judge.records import DeclaredFailure

    settings = attach_settings(tmp_path, deployment.spec, "attach-declared")
    declared = DeclaredFailure(
        "MISMATCH", "generated tokens differ", "the upstream cause", "a-scenario"
    )
    sweep = Sweep(
        SweepSpec(
            topologies=(deployment.spec.topology,),
            prompts=PROMPTS,
            declared=(("image", declared),),
        ),
        settings,
        baseline_cache=cached_baseline(tmp_path, settings),
    )
    text, image = sweep.run_all().records
    assert (text.verdict, text.policy_passed) == (Verdict.MATCH, True), text.detail
    assert (image.verdict, image.policy_passed) == (Verdict.MATCH, False), image.detail
    assert "NOT the declared MISMATCH" in image.detail, image.detail


def test_an_instance_down_before_the_run_is_an_error_naming_it(
    tmp_path: Path, deployment: Deployment
) -> None:
    deployment.kill("pd")
    pd = deployment.spec.with_role(Role.PREFILL_DECODE)[0]
    started = time.monotonic()
    records = attach_sweep(tmp_path, deployment.spec, "attach-dead").run_all().records
    took = time.monotonic() - started
    assert [r.verdict for r in records] == [Verdict.ERROR, Verdict.ERROR], records
    named = f"1E+1PD/pd0 (pd, {pd.url}) is not serving: GET /health: connection refused"
    for record in records:
        assert record.detail == f"request failed: {named}", record.detail
        assert "no request was sent" in (record.error or ""), record.error
    assert took < REPORTED_WITHIN_S, f"took {took:.1f} s"


def test_an_instance_dying_while_the_proxy_holds_the_request_ends_it_within_seconds(
    tmp_path: Path, port_locks: Path, monkeypatch
) -> None:
    """The proxy holds every request (as a proxy retrying a dead backend might); the pd is
    killed meanwhile: the request ends when two health checks in a row miss, not at the
    30 s request timeout."""
    monkeypatch.setenv(MODE_ENV, "proxy:hang")
    fake = Deployment(tmp_path)
    try:
        fake.start()
        settings = attach_settings(tmp_path, fake.spec, "attach-mid")
        with AttachedSession(fake.spec, settings) as session:
            threading.Timer(1.0, fake.kill, args=("pd",)).start()
            outcome = session.send("text", render_request(PROMPTS[0], "epd-model"))
    finally:
        fake.stop()
    assert outcome.result is None and outcome.error, outcome
    pd = fake.spec.with_role(Role.PREFILL_DECODE)[0]
    assert outcome.error.startswith(f"1E+1PD/pd0 (pd, {pd.url}) is not serving"), outcome.error
    assert "while the request was in flight" in outcome.error, outcome.error
    assert outcome.seconds < 1.0 + REPORTED_WITHIN_S, f"{outcome.seconds:.1f} s"


def swept_deployment(tmp_path: Path, label: str) -> tuple[list, AttachedInstance]:
    """The records of a sweep of a fake deployment started for it (as the environment's
    FAKE_DEPLOYMENT_* cues say), and its encoder."""
    fake = Deployment(tmp_path)
    try:
        fake.start()
        records = attach_sweep(tmp_path, fake.spec, label).run_all().records
    finally:
        fake.stop()
    return records, fake.spec.with_role(Role.ENCODER)[0]


def test_a_deployment_serving_another_max_model_len_than_the_baseline_sends_nothing(
    tmp_path: Path, port_locks: Path, monkeypatch
) -> None:
    """The baseline is the harness's own, rendered with its --max-model-len; a deployment
    serving another one is not the comparison the verdicts would claim (a long prompt is
    refused by one and answered by the other). Its instances say theirs at /v1/models, so
    the run says so before any request, naming the instance, and judges nothing."""
    monkeypatch.setenv("FAKE_DEPLOYMENT_MAX_MODEL_LEN", "2048")
    records, encoder = swept_deployment(tmp_path, "attach-maxlen")
    assert [r.verdict for r in records] == [Verdict.ERROR, Verdict.ERROR], records
    first = (
        f"request failed: 1E+1PD/encoder0 (encoder, {encoder.url}) serves epd-model with "
        "max_model_len 2048, the baseline 4096"
    )
    assert records[0].detail.startswith(first), records[0].detail
    assert "no request was sent" in (records[0].error or ""), records[0].error


def test_a_deployment_with_another_block_size_sends_nothing(
    tmp_path: Path, port_locks: Path, monkeypatch
) -> None:
    """Every instance the harness launches, its baseline's too, serves blocks of 32, and the
    KV guard's block-aligned rule is computed with them: a D with blocks of 64 moves
    align_down(120, 64) = 64 of a 121-token prompt where the rule asks 96, so such cases
    failed `kv_transfer` for the harness's reason. vLLM says its block size at /metrics
    (`vllm:cache_config_info`); here the encoder is the first to say another."""
    monkeypatch.setenv("FAKE_DEPLOYMENT_BLOCK_SIZE", "64")
    records, encoder = swept_deployment(tmp_path, "attach-block")
    assert [r.verdict for r in records] == [Verdict.ERROR, Verdict.ERROR], records
    first = (
        f"request failed: 1E+1PD/encoder0 (encoder, {encoder.url}) serves with block_size 64, "
        "the harness's 32"
    )
    assert records[0].detail.startswith(first), records[0].detail


@pytest.mark.parametrize(
    ("kv_blocks", "first"),
    [
        (  # a plain vLLM (or a PD) listed as the encoder
            "encoder=4096,pd=4096",
            "1E+1PD/encoder0 (encoder, {encoder}) is declared an encoder, but its /metrics "
            "reports a KV cache of 4096 blocks",
        ),
        (  # encoder and PD swapped: the PD's URL is an encode-only instance
            "encoder=1,pd=1",
            "1E+1PD/pd0 (pd, {pd}) is declared a pd, but its /metrics reports a KV cache of "
            "1 block",
        ),
    ],
)
def test_an_instance_whose_metrics_tell_another_role_sends_nothing(
    tmp_path: Path, port_locks: Path, monkeypatch, kv_blocks: str, first: str
) -> None:
    """An encoder allocates no KV cache (vLLM gives an EC-producer-only instance an empty KV
    cache spec: 1 block, the null block), and every instance that runs the language model holds
    at least max_model_len tokens of it; `vllm:cache_config_info` says num_gpu_blocks. A URL
    listed under the wrong role would be judged by the other role's evidence (the encoder
    guard reading a plain vLLM's request counter), so the run says so before any request."""
    monkeypatch.setenv("FAKE_DEPLOYMENT_BLOCK_SIZE", "32")
    monkeypatch.setenv("FAKE_DEPLOYMENT_KV_BLOCKS", kv_blocks)
    fake = Deployment(tmp_path)
    urls = {i.role: i.url for i in fake.spec.instances}
    try:
        fake.start()
        records = attach_sweep(tmp_path, fake.spec, "attach-role").run_all().records
    finally:
        fake.stop()
    assert [r.verdict for r in records] == [Verdict.ERROR, Verdict.ERROR], records
    expected = "request failed: " + first.format(
        encoder=urls[Role.ENCODER], pd=urls[Role.PREFILL_DECODE]
    )
    assert records[0].detail.startswith(expected), records[0].detail
    assert "no request was sent" in (records[0].error or ""), records[0].error


@pytest.mark.parametrize("kv_consumers", ["", "pd"])
def test_a_decode_that_is_no_kv_consumer_is_refused_where_vllm_tells(
    tmp_path: Path, port_locks: Path, monkeypatch, kv_consumers: str
) -> None:
    """vLLM 0.32 registers `vllm:num_requests_kv_fetch_by_stage` only on a KV consumer (kv_role
    kv_consumer or kv_both). P and D swapped in the attach file (or a PD listed as D) would
    have the KV guard read P's counters as D's; the declared D without the gauge says so. Here
    the fake's encoder and pd stand as P and D of a 1P+1D (both run no language model in the
    fake: no cache config line, so only the KV-consumer rule speaks)."""
    monkeypatch.setenv("FAKE_DEPLOYMENT_KV_CONSUMERS", kv_consumers)
    monkeypatch.setenv("FAKE_DEPLOYMENT_BLOCK_SIZE", "32")  # vLLM's stat logger is there
    fake = Deployment(tmp_path)
    topology = get_topology("1P+1D")
    urls = [i.url for i in fake.spec.instances]
    spec = AttachSpec(
        source=tmp_path / "attach.json",
        topology=topology,
        proxy_url=fake.spec.proxy_url,
        instances=attached_instances(topology, [(Role.PREFILL, urls[0]), (Role.DECODE, urls[1])]),
    )
    session = AttachedSession(spec, attach_settings(tmp_path, spec, "attach-kv-role"))
    try:
        fake.start()
        if kv_consumers:
            session.open()  # the declared D reports itself a KV consumer: nothing to say
            session.close()
            return
        with pytest.raises(AttachedMismatch) as raised:
            session.open()
    finally:
        fake.stop()
    assert str(raised.value).startswith(
        f"1P+1D/decode0 (decode, {urls[1]}) is declared a decode, but its /metrics has no "
        "vllm:num_requests_kv_fetch_by_stage"
    ), raised.value


def test_a_proxy_that_is_gone_is_named(tmp_path: Path, deployment: Deployment) -> None:
    deployment.kill("proxy")
    records = attach_sweep(tmp_path, deployment.spec, "attach-noproxy").run_all().records
    url = deployment.spec.proxy_url
    assert all(r.verdict is Verdict.ERROR for r in records), records
    expected = f"request failed: the proxy {url} is not reachable: connection refused"
    assert records[0].detail == expected, records[0].detail


def test_keep_up_writes_an_attach_file_that_reaches_the_kept_up_topology(
    tmp_path: Path, port_locks: Path, fake_vllm: Path, monkeypatch, caplog
) -> None:
    """`repro --keep-up` (harness.run.repro.keep_up) writes attach.json into its run directory:
    the proxy in front, each instance's own URL (not its tap's), the EC storage; an attached
    session opens on it while the topology is kept up."""
    from harness.preflight.attach import load_attach_file
    from harness.run import repro

    settings = fake_run_settings(
        tmp_path, fake_vllm, ServingConfig(model=MODEL), run_dir=tmp_path / "repro"
    )
    sweep = Sweep(SweepSpec(topologies=(get_topology("1E+1PD"),), prompts=()), settings)
    seen: dict[str, object] = {}

    def while_kept_up() -> None:  # stands in for serve_until_death: the topology serves
        spec = load_attach_file(str(settings.run_dir / "attach.json"), "example")
        seen["spec"] = spec
        with AttachedSession(spec, settings) as session:
            seen["versions"] = session.versions  # opened: every instance answered /health
        commands = sorted((settings.run_dir / "1E-1PD").glob("*.cmd.json"))
        argvs = [json.loads(c.read_text())["argv"] for c in commands]
        seen["ports"] = [argv[argv.index("--port") + 1] for argv in argvs]

    monkeypatch.setattr(repro, "serve_until_death", lambda session: while_kept_up())
    with caplog.at_level("INFO", logger="harness"):
        try:
            repro.keep_up(sweep, "1E+1PD")
        finally:
            sweep.pool.close()
    spec = seen["spec"]
    assert isinstance(spec, AttachSpec) and spec.topology.name == "1E+1PD"
    ports = [i.url.rsplit(":", 1)[1] for i in spec.instances]
    assert ports == seen["ports"], (ports, seen["ports"])  # the instances', not their taps'
    assert spec.ec_storage == settings.run_dir / "1E-1PD" / "storage" / "ec"
    assert seen["versions"] == {"1E+1PD/encoder0": "unknown", "1E+1PD/pd0": "unknown"}
    attach_file = settings.run_dir / "attach.json"
    assert f"attach file: {attach_file} (judge it: epd-harness run --attach" in caplog.text


def test_keep_up_of_a_planted_fault_serves_a_topology_started_again_without_it(
    tmp_path: Path, port_locks: Path, fake_vllm: Path, monkeypatch, caplog
) -> None:
    """`repro --keep-up` of a `--plant-fault ec-noise:0.05` bundle kept serving the instances the
    fault had been planted on; unplanted, it still answered MISMATCH at the same token to
    `run --attach` (real vLLM 0.32.0): the noised EC file stayed in the storage, and with it
    removed the encoder and the consumer still served the noised embeddings from their caches.
    What stays up must be started again, on fresh storage, and say why."""
    from harness.run import repro

    settings = fake_run_settings(
        tmp_path, fake_vllm, ServingConfig(model=MODEL), run_dir=tmp_path / "repro"
    )
    spec = SweepSpec(topologies=(get_topology("1E+1PD"),), prompts=(), fault="ec-noise:0.05")
    sweep = Sweep(spec, settings)
    seen: dict[str, object] = {}
    try:
        first = sweep.pool.session(get_topology("1E+1PD"))  # the session the case ran on
        altered = first.ec_storage / "epd-noised" / "encoder_cache.safetensors"
        altered.parent.mkdir(parents=True)
        altered.write_bytes(b"noised by the planted fault")

        def while_kept_up() -> None:
            kept = sweep.pool.session(get_topology("1E+1PD"))
            seen["fresh"] = getattr(kept, "base", kept) is not getattr(first, "base", first)
            seen["starts"] = len(sweep.pool.starts)
            seen["altered_left"] = altered.exists()

        monkeypatch.setattr(repro, "serve_until_death", lambda session: while_kept_up())
        with caplog.at_level("INFO", logger="harness"):
            repro.keep_up(sweep, "1E+1PD")
    finally:
        sweep.pool.close()
    assert seen["altered_left"] is False, "the planted fault's file is still served"
    assert seen["fresh"] is True and seen["starts"] == 2, seen
    assert "started again without the planted fault ec-noise:0.05" in caplog.text, caplog.text


def test_keep_up_stops_the_sessions_it_does_not_list(
    tmp_path: Path, port_locks: Path, fake_vllm: Path, monkeypatch, caplog
) -> None:
    """`repro --keep-up` (real vLLM, 1E+1PD) kept the baseline repro had started serving beside
    the topology it listed, unnamed, until Ctrl-C: a vLLM instance (2.4 GB RSS each for P and D
    in a load run here) that nobody was told of. Only the kept topology stays up."""
    from harness.cli.main import Progress
    from harness.run import repro
    from harness.run.pool import TopologyPool

    settings = fake_run_settings(
        tmp_path, fake_vllm, ServingConfig(model=MODEL), run_dir=tmp_path / "repro"
    )
    progress = Progress()  # what an interruption of the kept-up topology will say
    pool = TopologyPool(settings, progress.on_event)
    spec = SweepSpec(topologies=(get_topology("1E+1PD"),), prompts=())
    sweep = Sweep(spec, settings, pool=pool)
    seen: dict[str, object] = {}
    try:
        sweep.pool.session(get_topology("baseline"))  # as the repro's baseline answered
        sweep.pool.session(get_topology("1E+1PD"))

        def while_kept_up() -> None:
            seen["running"] = sorted(key.topology for key in sweep.pool.running())
            seen["interrupted"] = progress.describe()

        monkeypatch.setattr(repro, "serve_until_death", lambda session: while_kept_up())
        with caplog.at_level("INFO", logger="harness"):
            repro.keep_up(sweep, "1E+1PD", settled=progress.settled)
    finally:
        sweep.pool.close()
    assert seen["running"] == ["1E+1PD"], seen
    # The baseline's stop was keep-up's, not an interruption's (real vLLM: SIGTERM then said
    # "interrupted ... while baseline/baseline0 was ready", stopped 60 s before).
    assert seen["interrupted"] == "while 1E+1PD/encoder0 was ready, 1E+1PD/pd0 was ready"


def test_keep_up_says_at_once_that_an_instance_of_the_kept_topology_died(
    tmp_path: Path, port_locks: Path, fake_vllm: Path
) -> None:
    """Found on real vLLM: `repro --keep-up` on Ray kept 1E+1P+1D up for a fuzz of the attached
    deployment, a shrink trial (two images, no text) crashed D, and the kept-up terminal said
    nothing: it waited on signal.pause() until Ctrl-C. Keep-up ends as soon as an instance
    dies, returning its report (name, exit, log tail) for the command to print."""
    from harness.run import repro

    settings = fake_run_settings(
        tmp_path, fake_vllm, ServingConfig(model=MODEL), run_dir=tmp_path / "repro"
    )
    sweep = Sweep(SweepSpec(topologies=(get_topology("1E+1PD"),), prompts=()), settings)
    returned: list[str | None] = []
    try:
        pd = sweep.pool.session(get_topology("1E+1PD")).server(Role.PREFILL_DECODE)
        kept = threading.Thread(
            target=lambda: returned.append(repro.keep_up(sweep, "1E+1PD")), daemon=True
        )
        kept.start()
        # Once the attach file is written keep-up serves (a death before it is the case's,
        # whose topology keep-up starts again).
        attach_file = settings.run_dir / "attach.json"
        while not attach_file.exists() and kept.is_alive():
            time.sleep(0.05)
        os.killpg(pd.pid, signal.SIGKILL)
        kept.join(60)  # a bound on a hang (keep-up waiting for a signal), not a speed
    finally:
        sweep.pool.close()
    assert returned, "keep-up went on waiting after its instance died"
    died = returned[0]
    assert died is not None and died.startswith("instance 1E+1PD/pd0 exited with code -9"), died


def test_a_metrics_page_cut_off_mid_answer_is_no_crash(tmp_path: Path) -> None:
    """A D dying while it writes /metrics cuts the page short (http.client.IncompleteRead, no
    OSError): the request's outcome says what happened; the run goes on (found in review: the
    exception left AttachedSession.send and ended the whole run)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                request = conn.recv(65536)
                if request.startswith(b"GET /metrics"):  # promises 1000 bytes, sends 3
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\nvll")
                else:
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")

    threading.Thread(target=serve, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    topology = get_topology("1P+1D")
    spec = AttachSpec(
        tmp_path / "attach.json",
        topology,
        url,
        attached_instances(topology, [(Role.PREFILL, url), (Role.DECODE, url)]),
    )

    class Client:
        def send(self, body: dict, request_id: str) -> ChatReply:
            return ChatReply(cached_answer(89, 64))

        def close(self) -> None:
            pass

    session = AttachedSession(spec, attach_settings(tmp_path, spec, "cut"))
    session._client = Client()  # type: ignore[assignment]
    try:
        outcome = session.send("text", {"messages": [{"role": "user", "content": "hi"}]})
    finally:
        listener.close()
    assert outcome.result is not None and outcome.kv_counters is None  # D's counters unread


def test_an_attached_golden_run_judges_the_deployment_by_a_releases_goldens_end_to_end(
    tmp_path: Path, port_locks: Path, fake_vllm: Path, epd_cli
) -> None:
    """`run --attach FILE --golden VERSION`, the whole command: nothing starts on this host,
    the goldens stand in for the baseline. Tested only in pieces with the sweep stubbed
    (tests/test_golden_preflight.py), the run failed on real vLLM all the same: with no device
    (an attached --golden run has none), the goldens' lookup placed the baseline on the run's
    devices, "baseline: no cores to place it on" (exit 2). The deployment is fake vLLM behind
    the harness's proxy, as `repro --keep-up` leaves one; the goldens are filed as a run files
    them, by a first run of it without --golden whose baseline starts here."""
    from harness.environment import cache_dir
    from harness.preflight.model import resolve_model
    from harness.serve.attached import write_attach_file

    model = resolve_model(None, None, cache_dir())  # the CLI's default: served by both runs
    deployed = fake_run_settings(
        tmp_path, fake_vllm, ServingConfig(model=str(model)), run_dir=tmp_path / "deployed"
    )
    topology = get_topology("1E+1PD")
    deployment = Sweep(SweepSpec(topologies=(topology,), prompts=()), deployed)
    cache = tmp_path / "cache" / "baseline"
    run_dir = tmp_path / "golden-run"
    try:
        attach_file = tmp_path / "attach.json"
        write_attach_file(deployment.pool.session(topology), attach_file)
        asked = ("--vllm", fake_vllm, "--attach", attach_file, "--baseline-cache", cache)
        asked += ("--prompt", "text,image")
        code, out, err = epd_cli("run", *asked, "--run-dir", tmp_path / "filing-run")
        assert code == 0, out + err
        goldens = sorted((cache.parent / "goldens").rglob("*.json"))
        assert len(goldens) == 2, goldens  # text's and image's, of the served release
        release = goldens[0].stem.split("+torch-")[0]
        code, out, err = epd_cli("run", *asked, "--golden", release, "--run-dir", run_dir)
    finally:
        deployment.pool.close()
    assert code == 0, out + err
    summary = json.loads((run_dir / "summary.json").read_text())
    judged = [(c["prompt"], c["reference"], c["verdict"]) for c in summary["cases"]]
    assert judged == [
        ("text", f"golden-{release}", "MATCH"),
        ("image", f"golden-{release}", "MATCH"),
    ], judged
    # Nothing started here: no baseline's log or command, no instance in the summary.
    assert not (run_dir / "baseline").exists(), sorted(run_dir.iterdir())
    assert not list(run_dir.rglob("*.cmd.json")), list(run_dir.rglob("*.cmd.json"))
    assert summary["run"]["instances"] == []
    run = json.loads((run_dir / "run.json").read_text())
    assert run["devices"] == [], run["devices"]
    assert run["devices_used"]["count"] == 0, run["devices_used"]
