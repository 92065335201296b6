"""Which examples train and which validate: the dataset's validation split, or a stratified, seeded part
held out of train; seeded subsets; and the pseudo-labelled reviews of self-training."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from transformer_cli.config import DataConfig
from transformer_cli.data.sources import (
    MANY_CLASSES,
    UNLABELLED_SPLIT,
    RawSplit,
    _one_split,
    check_classes,
    load_splits,
    named_files,
    open_dataset_files,
    open_text_source,
    unread_split_hint,
)
from transformer_cli.data.text import text_keys
from transformer_cli.errors import TfmError, UsageError

VALIDATION_SPLIT = "validation"  # in `tfm evaluate`: what the run validated on (see train_val_splits)


def stratified_split(labels: np.ndarray, val_size: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded train/validation indices with the same label proportions in both. Every label with at least
    two examples has one in each part, however small `val_size` or large the label."""
    rng = np.random.default_rng(seed)
    train, val = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
    for label in np.unique(labels):
        idx = np.flatnonzero(labels == label)
        order = rng.permutation(len(idx))
        n_val = round(len(idx) * val_size)
        if len(idx) >= 2:
            n_val = min(max(n_val, 1), len(idx) - 1)
        val.append(idx[order[:n_val]])
        train.append(idx[order[n_val:]])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(val))


def sample_indices(idx: np.ndarray, n: int | None, seed: int) -> np.ndarray:
    """A seeded random subset of n indices, in their original order (datasets are often label-sorted)."""
    if n is None or n >= len(idx):
        return idx
    return np.sort(np.random.default_rng(seed).permutation(idx)[:n])


