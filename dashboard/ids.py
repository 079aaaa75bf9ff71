"""Every Dash component id of the dashboard, in one place.

Role in the data flow: layouts (``megascope.dashboard.layout`` and ``pages/``) create components
with these ids and callbacks refer to them; browser tests find elements by them. A typo becomes an
``AttributeError`` at import time instead of a callback that never fires.
"""

from __future__ import annotations

# Shell (every page)
URL = "url"
TICK = "tick"  # dcc.Interval that polls for new data of a live run
GENERATION = "generation"  # dcc.Store: {"run": id, "gen": n}; bumps when new parts arrive
LIVE_GENERATION = "live-generation"  # dcc.Store: {"run": id, "live": n}; bumps when the step sums' follower reads new steps
RUN_SELECT = "run-select"
NAV = "nav"
PAGE = "page"
STATUS = "status"  # "live: step 41, 8 ranks" line in the header
RUN_STATE = "run-state"  # the run state badge in the header: running, stalled, hung, finished, failed
PROBLEMS = "problems"

# Overview
OVERVIEW_CARDS = "overview-cards"
OVERVIEW_ALERTS = "overview-alerts"
OVERVIEW_GRAPH = "overview-graph"

# Heat-map
HEATMAP_PHASE = "heatmap-phase"
HEATMAP_GRAPH = "heatmap-graph"
HEATMAP_NOTE = "heatmap-note"
HEATMAP_TOP = "heatmap-top"  # the worst ranks, listed beside the map
HEATMAP_LIVE = "heatmap-live"  # the followed steps' map, shown while the analyses are behind
HEATMAP_LIVE_PHASE = "heatmap-live-phase"
HEATMAP_LIVE_GRAPH = "heatmap-live-graph"
HEATMAP_LIVE_NOTE = "heatmap-live-note"

# Stragglers
STRAGGLER_TABLE = "straggler-table"
STRAGGLER_WHATIF = "straggler-whatif"

# Topology
TOPOLOGY_GRAPH = "topology-graph"
TOPOLOGY_BANNER = "topology-banner"
TOPOLOGY_SUSPECTS = "topology-suspects"

# Timeline
TIMELINE_RANKS = "timeline-ranks"
TIMELINE_STEPS = "timeline-steps"
TIMELINE_APPLY = "timeline-apply"
TIMELINE_GRAPH = "timeline-graph"
TIMELINE_NOTE = "timeline-note"
TIMELINE_BUBBLES = "timeline-bubbles"
TIMELINE_DOWNLOAD_BUTTON = "timeline-download-button"
TIMELINE_DOWNLOAD = "timeline-download"
TIMELINE_PERFETTO_BUTTON = "timeline-perfetto-button"
TIMELINE_TRACE_URL = "timeline-trace-url"  # dcc.Store: the /trace URL of the current selection
TIMELINE_PERFETTO_STATUS = "timeline-perfetto-status"

# Health
HEALTH_METRIC = "health-metric"
HEALTH_GRAPH = "health-graph"
HEALTH_HOSTS = "health-hosts"
HEALTH_DIAGNOSTICS = "health-diagnostics"
HEALTH_FINDINGS = "health-findings"
