"""What a load did, judged: the one record every part of a load writes into and its account
is written from."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from harness.judge.guards import GuardResult
from harness.judge.records import CaseRecord
from harness.report.load import (
    FAILURES_KEPT_WHOLE,
    KvAccountLog,
    LoadRequestResult,
    LoadStats,
    LoadTally,
    RequestRow,
)
from harness.report.resources import ResourceHistory
from harness.run.baseline import BatchCalibration
from harness.spec.load import LoadSpec, MediaPlacement


@dataclass
class LoadResult:
    """Everything a load did, judged. Every request judged is counted in `tally` (the
    statistics are over all of them) and is a line of load-requests.jsonl; `results` holds whole
    (answer, log-probs, record) only those worth reading whole (`LoadResult.add`): a soak of
    hours that kept every answer grew by ~48 KB a request. Likewise every resource sample is a
    line of load-samples.jsonl and every KV account one of load-kv-accounts.jsonl, and
    `resources` and `kv` hold what the figures and the bounds read of them."""

    spec: LoadSpec
    results: list[LoadRequestResult] = field(default_factory=list)  # those kept whole, in order
    tally: LoadTally = field(default_factory=LoadTally)  # every request judged
    resources: ResourceHistory = field(default_factory=ResourceHistory)  # every sample
    placements: dict[str, MediaPlacement] = field(default_factory=dict)
    calibration: BatchCalibration | None = None
    calibration_source: str | None = None  # measured now, or earlier in the session for what
    rounds: int = 0
    ended_by: str | None = None  # the death that ended the load early (its first line)
    killed: str | None = None  # the instance a planted kill ended
    killed_at_s: float | None = None
    problems: list[str] = field(default_factory=list)  # bounds a soak broke, a kill not seen
    # What each request sent alone, declared to end an instance, did end (its first line).
    declared_deaths: list[str] = field(default_factory=list)
    kv: KvAccountLog = field(default_factory=KvAccountLog)  # one account a round (NIXL's rule)
    processes: list[int] = field(default_factory=list)  # every instance's process tree, at start
    stats: LoadStats | None = None
    # Requests that did not pass and were not kept whole, by (prompt, verdict): beyond the
    # first FAILURES_KEPT_WHOLE of each.
    failed_unlisted: Counter[tuple[str, str]] = field(default_factory=Counter)
    failed_kept: Counter[tuple[str, str]] = field(default_factory=Counter)  # kept whole

    @property
    def records(self) -> list[CaseRecord]:
        """The records of the requests kept whole."""
        return [r.record for r in self.results]

    @property
    def kv_accounts(self) -> list[GuardResult]:
        """The KV accounts kept whole: the first round's, and the first that failed."""
        return [account for _, account in self.kv.kept]

    @property
    def unlisted(self) -> int:
        """Requests judged and counted but not kept whole: those that passed after the first
        round, and the failures beyond the first of their prompt and verdict."""
        return self.tally.requests - len(self.results)

    @property
    def passed(self) -> bool:
        """Every request passed its policy (or, under a planted kill, ended ERROR naming the
        killed instance), nothing ended the load unplanned, every bound held."""
        if self.problems or not self.tally.requests:
            return False
        if self.killed is not None:
            return True  # checked into `problems` by the load itself
        return self.ended_by is None and self.tally.passed == self.tally.requests

    def add(
        self, results: list[LoadRequestResult]
    ) -> tuple[list[RequestRow], list[LoadRequestResult]]:
        """Count a round's judged requests; every one's row, and those kept whole. Kept whole:
        every request of a load's first round (a plain load has only that one, bounded by
        --requests; a soak's shows what every later round repeated) and, after it, the first
        FAILURES_KEPT_WHOLE requests of each prompt and verdict that did not pass (counted
        over the whole load). The others are their row: a broken build soaked for hours fails
        every request."""
        rows, kept = [], []
        for result in results:
            row = result.row()
            self.tally.add(row)
            rows.append(row)
            failing = not result.record.policy_passed
            key = (result.prompt, result.record.verdict.value)
            whole = result.round_number <= 1 or (
                failing and self.failed_kept[key] < FAILURES_KEPT_WHOLE
            )
            if whole:
                self.results.append(result)
                kept.append(result)
                self.failed_kept[key] += failing
            elif failing:
                self.failed_unlisted[key] += 1
        return rows, kept
