"""Transfer guards over tap records (harness/judge/guards.py `TransferEvidence.from_taps`):
the evidence is what each instance was sent and answered, whatever proxy was in between."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.judge.guards import (
    TransferEvidence,
    check_consumer_embeds,
    check_encoder_output,
    check_kv_transfer,
    check_transfers,
)
from harness.outcomes.taps import TapRecord, records_of
from harness.spec.connectors import KvRule
from harness.spec.topology import get_topology
from harness.testing.builders import cached_answer

pytestmark = pytest.mark.unit

ENTRY = {"item_indices": [0], "metadata": {"image_grid_thw": [1, 4, 4]}}


def encoder(seq: int, params: dict | None) -> TapRecord:
    return TapRecord(
        seq,
        "t/encoder0",
        "encoder",
        "/v1/chat/completions",
        status=200,
        part_types=["image_url"],
        metadata_only=[False],
        ec_transfer_params=params,
    )


def consumer(
    seq: int, role: str, metadata_only: bool = True, cached: int | None = None
) -> TapRecord:
    usage = {"prompt_tokens": 89, "prompt_tokens_details": {"cached_tokens": cached}}
    part = "image_embeds" if metadata_only else "image_url"
    return TapRecord(
        seq,
        f"t/{role}0",
        role,
        "/v1/chat/completions",
        status=200,
        part_types=[part],
        metadata_only=[metadata_only],
        usage=usage,
    )


def with_file(tmp_path: Path, mm_hash: str) -> Path:
    (tmp_path / mm_hash).mkdir()
    (tmp_path / mm_hash / "encoder_cache.safetensors").write_bytes(b"x")
    return tmp_path


def test_every_consumer_request_must_be_metadata_only() -> None:
    # E+P+D: P got embeds, D got raw media (a proxy that rewrote only for P) -> red
    records = [encoder(0, {"h": ENTRY}), consumer(1, "prefill"), consumer(2, "decode", False)]
    guard = check_consumer_embeds(TransferEvidence.from_taps(records, media_count=1))
    assert guard.ok is False and "t/decode0" in guard.evidence
    records[2] = consumer(2, "decode")
    assert check_consumer_embeds(TransferEvidence.from_taps(records, media_count=1)).ok


def test_no_consumer_request_at_all_is_not_a_pass() -> None:
    evidence = TransferEvidence.from_taps([encoder(0, {"h": ENTRY})], media_count=1)
    assert check_consumer_embeds(evidence).ok is False


def test_encoder_answers_at_the_taps_cover_the_media(tmp_path: Path) -> None:
    storage = with_file(tmp_path, "h")
    ok = TransferEvidence.from_taps([encoder(0, {"h": ENTRY}), consumer(1, "pd")], 1)
    guard = check_encoder_output(ok, storage)
    assert guard.ok and "seen at the taps" in guard.evidence
    nothing = TransferEvidence.from_taps([encoder(0, None), consumer(1, "pd")], 1)
    assert check_encoder_output(nothing, storage).ok is False
    # a decode retry re-encodes: two rounds of encoder answers for one item are not a pass
    retried = TransferEvidence.from_taps([encoder(0, {"h": ENTRY}), encoder(1, {"h": ENTRY})], 1)
    assert check_encoder_output(retried, storage).ok is False


def test_kv_guard_believes_d_not_the_answer_the_proxy_passed_on() -> None:
    # the client's answer claims 64 cached tokens (a proxy could write that); D said 0
    taps = TransferEvidence.from_taps([consumer(0, "prefill"), consumer(1, "decode", cached=0)], 0)
    guard = check_kv_transfer(cached_answer(89, 64), block_size=32, evidence=taps)
    assert guard.ok is False and "cached_tokens=0 (taps)" in guard.evidence
    honest = TransferEvidence.from_taps([consumer(1, "decode", cached=64)], 0)
    assert check_kv_transfer(cached_answer(89, None), block_size=32, evidence=honest).ok


def test_check_transfers_from_taps_picks_guards_per_topology(tmp_path: Path) -> None:
    storage = with_file(tmp_path, "h")
    records = [encoder(0, {"h": ENTRY}), consumer(1, "prefill"), consumer(2, "decode", cached=64)]
    evidence = TransferEvidence.from_taps(records, media_count=1)
    guards = check_transfers(
        get_topology("1E+1P+1D"), evidence, cached_answer(89, None), storage, 32
    )
    assert [(g.name, g.ok) for g in guards] == [
        ("encoder_output", True),
        ("consumer_embeds", True),
        ("kv_transfer", True),
    ]


def test_every_encoder_used_is_read_at_the_encoders_taps() -> None:
    from types import SimpleNamespace

    from harness.outcomes.outcome import Outcome
    from harness.run.matrix import check_every_encoder_used
    from harness.spec.topology import Role

    session = SimpleNamespace(
        instances=[
            SimpleNamespace(name="t/encoder0", role=Role.ENCODER),
            SimpleNamespace(name="t/encoder1", role=Role.ENCODER),
            SimpleNamespace(name="t/pd0", role=Role.PREFILL_DECODE),
        ]
    )
    first = Outcome("image", taps=[encoder(0, {"h": ENTRY}), consumer(1, "pd")])
    assert check_every_encoder_used(session, [first]).ok is False  # encoder1 got nothing
    second = encoder(2, {"h": ENTRY})
    second.instance = "t/encoder1"
    assert check_every_encoder_used(session, [first, Outcome("image", taps=[second])]).ok


def test_a_request_with_media_but_no_evidence_fails_the_ec_guards(tmp_path: Path) -> None:
    """Neither taps nor a proxy trace (a session built without either): the EC guards cannot
    be held, so they fail, naming why, rather than leaving a MATCH unguarded."""
    from harness.judge.guards import transfer_guards
    from harness.outcomes.outcome import Outcome, ServedTopology

    served = ServedTopology(get_topology("1E+1PD"), tmp_path, 32, "ExampleConnector")
    bare = Outcome("image", result=cached_answer(89, 64), media_count=1)
    guards = {g.name: g for g in transfer_guards(served, bare)}
    assert set(guards) == {"encoder_output", "consumer_embeds"}
    assert all(g.failed and "no tap records" in g.evidence for g in guards.values())
    text_only = Outcome("text", result=cached_answer(89, 64), media_count=0)
    assert transfer_guards(served, text_only) == []


def test_an_item_the_consumer_got_that_no_encoder_was_asked_for_fails_the_encoder_guard(
    tmp_path: Path,
) -> None:
    """Two images; a proxy sends the first to both encoders and the second to none, then
    hands the consumer both as metadata-only parts. Counted per call the encoders covered two
    items, and the second's file was already in the storage from an earlier case: the guard
    held for an encode that never happened. The consumer's items (their uuids, as vLLM's
    proxy and the harness's send them both ways) must each have gone to an encoder that
    answered in this request."""
    storage = with_file(tmp_path, "h0")
    with_file(tmp_path, "h1")

    def encode(seq: int, uuid: str) -> TapRecord:
        record = encoder(seq, {uuid: ENTRY})
        record.uuids = [uuid]
        return record

    def consume(uuids: list[str]) -> TapRecord:
        record = consumer(9, "pd")
        record.part_types = ["image_embeds"] * len(uuids)
        record.metadata_only = [True] * len(uuids)
        record.uuids = list(uuids)
        return record

    twice = [encode(0, "h0"), encode(1, "h0"), consume(["h0", "h1"])]
    guard = check_encoder_output(TransferEvidence.from_taps(twice, media_count=2), storage)
    assert guard.ok is False and "h1" in guard.evidence, guard.evidence
    each = [encode(0, "h0"), encode(1, "h1"), consume(["h0", "h1"])]
    assert check_encoder_output(TransferEvidence.from_taps(each, media_count=2), storage).ok
    # One image twice in a request: one uuid, two items, one encoder call for both.
    same = encoder(0, {"h0": {**ENTRY, "item_indices": [0, 1]}})
    same.uuids = ["h0", "h0"]
    duplicated = [same, consume(["h0", "h0"])]
    assert check_encoder_output(TransferEvidence.from_taps(duplicated, 2), storage).ok


def test_an_encoder_part_without_a_uuid_leaves_the_consumers_items_unjudged(
    tmp_path: Path,
) -> None:
    """A proxy that sends the encoder no uuid (the part's hash is then vLLM's own) names its
    item in no way the consumer's uuid can be matched with: nothing is claimed either way,
    else every such proxy's consumer items read as never encoded."""
    storage = with_file(tmp_path, "h0")
    anonymous = encoder(0, {"h0": ENTRY})
    anonymous.uuids = [None]
    consumed = consumer(1, "pd")
    consumed.uuids = ["h0"]
    evidence = TransferEvidence.from_taps([anonymous, consumed], media_count=1)
    guard = check_encoder_output(evidence, storage)
    assert guard.ok, guard.evidence


