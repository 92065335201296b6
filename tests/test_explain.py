"""Per-token explanations: `tfm predict --explain`, `tfm explain --html`, transformer_cli.explain."""

import json
import re
from html.parser import HTMLParser

import numpy as np
import pytest
import torch
from test_cli import NEGATIVE_TEXT, POSITIVE_TEXT, assert_fails_cleanly, json_lines, tfm

from transformer_cli.calibration import saved_temperature
from transformer_cli.data import PAD_ID
from transformer_cli.evaluate import load_model_dir
from transformer_cli.explain import display_pieces, faithfulness, integrated_gradients, review_ids

pytest.importorskip("captum")


def probability(model, ids: torch.Tensor, target: int, temperature: float = 1.0) -> float:
    with torch.no_grad():
        logits = model(ids[None], torch.ones(1, len(ids), dtype=torch.bool))
        return (logits / temperature).softmax(-1)[0, target].item()


def test_predict_explain_json_gives_the_models_pieces_and_complete_attributions(trained_dir):
    r = tfm("predict", "-c", trained_dir, "--json", "--explain", POSITIVE_TEXT, NEGATIVE_TEXT)
    assert r.exit_code == 0, r.stderr
    plain = json_lines(tfm("predict", "-c", trained_dir, "--json", POSITIVE_TEXT, NEGATIVE_TEXT).stdout)
    model, cfg, tokenizer, labels = load_model_dir(trained_dir)
    for text, out, before in zip([POSITIVE_TEXT, NEGATIVE_TEXT], json_lines(r.stdout), plain):
        assert {k: out[k] for k in before} == before  # predict's own fields unchanged
        ids = review_ids(tokenizer, [text], cfg.data)[0]
        assert out["tokens"] == [tokenizer.id_to_token(int(i)) for i in ids[1:]]
        assert len(out["attributions"]) == len(out["tokens"]) and all(np.isfinite(out["attributions"]))
        # completeness: the attributions add up to p(review) - p(every token [PAD]), the probabilities
        # predict gives (calibrated by the run's temperature)
        target, temperature = labels.index(out["label"]), saved_temperature(trained_dir)
        assert temperature != 1.0 and probability(model, ids, target, temperature) == pytest.approx(out["score"])
        baseline = ids.clone()
        baseline[1:] = PAD_ID
        gap = probability(model, ids, target, temperature) - probability(model, baseline, target, temperature)
        assert sum(out["attributions"]) == pytest.approx(gap, abs=0.05 * abs(gap) + 0.005)  # IG_TOLERANCE
    assert json_lines(r.stdout)[0]["label"] == "pos"


def test_attributions_converge_with_more_steps(trained_dir):
    """The default (adaptive) number of steps is close to a 512-step integral."""
    model, cfg, tokenizer, _ = load_model_dir(trained_dir)
    ids = review_ids(tokenizer, [POSITIVE_TEXT], cfg.data)[0]
    fine, _ = integrated_gradients(model, ids, 1, steps=512)
    coarse, delta = integrated_gradients(model, ids, 1)
    assert np.abs(coarse - fine).max() < 0.1 * np.abs(fine).max()
    assert abs(delta) <= 0.05 * abs(fine.sum()) + 0.005


def test_hiding_the_most_attributed_tokens_lowers_the_probability_more_than_random_ones(trained_dir, test_rows):
    model, cfg, tokenizer, _ = load_model_dir(trained_dir)
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
    assert_fails_cleanly(tfm("explain", "-c", tmp_path / "none", "--html", tmp_path / "x.html", "good"), 1,
                         "does not exist")
    assert not (tmp_path / "x.html").exists()


def test_explain_refuses_a_wide_and_deep_model(synthetic_data_dir, tmp_path):
    from conftest import tiny_config

    from transformer_cli.train import train

    out = tmp_path / "wide"
    train(tiny_config(synthetic_data_dir, out, model__ngram_buckets=64, train__max_steps=2), progress=False)
    assert_fails_cleanly(tfm("predict", "-c", out, "--explain", "good"), 1, "n-gram path")
    assert json.loads(tfm("predict", "-c", out, "--json", "good").stdout)["label"] in ("neg", "pos")
