"""``/metrics`` in Prometheus' text format: MFU, step time, tokens/s, stragglers and hang per served run.

Role in the data flow: a custom ``prometheus_client`` collector over the run registry. Each scrape
reads the per-generation cache (the watcher precomputes these results after each refresh), so
Grafana and alerting rules pick megascope up without a plugin and without re-running analyses.

Example (Prometheus scrape config)::

    - job_name: megascope
      static_configs: [{targets: ["127.0.0.1:8050"]}]
      authorization: {credentials: "<the --token>"}     # only when served with --token
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import flask
from megascope.dashboard import data
from megascope.dashboard.runs import RunRegistry
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from megascope.analysis.timeline import steady_mean

log = logging.getLogger(__name__)


def _label(value: Any) -> str:
    """A coordinate as a label value ("" when the run has no such axis)."""
    if value is None or (isinstance(value, float) and value != value):
        return ""
    return str(int(value))


class RunsCollector(Collector):
    """One sample per served run for each gauge; a run that cannot be analysed reports ``up 0``."""

    def __init__(self, registry: RunRegistry) -> None:
        self.registry = registry

    def describe(self) -> list[Metric]:
        return []  # no collect() at registration time: that would analyse every run on start-up

    def collect(self) -> Iterator[Metric]:
        from megascope.analysis.runstate import STATES

        labels = ["run"]
        up = GaugeMetricFamily("megascope_run_up", "1 when the run directory could be read and analysed", labels=labels)
        last_step = GaugeMetricFamily("megascope_last_step", "Last step with timings", labels=labels)
        mfu = GaugeMetricFamily("megascope_mfu_ratio", "Model FLOPs utilisation of the last step (0-1)", labels=labels)
        mfu_mean = GaugeMetricFamily("megascope_mfu_mean_ratio", "Mean MFU over the steps with timings after the first, the warm-up (0-1)",
                                     labels=labels)
        step_time = GaugeMetricFamily("megascope_step_time_seconds", "Step time of the last step", labels=labels)
        tokens = GaugeMetricFamily("megascope_tokens_per_second", "Training throughput of the last step", labels=labels)
        stragglers = GaugeMetricFamily("megascope_stragglers", "Ranks the analysis names as stragglers", labels=labels)
        worst = GaugeMetricFamily("megascope_straggler_worst_slowdown_ratio",
                                  "Slowdown of the worst straggler against its peers (1 when none)", labels=labels)
        hung = GaugeMetricFamily("megascope_hung", "1 when the run is hung (a collective some members never entered)",
                                 labels=labels)
        state_family = GaugeMetricFamily("megascope_run_state", "1 for the run's current state (running, stalled, "
                                         "hung, finished, failed), 0 for the others", labels=["run", "state"])
        data_age = GaugeMetricFamily("megascope_last_data_age_seconds",
                                     "Seconds since spans, markers or metrics were last written", labels=labels)
        culprit = GaugeMetricFamily("megascope_hang_culprit", "1 for the rank the hang analysis names, while hung",
                                    labels=["run", "rank", "host", "pp", "dp", "tp", "group"])
        failed_rank = GaugeMetricFamily("megascope_failed_rank",
                                        "1 for the rank a failed run's state names (it raised first, or ended "
                                        "without a word while the others failed after it)",
                                        labels=["run", "rank", "where"])
        worst_rank = GaugeMetricFamily("megascope_straggler_worst",
                                       "Slowdown of the worst straggler, labelled with its place and cause",
                                       labels=["run", "rank", "host", "pp", "dp", "tp", "cause"])
        families = [up, last_step, mfu, mfu_mean, step_time, tokens, stragglers, worst, hung, state_family,
                    data_age, culprit, failed_rank, worst_rank]
        for served in self.registry:
            label = [served.id]
            if served.run is None:
                up.add_metric(label, 0)
                continue
            try:
                per_step = data.live_per_step(served)  # the followed steps too, on a big live run
                frame = data.stragglers(served)
                state = data.run_state(served)
            except Exception as exc:  # noqa: BLE001 - one bad run must not break the scrape of the others
                log.warning("metrics for run %s: %s", served.id, exc)
                up.add_metric(label, 0)
                continue
            up.add_metric(label, 1)
            if len(per_step):
                last = per_step.iloc[-1]
                last_step.add_metric(label, float(last["step"]))
                for family, column, scale in ((mfu, "mfu", 1.0), (step_time, "step_time_ns", 1e-9),
                                              (tokens, "tokens_per_s", 1.0)):
                    if column in per_step and last[column] == last[column]:  # not NaN
                        family.add_metric(label, float(last[column]) * scale)
                mean = steady_mean(per_step, "mfu")
                if mean is not None:
                    mfu_mean.add_metric(label, mean)
            stragglers.add_metric(label, len(frame))
            worst.add_metric(label, float(frame["slowdown"].max()) if len(frame) else 1.0)
            hung.add_metric(label, 1.0 if state["hung"] else 0.0)
            for name in STATES:
                state_family.add_metric([served.id, name], 1.0 if state["state"] == name else 0.0)
            if state.get("last_data_age_s") is not None:
                data_age.add_metric(label, float(state["last_data_age_s"]))
            suspect = state.get("culprit")
            if state["state"] == "failed" and suspect:
                failed_rank.add_metric([served.id, str(suspect["rank"]), str(suspect.get("where") or "")], 1.0)
            if state["hung"] and suspect:
                coords = suspect.get("coords") or {}
                culprit.add_metric([served.id, str(suspect["rank"]), str(suspect.get("host", "")),
                                    *(_label(coords.get(a)) for a in ("pp", "dp", "tp")),
                                    str(suspect.get("group") or "")], 1.0)
            if len(frame):
                top = frame.iloc[0]
                worst_rank.add_metric([served.id, str(int(top["rank"])), str(top.get("host", "")),
                                       *(_label(top.get(a)) for a in ("pp", "dp", "tp")), str(top.get("cause", ""))],
                                      float(top["slowdown"]))
        yield from families


def install_metrics_route(server: flask.Flask, registry: RunRegistry) -> None:
    prom_registry = CollectorRegistry(auto_describe=False)
    prom_registry.register(RunsCollector(registry))

    @server.route("/metrics")
    def _metrics() -> flask.Response:
        # content_type, not mimetype: flask would append a second charset to CONTENT_TYPE_LATEST.
        return flask.Response(generate_latest(prom_registry), content_type=CONTENT_TYPE_LATEST)
