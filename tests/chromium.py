"""Debian's headless chromium driven by Playwright, for the browser tests.

Playwright's own browser downloads are not used: the tests drive ``/usr/bin/chromium``
(``apt-get install chromium chromium-driver``; ``make browser`` does it). A missing
browser is a test failure with that instruction, never a skip.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

CHROMIUM = Path(os.environ.get("GRADSTREAM_CHROMIUM", "/usr/bin/chromium"))
"""The browser binary (override with GRADSTREAM_CHROMIUM)."""

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@contextlib.contextmanager
def chromium_page(width: int = 1400, height: int = 1000) -> Iterator[object]:
    """A Playwright page in a fresh headless chromium profile (new ``--user-data-dir``).

    Raises:
        AssertionError: chromium is not installed (run ``make browser``).
    """
    assert CHROMIUM.exists(), (
        f"{CHROMIUM} is missing: install Debian's chromium with `make browser` "
        "(apt-get install -y chromium chromium-driver)"
    )
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="gradstream-chromium-") as profile, \
            sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            profile, executable_path=str(CHROMIUM), headless=True, args=FLAGS,
            viewport={"width": width, "height": height},
        )
        try:
            page = context.pages[0] if context.pages else context.new_page()
            yield page
        finally:
            context.close()


def image_stats(png: Path) -> tuple[float, int]:
    """(standard deviation of the pixel values, number of distinct colours) of a PNG."""
    import matplotlib.image as mpimg

    pixels = mpimg.imread(png)[..., :3]
    flat = (pixels.reshape(-1, 3) * 255).round().astype(np.int64)
    distinct = len(np.unique(flat[:, 0] << 16 | flat[:, 1] << 8 | flat[:, 2]))
    return float(pixels.std()), distinct
