"""`tfm pretrain`: masked-language-model pretraining (BERT's objective) of the encoder on unlabelled text.

The text (by default IMDB's `unsupervised` and `train` reviews; labels are never read, `test` never
opened) is read from `datasets`' memory-mapped Arrow tables a chunk at a time: the tokenizer is
trained on it as a stream, and the token ids are written chunk by chunk into one file that training
memory-maps. So a corpus larger than memory is never held in it. The run itself goes through
train.py's machinery: the same step, loop, checkpoints, resume, signals, DDP and precision.

Output directory: model.safetensors (the encoder and its masked-LM head, best by held-out loss),
config.json, tokenizer.json, metrics.json, TensorBoard events, checkpoints/. `tfm train
--init-from DIR` starts a classifier from its encoder and tokenizer.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from transformer_cli import checkpoint as ckpt
from transformer_cli.config import CLASSIFIER_ONLY, Config, PretrainConfig
from transformer_cli.data import (
    Encoded,
    cache_key,
    cached_tokenizer,
    collate,
    encode_texts,
    keys_of_test_texts,
    length_batches,
    open_text_source,
    text_chunks,
    text_keys,
    unread_split_hint,
)
from transformer_cli.errors import TfmError, UsageError
from transformer_cli.fileio import cache_dir, write_json
from transformer_cli.model import MaskedLM
from transformer_cli.runtime import Runtime, make_runtime
from transformer_cli.tokens import CLS_ID, MASK_ID, SPECIAL_TOKENS
from transformer_cli.training.loop import Batch, Logger, Run, selection_score
from transformer_cli.training.run import (
    begin,
    build_run,
    load_tokenizer,
    on_every_rank,
    run_metrics,
    run_to_end,
)

# Held-out windows per validation batch (at most 16,384 tokens). Fixed: the masks are drawn batch by batch, so
# another batching (train.eval_batch_size, free to change on resume) would validate on other masks.
VAL_BATCH = 256
SHARD_TEXTS = 8192  # texts tokenized at a time into the memory-mapped token file
FIRST_WORD_ID = len(SPECIAL_TOKENS)  # random replacements are drawn from the words, not the special tokens
CORPUS_VERSION = 1  # in the token file's cache key
PRETRAIN_METRICS = (None, "loss", "accuracy")  # what train.select_metric may be here (None: the loss)


# --------------------------------------------------------------------------- text


def text_splits(cfg: Config) -> list:
    """The `datasets` splits (memory-mapped Arrow tables) whose text column is pretrained on."""
    source, pc = cfg.data.source, cfg.pretrain
    ds = open_text_source(source, pc.splits)
    # The default splits are those IMDB has; another source is read in those of them it has.
    # A default split that is missing only because `datasets` did not take its file as one
    # (unsupervised.csv beside train.csv) is refused too, not silently left out.
    default = pc.splits == PretrainConfig().splits
    absent, present = [s for s in pc.splits if s not in ds], [s for s in pc.splits if s in ds]
    hint = unread_split_hint(source, absent, present)
    if hint or not present or (absent and not default):
        raise UsageError(f"'{source}' has no split {', '.join(absent)} (it has: {', '.join(ds)})"
                         + (hint or "; name the splits to read with pretrain.splits=[...]"))
    wanted = present
    column = cfg.data.text_column
    for split in wanted:
        if column not in ds[split].column_names:
            raise TfmError(f"split '{split}' of '{source}' has no column '{column}' (columns: "
                           f"{', '.join(ds[split].column_names)}); set data.text_column")
    return [ds[split].select_columns([column]) for split in wanted]


def is_lines(table) -> bool:
    """Whether a split was read from .txt files (`datasets`' text builder): one text per line."""
    return getattr(table.info, "builder_name", None) == "text"


# --------------------------------------------------------------------------- the corpus


@dataclass
class Corpus:
    tokenizer: object
    texts: Encoded  # every text; ids memory-mapped from the token file
    train_idx: np.ndarray  # (N_train,) indices of the texts trained on
    val_idx: np.ndarray  # (N_val,) the held-out ones
    test_texts_left_out: int  # texts of the source that are also in its test split, never pretrained on


def prepare_corpus(cfg: Config, tokenizer=None) -> Corpus:
    """The tokenizer (trained on the text unless given) and the memory-mapped token ids of every text,
    cached in the cache folder under a key of the text, the tokenizer and the encoding settings."""
    d, pc = cfg.data, cfg.pretrain
    tables = text_splits(cfg)
    lines = any(is_lines(t) for t in tables)  # a .txt file's blank lines separate texts: they are none

    test_keys = keys_of_test_texts(d)  # never pretrained on
    kept: list[np.ndarray] = []  # per chunk of the source, which of its texts are pretrained on

    def chunks() -> Iterator[list[str]]:  # a new pass over the text
        for i, texts in enumerate(text_chunks(tables, d.text_column, SHARD_TEXTS, d.max_train_samples,
                                              skip_blank=lines)):
            if i == len(kept):
                kept.append(np.array([k not in test_keys for k in text_keys(texts)], dtype=bool))
            if kept[i].any():
                yield [t for t, keep in zip(texts, kept[i]) if keep]

    class Texts:  # every text, from the start on each iter(): the tokenizer trainer reads them twice
        def __iter__(self) -> Iterator[str]:
            return (t for texts in chunks() for t in texts)

    h = hashlib.blake2b(digest_size=16)
    n = 0
    for texts in chunks():
        for t in texts:
            h.update(t.encode("utf-8", "surrogatepass"))
            h.update(b"\0")
        n += len(texts)
    left_out = sum(int((~k).sum()) for k in kept)
    if left_out:
        print(f"tfm: pretraining leaves out {left_out:,} texts that are also in the test split", file=sys.stderr)
    if n == 0 and lines:
        raise TfmError(f"'{d.source}' has no text, only blank lines; pretrain on a file of texts, one per line")
    if n <= pc.val_texts:
        raise TfmError(f"'{d.source}' has {n} texts; pretraining needs more than pretrain.val_texts = {pc.val_texts}")
    fingerprint = h.hexdigest()
    if tokenizer is None:
        tokenizer = cached_tokenizer(Texts(), n, d, fingerprint)
    if tokenizer.get_vocab_size() <= FIRST_WORD_ID:  # masking draws its random words from the others
        raise TfmError(f"'{d.source}' has no words: its texts gave a vocabulary of the special tokens alone "
                       f"({', '.join(SPECIAL_TOKENS)}); pretrain on a corpus of text")
    folder = cache_dir()
    key = cache_key(fingerprint, tokenizer.to_str(), d.max_length, d.truncation, CORPUS_VERSION)
    texts = load_token_file(folder / f"corpus-{key}", n)
    if texts is None:
        texts = write_token_file(folder / f"corpus-{key}", tokenizer, chunks(), cfg)
    val_idx = np.sort(np.random.default_rng(cfg.train.seed).permutation(n)[: pc.val_texts])
    train_idx = np.setdiff1d(np.arange(n), val_idx)
    return Corpus(tokenizer, texts, train_idx, val_idx, left_out)


def write_token_file(folder: Path, tokenizer, chunks: Iterator[list[str]], cfg: Config) -> Encoded:
    """Encode the texts chunk by chunk into FOLDER/ids.bin (int32, appended) and offsets.npy; the
    folder appears whole or not at all (written under a temporary name, then renamed). Where another
    process wrote it meanwhile (the same key: the same texts), that one is kept."""
    d = cfg.data
    shutil.rmtree(folder, ignore_errors=True)  # one load_token_file did not take (none, or broken)
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        ends = [np.zeros(1, dtype=np.int64)]
        total = 0
        with open(tmp / "ids.bin", "wb") as f:
            for texts in chunks:
                ids, offsets = encode_texts(tokenizer, texts, d.max_length, d.truncation)
                f.write(ids.astype(np.int32).tobytes())
                ends.append(offsets[1:] + total)
                total += int(offsets[-1])
            f.flush()
            os.fsync(f.fileno())
        np.save(tmp / "offsets.npy", np.concatenate(ends))
        try:
            os.rename(tmp, folder)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process's copy of the same texts is in place
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    texts = load_token_file(folder, len(np.load(folder / "offsets.npy")) - 1)
    assert texts is not None
    return texts


def load_token_file(folder: Path, n: int) -> Encoded | None:
    """The texts of a token file, their ids memory-mapped (read from disk as batches need them); None
    if there is none for n texts."""
    try:
        offsets = np.load(folder / "offsets.npy", allow_pickle=False)
        if len(offsets) != n + 1 or (folder / "ids.bin").stat().st_size != 4 * int(offsets[-1]):
            return None
        ids = np.memmap(folder / "ids.bin", dtype=np.int32, mode="r") if offsets[-1] else np.zeros(0, np.int32)
    except (OSError, ValueError):
        return None
    return Encoded(ids, offsets, np.zeros(n, dtype=np.int64))


def cut_windows(texts: Encoded, window: int) -> tuple[Encoded, np.ndarray, np.ndarray]:
    """The texts cut into training windows: each text into the fewest near-equal consecutive windows
    of at most `window` tokens (0: each text whole). Consecutive windows tile the texts, so they index
    the same memory-mapped ids. Returns (the windows, each one's first position in its text (N_w,),
    the index of its text (N_w,))."""
    n, lengths = len(texts), texts.lengths
    if window == 0:
        return texts, np.zeros(n, dtype=np.int64), np.arange(n)
    counts = -(-lengths // window)  # (N,) windows per text; every text has its [CLS]
    text = np.repeat(np.arange(n), counts)  # (N_w,)
    k = np.arange(len(text)) - np.repeat(np.cumsum(counts) - counts, counts)  # (N_w,) the window's rank in its text
    starts = k * lengths[text] // counts[text]  # (N_w,)
    offsets = np.append(texts.offsets[:-1][text] + starts, texts.offsets[-1])  # (N_w + 1,)
    return Encoded(texts.ids, offsets, np.zeros(len(text), dtype=np.int64)), starts, text


# --------------------------------------------------------------------------- the objective


def mask_tokens(ids: torch.Tensor, mask: torch.Tensor, p: float, vocab_size: int,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """BERT's masking: each real token but [CLS] is picked with probability p (at least one per
    batch); a picked token becomes [MASK] 80% of the time, a random word 10%, and stays 10%.

    Returns (the masked ids (B, T), picked (N,) flat indices into (B, T), their original ids (N,)).
    """
    candidates = mask & (ids != CLS_ID)  # [CLS] leads each text, so the first window of a text only
    if not candidates.any():
        candidates = mask  # texts of [CLS] alone: predict that
    chosen = (torch.rand(ids.shape, generator=generator) < p) & candidates
    if not chosen.any():
        chosen.view(-1)[candidates.view(-1).nonzero()[0]] = True
    picked = chosen.view(-1).nonzero().squeeze(1)  # (N,)
    targets = ids.view(-1)[picked]  # (N,)
    r = torch.rand(picked.shape, generator=generator)
    random_words = torch.randint(FIRST_WORD_ID, max(vocab_size, FIRST_WORD_ID + 1), picked.shape, generator=generator)
    replaced = torch.where(r < 0.8, MASK_ID, torch.where(r < 0.9, random_words, targets))
    masked = ids.clone()
    masked.view(-1)[picked] = replaced
    return masked, picked, targets


class MaskedLanguageModelling:
    """The pretraining task (train.Task): mask tokens of the training texts, for the model to predict them
    (MaskedLM, whose loss is the task's). Validated on the held-out texts with the same masks and samples every
    time, so that its figures compare across steps.

    With `pretrain.window`, the examples are windows of the texts (`cut_windows`), as BERT trains
    mostly on 128-token sequences: attention costs less per token, and each window keeps its
    positions in its text, so the whole position table trains. The held-out texts are cut alike."""

    prefix = "pretrain"

    def __init__(self, corpus: Corpus, pc: PretrainConfig, vocab_size: int, select_metric: str = "loss"):
        windows, self.starts, text = cut_windows(corpus.texts, pc.window)
        held_out = np.zeros(len(corpus.texts), dtype=bool)
        held_out[corpus.val_idx] = True
        self.texts, self.train_idx = windows, np.flatnonzero(~held_out[text])  # (N_train,) windows
        val_idx = np.flatnonzero(held_out[text])
        self.val, self.val_starts = windows.subset(val_idx), self.starts[val_idx]
        self.windowed = pc.window > 0
        self.select_metric = select_metric
        self.mask_prob, self.vocab_size = pc.mask_prob, vocab_size
        self.lengths = windows.lengths[self.train_idx]
        self.num_train, self.num_val = len(self.train_idx), len(val_idx)
        self.val_tokens = int(self.val.lengths.sum())

    def _masked(self, enc: Encoded, idx: np.ndarray, starts: np.ndarray, generator=None):
        """(the model's tensors: masked ids, mask, picked, targets and, for windows, each token's
        position in its text (B, T)), the real tokens."""
        ids, mask, _ = collate(enc, idx)
        ids, mask = torch.from_numpy(ids), torch.from_numpy(mask)
        masked, picked, targets = mask_tokens(ids, mask, self.mask_prob, self.vocab_size, generator)
        tensors = (masked, mask, picked, targets)
        if self.windowed:
            positions = starts[idx][:, None] + np.arange(ids.shape[1])  # (B, T); padding's set to 0 below
            tensors += (torch.from_numpy(np.where(mask.numpy(), positions, 0)),)
        return tensors, int(mask.sum())

    def batch(self, rt: Runtime, idx: np.ndarray, epoch: int = 0) -> Batch:
        tensors, tokens = self._masked(self.texts, self.train_idx[idx], self.starts)
        return Batch(rt.tensors(*(t.numpy() for t in tensors)), len(tensors[3]), len(idx), tokens)

    def loss(self, engine, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, stats = engine(*batch.tensors)
        return loss, {"loss": loss.detach(), **stats}

    def log_pictures(self, writer, step: int, metrics: dict, data_cfg) -> None:
        pass  # the classifier's pictures only

    def held_out(self, generator: torch.Generator) -> Iterator[tuple[torch.Tensor, ...]]:
        """The model's tensors of each held-out batch."""
        for idx in length_batches(self.val.lengths, VAL_BATCH, 16384):
            yield self._masked(self.val, idx, self.val_starts, generator)[0]

    @torch.no_grad()
    def evaluate(self, run: Run) -> tuple[dict, dict[str, float], float]:
        model, rt = run.model, run.rt
        was_training = model.training
        model.eval()
        sums: dict[str, float] = {}
        count = 0
        # drawn from a fixed seed, on a copy of the RNG state: training's draws go on as if there had been none
        gpu = rt.device.type in ("cuda", "mps")  # torch.manual_seed below reseeds the GPU's generator too
        with torch.random.fork_rng(devices=[rt.device] if gpu else [], device_type=rt.device.type if gpu else None):
            torch.manual_seed(0)
            try:
                for tensors in self.held_out(torch.Generator().manual_seed(0)):
                    n = len(tensors[3])  # the tokens to predict: each batch's means are weighted by them
                    with rt.autocast():
                        loss, stats = model(*rt.tensors(*(t.numpy() for t in tensors)))
                    for name, value in {"loss": loss, **stats}.items():
                        sums[name] = sums.get(name, 0.0) + value.item() * n
                    count += n
            finally:
                model.train(was_training)
        if count == 0:
            raise TfmError("the held-out texts give the objective nothing to predict; hold out more texts with "
                           "pretrain.val_texts")
        m = {name: total / count for name, total in sums.items()}
        tags = {f"pretrain_val/{k}": v for k, v in m.items()}
        return {**m, "num_predicted": count}, tags, selection_score(m, self.select_metric)


# --------------------------------------------------------------------------- the command


def check_classifier_only(cfg: Config) -> None:
    """Refuse a CLASSIFIER_ONLY setting that differs from its default, rather than ignore it."""
    defaults = Config().to_dict()
    for key, why in CLASSIFIER_ONLY.items():
        section, name = key.split(".")
        value, default = getattr(getattr(cfg, section), name), defaults[section][name]
        if value != default:
            then = "leave it unset" if default is None else f"leave it at its default, {default!r}"
            raise UsageError(f"{key} = {value!r} is for `tfm train` ({why}); `tfm pretrain` does not use it: {then}")


def setup(cfg: Config, rt: Runtime, resume: bool | str = False, force: bool = False) -> Run:
    tc = cfg.train
    check_classifier_only(cfg)
    if tc.select_metric not in PRETRAIN_METRICS:
        raise UsageError(f"train.select_metric = {tc.select_metric!r}: `tfm pretrain` measures the masked-LM loss and "
                         "accuracy only; use \"loss\" (its default) or \"accuracy\"")
    resume_dir = begin(tc, rt, resume, pretraining=True)
    tokenizer = load_tokenizer(resume_dir.parent.parent) if resume_dir is not None else None
    corpus = on_every_rank(rt, lambda: prepare_corpus(cfg, tokenizer))
    vocab_size = corpus.tokenizer.get_vocab_size()
    model = MaskedLM(cfg.model, vocab_size, cfg.data.max_length)
    task = MaskedLanguageModelling(corpus, cfg.pretrain, vocab_size, tc.select_metric or "loss")
    files = ckpt.model_files(cfg.to_dict(), corpus.tokenizer.to_str(), vocab_size, kind=ckpt.PRETRAINED_KIND,
                             num_texts=len(corpus.texts), test_texts_left_out=corpus.test_texts_left_out)
    return build_run(cfg, rt, model, task, resume_dir, force, files)


def finish(run: Run, logger: Logger) -> dict:
    metrics = run_metrics(run)
    best = run.state.best_val
    logger.hparams({f"{s}.{k}": v for s, sec in run.cfg.to_dict().items() for k, v in sec.items() if v is not None},
                   {"hparam/pretrain_val_loss": best["loss"], "hparam/pretrain_val_accuracy": best["accuracy"]},
                   run.state.step)
    if run.rt.is_main:
        write_json(run.out / ckpt.METRICS_FILE, metrics)
    return metrics


def pretrain(cfg: Config, resume: bool | str = False, force: bool = False, progress: bool = True) -> dict:
    """Run `tfm pretrain`: returns the metrics that are also written to metrics.json."""
    rt = make_runtime(cfg.train.device, cfg.train.precision)
    return run_to_end(rt, lambda: setup(cfg, rt, resume, force), finish, resume, progress)
