"""Where labelled and unlabelled texts come from: Hub ids, Hub-layout folders, data files (CSV, TSV, JSON
Lines, Parquet, text), aclImdb folders or tarballs; and their labels, as ids into a model's class names.
`datasets` is imported only where a dataset is loaded."""

from __future__ import annotations

import codecs
import csv
import hashlib
import re
import tarfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from transformer_cli.config import DataConfig
from transformer_cli.errors import TfmError, UsageError, cause_line, first_line

DEFAULT_LABELS = ["neg", "pos"]  # the names of integer labels 0 and 1 when a dataset has no others (IMDB's)
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


def load_splits(cfg: DataConfig, splits: tuple[str, ...], optional: tuple[str, ...] = (),
                label_names: list[str] | None = None) -> tuple[dict[str, RawSplit], list[str]]:
    """The requested splits of `cfg.source`, and those of the `optional` ones it has; the class names. Labels
    become ids into `label_names` (a trained model's classes) when given, else into the first split's classes."""
    odd = [s for s in splits if s not in ACL_SPLITS]
    if odd and acl_root(cfg.source) is not None:
        raise UsageError(f"the aclImdb data has only the splits {', '.join(ACL_SPLITS)}, not '{odd[0]}'")
    ds = open_text_source(cfg.source, (*splits, *optional))
    return _from_dataset_dict(ds, cfg, splits, cfg.source, optional, label_names)


def open_text_source(source: str, splits: Iterable[str] | None = None):
    """The `datasets.DatasetDict` of a data source. `splits`: the splits the caller reads (default: all);
    aclImdb's reviews of other splits are not read at all."""
    acl = acl_root(source)
    if acl is not None:
        return acl_dataset(acl, splits)
    files = named_files(source)
    if files is not None:
        return open_dataset_files(files)
    if Path(source).is_file():
        raise UsageError(f"don't know how to read '{source}'; pass a Hub id, a Hub-layout folder, the aclImdb "
                         "folder or archive, or .csv/.tsv/.jsonl/.parquet/.txt file(s)")
    if not Path(source).is_dir() and looks_like_path(source):
        raise UsageError(f"data path '{source}' does not exist; pass an existing folder or file, or a Hub dataset id")
    return open_dataset(source)


def local_paths(source: str) -> list[str]:
    """The files or folder a data source names on this machine (none for a Hub id)."""
    files = named_files(source)
    if files is not None:
        return list(files.values())
    return [source] if Path(source).exists() or looks_like_path(source) else []


def looks_like_path(source: str) -> bool:
    """Hub ids are `name` or `owner/name`; anything else that does not exist is a missing path."""
    suffixes = (*FILE_BUILDERS, ".tar.gz", ".tgz")
    return source.startswith((".", "/", "~")) or source.count("/") > 1 or source.lower().endswith(suffixes)


def quiet_datasets():
    """`datasets`, silenced: its errors reach us as exceptions, and it shows no progress bars."""
    import datasets

    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    datasets.disable_progress_bars()
    return datasets


