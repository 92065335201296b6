"""Inference and metrics: loading a trained model, validation during training, `tfm evaluate`, `tfm predict`.

Batching: examples are sorted by length, so that a batch holds reviews of similar length and little
padding, and cut into batches of at most `batch_size` reviews and, on a CPU, at most CPU_BATCH_TOKENS
padded tokens per torch thread. Logits are gathered in input order into one tensor, and loss, confusion
matrix and probabilities are computed from it once.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from transformer_cli.calibration import expected_calibration_error, softmax, temperature_of
from transformer_cli.card import write_card
from transformer_cli.checkpoint import (
    CONFIG_FILE,
    MODEL_FILE,
    TOKENIZER_FILE,
    load_weights,
    read_tokenizer,
    refuse_pretrained_encoder,
)
from transformer_cli.config import FORMAT_VERSION, Config, DataConfig, check_device_and_precision, saved_config
from transformer_cli.data import (
    VALIDATION_SPLIT,
    Encoded,
    collate,
    encode_texts,
    length_batches,
    local_paths,
    prepare_eval_data,
    read_length,
    window_bounds,
    windows,
)
from transformer_cli.errors import TfmError, UsageError
from transformer_cli.fileio import read_json
from transformer_cli.model import CTransformer
from transformer_cli.runtime import Runtime, make_runtime, resolve_precision

CPU_BATCH_TOKENS = 4096  # padded tokens (reviews x longest review) per forward pass and torch thread on a CPU


def batches_for(enc: Encoded, batch_size: int, rt: Runtime) -> list[np.ndarray]:
    """This rank's batches of `enc`, sorted by length: under DDP each rank takes every world_size-th one."""
    max_tokens = CPU_BATCH_TOKENS * torch.get_num_threads() if rt.device.type == "cpu" else None
    return length_batches(enc.lengths, batch_size, max_tokens)[rt.rank :: rt.world_size]


def batched_logits(model, enc: Encoded, batches: list[np.ndarray], rt: Runtime, num_labels: int) -> torch.Tensor:
    """(len(enc), num_labels) float32 logits on the CPU, in the order of `enc`; rows of examples in no
    batch stay zero. The model must be in eval mode."""
    out = torch.zeros(len(enc), num_labels)
    with torch.inference_mode():
        for idx in batches:
            ids, mask, _ = rt.tensors(*collate(enc, idx))
            with rt.autocast():
                out[torch.from_numpy(idx)] = model(ids, mask).float().cpu()
    return out


def evaluate_model(enc: Encoded, rt: Runtime, batch_size: int, num_labels: int, logits: torch.Tensor,
                   label_names: list[str] | None = None) -> dict:
    """Loss, and metrics_from_confusion's accuracy, macro-F1, per-class figures and confusion matrix, of the
    `logits` of all of `enc` (all_logits, maybe temperature-scaled). Each rank sums its own batches' examples and
    the sums are reduced over ranks, so a distributed evaluation equals a single-process one."""
    batches = batches_for(enc, batch_size, rt)
    mine = np.concatenate(batches) if batches else np.zeros(0, dtype=np.int64)
    logits, y = logits[torch.from_numpy(mine)].double(), enc.labels[mine]
    loss_sum = F.cross_entropy(logits, torch.from_numpy(y), reduction="sum").item() if len(mine) else 0.0
    confusion = np.zeros((num_labels, num_labels), dtype=np.float64)  # rows: true, cols: predicted
    np.add.at(confusion, (y, logits.argmax(-1).numpy()), 1)
    reduced = rt.all_sum([loss_sum, *confusion.ravel().tolist()])
    loss_sum, confusion = reduced[0], np.array(reduced[1:]).reshape(num_labels, num_labels)
    out = metrics_from_confusion(confusion, label_names)
    out["loss"] = loss_sum / max(1, int(confusion.sum()))
    return out


