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
from transformer_cli.explain import (
    CUT_MARK,
    IG_STEPS,
    Explained,
    cut_positions,
    explain_texts,
    faithfulness,
    integrated_gradients,
    review_ids,
    review_spans,
    rich_text,
    shown_pieces,
)
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


def test_predict_explain_json_gives_the_models_pieces_their_spans_and_attributions(calibrated_dir):
    r = tfm("predict", "-c", calibrated_dir, "--json", "--explain", POSITIVE_TEXT, NEGATIVE_TEXT)
    assert r.exit_code == 0, r.stderr
    plain = json_lines(tfm("predict", "-c", calibrated_dir, "--json", POSITIVE_TEXT, NEGATIVE_TEXT).stdout)
    model, cfg, tokenizer, labels, _ = load_model_dir(calibrated_dir)
    temperature = saved_temperature(calibrated_dir)
    for text, out, before in zip([POSITIVE_TEXT, NEGATIVE_TEXT], json_lines(r.stdout), plain):
        assert {k: out[k] for k in before} == before  # predict's own fields unchanged
        ids = review_ids(tokenizer, [text], cfg.data)[0]
        assert out["tokens"] == [tokenizer.id_to_token(int(i)) for i in ids[1:]]
        assert len(out["spans"]) == len(out["tokens"])
        for token, (start, end) in zip(out["tokens"], out["spans"]):  # each span holds its token's own text
            if token.removeprefix("##").isascii() and token.removeprefix("##").isalnum():
                assert text[start:end].lower() == token.removeprefix("##")
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


REVIEWS = ["GREAT film!<br /><br />The café scene was SUPERB 😀, naïve but wonderfully acted.",
           "  Terrible.   Boring, awful <br/>film\u2026 I hated it  "]


def explained(model_dir, texts: list[str]) -> list[Explained]:
    from transformer_cli.evaluate import predict_texts

    return explain_texts(model_dir, texts, predict_texts(model_dir, texts, "cpu"), "cpu")


def test_the_display_is_the_reviews_own_text(trained_dir):
    """Upper case, <br /> tags, accents, an emoji and words of several pieces are shown as written, not as the
    tokenizer reads them; spaces and characters the tokenizer dropped stand between the coloured spans."""
    _, _, tokenizer, _, _ = load_model_dir(trained_dir)
    assert any(t.startswith("##") for t in tokenizer.encode(REVIEWS[0], add_special_tokens=False).tokens)
    for text, e in zip(REVIEWS, explained(trained_dir, REVIEWS)):
        assert e.cut is None and rich_text(e).plain == text
        pieces = shown_pieces(e)
        assert "".join(piece for _, piece, _ in pieces) == text
        assert sum(a for kind, _, a in pieces if kind == "token") == pytest.approx(sum(e.attributions))
    r = tfm("predict", "-c", trained_dir, "--explain", POSITIVE_TEXT)
    assert r.exit_code == 0, r.stderr
    first, second = r.stdout.splitlines()[:2]
    assert first.startswith("pos\t") and second == POSITIVE_TEXT


def test_pieces_that_share_characters_are_shown_once_with_their_summed_attribution():
    """NFKC turns one character into several ("\u2026" into "...", three tokens): it is shown once, as one span."""
    e = Explained("Wow\u2026 ok", ["wow", ".", ".", ".", "ok"], [0.1, 0.2, 0.3, -0.4, 0.5], 0.0,
                  [(0, 3), (3, 4), (3, 4), (3, 4), (5, 7)])
    pieces = shown_pieces(e)
    assert [(kind, piece) for kind, piece, _ in pieces] == [("token", "Wow"), ("token", "\u2026"), ("plain", " "),
                                                            ("token", "ok")]
    assert pieces[1][2] == pytest.approx(0.1)


