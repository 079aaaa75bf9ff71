"""``create_app``: the Dash dashboard over one or more run directories.

Role in the data flow: the presentation end. It wires the run registry (ids, live refresh, cache),
the shell and the pages (``pages/``), ``/metrics`` for Prometheus and ``/trace`` for Perfetto
exports onto one Dash app. ``megascope serve`` and ``megascope demo`` run it; tests call it with
``start_watcher=False`` and drive polling themselves.

Example::

    from megascope.dashboard import create_app
    app = create_app(["runs/demo"])            # 127.0.0.1 only, no token needed
    app.run(host="127.0.0.1", port=8050)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from dash import Dash
from megascope.dashboard import data, shell
from megascope.dashboard.pages import health, heatmap, overview, stragglers, timeline, topology
from megascope.dashboard.prom import install_metrics_route
from megascope.dashboard.runs import RunRegistry
from megascope.dashboard.security import check_bind, install_guards
from megascope.dashboard.trace import install_trace_route

log = logging.getLogger(__name__)

ASSETS = Path(__file__).parent / "assets"
PAGE_MODULES: dict[str, ModuleType] = {
    "overview": overview,
    "heatmap": heatmap,
    "stragglers": stragglers,
    "topology": topology,
    "timeline": timeline,
    "health": health,
}


def create_app(
    run_dirs: Sequence[Path | str],
    *,
    host: str = "127.0.0.1",
    token: str | None = None,
    poll_interval_s: float = 2.0,
    wait: bool = False,
    start_watcher: bool = True,
    perfetto_ui: str = "https://ui.perfetto.dev",
    compact_every_s: float | None = None,
) -> Dash:
    """A dashboard serving ``run_dirs`` (only those: URLs name runs by id, never by path).

    ``host`` is where it will listen: anything but loopback needs ``token``. ``wait`` accepts
    directories a job has not written yet. ``perfetto_ui`` is where "Open in Perfetto UI"
    sends traces (a self-hosted UI, for sites without internet access). ``compact_every_s``: the
    watcher compacts each served run this often (``megascope compact``'s live pass; None: never).
    The registry is ``registry_of(app)``.
    """
    check_bind(host, token)
    registry = RunRegistry(run_dirs, wait=wait, poll_interval_s=poll_interval_s, compact_every_s=compact_every_s)
    for fetch in data.WARM:
        registry.add_warmer(fetch)
    app = Dash(
        __name__, title="megascope", update_title="", assets_folder=str(ASSETS),
        suppress_callback_exceptions=True,  # page components appear only when their page is shown
    )
    app.server.extensions["megascope"] = registry
    app.server.config["MEGASCOPE_PERFETTO_UI"] = perfetto_ui
    install_guards(app.server, host=host, token=token)
    install_metrics_route(app.server, registry)
    install_trace_route(app.server, registry)
    app.layout = shell.layout(registry)
    shell.register(app, registry, PAGE_MODULES)
    for module in PAGE_MODULES.values():
        module.register(app, registry)
    if start_watcher:
        registry.start()
    return app


def registry_of(app: Dash) -> RunRegistry:
    """The run registry behind an app made by :func:`create_app`."""
    registry = app.server.extensions["megascope"]
    assert isinstance(registry, RunRegistry)
    return registry
