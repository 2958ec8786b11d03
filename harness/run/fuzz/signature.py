"""A failure's signature: what makes two failing requests the same bug.

The verdict alone is too coarse (every crash is an ERROR) and the full evidence too fine (a
divergence index or a pid changes with the request), so a signature is the verdict, where it
showed (the instance role that died, an HTTP status, which ids differ, the guard
that failed) and the first distinguishing line of the evidence with its numbers
blanked. Failures are grouped by it, shrinking keeps it, and known failures are recognised
by it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from harness.judge.records import CaseRecord, Verdict
from harness.judge.verdicts import STREAM_CHECK

# Exception lines that only wrap the cause: an engine that died, a client that saw a 500 (the
# harness's client's ServerFailedError; the openai client's names, in runs before it went).
WRAPPERS = (
    "EngineDeadError",
    "EngineGenerateError",
    "ServerFailedError",
    "APIConnectionError",
    "APITimeoutError",
    "InternalServerError",
    "APIStatusError",
    "ConnectError",
    "ConnectionRefusedError",
    "RemoteProtocolError",
    "ServerDied",
    "ClientConnectorError",
)
_EXCEPTION = re.compile(r"\b([A-Z][\w.]*(?:Error|Exception))\b:?\s?(.*)")
_DIED = re.compile(r"instance (\S+) exited with code (-?\d+)|(\S+) \(pid \d+\) died")
_STATUS = re.compile(r"Error code: (\d{3})")
_NUMBER = re.compile(r"0x[0-9a-fA-F]+|\d+(?:\.\d+)?")
# An absolute path's directories (the run directory, a KV folder named by its key's hash), and
# a hex digest standing alone (a request id, a cache key): both vary with the request.
_DIRECTORIES = re.compile(r"/(?:[^\s/'\"(),:]+/)+")
_DIGEST = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{8,}\b")
# A uuid with its dashes (`str(uuid.uuid4())`, a proxy's request id): one digest, whose
# 4-digit groups `_DIGEST` does not take and `_NUMBER` would blank only in part.
_UUID = re.compile(r"\b[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}\b")
CAUSE_WIDTH = 160
# What `normalize` puts in place of what varies: a number, a hex digest, a path's directories.
# A cause line is the error's own text only up to the first of them.
BLANKED = re.compile(r"\bN\b|\bH\b|\.\.\./")


@dataclass(frozen=True)
class Signature:
    verdict: str
    where: str
    cause: str = ""

    @property
    def key(self) -> str:
        return " | ".join(part for part in (self.verdict, self.where, self.cause) if part)

    @property
    def slug(self) -> str:
        text = f"{self.verdict}-{self.where}-{self.cause}".lower()
        return re.sub(r"[^a-z0-9]+", "-", text).strip("-")[:60]

    def to_json(self) -> dict[str, str]:
        return {"verdict": self.verdict, "where": self.where, "cause": self.cause}


def normalize(line: str) -> str:
    """A cause line without what varies between occurrences: numbers, addresses, spacing, the
    directories of a path and hex digests (a dashed uuid one of them). With the path whole,
    one cause made as many groups as it had KV folders (seen on real vLLM: P's
    `FileNotFoundError` on two folders of one run, each group shrunk and confirmed apart,
    and the longer hash cut the line elsewhere)."""
    text = _DIGEST.sub("H", _UUID.sub("H", _DIRECTORIES.sub(".../", line)))
    text = _NUMBER.sub("N", text)
    return re.sub(r"\s+", " ", text).strip()[:CAUSE_WIDTH]


def cause_line(error: str) -> str:
    """The first exception line of the evidence that is not a mere wrapper (the assertion in
    a worker, not the EngineDeadError it became), from where the exception's name starts;
    else the error's first line."""
    fallback = ""
    for line in error.splitlines():
        match = _EXCEPTION.search(line)
        if match is None:
            continue
        name = match.group(1).rsplit(".", 1)[-1]
        text = f"{name}: {match.group(2)}".rstrip(": ")
        if name not in WRAPPERS:
            return normalize(text)
        fallback = fallback or normalize(text)
    first = next((line for line in error.splitlines() if line.strip()), "")
    return fallback or normalize(first)


