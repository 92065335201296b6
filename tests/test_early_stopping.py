"""train.select_metric picks the saved model; train.patience stops a run whose validation score stopped
improving, at the same step whether or not it was interrupted and resumed."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from conftest import read_scalars, tiny_config

from transformer_cli import checkpoint as ckpt
from transformer_cli.config import load_config
from transformer_cli.errors import TfmError, UsageError
from transformer_cli.training import classify
from transformer_cli.training.classify import train
from transformer_cli.training.pretrain import pretrain

# 360 training reviews in batches of 16: 23 steps an epoch, 92 in 4 epochs. Validated every 4 steps and at
# epoch ends (4, 8, ..., 20, 23, 24, ...); the tiny model's validation loss stops falling well before 92.
EARLY = {"train__epochs": 4, "train__eval_every": 4, "train__patience": 2, "train__select_metric": "loss"}
TOTAL = 92
VALIDATED = sorted({*range(4, TOTAL + 1, 4), *range(23, TOTAL + 1, 23)})


def early_cfg(data_dir: Path, out: Path, **overrides):
    return tiny_config(data_dir, out, **{**EARLY, **overrides})


def without_timing(d: dict) -> dict:
    return {k: without_timing(v) if isinstance(v, dict) else v for k, v in d.items() if not k.endswith("_sec")}


@pytest.fixture(scope="module")
def early_run(synthetic_data_dir, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("early") / "run"
    return out, train(early_cfg(synthetic_data_dir, out), progress=False)


def test_a_run_stops_after_patience_validations_without_a_better_score(early_run):
    out, metrics = early_run
    stop = metrics["steps"]
    assert stop < TOTAL and (metrics["stopped_early"], metrics["stop_reason"]) == (True, "patience")
    assert json.loads((out / ckpt.METRICS_FILE).read_text())["stop_reason"] == "patience"
    losses = read_scalars(out)["val/loss"]
    assert [s for s, _ in losses] == [s for s in VALIDATED if s <= stop]
    best_step, best_loss = min(losses, key=lambda sv: sv[1])  # the select_metric: the lowest loss wins
    assert metrics["best_step"] == best_step and metrics["select_metric"] == "loss"
    assert metrics["val"]["loss"] == pytest.approx(best_loss, rel=1e-5)
    after_best = [s for s, _ in losses if s > best_step]
    assert len(after_best) == 2 and after_best[-1] == stop  # patience = 2 passes after the best
    assert [v for s, v in read_scalars(out)["train/evals_since_best"] if s > best_step] == [1, 2]
    assert ckpt.checkpoint_dirs(out)[-1].name == f"step-{stop:08d}"  # written at the stop


def test_selection_by_accuracy_keeps_the_first_best(synthetic_data_dir, tmp_path):
    metrics = train(early_cfg(synthetic_data_dir, tmp_path / "run", train__select_metric="accuracy",
                              train__patience=0, train__epochs=1), progress=False)
    accuracy = read_scalars(tmp_path / "run")["val/accuracy"]
    best = max(v for _, v in accuracy)
    assert metrics["best_step"] == next(s for s, v in accuracy if v == best)  # strictly better replaces it
    assert (metrics["stopped_early"], metrics["stop_reason"], metrics["steps"]) == (False, "epochs", 23)


def test_an_interrupted_run_resumed_stops_at_the_same_step(early_run, synthetic_data_dir, tmp_path, monkeypatch):
    full, full_metrics = early_run
    out = tmp_path / "run"
    stop_at = next(s for s in VALIDATED if s > full_metrics["best_step"])  # after one pass without a better loss
    real_collate, calls = classify.collate, []

    def collate(enc, idx):  # SIGTERM while that step's batch is read: it ends, validates and checkpoints
        calls.append(1)
        if len(calls) == stop_at:
            signal.raise_signal(signal.SIGTERM)
        return real_collate(enc, idx)

    # The one patch: the signal must arrive at a chosen step, and collating a training batch is where a step begins.
    monkeypatch.setattr(classify, "collate", collate)
    with pytest.raises(TfmError, match="stopped by SIGTERM"):
        train(early_cfg(synthetic_data_dir, out), progress=False)
    saved = ckpt.load_checkpoint(ckpt.checkpoint_dirs(out)[-1])[0]["state"]
    assert (saved["step"], saved["evals_since_best"]) == (stop_at, 1)  # the count lives in the train state
    monkeypatch.undo()
    metrics = train(early_cfg(synthetic_data_dir, out), resume=True, progress=False)
    assert without_timing(metrics) == without_timing(full_metrics)
    assert (out / ckpt.MODEL_FILE).read_bytes() == (full / ckpt.MODEL_FILE).read_bytes()
    assert read_scalars(out)["val/loss"] == read_scalars(full)["val/loss"]


def test_resuming_a_run_that_stopped_early_trains_no_further(early_run, tmp_path, synthetic_data_dir):
    import shutil

    out = Path(shutil.copytree(early_run[0], tmp_path / "run"))
    stop = early_run[1]["steps"]
    metrics = train(early_cfg(synthetic_data_dir, out), resume=True, progress=False)
    assert metrics["steps"] == stop and metrics["stopped_early"]
    more = train(early_cfg(synthetic_data_dir, out, train__patience=3), resume=True, force=True, progress=False)
    assert more["steps"] > stop  # more patience (accepted with --force) goes on


def test_resuming_a_finished_run_logs_its_end_of_run_figures_once(early_run, tmp_path, synthetic_data_dir):
    """The calibration, hparam and test figures are written after the last checkpoint: a resume that
    trains no further must not write them at that step a second time."""
    import shutil

    out = Path(shutil.copytree(early_run[0], tmp_path / "run"))
    before = read_scalars(out)
    assert {"calibration/temperature", "hparam/val_loss"} <= set(before)
    train(early_cfg(synthetic_data_dir, out), resume=True, progress=False)
    assert read_scalars(out) == before


def test_a_forced_resume_with_another_select_metric_selects_by_it(synthetic_data_dir, tmp_path):
    """Chosen by accuracy, then resumed choosing by loss: the saved pass's loss is the bar from then on,
    not its accuracy score (which no negated loss could beat)."""
    out = tmp_path / "run"
    kw = {"train__epochs": 4, "train__eval_every": 4}
    first = train(tiny_config(synthetic_data_dir, out, train__max_steps=24, **kw), progress=False)
    assert first["select_metric"] == "accuracy"
    resumed = train(tiny_config(synthetic_data_dir, out, train__select_metric="loss", **kw), resume=True, force=True,
                    progress=False)
    losses = dict(read_scalars(out)["val/loss"])
    later = {step: loss for step, loss in losses.items() if step > 24}
    best = min([first["val"]["loss"], *later.values()])
    assert resumed["val"]["loss"] == pytest.approx(best, abs=1e-6)
    assert resumed["best_step"] == (first["best_step"] if best == first["val"]["loss"] else min(later, key=later.get))
    assert resumed["best_step"] > 24  # the tiny model's loss keeps falling after step 24: some later pass is better


def test_patience_and_select_metric_are_validated():
    assert load_config(None, {"train.patience": 3, "train.select_metric": "macro_f1"}).train.patience == 3
    with pytest.raises(UsageError, match=r"train.patience = -1: must be at least 0 \(0: never stop early\)"):
        load_config(None, {"train.patience": -1})
    with pytest.raises(UsageError, match=r"train.select_metric = 'f1': expected one of 'accuracy', 'macro_f1', 'loss'"):
        load_config(None, {"train.select_metric": "f1"})


def test_pretrain_refuses_a_metric_it_does_not_measure(synthetic_data_dir, tmp_path):
    cfg = tiny_config(synthetic_data_dir, tmp_path / "pre", train__select_metric="macro_f1")
    with pytest.raises(UsageError, match=r"train.select_metric = 'macro_f1': `tfm pretrain` measures the masked-LM "
                                         r"loss and accuracy only"):
        pretrain(cfg, progress=False)
    assert not (tmp_path / "pre").exists()
