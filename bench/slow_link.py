"""Real-run sweep: one rank's network link slowed, in a gloo job whose ranks talk over real links,
against what ``report`` names.

Each rank of the bundled trainer runs in a network namespace of its own, joined to the others by a
veth pair and a bridge, so gloo's traffic between any two ranks leaves one namespace and enters
another (on one machine without this, it never leaves the loopback). In a fault run one rank's
link is rate-limited both ways with a token bucket (``tc ... tbf``): a NIC that negotiated a lower
speed, or a congested port, for that rank alone; with ``--direction out`` (or ``in``) only what the
rank sends (or receives) is limited: a NIC whose transmit side alone is slow, a one-way congested
uplink. Healthy runs limit nothing. The ranks rendezvous
through ``env://`` on rank 0's address; every other port is gloo's own, inside the namespaces.

Scored as ``bench/detect_sweep.py`` scores its runs:

* slow link: the limited rank is named first, and with cause ``communication``; or, where the
  report names both ends of a slow pipeline link ("either end"), the limited rank one of them
  (the link told, its end not: a column of its own);
* healthy: nothing named.

Besides who is named, the table gives the job's step time (the limit's cost) and, per fault run,
the limited rank's transfer time against the median rank's (what the collector's spans measured).

Needs root (or CAP_NET_ADMIN) and the kernel's ``tbf`` qdisc; the namespaces, links and bridge it
makes are named ``msl<pid>*`` and removed when it ends, a run that fails included.

    python bench/slow_link.py -o /tmp/sl --seed 5                     # run and score (~15 min)
    python bench/slow_link.py -o /tmp/sl --score-only                 # score runs already there
    python bench/slow_link.py -o /tmp/sl --meshes 2x1x2 --rates 20,80 --healthy 1
    python bench/slow_link.py -o /tmp/sl --direction out             # what the rank sends, only
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
# The jobs running now, and the SIGTERM handler that kills them with their process groups.
from detect_sweep import _RUNNING, _stop_running  # noqa: E402

# (tp, pp, dp): four ranks on two cores. In every one of these the limited rank shares groups with
# ranks whose links are fast, so only it takes part in every slow call.
MESHES = [(2, 1, 2), (1, 2, 2), (2, 2, 1), (1, 1, 4)]
RATES_MBIT = [20.0, 60.0]
HEALTHY_PER_MESH = 1
RUN_TIMEOUT_S = 300.0
SUBNET = "10.77.{}.{}"


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip() or proc.returncode}")


class Links:
    """A bridge and one namespace per rank, each with its veth pair; ``limit`` slows one rank's link."""

    def __init__(self, ranks: int, tag: str, net: int) -> None:
        self.ranks, self.tag, self.net = ranks, tag, net
        self.bridge = f"{tag}br"
        self.made: list[tuple[str, str]] = []

    def ns(self, rank: int) -> str:
        return f"{self.tag}n{rank}"

    def addr(self, rank: int) -> str:
        return SUBNET.format(self.net, rank + 1)

    def make(self) -> None:
        """Make the bridge, the namespaces and their links (all removed again if one step fails)."""
        try:
            _ip("ip", "link", "add", self.bridge, "type", "bridge")
            self.made.append(("link", self.bridge))
            _ip("ip", "link", "set", self.bridge, "up")
            for rank in range(self.ranks):
                ns, outer, inner = self.ns(rank), f"{self.tag}v{rank}", f"{self.tag}p{rank}"
                _ip("ip", "netns", "add", ns)
                self.made.append(("netns", ns))
                _ip("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
                self.made.append(("link", outer))
                _ip("ip", "link", "set", inner, "netns", ns)
                _ip("ip", "link", "set", inner, "name", "eth0", ns=ns)
                _ip("ip", "addr", "add", f"{self.addr(rank)}/24", "dev", "eth0", ns=ns)
                _ip("ip", "link", "set", "eth0", "up", ns=ns)
                _ip("ip", "link", "set", "lo", "up", ns=ns)
                _ip("ip", "link", "set", outer, "master", self.bridge)
                _ip("ip", "link", "set", outer, "up")
        except Exception:
            self.__exit__()
            raise

    def __enter__(self) -> Links:
        if not self.made:
            self.make()
        return self

    def limit(self, rank: int, mbit: float | None, direction: str = "both") -> None:
        """Rate-limit ``rank``'s link (None: no limit on any link): ``both`` ways, ``out`` (what it
        sends: its own end's queue) or ``in`` (what it receives: the bridge end's queue)."""
        for r in range(self.ranks):
            for dev, ns in ((f"{self.tag}v{r}", None), ("eth0", self.ns(r))):
                cmd = ["tc", "qdisc", "del", "dev", dev, "root"]
                subprocess.run((["ip", "netns", "exec", ns] if ns else []) + cmd, capture_output=True)
        if mbit is None:
            return
        ends = {"in": [(f"{self.tag}v{rank}", None)], "out": [("eth0", self.ns(rank))]}
        for dev, ns in ends.get(direction, ends["in"] + ends["out"]):
            _ip("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit:g}mbit", "burst", "64kb",
                "latency", "500ms", ns=ns)

    def __exit__(self, *_exc: object) -> None:
        for what, name in reversed(self.made):
            args = ["ip", "netns", "del", name] if what == "netns" else ["ip", "link", "del", name]
            subprocess.run(args, capture_output=True)
        self.made.clear()


def plan(meshes: list[tuple[int, int, int]], rates: list[float], healthy: int, seed: int,
         direction: str = "both") -> list[dict[str, Any]]:
    rng = random.Random(seed)
    runs: list[dict[str, Any]] = []
    for tp, pp, dp in meshes:
        world = tp * pp * dp
        mesh = f"{tp}x{pp}x{dp}"
        for mbit in rates:
            rank = rng.randrange(world)
            way = "" if direction == "both" else f"-{direction}"
            runs.append({"name": f"{mesh}-link{mbit:g}{way}-r{rank}", "mesh": [tp, pp, dp], "kind": "slow_link",
                         "rank": rank, "mbit": mbit, "direction": direction})
        for i in range(healthy):
            runs.append({"name": f"{mesh}-healthy{i}", "mesh": [tp, pp, dp], "kind": "healthy", "rank": None,
                         "mbit": None})
    rng.shuffle(runs)
    return runs


def launch(r: dict[str, Any], links: Links, out: Path, *, steps: int, port: int) -> dict[str, Any]:
    tp, pp, dp = r["mesh"]
    world = tp * pp * dp
    links.limit(r["rank"], r["mbit"], r.get("direction", "both"))
    run_dir = out / r["name"]
    procs: list[subprocess.Popen[str]] = []
    logs = []
    t0 = time.perf_counter()
    load = os.getloadavg()[0]
    heads = max(4, tp)
    per_step = dp * max(4, pp)
    batch = per_step * -(-16 // per_step)
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR=links.addr(0), MASTER_PORT=str(port),
                   GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1")
        cmd = ["ip", "netns", "exec", links.ns(rank), sys.executable, "-c", "from megascope.cli import main; main()",
               "train", "--tp", str(tp), "--pp", str(pp), "--dp", str(dp), "--steps", str(steps),
               "--seed", str(abs(hash(r["name"])) % 1000), "--heads", str(heads), "--global-batch", str(batch),
               "--collective-timeout", "60", "--device", "cpu", "-o", str(run_dir)]
        if 4 % pp:  # the default model's 4 layers split over 1, 2 or 4 stages; 3 stages get 6 layers
            cmd[-2:-2] = ["--layers", str(2 * pp)]
        log = open(out / f"{r['name']}.rank{rank}.log", "w")  # noqa: SIM115 - closed below
        logs.append(log)
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    _RUNNING[:] = procs
    rcs: list[int] = []
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        for proc in procs:
            try:
                rcs.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                for p in procs:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                rcs.append(proc.wait())
    finally:
        _RUNNING.clear()
        for log in logs:
            log.close()
        links.limit(0, None)
    wall = time.perf_counter() - t0
    bad = [i for i, rc in enumerate(rcs) if rc]
    err = ""
    if bad:
        lines = (out / f"{r['name']}.rank{bad[0]}.log").read_text().strip().splitlines()
        err = f"rank {bad[0]}: " + (lines[-1] if lines else f"exit {rcs[bad[0]]}")
    return {"load": load, "wall_s": round(wall, 1), "rc": max(rcs, default=0), "err": err}


def score(r: dict[str, Any], path: Path) -> dict[str, Any]:
    from megascope.analysis.report import report
    from megascope.store import open_run

    run = open_run(path)
    res = report(run, with_whatif=False)
    named = [(s["rank"], s["cause"]) for s in res["stragglers"]]
    first = named[0] if named else None
    out: dict[str, Any] = {"named": named, "hung": bool(res["hang"].get("hung")),
                           "step_ms": round(res["run"]["step_time_ns"] / 1e6, 1) if res["run"]["step_time_ns"] else None}
    xfer = run.con.execute("""
        SELECT rank, median(xfer_ns) AS xfer, median(wait_ns) AS wait, median(own_ns) AS own
        FROM ms_cache.rank_step WHERE step >= 3 GROUP BY rank ORDER BY rank""").fetchall()
    med = sorted(x[1] for x in xfer)[len(xfer) // 2] if xfer else None
    out["xfer_ms"] = {int(x[0]): round(float(x[1]) / 1e6, 1) for x in xfer}
    if r["kind"] == "slow_link":
        mine = next((x[1] for x in xfer if x[0] == r["rank"]), None)
        out["xfer_ratio"] = round(float(mine) / float(med), 2) if mine is not None and med else None
        out["first_right"] = bool(first and first[0] == r["rank"]) and not out["hung"]
        out["cause_right"] = bool(out["first_right"] and first and first[1] == "communication")
        out["false"] = [n for n, _ in named if n != r["rank"]]
        # Both ends of a slow pipeline link named first, the limited rank one of them.
        ends = [s["rank"] for s in res["stragglers"]
                if any(g.endswith("(either end)") for g in (s.get("evidence") or {}).get("slow_groups") or [])]
        out["pair_right"] = bool(ends and named[0][0] in ends and r["rank"] in ends) and not out["hung"]
        out["false"] = [n for n in out["false"] if not (out["pair_right"] and n in ends)]
        if named and named[0][0] in ends:  # a link told, not its end: not the rank named alone
            out["first_right"] = out["cause_right"] = False
    else:
        out["first_right"] = out["cause_right"] = not named and not out["hung"]
        out["false"] = [n for n, _ in named]
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| mesh | fault | runs | limited rank named first | with cause `communication` | "
             "its link named, both ends | other ranks named | step ms (median) | limited rank's transfers / median rank's |",
             "|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        way = "" if row.get("direction", "both") == "both" else f" ({row['direction']} only)"
        fault = "healthy" if row["kind"] == "healthy" else f"{row['mbit']:g} Mbit/s{way}"
        groups.setdefault(("x".join(map(str, row["mesh"])), fault), []).append(row)
    for (mesh, fault), group in sorted(groups.items()):
        scored = [g for g in group if "first_right" in g]
        steps = sorted(g["step_ms"] for g in scored if g.get("step_ms"))
        ratios = [f"{g['xfer_ratio']:.2f}" for g in scored if g.get("xfer_ratio") is not None]
        others = sorted({f"{n}:{c}" for g in scored for n, c in g["named"] if n in g["false"]})
        first = sum(g["first_right"] for g in scored)
        cause = sum(g["cause_right"] for g in scored)
        pair = sum(bool(g.get("pair_right")) for g in scored)
        lines.append(f"| {mesh} | {fault} | {len(scored)} | {first if fault != 'healthy' else '-'} | "
                     f"{cause if fault != 'healthy' else '-'} | {pair if fault != 'healthy' else '-'} | "
                     f"{', '.join(others) or 'none'} | "
                     f"{steps[len(steps) // 2] if steps else '-'} | {', '.join(ratios) or '-'} |")
    return "\n".join(lines)


def _mesh(text: str) -> tuple[int, int, int]:
    try:
        tp, pp, dp = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a TPxPPxDP mesh: {text!r}") from None
    return tp, pp, dp


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-o", "--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--meshes", type=lambda s: [_mesh(m) for m in s.split(",")], default=MESHES)
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=RATES_MBIT,
                        help="Mbit/s of the limited link, one fault run per rate and mesh.")
    parser.add_argument("--healthy", type=int, default=HEALTHY_PER_MESH, help="Healthy runs per mesh.")
    parser.add_argument("--direction", choices=["both", "out", "in"], default="both",
                        help="Which way the limited link is slow: both, what the rank sends, or what it receives.")
    parser.add_argument("--score-only", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _stop_running)
    runs = plan(args.meshes, args.rates, args.healthy, args.seed, args.direction)
    results = args.out / "sweep.jsonl"
    done = {}
    if results.exists():
        for line in results.read_text().splitlines():
            row = json.loads(line)
            done[row["name"]] = row
    if not args.score_only:
        world = max(tp * pp * dp for tp, pp, dp in args.meshes)
        tag = f"msl{os.getpid() % 100000}"
        links = Links(world, tag, net=77)
        try:
            links.make()
        except RuntimeError as exc:
            print(f"slow_link: cannot make the ranks' links (root or CAP_NET_ADMIN needed): {exc}", file=sys.stderr)
            return 2
        with links:
            for i, r in enumerate(runs):
                if r["name"] in done and done[r["name"]].get("rc") == 0:
                    continue
                print(f"[{i + 1}/{len(runs)}] {r['name']} ...", file=sys.stderr, flush=True)
                r.update(launch(r, links, args.out, steps=args.steps, port=29400 + i))
                r["when"] = datetime.datetime.now(datetime.UTC).strftime("%H:%M:%S")
                if r["rc"] == 0:
                    r.update(score(r, args.out / r["name"]))
                done[r["name"]] = r
                with results.open("a") as f:
                    f.write(json.dumps(r) + "\n")
    else:
        for name, row in done.items():
            if row.get("rc") == 0:
                row.update(score(row, args.out / name))
    rows = [done[r["name"]] for r in runs if r["name"] in done]
    failed = [r for r in rows if r.get("rc")]
    for r in failed:
        print(f"{r['name']}: failed: {r['err']}", file=sys.stderr)
    print(table([r for r in rows if not r.get("rc")]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
