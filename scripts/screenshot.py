"""Render an HTML file to a PNG with headless Chromium (e.g. a `tfm explain --html` page for docs/).

    python scripts/screenshot.py page.html docs/explain.png --size 1000,560

Fails with one line when chromium is missing, exits with an error, does not finish or writes no
image; an image already at the PNG's path is replaced only by a new one.
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
    name = Path(browser).name
    # a fresh profile: no state read or left behind; the image goes to a new folder beside `png` and
    # replaces it only once it is there, so an image from before is neither taken for this one's nor lost
    with tempfile.TemporaryDirectory() as profile, tempfile.TemporaryDirectory(dir=png.parent) as out:
        shot = Path(out) / png.name
        cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               f"--user-data-dir={profile}", f"--screenshot={shot.resolve()}", f"--window-size={size}",
               page.resolve().as_uri()]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            sys.exit(f"screenshot: error: {name} did not finish in {timeout:.0f} s")
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            sys.exit(f"screenshot: error: {name} exited with {done.returncode}: {last}")
        if not shot.is_file() or shot.stat().st_size == 0:
            sys.exit(f"screenshot: error: {name} wrote no image to '{png}'")
        shot.replace(png)
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
