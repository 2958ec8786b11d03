"""A round's KV accounted as a whole, where D's evidence is a counter shared by every request
in flight (NIXL's whole-prompt rule): one account a round, each a line of
load-kv-accounts.jsonl. ExampleConnector's evidence is each request's own `cached_tokens`,
read at D's tap and judged with the request."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

from harness.files import append_json_lines
from harness.judge.guards import check_kv_account, kv_rule_for
from harness.report.load import KV_ACCOUNTS_FILE, kv_account_line
from harness.run.load.result import LoadResult
from harness.run.load.sending import Sent
from harness.serve.kv_metrics import KvCounters
from harness.spec.connectors import KvRule
from harness.spec.topology import Topology


def accounts_kv(topology: Topology, kv_connector: str) -> bool:
    """Whether a load on `topology` under `kv_connector` accounts each round's KV."""
    rule = kv_rule_for(kv_connector)
    return topology.has_kv_transfer and rule is KvRule.WHOLE_PROMPT


def account_kv(
    result: LoadResult,
    sent: list[Sent],
    before: KvCounters | None,
    after: KvCounters | None,
    block_size: int,
    run_dir: Path,
    prompt_tokens: Mapping[str, int],
) -> None:
    """The round's requests against D's counters over the whole round
    (`harness.judge.guards.check_kv_account`); a shortfall fails the load. A round a death
    ended is not accounted: its requests' transfers stopped part way. A request that was sent
    and errored is in D's counters as far as it got: it is accounted as such, at most its
    whole prompt (`prompt_tokens`: the baseline's, by prompt; its own answer has none)."""
    if result.ended_by or result.killed:
        return
    prompts = {
        item.request.name: len(item.observed.outcome.result.prompt_token_ids)
        for item in sent
        if item.observed is not None and item.observed.outcome.result is not None
    }
    if not prompts:
        return
    errored = {
        item.request.name: prompt_tokens.get(item.request.prompt, math.inf)
        for item in sent
        if item.observed is not None and item.observed.outcome.result is None
    }
    counters = None if before is None or after is None else after.minus(before)
    account = check_kv_account(prompts, counters, KvRule.WHOLE_PROMPT, block_size, errored)
    kept = result.kv.add(result.rounds, account, counters)
    append_json_lines(run_dir / KV_ACCOUNTS_FILE, [kv_account_line(result.rounds, account)])
    if account.failed and kept:  # the others are counted (the load's end says how many)
        result.problems.append(f"round {result.rounds}, KV account: {account.evidence}")
