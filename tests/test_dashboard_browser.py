"""End to end: the ``/monarch`` dashboard page in a real headless Chromium (Debian's ``chromium`` and
``chromium-driver``, driven with Selenium), on a running cluster with an active session.

The test reads what the browser shows: the rendered text of the page (Bokeh renders its tables inside shadow
roots, so the text is collected through them) and the rows of the page's Bokeh document as synchronized to the
browser. It saves screenshots to ``build/screenshots/``: ``monarch-dashboard.png`` (a live session) and
``monarch-dashboard-stuck.png`` (a rank made slow on purpose, flagged, with its stack). Skipped, with the reason,
when Chromium, its driver or Selenium is missing (``.ci/run`` installs them).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import dask
import pytest
import torch
from distributed import Client

import dask_monarch as dm
from dask_monarch.controller.task_keys import session_tag
from dask_monarch.dashboard.data import NO_SESSION

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOT = ROOT / "build" / "screenshots" / "monarch-dashboard.png"
STUCK_SCREENSHOT = ROOT / "build" / "screenshots" / "monarch-dashboard-stuck.png"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver") or ("/usr/bin/chromedriver" if Path("/usr/bin/chromedriver").exists()
                                                else None)
WAIT = 60.0

try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
except ImportError:  # pragma: no cover - the test extra installs it
    webdriver = None

pytestmark = [
    pytest.mark.skipif(webdriver is None, reason="selenium is not installed (pip install -e '.[test]')"),
    pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                       reason="chromium and chromium-driver are not installed (apt-get install -y chromium "
                              "chromium-driver; .ci/run does)"),
]

# All text on the page, including what Bokeh renders inside shadow roots (its tables and divs).
PAGE_TEXT_JS = """
function collect(node) {
  let text = '';
  if (node.shadowRoot) text += collect(node.shadowRoot);
  for (const child of node.childNodes) {
    if (child.nodeType === Node.TEXT_NODE) text += child.textContent + ' ';
    else if (child.nodeType === Node.ELEMENT_NODE && !['STYLE', 'SCRIPT'].includes(child.tagName)) text += collect(child);
  }
  return text;
}
return collect(document.body);
"""
# The page's rank rows as the browser holds them (the Bokeh document synchronized over the websocket).
RANK_ROWS_JS = """
if (!window.Bokeh || !Bokeh.documents || !Bokeh.documents.length) return null;
const source = Bokeh.documents[0].get_model_by_name('monarch-ranks-source');
if (!source) return null;
const rows = {};
for (const column of ['rank', 'worker', 'received', 'applied', 'state']) rows[column] = Array.from(source.data[column] || []);
return JSON.stringify(rows);
"""

# Every table header: its title, the title's rendered width and its column's (pixels).
HEADERS_JS = """
const out = [];
function walk(node) {
  if (node.shadowRoot) walk(node.shadowRoot);
  for (const child of node.children || []) {
    if (child.classList && child.classList.contains('slick-header-column')) {
      const name = child.querySelector('.slick-column-name') || child;
      out.push([name.textContent, name.scrollWidth, child.clientWidth]);
    }
    walk(child);
  }
}
walk(document.body);
return JSON.stringify(out);
"""


# The x values (ms) of the history lines, and the page's stacks and health text, as the browser holds them.
LINES_JS = """
if (!window.Bokeh || !Bokeh.documents || !Bokeh.documents.length) return null;
const doc = Bokeh.documents[0];
const out = {};
for (const key of ['rates', 'queued', 'held']) {
  const source = doc.get_model_by_name('monarch-' + key + '-source');
  out[key] = source ? Array.from(source.data.xs || []).map(xs => Array.from(xs)) : null;
}
return JSON.stringify(out);
"""


def add_one(x):
    return x + 1


def fail(x):
    raise ValueError("boom from the browser test")


def hold_rank_one(mesh, release: str, bound: float = 60.0):
    """Rank 1 sleeps until the file ``release`` exists (at most ``bound`` s); the other ranks return at once."""
    if mesh.dims["dp"].rank == 1:
        deadline = time.monotonic() + bound
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.05)


@pytest.fixture
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="monarch-chromium-")
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1600,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def wait_for(condition, what: str, driver, timeout: float = WAIT):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            text = " ".join(driver.execute_script(PAGE_TEXT_JS).split())
            text = text[max(0, text.find("dask_monarch")):]  # the page, after Dask's menu
            raise AssertionError(f"the page did not show {what} within {timeout:g} s; it shows:\n{text[:4000]}")
        time.sleep(0.25)


def rank_rows(driver) -> dict | None:
    rows = driver.execute_script(RANK_ROWS_JS)
    return json.loads(rows) if rows else None


def page_text_with(driver, *needles: str) -> str | None:
    """The page's text if it contains every one of ``needles``, else None."""
    text = driver.execute_script(PAGE_TEXT_JS)
    return text if all(n in text for n in needles) else None


@pytest.fixture
def client2():
    """A cluster of its own: the page's all-sessions view and its 'no session' text must show this test's session
    alone, not the sessions that other tests ran on the run's shared cluster."""
    from conftest import _cluster

    with _cluster(2) as cluster, Client(cluster) as client:
        yield client


