"""``megascope report``, ``localize``, ``heatmap``: post-mortem on a run directory.

Thin commands: open the run, call one function of :mod:`megascope.analysis`, print. ``--json``
prints one object on stdout (the contract of ARCHITECTURE.md); progress and warnings go to
stderr; a bad run directory is one line on stderr and exit status 1.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import click

from megascope.cli.common import echo_json, echo_problems, json_option, run_dir_argument
from megascope.errors import ConfigError, ExportError

# Bounded so a 12,288-rank post-mortem fits next to other work on a small machine.
MEMORY_LIMIT = "3GB"
# A run read from this many part files or more (not compacted) gets a hint from `report`: every
# reader opens a few compacted files faster than thousands of parts (1,024 ranks x 1,000 steps on
# two cores: a cold report 46 s on its 32,784 parts, 12 s compacted).
COMPACT_HINT_PARTS = 2_000
# A host straggler whose host probe took this many times the median rank's ran on a slower CPU; at
# CPU_SAME or less, on one as fast as its peers'.
CPU_SLOW = 1.25
CPU_SAME = 1.10
# On a pure pipeline (stragglers not told): the stages shown by their own time, highest first.
STAGES_SHOWN = 4


def _open(run_dir: Path) -> Any:
    from megascope.store import open_run

    return open_run(run_dir, memory_limit=MEMORY_LIMIT)


def _progress(quiet: bool) -> Any:
    if quiet or not sys.stderr.isatty():
        return None
    return lambda message: click.echo(f"... {message}", err=True)


def _ms(ns: Any) -> str:
    return "-" if ns is None else f"{ns / 1e6:.1f} ms"


def _coords(coords: dict[str, int]) -> str:
    from megascope.topology import format_coords

    return format_coords(coords) or "-"


def _print_report(r: dict[str, Any]) -> None:
    from megascope.topology import ranks_text

    run = r["run"]
    mesh = " x ".join(f"{k}={v}" for k, v in run["mesh"].items())
    steps = run["steps"]
    click.echo(f"run {run['path']}  ({run['source']}, {ranks_text(run['world_size'])}, {mesh}, "
               f"{steps} step{'' if steps == 1 else 's'})")
    state = r.get("state") or {}
    if state.get("state") in ("stalled", "hung", "failed"):
        click.echo(f"{state['state'].upper()}: {state['reason']}")
    mfu = r["mfu"]
    mfu_text = f"- ({mfu['missing']})" if mfu["mean"] is None and mfu.get("missing") else (
        "-" if mfu["mean"] is None else f"{100 * mfu['mean']:.1f}%")
    drift = mfu.get("drift") or {}
    click.echo(f"step time {_ms(run['step_time_ns'])} (median)   MFU {mfu_text}"
               + (f"   step time drifts {100 * drift['change_frac']:+.1f}% over the run" if drift.get("drifting") else ""))
    click.echo("")
    slow = r["stragglers"]
    if slow:
        from megascope.analysis.pipeline import HOST_BOUND_FRAC

        click.echo(f"STRAGGLERS ({len(slow)})")
        click.echo(f"  {'rank':>6} {'host':<16} {'coords':<18} {'cause':<14} {'phase':<10} {'slowdown':>8} {'steps':>6} {'last-in':>7}")
        for s in slow[:20]:
            last = "-" if s.get("last_arrival_frac") is None else f"{100 * s['last_arrival_frac']:.0f}%"
            click.echo(f"  {s['rank']:>6} {s['host']:<16} {_coords(s['coords']):<18} {s['cause']:<14} {s['phase']:<10} "
                       f"{s['slowdown']:>7.2f}x {100 * s['steps_slow_frac']:>5.0f}% {last:>7}")
        if len(slow) > 20:
            click.echo(f"  ... {len(slow) - 20} more (--json for all)")
        for s in slow[:20]:
            tp = (s.get("evidence") or {}).get("tp_compute_ratio")
            if s["cause"] == "compute" and tp is not None and tp == tp:
                click.echo(f"  rank {s['rank']}: compute outside its TP calls {tp:.2f}x its TP partners' "
                           "(their spans hold their waits for it)")
            dp = (s.get("evidence") or {}).get("dp_compute_ratio")
            if s["cause"] == "compute" and dp is not None and dp == dp:
                click.echo(f"  rank {s['rank']}: forward and backward {dp:.2f}x its data-parallel peers' at its stage "
                           "(its replica waits for it, so its own time stands out less)")
            outside = (s.get("evidence") or {}).get("outside_calls_ratio")
            if s["cause"] == "compute" and outside is not None and outside == outside:
                click.echo(f"  rank {s['rank']}: forward and backward less the calls inside them {outside:.2f}x its "
                           "peers' at its stage (its spans hold its collectives, in which it waits less than they do: "
                           "its spans read no longer than theirs)")
            groups = (s.get("evidence") or {}).get("slow_groups")
            late = [g for g in groups or [] if "(late, " in g]
            either = [g.removesuffix(" (either end)") for g in groups or [] if g.endswith(" (either end)")
                      and "(late, " not in g]
            one_way = [g for g in groups or [] if g.endswith(("(into it)", "(out of it)", "(one way, either end)"))]
            if one_way:
                side = ("what this rank receives" if one_way[0].endswith("(into it)") else
                        "what this rank sends" if one_way[0].endswith("(out of it)") else
                        "one side of this rank's link or of the other end's, which nothing else tells apart")
                click.echo(f"  rank {s['rank']}: pipeline transfers slow one way only against the other links "
                           f"between the same stages ({', '.join(one_way)}): a slow link or NIC, {side}")
            elif late:
                ends = "; ".join(g.removesuffix(" (late, either end)").removesuffix(" (late, into it)") for g in late)
                where = ("a slow link or NIC under one of the two ends, which nothing else tells apart"
                         if late[0].endswith("(late, either end)") else
                         "a slow link or NIC under it, or under the rank that sends to it")
                click.echo(f"  rank {s['rank']}: calls completing later on the receiving rank than on the others "
                           f"({ends}), its compute outside them as its peers': data arriving slowly: {where}")
            elif either:
                click.echo(f"  rank {s['rank']}: its pipeline link transfers slowly both ways against the other links "
                           f"between the same stages ({', '.join(either)}): a slow link or NIC under this rank or "
                           "under the link's other end, which nothing else tells apart")
            elif groups:
                click.echo(f"  rank {s['rank']}: its groups and pipeline links {', '.join(groups)} transfer slowly against "
                           "the others of their kind, and it alone is in all of them: a slow link or NIC under this rank")
            behind = (s.get("evidence") or {}).get("behind_rank")
            if behind is not None:
                click.echo(f"  rank {s['rank']}: a later stage of rank {behind}'s pipeline replica, whose compute "
                           "spans stretch more: it reaches its calls late behind rank "
                           f"{behind}, and some of its slowness may be rank {behind}'s")
            idle = (s.get("evidence") or {}).get("device_idle_frac")
            if s["cause"] == "host" and idle is not None and idle == idle and idle >= HOST_BOUND_FRAC:
                click.echo(f"  rank {s['rank']}: its GPU sat idle, waiting for its host, at {100 * idle:.0f}% of its "
                           "communication calls: its host set the pace, not its GPU")
            cpu = (s.get("evidence") or {}).get("cpu_slowdown")
            if s["cause"] != "host" or cpu is None or cpu != cpu:  # NaN: no host probes
                continue
            verdict = ("a slow or shared CPU, not more work" if cpu >= CPU_SLOW
                       else "a CPU as fast as its peers' when probed: more host work, or a slowdown between "
                            "probes (one every few steps)" if cpu <= CPU_SAME
                       else "a little slower CPU, not enough to explain it")
            click.echo(f"  rank {s['rank']}: host probe {cpu:.2f}x the median rank's time: {verdict}")
    elif r.get("stragglers_withheld") == "hung":
        click.echo("STRAGGLERS not told: the run hung, and every rank is a hang suspect or its victim (below)")
    elif r.get("stragglers_withheld") == "no_peers" and r["run"]["world_size"] == 1:
        click.echo("STRAGGLERS not told: a run of one rank has no peer to compare it with")
    elif r.get("stragglers_withheld") == "no_peers":
        click.echo("STRAGGLERS not told: no pipeline stage has two ranks, so no rank has a peer doing the same work")
        own = [o for o in (r.get("stages_own") or []) if o.get("x") is not None]
        if len(own) > 1:
            shown = ", ".join(f"rank {o['rank']} {o['own_ns'] / 1e6:.1f} ms {o['x']:.2f}x" for o in own[:STAGES_SHOWN])
            click.echo(f"  own time a step, highest first, x all stages' median (stages do different work: a heavier "
                       f"one reads high too): {shown}")
    else:
        click.echo("STRAGGLERS none")
    for d in (r.get("stragglers_dismissed") or [])[:5]:
        last = "-" if d.get("last_arrival_frac") is None else f"{100 * d['last_arrival_frac']:.0f}%"
        saving = "-" if d.get("saving") is None else f"{100 * d['saving']:.1f}%"
        at_least = "at least " if d.get("saving_lower_bound") else ""
        what = "in its compute spans" if d.get("cause") == "compute" else "no longer spans"
        click.echo(f"  not named: rank {d['rank']} {_coords(d['coords'])} arrived last at {last} of its calls "
                   f"({d['slowdown']:.2f}x own time, {what}), but a replay of its steps at its peers' pace "
                   f"saves {at_least}{saving} of the step")
    if any(d.get("saving_lower_bound") for d in (r.get("stragglers_dismissed") or [])[:5]):
        from megascope.analysis.stragglers import LOWER_BOUND_NOTE

        click.echo(f"  ({LOWER_BOUND_NOTE})")
    w = r.get("whatif")
    if w:
        from megascope.analysis.whatif import gain_words, host_held

        gain = gain_words(float(w["speedup"] or 1.0))
        mfu_line = "" if w.get("whatif_mfu") is None else f", MFU {100 * w['mfu']:.1f}% -> {100 * w['whatif_mfu']:.1f}%"
        click.echo(f"  what-if fixed: step {_ms(w['step_time_ns'])} -> {_ms(w['whatif_step_time_ns'])} "
                   f"({'at least: ' if w.get('lower_bound') else ''}{gain}{mfu_line})")
        if w.get("lower_bound"):
            click.echo("    (some communication calls were not timed, and the waits behind them count as work)")
        if host_held(w):
            floor = w["host_floor"]
            click.echo(f"    (held to the hosts' pace: rank {floor['rank']}'s device waits for its host, which takes "
                       f"{_ms(floor['issue_ns'])} to issue a step; a replay of device time alone: "
                       f"{_ms(w['replay_step_time_ns'])})")
    click.echo("")
    hang = r["hang"]
    if hang["hung"]:
        click.echo(f"HANG: {ranks_text(len(hang['waiting']))} waiting inside a call" if hang["waiting"]
                   else "HANG: the job stopped with no rank's trail inside a call")
        for s in hang["suspects"][:5]:
            click.echo(f"  suspect {_suspect_text(s)}")
        if hang.get("lost"):
            click.echo(f"  note: {hang['note']}")
    else:
        click.echo("HANG none" + ("" if hang.get("markers") else " (no collective markers in this run)"))
    skew_drift = r["skew"]["drift"]
    click.echo("")
    if skew_drift.get("drifting"):
        click.echo("SKEW DRIFT: late arrivals grow over the run")
        for c in skew_drift["collectives"][:5]:
            ranks = ", ".join(str(x["rank"]) for x in c["ranks"][:5]) or "-"
            click.echo(f"  {c['name']} ({c['group_kind']}): +{_ms(c['late_growth_ns'])} over the run; ranks {ranks}")
    coll = r["skew"]["collectives"]
    if coll:
        click.echo(f"  {'collective':<22} {'kind':<6} {'spread p50':>11} {'spread p99':>11} {'most often last':>16}")
        for c in coll[:8]:
            last = f"rank {c['top_last_rank']} ({100 * c['top_last_frac']:.0f}%)"
            click.echo(f"  {c['name']:<22} {c['group_kind']:<6} {_ms(c['spread_median_ns']):>11} "
                       f"{_ms(c['spread_p99_ns']):>11} {last:>16}")
    if r["bubbles"] and len(r["bubbles"]) > 1:
        click.echo("")
        click.echo("PIPELINE BUBBLES  " + "  ".join(f"pp{b['stage']}: {100 * (b['bubble_frac'] or 0):.0f}%" for b in r["bubbles"]))
    exposed: dict[str, float] = {}
    calls: dict[str, list[float]] = {}  # group kind -> [timed, issued]
    for row in r.get("exposed_comm") or []:
        # Every call issued: untimed calls (a collector timing some micro-batches only) are
        # counted at the mean of the timed ones of their op and size.
        per = row.get("exposed_ns_per_rank_step_all", row.get("exposed_ns_per_rank_step"))
        if per is not None and per == per:  # not NaN
            kind = row["group_kind"]
            exposed[kind] = exposed.get(kind, 0.0) + float(per)
            counts = calls.setdefault(kind, [0.0, 0.0])
            counts[0] += float(row.get("spans") or 0)
            counts[1] += float(row.get("calls") or row.get("spans") or 0)
    if exposed:
        step_ns = run.get("step_time_ns")
        share = (lambda ns: f" ({100 * ns / step_ns:.1f}%)") if step_ns else (lambda ns: "")

        def sampled(kind: str) -> str:
            timed, issued = calls.get(kind, (0.0, 0.0))
            return f" [{100 * timed / issued:.0f}% of calls timed]" if issued and timed < issued else ""

        click.echo("")
        click.echo("EXPOSED COMM per rank-step  " + "  ".join(
            f"{kind}: {_ms(ns)}{share(ns)}{sampled(kind)}"
            for kind, ns in sorted(exposed.items(), key=lambda kv: -kv[1])))
    lead = r.get("host_lead") or {}
    if lead.get("ranks"):
        rows = lead["ranks"]
        click.echo("")
        click.echo(f"HOST LEAD (host ahead of device at each call, {len(rows)} device-timed ranks sampled)  "
                   f"p10 as low as {_ms(min(x['lead_p10_ns'] for x in rows))}, "
                   f"median {_ms(sorted(x['lead_p50_ns'] for x in rows)[len(rows) // 2])}")
        for x in lead.get("host_bound") or []:
            click.echo(f"  host-bound: rank {x['rank']}: the device was idle at {100 * x['starved_frac']:.0f}% of "
                       f"{x['calls']} calls (lead p10 {_ms(x['lead_p10_ns'])}); host time is step time there")
        if lead.get("host_bound"):
            click.echo("  fewer and larger kernels (torch.compile, CUDA graphs) and no host syncs inside the step "
                       "keep the host ahead")
    pauses = r.get("gc") or {}
    if pauses.get("total_ns"):
        worst = pauses["top"][0]
        click.echo("")
        click.echo(f"GC PAUSES inside steps: {pauses['ranks_with_gc']} of {pauses['ranks']} ranks, "
                   f"{_ms(pauses['total_ns'])} in all; longest: rank {worst['rank']}, {_ms(worst['total_ns'])} "
                   f"over {worst['steps']} steps (at most {_ms(worst['max_step_ns'])} in one)")
    footprint = r.get("collector") or {}
    if footprint.get("stamps_per_step") is not None:
        line = f"COLLECTOR {footprint['stamps_per_step']:,.0f} stamps a rank-step"
        if footprint.get("device_ns_per_step_est") is not None:
            frac = footprint.get("share_of_step_est")
            line += (f", about {_ms(footprint['device_ns_per_step_est'])} of device time"
                     + ("" if frac is None else f" ({100 * frac:.2f}% of a step)")
                     + f" at ~{footprint['ns_per_stamp_assumed'] / 1e3:g} us each")
        if footprint.get("host_ns_per_step_est") is not None:
            frac = footprint.get("host_share_of_step_est")
            line += (f" and {_ms(footprint['host_ns_per_step_est'])} of the training thread's"
                     + ("" if frac is None else f" ({100 * frac:.2f}%)")
                     + f" at ~{footprint['host_ns_per_stamp_assumed'] / 1e3:g} us")
        click.echo("")
        click.echo(line)
        if footprint.get("host_bound") and footprint.get("host_ns_per_step_est") is not None:
            click.echo("  host-bound ranks: there the collector's host time is step time, and whole runs have lost "
                       "more than these sums; a run with MEGASCOPE_DISABLE=1 measures what it costs this job")
    clock = r["clock"]
    if clock["hosts"] > 1:
        err = clock.get("max_error_ns")
        click.echo(f"CLOCKS {clock['hosts']} hosts, offsets up to {_ms(clock['max_abs_offset_ns'])}"
                   + ("" if err is None else f" (+- {_ms(err)})") + ", corrected before comparing ranks")
    for lead in clock.get("ranks_put_back") or []:
        click.echo(f"CLOCKS rank {lead['rank']}'s clock read {_ms(lead['skew_ns'])} late against its TP group's "
                   "(their TP calls end together): its times are put back by it")


@click.command()
@run_dir_argument
@json_option
@click.option("--no-whatif", is_flag=True, help="Skip the what-if replay (faster on huge runs).")
@click.option("-q", "--quiet", is_flag=True, help="No progress messages.")
def report(run_dir: Path, as_json: bool, no_whatif: bool, quiet: bool) -> None:
    """Stragglers with causes, skew, MFU and its drift, hang state."""
    from megascope.analysis import report as build_report

    run = _open(run_dir)
    echo_problems(run.problems)
    result = build_report(run, progress=_progress(quiet), with_whatif=not no_whatif)
    if as_json:
        echo_json(result)
    else:
        _print_report(result)
    hint = _compact_hint(run, run_dir, str((result.get("state") or {}).get("state", "")))
    if hint is not None:
        click.echo(f"hint: {hint}", err=True)


def _compact_hint(run: Any, run_dir: Path, state: str) -> str | None:
    """What to run so that the next reader of ``run`` opens a few files instead of thousands of
    parts (None: few parts). An ended run is compacted whole, and keeps the report's analysis;
    one that may still write, only its parts older than a minute (safe beside the job)."""
    parts = sum(len(files) - len(run.compacted.get(table, [])) for table, files in run.files.items())
    if parts < COMPACT_HINT_PARTS:
        return None
    if state in ("finished", "failed"):
        return (f"{run_dir} is read from {parts:,} part files; `megascope compact {run_dir} --all` merges them "
                "into a few sorted files that every later reader opens faster, and keeps this analysis for them")
    return (f"{run_dir} is read from {parts:,} part files; `megascope compact {run_dir}` merges those older than "
            "a minute beside the job (or one pass per node: docs/run-directory.md, \"Compaction\")")


@click.command()
@run_dir_argument
@json_option
def localize(run_dir: Path, as_json: bool) -> None:
    """Where is the hang: the rank, host and TP/PP/DP coordinates behind it."""
    from megascope.analysis import localize as find_hang
    from megascope.analysis.report import jsonable
    from megascope.topology import ranks_text

    run = _open(run_dir)
    echo_problems(run.problems)
    found = find_hang(run)
    result = jsonable(found)
    if as_json:
        echo_json(result)
        return
    if not result["markers"]:
        click.echo("no collective markers in this run: nothing to localize")
        return
    fr = result.get("flight_recorder")
    if not result["hung"]:
        click.echo(f"not hung: {result['note']}" if result.get("note")
                   else "not hung: every collective that was entered also completed")
        if fr:
            click.echo(_fr_line(fr))
        from megascope.analysis.runstate import run_state

        state = run_state(run, hang=found)
        if state["state"] in ("stalled", "failed"):  # where it stopped, if not in a call
            click.echo(f"{state['state'].upper()}: {state['reason']}")
        return
    waited = f", the first for {result['waited_s']:.0f} s" if result.get("waited_s") is not None else ""
    groups = result["stuck_group_count"]
    click.echo(f"HUNG: {ranks_text(len(result['waiting']))} waiting in {groups} group{'' if groups == 1 else 's'}{waited}"
               if result["waiting"] else "HUNG: the job stopped with no rank's trail inside a call")
    if result.get("lost"):
        click.echo(f"  note: {result['note']}")
    for i, s in enumerate(result["suspects"][:10], 1):
        click.echo(f"{i:>3}. {_suspect_text(s)} [{' + '.join(s.get('evidence') or ['markers'])}]")
        stack = s.get("stack")
        if stack and stack.get("frames"):
            from megascope.analysis.witness import frame_text

            click.echo(f"       stack at step {stack.get('step')}: "
                       + " < ".join(frame_text(f) for f in stack["frames"][:3]))
    if result["silent"]:
        shown = ", ".join(map(str, result["silent"][:20]))
        click.echo(f"silent ranks (no sign of life near the end): {shown}")
    if fr:
        click.echo(_fr_line(fr))


def _suspect_text(s: dict[str, Any]) -> str:
    """A hang suspect in one line: who, where, what it did, and how many wait on it."""
    where = str(s.get("where") or f"stuck in {s.get('group')}")
    done = (f" (last completed {s['last_completed_seq']})"
            if s.get("last_completed_seq") is not None and not where.startswith("stopped") else "")
    n = s.get("waited_on_by")
    waits = (", 1 rank waits on it" if n == 1 else f", {n} ranks wait on it") if n else ""
    from megascope.analysis.hang import place_text

    place = place_text(s) if s.get("place_inferred") or s.get("host") in (None, "unknown") \
        else f"host {s['host']} {_coords(s['coords'])}"
    return f"rank {s['rank']} ({s['state']}) {place}: {where}{done}{waits}"


def _fr_line(fr: dict[str, Any]) -> str:
    """What the NCCL flight recorder's dumps say, in one line."""
    if fr.get("error"):
        return f"flight recorder: dumps unreadable ({fr['error']})"
    named = ", ".join(map(str, fr["suspects"][:5])) or "nobody"
    verdict = "agrees" if fr["agrees"] else f"DISAGREES: {fr.get('disagreement', '')}"
    return f"flight recorder ({fr['dumps']} dumps): hung={fr['hung']}, names {named}; {verdict}"


