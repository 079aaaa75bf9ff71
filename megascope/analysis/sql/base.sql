-- Base tables every analysis of megascope reads: each rank's place and clock, one row per
-- communication instance, one row per (rank, step) with its time split by what it was doing.
-- Built once per run (and rebuilt when the run grows) into schema ms_cache.
--
-- Vocabulary used across the analysis modules:
--   arrival      a communication span's start_ns: when the rank reached the collective / p2p op.
--   instance     one collective call across its group (same "group", seq), or one p2p transfer
--                (same sender, receiver, seq).
--   wait         time a rank spent in an instance before its last member arrived: not its fault.
--   xfer         the rest of the span: the transfer itself.
--   own          step time minus communication time: what the rank itself spent (compute, data
--                loading, host work, idle gaps). In a synchronous job every rank's step time is
--                equal, so own time is where a straggler differs from its peers.
--   stage        the pipeline stage (pp coordinate, 0 without pipeline): ranks of one stage do the
--                same work and are each other's peers.

-- @statement rank_info
-- One row per rank seen anywhere in the run (ranks table, spans or markers).
-- @column rank   global rank
-- @column host   host name from the ranks table ('unknown' when the rank wrote no ranks row)
-- @column pp, dp, tp  mesh coordinates as written (never recomputed here)
-- @column stage  pp, or 0 when the run has no pipeline axis
CREATE OR REPLACE TABLE ms_cache.rank_info AS
WITH r AS (
    SELECT rank, any_value(host) AS host, any_value(pp) AS pp, any_value(dp) AS dp, any_value(tp) AS tp
    FROM ranks GROUP BY rank
), seen AS (
    SELECT rank FROM r
    UNION SELECT DISTINCT rank FROM spans
    UNION SELECT DISTINCT rank FROM markers
)
SELECT seen.rank, coalesce(r.host, 'unknown') AS host, r.pp, r.dp, r.tp, coalesce(r.pp, 0) AS stage
FROM seen LEFT JOIN r USING (rank)
ORDER BY seen.rank;

-- @statement step_list
-- The steps that have spans, in order (a cheap scan of one column).
SELECT DISTINCT step FROM spans WHERE step IS NOT NULL ORDER BY step;

-- @statement clock_samples
-- Completion times of communication in the sampled steps {{steps}}, for clock-offset estimation.
-- Members of one collective finish together (within the last transfer), and so do the two ends of
-- a pipeline send/receive, so their completion times disagree only by their hosts' clock offsets.
-- Pipeline pairs matter: with TP inside a host and DP groups spanning few hosts, only they link
-- the hosts of different stages.
-- @column grp, seq  the instance ('p2p:S>R' for a point-to-point pair)
-- @column rank, host  the member and its host
-- @column end_ns    completion on the member host's clock
CREATE OR REPLACE TABLE ms_cache.clock_samples AS
SELECT CASE WHEN s.kind = 'collective' THEN s."group"
            WHEN s.kind = 'send' THEN 'p2p:' || s.rank || '>' || s.peer
            ELSE 'p2p:' || s.peer || '>' || s.rank END AS grp,
       s.seq, s.rank, i.host, s.start_ns + s.dur_ns AS end_ns
FROM spans s JOIN ms_cache.rank_info i USING (rank)
WHERE s.kind IN ('collective', 'send', 'recv') AND s.seq IS NOT NULL
  AND (s.kind = 'collective' AND s."group" IS NOT NULL OR s.kind <> 'collective' AND s.peer IS NOT NULL)
  AND list_contains({{steps}}, s.step);

