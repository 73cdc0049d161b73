"""Debian's headless Chromium, driven through its matching `chromium-driver` by
Selenium, for the tests that load the console in a real browser."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from selenium import webdriver
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

WAIT_S = 20  # hang guard for a page to render


def _binary(*names: str) -> str:
    for name in names:
        found = shutil.which(name) or (Path("/usr/bin") / name).as_posix()
        if Path(found).exists():
            return found
    raise RuntimeError(f"none of {names} is installed: run `make sysdeps`")


def chromium(*args: str) -> WebDriver:
    """A headless Chromium (and `args` beside the usual ones); the caller quits it."""
    options = webdriver.ChromeOptions()
    options.binary_location = _binary("chromium", "chromium-browser")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", *args):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(_binary("chromedriver")), options=options)
    driver.set_page_load_timeout(WAIT_S)
    return driver


def until(driver: WebDriver, what: Callable[[WebDriver], Any]) -> Any:
    """`what(driver)` once it is true, tried every 0.1 s for `WAIT_S` (an element not
    there yet, or replaced while read, counts as not yet)."""

    def probe(d: WebDriver) -> Any:
        try:
            return what(d)
        except (NoSuchElementException, StaleElementReferenceException):
            return False

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(probe)
