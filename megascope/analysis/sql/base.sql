-- Base tables every analysis of megascope reads: each rank's place and clock, one row per
-- communication instance, one row per (rank, step) with its time split by what it was doing.
-- Built once per run (and rebuilt when the run grows) into schema ms_cache.
--
-- Cost: the spans are scanned twice (collective instances; per-rank-step sums), plus a sample of
-- ranks for clock offsets; nothing joins millions of spans back to their instances.
--
-- Vocabulary used across the analysis modules:
--   arrival      a communication span's start_ns: when the rank reached the collective / p2p op.
--   instance     one collective call across its group (same "group", seq).
--   xfer         an instance's transfer: completion minus its last member's arrival.
--   wait         time a rank spent in communication beyond the transfer: waiting for the last
--                member of a collective, or blocked in a pipeline receive. Not its fault.
--   own          step time minus communication time: what the rank itself spent (compute, data
--                loading, host work, idle gaps). In a synchronous job every rank's step time is
--                equal, so own time is where a straggler differs from its peers.
--   stage        the pipeline stage (pp coordinate, 0 without pipeline): ranks of one stage do the
--                same work and are each other's peers.

-- @statement rank_info
-- One row per rank of the ranks table (ranks that wrote spans but no ranks row are added after
-- rank_step, as 'unknown' hosts).
-- @column rank   global rank
-- @column host   host name from the ranks table
-- @column pp, dp, tp  mesh coordinates as written (never recomputed here)
-- @column stage  pp, or 0 when the run has no pipeline axis
CREATE OR REPLACE TABLE ms_cache.rank_info AS
SELECT rank, any_value(host) AS host, any_value(pp) AS pp, any_value(dp) AS dp, any_value(tp) AS tp,
       coalesce(any_value(pp), 0) AS stage
FROM ranks GROUP BY rank ORDER BY rank;

-- @statement add_unknown_ranks
-- Ranks seen in rank_step but missing from the ranks table.
INSERT INTO ms_cache.rank_info
SELECT DISTINCT r.rank, 'unknown', NULL, NULL, NULL, 0
FROM ms_cache.rank_step r ANTI JOIN ms_cache.rank_info i USING (rank);

-- @statement step_list
-- The steps of one rank ({{rank}}; a cheap read of its partition), in order.
SELECT DISTINCT step FROM spans WHERE rank = {{rank}} AND step IS NOT NULL ORDER BY step;

-- @statement clock_samples
-- Completion times of communication in the sampled steps {{steps}} on the sampled ranks
-- ({{ranks}}: whole collectives and pipeline pairs of one TP index), for clock-offset estimation.
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
WHERE s.rank IN ({{ranks}})
  AND s.kind IN ('collective', 'send', 'recv') AND s.seq IS NOT NULL
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

