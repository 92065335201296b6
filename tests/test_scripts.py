"""scripts/reproduce_imdb.py end to end on the synthetic data, with the recipes shrunk to seconds."""

import json
import subprocess
import sys

from conftest import REPO

SHRINK = ["train.max_steps=3", "data.max_length=64", "data.vocab_size=500", "train.eval_batch_size=64"]


def test_reproduce_trains_evaluates_and_tabulates_each_seed(synthetic_data_dir, tmp_path):
    cmd = [sys.executable, str(REPO / "scripts" / "reproduce_imdb.py"), "--data", str(synthetic_data_dir),
           "--out", str(tmp_path / "runs"), "--recipes", "quick", "--seeds", "1", "2",
           "--results-dir", str(tmp_path / "results"), *SHRINK]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    rows = [line for line in first.stdout.splitlines() if line.startswith("| quick |")]
    assert [r.split("|")[2].strip() for r in rows] == ["1", "2"]
    for seed, row in zip((1, 2), rows):
        test = json.loads((tmp_path / "results" / f"quick-s{seed}.json").read_text())
        assert test == json.loads((tmp_path / "runs" / f"quick-s{seed}" / "test.json").read_text())
        assert test["num_examples"] == 200 and f"{test['accuracy']:.2%}" in row
    assert "quick: test accuracy" in first.stdout and "over 2 seeds" in first.stdout

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)  # finished runs are not repeated
    assert again.returncode == 0 and "$ " not in again.stdout
    assert [line for line in again.stdout.splitlines() if line.startswith("| quick |")] == rows
