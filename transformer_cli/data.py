"""Data: load labelled reviews from any supported source, train the tokenizer, encode, batch.

Encoded splits are flat int32 token arrays plus offsets, cached on disk as .npy files keyed by a
hash of the texts and every setting that changes the result, so a second run skips tokenization.
Heavy libraries (`datasets`) are imported only where a dataset is actually loaded.
"""

from __future__ import annotations

import codecs
import csv
import functools
import hashlib
import io
import itertools
import json
import re
import string
import tarfile
import unicodedata
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from transformer_cli.config import DataConfig
from transformer_cli.errors import TfmError, UsageError, cause_line, first_line
from transformer_cli.fileio import atomic_write_bytes, atomic_write_text, cache_dir

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
PAD_ID, CLS_ID = 0, 2  # their positions in SPECIAL_TOKENS
DEFAULT_LABELS = ["neg", "pos"]  # the names of integer labels 0 and 1 when a dataset has no others (IMDB's)
CONTINUATION = "##"  # WordPiece's mark of a subword that continues a word
BR_TAG = r"<br\s*/?>"  # the tokenizer's normalizer turns these tags into spaces
MIN_FREQUENCY = 2  # a subword enters the vocabulary only if it occurs at least this often in training
TOKENIZER_VERSION = 3  # in the tokenizer cache's key; 3: WordPiece trained the same in every process
ENCODING_VERSION = 2  # in the encoding cache's key; 2: special tokens' text in a review is encoded as text
VALIDATION_SPLIT = "validation"  # in `tfm evaluate`: what the run validated on (see train_val_splits)
DEFAULT_VAL_SPLIT = DataConfig.val_split  # validated on when the dataset has it, else part of train is held out
EVAL_SUBSET_SEED = 0  # evaluate --max-samples N draws the same N reviews for every model
MANY_CLASSES = 100  # beyond this, a label column with more classes than half its examples is no label column
UNLABELLED_SPLIT = "unsupervised"  # IMDB's 50,000 unlabelled reviews: what `tfm pseudo-label` labels
FILE_BUILDERS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet",
                 ".txt": "text"}  # .txt: one text per line, in a column "text" (`tfm pretrain` skips blank lines)