def all_logits(model, enc: Encoded, rt: Runtime, batch_size: int, num_labels: int,
               window: int | None = None) -> torch.Tensor:
    """(len(enc), num_labels) float32 logits of every example of `enc`, on every rank: each rank computes
    its batches (batches_for) and the ranks' rows are summed. With `window` (data.long_text = "windows"), the
    mean of the logits of every window of that many tokens of each text. The model is in eval mode meanwhile."""
    texts, owner = (enc, None) if window is None else windows(enc, window)
    was_training = model.training
    model.eval()
    try:
        logits = batched_logits(model, texts, batches_for(texts, batch_size, rt), rt, num_labels)
    finally:
        model.train(was_training)
    if rt.distributed:  # each row is non-zero on one rank only: the sum gathers them
        logits = torch.tensor(rt.all_sum(logits.ravel().tolist()), dtype=torch.float32).view_as(logits)
    if owner is not None:
        counts = torch.from_numpy(np.bincount(owner, minlength=len(enc))).clamp(min=1)[:, None]
        logits = torch.zeros(len(enc), num_labels).index_add_(0, torch.from_numpy(owner), logits) / counts
    return logits


def evaluate_scaled(model, enc: Encoded, rt: Runtime, batch_size: int, num_labels: int,
                    label_names: list[str] | None = None, temperature: float = 1.0,
                    window: int | None = None) -> tuple[dict, torch.Tensor]:
    """(evaluate_model's metrics of logits / temperature, plus "ece" and "examples_per_sec"; those logits): one
    forward pass whose logits the caller may reuse (plots, calibration)."""
    t0 = time.perf_counter()
    logits = all_logits(model, enc, rt, batch_size, num_labels, window) / temperature
    metrics = evaluate_model(enc, rt, batch_size, num_labels, logits, label_names)
    elapsed = time.perf_counter() - t0
    metrics["examples_per_sec"] = len(enc) / elapsed if elapsed > 0 else 0.0
    metrics["ece"] = expected_calibration_error(softmax(logits), enc.labels)
    return metrics, logits


def metrics_from_confusion(confusion: np.ndarray, label_names: list[str] | None = None) -> dict:
    """Accuracy, macro-F1, each class's precision, recall, F1 and support (under its name; default
    its id), and the confusion matrix (rows: true class, columns: predicted) with its `labels`.

    A ratio of zero counts is 0, never NaN. Macro-F1 is the mean F1 of the classes that occur in
    the split or are predicted (a class that is neither has no F1 to average).
    """
    names = list(label_names) if label_names is not None else [str(i) for i in range(len(confusion))]
    confusion = np.asarray(confusion, dtype=np.float64)
    n = confusion.sum()
    hits, predicted, support = np.diag(confusion), confusion.sum(axis=0), confusion.sum(axis=1)
    precision = _ratio(hits, predicted)
    recall = _ratio(hits, support)
    f1 = _ratio(2 * precision * recall, precision + recall)
    seen = (predicted + support) > 0
    return {
        "accuracy": float(np.trace(confusion) / n) if n else 0.0,
        "macro_f1": float(f1[seen].mean()) if seen.any() else 0.0,
        "per_class": {
            name: {"precision": float(p), "recall": float(r), "f1": float(f), "support": int(s)}
            for name, p, r, f, s in zip(names, precision, recall, f1, support)
        },
        "confusion_matrix": confusion.astype(int).tolist(),
        "labels": names,
        "num_examples": int(n),
    }


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b elementwise, 0 where b is 0."""
    return np.divide(a, b, out=np.zeros_like(a, dtype=np.float64), where=b > 0)


def window_of(cfg: DataConfig) -> int | None:
    """The window length inference reads whole reviews in (data.long_text = "windows"), else None."""
    return cfg.max_length if cfg.long_text == "windows" else None


def encode_reviews(tokenizer, texts: list[str], cfg: DataConfig) -> Encoded:
    """Reviews encoded as the model reads them (truncated, or whole for windows), with no labels."""
    ids, offsets = encode_texts(tokenizer, texts, read_length(cfg), cfg.truncation)
    return Encoded(ids, offsets, np.zeros(len(texts), dtype=np.int64))


def predict_proba(model, enc: Encoded, cfg: DataConfig, rt: Runtime, batch_size: int = 64,
                  temperature: float = 1.0) -> np.ndarray:
    """(N, num_labels) probabilities of logits / temperature of encode_reviews' texts, in their order."""
    logits = all_logits(model, enc, rt, batch_size, model.head.out_features, window_of(cfg))
    return softmax(logits, temperature)


