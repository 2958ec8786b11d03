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
listed (which: `harness.run.load`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harness.judge.records import CaseRecord
from harness.outcomes.load import ResourceSample
from harness.outcomes.outcome import Outcome

MIB = 2**20
REQUESTS_FILE = "load-requests.jsonl"  # every request judged, one line each, appended per round


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
class SoakBounds:
    """What a soak must stay under to pass. Storage is bounded because the harness cleans what
    it can between rounds; RSS and open files are measured from the end of the first round
    (start-up and warm-up allocations are no leak) to the end of the soak."""

    storage_bytes: int = 512 * MIB  # per storage, at any sample
    rss_growth_bytes: int = 256 * MIB  # per instance
    fd_growth: int = 64  # per instance


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


@dataclass(frozen=True)
class Growth:
    """How one quantity moved over a load: first, last, and the rate fitted over the samples
    after the first (start-up is not growth), and over the last half of them: a cache that
    fills levels off, so its late rate falls; a leak keeps its rate."""

    first: float
    last: float
    per_minute: float | None  # least squares; None with fewer than two samples after warm-up
    late_per_minute: float | None = None  # the same over the last half of the samples

    @property
    def change(self) -> float:
        return self.last - self.first


def growth(points: Sequence[tuple[float, float]]) -> Growth:
    """`points` (seconds, value), in time order; the rate is fitted from the second point on,
    the late rate over the last half."""
    if not points:
        return Growth(0.0, 0.0, None)
    fitted = list(points[1:])
    late = fitted[len(fitted) // 2 :]
    return Growth(
        points[0][1], points[-1][1], _slope(fitted), _slope(late) if len(late) >= 3 else None
    )


def _slope(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares change per minute; None with fewer than two points or no time between."""
    if len(points) < 2:
        return None
    mean_t = sum(t for t, _ in points) / len(points)
    mean_v = sum(v for _, v in points) / len(points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    if spread <= 0:
        return None
    return 60 * sum((t - mean_t) * (v - mean_v) for t, v in points) / spread


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


def tally_of(results: Iterable[LoadRequestResult]) -> LoadTally:
    """The tally of whole results (a load that kept every request, or a test's)."""
    return LoadTally.of(result.row() for result in results)


def load_stats(tally: LoadTally, samples: Sequence[ResourceSample]) -> LoadStats:
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
        instances=instance_growth(samples),
        storage=storage_growth(samples),
    )


def instance_growth(samples: Sequence[ResourceSample]) -> dict[str, dict[str, Growth]]:
    names = dict.fromkeys(name for s in samples for name in s.instances)
    found: dict[str, dict[str, Growth]] = {}
    for name in names:
        alive = [(s.at_s, s.instances[name]) for s in samples if s.instances.get(name)]
        alive = [(t, usage) for t, usage in alive if usage.alive]
        found[name] = {
            "rss_bytes": growth([(t, u.rss_bytes) for t, u in alive]),
            "open_fds": growth([(t, u.open_fds) for t, u in alive]),
        }
    return found


def storage_growth(samples: Sequence[ResourceSample]) -> dict[str, dict[str, Growth]]:
    """Per storage kind: the files and bytes each sample saw (before any cleaning), and what
    accumulated over the run: what was there at the end plus everything cleaned before."""
    kinds = dict.fromkeys(kind for s in samples for kind in s.storage)
    found: dict[str, dict[str, Growth]] = {}
    for kind in kinds:
        points = [(s.at_s, s.storage[kind]) for s in samples if kind in s.storage]
        found[kind] = {
            "files": growth([(t, u.files) for t, u in points]),
            "bytes": growth([(t, u.bytes) for t, u in points]),
        }
    return found


def bound_problems(
    stats: LoadStats, samples: Sequence[ResourceSample], bounds: SoakBounds
) -> list[str]:
    """What a soak did not stay under (empty: every bound held)."""
    problems = []
    for kind in dict.fromkeys(k for s in samples for k in s.storage):
        peak = max(s.storage[kind].bytes for s in samples if kind in s.storage)
        if peak > bounds.storage_bytes:
            problems.append(
                f"{kind} storage reached {peak / MIB:.1f} MiB (bound {bounds.storage_bytes / MIB:.0f} MiB)"
            )
    # Growth is held from the end of the first round: start-up and warm-up are not growth.
    # A soak that ended within its first round has nothing after it to hold, and would pass
    # on a growth check that never ran (found in review: it held the warm-up instead).
    warm = samples[1:]
    if len(warm) < 2:
        problems.append(
            "growth after the first round was not measured: the soak ended within its first "
            "round (give a --duration longer than one round)"
        )
        warm = []
    for name, figures in instance_growth(warm).items():
        rss, fds = figures["rss_bytes"], figures["open_fds"]
        if rss.change > bounds.rss_growth_bytes:
            problems.append(
                f"{name}: RSS grew {rss.change / MIB:.1f} MiB after the first round "
                f"(bound {bounds.rss_growth_bytes / MIB:.0f} MiB; {_rate(rss.per_minute, MIB, 'MiB')}, "
                f"last half {_rate(rss.late_per_minute, MIB, 'MiB')})"
            )
        if fds.change > bounds.fd_growth:
            problems.append(
                f"{name}: open files grew by {fds.change:.0f} after the first round "
                f"(bound {bounds.fd_growth}; {_rate(fds.per_minute, 1, 'fds')})"
            )
    for sample in samples:
        dead = [name for name, usage in sample.instances.items() if not usage.alive]
        if dead:
            problems.append(f"{', '.join(dead)} not running at {sample.label}")
            break
    return problems


def _rate(per_minute: float | None, unit: float, name: str) -> str:
    return "rate n/a" if per_minute is None else f"{per_minute / unit:+.2f} {name}/min"


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


# -- rendering --------------------------------------------------------------------------------


def format_load(
    title: str,
    stats: LoadStats,
    rows: Sequence[RequestRow],
    samples: Sequence[ResourceSample],
    notes: Sequence[str] = (),
    unlisted: int = 0,
) -> str:
    """load.md: the figures, then the resources, then one row per request listed (`unlisted`:
    how many more were judged, passed and are counted above; each is a line of
    load-requests.jsonl)."""
    verdicts = ", ".join(f"{v} {n}" for v, n in sorted(stats.verdicts.items()))
    lines = [
        f"# {title}",
        "",
        f"- requests: {stats.requests} ({stats.sent} sent, {stats.batched} in flight with "
        f"another); verdicts: {verdicts}; {stats.passed}/{stats.requests} passed",
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
    lines += resource_lines(stats, samples)
    lines += ["", "## Requests", ""]
    if unlisted:
        lines += [
            f"The first round's requests and every one that did not pass. The {unlisted} other "
            "request(s) passed after the first round: counted in the figures above, each a "
            f"line of {REQUESTS_FILE}.",
            "",
        ]
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


def resource_lines(stats: LoadStats, samples: Sequence[ResourceSample]) -> list[str]:
    if not samples:
        return []
    labels = [s.label for s in samples]
    shown = ", ".join(labels) if len(labels) <= 4 else f"{labels[0]}, {labels[1]} ... {labels[-1]}"
    lines = [
        "",
        "## Resources",
        "",
        f"Sampled {len(samples)} time(s): {shown}. Rates are fitted from the second sample on, "
        "and over the last half of the samples.",
        "",
        "| instance | RSS first | RSS last | RSS rate | last half | open files first | last | "
        "rate |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, figures in stats.instances.items():
        rss, fds = figures["rss_bytes"], figures["open_fds"]
        lines.append(
            f"| {name} | {rss.first / MIB:.0f} MiB | {rss.last / MIB:.0f} MiB | "
            f"{_rate(rss.per_minute, MIB, 'MiB')} | {_rate(rss.late_per_minute, MIB, 'MiB')} | "
            f"{fds.first:.0f} | {fds.last:.0f} | {_rate(fds.per_minute, 1, 'fds')} |"
        )
    lines += ["", "| storage | files first | files last | bytes first | bytes last | bytes rate |"]
    lines.append("|---|---|---|---|---|---|")
    for kind, figures in stats.storage.items():
        files, size = figures["files"], figures["bytes"]
        lines.append(
            f"| {kind} | {files.first:.0f} | {files.last:.0f} | {size.first / MIB:.1f} MiB | "
            f"{size.last / MIB:.1f} MiB | {_rate(size.per_minute, MIB, 'MiB')} |"
        )
    cleaned = [s for s in samples if s.cleaned]
    if cleaned:
        total = {
            kind: sum(s.cleaned[kind].bytes for s in cleaned if kind in s.cleaned)
            for kind in dict.fromkeys(k for s in cleaned for k in s.cleaned)
        }
        lines.append("")
        lines.append(
            f"Cleaned by the harness after {len(cleaned)} sample(s): "
            + ", ".join(f"{kind} {size / MIB:.1f} MiB" for kind, size in total.items())
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
