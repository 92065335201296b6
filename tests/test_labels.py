"""Labels of any kind and number: integer or text labels, or a ClassLabel's names, become class ids in
a stable order; every class must be in train and validation; a model reports its classes by name."""

from __future__ import annotations

import csv
import dataclasses
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import CONFIGS, THREE_CLASSES, make_three_class_examples, write_jsonl
from typer.testing import CliRunner

from transformer_cli.cli import app
from transformer_cli.config import DataConfig
from transformer_cli.data import label_ids, load_splits, prepare_train_data, stratified_split, train_val_splits
from transformer_cli.errors import TfmError

runner = CliRunner()


def tfm(*args):
    return runner.invoke(app, [str(a) for a in args])


def write_csv(path: Path, rows: list[dict]) -> Path:
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        w.writerows([[r["text"], r["label"]] for r in rows])
    return path


# --------------------------------------------------------------------------- the id mapping


@pytest.mark.parametrize(("values", "names", "ids"), [
    (["positive", "negative", "neutral", "negative"], ["negative", "neutral", "positive"], [2, 0, 1, 0]),
    ([10, 2, 2, -1, 0], ["-1", "0", "2", "10"], [3, 2, 2, 0, 1]),  # numerically, not as text ("10" < "2")
    ([1, 0, 0, 1], ["neg", "pos"], [1, 0, 0, 1]),  # 0 and 1 alone: IMDB's names
    ([True, False, True], ["neg", "pos"], [1, 0, 1]),
    ([2, 1, 2], ["1", "2"], [1, 0, 1]),
], ids=["names", "integers", "zero-one", "booleans", "other-two-integers"])
def test_classes_are_numbered_in_sorted_order(values, names, ids):
    got_ids, got_names = label_ids(values, None, None, "split 'train'")
    assert got_names == names
    assert got_ids.tolist() == ids and got_ids.dtype == np.int64


def test_a_classlabel_keeps_its_own_order_and_names():
    ids, names = label_ids([0, 2, 2, 1], ["pos", "neg", "meh"], None, "split 'train'")
    assert names == ["pos", "neg", "meh"] and ids.tolist() == [0, 2, 2, 1]
    with pytest.raises(TfmError, match=r"has label 3; its ClassLabel's labels are 0..2 \(pos, neg, meh\)"):
        label_ids([0, 3], ["pos", "neg", "meh"], None, "split 'train'")


def test_given_classes_number_another_splits_labels():
    """A later split (validation, test) or another dataset is numbered by the classes trained on."""
    trained = ["negative", "neutral", "positive"]
    ids, names = label_ids(["positive", "positive", "negative"], None, trained, "split 'test'")  # no neutral: fine
    assert names == trained and ids.tolist() == [2, 2, 0]
    assert label_ids([1, 0], None, ["neg", "pos"], "x")[0].tolist() == [1, 0]
    assert label_ids(["pos", "neg"], None, ["neg", "pos"], "x")[0].tolist() == [1, 0]  # names for IMDB's 0/1
    assert label_ids([1, 0], ["neg", "pos"], ["neg", "pos"], "x")[0].tolist() == [1, 0]  # a ClassLabel's
    with pytest.raises(TfmError, match=r"split 'test' has label 'great', which is not one of the classes trained on "
                                       r"\(negative, neutral, positive\)"):
        label_ids(["positive", "great"], None, trained, "split 'test'")


@pytest.mark.parametrize(("values", "fragment"), [
    ([1, "pos"], "has label 'pos'; labels must be integers or class names (text), one kind throughout"),
    ([1.5, 0.0], "has label 1.5; labels must be integers or class names"),
    (["pos", None], "has an empty label (example 2)"),
    (["pos", " "], "has an empty label (example 2)"),
])
def test_labels_that_name_no_class_are_refused(values, fragment):
    with pytest.raises(TfmError) as e:
        label_ids(values, None, None, "split 'train'")
    assert str(e.value).startswith("split 'train' ") and fragment in str(e.value)


def test_a_classlabel_dataset_folder_keeps_the_classlabel_names(tmp_path):
    """A Hub-layout folder whose card declares a ClassLabel (as IMDB's does): ids and names are its own."""
    (tmp_path / "README.md").write_text(
        "---\ndataset_info:\n  features:\n  - name: text\n    dtype: string\n  - name: label\n    dtype:\n"
        "      class_label:\n        names:\n          '0': pos\n          '1': neg\n          '2': meh\n---\n")
    write_jsonl(tmp_path / "train.jsonl", [{"text": f"review {i}", "label": i % 3} for i in range(9)])
    splits, names = load_splits(DataConfig(source=str(tmp_path)), ("train",))
    assert names == ["pos", "neg", "meh"]
    assert splits["train"].labels.tolist() == [0, 1, 2] * 3


