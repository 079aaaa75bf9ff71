-- Hang localization from the collective trail (markers): per process group, which member never
-- entered the sequence number its peers entered, and which members are stuck inside a call.
--
-- A collective's members each write `enqueued` before the call blocks and `completed` after it
-- returns. In a hang the members that reached call N sit between the two; the member that never
-- reached N has no `enqueued` for it. Point-to-point calls form a two-member group per direction
-- ('p2p:SENDER>RECEIVER', sequence counted per pair).
--
-- A collective cannot complete before every member has entered it, so a `completed` marker past
-- the last call some member entered is not taken as a completion. NCCL writes such ones: a call
-- whose completion is read from a device event "completes" when the watchdog aborts the
-- communicator at the collective timeout, and a job that hooks a future's callback may see it
-- fire at launch. The member then counts as stuck in the first call past that frontier, since
-- it entered it. Of a point-to-point pair the rule holds for the receiver only: a small send may
-- complete before its receive is posted.
--
-- A member that completed more than a step's worth of the group's calls past the frontier (three
-- at least) went on with its peers: an abort completes only the calls in flight, those of the
-- step the member waits in, and a host that runs ahead of futures fired at launch stops at its
-- next synchronization, mostly within the step. The members behind it have *lost* their trail
-- (their data stopped reaching the disk: a writer that could not run while its rank waited,
-- parts that were never flushed), not their progress: each is taken to have entered and
-- completed every call its peers proved, and its trail's end (a call it "never entered", one it
-- "never completed") is no evidence anywhere. In a group where its peers proved nothing its place
-- is unknown: it is not missing there, and the calls its peers completed past its trail's end
-- are not set aside.

