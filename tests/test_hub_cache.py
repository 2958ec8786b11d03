"""harness/preflight/model.py: where a model given by name is looked up must be where
huggingface_hub keeps it (its own variables, read as it reads them), or an offline run says
"not in the Hugging Face cache" of a model that is."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.preflight.model import cached_snapshot, hf_hub_cache, hub_offline

pytestmark = pytest.mark.unit

HOME = Path.home()


@pytest.mark.parametrize(
    "environ,expected",
    [
        ({}, HOME / ".cache" / "huggingface" / "hub"),
        ({"HF_HUB_CACHE": "/data/hub", "HF_HOME": "/elsewhere"}, Path("/data/hub")),
        ({"HF_HOME": "/data/hf"}, Path("/data/hf/hub")),
        # huggingface_hub expands a leading ~ in both (its constants.py)
        ({"HF_HUB_CACHE": "~/hub"}, HOME / "hub"),
        ({"HF_HOME": "~/hf"}, HOME / "hf" / "hub"),
        # without HF_HOME, the hub keeps its cache under XDG_CACHE_HOME
        ({"XDG_CACHE_HOME": "/data/cache"}, Path("/data/cache/huggingface/hub")),
        # the legacy name, still read by the hub after HF_HUB_CACHE
        ({"HUGGINGFACE_HUB_CACHE": "/legacy/hub", "HF_HOME": "/data/hf"}, Path("/legacy/hub")),
        # and expands variables in both, as a unit file or an image's ENV may leave them
        # (found in review: the harness looked under a directory named "$DATA")
        ({"HF_HOME": "$DATA/hf", "DATA": "/data"}, Path("/data/hf/hub")),
        ({"HF_HUB_CACHE": "${DATA}/hub", "DATA": "/data"}, Path("/data/hub")),
        ({"HUGGINGFACE_HUB_CACHE": "$DATA/hub", "DATA": "/data"}, Path("/data/hub")),
        ({"HF_HOME": "$UNSET_HERE/hf"}, Path("$UNSET_HERE/hf/hub")),  # left as it is
    ],
)
def test_the_hub_cache_is_where_huggingface_hub_puts_it(
    environ: dict[str, str], expected: Path
) -> None:
    assert hf_hub_cache(environ) == expected


@pytest.mark.parametrize(
    "variable,value",
    [("HF_HUB_OFFLINE", "1"), ("HF_HUB_OFFLINE", "true"), ("HF_HUB_OFFLINE", "YES")]
    + [("TRANSFORMERS_OFFLINE", "1")],
)
def test_a_model_missing_offline_names_offline_mode(
    variable: str, value: str, tmp_path: Path, monkeypatch
) -> None:
    """huggingface_hub is offline for any of its true values (1, ON, YES, TRUE, any case) of
    HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE; the harness read only HF_HUB_OFFLINE=1, and for the
    others tried a fetch the hub refuses, its line naming a failed download, not offline mode
    (found in review)."""
    from harness.errors import BadInput
    from harness.preflight import model

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv(variable, value)
    monkeypatch.setattr(model, "fetch_snapshot", lambda name: pytest.fail(f"fetched {name}"))
    with pytest.raises(BadInput) as refused:
        model.resolve_named_model("org/absent")
    assert str(refused.value) == (
        f"model org/absent is not in the Hugging Face cache ({tmp_path / 'hub'}) and "
        f"{variable}={value} forbids fetching it: download it first (hf download org/absent) "
        "or pass --model DIR"
    )


@pytest.mark.parametrize(
    "environ,offline",
    [
        ({"HF_HUB_OFFLINE": "", "TRANSFORMERS_OFFLINE": "1"}, "TRANSFORMERS_OFFLINE=1"),
        ({"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "1"}, None),
        ({"TRANSFORMERS_OFFLINE": "on"}, "TRANSFORMERS_OFFLINE=on"),
        ({"HF_HUB_OFFLINE": "false"}, None),
    ],
)
def test_transformers_offline_counts_only_where_hf_hub_offline_is_unset_or_empty(
    environ: dict[str, str], offline: str | None
) -> None:
    """huggingface_hub reads `HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE`: an empty HF_HUB_OFFLINE
    (exported blank by a job template) leaves TRANSFORMERS_OFFLINE to decide, a set one
    decides alone; taken otherwise, the run tried a fetch the hub would refuse."""
    assert hub_offline(environ) == offline


def test_a_snapshot_is_cached_only_once_it_holds_its_config(tmp_path: Path) -> None:
    """A download cut short leaves refs/main and a snapshot directory without config.json:
    taken as the cached model, the run was refused as "no config.json" where fetching the
    model again would have completed it."""
    repo = tmp_path / "models--org--name"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123\n")
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    assert cached_snapshot("org/name", tmp_path) is None
    (snapshot / "config.json").write_text("{}")
    assert cached_snapshot("org/name", tmp_path) == snapshot
