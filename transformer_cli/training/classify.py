"""`tfm train`: supervised training of the classifier, from scratch or from a pretrained encoder
(`train.init_from`). Output directory: model.safetensors (best by validation), config.json, tokenizer.json,
metrics.json, TensorBoard events, and checkpoints/ for exact resume.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from transformer_cli import calibration, tb_pictures
from transformer_cli import checkpoint as ckpt
from transformer_cli.config import Config
from transformer_cli.data import Encoded, collate, prepare_eval_data, prepare_train_data, windows
from transformer_cli.errors import UsageError
from transformer_cli.evaluate import all_logits, evaluate_scaled
from transformer_cli.fileio import (
    write_json,
)
from transformer_cli.model import CTransformer
from transformer_cli.runtime import Runtime, make_runtime
from transformer_cli.training.loop import Batch, Logger, Run, selection_score
from transformer_cli.training.run import (
    begin,
    build_run,
    load_encoder,
    load_labels,
    load_tokenizer,
    on_every_rank,
    run_metrics,
    run_to_end,
)


class Classification:
    """Supervised training of the classifier: cross-entropy on the labels."""

    prefix = "train"

    def __init__(self, train: Encoded, val: Encoded, labels: list[str], eval_batch_size: int,
                 select_metric: str = "accuracy", tokenizer=None, val_texts: list[str] | None = None,
                 window: int | None = None, train_window: int | None = None, class_weights: list[float] | None = None):
        self.train, self.val, self.labels = train, val, labels
        # Weigh the training loss only (train/loss logs that objective); validation's loss stays unweighted, so that
        # val/loss compares across runs with and without weights.
        self.class_weights = None if class_weights is None else torch.tensor(class_weights, dtype=torch.float32)
        self.window, self.train_window = window, train_window  # data.long_text = "windows": reviews read whole
        self.val_texts = val_texts  # val's reviews, to show where one was cut (TensorBoard pictures)
        self.tokenizer = tokenizer  # the run's, to show validation reviews as text (TensorBoard pictures)
        self.eval_batch_size = eval_batch_size
        self.select_metric = select_metric
        self.lengths, self.num_train, self.num_val = train.lengths, len(train), len(val)
        if train_window is not None:
            self.lengths = np.minimum(train.lengths, train_window)
        self.val_tokens = int(val.lengths.sum())
        self.val_logits: torch.Tensor | None = None  # of the last validation pass, for pictures and calibration

    def batch(self, rt: Runtime, idx: np.ndarray, epoch: int = 0) -> Batch:
        """The reviews `idx`; with windows, one window of each, another each epoch."""
        if self.train_window is None:
            ids, mask, y = rt.tensors(*collate(self.train, idx))
        else:
            texts, _ = windows(self.train.subset(idx), self.train_window, pick=epoch + idx)
            ids, mask, y = rt.tensors(*collate(texts, np.arange(len(idx))))
        return Batch((ids, mask, y), len(idx), len(idx), int(self.lengths[idx].sum()))

    def loss(self, engine, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ids, mask, y = batch.tensors
        weights = None if self.class_weights is None else self.class_weights.to(ids.device)
        _, loss = engine(ids, mask, y, class_weights=weights)
        return loss, {"loss": loss.detach()}

    def log_pictures(self, writer, step: int, metrics: dict, data_cfg) -> None:
        tb_pictures.log_validation(writer, step, metrics, self.val_logits, self.val, self.labels, self.tokenizer,
                                   self.val_texts, data_cfg)

    def evaluate(self, run: Run) -> tuple[dict, dict[str, float], float]:
        m, self.val_logits = evaluate_scaled(run.model, self.val, run.rt, self.eval_batch_size, len(self.labels),
                                             self.labels, window=self.window)
        tags = {f"val/{k}": m[k] for k in ("loss", "accuracy", "macro_f1", "ece")}
        return m, tags, selection_score(m, self.select_metric)



def class_weights(setting: str | list[float] | None, train_labels: np.ndarray, labels: list[str]) -> list[float] | None:
    """train.class_weights for the classes `labels`: "balanced" is n / (K x count) for each class over the
    training labels (scikit-learn's), so that each class, all its reviews together, weighs as much in the loss."""
    if setting == "balanced":
        counts = np.bincount(train_labels, minlength=len(labels))
        if not counts.all():
            absent = ", ".join(name for name, n in zip(labels, counts) if n == 0)
            raise UsageError(f'train.class_weights = "balanced": the training part has no review of class {absent}; '
                             "give the weights as a list, one per class")
        return (len(train_labels) / (len(labels) * counts)).tolist()
    if setting is not None and len(setting) != len(labels):
        raise UsageError(f"train.class_weights = {setting!r}: {len(setting)} weights, but the data has {len(labels)} "
                         f"classes ({', '.join(labels)}); give one weight per class, in that order, or \"balanced\"")
    return setting


def setup(cfg: Config, rt: Runtime, resume: bool | str = False, force: bool = False) -> Run:
    """The classifier's run: output folder checked, data prepared, model built (from a pretrained
    encoder with `train.init_from`), optimizer ready, restored on resume."""
    tc = cfg.train
    resume_dir = begin(tc, rt, resume)
    # A resumed run keeps the tokenizer its weights were trained with, even if --force changed what
    # would train another; a fine-tuned one reads its pretrained encoder's.
    tokenizer = trained_labels = None
    if resume_dir is not None:
        tokenizer = load_tokenizer(resume_dir.parent.parent)
        trained_labels = load_labels(resume_dir.parent.parent)
    if tokenizer is None and tc.init_from:  # also a resumed run whose folder lost its copy
        tokenizer = load_tokenizer(Path(tc.init_from))
    needed = ("test",) if tc.test_at_end else ()  # refused now rather than after training
    data = on_every_rank(rt, lambda: prepare_train_data(cfg.data, tc.seed, tokenizer, needed))
    if trained_labels is not None and data.labels != trained_labels:  # the head's rows are those classes
        raise UsageError(f"the resumed run was trained on the classes ({', '.join(trained_labels)}), but its data "
                         f"now has ({', '.join(data.labels)}); resume on the data it was trained with, or start a "
                         "new run in another --output-dir")

    # The run's config says what it validated on ("" = a part held out of train), whatever the dataset
    # gains later: resume compares it, and `tfm evaluate --split validation` reads it.
    cfg = cfg.replace(data={"val_split": data.val_split})
    vocab_size = data.tokenizer.get_vocab_size()
    model = CTransformer(cfg.model, vocab_size, cfg.data.max_length, len(data.labels))
    if tc.init_from and resume_dir is None:
        load_encoder(model.encoder, Path(tc.init_from))
    d = cfg.data
    windowed = d.long_text == "windows"
    weights = class_weights(tc.class_weights, data.train.labels, data.labels)
    task = Classification(data.train, data.val, data.labels, tc.eval_batch_size, tc.select_metric or "accuracy",
                          data.tokenizer, data.val_texts, d.max_length if windowed else None,
                          (d.train_max_length or d.max_length) if windowed else None, weights)
    meta = {"class_weights": weights} if weights is not None else {}  # the weights used, beside the labels
    files = ckpt.model_files(cfg.to_dict(), data.tokenizer.to_str(), vocab_size, labels=data.labels, **meta)
    return build_run(cfg, rt, model, task, resume_dir, force, files)



def train(cfg: Config, resume: bool | str = False, force: bool = False, progress: bool = True,
          on_validation: Callable[[int, dict], None] | None = None) -> dict:
    """Run `tfm train`: returns the metrics that are also written to metrics.json. `on_validation(step, metrics)`
    is called after each validation pass (Run.on_validation)."""
    rt = make_runtime(cfg.train.device, cfg.train.precision)
    return run_to_end(rt, lambda: replace(setup(cfg, rt, resume, force), on_validation=on_validation), finish, resume,
                      progress)



def finish(run: Run, logger: Logger) -> dict:
    st, tc, task = run.state, run.cfg.train, run.task
    metrics = run_metrics(run)
    ckpt.load_weights(run.model, run.out / ckpt.MODEL_FILE)  # the best model, which what follows is of
    metrics["calibration"] = calibrate(run, logger)
    temperature = metrics["calibration"]["temperature"]
    if tc.test_at_end:
        test = prepare_eval_data(run.cfg.data, task.tokenizer, "test", run.cfg.data.max_eval_samples,
                                 label_names=task.labels)
        metrics["test"], _ = evaluate_scaled(run.model, test, run.rt, tc.eval_batch_size, len(task.labels), task.labels,
                                             temperature, task.window)
        logger.scalars(st.step, {"test/accuracy": metrics["test"]["accuracy"], "test/loss": metrics["test"]["loss"]})
    hp = {f"{s}.{k}": v for s, sec in run.cfg.to_dict().items() for k, v in sec.items() if v is not None}
    final = {"hparam/val_accuracy": st.best_val.get("accuracy", 0.0), "hparam/val_loss": st.best_val.get("loss", 0.0)}
    if "test" in metrics:
        final["hparam/test_accuracy"] = metrics["test"]["accuracy"]
    logger.hparams(hp, final, st.step)
    tb_pictures.log_attention(logger.writer, st.step, run.model, task.val, task.labels, task.tokenizer,
                              temperature)
    if run.rt.is_main:
        write_json(run.out / ckpt.METRICS_FILE, metrics)
    return metrics


def calibrate(run: Run, logger: Logger) -> dict:
    """The best model's temperature, fitted on the validation split (calibration.py), stored in
    config.json and logged. The last validation pass's logits are the best model's when it was the
    best; otherwise (e.g. a resumed run) they are computed again."""
    st, task = run.state, run.task
    logits = task.val_logits
    if logits is None or st.best_step != st.step:
        logits = all_logits(run.model, task.val, run.rt, run.cfg.train.eval_batch_size, len(task.labels), task.window)
    cal = calibration.calibrate(logits, task.val.labels)
    logger.scalars(st.step, {f"calibration/{k}": cal[k] for k in ("temperature", "ece_before", "ece_after")})
    if run.rt.is_main:
        calibration.save_calibration(run.out, cal)
    return cal
