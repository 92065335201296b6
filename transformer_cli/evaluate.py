"""Inference and metrics: used by validation during training, `tfm evaluate` and `tfm predict`."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from transformer_cli.data import Encoded, collate, encode_texts
from transformer_cli.errors import TfmError
from transformer_cli.runtime import Runtime


def _eval_batches(enc: Encoded, batch_size: int, rt: Runtime):
    """Length-sorted batches (little padding); under DDP each rank takes every world_size-th."""
    order = np.argsort(enc.lengths, kind="stable")
    starts = range(0, len(order), batch_size)
    for start in list(starts)[rt.rank :: rt.world_size]:
        yield order[start : start + batch_size]


@torch.inference_mode()
def evaluate_model(model, enc: Encoded, rt: Runtime, batch_size: int, num_labels: int) -> dict:
    """Loss, accuracy, precision/recall/F1 (of the last label, "pos") and the confusion matrix.

    Sums are reduced over ranks, so a distributed evaluation equals a single-process one.
    """
    was_training = model.training
    model.eval()
    confusion = np.zeros((num_labels, num_labels), dtype=np.float64)  # rows: true, cols: predicted
    loss_sum = 0.0
    t0 = time.perf_counter()
    for idx in _eval_batches(enc, batch_size, rt):
        ids, mask, y = rt.tensors(*collate(enc, idx))
        with rt.autocast():
            logits = model(ids, mask).float()
        loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
        np.add.at(confusion, (y.cpu().numpy(), logits.argmax(-1).cpu().numpy()), 1)
    elapsed = time.perf_counter() - t0
    model.train(was_training)
    reduced = rt.all_sum([loss_sum, *confusion.ravel().tolist()])
    loss_sum, confusion = reduced[0], np.array(reduced[1:]).reshape(num_labels, num_labels)
    out = metrics_from_confusion(confusion)
    out["loss"] = loss_sum / max(1, int(confusion.sum()))
    out["examples_per_sec"] = len(enc) / elapsed if elapsed > 0 else 0.0
    return out


def metrics_from_confusion(confusion: np.ndarray) -> dict:
    n = confusion.sum()
    tp = confusion[-1, -1]
    pred_pos, true_pos = confusion[:, -1].sum(), confusion[-1, :].sum()
    precision = tp / pred_pos if pred_pos else 0.0
    recall = tp / true_pos if true_pos else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {
        "accuracy": float(np.trace(confusion) / n) if n else 0.0,
        "precision": float(precision),
        "recall": float(recall),
        "f1": float(f1),
        "confusion_matrix": confusion.astype(int).tolist(),
        "num_examples": int(n),
    }


@torch.inference_mode()
def predict_proba(model, tokenizer, texts: list[str], max_length: int, truncation: str,
                  head_fraction: float, rt: Runtime, batch_size: int = 64) -> np.ndarray:
    """(N, num_labels) probabilities, in the order of `texts`."""
    ids, offsets = encode_texts(tokenizer, texts, max_length, truncation, head_fraction)
    enc = Encoded(ids, offsets, np.zeros(len(texts), dtype=np.int64))
    probs = np.zeros((len(texts), model.head.out_features), dtype=np.float64)
    order = np.argsort(enc.lengths, kind="stable")
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        x, mask, _ = rt.tensors(*collate(enc, idx))
        with rt.autocast():
            logits = model(x, mask).float()
        probs[idx] = logits.softmax(-1).cpu().numpy()
    return probs


def predict_texts(model_dir: str | Path, texts: list[str], device: str = "auto", batch_size: int = 64) -> list[dict]:
    """[{"label", "score", "probabilities"}] for each text, from a `tfm train` output directory."""
    from transformer_cli.checkpoint import load_model_dir
    from transformer_cli.runtime import make_runtime

    if not texts:
        raise TfmError("no input texts; pass TEXT arguments or --file PATH (one review per line)")
    rt = make_runtime(device, "fp32")
    model, cfg, tokenizer, labels = load_model_dir(model_dir, rt.device)
    d = cfg.data
    probs = predict_proba(model, tokenizer, texts, d.max_length, d.truncation, d.head_fraction, rt, batch_size)
    return [
        {
            "label": labels[int(p.argmax())],
            "score": float(p.max()),
            "probabilities": {name: float(q) for name, q in zip(labels, p)},
        }
        for p in probs
    ]


def evaluate_checkpoint(model_dir: str | Path, data: str | None = None, split: str = "test",
                        max_samples: int | None = None, device: str = "auto", batch_size: int | None = None) -> dict:
    """Metrics of a saved model on a split of its dataset (or of `data`)."""
    from transformer_cli.checkpoint import load_model_dir
    from transformer_cli.data import prepare_eval_data
    from transformer_cli.runtime import make_runtime

    rt = make_runtime(device, "fp32")
    model, cfg, tokenizer, labels = load_model_dir(model_dir, rt.device)
    if data is not None:
        cfg = cfg.replace(data={"source": data})
    t0 = time.perf_counter()
    enc = prepare_eval_data(cfg.data, tokenizer, split, max_samples)
    prep = time.perf_counter() - t0
    metrics = evaluate_model(model, enc, rt, batch_size or cfg.train.eval_batch_size, len(labels))
    metrics.update({"split": split, "data": cfg.data.source, "labels": labels, "data_prep_sec": prep})
    return metrics
