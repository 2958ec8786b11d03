"""A load's account: every request's verdict, and the figures of the run as a whole.

Per run: verdict counts (also by where each request's media landed), throughput, latency
p50/p99 end to end and per role (read at the instances' taps: what each instance took for
the request), time to the first token of streamed answers, EC and KV storage growth, each
instance's RSS and open files before and after, and for a soak their growth rates and the
bounds they were held to. `load.md` and `load.json` in the run directory carry all of it.

A soak of hours judges hundreds of thousands of requests. Each answer (ids, top log-probs,
text, and its record) held ~48 KB, measured on the fake vLLM's 32-token answers, and listing
each one in load.json and load.md, rewritten every round, made a round cost what the soak had
done so far. So every request judged is counted as it is (`LoadTally`: counts, token totals,
and every latency, 8 bytes each, for exact percentiles) and reduced to its `RequestRow`, the
compact line `load-requests.jsonl` appends; only the requests worth reading whole are kept and
listed (which: `harness.run.load.result`). A soak's resource samples and the bounds they are held
to: `harness.report.resources`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harness.judge.guards import GuardResult
from harness.judge.records import CaseRecord
from harness.outcomes.outcome import Outcome
from harness.report.resources import MIB, SAMPLES_FILE, Growth, ResourceHistory, rate

REQUESTS_FILE = "load-requests.jsonl"  # every request judged, one line each, appended per round
KV_ACCOUNTS_FILE = "load-kv-accounts.jsonl"  # every round's KV account (NIXL), one line each
# Of the requests (and KV accounts) that did not pass, how many a load keeps whole per prompt and
# verdict (per load): a broken build soaked for hours fails every request, ~48 KB each whole.
FAILURES_KEPT_WHOLE = 20


@dataclass
class LoadRequestResult:
    """One request of a load, sent and judged, whole: its answer and its record."""

    number: int
    prompt: str
    region: str  # harness.spec.load.Region value: where its media end
    outcome: Outcome
    record: CaseRecord  # against the baseline's answer to its own prompt
    batched: bool  # in flight together with another request
    started_s: float  # since the load began
    ended_s: float
    not_sent: bool = False  # the load ended before it (an instance died): never sent
    round_number: int = 1  # of a soak's rounds (the requests sent alone: the last round's)

    def row(self) -> RequestRow:
        """What the statistics and the account read of this request, without its answer."""
        answer = self.outcome.result
        stream = self.outcome.stream
        return RequestRow(
            number=self.number,
            round_number=self.round_number,
            prompt=self.prompt,
            region=self.region,
            verdict=self.record.verdict.value,
            passed=self.record.policy_passed,
            detail=self.record.detail,
            batched=self.batched,
            started_s=self.started_s,
            ended_s=self.ended_s,
            seconds=self.outcome.seconds,
            answered=answer is not None,
            generated_tokens=len(answer.token_ids) if answer is not None else 0,
            first_token_s=stream.first_token_s if stream is not None else None,
            role_seconds=role_seconds(self.outcome),
            not_sent=self.not_sent,
        )

    def to_json(self) -> dict[str, Any]:
        return self.row().to_json()


@dataclass(frozen=True)
class RequestRow:
    """One request judged, reduced to what the statistics and the account read: its verdict,
    its times and its token count, not its answer (ids, log-probs, text) nor its record's
    references. A soak's requests that passed after its first round are only this, counted
    into the `LoadTally` and appended to load-requests.jsonl, then let go."""

    number: int
    round_number: int
    prompt: str
    region: str
    verdict: str  # harness.judge.records.Verdict value
    passed: bool  # by its policy
    detail: str
    batched: bool
    started_s: float
    ended_s: float
    seconds: float  # end to end, as the client timed it
    answered: bool  # an answer came back (not an error, not unsent)
    generated_tokens: int
    first_token_s: float | None  # streamed answers only
    role_seconds: dict[str, float]  # the longest call per role, at the taps
    not_sent: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "round": self.round_number,
            "prompt": self.prompt,
            "region": self.region,
            "verdict": self.verdict,
            "passed": self.passed,
            "detail": self.detail,
            "batched": self.batched,
            "started_s": round(self.started_s, 3),
            "ended_s": round(self.ended_s, 3),
            "seconds": round(self.seconds, 3),
            "generated_tokens": self.generated_tokens,
            "first_token_s": _round(self.first_token_s),
            "role_seconds": self.role_seconds,
            "not_sent": self.not_sent,
        }


@dataclass(frozen=True)
class Percentiles:
    count: int
    p50: float | None
    p99: float | None
    max: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        return cls.of_sorted(sorted(values))

    @classmethod
    def of_sorted(cls, ordered: Sequence[float] | np.ndarray) -> Percentiles:
        if not len(ordered):
            return cls(0, None, None, None)
        return cls(
            len(ordered), percentile(ordered, 50), percentile(ordered, 99), float(ordered[-1])
        )

    def describe(self) -> str:
        if not self.count:
            return "-"
        return f"p50 {self.p50:.3f}s, p99 {self.p99:.3f}s, max {self.max:.3f}s (n={self.count})"


def percentile(ordered: Sequence[float] | np.ndarray, p: float) -> float:
    """The nearest-rank percentile of sorted values: the smallest value with at least p% of
    the values at or below it."""
    if not len(ordered):
        raise ValueError("no values")
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return float(ordered[rank - 1])


class LatencySeries:
    """Every value of one latency over a load, held sorted for exact nearest-rank percentiles:
    8 bytes a value, where a kept answer cost ~48 KB. Values added since the figures were last
    read are merged in when they are read again (a sort of the new ones and one copy of the
    rest), so a soak's account, rewritten every round, never sorts its whole past again."""

    def __init__(self) -> None:
        self._sorted = np.empty(0, dtype=np.float64)
        self._pending: list[float] = []

    def add(self, value: float) -> None:
        self._pending.append(value)

    def __len__(self) -> int:
        return len(self._sorted) + len(self._pending)

    def ordered(self) -> np.ndarray:
        """Every value, ascending."""
        if self._pending:
            new = np.sort(np.asarray(self._pending, dtype=np.float64))
            self._sorted = np.insert(self._sorted, np.searchsorted(self._sorted, new), new)
            self._pending = []
        return self._sorted

    def percentiles(self) -> Percentiles:
        return Percentiles.of_sorted(self.ordered())


