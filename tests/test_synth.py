"""megascope synth: the simulated job records what a real one would, faults included."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import Result

from megascope.errors import ConfigError
from megascope.inject import parse_injects
from megascope.store import open_run
from megascope.synth import SynthConfig, one_f_one_b, synth_run
from megascope.topology import Mesh


def _run(tmp_path: Path, name: str = "run", **kw: object) -> Path:
    faults = parse_injects(kw.pop("injects", []))  # type: ignore[arg-type]
    cfg = SynthConfig(**{"ranks": 16, "steps": 4, "tp": 2, "pp": 2, "faults": faults, **kw})  # type: ignore[arg-type]
    synth_run(tmp_path / name, cfg)
    return tmp_path / name


def test_one_f_one_b_order() -> None:
    assert one_f_one_b(0, 2, 3) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    assert one_f_one_b(1, 2, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    for stage in range(4):
        ops = one_f_one_b(stage, 4, 6)
        assert sorted(ops) == sorted([("F", i) for i in range(6)] + [("B", i) for i in range(6)])


def test_healthy_run_is_consistent(tmp_path: Path) -> None:
    run = open_run(_run(tmp_path))
    con = run.con
    assert run.problems == []
    assert run.meta.world_size == 16 and run.meta.mesh_sizes == {"pp": 2, "dp": 4, "tp": 2}
    # ranks and groups agree with the topology module
    mesh = Mesh.for_world(16, tp=2, pp=2)
    for rank, pp, dp, tp in con.execute("SELECT rank, coords['pp'], coords['dp'], coords['tp'] FROM ranks").fetchall():
        assert mesh.coords(rank) == {"pp": pp, "dp": dp, "tp": tp}
    for rank, group, members in con.execute("SELECT rank, \"group\", members FROM groups").fetchall():
        axis = group.split(":")[0]
        assert mesh.group_of(rank, axis).id == group and tuple(members) == mesh.group_of(rank, axis).members
    # every member of a group saw the same collective sequence numbers
    mismatched = con.execute("""
        WITH s AS (SELECT "group", rank, list(seq ORDER BY seq) AS seqs FROM spans
                   WHERE kind = 'collective' GROUP BY ALL)
        SELECT "group" FROM s GROUP BY "group" HAVING count(DISTINCT seqs) > 1
    """).fetchall()
    assert mismatched == []
    # each send has exactly one matching recv, with reciprocal peers and the same seq
    unmatched = con.execute("""
        SELECT count(*) FROM spans s FULL JOIN spans r
          ON s.kind = 'send' AND r.kind = 'recv' AND s.peer = r.rank AND r.peer = s.rank AND s.seq = r.seq
        WHERE (s.kind = 'send' AND r.rank IS NULL) OR (r.kind = 'recv' AND s.rank IS NULL)
    """).fetchone()
    assert unmatched == (0,)
    # members of a collective instance complete together (on the true clock: same host here)
    spread = con.execute("""
        SELECT max(end_spread) FROM (
          SELECT max(start_ns + dur_ns) - min(start_ns + dur_ns) AS end_spread
          FROM spans JOIN ranks USING (rank) WHERE kind = 'collective' GROUP BY "group", seq, host)
    """).fetchone()[0]
    assert spread <= 2  # float ns rounding only
    assert con.execute("SELECT count(DISTINCT step) FROM spans WHERE kind = 'step'").fetchone() == (4,)
    assert con.execute("SELECT count(*) FROM metrics WHERE name = 'loss'").fetchone()[0] == 4 * 4


def test_straggler_slows_its_compute_and_makes_peers_wait(tmp_path: Path) -> None:
    con = open_run(_run(tmp_path, injects=["straggler:rank=5,factor=1.4"])).con
    fwd = dict(con.execute("SELECT rank, median(dur_ns) FROM spans WHERE kind = 'forward' GROUP BY rank").fetchall())
    others = sorted(v for r, v in fwd.items() if r != 5)
    assert fwd[5] > 1.3 * others[len(others) // 2]
    # its TP peer (rank 4) waits in the TP all-reduce; rank 5 itself arrives last and waits least
    wait = dict(con.execute("SELECT rank, sum(dur_ns) FROM spans WHERE name = 'tp.all_reduce' GROUP BY rank").fetchall())
    assert wait[4] > 3 * wait[5]


def test_skew_delays_arrival_at_dp_sync_only(tmp_path: Path) -> None:
    con = open_run(_run(tmp_path, injects=["skew:rank=6,ms=40"], clock_skew_ms=0.0)).con
    late = con.execute("""
        SELECT rank, median(start_ns - min_start) FROM (
          SELECT rank, start_ns, min(start_ns) OVER (PARTITION BY "group", seq) AS min_start
          FROM spans WHERE name = 'dp.reduce_scatter') GROUP BY rank ORDER BY 2 DESC LIMIT 1
    """).fetchone()
    assert late[0] == 6 and late[1] > 35e6
    fwd = dict(con.execute("SELECT rank, median(dur_ns) FROM spans WHERE kind = 'forward' GROUP BY rank").fetchall())
    assert fwd[6] < 1.1 * sorted(fwd.values())[8]


def test_hang_leaves_a_trail_and_ends_the_run(tmp_path: Path) -> None:
    con = open_run(_run(tmp_path, steps=6, injects=["hang:rank=3,step=2"])).con
    assert con.execute("SELECT max(step) FROM spans").fetchone() == (2,)
    assert con.execute("SELECT max(step) FROM spans WHERE rank = 3 AND kind = 'step'").fetchone() == (1,)
    # in rank 3's TP group, the peer enqueued a sequence number rank 3 never reached
    rows = dict(con.execute("""
        SELECT rank, max(seq) FROM markers WHERE "group" = 'tp:1' AND state = 'enqueued' GROUP BY rank
    """).fetchall())
    assert rows[2] == rows[3] + 1
    completed = con.execute("""SELECT max(seq) FROM markers WHERE "group" = 'tp:1' AND state = 'completed'""").fetchone()
    assert completed == (rows[3],)


def test_clock_offsets_recorded_and_applied(tmp_path: Path) -> None:
    path = _run(tmp_path, ranks=16, tp=1, pp=1, gpus_per_host=4, clock_skew_ms=5.0)
    offsets = json.loads((path / "run.json").read_text())["config"]["synth"]["clock_offsets_ns"]
    assert set(offsets) == {"node00000", "node00001", "node00002", "node00003"} and offsets["node00000"] == 0
    con = open_run(path).con
    # collective completions differ across hosts by exactly the recorded offsets
    for host, off in offsets.items():
        diff = con.execute("""
            SELECT median(e - ref) FROM (
              SELECT seq, max(start_ns + dur_ns) FILTER (WHERE host = ?) AS e,
                     max(start_ns + dur_ns) FILTER (WHERE host = 'node00000') AS ref
              FROM spans JOIN ranks USING (rank) WHERE name = 'dp.reduce_scatter' GROUP BY seq)
        """, [host]).fetchone()[0]
        assert diff == pytest.approx(off, abs=1)


def test_same_seed_same_data(tmp_path: Path) -> None:
    a = open_run(_run(tmp_path, "a", seed=3)).con
    b = open_run(_run(tmp_path, "b", seed=3)).con
    q = "SELECT * FROM spans ORDER BY rank, start_ns, name"
    assert a.execute(q).fetchall() == b.execute(q).fetchall()


def test_bad_config() -> None:
    with pytest.raises(ConfigError, match="not divisible"):
        SynthConfig(ranks=10, steps=1, tp=4)
    with pytest.raises(ConfigError, match="past the last step"):
        SynthConfig(ranks=4, steps=3, faults=parse_injects(["hang:rank=1,step=3"]))
    # A crash or a kill is a process's fault: synth refuses it in one line rather than plant nothing.
    for spec in ("crash:rank=1,step=1", "kill:rank=0,step=2"):
        with pytest.raises(ConfigError, match=rf"--inject {spec}: synth does not model a {spec.split(':')[0]}"):
            SynthConfig(ranks=4, steps=3, faults=parse_injects([spec]))


def test_cli_refuses_to_overwrite(tmp_path: Path, cli: Callable[..., Result]) -> None:
    out = tmp_path / "r"
    first = cli("synth", "--ranks", "8", "--steps", "2", "--tp", "2", "-o", str(out))
    assert first.exit_code == 0, first.output
    assert "8 ranks (tp=2 pp=1 dp=4)" in first.output
    before = sorted(p.name for p in out.rglob("*"))
    second = cli("synth", "--ranks", "8", "--steps", "2", "-o", str(out))
    assert second.exit_code == 1 and "already exists" in second.output
    assert sorted(p.name for p in out.rglob("*")) == before
    bad = cli("synth", "--ranks", "8", "--steps", "2", "--inject", "slow:rank=1", "-o", str(tmp_path / "x"))
    assert bad.exit_code == 1 and "unknown fault kind" in bad.output and not (tmp_path / "x").exists()


def test_times_are_epoch_ns(tmp_path: Path) -> None:
    run = open_run(_run(tmp_path))
    lo, hi = run.con.execute("SELECT min(start_ns), max(start_ns + dur_ns) FROM spans").fetchone()
    assert run.meta.start_ns is not None
    assert abs(lo - run.meta.start_ns) < 60e9 and hi - lo < 3600e9
    assert run.con.execute("SELECT min(time_ns) FROM markers").fetchone()[0] > run.meta.start_ns - 60e9
