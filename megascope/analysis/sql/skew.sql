-- Arrival skew of collectives: how far apart members reach each collective instance, who is last,
-- and whether that lateness grows over the run (MFU drift from late collective starts).

-- @statement instances
-- One row per collective instance (limit {{limit}}, 0 = all), filtered to group kind
-- {{kind_filter}} ('' = all).
-- @column group, seq    the instance
-- @column step          the step it belongs to
-- @column name, op      span name / collective op
-- @column group_kind    tp | dp | pp | cp | ep | world | other
-- @column n             members that recorded it
-- @column xfer_ns       completion of the last member minus the last arrival
-- @column last_host, last_coords  the last arriver's host and coordinates (every axis)
-- @column last_pp, last_dp, last_tp  of which the axes read by name
-- @column spread_ns     last minus first arrival (reference clock)
-- @column last_late_ns  last arrival minus mean arrival: how late the straggler came
-- @column last_rank     the last arriver, with its host and coordinates
SELECT i.grp AS "group", i.seq, i.step, i.name, i.op, i.group_kind, i.n,
       i.spread_ns, i.last_arrival_ns - i.mean_arrival_ns AS last_late_ns, i.xfer_ns,
       i.last_rank, r.host AS last_host, r.coords AS last_coords, r.pp AS last_pp, r.dp AS last_dp, r.tp AS last_tp
FROM ms_cache.inst i LEFT JOIN ms_cache.rank_info r ON r.rank = i.last_rank
WHERE i.n >= 2 AND ('{{kind_filter}}' = '' OR i.group_kind = '{{kind_filter}}')
ORDER BY i.step, i.grp, i.seq
LIMIT CASE WHEN {{limit}} > 0 THEN {{limit}} ELSE 9223372036854775807 END;

-- @statement by_collective
-- One row per collective (span name and group kind): instances, arrival spread, the most
-- frequent last arriver, and the growth of lateness over the run.
-- @column name, group_kind  the collective (span name) and its group kind
-- @column instances         its instances
-- @column steps, first_step, last_step  the steps they cover
-- @column spread_median_ns, spread_p99_ns  arrival spread across its instances
-- @column late_median_ns                   last arrival minus mean arrival, median
-- @column top_last_rank, top_last_frac     the rank most often last, and the share of instances
-- @column late_slope_ns_per_step           least-squares slope of last_late_ns over steps
-- @column late_growth_ns                   that slope times the steps covered
-- @column late_r2                          how much of the lateness's variance the trend explains
WITH x AS (
    SELECT name, group_kind, step, spread_ns, last_arrival_ns - mean_arrival_ns AS late_ns, last_rank
    FROM ms_cache.inst WHERE n >= 2
), top AS (
    SELECT name, group_kind, last_rank, count(*) AS c,
           row_number() OVER (PARTITION BY name, group_kind ORDER BY count(*) DESC, last_rank) AS k
    FROM x GROUP BY name, group_kind, last_rank
)
SELECT x.name, x.group_kind, count(*) AS instances,
       median(x.spread_ns)::BIGINT AS spread_median_ns,
       quantile_cont(x.spread_ns, 0.99)::BIGINT AS spread_p99_ns,
       median(x.late_ns)::BIGINT AS late_median_ns,
       any_value(t.last_rank) AS top_last_rank, any_value(t.c) / count(*) AS top_last_frac,
       coalesce(regr_slope(x.late_ns, x.step), 0) AS late_slope_ns_per_step,
       coalesce(regr_slope(x.late_ns, x.step), 0) * (max(x.step) - min(x.step)) AS late_growth_ns,
       coalesce(regr_r2(x.late_ns, x.step), 0) AS late_r2, count(DISTINCT x.step) AS steps,
       min(x.step) AS first_step, max(x.step) AS last_step
FROM x LEFT JOIN top t ON t.name = x.name AND t.group_kind = x.group_kind AND t.k = 1
GROUP BY x.name, x.group_kind
ORDER BY late_growth_ns DESC;

-- @statement collectives
-- The by_collective list as the caller holds it (registered as {{frame}}), numbered, so that
-- growing_ranks can name a collective by its position and no span name reaches SQL text.
-- @column idx               its position in the list
-- @column name, group_kind  the collective
CREATE OR REPLACE TABLE ms_cache.skew_collectives AS
SELECT idx::BIGINT AS idx, name::VARCHAR AS name, group_kind::VARCHAR AS group_kind FROM {{frame}};

-- @statement growing_ranks
-- For collective {{name_index}} of the by_collective list: ranks whose lateness when last grows.
-- @column rank, times_last, late_slope_ns_per_step, late_growth_ns, late_median_ns
SELECT last_rank AS rank, count(*) AS times_last,
       coalesce(regr_slope(last_arrival_ns - mean_arrival_ns, step), 0) AS late_slope_ns_per_step,
       coalesce(regr_slope(last_arrival_ns - mean_arrival_ns, step), 0) * (max(step) - min(step)) AS late_growth_ns,
       median(last_arrival_ns - mean_arrival_ns)::BIGINT AS late_median_ns
FROM ms_cache.inst
WHERE n >= 2 AND name = (SELECT name FROM ms_cache.skew_collectives WHERE idx = {{name_index}})
  AND group_kind = (SELECT group_kind FROM ms_cache.skew_collectives WHERE idx = {{name_index}})
GROUP BY last_rank HAVING count(*) >= 3
ORDER BY late_growth_ns DESC
LIMIT 10;

-- @statement median_step
-- The median step time over all rank-steps (step span, else the spans' extent).
-- @column step_ns  that median (NULL without rank-steps)
SELECT median(coalesce(step_ns, extent_ns)) AS step_ns FROM ms_cache.rank_step;
