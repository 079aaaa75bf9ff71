-- Base tables every analysis of megascope reads: each rank's place and clock, one row per
-- communication instance, one row per (rank, step) with its time split by what it was doing.
-- Built once per run (and rebuilt when the run grows) into schema ms_cache.
--
-- Cost: the spans are scanned twice (collective instances; per-rank-step sums), plus a sample of
-- ranks for clock offsets; nothing joins millions of spans back to their instances. The
-- per-rank-step sums read the writers' step_sums instead wherever a spans file has them (a few
-- rows per rank and step instead of every span). (One pass with
-- GROUPING SETS was measured no faster and took more memory: the hash aggregation, not the reading,
-- is what costs.)
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
--   group kind   what a group is for (tp | dp | pp | cp | ep | world | other): the groups
--                table's kind, never read out of the group's id; 'other' for a group it lacks.

-- @statement rank_info
-- One row per rank of the ranks table (ranks that wrote spans but no ranks row are added after
-- rank_step, as 'unknown' hosts).
-- @column rank   global rank
-- @column host   host name from the ranks table
-- @column coords  mesh coordinates as written, axis -> index, every axis (never recomputed here)
-- @column pp, dp, tp  of which the axes the analyses read by name (NULL where absent)
-- @column stage  pp, or 0 when the run has no pipeline axis
-- @column tp_key  its coordinates on every axis but tp, sorted: ranks alike in it (and with a
--                 tp coordinate) are one tensor-parallel group
CREATE OR REPLACE TABLE ms_cache.rank_info AS
WITH r AS (SELECT rank, any_value(host) AS host, any_value(coords) AS coords FROM ranks GROUP BY rank)
SELECT rank, host, coords, coords['pp'] AS pp, coords['dp'] AS dp, coords['tp'] AS tp,
       coalesce(coords['pp'], 0) AS stage,
       list_sort(list_filter(map_entries(coords), lambda e: e.key <> 'tp')) AS tp_key
FROM r ORDER BY rank;

-- @statement places
-- rank_info by rank: each rank's place.
-- @column rank, host, coords, pp, dp, tp, stage, tp_key  as in rank_info
SELECT * FROM ms_cache.rank_info ORDER BY rank;

-- @statement add_unknown_ranks
-- Ranks seen in rank_step but missing from the ranks table.
INSERT INTO ms_cache.rank_info (rank, host, stage)
SELECT DISTINCT r.rank, 'unknown', 0
FROM ms_cache.rank_step r ANTI JOIN ms_cache.rank_info i USING (rank);

-- @statement group_kind
-- One row per group of the groups table: its kind, as the writer recorded it.
-- @column group   the group id
-- @column kind    tp | dp | pp | cp | ep | world | other
CREATE OR REPLACE TABLE ms_cache.group_kind AS
SELECT "group", any_value(kind) AS kind FROM groups GROUP BY "group";

-- @statement rank_shape
-- What rank_step is built with, read off rank_info: the rank whose spans are probed for nested
-- collectives, and whether there is more than one pipeline stage.
-- @column first_rank  the lowest rank (NULL without ranks)
-- @column stages      distinct pipeline stages
SELECT min(rank) AS first_rank, count(DISTINCT stage) AS stages FROM ms_cache.rank_info;

-- @statement first_ranks
-- The lowest four ranks: the run's steps are read from the first of them that has spans.
-- @column rank  a rank of rank_info
SELECT rank FROM ms_cache.rank_info ORDER BY rank LIMIT 4;

-- @statement all_steps
-- Every step of the spans (where none of first_ranks recorded one): a scan of every partition.
-- @column step  a step some rank recorded spans in
SELECT DISTINCT step FROM spans WHERE step IS NOT NULL ORDER BY step;

-- @statement step_list
-- The steps of one rank ({{rank}}; a cheap read of its partition), in order.
-- @column step           a step the rank recorded spans in
SELECT DISTINCT step FROM spans WHERE rank = {{rank}} AND step IS NOT NULL ORDER BY step;

-- @statement clock_ranks
-- Ranks whose spans suffice for clock offsets: every rank of the TP index that each host's lowest
-- rank has. Their collectives (DP, PP, world) and pipeline pairs are complete, every host is
-- covered, and only 1/tp of the partitions is read.
-- @column rank  a sampled rank
WITH firsts AS (SELECT host, arg_min(tp, rank) AS tp FROM ms_cache.rank_info GROUP BY host)
SELECT rank FROM ms_cache.rank_info
WHERE tp IS NULL OR tp IN (SELECT tp FROM firsts) ORDER BY rank;

