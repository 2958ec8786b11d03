"""`--dtype` (harness/preflight/dtype.py): a T4 or V100 box runs the harness in float16, and a
dtype the served vLLM would not compute in is refused before anything starts, in one line
naming the cause, never served as something else. The GPUs and the served interpreter are
given as data here; tests/test_devices.py reads them from a fake nvidia-smi, and
tests/test_bad_input.py shows the refusals as the CLI prints them."""

from __future__ import annotations

import pytest

from harness.errors import BadInput
from harness.preflight import RunRequest
from harness.preflight.config import check_arguments
from harness.preflight.dtype import check_dtype_name
from harness.spec.instances import InstanceSpec
from harness.spec.platforms import CPU
from harness.spec.topology import DEFAULT_DTYPE, DTYPES, Role, serving_for
from harness.testing.session_options import session_request

pytestmark = pytest.mark.unit


def test_every_instance_serves_the_dtype_asked_and_bfloat16_by_default() -> None:
    assert DEFAULT_DTYPE == "bfloat16" == RunRequest().dtype
    for dtype in DTYPES:
        argv = InstanceSpec("b", Role.BASELINE, 20000, serving_for(CPU, "/m", dtype=dtype)).argv()
        assert argv[argv.index("--dtype") + 1] == dtype


def test_vllms_auto_is_refused_with_its_cause_and_an_unknown_name_with_the_known() -> None:
    assert [check_dtype_name(d) for d in DTYPES] == list(DTYPES)
    with pytest.raises(BadInput, match="^--dtype auto lets vLLM choose each instance's dtype"):
        check_dtype_name("auto")
    with pytest.raises(BadInput, match=r"^unknown dtype 'half' \(known: bfloat16, float16, "):
        check_dtype_name("half")
    # The preflight's first, cheapest checks hold it: a pytest session's --epd-dtype too.
    with pytest.raises(BadInput, match="^--dtype auto"):
        check_arguments(RunRequest(dtype="auto"), read_files=False)


def test_the_sessions_epd_dtype_is_the_runs_dtype() -> None:
    options = {"--epd-dtype": "float16", "--epd-platform": "cpu"}
    request = session_request(options.get, "runs", ("main", 1))
    assert request.dtype == "float16"
