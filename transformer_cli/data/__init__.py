"""Data: load labelled reviews from any supported source, train the tokenizer, encode, batch."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from transformer_cli.config import DataConfig
from transformer_cli.data.batching import BucketSampler, batch_width, collate, length_batches, window_bounds, windows
from transformer_cli.data.sources import (
    DEFAULT_LABELS,
    FILE_BUILDERS,
    UNLABELLED_SPLIT,
    RawSplit,
    check_classes,
    label_ids,
    label_names_of,
    load_splits,
    local_paths,
    named_files,
    open_dataset,
    open_dataset_files,
    open_text_source,
    source_files,
    text_chunks,
    unread_split_hint,
)
from transformer_cli.data.splits import (
    VALIDATION_SPLIT,
    keys_of_test_texts,
    read_pseudo_labels,
    sample_indices,
    stratified_split,
    train_val_splits,
)
from transformer_cli.data.text import (
    CONTINUATION,
    HEAD_SHARE,
    Encoded,
    cache_key,
    cached_encode,
    cached_tokenizer,
    encode_texts,
    read_length,
    text_keys,
    text_normalizer,
    train_tokenizer,
    truncate,
)
from transformer_cli.errors import TfmError, UsageError
from transformer_cli.tokens import CLS_ID, PAD_ID, PAD_MULTIPLE, SPECIAL_TOKENS

EVAL_SUBSET_SEED = 0  # evaluate --max-samples N draws the same N reviews for every model


@dataclass
class Prepared:
    tokenizer: object
    labels: list[str]
    train: Encoded
    val: Encoded
    val_split: str  # the dataset's split validated on; "" when held out of train
    val_texts: list[str]  # val's reviews, to show one cut where its encoding was (TensorBoard pictures)


def prepare_train_data(cfg: DataConfig, seed: int, tokenizer=None, needed: tuple[str, ...] = ()) -> Prepared:
    """Load train and the validation split (train_val_splits), add the pseudo-labelled reviews to train
    (data.pseudo_labels), train the tokenizer (unless one is given), encode both (train cut to
    data.train_max_length)."""
    if cfg.pseudo_labels is None and cfg.pseudo_min_score > 0:  # e.g. configs/self-train.toml alone
        raise UsageError("data.pseudo_min_score is set but data.pseudo_labels is not: pass "
                         "data.pseudo_labels=FILE, a file written by `tfm pseudo-label`")
    train_raw, val_raw, label_names, val_split = train_val_splits(cfg, seed, needed)
    if cfg.pseudo_labels is not None:
        # Never trained on: validation and test reviews (IMDB's unlabelled reviews repeat some of its test
        # reviews), nor a second copy of a training review, whose own label stands; copies as the tokenizer sees them.
        known = set(text_keys([*val_raw.texts, *train_raw.texts])) | keys_of_test_texts(cfg)
        extra = read_pseudo_labels(cfg, label_names, known)
        train_raw = RawSplit(train_raw.texts + extra.texts, np.concatenate([train_raw.labels, extra.labels]))
    train_fp = train_raw.fingerprint()
    tok = tokenizer or cached_tokenizer(train_raw.texts, len(train_raw), cfg, train_fp)
    train_cfg = replace(cfg, max_length=cfg.train_max_length or cfg.max_length)
    return Prepared(
        tokenizer=tok,
        labels=label_names,
        train=cached_encode(tok, train_raw, train_cfg, train_fp),
        val=cached_encode(tok, val_raw, cfg, val_raw.fingerprint()),
        val_split=val_split,
        val_texts=val_raw.texts,
    )


def prepare_eval_data(cfg: DataConfig, tokenizer, split: str, max_samples: int | None,
                      seed: int | None = None, label_names: list[str] | None = None) -> Encoded:
    """A split of `cfg.source`, encoded, its labels as ids into `label_names` (the model's classes;
    default: the split's own). VALIDATION_SPLIT is what a run with `seed` validated on."""
    if split == VALIDATION_SPLIT:
        if seed is None:
            raise ValueError("the validation split is drawn with the run's seed; pass it")
        _, data, _, _ = train_val_splits(cfg, seed, label_names=label_names)
    else:
        raw, _ = load_splits(cfg, (split,), label_names=label_names)
        data = raw[split]
    if max_samples is not None:
        data = data.subset(sample_indices(np.arange(len(data)), max_samples, seed=EVAL_SUBSET_SEED))
    if len(data) == 0:
        raise TfmError(f"split '{split}' of '{cfg.source}' is empty")
    return cached_encode(tokenizer, data, cfg, data.fingerprint())
