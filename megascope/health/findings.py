"""Health findings: heartbeats and self-test results turned into named problems per rank.

Role in the data flow: *analyze*. Reads the ``heartbeats``, ``diagnostics`` and ``ranks`` views of
an opened run (``megascope.store``) and returns one row per problem, so the straggler and hang
analyses can join a slow or silent rank to its likely cause (a throttled clock, a hot GPU, an XID)
on ``rank`` (or on ``host`` for host-wide rows, whose ``rank`` is null).

Findings (``Finding``), most severe first:

* ``xid`` -- the driver reported a critical XID error on the GPU;
* ``ecc`` -- uncorrected ECC errors, a pending row remap, or a failed one;
* ``silent`` -- the rank's (or host's) heartbeats stopped: none for ``silent_after`` periods before
  the newest heartbeat of the run, or a rank of the ``ranks`` table that never sent one;
* ``throttled`` -- the clock was held down by hardware slowdown, thermal or power-brake reasons
  (``sw_power_cap`` alone is normal under full load and not a finding);
* ``high_temp`` -- the GPU came within ``temp_margin_c`` of its own slowdown temperature (or
  reached ``temp_max_c`` where the card does not say);
* ``ib_link`` -- an InfiniBand port left ACTIVE or counted link-down events during the run;
* ``diagnose_failed`` / ``diagnose_slow`` -- a self-test result was wrong, or slow against peers;
* ``collector_drops`` -- the collector counted dropped rows or write errors.

Each finding's SQL is a CTE below with a comment; the Python is a thin wrapper.

Example::

    from megascope.store import open_run
    from megascope.health import health_findings
    run = open_run("runs/job1")
    health_findings(run.cursor())[["rank", "host", "finding", "detail"]]
"""

from __future__ import annotations

import enum
import logging

import duckdb
import pandas as pd

from megascope.errors import ConfigError

log = logging.getLogger(__name__)


class Finding(enum.StrEnum):
    XID = "xid"
    ECC = "ecc"
    SILENT = "silent"
    THROTTLED = "throttled"
    HIGH_TEMP = "high_temp"
    IB_LINK = "ib_link"
    DIAGNOSE_FAILED = "diagnose_failed"
    DIAGNOSE_SLOW = "diagnose_slow"
    COLLECTOR_DROPS = "collector_drops"


COLUMNS = ["rank", "host", "finding", "detail", "device", "first_ns", "last_ns"]

# NVML clock-event bits that mean the hardware slowed the clock (not idle, not the normal power cap):
# hw_slowdown 0x8 | sw_thermal 0x20 | hw_thermal 0x40 | hw_power_brake 0x80.
SERIOUS_THROTTLE_MASK = 0x8 | 0x20 | 0x40 | 0x80

