"""Inference and metrics: loading a trained model, validation during training, `tfm evaluate`
and `tfm predict`.

Batching: examples are sorted by length, so that a batch holds reviews of similar length and
little padding, and cut into batches of at most `batch_size` reviews. On the CPU a batch also
holds at most `CPU_TOKENS_PER_THREAD` tokens per torch thread (reviews x longest review, before
`collate` rounds the width up), so that its activations stay in the core's caches, and the cuts
are placed where padding plus a forward pass's own cost is least (`batch_plan`). Where the bf16
attention kernel runs, a pass instead holds its texts end to end with no padding (`packs`,
`pack_plan`: passes of even work), which a few texts of scattered lengths gain most from. The CPU's
torch threads are split between up to `CPU_WORKERS` workers, each running whole batches on its
share, rather than all threads sharing each small operation; the cap keeps the workers' Python
work, serialised by the GIL, small beside their batches on many cores. Logits are gathered in
input order into one tensor, and loss, confusion matrix and probabilities are computed from it once.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from transformer_cli import kernels
from transformer_cli.calibration import expected_calibration_error, softmax, temperature_of
from transformer_cli.checkpoint import (
    CONFIG_FILE,
    MODEL_FILE,
    TOKENIZER_FILE,
    load_weights,
    read_tokenizer,
    refuse_pretrained_encoder,
)
from transformer_cli.config import FORMAT_VERSION, Config, check_device_and_precision, with_legacy_values
from transformer_cli.data import (
    PAD_ID,
    PAD_MULTIPLE,
    Encoded,
    collate,
    collate_packed,
    encode_texts,
    local_paths,
    prepare_eval_data,
)
from transformer_cli.errors import TfmError, UsageError
from transformer_cli.fileio import read_json
from transformer_cli.model import CTransformer, Packed
from transformer_cli.runtime import Runtime, keep_freed_memory, make_runtime, resolve_precision

CPU_TOKENS_PER_THREAD = 4096  # padded tokens (reviews x longest review) per forward pass and CPU thread
BATCH_CALL_TOKENS = 256  # a forward pass's own cost (Python, dispatch) in padded tokens' worth of work
CPU_WORKERS = 4  # at most this many workers share the CPU's torch threads (1: all threads share each op)


def cpu_workers() -> tuple[int, int]:
    """(workers, torch threads per worker): as many workers as the cap allows, threads shared evenly."""
    threads = torch.get_num_threads()
    per_worker = -(-threads // max(1, CPU_WORKERS))  # ceil
    return threads // per_worker, per_worker


def cpu_batch_tokens() -> int:
    return CPU_TOKENS_PER_THREAD * cpu_workers()[1]


def packs(model, rt: Runtime) -> bool:
    """Whether `batched_logits` runs `model` on packed texts (`CTransformer.packed_logits`, no padding): where
    its attention is the hand-written kernel, which takes them as they are (bf16 inference on a CPU with
    AVX-512 BF16, `attention = "auto"`, a head size it has). Elsewhere attention would pad each pass again,
    and the padded batches of `batch_plan` are as cheap."""
    if not isinstance(model, CTransformer):
        return False
    cfg = model.cfg
    return (cfg.attention == "auto" and cfg.d_model // cfg.n_heads in kernels.HEAD_SIZES and rt.device.type == "cpu"
            and rt.amp_dtype is torch.bfloat16 and kernels.available())


def _plan(lengths: np.ndarray, batch_size: int, rt: Runtime, model) -> list[np.ndarray]:
    if packs(model, rt):
        return pack_plan(lengths, batch_size, cpu_batch_tokens(), cpu_workers()[0], attention_length(model))
    return batch_plan(lengths, batch_size, cpu_batch_tokens() if rt.device.type == "cpu" else None)


def attention_length(model: CTransformer) -> float:
    """The text length at which a token's attention has the FLOPs of the rest of its layer (4 T C against
    24 C^2 with a feed-forward layer 4 C wide): beyond it attention is most of a text's work."""
    return 6 * model.cfg.d_model


def text_work(lengths: np.ndarray, attention_length: float = math.inf) -> np.ndarray:
    """A packed text's work in tokens' worth: L (1 + L / attention_length) for L tokens."""
    lengths = lengths.astype(np.float64)
    return lengths * (1 + lengths / attention_length)