def open_dataset(source: str):
    """The `datasets.DatasetDict` of a Hub id or a Hub-layout folder: Arrow tables, memory-mapped."""
    datasets = quiet_datasets()
    if Path(source).is_dir():
        files = folder_files(source)
        if files is not None and {Path(f).suffix.lower() for fs in files.values() for f in fs} in ({".csv"}, {".tsv"}):
            return open_dataset_files(files)  # read as the same file named alone is read
    try:
        return datasets.load_dataset(source, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 (many types, for missing, offline or unreadable sources)
        hint = "pass a local copy with --data PATH"
        if Path(source).is_dir():
            refuse_empty_files(source_files(source))  # datasets says only that a split "corresponds to no data"
            hint = "check its data files (one per split, e.g. train.csv and test.csv)"
        raise TfmError(f"could not load dataset '{source}' ({cause_line(e)}); {hint}") from None


SHARD = re.compile(r".*-\d{5}-of-\d{5}$")  # train-00000-of-00003.parquet: one split's files, as the Hub writes them


def folder_files(source: str) -> dict[str, list[str]] | None:
    """{split: files} of a Hub-layout folder as `datasets` finds them (None if it cannot tell). Without a
    README.md whose configs: section lists them, a split of several files that are not one shard series
    (train.jsonl beside train_backup.jsonl or old/train.jsonl, which `datasets` would join) is refused."""
    try:
        found = quiet_datasets().load_dataset_builder(source).config.data_files or {}  # a folder: no loading script
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
    """"; ..." to end a "has no split" error: why a file in the folder `source` named for one of the `missing`
    splits (unsupervised.csv) is not that split, and what to do; "" where there is none. `others`: the splits
    read beside them, for the example of named files."""
    folder = Path(source)
    if not folder.is_dir():
        return ""

    def named_for(split: str) -> list[Path]:
        pattern = re.compile(rf"{re.escape(split)}([-_.]|$)", re.IGNORECASE)
        return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in FILE_BUILDERS and
                      pattern.match(p.stem) and not any(part.startswith(".") for part in p.relative_to(folder).parts))

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
    every = [f for fs in files.values() for f in ([fs] if isinstance(fs, str) else fs)]
    for f in every:
        if not Path(f).is_file():
            raise UsageError(f"data file '{f}' does not exist")
    suffixes = {Path(f).suffix.lower() for f in every}
    suffix = suffixes.pop() if len(suffixes) == 1 else None
    if suffix not in FILE_BUILDERS:
        raise UsageError(f"data files must share one of the types {', '.join(FILE_BUILDERS)}; got {', '.join(every)}")
    if suffix in (".json", ".jsonl"):  # pyarrow's JSON reader keeps bad bytes, which fail later, unnamed
        for f in every:
            check_utf8(Path(f))
    kwargs = {"keep_default_na": False} if suffix in (".csv", ".tsv") else {}  # cells such as "NA" stay text
    if suffix == ".tsv":  # no quoting, as TSV readers of text data (GLUE's) take it: a review may open with '"'
        kwargs.update(delimiter="\t", quoting=csv.QUOTE_NONE)
    try:
        return quiet_datasets().load_dataset(FILE_BUILDERS[suffix], data_files=files, **kwargs)
    except Exception as e:  # noqa: BLE001 (each file builder raises its own types for unreadable files)
        refuse_empty_files(every)  # datasets says "corresponds to no data", or "StopIteration"
        cause = cause_line(e)
        hint = "; save the file as UTF-8" if "codec can't decode" in cause else ""
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
    """A TfmError naming the first of `files` that holds no rows (blank, a CSV/TSV header alone, Parquet's none)."""
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
                raise TfmError(f"data file '{f}' has no rows: fill it or remove it") from None
        elif f.stat().st_size <= 4096:
            lines = [line for line in f.read_bytes().splitlines() if line.strip()]
            if not lines:
                raise TfmError(f"data file '{f}' is empty: fill it or remove it") from None
            if len(lines) == 1 and suffix in (".csv", ".tsv"):
                raise TfmError(f"data file '{f}' has a header line but no rows: fill it or remove it") from None


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
            texts = [t for t in chunk[column] if not (skip_blank and isinstance(t, str) and not t.strip())][:left]
            if any(not isinstance(t, str) for t in texts):
                raise TfmError(f"column '{column}' holds empty or non-text values")
            if texts:
                yield texts
            if left is not None and (left := left - len(texts)) <= 0:
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
        raise TfmError(f"split '{split}' of '{name}' has no column {' or '.join(repr(m) for m in missing)} "
                       f"(columns: {', '.join(d.column_names)}); set data.text_column / data.label_column "
                       "(tfm evaluate: --text-column / --label-column)")
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
        imdb = label_names == DEFAULT_LABELS  # integers 0 and 1 are then neg and pos
        names = [DEFAULT_LABELS[v] if imdb and v in (0, 1) else str(v) for v in distinct.tolist()]
    index = {n: i for i, n in enumerate(label_names)}
    unknown = [n for n in names if n not in index]
    if unknown:
        raise TfmError(f"{where} has label '{unknown[0]}', which is not one of the classes trained on "
                       f"({', '.join(label_names)}); leave such examples out, or train on examples of every class")
    return np.array([index[n] for n in names], dtype=np.int64)[inverse], label_names