-- @statement clock_hosts
-- The hosts in the order of their lowest rank: the first is the reference clock (rank 0's host).
-- @column host  a host of rank_info
SELECT host FROM ms_cache.rank_info GROUP BY host ORDER BY min(rank);

-- @statement drop_clock_samples
-- The samples are read once, by clock_pairs.
DROP TABLE IF EXISTS ms_cache.clock_samples;

-- @statement rank_skew
-- Device-timed ranks whose own clock reads late against their TP group's: each maps its CUDA
-- events to the host's clock through anchors of its own, and an anchor off by milliseconds puts
-- the rank's whole run off by as much. The members of a TP group end their step's last TP call
-- together, so per (group, step) in the sampled steps {{steps}} each member's last TP completion
-- minus the group's earliest is its clock's lead; a member late by at least 0.2 ms in the median,
-- steadily (deviation at most 50 us or 5% of it), over at least 3 steps, is put back by it.
-- ({{ends}}: rank, grp, step, last_end_ns of its calls, from the writers' sums or the spans.)
-- @column rank      a device-timed rank (ranks.device on CUDA)
-- @column skew_ns   how late its clock reads: subtract it from its times
-- @column samples   group-steps behind it
CREATE OR REPLACE TABLE ms_cache.rank_skew AS
WITH e AS (
    SELECT e.rank, e.grp, e.step, max(e.last_end_ns) AS end_ns
    FROM {{ends}} e JOIN ms_cache.group_kind k ON k."group" = e.grp
    WHERE k.kind = 'tp' AND list_contains({{steps}}, e.step)
      AND e.rank IN (SELECT rank FROM ranks WHERE device LIKE 'cuda%')
    GROUP BY e.rank, e.grp, e.step
), d AS (
    SELECT rank, end_ns - min(end_ns) OVER (PARTITION BY grp, step) AS d,
           count(*) OVER (PARTITION BY grp, step) AS n
    FROM e
), m AS (
    SELECT rank, median(d) AS skew, count(*) AS samples FROM d WHERE n >= 2 GROUP BY rank
)
SELECT m.rank, round(m.skew)::BIGINT AS skew_ns, m.samples::BIGINT AS samples
FROM m JOIN d USING (rank) WHERE d.n >= 2
GROUP BY m.rank, m.skew, m.samples
HAVING m.skew >= 200000 AND m.samples >= 3 AND median(abs(d.d - m.skew)) <= greatest(50000, m.skew / 20);

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
       s.seq, s.rank, i.host, s.start_ns + s.dur_ns - coalesce(k.skew_ns, 0) AS end_ns
FROM spans s JOIN ms_cache.rank_info i USING (rank) LEFT JOIN ms_cache.rank_skew k USING (rank)
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

-- @statement clock_offsets
-- Per host its clock offset, as solved in Python from clock_pairs (base.solve_offsets) and
-- registered as {{frame}}.
-- @column host       the host
-- @column offset_ns  add it to the host's times to put them on the reference clock
-- @column error_ns   bound on the estimate (NULL without samples)
-- @column samples    collective completions used
CREATE OR REPLACE TABLE ms_cache.clock_offsets AS
SELECT host::VARCHAR AS host, offset_ns::BIGINT AS offset_ns, error_ns::BIGINT AS error_ns,
       samples::BIGINT AS samples
FROM {{frame}};

-- @statement offsets
-- ms_cache.clock_offsets by host.
-- @column host, offset_ns, error_ns, samples  as in clock_offsets
SELECT host, offset_ns, error_ns, samples FROM ms_cache.clock_offsets ORDER BY host;

-- @statement rank_leads
-- The ranks rank_skew put back on their TP group's clock, as rank_clock keeps them.
-- @column rank     the rank
-- @column host     its host
-- @column skew_ns  how late its clock read against its TP group's
SELECT rank, host, host_offset_ns - offset_ns AS skew_ns
FROM ms_cache.rank_clock WHERE offset_ns <> host_offset_ns ORDER BY rank;

-- @statement rank_clock
-- Each rank's clock offsets: add offset_ns to its spans' times (its host's offset, less its own
-- clock's lead where rank_skew found one), host_offset_ns to what its host's clock stamped
-- (markers, heartbeats).
-- @column rank, host       the rank and its host
-- @column stage            as in rank_info
-- @column offset_ns        its host's clock offset (0 when unknown), less the rank's skew
-- @column host_offset_ns   its host's clock offset (0 when unknown)
CREATE OR REPLACE TABLE ms_cache.rank_clock AS
SELECT i.rank, i.host, i.stage, (coalesce(o.offset_ns, 0) - coalesce(k.skew_ns, 0))::BIGINT AS offset_ns,
       coalesce(o.offset_ns, 0)::BIGINT AS host_offset_ns
FROM ms_cache.rank_info i LEFT JOIN ms_cache.clock_offsets o USING (host)
LEFT JOIN ms_cache.rank_skew k USING (rank);

-- @statement inst
-- One row per collective instance, arrivals on the reference clock ({{where}}: true, or the
-- steps a grown run added, when the base tables are extended).
-- @column grp, seq       the instance
-- @column step           the step it belongs to (first member's)
-- @column name, op       span name / collective op of its members
-- @column group_kind     tp | dp | pp | cp | ep | world | other (ms_cache.group_kind)
-- @column n              members that recorded it
-- @column first_arrival_ns, last_arrival_ns, mean_arrival_ns  arrivals
-- @column last_rank      the last member to arrive: the one the others waited for
-- @column spread_ns      last minus first arrival
-- @column xfer_ns        completion of the last member minus the last arrival: the transfer
-- @column last_end_ns    latest completion among its members (reference clock)
CREATE OR REPLACE TABLE ms_cache.inst AS
WITH c AS (
    SELECT s.rank, s.step, s.name, s.op, s."group" AS grp, s.seq,
           s.start_ns + coalesce(k.offset_ns, 0) AS a, s.start_ns + coalesce(k.offset_ns, 0) + s.dur_ns AS e
    FROM spans s LEFT JOIN ms_cache.rank_clock k USING (rank)
    WHERE s.kind = 'collective' AND s."group" IS NOT NULL AND s.seq IS NOT NULL AND {{where}}
), g AS (
    SELECT grp, seq, min(step) AS step, any_value(name) AS name, any_value(op) AS op, count(*) AS n,
           min(a) AS first_arrival_ns, max(a) AS last_arrival_ns, avg(a)::BIGINT AS mean_arrival_ns,
           arg_max(rank, a) AS last_rank, max(e) AS last_end_ns
    FROM c GROUP BY grp, seq
)
SELECT g.*, coalesce(k.kind, 'other') AS group_kind,
       g.last_arrival_ns - g.first_arrival_ns AS spread_ns,
       greatest(g.last_end_ns - g.last_arrival_ns, 0) AS xfer_ns
FROM g LEFT JOIN ms_cache.group_kind k ON k."group" = g.grp;

-- @statement rank_step
-- One row per (rank, step): step time and what it was spent on ({{where}}, {{metrics_where}}: the
-- spans' and metrics' steps read, all of them or those a grown run added). Summed from the
-- writers' step_sums where the spans files have them, from the spans where not ({{lvl}},
-- {{spans}}: base._sums_source): the same table either way ({{split_where}}: see sums_split).
-- @column rank, step     the rank and the step
-- @column stage          pipeline stage
-- @column step_ns        the rank's step span (NULL when it wrote none: an unfinished step)
-- @column start_ns       start of the step on the reference clock
-- @column extent_ns      last end minus first start of all its spans in the step
-- @column forward_ns, backward_ns, optimizer_ns, compute_ns  compute kinds, summed
-- @column data_ns, host_ns, other_ns                          data wait, host work, other
-- @column gc_ns          of host_ns, Python garbage collections (the collector's gc.* spans)
-- @column compute_excl_ns  its own compute: top-level forward/backward spans (or all compute
--                        spans), optimizer and other compute, minus the wait of collectives that
--                        run inside compute spans (e.g. TP collectives inside "forward")
-- @column comm_ns        summed communication spans. Where the collector timed a group's calls
--                        in some micro-batches only (metric collector_calls:<group>), that
--                        group's time and wait count the untimed calls at the timed ones' mean
-- @column coll_ns, recv_ns, send_ns  of which collectives, pipeline receives, pipeline sends
-- @column wait_ns        time it waited for others (at most the step): in each collective, the last member's arrival
--                        minus its own (summed per group through the instances, no join back
--                        to the spans; at most the extent of that group's spans in the step,
--                        or, for gradient reductions the backward hid, their part after its end;
--                        the whole duration where it missed instances), plus recv_ns
--                        (blocked on the previous/next stage)
-- @column xfer_ns        coll_ns minus its collective wait: the transfers themselves
-- @column p2p_wait_ns    recv_ns: the pipeline bubble (a receive's own transfer is small)
-- @column own_ns         step time (or extent) minus wait_ns, never negative: what is left is the rank's own
--                        doing. Built on arrivals, not on span durations, so it holds when spans
--                        nest (layers inside forward, collectives inside layers) and when
--                        asynchronous collectives overlap compute and each other; a posted send
--                        is not subtracted (the sender goes on computing)
-- @column coll_count     collective instances it took part in (with >= 2 members recorded)
-- @column coll_tp, coll_dp, coll_pp, coll_other  collectives by group kind (other: every kind but tp, dp and pp)
-- @column last_tp, last_dp, last_pp, last_other  of which it arrived last
-- @column last_count     their sum
-- @column last_expected, last_var, last_peer  in groups of peers ({{peer_kinds}}: same stage),
--                        last arrivals expected by chance (sum of 1/n), their variance, and seen
CREATE OR REPLACE TABLE ms_cache.rank_step AS
WITH spans_lvl AS (
    -- One scan of the spans ({{spans}}: all of them, or those of the files without sums),
    -- grouped by (rank, step, collective group): a group's collectives are summed apart so that
    -- their wait can be bounded by their extent (below). The writers' step_sums hold exactly these
    -- columns, per spans file (megascope.stepsums).
    SELECT s.rank, s.step, CASE WHEN s.kind = 'collective' THEN s."group" END AS grp,
           max(s.dur_ns) FILTER (WHERE s.kind = 'step') AS step_ns,
           min(s.start_ns) FILTER (WHERE s.kind = 'step') AS step_start_raw,
           min(s.start_ns) AS first_raw, max(s.start_ns + s.dur_ns) AS last_raw,
           sum(s.dur_ns) FILTER (WHERE s.kind = 'forward') AS forward_ns,
           sum(s.dur_ns) FILTER (WHERE s.kind = 'backward') AS backward_ns,
           sum(s.dur_ns) FILTER (WHERE s.kind = 'optimizer') AS optimizer_ns,
           sum(s.dur_ns) FILTER (WHERE s.kind = 'compute') AS compute_ns,
           -- Top-level compute: spans named after their kind ("forward", "backward"); module
           -- spans ("layers.3") nest inside them and would count the same time twice.
           sum(s.dur_ns) FILTER (WHERE s.kind IN ('forward', 'backward') AND s.name IN ('forward', 'backward')) AS top_compute_ns,
           sum(s.dur_ns) FILTER (WHERE s.kind = 'data') AS data_ns,
           sum(s.dur_ns) FILTER (WHERE s.kind = 'host') AS host_ns,
           sum(s.dur_ns) FILTER (WHERE s.kind = 'host' AND starts_with(s.name, 'gc.')) AS gc_ns,
           sum(s.dur_ns) FILTER (WHERE s.kind = 'other') AS other_ns,
           sum(s.dur_ns) FILTER (WHERE s.kind = 'collective') AS coll_ns,
           sum(s.dur_ns) FILTER (WHERE s.kind = 'recv') AS recv_ns,
           sum(s.dur_ns) FILTER (WHERE s.kind = 'send') AS send_ns,
           -- Raw arrivals summed: with the instances' last arrivals this gives the wait (below).
           sum(s.start_ns) FILTER (WHERE s.kind = 'collective') AS arrival_sum,
           count(*) FILTER (WHERE s.kind = 'collective') AS coll_spans,
           -- What tells a group of gradient reductions whose waits the backward hid (waited, below).
           count(*) FILTER (WHERE s.kind = 'collective' AND s.op IN ('all_reduce', 'reduce_scatter')) AS reduce_spans,
           -- Waits for gradient reductions issued on the caller's stream alone: FSDP2's all-gathers
           -- have waits of their own on GPU, and so have its reduce-scatters, issued on a stream
           -- of their own beside the backward, where the next group waits for them (hidden, below).
           count(*) FILTER (WHERE s.kind = 'other' AND ends_with(s.name, ':wait')
                            AND s.op IN ('all_reduce', 'reduce_scatter')
                            AND NOT starts_with(s.stream, 'cuda:')) AS wait_spans,
           min(s.start_ns) FILTER (WHERE s.kind = 'backward' AND s.name = 'backward') AS bwd_start_raw,
           max(s.start_ns + s.dur_ns) FILTER (WHERE s.kind = 'backward' AND s.name = 'backward') AS bwd_end_raw,
           count(*) FILTER (WHERE s.kind = 'collective' AND s.op IN ('all_reduce', 'reduce_scatter')
                            AND starts_with(s.stream, 'cuda:')) AS reduce_side_spans,
           sum(s.start_ns) FILTER (WHERE s.kind = 'collective' AND s.op IN ('all_reduce', 'reduce_scatter')) AS red_arrival_sum,
           min(s.start_ns) FILTER (WHERE s.kind = 'collective' AND s.op IN ('all_reduce', 'reduce_scatter')) AS red_first_raw,
           max(s.start_ns + s.dur_ns) FILTER (WHERE s.kind = 'collective' AND s.op IN ('all_reduce', 'reduce_scatter')) AS red_last_raw
    FROM {{spans}} s
    WHERE s.step IS NOT NULL AND {{where}}
    GROUP BY s.rank, s.step, grp
), sums AS NOT MATERIALIZED (
    -- Read where it is used (three times), not materialized: DuckDB keeps a materialized CTE as
    -- one chunk per file read, and the twins of a run's parts hold a few rows each (90 MB of
    -- COLUMN_DATA for the 20,480 rows of a 256-rank run's 256 twins, for a 5,120-row result).
    SELECT * FROM step_sums s WHERE {{where}}
), sums_split AS (
    -- (rank, step, group)s with rows in more than one file (a step that crossed a flush, or
    -- compacted files): only these are aggregated, the others (most) taken as they are. Looked
    -- for among the rows {{split_where}} (base._split_filter: the ranks of files whose rank and
    -- step ranges overlap, where the files' footers tell; else every row).
    SELECT rank, step, "group" FROM sums s WHERE {{split_where}} GROUP BY ALL HAVING count(*) > 1
), sums_lvl AS (
    -- The same from the sums the writers kept beside their spans files (view step_sums), one row
    -- or more per (rank, step, group): sums and counts add up, extremes combine. Arrivals are
    -- kept relative to the row's first start (their raw sum needs more than 64 bits). Typed as
    -- spans_lvl's sums (HUGEINT), so that the table is the same either way. {{sums_hidden}} and
    -- {{sums_hidden_combined}}: the columns of the hidden reductions (base._sums_hidden), nulls
    -- where the twins come from a writer that had none.
    SELECT s.rank, s.step, s."group" AS grp, s.step_ns, s.step_start_ns AS step_start_raw,
           s.first_start_ns AS first_raw, s.last_end_ns AS last_raw,
           s.forward_ns::HUGEINT AS forward_ns, s.backward_ns::HUGEINT AS backward_ns,
           s.optimizer_ns::HUGEINT AS optimizer_ns, s.compute_ns::HUGEINT AS compute_ns,
           s.top_compute_ns::HUGEINT AS top_compute_ns, s.data_ns::HUGEINT AS data_ns, s.host_ns::HUGEINT AS host_ns,
           s.gc_ns::HUGEINT AS gc_ns, s.other_ns::HUGEINT AS other_ns, s.coll_ns::HUGEINT AS coll_ns,
           s.recv_ns::HUGEINT AS recv_ns, s.send_ns::HUGEINT AS send_ns,
           s.arrival_rel_ns::HUGEINT + s.coll_spans::HUGEINT * s.first_start_ns AS arrival_sum, s.coll_spans,
           {{sums_hidden}}
    FROM sums s ANTI JOIN sums_split d
      ON s.rank = d.rank AND s.step = d.step AND s."group" IS NOT DISTINCT FROM d."group"
    UNION ALL
    SELECT s.rank, s.step, s."group" AS grp, max(s.step_ns) AS step_ns, min(s.step_start_ns) AS step_start_raw,
           min(s.first_start_ns) AS first_raw, max(s.last_end_ns) AS last_raw,
           sum(s.forward_ns) AS forward_ns, sum(s.backward_ns) AS backward_ns, sum(s.optimizer_ns) AS optimizer_ns,
           sum(s.compute_ns) AS compute_ns, sum(s.top_compute_ns) AS top_compute_ns, sum(s.data_ns) AS data_ns,
           sum(s.host_ns) AS host_ns, sum(s.gc_ns) AS gc_ns, sum(s.other_ns) AS other_ns, sum(s.coll_ns) AS coll_ns,
           sum(s.recv_ns) AS recv_ns, sum(s.send_ns) AS send_ns,
           sum(s.arrival_rel_ns::HUGEINT + s.coll_spans::HUGEINT * s.first_start_ns) AS arrival_sum,
           sum(s.coll_spans)::BIGINT AS coll_spans,
           {{sums_hidden_combined}}
    FROM sums s SEMI JOIN sums_split d
      ON s.rank = d.rank AND s.step = d.step AND s."group" IS NOT DISTINCT FROM d."group"
    GROUP BY s.rank, s.step, s."group"
), both_lvl AS (
    -- Some spans files with sums, some without: the two combined as sums_lvl combines sums.
    SELECT rank, step, grp, max(step_ns) AS step_ns, min(step_start_raw) AS step_start_raw,
           min(first_raw) AS first_raw, max(last_raw) AS last_raw,
           sum(forward_ns) AS forward_ns, sum(backward_ns) AS backward_ns, sum(optimizer_ns) AS optimizer_ns,
           sum(compute_ns) AS compute_ns, sum(top_compute_ns) AS top_compute_ns, sum(data_ns) AS data_ns,
           sum(host_ns) AS host_ns, sum(gc_ns) AS gc_ns, sum(other_ns) AS other_ns, sum(coll_ns) AS coll_ns,
           sum(recv_ns) AS recv_ns, sum(send_ns) AS send_ns, sum(arrival_sum) AS arrival_sum,
           sum(coll_spans)::BIGINT AS coll_spans,
           sum(reduce_spans)::BIGINT AS reduce_spans, sum(wait_spans)::BIGINT AS wait_spans,
           min(bwd_start_raw) AS bwd_start_raw, max(bwd_end_raw) AS bwd_end_raw,
           sum(reduce_side_spans)::BIGINT AS reduce_side_spans, sum(red_arrival_sum) AS red_arrival_sum,
           min(red_first_raw) AS red_first_raw, max(red_last_raw) AS red_last_raw
    FROM (SELECT * FROM spans_lvl UNION ALL BY NAME SELECT * FROM sums_lvl)
    GROUP BY rank, step, grp
), lvl AS (
    -- {{lvl}}: spans_lvl (no sums), sums_lvl (every spans file has them) or both_lvl.
    SELECT * FROM {{lvl}}
), per_group AS (
    SELECT grp, step, any_value(group_kind) AS group_kind, count(*) FILTER (WHERE n >= 2) AS instances,
           count(*) AS all_instances, sum(last_arrival_ns) AS last_arrival_sum,
           count(*) FILTER (WHERE op IN ('all_reduce', 'reduce_scatter')) AS red_instances,
           sum(last_arrival_ns) FILTER (WHERE op IN ('all_reduce', 'reduce_scatter')) AS red_last_arrival_sum,
           sum(1.0 / n) FILTER (WHERE n >= 2) AS last_expected, sum((1.0 / n) * (1 - 1.0 / n)) FILTER (WHERE n >= 2) AS last_var
    FROM ms_cache.inst GROUP BY grp, step
), lasts AS (
    SELECT last_rank AS rank, step,
           count(*) FILTER (WHERE group_kind = 'tp') AS last_tp,
           count(*) FILTER (WHERE group_kind = 'dp') AS last_dp,
           count(*) FILTER (WHERE group_kind = 'pp') AS last_pp,
           count(*) FILTER (WHERE group_kind NOT IN ('tp', 'dp', 'pp')) AS last_other
    FROM ms_cache.inst WHERE n >= 2 GROUP BY last_rank, step
), sampled AS (
    -- Groups whose calls the collector timed in some micro-batches only: the calls issued per
    -- rank-step (metric collector_calls:<group>). The timed calls' wait and time stand for all.
    -- Where it timed the group's step-level calls one in N (metric collector_step_calls:<group>,
    -- step_calls), those calls overlap (a gradient sync's buckets): their wait is scaled, but not
    -- the extent that bounds it.
    SELECT rank, step, grp, max(value) FILTER (WHERE NOT step_level) AS calls,
           max(value) FILTER (WHERE step_level) AS step_calls
    FROM (SELECT rank, step, value, starts_with(name, '{{step_calls_prefix}}') AS step_level,
                 CASE WHEN starts_with(name, '{{step_calls_prefix}}') THEN substr(name, {{step_calls_prefix_len}} + 1)
                      ELSE substr(name, {{calls_prefix_len}} + 1) END AS grp
          FROM metrics
          WHERE (starts_with(name, '{{calls_prefix}}') OR starts_with(name, '{{step_calls_prefix}}'))
            AND step IS NOT NULL AND {{metrics_where}})
    GROUP BY ALL
), lvl_s AS (
    SELECT l.*, CASE WHEN sm.calls > l.coll_spans AND l.coll_spans > 0 THEN sm.calls / l.coll_spans ELSE 1.0 END AS scale,
           coalesce(sm.step_calls > 0, false) AS calls_sampled
    FROM lvl l LEFT JOIN sampled sm ON sm.rank = l.rank AND sm.step = l.step AND sm.grp = l.grp
), lvl_b AS (
    -- Where the scale applies to the wait: before its bound (step-level calls timed one in N),
    -- or after it (whole micro-batches left untimed).
    -- A group's gradient reductions (all-reduce, reduce-scatter) are candidates for the hidden
    -- waits of j (below) where they are all its calls (DDP's buckets) or were all issued on a
    -- stream of their own (FSDP's reduce-scatters beside its all-gathers, on GPU), in a
    -- data-parallel group whose every instance the rank took part in (waited).
    SELECT *, CASE WHEN calls_sampled THEN scale ELSE 1.0 END AS wait_scale,
           CASE WHEN calls_sampled THEN 1.0 ELSE scale END AS bound_scale,
           coalesce(grp IS NOT NULL AND reduce_spans > 0
                    AND (reduce_spans = coll_spans OR reduce_side_spans = reduce_spans), false) AS reductions
    FROM lvl_s
), lvl_p AS (
    -- Each group-step with its instances (per_group) and the rank's clock. Its reductions are
    -- read as such (the hidden waits of j) where they are candidates (lvl_b) in a data-parallel
    -- group ({{dp_kinds}}: `dp`, and a Kineto trace's `world` where the job has no other kind of
    -- group) whose every instance, and every reduction's, the rank took part in: only there do the
    -- rank's sums and the instances' cover the same calls. Elsewhere (a rank that died
    -- mid-backward, its partner's buckets without it) their difference counts whole arrival
    -- times, and overflowed.
    SELECT l.* REPLACE (l.reductions AND coalesce(list_contains({{dp_kinds}}, p.group_kind) AND p.all_instances = l.coll_spans
                                                  AND p.red_instances = l.reduce_spans, false) AS reductions),
           coalesce(k.offset_ns, 0) AS offset_ns, coalesce(k.stage, 0) AS stage, p.group_kind, p.instances,
           p.all_instances, p.last_arrival_sum, p.red_last_arrival_sum,
           p.last_expected AS group_last_expected, p.last_var AS group_last_var
    FROM lvl_b l
    LEFT JOIN ms_cache.rank_clock k USING (rank)
    LEFT JOIN per_group p ON p.grp = l.grp AND p.step = l.step
), waited AS (
    SELECT l.* EXCLUDE (all_instances, last_arrival_sum, red_last_arrival_sum, group_last_expected, group_last_var)
               REPLACE ((l.coll_ns * l.scale)::BIGINT AS coll_ns),
           CASE WHEN l.all_instances = l.coll_spans THEN l.group_last_expected END AS last_expected,
           CASE WHEN l.all_instances = l.coll_spans THEN l.group_last_var END AS last_var,
           -- Wait in a group's collectives: the sum over its instances of (last arrival - own
           -- arrival), no join back to the spans needed. Bounded by the extent of those spans:
           -- asynchronous buckets overlap each other and must not count their wait twice.
           -- Unknown membership (it missed instances of the group): the whole duration.
           -- Calls left untimed (sampled): counted at the timed ones' mean (scale); the bound
           -- scaled with them where whole micro-batches were left untimed, not where one
           -- step-level call in N was timed (calls_sampled: the timed ones span the whole sync).
           (CASE WHEN l.grp IS NULL THEN 0
                 WHEN l.all_instances = l.coll_spans
                 THEN least((l.last_arrival_sum - l.arrival_sum - l.coll_spans * l.offset_ns) * l.wait_scale,
                            l.last_raw - l.first_raw) * l.bound_scale
                 ELSE l.coll_ns * l.scale END)::BIGINT AS coll_wait,
           -- Of a group's wait, its reductions' part (bounded in j) and the rest's (by the extent),
           -- where the reductions are read as such (lvl_p).
           CASE WHEN l.reductions
                THEN ((l.red_last_arrival_sum - l.red_arrival_sum - l.reduce_spans * l.offset_ns)
                      * l.wait_scale * l.bound_scale)::BIGINT END AS red_wait,
           CASE WHEN l.reductions
                THEN (least((l.last_arrival_sum - l.arrival_sum - (l.red_last_arrival_sum - l.red_arrival_sum)
                             - (l.coll_spans - l.reduce_spans) * l.offset_ns) * l.wait_scale,
                            l.last_raw - l.first_raw) * l.bound_scale)::BIGINT END AS rest_wait
    FROM lvl_p l
), j AS (
    SELECT rank, step, any_value(stage) AS stage, any_value(offset_ns) AS offset_ns,
           max(step_ns) AS step_ns, min(step_start_raw) AS step_start_raw,
           min(first_raw) AS first_raw, max(last_raw) AS last_raw,
           sum(forward_ns) AS forward_ns, sum(backward_ns) AS backward_ns, sum(optimizer_ns) AS optimizer_ns,
           sum(compute_ns) AS compute_ns, sum(data_ns) AS data_ns, sum(host_ns) AS host_ns, sum(gc_ns) AS gc_ns,
           sum(other_ns) AS other_ns, sum(top_compute_ns) AS top_compute_ns,
           coalesce(sum(coll_wait) FILTER (WHERE list_contains({{nested_kinds}}, group_kind) AND NOT reductions), 0)
               AS nested_other,
           sum(coll_wait) FILTER (WHERE list_contains({{nested_kinds}}, group_kind) AND reductions) AS nested_old,
           sum(rest_wait) FILTER (WHERE list_contains({{nested_kinds}}, group_kind) AND reductions) AS nested_rest,
           sum(red_wait) FILTER (WHERE list_contains({{nested_kinds}}, group_kind) AND reductions) AS nested_red,
           coalesce(sum(coll_ns), 0) AS coll_ns, coalesce(sum(recv_ns), 0) AS recv_ns,
           coalesce(sum(send_ns), 0) AS send_ns, coalesce(sum(coll_wait) FILTER (WHERE NOT reductions), 0) AS wait_other,
           sum(coll_wait) FILTER (WHERE reductions) AS wait_old, sum(rest_wait) FILTER (WHERE reductions) AS wait_rest,
           sum(red_wait) FILTER (WHERE reductions) AS wait_red,
           min(red_first_raw) FILTER (WHERE reductions) AS red_first, max(red_last_raw) FILTER (WHERE reductions) AS red_last,
           sum(wait_spans) AS wait_spans, min(bwd_start_raw) AS bwd_start_raw, max(bwd_end_raw) AS bwd_end_raw,
           -- Chance of being last, counted where members are each other's peers (same stage).
           coalesce(sum(last_expected) FILTER (WHERE list_contains({{peer_kinds}}, CASE WHEN group_kind IN ('tp', 'dp', 'pp') THEN group_kind ELSE 'other' END)), 0) AS last_expected,
           coalesce(sum(last_var) FILTER (WHERE list_contains({{peer_kinds}}, CASE WHEN group_kind IN ('tp', 'dp', 'pp') THEN group_kind ELSE 'other' END)), 0) AS last_var,
           coalesce(sum(instances) FILTER (WHERE group_kind = 'tp'), 0) AS coll_tp,
           coalesce(sum(instances) FILTER (WHERE group_kind = 'dp'), 0) AS coll_dp,
           coalesce(sum(instances) FILTER (WHERE group_kind = 'pp'), 0) AS coll_pp,
           coalesce(sum(instances) FILTER (WHERE group_kind NOT IN ('tp', 'dp', 'pp')), 0) AS coll_other
    FROM waited GROUP BY rank, step
), kbwd AS (
    -- The backward of a Kineto trace's GPU rank is its kernels alone (no span of its own): its
    -- window runs from its first kernel to the end of the last computing one (not a copy nor a
    -- memset) that ended by the reductions' last end. The reducer's copies of each bucket, after
    -- its reduction, and what ran once its wait for them let the stream go on come later: on a
    -- 2x H200 DDP job beside a peer paused 60 ms, the backward's last kernel ended at 25 ms into
    -- the step, the bucket copies at 67.7-77.9 ms, its last reduction at 77.9 ms.
    -- ({{kernel_backward}}: false elsewhere, where nothing is read here.)
    SELECT s.rank, s.step, min(s.start_ns) AS bwd_start_raw, max(s.start_ns + s.dur_ns) AS bwd_end_raw
    FROM {{spans}} s JOIN j ON j.rank = s.rank AND j.step = s.step
    WHERE {{kernel_backward}} AND s.kind = 'backward' AND starts_with(s.stream, 'cuda:')
      AND NOT (starts_with(s.name, 'Memcpy') OR starts_with(s.name, 'Memset'))
      AND j.bwd_end_raw IS NULL AND j.red_last IS NOT NULL AND s.start_ns + s.dur_ns <= j.red_last
    GROUP BY ALL
), hidden AS (
    -- Gradient reductions that begin inside the rank's backward, in a rank-step with no wait span
    -- for a reduction on the caller's stream (no Python wait marks them: DistributedDataParallel's
    -- buckets, which its reducer waits for in C++ as the backward ends; FSDP2's reduce-scatters on
    -- a stream of their own, whose waits the next group's post_backward and the backward's end
    -- hold): the rank's backward went on while they waited, and only their
    -- part after its end held the rank, their wait bounded by it. Bounded by their extent alone,
    -- a fast rank's waits for a slow one's buckets came off its own time, and on 2x H200 DDP jobs
    -- a GPU 1.15x slow read 1.57x its peer.
    SELECT *, CASE WHEN wait_spans = 0 AND red_first > bwd_start_raw AND red_first < bwd_end_raw
                   THEN greatest(red_last - bwd_end_raw, 0) END AS hidden_bound
    FROM (SELECT j.* REPLACE (coalesce(j.bwd_start_raw, k.bwd_start_raw) AS bwd_start_raw,
                              coalesce(j.bwd_end_raw, k.bwd_end_raw) AS bwd_end_raw)
          FROM j LEFT JOIN kbwd k ON k.rank = j.rank AND k.step = j.step)
), jw AS (
    -- Where the reductions' waits were not hidden, the group's wait as it was always read.
    SELECT * EXCLUDE (nested_other, nested_old, nested_rest, nested_red, wait_other, wait_old, wait_rest,
                      wait_red, red_first, red_last, wait_spans, bwd_start_raw, bwd_end_raw, hidden_bound),
           nested_other + CASE WHEN hidden_bound IS NOT NULL
                               THEN coalesce(nested_rest, 0) + coalesce(least(nested_red, hidden_bound), 0)
                               ELSE coalesce(nested_old, 0) END AS nested_wait,
           wait_other + CASE WHEN hidden_bound IS NOT NULL
                             THEN coalesce(wait_rest, 0) + coalesce(least(wait_red, hidden_bound), 0)
                             ELSE coalesce(wait_old, 0) END AS coll_wait
    FROM hidden
), jk AS (
    -- A rank traced kernel by kernel ({{kernel_backward}}) waited in its collectives at most as
    -- long as its device ran none of its own kernels in the step: the waits of calls on a stream
    -- of their own that its kernels ran beside (FSDP's gathers, prefetched a layer ahead) were no
    -- stall. On 2x H200 FSDP2 jobs under the profiler, a healthy rank read 3.6 ms of waits where
    -- its device sat idle 2.4 ms of the step.
    SELECT * REPLACE (CASE WHEN {{kernel_backward}}
                           THEN least(coll_wait, greatest(coalesce(step_ns, last_raw - first_raw)
                                                          - coalesce(forward_ns, 0) - coalesce(backward_ns, 0)
                                                          - coalesce(optimizer_ns, 0) - coalesce(compute_ns, 0), 0))
                           ELSE coll_wait END AS coll_wait)
    FROM jw
)
SELECT j.rank, j.step, j.stage, j.step_ns,
       coalesce(j.step_start_raw, j.first_raw) + j.offset_ns AS start_ns,
       j.last_raw - j.first_raw AS extent_ns,
       coalesce(j.forward_ns, 0) AS forward_ns, coalesce(j.backward_ns, 0) AS backward_ns,
       coalesce(j.optimizer_ns, 0) AS optimizer_ns, coalesce(j.compute_ns, 0) AS compute_ns,
       coalesce(j.data_ns, 0) AS data_ns, coalesce(j.host_ns, 0) AS host_ns, coalesce(j.gc_ns, 0) AS gc_ns,
       coalesce(j.other_ns, 0) AS other_ns,
       -- Compute of the rank itself: top-level forward/backward (all compute spans where there
       -- are none), minus the wait of collectives issued inside them ({{nested_kinds}}).
       coalesce(j.top_compute_ns, coalesce(j.forward_ns, 0) + coalesce(j.backward_ns, 0))
           + coalesce(j.compute_ns, 0) + coalesce(j.optimizer_ns, 0) - j.nested_wait AS compute_excl_ns,
       j.coll_ns + j.recv_ns + j.send_ns AS comm_ns, j.coll_ns, j.recv_ns, j.send_ns,
       greatest(j.coll_ns - j.coll_wait, 0) AS xfer_ns,
       -- Waits of overlapping calls (asynchronous buckets beside a pipeline receive) can add up
       -- to more than the step: capped at the step, so own time is never negative.
       least(j.coll_wait + j.recv_ns, coalesce(j.step_ns, j.last_raw - j.first_raw)) AS wait_ns,
       j.recv_ns AS p2p_wait_ns,
       greatest(coalesce(j.step_ns, j.last_raw - j.first_raw) - j.coll_wait - j.recv_ns, 0) AS own_ns,
       j.coll_tp + j.coll_dp + j.coll_pp + j.coll_other AS coll_count,
       j.last_expected, j.last_var,
       coalesce(CASE WHEN list_contains({{peer_kinds}}, 'tp') THEN l.last_tp ELSE 0 END
                + CASE WHEN list_contains({{peer_kinds}}, 'dp') THEN l.last_dp ELSE 0 END
                + CASE WHEN list_contains({{peer_kinds}}, 'pp') THEN l.last_pp ELSE 0 END
                + CASE WHEN list_contains({{peer_kinds}}, 'other') THEN l.last_other ELSE 0 END, 0) AS last_peer,
       j.coll_tp, j.coll_dp, j.coll_pp, j.coll_other,
       coalesce(l.last_tp + l.last_dp + l.last_pp + l.last_other, 0) AS last_count,
       coalesce(l.last_tp, 0) AS last_tp, coalesce(l.last_dp, 0) AS last_dp,
       coalesce(l.last_pp, 0) AS last_pp, coalesce(l.last_other, 0) AS last_other
FROM jk j LEFT JOIN lasts l ON l.rank = j.rank AND l.step = j.step;

-- @statement nested_kinds
-- Group kinds whose collectives start inside the rank's compute spans, probed on one rank's
-- partition ({{rank}}) in steps {{steps}}: their wait is inside the compute spans' durations.
-- @column group_kind     tp | dp | pp | cp | ep | world | other
WITH s AS (SELECT * FROM spans WHERE rank = {{rank}} AND list_contains({{steps}}, step)),
c AS (SELECT step, start_ns AS s, start_ns + dur_ns AS e FROM s WHERE kind IN ('forward', 'backward', 'compute')),
k AS (
    SELECT row_number() OVER () AS id, s.step, s.start_ns, coalesce(gk.kind, 'other') AS group_kind
    FROM s LEFT JOIN ms_cache.group_kind gk ON gk."group" = s."group"
    WHERE s.kind = 'collective' AND s."group" IS NOT NULL
), inside AS (
    SELECT DISTINCT k.id FROM k JOIN c ON k.step = c.step AND k.start_ns > c.s AND k.start_ns < c.e
)
SELECT group_kind FROM k LEFT JOIN inside i USING (id)
GROUP BY group_kind HAVING count(i.id) >= 0.5 * count(*);

-- @statement kernel_backward
-- Whether the run's backward is its kernels alone, probed on one rank's partition ({{rank}}) in
-- steps {{steps}}: spans of kind backward on a device stream and no backward span of its own (a
-- Kineto trace of GPU ranks; the collector writes one).
-- @column kernels  true where so
SELECT coalesce(bool_or(kind = 'backward' AND starts_with(stream, 'cuda:'))
                AND NOT bool_or(kind = 'backward' AND name = 'backward'), false) AS kernels
FROM spans WHERE rank = {{rank}} AND list_contains({{steps}}, step);

-- @statement world_only
-- Whether the run's collectives are in groups of no kind but `world` (a Kineto trace of a
-- data-parallel job names its one process group so).
-- @column world_only  true where so
SELECT coalesce(bool_and(kind = 'world'), false) AS world_only FROM ms_cache.group_kind;

-- @statement has_step_spans
-- Whether any rank-step has a step span: the analyses take step times from step spans when there
-- are any, else from the spans' extent.
-- @column rank_steps  rank-steps with a step span
SELECT count(*) AS rank_steps FROM ms_cache.rank_step WHERE step_ns IS NOT NULL;

-- Extending the base tables of a run that grew (base._extend): the cached tables are loaded as
-- ms_cache.old_*, the new ones built from the first new step on, and the two joined where nothing
-- crosses that edge.

-- @statement keep_clock_offsets
-- The cached hosts' clock offsets, kept where the new parts hold none of the sampled steps.
-- @column host, offset_ns, error_ns, samples  as in clock_offsets
CREATE OR REPLACE TABLE ms_cache.clock_offsets AS SELECT * FROM ms_cache.old_clock_offsets;

-- @statement keep_rank_clock
-- The cached ranks' clock offsets, kept with keep_clock_offsets.
-- @column rank, host, stage, offset_ns, host_offset_ns  as in rank_clock
CREATE OR REPLACE TABLE ms_cache.rank_clock AS SELECT * FROM ms_cache.old_rank_clock;

-- @statement moved_clocks
-- Ranks whose clock offset differs between the cached and the new estimate.
-- @column ranks  ranks whose offset moved (0: the cached tables may be kept)
SELECT count(*) AS ranks FROM ms_cache.rank_clock n FULL JOIN ms_cache.old_rank_clock o USING (rank)
WHERE n.offset_ns IS DISTINCT FROM o.offset_ns;

-- @statement calls_across_edge
-- Calls of the new steps' instances that the cached tables already hold before step {{first}}.
-- @column calls  such instances (0: the edge cuts no call)
SELECT count(*) AS calls FROM ms_cache.inst n JOIN ms_cache.old_inst o USING (grp, seq)
WHERE o.step IS NULL OR o.step < {{first}};

-- @statement extend_inst
-- The cached instances before step {{first}} followed by the new ones.
-- @column grp, seq, step, *  every column of inst, as there
CREATE OR REPLACE TABLE ms_cache.inst AS
SELECT * FROM ms_cache.old_inst WHERE step IS NULL OR step < {{first}}
UNION ALL SELECT * FROM ms_cache.inst;

-- @statement extend_rank_step
-- The cached rank-steps before step {{first}} followed by the new ones.
-- @column rank, step, *  every column of rank_step, as there
CREATE OR REPLACE TABLE ms_cache.rank_step AS
SELECT * FROM ms_cache.old_rank_step WHERE step < {{first}}
UNION ALL SELECT * FROM ms_cache.rank_step;