def role_seconds(outcome: Outcome) -> dict[str, float]:
    """What each role took for one request, read at the taps: the longest call per role
    (a request's encoder calls run side by side)."""
    seconds: dict[str, float] = {}
    for record in outcome.taps or ():
        if record.status is None and record.error is None:
            continue  # never answered
        seconds[record.role] = round(max(seconds.get(record.role, 0.0), record.seconds), 4)
    return seconds


@dataclass
class LoadStats:
    """The figures of one load."""

    requests: int
    sent: int
    verdicts: dict[str, int]
    passed: int
    wall_s: float
    requests_per_s: float
    tokens_per_s: float
    end_to_end: Percentiles
    by_role: dict[str, Percentiles]
    first_token: Percentiles
    by_region: dict[str, dict[str, int]]
    batched: int
    instances: dict[str, dict[str, Growth]] = field(default_factory=dict)  # name -> rss/fds
    storage: dict[str, dict[str, Growth]] = field(default_factory=dict)  # kind -> files/bytes


@dataclass
class LoadTally:
    """Every request of a load, counted as it is judged: what `load_stats` reads, so the
    figures are exact over every request however few of them a soak keeps whole. Its size
    grows by the latencies alone (a few floats a request)."""

    requests: int = 0
    sent: int = 0
    answered: int = 0
    passed: int = 0
    batched: int = 0  # sent and in flight with another
    generated_tokens: int = 0  # over the answered
    first_started_s: float | None = None  # of the sent
    last_ended_s: float | None = None
    verdicts: Counter[str] = field(default_factory=Counter)
    by_region: dict[str, Counter[str]] = field(default_factory=dict)
    end_to_end: LatencySeries = field(default_factory=LatencySeries)  # the answered
    by_role: dict[str, LatencySeries] = field(default_factory=dict)
    first_token: LatencySeries = field(default_factory=LatencySeries)  # streamed answers

    @classmethod
    def of(cls, rows: Iterable[RequestRow]) -> LoadTally:
        tally = cls()
        for row in rows:
            tally.add(row)
        return tally

    def add(self, row: RequestRow) -> None:
        self.requests += 1
        self.passed += row.passed
        self.verdicts[row.verdict] += 1
        self.by_region.setdefault(row.region, Counter())[row.verdict] += 1
        if row.not_sent:
            return
        self.sent += 1
        self.batched += row.batched
        if self.first_started_s is None or row.started_s < self.first_started_s:
            self.first_started_s = row.started_s
        if self.last_ended_s is None or row.ended_s > self.last_ended_s:
            self.last_ended_s = row.ended_s
        if not row.answered:
            return
        self.answered += 1
        self.generated_tokens += row.generated_tokens
        self.end_to_end.add(row.seconds)
        for role, seconds in row.role_seconds.items():
            self.by_role.setdefault(role, LatencySeries()).add(seconds)
        if row.first_token_s is not None:
            self.first_token.add(row.first_token_s)