-- @statement inst
-- One row per collective instance, arrivals on the reference clock.
-- @column grp, seq       the instance
-- @column step           the step it belongs to (first member's)
-- @column name, op       span name / collective op of its members
-- @column group_kind     tp | dp | pp | world | other
-- @column n              members that recorded it
-- @column first_arrival_ns, last_arrival_ns, mean_arrival_ns  arrivals
-- @column last_rank      the last member to arrive: the one the others waited for
-- @column spread_ns      last minus first arrival
-- @column xfer_ns        completion of the last member minus the last arrival: the transfer
CREATE OR REPLACE TABLE ms_cache.inst AS
WITH c AS (
    SELECT s.rank, s.step, s.name, s.op, s."group" AS grp, s.seq,
           s.start_ns + coalesce(k.offset_ns, 0) AS a, s.start_ns + coalesce(k.offset_ns, 0) + s.dur_ns AS e
    FROM spans s LEFT JOIN ms_cache.rank_clock k USING (rank)
    WHERE s.kind = 'collective' AND s."group" IS NOT NULL AND s.seq IS NOT NULL
), g AS (
    SELECT grp, seq, min(step) AS step, any_value(name) AS name, any_value(op) AS op, count(*) AS n,
           min(a) AS first_arrival_ns, max(a) AS last_arrival_ns, avg(a)::BIGINT AS mean_arrival_ns,
           arg_max(rank, a) AS last_rank, max(e) AS last_end_ns
    FROM c GROUP BY grp, seq
), kinds AS (SELECT "group", any_value(kind) AS kind FROM groups GROUP BY "group")
SELECT g.*,
       coalesce(kinds.kind, CASE WHEN split_part(g.grp, ':', 1) IN ('tp', 'dp', 'pp', 'world')
                                 THEN split_part(g.grp, ':', 1) ELSE 'other' END) AS group_kind,
       g.last_arrival_ns - g.first_arrival_ns AS spread_ns,
       greatest(g.last_end_ns - g.last_arrival_ns, 0) AS xfer_ns
FROM g LEFT JOIN kinds ON kinds."group" = g.grp;

-- @statement rank_step
-- One row per (rank, step): step time and what it was spent on.
-- @column stage          pipeline stage
-- @column step_ns        the rank's step span (NULL when it wrote none: an unfinished step)
-- @column start_ns       start of the step on the reference clock
-- @column extent_ns      last end minus first start of all its spans in the step
-- @column forward_ns, backward_ns, optimizer_ns, compute_ns  compute kinds, summed
-- @column data_ns, host_ns, other_ns                          data wait, host work, other
-- @column comm_ns        summed communication spans
-- @column coll_ns, recv_ns, send_ns  of which collectives, pipeline receives, pipeline sends
-- @column xfer_ns        transfer time of its collectives (from its groups' instances)
-- @column wait_ns        coll_ns - xfer_ns (waiting for the last member) + recv_ns (blocked on
--                        the previous/next stage)
-- @column p2p_wait_ns    recv_ns: the pipeline bubble (a receive's own transfer is small)
-- @column own_ns         step time (or extent) minus blocking communication (collectives and
--                        receives; a send is posted and the sender goes on computing, so its
--                        span overlaps the sender's own work)
-- @column coll_count     collective instances it took part in (with >= 2 members recorded)
-- @column coll_tp, coll_dp, coll_pp, coll_other  collectives by group kind
-- @column last_tp, last_dp, last_pp, last_other  of which it arrived last
-- @column last_count     their sum
CREATE OR REPLACE TABLE ms_cache.rank_step AS
WITH own AS (
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
           sum(s.dur_ns) FILTER (WHERE s.kind = 'other') AS other_ns,
           sum(s.dur_ns) FILTER (WHERE s.kind = 'collective') AS coll_ns,
           sum(s.dur_ns) FILTER (WHERE s.kind = 'recv') AS recv_ns,
           sum(s.dur_ns) FILTER (WHERE s.kind = 'send') AS send_ns
    FROM spans s
    WHERE s.step IS NOT NULL
    GROUP BY s.rank, s.step
), per_group AS (
    SELECT grp, step, any_value(group_kind) AS group_kind, count(*) FILTER (WHERE n >= 2) AS instances,
           sum(xfer_ns) FILTER (WHERE n >= 2) AS xfer_ns
    FROM ms_cache.inst GROUP BY grp, step
), members AS (SELECT DISTINCT rank, "group" AS grp FROM groups), via_groups AS (
    SELECT m.rank, p.step, sum(p.xfer_ns) AS xfer_ns,
           sum(p.instances) FILTER (WHERE p.group_kind = 'tp') AS coll_tp,
           sum(p.instances) FILTER (WHERE p.group_kind = 'dp') AS coll_dp,
           sum(p.instances) FILTER (WHERE p.group_kind = 'pp') AS coll_pp,
           sum(p.instances) FILTER (WHERE p.group_kind NOT IN ('tp', 'dp', 'pp')) AS coll_other
    FROM per_group p JOIN members m USING (grp)
    GROUP BY m.rank, p.step
), lasts AS (
    SELECT last_rank AS rank, step,
           count(*) FILTER (WHERE group_kind = 'tp') AS last_tp,
           count(*) FILTER (WHERE group_kind = 'dp') AS last_dp,
           count(*) FILTER (WHERE group_kind = 'pp') AS last_pp,
           count(*) FILTER (WHERE group_kind NOT IN ('tp', 'dp', 'pp')) AS last_other
    FROM ms_cache.inst WHERE n >= 2 GROUP BY last_rank, step
), j AS (
    SELECT o.*, coalesce(k.offset_ns, 0) AS offset_ns, coalesce(k.stage, 0) AS stage,
           coalesce(o.coll_ns, 0) + coalesce(o.recv_ns, 0) + coalesce(o.send_ns, 0) AS comm,
           coalesce(o.coll_ns, 0) + coalesce(o.recv_ns, 0) AS blocking,
           coalesce(v.xfer_ns, 0) AS xfer,
           coalesce(v.coll_tp, 0) AS coll_tp, coalesce(v.coll_dp, 0) AS coll_dp,
           coalesce(v.coll_pp, 0) AS coll_pp, coalesce(v.coll_other, 0) AS coll_other,
           coalesce(l.last_tp, 0) AS last_tp, coalesce(l.last_dp, 0) AS last_dp,
           coalesce(l.last_pp, 0) AS last_pp, coalesce(l.last_other, 0) AS last_other
    FROM own o
    LEFT JOIN ms_cache.rank_clock k USING (rank)
    LEFT JOIN via_groups v ON v.rank = o.rank AND v.step = o.step
    LEFT JOIN lasts l ON l.rank = o.rank AND l.step = o.step
)
SELECT rank, step, stage, step_ns,
       coalesce(step_start_raw, first_raw) + offset_ns AS start_ns,
       last_raw - first_raw AS extent_ns,
       coalesce(forward_ns, 0) AS forward_ns, coalesce(backward_ns, 0) AS backward_ns,
       coalesce(optimizer_ns, 0) AS optimizer_ns, coalesce(compute_ns, 0) AS compute_ns,
       coalesce(data_ns, 0) AS data_ns, coalesce(host_ns, 0) AS host_ns, coalesce(other_ns, 0) AS other_ns,
       comm AS comm_ns, coalesce(coll_ns, 0) AS coll_ns, coalesce(recv_ns, 0) AS recv_ns,
       coalesce(send_ns, 0) AS send_ns,
       least(xfer, coalesce(coll_ns, 0)) AS xfer_ns,
       greatest(coalesce(coll_ns, 0) - xfer, 0) + coalesce(recv_ns, 0) AS wait_ns,
       coalesce(recv_ns, 0) AS p2p_wait_ns,
       coalesce(step_ns, last_raw - first_raw) - blocking AS own_ns,
       coll_tp + coll_dp + coll_pp + coll_other AS coll_count,
       coll_tp, coll_dp, coll_pp, coll_other,
       last_tp + last_dp + last_pp + last_other AS last_count,
       last_tp, last_dp, last_pp, last_other
FROM j;
