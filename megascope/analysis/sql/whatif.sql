-- What-if replay: the communication events of a few sampled steps, each with the instance it
-- belongs to and that instance's transfer time, read by the replay in whatif.py.

-- @statement events
-- Communication spans of steps {{steps}} with instance keys, on the reference clock (one scan of
-- the spans), into ms_cache.{{table}} (kept in the run's analysis cache for the next report).
-- A pipeline pair is one instance: its send and its receive share (sender, receiver, seq).
-- An asynchronous call (one with a `<name>:wait` span of the same rank, step, seq and peer) does
-- not hold its rank where it is issued. Where its wait began within the rank's step, it gets a
-- second row, kind `wait`, at the start of that wait, which holds the rank until the instance
-- completes; a call waited for in a later step (parameters gathered for the next forward) holds
-- nothing in this one. Its instance completes at the earliest member's end: each member's end
-- comes after its own wait, which may begin long after the transfer is over (the compute the call
-- overlapped).
-- A data-parallel gradient reduction (all-reduce, reduce-scatter; in a group of {{dp_kinds}}) issued
-- inside the rank's top-level backward span (or its backward's kernels' window, see backward
-- below) with no wait span is asynchronous too, waited for where that span ends:
-- DistributedDataParallel's buckets (its reducer waits for them in C++ as the backward ends) and
-- FSDP1's reduce-scatters on their own stream, which no Python wait marks (FSDP2's on GPU have
-- wait spans where the next group's post_backward and the backward's end wait for them: the
-- collector's hold_reductions; beside a slow rank its peers stall there). Taken as blocking, a
-- rank that waited for a late peer's buckets while its own backward went on read as a rank that
-- computed little, and on 2x H200 DDP jobs the fixed step came out 20-40% under the healthy runs'
-- step. FSDP's parameter all-gathers block where issued (the next layer's compute waits for
-- them) unless they have wait spans: FSDP2's on GPU, issued a layer ahead on a stream of their
-- own, are waited for where the compute stream needs them (the collector's hold_until_waited).
-- @column step, rank, kind, seq  the span (kind: collective | send | recv | wait)
-- @column arrival_ns, end_ns    its start and completion, reference clock (a wait row: the wait's
--                               start and the call's end)
-- @column step_start_ns, step_end_ns  the rank's step (rank_step: start, start plus step time)
-- @column stage                 the rank's pipeline stage
-- @column inst                  the instance within the step, numbered from 0
-- @column xfer_ns               the instance's transfer: its completion (last member's end; the
--                               first member's end where a member waited asynchronously) minus
--                               its last arrival
-- @column is_async              the call was waited for later (its rank goes on where it issued it)
CREATE OR REPLACE TABLE ms_cache.{{table}} AS
WITH src AS MATERIALIZED (
    SELECT s.step, s.rank, s.kind, s.name, s.op, s.peer, s."group", s.seq, s.start_ns + k.offset_ns AS start_ns, s.dur_ns
    FROM spans s JOIN ms_cache.rank_clock k USING (rank)
    WHERE s.step IN ({{steps}})
      AND (s.seq IS NOT NULL
           AND (s.kind IN ('collective', 'send', 'recv') OR s.kind = 'other' AND ends_with(s.name, ':wait'))
           OR s.kind = 'backward' AND s.name = 'backward')
), kernels AS NOT MATERIALIZED (
    -- Where the ranks were traced kernel by kernel ({{kernel_backward}}; nothing is read
    -- elsewhere): their kernels, each with whether it is a copy or a memset, and no more, read
    -- where used (a kernel's name is a long template: carried in src, they took 55 MB more of a
    -- 256-rank report, and 30-50 MB kept apart).
    SELECT s.step, s.rank, s.kind, s.start_ns + k.offset_ns AS start_ns, s.start_ns + s.dur_ns + k.offset_ns AS end_ns,
           starts_with(s.name, 'Memcpy') OR starts_with(s.name, 'Memset') AS copy
    FROM spans s JOIN ms_cache.rank_clock k USING (rank)
    WHERE {{kernel_backward}} AND s.step IN ({{steps}}) AND starts_with(s.stream, 'cuda:')
      AND s.kind IN ('forward', 'backward', 'compute', 'optimizer')
), device AS (
    -- There each rank-step begins on its device at its first kernel: a device running a step
    -- behind its host (a deep queue) does the step's work long after the host's step began, and a
    -- chain begun at the host's would model that lag as work (the shared 2-rank GPU sample: 41 ms
    -- steps modeled for 24 ms).
    SELECT step, rank, min(start_ns) AS start_ns FROM kernels GROUP BY ALL
), c AS (
    SELECT s.step, s.rank, s.kind, s.name, s.op, s.peer, s.kind = 'collective' AS is_coll,
           CASE WHEN s.kind = 'collective' THEN s."group" ELSE '' END AS grp, s.seq,
           CASE WHEN s.kind = 'collective' THEN -1 WHEN s.kind = 'send' THEN s.rank ELSE s.peer END AS sender,
           CASE WHEN s.kind = 'collective' THEN -1 WHEN s.kind = 'send' THEN s.peer ELSE s.rank END AS receiver,
           s.start_ns AS arrival_ns, s.start_ns + s.dur_ns AS end_ns,
           coalesce(d.start_ns, r.start_ns) AS step_start_ns,
           coalesce(d.start_ns, r.start_ns) + coalesce(r.step_ns, r.extent_ns) AS step_end_ns, r.stage
    FROM src s
    JOIN ms_cache.rank_step r ON r.rank = s.rank AND r.step = s.step
    LEFT JOIN device d ON d.rank = s.rank AND d.step = s.step
    WHERE s.kind IN ('collective', 'send', 'recv')
      AND (s.kind = 'collective' AND s."group" IS NOT NULL OR s.kind <> 'collective' AND s.peer IS NOT NULL)
), w AS (
    SELECT step, rank, seq, peer, name[:-6] AS op_name, min(start_ns) AS wait_ns
    FROM src WHERE kind = 'other'
    GROUP BY ALL
), reductions AS (
    SELECT c.* FROM c JOIN ms_cache.group_kind gk ON gk."group" = c.grp AND list_contains({{dp_kinds}}, gk.kind)
    WHERE c.is_coll AND c.op IN ('all_reduce', 'reduce_scatter')
), backward AS (
    -- The rank's top-level backward spans; where its backward is its kernels alone (a Kineto
    -- trace of GPU ranks, {{kernel_backward}}), one window per step from its first kernel to the
    -- end of the last computing one that ended by its last reduction's end (as rank_step reads
    -- it, sql/base.sql).
    SELECT step, rank, start_ns, start_ns + dur_ns AS end_ns FROM src
    WHERE kind = 'backward' AND name = 'backward'
    UNION ALL
    SELECT f.step, f.rank, min(f.start_ns), max(f.end_ns)
    FROM kernels f JOIN (SELECT step, rank, max(end_ns) AS red_last FROM reductions GROUP BY ALL) r
         ON r.step = f.step AND r.rank = f.rank
    WHERE f.kind = 'backward' AND NOT f.copy AND f.end_ns <= r.red_last
    GROUP BY ALL
), idled AS (
    -- Where the ranks were traced kernel by kernel, a collective (on NCCL's stream of its own)
    -- held its rank only from where the rank's kernels stopped before it completed: a kernel
    -- running as it completed, none (a prefetched gather, its compute going on beside it); else
    -- from the end of the last kernel that ended while it was in flight, or from its arrival (a
    -- TP call the next kernel waits for at once). On 2x H200 FSDP2 jobs under the profiler, the
    -- gathers taken as blocking where issued made the fixed step 22 ms, under the healthy 25.4-26.5.
    SELECT c.step, c.rank, c.grp, c.seq,
           CASE WHEN bool_or(k.start_ns < c.end_ns AND k.end_ns > c.end_ns) THEN max(c.end_ns)
                ELSE greatest(max(c.arrival_ns), coalesce(max(k.end_ns) FILTER (WHERE k.end_ns <= c.end_ns), 0)) END
               AS wait_ns
    FROM c LEFT JOIN kernels k ON k.step = c.step AND k.rank = c.rank AND k.end_ns > c.arrival_ns
                              AND k.start_ns < c.end_ns
    WHERE {{kernel_backward}} AND c.is_coll
    GROUP BY c.step, c.rank, c.grp, c.seq
), enclosed AS (
    -- Data-parallel gradient reductions issued inside the top-level backward of their rank, and
    -- where that backward ends.
    SELECT c.step, c.rank, c.grp, c.seq, min(f.end_ns) AS span_end_ns
    FROM reductions c
    JOIN backward f ON f.step = c.step AND f.rank = c.rank AND f.start_ns < c.arrival_ns AND f.end_ns > c.arrival_ns
    GROUP BY ALL
), o AS (
    SELECT c.* EXCLUDE (wait_ns), coalesce(c.wait_ns, e.span_end_ns, g.wait_ns) AS wait_ns,
           coalesce(c.wait_ns >= c.arrival_ns OR c.wait_ns IS NULL AND coalesce(e.span_end_ns, g.wait_ns) IS NOT NULL,
                    false) AS is_async,
           coalesce(coalesce(c.wait_ns, e.span_end_ns, g.wait_ns) >= c.arrival_ns
                    AND coalesce(c.wait_ns, e.span_end_ns, g.wait_ns) <= c.step_end_ns, false) AS waited_here
    FROM (SELECT c.*, w.wait_ns
          FROM c LEFT JOIN w ON w.step = c.step AND w.rank = c.rank AND w.seq = c.seq AND w.op_name = c.name
                            AND w.peer IS NOT DISTINCT FROM c.peer) c
    LEFT JOIN enclosed e ON e.step = c.step AND e.rank = c.rank AND e.grp = c.grp AND e.seq = c.seq
    LEFT JOIN idled g ON g.step = c.step AND g.rank = c.rank AND g.grp = c.grp AND g.seq = c.seq
), i AS (
    SELECT o.*,
           (dense_rank() OVER (PARTITION BY step ORDER BY is_coll, grp, seq, sender, receiver) - 1) AS inst,
           greatest(CASE WHEN bool_or(is_async) OVER g THEN min(end_ns) OVER g ELSE max(end_ns) OVER g END
                    - max(arrival_ns) OVER g, 0) AS xfer_ns
    FROM o
    WINDOW g AS (PARTITION BY step, is_coll, grp, seq, sender, receiver)
)
SELECT step, rank, kind, seq, arrival_ns, end_ns, step_start_ns, step_end_ns, stage, inst, xfer_ns, is_async FROM i
UNION ALL
SELECT step, rank, 'wait' AS kind, seq, wait_ns AS arrival_ns, end_ns, step_start_ns, step_end_ns, stage, inst, xfer_ns,
       false AS is_async
FROM i WHERE waited_here;

-- @statement events_in_order
-- The events of ms_cache.{{table}} in replay order: per step and rank by arrival, a send before a
-- receive that arrives at the same time, a wait after the call it waits for where it begins as
-- that call is issued (a wait taken first would wait for its own rank's arrival).
-- @column step, rank, arrival_ns, end_ns, step_start_ns, step_end_ns, stage, inst, xfer_ns  as in events
-- @column posted  the rank goes on at once (a send, or a call waited for later): all the replay
--                 needs of its kind, as a flag (a column of strings, one per event, took ~8 MB of
--                 a 256-rank report)
-- @column waiter  a wait row: holds its rank until the instance completes, and is no arrival
SELECT * EXCLUDE (seq, kind, is_async), kind = 'send' OR is_async AS posted, kind = 'wait' AS waiter
FROM ms_cache.{{table}} ORDER BY step, rank, arrival_ns, kind = 'wait', kind <> 'send', seq;

-- @statement drop_events
-- ms_cache.{{table}} once events_in_order has read it: the replay works on that frame, and the
-- run's analysis cache keeps the table on disk for the next report.
DROP TABLE IF EXISTS ms_cache.{{table}};

-- @statement events_per_step
-- How many events a replay of one step handles: collective instances per rank-step plus one.
-- @column events  per step, summed over ranks (NULL without steps)
SELECT sum(coll_count + 1) / nullif(count(DISTINCT step), 0) AS events FROM ms_cache.rank_step;

-- @statement sampled_groups
-- Metrics of calls the collector timed in some micro-batches only ({{calls_prefix}}<group>).
-- @column metrics  their number (0: every call was timed)
SELECT count(*) AS metrics FROM metrics WHERE starts_with(name, '{{calls_prefix}}');

-- @statement sample_periods
-- For rank {{rank}} in steps {{steps}}: each group whose calls the collector timed in part
-- (metrics {{calls_prefix}}<group> and {{step_calls_prefix}}<group>: the calls it issued in the
-- step), how many calls it issued for each one timed. The collector picks the timed ones by the
-- step's number (one micro-batch in N, one bucket in N), so the sample repeats every N steps.
-- @column grp     the group
-- @column period  calls issued over calls timed, the median over the steps read
WITH m AS (
    SELECT step, max(value) AS calls,
           CASE WHEN starts_with(name, '{{step_calls_prefix}}') THEN substr(name, {{step_calls_prefix_len}} + 1)
                ELSE substr(name, {{calls_prefix_len}} + 1) END AS grp
    FROM metrics
    WHERE rank = {{rank}} AND list_contains({{steps}}, step)
      AND (starts_with(name, '{{calls_prefix}}') OR starts_with(name, '{{step_calls_prefix}}'))
    GROUP BY ALL
), t AS (
    SELECT step, "group" AS grp, count(*) AS timed
    FROM spans WHERE rank = {{rank}} AND list_contains({{steps}}, step) AND kind = 'collective'
    GROUP BY ALL
)
SELECT grp, median(m.calls / t.timed) AS period FROM m JOIN t USING (step, grp) GROUP BY grp ORDER BY grp;