# Where D takes a prompt's tokens from, as its counters name them (`harness.serve.kv_metrics`).
KV_SOURCES = ("p2p_cached_tokens", "local_cache_hit_tokens", "local_compute_tokens")


@dataclass
class KvAccountLog:
    """A load's KV accounts (under NIXL, one a round: D's counters over the whole round), each
    counted and each a line of load-kv-accounts.jsonl. Kept whole are the first round's and
    the first `FAILURES_KEPT_WHOLE` that failed: a broken build soaked for hours fails every
    round's."""

    rounds: int = 0
    held: int = 0
    failed: int = 0
    not_checkable: int = 0  # D held every prompt itself: nothing had to move
    kept: list[tuple[int, GuardResult]] = field(default_factory=list)  # (round, account)
    kept_failed: int = 0  # of `kept`, those that failed
    # Over every round, where D took its prompt tokens from (`KV_SOURCES`): a load's prompts
    # repeat into D's warm prefix cache, and the first round's figures alone read as if every
    # round moved its KV (real vLLM, a NIXL soak: rounds 2-26 took 122 of 1402 tokens from P,
    # 1280 from D's own cache).
    sources: dict[str, float] = field(default_factory=dict)
    sourced_rounds: int = 0  # the rounds whose counters were read, summed in `sources`

    def add(
        self, round_number: int, account: GuardResult, counters: Mapping[str, float] | None = None
    ) -> bool:
        """Count a round's account (and D's counters over it, when read); whether it is kept
        whole."""
        if counters is not None:
            self.sourced_rounds += 1
            for key in KV_SOURCES:
                self.sources[key] = self.sources.get(key, 0.0) + counters.get(key, 0.0)
        self.rounds += 1
        self.held += account.ok
        self.failed += account.failed
        self.not_checkable += not account.checkable
        keep = not self.kept or (account.failed and self.kept_failed < FAILURES_KEPT_WHOLE)
        if keep:
            self.kept.append((round_number, account))
            self.kept_failed += account.failed
        return keep

    @property
    def failed_unlisted(self) -> int:
        return self.failed - self.kept_failed

    def describe(self) -> str:
        first_round, first = self.kept[0]
        text = (
            f"KV account (D's counters over each whole round): {self.held} of {self.rounds} "
            f"round(s) held; round {first_round}: {first.evidence}"
        )
        if self.rounds > len(self.kept):
            text += (
                f"; {self.failed} failed, {self.not_checkable} not checkable; load.json lists "
                f"the first round's and the first {FAILURES_KEPT_WHOLE} that failed, every "
                f"round's is a line of {KV_ACCOUNTS_FILE}"
            )
        if self.rounds > 1 and self.sources:
            source = self.sources
            rounds = (
                f"all {self.rounds} rounds"
                if self.sourced_rounds == self.rounds
                else f"the {self.sourced_rounds} rounds whose counters were read"
            )
            text += (
                f"; over {rounds} D took {source['p2p_cached_tokens']:g} prompt "
                f"tokens from P, {source['local_cache_hit_tokens']:g} from its own prefix cache "
                f"and computed {source['local_compute_tokens']:g} itself"
            )
        return text

    def to_json(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "held": self.held,
            "failed": self.failed,
            "not_checkable": self.not_checkable,
            "prompt_tokens_by_source": self.sources,
            "file": KV_ACCOUNTS_FILE,
        }


