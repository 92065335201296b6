"""TensorBoard pictures of a classifier's training, beside the scalars. At each validation pass, from its
logits: a precision-recall curve per class (`val_pr/LABEL`), the confusion matrix (`val/confusion_matrix`)
and the most confidently wrong reviews (`val/confidently_wrong`). At the end of training: one validation
review's attention maps, a panel per layer, heads averaged (`val/attention`).
"""

from __future__ import annotations

import numpy as np
import torch

from transformer_cli.calibration import softmax
from transformer_cli.data import Encoded
from transformer_cli.explain import cut_positions, shown_text
from transformer_cli.model import explicit_attention
from transformer_cli.report import confusion_figure, new_figure, plain, rgb_array, short

WRONG_SHOWN = 10  # reviews in the confidently-wrong panel
TEXT_CHARS = 300  # of each review shown there
ATTENTION_TOKENS = 40  # the review whose attention is drawn is cut to this many tokens, to stay legible


def log_validation(writer, step: int, metrics: dict, logits: torch.Tensor, enc: Encoded, names: list[str],
                   tokenizer, texts: list[str], data_cfg) -> None:
    """PR curves, confusion matrix and confidently-wrong panel of one validation pass (its metrics, (N, K)
    logits of `enc`, and the reviews `texts`); nothing without a writer (ranks other than the main one)."""
    if writer is None or not torch.isfinite(logits).all():  # a diverged pass: nothing to draw
        return
    probs = softmax(logits)
    for c, name in enumerate(names):
        writer.add_pr_curve(f"val_pr/{name}", enc.labels == c, probs[:, c], step)
    fig = confusion_figure(np.asarray(metrics["confusion_matrix"]), names)
    writer.add_image("val/confusion_matrix", rgb_array(fig), step, dataformats="HWC")
    writer.add_text("val/confidently_wrong", wrong_panel(probs, enc, names, tokenizer, texts, data_cfg), step)


def wrong_panel(probs: np.ndarray, enc: Encoded, names: list[str], tokenizer, texts: list[str], data_cfg,
                shown: int = WRONG_SHOWN) -> str:
    """A markdown table of the `shown` wrong predictions with the highest probability (`texts`: the
    reviews of `enc`, to tell where one was cut to data_cfg's length)."""
    predicted = probs.argmax(axis=1)
    wrong = np.nonzero(predicted != enc.labels)[0]
    if not len(wrong):
        return f"No validation review of {len(enc)} is predicted wrong."
    worst = wrong[np.argsort(-probs[wrong, predicted[wrong]], kind="stable")[:shown]]
    lines = [f"The {len(worst)} most confidently wrong of {len(wrong)} wrong validation reviews (of {len(enc)}):", "",
             "| probability | true | predicted | review |", "|---|---|---|---|"]
    rows = [enc.ids[enc.offsets[i] : enc.offsets[i + 1]] for i in worst]
    for i, row, cut in zip(worst, rows, cut_positions(tokenizer, [texts[i] for i in worst], rows, data_cfg)):
        lines.append(f"| {probs[i, predicted[i]]:.3f} | {_cell(names[enc.labels[i]])} | {_cell(names[predicted[i]])} | "
                     f"{_cell(review_text(row, cut, tokenizer))} |")
    return "\n".join(lines)


def review_text(ids: np.ndarray, cut: int | None, tokenizer, chars: int = TEXT_CHARS) -> str:
    """A review's ids ([CLS] first) as the model read them, shown as `tfm explain` shows them (an
    ellipsis where it was cut, cut_positions' `cut`), cut to `chars` characters."""
    text = shown_text([tokenizer.id_to_token(int(t)) or "?" for t in ids[1:]], cut)
    return text if len(text) <= chars else text[: chars - 3] + "..."


def _cell(text: str) -> str:
    """`text` as one markdown table cell: on one line, its bars escaped."""
    return " ".join(text.split()).replace("|", "\\|")


# --------------------------------------------------------------------------- attention


