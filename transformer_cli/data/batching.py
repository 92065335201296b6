"""Batches: seeded, length-bucketed training batches, length-sorted inference batches, and padding."""

from __future__ import annotations

import numpy as np

from transformer_cli.data.text import Encoded
from transformer_cli.tokens import PAD_ID, round_width


class BucketSampler:
    """Seeded, length-bucketed batches of indices, one list per epoch.

    Each epoch shuffles all examples, sorts windows of `bucket_batches` batches by length (so a batch
    holds reviews of similar length and little padding), and shuffles the batch order. With
    `world_size > 1`, each global batch is split into equal contiguous slices, one per rank; a
    trailing batch that cannot be split evenly is dropped so that every rank runs the same steps.
    """

    def __init__(self, lengths: np.ndarray, batch_size: int, seed: int, world_size: int = 1, rank: int = 0,
                 bucket_batches: int = 50):
        self.lengths = lengths
        self.batch_size = batch_size
        self.seed = seed
        self.world_size = world_size
        self.rank = rank
        self.bucket_batches = bucket_batches

    def global_batches(self, epoch: int) -> list[np.ndarray]:
        n = len(self.lengths)
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(n)
        window = self.batch_size * self.bucket_batches
        batches = []
        for start in range(0, n, window):
            chunk = order[start : start + window]
            chunk = chunk[np.argsort(self.lengths[chunk], kind="stable")]
            batches += [chunk[i : i + self.batch_size] for i in range(0, len(chunk), self.batch_size)]
        return [batches[i] for i in rng.permutation(len(batches))]

    def batches(self, epoch: int) -> list[np.ndarray]:
        if self.world_size == 1:
            return self.global_batches(epoch)
        out = []
        for b in self.global_batches(epoch):
            if len(b) % self.world_size == 0:
                per = len(b) // self.world_size
                out.append(b[self.rank * per : (self.rank + 1) * per])
        return out



def batch_width(enc: Encoded, idx: np.ndarray) -> int:
    """The width `collate` pads a batch to: its longest review rounded up to a multiple of
    PAD_MULTIPLE, but no longer than the longest review of `enc` (so never past the model's
    max_length). A few batch shapes instead of one per length keep the allocator's and oneDNN's
    caches warm: faster steps and less peak memory."""
    width = int(enc.lengths[idx].max())
    return min(round_width(width), enc.longest)  # >= width: idx is part of enc


def collate(enc: Encoded, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids (B, T) int64 padded with [PAD] to T = batch_width, mask (B, T) bool, labels (B,))."""
    lengths = enc.lengths[idx]
    width = batch_width(enc, idx)
    ids = np.full((len(idx), width), PAD_ID, dtype=np.int64)
    for row, (i, n) in enumerate(zip(idx, lengths)):
        ids[row, :n] = enc.ids[enc.offsets[i] : enc.offsets[i] + n]
    mask = np.arange(ids.shape[1])[None, :] < lengths[:, None]
    return ids, mask, enc.labels[idx]


def length_batches(lengths: np.ndarray, batch_size: int, max_tokens: int | None = None) -> list[np.ndarray]:
    """Indices sorted by length (stable), cut into batches of at most `batch_size` rows and, with `max_tokens`,
    at most that many padded tokens (rows x longest row; a longer row gets a batch of its own)."""
    order = np.argsort(lengths, kind="stable")
    batches, start = [], 0
    for end, longest in enumerate(lengths[order].tolist(), 1):  # rows start..end-1, the last the longest
        if end - start > batch_size or (max_tokens and start < end - 1 and (end - start) * longest > max_tokens):
            batches.append(order[start : end - 1])
            start = end - 1
    if start < len(order):
        batches.append(order[start:])
    return batches


def window_bounds(length: int, window: int) -> np.ndarray:
    """(n + 1,) token positions cutting a text of `length` tokens ([CLS] first) into the fewest near-equal windows
    whose tokens after [CLS] fit `window` - 1: window k is [CLS] + tokens bounds[k]:bounds[k + 1]."""
    n = max(1, -(-(length - 1) // (window - 1)))
    return 1 + np.arange(n + 1) * (length - 1) // n


def windows(enc: Encoded, window: int, pick: np.ndarray | None = None) -> tuple[Encoded, np.ndarray]:
    """Each text of `enc` as windows of at most `window` tokens, each [CLS] + a stretch of the text: all of them,
    or, with `pick` ((N,) ints), window pick[i] % n_i of text i alone. Returns (the windows, each one's text)."""
    rows, owner = [], []
    for i in range(len(enc)):
        text = enc.ids[enc.offsets[i] : enc.offsets[i + 1]]
        bounds = window_bounds(len(text), window)
        ks = range(len(bounds) - 1) if pick is None else [int(pick[i]) % (len(bounds) - 1)]
        for k in ks:
            rows.append(np.concatenate([text[:1], text[bounds[k] : bounds[k + 1]]]))
            owner.append(i)
    owner = np.asarray(owner, dtype=np.int64)
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    ids = np.concatenate(rows) if rows else enc.ids[:0]
    return Encoded(ids.astype(np.int32), offsets, enc.labels[owner]), owner