class ModelDir(NamedTuple):
    """A `tfm train` output directory, loaded."""

    model: CTransformer  # in eval mode
    cfg: Config
    tokenizer: Any  # tokenizers.Tokenizer
    labels: list[str]
    temperature: float  # the calibration (config.json): predictions divide the logits by it; 1.0 if none


class Loaded(NamedTuple):
    """load_for_inference's result: a ModelDir's fields with the runtime that runs it."""

    rt: Runtime
    model: CTransformer
    cfg: Config
    tokenizer: Any
    labels: list[str]
    temperature: float


def load_model_dir(path: str | Path, device="cpu") -> ModelDir:
    """The model (in eval mode), Config, tokenizer, labels and temperature of a `tfm train` output
    directory, its config.json read once."""
    out = Path(path)
    if not out.is_dir():
        what = "is a file, not a directory" if out.exists() else "does not exist"
        raise TfmError(f"checkpoint directory '{out}' {what}; pass the --output-dir of a `tfm train` run")
    for name in (CONFIG_FILE, TOKENIZER_FILE, MODEL_FILE):
        if not (out / name).is_file():
            refuse_pretrained_encoder(out)  # first: a pretraining that saved no model yet is no classifier either
            raise TfmError(f"'{out}' is not a complete model directory: {name} is missing")
    meta = read_json(out / CONFIG_FILE, "config")
    refuse_pretrained_encoder(out, meta)
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        version = meta.get("format_version") if isinstance(meta, dict) else None
        raise TfmError(f"'{out / CONFIG_FILE}' has format version {version!r}; this tfm reads version {FORMAT_VERSION}")
    saved = saved_config(meta, out / CONFIG_FILE)
    try:
        cfg = Config.from_dict({k: saved[k] for k in ("model", "data", "train")})
        labels, vocab_size = meta["labels"], int(meta["vocab_size"])
        if not (isinstance(labels, list) and len(labels) >= 2 and all(isinstance(x, str) for x in labels)
                and len(set(labels)) == len(labels)):
            raise ValueError(f"labels must be a list of at least two distinct names, not {labels!r}")
    except (KeyError, TypeError, ValueError, TfmError) as e:  # TfmError: a value the config refuses
        raise TfmError(f"'{out / CONFIG_FILE}' is incomplete or invalid ({e})") from None
    temperature = temperature_of(meta, str(out / CONFIG_FILE))
    tokenizer = read_tokenizer(out / TOKENIZER_FILE)
    if tokenizer.get_vocab_size() != vocab_size:
        raise TfmError(f"tokenizer in '{out}' has {tokenizer.get_vocab_size()} tokens but config.json says "
                       f"{vocab_size}")
    model = CTransformer(cfg.model, vocab_size, cfg.data.max_length, len(labels))
    load_weights(model, out / MODEL_FILE)
    # aminmax carries a NaN or inf through to its result, and reads each tensor faster than isfinite().all().
    bad = [name for name, t in model.state_dict().items()
           if t.is_floating_point() and not all(v.isfinite() for v in t.aminmax())]
    if bad:
        raise TfmError(f"weights in '{out / MODEL_FILE}' are not finite (NaN or inf in {', '.join(bad[:3])}); "
                       "the file is damaged or the run diverged: train again")
    return ModelDir(model.to(device).eval(), cfg, tokenizer, labels, temperature)


def load_for_inference(model_dir: str | Path, device: str, precision: str | None) -> Loaded:
    """A `tfm train` output directory with the runtime to run it on. `precision` None: fp32 for a run
    trained in fp32, else "auto" (this machine's mixed precision, if it has one)."""
    check_device_and_precision(device, precision)
    rt = make_runtime(device, "fp32")
    loaded = Loaded(rt, *load_model_dir(model_dir, rt.device))
    if precision is None:
        precision = "fp32" if loaded.cfg.train.precision == "fp32" else "auto"
    rt.amp_dtype = resolve_precision(precision, rt.device)
    return loaded


