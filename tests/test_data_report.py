import json

import pytest
from conftest import write_jsonl
from typer.testing import CliRunner

from transformer_cli.cli import app

runner = CliRunner()


def tfm_data(*args):
    return runner.invoke(app, ["data", *map(str, args)])


def report_of(*args) -> dict:
    result = tfm_data(*args, "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def rows(texts: list[str], labels: list[int] | None = None) -> list[dict]:
    labels = labels if labels is not None else [i % 2 for i in range(len(texts))]
    return [{"text": t, "label": y} for t, y in zip(texts, labels)]


def named(tmp_path, **splits: list[dict]) -> str:
    """--data SPLIT=FILE,... of one .jsonl file a split."""
    return ",".join(f"{name}={write_jsonl(tmp_path / f'{name}.jsonl', r)}" for name, r in splits.items())


def film(i: int) -> str:
    return f"Film {i} was great"


def test_planted_duplicates_and_conflicting_labels_are_counted_exactly(tmp_path):
    train = rows([film(i) for i in range(20)])
    train += [train[0], {"text": "FILM 1 WAS GREAT", "label": 1},  # exact; case
              {"text": "film 2   was<br />great", "label": 1}]  # spacing and a tag, the other label: a conflict
    val = rows([film(i) for i in range(100, 110)])
    val += [val[0], {"text": "  Film 3 was great ", "label": 1}]
    test = rows([film(i) for i in range(200, 210)])
    test += [train[4], {"text": "Film 5 was<br /><br />great", "label": 0}, val[1],
             {"text": "<br /><br />", "label": 0}]
    unlabelled = rows([film(i) for i in range(300, 305)], [-1] * 5)
    unlabelled += [{**test[0], "label": -1}, {**train[6], "label": -1}, unlabelled[0]]
    r = report_of("--data", named(tmp_path, train=train, validation=val, test=test, unsupervised=unlabelled))

    s = r["splits"]
    assert r["val_split"] == "validation"
    assert {name: s[name]["examples"] for name in s} == {"train": 23, "validation": 12, "test": 14, "unsupervised": 8}
    assert {name: s[name]["duplicates"] for name in s} == {"train": 3, "validation": 1, "test": 0, "unsupervised": 1}
    assert {name: s[name]["empty"] for name in s} == {"train": 0, "validation": 0, "test": 1, "unsupervised": 0}
    assert r["shared"] == {"train": {"validation": 1, "test": 2, "unsupervised": 1},
                           "validation": {"test": 1, "unsupervised": 0}, "test": {"unsupervised": 1}}
    assert [s[name]["conflicting"] for name in ("train", "validation", "test")] == [1, 0, 0]
    assert "conflicting" not in s["unsupervised"] and "labels" not in s["unsupervised"]
    assert r["conflicting"] == 2  # film 2 within train, film 5 across train and test
    assert s["train"]["labels"] == {"neg": {"count": 11, "share": 11 / 23}, "pos": {"count": 12, "share": 12 / 23}}
    warnings = " ".join(r["warnings"])
    assert "texts of test also in train: 2 " in warnings
    assert "texts of the validation part (split 'validation') also in test: 1;" in warnings


def test_a_validation_part_held_out_of_train_that_shares_texts_with_test_is_warned_of(tmp_path):
    texts = [film(i) for i in range(40)]
    data = named(tmp_path, train=rows(texts), test=rows(texts[:20]))  # every held-out text is in test or not
    r = report_of("--data", data, "data.val_size=0.5")
    assert r["val_split"] == ""
    assert r["splits"]["train"]["examples"] == r["splits"]["validation"]["examples"] == 20
    assert r["shared"]["train"]["validation"] == 0
    assert r["shared"]["train"]["test"] + r["shared"]["validation"]["test"] == 20
    assert any("(held out of train) also in test" in w for w in r["warnings"])


@pytest.mark.parametrize(("positives", "warned"), [(95, True), (50, False)], ids=["95-5", "50-50"])
def test_imbalance_above_4_to_1_is_warned_of(tmp_path, positives, warned):
    labels = [1] * positives + [0] * (100 - positives)
    data = write_jsonl(tmp_path / "d.jsonl", rows([film(i) for i in range(100)], labels))
    result = tfm_data("--data", data)
    assert result.exit_code == 0, result.stderr
    imbalance = [line for line in result.stderr.splitlines() if "imbalanced" in line]
    if warned:
        assert len(imbalance) == 1 and imbalance[0].startswith("tfm: warning: ")
        assert 'train.class_weights="balanced"' in imbalance[0]
    else:
        assert imbalance == []


def test_length_percentiles_in_words_and_tokens(tmp_path):
    train = rows([" ".join(["great"] * k) for k in range(1, 101)])  # k words, k tokens and [CLS]
    val = rows(["great<br />great", "great great great"])
    r = report_of("--data", named(tmp_path, train=train, validation=val), "data.max_length=51")
    t = r["splits"]["train"]
    assert t["words"] == {"p50": 50, "p90": 90, "p99": 99, "max": 100}
    assert t["tokens"] == {"p50": 51, "p90": 91, "p99": 100, "max": 101, "limit": 51, "over_limit": 0.5}
    assert r["splits"]["validation"]["words"]["max"] == 3 and r["splits"]["validation"]["words"]["p50"] == 2
    trained_shorter = report_of("--data", named(tmp_path, train=train, validation=val), "data.max_length=51",
                                "data.train_max_length=11", "model.pos_emb=rope")["splits"]
    assert trained_shorter["train"]["tokens"]["over_limit"] == 0.9  # train is cut to data.train_max_length
    assert trained_shorter["validation"]["tokens"]["limit"] == 51


def test_text_report_and_pictures(tmp_path):
    data = named(tmp_path, train=rows([film(i) for i in range(30)]), test=rows([film(0), film(99)]))
    result = tfm_data("--data", data, "--report", tmp_path / "pictures")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"{data}: classes neg, pos; validation held out of train")
    assert any(line.split()[:2] == ["train", "26"] for line in lines)
    assert "tfm: warning: texts of test also in train: 1 " in result.stderr
    pictures = sorted(p.name for p in (tmp_path / "pictures").iterdir())
    assert pictures == ["lengths_test.png", "lengths_train.png", "lengths_validation.png"]
    for name in pictures:
        assert (tmp_path / "pictures" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def assert_fails_cleanly(result, code: int, fragment: str) -> None:
    assert result.exit_code == code, (result.stdout, result.stderr)
    assert result.stdout == "" and result.stderr.count("\n") == 1 and result.stderr.startswith("tfm: error: ")
    assert fragment in result.stderr


def test_bad_input_fails_as_tfm_train_does(tmp_path):
    assert_fails_cleanly(tfm_data("--data", tmp_path / "nowhere.jsonl"), 2, "does not exist")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"review": "good", "label": 1}] * 4)
    assert_fails_cleanly(tfm_data("--data", bad), 1, "no column 'text'")
    (tmp_path / "afile").write_text("keep me")  # an unusable --report is refused before the data is read
    assert_fails_cleanly(tfm_data("--data", bad, "--report", tmp_path / "afile"), 2, "--report")
    assert_fails_cleanly(tfm_data("--data", bad, "model.nope=1"), 2, "model.nope")
