"""What every planted fault is: ProxyFaults hooks that also record what they did, and how a
running proxy is made to carry them (`plant`), or to carry one for a single request."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.run.faults.storage_files import rewrite_tensors
from harness.serve.proxy import ProxyFaults

if TYPE_CHECKING:
    import torch

# Why a planted fault did not act on a request, as the fuzzer's shrink must tell: the request's
# SHAPE (nothing in it for the fault: one media item for ec-swap-items, no video for
# ec-zero-frame), which fresh servers share, so a failure there is not the fault's; or LEFTOVER
# state, what earlier requests left in a storage or cache (kv-noise: P found this prompt's KV
# files stored and wrote none), which fresh servers would not have. A fault records a leftover
# miss only where its earlier action on that state stands: what the request read is what the
# fault would have made for it on fresh servers (`PlantedFault.leftover`); any other miss counts
# as the request's shape. Making the fault act again instead would take a fresh
# ExampleConnector key, which hashes the prompt's tokens and media only (no cache_salt): the
# request itself would have to change. A third kind is no miss of the fault's at all: it did
# not act on the request (its shape), yet what it did to an EARLIER request reaches this one,
# which fresh servers would pass (`PlantedFault.outlived`: ec-swap-items put a swapped file
# back, but the consumer's encoder cache keeps the swapped embedding by mm_hash). A failure
# there is the fault's, and no request shape's to shrink.


@dataclass
class PlantedFault(ProxyFaults):
    """ProxyFaults that also record what they did.

    A fault that silently touched nothing would make the self-test vacuous in turn (the run
    would be "red" for some other reason, or green by luck), so the tests assert on `touched`
    and `problems` as well as on the verdict. Hooks run on the proxy's thread, where an
    exception would only surface as an opaque HTTP 500: they record their problems instead.
    """

    touched: list[Path] = field(default_factory=list)  # files rewritten, in order
    problems: list[str] = field(default_factory=list)  # what the fault could not do, and why
    # What the fault measurably did, one line per file or item (e.g. the relative std of the
    # noise really added, after rounding to the file's dtype): evidence for the report.
    effects: list[str] = field(default_factory=list)
    # The problems that are no miss of the request's shape but of what earlier requests left,
    # on which the fault already acted as it would on this request on fresh servers (each is in
    # `problems` too). Every other problem counts as the request's shape (e.g. ec-swap-items on
    # one item): fresh servers would not see the fault act either. See above, before this class.
    leftover: list[str] = field(default_factory=list)
    # The problems (each in `problems` too) of requests the fault did not act on but whose
    # items it changed for an earlier request, which may still reach them (see above).
    outlived: list[str] = field(default_factory=list)
    # Why the fault cannot be narrowed to one request among several in flight ("" if it can):
    # `first_request_only` refuses it rather than let it act on the neighbours too.
    not_one_request: str = ""

    def rewrite(
        self, request_id: str, path: Path, transform: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """Rewrite one file, recording it as touched or recording why it could not be."""
        if not path.is_file():
            self.problems.append(f"{request_id}: {path} does not exist")
            return
        try:
            rewrite_tensors(path, transform)
        except Exception as exc:  # noqa: BLE001 - reported through `problems`, see above
            self.problems.append(f"{request_id}: rewriting {path}: {type(exc).__name__}: {exc}")
            return
        self.touched.append(path)


def plant(live: ProxyFaults, fault: ProxyFaults | None = None) -> None:
    """Make a running proxy behave as `fault` prescribes (None: no fault) from its next request.

    A TopologySession hands its ProxyFaults object to the proxy once, at start, and the proxy
    reads the hooks on every request. Swapping the hooks on that same object lets one started
    topology serve a clean request and several planted faults in turn, instead of one start
    (~40 s on CPU) per fault.
    """
    source = fault if fault is not None else ProxyFaults()
    for hook in dataclasses.fields(ProxyFaults):
        setattr(live, hook.name, getattr(source, hook.name))


def first_request_only(fault: PlantedFault, id_contains: str = "") -> PlantedFault:
    """`fault`, acting on the first request whose hook runs (of those whose id holds
    `id_contains`; the harness's sessions put the prompt's name in it) and on no other: one
    broken request among many in flight (a load), the rest left as they were.

    ValueError for a fault that picks what it acts on by something other than the request
    (`PlantedFault.not_one_request`): narrowed to the first request's hook, it would still act
    on the other requests in flight.
    """
    if fault.not_one_request:
        raise ValueError(f"first_request_only: {fault.not_one_request}")
    chosen: list[str] = []

    def once(hook: Callable[[str, dict[str, Any]], None] | None):
        if hook is None:
            return None

        def run(request_id: str, params: dict[str, Any]) -> None:
            if not chosen and id_contains in request_id:
                chosen.append(request_id)
            if chosen and request_id == chosen[0]:
                hook(request_id, params)

        return run

    fault.after_encode = once(fault.after_encode)
    fault.after_prefill = once(fault.after_prefill)
    return fault
