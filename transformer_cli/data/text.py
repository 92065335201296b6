"""Text to token ids: the WordPiece tokenizer trained on the training texts, and encoding with truncation.
Encoded splits are flat int32 token arrays plus offsets, cached on disk as .npz files keyed by a hash of the
texts and every setting that changes the result, so a second run skips tokenization."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import unicodedata
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from transformer_cli.config import DataConfig
from transformer_cli.data.sources import RawSplit
from transformer_cli.fileio import atomic_write_bytes, atomic_write_text, cache_dir
from transformer_cli.tokens import CLS_ID, SPECIAL_TOKENS

CONTINUATION = "##"  # WordPiece's mark of a subword that continues a word
BR_TAG = r"<br\s*/?>"  # the tokenizer's normalizer turns these tags into spaces
MIN_FREQUENCY = 2  # a subword enters the vocabulary only if it occurs at least this often in training
TOKENIZER_VERSION = 3  # in the tokenizer cache's key: raise it when training gives other tokenizers
ENCODING_VERSION = 2  # in the encoding cache's key: raise it when encoding gives other ids


@dataclass
class Encoded:
    """A split's token ids: review i is ids[offsets[i]:offsets[i+1]], starting with [CLS]."""

    ids: np.ndarray  # (total_tokens,) int32
    offsets: np.ndarray  # (N + 1,) int64
    labels: np.ndarray  # (N,) int64

    def __len__(self) -> int:
        return len(self.labels)

    @functools.cached_property
    def lengths(self) -> np.ndarray:  # computed once: collate reads it for every batch
        return np.diff(self.offsets)

    @functools.cached_property
    def longest(self) -> int:
        return int(self.lengths.max()) if len(self) else 0

    def subset(self, idx: np.ndarray) -> Encoded:
        rows = [self.ids[self.offsets[i] : self.offsets[i + 1]] for i in idx]
        offsets = np.cumsum(np.r_[0, self.lengths[idx]], dtype=np.int64)
        return Encoded(np.concatenate(rows) if rows else self.ids[:0], offsets, self.labels[idx])


def cache_key(*parts) -> str:
    """A short hash of JSON-able parts: names a cache entry by everything that changes its content."""
    return hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(), digest_size=12).hexdigest()