def died_instance(error: str) -> str | None:
    """The instance that died ('1E+1P+1D/decode0'), if one did."""
    match = _DIED.search(error)
    return None if match is None else match.group(1) or match.group(3)


def died_role(error: str) -> str | None:
    """The role of the instance that died ('1E+1P+1D/decode0' -> 'decode'), if one did."""
    name = died_instance(error)
    return None if name is None else re.sub(r"\d+$", "", name.rsplit("/", 1)[-1])


def http_status(error: str) -> str | None:
    match = _STATUS.search(error)
    return match.group(1) if match else None


def signature_of(record: CaseRecord) -> Signature:
    verdict = record.verdict.value
    if record.verdict is Verdict.ERROR:
        error = record.error or record.detail
        role = died_role(error)
        status = http_status(error)
        where = f"{role} died" if role else (f"HTTP {status}" if status else "request failed")
        return Signature(verdict, where, cause_line(error))
    if record.verdict is Verdict.VACUOUS:
        failed = sorted(record.failed_guards())
        return Signature(verdict, f"guard {failed[0]}" if failed else "guard")
    if record.verdict in (Verdict.MISMATCH, Verdict.DRIFT):
        # A stream whose framing broke (`fuzz --stream`) is that failure whatever its ids did:
        # a duplicated chunk also shifts the ids, and grouped as "generated ids" it would
        # join, and be shrunk as, a failure of the answer itself.
        if STREAM_CHECK in record.failed_guards():
            return Signature(verdict, STREAM_FRAMING)
        return Signature(verdict, ids_kind(record.detail))
    return Signature(verdict, "")


# Where a MISMATCH or DRIFT of a stream whose framing broke showed (`signature_of`).
STREAM_FRAMING = "stream framing"

_PROMPT_IDS = re.compile(
    r"^prompt ids differ at position \d+ \(reference (\d+) ids, candidate (\d+) ids\)"
)


def ids_kind(detail: str) -> str:
    """Which ids a comparison's headline (`TokenComparison.headline`) says differ: prompt ids of
    another count (the placeholders sized otherwise) or of the same count, or generated ids.
    Every prompt-ids MISMATCH had one signature, so the two kinds made one group and only its
    first was shrunk (found in review). Generated ids stay one kind whatever the position of
    their first difference: the same fault diverges at token 7 of a long request and at token 0
    of its shrunk one (docs/fuzzing.md, kv-noise), and a shrink must keep the signature."""
    prompt = _PROMPT_IDS.match(detail)
    if prompt is not None:
        return "prompt ids, " + ("same count" if prompt[1] == prompt[2] else "another count")
    if detail.startswith("prompt ids differ"):
        return "prompt ids"
    return "generated ids"


def is_failure(record: CaseRecord) -> bool:
    """A verdict that blames the topology: not MATCH, not a DRIFT the run's reference policy
    accepts (a P->D topology on GPUs under pd-drift; found in review: it was grouped as a new
    failure, and --save would have declared it an upstream bug), and not a baseline that
    disagreed with itself (that is the reference's problem, counted apart)."""
    if record.verdict is Verdict.DRIFT and record.policy_passed:
        return False
    # Failed exactly as a declaration the judging path applies itself says (vLLM's toy P/D
    # proxy streams as application/json: `proxy_failure`), as `run` passes it; grouped, every
    # example of `fuzz --stream --proxy vllm` on 1P+1D was one "new" failure (real vLLM).
    if record.policy_passed and record.declared_failure:
        return False
    return record.verdict not in (Verdict.MATCH, Verdict.UNSTABLE_BASELINE)