@dataclass
class RawSplit:
    texts: list[str]
    labels: np.ndarray  # (N,) int64

    def __len__(self) -> int:
        return len(self.texts)

    def subset(self, idx: np.ndarray) -> RawSplit:
        return RawSplit([self.texts[i] for i in idx], self.labels[idx])

    def fingerprint(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        for t in self.texts:
            h.update(t.encode("utf-8", "surrogatepass"))
            h.update(b"\0")
        h.update(self.labels.astype(np.int64).tobytes())
        return h.hexdigest()


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
        lengths = self.lengths[idx]
        offsets = np.zeros(len(idx) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        ids = np.concatenate([self.ids[self.offsets[i] : self.offsets[i + 1]] for i in idx]) if len(idx) else self.ids[:0]
        return Encoded(ids, offsets, self.labels[idx])


# --------------------------------------------------------------------------- loading


def load_splits(cfg: DataConfig, splits: tuple[str, ...], optional: tuple[str, ...] = (),
                label_names: list[str] | None = None) -> tuple[dict[str, RawSplit], list[str]]:
    """The requested splits of `cfg.source`, and those of the `optional` ones it has; the class names.

    Labels become ids into `label_names` (a trained model's classes) when given, else into the classes
    of the first split loaded (see label_names_of); a label outside them is refused.
    """
    source = cfg.source
    path = Path(source)
    files = named_files(source)
    if files is not None:
        return _from_hf_files(files, cfg, splits, optional, label_names)
    acl = acl_root(source)
    if acl is not None:
        what = "folder" if acl.is_dir() else "archive"
        return _with_names(_from_acl(acl, _acl_splits(splits, optional, what)), label_names, source)
    if path.is_file():
        raise UsageError(f"don't know how to read '{source}'; pass a .csv/.jsonl/.parquet file, a folder or aclImdb_v1.tar.gz")
    if path.is_dir():
        return _from_hf(source, cfg, splits, optional, label_names)
    if looks_like_path(source):
        raise UsageError(f"data path '{source}' does not exist; pass an existing folder or file, or a Hub dataset id")
    return _from_hf(source, cfg, splits, optional, label_names)


def local_paths(source: str) -> list[str]:
    """The files or folder a data source names on this machine (none for a Hub id)."""
    if "=" in source and not Path(source).exists():  # train=a.csv,test=b.csv
        return [part.split("=", 1)[1] for part in source.split(",") if "=" in part]
    return [source] if Path(source).exists() or looks_like_path(source) else []


def looks_like_path(source: str) -> bool:
    """Hub ids are `name` or `owner/name`; anything else that does not exist is a missing path."""
    suffixes = (*FILE_BUILDERS, ".tar.gz", ".tgz")
    return source.startswith((".", "/", "~")) or source.count("/") > 1 or source.lower().endswith(suffixes)


def _from_hf(source: str, cfg: DataConfig, splits: tuple[str, ...], optional: tuple[str, ...] = (),
             label_names: list[str] | None = None):
    return _from_dataset_dict(open_dataset(source), cfg, splits, source, optional, label_names)


def _from_hf_files(files: dict[str, str], cfg: DataConfig, splits: tuple[str, ...], optional: tuple[str, ...] = (),
                   label_names: list[str] | None = None):
    return _from_dataset_dict(open_dataset_files(files), cfg, splits, ", ".join(files.values()), optional, label_names)


def open_dataset(source: str):
    """The `datasets.DatasetDict` of a Hub id or a Hub-layout folder: Arrow tables, memory-mapped."""
    import datasets

    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors reach us as exceptions
    datasets.disable_progress_bars()
    if Path(source).is_dir():
        files = folder_files(source)
        if files is not None and {Path(f).suffix.lower() for fs in files.values() for f in fs} in ({".csv"}, {".tsv"}):
            return open_dataset_files(files)  # read as the same file named alone is read
    try:
        # Never a loading script: datasets 2.x would run one with trust_remote_code (4.0 dropped them).
        return datasets.load_dataset(source, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 (datasets raises many types for missing/offline/unreadable sources)
        if not Path(source).is_dir():
            raise TfmError(f"could not load dataset '{source}' ({cause_line(e)}); pass a local copy with --data PATH") \
                from None
        refuse_empty_files(source_files(source))  # datasets says only that a split "corresponds to no data"
        raise TfmError(f"could not load dataset '{source}' ({cause_line(e)}); check its data files (one per "
                       "split, e.g. train.csv and test.csv)") from None


SHARD = re.compile(r".*-\d{5}-of-\d{5}$")  # train-00000-of-00003.parquet: one split's files, as the Hub writes them


def folder_files(source: str) -> dict[str, list[str]] | None:
    """{split: files} of a Hub-layout folder as `datasets` finds them (None if it cannot tell). Without a
    README.md whose configs: section lists them, a split of several files that are not one shard series
    (train.jsonl beside train_backup.jsonl or old/train.jsonl, which `datasets` would join) is refused."""
    import datasets

    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        found = datasets.load_dataset_builder(source).config.data_files or {}  # a folder: no loading script
    except Exception:  # noqa: BLE001 (open_dataset says what is wrong with the folder)
        return None
    files = {str(split): [str(f) for f in split_files] for split, split_files in found.items()}
    readme = Path(source) / "README.md"
    if readme.is_file() and "configs:" in readme.read_text(encoding="utf-8", errors="replace"):
        return files  # the folder says which files each split has
    for split, split_files in files.items():
        if len(split_files) > 1 and not all(SHARD.match(Path(f).name.split(".")[0]) for f in split_files):
            shown = ", ".join(split_files[:3]) + (f" and {len(split_files) - 3:,} more" if len(split_files) > 3 else "")
            raise UsageError(f"data folder '{source}' has {len(split_files):,} files that `datasets` would join as "
                             f"split '{split}': {shown}; keep one file a split, or name them (--data {split}=FILE,...)")
    return files


def unread_split_hint(source: str, missing: Iterable[str], others: Iterable[str] = ()) -> str:
    """Why a data file in the folder `source` named for one of the `missing` splits (unsupervised.csv,
    unsupervised-00000-of-00001.parquet) is not that split, and what to do, as "; ..." to end a "has no
    split" error; "" where there is no such file. `others`: the splits the command reads beside them, for
    the example of named files."""
    folder = Path(source)
    if not folder.is_dir():
        return ""

    def named_for(split: str) -> list[Path]:
        pattern = re.compile(rf"{re.escape(split)}([-_.]|$)", re.IGNORECASE)
        return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in FILE_BUILDERS
                      and pattern.match(p.stem) and not any(part.startswith(".") for part in p.relative_to(folder).parts))

    found = {split: files for split in missing if (files := named_for(split))}
    if not found:
        return ""
    named = {split: named_for(split) for split in others} | found
    example = (",".join(f"{split}={files[0]}" for split, files in named.items())
               if all(len(files) == 1 for files in named.values()) else "SPLIT=FILE,SPLIT=FILE")
    unread = ", ".join(f"{files[0]} as split '{split}'" for split, files in found.items())
    return ("; `datasets` reads a folder's files as splits only by the names train, test and validation (or "
            f"variants such as dev), so it did not read {unread}: name the files instead (--data {example}), or "
            "add a README.md whose configs: section lists the splits and their files, as IMDB's has")


def open_dataset_files(files: dict[str, str] | dict[str, list[str]]):
    """The `datasets.DatasetDict` of data files, a file (or a list of a split's shards) per split name, all
    of one type (FILE_BUILDERS)."""
    import datasets

    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    datasets.disable_progress_bars()
    every = [f for fs in files.values() for f in ([fs] if isinstance(fs, str) else fs)]
    suffixes = {Path(f).suffix.lower() for f in every}
    for f in every:
        if not Path(f).is_file():
            raise UsageError(f"data file '{f}' does not exist")
    if len(suffixes) != 1 or next(iter(suffixes)) not in FILE_BUILDERS:
        raise UsageError(f"data files must share one of the types {', '.join(FILE_BUILDERS)}; got {', '.join(every)}")
    suffix = next(iter(suffixes))
    if suffix in (".json", ".jsonl"):  # pyarrow's JSON reader keeps bad bytes, which fail later, unnamed
        for f in every:
            check_utf8(Path(f))
    kwargs = {}
    if suffix in (".csv", ".tsv"):  # cells such as "NA" or "None" stay text, not missing values
        kwargs["keep_default_na"] = False
    if suffix == ".tsv":  # no quoting, as TSV readers of text data (GLUE's) take it: a review may open with '"'
        kwargs.update(delimiter="\t", quoting=csv.QUOTE_NONE)
    try:
        return datasets.load_dataset(FILE_BUILDERS[suffix], data_files=files, **kwargs)
    except Exception as e:  # noqa: BLE001 (each file builder raises its own types for unreadable files)
        refuse_empty_files(every)  # datasets says "corresponds to no data", or "StopIteration"
        cause, hint = cause_line(e), ""
        if "codec can't decode" in cause:
            hint = "; save the file as UTF-8"
        raise TfmError(f"could not read {', '.join(every)}: {cause}{hint}") from None


def check_utf8(path: Path, chunk: int = 1 << 20) -> None:
    """A TfmError naming `path` and the first byte that is not UTF-8, read a chunk at a time."""
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with open(path, "rb") as f:
        while True:
            data = f.read(chunk)
            try:
                decoder.decode(data, final=not data)
            except UnicodeDecodeError as e:  # e.object: the bytes a previous chunk left pending, then `data`
                at = offset - (len(e.object) - len(data)) + e.start
                raise TfmError(f"could not read {path}: byte 0x{e.object[e.start]:02x} at offset {at:,} is not "
                               "UTF-8; save the file as UTF-8") from None
            if not data:
                return
            offset += len(data)


def refuse_empty_files(files: Iterable[str | Path]) -> None:
    """A UsageError naming the first of `files` that holds no rows: blank, a CSV/TSV header alone, or a
    Parquet file of none."""
    for f in map(Path, files):
        if not f.is_file():
            continue
        suffix = f.suffix.lower()
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            try:
                rows = pq.ParquetFile(f).metadata.num_rows
            except Exception:  # noqa: BLE001 (pyarrow's errors for a damaged file; the caller names it)
                rows = None
            if rows == 0:
                raise UsageError(f"data file '{f}' has no rows: fill it or remove it") from None
        elif f.stat().st_size <= 4096:
            lines = [line for line in f.read_bytes().splitlines() if line.strip()]
            if not lines:
                raise UsageError(f"data file '{f}' is empty: fill it or remove it") from None
            if len(lines) == 1 and suffix in (".csv", ".tsv"):
                raise UsageError(f"data file '{f}' has a header line but no rows: fill it or remove it") from None


def open_text_source(source: str, splits: Iterable[str] | None = None):
    """The `datasets.DatasetDict` of a source read as text (`tfm pretrain`, `tfm pseudo-label`): data
    files, a Hub-layout folder or a Hub id; another kind of file is refused. `splits`: the splits the
    caller reads (default: all); aclImdb's reviews of other splits are not read at all."""
    files = named_files(source)
    if files is not None:
        return open_dataset_files(files)
    acl = acl_root(source)
    if acl is not None:
        return acl_text_source(acl, splits)
    if Path(source).is_dir() or not Path(source).exists():
        return open_dataset(source)
    raise UsageError(f"don't know how to read '{source}' as text; pass a Hub id, a Hub-layout folder, the aclImdb "
                     "folder or archive, or .txt/.csv/.jsonl/.parquet file(s)")


def source_files(source: str) -> list[Path]:
    """The files on this machine that open_text_source reads for `source`: its named files, or the data
    files of a Hub-layout folder (every file in it if `datasets` cannot tell); none for a Hub id."""
    files = named_files(source)
    if files is not None:
        return [Path(f) for f in files.values()]
    acl = acl_root(source)
    if acl is not None:
        return [acl] if acl.is_file() else [f for f in acl.rglob("*.txt") if _ACL_REVIEW.fullmatch(f.name)]
    if not Path(source).is_dir():
        return []
    found = folder_files(source)
    if found is None:  # open_text_source says what is wrong with the folder
        return [p for p in Path(source).rglob("*") if p.is_file()]
    return [Path(f) for split_files in found.values() for f in split_files]


def text_chunks(tables: list, column: str, size: int, limit: int | None = None,
                skip_blank: bool = False) -> Iterator[list[str]]:
    """The first `limit` (default: all) texts of `tables`, in order, `size` at a time: only one chunk is
    in memory at once. `skip_blank`: whitespace-only texts are left out (and not counted)."""
    left = limit
    for table in tables:
        for chunk in table.iter(batch_size=size):
            texts = chunk[column]
            if skip_blank:
                texts = [t for t in texts if not isinstance(t, str) or t.strip()]
            texts = texts[:left]
            if any(not isinstance(t, str) for t in texts):
                raise TfmError(f"column '{column}' holds empty or non-text values")
            if not texts:
                continue
            yield texts
            if left is not None:
                left -= len(texts)
                if left <= 0:
                    return


def named_files(source: str) -> dict[str, str] | None:
    """SPLIT=FILE[,SPLIT=FILE...] as {split: file}; one data file as {"train": file}; else None."""
    if "=" in source and not Path(source).exists():
        parts = [part.split("=", 1) for part in source.split(",")]
        if any(len(p) != 2 or not p[0] or not p[1] for p in parts):
            raise UsageError(f"data source '{source}': write named files as SPLIT=FILE[,SPLIT=FILE...], "
                             "e.g. train=a.csv,test=b.csv")
        names = [name for name, _ in parts]
        if len(set(names)) < len(names):
            twice = sorted({name for name in names if names.count(name) > 1})
            raise UsageError(f"data source '{source}' names split {', '.join(twice)} more than once; give each "
                             "split one file (join the files first to train on several)")
        return dict(parts)
    if Path(source).is_file() and Path(source).suffix.lower() in FILE_BUILDERS:
        return {"train": source}
    return None


def _from_dataset_dict(ds, cfg: DataConfig, splits: tuple[str, ...], name: str, optional: tuple[str, ...] = (),
                       label_names: list[str] | None = None):
    out: dict[str, RawSplit] = {}
    for split in (*splits, *(s for s in optional if s in ds and s not in splits)):
        if split not in ds:
            raise UsageError(f"dataset '{name}' has no '{split}' split (it has: {', '.join(ds)})"
                             + unread_split_hint(name, [split], [s for s in splits if s in ds]))
        try:
            out[split], label_names = _one_split(ds[split], cfg, split, name, label_names)
        except TfmError as e:
            if split in splits:
                raise
            raise type(e)(f'{e} (or set data.val_split = "" to validate on part of train instead)') from None
    return out, label_names


def _one_split(d, cfg: DataConfig, split: str, name: str,
               label_names: list[str] | None) -> tuple[RawSplit, list[str]]:
    missing = [c for c in (cfg.text_column, cfg.label_column) if c not in d.column_names]
    if missing:
        raise TfmError(
            f"split '{split}' of '{name}' has no column {' or '.join(repr(m) for m in missing)} "
            f"(columns: {', '.join(d.column_names)}); set data.text_column / data.label_column (tfm evaluate: "
            "--text-column / --label-column)"
        )
    feature = d.features[cfg.label_column]
    class_names = list(feature.names) if hasattr(feature, "names") else None  # a datasets ClassLabel
    columns = d.select_columns([cfg.text_column, cfg.label_column]).to_dict()  # one Arrow -> Python pass
    texts = columns[cfg.text_column]
    bad = next((i for i, t in enumerate(texts) if not isinstance(t, str) or not t.strip()), None)
    if bad is not None:  # an empty review would train as [CLS] alone, with a label
        raise TfmError(f"split '{split}' of '{name}' has an empty or non-text value in column '{cfg.text_column}' "
                       f"(row {bad + 1}); fill it or remove the row")
    labels, label_names = label_ids(columns[cfg.label_column], class_names, label_names, f"split '{split}' of '{name}'")
    return RawSplit(texts, labels), label_names


# --------------------------------------------------------------------------- labels


def label_ids(values: list, class_names: list[str] | None, label_names: list[str] | None,
              where: str) -> tuple[np.ndarray, list[str]]:
    """((N,) int64 class ids, the class names): `values` (integers, or names as text; a ClassLabel's
    integers index `class_names`) as ids into `label_names`, or, when that is None, into the classes
    they define (a ClassLabel's names, else label_names_of the distinct values)."""
    distinct, inverse = _distinct_labels(values, where)
    if class_names is not None:
        bad = [v for v in distinct.tolist() if not 0 <= v < len(class_names)]
        if bad:
            raise TfmError(f"{where} has label {bad[0]}; its ClassLabel's labels are 0..{len(class_names) - 1} "
                           f"({', '.join(class_names)})")
        names = [class_names[v] for v in distinct.tolist()]
        label_names = list(class_names) if label_names is None else label_names
    else:
        label_names = label_names_of(distinct.tolist()) if label_names is None else label_names
        names = [value_name(v, label_names) for v in distinct.tolist()]
    index = {n: i for i, n in enumerate(label_names)}
    unknown = [n for n in names if n not in index]
    if unknown:
        raise TfmError(f"{where} has label '{unknown[0]}', which is not one of the classes trained on "
                       f"({', '.join(label_names)}); leave such examples out, or train on examples of every class")
    return np.array([index[n] for n in names], dtype=np.int64)[inverse], label_names


def label_names_of(values: list) -> list[str]:
    """The class names of a dataset's distinct label values, sorted, in id order: integers sorted
    numerically and named by their digits, except that 0 and 1 alone are IMDB's `neg` and `pos`;
    names sorted as text."""
    values = sorted(values)
    if values == [0, 1]:
        return list(DEFAULT_LABELS)
    return [str(v) for v in values]


def value_name(value: int | str, label_names: list[str]) -> str:
    """The class name of one label value: integers 0 and 1 are `neg` and `pos` where those are the
    classes (see label_names_of), other integers their digits; text is the name itself."""
    if isinstance(value, int) and label_names == DEFAULT_LABELS and value in (0, 1):
        return DEFAULT_LABELS[value]
    return str(value)


def _distinct_labels(values: list, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct label values, sorted, as an int64 or text array; (N,) each example's index into them)."""
    for i, v in enumerate(values):
        if v is None or (isinstance(v, str) and not v.strip()):
            raise TfmError(f"{where} has an empty label (example {i + 1}); every example needs one")
    if all(isinstance(v, (int, bool, np.integer)) for v in values):
        array = np.asarray(values, dtype=np.int64)
    elif all(isinstance(v, str) for v in values):
        array = np.asarray(values, dtype=str)
    else:
        text = isinstance(values[0], str)
        odd = next(v for v in values if isinstance(v, str) != text or not isinstance(v, (int, np.integer, str)))
        raise TfmError(f"{where} has label {odd!r}; labels must be integers or class names (text), "
                       "one kind throughout")
    distinct, inverse = np.unique(array, return_inverse=True)
    return distinct, inverse.reshape(-1)


def _with_names(loaded: tuple[dict[str, RawSplit], list[str]], label_names: list[str] | None, source: str):
    """aclImdb's splits (ids of neg and pos) as ids into `label_names`, when given."""
    raw, names = loaded
    if label_names is None or label_names == names:
        return raw, names
    for split, r in raw.items():
        ids, _ = label_ids(r.labels.tolist(), names, label_names, f"split '{split}' of '{source}'")
        raw[split] = RawSplit(r.texts, ids)
    return raw, label_names


def check_classes(labels: np.ndarray, label_names: list[str], where: str, hint: str) -> None:
    """Every class has an example in `labels` (ids), else one error line naming the first that has none."""
    counts = np.bincount(labels, minlength=len(label_names))
    empty = [name for name, n in zip(label_names, counts) if n == 0]
    if empty:
        raise TfmError(f"class '{empty[0]}' has no examples in {where}; {hint}")


_ACL_NAME = re.compile(r"(?:^|/)aclImdb/(train|test)/(pos|neg|unsup)/\d+_\d+\.txt$")
_ACL_REVIEW = re.compile(r"\d+_\d+\.txt")  # ID_RATING.txt: not ._ID_RATING.txt (macOS) or notes.txt
# The Hub's splits of IMDB in aclImdb's folders
ACL_TEXT_SPLITS = {"train": (("train", "neg"), ("train", "pos")), "test": (("test", "neg"), ("test", "pos")),
                   UNLABELLED_SPLIT: (("train", "unsup"),)}


def acl_root(source: str) -> Path | None:
    """The aclImdb folder (`source` or its aclImdb/), or the archive `source`, if it is one; else None."""
    path = Path(source)
    if path.is_file() and source.endswith((".tar.gz", ".tgz")):
        return path
    acl = path / "aclImdb" if (path / "aclImdb").is_dir() else path
    return acl if (acl / "train" / "pos").is_dir() else None


def _acl_splits(splits: tuple[str, ...], optional: tuple[str, ...], what: str) -> tuple[str, ...]:
    """The splits to read from aclImdb (train and test are all it has): the requested ones, and those
    of the optional ones it has."""
    for split in splits:
        if split not in ("train", "test"):
            raise UsageError(f"the aclImdb {what} has only 'train' and 'test' splits, not '{split}'")
    return (*splits, *(s for s in optional if s in ("train", "test") and s not in splits))


def _acl_reviews(root: Path, folders: list[tuple[str, str]]) -> dict[tuple[str, str], list[str]]:
    """The reviews of aclImdb's `folders` ((split, "pos" | "neg" | "unsup") pairs), each folder's in the
    order of its file names, from the folder `root` or the archive `root`."""
    found: dict[tuple[str, str], list[tuple[str, str]]] = {f: [] for f in folders}
    if root.is_dir():
        for split, sub in folders:
            for f in sorted(f for f in (root / split / sub).glob("*.txt") if _ACL_REVIEW.fullmatch(f.name)):
                found[split, sub].append((f.name, f.read_text(encoding="utf-8", errors="replace")))
        return {k: [text for _, text in rows] for k, rows in found.items()}
    try:
        with tarfile.open(root, "r:*") as tar:
            for member in tar:
                m = _ACL_NAME.search(member.name)
                if m and member.isfile() and (m.group(1), m.group(2)) in found:
                    text = tar.extractfile(member).read().decode("utf-8", errors="replace")
                    found[m.group(1), m.group(2)].append((member.name, text))
    except (tarfile.TarError, OSError, EOFError) as e:
        raise TfmError(f"could not read '{root}' as a tar archive: {first_line(e).rstrip(':')}") from None
    return {k: [text for _, text in sorted(rows)] for k, rows in found.items()}


def _from_acl(root: Path, splits: tuple[str, ...]):
    reviews = _acl_reviews(root, [(split, sub) for split in splits for sub in ("neg", "pos")])
    out = {}
    for split in splits:
        neg, pos = reviews[split, "neg"], reviews[split, "pos"]
        if not neg and not pos:
            raise TfmError(f"'{root}' holds no aclImdb/{split}/pos|neg/*.txt reviews")
        out[split] = RawSplit(neg + pos, np.array([0] * len(neg) + [1] * len(pos), dtype=np.int64))
    return out, DEFAULT_LABELS


def acl_text_source(root: Path, splits: Iterable[str] | None = None):
    """aclImdb as a text source (`tfm pretrain`, `tfm pseudo-label`): a `datasets.DatasetDict` of its splits
    as the Hub names them, train and test (pos and neg, labels left out) and unsupervised (train/unsup),
    each with a column "text". Only `splits` (default: all) are read, so that pretraining never reads the
    test reviews; a split it holds no reviews of is left out."""
    import datasets

    wanted = {split: folders for split, folders in ACL_TEXT_SPLITS.items() if splits is None or split in splits}
    reviews = _acl_reviews(root, [folder for folders in wanted.values() for folder in folders])
    texts = {split: [t for folder in folders for t in reviews[folder]] for split, folders in wanted.items()}
    return datasets.DatasetDict({split: datasets.Dataset.from_dict({"text": t}) for split, t in texts.items() if t})


def stratified_split(labels: np.ndarray, val_size: float, seed: int, block: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Seeded train/validation indices with the same label proportions in both.

    With block > 1, each label's examples (in dataset order) are cut into runs of `block` and whole
    runs are held out. A dataset that keeps related examples together (IMDB keeps each movie's
    reviews together) then validates on examples unlike those it trains on. Every label with at
    least two runs has one in each part, however small `val_size` or large the label.
    """
    rng = np.random.default_rng(seed)
    train, val = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
    for label in np.unique(labels):
        idx = np.flatnonzero(labels == label)
        runs = [idx[i : i + block] for i in range(0, len(idx), block)]
        order = rng.permutation(len(runs))
        n_val = round(len(runs) * val_size)
        if len(runs) >= 2:
            if n_val < 1:  # val_size asks for less than a run: the shortest (the remainder), nearest to it
                shortest = order[np.argmin([len(runs[i]) for i in order])]  # the first in `order` of a tie
                order = np.r_[shortest, order[order != shortest]]
            n_val = min(max(n_val, 1), len(runs) - 1)
        val += [runs[i] for i in order[:n_val]]
        train += [runs[i] for i in order[n_val:]]
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(val))


# --------------------------------------------------------------------------- tokenizer


def cache_key(*parts) -> str:
    """A short hash of JSON-able parts: names a cache entry by everything that changes its content."""
    return hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(), digest_size=12).hexdigest()


def train_tokenizer(texts: Iterable[str], cfg: DataConfig, length: int | None = None):
    """A WordPiece or BPE tokenizer trained on `texts`; `length`: how many there are (default:
    len(texts)), for the trainer's progress. WordPiece reads `texts` twice, so it must start over on
    each `iter()` (a list, not a generator).

    The same texts and settings give the same tokenizer in every process. `tokenizers`' WordPiece
    trainer alone does not: it numbers the "##" continuation of each character in hash-map order,
    after the alphabet, and those numbers break ties between equally frequent merges
    (huggingface/tokenizers#1794). Naming the alphabet in the trainer's own order (by code point)
    and then every continuation, sorted, among the trainer's special tokens gives the numbers the
    trainer would give had its hash map come out sorted; the tokenizer returned keeps only
    SPECIAL_TOKENS as special.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    normalizer = text_normalizer(cfg)
    if cfg.tokenizer == "wordpiece":
        if iter(texts) is texts:
            raise TypeError("train_tokenizer reads WordPiece's texts twice: pass a list or a re-iterable")
        alphabet = sorted(characters(texts, normalizer))
        continuations = [CONTINUATION + c for c in alphabet if not splits_words(c)]
        model, decoder = models.WordPiece(unk_token="[UNK]"), decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=cfg.vocab_size,
                                             special_tokens=SPECIAL_TOKENS + alphabet + continuations,
                                             min_frequency=MIN_FREQUENCY, continuing_subword_prefix=CONTINUATION,
                                             show_progress=False)
    else:
        model, decoder = models.BPE(unk_token="[UNK]"), decoders.BPEDecoder()
        trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, special_tokens=SPECIAL_TOKENS,
                                       min_frequency=MIN_FREQUENCY, show_progress=False)

    def assemble(model):
        tok = Tokenizer(model)
        tok.normalizer, tok.pre_tokenizer, tok.decoder = normalizer, pre_tokenizers.BertPreTokenizer(), decoder
        return tok

    tok = assemble(model)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts) if length is None else length)
    if cfg.tokenizer == "wordpiece":  # the alphabet and the continuations stay in the vocabulary, as ordinary tokens
        tok = assemble(tok.model)
        tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def text_normalizer(cfg: DataConfig):
    """What a trained tokenizer does to a text before splitting it: `<br />` tags become spaces, NFKC,
    lowercasing with data.lowercase."""
    from tokenizers import Regex, normalizers

    norm = [normalizers.Replace(Regex(BR_TAG), " "), normalizers.NFKC()]
    if cfg.lowercase:
        norm.append(normalizers.Lowercase())
    return normalizers.Sequence(norm)


def characters(texts: Iterable[str], normalizer) -> set[str]:
    """The characters of `texts` normalized by `normalizer`, whitespace aside. It may hold a few
    that no text has once normalized whole (e.g. the "<" of a "<br />"): never in a word, they are
    dead entries of a vocabulary and leave the other tokens in the order they had."""
    seen: set[str] = set()
    for t in texts:  # only texts that NFKC changes are normalized whole, since NFKC composes characters;
        seen.update(t if unicodedata.is_normalized("NFKC", t) else normalizer.normalize_str(t))
    # the rest of the normalizer (the <br> replacement, lowercasing) maps character by character
    return {c for ch in seen for c in normalizer.normalize_str(ch) if not is_whitespace(c)}


def is_whitespace(c: str) -> bool:
    """Rust's char::is_whitespace, which BertPreTokenizer splits at: Python's isspace() less U+001C-U+001F."""
    return c.isspace() and c not in "\x1c\x1d\x1e\x1f"


def splits_words(c: str) -> bool:
    """Whether BertPreTokenizer splits words at `c` (whitespace, punctuation): then no word continues with it."""
    return is_whitespace(c) or c in string.punctuation or unicodedata.category(c)[0] == "P"


def cached_tokenizer(texts: Iterable[str], n: int, cfg: DataConfig, fingerprint: str):
    """The tokenizer trained on `texts` (n of them, re-iterable as train_tokenizer needs), or loaded
    from the cache, where it is kept under a key of their `fingerprint` and the tokenizer settings."""
    from tokenizers import Tokenizer

    key = cache_key(fingerprint, cfg.tokenizer, cfg.vocab_size, cfg.lowercase, MIN_FREQUENCY, TOKENIZER_VERSION)
    path = cache_dir(cfg.cache_dir) / f"tokenizer-{key}.json"
    if path.is_file():
        try:
            return Tokenizer.from_file(str(path))
        except Exception:  # noqa: BLE001, S110 (a damaged cache entry is rebuilt below)
            pass
    tok = train_tokenizer(texts, cfg, n)
    try:
        atomic_write_text(path, tok.to_str())
    except OSError:
        pass  # caching is an optimisation; a read-only cache dir must not stop training
    return tok


# --------------------------------------------------------------------------- encoding


def truncate(ids: list[int], limit: int, strategy: str, head_fraction: float) -> list[int]:
    if len(ids) <= limit:
        return ids
    if strategy == "head":
        return ids[:limit]
    head = round(limit * head_fraction)
    return ids[:head] + ids[len(ids) - (limit - head) :]


LONG_TEXT_CHARS = 32  # per kept token: a text longer than this is encoded from its two ends only
CUT_AFTER = " \n,.!?;:"  # a long text may be cut just after one of these (_broken_tag: the exception)
_CUT = re.compile(f"[{re.escape(CUT_AFTER)}]")
_SPACES = re.compile(r"\s*")


def encode_texts(tokenizer, texts: list[str], max_length: int, truncation: str, head_fraction: float):
    """(flat ids, offsets): each text as [CLS] + its truncated subword ids."""
    tokenizer.encode_special_tokens = True  # "[PAD]" or "[CLS]" written in a review are words, not those ids
    limit = max_length - 1
    long = [len(t) > limit * LONG_TEXT_CHARS for t in texts]
    subwords = subword_ids(tokenizer, ["" if skip else t for t, skip in zip(texts, long)])
    rows = [
        [CLS_ID] + (_ends_ids(tokenizer, t, limit, truncation, head_fraction) if skip
                    else truncate(s, limit, truncation, head_fraction))
        for t, skip, s in zip(texts, long, subwords)
    ]
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    ids = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int32, count=int(offsets[-1]))
    return ids, offsets


