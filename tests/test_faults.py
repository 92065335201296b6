"""Faults during training, each with its expected outcome: NaN steps, a full disk, SIGKILL during
checkpoint writes, changed settings on resume, and exact resume with dropout (RNG restore)."""

import errno
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from safetensors.torch import load_file
from typer.testing import CliRunner

from transformer_cli import checkpoint as ckpt
from transformer_cli import train as train_mod
from transformer_cli.cli import app
from transformer_cli.errors import TfmError
from transformer_cli.model import CTransformer
from transformer_cli.train import train


def nan_on(calls: set[int] | None, monkeypatch) -> list[int]:
    """Make training's cross-entropy return NaN on the given call numbers (all if None)."""
    real = train_mod.F.cross_entropy
    seen = []

    def fake(logits, target, **kw):
        loss = real(logits, target, **kw)
        if kw.get("reduction", "mean") == "mean":  # training; evaluation sums
            seen.append(len(seen))
            if calls is None or seen[-1] in calls:
                return loss * float("nan")
        return loss

    monkeypatch.setattr(train_mod.F, "cross_entropy", fake)
    return seen


def test_nan_steps_are_skipped_and_counted(tiny_cfg, monkeypatch):
    nan_on({3, 4, 11}, monkeypatch)
    metrics = train(tiny_cfg, progress=False)
    assert metrics["bad_steps"] == 3
    out = Path(tiny_cfg.train.output_dir)
    assert all(torch.isfinite(t).all() for t in load_file(out / ckpt.MODEL_FILE).values())
    assert math.isfinite(metrics["val"]["loss"])


def test_nan_every_step_stops_training_with_a_clear_error(synthetic_data_dir, tmp_path, monkeypatch):
    cfg = tiny_config(synthetic_data_dir, tmp_path / "run", train__max_bad_steps=3)
    nan_on(None, monkeypatch)
    with pytest.raises(TfmError, match="diverged: 3 steps in a row"):
        train(cfg, progress=False)
    model = Path(cfg.train.output_dir) / ckpt.MODEL_FILE
    assert not model.exists()  # nothing was ever good enough to be saved as the best model


def test_disk_full_during_a_checkpoint_keeps_the_previous_one(synthetic_data_dir, tmp_path, monkeypatch):
    out = tmp_path / "run"
    real = ckpt.atomic_write_bytes

    def full_disk(path, data):
        if Path(path).parent.name.startswith(".step-00000020"):  # the second checkpoint
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, data)

    monkeypatch.setattr(ckpt, "atomic_write_bytes", full_disk)
    result = CliRunner().invoke(app, ["train", "--config", "configs/tiny.toml", "--data", str(synthetic_data_dir),
                                      "-o", str(out), "--no-progress", "train.checkpoint_every=10"])
    assert result.exit_code == 1
    assert result.stderr.strip().count("\n") == 0 and "No space left on device" in result.stderr
    assert "Traceback" not in result.stderr
    (last,) = ckpt.checkpoint_dirs(out)
    assert last.name == "step-00000010"
    ckpt.load_checkpoint(last)
    assert not list((out / ckpt.CKPT_DIR).glob(".step-*"))


@pytest.mark.parametrize(("change", "field"), [("--seed=7", "train.seed"), ("--batch-size=8", "train.batch_size")])
def test_changed_settings_on_resume_are_refused_unless_forced(synthetic_data_dir, tmp_path, change, field):
    base = ["train", "--config", "configs/tiny.toml", "--data", str(synthetic_data_dir), "-o", str(tmp_path / "r"),
            "--no-progress", "--epochs", "1"]
    assert CliRunner().invoke(app, base).exit_code == 0
    refused = CliRunner().invoke(app, [*base, change, "--resume"])
    assert refused.exit_code == 2 and field in refused.stderr and "--force" in refused.stderr
    assert CliRunner().invoke(app, [*base, change, "--resume", "--force"]).exit_code == 0