def kv_account_line(round_number: int, account: GuardResult) -> dict[str, Any]:
    """A round's line of load-kv-accounts.jsonl (and how load.json lists one kept whole)."""
    return {"round": round_number, **account.to_json()}


def tally_of(results: Iterable[LoadRequestResult]) -> LoadTally:
    """The tally of whole results (a load that kept every request, or a test's)."""
    return LoadTally.of(result.row() for result in results)


def load_stats(tally: LoadTally, resources: ResourceHistory) -> LoadStats:
    wall = 0.0
    if tally.first_started_s is not None and tally.last_ended_s is not None:
        wall = tally.last_ended_s - tally.first_started_s
    return LoadStats(
        requests=tally.requests,
        sent=tally.sent,
        verdicts=dict(tally.verdicts),
        passed=tally.passed,
        wall_s=wall,
        requests_per_s=tally.answered / wall if wall > 0 else 0.0,
        tokens_per_s=tally.generated_tokens / wall if wall > 0 else 0.0,
        end_to_end=tally.end_to_end.percentiles(),
        by_role={role: series.percentiles() for role, series in sorted(tally.by_role.items())},
        first_token=tally.first_token.percentiles(),
        by_region={region: dict(counts) for region, counts in tally.by_region.items()},
        batched=tally.batched,
        instances=resources.instance_growth(),
        storage=resources.storage_growth(),
    )


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


# -- rendering --------------------------------------------------------------------------------


