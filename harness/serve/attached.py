"""An EPD deployment the harness did not start (`--proxy attach`): its proxy, its instances'
liveness, and the evidence that can be read from outside.

`AttachedSession` stands where a `TopologySession` stands in a sweep, but launches nothing,
holds no port and stops nothing. What it gives up is the taps: the deployment's proxy talks to
its instances directly, so nothing sits where the harness could see what each instance was
sent and answered. What it can still see, per request:

- whether every instance answers `GET /health`: before the first request (a deployment that
  is not serving is an ERROR naming the instance, not a hang), before each request, and every
  second while one is in flight (an instance that stops answering twice in a row ends the
  request within seconds instead of at the request timeout);
- each instance's `/metrics`: the requests the encoders finished, and D's KV counters (the
  NIXL rule of the KV guard, `harness.serve.kv_metrics`);
- the EC storage, when the attach file names a directory this machine can read: which
  `<mm_hash>/encoder_cache.safetensors` files appeared or were rewritten during the request;
- the proxy's answer: the token ids, and D's `cached_tokens` as the proxy passed it on.

Which guards that evidence can decide, and which it cannot, is `harness.judge.guards`'s call
(`attached_guards`); the ones it cannot are reported as not checkable, never as held.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from harness.errors import EXIT_FAILED, HarnessError
from harness.files import write_json_atomic
from harness.outcomes.attached import AttachedEvidence
from harness.outcomes.outcome import Outcome, ServedTopology
from harness.serve.attached_roles import cache_config_labels, read_role
from harness.serve.client import ChatClient, ChatReply
from harness.serve.http_direct import DIRECT_OPENER
from harness.serve.in_flight import InFlightWindows
from harness.serve.kv_metrics import KvCounters, metrics_page, read_counters
from harness.serve.proxy import ProxyFaults
from harness.serve.proxy_protocol import MediaRef, collect_media
from harness.serve.session import TopologySession, safe_name, served_topology
from harness.spec.attach import AttachedInstance, AttachSpec, attached_instances
from harness.spec.connectors import EC_CACHE_FILE, kv_connector_for_class
from harness.spec.settings import RunSettings
from harness.spec.topology import Role, ServingConfig

# vLLM answers /health in milliseconds; a remote deployment gets some slack for the network.
HEALTH_TIMEOUT_S = 3.0
WATCH_INTERVAL_S = 1.0  # how often every instance's /health is asked while a request runs
MISSES_BEFORE_DOWN = 2  # consecutive failed checks that end a request in flight
VERSION_TIMEOUT_S = 5.0
# After a failed request: how long an engine may still be failing before its /health says so.
# A dead engine's server answers 503 at once, and an attached instance is down from then on
# (its exit is not waited for, as a launched one's is): a short grace.
DEATH_GRACE_S = 3.0


class AttachedDown(HarnessError):
    """An attached instance (or the deployment's proxy) is not serving; the message names it
    with its role and URL. A sweep or a load makes it their cases' ERROR; where it reaches the
    command line (a fuzz run's start), it is that one line, exit 1 (found in review)."""

    exit_code = EXIT_FAILED


class AttachedMismatch(AttachedDown):
    """An attached instance serves the model otherwise than the harness's baseline does (its
    name, max_model_len or block size), or reports another role than the attach file gives
    it: the verdicts would compare two different servings, or judge by the wrong evidence.
    An AttachedDown to every caller that ends on one (a load, a fuzz run): nothing is sent."""


def health_problem(url: str, timeout_s: float = HEALTH_TIMEOUT_S) -> str | None:
    """None when `GET url` answers 2xx; otherwise what went wrong, in a few words."""
    try:
        with DIRECT_OPENER.open(url, timeout=timeout_s) as reply:
            return None if 200 <= reply.status < 300 else f"HTTP {reply.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except urllib.error.URLError as exc:
        return describe_network_error(exc.reason)
    except (OSError, http.client.HTTPException) as exc:
        return describe_network_error(exc)


def answers_http(url: str, timeout_s: float = HEALTH_TIMEOUT_S) -> str | None:
    """None when anything at `url` answers HTTP, whatever the status (a proxy need not serve
    /health: the toy proxy of vLLM's NIXL tests serves /healthcheck)."""
    problem = health_problem(url, timeout_s)
    return None if problem is None or problem.startswith("HTTP ") else problem


def describe_network_error(reason: object) -> str:
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    if isinstance(reason, (socket.timeout, TimeoutError)):
        return "no answer (timed out)"
    return str(reason) or type(reason).__name__


def read_version(url: str) -> str:
    """The vLLM version an instance reports at /version ("unknown" if it does not say)."""
    try:
        with DIRECT_OPENER.open(f"{url}/version", timeout=VERSION_TIMEOUT_S) as reply:
            return str(json.loads(reply.read()).get("version") or "unknown")
    except (OSError, ValueError, AttributeError, http.client.HTTPException):
        return "unknown"


def model_cards(url: str) -> list[dict[str, Any]] | None:
    """The model cards an instance lists at /v1/models (None: it does not say)."""
    try:
        with DIRECT_OPENER.open(f"{url}/v1/models", timeout=VERSION_TIMEOUT_S) as reply:
            cards = json.loads(reply.read()).get("data")
    except (OSError, ValueError, AttributeError, http.client.HTTPException):
        return None
    return [c for c in cards if isinstance(c, dict)] if isinstance(cards, list) else None


def served_block_size(page: str | None) -> int | None:
    """The KV block size a /metrics `page` reports, where vLLM labels
    `vllm:cache_config_info` with every cache setting (None: it does not say)."""
    block_size = cache_config_labels(page or "").get("block_size", "")
    return int(block_size) if block_size.isdigit() else None


def serving_mismatch(
    instance: AttachedInstance, serving: ServingConfig, page: str | None
) -> str | None:
    """What of the serving an instance reports differs from the baseline's (None: nothing, or
    it does not say): its /v1/models cards carry the model's name and max_model_len, its
    /metrics `page` the block size (a numerics flag, and the KV guard's block-aligned rule)."""
    block_size = served_block_size(page)
    if block_size is not None and block_size != serving.block_size:
        return (
            f"{instance.describe()} serves with block_size {block_size}, the harness's "
            f"{serving.block_size} (its baseline's, and the KV guard's rule): serve it with "
            f"--block-size {serving.block_size}"
        )
    served_model_name, max_model_len = serving.served_model_name, serving.max_model_len
    cards = model_cards(instance.url)
    if not cards:
        return None
    card = next((c for c in cards if c.get("id") == served_model_name), None)
    if card is None:
        names = ", ".join(str(c.get("id")) for c in cards)
        return (
            f"{instance.describe()} serves no model named {served_model_name} (it serves "
            f"{names}): serve it with --served-model-name {served_model_name}, the name the "
            "harness's requests and baseline use"
        )
    theirs = card.get("max_model_len")
    if isinstance(theirs, int) and theirs != max_model_len:
        return (
            f"{instance.describe()} serves {served_model_name} with max_model_len {theirs}, "
            f"the baseline {max_model_len}: run with --max-model-len {theirs}"
        )
    return None


def ec_files(storage: Path) -> dict[str, int]:
    """<mm_hash> -> modification time (ns) of every EC file in the storage."""
    found: dict[str, int] = {}
    for path in storage.glob(f"*/{EC_CACHE_FILE}"):
        try:
            found[path.parent.name] = path.stat().st_mtime_ns
        except FileNotFoundError:
            continue
    return found


class AttachedSession:
    """Requests through an attached deployment's proxy, with its instances watched."""

    def __init__(self, spec: AttachSpec, settings: RunSettings):
        self.spec = spec
        self.topology = spec.topology
        self.settings = settings
        self.faults = ProxyFaults()  # nothing is planted: the preflight refuses --plant-fault
        self.entry_url = spec.proxy_url
        self.versions: dict[str, str] = {}  # instance name -> its /version
        # instance name -> what of its declared role its /metrics cannot tell (open() fills it)
        self.roles_unverified: dict[str, list[str]] = {}
        self._client: ChatClient | None = None
        # A load sends concurrently: a window another request shared holds EC files and
        # encoder counts that are not one request's alone.
        self._in_flight = InFlightWindows()

    @property
    def ec_storage(self) -> Path | None:
        return self.spec.ec_storage

    @property
    def kv_storage(self) -> Path | None:
        return None  # D's own reports are the KV evidence (harness.judge.guards)

    @property
    def served(self) -> ServedTopology:
        """What the guards need to know of the deployment."""
        return served_topology(self.topology, self.ec_storage, self.settings)

    # -- lifecycle -----------------------------------------------------------------------------

    def __enter__(self) -> AttachedSession:
        self.open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def open(self) -> None:
        """Every instance must answer /health and the proxy must answer at all; otherwise
        AttachedDown, naming the first that does not. Every instance must serve the
        baseline's model name, max_model_len and block size where it reports them, and not
        report another role than the attach file gives it (`harness.serve.attached_roles`);
        otherwise AttachedMismatch (found in review). Reads each instance's version."""
        down = self.first_down()
        if down is not None:
            raise AttachedDown(down)
        problem = answers_http(f"{self.entry_url}/health")
        if problem is not None:
            raise AttachedDown(f"the proxy {self.entry_url} is not reachable: {problem}")
        pages = {i.name: metrics_page(i.url) for i in self.spec.instances}  # read once
        for instance in self.spec.instances:
            mismatch = serving_mismatch(instance, self.settings.serving, pages[instance.name])
            if mismatch is not None:
                raise AttachedMismatch(mismatch)
        self.versions = {i.name: read_version(i.url) for i in self.spec.instances}
        for instance in self.spec.instances:
            reading = read_role(
                instance,
                pages[instance.name],
                self.versions[instance.name],
                self.settings.serving.max_model_len,
                self.topology.has_ec_transfer,
            )
            if reading.mismatch is not None:
                raise AttachedMismatch(reading.mismatch)
            if reading.unverified:
                self.roles_unverified[instance.name] = reading.unverified
        self._client = ChatClient(self.entry_url, timeout_s=self.settings.request_timeout_s)

    def close(self) -> None:
        """Close the client; the deployment is not the harness's to stop."""
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def first_down(self) -> str | None:
        """The first instance that does not answer /health, named with its role and URL."""
        for instance in self.spec.instances:
            problem = health_problem(f"{instance.url}/health")
            if problem is not None:
                return f"{instance.describe()} is not serving: GET /health: {problem}"
        return None

    # -- requests ------------------------------------------------------------------------------

    def send(self, prompt: str, body: dict[str, Any]) -> Outcome:
        """One request through the proxy; every failure becomes an Outcome whose error's first
        line names the instance that is down, when one is."""
        assert self._client is not None, "open() first"
        media = collect_media(body)
        outcome = Outcome(prompt=prompt, media_count=len(media), sent_at=time.time())
        started = time.monotonic()
        down = self.first_down()
        if down is not None:
            outcome.error = down
            outcome.seconds = time.monotonic() - started
            return outcome
        request_id = f"{safe_name(self.topology.name)}-{prompt}-{uuid.uuid4().hex[:8]}"
        self._in_flight.begin(request_id)
        try:
            self._send_counted(outcome, media, body, request_id, started)
        finally:
            shared = self._in_flight.end(request_id)
        outcome.others_in_flight = shared
        if outcome.attached is not None:
            outcome.attached.shared = shared
        return outcome

    def _send_counted(
        self,
        outcome: Outcome,
        media: list[MediaRef],
        body: dict[str, Any],
        request_id: str,
        started: float,
    ) -> None:
        """The request, and what it left outside the deployment (`outcome.attached`)."""
        counters_before = self.decode_counters()
        encoders_before = self._encoder_requests()
        storage = self.spec.ec_storage
        files_before = ec_files(storage) if storage is not None else {}
        try:
            reply = self._chat_watched(body, request_id)
            outcome.result, outcome.stream = reply.result, reply.stream
        except AttachedDown as exc:
            outcome.error = str(exc)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, none is raised
            outcome.stream = getattr(exc, "record", None)  # a stream that failed: as read
            outcome.error = f"{type(exc).__name__}: {exc}"
            cause = self._cause_of_failure()
            outcome.error = f"{cause}\n{outcome.error}" if cause else outcome.error
        outcome.seconds = time.monotonic() - started
        if outcome.result is None:
            return
        if counters_before is not None:
            counters_after = self.decode_counters()
            if counters_after is not None:
                outcome.kv_counters = counters_after.minus(counters_before)
        encoders_after = self._encoder_requests()
        files_after = ec_files(storage) if storage is not None else {}
        outcome.attached = AttachedEvidence(
            media_items=len({ref.uuid for ref in media}),
            ec_storage=str(storage) if storage is not None else None,
            ec_files_before=len(files_before),
            ec_files_written=sorted(
                h for h, mtime in files_after.items() if files_before.get(h) != mtime
            ),
            encoder_requests=None
            if encoders_before is None or encoders_after is None
            else encoders_after - encoders_before,
        )

    def decode_counters(self) -> KvCounters | None:
        """D's KV counters now (None: the deployment has no D, or its /metrics is unreadable)."""
        decodes = self.spec.with_role(Role.DECODE)
        return read_counters(decodes[0].url) if decodes else None

    def _chat_watched(self, body: dict[str, Any], request_id: str) -> ChatReply:
        """The request runs on a thread while every instance's /health is asked each second:
        an instance that dies mid-request ends it within seconds (AttachedDown), not at the
        request timeout. An abandoned request ends on its own timeout or when the session
        closes its client."""
        client = self._client
        assert client is not None
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["result"] = client.send(body, request_id=request_id)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                box["error"] = exc

        thread = threading.Thread(target=run, name=f"attach-{request_id}", daemon=True)
        thread.start()
        misses = 0
        while True:
            thread.join(WATCH_INTERVAL_S)
            if not thread.is_alive():
                break
            down = self.first_down()
            misses = misses + 1 if down else 0
            if down and misses >= MISSES_BEFORE_DOWN:
                raise AttachedDown(f"{down} (while the request was in flight)")
        if "error" in box:
            raise box["error"]
        return box["result"]

    def _cause_of_failure(self) -> str | None:
        """After a failed request: the instance that is down (an engine may still be dying,
        so it gets DEATH_GRACE_S), else the proxy if it is gone."""
        deadline = time.monotonic() + DEATH_GRACE_S
        while True:
            down = self.first_down()
            if down is not None or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        if down is not None:
            return down
        problem = answers_http(f"{self.entry_url}/health")
        if problem is not None:
            return f"the proxy {self.entry_url} is not reachable: {problem}"
        return None

    def _encoder_requests(self) -> float | None:
        """Requests the encoders have finished so far (summed), or None if any /metrics
        cannot be read or holds no finished-request counter: vLLM shows it from start-up, so
        a page without it (a sidecar's, another naming) shows nothing, not 0 (found in review)."""
        total = 0.0
        for encoder in self.spec.with_role(Role.ENCODER):
            counters = read_counters(encoder.url)
            if counters is None or "finished_requests" not in counters.values:
                return None
            total += counters.values["finished_requests"]
        return total


def attach_spec_for(session: TopologySession, source: Path) -> AttachSpec:
    """The attach file of a topology the harness keeps serving (`repro --keep-up`): its entry
    point, its instances' own URLs (not their taps'), its EC storage and KV connector."""
    connector = kv_connector_for_class(session.settings.serving.kv_connector)
    return AttachSpec(
        source=source,
        topology=session.topology,
        proxy_url=session.entry_url,
        instances=attached_instances(
            session.topology, [(spec.role, spec.url) for spec in session.instances]
        ),
        ec_storage=session.ec_storage,
        # An unknown class (through extra_args) is held to the block-aligned rule, as ever.
        kv_connector=connector.name if connector is not None else "example",
    )


def write_attach_file(session: TopologySession, path: Path) -> AttachSpec:
    """Write the attach file of a running session to `path`; returns what it says."""
    spec = attach_spec_for(session, path)
    write_json_atomic(path, spec.to_json())
    return spec
