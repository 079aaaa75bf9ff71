-- Run state: is the job running, finished, stalled or hung? The facts the decision in
-- runstate.py reads, each from the base tables or the newest marker parts.
--
-- {{cut}} is a relation c(rank, cut_ns): per rank a progress cut-off (a rank counts only up to
-- it), empty where no rank has one.

-- @statement last_completion
-- Newest completed-call marker of any rank, reference clock, read from the marker parts {{files}}
-- (each rank's newest) only.
-- @column last_ns  its time (NULL without one)
SELECT max(t) AS last_ns
FROM (SELECT m.rank, m.time_ns + coalesce(k.host_offset_ns, 0) AS t, m.state
      FROM read_parquet([{{files}}], union_by_name=true) m LEFT JOIN ms_cache.rank_clock k USING (rank))
LEFT JOIN {{cut}} USING (rank)
WHERE state = 'completed' AND (c.cut_ns IS NULL OR t <= c.cut_ns);

-- @statement in_flight
-- Calls some rank entered and never completed, per rank, group and p2p direction.
-- @column calls  their number
SELECT count(*) AS calls FROM (
    -- A p2p pair counts its sequence per direction: sends and receives apart.
    SELECT rank, "group", peer, CASE WHEN op IN ('send', 'recv') THEN op END AS direction,
           max(seq) FILTER (WHERE state = 'enqueued') AS entered,
           max(seq) FILTER (WHERE state = 'completed') AS done
    FROM markers GROUP BY ALL
) WHERE entered > coalesce(done, -9223372036854775807);

-- @statement step_facts
-- The run's progress in one row.
-- @column ranks              ranks of the ranks table
-- @column last_step          the newest step some rank finished (has a step span)
-- @column slowest_last_step  the newest step the slowest rank finished (-1: a rank finished none)
-- @column ranks_at_last_step ranks that finished last_step
-- @column median_step_ns     median step span
-- @column last_span_end_ns   newest end of a rank-step's spans, reference clock
WITH ranks_all AS (SELECT DISTINCT rank FROM ms_cache.rank_info),
done AS (SELECT rank, max(step) AS last FROM ms_cache.rank_step WHERE step_ns IS NOT NULL GROUP BY rank)
SELECT (SELECT count(*) FROM ranks_all) AS ranks,
       (SELECT max(last) FROM done) AS last_step,
       (SELECT min(coalesce(d.last, -1)) FROM ranks_all a LEFT JOIN done d USING (rank)) AS slowest_last_step,
       (SELECT count(*) FROM done WHERE last = (SELECT max(last) FROM done)) AS ranks_at_last_step,
       (SELECT median(step_ns) FROM ms_cache.rank_step WHERE step_ns IS NOT NULL) AS median_step_ns,
       (SELECT max(r.start_ns + r.extent_ns) FROM ms_cache.rank_step r LEFT JOIN {{cut}} USING (rank)
        WHERE c.cut_ns IS NULL OR r.start_ns + r.extent_ns <= c.cut_ns) AS last_span_end_ns;

-- @statement step_errors
-- Each rank's first step that ended by an exception ({{prefix}}<class> metrics, written by the
-- collector as the exception left the step), first in time first.
-- @column rank      the rank
-- @column step      the step the exception ended
-- @column error     the exception's class
-- @column time_ns   when (the rank's host clock)
SELECT rank, arg_min(step, time_ns) AS step, arg_min(substr(name, {{skip}}), time_ns) AS error, min(time_ns) AS time_ns
FROM metrics WHERE starts_with(name, '{{prefix}}')
GROUP BY rank ORDER BY time_ns, rank;
