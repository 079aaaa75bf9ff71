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
-- @column n           peers in the (stage, step), the rank included
-- @column base_own_ns peer baseline of own time
-- @column z_own       robust z-score of own time: (own - median) / max(1.4826 MAD, {{rel_floor}} median)
-- @column slowdown    own / baseline own
-- @column ex_*_ns     excess over the peer baseline, per kind of own time (ex_recv_ns: of its
--                     pipeline receive wait)
-- @column xfer_ratio  transfer time / peer baseline transfer time
CREATE OR REPLACE TABLE ms_cache.peer_step AS
WITH rs AS (
    SELECT * FROM ms_cache.rank_step
    WHERE step_ns IS NOT NULL OR NOT {{has_step_spans}}
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
           median(recv_ns) AS med_recv, sum(recv_ns) AS sum_recv
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
-- @column steps, slow_steps, strict_steps, comm_slow_steps  counted steps
-- @column median_slowdown  median slowdown over all its steps
-- @column median_ex_recv_ns, median_ex_own_ns  median excess of pipeline receive wait and of own
--                       time over the peer baseline, over all its steps
-- @column slowdown      median slowdown over its slow steps
-- @column ex_*_ns       median excess over its slow steps
-- @column sigma         the run's noise
-- @column last_arrival_frac  share of its collectives where it arrived last
-- @column last_z        t-statistic over steps of how far above chance (1 / group size) it
--                       arrived last among its peers (same-stage groups)
-- @column last_tp, last_dp, last_pp, last_other  that share per group kind
CREATE OR REPLACE TABLE ms_cache.rank_scores AS
WITH per_rank AS (
    SELECT rank, 1.4826 * mad(ln(slowdown)) AS s,
           1.4826 * mad(ln(xfer_ratio)) FILTER (WHERE xfer_ratio > 0) AS xs
    FROM ms_cache.peer_step WHERE slowdown > 0 AND n >= 2 GROUP BY rank
), cross_rank AS (
    -- Transfer times are shared by a group's members, so a slow link shows in several ranks at
    -- once: judge them against the spread across ranks as well, the larger of the two.
    SELECT coalesce(1.4826 * median(abs(ln(xfer_ratio))), 0) AS xs
    FROM ms_cache.peer_step WHERE xfer_ratio > 0 AND n >= 2
), noise AS (
    SELECT coalesce(median(s), 0) AS sigma,
           greatest(coalesce(median(per_rank.xs), 0), any_value(cross_rank.xs)) AS xsigma
    FROM per_rank, cross_rank
), f AS (
    SELECT p.*, noise.sigma,
           coalesce(slowdown >= greatest({{min_slowdown}}, exp(2 * noise.sigma)) AND (n < 5 OR z_own >= {{z}}), false) AS slow,
           coalesce(slowdown >= greatest({{min_slowdown}}, exp({{z}} * noise.sigma)) AND (n < 5 OR z_own >= {{z}}), false) AS strict,
           coalesce(xfer_ratio >= greatest({{min_slowdown}}, exp({{z}} * noise.xsigma)) AND (n < 5 OR z_xfer >= {{z}}), false) AS xslow
    FROM ms_cache.peer_step p, noise WHERE n >= 2
)
SELECT rank, any_value(stage) AS stage, count(*) AS steps, any_value(sigma) AS sigma,
       count(*) FILTER (WHERE slow) AS slow_steps,
       count(*) FILTER (WHERE strict) AS strict_steps,
       count(*) FILTER (WHERE xslow AND NOT slow) AS comm_slow_steps,
       median(slowdown) AS median_slowdown,
       median(slowdown) FILTER (WHERE slow) AS slowdown,
       median(xfer_ratio) FILTER (WHERE xslow AND NOT slow) AS xfer_slowdown,
       median(ex_own_ns) FILTER (WHERE slow) AS ex_own_ns,
       median(ex_forward_ns) FILTER (WHERE slow) AS ex_forward_ns,
       median(ex_backward_ns) FILTER (WHERE slow) AS ex_backward_ns,
       median(ex_optimizer_ns) FILTER (WHERE slow) AS ex_optimizer_ns,
       median(ex_compute_ns) FILTER (WHERE slow) AS ex_compute_ns,
       median(ex_compute_excl_ns) FILTER (WHERE slow) AS ex_compute_excl_ns,
       median(ex_data_ns) FILTER (WHERE slow) AS ex_data_ns,
       median(ex_host_ns) FILTER (WHERE slow) AS ex_host_ns,
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

-- @statement candidates
-- Stragglers and comm-slow ranks, with place and host. A straggler is slow in at least
-- {{min_frac}} of its steps, and beats two kinds of noise:
--   * step noise: either strictly slow in half its steps, or its median slowdown over the run
--     beats the noise of a median of that many steps (1.25 sigma / sqrt(steps)) by z = {{z}};
--   * rank noise: healthy ranks differ a little, persistently (sys = robust spread of the ranks'
--     median slowdowns; with fewer than five ranks it cannot be told from the straggler and is 0).
-- Persistent mild slowness is found on quiet runs, only gross slowness on noisy ones. Or: it is
-- the last arriver of its collectives {{last_z}} standard deviations above chance, and slower.
-- Either way, not a rank whose excess over its peers is explained by longer pipeline receives
-- (a neighbour of a slow stage).
WITH sys AS (
    SELECT CASE WHEN count(*) >= 5 THEN coalesce(1.4826 * mad(ln(median_slowdown)), 0) ELSE 0 END AS sys
    FROM ms_cache.rank_scores WHERE median_slowdown > 0
)
SELECT s.*, i.host, i.pp, i.dp, i.tp, sys.sys,
       s.slow_steps / s.steps AS steps_slow_frac, s.comm_slow_steps / s.steps AS steps_comm_slow_frac,
       coalesce(
           (s.slow_steps / s.steps >= {{min_frac}}
            AND ((s.strict_steps / s.steps >= greatest({{min_frac}}, 0.5) AND s.slowdown >= exp({{z}} * sys.sys))
                 OR s.median_slowdown >= greatest({{min_slowdown}},
                                                   exp({{z}} * sqrt(pow(1.25 * s.sigma, 2) / s.steps + pow(sys.sys, 2))))))
           -- The last to arrive among its peers, far more often than chance, with longer own
           -- time: the straggler even when noise hides the size of its slowdown.
           OR (s.last_z >= {{last_z}} AND s.median_slowdown >= {{min_slowdown}}), false)
       -- Not when its pipeline receives waited longer than its peers' by at least as much as its
       -- own time exceeds theirs: it is late because its neighbour stage is (that rank is named).
       AND NOT coalesce(s.median_ex_recv_ns > 0 AND s.median_ex_recv_ns >= s.median_ex_own_ns, false) AS straggler
FROM ms_cache.rank_scores s JOIN ms_cache.rank_info i USING (rank), sys
WHERE s.steps >= {{min_steps}}
  AND (s.slow_steps / s.steps >= {{min_frac}} OR s.comm_slow_steps / s.steps >= {{min_frac}}
       OR s.last_z >= {{last_z}});
