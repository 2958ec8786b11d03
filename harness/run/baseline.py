"""The monolithic baseline's answers to a run's requests, and what its controls measured.

Every EPD answer is judged against these, so they are checked before they are trusted (each
send under a cache salt of its own, `send_cold`, so that every answer is computed cold, as
each EPD case is):

* the control: each request is sent twice, alone; a baseline that disagrees with itself would
  make EPD look broken when it is not, so its cases get UNSTABLE_BASELINE instead;
* the batched pass: each of the sweep's requests once more, in flight together with another
  request, so the engine runs it in another batch shape (the scenarios' many other requests
  get the control only: the floor is one number for the run). How far its log-probs move (over the
  tokens both answers agree on) is the noise a change of kernel shapes makes on this platform: the
  same kind of change a P->D hop makes (D computes only the prompt's tail). The largest such move
  over the run is the noise floor the drift rule may excuse (`harness.judge.compare`); whether
  the ids changed at all is recorded per request (batch numerics, measured, not assumed).

An answer already in the baseline cache (same served vLLM, model, flags, launch and request;
and batched if this run batches it) is read from it, so a warm run starts no baseline at all,
and records which entry answered (`sources`: directory, key, who computed it and when); `--golden`
stands another release's stored answers in for the baseline instead (`harness.run.goldens`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fixtures.checkpoint_digest import model_digest
from harness.judge.verdicts import Reference, Stability, baseline_stability, batch_shape_noise
from harness.outcomes.outcome import Outcome
from harness.run.baseline_cache import BaselineCache, baseline_key
from harness.run.baseline_launch import BaselineLaunch
from harness.run.goldens import GoldenStore, golden_key
from harness.serve.session import TopologySession, cluster_inherited
from harness.spec.prompts import cold_request
from harness.spec.settings import RunSettings

BASELINE_NAME = "baseline"
log = logging.getLogger(__name__)


def send_cold(session: TopologySession, name: str, body: dict[str, Any]) -> Outcome:
    """`body` sent under a cache salt of this send's own (`cold_request`); what is recorded
    and keyed (`bodies`, the cache, the goldens) stays the body as rendered."""
    return session.send(name, cold_request(body))


@dataclass(frozen=True)
class BatchedAnswer:
    """One request answered in flight with others, against its answer alone."""

    label: str  # the request ("request 17")
    prompt: str
    same_ids: bool
    noise_nats: float | None  # the largest log-prob move over the ids both answers agree on
    detail: str
    # The baseline answered it batched (and alone): else nothing of batching was measured.
    answered: bool = True


# What a calibration measured: the requests ((label, prompt), in the order a load sends them)
# and how many went at once. It depends on nothing else the load does (not the topology under
# test, not whether the load streams): the baseline answers them, as `calibrate_batched` sends.
CalibrationKey = tuple[tuple[tuple[str, str], ...], int]


@dataclass(frozen=True)
class BatchCalibration:
    """The baseline itself under a load's traffic: the same requests at the same concurrency,
    each answer compared with the same request answered alone. Whether batching changes ids
    on this platform, and by how much it moves log-probs, is measured here, not assumed."""

    concurrency: int
    answers: tuple[BatchedAnswer, ...]
    measured_for: str = ""  # why it was measured when it was ("the load on 1E+1P+1D", ...)

    @property
    def noise_floor(self) -> float:
        return max((a.noise_nats or 0.0 for a in self.answers), default=0.0)

    @property
    def changed(self) -> list[BatchedAnswer]:
        return [a for a in self.answers if a.answered and not a.same_ids]

    @property
    def unanswered(self) -> list[BatchedAnswer]:
        return [a for a in self.answers if not a.answered]

    def describe(self) -> str:
        changed = sorted({a.prompt for a in self.changed})
        ids = (
            f"batching changed the ids of {len(self.changed)} answer(s) ({', '.join(changed)})"
            if changed
            else "every answer's ids equal its answer alone"
            if not self.unanswered
            else "every answered one's ids equal its answer alone"
        )
        if self.unanswered:
            missing = sorted({a.prompt for a in self.unanswered})
            ids += (
                f"; the baseline did not answer {len(self.unanswered)} of them "
                f"({', '.join(missing)}): nothing measured there"
            )
        return (
            f"the baseline at concurrency {self.concurrency}, {len(self.answers)} request(s): "
            f"{ids}; log-prob noise up to {self.noise_floor:.3g} nats"
        )


class BaselineAnswers:
    """The baseline's answer, stability and noise per request body (by prompt name)."""

    def __init__(
        self,
        settings: RunSettings,
        cache: BaselineCache | None = None,
        goldens: GoldenStore | None = None,
        golden_release: str | None = None,
    ):
        """`goldens` keeps every baseline answer per release; with `golden_release` the
        baseline is never started: that release's stored answers stand in."""
        if golden_release is not None and goldens is None:
            raise ValueError("golden_release needs a GoldenStore")
        self.settings = settings
        self.cache = cache
        self.goldens = goldens
        self.golden_release = golden_release
        self.label = f"golden-{golden_release}" if golden_release else BASELINE_NAME
        self.bodies: dict[str, dict[str, Any]] = {}
        self.outcomes: dict[str, Outcome] = {}
        self.stability: dict[str, Stability] = {}
        self.calibrations: list[BatchCalibration] = []
        # Each calibration by what it measured: a second load of the same requests at the
        # same concurrency reads it instead of serving the baseline again (`known_calibration`).
        self._calibrated: dict[CalibrationKey, BatchCalibration] = {}
        # The requests the batched pass measures (None: all): the floor is one number for
        # the run, so the sweep's own prompts measure it and the scenarios' many others only
        # get their determinism control.
        self.batch_probes: set[str] | None = None
        # Where each answer came from (run.json's baseline_sources): this run's baseline, a
        # cache entry (its directory, key and provenance) or a golden.
        self.sources: dict[str, dict[str, Any]] = {}
        self._digest: str | None = None
        # On a Ray cluster: what its nodes give an instance, asked once per run for the lookup
        # (`lookup_launch`); the harness's own variables reach no node.
        self._nodes_inherited: dict[str, str] | None = None

    # -- what is known ---------------------------------------------------------------------

    def add(self, bodies: dict[str, dict[str, Any]]) -> None:
        """Requests the baseline must answer (a body already known under its name is kept)."""
        for name, body in bodies.items():
            self.bodies.setdefault(name, body)

    def missing(self) -> list[str]:
        """Requests with no answer yet (after the cache or the goldens were read)."""
        return [name for name in self.bodies if name not in self.outcomes]

    def reference(self, prompt: str) -> Reference:
        stability = self.stability.get(prompt)
        return Reference(
            self.label,
            self.outcomes[prompt],
            monolithic=True,
            stable=stability.stable if stability else False,
        )

    @property
    def noise_floor(self) -> float:
        """The largest log-prob noise the baseline showed (nats), over the control and the
        batched pass of every stable request: the drift tolerance of every comparison."""
        floors = [s.noise_floor for s in self.stability.values() if s.stable and s.noise_floor]
        return max(floors, default=0.0)

    # -- from the cache or the goldens ----------------------------------------------------

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Held while the baseline is computed, so a parallel worker waits and then reads."""
        with self.cache.locked() if self.cache is not None else contextlib.nullcontext():
            yield

    def wants_batched(self, name: str) -> bool:
        """Whether this run measures its noise floor on `name` (the batched pass)."""
        return self.batch_probes is None or name in self.batch_probes

    def load_stored(self, again: bool = False) -> None:
        """Every answer the goldens or the cache hold for the known requests. An entry that
        had no batched pass is a miss for a request this run batches: its floor would lack
        what a fresh baseline measures (the pytest session stores its scenarios' prompts
        control-only; `run --scenario` batches every prompt).

        `again`: the cache read once more under its lock, before the baseline is started for
        what was missing: it says something only if a parallel run stored some meanwhile. Each
        read printed its line, so every command that started a baseline printed two of them
        (found walking the CLI: `load`)."""
        if self.golden_release is not None:
            self._load_goldens()
            return
        if self.cache is None:
            return
        hits, unbatched, oldest = 0, 0, None
        launch = self.lookup_launch()
        for name in self.missing():
            key = self.cache_key(self.bodies[name], launch)
            cached = self.cache.load(key, name)
            if cached is None:
                continue
            if not cached.batched and self.wants_batched(name):
                unbatched += 1
                continue
            hits += 1
            provenance = cached.provenance
            self.outcomes[name] = cached.outcome
            self.stability[name] = Stability(
                True,
                f"from the baseline cache {cached.path} ({provenance.describe()}); "
                f"{cached.batch_detail}",
                cached.noise_floor_nats,
            )
            self.sources[name] = {
                "source": "baseline cache",
                "cache_dir": str(self.cache.directory),
                "key": key,
                "batched": cached.batched,
                "entry": provenance.to_json(),
            }
            oldest = min(oldest or provenance.created, provenance.created)
            self._store_golden(name, cached.outcome, launch)
        if again and not hits:
            return
        log.info(
            "[baseline] cache %s: %d hit(s)%s%s, %d to compute%s",
            self.cache.directory,
            hits,
            " stored meanwhile by a parallel run" if again else "",
            f" (the oldest computed {oldest})" if oldest else "",
            len(self.missing()),
            f" ({unbatched} stored without the batched pass this run measures)"
            if unbatched
            else "",
        )

    def _load_goldens(self) -> None:
        """--golden: another release's stored answers; a missing one is BadInput."""
        assert self.goldens is not None and self.golden_release is not None
        launch = self.lookup_launch()  # as they were stored: by what the baseline inherited
        for name in self.missing():
            self.outcomes[name] = self.goldens.outcome_for(
                self.golden_key(name, launch),
                name,
                self.golden_release,
                self.settings.vllm.torch_version,
            )
            self.stability[name] = Stability(True, f"golden of vLLM {self.golden_release}", 0.0)
            self.sources[name] = {
                "source": "golden",
                "release": self.golden_release,
                "goldens_dir": str(self.goldens.directory),
            }
        log.info(
            "[baseline] the goldens of vLLM %s (%d request(s)); no baseline started",
            self.golden_release,
            len(self.outcomes),
        )

    # -- computed on a running baseline ---------------------------------------------------

    def answer_on(self, session: TopologySession) -> None:
        """Every missing request on a running monolithic instance: each alone, each alone
        again (the control), then each batched with another (the noise floor); stored in the
        cache and the goldens when stable. Call it holding `locked()`."""
        names = self.missing()
        if not names:
            return
        log.info(
            "[baseline] %d request(s): each alone twice (determinism control); the sweep's "
            "batched with another (noise floor)",
            len(names),
        )
        for name in names:
            self.outcomes[name] = send_cold(session, name, self.bodies[name])
        again = {name: send_cold(session, name, self.bodies[name]) for name in names}
        probes = [n for n in names if self.wants_batched(n)]
        batched = self._batched_pass(session, probes)
        wanted = self.cache is not None or self.goldens is not None
        launch = self.launch_of(session) if wanted else None
        for name in names:
            control = baseline_stability(self.outcomes[name], again[name])
            if name in batched:
                floor, detail = batch_shape_noise(self.outcomes[name], batched[name])
            else:
                floor, detail = (
                    None,
                    "not batched (the run's floor is measured on its sweep prompts)",
                )
            floors = [f for f in (control.noise_floor, floor) if f is not None]
            self.stability[name] = Stability(
                control.stable,
                f"{control.detail}; {detail}",
                max(floors) if control.stable and floors else None,
            )
            if not control.stable:
                log.warning("[baseline] UNSTABLE on %s: %s", name, control.detail)
                continue
            if self.cache is not None:
                key = self.cache_key(self.bodies[name], launch)
                # Measured only where the batched pass got an answer: one stored as batched
                # without it stood in for one that had it (found in review).
                measured = name in batched and batched[name].result is not None
                self.cache.store(
                    key,
                    self.outcomes[name],
                    self.stability[name].noise_floor or 0.0,
                    detail,
                    batched=measured,
                    served=self.settings.vllm,
                )
                self.sources[name] = {
                    "source": "this run's baseline",
                    "cache_dir": str(self.cache.directory),
                    "key": key,
                    "batched": measured,
                }
            self._store_golden(name, self.outcomes[name], launch)

    def lookup_launch(self) -> BaselineLaunch:
        """The launch the cache is looked up by, before any start: with this process's
        variables, or on a Ray cluster those a node of it gives an instance
        (`cluster_inherited`, asked once): keyed by the harness's, which reach no node, a
        second run on the same cluster missed what the first stored (found in review)."""
        if self._nodes_inherited is None:
            self._nodes_inherited = cluster_inherited(self.settings)
        return BaselineLaunch.of(self.settings, inherited=self._nodes_inherited)

    def launch_of(self, session: TopologySession) -> BaselineLaunch:
        """The launch of the running baseline `session`, keyed by the variables it inherited
        where it runs (its Reservation's). On a Ray node they are the node's, not this
        process's, by which the cache was looked up before the start: stored under those, an
        answer the node computed under another VLLM_ATTENTION_BACKEND stood in for a run
        without it (found in review). Where they differ from the lookup's (`lookup_launch`:
        this node gave it other variables than the one asked, or the harness's), it says
        which."""
        recorded = session.inherited_envs
        if not recorded:
            return BaselineLaunch.of(self.settings)
        launch = BaselineLaunch.of(self.settings, inherited=recorded[0])
        assumed = dict(self.lookup_launch().env)
        ran = dict(launch.env)
        differ = sorted(k for k in {*assumed, *ran} if assumed.get(k) != ran.get(k))
        if differ:
            log.warning(
                "[baseline] it inherited %s where it runs, not %s as the cache was looked up "
                "by: its answers are stored under what it inherited",
                ", ".join(f"{k}={ran[k]}" if k in ran else f"no {k}" for k in differ),
                ", ".join(f"{k}={assumed[k]}" if k in assumed else f"no {k}" for k in differ),
            )
        return launch

    def _batched_pass(self, session: TopologySession, names: list[str]) -> dict[str, Outcome]:
        """Each request in flight together with its neighbour in the list (itself when alone:
        two copies still make a batch of two)."""
        batched: dict[str, Outcome] = {}
        if not names:
            return batched
        with ThreadPoolExecutor(max_workers=2) as pool:
            for index, name in enumerate(names):
                partner = names[(index + 1) % len(names)]
                mine = pool.submit(send_cold, session, name, self.bodies[name])
                other = pool.submit(send_cold, session, f"{partner}-partner", self.bodies[partner])
                batched[name] = mine.result()
                other.result()
        return batched

    def known_calibration(
        self, requests: Sequence[tuple[str, str]], concurrency: int
    ) -> BatchCalibration | None:
        """The calibration of exactly these requests at this concurrency, if one was measured
        on this baseline already (earlier in this run or pytest process), else None."""
        return self._calibrated.get((tuple(requests), concurrency))

    def calibrate_batched(
        self,
        session: TopologySession,
        requests: Sequence[tuple[str, str]],
        concurrency: int,
        measured_for: str = "",
    ) -> BatchCalibration:
        """`requests` ((label, prompt), each prompt answered already) sent to the running
        baseline `concurrency` at a time, as a load sends them; each answer compared with the
        prompt's answer alone (`batch_shape_noise`). The tolerance of the batched answers of a
        load of these requests at this concurrency (that load's own: `harness.run.load.run`),
        and kept for a later one of the same (`known_calibration`); `measured_for` says what it
        was measured for."""
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            sent = [
                (label, prompt, pool.submit(send_cold, session, prompt, self.bodies[prompt]))
                for label, prompt in requests
            ]
            outcomes = [(label, prompt, future.result()) for label, prompt, future in sent]
        answers = []
        for label, prompt, outcome in outcomes:
            alone = self.outcomes[prompt]
            noise, detail = batch_shape_noise(alone, outcome)
            same = (
                outcome.result is not None
                and alone.result is not None
                and outcome.result.token_ids == alone.result.token_ids
                and outcome.result.prompt_token_ids == alone.result.prompt_token_ids
            )
            answered = outcome.result is not None and alone.result is not None
            answers.append(BatchedAnswer(label, prompt, same, noise, detail, answered))
        calibration = BatchCalibration(concurrency, tuple(answers), measured_for)
        self.calibrations.append(calibration)
        if all(outcome.result is not None for _, _, outcome in outcomes):
            # One the baseline failed to answer in full is this load's account only: the
            # next load of the same requests measures its own.
            self._calibrated[(tuple(requests), concurrency)] = calibration
        log.info("[baseline] %s", calibration.describe())
        return calibration

    # -- keys --------------------------------------------------------------------------------

    def digest(self) -> str:
        if self._digest is None:
            model = Path(self.settings.serving.model)
            self._digest = model_digest(model) if model.is_dir() else str(model)
        return self._digest

    def cache_key(self, body: dict[str, Any], launch: BaselineLaunch | None = None) -> str:
        """`launch` is rendered, when not given, from the environment as it is then: the
        baseline is launched with the harness's environment (harness.run.baseline_launch). A
        loop over prompts renders it once and passes it."""
        return baseline_key(
            self.settings.vllm,
            self.settings.serving,
            self.digest(),
            body,
            launch=launch or BaselineLaunch.of(self.settings),
        )

    def golden_key(self, name: str, launch: BaselineLaunch | None = None) -> str:
        """The key of `name`'s goldens (`launch` as for `cache_key`)."""
        return golden_key(
            self.settings.serving,
            self.digest(),
            self.bodies[name],
            launch or BaselineLaunch.of(self.settings),
        )

    def _store_golden(
        self, name: str, outcome: Outcome, launch: BaselineLaunch | None = None
    ) -> None:
        if self.goldens is not None and self.golden_release is None:
            self.goldens.store(
                self.golden_key(name, launch),
                name,
                self.settings.vllm,
                outcome,
                dtype=self.settings.serving.dtype,
            )
