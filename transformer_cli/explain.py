"""Why a review got its label: each token's contribution to the predicted label's probability.

Integrated gradients on the token embeddings: the gradient of the label's probability is
integrated along the straight path from a baseline, where every token of the review is [PAD] (an
embedding the model never reads at a real position: padding is masked), to the review; [CLS] and
the positions stay as they are. A token's attribution is the sum over its embedding's components,
and the attributions add up to p(review) - p(baseline) as the integral converges. The path's
embeddings replace the lookup's output through a forward hook, and its nodes go through the model
IG_BATCH at a time. Written here rather than with captum's LayerIntegratedGradients, which runs the
model four more times per review (twice to record the layer's outputs at the review and the
baseline, twice for the convergence delta): more than the path itself at IG_STEPS nodes. The tokens
are the tokenizer's pieces of the review as the model read it (truncated as in training), without
[CLS], each with its span in the review's own text: (start, end) in characters (Python string
indices), which `tokenizers` maps back through the normalizer (<br /> tags, NFKC, lowercasing). The
displays show the review's own text, each token's span coloured, an ellipsis for what the model
did not read.

`faithfulness` checks that the attributions mean something: hiding a review's most-attributed
tokens (as padding, through the mask) must lower the label's probability more than hiding as many
random ones.
"""

from __future__ import annotations

import html
import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from transformer_cli.data import HEAD_SHARE, PAD_ID, encode_texts, read_length, truncate, window_bounds
from transformer_cli.errors import TfmError
from transformer_cli.fileio import atomic_write_text

# Gauss-Legendre nodes on the path. Each costs about 2.6 plain predictions (a forward and a
# backward pass); on unlabelled IMDB reviews the default model's attributions at 3 nodes are as
# faithful as at 16 and agree with 256 nodes' nearly as well (docs/results.md). More nodes mostly
# bring the attributions' sum closer to p(review) - p(baseline); they refine the ranking little.
IG_STEPS = 3
IG_BATCH = 16  # nodes per forward pass: memory stays bounded with many nodes and long reviews


@dataclass
class Explained:
    text: str  # the review
    tokens: list[str]  # its pieces as the model read them, without [CLS]
    attributions: list[float]  # each piece's contribution to the label's probability
    delta: float  # sum(attributions) - (p(review) - p(baseline)): the integral's error
    spans: list[tuple[int, int]]  # each piece's (start, end) in `text`
    cut: int | None = None  # a review longer than the model reads: how many of `tokens` come before the cut


def review_ids(tokenizer, texts: list[str], data_cfg) -> list[torch.Tensor]:
    """Each text's (T,) ids as the model reads them: [CLS] + its subword ids, truncated (or whole, for windows)."""
    ids, offsets = encode_texts(tokenizer, texts, read_length(data_cfg), data_cfg.truncation)
    return [torch.from_numpy(ids[a:b].astype(np.int64)) for a, b in itertools.pairwise(offsets)]


def review_spans(tokenizer, texts: list[str], data_cfg) -> list[list[tuple[int, int]]]:
    """Each text's (start, end) character span of each piece review_ids keeps of it, without [CLS]."""
    tokenizer.encode_special_tokens = True  # as encode_texts reads them
    encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    if read_length(data_cfg) is None:  # windows: every piece
        return [e.offsets for e in encodings]
    return [truncate(e.offsets, data_cfg.max_length - 1, data_cfg.truncation) for e in encodings]


def cut_positions(tokenizer, texts: list[str], ids: list[torch.Tensor], data_cfg) -> list[int | None]:
    """Where each review (`ids`: review_ids' of `texts`) was cut to the model's length: None where it
    was read whole, else how many of its pieces come before the cut (the head of data.truncation's
    "head_tail"; all of them with "head": its end was cut)."""
    if read_length(data_cfg) is None:  # windows: nothing is cut
        return [None] * len(texts)
    limit = data_cfg.max_length - 1
    head = limit if data_cfg.truncation == "head" else round(limit * HEAD_SHARE)
    cuts: list[int | None] = []
    for text, row in zip(texts, ids):
        # a review that fills the model's length was cut if one more token would have been read
        fills = len(row) - 1 == limit
        cut = fills and encode_texts(tokenizer, [text], limit + 2, data_cfg.truncation)[1][1] > limit + 1
        cuts.append(head if cut else None)
    return cuts


