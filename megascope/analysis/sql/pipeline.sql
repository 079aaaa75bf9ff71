-- Pipeline bubbles per stage and exposed (not overlapped by compute) communication.

-- @statement bubbles
-- One row per pipeline stage, over the run's steps after its first where it has others: the
-- first step holds the job's warm-up (process groups made, first calls, allocations), on real
-- pipelined CPU runs 8-12x a later step and its receives' wait 10-25x theirs, which would
-- otherwise weigh on every mean below (a pp4 stage's bubble share read 46.6% for 24.0%).
-- @column stage          pp coordinate (0 without pipeline)
-- @column ranks, steps   ranks of the stage, steps counted
-- @column bubble_ns      mean time per rank-step blocked in pipeline receives (the warm-up and
--                        cool-down bubble and stalls behind a slow stage; includes the small
--                        transfer itself)
-- @column step_ns        mean step time
-- @column bubble_frac    bubble_ns / step_ns
WITH counted AS (
    SELECT * FROM ms_cache.rank_step WHERE step_ns IS NOT NULL OR NOT {{has_step_spans}}
), first_step AS (
    SELECT min(step) AS step, count(DISTINCT step) AS steps FROM counted
)
SELECT stage, count(DISTINCT rank) AS ranks, count(DISTINCT c.step) AS steps,
       avg(p2p_wait_ns) AS bubble_ns, avg(coalesce(step_ns, extent_ns)) AS step_ns,
       sum(p2p_wait_ns) / nullif(sum(coalesce(step_ns, extent_ns)), 0) AS bubble_frac
FROM counted c, first_step f
WHERE c.step > f.step OR f.steps = 1
GROUP BY stage ORDER BY stage;

-- @statement exposed
-- One row per (group kind, span name) of communication in steps {{steps}} of sampled ranks.
-- A call waited on asynchronously has a "<name>:wait" span (same rank, seq, op, peer) from the
-- wait to completion: that stall is its exposed time. Its overlapped time is the part of issue ->
-- wait that the rank spent in compute (outermost compute spans) and not stalled inside it (in a
-- wait or a blocking call); the rest of its span was in flight while the rank waited on something
-- else or sat in host gaps, neither hidden by compute nor its own stall. So exposed_ns adds up, over
-- calls, to the time the rank stalled on communication. A call without a wait span blocked where it
-- was issued (the collector's blocking form) or ran on a stream of its own (Kineto kernels): its
-- overlapped part is what leaf compute spans of the rank cover (a leaf encloses no communication
-- span, so a block that merely contains a blocking collective does not hide it), the rest is exposed.
-- @column group_kind    tp | dp | pp | cp | ep | world | other (ms_cache.group_kind), or p2p
-- @column name          span name of the calls
-- @column spans         calls with a span (timed)
-- @column comm_ns       summed communication time, issue to completion (concurrent asynchronous
--                       calls each count their whole span, so this can exceed the step)
-- @column overlapped_ns of which the rank was computing (hidden)
-- @column exposed_ns    of which the rank stalled on the call (its wait, or the blocking call)
-- @column exposed_frac  exposed_ns / comm_ns
-- @column op            the calls' operation (all_gather, send, ...)
-- @column calls         calls issued (enqueued markers), timed or not; the spans where a run has
--                       no markers. A collector told to time a group kind's calls in some
--                       micro-batches only (CollectorConfig.comm_sample_kinds, the trainer's
--                       --tp-comm-spans rotate) leaves the others with their markers alone.
-- @column exposed_all_ns exposed_ns estimated for every call issued: the calls of one (group kind,
--                       op, bytes) are counted at the mean stall of the timed ones
WITH src AS MATERIALIZED (
    -- One read of the sampled rank-steps' spans: a step's row group holds every rank of its file,
    -- so each read of the spans decodes many more rows than it keeps.
    SELECT rank, step, name, kind, "group", seq, op, peer, bytes, start_ns, dur_ns
    FROM spans
    WHERE rank IN ({{ranks}}) AND list_contains({{steps}}, step)
      AND (kind IN ('collective', 'send', 'recv', 'forward', 'backward', 'optimizer', 'compute')
           OR kind = 'other' AND name LIKE '%:wait')
), c AS (
    -- Numbered in a fixed order, whatever order the spans were read in: calls that start at the
    -- same moment (a send and a receive posted together) are ordered by kind, then sequence.
    SELECT row_number() OVER (ORDER BY rank, step, start_ns, kind, "group", seq, peer, name) AS id,
           rank, step, name, kind, "group", seq, op, peer, bytes,
           start_ns AS s, start_ns + dur_ns AS e, dur_ns
    FROM src
    WHERE kind IN ('collective', 'send', 'recv')
), w AS (
    SELECT rank, step, seq, op, peer, left(name, length(name) - 5) AS name, start_ns AS s, start_ns + dur_ns AS e
    FROM src
    WHERE kind = 'other' AND name LIKE '%:wait' AND seq IS NOT NULL
), cw0 AS (
    SELECT c.*, w.s AS wait_s, CASE WHEN w.s IS NOT NULL THEN least(w.e - w.s, c.dur_ns) END AS wait_ns
    FROM c LEFT JOIN w ON c.rank = w.rank AND c.seq = w.seq AND c.op = w.op AND c.name = w.name
                      AND c.peer IS NOT DISTINCT FROM w.peer
), cw AS (
    -- Calls without a wait span that overlap each other (several in flight on their own streams,
    -- or an older recording's asynchronous calls): each counts only from where the ones that
    -- started before it end (eff_s), so their exposed time adds up to the union, not more.
    SELECT *, greatest(s, coalesce(max(e) FILTER (WHERE wait_ns IS NULL) OVER (
               PARTITION BY rank ORDER BY s, id ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), s)) AS eff_s
    FROM cw0
), stalls AS (
    SELECT rank, step, s, e FROM w
    UNION ALL
    SELECT rank, step, s, e FROM cw WHERE wait_ns IS NULL
), comp AS (
    SELECT DISTINCT rank, step, start_ns AS s, start_ns + dur_ns AS e
    FROM src
    WHERE kind IN ('forward', 'backward', 'optimizer', 'compute')
), p AS (
    -- Leaf compute: encloses no communication span.
    SELECT * FROM comp q
    WHERE NOT EXISTS (SELECT 1 FROM c WHERE c.rank = q.rank AND c.step = q.step AND c.s >= q.s AND c.e <= q.e)
), o_sync AS (
    SELECT cw.id, sum(least(cw.e, p.e) - greatest(cw.eff_s, p.s)) AS ov
    FROM cw JOIN p ON cw.rank = p.rank AND cw.step = p.step AND p.s < cw.e AND p.e > cw.eff_s
    WHERE cw.wait_ns IS NULL AND cw.eff_s < cw.e
    GROUP BY cw.id
), top AS (
    SELECT * FROM comp q
    WHERE NOT EXISTS (SELECT 1 FROM comp r WHERE r.rank = q.rank AND r.step = q.step AND r.s <= q.s AND r.e >= q.e
                      AND (r.s < q.s OR r.e > q.e))
), stalls_in AS (
    SELECT DISTINCT t.rank, t.s, t.e FROM stalls t
    JOIN top p ON t.rank = p.rank AND t.step = p.step AND t.s >= p.s AND t.e <= p.e
), a AS (
    SELECT id, rank, s, wait_s FROM cw WHERE wait_ns IS NOT NULL
), o_async AS (
    SELECT a.id,
           coalesce((SELECT sum(least(a.wait_s, p.e) - greatest(a.s, p.s)) FROM top p
                     WHERE p.rank = a.rank AND p.s < a.wait_s AND p.e > a.s), 0)
         - coalesce((SELECT sum(least(a.wait_s, t.e) - greatest(a.s, t.s)) FROM stalls_in t
                     WHERE t.rank = a.rank AND t.s < a.wait_s AND t.e > a.s), 0) AS computed
    FROM a
), x AS (
    SELECT cw.*,
           CASE WHEN cw.wait_ns IS NOT NULL THEN greatest(0, least(coalesce(oa.computed, 0), cw.dur_ns - cw.wait_ns))
                ELSE least(coalesce(os.ov, 0), cw.dur_ns) END AS hidden_ns,
           CASE WHEN cw.wait_ns IS NOT NULL THEN cw.wait_ns
                ELSE greatest(0, cw.e - cw.eff_s - coalesce(os.ov, 0)) END AS stall_ns
    FROM cw LEFT JOIN o_sync os USING (id) LEFT JOIN o_async oa USING (id)
), xb AS (
    SELECT CASE WHEN x.kind <> 'collective' THEN 'p2p' ELSE coalesce(gk.kind, 'other') END AS group_kind,
           x.name, x.op, x.bytes, count(*) AS spans, sum(x.dur_ns) AS comm_ns, sum(x.hidden_ns) AS hidden_ns,
           sum(x.stall_ns) AS stall_ns
    FROM x LEFT JOIN ms_cache.group_kind gk ON gk."group" = x."group" GROUP BY ALL
), issued AS (
    -- Every call issued, timed or not: its enqueued marker (once, whatever else wrote markers).
    SELECT CASE WHEN m.op IN ('send', 'recv') THEN 'p2p' ELSE coalesce(gk.kind, 'other') END AS group_kind,
           m.op, m.bytes, count(*) AS calls
    FROM (SELECT DISTINCT rank, "group", seq, op, peer, bytes FROM markers
          WHERE rank IN ({{ranks}}) AND state = 'enqueued' AND list_contains({{steps}}, step)) m
    LEFT JOIN ms_cache.group_kind gk ON gk."group" = m."group"
    GROUP BY ALL
), est AS (
    -- Calls of one (group kind, op, size) are alike: the untimed ones are counted at the timed
    -- ones' mean.
    SELECT xb.*, greatest(coalesce(i.calls, 0), sum(xb.spans) OVER (PARTITION BY xb.group_kind, xb.op, xb.bytes))
               / sum(xb.spans) OVER (PARTITION BY xb.group_kind, xb.op, xb.bytes) AS scale
    FROM xb LEFT JOIN issued i ON i.group_kind = xb.group_kind AND i.op IS NOT DISTINCT FROM xb.op
                               AND i.bytes IS NOT DISTINCT FROM xb.bytes
)
SELECT group_kind, name, any_value(op) AS op, sum(spans)::BIGINT AS spans, sum(comm_ns) AS comm_ns,
       sum(hidden_ns) AS overlapped_ns,
       sum(stall_ns) AS exposed_ns,
       sum(stall_ns) / nullif(sum(comm_ns), 0) AS exposed_frac,
       round(sum(spans * scale))::BIGINT AS calls,
       sum(stall_ns * scale) AS exposed_all_ns
FROM est
GROUP BY ALL ORDER BY exposed_ns DESC;

-- @statement host_lead
-- One row per sampled rank timed on a device (ranks.device 'cuda...'), over steps {{steps}}: how far
-- the host ran ahead of the device. For every communication call, the lead is from its enqueued
-- marker (the host's clock when the call was issued) to its span's start (when the device reached
-- it). A device kept busy has queued work between the two; a lead near zero means the device had
-- run dry and waited for the host to issue more: a host-bound rank (Python, the data loader, the
-- launch queue), whose every extra host microsecond is device time lost, and under tensor
-- parallelism the peers' time too. Host-timed ranks (CPU) are left out: their lead is zero by
-- construction. So are calls issued on a stream of their own (stream `cuda:<id>`: FSDP's
-- all-gathers and reduce-scatters): such a stream runs nothing else, a call on it starts as soon
-- as it is issued however busy the device is, and FSDP1 and FSDP2 ranks whose devices never waited
-- read 25-42% of their calls "starved", their slow GPUs `host`.
-- @column rank
-- @column calls          communication calls with both an enqueued marker and a span
-- @column lead_p10_ns    10th percentile of the lead
-- @column lead_p50_ns    median lead
-- @column starved_frac   share of calls with a lead under {{starved_ns}} ns: the device was idle,
--                        waiting for the host, when the call was issued
SELECT s.rank, count(*) AS calls,
       quantile_cont(s.start_ns - m.time_ns, 0.1) AS lead_p10_ns,
       quantile_cont(s.start_ns - m.time_ns, 0.5) AS lead_p50_ns,
       avg(CASE WHEN s.start_ns - m.time_ns < {{starved_ns}} THEN 1.0 ELSE 0.0 END) AS starved_frac
FROM spans s
JOIN markers m ON m.rank = s.rank AND m."group" = s."group" AND m.seq = s.seq
                  AND m.op IS NOT DISTINCT FROM s.op AND m.peer IS NOT DISTINCT FROM s.peer
                  AND m.state = 'enqueued'
JOIN ranks r ON r.rank = s.rank
WHERE s.rank IN ({{ranks}}) AND m.rank IN ({{ranks}}) AND list_contains({{steps}}, s.step)
  AND r.rank IN ({{ranks}}) AND s.kind IN ('collective', 'send', 'recv') AND r.device LIKE 'cuda%'
  AND NOT starts_with(s.stream, 'cuda:')
GROUP BY s.rank ORDER BY s.rank;

-- @statement host_issue
-- Per rank in {{ranks}}, over steps {{steps}}: how long its host took to issue a step's
-- communication calls, from the first call's enqueued marker to the last one's (the host's clock).
-- Where the device waits for its host (a host-bound job), a step cannot take less than that: a
-- replay of device spans, which sees no host, is held to it (whatif).
-- @column rank
-- @column steps     steps with two calls or more
-- @column issue_ns  median over those steps of the last enqueued call minus the first
SELECT rank, count(*) AS steps, median(issue_ns) AS issue_ns
FROM (SELECT rank, step, max(time_ns) - min(time_ns) AS issue_ns
      FROM markers
      WHERE rank IN ({{ranks}}) AND list_contains({{steps}}, step) AND state = 'enqueued'
      GROUP BY rank, step HAVING count(*) >= 2)
GROUP BY rank ORDER BY rank;

-- @statement sample_steps
-- The steps of the base tables, in order (exposed and host_lead sample a few of them).
-- @column step  a step
SELECT DISTINCT step FROM ms_cache.rank_step ORDER BY step;

-- @statement sample_ranks
-- Up to {{per_stage}} ranks per pipeline stage, spread by hash (every stage, many hosts), so that
-- exposed and host_lead read few partitions.
-- @column rank  a sampled rank
SELECT rank FROM (SELECT rank, row_number() OVER (PARTITION BY stage ORDER BY hash(rank)) AS k FROM ms_cache.rank_info)
WHERE k <= {{per_stage}} ORDER BY rank;

-- @statement rank_steps
-- The rank-steps of ranks {{ranks}} in steps {{steps}}: what exposed's sums are spread over.
-- @column rank_steps  their number
SELECT count(*) AS rank_steps FROM ms_cache.rank_step WHERE rank IN ({{ranks}}) AND list_contains({{steps}}, step);
