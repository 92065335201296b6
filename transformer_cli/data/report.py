"""`tfm data`: what a dataset holds before training on it, as `tfm train` would read it.

Each split (train, the validation part, test, the unlabelled reviews): its examples and classes, its
lengths in words and in tokens of the tokenizer training would use, and its texts that repeat, within it
and in the other splits. Two texts are one when the tokenizer cannot tell them apart (text_keys: case,
spacing and `<br />` tags aside). The warnings name what to change before training.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from transformer_cli.config import Config
from transformer_cli.data.sources import UNLABELLED_SPLIT, RawSplit, load_splits, open_text_source
from transformer_cli.data.splits import keys_of_test_texts, read_pseudo_labels, train_val_splits
from transformer_cli.data.text import BR_TAG, cached_tokenizer, encode_texts, text_keys

SPLITS = ("train", "validation", "test", UNLABELLED_SPLIT)  # in the report's order
IMBALANCE = 4.0  # a larger ratio of train's largest class to its smallest is warned of
PERCENTILES = (50, 90, 99)
_BR = re.compile(BR_TAG)


def picture_name(split: str) -> str:
    return f"lengths_{split}.png"


def data_report(cfg: Config, report_dir: str | Path | None = None) -> dict:
    """The report of `cfg.data` (split as `tfm train` with seed `cfg.train.seed` splits it), as one
    JSON-able dict; with `report_dir`, also a histogram of each split's token lengths there, as PNG."""
    if report_dir is not None:
        report_dir = check_report_dir(report_dir)
    d = cfg.data
    train, val, names, val_split = train_val_splits(d, cfg.train.seed)
    if d.pseudo_labels is not None:  # as prepare_train_data adds them
        extra = read_pseudo_labels(d, names, set(text_keys([*val.texts, *train.texts])) | keys_of_test_texts(d))
        train = RawSplit(train.texts + extra.texts, np.concatenate([train.labels, extra.labels]))
    splits = {"train": train, "validation": val, **load_splits(d, (), ("test",), names)[0]}
    unlabelled = open_text_source(d.source, [UNLABELLED_SPLIT])
    if UNLABELLED_SPLIT in unlabelled and d.text_column in unlabelled[UNLABELLED_SPLIT].column_names:
        texts = [t if isinstance(t, str) else "" for t in unlabelled[UNLABELLED_SPLIT][d.text_column]]
        splits[UNLABELLED_SPLIT] = RawSplit(texts, np.full(len(texts), -1, dtype=np.int64))

    tok = training_tokenizer(cfg, train)
    keys = {name: np.array(text_keys(s.texts), dtype="S16") for name, s in splits.items()}
    _, ids = np.unique(np.concatenate(list(keys.values())), return_inverse=True)  # one id a distinct text
    ids = dict(zip(splits, np.split(ids.reshape(-1), np.cumsum([len(k) for k in keys.values()])[:-1])))
    empty = np.array(text_keys([""]), dtype="S16")[0]
    labelled = [name for name in splits if name != UNLABELLED_SPLIT]

    report = {"data": d.source, "labels": names, "val_split": val_split, "seed": cfg.train.seed,
              "max_length": d.max_length, "vocab_size": tok.get_vocab_size(), "splits": {}}
    lengths = {}
    for name, s in splits.items():
        _, offsets = encode_texts(tok, s.texts, None, d.truncation)
        lengths[name] = np.diff(offsets)  # as training encodes them, [CLS] included
        limit = (d.train_max_length or d.max_length) if name == "train" else d.max_length
        stats = {"examples": len(s), "empty": int((keys[name] == empty).sum()),
                 "duplicates": len(s) - len(np.unique(ids[name])),
                 "words": percentiles(np.array([len(_BR.sub(" ", t).split()) for t in s.texts])),
                 "tokens": {**percentiles(lengths[name]), "limit": limit,
                            "over_limit": float(np.mean(lengths[name] > limit)) if len(s) else 0.0}}
        if name in labelled:
            counts = np.bincount(s.labels, minlength=len(names))
            stats["labels"] = {n: {"count": int(c), "share": float(c / max(len(s), 1))} for n, c in zip(names, counts)}
            stats["conflicting"] = conflicting(ids[name], s.labels)
        report["splits"][name] = stats
    report["shared"] = {a: {b: len(np.intersect1d(ids[a], ids[b])) for b in list(splits)[i + 1:]}
                        for i, a in enumerate(list(splits)[:-1])}
    report["conflicting"] = conflicting(np.concatenate([ids[n] for n in labelled]),
                                        np.concatenate([splits[n].labels for n in labelled]))
    report["warnings"] = advice(report)
    if report_dir is not None:
        report["pictures"] = [str(p) for p in write_pictures(report_dir, lengths, report)]
    return report


def training_tokenizer(cfg: Config, train: RawSplit):
    """The tokenizer `tfm train` would use: a pretrained encoder's (train.init_from), else the one trained on
    the training texts, from the cache where that run would find it (or put there for it)."""
    if cfg.train.init_from and (Path(cfg.train.init_from) / "tokenizer.json").is_file():
        from transformer_cli.checkpoint import read_tokenizer  # imports torch

        return read_tokenizer(Path(cfg.train.init_from) / "tokenizer.json")
    return cached_tokenizer(train.texts, len(train), cfg.data, train.fingerprint())