def integrated_gradients(model, ids: torch.Tensor, target: int, steps: int = IG_STEPS, temperature: float = 1.0,
                         window: int | None = None) -> tuple[np.ndarray, float]:
    """((T,) attributions to the probability of label `target`, [CLS]'s included; the integral's error
    sum(attributions) - (p(review) - p(baseline))) for one review's (T,) ids, integrated over `steps`
    Gauss-Legendre nodes. `model` is a CTransformer in eval mode; its logits are divided by `temperature` (its
    calibration) before the softmax. With `window`, the review is read as its windows (data.long_text), whose
    logits are averaged: the attributions are of every token of the whole review."""
    if steps < 1:
        raise TfmError(f"integrated gradients need at least 1 step, not {steps}")
    device = next(model.parameters()).device
    bounds = window_bounds(len(ids), window) if window else np.array([1, len(ids)])
    pieces = [torch.cat([ids[:1], ids[a:b]]) for a, b in itertools.pairwise(bounds)]
    rows = torch.nn.utils.rnn.pad_sequence(pieces, batch_first=True, padding_value=PAD_ID).to(device)  # (R, W)
    mask = rows != PAD_ID  # (R, W); [CLS] is never [PAD]
    baseline = rows.masked_fill(mask & (torch.arange(rows.size(1), device=device) > 0), PAD_ID)  # [CLS] stays
    R, W = rows.shape
    embedding = model.encoder.tok_emb

    def probability(logits: torch.Tensor) -> torch.Tensor:  # (b * R, L) -> (b,): of the windows' mean logits
        return (logits.float().view(-1, R, logits.size(-1)).mean(1) / temperature).softmax(-1)[:, target]

    with torch.no_grad():
        p_review, p_baseline = probability(model(torch.cat([rows, baseline]), mask.repeat(2, 1))).tolist()
        x, x0 = embedding(torch.cat([rows, baseline])).float().chunk(2)  # (R, W, C) each
    nodes, weights = np.polynomial.legendre.leggauss(steps)  # on [-1, 1]
    alpha = torch.as_tensor((nodes + 1) / 2, dtype=x.dtype, device=device)  # (n,): the nodes on [0, 1]
    w = torch.as_tensor(weights / 2, dtype=x.dtype, device=device)  # (n,): their weights on [0, 1]
    integral = torch.zeros_like(x)  # (R, W, C): the weighted sum of the nodes' gradients
    for start in range(0, steps, IG_BATCH):
        a = alpha[start : start + IG_BATCH]  # (b,)
        path = (x0 + a[:, None, None, None] * (x - x0)).flatten(0, 1).requires_grad_(True)  # (b * R, W, C)
        hook = embedding.register_forward_hook(lambda module, args, out, path=path: path)  # replaces the lookup
        try:
            with torch.enable_grad():
                p = probability(model(rows.repeat(len(a), 1), mask.repeat(len(a), 1)))  # (b,)
                (grad,) = torch.autograd.grad(p.sum(), path)  # (b * R, W, C): each node's own gradient
        finally:
            hook.remove()
        integral += torch.einsum("b,brwc->rwc", w[start : start + IG_BATCH], grad.view(len(a), R, W, -1))
    per_row = ((x - x0) * integral).sum(-1).cpu().double().numpy()  # (R, W): summed over C
    attr = np.zeros(len(ids))
    for k, (a, b) in enumerate(itertools.pairwise(bounds)):
        attr[a:b] = per_row[k, 1 : 1 + b - a]  # a window's [CLS] is no token of the review: its attribution is 0
    return attr, float(attr.sum() - (p_review - p_baseline))


def explain_texts(model_dir: str | Path, texts: list[str], predictions: list[dict], device: str = "auto",
                  steps: int | None = None) -> list[Explained]:
    """The explanation of each text's predicted label (`predictions`: predict_texts' results for `texts`)."""
    from transformer_cli.evaluate import load_for_inference, window_of

    _, model, cfg, tokenizer, labels, temperature = load_for_inference(model_dir, device, "fp32")  # gradients in fp32
    ids = review_ids(tokenizer, texts, cfg.data)
    explained = []
    for text, row, spans, cut, p in zip(texts, ids, review_spans(tokenizer, texts, cfg.data),
                                        cut_positions(tokenizer, texts, ids, cfg.data), predictions, strict=True):
        attr, delta = integrated_gradients(model, row, labels.index(p["label"]), steps or IG_STEPS, temperature,
                                           window_of(cfg.data))
        tokens = [tokenizer.id_to_token(int(i)) for i in row[1:]]
        explained.append(Explained(text, tokens, attr[1:].tolist(), delta, spans, cut))
    return explained


