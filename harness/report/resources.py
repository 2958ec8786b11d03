"""A soak's resource samples: what its account and its bounds read of them, held compactly.

A soak samples every instance's RSS and open files and the connectors' storage between rounds,
one `ResourceSample` a round. Holding each (~1.8 KB in memory) and listing each in load.json,
rewritten every round, made a soak of hours cost what it had run so far at every round. What
the figures and the bounds read of the samples is less than the samples:

- per instance, the (seconds, RSS) and (seconds, open files) of each sample it was alive in,
  for its first and last values and the least-squares rates (over every point after the first,
  and over the last half of them: the rate a leak keeps and a filling cache loses). The late
  half moves as the soak grows, so every point is kept: 24 bytes a sample, as numbers.
- the same from the end of the first round on (growth is held from there: warm-up is no leak);
- per storage kind, its (seconds, files, bytes) points: its peak is what its bound holds;
- the first sample at which an instance was not running, and how many samples there were.

`ResourceHistory` holds exactly those, so the figures and the verdicts are those of every
sample; every sample is a line of load-samples.jsonl as it is taken, and load.json lists only
the samples a reader needs whole (the first, the end of the first round, the last, each
storage's peak, the first with an instance down, and an evenly spaced trend).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from harness.outcomes.load import ResourceSample

MIB = 2**20
SAMPLES_FILE = "load-samples.jsonl"  # every resource sample of a load, one line each
TREND_SAMPLES = 32  # at most this many evenly spaced samples listed for the trend


@dataclass(frozen=True)
class SoakBounds:
    """What a soak must stay under to pass. Storage is bounded because the harness cleans what
    it can between rounds; RSS and open files are measured from the end of the first round
    (start-up and warm-up allocations are no leak) to the end of the soak."""

    storage_bytes: int = 512 * MIB  # per storage, at any sample
    rss_growth_bytes: int = 256 * MIB  # per instance
    fd_growth: int = 64  # per instance


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


class _Points:
    """Points of quantities read at the same moments, as numbers: the seconds (8 bytes) and
    each quantity's integer value (8 bytes each). Read back as the Python numbers they were
    given, so a rate fitted over them is the one fitted over the samples."""

    def __init__(self, quantities: Sequence[str]) -> None:
        self.seconds = array("d")
        self.values = {name: array("q") for name in quantities}

    def add(self, at_s: float, **values: int) -> None:
        self.seconds.append(at_s)
        for name, column in self.values.items():
            column.append(values[name])

    def __len__(self) -> int:
        return len(self.seconds)

    def growth(self, quantity: str, start: int = 0) -> Growth:
        seconds = self.seconds[start:].tolist()
        return growth(list(zip(seconds, self.values[quantity][start:].tolist(), strict=True)))


@dataclass
class _InstanceTrack:
    """One instance's alive samples; `from_first`: its first point is the load's first sample
    (the one growth after the first round leaves out)."""

    points: _Points = field(default_factory=lambda: _Points(("rss_bytes", "open_fds")))
    from_first: bool = False
    down_from: str | None = None  # since when it is down ("from sample 'after'"), while it is

    def growth(self, after_first: bool) -> dict[str, Growth]:
        start = 1 if after_first and self.from_first else 0
        return {key: self.points.growth(key, start) for key in ("rss_bytes", "open_fds")}


@dataclass(frozen=True)
class InstanceDown:
    """The first sample at which an instance was not running."""

    label: str
    names: tuple[str, ...]


class ResourceHistory:
    """Every resource sample of a load, as its figures and its bounds read them (see the
    module's docstring), and whole only the samples a reader needs (`listed`)."""

    def __init__(self, trend_samples: int = TREND_SAMPLES) -> None:
        self.count = 0
        self._trend_limit = trend_samples
        self._stride = 1  # the trend keeps every sample whose number is a multiple of it
        self._trend: dict[int, ResourceSample] = {}
        # By number: what a reader needs whole, and why each is kept.
        self._marked: dict[int, tuple[ResourceSample, list[str]]] = {}
        self._last: ResourceSample | None = None
        self._labels: list[str] = []  # the first four's
        self._instances: dict[str, _InstanceTrack] = {}  # in order of first appearance
        self._warm_names: dict[str, None] = {}  # first seen after the first sample, in order
        self._storage: dict[str, _Points] = {}
        self._peaks: dict[str, tuple[int, int]] = {}  # storage kind -> (bytes, sample number)
        self.down: InstanceDown | None = None
        self.cleaned_samples = 0
        self.cleaned_bytes: dict[str, int] = {}

    @classmethod
    def of(cls, samples: Iterable[ResourceSample]) -> ResourceHistory:
        """The history of samples taken already (a test's, or a load read back)."""
        history = cls()
        for sample in samples:
            history.add(sample)
        return history

    @property
    def last(self) -> ResourceSample | None:
        return self._last

    def add(self, sample: ResourceSample) -> int:
        """Count `sample` into the history (its storage cleaning, if any, already in it);
        its number, from 0."""
        number = self.count
        self.count += 1
        self._last = sample
        if len(self._labels) < 4:
            self._labels.append(sample.label)
        if number == 0:
            self._mark(number, sample, "first")
        elif number == 1:
            self._mark(number, sample, "end of the first round: growth is held from here")
        for name, usage in sample.instances.items():
            track = self._instances.setdefault(name, _InstanceTrack())
            if number >= 1:
                self._warm_names.setdefault(name)
            if usage.alive:
                if not len(track.points):
                    track.from_first = number == 0
                track.points.add(sample.at_s, rss_bytes=usage.rss_bytes, open_fds=usage.open_fds)
                track.down_from = None
            elif track.down_from is None:
                track.down_from = f"from sample '{sample.label}'"
        for kind, usage in sample.storage.items():
            points = self._storage.setdefault(kind, _Points(("files", "bytes")))
            points.add(sample.at_s, files=usage.files, bytes=usage.bytes)
            peak = self._peaks.get(kind)
            if peak is None or usage.bytes > peak[0]:
                if peak is not None:
                    self._unmark(peak[1], f"peak {kind} storage")
                self._peaks[kind] = (usage.bytes, number)
                self._mark(number, sample, f"peak {kind} storage")
        if sample.cleaned:
            self.cleaned_samples += 1
            for kind, usage in sample.cleaned.items():
                self.cleaned_bytes[kind] = self.cleaned_bytes.get(kind, 0) + usage.bytes
        dead = tuple(name for name, usage in sample.instances.items() if not usage.alive)
        if dead and self.down is None:
            self.down = InstanceDown(sample.label, dead)
            self._mark(number, sample, "first with an instance down")
        self._keep_for_trend(number, sample)
        return number

    def _mark(self, number: int, sample: ResourceSample, why: str) -> None:
        """Keep `sample` whole for the reason `why`."""
        self._marked.setdefault(number, (sample, []))[1].append(why)

    def _unmark(self, number: int, why: str) -> None:
        _, reasons = self._marked.get(number, (None, []))
        if why in reasons:
            reasons.remove(why)
        if not reasons:
            self._marked.pop(number, None)

    def _keep_for_trend(self, number: int, sample: ResourceSample) -> None:
        """Every `_stride`-th sample; with more than the limit kept, the stride doubles and
        every other is let go: evenly spaced, between half the limit and the limit."""
        if number % self._stride:
            return
        self._trend[number] = sample
        if len(self._trend) > self._trend_limit:
            self._stride *= 2
            self._trend = {n: s for n, s in self._trend.items() if n % self._stride == 0}

    # -- what the figures and the bounds read -----------------------------------------------

    def instance_growth(self, after_first: bool = False) -> dict[str, dict[str, Growth]]:
        """Per instance, its RSS and open files over the samples it was alive in: every
        sample, or (`after_first`) from the end of the first round on."""
        names = self._warm_names if after_first else self._instances
        return {name: self._instances[name].growth(after_first) for name in names}

    def down_from(self, name: str) -> str | None:
        """When instance `name` was first seen down, if it is down to the last (None: it
        runs)."""
        track = self._instances.get(name)
        return track.down_from if track is not None else None

    def ended_after_the_samples(self, name: str, when: str) -> None:
        """Instance `name` died after the last sample (`when`: of a request declared to end it,
        sent alone after every round). No sample is taken for it: the topology may have started
        again for that request, and a soak's growth and bounds are those of its rounds; its
        row only stops showing its figures from before as live ones."""
        track = self._instances.get(name)
        if track is not None and track.down_from is None:
            track.down_from = when

    def storage_growth(self) -> dict[str, dict[str, Growth]]:
        """Per storage kind: the files and bytes each sample saw (before any cleaning)."""
        return {
            kind: {"files": points.growth("files"), "bytes": points.growth("bytes")}
            for kind, points in self._storage.items()
        }

    def storage_peaks(self) -> dict[str, int]:
        """Per storage kind, the most bytes a sample saw."""
        return {kind: self._peaks[kind][0] for kind in self._storage}

    # -- what is listed ----------------------------------------------------------------------

    def labels(self) -> list[str]:
        """The first four samples' labels, and the last's after them."""
        if self.count <= 4 or self._last is None:
            return list(self._labels)
        return [*self._labels, self._last.label]

    def listed(self) -> list[tuple[int, list[str], ResourceSample]]:
        """The samples kept whole, in order: (number, why each is kept, the sample)."""
        kept: dict[int, list[str]] = {n: list(why) for n, (_, why) in self._marked.items()}
        samples = {n: sample for n, (sample, _) in self._marked.items()}
        for number, sample in self._trend.items():
            kept.setdefault(number, []).append("trend")
            samples[number] = sample
        if self._last is not None:
            kept.setdefault(self.count - 1, []).append("last")
            samples[self.count - 1] = self._last
        return [(n, kept[n], samples[n]) for n in sorted(kept)]

    def listed_json(self) -> list[dict[str, Any]]:
        return [
            {"number": number, "kept_for": why, **sample.to_json()}
            for number, why, sample in self.listed()
        ]


def sample_line(number: int, sample: ResourceSample) -> dict[str, Any]:
    """A sample's line of load-samples.jsonl: its number (from 0), then the sample."""
    return {"number": number, **sample.to_json()}


def bound_problems(resources: ResourceHistory, bounds: SoakBounds) -> list[str]:
    """What a soak did not stay under (empty: every bound held)."""
    problems = []
    for kind, peak in resources.storage_peaks().items():
        if peak > bounds.storage_bytes:
            problems.append(
                f"{kind} storage reached {peak / MIB:.1f} MiB (bound {bounds.storage_bytes / MIB:.0f} MiB)"
            )
    # Growth is held from the end of the first round: start-up and warm-up are not growth.
    # A soak that ended within its first round has nothing after it to hold, and would pass
    # on a growth check that never ran (found in review: it held the warm-up instead).
    warm = {}
    if resources.count - 1 < 2:
        problems.append(
            "growth after the first round was not measured: the soak ended within its first "
            "round (give a --duration longer than one round)"
        )
    else:
        warm = resources.instance_growth(after_first=True)
        # Samples without an instance leave the loop below nothing to hold: a bound never
        # read is not held (found in review: an attached soak passed so; the CLI now refuses
        # one, and this stays for any other way of sampling nothing).
        if not warm:
            problems.append(
                "RSS and open files were not measured: no instance's processes were sampled"
            )
    for name, figures in warm.items():
        rss, fds = figures["rss_bytes"], figures["open_fds"]
        if rss.change > bounds.rss_growth_bytes:
            problems.append(
                f"{name}: RSS grew {rss.change / MIB:.1f} MiB after the first round "
                f"(bound {bounds.rss_growth_bytes / MIB:.0f} MiB; {rate(rss.per_minute, MIB, 'MiB')}, "
                f"last half {rate(rss.late_per_minute, MIB, 'MiB')})"
            )
        if fds.change > bounds.fd_growth:
            problems.append(
                f"{name}: open files grew by {fds.change:.0f} after the first round "
                f"(bound {bounds.fd_growth}; {rate(fds.per_minute, 1, 'fds')})"
            )
    if resources.down is not None:
        problems.append(f"{', '.join(resources.down.names)} not running at {resources.down.label}")
    return problems


def rate(per_minute: float | None, unit: float, name: str) -> str:
    return "rate n/a" if per_minute is None else f"{per_minute / unit:+.2f} {name}/min"
