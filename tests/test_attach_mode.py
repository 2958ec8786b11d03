"""Attach mode without servers: the attach file read into an AttachSpec, the guards an attached
deployment allows (the rest reported as not checkable, never as held), and how reports show
them. Malformed attach files and refused flags are in tests/test_bad_input.py (the catalogue).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from harness.errors import BadInput
from harness.judge.guards import GuardResult, attached_guards, not_checkable, transfer_guards
from harness.judge.records import Verdict
from harness.outcomes.attached import AttachedEvidence
from harness.outcomes.outcome import Outcome
from harness.preflight.attach import load_attach_file
from harness.report.html import _guards
from harness.report.text import format_failure, format_verdict_table
from harness.run.scenarios import Scenario, SendMode, attached_prompt, get_scenario
from harness.serve import attached
from harness.serve.attached import AttachedSession
from harness.serve.client import ChatReply
from harness.serve.kv_metrics import KvCounters
from harness.spec.attach import AttachSpec, attached_instances
from harness.spec.connectors import EC_CACHE_FILE, KvRule
from harness.spec.prompts import SKELETON_PROMPTS, PromptSpec, TextPart, render_request
from harness.spec.settings import ATTACH_PROXY, ProxyChoice
from harness.spec.topology import Role, ServingConfig, get_topology
from harness.testing.builders import cached_answer
from harness.testing.fake_vllm import fake_run_settings
from harness.testing.judging import judged

pytestmark = pytest.mark.unit


def write(tmp_path: Path, document: object, name: str = "attach.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(document) if name.endswith(".json") else str(document))
    return path


def test_a_file_becomes_a_spec_with_the_harness_names(tmp_path: Path) -> None:
    (tmp_path / "ec").mkdir()
    path = write(
        tmp_path,
        {
            "proxy": "http://10.0.0.5:8000/",
            "instances": [
                {"role": "decode", "url": "http://10.0.0.8:8000"},
                {"role": "encoder", "url": "http://10.0.0.6:8000"},
                {"role": "prefill", "url": "https://10.0.0.7:443"},
            ],
            "ec_storage": "ec",  # relative to the file
            "kv_connector": "nixl",
        },
    )
    spec = load_attach_file(str(path), "example")
    assert spec.topology.name == "1E+1P+1D"  # from the roles, in any order
    assert spec.proxy_url == "http://10.0.0.5:8000"  # the trailing slash dropped
    assert [(i.name, i.role, i.url) for i in spec.instances] == [
        ("1E+1P+1D/decode0", Role.DECODE, "http://10.0.0.8:8000"),
        ("1E+1P+1D/encoder0", Role.ENCODER, "http://10.0.0.6:8000"),
        ("1E+1P+1D/prefill0", Role.PREFILL, "https://10.0.0.7:443"),
    ]
    assert spec.ec_storage == tmp_path / "ec" and spec.kv_connector == "nixl"
    assert spec.instances[0].describe() == "1E+1P+1D/decode0 (decode, http://10.0.0.8:8000)"


def test_two_encoders_are_numbered_per_role_and_the_default_connector_applies(
    tmp_path: Path,
) -> None:
    path = tmp_path / "attach.yaml"
    path.write_text(
        "topology: 1P+1D\nproxy: http://h:1\ninstances:\n"
        "  - {role: prefill, url: 'http://h:2'}\n  - {role: decode, url: 'http://h:3'}\n"
    )
    spec = load_attach_file(str(path), "example")
    assert spec.topology.name == "1P+1D" and spec.kv_connector == "example"
    two = write(
        tmp_path,
        {
            "proxy": "http://h:1",
            "instances": [
                {"role": "encoder", "url": "http://h:2"},
                {"role": "encoder", "url": "http://h:3"},
                {"role": "pd", "url": "http://h:4"},
            ],
        },
    )
    names = [i.name for i in load_attach_file(str(two), "example").instances]
    assert names == ["2E+1PD/encoder0", "2E+1PD/encoder1", "2E+1PD/pd0"]


def test_what_keep_up_writes_reads_back_as_the_same_spec(tmp_path: Path) -> None:
    (tmp_path / "ec").mkdir()
    path = tmp_path / "attach.json"
    topology = get_topology("1E+1PD")
    spec = AttachSpec(
        source=path,
        topology=topology,
        proxy_url="http://127.0.0.1:9000",
        instances=attached_instances(
            topology,
            [
                (Role.ENCODER, "http://127.0.0.1:9001"),
                (Role.PREFILL_DECODE, "http://127.0.0.1:9002"),
            ],
        ),
        ec_storage=tmp_path / "ec",
    )
    path.write_text(json.dumps(spec.to_json()))
    assert "kv_connector" not in spec.to_json()  # 1E+1PD has no D: the field would be refused
    assert load_attach_file(str(path), "example") == spec
    recorded = ProxyChoice(ATTACH_PROXY, origin=str(path), attach=spec).to_json()
    assert recorded["attach"]["instances"][1] == {"role": "pd", "url": "http://127.0.0.1:9002"}


def test_a_yaml_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "attach.yml"
    path.write_text("proxy: [http://h:1\n")
    with pytest.raises(BadInput, match=rf"attach file {path}: not valid YAML: line 2"):
        load_attach_file(str(path), "example")


# -- guards ------------------------------------------------------------------------------------


def session_sending_an_image(
    spec: AttachSpec, tmp_path: Path, client: object
) -> tuple[AttachedSession, dict]:
    """An attached session whose requests go to `client` (its /health and /metrics stubbed by
    the test), and the image prompt's body to send through it."""
    session = AttachedSession(spec, fake_run_settings(tmp_path, tmp_path / "vllm"))
    session._client = client  # type: ignore[assignment]
    image = render_request(next(p for p in SKELETON_PROMPTS if p.name == "image"), "m")
    return session, image


def guards_of(topology: str, evidence: AttachedEvidence, **kw) -> dict[str, GuardResult]:
    guards = attached_guards(
        get_topology(topology),
        evidence,
        kw.pop("result", cached_answer(89, None)),
        32,
        kw.pop("rule", KvRule.BLOCK_ALIGNED_PREFIX),
        kw.pop("counters", None),
    )
    return {g.name: g for g in guards}


def test_encoder_output_holds_when_every_item_left_an_ec_file() -> None:
    evidence = AttachedEvidence(
        media_items=2, ec_storage="/ec", ec_files_written=["a", "b"], encoder_requests=1.0
    )
    guards = guards_of("1E+1PD", evidence)
    assert guards["encoder_output"].ok and guards["encoder_output"].checkable
    assert "2 EC file(s) written under /ec" in guards["encoder_output"].evidence
    assert "the encoders finished 1 request(s)" in guards["encoder_output"].evidence
    consumer = guards["consumer_embeds"]
    assert not consumer.checkable and not consumer.ok and not consumer.failed
    assert consumer.evidence.startswith("not checkable: ")


def test_encoder_output_fails_without_files_or_encoder_requests() -> None:
    missing = AttachedEvidence(media_items=2, ec_storage="/ec", ec_files_written=["a"])
    guard = guards_of("1E+1PD", missing)["encoder_output"]
    assert (
        guard.failed and "1 EC file(s) written" in guard.evidence and "(0 there" in guard.evidence
    )
    idle = AttachedEvidence(
        media_items=1, ec_storage="/ec", ec_files_written=["a"], encoder_requests=0.0
    )
    assert guards_of("1E+1PD", idle)["encoder_output"].failed  # somebody else wrote it