def train_val_splits(cfg: DataConfig, seed: int, needed: tuple[str, ...] = (),
                     label_names: list[str] | None = None) -> tuple[RawSplit, RawSplit, list[str], str]:
    """(train, validation, class names, the validation's split name): the dataset's `data.val_split` if it has
    one, else a stratified, seeded part held out of train (name ""). The `needed` splits (test) must exist too.
    The classes, `label_names` (a trained model's) or else train's, must each have examples in both parts."""
    optional = (cfg.val_split,) if cfg.val_split else ()
    raw, label_names = load_splits(cfg, ("train", *needed), optional, label_names)
    if cfg.val_split not in (*raw, "", DataConfig.val_split):  # the default may be missing, not another
        hint = unread_split_hint(cfg.source, [cfg.val_split], ["train", *needed])
        raise UsageError(f"data.val_split = '{cfg.val_split}': '{cfg.source}' has no such split; name one it has, "
                         'or set data.val_split = "" to hold out part of train' + hint)
    full = raw["train"]
    if len(full) < 2:
        raise TfmError(f"the train split of '{cfg.source}' has {len(full)} example(s); need at least 2")
    if len(label_names) < 2:
        raise TfmError(f"the train split of '{cfg.source}' has only one class ({', '.join(label_names)}); "
                       "a classifier needs examples of at least two")
    if len(label_names) > max(MANY_CLASSES, len(full) // 2):  # e.g. data.label_column naming the text or an id
        raise TfmError(f"column '{cfg.label_column}' of the train split of '{cfg.source}' has {len(label_names):,} "
                       f"distinct values in {len(full):,} examples; set data.label_column to the column of labels")
    val_split = cfg.val_split if cfg.val_split in raw else ""
    named = named_files(cfg.source) or {}
    unread = [split for split in named if split not in ("train", *needed, UNLABELLED_SPLIT, "test")]
    if not val_split and cfg.val_split and unread:  # e.g. train=a.csv,dev=b.csv: was dev meant to validate?
        raise UsageError(f"--data names split '{unread[0]}', which training does not read: it validates on split "
                         f"'{cfg.val_split}' (data.val_split), else on part of train; name the file "
                         f"{cfg.val_split}=FILE, or set data.val_split = \"{unread[0]}\"")
    if val_split:
        val = raw[val_split]
        train_idx, val_idx = np.arange(len(full)), np.arange(len(val))
        val_hint = f"add some to the '{val_split}' split, or set data.val_split = \"\" to hold out part of train"
    else:  # every class of at least 2 examples has one in each part (checked below)
        val = full
        train_idx, val_idx = stratified_split(full.labels, cfg.val_size, seed)
        val_hint = "holding some out of train for validation needs at least 2 examples of each class; add examples"
    train_idx = sample_indices(train_idx, cfg.max_train_samples, seed)
    val_idx = sample_indices(val_idx, cfg.max_eval_samples, seed)
    train, val = full.subset(train_idx), val.subset(val_idx)
    check_classes(train.labels, label_names, f"the training part of '{cfg.source}'",
                  "every class needs training examples (raise data.max_train_samples, or add examples)")
    subset = " or raise data.max_eval_samples" if cfg.max_eval_samples is not None else ""
    check_classes(val.labels, label_names, f"the validation part of '{cfg.source}'", val_hint + subset)
    return train, val, label_names, val_split


def keys_of_test_texts(cfg: DataConfig) -> set[bytes]:
    """The text_keys of the source's test split, where it has one: texts that pretraining and self-training leave
    out (IMDB's unlabelled split repeats some of its test reviews), so that no test text is trained on."""
    try:
        ds = open_text_source(cfg.source, ["test"])
    except TfmError:
        return set()
    if "test" not in ds or cfg.text_column not in ds["test"].column_names:
        return set()
    return set(text_keys(ds["test"][cfg.text_column]))


def read_pseudo_labels(cfg: DataConfig, label_names: list[str], known: set[bytes]) -> RawSplit:
    """The reviews of `tfm pseudo-label`'s file `cfg.pseudo_labels` labelled with a score of at least
    `cfg.pseudo_min_score`, each once, less any whose text_key is in `known` (see prepare_train_data)."""
    path = cfg.pseudo_labels
    if not Path(path).is_file():
        raise UsageError(f"data.pseudo_labels = '{path}' is not a file; write one with `tfm pseudo-label`")
    if Path(path).suffix.lower() not in (".jsonl", ".json"):
        raise UsageError(f"data.pseudo_labels = '{path}': expected the .jsonl file that `tfm pseudo-label` writes")
    d = open_dataset_files({"train": path})["train"]
    missing = [c for c in ("text", "label", "score") if c not in d.column_names]
    if missing:
        raise TfmError(f"'{path}' has no column {' or '.join(repr(c) for c in missing)} (columns: "
                       f"{', '.join(d.column_names)}); a pseudo-label file holds text, label and score: "
                       "write it with `tfm pseudo-label`")
    rows, _ = _one_split(d, replace(cfg, text_column="text", label_column="label"), "train", path, label_names)
    # a score that is not a number (a string, a list, true) becomes NaN, which the check refuses
    scores = np.asarray([s if type(s) in (int, float) else None for s in d["score"]], dtype=np.float64)
    if not np.all((scores >= 0) & (scores <= 1)):  # NaN fails too
        raise TfmError(f"'{path}' has scores that are not numbers in [0, 1]; write it with `tfm pseudo-label`")
    seen, keep = set(known), []
    for i, (key, score) in enumerate(zip(text_keys(rows.texts), scores)):
        if score >= cfg.pseudo_min_score and key not in seen:
            seen.add(key)
            keep.append(i)
    if not keep:
        scored = int((scores >= cfg.pseudo_min_score).sum())
        if scored:  # the threshold kept some, but each is a train, validation or test review
            raise TfmError(f"every review of '{path}' scored at least data.pseudo_min_score = {cfg.pseudo_min_score} "
                           f"({scored:,}) is also in train, validation or test; label other reviews (by default IMDB's "
                           "unsupervised split)")
        best = f"the highest score is {scores.max():.4f}" if len(scores) else "it has no reviews"
        raise TfmError(f"data.pseudo_min_score = {cfg.pseudo_min_score} keeps none of the reviews of '{path}' "
                       f"({best}); lower it")
    return rows.subset(np.asarray(keep, dtype=np.int64))