def test_only_the_consumers_metadata_only_parts_must_have_been_encoded(tmp_path: Path) -> None:
    """A raw media part the consumer got (it encodes that item itself; `consumer_embeds` is
    the guard that judges it) is no claim that an encoder produced it: its uuid going to no
    encoder is not the encoder guard's failure."""
    storage = with_file(tmp_path, "h0")
    encoded = encoder(0, {"h0": ENTRY})
    encoded.uuids = ["h0"]
    consumed = consumer(1, "pd")
    consumed.part_types = ["image_embeds", "image_url"]
    consumed.metadata_only = [True, False]
    consumed.uuids = ["h0", "h1"]
    evidence = TransferEvidence.from_taps([encoded, consumed], media_count=1)
    guard = check_encoder_output(evidence, storage)
    assert guard.ok, guard.evidence


def test_an_item_only_an_encoder_without_metadata_was_sent_fails_the_encoder_guard(
    tmp_path: Path,
) -> None:
    """Two images: the first sent to two encoders that both answered its metadata, the second
    to one that answered none (it did not encode it). Counted per call the items add up and
    the second's file may be in the storage from an earlier case; the consumer's second
    metadata-only part was still encoded by no one in this request."""
    storage = with_file(tmp_path, "h0")
    with_file(tmp_path, "h1")
    first, again = encoder(0, {"h0": ENTRY}), encoder(1, {"h0": ENTRY})
    first.uuids, again.uuids = ["h0"], ["h0"]
    empty = encoder(2, {})
    empty.uuids = ["h1"]
    consumed = consumer(3, "pd")
    consumed.part_types = ["image_embeds"] * 2
    consumed.metadata_only = [True, True]
    consumed.uuids = ["h0", "h1"]
    evidence = TransferEvidence.from_taps([first, again, empty, consumed], media_count=2)
    guard = check_encoder_output(evidence, storage)
    assert guard.ok is False and "h1 as metadata" in guard.evidence, guard.evidence