# --------------------------------------------------------------------------- faithfulness


def hidden_probability(model, ids: torch.Tensor, target: int, hidden: list[np.ndarray],
                       temperature: float = 1.0) -> np.ndarray:
    """The probability of `target` (of the logits divided by `temperature`, the model's calibration) with
    each set of positions of `hidden` masked out (as padding), one review's (T,) ids; a batch of
    len(hidden) forward passes."""
    device = next(model.parameters()).device
    mask = torch.ones(len(hidden), len(ids), dtype=torch.bool)
    for row, positions in enumerate(hidden):
        mask[row, torch.as_tensor(positions, dtype=torch.long)] = False
    with torch.inference_mode():
        logits = model(ids.expand(len(hidden), -1).to(device), mask.to(device))  # (N, L)
    return (logits.float() / temperature).softmax(-1)[:, target].cpu().double().numpy()


def faithfulness(model, reviews: list[tuple[torch.Tensor, int, np.ndarray]], fraction: float = 0.1,
                 random_draws: int = 5, seed: int = 0, temperature: float = 1.0) -> dict:
    """Hide each review's most-attributed tokens (the top `fraction` of its tokens, at least one) and,
    separately, as many random ones (`random_draws` draws, averaged); report the mean drops of the
    label's probability and their ratio. `reviews`: ((T,) ids, target, (T-1,) attributions without
    [CLS]). A ratio well above 1 says the attributions point at what the model reads; it is None
    where hiding random tokens did not lower the probability, since then no ratio measures anything.
    Reviews of no token beyond [CLS] have nothing to hide and are left out of the means."""
    rng = np.random.default_rng(seed)
    top_drops, random_drops = [], []
    for ids, target, attr in reviews:
        n = len(ids) - 1
        if n == 0:
            continue
        k = max(1, round(fraction * n))
        top = 1 + np.argsort(-np.asarray(attr), kind="stable")[:k]  # positions after [CLS]
        draws = [1 + rng.choice(n, size=k, replace=False) for _ in range(random_draws)]
        p = hidden_probability(model, ids, target, [np.zeros(0, dtype=np.int64), top, *draws], temperature)
        top_drops.append(p[0] - p[1])
        random_drops.append(p[0] - p[2:].mean())
    if not top_drops:
        raise TfmError("no review has a token to hide; pass reviews with at least one word")
    top, rand = float(np.mean(top_drops)), float(np.mean(random_drops))
    return {"reviews": len(top_drops), "fraction": fraction, "top_drop": top, "random_drop": rand,
            "ratio": top / rand if rand > 0 else None}


# --------------------------------------------------------------------------- showing them


CUT_MARK = "\u2026"  # shown where a review longer than the model reads was cut


def shown_pieces(e: Explained) -> list[tuple[str, str, float]]:
    """The review's own text in order, as (kind, text, attribution): "token" for a piece's span (pieces
    that share characters, as the three of "ﬃ" do, as one span with their attributions' sum), "plain"
    for what lies between spans (spaces, characters the tokenizer dropped), "cut" for the ellipsis that
    stands for the text the model did not read (the middle with data.truncation "head_tail", the end
    with "head")."""
    pieces, pos = [], 0
    for i, ((start, end), a) in enumerate(zip(e.spans, e.attributions)):
        if i == e.cut:
            pieces.append(("cut", f" {CUT_MARK} " if i else f"{CUT_MARK} ", 0.0))
            pos = start
        if start < pos and pieces[-1][0] == "token":
            _, shared, total = pieces.pop()
            pieces.append(("token", shared + e.text[pos:end], total + a))
        else:
            if start > pos:
                pieces.append(("plain", e.text[pos:start], 0.0))
            pieces.append(("token", e.text[start:end], a))
        pos = max(pos, end)
    if e.cut is not None and e.cut == len(e.spans):
        pieces.append(("cut", f" {CUT_MARK}", 0.0))
    elif pos < len(e.text):
        pieces.append(("plain", e.text[pos:], 0.0))
    return pieces