def predict_texts(model_dir: str | Path, texts: list[str], device: str = "auto", batch_size: int = 64,
                  precision: str | None = None) -> list[dict]:
    """[{"label", "score", "probabilities"}] for each text, from a `tfm train` output directory."""
    if not texts:
        raise TfmError("no input texts; pass TEXT arguments or --file PATH (one review per line)")
    return predict_loaded(load_for_inference(model_dir, device, precision), texts, batch_size)


def predict_loaded(loaded: Loaded, texts: list[str], batch_size: int = 64) -> list[dict]:
    """predict_texts with a model already loaded by load_for_inference (`tfm serve` loads it once)."""
    rt, model, cfg, tokenizer, labels, temperature = loaded
    enc = encode_reviews(tokenizer, texts, cfg.data)
    probs = predict_proba(model, enc, cfg.data, rt, batch_size, temperature)
    results = [{"label": labels[int(p.argmax())], "score": float(p.max()),
                "probabilities": {name: float(q) for name, q in zip(labels, p)}} for p in probs]
    if cfg.data.long_text == "windows":  # how many windows each review was read in
        for r, n in zip(results, enc.lengths):
            r["windows"] = len(window_bounds(int(n), cfg.data.max_length)) - 1
    return results


def warm_up(loaded: Loaded, batch_size: int = 64) -> None:
    """Pay a fresh process's first-call costs before the first request (`tfm serve`): one prediction."""
    predict_loaded(loaded, ["warm-up"], batch_size)


def evaluate_checkpoint(model_dir: str | Path, data: str | None = None, split: str = "test",
                        max_samples: int | None = None, device: str = "auto", batch_size: int | None = None,
                        precision: str | None = None, report: str | Path | None = None,
                        text_column: str | None = None, label_column: str | None = None) -> dict:
    """Metrics of a saved model on a split of its dataset (or of `data`, whose columns may be named
    otherwise than the run's: `text_column`, `label_column`), its logits divided by its calibration
    temperature. Split "validation" is what the run validated on (data.train_val_splits, with its seed):
    the split its best model was chosen on. `report`: a folder for report.write_report's plots and report.html."""
    rt, model, cfg, tokenizer, labels, temperature = load_for_inference(model_dir, device, precision)
    src = cfg.data.source
    columns = {k: v for k, v in (("text_column", text_column), ("label_column", label_column)) if v is not None}
    if columns:
        cfg = cfg.replace(data=columns)
    if data is not None:
        cfg = cfg.replace(data={"source": data})
    elif any(not Path(f).is_absolute() and not Path(f).exists() for f in local_paths(src)):
        raise UsageError(f"the run's dataset '{src}' (its data.source, relative to where `tfm train` ran) "
                         "is not found from here; pass --data")
    t0 = time.perf_counter()
    try:
        enc = prepare_eval_data(cfg.data, tokenizer, split, max_samples, cfg.train.seed, labels)
    except UsageError as e:
        if split == VALIDATION_SPLIT or f"has no '{split}' split" not in str(e):
            raise
        raise UsageError(f"{e}; evaluate the part the run validated on with --split {VALIDATION_SPLIT}") from None
    prep = time.perf_counter() - t0
    metrics, logits = evaluate_scaled(model, enc, rt, batch_size or cfg.train.eval_batch_size, len(labels), labels,
                                      temperature, window_of(cfg.data))
    metrics.update({"split": split, "data": cfg.data.source, "data_prep_sec": prep, "compute_dtype": rt.precision,
                    "temperature": temperature})  # not "precision": that is a class's metric
    if split == "test" and data is None and max_samples is None and columns == {}:  # the run's own test split
        try:
            write_card(model_dir, test=metrics)
        except OSError:
            pass  # a model directory that cannot be written (read-only, say) keeps its card
    if report is not None:
        from transformer_cli.report import write_report  # imports matplotlib

        write_report(report, metrics, softmax(logits), enc.labels, enc.lengths)
    return metrics
