import json
import math

import numpy as np
import pytest
from conftest import edit_config, write_jsonl

from transformer_cli.errors import TfmError, UsageError
from transformer_cli.evaluate import evaluate_checkpoint, metrics_from_confusion, predict_texts


@pytest.mark.parametrize(("tn", "fp", "fn", "tp"), [(50, 10, 5, 35), (3, 0, 0, 7), (1, 2, 3, 4)])
def test_metrics_from_confusion(tn, fp, fn, tp):
    m = metrics_from_confusion(np.array([[tn, fp], [fn, tp]], dtype=float), ["neg", "pos"])
    precision, recall = tp / (tp + fp), tp / (tp + fn)
    pos_f1 = 2 * precision * recall / (precision + recall)
    assert m["accuracy"] == pytest.approx((tp + tn) / (tn + fp + fn + tp))
    assert m["per_class"]["pos"] == pytest.approx({"precision": precision, "recall": recall, "f1": pos_f1,
                                                   "support": fn + tp})
    neg_precision, neg_recall = tn / (tn + fn), tn / (tn + fp)  # neg's figures: the classes swapped
    neg_f1 = 2 * neg_precision * neg_recall / (neg_precision + neg_recall)
    assert m["per_class"]["neg"] == pytest.approx({"precision": neg_precision, "recall": neg_recall, "f1": neg_f1,
                                                   "support": tn + fp})
    assert m["macro_f1"] == pytest.approx((pos_f1 + neg_f1) / 2)
    assert m["confusion_matrix"] == [[tn, fp], [fn, tp]]
    assert m["labels"] == ["neg", "pos"]
    assert m["num_examples"] == tn + fp + fn + tp


def test_metrics_without_positive_predictions_are_zero_not_nan():
    m = metrics_from_confusion(np.array([[10.0, 0.0], [5.0, 0.0]]))
    assert m["labels"] == ["0", "1"]  # without names: the class ids
    assert m["per_class"]["1"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 5}
    assert m["per_class"]["0"]["f1"] == pytest.approx(2 * (10 / 15) / (10 / 15 + 1))
    assert m["macro_f1"] == pytest.approx(m["per_class"]["0"]["f1"] / 2)
    assert m["accuracy"] == pytest.approx(10 / 15)


@pytest.fixture(scope="session")
def row_predictions(trained_dir, test_rows) -> list[dict]:
    return predict_texts(trained_dir, [r["text"] for r in test_rows], device="cpu")


def test_evaluate_checkpoint_agrees_with_predictions(trained_dir, test_rows, row_predictions):
    m = evaluate_checkpoint(trained_dir, device="cpu")
    truth = [r["label"] for r in test_rows]
    predicted = [["neg", "pos"].index(p["label"]) for p in row_predictions]
    assert m["num_examples"] == len(test_rows)
    assert m["accuracy"] == pytest.approx(np.mean([p == t for p, t in zip(predicted, truth)]))
    confusion = np.zeros((2, 2), dtype=int)
    np.add.at(confusion, (truth, predicted), 1)
    assert m["confusion_matrix"] == confusion.tolist()
    nll = [-math.log(p["probabilities"][["neg", "pos"][t]]) for p, t in zip(row_predictions, truth)]
    assert m["loss"] == pytest.approx(np.mean(nll), rel=1e-4)
    assert m["accuracy"] >= 0.85  # the test split is unseen: the model generalises


def test_evaluation_does_not_depend_on_the_batch_size(trained_dir):
    a, b = (evaluate_checkpoint(trained_dir, device="cpu", batch_size=n) for n in (7, 200))
    assert a["confusion_matrix"] == b["confusion_matrix"]
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)


def test_evaluate_other_data_and_subsets(trained_dir, test_rows, tmp_path):
    path = write_jsonl(tmp_path / "few.jsonl", test_rows[:30])
    m = evaluate_checkpoint(trained_dir, data=str(path), split="train", device="cpu")
    assert (m["num_examples"], m["data"], m["split"]) == (30, str(path), "train")
    assert evaluate_checkpoint(trained_dir, device="cpu", max_samples=17)["num_examples"] == 17


