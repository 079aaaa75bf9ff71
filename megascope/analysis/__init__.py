"""The analysis engine: from a run directory to answers an on-call engineer can act on.

Role in the data flow: reads a :class:`~megascope.store.Run` (DuckDB views over the Parquet
parts); every analysis is a documented SQL module in ``sql/`` plus a thin Python function that
returns a pandas DataFrame (or a JSON-ready dict for the report and hang localization). Heavy
work stays in DuckDB, so a 12,288-rank run is never loaded into pandas.

Example::

    from megascope.store import open_run
    from megascope import analysis
    run = open_run("runs/demo")
    analysis.stragglers(run)              # who is slow, where in TP/PP/DP, why
    analysis.localize(run)["suspects"]    # where the hang is
    analysis.report(run)                  # everything, as `megascope report --json` prints it
"""

from megascope.analysis.hang import localize, rank_states
from megascope.analysis.pipeline import bubbles, exposed_comm, host_lead, host_lead_summary
from megascope.analysis.report import clock_offsets, report
from megascope.analysis.skew import skew, skew_by_collective, skew_drift
from megascope.analysis.stragglers import StragglerConfig, stragglers
from megascope.analysis.stragglers import detect as stragglers_detect
from megascope.analysis.stragglers import dismissed as stragglers_dismissed
from megascope.analysis.stragglers import told as stragglers_told
from megascope.analysis.timeline import PHASES, heatmap, mfu, mfu_drift, step_times
from megascope.analysis.whatif import whatif

__all__ = [
    "PHASES",
    "StragglerConfig",
    "bubbles",
    "clock_offsets",
    "exposed_comm",
    "heatmap",
    "host_lead",
    "host_lead_summary",
    "localize",
    "mfu",
    "mfu_drift",
    "rank_states",
    "report",
    "skew",
    "skew_by_collective",
    "skew_drift",
    "step_times",
    "stragglers",
    "stragglers_detect",
    "stragglers_dismissed",
    "stragglers_told",
    "whatif",
]