def test_a_storage_that_saw_the_media_before_makes_the_encoder_guard_unchecked() -> None:
    """Judged twice, a deployment's encoder loads the items it stored the first time: no new
    file, and nothing outside tells which stored file is which item's."""
    stale = AttachedEvidence(
        media_items=2, ec_storage="/ec", ec_files_before=5, ec_files_written=[], encoder_requests=1
    )
    guard = guards_of("1E+1PD", stale)["encoder_output"]
    assert not guard.checkable and not guard.ok and not guard.failed
    assert "not encoded again" in guard.evidence and "(5 there before)" in guard.evidence


def test_without_ec_storage_the_encoder_guard_is_not_checkable() -> None:
    guard = guards_of("1E+1PD", AttachedEvidence(media_items=1))["encoder_output"]
    assert not guard.checkable and not guard.ok and "no ec_storage" in guard.evidence


def test_text_only_requests_have_no_ec_guards() -> None:
    assert guards_of("1E+1PD", AttachedEvidence(media_items=0)) == {}


def test_kv_transfer_reads_the_answer_or_d_metrics_and_is_unchecked_without_them() -> None:
    evidence = AttachedEvidence(media_items=0)
    held = guards_of("1P+1D", evidence, result=cached_answer(89, 64))["kv_transfer"]
    assert held.ok and "client answer" in held.evidence
    assert guards_of("1P+1D", evidence, result=cached_answer(89, 0))["kv_transfer"].failed
    nixl = guards_of("1P+1D", evidence, rule=KvRule.WHOLE_PROMPT)["kv_transfer"]
    assert not nixl.checkable and "/metrics could not be read" in nixl.evidence
    counted = guards_of(
        "1P+1D", evidence, rule=KvRule.WHOLE_PROMPT, counters={"p2p_cached_tokens": 88.0}
    )["kv_transfer"]
    assert counted.ok and counted.checkable


def test_ec_files_without_the_encoders_count_do_not_hold_the_encoder_guard() -> None:
    """The evidence is the files and the encoders' own count of requests; found in review,
    an unreadable /metrics let the files alone hold it (a count of 0 already failed it)."""
    unread = AttachedEvidence(
        media_items=1, ec_storage="/ec", ec_files_written=["a"], encoder_requests=None
    )
    guard = guards_of("1E+1PD", unread)["encoder_output"]
    assert not guard.checkable and not guard.ok and not guard.failed
    assert "/metrics could not be read" in guard.evidence


def test_a_kv_guard_d_held_from_its_own_prefix_cache_is_not_checkable() -> None:
    """A deployment judged again: D's own count says every prompt token it did not compute
    came from its prefix cache, none through the connector. Found in review: cached_tokens
    alone held the ExampleConnector rule with nothing moved (NIXL's rule said not checkable)."""
    evidence = AttachedEvidence(media_items=0)
    own_cache = {"local_cache_hit_tokens": 80.0, "external_kv_tokens": 0.0}
    guard = guards_of("1P+1D", evidence, result=cached_answer(89, 80), counters=own_cache)[
        "kv_transfer"
    ]
    assert not guard.checkable and not guard.ok and not guard.failed
    assert "D took 80 prompt tokens from its own prefix cache" in guard.evidence
    moved = {"local_cache_hit_tokens": 0.0, "external_kv_tokens": 80.0}
    held = guards_of("1P+1D", evidence, result=cached_answer(89, 80), counters=moved)
    assert held["kv_transfer"].ok


def test_an_example_connector_request_in_flight_with_another_is_judged_by_its_own_answer() -> None:
    """Another request in flight makes D's p2p counter (NIXL's evidence) shared, not the
    answer's own `cached_tokens` (ExampleConnector's): that guard is still decided."""
    evidence = AttachedEvidence(media_items=0, shared=True)
    held = guards_of("1P+1D", evidence, result=cached_answer(89, 64))["kv_transfer"]
    assert held.ok and held.checkable, held.evidence
    assert guards_of("1P+1D", evidence, result=cached_answer(89, 0))["kv_transfer"].failed


def test_a_kv_guard_with_tokens_through_the_connector_is_judged_though_d_held_some() -> None:
    """D took part of the prompt from its own prefix cache and the rest through the
    connector (its /metrics): something moved, so the guard is decided, not "not checkable"."""
    evidence = AttachedEvidence(media_items=0)
    mixed = {"local_cache_hit_tokens": 64.0, "external_kv_tokens": 16.0}
    guard = guards_of("1P+1D", evidence, result=cached_answer(89, 80), counters=mixed)
    assert guard["kv_transfer"].ok and guard["kv_transfer"].checkable, guard["kv_transfer"]


@pytest.mark.parametrize(
    "document, said",
    [
        ({"instances": [{"role": ["prefill"], "url": "http://h:2"}]}, "'role' must be one of"),
        ({"instances": [{"role": {"x": 1}, "url": "http://h:2"}]}, "'role' must be one of"),
        ({"kv_connector": ["nixl"]}, "unknown 'kv_connector' a list"),
    ],
)
def test_a_role_or_connector_that_is_no_string_is_one_line(
    tmp_path: Path, document: dict, said: str
) -> None:
    """A YAML `role: [prefill]` raised TypeError (unhashable) instead of naming the field
    (found in review)."""
    pair = [{"role": "prefill", "url": "http://h:2"}, {"role": "decode", "url": "http://h:3"}]
    path = tmp_path / "attach.json"
    path.write_text(json.dumps({"proxy": "http://h:1", "instances": pair, **document}))
    with pytest.raises(BadInput, match=said) as refused:
        load_attach_file(str(path), "example")
    assert str(path) in str(refused.value) and "\n" not in str(refused.value)


def test_ec_storage_for_a_deployment_without_encoders_is_refused(tmp_path: Path) -> None:
    """`ec_storage` is where the encoders write: given for a 1P+1D (a file copied from an EPD
    deployment's), it was taken silently, and run.json named an EC storage no instance used."""
    pair = [{"role": "prefill", "url": "http://h:2"}, {"role": "decode", "url": "http://h:3"}]
    (tmp_path / "ec").mkdir()
    path = tmp_path / "attach.json"
    path.write_text(json.dumps({"proxy": "http://h:1", "instances": pair, "ec_storage": "ec"}))
    with pytest.raises(BadInput, match="'ec_storage' is the encoders' directory, and there is no"):
        load_attach_file(str(path), "example")


# -- verdicts and reports ----------------------------------------------------------------------


def outcome(error: str | None = None) -> Outcome:
    return Outcome("image", result=None if error else cached_answer(89, None), error=error)


UNCHECKED = not_checkable("consumer_embeds", "no taps")
HELD = GuardResult("encoder_output", True, "1 media item(s); 1 EC file(s) written")


def test_an_unchecked_guard_neither_holds_nor_fails_and_the_detail_names_it() -> None:
    record = judged("1E+1PD", "baseline", outcome(), outcome(), [HELD, UNCHECKED])
    assert record.verdict is Verdict.MATCH and record.policy_passed
    assert record.detail.endswith("; not checkable: consumer_embeds"), record.detail
    assert record.guards["consumer_embeds"] == {
        "ok": False,
        "not_checkable": True,
        "evidence": "not checkable: no taps",
    }
    assert record.failed_guards() == {}
    assert list(record.unchecked_guards()) == ["consumer_embeds"]
    broken = GuardResult("encoder_output", False, "0 EC file(s)")
    vacuous = judged("1E+1PD", "baseline", outcome(), outcome(), [broken, UNCHECKED])
    assert vacuous.verdict is Verdict.VACUOUS and "encoder_output" in vacuous.detail