def test_one_encoder_part_without_a_uuid_leaves_the_consumers_items_unjudged(
    tmp_path: Path,
) -> None:
    """Some encoder parts with a uuid and one without: the one without names its item in no
    way the consumer's uuid can be matched with, so nothing is claimed either way (not only
    when every part lacks one)."""
    storage = with_file(tmp_path, "h0")
    with_file(tmp_path, "h1")
    anonymous = encoder(0, {"h0": ENTRY})
    anonymous.uuids = [None]
    named = encoder(1, {"h1": ENTRY})
    named.uuids = ["h1"]
    consumed = consumer(2, "pd")
    consumed.part_types = ["image_embeds"] * 2
    consumed.metadata_only = [True, True]
    consumed.uuids = ["h0", "h1"]
    evidence = TransferEvidence.from_taps([anonymous, named, consumed], media_count=2)
    guard = check_encoder_output(evidence, storage)
    assert guard.ok, guard.evidence


def test_a_text_only_request_on_an_epd_topology_has_no_ec_guards() -> None:
    """No media, nothing for an encoder to do: no EC guard at all, rather than two that hold
    on nothing and make a text-only MATCH look encoder-guarded."""
    records = [consumer(0, "pd", cached=None)]
    records[0].part_types, records[0].metadata_only = [], []
    evidence = TransferEvidence.from_taps(records, media_count=0)
    guards = check_transfers(get_topology("1E+1PD"), evidence, cached_answer(89, None), None, 32)
    assert [g.name for g in guards] == []


