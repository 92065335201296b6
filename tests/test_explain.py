"""Per-token explanations: `tfm predict --explain`, `tfm explain --html`, transformer_cli.explain."""

import dataclasses
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import edit_config
from test_cli import NEGATIVE_TEXT, POSITIVE_TEXT, assert_fails_cleanly, json_lines, tfm

from transformer_cli.calibration import saved_temperature
from transformer_cli.errors import TfmError
from transformer_cli.evaluate import load_model_dir
from transformer_cli.explain import IG_STEPS, display_pieces, faithfulness, integrated_gradients, review_ids
from transformer_cli.model import CTransformer
from transformer_cli.tokens import PAD_ID


def probability(model, ids: torch.Tensor, target: int, temperature: float = 1.0) -> float:
    with torch.no_grad():
        logits = model(ids[None], torch.ones(1, len(ids), dtype=torch.bool))
        return (logits / temperature).softmax(-1)[0, target].item()


def baseline_gap(model, ids: torch.Tensor, target: int, temperature: float = 1.0) -> float:
    """p(review) - p(every token [PAD]): what the attributions add up to as the integral converges."""
    baseline = ids.clone()
    baseline[1:] = PAD_ID
    return probability(model, ids, target, temperature) - probability(model, baseline, target, temperature)


@pytest.fixture
def calibrated_dir(model_dir) -> Path:
    """The trained model with a calibration temperature of 0.5, whatever the fixture's fit gave."""
    edit_config(model_dir, calibration={"temperature": 0.5})
    return model_dir


def test_predict_explain_json_gives_the_models_pieces_and_its_attributions(calibrated_dir):
    r = tfm("predict", "-c", calibrated_dir, "--json", "--explain", POSITIVE_TEXT, NEGATIVE_TEXT)
    assert r.exit_code == 0, r.stderr
    plain = json_lines(tfm("predict", "-c", calibrated_dir, "--json", POSITIVE_TEXT, NEGATIVE_TEXT).stdout)
    model, cfg, tokenizer, labels, _ = load_model_dir(calibrated_dir)
    temperature = saved_temperature(calibrated_dir)
    for text, out, before in zip([POSITIVE_TEXT, NEGATIVE_TEXT], json_lines(r.stdout), plain):
        assert {k: out[k] for k in before} == before  # predict's own fields unchanged
        ids = review_ids(tokenizer, [text], cfg.data)[0]
        assert out["tokens"] == [tokenizer.id_to_token(int(i)) for i in ids[1:]]
        # attributions to the probability predict gives (calibrated by the run's temperature)
        target = labels.index(out["label"])
        assert temperature == 0.5 and probability(model, ids, target, temperature) == pytest.approx(out["score"])
        attr, _ = integrated_gradients(model, ids, target, IG_STEPS, temperature)
        assert out["attributions"] == pytest.approx(attr[1:].tolist(), abs=1e-6)
    assert json_lines(r.stdout)[0]["label"] == "pos"


def test_attributions_add_up_to_the_change_of_probability_with_enough_steps(trained_dir):
    """Completeness, --ig-steps through the CLI: the integral converges to p(review) - p(baseline).
    1,024 nodes leave room for a sharp path (a model fitted to a temperature well below 1)."""
    model, cfg, tokenizer, labels, _ = load_model_dir(trained_dir)
    temperature = saved_temperature(trained_dir)
    r = tfm("predict", "-c", trained_dir, "--json", "--explain", "--ig-steps", "1024", POSITIVE_TEXT, NEGATIVE_TEXT)
    assert r.exit_code == 0, r.stderr
    gaps = []
    for text, out in zip([POSITIVE_TEXT, NEGATIVE_TEXT], json_lines(r.stdout)):
        ids = review_ids(tokenizer, [text], cfg.data)[0]
        gaps.append(baseline_gap(model, ids, labels.index(out["label"]), temperature))
        assert sum(out["attributions"]) == pytest.approx(gaps[-1], abs=0.01 * abs(gaps[-1]) + 1e-4)
    assert max(map(abs, gaps)) > 0.1  # the all-[PAD] baseline leans one way: one review moves far from it


def test_attributions_converge_with_more_steps(trained_dir):
    """Gauss-Legendre nodes converge fast on a smooth path: a freshly initialised mean-pooling model's
    error (against 1,024 nodes) falls several-fold with each doubling, to float noise by 8 nodes. (Max
    pooling's path has kinks where a maximum moves to another token.)"""
    model, cfg, tokenizer, labels, _ = load_model_dir(trained_dir)
    torch.manual_seed(0)
    smooth = dataclasses.replace(cfg.model, pooling="mean")
    fresh = CTransformer(smooth, tokenizer.get_vocab_size(), model.encoder.max_length, len(labels)).eval()
    ids = review_ids(tokenizer, [NEGATIVE_TEXT], cfg.data)[0]
    fine, fine_delta = integrated_gradients(fresh, ids, 0, steps=1024)
    scale = np.abs(fine).max()
    assert abs(fine_delta) < 1e-3 * abs(baseline_gap(fresh, ids, 0))
    errors = [np.abs(integrated_gradients(fresh, ids, 0, steps=n)[0] - fine).max() / scale for n in (1, 2, 4, 8)]
    assert errors[0] > 2 * errors[1] > 4 * errors[2] and errors[3] < 1e-3