def test_the_verdict_table_and_the_failure_block_show_unchecked_guards() -> None:
    record = judged("1E+1PD", "baseline", outcome(), outcome(), [HELD, UNCHECKED])
    table = format_verdict_table([record, record])
    assert table.splitlines()[-1] == (
        "guards NOT CHECKED (no evidence where this run stands): consumer_embeds in 2 case(s)"
    )
    assert "NOT CHECKED" not in format_verdict_table(
        [judged("1E+1PD", "baseline", outcome(), outcome(), [HELD])]
    )
    assert "guard consumer_embeds not checkable: no taps" in format_failure(record)
    html = _guards(record.guards)
    assert "(1 not checkable)" in html and 'class="unchecked"' in html and ">?<" in html


def test_an_error_names_its_first_line_in_the_detail() -> None:
    error = "1E+1PD/pd0 (pd, http://h:2) is not serving: GET /health: connection refused\nmore"
    record = judged("1E+1PD", "baseline", outcome(), outcome(error=error), [])
    assert record.verdict is Verdict.ERROR
    assert record.detail == f"request failed: {error.splitlines()[0]}"


def test_repro_refuses_a_bundle_of_an_attached_deployment(tmp_path: Path, epd_cli) -> None:
    bundle = tmp_path / "run"
    bundle.mkdir()
    (bundle / "run.json").write_text(json.dumps({"proxy": {"kind": "attach"}}))
    (bundle / "requests.json").write_text("{}")
    (bundle / "summary.json").write_text('{"cases": []}')
    code, _, err = epd_cli("repro", bundle)
    assert code == 2
    assert err == (
        f"epd-harness: error: {bundle} judged an attached deployment, which repro cannot "
        "start; rerun 'epd-harness run --attach FILE' against it\n"
    )


def attach_1e1pd(tmp_path: Path) -> Path:
    """The attach file `repro --keep-up` writes for a 1E+1PD case (URLs made up)."""
    return write(
        tmp_path,
        {
            "proxy": "http://127.0.0.1:8000",
            "instances": [
                {"role": "encoder", "url": "http://127.0.0.1:8001"},
                {"role": "pd", "url": "http://127.0.0.1:8002"},
            ],
        },
    )


def test_attach_sends_a_scenarios_prompt_judged_as_the_scenario_declares(
    tmp_path: Path,
) -> None:
    """After `repro --keep-up` of ec-video-jpeg-frames-default-fps, `run --attach FILE
    --prompt m-video-jpeg-frames` answered "unknown prompt" (an audit on real vLLM): only the
    skeleton prompts were looked up. A scenario's prompt is sent, under the failure the
    scenario declares where one request to the attached topology is the scenario."""
    from harness.preflight.config import RunRequest, check_arguments

    path = attach_1e1pd(tmp_path)
    request = RunRequest(
        proxy=ATTACH_PROXY, attach=str(path), prompts=("image", "m-video-jpeg-frames")
    )
    checked = check_arguments(request)
    assert [p.name for p in checked.prompts] == ["image", "m-video-jpeg-frames"]
    [(prompt, failure)] = checked.declared
    assert (prompt, failure.verdict, failure.evidence) == (
        "m-video-jpeg-frames",
        "MISMATCH",
        "generated tokens differ",
    )
    # A scenario expected to MATCH is a prompt like any other: no declaration.
    plain = check_arguments(
        RunRequest(proxy=ATTACH_PROXY, attach=str(path), prompts=("m-video-jpeg-frames-2fps",))
    )
    assert [p.name for p in plain.prompts] == ["m-video-jpeg-frames-2fps"]
    assert plain.declared == ()


def test_attach_refuses_a_declared_prompt_one_request_cannot_judge_as_declared(
    tmp_path: Path,
) -> None:
    """A declared failure on another topology than the attached one would read as a new
    failure, not the known one: refused, naming the scenario to run instead."""
    from harness.preflight.config import RunRequest, check_arguments
    from harness.run.scenarios import MATRIX

    elsewhere = next(
        s
        for s in MATRIX
        if s.declared is not None and s.topology != "1E+1PD" and len(s.prompts) == 1
    )
    name = elsewhere.prompts[0].name
    request = RunRequest(proxy=ATTACH_PROXY, attach=str(attach_1e1pd(tmp_path)), prompts=(name,))
    with pytest.raises(BadInput) as refused:
        check_arguments(request)
    assert str(refused.value).startswith(f"--prompt {name}: matrix scenario {elsewhere.name} ")
    assert str(refused.value).endswith(f"run 'epd-harness run --scenario {elsewhere.name}' instead")


def test_attach_refusing_a_scenario_names_its_prompts(tmp_path: Path) -> None:
    from harness.preflight.config import RunRequest, check_arguments

    request = RunRequest(
        proxy=ATTACH_PROXY,
        attach=str(attach_1e1pd(tmp_path)),
        scenarios=("ec-video-jpeg-frames-default-fps",),
    )
    with pytest.raises(BadInput) as refused:
        check_arguments(request)
    assert str(refused.value).endswith(
        "drop --scenario and choose its prompts with --prompt m-video-jpeg-frames"
    ), refused.value


def test_an_unknown_prompt_with_attach_says_a_scenarios_prompt_is_known_too(
    tmp_path: Path,
) -> None:
    from harness.preflight.config import RunRequest, check_arguments

    request = RunRequest(proxy=ATTACH_PROXY, attach=str(attach_1e1pd(tmp_path)), prompts=("nope",))
    with pytest.raises(BadInput) as refused:
        check_arguments(request)
    assert str(refused.value) == (
        "unknown prompt 'nope' (known: text, image, two_images, video), or a matrix "
        "scenario's, such as m-one-image"
    )


def attached_1e1pd(tmp_path: Path) -> AttachSpec:
    """A 1E+1PD deployment at made-up loopback URLs, its EC storage under tmp_path."""
    storage = tmp_path / "ec"
    storage.mkdir(exist_ok=True)
    topology = get_topology("1E+1PD")
    return AttachSpec(
        tmp_path / "attach.json",
        topology,
        "http://127.0.0.1:1",
        attached_instances(
            topology,
            [(Role.ENCODER, "http://127.0.0.1:2"), (Role.PREFILL_DECODE, "http://127.0.0.1:3")],
        ),
        ec_storage=storage,
    )


