"""`tfm export`: the ONNX file, run in onnxruntime, gives `tfm predict`'s probabilities (fp32, 1e-4) on
batches of mixed lengths, for the tiny trained model and for a model at configs/seed.toml's sizes."""

import json
import random

import numpy as np
import pytest
import torch
from conftest import CONFIGS, NEUTRAL, POSITIVE, make_review
from test_cli import assert_fails_cleanly, tfm

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from transformer_cli import checkpoint as ckpt
from transformer_cli.config import load_config
from transformer_cli.data import collate
from transformer_cli.evaluate import load_model_dir, predict_texts
from transformer_cli.export import OnnxClassifier
from transformer_cli.fileio import atomic_write_bytes
from transformer_cli.model import CTransformer

TOL = 1e-4


def mixed_texts(n: int, seed: int, long_words: int) -> list[str]:
    """Reviews of 1 word to `long_words` words (past max_length after tokenizing), in random order."""
    rng = random.Random(seed)
    texts = [make_review(rng, i % 2, rng.choice([0, 3, 20, 60, long_words])) for i in range(n)]
    return ["superb", "A", *texts, " ".join(rng.choice(NEUTRAL + POSITIVE) for _ in range(long_words))]


def predicted(model_dir, texts) -> np.ndarray:
    """predict_texts' probabilities in fp32, as an (N, num_labels) array in label order."""
    results = predict_texts(model_dir, texts, "cpu", batch_size=16, precision="fp32")
    labels = list(results[0]["probabilities"])
    return np.array([[r["probabilities"][k] for k in labels] for r in results])


def onnx_in_input_order(clf: OnnxClassifier, texts: list[str], batch: int) -> np.ndarray:
    """Batches of consecutive texts (not sorted by length: each holds short and long rows and padding)."""
    enc = clf.encode(texts)
    rows = []
    for start in range(0, len(texts), batch):
        ids, mask, _ = collate(enc, np.arange(start, min(start + batch, len(texts))))
        rows.append(torch.from_numpy(clf.logits(ids, mask)).softmax(-1).numpy())
    return np.concatenate(rows)


def export(model_dir, out) -> OnnxClassifier:
    result = tfm("export", "-c", model_dir, "-o", out)
    assert result.exit_code == 0, result.stderr
    assert "wrote" in result.stdout and out.is_file()
    return OnnxClassifier(out)


def assert_matches_predict(model_dir, onnx_path, texts) -> None:
    clf = export(model_dir, onnx_path)
    _, cfg, tokenizer, labels, _ = load_model_dir(model_dir)
    assert clf.labels == labels and clf.max_length == cfg.data.max_length
    assert clf.tokenizer.to_str() == tokenizer.to_str()
    expected = predicted(model_dir, texts)
    enc = clf.encode(texts)
    assert enc.lengths.min() < 5 and enc.lengths.max() == cfg.data.max_length  # mixed, up to truncation
    for batch in (1, 7, len(texts)):
        np.testing.assert_allclose(onnx_in_input_order(clf, texts, batch), expected, rtol=0, atol=TOL)
    np.testing.assert_allclose(clf.proba(texts, batch_size=5), expected, rtol=0, atol=TOL)


def test_export_of_the_trained_model_gives_predicts_probabilities(trained_dir, tmp_path):
    out = tmp_path / "deploy" / "tiny.ONNX"  # the suffix in any case
    assert_matches_predict(trained_dir, out, mixed_texts(30, seed=3, long_words=120))
    meta = OnnxClassifier(out).runner.get_modelmeta().custom_metadata_map
    assert meta["tfm.tokenizer"] == "tiny.tokenizer.json" and (tmp_path / "deploy" / "tiny.tokenizer.json").is_file()
    assert json.loads(meta["tfm.labels"]) == ["neg", "pos"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny.ONNX", "tiny.tokenizer.json"]  # no temp files


def random_model_dir(trained_dir, where, recipe: str | None, **model) -> object:
    """A randomly initialised model of a recipe's sizes (and `model` overrides) with the trained model's
    tokenizer (so its vocabulary, not the recipe's), saved as `tfm train` saves one."""
    _, _, tokenizer, labels, _ = load_model_dir(trained_dir)
    values = {f"model.{k}": v for k, v in model.items()}
    cfg = load_config(CONFIGS / recipe if recipe else None, values)
    torch.manual_seed(0)
    vocab = tokenizer.get_vocab_size()
    net = CTransformer(cfg.model, vocab, cfg.data.max_length, len(labels))
    for p in net.parameters():  # larger than init's 0.02, so that the probabilities are far from 0.5
        p.data.normal_(0, 0.2)
    ckpt.save_model_files(where, cfg.to_dict(), tokenizer.to_str(), labels, vocab)
    atomic_write_bytes(where / ckpt.MODEL_FILE, ckpt.state_bytes(net))
    return where


@pytest.mark.parametrize(("recipe", "model"), [
    ("seed.toml", {}),  # post-norm, max pooling, 8 heads, max_length 256
    ("tiny.toml", {"pos_emb": "sinusoidal", "pooling": "first"}),  # the fixed position table and [CLS] pooling
    ("tiny.toml", {"pos_emb": "rope", "ff": "geglu"}),  # rotary positions and gated feed-forward layers traced
])
def test_export_at_recipe_sizes_gives_predicts_probabilities(trained_dir, tmp_path, recipe, model):
    model_dir = random_model_dir(trained_dir, tmp_path / "model", recipe, **model)
    assert_matches_predict(model_dir, tmp_path / "m.onnx", mixed_texts(12, seed=4, long_words=400))


def test_export_refuses_a_bad_directory_or_output(trained_dir, tmp_path):
    assert_fails_cleanly(tfm("export", "-c", tmp_path / "missing", "-o", tmp_path / "m.onnx"), 1, "does not exist")
    assert_fails_cleanly(tfm("export", "-c", trained_dir, "-o", tmp_path / "m.txt"), 2, ".onnx")
    (tmp_path / "d.onnx").mkdir()
    assert_fails_cleanly(tfm("export", "-c", trained_dir, "-o", tmp_path / "d.onnx"), 2, "is a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.onnx"]


def test_a_failed_export_leaves_the_pair_it_would_replace_and_names_the_file(trained_dir, tmp_path, monkeypatch):
    import errno
    import os

    from transformer_cli import fileio
    from transformer_cli.export import export_onnx

    out = tmp_path / "m.onnx"
    out.write_bytes(b"an earlier graph")
    out.with_name("m.tokenizer.json").write_bytes(b"its tokenizer")
    before = {p.name: (p.stat().st_ino, p.read_bytes()) for p in tmp_path.iterdir()}
    fsync = os.fsync

    def disk_full_on_the_graph(fd):  # the tokenizer, written first, is whole; the graph is not
        if os.readlink(f"/proc/self/fd/{fd}").endswith(f".m.onnx.tmp-{os.getpid()}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        fsync(fd)

    monkeypatch.setattr(fileio.os, "fsync", disk_full_on_the_graph)
    with pytest.raises(OSError, match="No space left on device") as failed:
        export_onnx(trained_dir, out)
    assert failed.value.filename == str(out)  # the file whose write failed, not its temp name nor the tokenizer
    assert {p.name: (p.stat().st_ino, p.read_bytes()) for p in tmp_path.iterdir()} == before  # neither replaced