def test_exact_resume_with_dropout_restores_the_random_streams(synthetic_data_dir, tmp_path):
    def cfg(name):
        return tiny_config(synthetic_data_dir, tmp_path / name, model__dropout=0.2, train__checkpoint_every=7,
                           train__keep_checkpoints=100)

    train(cfg("full"), progress=False)
    # A copy of the uninterrupted run cut back to its mid-epoch checkpoint at step 14, then resumed.
    split = tmp_path / "split"
    shutil.copytree(tmp_path / "full", split)
    for d in ckpt.checkpoint_dirs(split):
        if int(d.name.split("-")[1]) > 14:
            shutil.rmtree(d)
    (split / ckpt.MODEL_FILE).unlink()
    (split / ckpt.METRICS_FILE).unlink()
    train(cfg("split"), resume=True, progress=False)
    a = load_file(ckpt.checkpoint_dirs(split)[-1] / ckpt.MODEL_FILE)
    b = load_file(ckpt.checkpoint_dirs(tmp_path / "full")[-1] / ckpt.MODEL_FILE)
    assert all(a[k].equal(b[k]) for k in a)
    _, state_a = ckpt.load_checkpoint(ckpt.checkpoint_dirs(split)[-1])
    _, state_b = ckpt.load_checkpoint(ckpt.checkpoint_dirs(tmp_path / "full")[-1])
    for sa, sb in zip(state_a["optimizer"]["state"].values(), state_b["optimizer"]["state"].values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_sigkill_during_checkpoint_writes_never_breaks_the_latest_checkpoint(synthetic_data_dir, tmp_path):
    rng = random.Random(0)
    cmd = [sys.executable, "-m", "transformer_cli", "train", "--config", "configs/tiny.toml", "--data",
           str(synthetic_data_dir), "--no-progress", "--epochs", "50", "train.checkpoint_every=1"]
    for trial in range(20):
        out = tmp_path / f"t{trial}"
        proc = subprocess.Popen([*cmd, "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not ckpt.checkpoint_dirs(out):  # the folder exists while the first one is being written
            assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        found = ckpt.checkpoint_dirs(out)
        assert found, f"trial {trial}: no complete checkpoint"
        assert all((d / ckpt.COMPLETE).is_file() for d in (out / ckpt.CKPT_DIR).glob("step-*"))
        ckpt.load_checkpoint(found[-1])
        vocab = json.loads((out / ckpt.CONFIG_FILE).read_text())["vocab_size"]
        model = CTransformer(tiny_config(synthetic_data_dir, out).model, vocab, 64)
        ckpt.load_weights(model, found[-1] / ckpt.MODEL_FILE)
        if trial % 5 == 0:
            next_steps = str(int(found[-1].name.split("-")[1]) + 2)  # a short continuation
            r = subprocess.run([*cmd, "--max-steps", next_steps, "--force", "--resume", "-o", str(out)],
                               capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stderr[-500:]
            assert not [p for p in out.rglob("*") if ".tmp" in p.name]


def test_the_examples_after_a_resume_are_those_the_uninterrupted_run_would_see(synthetic_data_dir, tmp_path,
                                                                                monkeypatch):
    real_collate, real_lr_at = train_mod.collate, train_mod.lr_at
    seen: list[list[int]] = []

    def recording_collate(enc, idx):
        if enc is recording_collate.train_split:
            seen.append(sorted(int(i) for i in idx))
        return real_collate(enc, idx)

    def run(name, stop_at=None, resume=False):
        cfg = tiny_config(synthetic_data_dir, tmp_path / name)
        original_setup = train_mod.setup

        def setup(*a, **kw):
            r = original_setup(*a, **kw)
            recording_collate.train_split = r.train
            return r

        def lr_at(step, total, tc):
            if step == stop_at:
                os.kill(os.getpid(), signal.SIGTERM)  # the trainer finishes this step, then stops
            return real_lr_at(step, total, tc)

        monkeypatch.setattr(train_mod, "setup", setup)
        monkeypatch.setattr(train_mod, "collate", recording_collate)
        monkeypatch.setattr(train_mod, "lr_at", lr_at)
        try:
            train(cfg, resume=resume, progress=False)
        except train_mod.Interrupted:
            pass
        finally:
            monkeypatch.undo()

    run("full")
    full, seen[:] = list(seen), []
    run("split", stop_at=30)  # step 31 of 46 lies in the second epoch
    before = list(seen)
    seen[:] = []
    run("split", resume=True)
    assert len(before) == 31 and before + seen == full  # none repeated, none skipped


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_tfm_train_checkpoints_and_exits_with_its_code(synthetic_data_dir, tmp_path, sig, code):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "transformer_cli", "train", "--config", "configs/tiny.toml", "--data",
           str(synthetic_data_dir), "--no-progress", "--epochs", "500", "-o", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (out / ckpt.CKPT_DIR).is_dir():
        assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
        time.sleep(0.05)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code
    (line,) = stderr.strip().splitlines()
    assert line.startswith("tfm: error: stopped by") and "--resume" in line
    assert ckpt.checkpoint_dirs(out)[-1].name in line


def _truncate_weights(d: Path) -> None:
    data = (d / ckpt.MODEL_FILE).read_bytes()
    (d / ckpt.MODEL_FILE).write_bytes(data[: len(data) // 2])


def _future_version(d: Path) -> None:
    meta = json.loads((d / ckpt.CONFIG_FILE).read_text())
    (d / ckpt.CONFIG_FILE).write_text(json.dumps({**meta, "format_version": 999}))


@pytest.mark.parametrize(("damage", "command", "fragment"), [
    (_truncate_weights, "evaluate", "damaged"),
    (_truncate_weights, "predict", "damaged"),
    (_future_version, "evaluate", "format version 999"),
    (_future_version, "predict", "format version 999"),
], ids=["truncated-evaluate", "truncated-predict", "version-evaluate", "version-predict"])
def test_a_damaged_or_incompatible_model_directory_fails_cleanly(trained_dir, tmp_path, damage, command, fragment):
    d = tmp_path / "model"
    shutil.copytree(trained_dir, d)
    damage(d)
    args = [command, "-c", str(d)] + (["some review"] if command == "predict" else [])
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("tfm: error:") and fragment in line


@pytest.mark.parametrize("command", ["train", "evaluate"])
def test_a_missing_data_path_is_a_usage_error(trained_dir, tmp_path, command):
    args = (["train", "-o", str(tmp_path / "out")] if command == "train" else ["evaluate", "-c", str(trained_dir)])
    result = CliRunner().invoke(app, [*args, "--data", str(tmp_path / "no" / "such" / "data")])
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert "does not exist" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("stop_step", [22, 45], ids=["last-step-of-epoch-1", "last-step-of-run"])
def test_a_stop_on_the_last_step_of_an_epoch_keeps_its_validation(trained_run, tiny_cfg, monkeypatch, stop_step):
    _, full = trained_run
    real_lr_at = train_mod.lr_at

    def lr_at(step, total, tc):
        if step == stop_step:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_lr_at(step, total, tc)

    monkeypatch.setattr(train_mod, "lr_at", lr_at)
    with pytest.raises(train_mod.Interrupted):
        train(tiny_cfg, progress=False)
    monkeypatch.undo()
    resumed = train(tiny_cfg, resume=True, progress=False)
    def untimed(m):
        return {k: v for k, v in m["val"].items() if k != "examples_per_sec"}

    assert resumed["best_step"] == full["best_step"] and untimed(resumed) == untimed(full)
