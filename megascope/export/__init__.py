"""Perfetto (protobuf) and Chrome JSON traces of a run, whole or a selection.

Role in the data flow: store -> export. The CLI (``megascope export perfetto|chrome``) and the
dashboard's "download this selection" call these two functions; both stream a chunk of ranks at a
time, add the hosts' estimated clock offsets (or, with ``clock="raw"``, keep the host clocks as
recorded), and write the same bytes for the same run and selection.

Example::

    from megascope.export import export_perfetto
    stats = export_perfetto("runs/demo", "demo.pftrace", ranks=range(8), steps=(10, 12))
    print(stats.spans, stats.flows, stats.bytes)
"""

from megascope.export.chrome import export_chrome
from megascope.export.common import ExportStats
from megascope.export.perfetto import export_perfetto
from megascope.export.selection import Selection, parse_ranks, parse_steps, parse_window

__all__ = ["ExportStats", "Selection", "export_chrome", "export_perfetto", "parse_ranks", "parse_steps", "parse_window"]