def shown_text(tokens: list[str], cut: int | None = None) -> str:
    """Pieces as plain text where the review's own text is not at hand: a WordPiece continuation ("##ing")
    joins the piece before it, except across the `cut` (Explained.cut), marked by CUT_MARK."""
    text = ""
    for i, t in enumerate(tokens):
        if i == cut:
            text += f" {CUT_MARK} " if i else f"{CUT_MARK} "
        elif i:
            text += "" if t.startswith("##") else " "
        text += t.removeprefix("##")
    return text + (f" {CUT_MARK}" if cut is not None and cut == len(tokens) else "")


def _strengths(pieces: list[tuple[str, str, float]]) -> list[float]:
    """Each piece's attribution over the largest |attribution| of the tokens': in [-1, 1]."""
    peak = max((abs(a) for kind, _, a in pieces if kind == "token"), default=0.0)
    return [a / peak if peak > 0 else 0.0 for _, _, a in pieces]


def rich_text(e: Explained):
    """The review as a rich Text: green behind tokens that speak for the label, red against, by strength;
    a dim ellipsis where it was cut."""
    from rich.text import Text

    text = Text()
    pieces = shown_pieces(e)
    for (kind, piece, _), s in zip(pieces, _strengths(pieces)):
        if kind == "cut":
            text.append(piece, style="dim")
        elif kind == "plain" or abs(s) < 0.05:
            text.append(piece)
        else:
            fade = round(255 * (1 - abs(s)))
            rgb = (fade, 255, fade) if s > 0 else (255, fade, fade)
            text.append(piece, style=f"black on rgb({rgb[0]},{rgb[1]},{rgb[2]})")
    return text


PAGE_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; padding: 0 1rem; color: #111; }
h1 { font-size: 1.3rem; } h2 { font-size: 1.05rem; margin-bottom: 0.3rem; }
.review { line-height: 1.9; border: 1px solid #ddd; border-radius: 6px; padding: 0.6rem 0.8rem; white-space: pre-wrap; }
.t { border-radius: 3px; padding: 0.05rem 0; }
.legend span { padding: 0.1rem 0.4rem; border-radius: 3px; margin-right: 0.5rem; }
"""


LEGEND = ('<p class="legend"><span style="background: rgba(22,163,74,0.6)">for the label</span>'
          '<span style="background: rgba(220,38,38,0.6)">against it</span> (integrated gradients on the token '
          "embeddings; hover a token for its contribution to the label's probability)</p>")


def html_page(items: list[tuple[dict, Explained]]) -> str:
    """One self-contained page (no external resource): each review's label and probability (of its
    prediction, the dict) and its own text, each token's span's background green (for the label) or red
    (against) by the strength of its attribution, which its title gives, and an ellipsis where it was cut."""
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             "<title>tfm explain</title>", f"<style>{PAGE_STYLE}</style></head><body>",
             "<h1>Why each review got its label</h1>",
             LEGEND]
    for n, (prediction, e) in enumerate(items, 1):
        parts.append(f"<section><h2>{n}. {html.escape(prediction['label'])} ({prediction['score']:.3f})</h2>"
                     '<p class="review">')
        pieces = shown_pieces(e)
        for (kind, piece, a), s in zip(pieces, _strengths(pieces)):
            if kind == "cut":
                parts.append(f'<span class="cut" title="the review was cut here, to the {len(e.tokens)} tokens the '
                             f'model reads">{html.escape(piece)}</span>')
            elif kind == "plain":
                parts.append(html.escape(piece))
            else:
                colour = "22,163,74" if s > 0 else "220,38,38"
                parts.append(f'<span class="t" style="background: rgba({colour},{abs(s):.3f})" '
                             f'title="{a:+.4f}">{html.escape(piece)}</span>')
        parts.append("</p></section>")
    parts.append("</body></html>\n")
    return "".join(parts)


def write_html(path: Path, items: list[tuple[dict, Explained]]) -> None:
    atomic_write_text(path, html_page(items))