# --------------------------------------------------------------------------- the split


def test_the_stratified_split_keeps_three_classes_proportions():
    labels = np.random.default_rng(0).permutation(np.array([0] * 60 + [1] * 30 + [2] * 10))
    train, val = stratified_split(labels, 0.2, seed=3)
    assert Counter(labels[val].tolist()) == {0: 12, 1: 6, 2: 2}
    assert Counter(labels[train].tolist()) == {0: 48, 1: 24, 2: 8}
    assert sorted([*train, *val]) == list(range(len(labels)))


def test_the_stratified_split_holds_out_one_of_each_small_class_and_keeps_one():
    labels = np.array([0] * 40 + [1] * 2 + [2] * 3)
    train, val = stratified_split(labels, 0.1, seed=0)  # 10% of 2 or 3 rounds to none; 40 gives 4
    assert Counter(labels[val].tolist()) == {0: 4, 1: 1, 2: 1}
    assert Counter(labels[train].tolist()) == {0: 36, 1: 1, 2: 2}
    train, val = stratified_split(labels, 0.9, seed=0)  # ... and 90% of them to all
    assert Counter(labels[train].tolist()) == {0: 4, 1: 1, 2: 1}


@pytest.fixture
def three_class_rows() -> list[dict]:
    return make_three_class_examples(90, seed=4)


def data_cfg(source, **fields) -> DataConfig:
    return DataConfig(source=str(source), vocab_size=200, max_length=32, **fields)


def test_three_classes_of_text_labels_are_split_and_encoded(three_class_rows, tmp_path):
    path = write_csv(tmp_path / "reviews.csv", three_class_rows)
    prepared = prepare_train_data(data_cfg(path), seed=0)
    assert prepared.labels == THREE_CLASSES
    want = Counter(r["label"] for r in three_class_rows)
    got = Counter(THREE_CLASSES[i] for i in [*prepared.train.labels, *prepared.val.labels])
    assert got == want
    assert Counter(prepared.val.labels.tolist()) == {0: 3, 1: 3, 2: 3}  # 10% of each class's 30


def test_a_class_with_one_example_cannot_be_validated_on(three_class_rows, tmp_path):
    rows = [*three_class_rows, {"text": "so so, I guess", "label": "mixed"}]
    with pytest.raises(TfmError, match=r"class 'mixed' has no examples in the validation part of .*; holding some out "
                                       r"of train for validation needs at least 2 examples of each class; add "
                                       r"examples$"):
        train_val_splits(data_cfg(write_csv(tmp_path / "r.csv", rows)), seed=0)


def test_a_validation_split_without_a_class_is_refused(three_class_rows, tmp_path):
    train = write_csv(tmp_path / "train.csv", three_class_rows)
    val = write_csv(tmp_path / "val.csv", [r for r in make_three_class_examples(30, seed=5) if r["label"] != "neutral"])
    cfg = data_cfg(f"train={train},validation={val}")
    with pytest.raises(TfmError, match=r"class 'neutral' has no examples in the validation part of .*; add some to the "
                                       r"'validation' split, or set data.val_split = \"\" to hold out part of train"):
        train_val_splits(cfg, seed=0)
    assert len(train_val_splits(dataclasses.replace(cfg, val_split=""), seed=0)[1]) == 9


def test_a_training_subset_without_a_class_is_refused(tmp_path):
    rows = [{"text": f"good {i}", "label": "pos"} for i in range(200)] + [
        {"text": f"bad {i}", "label": "neg"} for i in range(2)]
    with pytest.raises(TfmError, match=r"class 'neg' has no examples in the training part .*raise "
                                       r"data.max_train_samples"):
        train_val_splits(data_cfg(write_csv(tmp_path / "r.csv", rows), max_train_samples=5), seed=0)


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def three_class_run(tmp_path_factory) -> Path:
    """A model trained by `tfm train` on a 3-class CSV with text labels (and tested on another)."""
    root = tmp_path_factory.mktemp("three-classes")
    rows = make_three_class_examples(600, seed=1)
    train, test = write_csv(root / "train.csv", rows[:480]), write_csv(root / "test.csv", rows[480:])
    out = root / "run"
    r = tfm("train", "--config", CONFIGS / "tiny.toml", "--data", f"train={train},test={test}", "-o", out,
            "--device", "cpu", "--precision", "fp32", "--test", "--no-progress")
    assert r.exit_code == 0, r.stderr
    return out


