-- Per-step views over the base tables: step times, heat-map cells, MFU.

-- @statement step_times
-- One row per (rank, step) that has a step span (or, when the run has none, spans in a step).
-- @column rank, step  the rank and the step
-- @column start_ns  step start on the reference clock (clock offsets applied)
-- @column dur_ns    the step span's duration (or the extent of its spans)
SELECT rank, step, start_ns, coalesce(step_ns, extent_ns) AS dur_ns
FROM ms_cache.rank_step
WHERE step_ns IS NOT NULL OR NOT {{has_step_spans}}
ORDER BY rank, step;

-- @statement heat_cells
-- Heat-map cells of one phase ({{value}}, over rank_step and {{gaps}}: host_gaps or an empty
-- stand-in): value per (rank, step), normalised by the median of the
-- rank's peers (same pipeline stage) in that step, binned to at most {{rank_bins}} x {{step_bins}}.
-- Where no stage has two ranks ({{all_ranks}}: a pure pipeline, stragglers.told) a rank has no peer
-- and would read 1.0 everywhere: there the median of every rank in the step is taken, and
-- ``peers`` says so.
-- A bin shows its worst cell (largest norm): a 0.5% slow machine must survive downsampling.
-- @column rank_bin, step_bin  bin indices (equal to rank and step position when not binned)
-- @column rank, step          the worst cell's rank and step
-- @column rank_lo, rank_hi, step_lo, step_hi  the bin's range
-- @column value_ns, norm      the worst cell's value and value / peer median (both plus a
--                             thousandth of the peers' median step)
-- @column host, coords, pp, dp, tp  the cell's rank's host and coordinates (every axis; the three read by name)
-- @column peers               'stage' (the rank's pipeline stage) or 'all' (every rank: no stage has two)
WITH v AS (
    SELECT rank, step, CASE WHEN {{all_ranks}} THEN 0 ELSE stage END AS stage,
           {{value}} AS value_ns, coalesce(step_ns, extent_ns) AS step_ns
    FROM ms_cache.rank_step LEFT JOIN {{gaps}} USING (rank, step)
    WHERE step_ns IS NOT NULL OR NOT {{has_step_spans}}
), p AS (
    -- floor: a thousandth of the step; values below it are rounding, not a slowdown (30 ns of
    -- host gap against 20 ns is not "1.5x").
    SELECT stage, step, median(value_ns) AS med, 0.001 * median(step_ns) AS floor FROM v GROUP BY stage, step
), steps AS (
    SELECT step, (row_number() OVER (ORDER BY step) - 1) AS step_pos FROM (SELECT DISTINCT step FROM v)
), ranks AS (
    SELECT rank, (row_number() OVER (ORDER BY rank) - 1) AS rank_pos FROM (SELECT DISTINCT rank FROM v)
), cells AS (
    SELECT v.rank, v.step, v.value_ns,
           CASE WHEN p.med + coalesce(p.floor, 0) > 0 THEN (v.value_ns + coalesce(p.floor, 0)) / (p.med + coalesce(p.floor, 0))
                WHEN v.value_ns = 0 THEN 1.0 END AS norm,
           r.rank_pos // {{rank_per_bin}} AS rank_bin, s.step_pos // {{step_per_bin}} AS step_bin
    FROM v JOIN p USING (stage, step) JOIN steps s USING (step) JOIN ranks r USING (rank)
), binned AS (
    SELECT rank_bin, step_bin,
           arg_max(rank, coalesce(norm, 0)) AS rank, arg_max(step, coalesce(norm, 0)) AS step,
           min(rank) AS rank_lo, max(rank) AS rank_hi, min(step) AS step_lo, max(step) AS step_hi,
           arg_max(value_ns, coalesce(norm, 0)) AS value_ns, max(norm) AS norm
    FROM cells GROUP BY rank_bin, step_bin
)
SELECT b.rank_bin, b.step_bin, b.rank, b.step, b.rank_lo, b.rank_hi, b.step_lo, b.step_hi,
       b.value_ns, b.norm, i.host, i.coords, i.pp, i.dp, i.tp,
       CASE WHEN {{all_ranks}} THEN 'all' ELSE 'stage' END AS peers
FROM binned b JOIN ms_cache.rank_info i USING (rank)
ORDER BY b.rank_bin, b.step_bin;

-- @statement host_gaps
-- Per (rank, step): time inside the step that no span of the rank covers (the union of its
-- spans, nested and overlapping ones included, subtracted from the step span). A host pause
-- outside every span (a stall before a collective, a slow launch) shows here and nowhere else.
-- @column rank, step  the rank and the step
-- @column gap_ns  uncovered time of the step
CREATE OR REPLACE TABLE ms_cache.host_gaps AS
WITH steps AS (
    SELECT rank, step, min(start_ns) AS s0, max(start_ns + dur_ns) AS s1
    FROM spans WHERE kind = 'step' AND step IS NOT NULL GROUP BY rank, step
), s AS (
    SELECT x.rank, x.step, greatest(x.start_ns, st.s0) AS b, least(x.start_ns + x.dur_ns, st.s1) AS e, st.s0, st.s1
    FROM spans x JOIN steps st USING (rank, step)
    WHERE x.kind <> 'step' AND x.step IS NOT NULL
), o AS (
    SELECT rank, step, b, e, s0, s1,
           max(e) OVER (PARTITION BY rank, step ORDER BY b, e ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS reach
    FROM s WHERE e > b
)
SELECT rank, step,
       sum(greatest(b - coalesce(reach, s0), 0))
           + greatest(any_value(s1) - greatest(max(e), any_value(s0)), 0) AS gap_ns
FROM o GROUP BY rank, step;

-- @statement step_summary
-- One row per step: the job's step time (median over ranks of their step span) and how many
-- ranks finished it.
-- @column step          the step
-- @column step_time_ns  median step time over ranks
-- @column ranks         ranks that finished it
SELECT step, median(coalesce(step_ns, extent_ns))::BIGINT AS step_time_ns, count(*) AS ranks
FROM ms_cache.rank_step
WHERE step_ns IS NOT NULL OR NOT {{has_step_spans}}
GROUP BY step ORDER BY step;

-- @statement tokens_per_step
-- Tokens per step from the metrics table (summed over ranks that logged "tokens").
-- @column step    the step
-- @column tokens  tokens of the step, summed over ranks
SELECT step, sum(value) AS tokens FROM metrics WHERE name = 'tokens' GROUP BY step ORDER BY step;

-- @statement extent
-- The ranks and steps of the base tables: how many the heat-map bins.
-- @column ranks, steps  distinct ranks and steps of rank_step
SELECT count(DISTINCT rank) AS ranks, count(DISTINCT step) AS steps FROM ms_cache.rank_step;
