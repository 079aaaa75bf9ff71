"""What a person sees in headless Chromium at 1600x1000: run state, no false hang, the straggler's
pixels at 1,024 ranks, a topology click that opens the timeline."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from dashboard_harness import (
    browser_available,
    chromium,
    console_errors,
    own_console,  # noqa: F401 (an autouse fixture)
    serving,
    wait_for_graph,
    wait_for_text,
)
from megascope.dashboard import create_app, ids, registry_of
from megascope.dashboard.routes import parse_ranks
from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from megascope.inject import parse_injects
from megascope.synth import SynthConfig, synth_run

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not browser_available(), reason="needs Debian's chromium and chromium-driver (make system-deps)"),
]

WIDTH, HEIGHT = 1600, 1000
STRAGGLER = 77


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("truth-runs")
    synth_run(root / "big", SynthConfig(ranks=1024, steps=8, tp=8, pp=8, seed=4,
                                        faults=parse_injects([f"straggler:rank={STRAGGLER},factor=1.15"])))
    synth_run(root / "hang", SynthConfig(ranks=8, steps=10, tp=2, pp=2, gpus_per_host=4, seed=2,
                                         faults=parse_injects(["hang:rank=6,step=5"])))
    return {"big": root / "big", "hang": root / "hang"}


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    with chromium(WIDTH, HEIGHT) as browser:
        yield browser


def _screen_pixels(driver: Any, x0: int, x1: int, y: int) -> list[tuple[int, int, int]]:
    """RGB of screenshot pixels (x0..x1, y), decoded by the browser itself from a real screenshot."""
    png = driver.get_screenshot_as_base64()
    flat = driver.execute_async_script(
        """
        const [b64, x0, x1, y, done] = arguments;
        const img = new Image();
        img.onload = () => {
          const c = document.createElement('canvas'); c.width = img.width; c.height = img.height;
          const g = c.getContext('2d'); g.drawImage(img, 0, 0);
          done(Array.from(g.getImageData(x0, y, x1 - x0, 1).data));
        };
        img.src = 'data:image/png;base64,' + b64;
        """, png, x0, x1, y)
    return [(flat[i], flat[i + 1], flat[i + 2]) for i in range(0, len(flat), 4)]


def _plot_point(driver: Any, graph_id: str, x: float, y: float) -> tuple[float, float]:
    """Viewport pixel of data point (x, y) of a graph's main axes."""
    return tuple(driver.execute_script(  # type: ignore[return-value]
        """
        const g = document.querySelector('#' + arguments[0] + ' .js-plotly-plot');
        const box = g.getBoundingClientRect(), L = g._fullLayout;
        return [box.left + L._size.l + L.xaxis.l2p(arguments[1]), box.top + L._size.t + L.yaxis.l2p(arguments[2])];
        """, graph_id, x, y))


def _trace_values(driver: Any, graph_id: str, key: str) -> list[float]:
    """The first trace's ``key`` array as plotly holds it after decoding (typed arrays included)."""
    return list(driver.execute_script(
        "const g = document.querySelector('#' + arguments[0] + ' .js-plotly-plot');"
        "return Array.from(g._fullData[0][arguments[1]]);", graph_id, key))


# A callback request still in flight when the test itself leaves the page (a click, driver.get) is
# cut off: the browser logs the reset connection and dash a callback without answer. Only a loaded
# machine, where a poll takes long enough to be caught, shows these; they say nothing of the app.
_CUT_BY_NAVIGATION = re.compile(r"_dash-update-component.*net::ERR_(CONNECTION_RESET|ABORTED)"
                                r"|server did not respond", re.S)


def _no_errors(driver: Any, navigated: bool = False) -> None:
    errors = console_errors(driver)
    if navigated:
        errors = [e for e in errors if not _CUT_BY_NAVIGATION.search(e)]
    assert errors == []
    assert [e.text for e in driver.find_elements(By.CSS_SELECTOR, ".notice-error")] == []