def test_a_three_class_model_keeps_and_predicts_the_names(three_class_run):
    from transformer_cli.evaluate import load_model_dir

    out = three_class_run
    assert json.loads((out / "config.json").read_text())["labels"] == THREE_CLASSES
    model, _, _, labels, _ = load_model_dir(out)
    assert labels == THREE_CLASSES and model.head.out_features == 3
    texts = ["great wonderful superb film, loved it", "the movie was okay, average and decent",
             "awful boring terrible film, hated it"]
    r = tfm("predict", "-c", out, "--device", "cpu", *texts)
    assert r.exit_code == 0, r.stderr
    assert [line.split("\t")[0] for line in r.stdout.splitlines()] == ["positive", "neutral", "negative"]
    r = tfm("predict", "-c", out, "--device", "cpu", "--json", *texts)
    results = [json.loads(line) for line in r.stdout.splitlines()]
    assert [p["label"] for p in results] == ["positive", "neutral", "negative"]
    assert all(list(p["probabilities"]) == THREE_CLASSES for p in results)


def test_a_three_class_model_is_evaluated_per_class(three_class_run):
    out = three_class_run
    r = tfm("evaluate", "-c", out, "--device", "cpu", "--json")
    assert r.exit_code == 0, r.stderr
    m = json.loads(r.stdout)
    assert m["labels"] == list(m["per_class"]) == THREE_CLASSES
    confusion = np.array(m["confusion_matrix"])
    assert confusion.shape == (3, 3) and confusion.sum() == m["num_examples"] == 120
    for i, name in enumerate(THREE_CLASSES):
        c = m["per_class"][name]
        assert c["support"] == confusion[i].sum() > 0
        assert c["precision"] == pytest.approx(confusion[i, i] / confusion[:, i].sum())
        assert c["recall"] == pytest.approx(confusion[i, i] / c["support"])
        assert c["f1"] == pytest.approx(2 * c["precision"] * c["recall"] / (c["precision"] + c["recall"]))
    assert m["macro_f1"] == pytest.approx(np.mean([c["f1"] for c in m["per_class"].values()]))
    assert m["accuracy"] == pytest.approx(np.trace(confusion) / 120) and m["accuracy"] > 0.6  # it learnt
    assert m["loss"] > 0 and {"examples_per_sec", "data", "split", "num_examples"} <= m.keys()
    at_training_end = json.loads((out / "metrics.json").read_text())["test"]
    assert at_training_end["confusion_matrix"] == m["confusion_matrix"]
    report = tfm("evaluate", "-c", out, "--device", "cpu").stdout
    assert all(any(line.split()[:1] == [name] for line in report.splitlines()) for name in THREE_CLASSES)


def test_a_test_label_the_model_never_saw_is_one_error_line(three_class_run, tmp_path):
    out = three_class_run
    rows = [{"text": "great film", "label": "positive"}, {"text": "a film", "label": "mixed"}]
    r = tfm("evaluate", "-c", out, "--device", "cpu", "--data", write_csv(tmp_path / "t.csv", rows), "--split", "train")
    assert r.exit_code == 1 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [(
        f"tfm: error: split 'train' of '{tmp_path / 't.csv'}' has label 'mixed', which is not one of the classes "
        "trained on (negative, neutral, positive); leave such examples out, or train on examples of every class")]


def test_resuming_on_data_whose_classes_changed_is_refused(tmp_path):
    rows = make_three_class_examples(150, seed=6)
    data = write_csv(tmp_path / "train.csv", rows)
    out = tmp_path / "run"
    args = ["train", "--config", CONFIGS / "tiny.toml", "--data", data, "-o", out, "--device", "cpu",
            "--precision", "fp32", "--no-progress", "--max-steps", "4", "train.checkpoint_every=2"]
    assert tfm(*args).exit_code == 0
    assert tfm(*args, "--resume").exit_code == 0  # the same classes: it resumes
    # The file is relabelled in place: the same number of classes, one renamed, so only the names tell.
    write_csv(data, [{**r, "label": "mixed" if r["label"] == "neutral" else r["label"]} for r in rows])
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    r = tfm(*args, "--resume")
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [(
        "tfm: error: the resumed run was trained on the classes (negative, neutral, positive), but its data now has "
        "(mixed, negative, positive); resume on the data it was trained with, or start a new run in another "
        "--output-dir")]
    assert before == {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
