"""Headless Chromium driven by Selenium: how the live view's browser test and screenshot tool
(`tests/test_15_dashboard_browser.py`, `tools/dashboard_screenshot.py`) open a page.

Debian's `chromium` and `chromium-driver` (`make browser`) and selenium (a dev dependency).
Selenium Manager is kept offline: the driver is the installed one, never a download.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

INSTALL_HINT = "apt-get install chromium chromium-driver (Debian; `make browser` runs it)"


def missing() -> str | None:
    """What is missing to open a page, or None."""
    if shutil.which("chromium") is None or shutil.which("chromedriver") is None:
        return f"no Chromium or no chromedriver here: {INSTALL_HINT}"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (a dev dependency: pip install -e '.[dev]')"
    return None


def headless_chromium(width: int = 1400, height: int = 1000) -> Any:
    """A headless Chromium of `width` x `height` pixels; RuntimeError saying what is missing."""
    if (reason := missing()) is not None:
        raise RuntimeError(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", f"--window-size={width},{height}"):  # fmt: skip
        options.add_argument(argument)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
