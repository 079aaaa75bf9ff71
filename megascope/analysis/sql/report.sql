-- The report's own figures beside the analyses it gathers: the run's extent, garbage-collection pauses and what the collector itself cost.

-- @statement extent
-- The steps of the base tables and the ranks seen.
-- @column steps, first_step, last_step  steps with a rank-step row, the lowest and the highest
-- @column ranks_seen                   ranks of rank_info (those of the ranks table and any that
--                                      wrote spans without a ranks row)
SELECT count(DISTINCT step) AS steps, min(step) AS first_step, max(step) AS last_step,
       (SELECT count(*) FROM ms_cache.rank_info) AS ranks_seen
FROM ms_cache.rank_step;

-- @statement collector_stamps
-- The collector's timing stamps per rank and step (metric {{stamps_metric}}), and whether any
-- rank ran on a CUDA device.
-- @column stamps_median  median over its rank-steps
-- @column rank_steps     rank-steps that logged it
-- @column cuda_ranks     ranks of the ranks table on a CUDA device
SELECT median(value) AS stamps_median, count(*) AS rank_steps,
       (SELECT count(*) FROM ranks WHERE device LIKE 'cuda%') AS cuda_ranks
FROM metrics WHERE name = '{{stamps_metric}}';

-- @statement gc_totals
-- Python garbage collections inside steps (rank_step.gc_ns), over the run.
-- @column ranks_with_gc  ranks that collected in some step
-- @column total_ns       collection time, summed over ranks and steps
-- @column ranks          ranks with rank-step rows
SELECT count(DISTINCT rank) FILTER (WHERE gc_ns > 0) AS ranks_with_gc, coalesce(sum(gc_ns), 0) AS total_ns,
       count(DISTINCT rank) AS ranks
FROM ms_cache.rank_step;

-- @statement gc_ranks
-- The {{top}} ranks that spent longest in garbage collections.
-- @column rank         the rank
-- @column steps        its steps with a collection
-- @column total_ns     its collection time, summed
-- @column max_step_ns  its longest in one step
SELECT rank, count(*) FILTER (WHERE gc_ns > 0) AS steps, sum(gc_ns) AS total_ns, max(gc_ns) AS max_step_ns
FROM ms_cache.rank_step GROUP BY rank HAVING sum(gc_ns) > 0 ORDER BY total_ns DESC, rank LIMIT {{top}};
