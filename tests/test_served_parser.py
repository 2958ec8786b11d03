"""The bookkeeping of the session's one probe of the served vLLM's parser
(harness/testing/served_parser.py), with a fake probe in place of vLLM's: a line is accepted
only on the parser's word, and only the interpreter judged answers from the batch. The real
parser's verdicts are tests/test_vllm_args_model.py's (the model tier).
"""

from __future__ import annotations

import fcntl
import json
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

from harness.errors import BadInput
from harness.preflight import vllm_args
from harness.preflight.vllm_args import check_serve_argvs
from harness.testing import served_parser
from harness.testing.served_parser import ServedParser

pytestmark = pytest.mark.unit

MAGIC = "--enable-epd-magic"
GOOD = ["vllm", "serve", "/models/m", "--port", "8000"]
BAD = [*GOOD, MAGIC]


class FakeProbe:
    """`vllm_args._run_probe` for a parser that refuses MAGIC, and accepts MAGIC where
    `accepts_magic` names the interpreter; `forgets` lines it returns no verdict for (a probe
    that died part-way). Every call is kept."""

    def __init__(self, accepts_magic: Sequence[str] = (), forgets: Sequence[str] = ()) -> None:
        self.accepts_magic = set(accepts_magic)
        self.forgets = set(forgets)
        self.calls: list[tuple[tuple[str, ...], set[str]]] = []

    def __call__(
        self, interpreter: Sequence[str], argvs: dict[str, list[str]]
    ) -> tuple[dict[str, str | None], float]:
        self.calls.append((tuple(interpreter), set(argvs)))
        refuses = tuple(interpreter)[0] not in self.accepts_magic
        verdicts = {
            name: f"unrecognized arguments: {MAGIC}" if refuses and MAGIC in argv else None
            for name, argv in argvs.items()
            if name not in self.forgets
        }
        return verdicts, 0.1


@pytest.fixture
def fake_probe(monkeypatch: pytest.MonkeyPatch) -> FakeProbe:
    probe = FakeProbe(accepts_magic=["/other/python"], forgets=["forgotten"])
    monkeypatch.setattr(served_parser, "REAL_PROBE", probe)
    monkeypatch.setattr(vllm_args, "_run_probe", probe)  # what the checks below ask
    return probe


def test_a_line_the_probe_gave_no_verdict_is_not_accepted(fake_probe: FakeProbe) -> None:
    """A probe that ended before judging a line (killed, out of memory) leaves it unjudged:
    taken as accepted, it would be marked so for every run of the session."""
    parser = ServedParser(("/served/python",), {}, {})
    verdicts = parser.verdicts({"judged": GOOD, "forgotten": BAD})
    assert verdicts == {"judged": None, "forgotten": "no verdict"}


def test_another_interpreter_is_answered_by_its_own_probe(fake_probe: FakeProbe) -> None:
    """The batch is the served interpreter's verdicts: another vLLM (a fake, another release)
    may accept or refuse what this one did, so its lines are probed, even those the batch
    judged."""
    parser = ServedParser(("/served/python",), {}, {})
    assert parser.verdicts({"bad": BAD}) == {"bad": f"unrecognized arguments: {MAGIC}"}
    results, _seconds = parser.probe(("/other/python",), {"bad": BAD})
    assert results == {"bad": None}
    assert fake_probe.calls == [(("/served/python",), {"bad"}), (("/other/python",), {"bad"})]


def test_a_shared_batch_answers_only_the_interpreter_it_judged(
    fake_probe: FakeProbe, tmp_path: Path
) -> None:
    """The first process to need the batch leaves it in the shared directory for the others;
    a session that asks for another interpreter's parser there probes its own, else the
    other's verdicts (an unknown flag it accepts) would answer for it."""
    flagged = next(iter(served_parser.with_bundle_flag().values()))
    served = served_parser.served_parser(["/other/python"], tmp_path)
    assert served.by_line and served.probe(("/other/python",), {"x": flagged})[0] == {"x": None}
    again = served_parser.served_parser(["/other/python"], tmp_path)
    assert len(fake_probe.calls) == 1 and again.by_line == served.by_line  # read, not probed
    # main() judged nothing here (the fake probe is no vLLM): none of its verdicts is an accept.
    assert served.by_main and set(served.by_main.values()) == {"no verdict"}
    judged_apart = served_parser.served_parser(["/served/python"], tmp_path)
    assert len(fake_probe.calls) == 2
    verdict = judged_apart.probe(("/served/python",), {"x": flagged})[0]
    assert verdict == {"x": f"unrecognized arguments: {MAGIC}"}
    assert len(fake_probe.calls) == 2  # from its own batch


def test_only_the_lines_the_batch_accepted_are_marked_accepted(
    fake_probe: FakeProbe, tmp_path: Path
) -> None:
    """A run in a subprocess finds the batch's accepted lines marked in the session's
    directory and probes them no more; a line the batch refused is not marked, so a run that
    renders it is refused by the parser, not waved through."""
    parser = ServedParser(("/served/python",), {}, {})
    parser.verdicts({"good": GOOD, "bad": BAD})
    marks = tmp_path / "argv-check"
    parser.keep_accepted(marks, "0.32.0")
    assert check_serve_argvs({"good": GOOD}, ("/served/python",), "0.32.0", marks).judged == 0
    with pytest.raises(BadInput, match=f"unrecognized arguments: {MAGIC}"):
        check_serve_argvs({"bad": BAD}, ("/served/python",), "0.32.0", marks)


def test_a_process_that_needs_the_batch_while_another_probes_waits_and_reads_it(
    fake_probe: FakeProbe, tmp_path: Path
) -> None:
    """The first process to need the batch probes under the shared directory's lock; another
    (an xdist worker) waits for it and reads its verdicts, never probing the served vLLM's
    parser a second time (about 10 s each on a 2-core host). A mutant that took no lock
    survived: here the first holds the lock, as while it probes, and leaves its verdicts."""
    found: list[ServedParser] = []
    with open(tmp_path / "served-parser.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        waiter = threading.Thread(
            target=lambda: found.append(served_parser.served_parser(["/other/python"], tmp_path))
        )
        waiter.start()
        waiter.join(0.5)
        assert not found, "a second process went on while the first held the lock"
        record = {"interpreter": ["/other/python"], "by_line": {"[]": None}, "by_main": {}}
        (tmp_path / "served-parser.json").write_text(json.dumps(record))
    waiter.join(30)
    assert [parser.by_line for parser in found] == [{"[]": None}]
    assert fake_probe.calls == [], "the waiting process probed the parser again"
