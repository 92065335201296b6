"""Faults during training and hostile inputs, each with its promised outcome.

Exact resume (weights, optimizer, RNG streams, losses, example order) after a cut-back or a SIGTERM at any
step; SIGINT/SIGTERM handling (one stops after the step with a checkpoint, a second Ctrl-C aborts); SIGKILL
at random moments during checkpoint writes, and the temp files such kills leave; a full disk; malicious
pickles; damaged model directories and bad data through the CLI; NaN steps; changed settings on resume.
Everything runs the tiny recipe on the synthetic dataset, on the CPU in fp32.

The SIGKILL trials run `tfm train` and `tfm pretrain` in forked children of one "zygote" subprocess that has
already imported torch/datasets (it runs no torch op before forking), so each trial costs a training start, not
a 3-second interpreter start. The SIGTERM test uses a plain `python -m transformer_cli` subprocess.

A few faults are simulated by a narrow patch, each said where it is: a signal at a chosen step (collating a
training batch is where a step begins), a full disk (the writes of fileio), a NaN loss (the classifier's loss).
"""

from __future__ import annotations

import builtins
import errno
import json
import math
import os
import pickle
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import CONFIGS, REPO, read_scalars, tiny_config
from safetensors.torch import load_file
from typer.testing import CliRunner

from transformer_cli import checkpoint as ckpt
from transformer_cli import fileio
from transformer_cli.cli import app
from transformer_cli.config import Config
from transformer_cli.errors import TfmError
from transformer_cli.evaluate import load_model_dir
from transformer_cli.model import CTransformer, MaskedLM
from transformer_cli.training import classify, loop
from transformer_cli.training.classify import Classification, train

TINY = str(CONFIGS / "tiny.toml")
STEPS_PER_EPOCH = 23  # 400 reviews - 40 for validation = 360; ceil(360 / 16) = 23 batches
TOTAL = 30  # max_steps of the resume runs: one epoch and 7 steps of the second
WATCHDOG_SEC = 180  # only against hangs; no assertion is about time

# --------------------------------------------------------------------------- helpers


def cli(*args: str):
    """`tfm ARGS` in-process; returns the click Result (stdout and stderr kept apart)."""
    return CliRunner().invoke(app, [str(a) for a in args])


def train_args(data: Path, out: Path, *extra: str, command: str = "train") -> list[str]:
    """`tfm train` (or `tfm pretrain`) on the tiny recipe with the settings `tiny_config` uses (CPU, fp32)."""
    return [command, "--config", TINY, "--data", str(data), "-o", str(out), "--no-progress",
            "--device", "cpu", "--precision", "fp32", *extra]


def assert_one_line_error(result, code: int, *fragments: str) -> str:
    err = result.stderr.strip()
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr, result.exception)
    assert isinstance(result.exception, SystemExit), repr(result.exception)  # not an escaped exception
    assert len(err.splitlines()) == 1, err
    assert err.startswith("tfm: error:"), err
    assert "Traceback" not in result.output
    for f in fragments:
        assert f in err, (f, err)
    return err


def scalars(path: Path, tag: str) -> list[tuple[int, float]]:
    return read_scalars(path).get(tag, [])


def step_of(folder: Path) -> int:
    return int(folder.name.split("-")[1])


def assert_all_step_dirs_complete(out: Path) -> None:
    root = out / ckpt.CKPT_DIR
    named = [p for p in root.iterdir() if re.fullmatch(r"step-\d{8}", p.name)] if root.is_dir() else []
    for d in named:
        assert (d / ckpt.COMPLETE).is_file(), f"{d} carries a step-N name without {ckpt.COMPLETE}"
        for name in (ckpt.MODEL_FILE, "state.pt", "trainer.json"):
            assert (d / name).is_file(), f"{d / name} missing in a complete checkpoint"


def saved_model(out: Path):
    """A fresh model of the run's kind and sizes, built from its config.json."""
    meta = json.loads((out / ckpt.CONFIG_FILE).read_text())
    cfg = Config.from_dict({k: meta[k] for k in ("model", "data", "train")})
    if "labels" in meta:  # a classifier's run
        return CTransformer(cfg.model, meta["vocab_size"], cfg.data.max_length, len(meta["labels"]))
    return MaskedLM(cfg.model, meta["vocab_size"], cfg.data.max_length)  # a pretraining run's


def validated_weights(out: Path, folder: Path) -> bytes:
    """The model file a validation at checkpoint `folder` saves if it scores best: the checkpoint's
    weights, or their average where the run keeps one (train.ema_decay)."""
    model = saved_model(out)
    ckpt.load_weights(model, folder / ckpt.MODEL_FILE)
    average = ckpt.load_checkpoint(folder)[1].get("ema")
    if average is not None:
        with torch.no_grad():
            for p, a in zip(model.parameters(), average, strict=True):
                p.copy_(a)
    return ckpt.state_bytes(model)


def load_checkpoint_fully(out: Path, folder: Path) -> dict:
    """Load a checkpoint the way resume does, weights into a fresh model built from config.json."""
    train_json, tensors = ckpt.load_checkpoint(folder)
    assert train_json["state"]["step"] == step_of(folder)
    model = saved_model(out)
    ckpt.load_weights(model, folder / ckpt.MODEL_FILE)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert "optimizer" in tensors and "rng" in tensors
    return train_json


