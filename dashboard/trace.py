"""``/trace/<run>.pftrace?ranks=...&steps=...``: the Perfetto trace of exactly a timeline selection.

Role in the data flow: the timeline page's download link and its "Open in Perfetto UI" button
fetch this route; it calls :func:`megascope.export.export_perfetto` with the selection. The run
is looked up by id in the registry and the selection parsed as numbers, so nothing in the URL
reaches the file system.
"""

from __future__ import annotations

import io
import logging

import flask
from megascope.dashboard import routes
from megascope.dashboard.runs import RunRegistry

from megascope.errors import MegascopeError

log = logging.getLogger(__name__)


def _plain(text: str, status: int) -> flask.Response:
    return flask.Response(text.rstrip("\n") + "\n", status=status, mimetype="text/plain")


def install_trace_route(server: flask.Flask, registry: RunRegistry) -> None:
    @server.route("/trace/<run_id>.pftrace")
    def _trace(run_id: str) -> flask.Response:
        served = registry.get(run_id)
        if served is None or served.run is None:
            return _plain(f"no run {run_id!r} on this dashboard", 404)
        args = flask.request.args
        try:
            ranks = routes.parse_ranks(args.get("ranks"), world_size=served.run.meta.world_size)
            steps = routes.parse_steps(args.get("steps"))
        except MegascopeError as exc:
            return _plain(str(exc), 400)
        if ranks is None or steps is None:
            return _plain("a trace needs ?ranks=...&steps=... (the timeline page builds this link)", 400)
        from megascope.export import export_perfetto

        buffer = io.BytesIO()
        try:
            with served.locked() as run:
                export_perfetto(run, buffer, ranks=ranks, steps=steps)
        except MegascopeError as exc:
            return _plain(str(exc), 422)
        except Exception as exc:  # noqa: BLE001 - one line to the browser, the traceback to the log
            log.exception("trace export of run %s failed", served.id)
            return _plain(f"trace export failed: {type(exc).__name__}: {exc}", 500)
        name = f"{served.id}-ranks{routes.format_ranks(ranks)}-steps{steps[0]}-{steps[1]}.pftrace"
        response = flask.Response(buffer.getvalue(), mimetype="application/octet-stream")
        if args.get("download"):
            response.headers["Content-Disposition"] = f'attachment; filename="{name}"'
        return response
