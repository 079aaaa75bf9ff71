"""megascope.dashboard: the Dash dashboard (live MFU, heat-maps, stragglers, topology, timeline, health).

Role in the data flow: the presentation end, over run directories opened with
:mod:`megascope.store` and analysed by :mod:`megascope.analysis`. Needs the ``dashboard`` extra
(dash, plotly, prometheus-client).

Example::

    from megascope.dashboard import create_app
    create_app(["runs/demo"]).run(port=8050)
"""

from __future__ import annotations

from megascope.dashboard.app import create_app, registry_of

__all__ = ["create_app", "registry_of"]
