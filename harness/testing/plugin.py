"""The pytest plugin of the harness: its scenarios' session-wide fixtures and one start per
topology, and the harness's own tests' helpers. The repository's conftest.py registers it; it
registers its modules, one concern each:

- worker_ports: each xdist worker's own slice of the port range;
- session_account: the session's run directory, shared by its xdist workers, and the summary;
- collection: which items run, in which order, on which xdist worker; the markers;
- pool_hooks: the pool told which item begins, a group's topology stopped as the group ends;
- e2e_fixtures: the scenarios' fixtures (epd_config, epd_pool, epd_sweep, epd_live, ...);
- harness_test_fixtures: the harness's own tests' (epd_cli, fake_vllm, port_locks, ...).

Below them, plain modules: groups (an e2e item's group, the queue of them), session_options
(the `--epd-*` options: the run they ask for, what they refuse), before_stop (what is served
as a topology is about to stop). Options are in the repository's conftest.py.

A module is listed after those it imports: pytest imports each listed one for assertion
rewriting, and warns of one that another listed module imported first.
"""

pytest_plugins = [
    "harness.testing.worker_ports",
    "harness.testing.session_account",
    "harness.testing.collection",
    "harness.testing.pool_hooks",
    "harness.testing.e2e_fixtures",
    "harness.testing.harness_test_fixtures",
]