def train_tokenizer(texts: Iterable[str], cfg: DataConfig, length: int | None = None):
    """A lowercasing WordPiece tokenizer trained on `texts` (a list or another re-iterable: it is read twice);
    `length`: how many there are (default: len(texts)).

    The same texts give the same tokenizer in every process: `tokenizers`' trainer alone numbers each
    character's "##" continuation in hash-map order, and those numbers break ties between merges. So the
    alphabet (by code point, as the trainer orders it) and then the continuations, sorted, are given to the
    trainer as special tokens; the tokenizer returned keeps only SPECIAL_TOKENS as special.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if iter(texts) is texts:
        raise TypeError("train_tokenizer reads the texts twice: pass a list or a re-iterable")
    normalizer, pre_tokenizer = text_normalizer(), pre_tokenizers.BertPreTokenizer()
    # The trainer's alphabet: the characters of words (whitespace is none), by code point; those that can
    # continue a word (punctuation cannot: "a" + c + "a" is then three words) have a "##" continuation.
    alphabet = sorted(c for c in characters(texts, normalizer) if pre_tokenizer.pre_tokenize_str(c))
    continuations = [CONTINUATION + c for c in alphabet if len(pre_tokenizer.pre_tokenize_str(f"a{c}a")) == 1]
    trainer = trainers.WordPieceTrainer(vocab_size=cfg.vocab_size, min_frequency=MIN_FREQUENCY,
                                         special_tokens=SPECIAL_TOKENS + alphabet + continuations,
                                         continuing_subword_prefix=CONTINUATION, show_progress=False)

    def assemble(model):
        tok = Tokenizer(model)
        tok.normalizer, tok.pre_tokenizer, tok.decoder = normalizer, pre_tokenizer, decoders.WordPiece()
        return tok

    tok = assemble(models.WordPiece(unk_token="[UNK]"))
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts) if length is None else length)
    tok = assemble(tok.model)  # the alphabet and the continuations stay in the vocabulary, as ordinary tokens
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def text_normalizer():
    """What a trained tokenizer does to a text before splitting it: `<br />` tags become spaces, NFKC, lowercasing."""
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([normalizers.Replace(Regex(BR_TAG), " "), normalizers.NFKC(), normalizers.Lowercase()])


def text_keys(texts: Iterable[str]) -> list[bytes]:
    """Each text's key as the tokenizer sees it (normalized, whitespace runs as one space): two texts with one key
    tokenize alike, so that one stands in for the other in training."""
    normalizer = text_normalizer()
    return [hashlib.blake2b(" ".join(normalizer.normalize_str(t).split()).encode("utf-8", "surrogatepass"),
                            digest_size=16).digest() for t in texts]


def characters(texts: Iterable[str], normalizer) -> set[str]:
    """The characters of `texts` normalized by `normalizer`. A few may be in no text normalized whole (the
    "<" of a "<br />"): unused entries of the vocabulary, which change no other."""
    seen: set[str] = set()
    for t in texts:  # only texts that NFKC changes are normalized whole, since NFKC composes characters;
        seen.update(t if unicodedata.is_normalized("NFKC", t) else normalizer.normalize_str(t))
    # the rest of the normalizer (the <br> replacement, lowercasing) maps character by character
    return {c for ch in seen for c in normalizer.normalize_str(ch)}


def cached_tokenizer(texts: Iterable[str], n: int, cfg: DataConfig, fingerprint: str):
    """The tokenizer trained on `texts` (n of them, re-iterable as train_tokenizer needs), or loaded
    from the cache, where it is kept under a key of their `fingerprint` and the tokenizer settings."""
    from tokenizers import Tokenizer

    key = cache_key(fingerprint, "wordpiece", cfg.vocab_size, True, MIN_FREQUENCY, TOKENIZER_VERSION)
    path = cache_dir() / f"tokenizer-{key}.json"
    if path.is_file():
        with contextlib.suppress(Exception):  # a damaged cache entry is made again
            return Tokenizer.from_file(str(path))
    tok = train_tokenizer(texts, cfg, n)
    with contextlib.suppress(OSError):  # caching is an optimisation: a read-only cache must not stop training
        atomic_write_text(path, tok.to_str())
    return tok


# --------------------------------------------------------------------------- encoding


HEAD_SHARE = 0.25  # head_tail truncation: the share of a cut review taken from its start, the rest from its end


def truncate(ids: list[int], limit: int, strategy: str) -> list[int]:
    if len(ids) <= limit:
        return ids
    if strategy == "head":
        return ids[:limit]
    head = round(limit * HEAD_SHARE)
    return ids[:head] + ids[len(ids) - (limit - head) :]


ENCODE_CHUNK = 4096  # texts encoded at a time: memory stays bounded on any number of texts


def encode_texts(tokenizer, texts: list[str], max_length: int | None, truncation: str):
    """(flat int32 ids, (N + 1,) offsets): each text as [CLS] + its subword ids, truncated to `max_length` tokens
    (None: whole). Special tokens' text in a review ("[PAD]", "[CLS]") is encoded as words, not as those ids."""
    tokenizer.encode_special_tokens = True
    limit, rows = (max_length or 0) - 1, []
    for start in range(0, len(texts), ENCODE_CHUNK):
        for e in tokenizer.encode_batch_fast(texts[start : start + ENCODE_CHUNK], add_special_tokens=False):
            kept = e.ids if max_length is None else truncate(e.ids, limit, truncation)
            rows.append(np.array([CLS_ID, *kept], dtype=np.int32))
    offsets = np.cumsum([0, *map(len, rows)], dtype=np.int64)
    return (np.concatenate(rows) if rows else np.zeros(0, dtype=np.int32)), offsets


def read_length(cfg: DataConfig) -> int | None:
    """The tokens a review is encoded to: data.max_length, or None (whole) where data.long_text reads windows."""
    return None if cfg.long_text == "windows" else cfg.max_length


def cached_encode(tokenizer, raw: RawSplit, cfg: DataConfig, fingerprint: str) -> Encoded:
    key = cache_key(fingerprint, tokenizer.to_str(), read_length(cfg), cfg.truncation,
                    ENCODING_VERSION)
    path = cache_dir() / f"encoded-{key}.npz"
    damaged = (OSError, ValueError, KeyError, zipfile.BadZipFile)  # an entry made again
    if path.is_file():
        with contextlib.suppress(*damaged), np.load(path, allow_pickle=False) as z:
            if len(z["offsets"]) == len(raw) + 1:
                return Encoded(z["ids"], z["offsets"], raw.labels)
    ids, offsets = encode_texts(tokenizer, raw.texts, read_length(cfg), cfg.truncation)
    buf = io.BytesIO()
    np.savez(buf, ids=ids, offsets=offsets)
    with contextlib.suppress(OSError):
        atomic_write_bytes(path, buf.getvalue())
    return Encoded(ids, offsets, raw.labels)
