import json

import numpy as np
import pytest
import torch
from conftest import edit_config
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from transformer_cli.config import DataConfig, ModelConfig
from transformer_cli.data import HEAD_SHARE, Encoded, encode_texts
from transformer_cli.evaluate import load_model_dir, predict_texts
from transformer_cli.explain import CUT_MARK
from transformer_cli.model import CTransformer
from transformer_cli.report import new_figure
from transformer_cli.tb_pictures import ATTENTION_TOKENS, TEXT_CHARS, attention_maps, pick_review, wrong_panel


@pytest.fixture(scope="module")
def events(trained_run):
    out, metrics = trained_run
    acc = EventAccumulator(str(out), size_guidance={"images": 0, "tensors": 0, "scalars": 0})
    acc.Reload()
    return acc, metrics


def test_training_writes_pr_curves_confusion_images_and_wrong_reviews(events):
    acc, metrics = events
    tags = acc.Tags()
    validation_steps = [e.step for e in acc.Scalars("val/accuracy")]
    confusion = np.array(metrics["val"]["confusion_matrix"])
    for c, name in enumerate(["neg", "pos"]):
        curves = acc.Tensors(f"val_pr/{name}")
        assert [e.step for e in curves] == validation_steps
        data = tensor_util.make_ndarray(curves[-1].tensor_proto)  # (6, thresholds): TP, FP, TN, FN, P, R
        assert data[0, 0] + data[3, 0] == confusion[c].sum()  # every example of class c is a TP or FN
    assert "val/confusion_matrix" in tags["images"]
    assert [e.step for e in acc.Images("val/confusion_matrix")] == validation_steps
    texts = acc.Tensors("val/confidently_wrong/text_summary")
    assert [e.step for e in texts] == validation_steps
    panel = tensor_util.make_ndarray(texts[-1].tensor_proto).item().decode()
    wrong = confusion.sum() - np.trace(confusion)
    assert ("| probability | true | predicted | review |" in panel) == (wrong > 0)


def test_training_ends_with_an_attention_image_and_calibration_scalars(events):
    acc, metrics = events
    (image,) = acc.Images("val/attention")
    assert image.step == metrics["steps"] and image.encoded_image_string[:4] == b"\x89PNG"
    (t,) = acc.Scalars("calibration/temperature")
    assert t.value == pytest.approx(metrics["calibration"]["temperature"], rel=1e-6)


class Chars:
    """A stand-in tokenizer: token id i is the letter chr(ord('a') + i % 26)."""

    def id_to_token(self, i):
        return chr(ord("a") + i % 26)


UNCUT = DataConfig(max_length=1000)  # no review of the stand-in tests fills it: none was cut


def test_wrong_panel_shows_the_most_confident_mistakes_first():
    labels = np.array([0, 1, 2, 0, 1, 2])
    probs = np.array([[0.2, 0.7, 0.1], [0.9, 0.05, 0.05], [0.1, 0.1, 0.8], [0.5, 0.25, 0.25], [0.3, 0.1, 0.6],
                      [0.1, 0.85, 0.05]])
    lengths = np.array([3, 500, 2, 2, 2, 2])
    enc = Encoded(np.arange(lengths.sum()) % 7, np.r_[0, np.cumsum(lengths)], labels)
    panel = wrong_panel(probs, enc, ["a", "b", "c"], Chars(), [""] * 6, UNCUT, shown=3)
    rows = [line for line in panel.splitlines() if line.startswith("| 0.")]
    assert [r.split(" | ")[0] for r in rows] == ["| 0.900", "| 0.850", "| 0.700"]
    assert rows[0].split(" | ")[1:3] == ["b", "a"]
    assert "4 wrong" in panel
    assert all(len(r.split(" | ")[3]) <= 302 for r in rows)  # reviews cut to a few hundred characters
    right = wrong_panel(np.eye(3)[labels], enc, ["a", "b", "c"], Chars(), [""] * 6, UNCUT)
    assert right.startswith("No validation review")


def test_wrong_panel_keeps_its_columns_whatever_the_labels_hold():
    """Label names are any text: a '|' in one must not split its cell (labels "a|b", "c d")."""
    enc = Encoded(np.arange(4), np.array([0, 2, 4]), np.array([0, 1]))
    panel = wrong_panel(np.array([[0.2, 0.8], [0.9, 0.1]]), enc, ["a|b", "c d"], Chars(), ["", ""], UNCUT)
    rows = [line for line in panel.splitlines() if line.startswith("| 0.")]
    assert len(rows) == 2
    for row in rows:
        assert len(row.replace("\\|", "").split("|")) == 6  # four cells between the bars
    assert rows[0].startswith("| 0.900 | c d | a\\|b | ")