def test_a_review_cut_to_the_models_length_shows_its_own_start_and_end(trained_dir):
    """A review longer than the model reads loses its middle (head_tail) or its end (head): the display shows
    the review's own start and end as written, and an ellipsis for what the model did not read."""
    _, cfg, tokenizer, _, _ = load_model_dir(trained_dir)
    limit = cfg.data.max_length - 1
    long = "I LOVED it, Superb. " + "The middle goes on and on. " * 60 + "A wonderful ENDING, truly great."
    whole = "great " * limit  # just fits
    for truncation in ("head_tail", "head"):
        data_cfg = dataclasses.replace(cfg.data, truncation=truncation)
        ids = review_ids(tokenizer, [long, whole], data_cfg)
        cuts = cut_positions(tokenizer, [long, whole], ids, data_cfg)
        for text, row, spans, cut in zip([long, whole], ids, review_spans(tokenizer, [long, whole], data_cfg), cuts):
            assert len(spans) == len(row) - 1
            shown = rich_text(Explained(text, [], [0.0] * len(spans), 0.0, spans, cut)).plain
            if text == whole:
                assert cut is None and shown == whole
            elif truncation == "head":
                assert shown == text[: spans[-1][1]] + f" {CUT_MARK}" and shown.startswith("I LOVED it, Superb. The")
            else:
                start, end = shown.split(f" {CUT_MARK} ")
                assert text.startswith(start) and text.endswith(end) and len(shown) < len(text) / 2
                assert start.startswith("I LOVED it, Superb. The") and end.endswith("A wonderful ENDING, truly great.")

    page_review = "I loved it. " + "The middle goes on and on. " * 60 + "A wonderful ending."
    r = tfm("predict", "-c", trained_dir, "--explain", page_review, POSITIVE_TEXT)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.count(CUT_MARK) == 1 and POSITIVE_TEXT in r.stdout


class Page(HTMLParser):
    """Of a page: the text of every <span class="t">, of each review (with its cut mark) and of each cut mark,
    every tag and every URL-like attribute."""

    def __init__(self):
        super().__init__()
        self.tokens, self.reviews, self.cuts, self.urls, self.tags, self._in = [], [], [], [], set(), []

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        attrs = dict(attrs)
        self.urls += [v for k, v in attrs.items() if k in ("src", "href", "srcset", "action") and v]
        self._in.append(attrs.get("class"))
        if attrs.get("class") == "review":
            self.reviews.append("")
        elif attrs.get("class") in ("t", "cut"):
            (self.tokens if attrs["class"] == "t" else self.cuts).append("")

    def handle_endtag(self, tag):
        self._in.pop()

    def handle_data(self, data):
        if "t" in self._in:
            self.tokens[-1] += data
        if "cut" in self._in:
            self.cuts[-1] += data
        if "review" in self._in:
            self.reviews[-1] += data


def test_explain_html_page_shows_the_reviews_own_text_safely(trained_dir, tmp_path):
    page = tmp_path / "out" / "explain.html"
    tricky = 'Great <b>film</b> & "superb" cast,<br /><br />I LOVED it <script>alert(1)</script> café 😀'
    r = tfm("explain", "-c", trained_dir, "--html", page, POSITIVE_TEXT, tricky)
    assert r.exit_code == 0, r.stderr
    assert sorted(p.name for p in page.parent.iterdir()) == ["explain.html"]  # no temp file left
    content = page.read_text(encoding="utf-8")
    parser = Page()
    parser.feed(content)
    assert parser.reviews == [POSITIVE_TEXT, tricky] and parser.cuts == []  # markup in a review is text
    expected = []
    for text, out in zip([POSITIVE_TEXT, tricky], json_lines(
            tfm("predict", "-c", trained_dir, "--json", "--explain", POSITIVE_TEXT, tricky).stdout)):
        expected += [text[start:end] for start, end in out["spans"]]
        assert f"{out['label']} ({out['score']:.3f})" in content
    assert parser.tokens == expected and len(expected) > 10
    assert parser.urls == [] and parser.tags == {"html", "head", "meta", "title", "style", "body", "h1", "p",
                                                 "span", "section", "h2"}
    assert not re.search(r"https?:|url\(|@import", content)


def test_explain_html_page_marks_the_cut(trained_dir, tmp_path):
    long = "I loved it. " + "The middle goes on and on. " * 60 + "A wonderful ending."
    page = tmp_path / "page.html"
    assert tfm("explain", "-c", trained_dir, "--html", page, long, POSITIVE_TEXT).exit_code == 0
    content = page.read_text(encoding="utf-8")
    assert content.count('class="cut"') == 1 and content.index('class="cut"') < content.index("<h2>2.")
    parser = Page()
    parser.feed(content)
    assert parser.cuts == [f" {CUT_MARK} "] and CUT_MARK not in "".join(parser.tokens)  # the mark is no token
    start, end = parser.reviews[0].split(f" {CUT_MARK} ")
    assert long.startswith(start) and long.endswith(end) and parser.reviews[1] == POSITIVE_TEXT


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
