-- Stragglers: ranks whose own time (step time minus communication) is longer than that of their
-- peers (same pipeline stage, same step), step after step, and what their extra time went to.
--
-- In a synchronous job every rank's step time is equal: a slow rank makes its peers wait inside
-- collectives and pipeline receives. Subtracting communication time removes that wait, so the
-- straggler stands out in own time while its victims do not.
--
-- Baselines are leave-one-out where peers are few: with two peers the other one, with three the
-- mean of the other two, from four on the median (one slow rank barely moves it).

-- @statement macros
-- loo(n, sum, x, median): the peer baseline of value x in a peer set of n values summing to sum.
CREATE OR REPLACE MACRO ms_cache.loo(n, s, x, med) AS
    CASE WHEN n = 2 THEN s - x WHEN n = 3 THEN (s - x) / 2.0 ELSE med END;

-- @statement peer_step
-- One row per (rank, step) with peer baselines.
-- @column rank, step, stage  the rank-step and its pipeline stage
-- @column own_ns, step_ns, xfer_ns, wait_ns  as in rank_step
-- @column coll_count, coll_tp, coll_dp, coll_pp, coll_other  as in rank_step
-- @column last_count, last_expected, last_var, last_peer  as in rank_step
-- @column last_tp, last_dp, last_pp, last_other  as in rank_step
-- @column z_xfer      robust z-score of the transfer time, as z_own
-- @column n           peers in the (stage, step), the rank included
-- @column base_own_ns peer baseline of own time
-- @column z_own       robust z-score of own time: (own - median) / max(1.4826 MAD, {{rel_floor}} median)
-- @column slowdown    own / baseline own
-- @column ex_*_ns     excess over the peer baseline, per kind of own time (ex_recv_ns: of its
--                     pipeline receive wait)
-- @column xfer_ratio  transfer time / peer baseline transfer time
-- @column ex_spans_ns excess of its compute spans' raw durations (forward, backward, optimizer,
--                     compute; waits inside them not removed): a rank whose own spans stretch
--                     is slow in compute; one late with spans of normal length paused outside them
-- @column blame_ns    the wait it caused: over the collectives of its groups of peers
--                     ({{peer_kinds}}, as rank_step's last arrivals: tp and dp, every group with
--                     one stage) where it arrived last, (last - mean arrival) x members
-- @column d_blame     its blame minus the peer baseline blame, over the baseline own time
CREATE OR REPLACE TABLE ms_cache.peer_step AS
WITH blame AS (
    SELECT last_rank AS rank, step, sum((last_arrival_ns - mean_arrival_ns) * n) AS blame_ns
    FROM ms_cache.inst
    WHERE n >= 2 AND list_contains({{peer_kinds}}, CASE WHEN group_kind IN ('tp', 'dp', 'pp') THEN group_kind ELSE 'other' END)
    GROUP BY ALL
), rs AS (
    SELECT r.*, coalesce(b.blame_ns, 0) AS blame_ns,
           r.forward_ns + r.backward_ns + r.optimizer_ns + r.compute_ns AS spans_ns
    FROM ms_cache.rank_step r LEFT JOIN blame b USING (rank, step)
    WHERE r.step_ns IS NOT NULL OR NOT {{has_step_spans}}
), p AS (
    SELECT stage, step, count(*) AS n,
           median(own_ns) AS med_own, sum(own_ns) AS sum_own,
           median(forward_ns) AS med_fwd, sum(forward_ns) AS sum_fwd,
           median(backward_ns) AS med_bwd, sum(backward_ns) AS sum_bwd,
           median(optimizer_ns) AS med_opt, sum(optimizer_ns) AS sum_opt,
           median(compute_ns) AS med_cmp, sum(compute_ns) AS sum_cmp,
           median(compute_excl_ns) AS med_cx, sum(compute_excl_ns) AS sum_cx,
           median(data_ns) AS med_data, sum(data_ns) AS sum_data,
           median(host_ns) AS med_host, sum(host_ns) AS sum_host,
           median(xfer_ns) AS med_xfer, sum(xfer_ns) AS sum_xfer,
           median(recv_ns) AS med_recv, sum(recv_ns) AS sum_recv,
           median(spans_ns) AS med_spans, sum(spans_ns) AS sum_spans,
           median(blame_ns) AS med_blame, sum(blame_ns) AS sum_blame
    FROM rs GROUP BY stage, step
), m AS (
    SELECT rs.stage, rs.step, median(abs(rs.own_ns - p.med_own)) AS mad_own,
           median(abs(rs.xfer_ns - p.med_xfer)) AS mad_xfer
    FROM rs JOIN p USING (stage, step) GROUP BY rs.stage, rs.step
)
SELECT rs.rank, rs.step, rs.stage, p.n, rs.own_ns, rs.step_ns, rs.xfer_ns, rs.wait_ns,
       ms_cache.loo(p.n, p.sum_own, rs.own_ns, p.med_own) AS base_own_ns,
       (rs.own_ns - p.med_own) / greatest(1.4826 * m.mad_own, {{rel_floor}} * abs(p.med_own), 1) AS z_own,
       rs.own_ns / nullif(ms_cache.loo(p.n, p.sum_own, rs.own_ns, p.med_own), 0) AS slowdown,
       rs.own_ns - ms_cache.loo(p.n, p.sum_own, rs.own_ns, p.med_own) AS ex_own_ns,
       rs.forward_ns - ms_cache.loo(p.n, p.sum_fwd, rs.forward_ns, p.med_fwd) AS ex_forward_ns,
       rs.backward_ns - ms_cache.loo(p.n, p.sum_bwd, rs.backward_ns, p.med_bwd) AS ex_backward_ns,
       rs.optimizer_ns - ms_cache.loo(p.n, p.sum_opt, rs.optimizer_ns, p.med_opt) AS ex_optimizer_ns,
       rs.compute_ns - ms_cache.loo(p.n, p.sum_cmp, rs.compute_ns, p.med_cmp) AS ex_compute_ns,
       rs.compute_excl_ns - ms_cache.loo(p.n, p.sum_cx, rs.compute_excl_ns, p.med_cx) AS ex_compute_excl_ns,
       rs.data_ns - ms_cache.loo(p.n, p.sum_data, rs.data_ns, p.med_data) AS ex_data_ns,
       rs.host_ns - ms_cache.loo(p.n, p.sum_host, rs.host_ns, p.med_host) AS ex_host_ns,
       rs.recv_ns - ms_cache.loo(p.n, p.sum_recv, rs.recv_ns, p.med_recv) AS ex_recv_ns,
       rs.spans_ns - ms_cache.loo(p.n, p.sum_spans, rs.spans_ns, p.med_spans) AS ex_spans_ns,
       rs.blame_ns,
       (rs.blame_ns - ms_cache.loo(p.n, p.sum_blame, rs.blame_ns, p.med_blame))
           / nullif(ms_cache.loo(p.n, p.sum_own, rs.own_ns, p.med_own), 0) AS d_blame,
       (rs.xfer_ns - p.med_xfer) / greatest(1.4826 * m.mad_xfer, {{rel_floor}} * abs(p.med_xfer), 1) AS z_xfer,
       rs.xfer_ns / nullif(ms_cache.loo(p.n, p.sum_xfer, rs.xfer_ns, p.med_xfer), 0) AS xfer_ratio,
       rs.coll_count, rs.last_count, rs.last_expected, rs.last_var, rs.last_peer, rs.coll_tp, rs.coll_dp, rs.coll_pp, rs.coll_other, rs.last_tp, rs.last_dp, rs.last_pp, rs.last_other
