"""train.class_weights: a weighted training loss for imbalanced classes."""

import json
import random

import pytest
import torch
from conftest import CONFIGS, make_review, read_scalars, tiny_config, write_jsonl
from typer.testing import CliRunner

from transformer_cli.cli import app
from transformer_cli.config import ModelConfig
from transformer_cli.model import CTransformer
from transformer_cli.training.classify import train

NUM_TRAIN, MINORITY = 1600, 0.05  # 95/5; at these sizes one epoch leaves the unweighted model predicting the majority


def imbalanced(n: int, seed: int) -> list[dict]:
    """n reviews, 5% of them positive (label 1), in random order."""
    rng = random.Random(seed)
    labels = [1] * round(n * MINORITY) + [0] * (n - round(n * MINORITY))
    rng.shuffle(labels)
    return [{"text": make_review(rng, y), "label": y} for y in labels]


@pytest.fixture(scope="module")
def imbalanced_dir(tmp_path_factory):
    """train.jsonl 95/5, validation.jsonl 95/5 too (the run validates on it), a small test.jsonl."""
    root = tmp_path_factory.mktemp("imbalanced")
    write_jsonl(root / "train.jsonl", imbalanced(NUM_TRAIN, seed=1))
    write_jsonl(root / "validation.jsonl", imbalanced(400, seed=2))
    write_jsonl(root / "test.jsonl", imbalanced(40, seed=3))
    return root


def run(data_dir, out, **overrides) -> dict:
    return train(tiny_config(data_dir, out, train__epochs=1, train__batch_size=64, **overrides), progress=False)


@pytest.fixture(scope="module")
def unweighted(imbalanced_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("unweighted") / "run"
    return out, run(imbalanced_dir, out)


def minority_recall(metrics: dict) -> float:
    return metrics["val"]["per_class"]["pos"]["recall"]


def test_balanced_weights_raise_the_minority_recall(imbalanced_dir, unweighted, tmp_path):
    out = tmp_path / "balanced"
    balanced = run(imbalanced_dir, out, train__class_weights="balanced")
    assert minority_recall(balanced) > minority_recall(unweighted[1])  # same seed, same data
    meta = json.loads((out / "config.json").read_text())
    minority = round(NUM_TRAIN * MINORITY)
    expected = [NUM_TRAIN / (2 * (NUM_TRAIN - minority)), NUM_TRAIN / (2 * minority)]  # neg, pos
    assert meta["labels"] == ["neg", "pos"] and meta["class_weights"] == pytest.approx(expected, rel=1e-12)
    assert meta["train"]["class_weights"] == "balanced"
    assert "class_weights" not in json.loads((unweighted[0] / "config.json").read_text())


def test_weights_of_all_ones_train_exactly_as_none(imbalanced_dir, unweighted, tmp_path):
    out = tmp_path / "ones"
    ones = run(imbalanced_dir, out, train__class_weights=[1, 1])
    assert json.loads((out / "config.json").read_text())["class_weights"] == [1.0, 1.0]
    assert read_scalars(out)["train/loss"] == read_scalars(unweighted[0])["train/loss"]
    assert (out / "model.safetensors").read_bytes() == (unweighted[0] / "model.safetensors").read_bytes()
    assert ones["val"]["loss"] == unweighted[1]["val"]["loss"]


def test_the_weighted_loss_is_cross_entropy_weighted_by_class():
    torch.manual_seed(0)
    model = CTransformer(ModelConfig(d_model=16, n_heads=2, n_layers=1), vocab_size=50, max_length=8, num_labels=3)
    model.eval()
    ids, labels = torch.randint(5, 50, (6, 8)), torch.tensor([0, 1, 2, 2, 1, 0])
    mask = torch.ones_like(ids, dtype=torch.bool)
    logits, plain = model(ids, mask, labels)
    assert torch.equal(model(ids, mask, labels, class_weights=torch.ones(3))[1], plain)
    w = torch.tensor([0.5, 2.0, 1.0])
    per_example = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    weighted = model(ids, mask, labels, class_weights=w)[1]
    assert torch.allclose(weighted, (w[labels] * per_example).sum() / w[labels].sum())


def test_a_resumed_run_keeps_its_weights(imbalanced_dir, tmp_path):
    out = tmp_path / "run"
    run(imbalanced_dir, out, train__class_weights="balanced", train__max_steps=2, train__checkpoint_every=2)
    before = json.loads((out / "config.json").read_text())["class_weights"]
    cfg = tiny_config(imbalanced_dir, out, train__epochs=1, train__batch_size=64, train__class_weights="balanced",
                      train__max_steps=4, train__checkpoint_every=2)
    train(cfg, resume=True, force=True, progress=False)  # --force: max_steps changed
    assert json.loads((out / "config.json").read_text())["class_weights"] == before


def tfm(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.mark.parametrize(("value", "fragment"), [
    ("[1.0, 2.0, 3.0]", "3 weights, but the data has 2 classes (neg, pos)"),
    ("[1.0]", "1 weights, but the data has 2 classes (neg, pos)"),
    ("[-1.0, 1.0]", "each weight must be a finite number, 0 or more"),
    ("[inf, 1.0]", "each weight must be a finite number, 0 or more"),
    ("[nan, 1.0]", "each weight must be a finite number, 0 or more"),
    ("[0, 0.0]", "must give some class a weight above 0"),
    ('"balance"', "expected one of 'balanced' or a list of float"),
])
def test_bad_weights_are_one_line_usage_errors(imbalanced_dir, tmp_path, value, fragment):
    out = tmp_path / "run"
    result = tfm("train", "--config", CONFIGS / "tiny.toml", "--data", imbalanced_dir, "-o", out, "--no-progress",
                 f"train.class_weights={value}")
    assert result.exit_code == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tfm: error: train.class_weights = ") and fragment in lines[0]
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert not out.exists()  # refused before any training


def test_pretraining_refuses_class_weights(imbalanced_dir, tmp_path):
    result = tfm("pretrain", "--config", CONFIGS / "tiny.toml", "--data", imbalanced_dir, "-o", tmp_path / "run",
                 "train.class_weights=balanced")
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("tfm: error: train.class_weights = 'balanced' is for `tfm train`")
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()
