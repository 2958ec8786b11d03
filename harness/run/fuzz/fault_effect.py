"""Whether a planted fault (`--plant-fault`) acted on the request just sent, in the words a
fuzz report keeps: a fault acts on some request shapes only, and a self-test that found
nothing must say whether its fault ever acted. The engine marks what the fault has recorded
before each send and reads what it recorded since; `request_content` says which sends are the
same request (a fault that acted on an earlier send of it counts)."""

from __future__ import annotations

import json
import re
from typing import Any

from harness.run.faults.planted import PlantedFault
from harness.run.fuzz.signature import normalize

FAULT_ACTED = "acted"
# The fault did not act on this send, but did on an earlier one of the same request (all but
# max_tokens): kv-noise noises the KV files P writes, and P writes a prompt's files once, so a
# shrink candidate with fewer tokens finds them noised already; on fresh servers it would act.
FAULT_ACTED_BEFORE = "acted on an earlier send of this request"
# The fault did not act on this send for leftover state, not the request's shape: what it acts
# on was already there, left by an earlier request of other content, and the fault had acted on
# it as it would for this request on fresh servers (`PlantedFault.leftover`: kv-noise finds the
# KV files of this prompt's leading blocks written and noised for another prompt). Followed by
# ": " and the fault's reason.
FAULT_ON_LEFTOVER = "acted before, on what earlier requests left"
# The fault did not act on this send (its shape), but what it did to an earlier request of
# other content may reach it (`PlantedFault.outlived`: ec-swap-items' swapped embedding kept in
# the consumer's encoder cache): fresh servers would pass it, so it is neither the fault's to
# shrink nor a failure of vLLM's. Followed by ": " and the fault's reason.
FAULT_OUTLIVED = "not acted, but reached by what it did to an earlier request"
FAULT_NOT_ACTED = "not acted"


def request_content(body: dict[str, Any]) -> str:
    """A request body less what only changes how much is generated (max_tokens): two sends
    with the same content prefill the same prompt."""
    return json.dumps({k: v for k, v in body.items() if k != "max_tokens"}, sort_keys=True)


Mark = tuple[int, int, int, int, int]


def fault_mark(fault: PlantedFault | None) -> Mark | None:
    """How much the planted fault has recorded so far (None: nothing planted, or a fault
    without hooks, such as drop-metadata's flag, which records nothing)."""
    if fault is None or (fault.after_encode is None and fault.after_prefill is None):
        return None
    return (
        len(fault.touched),
        len(fault.effects),
        len(fault.problems),
        len(fault.leftover),
        len(fault.outlived),
    )


def fault_since(fault: PlantedFault | None, mark: Mark | None) -> str | None:
    """Whether the planted fault acted on the request just sent: it rewrote a file or
    recorded an effect; otherwise its first problem (request id dropped, what varies
    blanked), or that its hook never ran (nothing in the request for it to act on). A
    first problem the fault marked as leftover state is `FAULT_ON_LEFTOVER`, one it marked
    as reached by its earlier action `FAULT_OUTLIVED`, every other one the request's shape
    (`FAULT_NOT_ACTED`)."""
    if mark is None or fault is None:
        return None
    touched, effects, problems, leftover, outlived = mark
    if len(fault.touched) > touched or len(fault.effects) > effects:
        return FAULT_ACTED
    new = fault.problems[problems:]
    if not new:
        return f"{FAULT_NOT_ACTED}: its hook never ran (no encoder or prefill step)"
    reason = new[0].split(": ", 1)[-1]
    reason = re.split(r": [\[{]", reason, maxsplit=1)[0]  # not the tensors' layouts
    # Blanked as a failure's cause is (a path's directories, digests, numbers): one reason
    # counted apart per EC folder otherwise (found on real vLLM: ec-zero-frame:4 in a fuzz).
    reason = normalize(reason.splitlines()[0])
    if new[0] in fault.leftover[leftover:]:
        status = FAULT_ON_LEFTOVER
    elif new[0] in fault.outlived[outlived:]:
        status = FAULT_OUTLIVED
    else:
        status = FAULT_NOT_ACTED
    return f"{status}: {reason}"