def attention_maps(model, ids: torch.Tensor, mask: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(per layer, the (B, H, T, T) attention probabilities; the (B, K) logits) of a forward pass in eval mode.

    A hook before each block's attention recomputes q and k from its input; explicit_attention with the
    identity as values returns the attention matrix itself (att @ I = att), masked and scaled as the model does.
    """
    maps: list[torch.Tensor] = []

    def capture(attn, args) -> None:
        x, m, *rope = args  # rope: the rotary angles, where the model has them
        B, T, _ = x.shape
        q, k, _ = attn.heads(x, rope[0] if rope else None)  # (B, H, T, Dh) each
        eye = torch.eye(T, dtype=q.dtype, device=q.device).expand(B, attn.n_heads, T, T)  # (B, H, T, T)
        maps.append(explicit_attention(q, k, eye, m[:, None, None, :]))

    hooks = [block.attn.register_forward_pre_hook(capture) for block in model.encoder.blocks]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(ids, mask)
    finally:
        model.train(was_training)
        for h in hooks:
            h.remove()
    return maps, logits


def pick_review(enc: Encoded, tokens: int = ATTENTION_TOKENS) -> int:
    """The first validation review of at most `tokens` tokens, else the shortest."""
    fits = np.nonzero(enc.lengths <= tokens)[0]
    return int(fits[0]) if len(fits) else int(np.argmin(enc.lengths))


def log_attention(writer, step: int, model, enc: Encoded, names: list[str], tokenizer,
                  temperature: float = 1.0) -> None:
    """One validation review's attention maps, a panel per layer (heads averaged), as an image, titled
    with its true label and the label predicted from the tokens drawn, with its probability calibrated
    by `temperature` (what `tfm predict` prints for the review, where it is drawn whole)."""
    if writer is None or not len(enc):
        return
    i = pick_review(enc)
    drawn = min(ATTENTION_TOKENS, model.encoder.max_length)  # a windowed run's review may be longer than it reads
    ids_np = enc.ids[enc.offsets[i] : enc.offsets[i + 1]][:drawn].astype(np.int64)
    device = next(model.parameters()).device
    ids = torch.from_numpy(ids_np)[None].to(device)  # (1, T)
    mask = torch.ones_like(ids, dtype=torch.bool)
    maps, logits = attention_maps(model, ids, mask)
    maps = [m[0].mean(0).float().cpu().numpy() for m in maps]  # L x (T, T)
    p = (logits.float() / temperature).softmax(-1)[0].cpu()
    tokens = [tokenizer.id_to_token(int(t)) or "?" for t in ids_np]
    title = f"true {short(names[enc.labels[i]])}, predicted {short(names[int(p.argmax())])} ({float(p.max()):.3f})"
    if len(ids_np) < enc.lengths[i]:  # the prediction is of the tokens drawn, not of the whole review
        title += f" from its first {len(ids_np)} of {enc.lengths[i]} tokens"
    writer.add_image("val/attention", rgb_array(attention_figure(maps, tokens, title)), step, dataformats="HWC")


def attention_figure(maps: list[np.ndarray], tokens: list[str], title: str):
    """A heat map per layer: row = the token attending, column = the token attended to."""
    n, size = len(maps), 1.5 + 0.12 * len(tokens)
    cols = min(n, 3)
    rows = -(-n // cols)
    fig = new_figure(cols * size + 0.5, rows * size + 0.6)
    fig.suptitle(f"Attention, heads averaged: {plain(title)}", wrap=True)
    for layer, att in enumerate(maps):
        ax = fig.add_subplot(rows, cols, layer + 1)
        ax.imshow(att, cmap="viridis", vmin=0)
        ax.set_xticks(range(len(tokens)), [plain(t) for t in tokens], rotation=90, fontsize=6)
        ax.set_yticks(range(len(tokens)), [plain(t) for t in tokens], fontsize=6)
        ax.set_title(f"layer {layer + 1}", fontsize=9)
    return fig