def test_a_sharp_path_needs_many_nodes_but_converges(trained_dir):
    """The tiny trained model is trained hard on a few signal words, so its path is sharp: few nodes can be
    far off (how far depends on the run), but 256 nodes agree with 1,024."""
    model, cfg, tokenizer, _, _ = load_model_dir(trained_dir)
    ids = review_ids(tokenizer, [NEGATIVE_TEXT], cfg.data)[0]
    fine, fine_delta = integrated_gradients(model, ids, 0, steps=1024)
    assert abs(fine_delta) < 1e-3 * abs(baseline_gap(model, ids, 0))
    error = np.abs(integrated_gradients(model, ids, 0, steps=256)[0] - fine).max()
    assert error < 0.05 * np.abs(fine).max()


def test_hiding_the_most_attributed_tokens_lowers_the_probability_more_than_random_ones(trained_dir, test_rows):
    model, cfg, tokenizer, _, _ = load_model_dir(trained_dir)
    texts = [row["text"] for row in test_rows[:40]]
    reviews = []
    for ids in review_ids(tokenizer, texts, cfg.data):
        with torch.no_grad():
            target = int(model(ids[None], torch.ones(1, len(ids), dtype=torch.bool)).argmax())
        attr, _ = integrated_gradients(model, ids, target)
        reviews.append((ids, target, attr[1:]))
    out = faithfulness(model, reviews, fraction=0.1)
    assert out["reviews"] == 40
    assert out["top_drop"] > out["random_drop"]
    assert out["top_drop"] > 0.05  # the signal words carry the label


class Raising(torch.nn.Module):
    """A model whose first class gets likelier the more tokens are hidden."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))

    def forward(self, ids, mask):
        hidden = (~mask).float().sum(-1)
        return torch.stack([hidden * self.w, torch.zeros_like(hidden)], -1)


def test_faithfulness_gives_no_ratio_when_hiding_random_tokens_does_not_lower_the_probability():
    ids = torch.arange(21)
    out = faithfulness(Raising(), [(ids, 0, np.linspace(0, 1, 20))], fraction=0.1)
    assert out["top_drop"] < 0 and out["random_drop"] < 0
    assert out["ratio"] is None  # not inf: a useless attribution must not read as a perfect one
    json.dumps(out, allow_nan=False)


def test_faithfulness_measures_the_calibrated_probabilities():
    """As `tfm predict --explain` shows them: the logits divided by the model's temperature."""
    from transformer_cli.explain import hidden_probability

    ids = torch.arange(21)
    p = hidden_probability(Raising(), ids, 0, [np.zeros(0, dtype=np.int64), np.array([1, 2])], temperature=4.0)
    np.testing.assert_allclose(p, [0.5, 1 / (1 + np.exp(-2 / 4.0))], rtol=1e-6)  # 2 hidden: logits (2, 0)
    hot, cold = (faithfulness(Raising(), [(ids, 0, np.linspace(0, 1, 20))], fraction=0.1, temperature=t)
                 for t in (1.0, 4.0))
    assert hot["top_drop"] == pytest.approx(0.5 - 1 / (1 + np.exp(-2)))
    assert cold["top_drop"] == pytest.approx(0.5 - 1 / (1 + np.exp(-2 / 4.0)))


def test_faithfulness_leaves_out_reviews_with_nothing_to_hide():
    ids = torch.arange(21)
    alone = faithfulness(Raising(), [(ids, 0, np.linspace(0, 1, 20))], fraction=0.1)
    with_empty = faithfulness(Raising(), [(torch.tensor([2]), 0, np.zeros(0)), (ids, 0, np.linspace(0, 1, 20))],
                              fraction=0.1)
    assert with_empty == alone and with_empty["reviews"] == 1
    with pytest.raises(TfmError, match="no review has a token to hide"):
        faithfulness(Raising(), [(torch.tensor([2]), 0, np.zeros(0))])


class Spans(HTMLParser):
    """The text of every <span class="t"> of a page, and every URL-like attribute."""

    def __init__(self):
        super().__init__()
        self.tokens, self.urls, self.tags, self._in = [], [], set(), False

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        attrs = dict(attrs)
        self.urls += [v for k, v in attrs.items() if k in ("src", "href", "srcset", "action") and v]
        if tag == "span" and attrs.get("class") == "t":
            self._in = True
            self.tokens.append("")

    def handle_endtag(self, tag):
        if tag == "span":
            self._in = False

    def handle_data(self, data):
        if self._in:
            self.tokens[-1] += data


