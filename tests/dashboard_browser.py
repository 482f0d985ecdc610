"""Headless Chromium (Debian's ``chromium`` + ``chromium-driver``, driven by selenium) loading the
manager's dashboard: shared by tests/test_dashboard.py and tests/test_manager_e2e.py.

No sleeps: every wait is selenium's ``WebDriverWait`` on a DOM condition, with a timeout.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"

# The machine's network is closed: without these Chromium keeps dialling update, sync and
# field-trial servers (refused connections, seconds of start-up).
_FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--disable-dev-shm-usage",
    "--window-size=1400,1500",
]


def missing_browser() -> str | None:
    """Why the browser tests cannot run here, or None."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    for path in (CHROMIUM, CHROMEDRIVER):
        if not Path(path).is_file():
            return f"{path} is missing: apt-get install chromium chromium-driver (scripts/setup.sh --tests)"
    return None


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium with a fresh profile, quit and its profile removed afterwards."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="varuna-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*_FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        driver.set_page_load_timeout(60)
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def load_dashboard(
    driver: Any, url: str, token: str, job_id: str, *, timeout_s: float = 60.0, screenshot: Path | None = None
) -> dict[str, Any]:
    """Open the dashboard with the token, wait until ``job_id`` is drawn with every chart, and
    return what the page shows: P×D text, morph annotations, VM and event rows, trace counts
    (and save a screenshot of the whole page to ``screenshot``)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(f"{url}?token={token}#{job_id}")
    charts = ("pxd-chart", "throughput-chart", "loss-chart", "gantt-chart")

    def drawn(d: Any) -> bool:
        body = d.find_element(By.TAG_NAME, "body")
        if body.get_attribute("data-job") != job_id or not body.get_attribute("data-renders"):
            return False
        return all(d.find_elements(By.CSS_SELECTOR, f"#{c} .main-svg") for c in charts)

    WebDriverWait(driver, timeout_s, poll_frequency=0.2).until(drawn)
    seen: dict[str, Any] = {
        "pxd": driver.find_element(By.ID, "pxd").text,
        "state": driver.find_element(By.ID, "job-state").text,
        "address": driver.current_url,
        "morph_labels": [
            e.text for e in driver.find_elements(By.CSS_SELECTOR, "#pxd-chart .annotation-text")
        ],
        "vm_rows": [
            [td.text for td in tr.find_elements(By.TAG_NAME, "td")]
            for tr in driver.find_elements(By.CSS_SELECTOR, "#vms tbody tr")
        ],
        "event_kinds": [
            tr.find_elements(By.TAG_NAME, "td")[2].text
            for tr in driver.find_elements(By.CSS_SELECTOR, "#events tbody tr")
        ],
        "points": {
            c: len(driver.find_elements(By.CSS_SELECTOR, f"#{c} .scatterlayer .point"))
            for c in ("throughput-chart", "loss-chart")
        },
        "gantt_bars": len(driver.find_elements(By.CSS_SELECTOR, "#gantt-chart .barlayer .point")),
        "problem": driver.find_element(By.ID, "problem").text,
        "console_errors": [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"],
    }
    if screenshot is not None:
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(1400, max(900, int(height) + 40))
        WebDriverWait(driver, timeout_s, poll_frequency=0.2).until(drawn)
        seen["screenshot"] = driver.save_screenshot(str(screenshot))
    return seen
