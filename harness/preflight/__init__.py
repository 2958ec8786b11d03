"""Pre-flight: every input of a run checked (cheapest first) and assembled into a `RunConfig`
before any server starts; the CLI, the pytest fixtures and the benchmark all go through
`prepare_run`."""

from harness.preflight.config import RunConfig, RunRequest, prepare_run

__all__ = ["RunConfig", "RunRequest", "prepare_run"]