def test_wrong_panel_marks_where_a_long_review_was_cut(trained_dir):
    """A review longer than the model reads keeps its head and tail (data.truncation "head_tail"): the
    panel shows an ellipsis between them, and a word's continuation right after the cut does not join
    the word before it; a review that just fits is shown whole."""
    _, cfg, tokenizer, _, _ = load_model_dir(trained_dir)
    limit = cfg.data.max_length - 1
    head = round(limit * HEAD_SHARE)
    pieces = tokenizer.encode("greatfilms", add_special_tokens=False).tokens  # e.g. great ##f ##il ##ms
    assert len(pieces) > 1 and pieces[-1].startswith("##")
    texts = ["great " * limit + "greatfilms" + " great" * (limit - head - 1), "great " * limit]
    ids, offsets = encode_texts(tokenizer, texts, cfg.data.max_length, cfg.data.truncation)
    enc = Encoded(ids, offsets, np.array([0, 0]))
    panel = wrong_panel(np.array([[0.1, 0.9], [0.2, 0.8]]), enc, ["neg", "pos"], tokenizer, texts, cfg.data)
    cut, whole = [line.split(" | ")[3].removesuffix(" |") for line in panel.splitlines() if line.startswith("| 0.")]
    tail = " ".join([pieces[-1].removeprefix("##"), *["great"] * (limit - head - 1)])
    assert cut == ("great " * head + f"{CUT_MARK} {tail}")[: TEXT_CHARS - 3] + "..."
    assert whole.startswith("great great") and CUT_MARK not in whole


class Images:
    """A stand-in SummaryWriter that keeps the tags of its images."""

    def __init__(self):
        self.tags = []

    def add_image(self, tag, *args, **kwargs):
        self.tags.append(tag)


def test_attention_title_gives_the_probability_tfm_predict_prints(model_dir, monkeypatch):
    """The title's probability is calibrated by the run's temperature, as `tfm predict`'s is; a review
    drawn cut says that its prediction is of the tokens drawn."""
    from transformer_cli import tb_pictures

    edit_config(model_dir, calibration={"temperature": 0.5})
    model, cfg, tokenizer, labels, temperature = load_model_dir(model_dir)
    titles = []
    monkeypatch.setattr(tb_pictures, "attention_figure",
                        lambda maps, tokens, title: titles.append(title) or new_figure())
    texts = ["A wonderful film, I loved it.", "the plot " * 40]
    writer = Images()
    d = cfg.data
    for text in texts:
        ids, offsets = encode_texts(tokenizer, [text], d.max_length, d.truncation)
        review = Encoded(ids, offsets, np.array([1]))
        tb_pictures.log_attention(writer, 1, model, review, labels, tokenizer, temperature)
    assert writer.tags == ["val/attention"] * 2
    p = predict_texts(model_dir, texts[:1], device="cpu")[0]
    assert titles[0] == f"true pos, predicted {p['label']} ({p['score']:.3f})"
    assert titles[1].endswith(f" from its first {ATTENTION_TOKENS} of {cfg.data.max_length} tokens")


def test_attention_figure_draws_dollar_signs_as_they_are():
    from transformer_cli.report import png_bytes
    from transformer_cli.tb_pictures import attention_figure

    fig = attention_figure([np.eye(3)], ["[CLS]", "$", "$"], "true $$, predicted $$$ (0.900)")
    assert png_bytes(fig)[:4] == b"\x89PNG"  # mathtext would fail on "$$" and "$$$"
    title = fig._suptitle
    assert title._preprocess_math(title.get_text()) == ("Attention, heads averaged: true $$, predicted $$$ (0.900)",
                                                        False)


@pytest.mark.parametrize(("norm", "pos_emb"), [("post", "learned"), ("pre", "learned"), ("pre", "rope")])
def test_attention_maps_are_the_attention_the_model_applies(norm, pos_emb):
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_heads=4, n_layers=2, norm=norm, pos_emb=pos_emb, dropout=0.0)
    model = CTransformer(cfg, vocab_size=50, max_length=16, num_labels=3).eval()
    ids = torch.randint(5, 50, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False  # padding
    outputs = []
    hooks = [b.attn.register_forward_hook(lambda m, args, out: outputs.append((args[0], out)))
             for b in model.encoder.blocks]
    maps, logits = attention_maps(model, ids, mask)
    for h in hooks:
        h.remove()
    assert len(maps) == 2 and maps[0].shape == (2, 4, 9, 9)
    torch.testing.assert_close(logits, model(ids, mask))
    for att, (x, out), block in zip(maps, outputs, model.encoder.blocks, strict=True):
        assert torch.allclose(att.sum(-1), torch.ones(2, 4, 9))
        assert (att[1, :, :, 6:] == 0).all()  # no attention on padding
        attn = block.attn
        _, _, v = attn.heads(x)  # (B, H, T, Dh): values are not rotated
        mixed = (att @ v).transpose(1, 2).reshape(2, 9, 32)  # (B, T, C)
        torch.testing.assert_close(attn.proj(mixed), out, atol=1e-5, rtol=1e-5)
    assert not model.training and all(not b.attn._forward_pre_hooks for b in model.encoder.blocks)


def test_pick_review_prefers_a_short_one():
    lengths = np.array([90, 30, 20, 100])
    enc = Encoded(np.zeros(lengths.sum(), dtype=np.int32), np.r_[0, np.cumsum(lengths)], np.zeros(4, dtype=np.int64))
    assert pick_review(enc, 40) == 1
    assert pick_review(enc, 10) == 2


def test_metrics_json_carries_the_calibration(trained_run):
    out, metrics = trained_run
    assert json.loads((out / "metrics.json").read_text())["calibration"] == metrics["calibration"]
    assert "ece" in metrics["val"]
