"""data.long_text = "windows": a review is read whole, in windows whose logits are averaged; training reads one
window a review, another each epoch."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import one_at_a_time_logits, tiny_config

from transformer_cli.data import Encoded, window_bounds, windows
from transformer_cli.evaluate import all_logits, load_for_inference, predict_texts
from transformer_cli.runtime import make_runtime
from transformer_cli.tokens import CLS_ID
from transformer_cli.training.classify import train


def texts_of(lengths: list[int]) -> Encoded:
    rows = [np.array([CLS_ID, *range(10, 10 + n - 1)], dtype=np.int32) for n in lengths]
    offsets = np.cumsum([0, *map(len, rows)])
    return Encoded(np.concatenate(rows), offsets, np.arange(len(rows)))


@pytest.mark.parametrize("length", [1, 2, 15, 16, 17, 31, 100])
def test_windows_tile_each_text_in_the_fewest_near_equal_pieces(length):
    enc = texts_of([length])
    win, owner = windows(enc, 16)
    pieces = [win.ids[win.offsets[k] : win.offsets[k + 1]] for k in range(len(win))]
    assert all(p[0] == CLS_ID and len(p) <= 16 for p in pieces) and (owner == 0).all()
    assert np.concatenate([p[1:] for p in pieces]).tolist() == enc.ids[1:].tolist()  # all of it, once, in order
    assert len(pieces) == max(1, -(-(length - 1) // 15))
    assert max(map(len, pieces)) - min(map(len, pieces)) <= 1


def test_training_picks_another_window_each_epoch():
    enc = texts_of([46, 5])  # 3 windows of 16, and 1
    seen = [windows(enc, 16, pick=np.array([epoch, epoch]))[0] for epoch in range(4)]
    first = [w.ids[w.offsets[0] + 1] for w in seen]
    assert first == [10, 25, 40, 10] and all(len(w) == 2 for w in seen)


def test_evaluation_averages_the_logits_of_every_window(trained_dir):
    _, model, *_ = load_for_inference(trained_dir, "cpu", "fp32")
    enc = texts_of([5, 40, 63, 64])
    win, owner = windows(enc, 16)
    reference = one_at_a_time_logits(model, win)  # each window alone
    expected = torch.stack([reference[torch.from_numpy(owner == i)].mean(0) for i in range(len(enc))])
    got = all_logits(model, enc, make_runtime("cpu", "fp32"), 64, 2, window=16)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def windowed_run(synthetic_data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("windowed") / "run"
    cfg = tiny_config(synthetic_data_dir, out, data__long_text="windows", data__max_length=16)
    metrics = train(cfg, progress=False)
    return out, metrics


def test_a_windowed_run_trains_validates_and_says_how_many_windows_a_review_had(windowed_run):
    out, metrics = windowed_run
    assert metrics["val"]["accuracy"] > 0.6
    assert json.loads((out / "config.json").read_text())["data"]["long_text"] == "windows"
    long_review = " ".join(["a great film and a wonderful plot"] * 40)
    (short, long), = [predict_texts(out, ["Great!", long_review], device="cpu")]
    assert short["windows"] == 1 and long["windows"] >= 15


def test_a_20000_word_review_is_read_whole(windowed_run):
    out, _ = windowed_run
    (r,) = predict_texts(out, ["great " * 20_000], device="cpu")
    tokens = 20_000 + 1  # one token a word, and [CLS]
    assert r["windows"] == len(window_bounds(tokens, 16)) - 1


def test_the_exported_graph_reads_windows_as_predict_does(windowed_run, tmp_path):
    pytest.importorskip("onnxruntime")
    from transformer_cli.export import OnnxClassifier, export_onnx

    out, _ = windowed_run
    export_onnx(out, tmp_path / "m.onnx")
    texts = ["Great!", " ".join(["an awful boring film"] * 30)]
    onnx_probs = OnnxClassifier(tmp_path / "m.onnx").proba(texts)
    mine = np.array([[r["probabilities"][k] for k in ("neg", "pos")] for r in predict_texts(out, texts, device="cpu")])
    np.testing.assert_allclose(onnx_probs, mine, atol=1e-4)


def test_explanations_cover_every_token_of_a_review_read_in_windows(windowed_run):
    from transformer_cli.explain import explain_texts

    out, _ = windowed_run
    review = " ".join(["a great film but an awful boring plot"] * 8)  # many windows of 16 tokens
    (prediction,) = predict_texts(out, [review], device="cpu")
    (e,) = explain_texts(out, [review], [prediction], device="cpu", steps=512)
    assert e.cut is None and len(e.tokens) == len(e.attributions) == len(e.spans) > 5 * 16
    assert abs(e.delta) < 1e-3  # the attributions add up to the change of the (window-averaged) probability
    great = [a for t, a in zip(e.tokens, e.attributions) if t == "great"]
    assert len(great) == 8 and len(set(great)) > 1  # every window's tokens are attributed, each in its context
