"""Render an HTML file to a PNG with headless Chromium (e.g. a `tfm explain --html` page for docs/).

    python scripts/screenshot.py page.html docs/explain.png --size 1000,560

Fails with one line when chromium is missing or exits with an error, or writes no image.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def screenshot(page: Path, png: Path, size: str = "1000,560", timeout: float = 120.0) -> None:
    browser = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if browser is None:
        sys.exit(f"screenshot: error: no {', '.join(BROWSERS)} on PATH (Debian: apt-get install chromium)")
    if not page.is_file():
        sys.exit(f"screenshot: error: '{page}' does not exist")
    png.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as profile:  # a fresh profile: no state read or left behind
        cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               f"--user-data-dir={profile}", f"--screenshot={png.resolve()}", f"--window-size={size}",
               page.resolve().as_uri()]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        sys.exit(f"screenshot: error: {Path(browser).name} exited with {done.returncode}: {last}")
    if not png.is_file() or png.stat().st_size == 0:
        sys.exit(f"screenshot: error: {Path(browser).name} wrote no image to '{png}'")
    print(f"wrote {png} ({png.stat().st_size / 1024:.0f} KB)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("page", type=Path, help="HTML file to render")
    ap.add_argument("png", type=Path, help="where the PNG goes")
    ap.add_argument("--size", default="1000,560", help="window WIDTH,HEIGHT in pixels")
    args = ap.parse_args()
    screenshot(args.page, args.png, args.size)


if __name__ == "__main__":
    main()
