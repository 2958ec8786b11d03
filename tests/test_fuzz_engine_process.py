"""The fuzz engine end to end against the fake vLLM (harness/testing/fake_vllm.py): examples sent to
a baseline and a topology kept up side by side, judged, grouped, shrunk, and written as bundles
repro takes.

The fake encoder publishes no metadata, so every media request reaches the consumer as raw
media and the transfer guards fail: a VACUOUS verdict that shrinking must keep. What the fake
answers proves nothing about vLLM; this checks the engine's own bookkeeping only.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.judge.records import Verdict
from harness.run.fuzz.bundle import write_examples, write_fuzz_bundle
from harness.run.fuzz.engine import FuzzEngine
from harness.run.fuzz.shrink import ShrinkBudget
from harness.run.fuzz.space import FuzzSpace
from harness.run.fuzz.strategies import FuzzExample
from harness.run.repro import Bundle
from harness.spec.prompts import MEDIA_PARTS, ImagePart, PromptSpec, TextPart
from harness.spec.topology import TOPOLOGIES
from harness.testing.fake_vllm import fake_run_settings

pytestmark = pytest.mark.process


def test_the_engine_judges_groups_shrinks_and_bundles(
    tmp_path: Path, fake_vllm: Path, port_locks: Path
) -> None:
    settings = fake_run_settings(tmp_path, fake_vllm, request_timeout_s=30.0)
    examples = [
        FuzzExample(PromptSpec("ex-0000", (TextPart(" a b"),))),
        FuzzExample(
            PromptSpec(
                "ex-0001",
                (TextPart(" one two three"), ImagePart(1, (112, 112)), ImagePart(2, (56, 56))),
                max_tokens=6,
            )
        ),
        FuzzExample(PromptSpec("ex-0002", (ImagePart(3, (56, 56)), TextPart(" x")), 4)),
    ]
    topology = TOPOLOGIES["1E+1PD"]
    write_examples(settings.run_dir, examples, {"seed": 0, "space": FuzzSpace().to_json()})
    # The planted drop-metadata makes every request with media VACUOUS (its consumer gets the
    # raw media): the failure to group and shrink.
    budget = ShrinkBudget(max_trials=30)
    with FuzzEngine(settings, topology, fault="drop-metadata", budget=budget) as engine:
        report = engine.run(examples)
    assert report.counts() == {"MATCH": 1, "VACUOUS": 2}
    # Unstreamed unless asked (`fuzz --stream`): no stream framing to judge.
    assert all(e.candidate.stream is None for e in report.evaluations), "streamed unasked"
    (group,) = report.groups
    assert group.signature.verdict == Verdict.VACUOUS.value and not group.known
    assert group.start.spec.name == "ex-0002", "shrinking starts from the smallest member"
    minimal = group.minimal.spec
    assert [type(p) for p in minimal.parts if isinstance(p, MEDIA_PARTS)] == [ImagePart]
    assert minimal.max_tokens == 1 and group.shrink.restarts == 0
    meta = {"topology": topology.name, "seed": 0, "vllm": "unknown", "kv_connector": "x"}
    (bundle_dir,) = write_fuzz_bundle(settings, topology, report, meta, None)
    case = Bundle.load(bundle_dir).pick_case(None)
    assert (case.topology, case.prompt, case.verdict) == ("1E+1PD", minimal.name, "VACUOUS")
    top = Bundle.load(settings.run_dir)
    assert top.pick_case(None).prompt == minimal.name, "the minimal request comes first"
    fuzz = json.loads((settings.run_dir / "fuzz.json").read_text())
    assert fuzz["new_failures"] == 1 and len(fuzz["examples"]) == 3
    assert fuzz["timing"]["per_judged_example_mean_s"] is not None
    assert "Minimal request" in (settings.run_dir / "fuzz.md").read_text()


def test_a_streamed_fuzz_streams_to_the_topology_and_judges_the_framing(
    tmp_path: Path, fake_vllm: Path, port_locks: Path
) -> None:
    """`fuzz --stream`: every example reaches the topology streamed (the baseline answers
    unstreamed) and its framing is judged, so a planted duplicated chunk is a failure the run
    finds; the bundle says it streamed, so `repro` streams its case again."""
    settings = fake_run_settings(tmp_path, fake_vllm, request_timeout_s=30.0, stream=True)
    examples = [
        FuzzExample(PromptSpec("ex-0000", (TextPart(" a b"),), max_tokens=4)),
        FuzzExample(PromptSpec("ex-0001", (TextPart(" one two three"),), max_tokens=6)),
    ]
    topology = TOPOLOGIES["1E+1PD"]  # text alone: MATCH on the fake
    write_examples(settings.run_dir, examples, {"seed": 0, "space": FuzzSpace().to_json()})
    with FuzzEngine(settings, topology, budget=ShrinkBudget(max_trials=0)) as engine:
        report = engine.run(examples)
    assert report.counts() == {"MATCH": 2}
    assert all(e.candidate.stream is not None for e in report.evaluations), "not streamed"
    assert all(e.baseline.stream is None for e in report.evaluations), "the baseline streamed"
    planted = fake_run_settings(
        tmp_path / "planted", fake_vllm, request_timeout_s=30.0, stream=True
    )
    write_examples(planted.run_dir, examples, {"seed": 0, "space": FuzzSpace().to_json()})
    budget = ShrinkBudget(max_trials=0)
    with FuzzEngine(planted, topology, fault="stream-duplicate-chunk", budget=budget) as engine:
        report = engine.run(examples)
    assert report.counts() == {"MISMATCH": 2}, report.counts()
    assert all(e.record.detail.startswith("stream framing broken: ") for e in report.evaluations), [
        e.record.detail for e in report.evaluations
    ]
    meta = {"topology": topology.name, "seed": 0, "vllm": "unknown", "kv_connector": "x"}
    write_fuzz_bundle(planted, topology, report, meta, None)
    assert json.loads((planted.run_dir / "run.json").read_text())["stream"] is True


def test_the_command_line_imports_without_hypothesis() -> None:
    """In a fresh interpreter: this one has imported Hypothesis already."""
    code = (
        "import sys; sys.modules['hypothesis'] = None\n"
        "from harness.cli.main import build_parser; build_parser()"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("dies", "p_holds", "d_holds"), [("prefill", 0, 1), ("decode", 3, 0)], ids=["P", "D"]
)
def test_an_instance_that_died_is_revived_and_only_its_prefix_cache_forgotten(
    tmp_path: Path,
    fake_vllm: Path,
    port_locks: Path,
    monkeypatch: pytest.MonkeyPatch,
    dies: str,
    p_holds: int,
    d_holds: int,
) -> None:
    """Whether a later request kills P or D depends on what each one's prefix cache holds
    (harness/run/fuzz/consumer.py): the engine forgets only the revived instance's. The fake's
    `die-request` exits on an instance's first request, so the dying role dies on both
    examples and is revived between them; a D is never asked what a dead P was. Both caches
    hold an earlier prompt before the first example, so a revival that forgot nothing, or the
    wrong instance's cache, fails (found in review: a dying role had cached nothing, so the
    check held with the forgetting removed)."""
    from harness.run.fuzz.consumer import SentPrompt
    from harness.testing.fake_vllm import MODE_ENV

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"image_token_id": 151655, "video_token_id": 151656}')
    monkeypatch.setenv(MODE_ENV, f"{dies}:die-request")
    settings = fake_run_settings(tmp_path, fake_vllm, request_timeout_s=30.0)
    words = " ".join(f"w{i}" for i in range(40))
    examples = [FuzzExample(PromptSpec(f"ex-000{i}", (TextPart(f" {i} {words}"),))) for i in (0, 1)]
    with FuzzEngine(settings, TOPOLOGIES["1P+1D"]) as engine:
        earlier = SentPrompt(tuple(range(100, 164)))
        engine.consumer.prefill_cached.append(earlier)
        engine.consumer.cached.append(earlier)
        verdicts = [engine.evaluate(example.spec).record.verdict for example in examples]
    assert verdicts == [Verdict.ERROR, Verdict.ERROR]
    assert [r["how"] for r in engine.report_restarts] == ["revived"]
    assert dies in engine.report_restarts[0]["why"]
    assert len(engine.consumer.prefill_cached) == p_holds
    assert len(engine.consumer.cached) == d_holds
    # A P that died on a request stored nothing (it stores as its forward pass runs).
    assert len(engine.consumer.stored) == (0 if dies == "prefill" else 2)


def test_an_engine_on_a_shared_pool_leaves_no_fault_planted_when_it_closes(
    tmp_path: Path, fake_vllm: Path, port_locks: Path
) -> None:
    """Found in review: a fuzz with a planted fault on the run's pool (a pytest session's) left
    the fault in the topology's proxy when it closed, so every later request to that running
    topology, another scenario's, was served broken."""
    from harness.run.pool import TopologyPool
    from harness.serve.proxy import ProxyFaults

    settings = fake_run_settings(tmp_path, fake_vllm, request_timeout_s=30.0)
    topology = TOPOLOGIES["1E+1PD"]
    pool = TopologyPool(settings)
    try:
        with FuzzEngine(settings, topology, fault="drop-metadata", pool=pool) as engine:
            assert engine.session is not None and engine.session.faults.drop_encoder_metadata
        assert pool.session(topology).faults == ProxyFaults()
    finally:
        pool.close()