def test_a_request_in_flight_with_another_holds_no_guard_on_the_others_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load sends to an attached deployment concurrently. The EC files written and the
    encoders' requests finished during one request's window are then partly another's: the
    first request here left nothing, the second (sent while the first was in flight) one file,
    and the first must not hold `encoder_output` on it."""
    spec = attached_1e1pd(tmp_path)
    storage = spec.ec_storage
    finished = {"requests": 0.0}
    monkeypatch.setattr(attached, "health_problem", lambda url, timeout_s=0.0: None)
    monkeypatch.setattr(
        attached,
        "read_counters",
        lambda url: KvCounters({"finished_requests": finished["requests"]}),
    )
    first_in_flight, second_done = threading.Event(), threading.Event()

    class Client:
        def send(self, body: dict, request_id: str) -> ChatReply:
            if "-first-" in request_id:  # its media reach no encoder; it waits on the second
                first_in_flight.set()
                assert second_done.wait(10)
            else:
                (storage / "second-item").mkdir(exist_ok=True)
                (storage / "second-item" / EC_CACHE_FILE).write_bytes(b"ec")
                finished["requests"] += 1
            return ChatReply(cached_answer(89, None))

        def close(self) -> None:
            pass

    session, image = session_sending_an_image(spec, tmp_path, Client())
    outcomes: dict[str, Outcome] = {}
    first = threading.Thread(target=lambda: outcomes.update(first=session.send("first", image)))
    first.start()
    assert first_in_flight.wait(10)
    outcomes["second"] = session.send("second", image)
    second_done.set()
    first.join(10)
    guard = {g.name: g for g in transfer_guards(session.served, outcomes["first"])}
    assert not guard["encoder_output"].ok, guard["encoder_output"]
    assert not guard["encoder_output"].checkable  # nor failed: the files may well be its too
    assert "other requests were in flight" in guard["encoder_output"].evidence
    # The case's record says so too (found in review: a mutant that left `shared` out of the
    # evidence's JSON survived every test).
    assert outcomes["first"].to_json()["attached"]["shared"] is True
    alone = session.send("alone", image)  # nothing else in flight: its own evidence again
    assert alone.attached is not None and not alone.attached.shared
    assert alone.to_json()["attached"]["shared"] is False


def one_p_one_d(tmp_path: Path, **options: str) -> AttachSpec:
    """An attached 1P+1D: its proxy on port 1, P on 2, D on 3 (nothing listens on any)."""
    topology = get_topology("1P+1D")
    return AttachSpec(
        tmp_path / "attach.json",
        topology,
        "http://127.0.0.1:1",
        attached_instances(
            topology, [(Role.PREFILL, "http://127.0.0.1:2"), (Role.DECODE, "http://127.0.0.1:3")]
        ),
        **options,
    )


def test_a_nixl_request_in_flight_with_another_holds_no_kv_guard_on_its_p2p_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NIXL's KV evidence is D's p2p counter, shared by every request in flight: the first
    request here moved nothing to D, the second (sent while the first was in flight) its
    whole prompt, and the first must not hold `kv_transfer` on the second's tokens (a load's
    round account, `harness.run.load.kv_account`, judges the round's counter as a whole)."""
    spec = one_p_one_d(tmp_path, kv_connector="nixl")
    p2p = {"tokens": 0.0}
    monkeypatch.setattr(attached, "health_problem", lambda url, timeout_s=0.0: None)
    monkeypatch.setattr(
        attached, "read_counters", lambda url: KvCounters({"p2p_cached_tokens": p2p["tokens"]})
    )
    first_in_flight, second_done = threading.Event(), threading.Event()

    class Client:
        def send(self, body: dict, request_id: str) -> ChatReply:
            if "-first-" in request_id:  # its KV never reaches D; it waits on the second
                first_in_flight.set()
                assert second_done.wait(10)
            else:
                p2p["tokens"] += 96
            return ChatReply(cached_answer(89, 0))

        def close(self) -> None:
            pass

    serving = ServingConfig(model="m", kv_connector="NixlConnector")
    session = AttachedSession(spec, fake_run_settings(tmp_path, tmp_path / "vllm", serving))
    session._client = Client()  # type: ignore[assignment]
    text = render_request(next(p for p in SKELETON_PROMPTS if p.name == "text"), "m")
    outcomes: dict[str, Outcome] = {}
    first = threading.Thread(target=lambda: outcomes.update(first=session.send("first", text)))
    first.start()
    assert first_in_flight.wait(10)
    outcomes["second"] = session.send("second", text)
    second_done.set()
    first.join(10)
    guard = {g.name: g for g in transfer_guards(session.served, outcomes["first"])}
    assert not guard["kv_transfer"].ok, guard["kv_transfer"]
    assert not guard["kv_transfer"].checkable
    assert "other requests were in flight" in guard["kv_transfer"].evidence
    alone = {g.name: g for g in transfer_guards(session.served, session.send("alone", text))}
    assert alone["kv_transfer"].ok  # alone, the counter's growth is its own


def test_an_encoder_metrics_page_without_the_request_counter_fails_no_guard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An encoder URL whose /metrics answers without vLLM's finished-request counter (a sidecar
    in front of it, a vLLM that names it otherwise) shows nothing of what the encoder did. Read
    as "the encoders finished 0 request(s)" it failed `encoder_output` on a request that left
    its EC file, making a correct deployment's MATCH VACUOUS for the harness's reason."""
    spec = attached_1e1pd(tmp_path)
    monkeypatch.setattr(attached, "health_problem", lambda url, timeout_s=0.0: None)
    monkeypatch.setattr(attached, "read_counters", lambda url: KvCounters({}))

    class Client:
        def send(self, body: dict, request_id: str) -> ChatReply:
            assert spec.ec_storage is not None
            (spec.ec_storage / "item").mkdir(exist_ok=True)
            (spec.ec_storage / "item" / EC_CACHE_FILE).write_bytes(b"ec")
            return ChatReply(cached_answer(89, None))

        def close(self) -> None:
            pass

    session, image = session_sending_an_image(spec, tmp_path, Client())
    sent = session.send("image", image)
    guard = {g.name: g for g in transfer_guards(session.served, sent)}["encoder_output"]
    assert not guard.checkable, guard  # neither held nor failed
    assert "finished 0" not in guard.evidence, guard.evidence


def test_a_fuzz_on_an_attached_deployment_that_is_down_is_one_line_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`epd-harness fuzz --attach FILE` opens the attached session in `FuzzEngine.__enter__`,
    and the command catches nothing around it: the CLI prints one line for a HarnessError
    only, so an instance that was down (or served otherwise) ended fuzz in a traceback."""
    from harness.errors import EXIT_FAILED, HarnessError
    from harness.run.fuzz.engine import FuzzEngine

    spec = attached_1e1pd(tmp_path)
    settings = fake_run_settings(
        tmp_path,
        tmp_path / "vllm",
        proxy=ProxyChoice(ATTACH_PROXY, origin=str(spec.source), attach=spec),
    )
    monkeypatch.setattr(attached, "health_problem", lambda url, timeout_s=0.0: "connection refused")
    engine = FuzzEngine(settings, spec.topology, attached=True)
    monkeypatch.setattr(engine.pool, "session", lambda *a, **kw: object())  # the baseline
    with pytest.raises(HarnessError) as raised:
        with engine:
            pass
    assert str(raised.value).startswith("1E+1PD/encoder0 (encoder, http://127.0.0.1:2)")
    assert raised.value.exit_code == EXIT_FAILED  # as a run's ERROR verdicts: not bad input


def test_an_instance_serving_another_model_name_is_refused_saying_how_to_serve_it(
    monkeypatch,
) -> None:
    """The harness's requests and baseline name the served model `epd-model`: a deployment
    serving another name would answer every request 404, each case an ERROR of vLLM's words."""
    from harness.spec.attach import AttachedInstance

    monkeypatch.setattr(attached, "model_cards", lambda url: [{"id": "Qwen/Qwen2.5-VL-3B"}])
    instance = AttachedInstance(
        name="1E+1PD/pd0", role=Role.PREFILL_DECODE, url="http://127.0.0.1:9"
    )
    problem = attached.serving_mismatch(instance, ServingConfig(model="/m"), None)
    assert problem is not None and "serves no model named epd-model" in problem, problem
    assert "serve it with --served-model-name epd-model" in problem, problem
    monkeypatch.setattr(attached, "model_cards", lambda url: [{"id": "epd-model"}])
    assert attached.serving_mismatch(instance, ServingConfig(model="/m"), None) is None