-- @statement clock_pairs
-- Host-pair clock differences: in each instance spanning two or more hosts, every member's
-- completion minus that of the instance's lowest rank; the median per (host, ref_host) pair.
-- @column host, ref_host  the pair
-- @column diff_ns   median of completion(host) - completion(ref_host): clock(host) - clock(ref_host)
-- @column mad_ns    median absolute deviation of one sample around diff_ns
-- @column samples   instances behind it
WITH ref AS (
    SELECT grp, seq, arg_min(host, rank) AS ref_host, arg_min(end_ns, rank) AS ref_end
    FROM ms_cache.clock_samples GROUP BY grp, seq HAVING count(DISTINCT host) >= 2
), d AS (
    SELECT s.host, r.ref_host, s.end_ns - r.ref_end AS d
    FROM ms_cache.clock_samples s JOIN ref r USING (grp, seq)
    WHERE s.host <> r.ref_host
), m AS (
    SELECT host, ref_host, median(d) AS diff_ns, count(*) AS samples FROM d GROUP BY host, ref_host
)
SELECT m.host, m.ref_host, m.diff_ns, median(abs(d.d - m.diff_ns)) AS mad_ns, any_value(m.samples) AS samples
FROM m JOIN d USING (host, ref_host)
GROUP BY m.host, m.ref_host, m.diff_ns;

-- @statement rank_clock
-- Each rank's clock offset (that of its host): add offset_ns to its times.
CREATE OR REPLACE TABLE ms_cache.rank_clock AS
SELECT i.rank, i.host, i.stage, coalesce(o.offset_ns, 0)::BIGINT AS offset_ns
FROM ms_cache.rank_info i LEFT JOIN ms_cache.clock_offsets o USING (host);

-- @statement comm
-- Communication spans on the reference clock, with their instance key.
-- @column is_coll  collective (true) or point-to-point (false)
-- @column grp      group id for collectives, '' for p2p (its key is sender/receiver/seq)
-- @column sender, receiver  p2p endpoints (-1 for collectives)
-- @column arrival_ns, end_ns  corrected arrival and completion
CREATE OR REPLACE TABLE ms_cache.comm AS
SELECT s.rank, s.step, s.name, s.kind, s.op, s."group" AS group_id, s.seq,
       s.kind = 'collective' AS is_coll,
       CASE WHEN s.kind = 'collective' THEN s."group" ELSE '' END AS grp,
       CASE WHEN s.kind = 'collective' THEN -1 WHEN s.kind = 'send' THEN s.rank ELSE s.peer END AS sender,
       CASE WHEN s.kind = 'collective' THEN -1 WHEN s.kind = 'send' THEN s.peer ELSE s.rank END AS receiver,
       s.start_ns + c.offset_ns AS arrival_ns, s.dur_ns, s.start_ns + c.offset_ns + s.dur_ns AS end_ns
FROM spans s JOIN ms_cache.rank_clock c USING (rank)
WHERE s.kind IN ('collective', 'send', 'recv') AND s.seq IS NOT NULL
  AND (s.kind = 'collective' AND s."group" IS NOT NULL OR s.kind <> 'collective' AND s.peer IS NOT NULL);