def temp_names(out: Path) -> list[Path]:
    return [p for p in out.rglob("*") if ".tmp" in p.name or ".old-" in p.name]


def weights_equal(a: Path, b: Path) -> bool:
    ta, tb = load_file(str(a)), load_file(str(b))
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def assert_optimizer_states_equal(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys() and a["state"]
    for i in a["state"]:
        sa, sb = a["state"][i], b["state"][i]
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])), f"optimizer state {i}.{k} differs"


TIMING = {"train_time_sec", "samples_per_sec", "tokens_per_sec", "examples_per_sec", "data_prep_sec"}


def without_timing(x):
    if isinstance(x, dict):
        return {k: without_timing(v) for k, v in x.items() if k not in TIMING}
    return x


def assert_same_outcome(out: Path, ref: Path) -> None:
    """Everything a resumed run produces equals the uninterrupted run's (timings aside)."""
    last_out, last_ref = ckpt.checkpoint_dirs(out)[-1], ckpt.checkpoint_dirs(ref)[-1]
    assert last_out.name == last_ref.name == f"step-{TOTAL:08d}"
    assert weights_equal(last_out / ckpt.MODEL_FILE, last_ref / ckpt.MODEL_FILE), "final weights differ"
    json_out, state_out = ckpt.load_checkpoint(last_out)
    json_ref, state_ref = ckpt.load_checkpoint(last_ref)
    assert_optimizer_states_equal(state_out["optimizer"], state_ref["optimizer"])
    assert torch.equal(state_out["rng"][0]["torch"], state_ref["rng"][0]["torch"]), "torch RNG state differs"
    assert json_out["rng"] == json_ref["rng"], "python/numpy RNG state differs"
    assert without_timing(json_out["state"]) == without_timing(json_ref["state"])
    assert weights_equal(out / ckpt.MODEL_FILE, ref / ckpt.MODEL_FILE), "best model (model.safetensors) differs"
    m_out = json.loads((out / ckpt.METRICS_FILE).read_text())
    m_ref = json.loads((ref / ckpt.METRICS_FILE).read_text())
    assert without_timing(m_out) == without_timing(m_ref)
    for tag in ("train/loss", "val/accuracy"):
        got, want = scalars(out, tag), scalars(ref, tag)
        steps = [s for s, _ in got]
        assert steps == sorted(set(steps)), f"{tag}: a step logged twice or out of order: {steps}"
        assert got == want, f"{tag} differs from the uninterrupted run"


def cut_back_to(run: Path, k: int) -> None:
    """Turn a copy of a finished run into the run as it stood right after checkpoint step-k."""
    folders = ckpt.checkpoint_dirs(run)
    assert f"step-{k:08d}" in [d.name for d in folders]
    for d in folders:
        if step_of(d) > k:
            shutil.rmtree(d)
    best = json.loads((run / ckpt.CKPT_DIR / f"step-{k:08d}" / "trainer.json").read_text())["state"]["best_step"]
    (run / ckpt.METRICS_FILE).unlink()
    (run / ckpt.MODEL_FILE).unlink()
    if best >= 0:  # the best model then was the one validated at best_step (an epoch end, so checkpointed)
        (run / ckpt.MODEL_FILE).write_bytes(validated_weights(run, run / ckpt.CKPT_DIR / f"step-{best:08d}"))


# --------------------------------------------------------------------------- 1: exact resume


def resume_cfg(data: Path, out: Path):
    """With dropout and a weight average, so that resume must restore the RNG and the average too."""
    return tiny_config(data, out, model__dropout=0.1, train__ema_decay=0.9, train__log_every=1,
                       train__checkpoint_every=10, train__max_steps=TOTAL)


RESUME_POINTS = {"mid-epoch": 10, "epoch-boundary": STEPS_PER_EPOCH}


@pytest.fixture(scope="module")
def resume_runs(synthetic_data_dir, tmp_path_factory):
    """One uninterrupted run with dropout, and copies cut back to step k and resumed, recording the batches.

    Returns {name: (output dir, [indices of each training batch, in order])} for "full" and each k.
    """
    root = tmp_path_factory.mktemp("resume")
    real_collate = classify.collate
    runs = {}

    def run(name: str, out: Path, resume: bool) -> None:
        seen: list[tuple[int, ...]] = []

        def recording(enc, idx):
            seen.append(tuple(int(i) for i in idx))
            return real_collate(enc, idx)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(classify, "collate", recording)  # a spy on the training batches, in order
            mp.setattr(loop, "KEEP_CHECKPOINTS", 100)  # cut_back_to needs the early ones
            train(resume_cfg(synthetic_data_dir, out), resume=resume, progress=False)
        runs[name] = (out, seen)

    run("full", root / "full", False)
    for name, k in RESUME_POINTS.items():
        shutil.copytree(root / "full", root / name)
        cut_back_to(root / name, k)
        run(name, root / name, True)
    return runs


