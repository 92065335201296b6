"""The tree keeps ruff's rules (pyproject.toml), the 120-character line limit among them."""

import subprocess
import sys

import pytest
from conftest import REPO


def test_the_tree_keeps_ruffs_rules():
    pytest.importorskip("ruff")  # in the dev extra, which CI installs
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
