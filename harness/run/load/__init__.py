"""`epd-harness load`: many requests at once over a mix of prompts, every answer judged against
the baseline's answer to its own prompt.

The baseline answers each prompt of the mix once, alone (cached like every baseline answer),
and then, when requests go out more than one at a time, the same requests once more at the
load's concurrency (`calibration`). Then the topology serves the plan (`harness.spec.load`), at
most `concurrency` requests in flight; each answer is observed (its transfer guards read at
once) and judged. A soak repeats rounds of the plan until its time is up, sampling resources
between them and holding them to bounds; a death under load ends it (`death`, `--kill ROLE`);
under NIXL each round's KV is accounted as a whole.

One module per concern, each importing only those listed before it: `plan` (where each
prompt's media end, what is declared, the requests), `sessions` (what a load asks of the
session it serves), `calibration` (the baseline under the load's traffic), `result`
(`LoadResult`), `sending` (a round's requests in flight), `death` (the planted kill, a death
noticed), `samples` (a soak's resources), `kv_account` (NIXL's whole-round account), `account`
(load.md, load.json); `run` (`LoadRun`) runs a load from them.
"""
