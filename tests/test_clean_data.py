"""No test text is trained on: pretraining and self-training leave out every text that is also in the source's test
split, as the tokenizer sees it (case, <br /> tags and spacing aside)."""

from __future__ import annotations

import json
import shutil

import numpy as np
from conftest import UNLABELLED_README, make_examples, read_jsonl, tiny_config, write_jsonl

from transformer_cli.data import keys_of_test_texts, prepare_train_data, text_keys
from transformer_cli.training.pretrain import pretrain


def disguised(text: str) -> str:
    """The same review as the tokenizer sees it: other case, other spacing, a <br /> for a space."""
    return "  " + text.lower().replace(" ", "<br />", 1).replace(" ", "   ") + "\n"


def test_text_keys_ignore_what_the_tokenizer_ignores():
    a, b, c = text_keys(["A good film.", "  a GOOD<br />film. ", "A bad film."])
    assert a == b != c


def test_pretraining_leaves_out_the_test_texts(synthetic_data_dir, tmp_path, capsys):
    test = read_jsonl(synthetic_data_dir / "test.jsonl")
    root = tmp_path / "data"
    root.mkdir()
    for name in ("train.jsonl", "test.jsonl"):
        shutil.copyfile(synthetic_data_dir / name, root / name)
    unlabelled = [{"text": r["text"]} for r in make_examples(60, seed=3)] + [{"text": disguised(r["text"])}
                                                                             for r in test[:7]]
    write_jsonl(root / "unsupervised.jsonl", unlabelled)
    (root / "README.md").write_text(UNLABELLED_README, encoding="utf-8")
    cfg = tiny_config(root, tmp_path / "pre", train__max_steps=2, pretrain__val_texts=20)
    pretrain(cfg, progress=False)
    assert "pretraining leaves out 7 texts that are also in the test split" in capsys.readouterr().err
    meta = json.loads((tmp_path / "pre" / "config.json").read_text())
    assert meta["test_texts_left_out"] == 7 and meta["num_texts"] == 60 + 400


def test_self_training_leaves_out_pseudo_labelled_test_texts(synthetic_data_dir, tmp_path):
    test = read_jsonl(synthetic_data_dir / "test.jsonl")
    fresh = make_examples(30, seed=9)
    rows = [{"text": disguised(r["text"]), "label": r["label"], "score": 0.99} for r in test[:5]]
    rows += [{"text": r["text"], "label": r["label"], "score": 0.99} for r in fresh]
    write_jsonl(tmp_path / "pseudo.jsonl", rows)
    cfg = tiny_config(synthetic_data_dir, tmp_path / "run", data__pseudo_labels=str(tmp_path / "pseudo.jsonl"))
    data = prepare_train_data(cfg.data, cfg.train.seed)
    plain = prepare_train_data(tiny_config(synthetic_data_dir, tmp_path / "run2").data, cfg.train.seed)
    assert len(data.train) == len(plain.train) + len(fresh)
    assert not set(text_keys([r["text"] for r in rows[:5]])) - keys_of_test_texts(cfg.data)  # the five were test texts
    assert np.isin(data.train.labels[len(plain.train):], [0, 1]).all()
