-- Pipeline bubbles per stage and exposed (not overlapped by compute) communication.

-- @statement bubbles
-- One row per pipeline stage.
-- @column stage          pp coordinate (0 without pipeline)
-- @column ranks, steps   ranks of the stage, steps counted
-- @column bubble_ns      mean time per rank-step blocked in pipeline receives (the warm-up and
--                        cool-down bubble and stalls behind a slow stage; includes the small
--                        transfer itself)
-- @column step_ns        mean step time
-- @column bubble_frac    bubble_ns / step_ns
SELECT stage, count(DISTINCT rank) AS ranks, count(DISTINCT step) AS steps,
       avg(p2p_wait_ns) AS bubble_ns, avg(coalesce(step_ns, extent_ns)) AS step_ns,
       sum(p2p_wait_ns) / nullif(sum(coalesce(step_ns, extent_ns)), 0) AS bubble_frac
FROM ms_cache.rank_step
WHERE step_ns IS NOT NULL OR NOT {{has_step_spans}}
GROUP BY stage ORDER BY stage;

-- @statement exposed
-- One row per (group kind, span name) of communication in steps {{steps}} of sampled ranks.
-- @column comm_ns       summed communication time
-- @column overlapped_ns of which the same rank was running compute spans (another stream)
-- @column exposed_ns    comm_ns - overlapped_ns: communication nothing hid
-- @column exposed_frac  exposed_ns / comm_ns
WITH c AS (
    SELECT row_number() OVER () AS id, rank, step, name, kind, "group",
           start_ns AS s, start_ns + dur_ns AS e, dur_ns
    FROM spans
    WHERE rank IN ({{ranks}}) AND kind IN ('collective', 'send', 'recv') AND list_contains({{steps}}, step)
), p AS (
    SELECT rank, step, start_ns AS s, start_ns + dur_ns AS e
    FROM spans
    WHERE rank IN ({{ranks}}) AND kind IN ('forward', 'backward', 'optimizer', 'compute') AND list_contains({{steps}}, step)
), o AS (
    SELECT c.id, sum(least(c.e, p.e) - greatest(c.s, p.s)) AS ov
    FROM c JOIN p ON c.rank = p.rank AND c.step = p.step AND p.s < c.e AND p.e > c.s
    GROUP BY c.id
)
SELECT CASE WHEN c.kind <> 'collective' THEN 'p2p'
            WHEN split_part(c."group", ':', 1) IN ('tp', 'dp', 'pp', 'world') THEN split_part(c."group", ':', 1)
            ELSE 'other' END AS group_kind,
       c.name, count(*) AS spans, sum(c.dur_ns) AS comm_ns,
       sum(least(coalesce(o.ov, 0), c.dur_ns)) AS overlapped_ns,
       sum(c.dur_ns - least(coalesce(o.ov, 0), c.dur_ns)) AS exposed_ns,
       sum(c.dur_ns - least(coalesce(o.ov, 0), c.dur_ns)) / nullif(sum(c.dur_ns), 0) AS exposed_frac
FROM c LEFT JOIN o USING (id)
GROUP BY ALL ORDER BY exposed_ns DESC;
