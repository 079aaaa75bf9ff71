"""Node health: what the heartbeats and self-tests say about each rank's host, GPU and links.

Role in the data flow: *analyze* (``findings``: heartbeats + diagnostics -> one row per problem,
joinable on rank or host) and an in-job *self-test* (``diagnose``/``selftest``/``outliers``: the
``megascope diagnose`` command, which needs torch and pyarrow only). The heartbeat sampler itself
lives with the collector (``megascope.collectors.heartbeat``).

Importing this package is cheap; ``health_findings`` pulls in duckdb/pandas when first used.

Example::

    from megascope.store import open_run
    from megascope.health import health_findings
    findings = health_findings(open_run("runs/job1").con)   # rank, host, finding, detail, ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megascope.health.findings import Finding, health_findings

__all__ = ["Finding", "health_findings"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from megascope.health import findings

        return getattr(findings, name)
    raise AttributeError(name)