FROM rs JOIN p USING (stage, step) JOIN m USING (stage, step);

-- @statement rank_scores
-- One row per rank: how often and how much it was slow against its peers.
-- sigma is the run's noise: how much a rank's log(own / baseline) varies from step to step (robust
-- spread per rank, median over ranks). A persistent straggler is steady, so this does not absorb
-- it even with two peers. On a quiet GPU job it is about 1%; eight ranks sharing two CPU cores
-- reach 30-50%.
-- A step is slow for a rank when own time is at least max({{min_slowdown}}, exp(2 sigma)) x the
-- baseline and, with five or more peers, its robust z-score is at least {{z}}; strictly slow
-- when also above exp({{z}} sigma). A step is comm-slow when own time is not slow but the
-- transfer time is slow by the same rules (a bad link: normal arrival, slow transfers).
-- @column rank, stage   the rank and its pipeline stage
-- @column steps, slow_steps, strict_steps, comm_slow_steps  counted steps
-- @column median_slowdown  median slowdown over all its steps
-- @column median_ex_recv_ns, median_ex_own_ns  median excess of pipeline receive wait and of own
--                       time over the peer baseline, over all its steps
-- @column slowdown      median slowdown over its slow steps
-- @column ex_*_ns       median excess over its steps slower than the baseline
-- @column sigma         the run's noise (of own time)
-- @column bsigma        the same for d_blame: the step-to-step spread of the wait a rank causes
-- @column m_own         median over its steps of ln(own / baseline)
-- @column m_blame       median over its steps of d_blame (the wait it caused beyond its peers')
-- @column median_ex_spans_ns  median excess of its compute spans' raw durations, over all steps
-- @column t_spans       that median over its noise (the median over ranks of their spread)
-- @column blame_ns      mean wait it caused per step
-- @column last_arrival_frac  share of its collectives where it arrived last
-- @column last_z        t-statistic over steps of how far above chance (1 / group size) it
--                       arrived last among its peers (same-stage groups)
-- @column last_tp, last_dp, last_pp, last_other  that share per group kind
-- @column xfer_slowdown  median transfer slowdown over its comm-slow steps
-- @column base_own_ns   median peer baseline of its own time
-- @column max_z         its largest z_own over its steps
CREATE OR REPLACE TABLE ms_cache.rank_scores AS
WITH per_rank AS (
    SELECT rank, 1.4826 * mad(ln(slowdown)) AS s,
           1.4826 * mad(ln(xfer_ratio)) FILTER (WHERE xfer_ratio > 0) AS xs,
           1.4826 * mad(d_blame) AS bs, 1.4826 * mad(ex_spans_ns) AS ss
    FROM ms_cache.peer_step WHERE slowdown > 0 AND n >= 2 GROUP BY rank
), cross_rank AS (
    -- Transfer times are shared by a group's members, so a slow link shows in several ranks at
    -- once: judge them against the spread across ranks as well, the larger of the two.
    SELECT coalesce(1.4826 * median(abs(ln(xfer_ratio))), 0) AS xs
    FROM ms_cache.peer_step WHERE xfer_ratio > 0 AND n >= 2
), noise AS (
    SELECT coalesce(median(s), 0) AS sigma, coalesce(median(bs), 0) AS bsigma, coalesce(median(ss), 0) AS ssigma,
           greatest(coalesce(median(per_rank.xs), 0), any_value(cross_rank.xs)) AS xsigma
    FROM per_rank, cross_rank
), f AS (
    SELECT p.*, noise.sigma, noise.bsigma, noise.ssigma,
           coalesce(slowdown >= greatest({{min_slowdown}}, exp(2 * noise.sigma)) AND (n < 5 OR z_own >= {{z}}), false) AS slow,
           coalesce(slowdown >= greatest({{min_slowdown}}, exp({{z}} * noise.sigma)) AND (n < 5 OR z_own >= {{z}}), false) AS strict,
           coalesce(xfer_ratio >= greatest({{min_slowdown}}, exp({{z}} * noise.xsigma)) AND (n < 5 OR z_xfer >= {{z}}), false) AS xslow
    FROM ms_cache.peer_step p, noise WHERE n >= 2
)
SELECT rank, any_value(stage) AS stage, count(*) AS steps, any_value(sigma) AS sigma,
       any_value(bsigma) AS bsigma,
       median(ln(slowdown)) FILTER (WHERE slowdown > 0) AS m_own,
       median(d_blame) AS m_blame,
       median(ex_spans_ns) AS median_ex_spans_ns,
       -- Its compute spans' excess against their step-to-step noise: a stretch of its own spans
       -- (cause compute) or none (a pause outside them: cause host).
       median(ex_spans_ns) / greatest(1.25 * any_value(ssigma) / sqrt(count(*)), 1000) AS t_spans,
       avg(blame_ns) AS blame_ns,
       count(*) FILTER (WHERE slow) AS slow_steps,
       count(*) FILTER (WHERE strict) AS strict_steps,
       count(*) FILTER (WHERE xslow AND NOT slow) AS comm_slow_steps,
       median(slowdown) AS median_slowdown,
       median(slowdown) FILTER (WHERE slow) AS slowdown,
       median(xfer_ratio) FILTER (WHERE xslow AND NOT slow) AS xfer_slowdown,
       median(ex_own_ns) FILTER (WHERE slowdown > 1) AS ex_own_ns,
       median(ex_forward_ns) FILTER (WHERE slowdown > 1) AS ex_forward_ns,
       median(ex_backward_ns) FILTER (WHERE slowdown > 1) AS ex_backward_ns,
       median(ex_optimizer_ns) FILTER (WHERE slowdown > 1) AS ex_optimizer_ns,
       median(ex_compute_ns) FILTER (WHERE slowdown > 1) AS ex_compute_ns,
       median(ex_compute_excl_ns) FILTER (WHERE slowdown > 1) AS ex_compute_excl_ns,
       median(ex_data_ns) FILTER (WHERE slowdown > 1) AS ex_data_ns,
       median(ex_host_ns) FILTER (WHERE slowdown > 1) AS ex_host_ns,
       median(base_own_ns) AS base_own_ns,
       -- Over all its steps: a pipeline neighbour of a slow stage waits longer in its receives and
       -- then arrives late at its own stage's collectives; that excess is not its own.
       median(ex_recv_ns) AS median_ex_recv_ns, median(ex_own_ns) AS median_ex_own_ns,
       sum(last_count) / nullif(sum(coll_count), 0) AS last_arrival_frac,
       -- Arrival orders within a step are correlated (one delay makes a rank last at many
       -- collectives), so the test is over steps: a t-statistic of the per-step excess.
       avg((last_peer - last_expected) / nullif(sqrt(last_var), 0))
           / greatest(stddev_samp((last_peer - last_expected) / nullif(sqrt(last_var), 0)), 0.25)
           * sqrt(count(last_var) FILTER (WHERE last_var > 0)) AS last_z,
       sum(last_tp) / nullif(sum(coll_tp), 0) AS last_tp, sum(last_dp) / nullif(sum(coll_dp), 0) AS last_dp,
       sum(last_pp) / nullif(sum(coll_pp), 0) AS last_pp, sum(last_other) / nullif(sum(coll_other), 0) AS last_other,
       max(z_own) AS max_z
FROM f GROUP BY rank;

-- @statement drop_peer_step
-- peer_step is read by rank_scores alone: dropped once that is built, so that it does not stay in
-- memory for the rest of the analysis (a row per rank-step, 38 columns).
DROP TABLE IF EXISTS ms_cache.peer_step;

-- @statement candidates
-- Stragglers and comm-slow ranks, with place, host and the evidence that names them.
--
-- Four pieces of evidence, each a z-like score of a median over the rank's steps against the
-- step-to-step noise of such a median (1.25 x spread / sqrt(steps)). The spread is measured on
-- the run's healthy peer-steps: the median over ranks of each rank's own spread, which a
-- straggler and the few victims it makes do not move while they are under half the ranks.
-- (The spread of the ranks' medians is not used: a fault widens it through its victims, and a
-- clearly slow rank was held to a bar its own fault had raised.)
--   * t_own: its own time over its peers' (ln(own / baseline));
--   * t_blame: the wait it caused its same-stage peers beyond the wait they caused;
--   * last_z: how far above chance it was the last to arrive, a t-statistic over steps;
--   * t_spans: how far its own compute spans (raw) are longer than its peers'.
-- z = their sum over sqrt(count), each clipped to [-3, 6] so that no one piece decides alone
-- against the others (a rank can arrive last at every collective by the pipeline's timing);
-- t_spans to [0, 6]: compute spans shorter than the peers' are no sign of innocence. A rank that
-- pauses outside its spans makes its TP peers' spans hold the wait, and on shared CPU cores it
-- computes faster while they wait (real 50-100 ms skews read t_spans -3 and went unnamed).
-- A straggler: z >= {{z_comb}}, own time over all steps at least {{min_slowdown}} x its peers' and t_own >= 1,
-- and not a shadow of a worse one: its z at least {{shadow}} x the largest z named, and its t_own
-- at least {{own_shadow}} x the largest t_own named (a fault makes
-- its peers' times move too, its TP partner's spans hold the waits for it, its pipeline
-- neighbours run late: a rank with clearly less evidence shows the fault's wake; a TP partner of
-- a straggler reads high on the waits its spans hold and on the blame its whole group takes at
-- the DP collectives, but its own time barely moves). Two real
-- stragglers of very different size: the worse is named first; the other after it is fixed.
-- Not a rank whose excess over its peers is explained by longer pipeline receives (a neighbour
-- of a slow stage): that one is named instead. Not a rank whose TP partners are, in the median,
-- at least 3/4 as slow as it is: a whole TP group late is a group effect (a straggler's TP
-- partner, whose spans hold its waits, reads slow too, but clearly less). Where every flagged
-- rank is a shadow of another (the largest z and the largest t_own belong to different ranks,
-- each short of the other's bar), the flagged rank with the largest t_own is named: a rank
-- paused outside its spans has the most own time, while its TP partners' spans, holding the
-- wait, give them the larger z.
-- @column rank, stage, steps, slow_steps, strict_steps, comm_slow_steps  as in rank_scores
-- @column median_slowdown, slowdown, xfer_slowdown, ex_*_ns, base_own_ns  as in rank_scores
-- @column median_ex_recv_ns, median_ex_own_ns, median_ex_spans_ns  as in rank_scores
-- @column sigma, bsigma, m_own, m_blame, t_spans, blame_ns  as in rank_scores
-- @column last_arrival_frac, last_z, last_tp, last_dp, last_pp, last_other, max_z  as in rank_scores
-- @column host, coords, pp, dp, tp  its host and coordinates (every axis; the three read by name)
-- @column flag          it passes every test above but the shadow one
-- @column steps_slow_frac, steps_comm_slow_frac  slow_steps / steps, comm_slow_steps / steps
-- @column t_own, t_blame, z  the evidence
-- @column partners_m_own  median m_own of its TP partners (NULL without any)
-- @column straggler     named
WITH e AS (
    SELECT s.*,
           s.m_own / greatest(1.25 * s.sigma / sqrt(s.steps), {{rel_floor}}) AS t_own,
           -- Blame is zero for most ranks most of the time (a rank is rarely last), so its own
           -- spread can be tiny: never held to less noise than own time.
           s.m_blame / nullif(greatest(1.25 * greatest(s.bsigma, s.sigma) / sqrt(s.steps), {{rel_floor}}), 0) AS t_blame
    FROM ms_cache.rank_scores s
), z AS (
    SELECT e.*,
           (least(greatest(coalesce(t_own, 0), -3), 6) + least(greatest(coalesce(t_blame, 0), -3), 6)
            + least(greatest(coalesce(last_z, 0), -3), 6) + least(greatest(coalesce(t_spans, 0), 0), 6))
               / sqrt(1 + (t_blame IS NOT NULL)::INT + (last_z IS NOT NULL)::INT + (t_spans IS NOT NULL)::INT) AS z
    FROM e
), grp AS (
    -- Its tensor-parallel partners (alike on every axis but tp): a whole TP group slower than the
    -- rest of its stage is a group effect (a replica its host scheduled late), not a rank.
    SELECT z.rank, median(o.m_own) AS partners_m_own
    FROM z JOIN ms_cache.rank_info i USING (rank)
    JOIN ms_cache.rank_info j ON j.stage = i.stage AND j.tp_key IS NOT DISTINCT FROM i.tp_key AND j.rank <> i.rank
    JOIN z o ON o.rank = j.rank
    GROUP BY z.rank
), flagged AS (
    SELECT z.*, grp.partners_m_own,
           coalesce(z.z >= {{z_comb}} AND z.t_own >= 1 AND z.median_slowdown >= {{min_slowdown}}
                    AND NOT coalesce(grp.partners_m_own >= 0.75 * z.m_own, false)
                    AND NOT coalesce(z.median_ex_recv_ns > 0 AND z.median_ex_recv_ns >= z.median_ex_own_ns, false),
                    false) AS flag
    FROM z LEFT JOIN grp USING (rank) WHERE z.steps >= {{min_steps}}
), shaded AS (
    SELECT f.*,
           f.flag AND f.z >= {{shadow}} * max(f.z) FILTER (WHERE f.flag) OVER ()
                  AND f.t_own >= {{own_shadow}} * max(f.t_own) FILTER (WHERE f.flag) OVER () AS unshaded,
           -- The flagged rank with the most own-time evidence (then z, then the lowest rank).
           f.flag AND row_number() OVER (ORDER BY f.flag DESC, f.t_own DESC, f.z DESC, f.rank) = 1 AS leader
    FROM flagged f
)
SELECT f.* EXCLUDE (unshaded, leader), i.host, i.coords, i.pp, i.dp, i.tp,
       f.slow_steps / f.steps AS steps_slow_frac, f.comm_slow_steps / f.steps AS steps_comm_slow_frac,
       -- Where every flagged rank shades another (the one with the largest z holds less own
       -- time than half of another's, that one less z than 3/4 of the first's: a rank paused
       -- outside its spans, whose TP partner's spans hold the wait and read long), the leader.
       f.unshaded OR f.leader AND NOT bool_or(f.unshaded) OVER () AS straggler
FROM shaded f JOIN ms_cache.rank_info i USING (rank);

-- @statement largest_stage
-- How many ranks the most populous pipeline stage has: with one, no rank has a peer doing the
-- same work, and stragglers (judged against their stage's peers) cannot be told.
-- @column ranks  ranks of the largest stage (0 without ranks)
SELECT coalesce(max(n), 0) AS ranks FROM (SELECT stage, count(*) AS n FROM ms_cache.rank_info GROUP BY stage);

-- @statement lone_stages_own
-- Where stragglers cannot be told (every stage one rank): each rank's own time (all but waiting),
-- its median over the steps after the run's first (its warm-up; every step on a run of one),
-- against the median of every rank's. The stages do different work: what reads high may be a
-- heavier stage as well as a slow one, which the reader knows and the data does not.
-- @column rank, coords  the rank and its coordinates
-- @column own_ns        the median of its own time a step
-- @column x             own_ns / the median over ranks of own_ns
WITH first AS (
    SELECT min(step) AS s0, count(DISTINCT step) AS n FROM ms_cache.rank_step WHERE own_ns IS NOT NULL
), r AS (
    SELECT rank, median(own_ns) AS own_ns FROM ms_cache.rank_step, first
    WHERE own_ns IS NOT NULL AND (step > first.s0 OR first.n = 1) GROUP BY rank
)
SELECT r.rank, i.coords, r.own_ns, r.own_ns / nullif(median(r.own_ns) OVER (), 0) AS x
FROM r JOIN ms_cache.rank_info i USING (rank)
ORDER BY x DESC NULLS LAST, r.rank;

-- @statement axis_sizes
-- How many distinct coordinates the ranks have on the axes a straggler's place is told on.
-- @column tp, dp, pp  distinct tp, dp and pp coordinates (0 where the run lacks the axis)
SELECT count(DISTINCT tp) AS tp, count(DISTINCT dp) AS dp, count(DISTINCT pp) AS pp FROM ms_cache.rank_info;

-- @statement host_probe
-- Each rank's host probe (megascope.schema.HOST_PROBE_METRIC: the training thread timing a fixed
-- pure-Python loop every few steps): how fast the CPU under it ran. The median over its probes,
-- so that one probe cut short by the scheduler does not count.
-- @column rank
-- @column probes   probes it wrote
-- @column loop_ns  their median, nanoseconds
SELECT rank, count(*) AS probes, median(value) AS loop_ns
FROM metrics WHERE name = '{{probe_metric}}' AND value > 0
GROUP BY rank ORDER BY rank;

-- @statement tp_exclusive
-- Compute outside the tensor-parallel calls, for the ranks in {{ranks}} (every member of the TP
-- groups read: a candidate's and a few others'), read from {{spans}} (those ranks' files only).
-- On a device a TP call inside a forward or backward span holds the wait for the slowest member,
-- so a slow rank and its TP partners have spans of the same length; the partners' TP calls are
-- the longer ones. Per (rank, step,
-- micro-batch) in which its TP calls were timed: the top-level forward and backward spans less the
-- TP calls' durations, both read on the rank's own clock (no cross-rank alignment), compared with
-- the other members' mean in the same step and micro-batch. A job whose spans carry no
-- micro-batch (Megatron's schedule marks none) is compared step by step.
-- @column rank             the rank
-- @column grp              its TP group
-- @column samples          (step, micro-batch)s compared, or steps
-- @column ratio            median of its compute outside TP calls over its partners' mean
-- @column slow_frac        share of the samples at {{bar}} times its partners' or more
-- @column imbalance        its group's median (largest / smallest member) over the samples
-- @column other_imbalance  the largest imbalance among the other groups read (NULL without any)
WITH tpg AS (SELECT DISTINCT "group" AS grp FROM groups WHERE kind = 'tp'),
s AS (
    SELECT rank, step, microbatch,
           sum(dur_ns) FILTER (WHERE kind IN ('forward', 'backward') AND name IN ('forward', 'backward')) AS fb,
           sum(dur_ns) FILTER (WHERE kind = 'collective' AND "group" IN (SELECT grp FROM tpg)) AS tp,
           any_value("group") FILTER (WHERE kind = 'collective' AND "group" IN (SELECT grp FROM tpg)) AS grp
    FROM {{spans}}
    WHERE list_contains({{ranks}}, rank) AND step IS NOT NULL
      AND kind IN ('forward', 'backward', 'collective')
    GROUP BY rank, step, microbatch
), x AS (
    SELECT rank, step, microbatch, grp, (fb - tp)::DOUBLE AS ex FROM s WHERE tp > 0 AND fb > tp
), g AS (
    SELECT x.*, count(*) OVER w AS n, sum(ex) OVER w AS s_ex, max(ex) OVER w AS hi, min(ex) OVER w AS lo
    FROM x WINDOW w AS (PARTITION BY grp, step, microbatch)
), r AS (
    SELECT rank, grp, count(*) AS samples, median(ex / ((s_ex - ex) / (n - 1))) AS ratio,
           avg(CASE WHEN ex >= {{bar}} * (s_ex - ex) / (n - 1) THEN 1.0 ELSE 0.0 END) AS slow_frac
    FROM g WHERE n >= 2 AND s_ex > ex GROUP BY rank, grp
), gi AS (
    SELECT grp, median(hi / lo) AS imbalance FROM g WHERE n >= 2 AND lo > 0 GROUP BY grp
)
SELECT r.rank, r.grp, r.samples, r.ratio, r.slow_frac, gi.imbalance,
       (SELECT max(o.imbalance) FROM gi o WHERE o.grp <> r.grp) AS other_imbalance
FROM r JOIN gi USING (grp)
ORDER BY r.rank;

-- @statement dp_compute
-- Compute against the data-parallel peers doing the same work, for ranks without tensor-parallel
-- partners (a pipeline-and-data-parallel or data-parallel-only mesh): per step after the first,
-- the rank's forward and backward spans as recorded (rank_step's forward_ns + backward_ns) over
-- the median of the ranks at its stage and TP coordinate (the other one of a pair), which run the
-- same spans. On such a mesh a slow rank makes its whole pipeline replica slow: its replica-mates
-- wait for it at their receives, and on shared CPU cores their own time reads nearly as slow as
-- its own, but their spans do not stretch. (Its own time less the waits inside its spans,
-- compute_excl_ns, is no measure here: the waits of the asynchronous gradient calls inside a
-- backward vary more from step to step than a 1.3x slowdown.)
-- @column rank       the rank
-- @column samples    steps compared
-- @column ratio      median over those steps of its compute over its peers' median
-- @column slow_frac  share of the steps at {{bar}} times its peers' or more
WITH first AS (SELECT min(step) AS step FROM ms_cache.rank_step),
solo AS (
    SELECT i.rank, i.stage, i.tp FROM ms_cache.rank_info i
    WHERE NOT EXISTS (SELECT 1 FROM ms_cache.rank_info j
                      WHERE j.stage = i.stage AND j.tp_key IS NOT DISTINCT FROM i.tp_key AND j.rank <> i.rank
                        AND j.tp IS NOT NULL)
), c AS (
    SELECT r.rank, r.step, s.stage, s.tp, (r.forward_ns + r.backward_ns)::DOUBLE AS compute
    FROM ms_cache.rank_step r JOIN solo s USING (rank)
    WHERE r.step > (SELECT step FROM first) AND r.forward_ns + r.backward_ns > 0
), w AS (
    -- Its peers' median without a self-join (a data-parallel-only mesh of thousands of ranks has
    -- thousands of peers a stage): the other one of a pair, the median of all of them from three.
    SELECT rank, step, compute, count(*) OVER p AS n, sum(compute) OVER p AS total, median(compute) OVER p AS mid
    FROM c WINDOW p AS (PARTITION BY stage, tp, step)
), x AS (
    SELECT rank, step, compute / CASE WHEN n = 2 THEN total - compute ELSE mid END AS ratio
    FROM w WHERE n >= 2
)
SELECT rank, count(*) AS samples, median(ratio) AS ratio,
       avg(CASE WHEN ratio >= {{bar}} THEN 1.0 ELSE 0.0 END) AS slow_frac
FROM x GROUP BY rank ORDER BY rank;

-- @statement step_compute
-- The forward and backward spans of the ranks in {{ranks}}, per step after the run's first (as
-- dp_compute reads them), and their wait in collectives.
-- @column rank       the rank
-- @column step       the step
-- @column compute    forward_ns + backward_ns
-- @column coll_wait  wait_ns less its pipeline receives: the wait for others in collectives
SELECT rank, step, (forward_ns + backward_ns)::DOUBLE AS compute,
       greatest(wait_ns - p2p_wait_ns, 0)::DOUBLE AS coll_wait
FROM ms_cache.rank_step
WHERE list_contains({{ranks}}, rank) AND step > (SELECT min(step) FROM ms_cache.rank_step)
  AND forward_ns + backward_ns > 0
ORDER BY rank, step;

-- @statement group_members
-- The collective groups of {{max_members}} members or fewer but the world's, and their members,
-- from the groups table.
-- @column grp      the group id
-- @column members  its global ranks
SELECT "group" AS grp, any_value(members) AS members FROM groups
WHERE kind <> 'world' AND len(members) <= {{max_members}}
GROUP BY "group" ORDER BY "group";

-- @statement tp_members
-- The TP groups and their members, from the groups table.
-- @column grp      the group id
-- @column members  its global ranks
SELECT "group" AS grp, any_value(members) AS members FROM groups WHERE kind = 'tp' GROUP BY "group" ORDER BY "group";

-- @statement outside
-- How long each step a rank ran none of its compute or communication spans, for the ranks in
-- {{ranks}}, read from {{spans}} (those ranks' files only), on each rank's own clock: the step's
-- extent (its step span where there is one, else its spans' first start to last end) less the
-- union of those spans within it. A rank that pauses outside its spans (a sleep, a stall of its
-- host thread) shows the pause here, while its peers, waiting for it, sit in their collectives.
-- A send covers its rank only until the rank's next span of another kind begins: a pipeline
-- stage's sends are posted and left to complete (pp4 x dp2 on CPU: each lasted to the step's end,
-- 250-280 ms, and hid a 100 ms pause before the last backward); a blocking send ends first.
-- @column rank     the rank
-- @column step     the step
-- @column outside  that time in ns
WITH raw AS (
    SELECT rank, step, kind, start_ns, start_ns + dur_ns AS end_ns FROM {{spans}}
    WHERE list_contains({{ranks}}, rank) AND step IS NOT NULL AND dur_ns >= 0
      AND kind IN ('step', 'forward', 'backward', 'optimizer', 'compute', 'collective', 'send', 'recv')
), s0 AS (
    SELECT rank, step, kind, start_ns,
           CASE WHEN kind = 'send' THEN least(end_ns, coalesce(min(start_ns) FILTER (WHERE kind NOT IN ('send', 'step'))
                    OVER (PARTITION BY rank, step ORDER BY start_ns ROWS BETWEEN 1 FOLLOWING AND UNBOUNDED FOLLOWING),
                    end_ns))
                ELSE end_ns END AS end_ns
    FROM raw
), st AS (
    SELECT rank, step, min(start_ns) AS lo, max(end_ns) AS hi FROM s0 WHERE kind = 'step' GROUP BY rank, step
), c AS (
    SELECT s0.rank, s0.step, st.lo, st.hi,
           greatest(s0.start_ns, coalesce(st.lo, s0.start_ns)) AS a, least(s0.end_ns, coalesce(st.hi, s0.end_ns)) AS b
    FROM s0 LEFT JOIN st USING (rank, step) WHERE s0.kind <> 'step'
), o AS (
    SELECT rank, step, lo, hi, a, b,
           max(b) OVER (PARTITION BY rank, step ORDER BY a, b ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS covered
    FROM c WHERE b > a
)
SELECT rank, step,
       greatest(coalesce(any_value(hi), max(b)) - coalesce(any_value(lo), min(a))
                - sum(greatest(b - greatest(a, coalesce(covered, a)), 0)), 0) AS outside
FROM o GROUP BY rank, step ORDER BY rank, step;

-- @statement slow_groups
-- Each group's transfers against the other groups of its kind doing the same work: per step
-- after the first, the sum of its instances' transfer time (xfer_ns: completion less the last
-- arrival, so a late member does not count) over that of the other groups of its kind, at its
-- pipeline stage, that issued as many calls in the step (leave-one-out: the other group of two,
-- the mean of the other two of three, else the median of all). Stages are kept apart: their
-- groups move different tensors (a healthy pp2 x tp2 x dp2 run's DP groups read 0.3-0.4x and
-- 2.5-3.0x across its two stages). A slow link or NIC under one rank slows the transfers of
-- every group it is in, and those alone. Kinds with one group at a stage (world, a
-- data-parallel-only mesh) are never compared.
-- @column grp        the group
-- @column kind       its kind (tp | dp | pp | cp | ep | other)
-- @column members    its global ranks (groups table)
-- @column steps      steps compared
-- @column ratio      median over those steps of its transfer time over the others'
-- @column slow_frac  share of those steps at {{bar}} times the others' or more
WITH m AS (
    SELECT "group" AS grp, any_value(members) AS members FROM groups GROUP BY "group"
), st AS (
    -- A group's stage: its members' one stage (-1 for a group across stages).
    SELECT m.grp, CASE WHEN min(i.stage) = max(i.stage) THEN min(i.stage) ELSE -1 END AS stage
    FROM m, unnest(m.members) AS u(rank) JOIN ms_cache.rank_info i ON i.rank = u.rank
    GROUP BY m.grp
), ps AS (
    SELECT grp, group_kind, step, sum(xfer_ns)::DOUBLE AS x, count(*) AS calls
    FROM ms_cache.inst
    WHERE n >= 2 AND group_kind <> 'world' AND step > (SELECT min(step) FROM ms_cache.inst)
    GROUP BY grp, group_kind, step
), w AS (
    SELECT ps.grp, ps.group_kind, ps.step, ps.x,
           count(*) OVER p AS n, sum(ps.x) OVER p AS s, median(ps.x) OVER p AS med
    FROM ps LEFT JOIN st USING (grp) WINDOW p AS (PARTITION BY ps.group_kind, coalesce(st.stage, -1), ps.step, ps.calls)
), r AS (
    SELECT grp, group_kind, x / nullif(ms_cache.loo(n, s, x, med), 0) AS ratio FROM w WHERE n >= 2
), g AS (
    SELECT grp, any_value(group_kind) AS kind, count(*) AS steps, median(ratio) AS ratio,
           avg(CASE WHEN ratio >= {{bar}} THEN 1.0 ELSE 0.0 END) AS slow_frac
    FROM r WHERE ratio IS NOT NULL GROUP BY grp
)
SELECT g.grp, g.kind, m.members, g.steps, g.ratio, g.slow_frac
FROM g LEFT JOIN m USING (grp)
ORDER BY g.ratio DESC, g.grp;

-- @statement slow_edges
-- Each pipeline link's transfers against the other links between the same two stages, over the
-- sampled steps {{steps}} after the first: per step, the sum of the link's point-to-point
-- transfers (a receive's completion less the later of its send's start and its own, on the
-- reference clock, so a late sender or receiver does not count) over that of the other links from
-- the same stage to the same stage that carried as many transfers in the step (leave-one-out, as in
-- slow_groups). A link is one direction between two ranks, 'p2p:S>R'. A slow link or NIC under one
-- rank slows both directions of each link it is on; a straggler posts late and slows none.
-- @column grp        the link, 'p2p:S>R'
-- @column kind       'p2p'
-- @column members    [S, R]
-- @column steps      steps compared
-- @column ratio      median over those steps of its transfer time over the others'
-- @column slow_frac  share of those steps at {{bar}} times the others' or more
WITH p AS (
    SELECT s.step, s."group" AS g, s.seq, s.kind = 'send' AS sent,
           CASE WHEN s.kind = 'send' THEN s.rank ELSE s.peer END AS src,
           CASE WHEN s.kind = 'send' THEN s.peer ELSE s.rank END AS dst,
           s.start_ns + coalesce(k.offset_ns, 0) AS a, s.dur_ns
    FROM spans s LEFT JOIN ms_cache.rank_clock k USING (rank)
    WHERE s.kind IN ('send', 'recv') AND s.peer IS NOT NULL AND s.seq IS NOT NULL
      AND list_contains({{steps}}, s.step)
), x AS (
    -- A send and its receive: one aggregation, no join (the later start is the pair's max).
    SELECT min(step) AS step, src, dst, greatest(max(a + dur_ns) FILTER (WHERE NOT sent) - max(a), 0) AS xfer
    FROM p GROUP BY g, seq, src, dst
    HAVING count(*) FILTER (WHERE sent) = 1 AND count(*) FILTER (WHERE NOT sent) = 1
), l AS (
    SELECT x.src, x.dst, x.step, sum(x.xfer)::DOUBLE AS x, count(*) AS calls,
           any_value(i.stage) AS s_stage, any_value(j.stage) AS d_stage
    FROM x JOIN ms_cache.rank_clock i ON i.rank = x.src JOIN ms_cache.rank_clock j ON j.rank = x.dst
    WHERE x.step > (SELECT min(step) FROM ms_cache.rank_step)
    GROUP BY x.src, x.dst, x.step
), w AS (
    SELECT src, dst, step, x, count(*) OVER p AS n, sum(x) OVER p AS s, median(x) OVER p AS med
    FROM l WINDOW p AS (PARTITION BY s_stage, d_stage, step, calls)
), r AS (
    SELECT src, dst, x / nullif(ms_cache.loo(n, s, x, med), 0) AS ratio FROM w WHERE n >= 2
)
SELECT 'p2p:' || src || '>' || dst AS grp, 'p2p' AS kind, [src, dst] AS members, count(*) AS steps,
       median(ratio) AS ratio, avg(CASE WHEN ratio >= {{bar}} THEN 1.0 ELSE 0.0 END) AS slow_frac
FROM r WHERE ratio IS NOT NULL
GROUP BY src, dst
ORDER BY ratio DESC, grp;

-- @statement late_completion
-- For each rank of {{ranks}} and each collective group it is in (the world's and groups of more
-- than {{max_members}} left out): how much later than the group's earliest member it completed
-- its calls, summed per step over the group's calls with two members or more, the median over
-- steps {{steps}}; read from {{spans}} (the files of the groups' members), on the reference clock. A call completes on every member at about the same time once the last
-- one arrived; a member whose data arrives late (a slow link into it, or out of its partner)
-- completes later than the others at every call.
-- @column rank, grp  the rank and the group
-- @column lag_ns     its summed completion lag per step, the median over the steps read
-- @column steps      steps read
WITH c AS (
    SELECT s.rank, s.step, s."group" AS grp, s.seq, s.start_ns + s.dur_ns + coalesce(k.offset_ns, 0) AS e
    FROM {{spans}} s LEFT JOIN ms_cache.rank_clock k USING (rank)
    WHERE s.kind = 'collective' AND s.seq IS NOT NULL AND list_contains({{steps}}, s.step)
      AND s."group" IN (SELECT "group" FROM groups WHERE kind <> 'world' AND len(members) <= {{max_members}})
), l AS (
    SELECT rank, step, grp, e - min(e) OVER (PARTITION BY grp, seq) AS lag, count(*) OVER (PARTITION BY grp, seq) AS n
    FROM c
), per AS (
    SELECT rank, grp, step, sum(lag) AS lag FROM l WHERE n >= 2 AND list_contains({{ranks}}, rank) GROUP BY ALL
)
SELECT rank, grp, median(lag) AS lag_ns, count(*) AS steps FROM per GROUP BY rank, grp ORDER BY rank, grp;

-- @statement device_timed
-- The ranks timed on a device clock (ranks.device on CUDA), whose spans are the device's.
-- @column rank  the rank
SELECT rank FROM ranks WHERE device LIKE 'cuda%' ORDER BY rank;

-- @statement compute_outside_calls
-- The top-level forward and backward spans of the ranks in {{ranks}} less the collective calls
-- and the waits for asynchronous ones (`<name>:wait` spans) made inside them (the part of each
-- within a span), per step of {{steps}}, read from
-- {{spans}} (those ranks' files only) on each rank's own clock. A call inside a span holds the
-- data arriving into the rank: a slow link into it stretches its spans, not its compute.
-- @column rank     the rank
-- @column step     the step
-- @column compute  its forward and backward spans less the calls inside them, at least 0
WITH sp AS (
    SELECT rank, step, kind, name, start_ns AS s, start_ns + dur_ns AS e
    FROM {{spans}}
    WHERE list_contains({{ranks}}, rank)
      AND (list_contains({{steps}}, step) AND kind IN ('forward', 'backward') AND name IN ('forward', 'backward')
           -- a call of the step before may be waited for in this one's forward
           OR (list_contains({{steps}}, step) OR list_contains({{steps}}, step + 1))
              AND (kind = 'collective' OR kind = 'other' AND ends_with(name, ':wait')))
), fb AS (
    SELECT rank, step, s, e FROM sp WHERE kind IN ('forward', 'backward')
), inside AS (
    SELECT f.rank, f.step, sum(least(c.e, f.e) - greatest(c.s, f.s)) AS calls
    FROM fb f JOIN sp c ON c.kind NOT IN ('forward', 'backward') AND c.rank = f.rank AND c.s < f.e AND c.e > f.s
    GROUP BY ALL
), per AS (
    SELECT rank, step, sum(e - s) AS spans FROM fb GROUP BY ALL
)
SELECT p.rank, p.step, greatest(p.spans - coalesce(i.calls, 0), 0)::DOUBLE AS compute
FROM per p LEFT JOIN inside i USING (rank, step)
ORDER BY p.rank, p.step;