def test_explain_html_page_holds_every_token_and_nothing_external(trained_dir, tmp_path):
    page = tmp_path / "out" / "explain.html"
    tricky = 'Great <b>film</b> & "superb" cast, I loved it'
    r = tfm("explain", "-c", trained_dir, "--html", page, POSITIVE_TEXT, tricky)
    assert r.exit_code == 0, r.stderr
    assert sorted(p.name for p in page.parent.iterdir()) == ["explain.html"]  # no temp file left
    content = page.read_text(encoding="utf-8")
    parser = Spans()
    parser.feed(content)
    expected = []
    for out in json_lines(tfm("predict", "-c", trained_dir, "--json", "--explain", POSITIVE_TEXT, tricky).stdout):
        expected += [piece for _, piece in display_pieces(out["tokens"])]
        assert f"{out['label']} ({out['score']:.3f})" in content
    assert parser.tokens == expected and len(expected) > 10
    assert parser.urls == [] and not {"script", "link", "img", "iframe"} & parser.tags
    assert not re.search(r"https?:|url\(|@import", content)


def test_predict_explain_text_shows_the_review(trained_dir):
    r = tfm("predict", "-c", trained_dir, "--explain", POSITIVE_TEXT)
    assert r.exit_code == 0, r.stderr
    first, second = r.stdout.splitlines()[:2]
    assert first.startswith("pos\t")
    assert "great wonderful film" in second


def test_explain_usage_errors(trained_dir, tmp_path):
    assert_fails_cleanly(tfm("explain", "-c", trained_dir, "--html", tmp_path / "x.html"), 2, "no input")
    assert_fails_cleanly(tfm("explain", "-c", trained_dir, "good"), 2, "--html")
    assert_fails_cleanly(tfm("explain", "-c", trained_dir, "--html", tmp_path / "x.html", "--ig-steps", "0", "good"),
                         2, "--ig-steps")
    assert_fails_cleanly(tfm("predict", "-c", trained_dir, "--ig-steps", "8", "good"), 2, "add --explain")
    assert_fails_cleanly(tfm("explain", "-c", tmp_path / "none", "--html", tmp_path / "x.html", "good"), 1,
                         "does not exist")
    assert not (tmp_path / "x.html").exists()
    for name in ("model.safetensors", "config.json", "tokenizer.json"):  # the model it reads is never written over
        before = (trained_dir / name).read_bytes()
        assert_fails_cleanly(tfm("explain", "-c", trained_dir, "--html", trained_dir / name, "good"), 2,
                             "is the command's input")
        assert (trained_dir / name).read_bytes() == before
    reviews = tmp_path / "reviews.txt"
    reviews.write_text("good\nbad\n", encoding="utf-8")
    assert_fails_cleanly(tfm("explain", "-c", trained_dir, "--file", reviews, "--html", reviews), 2,
                         f"--html '{reviews}' is the command's input")
    assert reviews.read_text(encoding="utf-8") == "good\nbad\n"


def test_a_review_cut_to_the_models_length_is_shown_cut_where_it_was(trained_dir, tmp_path):
    """A review longer than the model reads loses its middle (head_tail) or end (head): the display marks
    the cut, and a word's continuation after it does not join the piece before it."""
    from transformer_cli.explain import CUT_MARK, cut_positions, rich_text

    _, cfg, tokenizer, _, _ = load_model_dir(trained_dir)
    limit = cfg.data.max_length - 1
    assert tokenizer.encode("great", add_special_tokens=False).ids.__len__() == 1
    texts = ["great " * limit, "great " * (limit + 1), "great " * 1000]
    for truncation, head in (("head_tail", round(limit * cfg.data.head_fraction)), ("head", limit)):
        data_cfg = dataclasses.replace(cfg.data, truncation=truncation)
        assert cut_positions(tokenizer, texts, review_ids(tokenizer, texts, data_cfg), data_cfg) == [None, head, head]
    assert display_pieces(["char", "##ged", "on"], cut=1) == [("", "char"), (" ", "ged"), (" ", "on")]
    assert rich_text(["char", "##ged"], [0.0, 0.0], cut=1).plain == f"char {CUT_MARK} ged"
    assert rich_text(["the", "end"], [0.0, 0.0], cut=2).plain == f"the end {CUT_MARK}"
    assert rich_text(["the", "end"], [0.0, 0.0]).plain == "the end"

    long = "I loved it. " + "The middle goes on and on. " * 60 + "A wonderful ending."
    r = tfm("predict", "-c", trained_dir, "--explain", long, POSITIVE_TEXT)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.count(CUT_MARK) == 1 and "great wonderful film" in r.stdout
    page = tmp_path / "page.html"
    assert tfm("explain", "-c", trained_dir, "--html", page, long, POSITIVE_TEXT).exit_code == 0
    content = page.read_text(encoding="utf-8")
    assert content.count('class="cut"') == 1 and content.index('class="cut"') < content.index("<h2>2.")
    parser = Spans()
    parser.feed(content)
    assert CUT_MARK not in "".join(parser.tokens)  # the mark is no token
