"""A run's output directory: one run at a time, a full disk, and resuming from the directory alone."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CONFIGS, REPO, tiny_config

from transformer_cli.errors import TfmError
from transformer_cli.evaluate import predict_texts
from transformer_cli.training.classify import train
from transformer_cli.training.run import lock_output_dir, release_output_dirs


def tfm(*args, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "transformer_cli", *map(str, args)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


def tiny_train_args(data: Path, out: Path, *extra) -> list:
    return ["train", "--config", CONFIGS / "tiny.toml", "--data", data, "-o", out, "--device", "cpu", "--no-progress",
            *extra]


def listing(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*")}


def test_a_run_into_a_directory_in_use_is_refused_and_touches_nothing(synthetic_data_dir, tmp_path):
    out = tmp_path / "run"
    lock_output_dir(out)  # as a run in progress holds it
    try:
        before = listing(out)
        p = tfm(*tiny_train_args(synthetic_data_dir, out))
        _, err = p.communicate(timeout=120)
        assert p.returncode == 1, err
        assert err.strip().splitlines() == [f"tfm: error: output directory '{out}' is in use by another tfm run; "
                                            + "wait for it to end, or choose another --output-dir"]
        assert listing(out) == before
    finally:
        release_output_dirs()


@pytest.mark.slow
def test_two_runs_started_together_leave_one_whole_model(synthetic_data_dir, tmp_path):
    out = tmp_path / "run"
    runs = [tfm(*tiny_train_args(synthetic_data_dir, out, f"train.seed={seed}")) for seed in (1, 2)]
    codes = [p.wait(timeout=180) for p in runs]
    errors = [p.stderr.read() for p in runs]
    assert sorted(codes) in ([0, 1], [0, 2]), errors  # the other is refused: in use (1), or already holds a run (2)
    winner = codes.index(0)
    seed = json.loads((out / "config.json").read_text())["train"]["seed"]
    assert seed == (1, 2)[winner]
    assert predict_texts(out, ["a great film"], device="cpu")[0]["label"] in ("0", "1", "neg", "pos")


def test_a_full_disk_names_the_file_and_keeps_the_last_checkpoint(synthetic_data_dir, tmp_path, monkeypatch):
    """A write that fails with ENOSPC after the first checkpoint: one line that names the file and says how to go
    on; the checkpoint before it is whole, and --resume then finishes the run."""
    from transformer_cli import fileio

    cfg = tiny_config(synthetic_data_dir, tmp_path / "run", train__checkpoint_every=10)
    real_fsync, calls = os.fsync, {"n": 0}

    def fsync(fd):
        if (tmp_path / "run" / "checkpoints").is_dir() and any((tmp_path / "run" / "checkpoints").glob("step-*")):
            calls["n"] += 1
            if calls["n"] > 3:  # a few writes after the first checkpoint
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(fileio.os, "fsync", fsync)
    with pytest.raises(TfmError) as e:
        train(cfg, progress=False)
    monkeypatch.undo()
    message = str(e.value)
    assert message.startswith("no space left on device writing '") and str(tmp_path / "run") in message
    assert "is intact: free some space, then run the same command with --resume" in message
    metrics = train(cfg, resume=True, progress=False)
    assert metrics["epochs"] == 2  # tiny.toml's


@pytest.mark.slow
def test_resume_with_the_output_directory_alone_continues_the_run(synthetic_data_dir, tmp_path):
    """Started with --config, --data and overrides; stopped by SIGINT after a checkpoint; `tfm train --resume -o RUN`
    finds everything else in the run's config.json, and says where it resumes."""
    out = tmp_path / "run"
    p = tfm(*tiny_train_args(synthetic_data_dir, out, "train.epochs=40", "train.checkpoint_every=20",
                             "model.d_model=48"))
    deadline = time.monotonic() + 120
    while not any((out / "checkpoints").glob("step-*")) and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    r = subprocess.run([sys.executable, "-m", "transformer_cli", "train", "--resume", "-o", str(out)], check=False,
                       cwd=REPO,
                       capture_output=True, text=True, timeout=300, env={**os.environ, "TFM_DATA": "nowhere/imdb"})
    assert r.returncode == 0, r.stderr
    assert "resuming from step " in r.stderr + r.stdout
    saved = json.loads((out / "config.json").read_text())
    assert saved["model"]["d_model"] == 48 and saved["data"]["source"] == str(synthetic_data_dir)
    assert json.loads((out / "metrics.json").read_text())["epochs"] == 40
