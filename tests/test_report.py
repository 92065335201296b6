import json
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from test_cli import assert_fails_cleanly, tfm

from transformer_cli import report
from transformer_cli.calibration import expected_calibration_error
from transformer_cli.evaluate import metrics_from_confusion

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class Page(HTMLParser):
    """The images and links of a page, the text of each element with an id, and the rows (each a list of
    its cells' text) of the per-class table."""

    def __init__(self):
        super().__init__()
        self.refs: list[str] = []
        self.by_id: dict[str, str] = {}
        self.per_class: list[list[str]] = []
        self._id = None
        self._in_per_class = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.refs.append(a["src"])
        if tag == "a" and "href" in a:
            self.refs.append(a["href"])
        if tag == "table":
            self._in_per_class = a.get("id") == "per_class"
        if tag == "tr" and self._in_per_class:
            self.per_class.append([])
        if tag in ("th", "td") and self._in_per_class:
            self.per_class[-1].append("")
        self._id = a.get("id")

    def handle_endtag(self, tag):
        if tag == "table":
            self._in_per_class = False

    def handle_data(self, data):
        if self._in_per_class and self.per_class and self.per_class[-1]:
            self.per_class[-1][-1] += data.strip()
        if self._id:
            self.by_id[self._id] = data.strip()
            self._id = None


def read_page(path: Path) -> Page:
    page = Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def assert_complete_report(folder: Path) -> Page:
    """Every picture is a PNG that decodes; report.html shows each of them and nothing else."""
    import matplotlib.image

    page = read_page(folder / report.REPORT_FILE)
    assert sorted(page.refs) == sorted(report.PICTURES)
    for name in report.PICTURES:
        data = (folder / name).read_bytes()
        assert data[:8] == PNG_SIGNATURE
        pixels = matplotlib.image.imread(folder / name)
        assert pixels.ndim == 3 and min(pixels.shape[:2]) > 100 and pixels.std() > 0  # a picture, not a blank
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]  # no temp files left
    return page


def assert_per_class_table(page: Page, metrics: dict) -> None:
    """The page's per-class table: a header, then each class's precision, recall, F1 and support, by name."""
    assert page.per_class[0] == ["class", "precision", "recall", "f1", "support"]
    assert page.per_class[1:] == [[name, f"{c['precision']:.4f}", f"{c['recall']:.4f}", f"{c['f1']:.4f}",
                                   str(c["support"])] for name, c in metrics["per_class"].items()]


def three_class_outputs(n: int = 300, seed: int = 0, names=("neg", "mixed", "pos")):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, n)
    logits = rng.normal(size=(n, 3)) + 2.0 * np.eye(3)[labels]
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    confusion = np.zeros((3, 3), dtype=int)
    np.add.at(confusion, (labels, probs.argmax(1)), 1)
    metrics = {"data": "reviews.jsonl", "split": "test", "loss": 0.5, "ece": expected_calibration_error(probs, labels),
               "temperature": 1.25, **metrics_from_confusion(confusion, list(names))}
    assert metrics["accuracy"] == (probs.argmax(1) == labels).mean()
    return metrics, probs, labels, rng.integers(3, 400, n)


def test_report_of_three_classes(tmp_path):
    metrics, probs, labels, lengths = three_class_outputs(names=("neg", "mixed & <unsure>", "pos"))
    path = report.write_report(tmp_path / "rep", metrics, probs, labels, lengths)
    assert path == tmp_path / "rep" / "report.html"
    page = assert_complete_report(tmp_path / "rep")
    assert page.by_id["ece"] == f"{metrics['ece']:.4f}"
    assert page.by_id["accuracy"] == f"{metrics['accuracy']:.4f}"
    assert page.by_id["macro_f1"] == f"{metrics['macro_f1']:.4f}"
    assert page.by_id["temperature"] == "1.2500"
    assert_per_class_table(page, metrics)  # a class's name as it is, markup characters too


def test_a_report_that_fails_midway_leaves_the_earlier_one_whole(tmp_path, monkeypatch):
    """The pictures and page belong together: a failure while writing them replaces none of the earlier
    report's files (they would describe two evaluations), and leaves no temporary file."""
    from transformer_cli import fileio

    metrics, probs, labels, lengths = three_class_outputs()
    folder = tmp_path / "rep"
    report.write_report(folder, metrics, probs, labels, lengths)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    real, opened = open, []

    def full_disk_at_the_third_file(path, mode="r", *args, **kwargs):
        if "w" in mode and str(path).startswith(str(folder)):
            opened.append(path)
            if len(opened) == 3:
                raise OSError(28, "No space left on device")
        return real(path, mode, *args, **kwargs)

    monkeypatch.setattr(fileio, "open", full_disk_at_the_third_file, raising=False)
    metrics["accuracy"] = 0.123
    with pytest.raises(OSError):
        report.write_report(folder, metrics, probs[::-1].copy(), labels, lengths)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


@pytest.mark.parametrize("names", [["$", "$$", "$$$"], ["$0-$10", "$10-$20", r"$\alpha$"]])
def test_label_names_are_drawn_as_they_are(tmp_path, names):
    """Dollar signs are no math: price levels "$", "$$", "$$$" are labels that matplotlib's mathtext
    cannot parse, and "$0-$10" would lose its dollars."""
    metrics, probs, labels, lengths = three_class_outputs(names=names)
    report.write_report(tmp_path / "rep", metrics, probs, labels, lengths)
    assert_complete_report(tmp_path / "rep")
    fig = report.confusion_figure(np.asarray(metrics["confusion_matrix"]), names)
    report.png_bytes(fig)
    ticks = fig.axes[0].get_xticklabels()
    assert [t._preprocess_math(t.get_text()) for t in ticks] == [(n, False) for n in names]  # what is drawn
    legend = report.pr_figure(probs, labels, names).axes[0].get_legend().get_texts()
    assert [t._preprocess_math(t.get_text())[0].split(" (AP")[0] for t in legend] == names