def cache_info_page(blocks: str, block_size: str = "32") -> str:
    """A /metrics page with vLLM's cache config line (engine 0 and 1, as with DP=2)."""
    return "".join(
        f'vllm:cache_config_info{{block_size="{block_size}",engine="{engine}",'
        f'num_gpu_blocks="{blocks}"}} 1.0\n'
        for engine in (0, 1)
    )


def test_a_role_is_read_from_the_kv_cache_an_instance_holds() -> None:
    """An encoder holds the null block only (one per engine: 2 with DP=2); an instance running
    the language model holds at least max_model_len tokens of KV. What the page cannot tell is
    said, never taken as verified."""
    from harness.serve.attached_roles import read_role
    from harness.spec.attach import AttachedInstance

    encoder = AttachedInstance("1E+1PD/encoder0", Role.ENCODER, "http://127.0.0.1:8001")
    pd = AttachedInstance("1E+1PD/pd0", Role.PREFILL_DECODE, "http://127.0.0.1:8002")
    assert read_role(encoder, cache_info_page("2"), "0.32.0", 4096, True).mismatch is None
    assert read_role(pd, cache_info_page("128"), "0.32.0", 4096, True).mismatch is None
    plain = read_role(encoder, cache_info_page("128"), "0.32.0", 4096, True).mismatch
    assert plain is not None and plain.startswith(
        "1E+1PD/encoder0 (encoder, http://127.0.0.1:8001) is declared an encoder, but its "
        "/metrics reports a KV cache of 128 blocks of 32 tokens"
    ), plain
    swapped = read_role(pd, cache_info_page("1"), "0.32.0", 4096, True).mismatch
    assert swapped is not None and "reports a KV cache of 1 block of 32 tokens" in swapped
    unread = read_role(pd, None, "0.32.0", 4096, True)
    assert unread.mismatch is None and unread.unverified[0] == "its /metrics cannot be read"
    untold = read_role(encoder, "vllm:request_success_total 0\n", "0.32.0", 4096, True)
    assert untold.mismatch is None and "num_gpu_blocks" in untold.unverified[0]
    assert any(
        "ec_consumer" in u
        for u in read_role(pd, cache_info_page("128"), "0.32.0", 4096, True).unverified
    )


def test_a_decode_is_a_kv_consumer_only_where_its_page_can_say_so() -> None:
    """vLLM 0.32 shows `vllm:num_requests_kv_fetch_by_stage` on a KV consumer; an older
    release, or a page without vLLM's stat logger (`--disable-log-stats`), cannot say it is
    missing: that is said as not verified, never refused."""
    from harness.serve.attached_roles import read_role
    from harness.spec.attach import AttachedInstance

    decode = AttachedInstance("1P+1D/decode0", Role.DECODE, "http://127.0.0.1:8003")
    page = cache_info_page("128")
    refused = read_role(decode, page, "0.32.0+cpu", 4096, False).mismatch
    assert refused is not None and "no vllm:num_requests_kv_fetch_by_stage" in refused
    consumer = page + 'vllm:num_requests_kv_fetch_by_stage{engine="0",stage="in_progress"} 0\n'
    assert read_role(decode, consumer, "0.32.0", 4096, False).mismatch is None
    older = read_role(decode, page, "0.31.0", 4096, False)
    assert older.mismatch is None and "from vLLM 0.31.0" in older.unverified[0]
    no_logger = read_role(decode, "", "0.32.0", 4096, False)
    assert no_logger.mismatch is None
    assert any("none of vLLM's engine metrics" in u for u in no_logger.unverified)


def test_an_attached_1e1p1d_is_judged_against_the_baseline_only(tmp_path: Path) -> None:
    """1E+1P+1D's exact reference (1P+1D) would have to be started beside the attached
    deployment, which is not the deployment under test: its cases are judged against the
    baseline alone, and nothing is started for the reference. Found in review: a mutant that
    asked for the reference of an attached topology survived every unit test."""
    from harness.judge.verdicts import Stability
    from harness.run.judging import Observed
    from harness.run.sweep import Sweep, SweepSpec

    storage = tmp_path / "ec"
    storage.mkdir()
    topology = get_topology("1E+1P+1D")
    spec = AttachSpec(
        tmp_path / "attach.json",
        topology,
        "http://127.0.0.1:1",
        attached_instances(
            topology,
            [
                (Role.ENCODER, "http://127.0.0.1:2"),
                (Role.PREFILL, "http://127.0.0.1:3"),
                (Role.DECODE, "http://127.0.0.1:4"),
            ],
        ),
        ec_storage=storage,
    )
    settings = fake_run_settings(
        tmp_path,
        tmp_path / "vllm",
        proxy=ProxyChoice(ATTACH_PROXY, origin=str(spec.source), attach=spec),
    )
    image = next(p for p in SKELETON_PROMPTS if p.name == "image")
    sweep = Sweep(SweepSpec((topology,), prompts=(image,)), settings)
    answer = cached_answer(3, None, (5, 6, 7))
    sweep.baseline.outcomes["image"] = Outcome("image", answer)
    sweep.baseline.stability["image"] = Stability(True, "planted", 0.0)
    asked: list[str] = []

    def serve_topology(name: str) -> dict[str, Observed]:
        asked.append(name)
        return {"image": Observed(Outcome("image", answer), ())}

    sweep.serve_topology = serve_topology  # type: ignore[method-assign]
    records = sweep.judge("1E+1P+1D", "image")
    assert asked == ["1E+1P+1D"]
    assert [(r.reference, r.verdict) for r in records] == [("baseline", Verdict.MATCH)]


def test_a_cache_config_line_without_a_block_size_is_said_unverified_not_a_crash() -> None:
    """Only both labels tell the KV tokens an instance holds; a page with num_gpu_blocks
    alone (another exporter, a relabelled scrape) cannot, and is said so, never read."""
    from harness.serve.attached_roles import read_role
    from harness.spec.attach import AttachedInstance

    pd = AttachedInstance("1E+1PD/pd0", Role.PREFILL_DECODE, "http://127.0.0.1:8002")
    page = 'vllm:cache_config_info{engine="0",num_gpu_blocks="2"} 1.0\n'
    reading = read_role(pd, page, "0.32.0", 4096, True)
    assert reading.mismatch is None
    assert "its /metrics has no vllm:cache_config_info num_gpu_blocks" in reading.unverified


def test_without_encoders_an_ec_consumer_is_not_listed_as_unverified() -> None:
    """'consumes the encoders' embeddings' is unverified only where there are encoders: a
    1P+1D deployment has none, and saying it there would misreport what was not checked."""
    from harness.serve.attached_roles import read_role
    from harness.spec.attach import AttachedInstance

    prefill = AttachedInstance("1P+1D/prefill0", Role.PREFILL, "http://127.0.0.1:8002")
    alone = read_role(prefill, cache_info_page("128"), "0.32.0", 4096, False).unverified
    assert not any("ec_consumer" in u for u in alone), alone
    with_encoders = read_role(prefill, cache_info_page("128"), "0.32.0", 4096, True).unverified
    assert any("ec_consumer" in u for u in with_encoders), with_encoders


