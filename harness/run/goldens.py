"""Goldens: every release's baseline token ids for the same request, kept side by side.

The baseline cache (`harness.run.baseline_cache`) is keyed by the served vLLM version, so one
release never reuses another's baseline. Goldens are the deliberate exception: stored under a
key WITHOUT the version (model content, numerics flags, request, and the launch's environment
and device: a golden stands in for a baseline, so what keeps one ISA's or one host's baseline
from answering another's keeps its golden too), one file per release that produced them, so
that

* consecutive releases' baselines can be compared (`agreement`): do they give the same tokens?
* `epd-harness run --golden VERSION` judges a candidate's EPD outputs against VERSION's
  baseline without starting a baseline at all (only when asked: never implicitly).

Only final releases are filed (a post release, e.g. 0.8.5.post1, under its own name): a
development build or a release candidate is not the release its version number leads to
(0.33.0.dev12+gabc1234 is a commit before 0.33.0, and an editable install's version does not
even name its code), so filing it as `0.33.0` would overwrite that release's golden and have
`--golden 0.33.0` and `goldens` present the development build's answers as the release's.
Kept under their full versions instead, they would crowd `goldens` (consecutive *releases*) with
builds nobody can install again; so they are not kept, and `--golden` names a final release.

One release may be served with more than one torch (the versions matrix pins one, a user's venv
another): each (release, torch) pair has its own file, so neither overwrites the other.

Layout: `<cache>/goldens/<golden key>/<release>+torch-<torch version>.json` (files of an older
harness, `<release>.json`, are read as the golden of the torch recorded inside them).

The dtype is among the key's flags, so each dtype's goldens are requests of their own; it is
recorded in the file too, for `goldens` to name it (the key is a hash).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.errors import BadInput
from harness.files import write_json_atomic
from harness.outcomes.chat import ChatResult
from harness.outcomes.outcome import Outcome
from harness.run.baseline_launch import NUMERICS_NEUTRAL_FIELDS, BaselineLaunch
from harness.spec.file_media import file_media_digests
from harness.spec.generations import parse_version
from harness.spec.settings import ServedVllm
from harness.spec.topology import DEFAULT_DTYPE, ServingConfig

GOLDEN_FORMAT = 2  # 2: the launch's environment and device in the key
TORCH_SEPARATOR = "+torch-"  # between the release and the torch version in a golden's name
REQUEST_LABEL_LENGTH = 12  # of a request's key, naming it in `goldens` beside its prompt
# A final release, as vLLM numbers them: X.Y[.Z][.postN], with an optional local build suffix
# (+cpu, +cu128). Anything else (.devN, rcN, aN, bN) is a build on the way to a release.
_FINAL_RELEASE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?(\.post\d+)?(?:\+[A-Za-z0-9.]+)?\s*$")
log = logging.getLogger(__name__)


def golden_key(
    serving: ServingConfig, model_digest: str, body: dict[str, Any], launch: BaselineLaunch
) -> str:
    """Like the baseline cache key, minus the vLLM and torch versions and the launch's argv
    (which follows the release's protocol generation); the launch's environment (inherited
    numerics variables, e.g. ATEN_CPU_CAPABILITY) and device are in it."""
    flags = {
        name: value
        for name, value in dataclasses.asdict(serving).items()
        if name not in NUMERICS_NEUTRAL_FIELDS and name != "model"
    }
    material = {
        "golden": GOLDEN_FORMAT,
        "model_digest": model_digest,
        "serving": flags,
        "request": body,
        "env": dict(launch.env),
        "device": launch.device,
    }
    media_files = file_media_digests(body)
    if media_files:  # as in the baseline cache's key: the file's bytes, not only its name
        material["media_files"] = media_files
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def release_of(version: str) -> str:
    """'0.31.0+cpu' -> '0.31.0': the release a version number leads to (bisect's ends)."""
    return ".".join(str(n) for n in parse_version(version))


def golden_release_of(version: str) -> str | None:
    """The final release a served version is, whatever its local build suffix ('0.31.0+cpu'
    -> '0.31.0', '0.8.5.post1' -> '0.8.5.post1'); None for a development build or a release
    candidate ('0.33.0.dev12+gabc1234', '0.33.0rc1'), whose answers are not the release's."""
    match = _FINAL_RELEASE.match(version)
    if match is None:
        return None
    return f"{match[1]}.{match[2]}.{match[3] or 0}{match[4] or ''}"


def golden_release_argument(text: str) -> str:
    """`--golden VERSION`: the final release it names, or one line saying only those are kept."""
    release = golden_release_of(text)
    if release is None:
        parse_version(text)  # a typo gets its own line
        raise BadInput(
            f"--golden {text}: goldens are kept for final releases only (a development "
            "build or release candidate is not filed); name one, e.g. 0.32.0"
        )
    return release


@dataclass(frozen=True)
class Golden:
    prompt: str
    release: str
    torch_version: str
    dtype: str
    result: ChatResult

    @property
    def token_ids(self) -> list[int]:
        return list(self.result.token_ids)


class GoldenStore:
    def __init__(self, directory: Path):
        self.directory = directory
        self._said_not_filed = False

    def _path(self, key: str, release: str, torch_version: str) -> Path:
        return self.directory / key / f"{release}{TORCH_SEPARATOR}{torch_version}.json"

    def store(
        self,
        key: str,
        prompt: str,
        served: ServedVllm,
        outcome: Outcome,
        *,
        dtype: str,
    ) -> bool:
        """File `outcome`, served in `dtype`, as the golden of the served release and torch;
        False when it is not filed (a failed answer, an unknown version, a build that is no
        final release's, such as a dev build or an editable install: the module's docstring
        says why)."""
        if outcome.result is None or not served.known:
            return False
        # An editable install runs its tree's code, whatever version it was installed as.
        release = None if served.source_tree else golden_release_of(served.version)
        if release is None:
            if not self._said_not_filed:
                log.info(
                    "[goldens] vLLM %s%s is not a final release's build: its answers are not "
                    "filed as goldens",
                    served.version,
                    f" (editable, {served.source_tree})" if served.source_tree else "",
                )
                self._said_not_filed = True
            return False
        write_json_atomic(
            self._path(key, release, served.torch_version),
            {
                "format": GOLDEN_FORMAT,
                "prompt": prompt,
                "vllm": served.version,
                "torch": served.torch_version,
                "dtype": dtype,
                "result": outcome.result.to_json(),
            },
        )
        return True

    def load_file(self, path: Path) -> Golden:
        """One golden file; a damaged one is one clear line, not a traceback."""
        release = path.stem.split(TORCH_SEPARATOR, 1)[0]
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                raise ValueError(f"expected a JSON object, found {type(data).__name__}")
            return Golden(
                str(data["prompt"]),
                release,
                str(data.get("torch", "unknown")),
                # A file from before the field: every run before --dtype served bfloat16.
                str(data.get("dtype", DEFAULT_DTYPE)),
                ChatResult.from_json(data["result"]),
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            cause = f"no field {exc}" if isinstance(exc, KeyError) else str(exc)
            raise BadInput(
                f"corrupt golden {path}: {cause}; delete it (the release's next sweep "
                "stores it again)"
            ) from None

    def goldens_of(self, key: str, release: str) -> list[Golden]:
        """Every golden of `release` for this request, one per torch it was served with."""
        found = {}
        # An older harness's file (`<release>.json`) first: a newer file of its torch wins.
        for path in (
            self.directory / key / f"{release}.json",
            *sorted((self.directory / key).glob(f"{release}{TORCH_SEPARATOR}*.json")),
        ):
            if path.exists():
                golden = self.load_file(path)
                found[golden.torch_version] = golden
        return list(found.values())

    def load(self, key: str, release: str, torch_version: str | None = None) -> Golden | None:
        """`release`'s golden for this request: the one of `torch_version` if there is one,
        else the only one; None if there is none. Several, none of `torch_version`, is
        BadInput: which torch's answers stand in must not be a guess."""
        goldens = self.goldens_of(key, release)
        if not goldens:
            return None
        same_torch = [g for g in goldens if g.torch_version == torch_version]
        if same_torch:
            return same_torch[0]
        if len(goldens) == 1:
            return goldens[0]
        torches = ", ".join(sorted(g.torch_version for g in goldens))
        raise BadInput(
            f"goldens of vLLM {release} for prompt {goldens[0].prompt!r} were served with "
            f"torch {torches}, none with the served torch {torch_version}; delete the ones "
            f"not to use under {self.directory / key}"
        )

    def outcome_for(
        self, key: str, prompt: str, release: str, torch_version: str | None = None
    ) -> Outcome:
        """`--golden`: VERSION's baseline answer to this request, or one clear line."""
        golden = self.load(key, release, torch_version)
        if golden is None:
            raise BadInput(
                f"no golden of vLLM {release} for prompt {prompt!r} (same model, "
                f"flags, request, environment and device) under {self.directory}; run that "
                "release's sweep once (here) to store it"
            )
        return Outcome(prompt=prompt, result=golden.result)

    def prompts_of(self, release: str) -> set[str]:
        """The prompts with a golden of `release` here, for any model, flags or request."""
        return {
            g.prompt for goldens in self.all().values() for g in goldens if g.release == release
        }

    def all(self) -> dict[str, list[Golden]]:
        """key -> its goldens, oldest release first (one per release and torch)."""
        found: dict[str, dict[tuple[str, str], Golden]] = {}
        for path in sorted(self.directory.glob("*/*.json")):
            if golden_release_of(path.stem.split(TORCH_SEPARATOR, 1)[0]) is None:
                # Named as no golden is (`goldens --dir` given a run directory: its
                # `versions/versions.json` was a "corrupt golden" to delete; found walking
                # the CLI).
                continue
            golden = self.load_file(path)
            mine = found.setdefault(path.parent.name, {})
            # An older harness's `<release>.json` sorts after `<release>+torch-...`: the
            # newer file of the same torch is kept.
            mine.setdefault((golden.release, golden.torch_version), golden)
        return {
            key: sorted(
                goldens.values(),
                key=lambda g: (parse_version(g.release), g.release, g.torch_version),
            )
            for key, goldens in found.items()
        }


@dataclass(frozen=True)
class Agreement:
    prompt: str
    older: str
    newer: str
    first_difference: int | None  # token index; None: identical token ids
    # The request's key, shown when another request has the same prompt name and dtype (another
    # model, flags, environment or device): their rows read alike (found walking the CLI).
    request: str = ""
    # The dtype, shown when the prompt has goldens of several: a hash alone did not say which.
    dtype: str = ""

    def describe(self) -> str:
        named = [self.dtype] if self.dtype else []
        named += [f"request {self.request}"] if self.request else []
        what = f"{self.prompt} ({', '.join(named)})" if named else self.prompt
        if self.first_difference is None:
            return f"{what}: {self.older} -> {self.newer}: identical"
        return f"{what}: {self.older} -> {self.newer}: differ from token {self.first_difference}"


def agreement(store: GoldenStore) -> list[Agreement]:
    """For every request with goldens of several releases: consecutive releases compared.
    Where a request has goldens of more than one torch, each is named with its torch, so a
    change of torch is never read as a change of release."""
    rows = []
    # A key's goldens share its dtype (one of its flags); the newest release's file is the
    # likeliest to have recorded it.
    every = {key: goldens for key, goldens in store.all().items() if len(goldens) > 1}
    dtypes = {key: goldens[-1].dtype for key, goldens in every.items()}
    prompts = Counter((goldens[0].prompt, dtypes[key]) for key, goldens in every.items())
    prompt_dtypes = Counter(prompt for prompt, _ in prompts)
    for key, goldens in every.items():
        prompt = goldens[0].prompt
        request = key[:REQUEST_LABEL_LENGTH] if prompts[prompt, dtypes[key]] > 1 else ""
        dtype = dtypes[key] if prompt_dtypes[prompt] > 1 else ""
        several_torches = len({g.torch_version for g in goldens}) > 1

        def label(golden: Golden, several_torches: bool = several_torches) -> str:
            return (
                f"{golden.release} (torch {golden.torch_version})"
                if several_torches
                else golden.release
            )

        for older, newer in zip(goldens, goldens[1:]):
            rows.append(
                Agreement(
                    newer.prompt,
                    label(older),
                    label(newer),
                    first_difference(older.token_ids, newer.token_ids),
                    request,
                    dtype,
                )
            )
    return sorted(
        rows, key=lambda a: (a.prompt, a.dtype, a.request, parse_version(a.older), a.older)
    )


def first_difference(a: list[int], b: list[int]) -> int | None:
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))