def pack_plan(lengths: np.ndarray, batch_size: int, max_tokens: int, parts: int = 1,
              attention_length: float = math.inf) -> list[np.ndarray]:
    """Indices sorted by length (stable), cut into passes of packed texts, of about `max_tokens` tokens and at
    most `batch_size` texts, and of even work (`text_work`: attention grows with a text's length). The
    number of passes is the tokens over `max_tokens` rounded to the nearest, not up, as long as a pass
    holds on average at most `max_tokens` plus the longest text: a few texts just over a budget go in
    one pass rather than two half ones, each with a pass's own cost (docs/experiments.md#evaluation-speed).
    Where there are enough texts the number of passes is a multiple of `parts`, so that as many
    workers get even shares: 32 reviews on 2 workers make 2 or 4 passes of equal work."""
    order = np.argsort(lengths, kind="stable")
    n = len(order)
    if n == 0:
        return []
    total, max_tokens = int(lengths.sum()), max(max_tokens, 1)
    k = max(int(total / max_tokens + 0.5), -(-total // (max_tokens + int(lengths.max()))), 1)
    k = min(n, -(-k // parts) * parts)
    work = np.cumsum(text_work(lengths[order], attention_length))  # up to and including each text
    # a pass ends with the text that brings it to its share of the work
    cuts = np.unique(np.searchsorted(work, work[-1] * np.arange(1, k) / k) + 1)
    cuts = [0, *cuts[(cuts > 0) & (cuts < n)].tolist(), n]
    return [order[i:j][r : r + batch_size] for i, j in itertools.pairwise(cuts) for r in range(0, j - i, batch_size)]


def batch_plan(lengths: np.ndarray, batch_size: int, max_tokens: int | None = None) -> list[np.ndarray]:
    """Indices sorted by length (stable), cut into batches of at most `batch_size` rows. Without
    `max_tokens`: batches of exactly `batch_size` (the last one shorter). With it (the CPU): at most
    `max_tokens` padded tokens a batch (a single longer row gets a batch of its own), cut where the
    padded tokens plus BATCH_CALL_TOKENS a batch add up to the least. A few reviews of scattered
    lengths, as `tfm serve` gets them, then go in several short batches rather than one padded to the
    longest review; on a whole split, where neighbours have nearly equal lengths, the batches come out
    nearly as full as the limits allow."""
    order = np.argsort(lengths, kind="stable")
    if not max_tokens:
        return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    s = lengths[order]
    n = len(s)
    batch_size = min(batch_size, max(n, 1))  # no batch has more rows than there are: the work is O(n), not O(batch_size)
    cost = np.zeros(n + 1)  # cost[j]: of the best plan for the j shortest rows
    start = np.zeros(n + 1, dtype=np.int64)  # where that plan's last batch starts
    rows = np.arange(1, batch_size + 1)
    for j, longest in enumerate(s.tolist(), 1):  # the last batch: rows j - k .. j - 1, padded to `longest`
        most = max(1, min(batch_size, j, max_tokens // max(longest, 1)))
        total = cost[j - most : j][::-1] + rows[:most] * longest  # (most,): for k = 1 .. most
        k = int(np.argmin(total)) + 1
        cost[j], start[j] = total[k - 1] + BATCH_CALL_TOKENS, j - k
    cuts = [n]
    while cuts[-1] > 0:
        cuts.append(int(start[cuts[-1]]))
    return [order[i:j] for i, j in itertools.pairwise(reversed(cuts))]


def batches_for(model, enc: Encoded, batch_size: int, rt: Runtime) -> list[np.ndarray]:
    """This rank's batches of `enc` as `batched_logits` runs them on `model`: under DDP each rank takes
    every world_size-th one."""
    return _plan(enc.lengths, batch_size, rt, model)[rt.rank :: rt.world_size]


def batched_logits(model, enc: Encoded, batches: list[np.ndarray], rt: Runtime, num_labels: int) -> torch.Tensor:
    """(len(enc), num_labels) float32 logits on the CPU, in the order of `enc`; rows of examples in no
    batch stay zero. The model must be in eval mode."""

    packed = packs(model, rt)

    def forward(idx: np.ndarray) -> torch.Tensor:
        with torch.inference_mode():  # thread-local, as autocast is: entered in the worker
            if packed:
                ids, offsets = collate_packed(enc, idx)
                packed_texts = Packed(*rt.tensors(offsets), int(np.diff(offsets).max()))
                with rt.autocast():
                    return model.packed_logits(*rt.tensors(ids), packed_texts).float()[: len(idx)].cpu()
            ids, mask, _ = rt.tensors(*collate(enc, idx))
            with rt.autocast():
                return model(ids, mask).float().cpu()

    def cost(idx: np.ndarray) -> float:  # a pass's work, as the plan weighs it
        if packed:
            return float(text_work(enc.lengths[idx], attention_length(model)).sum())
        return len(idx) * int(enc.lengths[idx].max())

    workers, per_worker = cpu_workers() if rt.device.type == "cpu" else (1, 0)
    if workers > 1 and len(batches) > 1:
        # the largest batches first, so that the workers end together (longest processing time first)
        batches = sorted(batches, key=lambda idx: -cost(idx))
        with torch_threads(per_worker):
            futures = [worker_pool(workers, per_worker).submit(forward, idx) for idx in batches]
            try:
                results = [f.result() for f in futures]
            finally:  # on an error or Ctrl-C, batches not started yet are dropped, not run
                for f in futures:
                    f.cancel()
    else:
        # a lone packed pass (a call of one review, or a few short ones) runs here on one worker's threads:
        # with each operation shared between all threads it took twice as long, and handing it to a worker
        # added a hand-off between threads to each call (docs/experiments.md). A lone padded batch still
        # runs faster on all threads.
        with torch_threads(per_worker if packed and workers > 1 else torch.get_num_threads()):
            results = [forward(idx) for idx in batches]
    out = torch.zeros(len(enc), num_labels)
    for idx, logits in zip(batches, results):
        out[torch.from_numpy(idx)] = logits
    return out


_pools: dict[tuple[int, int], ThreadPoolExecutor] = {}
os.register_at_fork(after_in_child=_pools.clear)  # a forked child has none of the parent's threads


def worker_pool(workers: int, per_worker: int) -> ThreadPoolExecutor:
    """The process's pool of `workers` threads with `per_worker` torch threads each (torch's thread
    count is per thread: each worker sets its own), made on first use and kept for later calls."""
    pool = _pools.get((workers, per_worker))
    if pool is None:
        pool = _pools[workers, per_worker] = ThreadPoolExecutor(
            workers, thread_name_prefix="tfm-eval", initializer=torch.set_num_threads, initargs=(per_worker,))
    return pool


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op thread count set to n inside, and restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def evaluate_model(model, enc: Encoded, rt: Runtime, batch_size: int, num_labels: int,
                   label_names: list[str] | None = None, logits: torch.Tensor | None = None) -> dict:
    """Loss, and metrics_from_confusion's accuracy, macro-F1, per-class figures and confusion matrix.

    Sums are reduced over ranks, so a distributed evaluation equals a single-process one. `logits`:
    those of all of `enc` already computed (all_logits, maybe temperature-scaled): no forward pass.
    """
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    batches = batches_for(model, enc, batch_size, rt)
    try:
        if logits is None:
            logits = batched_logits(model, enc, batches, rt, num_labels)
    finally:
        model.train(was_training)
    mine = np.concatenate(batches) if batches else np.zeros(0, dtype=np.int64)
    logits, y = logits[torch.from_numpy(mine)].double(), enc.labels[mine]
    loss_sum = F.cross_entropy(logits, torch.from_numpy(y), reduction="sum").item() if len(mine) else 0.0
    confusion = np.zeros((num_labels, num_labels), dtype=np.float64)  # rows: true, cols: predicted
    np.add.at(confusion, (y, logits.argmax(-1).numpy()), 1)
    elapsed = time.perf_counter() - t0
    reduced = rt.all_sum([loss_sum, *confusion.ravel().tolist()])
    loss_sum, confusion = reduced[0], np.array(reduced[1:]).reshape(num_labels, num_labels)
    out = metrics_from_confusion(confusion, label_names)
    out["loss"] = loss_sum / max(1, int(confusion.sum()))
    out["examples_per_sec"] = len(enc) / elapsed if elapsed > 0 else 0.0
    return out


def all_logits(model, enc: Encoded, rt: Runtime, batch_size: int, num_labels: int) -> torch.Tensor:
    """(len(enc), num_labels) float32 logits of every example of `enc`, on every rank: each rank computes
    its batches (batches_for) and the ranks' rows are summed. The model is in eval mode meanwhile."""
    was_training = model.training
    model.eval()
    try:
        logits = batched_logits(model, enc, batches_for(model, enc, batch_size, rt), rt, num_labels)
    finally:
        model.train(was_training)
    if rt.distributed:  # each row is non-zero on one rank only: the sum gathers them
        logits = torch.tensor(rt.all_sum(logits.ravel().tolist()), dtype=torch.float32).view_as(logits)
    return logits


def evaluate_scaled(model, enc: Encoded, rt: Runtime, batch_size: int, num_labels: int,
                    label_names: list[str] | None = None, temperature: float = 1.0) -> tuple[dict, torch.Tensor]:
    """(evaluate_model's metrics of logits / temperature, plus "ece"; those logits): one forward pass
    whose logits the caller may reuse (plots, calibration)."""
    t0 = time.perf_counter()
    logits = all_logits(model, enc, rt, batch_size, num_labels) / temperature
    metrics = evaluate_model(model, enc, rt, batch_size, num_labels, label_names, logits=logits)
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


def predict_proba(model, tokenizer, texts: list[str], max_length: int, truncation: str,
                  head_fraction: float, rt: Runtime, batch_size: int = 64, temperature: float = 1.0) -> np.ndarray:
    """(N, num_labels) probabilities of logits / temperature, in the order of `texts`. The model must be
    in eval mode."""
    ids, offsets = encode_texts(tokenizer, texts, max_length, truncation, head_fraction)
    enc = Encoded(ids, offsets, np.zeros(len(texts), dtype=np.int64))
    logits = batched_logits(model, enc, _plan(enc.lengths, batch_size, rt, model), rt, model.head.out_features)
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
    try:
        cfg = Config.from_dict(with_legacy_values({k: meta[k] for k in ("model", "data", "train")}))
        labels, vocab_size = meta["labels"], int(meta["vocab_size"])
        if not (isinstance(labels, list) and len(labels) >= 2 and all(isinstance(x, str) for x in labels)
                and len(set(labels)) == len(labels)):
            raise ValueError(f"labels must be a list of at least two distinct names, not {labels!r}")
    except (KeyError, TypeError, ValueError, TfmError) as e:  # TfmError: a value the config refuses
        raise TfmError(f"'{out / CONFIG_FILE}' is incomplete or invalid ({e})") from None
    temperature = temperature_of(meta, str(out / CONFIG_FILE))
    tokenizer = read_tokenizer(out / TOKENIZER_FILE)
    if tokenizer.get_vocab_size() != vocab_size:
        raise TfmError(f"tokenizer in '{out}' has {tokenizer.get_vocab_size()} tokens but config.json says {vocab_size}")
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
    trained in fp32, else "auto" (this machine's mixed precision, if it has one). On the CPU, the process's
    malloc keeps freed memory from then on (runtime.keep_freed_memory)."""
    check_device_and_precision(device, precision)
    rt = make_runtime(device, "fp32")
    if rt.device.type == "cpu":
        keep_freed_memory()
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
    d = cfg.data
    probs = predict_proba(model, tokenizer, texts, d.max_length, d.truncation, d.head_fraction, rt, batch_size,
                          temperature)
    return [
        {
            "label": labels[int(p.argmax())],
            "score": float(p.max()),
            "probabilities": {name: float(q) for name, q in zip(labels, p)},
        }
        for p in probs
    ]


WARM_TEXT_TOKENS = 256  # the length of warm_up's texts: short ones keep its attention cheap


def warm_up(loaded: Loaded, batch_size: int = 64) -> None:
    """Pay a fresh process's first-call costs before the first request (`tfm serve`): one prediction
    and, where passes are packed, one pass of each width that a pass of up to cpu_batch_tokens() plus
    a longest review has (multiples of PAD_MULTIPLE). oneDNN builds its matmul kernels for each new
    width the first time it meets it, which made that pass take about twice as long; a server that met
    them among its first requests answered those far slower (docs/serving.md)."""
    rt, model, cfg = loaded.rt, loaded.model, loaded.cfg
    predict_loaded(loaded, ["warm-up"], batch_size)
    if not packs(model, rt):
        return  # padded batches have too many shapes (rows x width) to sweep
    longest = min(cfg.data.max_length, WARM_TEXT_TOKENS)
    widths = range(PAD_MULTIPLE, cpu_batch_tokens() + cfg.data.max_length + 1, PAD_MULTIPLE)
    lengths, plan = [], []
    for width in widths:  # a pass of `width` tokens: texts of at most `longest` tokens, of near-equal lengths
        k = -(-width // longest)
        plan.append(np.arange(len(lengths), len(lengths) + k))
        lengths += [width // k + (i < width % k) for i in range(k)]
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    texts = Encoded(np.full(int(offsets[-1]), PAD_ID, dtype=np.int32), offsets, np.zeros(len(lengths), dtype=np.int64))
    batched_logits(model, texts, plan, rt, len(loaded.labels))


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
    enc = prepare_eval_data(cfg.data, tokenizer, split, max_samples, cfg.train.seed, labels)
    prep = time.perf_counter() - t0
    metrics, logits = evaluate_scaled(model, enc, rt, batch_size or cfg.train.eval_batch_size, len(labels), labels,
                                      temperature)
    metrics.update({"split": split, "data": cfg.data.source, "data_prep_sec": prep, "compute_dtype": rt.precision,
                    "temperature": temperature})  # not "precision": that is a class's metric
    if report is not None:
        from transformer_cli.report import write_report  # imports matplotlib

        write_report(report, metrics, softmax(logits), enc.labels, enc.lengths)
    return metrics