@pytest.mark.parametrize(
    ("theirs", "warned"),
    [("0.32.0+cu128", False), ("0.32.0", False), ("unknown", False), ("0.31.0+cpu", True)],
)
def test_an_attached_version_is_warned_of_only_when_its_release_is_not_the_baselines(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, theirs: str, warned: bool
) -> None:
    """The baseline serves 0.32.0+cpu: an attached 0.32.0 built for CUDA is the same release
    (a local build suffix is not one), so no warning; 0.31.0 is another release."""
    from harness.run.sweep import Sweep, SweepSpec
    from harness.spec.settings import RunSettings, ServedVllm

    settings = RunSettings(
        serving=ServingConfig(model="/m"),
        run_dir=tmp_path / "run",
        vllm=ServedVllm("vllm", "0.32.0+cpu", "2.13.0"),
    )
    sweep = Sweep(SweepSpec((), prompts=()), settings)
    with caplog.at_level("WARNING", logger="harness.run.sweep"):
        sweep._note_attached_versions({"encoder-0": theirs})
    assert sweep.run_info["attached_versions"] == {"encoder-0": theirs}
    said = [r.getMessage() for r in caplog.records if "the attached instances serve" in r.message]
    assert bool(said) is warned, said


# -- watching the instances while a request runs -------------------------------------------------

PD_URL = "http://127.0.0.1:3"  # attached_1e1pd's pd
PD_DOWN = f"1E+1PD/pd0 (pd, {PD_URL}) is not serving: GET /health: connection refused"


class PdHealth:
    """The pd's /health answers `answers` in turn, then answers 200; every other URL (the
    encoder, the proxy) answers 200, or `proxy_problem` for the proxy's. `all_given` is set
    once the pd has given every scripted answer: a request held until then was in flight
    through all of them, whatever the machine's speed."""

    def __init__(self, answers: list[str | None], proxy_problem: str | None = None) -> None:
        self.answers = answers
        self.proxy_problem = proxy_problem
        self.asked = 0
        self.all_given = threading.Event()

    def __call__(self, url: str, timeout_s: float = 0.0) -> str | None:
        if url.startswith("http://127.0.0.1:1/"):
            return self.proxy_problem
        if not url.startswith(f"{PD_URL}/"):
            return None
        answer = self.answers[self.asked] if self.asked < len(self.answers) else None
        self.asked += 1
        if self.asked >= len(self.answers):
            self.all_given.set()
        return answer


class HeldClient:
    """Answers each request once the pd's scripted /health answers are all given."""

    def __init__(self, health: PdHealth) -> None:
        self.health = health
        self.sent: list[str] = []

    def send(self, body: dict, request_id: str) -> ChatReply:
        self.sent.append(request_id)
        assert self.health.all_given.wait(5), "the watch stopped asking"
        return ChatReply(cached_answer(89, None))

    def close(self) -> None:
        pass


def watched_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, health: PdHealth, client: object
) -> tuple[AttachedSession, dict]:
    monkeypatch.setattr(attached, "health_problem", health)
    monkeypatch.setattr(attached, "read_counters", lambda url: None)
    monkeypatch.setattr(attached, "WATCH_INTERVAL_S", 0.01)
    return session_sending_an_image(attached_1e1pd(tmp_path), tmp_path, client)


def test_a_single_missed_health_check_in_flight_is_a_blip_not_the_end_of_the_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pd that misses one /health while a request runs (a slow answer, a busy event loop)
    and answers the next has not died: the request goes on. A miss, an answer, a miss again
    is two blips, not two misses in a row (found in review: no test held the count's reset
    nor its threshold)."""
    refused = "connection refused"
    health = PdHealth([None, refused, None, refused])  # before sending, then in flight
    session, image = watched_session(tmp_path, monkeypatch, health, HeldClient(health))
    outcome = session.send("image", image)
    assert outcome.error is None, outcome.error
    assert outcome.result is not None
    assert health.asked >= 4  # the watch saw both misses


def test_two_missed_health_checks_in_a_row_end_the_request_naming_the_instance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two misses in a row while the request runs end it, naming the pd, though the pd
    answers again afterwards (it would have answered the request in the end)."""
    refused = "connection refused"
    health = PdHealth([None, refused, refused])
    session, image = watched_session(tmp_path, monkeypatch, health, HeldClient(health))
    outcome = session.send("image", image)
    assert outcome.result is None
    assert outcome.error == f"{PD_DOWN} (while the request was in flight)", outcome.error


def test_a_request_to_a_deployment_whose_instance_went_down_since_open_is_not_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`open()` found every instance serving; the pd stopped before this request: the
    outcome's error names it and nothing reaches the proxy (whose answer, a 502 or a hang,
    would name no instance)."""
    health = PdHealth(["connection refused"])
    client = HeldClient(health)
    session, image = watched_session(tmp_path, monkeypatch, health, client)
    outcome = session.send("image", image)
    assert client.sent == []
    assert (outcome.result, outcome.error) == (None, PD_DOWN), outcome.error


# -- naming the cause of a failed request --------------------------------------------------------


class FailingClient:
    """The proxy drops every request at once (as when the instance behind it died)."""

    def send(self, body: dict, request_id: str) -> ChatReply:
        raise ConnectionResetError("the proxy closed the connection")

    def close(self) -> None:
        pass


def failed_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, health: PdHealth, grace_s: float
) -> Outcome:
    """The outcome of one request the proxy drops, the instances' /health answering `health`
    (its first pd answer is the check before sending; no check runs while in flight)."""
    session, image = watched_session(tmp_path, monkeypatch, health, FailingClient())
    monkeypatch.setattr(attached, "WATCH_INTERVAL_S", 30.0)  # the request ends first
    monkeypatch.setattr(attached, "DEATH_GRACE_S", grace_s)
    outcome = session.send("image", image)
    assert outcome.result is None and outcome.error is not None
    return outcome


def test_an_instance_still_dying_when_the_request_fails_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The proxy answers the request's failure before the dying pd stops answering /health:
    the grace after the failure lets the pd be named, not the proxy's error alone."""
    health = PdHealth([None, None, "connection refused"])  # serving, still serving, dead
    outcome = failed_request(tmp_path, monkeypatch, health, grace_s=30.0)  # ends when named
    assert outcome.error.splitlines() == [
        PD_DOWN,
        "ConnectionResetError: the proxy closed the connection",
    ], outcome.error


def test_a_failed_request_with_every_instance_serving_names_the_proxy_if_it_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    health = PdHealth([], proxy_problem="connection refused")
    outcome = failed_request(tmp_path, monkeypatch, health, grace_s=0.0)
    assert outcome.error.splitlines()[0] == (
        "the proxy http://127.0.0.1:1 is not reachable: connection refused"
    ), outcome.error


def test_a_dying_instance_is_named_before_a_proxy_that_went_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pd dying and its proxy gone too (one host, one restart): the pd is the cause the
    report names; the proxy's refusal is its consequence at most."""
    health = PdHealth([None, None, "connection refused"], proxy_problem="connection refused")
    outcome = failed_request(tmp_path, monkeypatch, health, grace_s=30.0)
    assert outcome.error.splitlines()[0] == PD_DOWN, outcome.error


