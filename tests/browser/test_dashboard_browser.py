"""The dashboard in real headless Chromium: every page, heat-map click, live steps, the live heat-map, hang
culprit, Perfetto handoff."""

from __future__ import annotations

import re
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import flask
import pyarrow as pa
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
from megascope.dashboard import create_app, data, ids, registry_of
from megascope.dashboard.replay import replay_run
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from megascope import layout, schema
from megascope.inject import parse_injects
from megascope.store import open_run
from megascope.synth import LiveSynth, SynthConfig, synth_run

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not browser_available(), reason="needs Debian's chromium and chromium-driver (make system-deps)"),
]

# A stand-in for ui.perfetto.dev that speaks its postMessage protocol and reports what it got.
FAKE_PERFETTO_UI = """<!doctype html><title>waiting</title><script>
window.addEventListener("message", (e) => {
  if (e.data === "PING") { e.source.postMessage("PONG", "*"); return; }
  if (e.data && e.data.perfetto) {
    const p = e.data.perfetto;
    document.title = "received " + p.buffer.byteLength + " " + p.title;
  }
});
</script>"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("browser-runs")
    out = {}
    for name, spec in (("straggler", "straggler:rank=5,factor=1.4"), ("hang", "hang:rank=6,step=5")):
        synth_run(root / name, SynthConfig(ranks=8, steps=10, tp=2, pp=2, gpus_per_host=4, seed=2,
                                           faults=parse_injects([spec])))
        out[name] = root / name
    # Heartbeats as the collector's sampler writes them (synth writes none): two hosts, one goes quiet.
    start = open_run(out["straggler"]).meta.start_ns or 0
    for host, samples in (("node00000", 20), ("node00001", 12)):
        rows = [{"host": host, "rank": None, "pid": None, "time_ns": start + i * 500_000_000, "device": "gpu0",
                 "metric": "gpu_util_pct", "value": 90.0 - i, "text": None} for i in range(samples)]
        rows.append({"host": host, "rank": None, "pid": None, "time_ns": start, "device": None, "metric": "log",
                     "value": None, "text": f"{host}: NCCL INFO ring 0 ready"})
        layout.write_part(out["straggler"], "heartbeats", pa.Table.from_pylist(rows, schema=schema.HEARTBEATS), host=host)
    return out


# The bundled trainer's hung sample run (a real gloo job), where the repository has it.
SAMPLE_HANG = Path(__file__).resolve().parents[2] / "sample_traces" / "hang"


@pytest.fixture(scope="module")
def site(runs: dict[str, Path]) -> Iterator[str]:
    dirs = [runs["straggler"], runs["hang"]] + ([SAMPLE_HANG] if SAMPLE_HANG.is_dir() else [])
    app = create_app(dirs, start_watcher=False)

    @app.server.route("/fake-perfetto-ui")
    def _fake_ui() -> flask.Response:
        return flask.Response(FAKE_PERFETTO_UI, mimetype="text/html")

    with serving(app) as base:
        app.server.config["MEGASCOPE_PERFETTO_UI"] = f"{base}/fake-perfetto-ui"
        yield base


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    with chromium() as browser:
        yield browser


def _no_errors(driver: Any) -> None:
    assert console_errors(driver) == []
    shown = [e.text for e in driver.find_elements(By.CSS_SELECTOR, ".notice-error")]
    assert shown == []


def _plot_data(driver: Any, graph_id: str) -> list[dict[str, Any]]:
    return driver.execute_script(  # type: ignore[no-any-return]
        "const g = document.querySelector('#' + arguments[0] + ' .js-plotly-plot');"
        "return g.data.map(t => ({name: t.name, text: t.text, type: t.type}));", graph_id)


def test_every_page_loads_without_console_errors(site: str, driver: Any) -> None:
    driver.get(f"{site}/run/straggler/overview")
    wait_for_text(driver, f"#{ids.OVERVIEW_CARDS}", "MFU")
    wait_for_text(driver, f"#{ids.OVERVIEW_ALERTS}", "Straggler: rank 5")
    wait_for_graph(driver, ids.OVERVIEW_GRAPH)
    _no_errors(driver)
    for page, graph in (("heatmap", ids.HEATMAP_GRAPH), ("topology", ids.TOPOLOGY_GRAPH),
                        ("timeline", ids.TIMELINE_GRAPH), ("health", ids.HEALTH_GRAPH)):
        driver.find_element(By.ID, f"nav-{page}").click()  # client-side navigation, as a person would
        wait_for_graph(driver, graph)
        assert urlsplit(driver.current_url).path == f"/run/straggler/{page}"
        _no_errors(driver)
    wait_for_text(driver, f"#{ids.HEALTH_HOSTS}", "node00001")
    wait_for_text(driver, f"#{ids.HEALTH_HOSTS}", "NCCL INFO ring 0 ready")
    # A GPU's metric: a line per host's GPU.
    assert {t["name"] for t in _plot_data(driver, ids.HEALTH_GRAPH)} == {"node00000 gpu0", "node00001 gpu0"}
    driver.get(f"{site}/run/straggler/stragglers")
    wait_for_text(driver, f"#{ids.STRAGGLER_TABLE}", "compute")
    wait_for_text(driver, f"#{ids.STRAGGLER_WHATIF}", " pts")  # the MFU gain card
    _no_errors(driver)
    driver.get(f"{site}/run/nope/overview")
    wait_for_text(driver, f"#{ids.PAGE}", "No such run")
    _no_errors(driver)


def test_heatmap_click_opens_the_timeline(site: str, driver: Any) -> None:
    driver.get(f"{site}/run/straggler/heatmap")
    wait_for_graph(driver, ids.HEATMAP_GRAPH)
    plot_area = driver.find_element(By.CSS_SELECTOR, f"#{ids.HEATMAP_GRAPH} .nsewdrag")
    ActionChains(driver).move_to_element(plot_area).click().perform()
    WebDriverWait(driver, 40).until(lambda d: "/run/straggler/timeline?" in d.current_url)
    wait_for_graph(driver, ids.TIMELINE_GRAPH)
    query = dict(part.split("=") for part in driver.current_url.split("?", 1)[1].split("&"))
    assert driver.find_element(By.ID, ids.TIMELINE_RANKS).get_attribute("value") == query["ranks"]
    assert driver.find_element(By.ID, ids.TIMELINE_STEPS).get_attribute("value") == query["steps"]
    title = driver.execute_script(
        f"return document.querySelector('#{ids.TIMELINE_GRAPH} .js-plotly-plot').layout.title.text")
    assert title.startswith(f"ranks {query['ranks']} · step {query['steps']}")
    _no_errors(driver)


@pytest.mark.parametrize("run_id", [
    "hang",
    pytest.param("hang-2", marks=pytest.mark.skipif(not SAMPLE_HANG.is_dir(), reason="no sample_traces/hang here")),
])
def test_hung_run_shows_the_culprit_on_the_topology(site: str, driver: Any, run_id: str) -> None:
    # Both runs plant the hang at rank 6 (pp=1 dp=1 tp=0): the synth one and the trainer's sample.
    driver.get(f"{site}/run/{run_id}/topology")
    banner = wait_for_text(driver, "#topology-culprit", "HANG: rank 6")
    assert "pp1 dp1 tp0" in banner.text
    wait_for_graph(driver, ids.TOPOLOGY_GRAPH)
    traces = _plot_data(driver, ids.TOPOLOGY_GRAPH)
    assert [t["text"] for t in traces if t["name"] == "suspect"] == [["rank 6"]]
    _no_errors(driver)


def test_open_in_perfetto_ui_sends_the_selected_trace(site: str, driver: Any) -> None:
    driver.get(f"{site}/run/straggler/timeline?ranks=4-5&steps=3")
    wait_for_graph(driver, ids.TIMELINE_GRAPH)
    link = driver.find_element(By.ID, ids.TIMELINE_DOWNLOAD_BUTTON).get_attribute("href")
    with urllib.request.urlopen(link) as response:
        expected = len(response.read())
    assert expected > 0
    main_window = driver.current_window_handle
    driver.find_element(By.ID, ids.TIMELINE_PERFETTO_BUTTON).click()
    WebDriverWait(driver, 20).until(lambda d: len(d.window_handles) == 2)
    ui = next(h for h in driver.window_handles if h != main_window)
    driver.switch_to.window(ui)
    try:
        WebDriverWait(driver, 40).until(lambda d: d.title.startswith("received"))
        assert driver.title.startswith(f"received {expected} megascope straggler ranks 4-5")
    finally:
        driver.close()
        driver.switch_to.window(main_window)
    wait_for_text(driver, f"#{ids.TIMELINE_PERFETTO_STATUS}", f"sent {expected:,} bytes")
    _no_errors(driver)


def test_live_run_shows_new_steps_without_reloading(runs: dict[str, Path], tmp_path: Path, driver: Any) -> None:
    live = tmp_path / "live"
    app = create_app([live], wait=True, poll_interval_s=0.5)
    stop = threading.Event()
    writer = threading.Thread(target=replay_run, args=(runs["straggler"], live),
                              kwargs={"step_interval_s": 2.5, "stop": stop})
    try:
        with serving(app) as base:
            driver.get(f"{base}/run/live/overview")
            driver.execute_script("window.__megascope_same_page = true;")
            writer.start()
            # The status line is redrawn each poll; on a loaded machine a poll can take longer than
            # a step, so a given step may never be shown: take the first step shown, then wait for
            # a later one and for step 4 or later, all on the same page.
            def shown(d: Any) -> int | None:
                found = re.findall(r"last step (\d+)", d.find_element(By.ID, ids.STATUS).text)
                return int(found[0]) if found else None

            first = WebDriverWait(driver, 60).until(shown)
            assert first < 9, f"the page first showed step {first}: the whole run, not a live one"
            WebDriverWait(driver, 60).until(lambda d: (shown(d) or 0) > max(first, 3))
            wait_for_graph(driver, ids.OVERVIEW_GRAPH)
            # Markers drawn in the first panel (MFU): one per step with timings. The status line and
            # the graph are separate callbacks, so the graph may still show an earlier poll: wait.
            points = f"#{ids.OVERVIEW_GRAPH} .scatterlayer .trace:first-child .point"
            WebDriverWait(driver, 60).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, points)) >= 4)
            assert driver.execute_script("return window.__megascope_same_page === true")
            _no_errors(driver)
    finally:
        stop.set()
        if writer.is_alive():
            writer.join(30)
        app.server.extensions["megascope"].stop()


def test_the_heat_map_maps_the_followed_steps_while_the_analyses_are_behind(tmp_path: Path, driver: Any) -> None:
    cfg = SynthConfig(ranks=32, steps=100, tp=2, pp=2, seed=9, faults=parse_injects(["straggler:rank=21,factor=1.5"]))
    job = LiveSynth(tmp_path / "lv", cfg, threads=1)
    job.write_step()
    app = create_app([job.out], start_watcher=False)
    served = registry_of(app).get("lv")
    assert served is not None
    served.follow()
    assert data.per_step(served)["step"].tolist() == [0]  # the analyses, as of the last full refresh
    job.write_step(3)  # three more steps the full refresh has not read; the follower has
    assert served.follow()
    try:
        with serving(app) as base:
            driver.get(f"{base}/run/lv/heatmap")
            wait_for_graph(driver, ids.HEATMAP_LIVE_GRAPH)
            assert driver.find_element(By.ID, ids.HEATMAP_LIVE).is_displayed()
            title = driver.execute_script(
                f"return document.querySelector('#{ids.HEATMAP_LIVE_GRAPH} .js-plotly-plot').layout.title.text")
            assert title == "compute, steps 0-3 (live)"
            # The worst rank of the compute map is the slow one: the trace's rows and colours.
            trace = driver.execute_script(
                f"const t = document.querySelector('#{ids.HEATMAP_LIVE_GRAPH} .js-plotly-plot')._fullData[0];"
                "return {y: Array.from(t.y), z: t.z.map(r => Array.from(r))};")
            rows = [max(v for v in row if v is not None) for row in trace["z"]]
            assert trace["y"][rows.index(max(rows))] == 21
            driver.find_element(By.CSS_SELECTOR, f"#{ids.HEATMAP_LIVE_PHASE} input[value='comm']").click()
            WebDriverWait(driver, 30).until(lambda d: d.execute_script(
                f"return document.querySelector('#{ids.HEATMAP_LIVE_GRAPH} .js-plotly-plot').layout.title.text")
                .startswith("communication"))
            _no_errors(driver)
    finally:
        job.close()
        app.server.extensions["megascope"].stop()
