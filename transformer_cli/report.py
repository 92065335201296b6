"""`tfm evaluate --report DIR`: an evaluation's pictures, as PNG files and a report.html that shows them:
the confusion matrix, the reliability diagram, each class's precision-recall curve, accuracy by review length.
Figures are drawn on matplotlib's Agg canvas (no display, no pyplot state); tb_pictures.py reuses them.
"""

from __future__ import annotations

import html
import io
from pathlib import Path

import numpy as np

from transformer_cli.calibration import BINS, expected_calibration_error, reliability
from transformer_cli.fileio import atomic_write_together, check_output_path

REPORT_FILE = "report.html"
PICTURES = {  # file -> caption, in the report's order
    "confusion_matrix.png": "Confusion matrix",
    "reliability.png": "Reliability diagram",
    "pr_curve.png": "Precision-recall curves",
    "accuracy_by_length.png": "Accuracy by review length",
}


def check_report_dir(path: str | Path) -> Path:
    """`path` usable as the report's folder (and each of its files, where one is there already: not a
    folder): checked before the evaluation runs."""
    hint = "pass a folder for the report's pictures"
    path = check_output_path(path, "--report", folder=True, hint=hint)
    for name in [*PICTURES, REPORT_FILE]:
        check_output_path(path / name, "--report", hint=f"remove it or {hint}")
    return path


def write_report(folder: str | Path, metrics: dict, probs: np.ndarray, labels: np.ndarray,
                 lengths: np.ndarray) -> Path:
    """The PNGs and report.html of an evaluation (evaluate_checkpoint's `metrics`, its (N, K)
    probabilities, true labels and token lengths) in `folder`; returns report.html's path."""
    folder = check_report_dir(folder)
    names = metrics["labels"]
    figures = {
        "confusion_matrix.png": confusion_figure(np.asarray(metrics["confusion_matrix"]), names),
        "reliability.png": reliability_figure(probs, labels),
        "pr_curve.png": pr_figure(probs, labels, names),
        "accuracy_by_length.png": length_figure(probs, labels, lengths),
    }
    files = {folder / name: png_bytes(fig) for name, fig in figures.items()}
    files[folder / REPORT_FILE] = report_html(metrics).encode("utf-8")
    atomic_write_together(files)  # a report of one evaluation: an earlier one's pictures never mix in
    return folder / REPORT_FILE


def report_html(metrics: dict) -> str:
    """A self-contained page: the headline numbers, each class's precision, recall, F1 and support (as `tfm
    evaluate` prints them), and each picture of PICTURES, by relative name."""
    rows = [("examples", f"{metrics['num_examples']}"), ("accuracy", f"{metrics['accuracy']:.4f}"),
            ("macro_f1", f"{metrics['macro_f1']:.4f}"), ("loss", f"{metrics['loss']:.4f}"),
            ("ece", f"{metrics['ece']:.4f}"), ("temperature", f"{metrics.get('temperature', 1.0):.4f}")]
    table = "\n".join(f'<tr><th>{name}</th><td id="{name}">{value}</td></tr>' for name, value in rows)
    per_class = "\n".join(
        f"<tr><th>{html.escape(name)}</th>" + "".join(f"<td>{c[k]:.4f}</td>" for k in ("precision", "recall", "f1"))
        + f"<td>{c['support']}</td></tr>" for name, c in metrics["per_class"].items())
    pictures = "\n".join(f'<figure><img src="{name}" alt="{html.escape(caption)}">'
                         f"<figcaption>{html.escape(caption)}</figcaption></figure>"
                         for name, caption in PICTURES.items())
    title = html.escape(f"{metrics['data']} [{metrics['split']}]")
    return f"""<!DOCTYPE html>
<html lang="en">
<head><meta charset="utf-8"><title>tfm evaluate: {title}</title>
<style>body {{ font-family: sans-serif; margin: 2em; }} td, th {{ padding: 0.2em 1em; text-align: left; }}
figure {{ display: inline-block; margin: 1em; }} img {{ max-width: 36em; }}</style></head>
<body>
<h1>{title}</h1>
<table>
{table}
</table>
<table id="per_class">
<tr><th>class</th><th>precision</th><th>recall</th><th>f1</th><th>support</th></tr>
{per_class}
</table>
{pictures}
</body>
</html>
"""


# --------------------------------------------------------------------------- figures


def plain(text: str) -> str:
    """`text` (a label name, a token) drawn as it is: matplotlib reads text between two dollar signs as
    math, and fails on what is no formula (labels "$", "$$", "$$$")."""
    return text.replace("$", r"\$")


LONGEST_NAME = 30  # characters of a class name drawn on an axis; longer ones are cut, with an ellipsis


def short(name: str) -> str:
    """A class name cut to LONGEST_NAME characters, as pictures show it (still to be made `plain`)."""
    return name if len(name) <= LONGEST_NAME else name[: LONGEST_NAME - 1] + "\u2026"