-- @statement member_state
-- One row per (group, member). The markers are read only when {{scan}} is true: a run whose
-- every rank finished every step cannot be hung.
-- @column grp          group id ('p2p:S>R' for point-to-point)
-- @column rank         member
-- @column last_enq     highest seq it enqueued (NULL: none)
-- @column last_done    highest seq it completed (NULL: none)
-- @column group_max_enq  highest seq any member enqueued
-- @column missing      it never enqueued a seq that another member enqueued
-- @column missing_seq  the first such seq
-- @column stuck        it enqueued a seq it never completed
-- @column stuck_seq    that seq
-- @column stuck_since_ns  when it enqueued it (reference clock)
-- @column set_aside    completions of its past the frontier were set aside (NCCL's abort): what it
--                      wrote after stuck_since_ns is no sign of progress
-- @column last_marker_ns  its latest marker of the group (reference clock)
-- @column last_step    the highest step of its markers of the group
-- @column last_enq_step  the step of the last call it enqueued
-- @column lost         its trail ends before calls its peers completed with it, in this group or
--                      another (last_enq and last_done are then what its peers proved)
CREATE OR REPLACE TABLE ms_cache.member_state AS
WITH raw AS (
    -- Aggregated on integer keys first; the p2p group name is built on the few result rows.
    SELECT m.rank,
           CASE WHEN m.op IN ('send', 'recv') AND m.peer IS NOT NULL THEN NULL ELSE m."group" END AS cgroup,
           CASE WHEN m.peer IS NULL THEN NULL WHEN m.op = 'send' THEN m.rank WHEN m.op = 'recv' THEN m.peer END AS snd,
           CASE WHEN m.peer IS NULL THEN NULL WHEN m.op = 'send' THEN m.peer WHEN m.op = 'recv' THEN m.rank END AS rcv,
           max(m.seq) FILTER (WHERE m.state = 'enqueued') AS last_enq,
           max(m.seq) FILTER (WHERE m.state = 'completed') AS last_done,
           arg_max(m.time_ns, m.seq) FILTER (WHERE m.state = 'enqueued') AS last_enq_raw,
           max(m.time_ns) AS last_marker_raw,
           min(m.seq) FILTER (WHERE m.state = 'enqueued') AS first_enq,
           max(m.step) AS last_step,
           arg_max(m.step, m.seq) FILTER (WHERE m.state = 'enqueued') AS last_enq_step,
           min(m.seq) FILTER (WHERE m.state = 'completed') AS first_done,
           max(m.step) FILTER (WHERE m.state = 'completed') - min(m.step) FILTER (WHERE m.state = 'completed') + 1
               AS done_steps
    FROM markers m
    WHERE {{scan}}
    GROUP BY ALL
), per AS (
    SELECT coalesce(r.cgroup, 'p2p:' || r.snd || '>' || r.rcv) AS grp, r.rank, r.last_enq, r.last_done,
           r.last_enq_raw + coalesce(k.host_offset_ns, 0) AS last_enq_ns,
           r.last_marker_raw + coalesce(k.host_offset_ns, 0) AS last_marker_ns, r.first_enq, r.last_step,
           r.last_enq_step, r.first_done, r.done_steps
    FROM raw r LEFT JOIN ms_cache.rank_clock k USING (rank)
), members AS (
    -- Declared members (groups table) that may have written nothing at all in the group.
    SELECT DISTINCT g."group" AS grp, unnest(g.members) AS rank FROM groups g
    WHERE g."group" IN (SELECT grp FROM per)
    UNION
    -- Both ends of a point-to-point pair, which no groups table declares: a rank that hung before
    -- its first send or receive wrote none, and its peer waits on it there. Each end only where
    -- the run records that side at all (a job may time its sends alone).
    SELECT grp, TRY_CAST(split_part(substr(grp, 5), '>', 1) AS INTEGER) FROM per
    WHERE grp LIKE 'p2p:%' AND (SELECT coalesce(bool_or(snd = rank), false) FROM raw)
    UNION
    SELECT grp, TRY_CAST(split_part(grp, '>', 2) AS INTEGER) FROM per
    WHERE grp LIKE 'p2p:%' AND (SELECT coalesce(bool_or(rcv = rank), false) FROM raw)
), everyone AS (
    SELECT grp, rank FROM per UNION SELECT grp, rank FROM members
), first_seq AS (
    SELECT grp, min(first_enq) AS min_seq FROM per GROUP BY grp
), trail AS (
    SELECT e.grp, e.rank, p.*EXCLUDE (grp, rank), min(p.last_enq) OVER (PARTITION BY e.grp) AS frontier0
    FROM everyone e LEFT JOIN per p USING (grp, rank)
), proven AS (
    -- Per group, the highest call a member completed past the frontier by more than a step's
    -- worth of the calls it completed (of a point-to-point pair, the receiver's).
    SELECT grp, max(last_done) AS proven FROM trail
    WHERE last_done - frontier0 >= 3 AND (last_done - frontier0) * done_steps > last_done - first_done + 1
      AND (grp NOT LIKE 'p2p:%' OR rank = TRY_CAST(split_part(grp, '>', 2) AS INTEGER))
    GROUP BY grp
), lost AS (
    SELECT DISTINCT t.rank FROM trail t JOIN proven p USING (grp) WHERE coalesce(t.last_enq < p.proven, true)
), joined0 AS (
    SELECT t.grp, t.rank, l.rank IS NOT NULL AS lost, l.rank IS NOT NULL AND p.proven IS NULL AS unread,
           CASE WHEN l.rank IS NULL THEN t.last_enq ELSE greatest(t.last_enq, p.proven) END AS last_enq,
           CASE WHEN l.rank IS NULL THEN t.last_done ELSE greatest(t.last_enq, p.proven) END AS last_done,
           t.last_enq_ns, t.last_marker_ns, t.last_step, t.last_enq_step
    FROM trail t LEFT JOIN lost l USING (rank) LEFT JOIN proven p USING (grp)
), joined AS (
    SELECT j.*, max(j.last_enq) FILTER (WHERE NOT j.unread) OVER (PARTITION BY j.grp) AS group_max_enq, f.min_seq,
           -- the last call every member with markers entered (one with none tells nothing: its
           -- parts may be lost, or its collector off; nor one whose place is unknown)
           min(j.last_enq) FILTER (WHERE NOT j.unread) OVER (PARTITION BY j.grp) AS frontier
    FROM joined0 j LEFT JOIN first_seq f USING (grp)
), judged AS (
    SELECT *, CASE WHEN lost OR last_done IS NULL OR last_done <= frontier THEN last_done
                   -- of a point-to-point pair only the receiver: a send may complete unreceived
                   WHEN grp LIKE 'p2p:%' AND rank <> TRY_CAST(split_part(grp, '>', 2) AS INTEGER) THEN last_done
                   ELSE frontier END AS done_eff
    FROM joined
), impossible AS (
    -- Members whose completions past the frontier were set aside: when they entered the first
    -- call past it (one lookup per such member; none in a healthy or ordinary hung run).
    SELECT j.grp, j.rank, min(m.time_ns) + coalesce(any_value(k.host_offset_ns), 0) AS since_ns
    FROM judged j
    JOIN markers m ON m.rank = j.rank AND m.seq = j.done_eff + 1 AND m.state = 'enqueued'
         AND CASE WHEN m.op IN ('send', 'recv') AND m.peer IS NOT NULL
                  THEN 'p2p:' || CASE WHEN m.op = 'send' THEN m.rank ELSE m.peer END || '>'
                              || CASE WHEN m.op = 'send' THEN m.peer ELSE m.rank END
                  ELSE m."group" END = j.grp
    LEFT JOIN ms_cache.rank_clock k ON k.rank = j.rank
    WHERE {{scan}} AND j.done_eff < j.last_done
    GROUP BY j.grp, j.rank
)
SELECT j.grp, j.rank, j.last_enq, j.done_eff AS last_done, j.group_max_enq, j.last_marker_ns,
       NOT j.unread AND coalesce(j.last_enq < j.group_max_enq, j.group_max_enq IS NOT NULL) AS missing,
       CASE WHEN j.last_enq IS NULL THEN j.min_seq WHEN j.last_enq < j.group_max_enq THEN j.last_enq + 1 END AS missing_seq,
       coalesce(j.last_enq > coalesce(j.done_eff, -9223372036854775807), false) AS stuck,
       CASE WHEN j.last_done > j.done_eff THEN j.done_eff + 1
            WHEN j.last_enq > coalesce(j.done_eff, -9223372036854775807) THEN j.last_enq END AS stuck_seq,
       CASE WHEN j.last_done > j.done_eff THEN coalesce(i.since_ns, j.last_enq_ns)
            WHEN j.last_enq > coalesce(j.done_eff, -9223372036854775807) THEN j.last_enq_ns END AS stuck_since_ns,
       coalesce(j.last_done > j.done_eff, false) AS set_aside,
       j.last_step, j.last_enq_step, j.lost
FROM judged j LEFT JOIN impossible i USING (grp, rank);

-- @statement activity
-- Each rank's last sign of life on the reference clock: markers, spans, its own heartbeats and
-- its host's host-wide heartbeats. The marker agent's `rank_alive` rows are left out: they say
-- the process exists, not that its Python runs (a frozen rank's process lives on).
-- @column rank, host    the rank and its host
-- @column marker_ns     its latest marker (reference clock; NULL: none)
-- @column span_ns       end of its latest step's spans
-- @column rank_hb_ns    its latest own heartbeat
-- @column host_hb_ns    its host's latest host-wide heartbeat
-- @column last_seen_ns  latest of those (NULL: never seen)
-- @column last_step     the highest step of its spans and markers (NULL: none)
WITH hb AS (
    SELECT h.rank, h.host, max(h.time_ns) AS t FROM heartbeats h WHERE h.metric <> 'rank_alive'
    GROUP BY h.rank, h.host
), by_rank AS (
    SELECT k.rank, k.host,
           (SELECT max(last_marker_ns) FROM ms_cache.member_state s WHERE s.rank = k.rank) AS marker_ns,
           (SELECT max(r.start_ns + r.extent_ns) FROM ms_cache.rank_step r WHERE r.rank = k.rank) AS span_ns,
           (SELECT max(hb.t) FROM hb WHERE hb.rank = k.rank) + k.host_offset_ns AS rank_hb_ns,
           (SELECT max(hb.t) FROM hb WHERE hb.rank IS NULL AND hb.host = k.host) + k.host_offset_ns AS host_hb_ns,
           greatest((SELECT max(r.step) FROM ms_cache.rank_step r WHERE r.rank = k.rank),
                    (SELECT max(s.last_step) FROM ms_cache.member_state s WHERE s.rank = k.rank)) AS last_step
    FROM ms_cache.rank_clock k
)
SELECT rank, host, marker_ns, span_ns, rank_hb_ns, host_hb_ns,
       greatest(marker_ns, span_ns, rank_hb_ns, host_hb_ns) AS last_seen_ns, last_step
FROM by_rank ORDER BY rank;

-- @statement process_alive
-- How long each rank's process was seen to exist, from its marker agent's `rank_alive` heartbeats
-- (one per flush interval while the process lives, a last one with value 0 once it is gone),
-- on the reference clock. No rows: the run has no marker agent.
-- @column rank            rank
-- @column alive_until_ns  the agent's last row for it
-- @column ended           the agent saw the process end (value 0) in its last row (a rank that
--                          closed its collector and opened another wrote rows after an earlier 0)
SELECT h.rank, max(h.time_ns) + coalesce(any_value(k.host_offset_ns), 0) AS alive_until_ns,
       arg_max(h.value, h.time_ns) = 0 AS ended
FROM heartbeats h LEFT JOIN ms_cache.rank_clock k ON k.rank = h.rank
WHERE h.metric = 'rank_alive' AND h.rank IS NOT NULL
GROUP BY h.rank ORDER BY h.rank;

-- @statement waiting_members
-- The rows of member_state of a member missing from a call or stuck in one, and of a rank whose
-- trail was lost.
-- @column grp, rank, last_enq, last_done, group_max_enq, missing, missing_seq, stuck, stuck_seq  as in member_state
-- @column stuck_since_ns, set_aside, last_marker_ns, last_step, last_enq_step, lost             as in member_state
SELECT * FROM ms_cache.member_state WHERE missing OR stuck OR lost;

-- @statement rank_trail
-- The member_state rows of ranks {{ranks}}, each rank's latest group first.
-- @column grp, rank, last_enq, last_done, stuck, last_marker_ns, last_enq_step, lost  as in member_state
SELECT grp, rank, last_enq, last_done, stuck, last_marker_ns, last_enq_step, lost
FROM ms_cache.member_state WHERE list_contains({{ranks}}, rank)
ORDER BY rank, last_marker_ns DESC NULLS LAST, grp;

-- @statement last_step
-- The highest step of the base tables.
-- @column step  that step (NULL without rank-steps)
SELECT max(step) AS step FROM ms_cache.rank_step;

-- @statement markers_beyond
-- Whether any marker is of a step after {{step}}. Asked as "any marker beyond it", the Parquet
-- readers skip every row group whose statistics end before it (not one value is decoded on a
-- finished run) where "the largest step" read every one.
-- @column markers  1 where one is, else 0
SELECT count(*) AS markers FROM (SELECT 1 FROM markers WHERE step > {{step}} LIMIT 1);

-- @statement groups_with
-- The groups whose declared members include rank {{rank}}, as any member wrote them: where a rank
-- wrote nothing at all, what its peers' groups say of its place.
-- @column group, kind, members  as in the groups table
SELECT "group", any_value(kind) AS kind, any_value(members) AS members
FROM groups WHERE list_contains(members, {{rank}}) GROUP BY "group" ORDER BY "group";

-- @statement finished_ranks
-- Ranks that wrote a step span for step {{step}}, against all ranks.
-- @column finished  ranks with a step span for it
-- @column ranks     ranks of rank_info
SELECT count(DISTINCT rank) FILTER (WHERE step = {{step}} AND step_ns IS NOT NULL) AS finished,
       (SELECT count(*) FROM ms_cache.rank_info) AS ranks
FROM ms_cache.rank_step;

-- @statement median_step
-- The median step span over all rank-steps.
-- @column step_ns  that median (NULL without step spans)
SELECT median(step_ns) AS step_ns FROM ms_cache.rank_step WHERE step_ns IS NOT NULL;

-- @statement has_markers
-- Whether the run has markers at all (the first row found answers: no footer after it is read).
-- @column any_markers  true where it has
SELECT count(*) > 0 AS any_markers FROM (SELECT 1 FROM markers LIMIT 1);