def _png_from_html(html: Path, png: Path, width: int, height: int, shown: Path | None = None) -> None:
    name = shown or png
    browser = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
    if browser is None:
        raise ExportError(f"{name}: PNG needs Chromium installed (write .html instead)")
    cmd = [browser, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars",
           f"--window-size={width},{height}", "--virtual-time-budget=10000", f"--screenshot={png}", html.as_uri()]
    try:
        proc = subprocess.run(cmd, capture_output=True, timeout=120, check=False)
    except subprocess.TimeoutExpired:
        raise ExportError(f"{name}: the browser took too long to render the heat-map") from None
    if proc.returncode != 0 or not png.exists():
        raise ExportError(f"{name}: the browser could not render the heat-map (exit {proc.returncode})")


@click.command()
@run_dir_argument
@click.option("-o", "--out", "out", required=True, type=click.Path(path_type=Path, dir_okay=False),
              help="HTML file to write (.png where a browser is installed).")
@click.option("--phase", default="step", show_default=True,
              type=click.Choice(["step", "own", "compute", "forward", "backward", "optimizer", "data", "host",
                                 "comm", "wait", "xfer", "bubble"]),
              help="What to colour: time of this phase over the peer median.")
@click.option("--max-ranks", default=512, show_default=True, type=click.IntRange(min=1), help="Rank bins at most.")
@click.option("--max-steps", default=400, show_default=True, type=click.IntRange(min=1), help="Step bins at most.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists (never a file inside a run directory).")
def heatmap(run_dir: Path, out: Path, phase: str, max_ranks: int, max_steps: int, force: bool) -> None:
    """Rank x step heat-map of each phase, normalized within peers."""
    from megascope import layout
    from megascope.analysis import heatmap as cells_of
    from megascope.figures.heatmap import heat_peers, heatmap_figure

    suffix = out.suffix.lower()
    if suffix not in (".html", ".htm", ".png"):
        raise ConfigError(f"{out}: write .html or .png")
    layout.check_output_file(out, replace=force)
    run = _open(run_dir)
    echo_problems(run.problems)
    cells = cells_of(run, phase=phase, max_ranks=max_ranks, max_steps=max_steps)
    fig = heatmap_figure(cells, phase=phase, title=f"{run.path.name}: {phase} time / {heat_peers(cells)}")
    # Written under a hidden name and renamed: the file appears whole, and a --force that fails
    # leaves the old one as it was.
    partial = out.with_name(f".{out.stem}.{os.getpid()}.tmp{out.suffix}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if suffix == ".png":
            with tempfile.TemporaryDirectory() as tmp:
                html = Path(tmp) / "heatmap.html"
                fig.write_html(html, include_plotlyjs=True, full_html=True)
                _png_from_html(html, partial, 1400, 900, shown=out)
        else:
            fig.write_html(partial, include_plotlyjs=True, full_html=True)
        os.replace(partial, out)
    except OSError as exc:
        raise ExportError(f"{exc.filename or out}: cannot write ({exc.strerror or exc})") from None
    finally:
        partial.unlink(missing_ok=True)
    click.echo(f"wrote {out} ({len(cells)} cells)", err=True)


def register(group: click.Group) -> None:
    for command in (report, localize, heatmap):
        group.add_command(command)