def new_figure(width: float = 5.0, height: float = 4.0):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def png_bytes(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def rgb_array(fig) -> np.ndarray:
    """(H, W, 3) uint8 pixels of `fig`, for TensorBoard images."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def confusion_figure(confusion: np.ndarray, names: list[str]):
    """Counts, rows the true label and columns the predicted one, shaded by each row's share."""
    k, shown = len(names), [plain(short(n)) for n in names]
    longest = max(len(n) for n in shown)
    tilt = k > 4 or longest > 8  # side by side, longer names would run into each other
    margin = 0.07 * longest  # inches the names take beside (and, tilted, below) the matrix
    fig = new_figure(1.5 + margin + 0.6 * max(k, 3), 1.2 + (margin if tilt else 0) + 0.6 * max(k, 3))
    ax = fig.add_subplot()
    share = confusion / np.maximum(confusion.sum(axis=1, keepdims=True), 1)
    ax.imshow(share, cmap="Blues", vmin=0, vmax=1)
    for i in range(k):
        for j in range(k):
            ax.text(j, i, f"{int(confusion[i, j])}", ha="center", va="center",
                    color="white" if share[i, j] > 0.5 else "black")
    ax.set_xticks(range(k), shown, rotation=45 if tilt else 0, ha="right" if tilt else "center")
    ax.set_yticks(range(k), shown)
    ax.set(xlabel="predicted", ylabel="true", title="Confusion matrix")
    return fig


def reliability_figure(probs: np.ndarray, labels: np.ndarray):
    """Accuracy against mean confidence in each of the BINS bins (bars), the diagonal, and the ECE."""
    r = reliability(probs, labels)
    ece = expected_calibration_error(probs, labels)
    fig = new_figure()
    ax = fig.add_subplot()
    width = 1.0 / BINS
    used = r["count"] > 0
    ax.bar(r["edges"][:-1][used], r["accuracy"][used], width=width, align="edge", edgecolor="black",
           label="accuracy")
    ax.bar(r["edges"][:-1][used], (r["confidence"] - r["accuracy"])[used], bottom=r["accuracy"][used], width=width,
           align="edge", color="tab:red", alpha=0.3, label="gap to confidence")
    ax.plot([0, 1], [0, 1], "k--", linewidth=1)
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="confidence (top probability)", ylabel="accuracy",
           title=f"Reliability: ECE {ece:.4f} ({BINS} bins)")
    ax.legend(loc="upper left")
    return fig


def pr_curve(scores: np.ndarray, positive: np.ndarray) -> tuple[np.ndarray, np.ndarray, float | None]:
    """(precision, recall, average precision) of ranking by `scores` against the bool `positive`, one
    point per distinct score; the average precision is None where no example is positive (undefined:
    there is no recall to gain)."""
    order = np.argsort(-scores, kind="stable")
    s, pos = scores[order], positive[order].astype(np.float64)
    last = np.r_[np.nonzero(np.diff(s))[0], len(s) - 1]  # the last index of each run of equal scores
    tp = np.cumsum(pos)[last]
    precision = tp / (last + 1)
    recall = tp / max(pos.sum(), 1)
    ap = float(np.sum(np.diff(np.r_[0.0, recall]) * precision)) if pos.any() else None
    return precision, recall, ap


def pr_figure(probs: np.ndarray, labels: np.ndarray, names: list[str]):
    """Each class's precision-recall curve, one against the rest, with its average precision; a class
    with no example has no curve, only its legend entry."""
    fig = new_figure()
    ax = fig.add_subplot()
    lines, texts = [], []  # given to the legend, which would leave out a name that starts with "_" (__label__pos)
    for c, name in enumerate(names):
        precision, recall, ap = pr_curve(probs[:, c], labels == c)
        lines += ax.plot([], []) if ap is None else ax.plot(np.r_[0.0, recall], np.r_[1.0, precision])
        texts.append(f"{plain(short(name))} ({'AP n/a, no examples' if ap is None else f'AP {ap:.3f}'})")
    ax.set(xlim=(0, 1), ylim=(0, 1.02), xlabel="recall", ylabel="precision",
           title="Precision-recall, each class against the rest")
    ax.legend(lines, texts, loc="lower left")
    return fig


def accuracy_by_length(probs: np.ndarray, labels: np.ndarray, lengths: np.ndarray) -> list[tuple[int, int, int, float]]:
    """[(low, high, examples, accuracy)] for each non-empty bin of lengths in (low, high]: 0 to 32, then
    powers of two up to past the longest review."""
    top = max(int(lengths.max()) if len(lengths) else 1, 33)
    edges = np.r_[0, 2 ** np.arange(5, int(np.ceil(np.log2(top))) + 1)]
    right = probs.argmax(axis=1) == labels
    which = np.searchsorted(edges, lengths, side="left") - 1  # (low, high] -> the bin of low
    return [(int(edges[b]), int(edges[b + 1]), int((which == b).sum()), float(right[which == b].mean()))
            for b in range(len(edges) - 1) if (which == b).any()]


def length_figure(probs: np.ndarray, labels: np.ndarray, lengths: np.ndarray):
    rows = accuracy_by_length(probs, labels, lengths)
    fig = new_figure(6.0, 4.0)
    ax = fig.add_subplot()
    xs = np.arange(len(rows))
    bars = ax.bar(xs, [r[3] for r in rows], edgecolor="black")
    ax.bar_label(bars, [f"n={r[2]}" for r in rows], fontsize=8)
    ax.set_xticks(xs, [f"{lo + 1}-{hi}" for lo, hi, _, _ in rows], rotation=30)
    ax.set(ylim=(0, 1.08), xlabel="review length (tokens, after truncation)", ylabel="accuracy",
           title="Accuracy by review length")
    return fig