_fast_paths: dict[int, tuple] = {}  # id(tokenizer) -> (tokenizer, its AsciiWordPiece or None): read once


def subword_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text's subword ids, no special tokens added, special tokens' text encoded as text (the
    tokenizer's encode_special_tokens set, as encode_texts sets it): ASCII texts through AsciiWordPiece
    where the tokenizer has its pipeline, the others through the tokenizer's fast batch (ids without
    the characters' offsets, which nothing here reads; docs/experiments.md)."""
    fast = AsciiWordPiece.of(tokenizer)
    ids = [fast.encode(t) if fast is not None and t.isascii() else None for t in texts]
    rest = [i for i, row in enumerate(ids) if row is None]
    for i, e in zip(rest, tokenizer.encode_batch_fast([texts[i] for i in rest], add_special_tokens=False)):
        ids[i] = e.ids
    return ids


class AsciiWordPiece:
    """The ids that a WordPiece tokenizer of train_tokenizer's pipeline gives an ASCII text, computed in
    Python with each word's pieces cached: reviews repeat their words, and the tokenizers library
    spends most of a review's time on per-word work (docs/experiments.md). On ASCII text NFKC changes nothing,
    lowercasing and the `<br>` pattern's `\\s` are plain ASCII rules, and BertPreTokenizer splits at
    ASCII whitespace and isolates string.punctuation; other text needs the tokenizers library's Unicode
    tables. Special tokens' text is encoded as text, as encode_texts asks of the tokenizer."""

    MAX_CACHED_WORDS = 1 << 16  # the cache starts over when full: a bound on its memory
    _SPACE = re.escape("".join(c for c in map(chr, range(128)) if is_whitespace(c)))  # also BR_TAG's `\s` on ASCII
    _PUNCT = re.escape(string.punctuation)
    _BR = re.compile(BR_TAG.replace(r"\s", f"[{_SPACE}]"))
    _WORD = re.compile(f"[^{_SPACE}{_PUNCT}]+|[{_PUNCT}]")

    def __init__(self, vocab: dict[str, int], unk_id: int, prefix: str, max_chars: int, lowercase: bool):
        self.vocab, self.unk, self.prefix, self.max_chars, self.lowercase = vocab, (unk_id,), prefix, max_chars, lowercase
        self.cache: dict[str, tuple[int, ...]] = {}

    @classmethod
    def of(cls, tokenizer) -> AsciiWordPiece | None:
        """The fast path for `tokenizer`, or None where its pipeline is another than train_tokenizer's WordPiece."""
        made = _fast_paths.get(id(tokenizer))
        if made is None or made[0] is not tokenizer:
            if len(_fast_paths) >= 8:  # a long-lived process that loads many tokenizers keeps the latest
                _fast_paths.clear()
            made = _fast_paths[id(tokenizer)] = (tokenizer, cls._from_pipeline(tokenizer))
        return made[1]

    @classmethod
    def _from_pipeline(cls, tokenizer) -> AsciiWordPiece | None:
        from tokenizers import Tokenizer

        if not isinstance(tokenizer, Tokenizer):
            return None
        spec = json.loads(tokenizer.to_str())
        model, norm = spec["model"], spec["normalizer"] or {}
        steps = [step.get("type") for step in norm.get("normalizers", [])]
        expected = {"type": "Replace", "pattern": {"Regex": BR_TAG}, "content": " "}
        if (model["type"] != "WordPiece" or spec["pre_tokenizer"] != {"type": "BertPreTokenizer"}
                or steps not in (["Replace", "NFKC"], ["Replace", "NFKC", "Lowercase"])
                or norm["normalizers"][0] != expected or spec["truncation"] or spec["padding"]
                or not all(t["special"] for t in spec["added_tokens"])):
            return None
        return cls(model["vocab"], model["vocab"][model["unk_token"]], model["continuing_subword_prefix"],
                   model["max_input_chars_per_word"], steps[-1] == "Lowercase")

    def encode(self, text: str) -> list[int]:
        """The ids of an ASCII `text`."""
        text = self._BR.sub(" ", text)
        ids, cache = [], self.cache
        for word in self._WORD.findall(text.lower() if self.lowercase else text):
            pieces = cache.get(word)
            if pieces is None:
                if len(cache) >= self.MAX_CACHED_WORDS:
                    cache.clear()
                pieces = cache[word] = self._pieces(word)
            ids += pieces
        return ids

    def _pieces(self, word: str) -> tuple[int, ...]:
        """WordPiece's greedy longest-match-first split of one word; [UNK] for the whole word where a
        part matches nothing or the word is too long."""
        if len(word) > self.max_chars:
            return self.unk
        out, start = [], 0
        while start < len(word):
            for end in range(len(word), start, -1):
                piece = self.vocab.get(word[start:end] if start == 0 else self.prefix + word[start:end])
                if piece is not None:
                    break
            else:
                return self.unk
            out.append(piece)
            start = end
        return tuple(out)


def _ends_ids(tokenizer, text: str, limit: int, truncation: str, head_fraction: float) -> list[int]:
    """truncate(ids of `text`), encoding only as much of its two ends as the kept tokens need: a huge
    review would take a lot of memory and time to encode whole. Each end is cut where a word ends,
    and grows until it holds enough tokens; text that never does is encoded whole."""
    n_head = limit if truncation == "head" else round(limit * head_fraction)
    n_tail = limit - n_head
    chars = 8 * limit + 64
    while 2 * chars < len(text):
        a, b = _cut_before(text, chars), (_cut_after(text, len(text) - chars) if n_tail else len(text))
        if a > 0 and (n_tail == 0 or a <= b < len(text)):
            head = tokenizer.encode(text[:a], add_special_tokens=False).ids
            tail = tokenizer.encode(text[b:], add_special_tokens=False).ids if n_tail else []
            if len(head) >= n_head and len(tail) >= n_tail and len(head) + len(tail) > limit:
                return head[:n_head] + tail[len(tail) - n_tail:]  # the whole has more than `limit` tokens
        chars *= 4
    return truncate(tokenizer.encode(text, add_special_tokens=False).ids, limit, truncation, head_fraction)


# Such a cut splits a text's encoding there too: the pre-tokenizer ends words at whitespace and
# isolates each punctuation character; NFKC composes nothing with these characters (it would with
# "=", "<" or ">": "=" + U+0338 is one character); and the only normalizer step that reads across
# a cut is the `<br\s*/?>` tag's, which a cut in the whitespace between "<br" and "/>" would break.


def _broken_tag(text: str, i: int) -> int | None:
    """Where the "<br" starts that a cut at i would part from its "/>"; None if the cut is safe."""
    j = i
    while j > 0 and text[j - 1].isspace():
        j -= 1
    if not text.endswith("<br", 0, j):
        return None
    return j - 3 if text.startswith((">", "/>"), _SPACES.match(text, i).end()) else None


def _cut_before(text: str, n: int) -> int:
    """The last safe cut at or before n, or 0. Scans back in windows that double, each read once."""
    hi, window = n, 256
    while hi > 0:
        lo = max(hi - window, 0)
        for end in reversed([m.end() for m in _CUT.finditer(text, lo, hi + 1)]):
            if end > hi:
                continue  # past n, or inside a tag found broken below
            broken = _broken_tag(text, end)
            if broken is None:
                return end
            hi = broken  # every cut from there to `end` parts the same tag
        hi, window = min(hi, lo), 2 * window
    return 0


def _cut_after(text: str, n: int) -> int:
    """The first safe cut at or after n, or len(text)."""
    start = max(n - 1, 0)
    while (m := _CUT.search(text, start)) is not None:
        if _broken_tag(text, m.end()) is None:
            return m.end()
        start = _SPACES.match(text, m.end()).end()  # every cut in this run of whitespace parts the same tag
    return len(text)


def cached_encode(tokenizer, raw: RawSplit, cfg: DataConfig, fingerprint: str) -> Encoded:
    key = cache_key(fingerprint, tokenizer.to_str(), cfg.max_length, cfg.truncation, cfg.head_fraction, ENCODING_VERSION)
    path = cache_dir(cfg.cache_dir) / f"encoded-{key}.npz"
    if path.is_file():
        try:
            with np.load(path, allow_pickle=False) as z:
                if len(z["offsets"]) == len(raw) + 1:
                    return Encoded(z["ids"], z["offsets"], raw.labels)
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache entry is rebuilt below
    ids, offsets = encode_texts(tokenizer, raw.texts, cfg.max_length, cfg.truncation, cfg.head_fraction)
    try:
        buf = io.BytesIO()
        np.savez(buf, ids=ids, offsets=offsets)
        atomic_write_bytes(path, buf.getvalue())
    except OSError:
        pass
    return Encoded(ids, offsets, raw.labels)


# --------------------------------------------------------------------------- batching


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


PAD_MULTIPLE = 32  # batch widths are rounded up to a multiple of this (see collate)


def round_width(width: int) -> int:
    """`width` rounded up to a multiple of PAD_MULTIPLE."""
    return -(-width // PAD_MULTIPLE) * PAD_MULTIPLE


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


def collate_packed(enc: Encoded, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ids (N,) int64, offsets (B + 1 + S,) int64): the reviews of `idx` end to end (model.Packed), then
    S < PAD_MULTIPLE texts of one [PAD] each that bring N to a multiple of PAD_MULTIPLE; their logits are
    to be dropped. A few widths instead of one per total keep oneDNN's caches of matmul shapes warm:
    unrounded, packed passes lost to padded ones (docs/experiments.md). One token each, the filler
    texts fit any max_length."""
    texts = enc.subset(idx)
    n = len(texts.ids)
    slack = -n % PAD_MULTIPLE
    ids = np.full(n + slack, PAD_ID, dtype=np.int64)
    ids[:n] = texts.ids
    return ids, np.concatenate([texts.offsets, np.arange(n + 1, n + slack + 1)])


# --------------------------------------------------------------------------- the whole pipeline


@dataclass
class Prepared:
    tokenizer: object
    labels: list[str]
    train: Encoded
    val: Encoded
    val_split: str  # the dataset's split validated on; "" when held out of train
    val_texts: list[str]  # val's reviews, to show one cut where its encoding was (TensorBoard pictures)


def sample_indices(idx: np.ndarray, n: int | None, seed: int) -> np.ndarray:
    """A seeded random subset of n indices, in their original order (datasets are often label-sorted)."""
    if n is None or n >= len(idx):
        return idx
    return np.sort(np.random.default_rng(seed).permutation(idx)[:n])


def train_val_splits(cfg: DataConfig, seed: int, needed: tuple[str, ...] = (),
                     label_names: list[str] | None = None) -> tuple[RawSplit, RawSplit, list[str], str]:
    """(train, validation, class names, the validation's split name): the dataset's `data.val_split` if
    it has one, else a stratified, seeded part held out of train (name ""). The `needed` splits (e.g.
    test, for later) must exist too. The classes are `label_names` if given (a trained model's), else
    those of train; each must have examples in both train and validation."""
    optional = (cfg.val_split,) if cfg.val_split else ()
    raw, label_names = load_splits(cfg, ("train", *needed), optional, label_names)
    if cfg.val_split and cfg.val_split not in raw and cfg.val_split != DEFAULT_VAL_SPLIT:
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
        if len(val) == 0:
            raise TfmError(f"the {cfg.val_split} split of '{cfg.source}' is empty; fill it, or set data.val_split = "
                           '"" to hold out part of train')
        train_idx, val_idx = np.arange(len(full)), np.arange(len(val))
        val_hint = f"add some to the '{val_split}' split, or set data.val_split = \"\" to hold out part of train"
    else:
        val = full
        check_classes(full.labels, label_names, f"the train split of '{cfg.source}'",
                      "every class needs training examples")
        train_idx, val_idx = stratified_split(full.labels, cfg.val_size, seed, cfg.val_block)
        if len(val_idx) == 0 or len(train_idx) == 0:
            raise TfmError(f"data.val_size = {cfg.val_size} (data.val_block = {cfg.val_block}) leaves an empty train "
                           f"or validation split of {len(full)} examples; change either")
        held, total = (np.bincount(full.labels[i], minlength=len(label_names)) for i in (val_idx, np.arange(len(full))))
        worst = int(np.argmax(held / np.maximum(total, 1)))
        if held[worst] > max(0.5, 2 * cfg.val_size) * total[worst]:  # whole runs: a small class may lose most of it
            raise UsageError(f"data.val_block = {cfg.val_block} holds out {held[worst]} of the {total[worst]} examples "
                             f"of class '{label_names[worst]}' for validation; lower data.val_block or add examples")
        val_hint = (f"holding some out of train for validation needs at least {cfg.val_block + 1} of each class "
                    f"(data.val_block = {cfg.val_block}); add examples")
    train_idx = sample_indices(train_idx, cfg.max_train_samples, seed)
    val_idx = sample_indices(val_idx, cfg.max_eval_samples, seed)
    train, val = full.subset(train_idx), val.subset(val_idx)
    check_classes(train.labels, label_names, f"the training part of '{cfg.source}'",
                  "every class needs training examples (raise data.max_train_samples, or add examples)")
    subset = " or raise data.max_eval_samples" if cfg.max_eval_samples is not None else ""
    check_classes(val.labels, label_names, f"the validation part of '{cfg.source}'", val_hint + subset)
    return train, val, label_names, val_split


def read_pseudo_labels(cfg: DataConfig, label_names: list[str], known: set[str]) -> RawSplit:
    """The reviews of `tfm pseudo-label`'s file `cfg.pseudo_labels` labelled with a score of at least
    `cfg.pseudo_min_score`, each once, less any whose text is in `known` (see prepare_train_data)."""
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
    for i, (text, score) in enumerate(zip(rows.texts, scores)):
        if score >= cfg.pseudo_min_score and text not in seen:
            seen.add(text)
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
        # reviews), nor a second copy of a training review, whose own label stands.
        try:
            test = load_splits(cfg, (), ("test",), label_names=label_names)[0].get("test")
        except TfmError:  # a test split whose labels cannot be read (-1, say) cannot be scored either
            test = None
        known = {*val_raw.texts, *train_raw.texts, *(test.texts if test is not None else ())}
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
