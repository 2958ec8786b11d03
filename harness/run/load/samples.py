"""A soak's resource samples: before the first round and after each, with nothing in flight,
every instance's RSS and open files and the connectors' storage; then, between rounds, the KV
storage cleaned (ExampleConnector keys files by prompt and writes them again when they are
missing). The EC storage is not cleaned: an encoder that still holds an item's embeddings in
memory does not encode it again, so it does not write the file again either (vLLM 0.32
`Scheduler._try_schedule_encoder_inputs` asks its encoder cache before the connector).
Measured: after the EC storage of a served image was emptied, the same image was answered
right (the consumer held the embeddings too) with no file written, so the `encoder_output`
guard had nothing to hold and the case was VACUOUS. With a fixed mix the EC storage holds one
file per item and does not grow."""

from __future__ import annotations

from pathlib import Path

from harness.files import append_json_lines
from harness.outcomes.load import ResourceSample
from harness.report.resources import SAMPLES_FILE, sample_line
from harness.run.load.result import LoadResult
from harness.run.load.sessions import Session, launched
from harness.serve.usage import clean_storage, storage_usage, tree_pids, tree_usage
from harness.spec.connectors import kv_connector_for_class


def sample_resources(
    session: Session,
    label: str,
    at_s: float,
    result: LoadResult,
    run_dir: Path,
    clean_kv: bool = False,
) -> None:
    """Every instance's RSS and open files and the connectors' storage, then (`clean_kv`:
    between a soak's rounds) the KV storage cleaned; counted into the load's resource history
    and appended to load-samples.jsonl. The first sample ("before") records every instance's
    process tree too."""
    base = launched(session)
    sample = ResourceSample(at_s=round(at_s, 2), requests_done=result.tally.sent, label=label)
    if base is not None:
        for server in base.servers:
            sample.instances[server.name] = tree_usage(server.pid)
            if label == "before":
                result.processes += tree_pids(server.pid)
    for kind in ("ec", "kv"):
        storage = _storage_of(session, kind)
        if storage is not None:
            sample.storage[kind] = storage_usage(storage)
    kv = _storage_of(session, "kv")
    if clean_kv and kv is not None:
        sample.cleaned["kv"] = clean_storage(kv)
    number = result.resources.add(sample)
    append_json_lines(run_dir / SAMPLES_FILE, [sample_line(number, sample)])


def _storage_of(session: Session, kind: str) -> Path | None:
    """The directory a connector of `kind` shares files in; None where it shares none. NIXL
    keeps the KV in P's memory: its topology's KV directory stays empty, and load.md's row of
    zero KV files read as if no KV had moved (real vLLM, `load --kv-connector nixl`)."""
    if kind == "ec":
        return session.ec_storage
    known = kv_connector_for_class(session.settings.serving.kv_connector)
    return session.kv_storage if known is None or known.uses_shared_storage else None