@pytest.mark.parametrize("point", RESUME_POINTS)
def test_resume_is_exact_with_dropout_and_replays_the_same_examples(resume_runs, point):
    k = RESUME_POINTS[point]
    full, full_batches = resume_runs["full"]
    resumed, resumed_batches = resume_runs[point]
    assert_same_outcome(resumed, full)
    # the per-step losses after k come from the resumed run (its own event file), and equal the originals
    newest = max(resumed.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime_ns)
    assert [s for s, _ in scalars(newest, "train/loss")] == list(range(k + 1, TOTAL + 1))
    assert [v for s, v in scalars(full, "train/loss") if s > k] == [v for _, v in scalars(newest, "train/loss")]
    assert len(full_batches) == TOTAL and resumed_batches == full_batches[k:]  # none repeated or skipped, in order


def sigterm_at_batch(monkeypatch, n: int) -> None:
    """Deliver a real SIGTERM to this process while the n-th training batch is being prepared."""
    real_collate = classify.collate
    calls = []

    def collate(enc, idx):
        calls.append(1)
        if len(calls) == n:
            signal.raise_signal(signal.SIGTERM)
        return real_collate(enc, idx)

    monkeypatch.setattr(classify, "collate", collate)  # the patch: a signal at a chosen step


@pytest.mark.parametrize("stop_step", [17, STEPS_PER_EPOCH], ids=["mid-epoch", "last-of-epoch"])
def test_sigterm_at_any_step_then_resume_equals_the_uninterrupted_run(resume_runs, synthetic_data_dir, tmp_path,
                                                                     monkeypatch, stop_step):
    """Also: a stop on the last step of an epoch still validates that step before exiting (of the run's last step:
    test_a_stop_during_the_last_validation_stops_after_it_and_resume_finishes)."""
    out = tmp_path / "run"
    sigterm_at_batch(monkeypatch, stop_step)
    with pytest.raises(TfmError, match="stopped by SIGTERM") as info:
        train(resume_cfg(synthetic_data_dir, out), progress=False)
    assert info.value.exit_code == 143
    assert ckpt.checkpoint_dirs(out)[-1].name == f"step-{stop_step:08d}"
    full = resume_runs["full"][0]  # validated at the end of epoch 1 and of the run, before the stopped run exits
    assert scalars(out, "val/accuracy") == [(s, v) for s, v in scalars(full, "val/accuracy") if s <= stop_step]
    monkeypatch.undo()
    train(resume_cfg(synthetic_data_dir, out), resume=True, progress=False)
    assert_same_outcome(out, full)


# --------------------------------------------------------------------------- 2: SIGINT / SIGTERM


