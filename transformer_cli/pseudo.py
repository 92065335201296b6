"""`tfm pseudo-label`: trained classifiers label unlabelled reviews, for self-training.

Self-training: a model fine-tuned on the labelled reviews labels the unlabelled ones (by default
IMDB's `unsupervised` split), and a new model trains on both (`tfm train data.pseudo_labels=FILE`),
keeping the pseudo-labels its teacher was sure of (`data.pseudo_min_score`). The student is still
the transformer alone: the teachers are `tfm train` runs too. Several teachers average their
calibrated probabilities, class by class (by name: their classes may be listed in different orders).

The file is JSON lines, one per review in the split's order: {"text", "label", "score"}, where
score is the (averaged) probability of the label. Validation and test labels are never read. The
split is read from its memory-mapped table and labelled and written a chunk at a time, so a split
larger than memory can be labelled.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from transformer_cli.data import (
    UNLABELLED_SPLIT,
    open_text_source,
    sample_indices,
    source_files,
    text_chunks,
    unread_split_hint,
)
from transformer_cli.errors import TfmError, UsageError
from transformer_cli.evaluate import encode_reviews, load_for_inference, predict_proba
from transformer_cli.fileio import atomic_writer, check_output_path

SUBSET_SEED = 0  # --max-samples draws the same reviews every time
CHUNK_TEXTS = 4096  # reviews read, labelled and written at a time: one chunk is in memory, whatever the split's size


def split_table(source: str, split: str, column: str, max_samples: int | None = None):
    """One split of a data source (Hub id, Hub-layout folder or data files) as a memory-mapped `datasets`
    table of its `column` (a seeded sample of `max_samples` rows), every value checked to be non-empty
    text before any is labelled."""
    ds = open_text_source(source, (split,))
    if split not in ds:
        raise UsageError(f"'{source}' has no split '{split}' (it has: {', '.join(ds)})"
                         + (unread_split_hint(source, [split]) or "; pass --split"))
    if column not in ds[split].column_names:
        raise TfmError(f"split '{split}' of '{source}' has no column '{column}' (columns: "
                       f"{', '.join(ds[split].column_names)}); set the teachers' data.text_column")
    table = ds[split].select_columns([column])
    if not len(table):
        raise TfmError(f"split '{split}' of '{source}' is empty")
    row = 0
    for chunk in table.iter(batch_size=CHUNK_TEXTS):
        texts = chunk[column]
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str) or not t.strip()), None)
        if bad is not None:
            raise TfmError(f"split '{split}' of '{source}' has an empty or non-text value in column '{column}' "
                           f"(row {row + bad + 1})")
        row += len(texts)
    if max_samples is not None:
        table = table.select(sample_indices(np.arange(len(table)), max_samples, SUBSET_SEED))
    return table


def check_output(output: Path, source: str, force: bool) -> None:
    """Refuse (exit 2) to write over the data being labelled, even with `force` (the gold labels of its
    other splits would go too), and over any other existing file without `force`."""
    if not output.exists():
        return
    check_output_path(output, "--output", inputs=source_files(source))
    if not force:
        raise UsageError(f"--output '{output}' already exists; pass --force to replace it, or choose another --output")


def pseudo_label(teachers: list[Path], output: Path, data: str | None = None, split: str = UNLABELLED_SPLIT,
                 max_samples: int | None = None, device: str = "auto", batch_size: int = 64,
                 precision: str | None = None, force: bool = False) -> dict:
    """Write `output` (JSON lines: text, label, score) with the teachers' averaged calibrated
    probabilities on `split` of `data` (default: the first teacher's dataset), CHUNK_TEXTS reviews at a
    time; the file appears whole when every review is labelled. An existing `output` is replaced only
    with `force`, and never when it is one of the data's files. Returns a summary: reviews, per-class
    counts, median score, seconds."""
    if not teachers:
        raise UsageError("pass at least one teacher with -c DIR (the output directory of `tfm train`)")
    if split == "test":
        raise UsageError("--split test: the test split is kept for the final report; label unlabelled reviews "
                         "(e.g. IMDB's 'unsupervised')")
    check_output_path(output, "--output")
    loaded = [load_for_inference(t, device, precision) for t in teachers]  # every teacher checked before the work
    labels = loaded[0].labels
    for t, other in zip(teachers[1:], (m.labels for m in loaded[1:])):
        if sorted(other) != sorted(labels):
            raise TfmError(f"teacher '{t}' has classes {', '.join(other)}, but '{teachers[0]}' has "
                           f"{', '.join(labels)}; teachers must share their classes")
    columns = [[m.labels.index(name) for name in labels] for m in loaded]  # each teacher's in the first's order
    column, source = loaded[0].cfg.data.text_column, data or loaded[0].cfg.data.source
    check_output(output, source, force)  # before the split is read
    table = split_table(source, split, column, max_samples)
    t0 = time.perf_counter()
    scores, counts = [], np.zeros(len(labels), dtype=np.int64)
    with atomic_writer(output) as f:
        for texts in text_chunks([table], column, CHUNK_TEXTS):
            probs = np.zeros((len(texts), len(labels)))
            for (rt, model, cfg, tokenizer, _, temperature), order in zip(loaded, columns):
                enc = encode_reviews(tokenizer, texts, cfg.data)
                probs += predict_proba(model, enc, cfg.data, rt, batch_size, temperature)[:, order]
            probs /= len(teachers)
            winner, score = probs.argmax(1), probs.max(1)
            f.write("".join(json.dumps({"text": text, "label": labels[k], "score": round(float(p), 6)}) + "\n"
                            for text, k, p in zip(texts, winner, score)).encode("utf-8"))
            scores.append(score)
            counts += np.bincount(winner, minlength=len(labels))
    scores = np.concatenate(scores)
    return {
        "reviews": len(scores),
        "per_class": {name: int(n) for name, n in zip(labels, counts)},
        "median_score": float(np.median(scores)),
        "seconds": time.perf_counter() - t0,
    }