def test_d_calls_of_several_requests_in_one_window_are_no_ones_kv_evidence() -> None:
    """vLLM's toy P/D proxy sends its own id (one uuid per client request) to P and D, so a
    request's records are its window's; under load the window also holds the calls of the
    requests in flight beside it. D's last answer there was another request's: reading it
    passed a request whose KV never reached D on its neighbour's cached tokens."""

    def call(seq: int, role: str, request_id: str, cached: int) -> TapRecord:
        record = consumer(seq, role, cached=cached)
        record.request_id = request_id
        return record

    window = [
        call(0, "prefill", "uuid-a", 0),
        call(1, "prefill", "uuid-b", 0),
        call(2, "decode", "uuid-a", 0),  # this request's: its KV never arrived
        call(3, "decode", "uuid-b", 64),  # the neighbour's, answered later
    ]
    mine = records_of(window, "load-req-a")
    assert mine == window  # nothing carries the client's id: the window is all there is
    evidence = TransferEvidence.from_taps(mine, 0)
    guard = check_kv_transfer(cached_answer(89, 64), block_size=32, evidence=evidence)
    assert not guard.ok and not guard.checkable, guard
    assert "2 requests" in guard.evidence, guard.evidence
    # One request's calls alone (sent one at a time), or a retry of one request at D: its own.
    alone = TransferEvidence.from_taps([call(0, "prefill", "u", 0), call(1, "decode", "u", 64)], 0)
    assert check_kv_transfer(cached_answer(89, None), block_size=32, evidence=alone).ok
    retried = [call(1, "decode", "req-a", 0), call(2, "decode", "req-a", 64)]
    evidence = TransferEvidence.from_taps(records_of(retried, "req-a"), 0)
    assert check_kv_transfer(cached_answer(89, None), block_size=32, evidence=evidence).ok


def test_under_nixl_d_calls_of_several_requests_in_one_window_hold_no_kv_guard_either() -> None:
    """The toy proxy's window under load, as above, with NixlConnector: D's p2p counter over
    the window grew by both requests' prompts, the neighbour's among them. Found in review:
    the whole-prompt rule read that growth as this request's transfer and held."""
    window = [consumer(0, "prefill"), consumer(1, "prefill"), consumer(2, "decode", cached=0)]
    window += [consumer(3, "decode", cached=0)]
    for record, request_id in zip(window, ("uuid-a", "uuid-b", "uuid-a", "uuid-b")):
        record.request_id = request_id
    evidence = TransferEvidence.from_taps(records_of(window, "load-req-a"), 0)
    counters = {"p2p_cached_tokens": 89.0, "nixl_transfers": 1.0, "nixl_failed_transfers": 0.0}
    guard = check_kv_transfer(
        cached_answer(89, 0), 32, KvRule.WHOLE_PROMPT, counters, evidence=evidence
    )
    assert not guard.ok and not guard.checkable, guard
    assert "2 requests" in guard.evidence, guard.evidence


def test_d_calls_without_ids_in_one_window_are_no_ones_kv_evidence() -> None:
    """A proxy that sends D no request id leaves nothing to tell a retry from a neighbour's
    call: two id-less calls at D in one window are no request's evidence either (read as one
    request's, the neighbour's cached tokens held this one's guard)."""
    first, second = consumer(2, "decode", cached=0), consumer(3, "decode", cached=64)
    first.request_id = second.request_id = None
    evidence = TransferEvidence.from_taps([first, second], 0)
    guard = check_kv_transfer(cached_answer(89, 64), block_size=32, evidence=evidence)
    assert not guard.ok and not guard.checkable, guard


def test_an_encoder_that_refused_its_work_was_not_used() -> None:
    """Only an encoder that answered (200) took the work: one that refused it (a 500 at its
    tap) proves nothing of round robin. Found in review: a mutant that counted any tap record
    of an encoder as its work survived every test."""
    from types import SimpleNamespace

    from harness.outcomes.outcome import Outcome
    from harness.run.matrix import check_every_encoder_used
    from harness.spec.topology import Role

    session = SimpleNamespace(
        instances=[
            SimpleNamespace(name="t/encoder0", role=Role.ENCODER),
            SimpleNamespace(name="t/encoder1", role=Role.ENCODER),
        ]
    )
    first = Outcome("image", taps=[encoder(0, {"h": ENTRY})])
    refused = encoder(1, None)
    refused.instance, refused.status = "t/encoder1", 500
    check = check_every_encoder_used(session, [first, Outcome("image", taps=[refused])])
    assert check.ok is False
    assert "received work: ['t/encoder0']" in check.evidence
