"""The model card every run directory gets: README.md in the Hugging Face format, with what a reader needs."""

from __future__ import annotations

import shlex

from conftest import tiny_config
from huggingface_hub import ModelCard

from transformer_cli.card import reproducing_command, write_card
from transformer_cli.config import load_config
from transformer_cli.evaluate import evaluate_checkpoint
from transformer_cli.training.pretrain import pretrain


def test_a_trained_model_has_a_card_that_parses_as_a_hugging_face_model_card(model_dir):
    card = ModelCard.load(model_dir / "README.md")
    assert card.data.library_name == "transformer-cli" and "text-classification" in card.data.tags
    results = {(r.dataset_split, r.metric_type): r.metric_value for r in card.data.eval_results}
    assert {("validation", "accuracy"), ("validation", "f1")} <= set(results)  # and test's, once evaluated
    assert 0.5 < results["validation", "accuracy"] <= 1
    text = card.text
    for heading in ("## Training", "## Results", "## Use", "## Limitations"):
        assert heading in text
    assert "tfm train --data " in text and "tfm predict -c " in text and "| neg |" in text


def test_evaluating_the_test_split_adds_its_results(model_dir):
    m = evaluate_checkpoint(model_dir, split="test", device="cpu")
    card = ModelCard.load(model_dir / "README.md")
    splits = {r.dataset_split: r for r in card.data.eval_results if r.metric_type == "accuracy"}
    assert set(splits) == {"validation", "test"} and splits["test"].metric_value == round(m["accuracy"], 4)
    assert f"| test | {m['accuracy']:.4f} |" in card.text


def test_the_card_command_trains_the_same_settings(model_dir):
    from transformer_cli.cli import _training_config

    meta_cfg = load_config(None, {"model.d_model": 32, "train.lr": 3e-3, "data.source": "stanfordnlp/imdb"})
    args = shlex.split(reproducing_command(meta_cfg, pretrained=False))
    assert args[:2] == ["tfm", "train"]
    assert args[2:6] == ["--data", "stanfordnlp/imdb", "-o", "runs/tfm"]
    again = _training_config("train", None, args[6:], {"data.source": args[3], "train.output_dir": args[5]}, False,
                             None)
    assert again == meta_cfg


def test_a_pretrained_encoder_has_a_card_too(unlabelled_data_dir, tmp_path):
    pretrain(tiny_config(unlabelled_data_dir, tmp_path / "pre", train__max_steps=2, pretrain__val_texts=20),
             progress=False)
    card = ModelCard.load(tmp_path / "pre" / "README.md")
    assert "fill-mask" in card.data.tags and "tfm train --init-from pre" in card.text
    write_card(tmp_path / "pre")  # again, from the files alone