_SQL = """
WITH
-- Heartbeat rows with a rank filled in: host-wide GPU rows ("gpuN", rank null) take the rank whose
-- device is cuda:N on that host, when the ranks table knows one.
hb AS (
    SELECT h.host, coalesce(h.rank, r.rank) AS rank, h.time_ns, h.device, h.metric, h.value, h.text
    FROM heartbeats h
    LEFT JOIN ranks r
      ON h.rank IS NULL AND h.device LIKE 'gpu%' AND r.host = h.host
     AND r.device = 'cuda:' || substr(h.device, 4)
),
-- The newest heartbeat of the run: the "now" against which silence is judged.
run_now AS (
    SELECT coalesce(CAST($now_ns AS BIGINT), max(time_ns)) AS now_ns FROM heartbeats
),
-- Each sampler's last sign of life and the period it promised (the larger of sample and flush period).
beats AS (
    SELECT host, rank,
           max(time_ns) FILTER (WHERE metric = 'heartbeat') AS last_ns,
           min(time_ns) AS first_ns,
           greatest(coalesce(max(value) FILTER (WHERE metric = 'heartbeat_interval_s'), 0),
                    coalesce(max(value) FILTER (WHERE metric = 'heartbeat_flush_s'), 0)) AS period_s
    FROM heartbeats
    GROUP BY host, rank
),
silent AS (
    SELECT b.rank, b.host, 'silent' AS finding,
           printf('no heartbeat for %.1f s before the newest one of the run (expected every %.1f s)',
                  (n.now_ns - b.last_ns) / 1e9, b.period_s) AS detail,
           CAST(NULL AS VARCHAR) AS device, b.last_ns AS first_ns, b.last_ns AS last_ns
    FROM beats b, run_now n
    WHERE b.last_ns IS NOT NULL AND b.period_s > 0
      AND n.now_ns - b.last_ns > $silent_after * b.period_s * 1e9
),
-- Ranks the job registered that never sent a heartbeat, in a run where others did.
never AS (
    SELECT r.rank, r.host, 'silent' AS finding, 'no heartbeat at all from this rank' AS detail,
           CAST(NULL AS VARCHAR) AS device, CAST(NULL AS BIGINT) AS first_ns, CAST(NULL AS BIGINT) AS last_ns
    FROM ranks r
    WHERE EXISTS (SELECT 1 FROM heartbeats WHERE rank IS NOT NULL)
      AND NOT EXISTS (SELECT 1 FROM heartbeats h WHERE h.rank = r.rank)
),
throttle AS (
    SELECT rank, host, device,
           count(*) AS samples,
           count(*) FILTER (WHERE (CAST(value AS BIGINT) & $throttle_mask) <> 0) AS bad,
           string_agg(DISTINCT text, ';') FILTER (WHERE (CAST(value AS BIGINT) & $throttle_mask) <> 0) AS reasons,
           min(time_ns) FILTER (WHERE (CAST(value AS BIGINT) & $throttle_mask) <> 0) AS first_ns,
           max(time_ns) FILTER (WHERE (CAST(value AS BIGINT) & $throttle_mask) <> 0) AS last_ns
    FROM hb WHERE metric = 'gpu_throttle_reasons'
    GROUP BY rank, host, device
),
-- SM clock while throttled (same sample), against the card's maximum.
clocks AS (
    SELECT c.rank, c.host, c.device,
           median(c.value) FILTER (WHERE c.metric = 'gpu_sm_clock_mhz' AND t.time_ns IS NOT NULL) AS sm_mhz,
           max(c.value) FILTER (WHERE c.metric = 'gpu_sm_clock_max_mhz') AS sm_max_mhz
    FROM hb c
    LEFT JOIN hb t
      ON t.metric = 'gpu_throttle_reasons' AND (CAST(t.value AS BIGINT) & $throttle_mask) <> 0
     AND t.host = c.host AND t.device = c.device AND t.rank IS NOT DISTINCT FROM c.rank AND t.time_ns = c.time_ns
    WHERE c.metric IN ('gpu_sm_clock_mhz', 'gpu_sm_clock_max_mhz')
    GROUP BY c.rank, c.host, c.device
),
throttled AS (
    SELECT t.rank, t.host, 'throttled' AS finding,
           printf('%s: %s in %d of %d samples', t.device, t.reasons, t.bad, t.samples)
             || coalesce(printf('; SM clock %.0f of %.0f MHz while throttled', c.sm_mhz, c.sm_max_mhz), '') AS detail,
           t.device, t.first_ns, t.last_ns
    FROM throttle t
    LEFT JOIN clocks c ON c.host = t.host AND c.device = t.device AND c.rank IS NOT DISTINCT FROM t.rank
    WHERE t.bad > 0
),
temps AS (
    SELECT rank, host, device,
           max(value) FILTER (WHERE metric = 'gpu_temp_c') AS max_c,
           max(value) FILTER (WHERE metric = 'gpu_temp_slowdown_c') AS slowdown_c,
           arg_max(time_ns, value) FILTER (WHERE metric = 'gpu_temp_c') AS at_ns
    FROM hb WHERE metric IN ('gpu_temp_c', 'gpu_temp_slowdown_c')
    GROUP BY rank, host, device
),
high_temp AS (
    SELECT rank, host, 'high_temp' AS finding,
           printf('%s: %.0f C', device, max_c)
             || CASE WHEN slowdown_c IS NOT NULL THEN printf(' (slowdown at %.0f C)', slowdown_c)
                     ELSE printf(' (limit %.0f C)', CAST($temp_max_c AS DOUBLE)) END AS detail,
           device, at_ns AS first_ns, at_ns AS last_ns
    FROM temps
    WHERE max_c >= coalesce(slowdown_c - $temp_margin_c, $temp_max_c)
),
xid AS (
    SELECT rank, host, 'xid' AS finding,
           printf('%s: XID %s (%d events)', device,
                  string_agg(DISTINCT CAST(CAST(value AS BIGINT) AS VARCHAR), ', '), count(*)) AS detail,
           device, min(time_ns) AS first_ns, max(time_ns) AS last_ns
    FROM hb WHERE metric = 'gpu_xid'
    GROUP BY rank, host, device
),
ecc AS (
    SELECT rank, host, 'ecc' AS finding,
           concat_ws('; ',
               CASE WHEN max(value) FILTER (WHERE metric = 'gpu_ecc_uncorrected') > 0
                    THEN printf('%.0f uncorrected ECC errors', max(value) FILTER (WHERE metric = 'gpu_ecc_uncorrected')) END,
               CASE WHEN max(value) FILTER (WHERE metric = 'gpu_remapped_rows_pending') > 0
                    THEN 'row remap pending (needs a GPU reset)' END,
               max(text) FILTER (WHERE metric = 'gpu_remapped_rows_pending')) AS detail,
           device, min(time_ns) AS first_ns, max(time_ns) AS last_ns
    FROM hb WHERE metric IN ('gpu_ecc_uncorrected', 'gpu_remapped_rows_pending')
    GROUP BY rank, host, device
    HAVING max(value) > 0 OR max(text) IS NOT NULL
),
ib_link AS (
    SELECT rank, host, 'ib_link' AS finding,
           concat_ws('; ',
               CASE WHEN min(value) FILTER (WHERE metric = 'ib_port_active') = 0
                    THEN 'port not ACTIVE (' || max(text) FILTER (WHERE metric = 'ib_port_active' AND value = 0) || ')' END,
               CASE WHEN max(value) FILTER (WHERE metric = 'ib_link_downed')
                         > min(value) FILTER (WHERE metric = 'ib_link_downed')
                    THEN printf('%.0f link-down events', max(value) FILTER (WHERE metric = 'ib_link_downed')
                                                         - min(value) FILTER (WHERE metric = 'ib_link_downed')) END)
               AS detail,
           device, min(time_ns) AS first_ns, max(time_ns) AS last_ns
    FROM hb WHERE metric IN ('ib_port_active', 'ib_link_downed')
    GROUP BY rank, host, device
    HAVING min(value) FILTER (WHERE metric = 'ib_port_active') = 0
        OR max(value) FILTER (WHERE metric = 'ib_link_downed') > min(value) FILTER (WHERE metric = 'ib_link_downed')
),
drops AS (
    SELECT rank, host, 'collector_drops' AS finding,
           string_agg(printf('%s=%.0f', substr(metric, 11), v), ', ') AS detail,
           CAST(NULL AS VARCHAR) AS device, min(first_ns) AS first_ns, max(last_ns) AS last_ns
    FROM (
        SELECT rank, host, metric, max(value) AS v, min(time_ns) AS first_ns, max(time_ns) AS last_ns
        FROM hb
        WHERE metric LIKE 'collector\\_%' ESCAPE '\\' AND (metric LIKE '%drop%' OR metric LIKE '%error%')
        GROUP BY rank, host, metric HAVING max(value) > 0
    )
    GROUP BY rank, host
),
diag AS (
    SELECT rank, host,
           CASE WHEN ok IS NOT DISTINCT FROM false THEN 'diagnose_failed' ELSE 'diagnose_slow' END AS finding,
           test || coalesce(' ' || "group", '') || ': ' || coalesce(detail, printf('%.3g %s', value, unit)) AS detail,
           CAST(NULL AS VARCHAR) AS device, time_ns AS first_ns, time_ns AS last_ns
    FROM diagnostics
    WHERE ok IS NOT DISTINCT FROM false OR outlier
),
found AS (
    SELECT * FROM silent UNION ALL BY NAME SELECT * FROM never
    UNION ALL BY NAME SELECT * FROM throttled UNION ALL BY NAME SELECT * FROM high_temp
    UNION ALL BY NAME SELECT * FROM xid UNION ALL BY NAME SELECT * FROM ecc
    UNION ALL BY NAME SELECT * FROM ib_link UNION ALL BY NAME SELECT * FROM drops
    UNION ALL BY NAME SELECT * FROM diag
)
SELECT CAST(rank AS INTEGER) AS rank, host, finding, detail, device, first_ns, last_ns
FROM found
ORDER BY list_position($order, finding), rank NULLS LAST, host, device
"""


def health_findings(
    con: duckdb.DuckDBPyConnection,
    *,
    silent_after: float = 3.0,
    temp_margin_c: float = 5.0,
    temp_max_c: float = 85.0,
    now_ns: int | None = None,
) -> pd.DataFrame:
    """One row per health problem: ``rank, host, finding, detail, device, first_ns, last_ns``.

    ``rank`` is null for host-wide problems that map to no rank (join those on ``host``).
    ``silent_after``: periods of silence before a sampler counts as stopped; ``now_ns``: judge
    silence against this time (a live run) instead of the newest heartbeat in the data.
    """
    if silent_after <= 0:
        raise ConfigError(f"silent_after must be > 0 periods, got {silent_after}")
    params = {
        "now_ns": now_ns,
        "silent_after": float(silent_after),
        "temp_margin_c": float(temp_margin_c),
        "temp_max_c": float(temp_max_c),
        "throttle_mask": SERIOUS_THROTTLE_MASK,
        "order": [str(f) for f in Finding],
    }
    df = con.execute(_SQL, params).df()
    df["rank"] = df["rank"].astype("Int32")
    for col in ("first_ns", "last_ns"):
        df[col] = df[col].astype("Int64")
    return df[COLUMNS].reset_index(drop=True)
