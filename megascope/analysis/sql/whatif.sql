-- What-if replay: the communication events of a few sampled steps, each with the instance it
-- belongs to and that instance's transfer time, read by the replay in whatif.py.

-- @statement events
-- Communication spans of steps {{steps}} with instance keys, on the reference clock (one scan of
-- the spans), into ms_cache.{{table}} (kept in the run's analysis cache for the next report).
-- A pipeline pair is one instance: its send and its receive share (sender, receiver, seq).
-- @column step, rank, kind, seq  the span (kind: collective | send | recv)
-- @column arrival_ns, end_ns    its start and completion, reference clock
-- @column step_start_ns, step_end_ns  the rank's step (rank_step: start, start plus step time)
-- @column stage                 the rank's pipeline stage
-- @column inst                  the instance within the step, numbered from 0
-- @column xfer_ns               the instance's transfer: last completion minus last arrival
CREATE OR REPLACE TABLE ms_cache.{{table}} AS
WITH c AS (
    SELECT s.step, s.rank, s.kind, s.kind = 'collective' AS is_coll,
           CASE WHEN s.kind = 'collective' THEN s."group" ELSE '' END AS grp, s.seq,
           CASE WHEN s.kind = 'collective' THEN -1 WHEN s.kind = 'send' THEN s.rank ELSE s.peer END AS sender,
           CASE WHEN s.kind = 'collective' THEN -1 WHEN s.kind = 'send' THEN s.peer ELSE s.rank END AS receiver,
           s.start_ns + k.offset_ns AS arrival_ns, s.start_ns + k.offset_ns + s.dur_ns AS end_ns,
           r.start_ns AS step_start_ns, r.start_ns + coalesce(r.step_ns, r.extent_ns) AS step_end_ns, r.stage
    FROM spans s
    JOIN ms_cache.rank_clock k USING (rank)
    JOIN ms_cache.rank_step r ON r.rank = s.rank AND r.step = s.step
    WHERE s.step IN ({{steps}}) AND s.kind IN ('collective', 'send', 'recv') AND s.seq IS NOT NULL
      AND (s.kind = 'collective' AND s."group" IS NOT NULL OR s.kind <> 'collective' AND s.peer IS NOT NULL)
)
SELECT step, rank, kind, seq, arrival_ns, end_ns, step_start_ns, step_end_ns, stage,
       (dense_rank() OVER (PARTITION BY step ORDER BY is_coll, grp, seq, sender, receiver) - 1) AS inst,
       greatest(max(end_ns) OVER w - max(arrival_ns) OVER w, 0) AS xfer_ns
FROM c
WINDOW w AS (PARTITION BY step, is_coll, grp, seq, sender, receiver);

-- @statement events_in_order
-- The events of ms_cache.{{table}} in replay order: per step and rank by arrival, a send before a
-- receive that arrives at the same time.
-- @column step, rank, arrival_ns, end_ns, step_start_ns, step_end_ns, stage, inst, xfer_ns  as in events
-- @column posted  the event is a send (its rank goes on at once): all the replay needs of its kind,
--                 as a flag (a column of strings, one per event, took ~8 MB of a 256-rank report)
SELECT * EXCLUDE (seq, kind), kind = 'send' AS posted
FROM ms_cache.{{table}} ORDER BY step, rank, arrival_ns, kind <> 'send', seq;

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