def test_evaluate_data_whose_columns_are_named_otherwise(trained_dir, test_rows, tmp_path):
    from test_cli import assert_fails_cleanly, tfm

    same = evaluate_checkpoint(trained_dir, data=str(write_jsonl(tmp_path / "a.jsonl", test_rows[:30])), split="train",
                               device="cpu")
    rows = [{"review": r["text"], "sentiment": r["label"]} for r in test_rows[:30]]
    renamed = write_jsonl(tmp_path / "b.jsonl", rows)
    assert_fails_cleanly(tfm("evaluate", "-c", trained_dir, "--data", renamed, "--split", "train"), 1,
                         "no column 'text' or 'label'", "--text-column / --label-column")
    result = tfm("evaluate", "-c", trained_dir, "--data", renamed, "--split", "train", "--device", "cpu", "--json",
                 "--text-column", "review", "--label-column", "sentiment")
    assert result.exit_code == 0, result.stderr
    m = json.loads(result.stdout)
    assert (m["accuracy"], m["confusion_matrix"], m["num_examples"]) == (
        same["accuracy"], same["confusion_matrix"], 30)


def test_predictions_are_distributions_in_input_order(trained_dir, test_rows, row_predictions):
    for p in row_predictions:
        assert sum(p["probabilities"].values()) == pytest.approx(1.0)
        assert p["score"] == max(p["probabilities"].values())
        assert p["label"] == max(p["probabilities"], key=p["probabilities"].get)
    texts = [r["text"] for r in test_rows[:25]]
    reversed_predictions = predict_texts(trained_dir, texts[::-1], device="cpu", batch_size=4)
    assert len(reversed_predictions) == len(texts)
    for a, b in zip(reversed_predictions[::-1], row_predictions[:25]):
        assert a["label"] == b["label"]
        assert a["score"] == pytest.approx(b["score"], abs=1e-5)


def test_predict_needs_texts(trained_dir):
    with pytest.raises(TfmError, match="no input"):
        predict_texts(trained_dir, [], device="cpu")


@pytest.mark.parametrize("form", ["folder", "named-files"])
def test_a_runs_relative_dataset_path_missing_from_here_asks_for_data(model_dir, synthetic_data_dir, tmp_path,
                                                                      monkeypatch, form):
    import os

    def source(root: str) -> str:
        return root if form == "folder" else f"train={root}/train.jsonl,test={root}/test.jsonl"

    data = json.loads((model_dir / "config.json").read_text())["data"]
    data["source"] = source(os.path.relpath(synthetic_data_dir, tmp_path))  # as trained from tmp_path
    edit_config(model_dir, data=data)
    monkeypatch.chdir(tmp_path)
    assert evaluate_checkpoint(model_dir, device="cpu", max_samples=5)["num_examples"] == 5
    monkeypatch.chdir(model_dir)
    with pytest.raises(UsageError, match=r"is not found from here; pass --data"):
        evaluate_checkpoint(model_dir, device="cpu", max_samples=5)
    edit_config(model_dir, data={**data, "source": source(str(synthetic_data_dir))})  # absolute: found from anywhere
    assert evaluate_checkpoint(model_dir, device="cpu", max_samples=5)["num_examples"] == 5
    given = evaluate_checkpoint(model_dir, data=str(synthetic_data_dir), device="cpu", max_samples=5)
    assert given["num_examples"] == 5


def test_the_validation_split_is_the_one_the_run_chose_its_model_on(trained_run):
    out, metrics = trained_run
    assert json.loads((out / "config.json").read_text())["data"]["val_split"] == ""  # held out of train
    m = evaluate_checkpoint(out, split="validation", device="cpu")
    assert m["split"] == "validation"
    assert m["num_examples"] == metrics["val"]["num_examples"]
    assert m["confusion_matrix"] == metrics["val"]["confusion_matrix"]
    # evaluate divides the logits by the temperature fitted on this very split: the fit's NLL and ECE
    assert m["loss"] == pytest.approx(metrics["calibration"]["nll_after"], rel=1e-5)
    assert m["ece"] == pytest.approx(metrics["calibration"]["ece_after"], abs=1e-6)