def percentiles(lengths: np.ndarray) -> dict:
    """p50, p90, p99 (the length that share of texts does not exceed) and the longest."""
    if not len(lengths):
        return {**{f"p{p}": 0 for p in PERCENTILES}, "max": 0}
    values = np.percentile(lengths, PERCENTILES, method="inverted_cdf")
    return {**{f"p{p}": int(v) for p, v in zip(PERCENTILES, values)}, "max": int(lengths.max())}


def conflicting(ids: np.ndarray, labels: np.ndarray) -> int:
    """How many distinct texts (ids) come with more than one label."""
    pairs = np.unique(np.stack([ids, labels], axis=1), axis=0)
    return int(np.count_nonzero(np.bincount(pairs[:, 0]) > 1)) if len(pairs) else 0


def advice(r: dict) -> list[str]:
    """What to change before training, one line each."""
    out = []
    counts = {name: c["count"] for name, c in r["splits"]["train"]["labels"].items()}
    most, least = max(counts, key=counts.get), min(counts, key=counts.get)
    if counts[most] > IMBALANCE * counts[least]:
        out.append(f"the training classes are imbalanced {counts[most] / counts[least]:.1f}:1 ('{most}' "
                   f"{counts[most]:,}, '{least}' {counts[least]:,}): weight them with train.class_weights=\"balanced\" "
                   "and select the model by macro-F1 (train.select_metric=macro_f1)")
    if r["shared"]["train"].get("test"):
        out.append(f"texts of test also in train: {r['shared']['train']['test']:,} (the same to the tokenizer); the "
                   "test accuracy counts reviews trained on: remove them from train")
    if r["shared"].get("validation", {}).get("test"):
        held = not r["val_split"]
        out.append(f"texts of the validation part ({'held out of train' if held else 'split ' + repr(r['val_split'])}) "
                   f"also in test: {r['shared']['validation']['test']:,}; the model is selected on texts it is tested "
                   f"on: remove them from {'train' if held else 'the validation split'}")
    return out


# --------------------------------------------------------------------------- output


def check_report_dir(path: str | Path) -> Path:
    """`path` usable as the folder of the pictures (and each of their files): checked before the work."""
    from transformer_cli.fileio import check_output_path

    hint = "pass a folder for the pictures"
    path = check_output_path(path, "--report", folder=True, hint=hint)
    for split in SPLITS:
        check_output_path(path / picture_name(split), "--report", hint=f"remove it or {hint}")
    return path


def write_pictures(folder: Path, lengths: dict[str, np.ndarray], r: dict) -> list[Path]:
    """A histogram of each split's token lengths, with its limit (data.max_length) marked."""
    from transformer_cli.fileio import atomic_write_together
    from transformer_cli.report import new_figure, png_bytes

    files = {}
    for split, n in lengths.items():
        fig = new_figure(6.0, 3.5)
        ax = fig.add_subplot()
        ax.hist(n, bins=60, color="tab:blue")
        limit = r["splits"][split]["tokens"]["limit"]
        ax.axvline(limit, color="black", linestyle="--", linewidth=1, label=f"limit {limit:,}")
        ax.set_xlabel("tokens ([CLS] included)")
        ax.set_ylabel("texts")
        ax.set_title(f"{split}: {len(n):,} texts, {r['splits'][split]['tokens']['over_limit']:.1%} over the limit")
        ax.legend(loc="upper right")
        files[folder / picture_name(split)] = png_bytes(fig)
    atomic_write_together(files)
    return list(files)


def report_text(r: dict) -> str:
    """`tfm data`'s report as a few aligned tables."""
    where = f"held out of train (seed {r['seed']})" if not r["val_split"] else f"split '{r['val_split']}'"
    title = f"{r['data']}: classes {', '.join(r['labels'])}; validation {where}; {r['vocab_size']:,} tokens"
    lines = [title, ""]
    splits = r["splits"]
    rows = [["split", "examples", "empty", "duplicates", "conflicting", *r["labels"]]]
    for name, s in splits.items():
        shares = [f"{c['count']:,} ({c['share']:.1%})" for c in s.get("labels", {}).values()]
        rows.append([name, f"{s['examples']:,}", f"{s['empty']:,}", f"{s['duplicates']:,}",
                     f"{s['conflicting']:,}" if "conflicting" in s else "-", *(shares or ["-"] * len(r["labels"]))])
    lines += table(rows) + [""]
    rows = [["lengths", "words p50", "p90", "p99", "max", "tokens p50", "p90", "p99", "max", "over limit"]]
    for name, s in splits.items():
        w, t = s["words"], s["tokens"]
        rows.append([name, *(f"{w[k]:,}" for k in ("p50", "p90", "p99", "max")),
                     *(f"{t[k]:,}" for k in ("p50", "p90", "p99", "max")), f"{t['over_limit']:.1%} of {t['limit']:,}"])
    lines += table(rows) + [""]
    names = list(splits)
    rows = [["shared texts", *names[1:]]]
    rows += [[a, *(f"{r['shared'][a][b]:,}" if b in r["shared"][a] else "" for b in names[1:])] for a in names[:-1]]
    lines += table(rows)
    lines.append(f"texts with conflicting labels (all labelled splits): {r['conflicting']:,}")
    lines += [f"picture: {p}" for p in r.get("pictures", [])]
    return "\n".join(lines)


def table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
            for row in rows]
