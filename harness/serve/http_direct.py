"""The harness's one urllib opener for its calls to the servers it runs or attaches to: straight
to them, never through the environment's HTTP(S)_PROXY / ALL_PROXY.

urllib's default opener follows those and, on Linux, bypasses nothing by itself, not even
127.0.0.1, unless NO_PROXY names it: on a CI runner with a proxy set, a health check, a
/metrics read or an admin call to a loopback server went to that proxy and failed. The package
index reads of `harness.preflight` go to the internet and keep the environment's proxy. The chat
client's httpx is told the same (`trust_env=False`, `harness.serve.client`); scripts that run
without the harness (an export's check.py, the fake vLLM) build their own.
`tests/test_direct_http_scan.py` holds every module to this.
"""

from __future__ import annotations

import urllib.request

DIRECT_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
