"""harness/preflight/model.py: where a model given by name is looked up must be where
huggingface_hub keeps it (its own variables, read as it reads them), or an offline run says
"not in the Hugging Face cache" of a model that is."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.preflight.model import hf_hub_cache

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
    ],
)
def test_the_hub_cache_is_where_huggingface_hub_puts_it(
    environ: dict[str, str], expected: Path
) -> None:
    assert hf_hub_cache(environ) == expected