def test_monarch_page_shows_live_session_in_chromium(client2, browser):
    port = client2.scheduler_info()["services"]["dashboard"]
    url = f"http://127.0.0.1:{port}/monarch"
    with dask.config.set({"monarch.dashboard.stuck-after": 1.0}):  # rank 1 is flagged after 1 s on one message
        mesh = dm.attach(client2, dims={"dp": 2}, comm_timeout=60)
    workers = [mesh.workers[r] for r in range(2)]
    tag = session_tag(mesh.session_id)
    release = Path(tempfile.mkdtemp(prefix="monarch-release-")) / "release"
    try:
        side = dm.Stream("side")
        with mesh.activate():
            x = dm.remote(torch.zeros)(4)
            with side.activate():
                dm.remote(torch.ones)(1)
        dm.inspect(x)  # both ranks have run the session's first messages
        time.sleep(2.0)  # heartbeats the scheduler samples with no page open
        opened = time.time() * 1000.0

        browser.get(url)
        # the rank rows appear, rendered in the table, with the workers' addresses and counters
        text = wait_for(lambda: page_text_with(browser, *workers), "a row per rank with its worker address", browser)
        assert mesh.session_id in text, "the sessions table does not show the session id"
        assert "dp=2" in text, "the sessions table does not show the mesh's dims"
        before = wait_for(lambda: (r := rank_rows(browser)) and len(r["rank"]) == 2 and min(r["received"]) > 0 and r,
                          "received counters above 0 on both ranks", browser)
        assert sorted(before["rank"]) == [0, 1]
        assert sorted(before["worker"]) == sorted(workers)
        assert set(before["state"]) == {"running"}

        # more work: the counters the browser shows grow, on every rank
        for _ in range(300):
            x = dm.remote(add_one)(x)
        assert dm.inspect(x).tolist() == [300.0] * 4
        after = wait_for(
            lambda: (r := rank_rows(browser)) and all(
                a >= b + 300 for a, b in zip(r["received"], before["received"])) and r,
            "received counters grown by the 300 more messages", browser,
        )
        # nothing more is sent: the table settles on the new counts and renders them
        wait_for(lambda: page_text_with(browser, *(f"{n:,}" for n in after["received"])),
                 f"the new received counts {after['received']} in the table", browser)

        # streams by their names; no header cut, also in a narrow window (the tables scroll instead)
        wait_for(lambda: page_text_with(browser, "main: 0, side: 0"), "the streams by name", browser)
        for width in (1600, 1024):
            browser.set_window_size(width, 1000)
            headers = wait_for(lambda: json.loads(browser.execute_script(HEADERS_JS)), "the table headers", browser)
            cut = [(title, text, column) for title, text, column in headers if text + 4 > column]
            assert len(headers) >= 20 and not cut, f"headers cut at a {width} px window: {cut}"

        # a remote error: in the list, with its seq and rank, and counted on the health line
        with mesh.activate():
            bad = dm.remote(fail, propagate=lambda x: torch.empty_like(x))(x)
        with pytest.raises(dm.RemoteException, match="boom from the browser test"):
            dm.inspect(bad)
        wait_for(lambda: page_text_with(browser, "ValueError: boom from the browser test", "2 remote errors"),
                 "the remote error in the list and on the health line", browser)
        # health at the top, with the links to Dask's pages and to the session's view
        wait_for(lambda: page_text_with(browser, f"{tag} running", "msg/s", "Task Stream", "Workers", "Profile"),
                 "the session's health line with its links", browser)
        # history from before the page was opened, in each of the three plots
        lines = json.loads(browser.execute_script(LINES_JS))
        for key in ("rates", "queued", "held"):
            before_open = [x for xs in lines[key] for x in xs if x < opened]
            assert len(before_open) >= 4, f"{key}: no history from before the page opened ({lines[key]})"

        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        browser.set_window_size(1600, 1000)
        assert browser.save_screenshot(str(SCREENSHOT)), "could not save the screenshot"
        assert SCREENSHOT.stat().st_size > 10_000

        # a rank made slow on purpose: flagged STUCK, its stack naming the sleeping function, shown as behind
        with mesh.activate():
            dm.remote(hold_rank_one, propagate="inspect")(mesh, str(release))
            x = x + 1
        mesh._session.flush()
        text = wait_for(lambda: page_text_with(browser, "STUCK", "hold_rank_one", "time.sleep", "stuck: rank 1",
                                               "slowest rank 1"), "rank 1 flagged with its stack", browser)
        assert "CallFunction seq" in text
        # the session's own view (mesh.dashboard_link) shows it too
        browser.get(mesh.dashboard_link)
        wait_for(lambda: page_text_with(browser, f"Session {tag}.", "STUCK", "hold_rank_one", "all sessions"),
                 "the session's own view with the stuck rank", browser)
        browser.set_window_size(1600, 2400)
        assert browser.save_screenshot(str(STUCK_SCREENSHOT)), "could not save the screenshot"
        assert STUCK_SCREENSHOT.stat().st_size > 10_000
        release.touch()
        assert dm.inspect(x).tolist() == [301.0] * 4
        wait_for(lambda: (t := page_text_with(browser, "No rank is stuck")) and "STUCK" not in t,
                 "the flag cleared once rank 1 moved on", browser)
        browser.get(url)
    finally:
        release.touch()
        mesh.exit()

    # the session ended: the page says so instead of showing empty tables
    wait_for(lambda: page_text_with(browser, NO_SESSION.split(".")[0]),
             "that no session is running", browser)