def label_names_of(values: list) -> list[str]:
    """The class names of distinct label values, in id order (sorted: integers numerically, text as text);
    integers are named by their digits, except that 0 and 1 alone are IMDB's `neg` and `pos`."""
    values = sorted(values)
    return list(DEFAULT_LABELS) if values == [0, 1] else [str(v) for v in values]


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
        if isinstance(odd, (list, tuple, np.ndarray)):
            raise TfmError(f"{where} has label {odd!r}, a list: multi-label data is not supported; give each "
                           "example one label (an integer or a class name)")
        raise TfmError(f"{where} has label {odd!r}; labels must be integers or class names (text), "
                       "one kind throughout")
    distinct, inverse = np.unique(array, return_inverse=True)
    return distinct, inverse.reshape(-1)


def check_classes(labels: np.ndarray, label_names: list[str], where: str, hint: str) -> None:
    """Every class has an example in `labels` (ids), else one error line naming the first that has none."""
    counts = np.bincount(labels, minlength=len(label_names))
    empty = [name for name, n in zip(label_names, counts) if n == 0]
    if empty:
        raise TfmError(f"class '{empty[0]}' has no examples in {where}; {hint}")


_ACL_NAME = re.compile(r"(?:^|/)aclImdb/(train|test)/(pos|neg|unsup)/\d+_\d+\.txt$")
_ACL_REVIEW = re.compile(r"\d+_\d+\.txt")  # ID_RATING.txt: not ._ID_RATING.txt (macOS) or notes.txt
ACL_SPLITS = {"train": (("train", "neg"), ("train", "pos")), "test": (("test", "neg"), ("test", "pos")),
              UNLABELLED_SPLIT: (("train", "unsup"),)}  # the Hub's splits of IMDB in aclImdb's folders
ACL_LABELS = {"neg": 0, "pos": 1, "unsup": -1}  # as the Hub's: ClassLabel neg, pos; -1 for no label


def acl_root(source: str) -> Path | None:
    """The aclImdb folder (`source` or its aclImdb/), or the archive `source`, if it is one; else None."""
    path = Path(source)
    if path.is_file() and source.endswith((".tar.gz", ".tgz")):
        return path
    acl = path / "aclImdb" if (path / "aclImdb").is_dir() else path
    return acl if (acl / "train" / "pos").is_dir() else None


def _acl_reviews(root: Path, folders: list[tuple[str, str]]) -> dict[tuple[str, str], list[str]]:
    """The reviews of aclImdb's `folders` ((split, "pos" | "neg" | "unsup") pairs), each folder's in the
    order of its file names, from the folder `root` or the archive `root`."""
    found: dict[tuple[str, str], list[tuple[str, str]]] = {f: [] for f in folders}
    if root.is_dir():
        for split, sub in folders:
            for f in (root / split / sub).glob("*.txt"):
                if _ACL_REVIEW.fullmatch(f.name):
                    found[split, sub].append((f.name, f.read_text(encoding="utf-8", errors="replace")))
    else:
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


def acl_dataset(root: Path, splits: Iterable[str] | None = None):
    """aclImdb as the Hub has it: a `datasets.DatasetDict` of train and test (neg, then pos) and unsupervised
    (train/unsup), with columns "text" and "label" (ACL_LABELS). Only `splits` (default: all) are read, so that
    pretraining never reads the test reviews; a split it holds no reviews of is left out."""
    datasets = quiet_datasets()
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=DEFAULT_LABELS)})
    wanted = {split: folders for split, folders in ACL_SPLITS.items() if splits is None or split in splits}
    reviews = _acl_reviews(root, [folder for folders in wanted.values() for folder in folders])
    out = {}
    for split, folders in wanted.items():
        texts = [text for folder in folders for text in reviews[folder]]
        labels = [ACL_LABELS[folder[1]] for folder in folders for _ in reviews[folder]]
        if texts:
            out[split] = datasets.Dataset.from_dict({"text": texts, "label": labels}, features=features)
    return datasets.DatasetDict(out)
