"""Drive the dashboard in real headless Chromium (Debian's chromium + chromedriver) for tests and screenshots.

``serving(app)`` runs a Dash app on a free loopback port in a thread; ``chromium()`` starts a
headless browser with a fresh profile and console logging on; ``console_errors(driver)`` returns
the SEVERE console lines since the last call.

Screenshots for the docs (small PNGs)::

    python tests/browser/dashboard_harness.py docs/img
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import WebDriverWait
from werkzeug.serving import make_server

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage")


def browser_available() -> bool:
    return Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()


@contextlib.contextmanager
def serving(app: Any) -> Iterator[str]:
    """The app's base URL while a server thread answers on 127.0.0.1 (a free port)."""
    server = make_server("127.0.0.1", 0, app.server, threaded=True)
    thread = threading.Thread(target=server.serve_forever, name="dash-test-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join(10)
        server.server_close()


@contextlib.contextmanager
def chromium(width: int = 1400, height: int = 1000) -> Iterator[webdriver.Chrome]:
    profile = tempfile.mkdtemp(prefix="megascope-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    options.add_argument(f"--window-size={width},{height}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def console_errors(driver: webdriver.Chrome) -> list[str]:
    """SEVERE browser-console lines since the last call (reading the log empties it)."""
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


@pytest.fixture(autouse=True)
def own_console(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test reads only its own page's console: a module shares one browser, and a page left
    open when its test's server shut down logs refused requests into the next test's log. Import
    it into a browser test module to have it there."""
    browser = request.getfixturevalue("driver") if "driver" in request.fixturenames else None
    if browser is not None:
        console_errors(browser)
    yield
    if browser is not None:
        browser.get("about:blank")
        console_errors(browser)


def wait_for_text(driver: webdriver.Chrome, css: str, text: str, timeout: float = 40) -> Any:
    """The first element matching ``css`` once its text contains ``text``."""
    try:
        WebDriverWait(driver, timeout).until(ec.text_to_be_present_in_element((By.CSS_SELECTOR, css), text))
    except TimeoutException:
        raise AssertionError(f"{text!r} never appeared in {css} of {driver.current_url}; the page says:\n"
                             f"{driver.find_element(By.TAG_NAME, 'body').text[:3000]}") from None
    return driver.find_element(By.CSS_SELECTOR, css)


def wait_for_graph(driver: webdriver.Chrome, graph_id: str, timeout: float = 40) -> Any:
    """A dcc.Graph once plotly has drawn its first trace."""
    css = f"#{graph_id} .js-plotly-plot .plot-container .main-svg"
    try:
        WebDriverWait(driver, timeout).until(
            lambda d: d.execute_script(
                "const g = document.querySelector(arguments[0] + ' .js-plotly-plot');"
                "return !!(g && g.data && g.data.length);", f"#{graph_id}")
        )
    except TimeoutException:
        raise AssertionError(f"graph {graph_id} never drew on {driver.current_url}; the page says:\n"
                             f"{driver.find_element(By.TAG_NAME, 'body').text[:3000]}") from None
    return driver.find_element(By.CSS_SELECTOR, css)


def screenshots(out_dir: Path) -> list[Path]:
    """One PNG per page at 1600x1000: a seeded 2x2x2 straggler run, the heat-map of a 1,024-rank
    run with a 1.15x straggler, and the topology of a hung run."""
    from megascope.dashboard import create_app, ids

    from megascope.inject import parse_injects
    from megascope.synth import SynthConfig, synth_run

    out_dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="megascope-shots-"))
    synth_run(root / "straggler", SynthConfig(ranks=8, steps=24, tp=2, pp=2, gpus_per_host=4, seed=1,
                                              faults=parse_injects(["straggler:rank=5,factor=1.4"])))
    synth_run(root / "hang", SynthConfig(ranks=64, steps=10, tp=4, pp=4, seed=1,
                                         faults=parse_injects(["hang:rank=37,step=6"])))
    synth_run(root / "big", SynthConfig(ranks=1024, steps=20, tp=8, pp=8, seed=1,
                                        faults=parse_injects(["straggler:rank=77,factor=1.15"])))
    # Real heartbeats of this machine under the run's two host names (synth writes none).
    from megascope.collectors.heartbeat import HeartbeatSampler

    samplers = [HeartbeatSampler(root / "straggler", rank=None, host=f"node{h:05d}", interval_s=0.2,
                                 flush_interval_s=0.5, nvml=False) for h in (0, 1)]
    for sampler in samplers:
        sampler.start()
    time.sleep(6)
    for sampler in samplers:
        sampler.stop()
    app = create_app([root / "straggler", root / "hang", root / "big"], start_watcher=False)
    graphs = {"overview": ids.OVERVIEW_GRAPH, "heatmap": ids.HEATMAP_GRAPH, "topology": ids.TOPOLOGY_GRAPH,
              "timeline": ids.TIMELINE_GRAPH, "health": ids.HEALTH_GRAPH}
    shots = [("straggler", p) for p in ("overview", "stragglers", "timeline", "health")] + \
            [("big", "heatmap"), ("hang", "topology")]
    written = []
    try:
        _shoot(app, shots, graphs, out_dir, written)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return written


def _shoot(app: Any, shots: list[tuple[str, str]], graphs: dict[str, str], out_dir: Path,
           written: list[Path]) -> None:
    from megascope.dashboard import ids

    with serving(app) as base, chromium(1600, 1000) as driver:
        for run_id, page in shots:
            driver.get(f"{base}/run/{run_id}/{page}")
            if page in graphs:
                wait_for_graph(driver, graphs[page])
            else:
                wait_for_text(driver, f"#{ids.STRAGGLER_TABLE}", "node")
            driver.execute_script("return new Promise(r => setTimeout(r, 800))")
            path = out_dir / f"{page}.png"
            driver.save_screenshot(str(path))
            written.append(path)


if __name__ == "__main__":
    for shot in screenshots(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/img")):
        sys.stdout.write(f"{shot}\n")