def test_every_class_is_in_the_legend_and_long_names_are_cut_and_tilted():
    """fastText-style names (`__label__pos`) start with "_", which a legend would leave out; long names
    are cut to LONGEST_NAME characters and tilted, in a figure wide enough to hold them."""
    import warnings

    metrics, probs, labels, _ = three_class_outputs()
    names = ["__label__neg", "__label__pos", "_other"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "No artists with labels found to put in legend"
        legend = report.pr_figure(probs, labels, names).axes[0].get_legend().get_texts()
    assert [t.get_text().split(" (AP")[0] for t in legend] == names
    long = ["a review that is neither here nor there but mixed", "very negative", "very positive"]
    fig = report.confusion_figure(np.asarray(metrics["confusion_matrix"]), long)
    shown = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert shown[0] == long[0][: report.LONGEST_NAME - 1] + "\u2026" and shown[1:] == long[1:]
    assert all(t.get_rotation() == 45 for t in fig.axes[0].get_xticklabels())
    short_fig = report.confusion_figure(np.asarray(metrics["confusion_matrix"]), ["a", "b", "c"])
    assert fig.get_size_inches()[0] > short_fig.get_size_inches()[0]
    assert all(t.get_rotation() == 0 for t in short_fig.axes[0].get_xticklabels())


def test_pr_curve_against_thresholds_one_by_one():
    rng = np.random.default_rng(1)
    scores = rng.choice([0.1, 0.3, 0.5, 0.7, 0.9], 200)  # ties
    positive = rng.random(200) < scores
    precision, recall, ap = report.pr_curve(scores, positive)
    thresholds = np.unique(scores)[::-1]
    for p, r, th in zip(precision, recall, thresholds, strict=True):
        chosen = scores >= th
        assert p == pytest.approx(positive[chosen].mean())
        assert r == pytest.approx(positive[chosen].sum() / positive.sum())
    assert report.pr_curve(np.array([0.9, 0.8, 0.2]), np.array([True, True, False]))[2] == 1.0
    assert 0 < ap < 1


def test_a_class_without_examples_has_no_average_precision(trained_dir, tmp_path):
    """Average precision is undefined for a class that no example of the sample has: the picture says
    so rather than "AP 0.000", and no NaN reaches the evaluation's JSON."""
    probs = np.array([[0.3, 0.6, 0.1], [0.8, 0.1, 0.1]])
    labels = np.array([1, 0])
    assert report.pr_curve(probs[:, 2], labels == 2)[2] is None
    legend = report.pr_figure(probs, labels, ["a", "b", "c"]).axes[0].get_legend().get_texts()
    assert [t.get_text() for t in legend] == ["a (AP 1.000)", "b (AP 1.000)", "c (AP n/a, no examples)"]

    result = tfm("evaluate", "-c", trained_dir, "--device", "cpu", "--json", "--max-samples", "1",
                 "--report", tmp_path / "report")
    assert result.exit_code == 0, result.stderr
    m = json.loads(result.stdout, parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))
    assert sorted(c["support"] for c in m["per_class"].values()) == [0, 1]
    assert_complete_report(tmp_path / "report")


def test_accuracy_by_length_bins():
    probs = np.array([[0.9, 0.1], [0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.3, 0.7]])
    labels = np.array([0, 1, 1, 1, 1])
    lengths = np.array([10, 32, 33, 64, 1000])
    assert report.accuracy_by_length(probs, labels, lengths) == [
        (0, 32, 2, 0.5), (32, 64, 2, 0.5), (512, 1024, 1, 1.0)]


def test_the_report_folder_is_checked_before_the_evaluation(tmp_path):
    (tmp_path / "file").write_text("x")
    assert_fails_cleanly(tfm("evaluate", "-c", str(tmp_path / "nowhere"), "--report", str(tmp_path / "file")), 2,
                         "--report", "is a file")
    (tmp_path / "old" / "pr_curve.png").mkdir(parents=True)  # where a picture goes: found before the evaluation
    assert_fails_cleanly(tfm("evaluate", "-c", str(tmp_path / "nowhere"), "--report", str(tmp_path / "old")), 2,
                         f"--report '{tmp_path / 'old' / 'pr_curve.png'}' is a directory")


def test_evaluate_report_matches_evaluate_json(trained_dir, tmp_path):
    folder = tmp_path / "report"
    result = tfm("evaluate", "-c", trained_dir, "--device", "cpu", "--json", "--report", folder)
    assert result.exit_code == 0, result.stderr
    m = json.loads(result.stdout)
    page = assert_complete_report(folder)
    assert page.by_id["ece"] == f"{m['ece']:.4f}"
    assert page.by_id["accuracy"] == f"{m['accuracy']:.4f}"
    assert page.by_id["examples"] == str(m["num_examples"])
    assert page.by_id["temperature"] == f"{m['temperature']:.4f}"
    assert page.by_id["macro_f1"] == f"{m['macro_f1']:.4f}"
    assert_per_class_table(page, m)
    text = tfm("evaluate", "-c", trained_dir, "--device", "cpu")
    assert f"ece        {m['ece']:.4f}" in text.stdout
