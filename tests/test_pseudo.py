"""Self-training: `tfm pseudo-label` and `tfm train data.pseudo_labels=FILE`."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import CONFIGS, edit_config, make_examples, read_jsonl, write_jsonl
from test_cli import assert_fails_cleanly, json_lines, tfm

from transformer_cli.config import DataConfig
from transformer_cli.data import prepare_train_data, train_val_splits
from transformer_cli.errors import TfmError, UsageError
from transformer_cli.evaluate import predict_texts
from transformer_cli.pseudo import UNLABELLED_SPLIT, split_table


@pytest.fixture(scope="module")
def unlabelled(unlabelled_data_dir) -> tuple[str, list[str]]:
    """(a dataset with an `unsupervised` split, as IMDB's; that split's reviews)."""
    return str(unlabelled_data_dir), [row["text"] for row in read_jsonl(unlabelled_data_dir / "unsupervised.jsonl")]


def test_pseudo_label_writes_what_predict_says_of_each_review(trained_dir, unlabelled, tmp_path):
    """One teacher: each review of the split, in order, with the label and score `tfm predict` gives it
    (calibrated)."""
    source, texts = unlabelled
    out = tmp_path / "pseudo.jsonl"
    r = tfm("pseudo-label", "-c", trained_dir, "--data", source, "-o", out)
    assert r.exit_code == 0, r.stderr
    rows = read_jsonl(out)
    assert [row["text"] for row in rows] == texts
    inputs = tmp_path / "texts.txt"
    inputs.write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    predicted = json_lines(tfm("predict", "-c", trained_dir, "--json", "--file", inputs).stdout)
    assert [row["label"] for row in rows] == [p["label"] for p in predicted]
    assert [row["score"] for row in rows] == pytest.approx([p["score"] for p in predicted], abs=1e-6)
    counts = {name: sum(row["label"] == name for row in rows) for name in ("neg", "pos")}
    assert f"{len(rows)} reviews ({counts['neg']} neg, {counts['pos']} pos)" in r.stdout


def test_teachers_average_their_probabilities_class_by_class_by_name(trained_dir, model_dir, unlabelled, tmp_path):
    """Two teachers: the mean of the probabilities `tfm predict` gives each class, by name. The second lists
    its classes as pos, neg (a ClassLabel's order, say) and is sharper (a lower temperature)."""
    source, texts = unlabelled
    edit_config(model_dir, labels=["pos", "neg"], calibration={"temperature": 0.3})
    out = tmp_path / "p.jsonl"
    r = tfm("pseudo-label", "-c", trained_dir, "-c", model_dir, "--data", source, "-o", out)
    assert r.exit_code == 0, r.stderr
    first, second = (predict_texts(d, texts, device="cpu") for d in (trained_dir, model_dir))
    mean = [{name: (a["probabilities"][name] + b["probabilities"][name]) / 2 for name in ("neg", "pos")}
            for a, b in zip(first, second)]
    rows = read_jsonl(out)
    assert [row["text"] for row in rows] == texts
    assert [row["label"] for row in rows] == [max(m, key=m.get) for m in mean]
    assert [row["score"] for row in rows] == pytest.approx([max(m.values()) for m in mean], abs=2e-6)
    assert any(row["label"] != a["label"] for row, a in zip(rows, first))  # not the first teacher's alone
    by_column = [(a["probabilities"]["neg"] + b["probabilities"]["pos"]) / 2 for a, b in zip(first, second)]
    assert by_column != pytest.approx([m["neg"] for m in mean], abs=1e-3)  # the second's first column is pos


def test_a_split_is_read_labelled_and_written_a_chunk_at_a_time(trained_dir, unlabelled, tmp_path, monkeypatch):
    """With chunks of 7 reviews the model never sees more than 7 at once, and the file says what it says
    when the whole split is one chunk. A failure midway leaves the earlier file as it was."""
    from transformer_cli import pseudo

    source, texts = unlabelled
    whole, chunked = tmp_path / "whole.jsonl", tmp_path / "chunked.jsonl"
    assert len(texts) <= pseudo.CHUNK_TEXTS  # one chunk by default
    pseudo.pseudo_label([trained_dir], whole, source)
    seen = []
    real = pseudo.predict_proba

    def spy(model, enc, *args):
        seen.append(len(enc))
        return real(model, enc, *args)

    monkeypatch.setattr(pseudo, "predict_proba", spy)
    monkeypatch.setattr(pseudo, "CHUNK_TEXTS", 7)
    summary = pseudo.pseudo_label([trained_dir, trained_dir], chunked, source)
    assert max(seen) == 7 and sum(seen) == 2 * len(texts)  # each chunk through each teacher
    rows, expected = read_jsonl(chunked), read_jsonl(whole)  # two equal teachers average to one
    assert [(r["text"], r["label"]) for r in rows] == [(r["text"], r["label"]) for r in expected]
    assert [r["score"] for r in rows] == pytest.approx([r["score"] for r in expected], abs=2e-6)
    assert summary["reviews"] == len(texts)

    def fail(*_):
        if len(seen) > 4:
            raise TfmError("stopped midway")
        seen.append(0)
        return np.full((7, 2), 0.5)

    seen.clear()
    before = chunked.read_bytes()
    monkeypatch.setattr(pseudo, "predict_proba", fail)
    with pytest.raises(TfmError, match="stopped midway"):
        pseudo.pseudo_label([trained_dir], chunked, source, force=True)
    assert chunked.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chunked.jsonl", "whole.jsonl"]  # no temporary file left


def test_sigterm_while_labelling_exits_143_and_leaves_no_partial_file(trained_dir, unlabelled, tmp_path, monkeypatch):
    """SIGTERM (a scheduler's, `timeout`'s) midway: the temporary file goes, the earlier output stays."""
    import os
    import signal

    from transformer_cli import pseudo

    source, _ = unlabelled
    out = tmp_path / "labels.jsonl"
    out.write_text("earlier\n")
    real, calls = pseudo.predict_proba, []

    def terminated_at_the_second_chunk(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(pseudo, "CHUNK_TEXTS", 7)
    monkeypatch.setattr(pseudo, "predict_proba", terminated_at_the_second_chunk)
    before = signal.getsignal(signal.SIGTERM)
    result = tfm("pseudo-label", "-c", trained_dir, "--data", source, "-o", out, "--force")
    assert_fails_cleanly(result, 143, "terminated")
    assert len(calls) == 2 and out.read_text() == "earlier\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["labels.jsonl"]  # no temporary file left
    assert signal.getsignal(signal.SIGTERM) is before  # the CLI's handler is gone with the command


def test_an_existing_output_is_replaced_only_with_force(trained_dir, unlabelled, tmp_path):
    source, texts = unlabelled
    out = tmp_path / "pseudo.jsonl"
    out.write_text("earlier pseudo-labels\n")
    assert_fails_cleanly(tfm("pseudo-label", "-c", trained_dir, "--data", source, "-o", out), 2,
                         f"--output '{out}' already exists", "--force")
    assert out.read_text() == "earlier pseudo-labels\n"
    r = tfm("pseudo-label", "-c", trained_dir, "--data", source, "-o", out, "--force")
    assert r.exit_code == 0, r.stderr
    assert [row["text"] for row in read_jsonl(out)] == texts
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pseudo.jsonl"]  # written in place, no temporary file


@pytest.mark.parametrize("layout", ["file", "named", "folder", "link"])
def test_the_data_being_labelled_is_never_overwritten(trained_dir, tmp_path, monkeypatch, layout):
    """Not even with --force, whatever the output's spelling, and before the split is read (its blank review
    would be refused, exit 1): the file holds gold labels (`--data unl.jsonl --split train -o unl.jsonl`
    replaced them with pseudo-labels)."""
    rows = [{"text": "a good film", "label": 1}, {"text": "a dull film", "label": 0}, {"text": " ", "label": 0}]
    monkeypatch.chdir(tmp_path)
    Path("data").mkdir()
    data = write_jsonl(Path("data/train.jsonl"), rows)
    before = data.read_bytes()
    source, output = {
        "file": (str(data), "data/../data/train.jsonl"),
        "named": (f"train={data}", str(data.absolute())),
        "folder": ("data", str(data)),
        "link": (str(data), "link.jsonl"),
    }[layout]
    if layout == "link":
        Path("link.jsonl").symlink_to(data.absolute())
    for force in ([], ["--force"]):
        assert_fails_cleanly(tfm("pseudo-label", "-c", trained_dir, "--data", source, "--split", "train", "-o", output,
                                 *force), 2, f"--output '{output}' is the command's input")
    assert data.read_bytes() == before


def pseudo_cfg(data_dir, path, **kw) -> DataConfig:
    return DataConfig(source=str(data_dir), vocab_size=200, max_length=64, pseudo_labels=str(path), **kw)


def test_pseudo_labelled_reviews_join_the_training_part_only(synthetic_data_dir, tmp_path):
    """The kept rows (score >= pseudo_min_score) follow the labelled train part with their labels as ids;
    one that repeats a validation, test or training review is dropped, as is a second copy, and
    validation is unchanged."""
    base = DataConfig(source=str(synthetic_data_dir), vocab_size=200, max_length=64)
    train_raw, val_raw, _, _ = train_val_splits(base, seed=0)
    test_text = json.loads((synthetic_data_dir / "test.jsonl").read_text().splitlines()[0])["text"]
    rows = [{"text": "a fresh unlabelled review, loved it", "label": "pos", "score": 0.97},
            {"text": "another one, boring and awful", "label": "neg", "score": 0.91},
            {"text": "an unsure one", "label": "pos", "score": 0.55},
            {"text": val_raw.texts[0], "label": "pos", "score": 0.99},
            {"text": test_text, "label": "pos", "score": 0.99},
            {"text": train_raw.texts[0], "label": "pos", "score": 0.99},
            {"text": "a fresh unlabelled review, loved it", "label": "pos", "score": 0.97}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    plain = prepare_train_data(base, seed=0)
    mixed = prepare_train_data(pseudo_cfg(synthetic_data_dir, path, pseudo_min_score=0.9), seed=0,
                               tokenizer=plain.tokenizer)
    assert len(mixed.train) == len(plain.train) + 2
    assert mixed.train.labels[-2:].tolist() == [1, 0]  # pos, neg
    np.testing.assert_array_equal(mixed.train.ids[: len(plain.train.ids)], plain.train.ids)
    np.testing.assert_array_equal(mixed.train.labels[: len(plain.train)], plain.train.labels)
    np.testing.assert_array_equal(mixed.val.ids, plain.val.ids)
    everything = prepare_train_data(pseudo_cfg(synthetic_data_dir, path), seed=0)
    assert len(everything.train) == len(plain.train) + 3  # every score, less the known reviews and the copy


def test_a_test_split_without_labels_does_not_stop_self_training(tmp_path):
    """Its reviews cannot be scored, so there is nothing to keep them out of (GLUE-style -1 labels)."""
    write_jsonl(tmp_path / "train.jsonl", make_examples(60, seed=1))
    write_jsonl(tmp_path / "test.jsonl", [{"text": "a hidden test review", "label": -1}])
    path = write_jsonl(tmp_path / "p.jsonl", [{"text": "an unlabelled review, loved it", "label": "pos",
                                               "score": 0.97}])
    plain = prepare_train_data(DataConfig(source=str(tmp_path), vocab_size=200, max_length=64), seed=0)
    mixed = prepare_train_data(pseudo_cfg(tmp_path, path), seed=0)
    assert len(mixed.train) == len(plain.train) + 1


@pytest.mark.parametrize(("rows", "message"), [
    ([{"text": "a review", "label": "maybe", "score": 0.9}], "label 'maybe'"),
    ([{"text": "a review", "label": "pos", "score": 1.5}], "scores that are not numbers in [0, 1]"),
    ([{"text": "a review", "label": "pos", "score": "high"}], "scores that are not numbers in [0, 1]"),
    ([{"text": "a review", "label": "pos", "score": 0.95}, {"text": "b", "label": "neg", "score": True}],
     "scores that are not numbers in [0, 1]"),
    ([{"text": "a review", "label": "pos"}], "no column 'score'"),
    ([{"review": "a review", "label": "pos", "score": 0.95}],
     "no column 'text' (columns: review, label, score); a pseudo-label file holds text, label and score"),
    ([{"text": "a review", "label": "pos", "score": 0.8}], "keeps none of the reviews"),
])
def test_a_bad_pseudo_label_file_is_refused(synthetic_data_dir, tmp_path, rows, message):
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(TfmError, match=re.escape(message)):
        prepare_train_data(pseudo_cfg(synthetic_data_dir, path, pseudo_min_score=0.9), seed=0)


def test_pseudo_labels_that_are_all_training_reviews_are_named_as_such(synthetic_data_dir, tmp_path):
    """Not blamed on the threshold, which kept them: the labelled split was train's own."""
    train = read_jsonl(synthetic_data_dir / "train.jsonl")[:5]
    path = write_jsonl(tmp_path / "p.jsonl", [{"text": r["text"], "label": "pos", "score": 0.99} for r in train])
    with pytest.raises(TfmError, match=r"every review of .* scored at least data.pseudo_min_score = 0.0 \(5\) is also "
                                       r"in train, validation or test; label other reviews"):
        prepare_train_data(pseudo_cfg(synthetic_data_dir, path), seed=0)


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_json_file_that_is_not_utf8_is_named_with_its_first_bad_byte(tmp_path, suffix):
    from transformer_cli.data import open_dataset_files

    path = tmp_path / f"reviews{suffix}"
    path.write_bytes(b'{"text": "great", "label": 1}\n{"text": "caf\xe9 awful", "label": 0}\n')
    with pytest.raises(TfmError, match=rf"^could not read {re.escape(str(path))}: byte 0xe9 at offset 43 is not "
                                       "UTF-8; save the file as UTF-8$"):
        open_dataset_files({"train": str(path)})


def test_train_on_pseudo_labels_through_the_cli(trained_dir, synthetic_data_dir, unlabelled, tmp_path):
    """The whole loop at the tiny sizes: the teacher labels a sample of the reviews, a student trains on them."""
    source, texts = unlabelled
    labels = tmp_path / "pseudo.jsonl"
    assert tfm("pseudo-label", "-c", trained_dir, "--data", source, "-o", labels, "--max-samples", "50").exit_code == 0
    rows = read_jsonl(labels)
    assert len(rows) == 50 and len({row["text"] for row in rows}) == 50 and {row["text"] for row in rows} < set(texts)
    out = tmp_path / "student"
    r = tfm("train", "--config", CONFIGS / "tiny.toml", "--data", synthetic_data_dir, "-o", out, "--max-steps", "3",
            "--no-progress", f"data.pseudo_labels={json.dumps(str(labels))}", "data.pseudo_min_score=0.8")
    assert r.exit_code == 0, r.stderr
    assert json.loads((out / "config.json").read_text())["data"]["pseudo_labels"] == str(labels)


def test_an_unsupervised_file_the_folder_does_not_read_as_a_split_is_named(tmp_path):
    """unsupervised.jsonl beside train.jsonl and test.jsonl: `datasets` takes only train/test/validation by
    their file names; the error says so and how to name the file, not just "pass --split"."""
    for name in ("train", "test", "unsupervised"):
        write_jsonl(tmp_path / f"{name}.jsonl", make_examples(10, seed=1))
    message = (f"'{tmp_path}' has no split 'unsupervised' (it has: train, test); `datasets` reads a folder's files "
               f"as splits only by the names train, test and validation (or variants such as dev), so it did not read "
               f"{tmp_path / 'unsupervised.jsonl'} as split 'unsupervised': name the files instead "
               f"(--data unsupervised={tmp_path / 'unsupervised.jsonl'})")
    with pytest.raises(UsageError, match=re.escape(message)):
        split_table(str(tmp_path), UNLABELLED_SPLIT, "text")
    assert len(split_table(f"unsupervised={tmp_path / 'unsupervised.jsonl'}", UNLABELLED_SPLIT, "text")) == 10


def test_pseudo_label_usage_errors(trained_dir, synthetic_data_dir, tmp_path):
    assert_fails_cleanly(tfm("pseudo-label", "-c", trained_dir, "-o", tmp_path / "p.txt"), 2, ".jsonl")
    assert_fails_cleanly(tfm("pseudo-label", "-c", trained_dir, "--data", synthetic_data_dir, "-o",
                             tmp_path / "p.jsonl"), 2, "no split 'unsupervised'", "--split")
    assert_fails_cleanly(tfm("pseudo-label", "-c", trained_dir, "--split", "test", "-o", tmp_path / "p.jsonl"), 2,
                         "final report")
    assert not (tmp_path / "p.jsonl").exists()
    assert_fails_cleanly(tfm("pseudo-label", "-c", tmp_path / "nothing", "-o", tmp_path / "p.jsonl"), 1,
                         "does not exist")
    r = tfm("train", "--config", CONFIGS / "tiny.toml", "--data", synthetic_data_dir, "-o", tmp_path / "run",
            "data.pseudo_labels='missing.jsonl'")
    assert_fails_cleanly(r, 2, "data.pseudo_labels", "tfm pseudo-label")
    assert not (tmp_path / "run").exists()
    r = tfm("train", "--config", CONFIGS / "tiny.toml", "--data", synthetic_data_dir, "-o", tmp_path / "run",
            "data.pseudo_min_score=0.9")  # a threshold with no file would train on the labelled reviews alone
    assert_fails_cleanly(r, 2, "data.pseudo_min_score is set but data.pseudo_labels is not", "tfm pseudo-label")
    assert not (tmp_path / "run").exists()
    assert_fails_cleanly(tfm("train", "--config", CONFIGS / "tiny.toml", "data.pseudo_min_score=1.0"), 2,
                         "pseudo_min_score")


def test_an_empty_review_is_named_before_any_is_labelled(trained_dir, tmp_path, monkeypatch):
    from transformer_cli import pseudo

    # the bad row in the second chunk: its row counts from the split's start
    monkeypatch.setattr(pseudo, "CHUNK_TEXTS", 2)
    path = write_jsonl(tmp_path / "u.jsonl", [{"text": "a good film"}, {"text": "dull"}, {"text": "  "}])
    out = tmp_path / "p.jsonl"
    with pytest.raises(TfmError, match=r"empty or non-text value in column 'text' \(row 3\)"):
        pseudo.pseudo_label([trained_dir], out, f"unsupervised={path}")
    assert not out.exists()


def test_teachers_must_share_their_classes(trained_dir, model_dir, tmp_path):
    edit_config(model_dir, labels=["bad", "good"])
    out = tmp_path / "p.jsonl"
    assert_fails_cleanly(tfm("pseudo-label", "-c", trained_dir, "-c", model_dir, "-o", out), 1,
                         "has classes bad, good", "teachers must share their classes")
    assert not out.exists()