-- @statement inst
-- One row per communication instance.
-- @column step           the step it belongs to (first member's)
-- @column name, op       span name / collective op of its members
-- @column group_kind     tp | dp | pp | world | other | p2p
-- @column n              members that recorded it
-- @column first_arrival_ns, last_arrival_ns, median_arrival_ns  arrivals on the reference clock
-- @column last_rank      the last member to arrive: the one the others waited for
-- @column spread_ns      last minus first arrival
-- @column xfer_ns        completion of the last member minus the last arrival: the transfer
CREATE OR REPLACE TABLE ms_cache.inst AS
WITH g AS (
    SELECT c.is_coll, c.grp, c.seq, c.sender, c.receiver,
           min(c.step) AS step, any_value(c.name) AS name, any_value(c.op) AS op,
           any_value(c.group_id) AS group_id,
           count(*) AS n, min(c.arrival_ns) AS first_arrival_ns, max(c.arrival_ns) AS last_arrival_ns,
           median(c.arrival_ns)::BIGINT AS median_arrival_ns, arg_max(c.rank, c.arrival_ns) AS last_rank,
           max(c.end_ns) AS last_end_ns
    FROM ms_cache.comm c
    GROUP BY c.is_coll, c.grp, c.seq, c.sender, c.receiver
), kinds AS (SELECT "group", any_value(kind) AS kind FROM groups GROUP BY "group")
SELECT g.*,
       CASE WHEN NOT g.is_coll THEN 'p2p'
            ELSE coalesce(kinds.kind, CASE WHEN split_part(g.grp, ':', 1) IN ('tp', 'dp', 'pp', 'world')
                                           THEN split_part(g.grp, ':', 1) ELSE 'other' END) END AS group_kind,
       g.last_arrival_ns - g.first_arrival_ns AS spread_ns,
       greatest(g.last_end_ns - g.last_arrival_ns, 0) AS xfer_ns
FROM g LEFT JOIN kinds ON kinds."group" = g.grp;

-- @statement rank_step
-- One row per (rank, step): step time and what it was spent on.
-- @column step_ns        the rank's step span (NULL when it wrote none: an unfinished step)
-- @column start_ns       start of the step on the reference clock
-- @column extent_ns      last end minus first start of all its spans in the step
-- @column forward_ns, backward_ns, optimizer_ns, compute_ns  compute kinds, summed
-- @column data_ns, host_ns, other_ns                          data wait, host work, other
-- @column comm_ns        summed communication spans
-- @column wait_ns        of which waiting for the last member to arrive
-- @column p2p_wait_ns    of which waiting in pipeline sends/receives (bubbles)
-- @column xfer_ns        comm_ns - wait_ns
-- @column own_ns         step time (or extent) minus blocking communication (collectives and
--                        receives; a send is posted and the sender goes on computing, so its
--                        span overlaps the sender's own work)
-- @column coll_count     collective instances it took part in (with >= 2 members recorded)
-- @column last_count     ... of which it arrived last
-- @column late_ns        summed arrival minus instance median arrival over those collectives
-- @column coll_tp, coll_dp, coll_pp, coll_other  collectives by group kind
-- @column last_tp, last_dp, last_pp, last_other  of which it arrived last
CREATE OR REPLACE TABLE ms_cache.rank_step AS
WITH own_spans AS (
    SELECT s.rank, s.step,
           max(s.dur_ns) FILTER (WHERE s.kind = 'step') AS step_ns,
           min(s.start_ns) FILTER (WHERE s.kind = 'step') AS step_start_raw,
           min(s.start_ns) AS first_raw, max(s.start_ns + s.dur_ns) AS last_raw,
           sum(s.dur_ns) FILTER (WHERE s.kind = 'forward') AS forward_ns,
           sum(s.dur_ns) FILTER (WHERE s.kind = 'backward') AS backward_ns,
           sum(s.dur_ns) FILTER (WHERE s.kind = 'optimizer') AS optimizer_ns,
           sum(s.dur_ns) FILTER (WHERE s.kind = 'compute') AS compute_ns,
           sum(s.dur_ns) FILTER (WHERE s.kind = 'data') AS data_ns,
           sum(s.dur_ns) FILTER (WHERE s.kind = 'host') AS host_ns,
           sum(s.dur_ns) FILTER (WHERE s.kind = 'other') AS other_ns
    FROM spans s
    WHERE s.step IS NOT NULL AND s.kind NOT IN ('collective', 'send', 'recv')
    GROUP BY s.rank, s.step
), comm_agg AS (
    SELECT c.rank, c.step,
           sum(c.dur_ns) AS comm_ns,
           sum(c.dur_ns) FILTER (WHERE c.kind <> 'send') AS blocking_ns,
           sum(CASE WHEN i.n >= 2 THEN least(greatest(i.last_arrival_ns - c.arrival_ns, 0), c.dur_ns) ELSE 0 END) AS wait_ns,
           sum(CASE WHEN i.n >= 2 AND NOT c.is_coll
                    THEN least(greatest(i.last_arrival_ns - c.arrival_ns, 0), c.dur_ns) ELSE 0 END) AS p2p_wait_ns,
           count(*) FILTER (WHERE c.is_coll AND i.n >= 2) AS coll_count,
           count(*) FILTER (WHERE c.is_coll AND i.n >= 2 AND i.last_rank = c.rank) AS last_count,
           sum(c.arrival_ns - i.median_arrival_ns) FILTER (WHERE c.is_coll AND i.n >= 2) AS late_ns,
           count(*) FILTER (WHERE c.is_coll AND i.n >= 2 AND i.group_kind = 'tp') AS coll_tp,
           count(*) FILTER (WHERE c.is_coll AND i.n >= 2 AND i.group_kind = 'dp') AS coll_dp,
           count(*) FILTER (WHERE c.is_coll AND i.n >= 2 AND i.group_kind = 'pp') AS coll_pp,
           count(*) FILTER (WHERE c.is_coll AND i.n >= 2 AND i.group_kind NOT IN ('tp', 'dp', 'pp')) AS coll_other,
           count(*) FILTER (WHERE c.is_coll AND i.n >= 2 AND i.last_rank = c.rank AND i.group_kind = 'tp') AS last_tp,
           count(*) FILTER (WHERE c.is_coll AND i.n >= 2 AND i.last_rank = c.rank AND i.group_kind = 'dp') AS last_dp,
           count(*) FILTER (WHERE c.is_coll AND i.n >= 2 AND i.last_rank = c.rank AND i.group_kind = 'pp') AS last_pp,
           count(*) FILTER (WHERE c.is_coll AND i.n >= 2 AND i.last_rank = c.rank
                            AND i.group_kind NOT IN ('tp', 'dp', 'pp')) AS last_other,
           min(c.arrival_ns) AS first_comm_ns, max(c.end_ns) AS last_comm_ns
    FROM ms_cache.comm c
    JOIN ms_cache.inst i USING (is_coll, grp, seq, sender, receiver)
    WHERE c.step IS NOT NULL
    GROUP BY c.rank, c.step
), j AS (
    SELECT coalesce(o.rank, c.rank) AS rank, coalesce(o.step, c.step) AS step, o.*  EXCLUDE (rank, step),
           c.* EXCLUDE (rank, step)
    FROM own_spans o FULL OUTER JOIN comm_agg c ON o.rank = c.rank AND o.step = c.step
)
SELECT j.rank, j.step, k.stage, j.step_ns,
       coalesce(j.step_start_raw, least(j.first_raw, j.first_comm_ns - k.offset_ns)) + k.offset_ns AS start_ns,
       greatest(j.last_raw + k.offset_ns, j.last_comm_ns) - least(j.first_raw + k.offset_ns, j.first_comm_ns) AS extent_ns,
       coalesce(j.forward_ns, 0) AS forward_ns, coalesce(j.backward_ns, 0) AS backward_ns,
       coalesce(j.optimizer_ns, 0) AS optimizer_ns, coalesce(j.compute_ns, 0) AS compute_ns,
       coalesce(j.data_ns, 0) AS data_ns, coalesce(j.host_ns, 0) AS host_ns, coalesce(j.other_ns, 0) AS other_ns,
       coalesce(j.comm_ns, 0) AS comm_ns, coalesce(j.wait_ns, 0) AS wait_ns,
       coalesce(j.p2p_wait_ns, 0) AS p2p_wait_ns,
       coalesce(j.comm_ns, 0) - coalesce(j.wait_ns, 0) AS xfer_ns,
       coalesce(j.step_ns, greatest(j.last_raw + k.offset_ns, j.last_comm_ns) - least(j.first_raw + k.offset_ns, j.first_comm_ns))
           - coalesce(j.blocking_ns, 0) AS own_ns,
       coalesce(j.coll_count, 0) AS coll_count, coalesce(j.last_count, 0) AS last_count,
       coalesce(j.late_ns, 0) AS late_ns,
       coalesce(j.coll_tp, 0) AS coll_tp, coalesce(j.coll_dp, 0) AS coll_dp,
       coalesce(j.coll_pp, 0) AS coll_pp, coalesce(j.coll_other, 0) AS coll_other,
       coalesce(j.last_tp, 0) AS last_tp, coalesce(j.last_dp, 0) AS last_dp,
       coalesce(j.last_pp, 0) AS last_pp, coalesce(j.last_other, 0) AS last_other
FROM j JOIN ms_cache.rank_clock k USING (rank);