# -- what a request left in the EC storage -------------------------------------------------------


def ec_file(storage: Path, mm_hash: str, mtime_ns: int, name: str = EC_CACHE_FILE) -> None:
    """`<mm_hash>/<name>` in the storage, its modification time set (no clock in the test)."""
    path = storage / mm_hash / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(b"ec")
    os.utime(path, ns=(mtime_ns, mtime_ns))


def test_the_ec_files_a_request_wrote_are_the_new_and_the_rewritten_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An EC file written during the request is evidence that the encoder stored the item:
    a new one, or one rewritten (same bytes, new mtime: the same image encoded again). One
    left untouched is not, nor a file of another name (found in review: no test held
    `ec_files`' keys, its mtimes, its file name, nor the before/after comparison)."""
    spec = attached_1e1pd(tmp_path)
    storage = spec.ec_storage
    assert storage is not None
    ec_file(storage, "rewritten", 1_000)
    ec_file(storage, "untouched", 1_000)

    class Client:
        def send(self, body: dict, request_id: str) -> ChatReply:
            ec_file(storage, "rewritten", 2_000)
            ec_file(storage, "new", 2_000)
            ec_file(storage, "other", 2_000, name="metadata.json")
            return ChatReply(cached_answer(89, None))

        def close(self) -> None:
            pass

    monkeypatch.setattr(attached, "health_problem", lambda url, timeout_s=0.0: None)
    monkeypatch.setattr(attached, "read_counters", lambda url: None)
    session, image = session_sending_an_image(spec, tmp_path, Client())
    evidence = session.send("image", image).attached
    assert evidence is not None
    assert (evidence.ec_files_before, evidence.ec_files_written) == (2, ["new", "rewritten"])


def test_an_ec_file_removed_while_the_storage_is_listed_is_left_out(tmp_path: Path) -> None:
    """vLLM may remove an EC file between the listing and the reading of its mtime: the file
    is not there, which is no crash of the request's evidence."""

    class Vanished:
        parent = tmp_path / "vanished"

        def stat(self) -> os.stat_result:
            raise FileNotFoundError(self.parent)

    ec_file(tmp_path, "kept", 1_000)

    class Listing:
        def glob(self, pattern: str) -> list:
            return [*tmp_path.glob(pattern), Vanished()]

    assert attached.ec_files(Listing()) == {"kept": 1_000}  # type: ignore[arg-type]


# -- the attach file `repro --keep-up` writes ----------------------------------------------------


def kept_up_1p1d(tmp_path: Path, kv_connector: str) -> object:
    """What `write_attach_file` reads of a TopologySession serving 1P+1D with `kv_connector`."""
    from types import SimpleNamespace

    serving = ServingConfig(model="m", kv_connector=kv_connector)
    return SimpleNamespace(
        settings=fake_run_settings(tmp_path, tmp_path / "vllm", serving),
        topology=get_topology("1P+1D"),
        entry_url="http://127.0.0.1:1",
        instances=[
            SimpleNamespace(role=Role.PREFILL, url="http://127.0.0.1:2"),
            SimpleNamespace(role=Role.DECODE, url="http://127.0.0.1:3"),
        ],
        ec_storage=None,
    )


def test_keep_up_of_a_nixl_topology_writes_an_attach_file_judged_by_nixls_rule(
    tmp_path: Path,
) -> None:
    """A kept-up NixlConnector topology's attach file must say `nixl`: read as the example
    connector, `run --attach` would hold its KV guard to the block-aligned rule NIXL does not
    follow. A class the harness does not know is held to that rule, as ever (found in review:
    no test held the connector the file names, nor the spec `write_attach_file` returns)."""
    path = tmp_path.resolve() / "attach.json"
    spec = attached.write_attach_file(kept_up_1p1d(tmp_path, "NixlConnector"), path)  # type: ignore[arg-type]
    assert (spec.source, spec.kv_connector) == (path, "nixl")
    assert load_attach_file(str(path), "example") == spec
    unknown = kept_up_1p1d(tmp_path, "SomeoneElsesConnector")
    assert attached.attach_spec_for(unknown, path).kv_connector == "example"  # type: ignore[arg-type]


def test_a_block_size_the_metrics_do_not_give_as_a_number_is_not_read() -> None:
    """vLLM labels `vllm:cache_config_info` with str() of every cache setting: one not yet
    set reads "None". That says no block size (nothing to compare), not a crash of `open()`
    (found in review: no test held the digits check, nor an unreadable page)."""
    assert attached.served_block_size(cache_info_page("4096", block_size="64")) == 64
    assert attached.served_block_size(cache_info_page("4096", block_size="None")) is None
    assert attached.served_block_size(None) is None


def test_the_same_image_twice_in_a_request_is_one_item_for_the_encoder_guard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The encoder caches by the item's hash: an image sent twice in one request is encoded
    and stored once, one EC file, which holds `encoder_output` (found in review: no test held it;
    counted per part, a request repeating an image would fail it for the harness's reason)."""
    spec = attached_1e1pd(tmp_path)
    storage = spec.ec_storage
    assert storage is not None
    monkeypatch.setattr(attached, "health_problem", lambda url, timeout_s=0.0: None)
    finished = {"requests": 0.0}
    monkeypatch.setattr(
        attached,
        "read_counters",
        lambda url: KvCounters({"finished_requests": finished["requests"]}),
    )

    class Client:
        def send(self, body: dict, request_id: str) -> ChatReply:
            ec_file(storage, "the-image", 2_000)
            finished["requests"] += 1
            return ChatReply(cached_answer(89, None))

        def close(self) -> None:
            pass

    session, image = session_sending_an_image(spec, tmp_path, Client())
    content = next(m["content"] for m in image["messages"] if isinstance(m["content"], list))
    content.extend([dict(part) for part in content if part.get("type") == "image_url"])
    sent = session.send("image-twice", image)
    assert sent.attached is not None and sent.attached.media_items == 1, sent.attached
    guard = {g.name: g for g in transfer_guards(session.served, sent)}["encoder_output"]
    assert guard.ok, guard


def test_open_names_a_proxy_that_does_not_answer_and_reads_nothing_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every instance serving but the proxy gone: `open()` says so, naming the proxy, before
    any request (found in review: no test held this check; a sweep still named the proxy,
    request by request, through each failure's cause)."""
    spec = attached_1e1pd(tmp_path)
    health = PdHealth([], proxy_problem="connection refused")
    monkeypatch.setattr(attached, "health_problem", health)
    for unread in ("metrics_page", "model_cards", "read_version"):
        monkeypatch.setattr(attached, unread, lambda url, name=unread: pytest.fail(f"{name} read"))
    session = AttachedSession(spec, fake_run_settings(tmp_path, tmp_path / "vllm"))
    with pytest.raises(attached.AttachedDown) as raised:
        session.open()
    assert str(raised.value) == "the proxy http://127.0.0.1:1 is not reachable: connection refused"


ALONE = PromptSpec("declared-alone", (TextPart("a prompt whose scenario declares it fails"),))
STAGE = PromptSpec("sets-the-stage", (TextPart("an earlier request of the scenario"),))


def declaring(**fields: object) -> Scenario:
    """A stand-in matrix scenario on 1E+1PD that declares its prompt fails, as `fields` send it."""
    return Scenario(
        "declares-a-failure",
        "1E+1PD",
        fields.pop("prompts", (ALONE,)),  # type: ignore[arg-type]
        expect=(Verdict.MISMATCH,),
        expect_evidence="generated tokens differ",
        reason="a stand-in",
        **fields,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    "scenario, stream",
    [
        (declaring(prompts=(STAGE, ALONE)), False),  # an earlier request sets its stage
        (declaring(mode=SendMode.CONCURRENT), False),
        (declaring(mode=SendMode.IDLE_GAPS), False),
        (declaring(rerun_on_kept_storage=True), False),
        (declaring(require_every_encoder=True), False),
        (declaring(stream=True), False),  # the scenario streams, the attached run does not
    ],
    ids=["two-requests", "concurrent", "idle-gaps", "rerun", "every-encoder", "streamed"],
)
def test_a_prompt_is_judged_as_declared_only_where_one_request_is_its_scenario(
    monkeypatch: pytest.MonkeyPatch, scenario: Scenario, stream: bool
) -> None:
    """`run --attach --prompt P` sends P alone: a scenario's declaration is its claim about
    the requests as the scenario sends them, so anything more it does (another request, all
    at once, a pause, a rerun, every encoder, a stream) makes one request another claim."""
    import harness.run.scenarios as scenarios

    monkeypatch.setattr(scenarios, "MATRIX", (scenario,))
    with pytest.raises(BadInput, match="run 'epd-harness run --scenario declares-a-failure'"):
        attached_prompt(ALONE.name, "1E+1PD", "ExampleConnector", stream)


def test_a_prompt_sent_alone_as_its_scenario_sends_it_is_judged_as_declared(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import harness.run.scenarios as scenarios

    alone, streamed = declaring(), declaring(stream=True)
    monkeypatch.setattr(scenarios, "MATRIX", (alone,))
    assert attached_prompt(ALONE.name, "1E+1PD", "ExampleConnector", False) == (
        ALONE,
        alone.declared,
    )
    monkeypatch.setattr(scenarios, "MATRIX", (streamed,))
    assert attached_prompt(ALONE.name, "1E+1PD", "ExampleConnector", True) == (
        ALONE,
        streamed.declared,
    )
    with pytest.raises(BadInput, match="on 1E\\+1PD as the scenario sends it"):
        attached_prompt(ALONE.name, "1E+1P+1D", "ExampleConnector", True)


def test_a_prompt_is_judged_under_the_declaration_of_any_scenario_that_owns_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prompt may belong to a scenario expected to MATCH and to one that declares it fails:
    the declaration is found whichever comes first in the matrix."""
    import harness.run.scenarios as scenarios

    plain, failing = Scenario("plain", "1E+1PD", (ALONE,)), declaring()
    for matrix in ((plain, failing), (failing, plain)):
        monkeypatch.setattr(scenarios, "MATRIX", matrix)
        assert attached_prompt(ALONE.name, "1E+1PD", "ExampleConnector", False) == (
            ALONE,
            failing.declared,
        )


def test_a_prompt_is_judged_as_declared_under_the_attached_deployments_kv_connector() -> None:
    """epd-media-in-decode-tail declares D's death under ExampleConnector only: NIXL hands D
    the whole prompt's KV and the prompt must MATCH there (`expect_by_kv_connector`)."""
    tail = get_scenario("epd-media-in-decode-tail")
    (prompt,) = tail.prompts
    spec, declared = attached_prompt(prompt.name, "1E+1P+1D", "ExampleConnector", False)
    assert (spec, declared) == (prompt, tail.declared) and declared.verdict == "ERROR"
    assert attached_prompt(prompt.name, "1E+1P+1D", "NixlConnector", False) == (prompt, None)


def test_a_prompt_declared_on_an_emptied_kv_storage_is_refused_on_an_attached_deployment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """epd-kv-lookup-miss-text's VACUOUS holds on a KV storage with nothing in it, which the
    matrix empties first (`empty_kv_storage`); an attached deployment's KV storage is not the
    harness's to see or empty, and after a prompt of the same prefix (the skeleton's text) P
    dies instead (epd-kv-lookup-miss-kills-prefill). Judged as declared there, that death read
    as a new failure: refused, naming the scenario to run, as for any declaration one request
    to the deployment is not."""
    import harness.run.scenarios as scenarios

    miss = get_scenario("epd-kv-lookup-miss-text")
    (prompt,) = miss.prompts
    with pytest.raises(BadInput, match=f"run 'epd-harness run --scenario {miss.name}' instead"):
        attached_prompt(prompt.name, "1E+1P+1D", "ExampleConnector", False)
    # Under NIXL it must MATCH: no declaration, nothing to refuse.
    assert attached_prompt(prompt.name, "1E+1P+1D", "NixlConnector", False) == (prompt, None)
    monkeypatch.setattr(scenarios, "MATRIX", (declaring(empty_kv_storage=True),))
    with pytest.raises(BadInput, match="run 'epd-harness run --scenario declares-a-failure'"):
        attached_prompt(ALONE.name, "1E+1PD", "ExampleConnector", False)


def test_open_of_a_deployment_without_encoders_says_no_ec_role_unverified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`open()` reads each role by whether the topology moves embeddings: a 1P+1D deployment
    has no encoders, so 'consumes the encoders' embeddings' is nothing it left unchecked; the
    run saying it was would misreport what was not verified."""
    spec = one_p_one_d(tmp_path)
    consumer = 'vllm:num_requests_kv_fetch_by_stage{engine="0",stage="in_progress"} 0\n'
    monkeypatch.setattr(attached, "health_problem", lambda url, timeout_s=0.0: None)
    monkeypatch.setattr(attached, "metrics_page", lambda url: cache_info_page("128") + consumer)
    monkeypatch.setattr(attached, "model_cards", lambda url: None)
    monkeypatch.setattr(attached, "read_version", lambda url: "0.32.0")
    session = AttachedSession(spec, fake_run_settings(tmp_path, tmp_path / "vllm"))
    session.open()
    try:
        said = [u for unverified in session.roles_unverified.values() for u in unverified]
        assert not any("ec_consumer" in u for u in said), said
    finally:
        session.close()


def test_the_kv_counters_of_a_request_are_ds_not_ps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D's counters are the KV evidence of a 1P+1D deployment: the tokens D received from P.
    P's page counts what P did (its own prefix cache, its own p2p counter where it has one),
    which is no proof that the KV reached D."""
    spec = one_p_one_d(tmp_path, kv_connector="nixl")
    sent = {"http://127.0.0.1:2": 0.0, "http://127.0.0.1:3": 0.0}
    monkeypatch.setattr(attached, "health_problem", lambda url, timeout_s=0.0: None)
    monkeypatch.setattr(
        attached, "read_counters", lambda url: KvCounters({"p2p_cached_tokens": sent[url]})
    )

    class Client:
        def send(self, body: dict, request_id: str) -> ChatReply:
            sent["http://127.0.0.1:3"] += 96  # D received 96 tokens
            sent["http://127.0.0.1:2"] += 7  # P's page moved too, by something else
            return ChatReply(cached_answer(89, 0))

        def close(self) -> None:
            pass

    session = AttachedSession(spec, fake_run_settings(tmp_path, tmp_path / "vllm"))
    session._client = Client()  # type: ignore[assignment]
    outcome = session.send("text", {"messages": [{"role": "user", "content": "hi"}]})
    assert outcome.error is None, outcome.error
    assert outcome.kv_counters == {"p2p_cached_tokens": 96.0}