def test_a_layout_read_while_d_is_down_counts_on_nothing_in_its_prefix_cache(
    tmp_path: Path, fake_vllm: Path, port_locks: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request's layout (what D holds, which earlier request a bundle replays for it) is
    read from the storage model when the baseline answers, before the topology is sent it;
    a D that died on the request before is revived only then, with an empty prefix cache.
    The model forgot D's cache at the revival, after the layout had counted on it: the
    example was judged and recognised (and replayed) as if D held an earlier prompt it no
    longer had (found in review)."""
    from harness.run.fuzz.consumer import SentPrompt
    from harness.testing.fake_vllm import MODE_ENV

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"image_token_id": 151655, "video_token_id": 151656}')
    monkeypatch.setenv(MODE_ENV, "decode:die-request")
    settings = fake_run_settings(tmp_path, fake_vllm, request_timeout_s=30.0)
    words = " ".join(f"w{i}" for i in range(40))
    dying, later = (PromptSpec(f"ex-000{i}", (TextPart(f" {i} {words}"),)) for i in (0, 1))
    with FuzzEngine(settings, TOPOLOGIES["1P+1D"]) as engine:
        ids = tuple(engine.ask_baseline(later).baseline.result.prompt_token_ids)
        engine.consumer.cached.append(SentPrompt(ids, name="ex-early"))
        assert engine.ask_baseline(later).layout.consumer_holds > 0, "D holds it while up"
        assert engine.evaluate(dying).record.verdict is Verdict.ERROR
        assert engine.topology_dead() is not None
        layout = engine.ask_baseline(later).layout
    assert layout.consumer_holds == 0, "D comes back with an empty prefix cache"