def test_1024_rank_heatmap_shows_the_straggler_in_its_pixels(runs: dict[str, Path], driver: Any) -> None:
    app = create_app([runs["big"]], start_watcher=False)
    with serving(app) as base:
        driver.get(f"{base}/run/big/heatmap")
        wait_for_graph(driver, ids.HEATMAP_GRAPH)
        wait_for_text(driver, "#heatmap-top-table", f"rank {STRAGGLER}")
        # Plotly draws the heat-map's image after the traces exist.
        WebDriverWait(driver, 40).until(lambda d: d.execute_script(
            "const i = document.querySelector(arguments[0]);"
            "return !!(i && (i.getAttribute('href') || i.getAttribute('xlink:href')));",
            f"#{ids.HEATMAP_GRAPH} .hm image"))
        bins = _trace_values(driver, ids.HEATMAP_GRAPH, "y")
        row_of = max(b for b in bins if b <= STRAGGLER)  # the bin (4 ranks) holding the straggler
        steps = _trace_values(driver, ids.HEATMAP_GRAPH, "x")
        (left, y), (right, _) = (_plot_point(driver, ids.HEATMAP_GRAPH, s, row_of) for s in (steps[0], steps[-1]))
        assert y < HEIGHT - 150, "the straggler's row is on screen"
        slow = _screen_pixels(driver, int(left), int(right), int(round(y)))
        quiet = _screen_pixels(driver, int(left), int(right),
                               int(round(_plot_point(driver, ids.HEATMAP_GRAPH, steps[0], bins[len(bins) // 2])[1])))
        # Orange (1.15x): red high, blue low; the median bin's row stays near white.
        orange = [p for p in slow if p[0] > 200 and p[2] < 170]
        white = [p for p in quiet if min(p) > 225]
        assert len(orange) > 0.8 * len(slow), slow[:: max(1, len(slow) // 10)]
        assert len(white) > 0.8 * len(quiet), quiet[:: max(1, len(quiet) // 10)]
        marks = driver.execute_script(
            f"return document.querySelector('#{ids.HEATMAP_GRAPH} .js-plotly-plot').data"
            ".filter(t => t.name === 'stragglers').map(t => t.text)")
        assert marks == [[f"r{STRAGGLER}"]]
        driver.save_screenshot(str(runs["big"].parent / "heatmap-1024.png"))
        _no_errors(driver)


def test_topology_click_opens_the_timeline_of_that_rank(runs: dict[str, Path], driver: Any) -> None:
    app = create_app([runs["hang"]], start_watcher=False)
    with serving(app) as base:
        driver.get(f"{base}/run/hang/topology")
        wait_for_text(driver, "#topology-culprit", "HANG: rank 6")
        wait_for_text(driver, f"#{ids.RUN_STATE}", "HUNG")
        wait_for_graph(driver, ids.TOPOLOGY_GRAPH)
        # Rank 5: pp=1 dp=0 tp=1, the cell right of stage 1's first column (x = 3 + 1, y = 0).
        _click_topology_cell(driver, rank=5)
        wait_for_graph(driver, ids.TIMELINE_GRAPH)
        query = parse_qs(urlsplit(driver.current_url).query)
        shown = parse_ranks(driver.find_element(By.ID, ids.TIMELINE_RANKS).get_attribute("value"), world_size=8)
        assert shown is not None and 5 in shown and shown == parse_ranks(query["ranks"][0], world_size=8)
        title = driver.execute_script(
            f"return document.querySelector('#{ids.TIMELINE_GRAPH} .js-plotly-plot').layout.title.text")
        assert title.startswith(f"ranks {query['ranks'][0]}")
        # The suspect row links to the culprit's timeline too.
        driver.get(f"{base}/run/hang/topology")
        link = wait_for_text(driver, "#suspect-table", "6").find_element(By.LINK_TEXT, "6")
        link.click()
        WebDriverWait(driver, 40).until(lambda d: "/run/hang/timeline?" in d.current_url)
        ranks = parse_ranks(parse_qs(urlsplit(driver.current_url).query)["ranks"][0], world_size=8)
        assert ranks is not None and 6 in ranks
        _no_errors(driver, navigated=True)


def _real_run(tmp_path: Path, name: str, as_id: str) -> Path:
    """A copy of tests/data/``name`` served as ``as_id`` (the analyses write their cache beside it)."""
    import shutil

    return Path(shutil.copytree(Path(__file__).resolve().parents[1] / "data" / name, tmp_path / as_id))


def _hung_topology(driver: Any, base: str, run_id: str, culprit: str) -> Any:
    """The topology page of a hung run once its banner names ``culprit`` and the header reads
    HUNG and the grid is drawn: the banner's element."""
    driver.get(f"{base}/run/{run_id}/topology")
    banner = wait_for_text(driver, "#topology-culprit", culprit)
    wait_for_text(driver, f"#{ids.RUN_STATE}", "HUNG")
    wait_for_graph(driver, ids.TOPOLOGY_GRAPH)
    return banner


def _topology_states(driver: Any) -> dict[str, str]:
    """Rank (as text) -> state of every cell the topology drew."""
    return dict(driver.execute_script(
        f"const g = document.querySelector('#{ids.TOPOLOGY_GRAPH} .js-plotly-plot');"
        "const c = g.data[0].customdata; const out = {};"
        "c.forEach(row => row.forEach(cell => { if (cell[0] >= 0) out[cell[0]] = cell[3]; })); return out;"))


def test_a_real_hang_whose_waiting_ranks_lost_their_trails_shows_the_hung_rank(tmp_path: Path, driver: Any) -> None:
    """tests/data/gpu-hang-lost-trails-tp2pp2 (4x H100, rank 0 hung at step 5; the waiting ranks'
    trails end at step 0): the header, the topology's banner and its suspect table name rank 0,
    the three others are grey ("lost"), and the timeline marks where rank 0 stopped."""
    run = _real_run(tmp_path, "gpu-hang-lost-trails-tp2pp2", "lost")
    app = create_app([run], start_watcher=False)
    with serving(app) as base:
        culprit = _hung_topology(driver, base, "lost", "HANG: rank 0")
        assert "stopped outside its calls in step 5" in culprit.text
        assert "1, 2, 3" in driver.find_element(By.ID, "topology-lost").text
        states = _topology_states(driver)
        assert states == {"0": "hung", "1": "lost", "2": "lost", "3": "lost"}
        rows = driver.find_element(By.ID, "suspect-table").text
        assert "stopped outside its calls" in rows and rows.splitlines()[1].startswith("0 ")
        driver.find_element(By.ID, "suspect-table").find_element(By.LINK_TEXT, "0").click()
        WebDriverWait(driver, 40).until(lambda d: "/run/lost/timeline?" in d.current_url)
        wait_for_graph(driver, ids.TIMELINE_GRAPH)
        labels = driver.execute_script(
            f"return document.querySelector('#{ids.TIMELINE_GRAPH} .js-plotly-plot').layout.annotations"
            ".map(a => a.text)")
        assert any(t.startswith("rank 0 stopped outside its calls in step 5") for t in labels), labels
        _no_errors(driver, navigated=True)


def test_a_rank_frozen_before_it_wrote_anything_is_drawn_in_its_place(tmp_path: Path, driver: Any) -> None:
    """tests/data/cpu-pp4-dp2-frozen-before-first-flush (gloo, pp4 x dp2, rank 3 frozen at step 0
    before its first flush): the header read no hang and the grid had a hole where rank 3 goes;
    now the header reads HUNG, the banner names rank 3 as a rank that wrote nothing, and the grid
    draws it at pp1 dp1, a suspect, with the seven others waiting."""
    run = _real_run(tmp_path, "cpu-pp4-dp2-frozen-before-first-flush", "frozen")
    app = create_app([run], start_watcher=False)
    with serving(app) as base:
        culprit = _hung_topology(driver, base, "frozen", "HANG: rank 3 (it wrote nothing; pp1 dp1 tp0")
        assert "never entered p2p:3>5" in culprit.text
        states = _topology_states(driver)
        assert states.pop("3") in ("silent", "hung") and set(states.values()) == {"waiting"} and len(states) == 7
        _no_errors(driver)


@pytest.mark.parametrize(("name", "rank", "said", "others"), [
    ("cpu-2x2x2-rank-killed", 6, "rank 6 ended with no exception of its own", "healthy"),
    ("gpu-dp2-rank-killed", 0, "rank 1 waited for it until stopped (it never entered world seq 5)", "waiting"),
], ids=["gloo", "nccl"])
def test_a_real_job_whose_rank_was_killed_shows_that_rank_failed(tmp_path: Path, driver: Any, name: str, rank: int,
                                                                said: str, others: str) -> None:
    """tests/data/cpu-2x2x2-rank-killed (gloo, rank 6 killed with SIGKILL at step 46; the others
    failed on the closed connection) and gpu-dp2-rank-killed (NCCL on 2x H200, rank 0 killed in
    step 5; rank 1 waited for it in its all-reduce until stopped): the header reads FAILED, the
    banner names the killed rank, and the grid draws it as the failed rank, ringed, among healthy
    ones (gloo: they failed after it) or ones waiting for it (NCCL); before: eight green cells and a
    reason that named nobody on gloo, HANG on NCCL."""
    run = _real_run(tmp_path, name, "killed")
    app = create_app([run], start_watcher=False)
    with serving(app) as base:
        driver.get(f"{base}/run/killed/topology")
        banner = wait_for_text(driver, "#topology-state", "FAILED: ")
        assert f"rank {rank} " in banner.text and said in banner.text, banner.text
        wait_for_text(driver, f"#{ids.RUN_STATE}", "FAILED")
        wait_for_graph(driver, ids.TOPOLOGY_GRAPH)
        states = _topology_states(driver)
        assert states.pop(str(rank)) == "failed" and set(states.values()) == {others}, states
        rings = driver.execute_script(
            f"return document.querySelector('#{ids.TOPOLOGY_GRAPH} .js-plotly-plot').data"
            ".filter(t => t.name === 'suspect').map(t => t.text)")
        assert rings == [[f"rank {rank}"]]
        assert not driver.find_elements(By.ID, "topology-culprit")  # no HANG banner
        _no_errors(driver)


def test_a_real_pure_pipeline_heat_map_compares_ranks_with_all_ranks_and_says_so(tmp_path: Path, driver: Any) -> None:
    """tests/data/cpu-pp8-slow (gloo, pp8, rank 3 1.18x slow): no stage has two ranks. The heat-map
    compared each rank with itself (a blank map, "none at 1.05x or more") and the topology read
    "8 healthy"; now the map compares with all ranks and says so, rank 3 tops its list, and the
    topology says slow ranks cannot be told."""
    run = _real_run(tmp_path, "cpu-pp8-slow", "pp8")
    app = create_app([run], start_watcher=False)
    with serving(app) as base:
        driver.get(f"{base}/run/pp8/heatmap")
        wait_for_graph(driver, ids.HEATMAP_GRAPH)
        note = wait_for_text(driver, f"#{ids.HEATMAP_NOTE}", "No pipeline stage has two ranks")
        assert "heavier stage" in note.text
        table = wait_for_text(driver, "#heatmap-top-table", "rank 3")
        assert table.text.splitlines()[1].startswith("rank 3 "), table.text
        assert "Highest against all ranks" in driver.find_element(By.ID, ids.HEATMAP_TOP).text
        title = driver.execute_script(
            f"return document.querySelector('#{ids.HEATMAP_GRAPH} .js-plotly-plot').layout.title.text")
        assert "median of all ranks" in title
        driver.get(f"{base}/run/pp8/topology")
        wait_for_graph(driver, ids.TOPOLOGY_GRAPH)
        wait_for_text(driver, f"#{ids.TOPOLOGY_BANNER}", "slow ranks cannot be told")
        _no_errors(driver, navigated=True)


def _plot_geometry(driver: Any) -> Any:
    return driver.execute_script(
        f"const g = document.querySelector('#{ids.TOPOLOGY_GRAPH} .js-plotly-plot');"
        "if (!g || !g._fullLayout) return null; const b = g.getBoundingClientRect(), L = g._fullLayout;"
        "return [b.left, b.top, b.width, b.height, L._size.l, L._size.t, L._size.w, L._size.h];")


def _click_topology_cell(driver: Any, rank: int, timeout: float = 90) -> None:
    """Click ``rank``'s cell of the topology graph until the page goes to its timeline.

    The graph is laid out again after its first draw (autosize, the run-state poll redrawing it),
    and a slow machine may take a while to act on a click: the cell is located again on a layout
    that held still for 0.3 s before each click, and the click is repeated until the page moves."""
    deadline = time.monotonic() + timeout
    while "/run/hang/timeline?" not in driver.current_url:
        before = _plot_geometry(driver)
        time.sleep(0.3)
        if before is not None and before == _plot_geometry(driver):
            cell = driver.execute_script(
                f"const g = document.querySelector('#{ids.TOPOLOGY_GRAPH} .js-plotly-plot');"
                "const c = g.data[0].customdata; for (let y = 0; y < c.length; y++) for (let x = 0; x < c[y].length; x++)"
                " if (c[y][x][0] == arguments[0]) return [x, y]; return null;", rank)
            assert cell is not None
            px, py = _plot_point(driver, ids.TOPOLOGY_GRAPH, *cell)
            try:
                plot = driver.find_element(By.CSS_SELECTOR, f"#{ids.TOPOLOGY_GRAPH} .nsewdrag")
                box = plot.rect
                ActionChains(driver).move_to_element_with_offset(
                    plot, int(px - (box["x"] + box["width"] / 2)), int(py - (box["y"] + box["height"] / 2))).click().perform()
                WebDriverWait(driver, 10).until(lambda d: "/run/hang/timeline?" in d.current_url)
                return
            except (StaleElementReferenceException, TimeoutException):
                pass  # redrawn under the click, or the click not acted on yet: locate it again
        assert time.monotonic() < deadline, f"clicking rank {rank}'s cell never opened its timeline"


@pytest.mark.dist
def test_live_trainer_run_raises_no_hang_and_ends_finished(tmp_path: Path, driver: Any) -> None:
    out = tmp_path / "x"
    log = (tmp_path / "train.log").open("w")
    job = subprocess.Popen([sys.executable, "-m", "megascope", "train", "--nproc", "8", "--tp", "2", "--pp", "2",
                            "--dp", "2", "--steps", "10", "-o", str(out)], stdout=log, stderr=subprocess.STDOUT)
    app = create_app([out], wait=True, poll_interval_s=0.5)
    seen: list[tuple[str, str, str]] = []
    try:
        with serving(app) as base:
            driver.get(f"{base}/run/x/topology")
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                time.sleep(1.0)
                # Read in one script: the header and banner are redrawn under us every poll.
                state, banner = driver.execute_script(
                    "const text = id => (document.getElementById(id) || {}).textContent || '';"
                    "return [text(arguments[0]).toLowerCase(), text(arguments[1])];", ids.RUN_STATE, ids.TOPOLOGY_BANNER)
                with urllib.request.urlopen(f"{base}/metrics") as response:
                    metrics = response.read().decode()
                hung = re.findall(r'^megascope_hung\{run="x"\} (\S+)$', metrics, re.M)
                seen.append((state, banner, hung[0] if hung else ""))
                if job.poll() is not None and state == "finished":
                    break
            states = [s for s, _, _ in seen]
            assert "running" in states and states[-1] == "finished", seen
            assert not any("HANG" in b or "hung" in s or h == "1.0" for s, b, h in seen), seen
            driver.get(f"{base}/run/x/overview")
            wait_for_text(driver, f"#{ids.OVERVIEW_CARDS}", "finished")
            alerts = driver.find_element(By.ID, ids.OVERVIEW_ALERTS).text
            assert not any(word in alerts for word in ("HANG", "STALLED", "FAILED")), alerts
            # What the job wrote while starting (ranks without data yet) is no problem once it ran.
            problems = driver.find_elements(By.CSS_SELECTOR, f"#{ids.PROBLEMS} details")
            assert problems == [], [p.get_attribute("textContent") for p in problems]
            _no_errors(driver)
    finally:
        if job.poll() is None:
            job.terminate()
        job.wait(60)
        log.close()
        registry_of(app).stop()
    assert job.returncode == 0


def test_a_run_growing_through_compaction_passes_shows_what_a_report_from_scratch_says(tmp_path: Path,
                                                                                         driver: Any) -> None:
    """A live job with a slow rank grows by steps while each node's pass merges its parts (left for
    readers, as node passes leave them): the watcher extends the analysis' tables through each
    pass, and the page shows the new last step and the straggler a report of a copy without any
    cache names."""
    import shutil

    from megascope import analysis
    from megascope.compact import Scope, compact
    from megascope.store import open_run
    from megascope.synth import LiveSynth

    job = LiveSynth(tmp_path / "growing", SynthConfig(ranks=32, steps=10**6, tp=2, pp=2, seed=37,
                                                      faults=parse_injects(["straggler:rank=13,factor=1.3"])))
    job.write_step(16)
    app = create_app([job.out], poll_interval_s=0.5)
    with contextlib.ExitStack() as stack:
        stack.callback(registry_of(app).stop)  # its watcher thread ends with the test
        base = stack.enter_context(serving(app))
        driver.get(f"{base}/run/{job.out.name}/stragglers")
        # " ·" after the step: the analyses have read it too (else "(analyses through step M)").
        wait_for_text(driver, f"#{ids.STATUS}", "last step 15 ·")
        for last in (19, 23):
            for _ in range(3):
                job.write_step(1)
            wait_for_text(driver, f"#{ids.STATUS}", f"last step {last - 1} ·")
            for low in range(0, 32, 8):  # a pass per node of 8 ranks, over parts the page has read
                compact(job.out, min_age_s=0, keep_newest=1, grace_s=600, scope=Scope(ranks=(low, low + 7)))
            job.write_step(1)
            wait_for_text(driver, f"#{ids.STATUS}", f"last step {last} ·")
            driver.get(f"{base}/run/{job.out.name}/stragglers")
            wait_for_text(driver, f"#{ids.STRAGGLER_TABLE}", "13")
            # The rows' first cells read in one script: the watcher may render the table anew
            # between finding a row and reading it.
            shown = driver.execute_script(
                "return Array.from(document.querySelectorAll(arguments[0] + ' tr'))"
                ".map(r => r.innerText.trim().split(/\\s+/)[0]).filter(t => /^\\d+$/.test(t));",
                f"#{ids.STRAGGLER_TABLE}")
            copy = tmp_path / f"copy-{last}"
            shutil.copytree(job.out, copy, ignore=shutil.ignore_patterns("_cache"))
            fresh = analysis.report(open_run(copy))
            assert fresh["run"]["steps"] == last + 1
            assert shown == [str(s["rank"]) for s in fresh["stragglers"]] == ["13"]
        assert console_errors(driver) == []
        driver.get("about:blank")  # no page polling a server about to stop
    job.close()
