"""What the commands read and print: reviews from arguments and files, and the reports of their results."""

from __future__ import annotations

import codecs
import os
import sys
from pathlib import Path

from transformer_cli.errors import UsageError


def read_inputs(texts: list[str], file: str | None) -> list[str]:
    """The reviews of TEXT arguments or of --file (a path, or '-' for standard input), one a line."""
    if file is not None:
        if texts:
            raise UsageError("pass review TEXT arguments or --file, not both")
        if file == "-":
            if sys.stdin is None:
                raise UsageError("--file -: standard input is closed; pipe reviews in or pass --file PATH")
            raw = sys.stdin.buffer.read()
        else:
            p = Path(file)
            if p.is_dir():
                raise UsageError(f"--file '{file}' is a directory; pass a text file with one review per line")
            try:
                raw = p.read_bytes()
            except FileNotFoundError:
                raise UsageError(f"--file '{file}' does not exist") from None
        content = decode(raw, file)
        # Lines end at \n or \r\n only: str.splitlines would also split a review at \x0c, \x1c-\x1e,
        # \x85 (an ellipsis in Windows-1252, read as Latin-1), U+2028 and U+2029.
        texts = content.split("\n")
        if texts[-1] == "":
            texts.pop()  # the newline that ends the last line
        texts = [t.removesuffix("\r") for t in texts]
    else:
        texts = [argument_text(t, i) for i, t in enumerate(texts, 1)]
    while file is not None and texts and not texts[-1].strip():
        texts.pop()  # blank lines at the end of a file are no reviews
    for i, t in enumerate(texts, 1):
        if not t.strip():
            where = f"line {i} of '{file}'" if file is not None else f"text {i}"
            raise UsageError(f"{where} is empty; every input must be a non-empty review")
    if not texts:
        raise UsageError("no input: pass review TEXT arguments or --file PATH ('-' for stdin)")
    return texts


# The byte-order marks of UTF-16 (PowerShell's `>` writes UTF-16 LE) and UTF-32, UTF-32 LE's first: it
# starts with UTF-16 LE's.
BOMS = ((codecs.BOM_UTF32_LE, "utf-32-le"), (codecs.BOM_UTF32_BE, "utf-32-be"), (codecs.BOM_UTF16_LE, "utf-16-le"),
         (codecs.BOM_UTF16_BE, "utf-16-be"))


def argument_text(text: str, i: int) -> str:
    """A TEXT argument as the shell gave it. Bytes that are not UTF-8 reach Python as lone surrogates,
    which the tokenizer refuses; they are read as Latin-1 with a warning, as --file's are."""
    raw = os.fsencode(text)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        print(f"tfm: warning: text {i} is not UTF-8; read it as Latin-1", file=sys.stderr)
        return raw.decode("latin-1")


def decode(raw: bytes, file: str) -> str:
    """The text of --file's bytes without a byte-order mark: a file that starts with a UTF-16 or UTF-32
    one is read in that encoding, any other as UTF-8 (Notepad's mark dropped), else as Latin-1 with a
    warning. A mark left in would be part of the first review, and UTF-16 read as Latin-1 is garbage."""
    for bom, encoding in BOMS:
        if raw.startswith(bom):
            name = encoding[:6].upper()
            try:
                return raw[len(bom):].decode(encoding)
            except UnicodeDecodeError as e:
                raise UsageError(f"--file '{file}' starts with a {name} byte-order mark but is not {name} "
                                 f"({e.reason} at byte {len(bom) + e.start}); save it as UTF-8") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        print(f"tfm: warning: '{file}' is not UTF-8; read it as Latin-1", file=sys.stderr)
        return raw.decode("latin-1")


def snippet(text: str, width: int = 60) -> str:
    """`text` on one line, its whitespace runs as single spaces, cut to `width` characters. Only as much
    of its start is read as holds enough words, so that a huge review costs no more than a short one."""
    size = 4 * width
    while len(line := " ".join(text[:size].split())) <= width and size < len(text):
        size *= 4  # mostly whitespace so far
    return line if len(line) <= width else line[: width - 3] + "..."


def imbalance_warning(val: dict, class_weights=None, select_metric: str | None = None) -> str | None:
    """What to do when the validation metrics show a model that leans on the majority: a class it never predicts,
    or macro-F1 far below accuracy. Where the classes are imbalanced it suggests the run's settings
    (train.class_weights, train.select_metric) that are not set already."""
    predicted = [sum(column) for column in zip(*val.get("confusion_matrix", []))]
    never = [name for name, n in zip(val.get("labels", []), predicted) if n == 0]
    if not never and val.get("macro_f1", 1.0) >= val.get("accuracy", 0.0) - 0.1:
        return None
    why = f"it never predicts {', '.join(repr(n) for n in never)} on validation" if never else "its macro-F1 is low"
    why += f" (macro-F1 {val['macro_f1']:.4f}, accuracy {val['accuracy']:.4f})"
    support = [sum(row) for row in val.get("confusion_matrix", [])]
    if support and min(support) >= 0.5 * max(support):  # balanced classes: the model has not learned them apart
        return f"{why}: it has not learned the classes apart; train it longer or at another --lr"
    advice = []
    if class_weights is None:
        advice.append("weigh them with train.class_weights=balanced")
    if select_metric != "macro_f1":
        advice.append("select the model by macro-F1 with train.select_metric=macro_f1")
    return f"{why}: the classes are imbalanced; " + (", and ".join(advice) or "more examples of the rarer would help")


def evaluation_report(m: dict) -> str:
    """`tfm evaluate`'s text report of evaluate_checkpoint's metrics, for any number of classes: the
    overall figures, a table of each class's, and the confusion matrix (rows: true, columns: predicted)."""
    lines = [f"{m['data']} [{m['split']}]: {m['num_examples']} examples, {m['examples_per_sec']:.0f} examples/s"]
    lines += [f"  {title:<10} {m[key]:.4f}" for title, key in
              (("accuracy", "accuracy"), ("macro F1", "macro_f1"), ("loss", "loss"))]
    labels = m["labels"]
    width = max(len("class"), *map(len, labels))
    lines.append(f"  {'class':<{width}}  precision  recall      f1  support")
    for name in labels:
        c = m["per_class"][name]
        lines.append(f"  {name:<{width}}  {c['precision']:9.4f}  {c['recall']:6.4f}  {c['f1']:6.4f}  {c['support']:7d}")
    cells = [str(n) for row in m["confusion_matrix"] for n in row]
    cell = max(map(len, [*labels, *cells]))
    lines.append("  confusion (rows: true, columns: predicted)")
    lines.append(f"  {'':<{width}}  " + "  ".join(f"{name:>{cell}}" for name in labels))
    for name, row in zip(labels, m["confusion_matrix"]):
        lines.append(f"  {name:<{width}}  " + "  ".join(f"{n:>{cell}}" for n in row))
    if "ece" in m:  # evaluate_checkpoint's, with the calibration temperature it applied
        lines.append(f"  {'ece':<10} {m['ece']:.4f} (temperature {m['temperature']:.3f})")
    return "\n".join(lines)
