"""torchrun with 2 CPU processes (gloo) against one process with the same global batch. Each test starts
several torchrun launches, seconds of interpreter start-up each: all are slow."""

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CONFIGS, read_scalars
from safetensors.torch import load_file
from typer.testing import CliRunner

from transformer_cli.cli import app


def _run(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run in its own process group: a timeout kills torchrun's workers too, not torchrun alone."""
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        finally:
            _kill_group(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is left (nothing, after a clean exit)
    except ProcessLookupError:
        pass


def _train(args: list[str], out: Path, env: dict, nproc: int, command: str = "train") -> subprocess.CompletedProcess:
    env = {**env, "PYTHONFAULTHANDLER": "1"}  # a crashed rank prints where each of its threads was
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                if nproc > 1 else [sys.executable])
    cmd = [*launcher, "-m", "transformer_cli", command, *args, "-o", str(out), "--no-progress"]
    return _run(cmd, env, timeout=240)


@pytest.mark.slow
def test_two_processes_equal_one_with_the_same_global_batch(synthetic_data_dir, tmp_path):
    """With gradient accumulation: each rank's first micro-batch runs without a gradient sync (no_sync), its
    last one averages the step's gradients over the ranks."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["--config", str(CONFIGS / "tiny.toml"), "--data", str(synthetic_data_dir), "--epochs", "1",
            "--seed", "5", "--precision", "fp32",  # the same arithmetic: bf16 rounds each process's sums apart
            "train.grad_accum_steps=2", "train.checkpoint_every=7"]
    ddp, single = tmp_path / "ddp", tmp_path / "single"
    r2 = _train(args, ddp, env, nproc=2)
    assert r2.returncode == 0, r2.stderr[-6000:]
    r1 = _train(args, single, env, nproc=1)
    assert r1.returncode == 0, r1.stderr[-2000:]

    # One set of outputs, written once (rank 0), and one summary line.
    assert len(list(ddp.glob("events.out.tfevents.*"))) == 1
    assert r2.stdout.count("done:") == 1

    a, b = load_file(ddp / "model.safetensors"), load_file(single / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:  # same data, same global batches: equal up to float reduction order
        assert (a[k] - b[k]).abs().max().item() < 1e-3, k

    # Validation is reduced over ranks: the same examples give the same figures.
    m2, m1 = (json.loads((d / "metrics.json").read_text()) for d in (ddp, single))
    assert m2["world_size"] == 2 and m1["world_size"] == 1
    assert m2["val"]["num_examples"] == m1["val"]["num_examples"]
    assert m2["val"]["confusion_matrix"] == m1["val"]["confusion_matrix"]
    assert m2["val"]["loss"] == pytest.approx(m1["val"]["loss"], rel=1e-4)
    assert m2["steps"] == m1["steps"]
    # The calibration sees every rank's validation logits, as one process does.
    assert m2["calibration"]["num_examples"] == m1["calibration"]["num_examples"]
    assert m2["calibration"]["temperature"] == pytest.approx(m1["calibration"]["temperature"], rel=1e-3)
    assert m2["val"]["ece"] == pytest.approx(m1["val"]["ece"], abs=1e-4)
    # train/loss is the mean over the global batch, as in one process (not rank 0's half).
    l2, l1 = read_scalars(ddp)["train/loss"], read_scalars(single)["train/loss"]
    assert [s for s, _ in l2] == [s for s, _ in l1]
    for (step, a), (_, b) in zip(l2, l1):
        assert a == pytest.approx(b, rel=1e-3), step


@pytest.mark.slow
def test_pretraining_runs_under_torchrun(synthetic_data_dir, tmp_path):
    """Each rank masks its share of the global batch of windows; gradients are averaged over ranks (every
    parameter takes part in every step), rank 0 alone writes the outputs."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "run"
    args = ["--config", str(CONFIGS / "tiny.toml"), "--data", str(synthetic_data_dir), "pretrain.window=16",
            "train.checkpoint_every=3"]
    r = _train([*args, "--max-steps", "6"], out, env, nproc=2, command="pretrain")
    assert r.returncode == 0, r.stderr[-6000:]
    assert r.stdout.count("done:") == 1 and len(list(out.glob("events.out.tfevents.*"))) == 1
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["steps"] == 6
    assert math.isfinite(metrics["val"]["loss"]) and 0 < metrics["val"]["accuracy"] <= 1
    assert [d.name for d in (out / "checkpoints").iterdir()] == ["step-00000003", "step-00000006"]


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_all_ranks_and_only_as_many_resume(synthetic_data_dir, tmp_path):
    import time

    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    tfm = ["-m", "transformer_cli", "train", "--config", str(CONFIGS / "tiny.toml"), "--data", str(synthetic_data_dir),
           "--epochs", "500", "-o", str(out), "--no-progress"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *tfm]
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            deadline = time.monotonic() + 120
            while not (out / "checkpoints").is_dir():  # training is under way once a checkpoint exists
                assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
                time.sleep(0.2)
            # Rank 1 is the worker that torchrun started with RANK=1. Any child of its own would inherit
            # that environment, so the parent is what tells them apart.
            rank1 = None
            for pid in Path("/proc").iterdir():
                try:
                    parent = int((pid / "stat").read_text().rsplit(")", 1)[1].split()[1])
                    environ = (pid / "environ").read_bytes().split(b"\0")
                except (OSError, ValueError, IndexError):
                    continue
                if parent == proc.pid and b"RANK=1" in environ:
                    rank1 = int(pid.name)
            assert rank1 is not None, "rank 1 not found"
            before = {p.name for p in (out / "checkpoints").iterdir()}
            os.kill(rank1, signal.SIGTERM)
            _, stderr = proc.communicate(timeout=120)  # a hang fails here
        finally:
            _kill_group(proc)
    assert "exitcode  : 143" in stderr
    after = sorted(p.name for p in (out / "checkpoints").iterdir() if (p / "COMPLETE").is_file())
    assert after[-1] not in before  # the stop wrote a new checkpoint at a step boundary

    # One process refuses to resume it (the global batch would change); the same world size resumes
    # from it (--force: a shorter max_steps, to finish quickly).
    stopped_at = int(after[-1].split("-")[1])
    alone = CliRunner().invoke(app, [*tfm[2:], "--resume"])  # in this process: one, not under torchrun
    assert alone.exit_code == 2 and "world size: 2 -> 1" in alone.stderr and "Traceback" not in alone.stderr
    resumed = _run([*cmd, "--max-steps", str(stopped_at + 3), "--resume", "--force"], env, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert json.loads((out / "metrics.json").read_text())["steps"] == stopped_at + 3