def format_load(
    title: str,
    stats: LoadStats,
    rows: Sequence[RequestRow],
    resources: ResourceHistory,
    notes: Sequence[str] = (),
    unlisted: int = 0,
    failed_unlisted: Mapping[tuple[str, str], int] | None = None,
) -> str:
    """load.md: the figures, then the resources, then one row per request listed (`unlisted`:
    how many more were judged and are counted above, each a line of load-requests.jsonl;
    `failed_unlisted`: of those, the ones that did not pass, by prompt and verdict)."""
    verdicts = ", ".join(f"{v} {n}" for v, n in sorted(stats.verdicts.items()))
    lines = [
        f"# {title}",
        "",
        f"- requests: {stats.requests} ({sent_line(stats)}); verdicts: {verdicts}; "
        f"{stats.passed}/{stats.requests} passed",
        f"- wall {stats.wall_s:.1f}s: {stats.requests_per_s:.2f} requests/s, "
        f"{stats.tokens_per_s:.1f} generated tokens/s",
        f"- latency end to end: {stats.end_to_end.describe()}",
    ]
    if stats.first_token.count:
        lines.append(f"- time to first token (streamed): {stats.first_token.describe()}")
    for role, figures in stats.by_role.items():
        lines.append(f"- {role} (at its tap): {figures.describe()}")
    lines += [f"- {note}" for note in notes]
    lines += [
        "",
        "## Verdicts by where the media end",
        "",
        "| media end in | verdicts |",
        "|---|---|",
    ]
    for region, counts in sorted(stats.by_region.items()):
        lines.append(f"| {region} | {', '.join(f'{v} {n}' for v, n in sorted(counts.items()))} |")
    lines += resource_lines(stats, resources)
    lines += ["", "## Requests", ""]
    if unlisted:
        lines += [*unlisted_lines(unlisted, failed_unlisted or {}), ""]
    lines += [
        "| # | prompt | media end in | verdict | pass | s | detail |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        detail = " ".join(row.detail.split())[:200].replace("|", "\\|")
        lines.append(
            f"| {row.number} | {row.prompt} | {row.region} | {row.verdict} | "
            f"{'yes' if row.passed else 'no'} | {row.seconds:.2f} | {detail} |"
        )
    return "\n".join(lines) + "\n"


def sent_line(stats: LoadStats) -> str:
    """How many requests went out, and of those how many shared the server with another; the
    rest never left because the load ended first (an instance died): without saying so, "16
    (8 sent, 8 in flight with another)" read as two halves of the 16."""
    line = f"{stats.sent} sent, {stats.batched} of them in flight with another"
    unsent = stats.requests - stats.sent
    if unsent:
        line += f"; {unsent} never sent: the load ended first"
    return line


def unlisted_lines(unlisted: int, failed: Mapping[tuple[str, str], int]) -> list[str]:
    """What the request list leaves out, and where it is."""
    failing = sum(failed.values())
    lines = [
        f"The first round's requests, and the first {FAILURES_KEPT_WHOLE} of each prompt and "
        f"verdict that did not pass. The {unlisted - failing} other request(s) passed after the "
        f"first round: counted in the figures above, each a line of {REQUESTS_FILE}."
    ]
    if failing:
        each = ", ".join(
            f"{prompt} {verdict} {n}" for (prompt, verdict), n in sorted(failed.items())
        )
        lines.append("")
        lines.append(
            f"{failing} more request(s) did not pass ({each}): counted in the figures above, "
            f"each a line of {REQUESTS_FILE}."
        )
    return lines


def resource_lines(stats: LoadStats, resources: ResourceHistory) -> list[str]:
    if not resources.count:
        return []
    labels = resources.labels()
    shown = (
        ", ".join(labels) if resources.count <= 4 else f"{labels[0]}, {labels[1]} ... {labels[-1]}"
    )
    lines = [
        "",
        "## Resources",
        "",
        f"Sampled {resources.count} time(s): {shown}. Rates are fitted from the second sample "
        f"on, and over the last half of the samples. Every sample is a line of {SAMPLES_FILE}; "
        "load.json lists the first, the end of the first round, the last, each storage's "
        "peak, the first with an instance down, and an evenly spaced few.",
        "",
        "| instance | RSS first | RSS last | RSS rate | last half | open files first | last | "
        "rate |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, figures in stats.instances.items():
        rss, fds = figures["rss_bytes"], figures["open_fds"]
        # Its figures are of the samples it ran in: a killed encoder's "RSS last" read as alive.
        down = resources.down_from(name)
        shown = f"{name} (down {down}: its figures are from before)" if down else name
        lines.append(
            f"| {shown} | {rss.first / MIB:.0f} MiB | {rss.last / MIB:.0f} MiB | "
            f"{rate(rss.per_minute, MIB, 'MiB')} | {rate(rss.late_per_minute, MIB, 'MiB')} | "
            f"{fds.first:.0f} | {fds.last:.0f} | {rate(fds.per_minute, 1, 'fds')} |"
        )
    if not stats.storage:  # 1P+1D under NIXL: a table of headers alone said nothing
        return [*lines, "", "Storage: none sampled (no connector here shares a directory)."]
    lines += ["", "| storage | files first | files last | bytes first | bytes last | bytes rate |"]
    lines.append("|---|---|---|---|---|---|")
    for kind, figures in stats.storage.items():
        files, size = figures["files"], figures["bytes"]
        lines.append(
            f"| {kind} | {files.first:.0f} | {files.last:.0f} | {size.first / MIB:.1f} MiB | "
            f"{size.last / MIB:.1f} MiB | {rate(size.per_minute, MIB, 'MiB')} |"
        )
    if resources.cleaned_samples:
        lines.append("")
        lines.append(
            f"Cleaned by the harness after {resources.cleaned_samples} sample(s): "
            + ", ".join(
                f"{kind} {size / MIB:.1f} MiB" for kind, size in resources.cleaned_bytes.items()
            )
        )
    return lines


def stats_json(stats: LoadStats) -> dict[str, Any]:
    def growths(table: dict[str, dict[str, Growth]]) -> dict[str, Any]:
        return {
            name: {
                key: {
                    "first": g.first,
                    "last": g.last,
                    "per_minute": g.per_minute,
                    "late_per_minute": g.late_per_minute,
                }
                for key, g in figures.items()
            }
            for name, figures in table.items()
        }

    def pct(p: Percentiles) -> dict[str, Any]:
        return {"count": p.count, "p50": p.p50, "p99": p.p99, "max": p.max}

    return {
        "requests": stats.requests,
        "sent": stats.sent,
        "verdicts": stats.verdicts,
        "passed": stats.passed,
        "wall_s": round(stats.wall_s, 3),
        "requests_per_s": round(stats.requests_per_s, 3),
        "tokens_per_s": round(stats.tokens_per_s, 2),
        "end_to_end": pct(stats.end_to_end),
        "by_role": {role: pct(p) for role, p in stats.by_role.items()},
        "first_token": pct(stats.first_token),
        "by_region": stats.by_region,
        "batched": stats.batched,
        "instances": growths(stats.instances),
        "storage": growths(stats.storage),
    }
