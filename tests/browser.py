"""Headless Chromium for the tests that open chipledger's HTML pages (one browser per test session, started
by the `browser` fixture in conftest.py). scripts/chromium.sh installs Debian's chromium and chromium-driver;
without them the tests skip loudly, or fail with CHIPLEDGER_REQUIRE_CHROMIUM=1 (CI)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

REQUIRE_ENV = "CHIPLEDGER_REQUIRE_CHROMIUM"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1280,900")


class ChromiumUnavailable(RuntimeError):
    pass


def required() -> bool:
    return os.environ.get(REQUIRE_ENV) == "1"


def find() -> tuple[str, str]:
    """The browser and the WebDriver executables, looked up as scripts/chromium.sh does."""
    browser = os.environ.get("CHIPLEDGER_CHROMIUM") or next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    driver = os.environ.get("CHIPLEDGER_CHROMEDRIVER") or shutil.which("chromedriver")
    if not browser or not os.access(browser, os.X_OK):
        raise ChromiumUnavailable("no chromium executable (run `bash scripts/chromium.sh ensure` as root, or "
                                  "apt-get install chromium chromium-driver)")
    if not driver or not os.access(driver, os.X_OK):
        raise ChromiumUnavailable("no chromedriver executable (apt-get install chromium-driver)")
    try:
        import selenium  # noqa: F401
    except ImportError:
        raise ChromiumUnavailable("the selenium package is not installed (pip install -e '.[test]')") from None
    return browser, driver


class Browser:
    """One headless Chromium with a fresh profile; `open(path)` loads a local file and returns the driver."""

    def __init__(self) -> None:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        browser, driver = find()
        self.profile = tempfile.mkdtemp(prefix="chipledger-chromium-")
        opts = webdriver.ChromeOptions()
        opts.binary_location = browser
        for flag in FLAGS:
            opts.add_argument(flag)
        opts.add_argument(f"--user-data-dir={self.profile}")
        # an alert left open would make every later call raise: keep it open for the test to see, then dismiss
        opts.set_capability("unhandledPromptBehavior", "ignore")
        self.driver = webdriver.Chrome(options=opts, service=Service(executable_path=driver))
        self.driver.set_page_load_timeout(30)

    def open(self, path: Path):
        self.driver.get(Path(path).resolve().as_uri())
        return self.driver

    def alert_text(self):
        """The text of an open alert/confirm/prompt dialog (dismissed), or None."""
        from selenium.common.exceptions import NoAlertPresentException

        try:
            alert = self.driver.switch_to.alert
        except NoAlertPresentException:
            return None
        text = alert.text
        alert.dismiss()
        return text

    def close(self) -> None:
        try:
            self.driver.quit()
        finally:
            shutil.rmtree(self.profile, ignore_errors=True)