@pytest.mark.parametrize("first", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_sets_the_flag_and_a_second_ctrl_c_aborts_at_once(first, tmp_path):
    """loop._StopFlag: the first SIGINT/SIGTERM is only noted (training finishes the step and checkpoints);
    a repeated SIGTERM still means that; a SIGINT after any stop signal raises Aborted (exit 130, pointing
    at the checkpoints to resume from). The handlers in place before are restored afterwards."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    outside: list[int] = []

    def previous(signum, frame):  # stands in for the handlers the flag must save and restore
        outside.append(signum)

    try:
        for s in before:
            signal.signal(s, previous)
        with loop._StopFlag(tmp_path) as stop:
            assert stop.signum is None
            signal.raise_signal(first)
            assert stop.signum == first
            if first == signal.SIGTERM:
                signal.raise_signal(signal.SIGTERM)
                assert stop.signum == signal.SIGTERM
            with pytest.raises(loop.Aborted, match="none yet, so run the same command again") as aborted:
                signal.raise_signal(signal.SIGINT)
            assert aborted.value.exit_code == 130
        complete = tmp_path / ckpt.CKPT_DIR / "step-00000005"
        complete.mkdir(parents=True)
        (complete / ckpt.COMPLETE).touch()
        with loop._StopFlag(tmp_path), pytest.raises(loop.Aborted, match="--resume continues") as aborted:
            signal.raise_signal(first)
            signal.raise_signal(signal.SIGINT)
        assert str(tmp_path / ckpt.CKPT_DIR) in str(aborted.value)
        assert outside == [], "a signal reached the previous handler while the flag was active"
        assert all(signal.getsignal(s) is previous for s in before), "the previous handlers were not restored"
        signal.raise_signal(signal.SIGINT)
        assert outside == [signal.SIGINT]
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def highest_step_started(out: Path) -> int:
    """The highest N among checkpoints/step-N and the temp folders .step-N.tmp-PID being written."""
    try:
        names = os.listdir(out / ckpt.CKPT_DIR)
    except FileNotFoundError:
        return 0
    return max((int(m.group(1)) for n in names if (m := re.match(r"\.?step-(\d{8})", n))), default=0)


def test_a_stop_during_the_last_validation_stops_after_it_and_resume_finishes(synthetic_data_dir, tmp_path,
                                                                              monkeypatch):
    out = tmp_path / "run"
    validate = loop.validate

    def signalled_at_20(run, logger):
        if run.state.step == 20:
            signal.raise_signal(signal.SIGINT)  # arrives while the run validates its last step
        return validate(run, logger)

    monkeypatch.setattr(loop, "validate", signalled_at_20)  # the patch: a signal during the last validation
    args = [a for a in train_args(synthetic_data_dir, out) if a != "--no-progress"]  # with the progress bar
    result = cli(*args, "--max-steps", "20")
    assert result.exit_code == 130, result.output
    bar, error = result.stderr.rstrip("\n").rsplit("\n", 1)
    assert "train:" in bar and error.startswith("tfm: error: stopped by SIGINT") and "step-00000020" in error
    assert not (out / ckpt.METRICS_FILE).exists()
    monkeypatch.undo()
    resumed = cli(*train_args(synthetic_data_dir, out), "--max-steps", "20", "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert json.loads((out / ckpt.METRICS_FILE).read_text())["steps"] == 20


@pytest.mark.slow
def test_sigterm_stops_a_process_at_a_step_with_a_checkpoint_and_resume_finishes(synthetic_data_dir, tmp_path):
    """A real `tfm train` process (SIGINT to one: test_run_dir; in-process: the tests above)."""
    sig, code = signal.SIGTERM, 143
    out = tmp_path / "run"
    args = train_args(synthetic_data_dir, out, "--max-steps", "16", "train.log_every=1", "train.checkpoint_every=4")
    proc = subprocess.Popen([sys.executable, "-m", "transformer_cli", *args], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        while highest_step_started(out) < 5 and proc.poll() is None:  # mid-training, after a checkpoint
            time.sleep(0.002)
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=WATCHDOG_SEC)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert f"stopped by {sig.name}" in lines[0] and "--resume" in lines[0]
    where = Path(re.search(r"checkpoint at '([^']+)'", lines[0]).group(1))
    assert where == ckpt.checkpoint_dirs(out)[-1]  # the message names the latest complete checkpoint
    stopped_at = load_checkpoint_fully(out, where)["state"]["step"]
    assert 5 <= stopped_at < 16
    assert [s for s, _ in scalars(out, "train/loss")] == list(range(1, stopped_at + 1))

    result = cli(*args, "--resume")
    assert result.exit_code == 0, result.output
    assert json.loads((out / ckpt.METRICS_FILE).read_text())["steps"] == 16
    steps = [s for s, _ in scalars(out, "train/loss")]
    assert steps == list(range(1, 17)), "TensorBoard has a step twice, a gap or a step out of order"
    assert [s for s, _ in scalars(out, "val/accuracy")] == [16]


# --------------------------------------------------------------------------- 3: SIGKILL at random moments

ZYGOTE = r"""
import json, os, sys
import numpy, torch, datasets, tokenizers, safetensors.torch  # imports only: no torch op before fork
for name in ("torch._dynamo", "torch.utils.tensorboard", "torch.utils.tensorboard.summary",
             "tensorboard.plugins.hparams.api_pb2", "datasets.packaged_modules.json.json"):
    try:
        __import__(name)
    except ImportError:
        pass
import transformer_cli.training.classify, transformer_cli.evaluate, transformer_cli.training.pretrain
from transformer_cli.cli import app
print("ready", flush=True)
for line in sys.stdin:
    args, log = json.loads(line)
    pid = os.fork()
    if pid == 0:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        code = 0
        try:
            app(args=args, prog_name="tfm")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 99
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    print(pid, flush=True)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
"""


class Zygote:
    """A subprocess with torch imported that forks one `tfm` child per command (its argv in JSON)."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], cwd=REPO, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)
        self._buf = b""
        assert self.readline(WATCHDOG_SEC) == "ready"

    def readline(self, timeout: float) -> str | None:
        """The next line from the zygote, or None if none arrives within `timeout` seconds."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            ready, _, _ = select.select([fd], [], [], timeout)
            if not ready:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError("the zygote process died")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode().strip()

    def start(self, args: list[str], log: Path) -> int:
        self.proc.stdin.write((json.dumps([args, str(log)]) + "\n").encode())
        self.proc.stdin.flush()
        return int(self.readline(WATCHDOG_SEC))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def zygote():
    if not hasattr(os, "fork"):
        pytest.skip("the SIGKILL trials fork a preloaded interpreter (POSIX only)")
    z = Zygote()
    yield z
    z.close()


KILL_STEPS = 16
KILL_BY = 10  # the highest step a kill waits for; the random delay is at most 2 steps


@pytest.mark.slow
@pytest.mark.parametrize("command", ["train", "pretrain"])
def test_sigkill_at_random_moments_never_breaks_the_latest_checkpoint(zygote, synthetic_data_dir, tmp_path, command):
    """10 kills; a killed run is either started afresh or resumed and killed again; every 5th trial the
    killed run is then resumed with the same command plus --resume and must finish, leaving no temp files."""
    rng = random.Random(20240607)
    killed = resumed = 0
    out, start = None, 0
    for trial in range(10):
        if out is not None:  # the killed run may have left the temp folder of the checkpoint after `start`
            start = max(start, highest_step_started(out))
        if out is None or start + 2 > KILL_BY:
            out, start = tmp_path / f"run{trial}", 0
        args = [*train_args(synthetic_data_dir, out, command=command), "--max-steps", str(KILL_STEPS),
                "train.checkpoint_every=1", "train.log_every=1",
                *(["--resume"] if (out / ckpt.CKPT_DIR).is_dir() else [])]
        # Kill once the checkpoint of step `wait_for` has started (so step-(wait_for - 1) is complete and
        # training is under way), after a further random delay of 0-2 step durations (as measured in this
        # trial, so the kill lands at a random phase of a step on any machine, often inside a checkpoint write).
        wait_for, steps_of_delay = rng.randint(start + 2, KILL_BY), rng.uniform(0.0, 2.0)
        log = tmp_path / f"t{trial}.log"
        pid = zygote.start(args, log)
        line, first_seen = None, {}
        while line is None and (highest := highest_step_started(out)) < wait_for:
            if highest > start:  # a step of this run (not a leftover of the killed one)
                first_seen.setdefault(highest, time.monotonic())
            line = zygote.readline(0.002)  # the child's exit code, if it ended on its own
        if line is None:
            step_sec = time.monotonic() - first_seen.get(wait_for - 1, time.monotonic() - 0.01)
            line = zygote.readline(steps_of_delay * step_sec)
        if line is None:
            os.kill(pid, signal.SIGKILL)
            line = zygote.readline(WATCHDOG_SEC)
        code = int(line)
        assert code in (0, -signal.SIGKILL), f"trial {trial}: exit {code}: {log.read_text()[-2000:]}"
        killed += code == -signal.SIGKILL

        assert_all_step_dirs_complete(out)
        found = ckpt.checkpoint_dirs(out)
        assert found and step_of(found[-1]) >= wait_for - 1, f"trial {trial}: progress lost: {found}"
        start = load_checkpoint_fully(out, found[-1])["state"]["step"]

        if trial % 5 == 4:
            resume_args = args if "--resume" in args else [*args, "--resume"]
            zygote.start(resume_args, log)
            code = int(zygote.readline(WATCHDOG_SEC))
            assert code == 0, f"trial {trial}: resume exited {code}: {log.read_text()[-2000:]}"
            assert json.loads((out / ckpt.METRICS_FILE).read_text())["steps"] == KILL_STEPS
            assert_all_step_dirs_complete(out)
            assert not temp_names(out), "temp files or folders of the killed runs were not cleaned up"
            resumed += 1
            out = None
        elif rng.random() < 0.5:
            out = None  # next trial: a fresh run; otherwise resume this one and kill it again
    assert resumed == 2
    assert killed >= 9, f"only {killed} of 10 trials were killed before their run ended"


STALE = [f".{ckpt.MODEL_FILE}.tmp-4242", f".{ckpt.METRICS_FILE}.tmp-4242", f".{ckpt.CONFIG_FILE}.tmp-17"]
NOT_OURS = [".notes", ".model.safetensors.tmp-backup", "draft.json.tmp-12", ".tmp-99"]


@pytest.mark.parametrize("how", ["resume", "restart"])
def test_temp_files_of_killed_writes_in_the_output_dir_are_removed_and_nothing_else(
        synthetic_data_dir, one_epoch_run, tmp_path, how):
    """A SIGKILL during a top-level atomic write leaves `.NAME.tmp-PID`; the next run in that directory
    (a resume, or a fresh start after a run that died before its first checkpoint) removes exactly those."""
    out = tmp_path / "run"
    if how == "resume":
        shutil.copytree(one_epoch_run, out)
        args = [*train_args(synthetic_data_dir, out), "--max-steps", "12", "train.checkpoint_every=5", "--resume"]
    else:
        out.mkdir()
        args = [*train_args(synthetic_data_dir, out), "--max-steps", "2"]
    for name in STALE + NOT_OURS:
        (out / name).write_bytes(b"half a file")
    (out / ".cache.tmp-5").mkdir()  # atomic writes never leave folders here

    result = cli(*args)
    assert result.exit_code == 0, result.output
    assert (out / ckpt.METRICS_FILE).is_file()
    names = {p.name for p in out.iterdir()}
    assert not names & set(STALE), f"stale temp files survived: {sorted(names & set(STALE))}"
    assert set(NOT_OURS) | {".cache.tmp-5"} <= names, "a file that is not a temp file of tfm was deleted"
    assert all((out / name).read_bytes() == b"half a file" for name in NOT_OURS)


# --------------------------------------------------------------------------- 4: disk full


class FullDisk:
    """A file whose write() stores half of the data and then fails like a full disk."""

    def __init__(self, f):
        self.f = f

    def write(self, data):
        self.f.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


@pytest.mark.parametrize("victim", [ckpt.MODEL_FILE, "state.pt", ckpt.COMPLETE, "best-model"])
def test_disk_full_while_saving_keeps_the_previous_checkpoint(synthetic_data_dir, tmp_path, monkeypatch, victim):
    """ENOSPC while writing one file of the second checkpoint (step 8), or the first best model (step 6)."""
    out = tmp_path / "run"
    folders: list[str] = []

    def fake_open(path, mode="r", *a, **kw):
        f = builtins.open(path, mode, *a, **kw)  # noqa: SIM115 - returned to the caller
        p = Path(path)
        if "w" in mode and p.parent.name.startswith(".step-") and p.parent.name not in folders:
            folders.append(p.parent.name)
        if victim == "best-model":
            hit = p.parent == out and p.name.startswith(f".{ckpt.MODEL_FILE}.tmp")
        else:
            hit = len(folders) == 2 and p.parent.name == folders[1] and p.name.startswith(f".{victim}.tmp")
        return FullDisk(f) if "w" in mode and hit else f

    monkeypatch.setattr(fileio, "open", fake_open, raising=False)
    args = [*train_args(synthetic_data_dir, out), "--max-steps", "12", "train.checkpoint_every=4"]
    if victim == "best-model":
        args.append("train.eval_every=6")
    err = assert_one_line_error(cli(*args), 1, "no space left on device writing '",
                                "the last complete checkpoint, ", "step-00000004', is intact")
    assert (ckpt.MODEL_FILE if victim == "best-model" else victim) in err.split("; ")[0]  # names the file
    monkeypatch.undo()

    expected = 4
    found = ckpt.checkpoint_dirs(out)
    assert step_of(found[-1]) == expected
    load_checkpoint_fully(out, found[-1])
    assert_all_step_dirs_complete(out)
    assert not temp_names(out), temp_names(out)
    assert not (out / ckpt.MODEL_FILE).exists()  # no half-written best model either
    if victim == "state.pt":  # and the run can be finished from there
        result = cli(*args, "--resume")
        assert result.exit_code == 0, result.output
        assert json.loads((out / ckpt.METRICS_FILE).read_text())["steps"] == 12


# --------------------------------------------------------------------------- 5: malicious pickles


class Evil:
    """Unpickling this runs a shell command that creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


def evil_bytes(marker: Path, fmt: str) -> bytes:
    payload = {"optimizer": Evil(marker), "scaler": {}, "rng": []}
    if fmt == "pickle":
        return pickle.dumps(payload, protocol=2)  # torch.load's own protocol; no warning
    import io

    buf = io.BytesIO()
    torch.save(payload, buf)
    return buf.getvalue()


@pytest.fixture
def trained_copy(trained_dir, tmp_path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(trained_dir, out)
    return out


def test_resume_refuses_a_malicious_state_pt(synthetic_data_dir, trained_copy, tmp_path):
    """Through the CLI (a raw pickle too: test_checkpoint)."""
    control = tmp_path / "control"  # the payload is live: unrestricted unpickling would run it
    pickle.loads(evil_bytes(control, "pickle"))
    assert control.exists()
    marker = tmp_path / "pwned"
    latest = ckpt.checkpoint_dirs(trained_copy)[-1]
    (latest / "state.pt").write_bytes(evil_bytes(marker, "torch.save"))
    result = cli(*train_args(synthetic_data_dir, trained_copy), "--resume")
    assert_one_line_error(result, 1, "refusing to load", "state.pt")
    assert not marker.exists(), "the checkpoint's pickle ran code"
    assert (latest / ckpt.COMPLETE).is_file()  # nothing was deleted or rewritten in its place


def test_resume_refuses_optimizer_state_saved_for_other_parameters(synthetic_data_dir, trained_copy):
    """State saved in another order of parameters (another version of the model) is one line, exit 1."""
    latest = ckpt.checkpoint_dirs(trained_copy)[-1]
    tensors = torch.load(latest / "state.pt", weights_only=True)
    state = tensors["optimizer"]["state"]
    shapes = {i: s["exp_avg"].shape for i, s in state.items()}
    a = next(iter(shapes))
    b = next(i for i in shapes if shapes[i] != shapes[a])
    state[a], state[b] = state[b], state[a]
    torch.save(tensors, latest / "state.pt")
    result = cli(*train_args(synthetic_data_dir, trained_copy), "--resume")
    assert_one_line_error(result, 1, "does not fit this model/optimizer", "optimizer state 'exp_avg'")
    assert (latest / ckpt.COMPLETE).is_file()


def test_malicious_pickle_as_weights_is_refused(synthetic_data_dir, trained_copy, tmp_path):
    marker = tmp_path / "pwned"
    (trained_copy / ckpt.MODEL_FILE).write_bytes(evil_bytes(marker, "pickle"))
    with pytest.raises(TfmError, match="not safetensors"):
        load_model_dir(trained_copy)
    assert_one_line_error(cli("predict", "-c", trained_copy, "--device", "cpu", "great film"), 1, "not safetensors")
    latest = ckpt.checkpoint_dirs(trained_copy)[-1]
    (latest / ckpt.MODEL_FILE).write_bytes(evil_bytes(marker, "torch.save"))
    result = cli(*train_args(synthetic_data_dir, trained_copy), "--resume")
    assert_one_line_error(result, 1, "not safetensors")
    assert not marker.exists()


# --------------------------------------------------------------------------- 6: bad inputs through the CLI


def test_predict_refuses_a_file_with_a_blank_line(trained_dir, tmp_path):
    path = tmp_path / "in"
    path.write_text("good film\n   \nbad film\n")
    assert_one_line_error(cli("predict", "-c", trained_dir, "--device", "cpu", "--file", path), 2, "line 2")


def write_dataset(root: Path, rows: list[dict]) -> Path:
    root.mkdir()
    for split in ("train", "test"):
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


@pytest.fixture
def bad_datasets(tmp_path):
    rows = [{"review": f"film number {i} was {'great' if i % 2 else 'awful'}", "label": i % 2} for i in range(40)]
    return {
        "missing": (tmp_path / "no" / "such" / "data", 2, "does not exist"),
        "no-text-column": (write_dataset(tmp_path / "nt", rows), 1, "no column 'text'"),
        "bad-labels": (write_dataset(tmp_path / "bl", [{"text": r["review"], "label": r["label"] + 0.5} for r in rows]),
                       1, "has label 0.5; labels must be integers or class names"),
    }


@pytest.mark.parametrize("kind", ["missing", "no-text-column", "bad-labels"])
def test_bad_datasets_are_refused_by_train_and_evaluate(trained_dir, bad_datasets, tmp_path, kind):
    data, code, fragment = bad_datasets[kind]
    out = tmp_path / "out"
    assert_one_line_error(cli(*train_args(data, out)), code, fragment)
    assert not out.exists(), "train wrote into the output directory before failing"
    assert_one_line_error(cli("evaluate", "-c", trained_dir, "--device", "cpu", "--data", data), code, fragment)


def damaged_model_dir(trained_dir: Path, dest: Path, damage: str) -> Path:
    if damage == "missing":
        return dest / "nothing-here"
    shutil.copytree(trained_dir, dest, ignore=shutil.ignore_patterns("checkpoints", "events.*"))
    if damage == "truncated":
        data = (dest / ckpt.MODEL_FILE).read_bytes()
        (dest / ckpt.MODEL_FILE).write_bytes(data[: len(data) // 2])
    elif damage == "future-format":
        meta = json.loads((dest / ckpt.CONFIG_FILE).read_text())
        meta["format_version"] = 999
        (dest / ckpt.CONFIG_FILE).write_text(json.dumps(meta))
    return dest


@pytest.mark.parametrize(("damage", "fragment"), [("missing", "does not exist"), ("truncated", "damaged"),
                                                  ("future-format", "format version 999")])
def test_predict_and_evaluate_refuse_a_damaged_model_dir(trained_dir, synthetic_data_dir, tmp_path, damage, fragment):
    model_dir = damaged_model_dir(trained_dir, tmp_path / "model", damage)
    predict = cli("predict", "-c", model_dir, "--device", "cpu", "--json", "great film")
    assert_one_line_error(predict, 1, fragment)
    assert_one_line_error(cli("evaluate", "-c", model_dir, "--device", "cpu", "--data", synthetic_data_dir), 1,
                          fragment)


# --------------------------------------------------------------------------- 7: NaN steps


def poison_training_loss(monkeypatch, bad_calls, kind: str = "loss") -> None:
    """The classifier's training loss is NaN (kind="loss"), or finite with NaN gradients (kind="grad"), on the
    chosen calls (0-based; a callable `n -> bool`). Validation does not go through it."""
    real = Classification.loss
    calls = []

    def fake(self, engine, batch):
        loss, stats = real(self, engine, batch)
        calls.append(1)
        if not bad_calls(len(calls) - 1):
            return loss, stats
        if kind == "loss":
            loss = loss * float("nan")
            return loss, {"loss": loss.detach()}
        zero = loss - loss.detach()  # value 0; d sqrt(x)/dx at 0 is inf, times 0 is NaN
        return loss + 0.0 * torch.sqrt(zero), stats

    monkeypatch.setattr(Classification, "loss", fake)  # the patch: a diverging step


@pytest.mark.parametrize("kind", ["loss", "grad"])
def test_occasional_non_finite_steps_are_skipped_and_counted(synthetic_data_dir, tmp_path, monkeypatch, kind):
    out = tmp_path / "run"
    poison_training_loss(monkeypatch, lambda n: n in (3, 4, 11), kind)
    train(tiny_config(synthetic_data_dir, out, train__log_every=1, train__max_steps=20), progress=False)
    monkeypatch.undo()
    metrics = json.loads((out / ckpt.METRICS_FILE).read_text())
    assert metrics["bad_steps"] == 3 and metrics["steps"] == 20
    assert math.isfinite(metrics["val"]["loss"])
    assert scalars(out, "train/bad_steps") == [(4, 1.0), (5, 2.0), (12, 3.0)]
    losses = scalars(out, "train/loss")
    assert [s for s, _ in losses] == [s for s in range(1, 21) if s not in (4, 5, 12)]
    assert all(math.isfinite(v) for _, v in losses)
    last = ckpt.checkpoint_dirs(out)[-1]
    _, state = ckpt.load_checkpoint(last)
    assert state["optimizer"]["state"]
    assert all(int(s["step"]) == 20 - 3 for s in state["optimizer"]["state"].values())  # skipped = no update
    for f in (out / ckpt.MODEL_FILE, last / ckpt.MODEL_FILE):
        assert all(torch.isfinite(t).all() for t in load_file(str(f)).values())


def test_the_fp16_scalers_skipped_steps_are_counted_and_never_stop_training(synthetic_data_dir, tmp_path,
                                                                          monkeypatch):
    """Under fp16 the gradient scaler skips a step whose gradients overflow and lowers its scale: how it
    finds its scale, so such steps count in bad_steps but not towards MAX_BAD_STEPS in a row. An enabled
    scaler on the CPU (fp32 compute) stands in for a GPU's fp16."""
    from transformer_cli import runtime

    monkeypatch.setattr(runtime.Runtime, "grad_scaler", lambda self: torch.amp.GradScaler("cpu", init_scale=2.0 ** 8))
    monkeypatch.setattr(loop, "MAX_BAD_STEPS", 3)
    out = tmp_path / "run"
    poison_training_loss(monkeypatch, lambda n: n in (3, 4, 5, 11), "grad")
    train(tiny_config(synthetic_data_dir, out, train__log_every=1, train__max_steps=20), progress=False)
    monkeypatch.undo()
    metrics = json.loads((out / ckpt.METRICS_FILE).read_text())
    assert metrics["bad_steps"] == 4 and metrics["steps"] == 20  # 3 in a row did not stop it
    assert scalars(out, "train/bad_steps") == [(4, 1.0), (5, 2.0), (6, 3.0), (12, 4.0)]
    assert [s for s, _ in scalars(out, "train/loss")] == [s for s in range(1, 21) if s not in (4, 5, 6, 12)]
    _, state = ckpt.load_checkpoint(ckpt.checkpoint_dirs(out)[-1])
    assert all(int(s["step"]) == 20 - 4 for s in state["optimizer"]["state"].values())  # skipped = no update
    assert state["scaler"]["scale"] < 2.0 ** 8  # lowered by the overflows


@pytest.mark.filterwarnings("error::RuntimeWarning")  # NaN logits are neither measured nor drawn
def test_a_run_without_a_finite_validation_ends_with_an_error(synthetic_data_dir, tmp_path):
    out = tmp_path / "run"
    result = cli(*train_args(synthetic_data_dir, out), "--max-steps", "3", "--lr", "1e30")
    assert_one_line_error(result, 1, "training diverged: no validation pass had finite weights and loss")
    assert not (out / ckpt.MODEL_FILE).exists() and not (out / ckpt.METRICS_FILE).exists()


def test_non_finite_steps_in_a_row_stop_training_with_finite_files(synthetic_data_dir, tmp_path, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setattr(loop, "MAX_BAD_STEPS", 3)
    poison_training_loss(monkeypatch, lambda n: n >= 30)  # steps 31, 32, 33 ... after the epoch-1 model
    result = cli(*train_args(synthetic_data_dir, out), "train.ema_decay=0.9")  # the best model: the epoch-1 average
    assert_one_line_error(result, 1, "training diverged: 3 steps in a row", "at step 33")
    best = out / ckpt.MODEL_FILE
    expected = tmp_path / "expected.safetensors"
    expected.write_bytes(validated_weights(out, out / ckpt.CKPT_DIR / f"step-{STEPS_PER_EPOCH:08d}"))
    assert weights_equal(best, expected)
    for f in [best, *(d / ckpt.MODEL_FILE for d in ckpt.checkpoint_dirs(out))]:
        assert all(torch.isfinite(t).all() for t in load_file(str(f)).values()), f


def test_non_finite_from_the_start_leaves_no_model(synthetic_data_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "MAX_BAD_STEPS", 3)
    cfg = tiny_config(synthetic_data_dir, tmp_path / "run")
    poison_training_loss(monkeypatch, lambda n: True)
    with pytest.raises(TfmError, match="diverged: 3 steps in a row"):
        train(cfg, progress=False)
    assert not (tmp_path / "run" / ckpt.MODEL_FILE).exists()  # nothing was ever good enough to be saved


# --------------------------------------------------------------------------- 8: changed settings on resume


@pytest.fixture(scope="module")
def one_epoch_run(synthetic_data_dir, tmp_path_factory) -> Path:
    """A 12-step run cut back to its checkpoint at step 10, ready to be resumed."""
    out = tmp_path_factory.mktemp("settings") / "run"
    result = cli(*train_args(synthetic_data_dir, out), "--max-steps", "12", "train.checkpoint_every=5")
    assert result.exit_code == 0, result.output
    cut_back_to(out, 10)
    return out


@pytest.mark.parametrize(("change", "field"), [(("--seed", "7"), "train.seed"),
                                               (("--batch-size", "8"), "train.batch_size"),
                                               (("model.dropout=0.3",), "model.dropout"),
                                               (("train.log_every=1",), None)])
def test_changed_settings_on_resume_are_refused_unless_forced(synthetic_data_dir, one_epoch_run, tmp_path, change,
                                                              field):
    out = tmp_path / "run"
    shutil.copytree(one_epoch_run, out)
    args = [*train_args(synthetic_data_dir, out), "--max-steps", "12", "train.checkpoint_every=5", *change, "--resume"]
    if field is None:  # a setting that does not change the trajectory is accepted as is
        assert cli(*args).exit_code == 0
        return
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    err = assert_one_line_error(cli(*args), 2, f"{field}:", "--force")
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert before == after, "a refused resume changed the output directory"
    assert "resume" in err
    result = cli(*args, "--force")
    assert result.exit_code == 0, result.output
    # The weights go on with the tokenizer they were trained with, whatever the new settings would train.
    assert (out / ckpt.TOKENIZER_FILE).read_bytes() == before[out / ckpt.TOKENIZER_FILE]
    saved = json.loads((out / ckpt.CONFIG_FILE).read_text())
    section, key = field.split(".")
    assert str(saved[section][key]) == change[-1].split("=")[-1]
    assert json.loads((out / ckpt.METRICS_FILE).read_text())["steps"] == 12  # it went on from step 10
