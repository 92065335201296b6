"""The CTransformer classifier, from scratch: attention -> block -> encoder -> classifier.

Shapes: B batch, T tokens, C = d_model, H heads, Dh = C // H head size.
`mask` is a (B, T) bool tensor, True at real tokens; every sequence has at least one (its [CLS]).
For inference, a `Packed` may stand in its place: B texts laid end to end in one row of N tokens.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from transformer_cli import kernels
from transformer_cli.config import ModelConfig
from transformer_cli.data import PAD_ID, round_width

Rotary = tuple[torch.Tensor, torch.Tensor]  # rope's (cos, sin), each (B or 1, T, 1, Dh/2): see `rotary`


class Packed(NamedTuple):
    """B texts laid end to end in one row of N tokens, with no padding: text b is tokens
    offsets[b]:offsets[b + 1]. It stands where a (B, T) padding mask would, for states of shape (1, N, C):
    attention keeps each text to itself and pooling pools each text. A pass then costs the texts' tokens
    and no more, however scattered their lengths (`CTransformer.packed_logits`)."""

    offsets: torch.Tensor  # (B + 1,) int64
    longest: int  # tokens in the longest text

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets.diff()  # (B,)

    def text_of_token(self) -> torch.Tensor:
        return torch.repeat_interleave(torch.arange(len(self.lengths), device=self.offsets.device), self.lengths)  # (N,)

    def positions(self) -> torch.Tensor:
        """(1, N): each token's place in its text."""
        n = int(self.offsets[-1])
        starts = torch.repeat_interleave(self.offsets[:-1], self.lengths)  # (N,)
        return (torch.arange(n, device=self.offsets.device) - starts)[None]

    def pad(self, x: torch.Tensor, fill: float = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, ...) -> ((B, longest, ...) with `fill` at padding, its (B, longest) mask): the padded layout."""
        columns = torch.arange(self.longest, device=x.device)
        mask = columns < self.lengths[:, None]  # (B, T)
        index = (self.offsets[:-1, None] + columns).clamp(max=max(x.size(0) - 1, 0))  # (B, T)
        return x[index].masked_fill_(~mask.view(*mask.shape, *[1] * (x.dim() - 1)), fill), mask


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)  # fused Q, K, V projections
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout
        self.attn_dropout = cfg.attn_dropout
        self.fused = cfg.attention in ("auto", "sdpa")
        self.cpu_kernel = cfg.attention == "auto"  # kernels.attention_bf16 for bf16 inference on CPUs that have it

    def forward(self, x: torch.Tensor, mask: torch.Tensor | Packed, rope: Rotary | None = None) -> torch.Tensor:
        qkv = self.qkv(x)  # (B, T, 3C)
        if rope is not None:
            qkv = rotate_qk(qkv, self.n_heads, rope)  # (B, T, 3C)
        kernel = self.cpu_kernel and not self.training
        if isinstance(mask, Packed):  # (1, N, 3C): the texts end to end
            y = kernels.attention_bf16_packed(qkv[0], mask.offsets, mask.longest, self.n_heads) if kernel else None
            if y is None:  # the padded layout, for this layer's attention only
                padded, real = mask.pad(qkv[0])  # (B, T, 3C), (B, T)
                y = self.attend(padded, real)[real]  # (N, C)
            y = y[None]  # (1, N, C)
        else:
            y = kernels.attention_bf16(qkv, mask, self.n_heads) if kernel else None  # None where it does not apply
            if y is None:
                y = self.attend(qkv, mask)
        return dropout(self.proj(y), self.dropout, self.training)

    def attend(self, qkv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, T, 3C) fused projections -> (B, T, C) attention output, heads merged."""
        B, T, C3 = qkv.shape
        q, k, v = split_heads(qkv, self.n_heads)  # 3 x (B, H, T, Dh)
        key_mask = mask[:, None, None, :]  # (B, 1, 1, T): padding keys get no attention
        p = self.attn_dropout if self.training else 0.0
        if self.fused:
            y = fused_attention(q, k, v, key_mask, p)
        else:
            y = explicit_attention(q, k, v, key_mask, p)
        return y.transpose(1, 2).reshape(B, T, C3 // 3)  # (B, T, C): heads merged


def split_heads(qkv: torch.Tensor, n_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, T, 3C) fused projections -> q, k, v, each (B, H, T, Dh)."""
    B, T, C3 = qkv.shape
    return tuple(t.transpose(1, 2) for t in qkv.view(B, T, 3, n_heads, C3 // (3 * n_heads)).unbind(2))


def rotary(positions: torch.Tensor, head_dim: int) -> Rotary:
    """Rotary position embedding (Su et al. 2021, RoFormer): the angles by which `rotate_qk` turns each
    pair of a head's dimensions (i, i + Dh/2) at each position, at frequencies 10000^(-2i/Dh). q.k then
    depends on the two tokens' distance, not on where they stand. `positions`: (T,) or (B, T)."""
    inv_freq = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)
    angles = (positions.float()[..., None] * inv_freq).unsqueeze(-2)  # (T or B x T, 1, Dh/2)
    if angles.dim() == 3:
        angles = angles[None]  # (1, T, 1, Dh/2)
    return angles.cos(), angles.sin()


def rotate_qk(qkv: torch.Tensor, n_heads: int, rope: Rotary) -> torch.Tensor:
    """(B, T, 3C) fused projections with q and k rotated by `rope` (see `rotary`), v as it was.

    It runs in qkv's own dtype (bf16 under autocast) rather than cast to fp32 and back: elementwise work
    on every layer, forward and backward, where the casts and copies cost more than the rounding. Under
    autograd it is `_RotateQK`, whose backward is the inverse rotation of the gradient."""
    cos, sin = (t.to(qkv.dtype) for t in rope)  # (B or 1, T, 1, Dh/2) each
    if torch.is_grad_enabled() and qkv.requires_grad:
        return _RotateQK.apply(qkv, cos, sin, n_heads)
    return _turn(qkv, n_heads, cos, sin)


def _turn(qkv: torch.Tensor, n_heads: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """A new (B, T, 3C) tensor: qkv with each pair (i, i + Dh/2) of q's and k's heads turned by the angle
    whose cos and sin are given (B or 1, T, 1, Dh/2), and v copied. Written into one output tensor, so
    that neither the halves nor q, k and v are concatenated."""
    C2 = 2 * qkv.size(-1) // 3  # q's and k's width, 2C
    heads = (2 * n_heads, C2 // (2 * n_heads))  # 2H heads of Dh: q's, then k's
    out = torch.empty_like(qkv)  # (B, T, 3C)
    out[..., C2:] = qkv[..., C2:]  # v
    x1, x2 = qkv[..., :C2].unflatten(2, heads).chunk(2, dim=-1)  # (B, T, 2H, Dh/2) each
    y1, y2 = out[..., :C2].unflatten(2, heads).chunk(2, dim=-1)  # views of out, as x1, x2
    torch.mul(x1, cos, out=y1).addcmul_(x2, sin, value=-1)  # x1 cos - x2 sin
    torch.mul(x2, cos, out=y2).addcmul_(x1, sin)  # x2 cos + x1 sin
    return out


class _RotateQK(torch.autograd.Function):
    """rotate_qk under autograd. A rotation's gradient is the gradient turned back by the same angle
    (its matrix is orthogonal), so the backward is `_turn` with -sin: one pass over q and k each way,
    keeping only cos and sin, where autograd's graph of the forward keeps both halves and concatenates."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.n_heads = n_heads
        return _turn(qkv, n_heads, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _turn(grad.contiguous(), ctx.n_heads, cos, -sin), None, None, None


def fused_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor, p: float = 0.0
) -> torch.Tensor:
    """F.scaled_dot_product_attention; on the CPU in fp32 even under bf16 autocast (which would run it
    in bf16): the CPU flash kernel took 1.8x its fp32 time in bf16 at head size 16 and 1.2x at head
    size 32, forward and backward at T=256 (docs/experiments.md)."""
    if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=key_mask, dropout_p=p)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, dropout_p=p)


def explicit_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor, p: float = 0.0
) -> torch.Tensor:
    """softmax(q k^T / sqrt(Dh)) v with padding keys masked out; the reference for the fused path."""
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))  # (B, H, T, T)
    att = att.masked_fill(~key_mask, float("-inf")).softmax(dim=-1)
    att = F.dropout(att, p, p > 0)
    return att @ v  # (B, H, T, Dh)


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """F.dropout; on the CPU its mask compares 16 random bits per element, drawn 64 at a time: about
    half of torch.rand's time there, and a third of bernoulli_'s. p is rounded to a multiple of 2^-16,
    and survivors are scaled by 1 / (1 - that p)."""
    if not training or p == 0.0 or x.device.type != "cpu":
        return F.dropout(x, p, training)
    n = x.numel()
    bits = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-(2**63), None)  # every bit uniform
    dropped = min(round(p * 65536), 65535)  # of the 65536 values of 16 bits
    keep = bits.view(torch.int16)[:n].view(x.shape) >= dropped - 32768  # (..): as x
    return x * keep.to(x.dtype).mul_(65536 / (65536 - dropped))


class Block(nn.Module):
    """Self-attention and a feed-forward layer, each with a residual and LayerNorm (post or pre)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pre_norm = cfg.norm == "pre"
        self.attn = SelfAttention(cfg)
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.ff = feed_forward(cfg)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, mask: torch.Tensor | Packed, rope: Rotary | None = None) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.attn(self.norm1(x), mask, rope)
            return x + dropout(self.ff(self.norm2(x)), self.dropout, self.training)
        x = self.norm1(x + self.attn(x, mask, rope))
        return self.norm2(x + dropout(self.ff(x), self.dropout, self.training))


def feed_forward(cfg: ModelConfig) -> nn.Module:
    """The block's position-wise layer: GELU between two linear maps (`ff = "gelu"`, hidden ff_mult * C), or
    GEGLU (`"geglu"`)."""
    if cfg.ff == "geglu":
        return GEGLU(cfg.d_model, geglu_hidden(cfg))
    return nn.Sequential(
        nn.Linear(cfg.d_model, cfg.ff_mult * cfg.d_model),
        nn.GELU(),
        nn.Linear(cfg.ff_mult * cfg.d_model, cfg.d_model),
    )


def geglu_hidden(cfg: ModelConfig) -> int:
    """Two thirds of the plain layer's hidden width, rounded up to a multiple of 64: three matrices instead of
    two, so that parameters and FLOPs stay about the same."""
    return -(-2 * cfg.ff_mult * cfg.d_model // 3 // 64) * 64


class GEGLU(nn.Module):
    """Gated feed-forward layer (Shazeer 2020): down(GELU(x W) * x V). One of the few transformer changes found to
    help across tasks at equal compute (Narang et al. 2021); Cramming BERT (Geiping & Goldstein 2022) pretrains
    with it on a one-GPU-day budget."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        # W and V as two layers, not one of twice the width cut in halves: elementwise work on the halves' strided
        # views made the layer 1.24x the plain one's time on a CPU, against 1.07x (docs/experiments.md).
        self.gate = nn.Linear(d_model, hidden)
        self.value = nn.Linear(d_model, hidden)
        self.down = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.gate(x)) * self.value(x))  # (..., hidden) -> (..., C)


class Encoder(nn.Module):
    """Token + position embeddings and the stack of blocks: (B, T) ids -> (B, T, C) states.
    With `pos_emb = "rope"` positions enter inside attention instead (`rotary`), not as an embedding.

    Kept apart from the classifier so that other heads (e.g. masked-LM pretraining) can share it.
    """

    def __init__(self, cfg: ModelConfig, vocab_size: int, max_length: int):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, cfg.d_model, sparse=cfg.lazy_embeddings)
        self.rope_dim = cfg.d_model // cfg.n_heads if cfg.pos_emb == "rope" else 0
        self.pos_emb = None
        if cfg.pos_emb == "learned":
            self.pos_emb = nn.Embedding(max_length, cfg.d_model)
        elif cfg.pos_emb == "sinusoidal":
            self.register_buffer("pos_table", sinusoidal_table(max_length, cfg.d_model), persistent=False)
        self.dropout = cfg.dropout
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model) if cfg.norm == "pre" else nn.Identity()
        self.max_length = max_length

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """`positions` (B, T): each token's place in its text, when it is not its column (see `compact`)."""
        return self.contextualize(self.embed(ids, positions), mask, positions)

    def contextualize(self, x: torch.Tensor, mask: torch.Tensor | Packed, positions: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """(B, T, C) embeddings -> (B, T, C) states: the blocks, then the final norm."""
        rope = self.rotary(x, positions)
        for block in self.blocks:
            x = block(x, mask, rope)
        return self.norm(x)

    def rotary(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> Rotary | None:
        """rope's angles for (B, T, C) states at `positions` (default: their columns); None without rope."""
        if not self.rope_dim:
            return None
        return rotary(torch.arange(x.size(1), device=x.device) if positions is None else positions, self.rope_dim)

    def embed(self, ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T) ids -> (B, T, C): token plus position embeddings (none with rope), with dropout.
        `positions` (B, T): each token's place in its text, when it is not its column."""
        T = ids.size(1)
        if positions is None and T > self.max_length:
            raise ValueError(f"sequence of {T} tokens is longer than max_length {self.max_length}")
        if self.rope_dim:
            return dropout(self.tok_emb(ids), self.dropout, self.training)  # (B, T, C)
        table = self.pos_emb.weight if self.pos_emb is not None else self.pos_table  # (max_length, C)
        # F.embedding, not table[positions]: its backward sums the rows' gradients in a fixed order
        pos = table[:T] if positions is None else F.embedding(positions, table)  # (T, C) or (B, T, C)
        return dropout(self.tok_emb(ids) + pos, self.dropout, self.training)  # (B, T, C)


def sinusoidal_table(length: int, dim: int) -> torch.Tensor:
    pos = torch.arange(length, dtype=torch.float32)[:, None]  # (T, 1)
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq[: dim // 2])
    return table  # (T, C)


def pool(h: torch.Tensor, mask: torch.Tensor | Packed, how: str) -> torch.Tensor:
    """(B, T, C) states -> (B, C), ignoring padding positions; (1, N, C) packed states -> (B, C)."""
    if isinstance(mask, Packed):
        return pool_packed(h[0], mask, how)
    if how == "first":
        return h[:, 0]
    m = mask.unsqueeze(-1)  # (B, T, 1)
    if how == "max":
        return h.masked_fill(~m, float("-inf")).amax(dim=1)
    return (h * m).sum(dim=1) / m.sum(dim=1).clamp(min=1).to(h.dtype)


def pool_packed(h: torch.Tensor, packed: Packed, how: str) -> torch.Tensor:
    """(N, C) states of packed texts -> (B, C), as `pool` gives them padded."""
    if how == "first":
        return h[packed.offsets[:-1]]
    text = packed.text_of_token()[:, None].expand_as(h)  # (N, C)
    B = len(packed.lengths)
    if how == "max":
        return h.new_full((B, h.size(1)), float("-inf")).scatter_reduce_(0, text, h, "amax")
    sums = h.new_zeros((B, h.size(1)), dtype=torch.float32).scatter_add_(0, text, h.float())  # (B, C)
    return (sums / packed.lengths[:, None].clamp(min=1)).to(h.dtype)


def drop_tokens(mask: torch.Tensor, p: float) -> torch.Tensor:
    """Word dropout: hide each real token with probability p, as if it were padding.

    Position 0 ([CLS]) always stays, so no sequence is left empty.
    """
    keep = torch.rand(mask.shape, device=mask.device) >= p  # (B, T)
    keep[:, 0] = True
    return mask & keep


def compact(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Move each row's real tokens to its front, in order, and cut the columns no row then needs.

    Returns (ids, mask, positions), each (B, W): W is the most real tokens in a row, rounded up to a
    multiple of data.PAD_MULTIPLE as `collate` rounds widths (no wider than T); `positions` holds
    each token's column in the input, and the columns after a row's tokens hold [PAD]. The encoder
    never reads a hidden token: it is no key, it is not pooled, and its own state feeds only
    itself. So after word dropout the encoder gives the kept tokens the same states over fewer
    columns: about 0.4 of them at token_dropout 0.7.
    """
    counts = mask.sum(dim=1)  # (B,)
    width = min(round_width(int(counts.max())), mask.size(1))
    positions = torch.sort((~mask).to(torch.uint8), dim=1, stable=True).indices[:, :width]  # (B, W): kept first
    kept = torch.arange(width, device=mask.device) < counts[:, None]  # (B, W)
    return ids.gather(1, positions).masked_fill(~kept, PAD_ID), kept, positions  # hidden ids out of the lookup


def adversarial_step(loss: torch.Tensor, x: torch.Tensor, mask: torch.Tensor, eps: float) -> torch.Tensor:
    """(B, T, C): the perturbation of embeddings `x` that raises `loss` most to first order, each
    text's scaled to `eps` times the norm of its real tokens' embeddings; held fixed (no gradient).

    Miyato et al. (2017) normalise the gradient over the whole text, as here; scaling by the
    embeddings' own norm makes `eps` a share, the same for any width, length or embedding scale.
    """
    (g,) = torch.autograd.grad(loss, x, retain_graph=True)  # (B, T, C); the parameters' gradients untouched
    return scaled_like(g, x, mask, eps)


VAT_PROBE = 1e-3  # small: the change in the predictions it causes is what the gradient measures


def virtual_adversarial_step(logits_at: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                             mask: torch.Tensor, target: torch.Tensor, eps: float) -> torch.Tensor:
    """(B, T, C): the perturbation of embeddings `x` that moves the predictions `logits_at(x)` away
    from `target` (B, K logits, held fixed) the most, found without labels: virtual adversarial
    training's one power iteration (Miyato et al. 2017), from a random direction of VAT_PROBE times
    the embeddings' norm. Scaled as adversarial_step's; held fixed (no gradient)."""
    probe = (x.detach() + scaled_like(torch.randn_like(x), x, mask, VAT_PROBE)).requires_grad_()  # (B, T, C)
    (g,) = torch.autograd.grad(kl_from(target, logits_at(probe)).mean(), probe)  # (B, T, C)
    return scaled_like(g, x, mask, eps)


def scaled_like(v: torch.Tensor, x: torch.Tensor, mask: torch.Tensor, eps: float) -> torch.Tensor:
    """(B, T, C): `v` on the real tokens, each text's scaled to `eps` times the norm of its real tokens'
    embeddings `x`; detached, in x's dtype."""
    v, real = v.detach().float(), mask.unsqueeze(-1)  # (B, T, C), (B, T, 1)
    x_norm = (x.detach().float() * real).flatten(1).norm(dim=1)  # (B,)
    v_norm = (v * real).flatten(1).norm(dim=1).clamp(min=1e-12)  # (B,)
    return (v * real * (eps * x_norm / v_norm)[:, None, None]).to(x.dtype)


def kl_from(target: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """(B,): each text's KL(softmax(target) || softmax(logits)), from (B, K) logits."""
    p, q = target.float().log_softmax(-1), logits.float().log_softmax(-1)  # (B, K) each
    return F.kl_div(q, p, log_target=True, reduction="none").sum(-1)


class NgramBag(nn.Module):
    """The wide path: a linear model over the bag of a text's token n-grams, up to length `order`.

    Each n-gram owns a vector of label scores; a text scores their sum over sqrt(count). With
    `binary` (each distinct n-gram counts once) that is logistic regression on L2-normalised
    n-gram features; without, repeated n-grams add up and the sum is divided by the square root
    of all occurrences. Rows [0, vocab_size) are the unigrams (token ids); longer n-grams share the
    next `buckets` rows by a rolling hash.
    """

    def __init__(
        self, vocab_size: int, buckets: int, num_labels: int, order: int = 3, binary: bool = True, sparse: bool = False
    ):
        super().__init__()
        self.vocab_size, self.buckets, self.order, self.binary = vocab_size, buckets, order, binary
        # Starts silent (the transformer's logits alone). Built from zeros rather than zeroed after
        # nn.Embedding's random init, which took 0.09 s of `tfm predict` for the default's 4.2M rows.
        zeros = torch.zeros(vocab_size + buckets, num_labels)
        self.table = nn.Embedding.from_pretrained(zeros, freeze=False, sparse=sparse)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        grams, keep = [ids], [mask]
        h, m = ids, mask
        for n in range(2, self.order + 1):  # extend each (n-1)-gram by the token after it
            h = (h[:, :-1] * 1_000_003 + ids[:, n - 1 :]) % self.buckets  # (B, T-n+1)
            m = m[:, :-1] & mask[:, n - 1 :]  # (B, T-n+1)
            grams.append(h + self.vocab_size)
            keep.append(m)
        grams, keep = torch.cat(grams, dim=1), torch.cat(keep, dim=1)  # (B, G)
        if self.binary:  # sort each row, then keep the first of each run of equal n-grams
            grams = grams.masked_fill(~keep, -1).sort(dim=1).values  # (B, G), dropped ones first
            keep = grams >= 0
            keep[:, 1:] &= grams[:, 1:] != grams[:, :-1]
            grams = grams.clamp(min=0)
        # n-grams that reach into padding look up [PAD]'s row, never a real one: with sparse gradients (LazyAdamW)
        # a row that is looked up counts as used, and its moments would move it
        grams = grams.masked_fill(~keep, PAD_ID)
        scores = self.table(grams) * keep.unsqueeze(-1)  # (B, G, num_labels)
        return scores.sum(dim=1) / keep.sum(dim=1, keepdim=True).sqrt().to(scores.dtype)


class CTransformer(nn.Module):
    """The classifier: the encoder's states pooled over the sequence, then a linear head; with
    `ngram_buckets`, the n-gram path's scores added to its logits."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, max_length: int, num_labels: int = 2):
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg, vocab_size, max_length)
        self.head = nn.Linear(cfg.d_model, num_labels)
        init_weights(self, cfg.n_layers)
        self.ngrams = (
            NgramBag(vocab_size, cfg.ngram_buckets, num_labels, cfg.ngram_order, cfg.ngram_binary, cfg.lazy_embeddings)
            if cfg.ngram_buckets else None
        )

    def forward(
        self, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor | None = None, label_smoothing: float = 0.0,
        adversarial_eps: float = 0.0, virtual_adversarial_eps: float = 0.0,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The logits, or with `labels` the logits and the training loss.

        With `ngram_own_loss`, the n-gram path learns from its own loss, as a linear model alone
        would, and the transformer from the loss of the sum with the path's scores held fixed:
        it learns what the path gets wrong.

        In training, two regularisers of Miyato et al. (2017) move the transformer's embeddings by a
        share of their norm and add a loss there. With `adversarial_eps` > 0: the loss again, in the
        direction that raises it most (see `adversarial_step`). With `virtual_adversarial_eps` > 0:
        the KL divergence of the predictions there from the clean ones, in the direction that changes
        them most, which needs no label (see `virtual_adversarial_step`).
        """
        wide = None if self.ngrams is None else self.ngrams(ids, mask)  # (B, num_labels)
        positions = None
        if self.training and self.cfg.token_dropout > 0:  # the transformer's regulariser only
            mask = drop_tokens(mask, self.cfg.token_dropout)
            ids, mask, positions = compact(ids, mask)  # (B, W) each, W a little over (1 - token_dropout) T
        x = self.encoder.embed(ids, positions)  # (B, T or W, C)
        deep = self.deep_logits(x, mask, positions)  # (B, num_labels)
        logits = deep if wide is None else deep + wide
        if labels is None:
            return logits

        def loss(x: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(x.float(), labels, label_smoothing=label_smoothing)

        if wide is None or not self.cfg.ngram_own_loss:
            objective = loss(logits)
        else:
            objective = loss(deep + wide.detach()) + loss(wide)
        if not self.training:
            return logits, objective
        fixed = 0.0 if wide is None else wide.detach()  # the perturbations are the transformer's alone

        def logits_at(x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, num_labels)
            return self.deep_logits(x, mask, positions) + fixed

        if adversarial_eps > 0:
            x_adv = x + adversarial_step(loss(deep + fixed), x, mask, adversarial_eps)  # (B, T, C)
            objective = objective + loss(logits_at(x_adv))
        if virtual_adversarial_eps > 0:
            target = (deep + fixed).detach()  # (B, num_labels): the clean predictions, held fixed
            x_vadv = x + virtual_adversarial_step(logits_at, x, mask, target, virtual_adversarial_eps)  # (B, T, C)
            objective = objective + kl_from(target, logits_at(x_vadv)).mean()
        return logits, objective

    def packed_logits(self, ids: torch.Tensor, packed: Packed) -> torch.Tensor:
        """(B, num_labels) logits of B texts laid end to end ((N,) ids; see Packed): those `forward` gives
        them padded, with no work spent on padding. For inference: `tfm serve`'s few texts of scattered
        lengths cost their own tokens, where padded batches cost more passes or padding."""
        wide = None if self.ngrams is None else self.ngrams(*packed.pad(ids, PAD_ID))  # (B, num_labels)
        positions = packed.positions()  # (1, N)
        deep = self.deep_logits(self.encoder.embed(ids[None], positions), packed, positions)  # (B, num_labels)
        return deep if wide is None else deep + wide

    def deep_logits(self, x: torch.Tensor, mask: torch.Tensor | Packed, positions: torch.Tensor | None = None
                    ) -> torch.Tensor:
        """(B, T, C) embeddings -> (B, num_labels): the transformer's logits."""
        return self.head(pool(self.encoder.contextualize(x, mask, positions), mask, self.cfg.pooling))

    def param_groups(self, weight_decay: float, layer_lr_decay: float = 1.0) -> list[dict]:
        """Weight decay on matrices (linear and embedding weights) only, not biases or norms; with
        `layer_lr_decay` < 1, lower layers learn at lower rates (see `layer_groups`).

        The n-gram table, a linear model, learns at `ngram_lr_scale` times the rate (`lr_scale`).
        """
        wide = [] if self.ngrams is None else [self.ngrams.table.weight]
        named = [(n, p) for n, p in self.named_parameters() if not any(p is w for w in wide)]
        groups = layer_groups(named, self.cfg.n_layers, weight_decay, layer_lr_decay)
        if wide:
            groups.append({"params": wide, "weight_decay": weight_decay, "lr_scale": self.cfg.ngram_lr_scale})
        return groups

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


class LMHead(nn.Module):
    """A masked-LM output layer: a transform of the states, then scores against the token embedding
    (the output layer shares its weights, as BERT's does) plus a bias per token.

    Its rows (the masked tokens) are padded to a multiple of ROW_MULTIPLE for the matmuls and cut
    after. Their number changes with every batch, and on the CPU each new matmul shape makes oneDNN
    build and cache another packed copy of the (V, C) embedding, so that memory grew by gigabytes
    (docs/experiments.md, "The masked-LM head's rows padded")."""

    ROW_MULTIPLE = 64

    def __init__(self, d_model: int, vocab_size: int):
        super().__init__()
        self.transform = nn.Sequential(nn.Linear(d_model, d_model), nn.GELU(), nn.LayerNorm(d_model))
        self.bias = nn.Parameter(torch.zeros(vocab_size))

    def forward(self, h: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        """(..., C) states and the (V, C) token embedding -> (..., V) token scores."""
        rows = h.reshape(-1, h.shape[-1])  # (N, C)
        n = rows.shape[0]
        scores = F.linear(self.transform(pad_rows(rows)), embedding, self.bias)[:n]  # (N, V)
        return scores.view(*h.shape[:-1], -1)  # (..., V)

    def loss(self, h: torch.Tensor, embedding: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean cross-entropy, accuracy) of the (N, C) states' scores against the (N,) `targets`: what
        F.cross_entropy(self(h, embedding).float(), targets) gives, without the (N, V) scores (see
        vocab_cross_entropy). Its rows are padded as forward's are."""
        rows = self.transform(pad_rows(h))[: h.shape[0]]  # (N, C)
        return vocab_cross_entropy(rows, embedding, self.bias, targets)


def pad_rows(rows: torch.Tensor) -> torch.Tensor:
    """(N, C) -> (N', C): zero rows appended up to the next multiple N' of LMHead.ROW_MULTIPLE."""
    return F.pad(rows, (0, 0, 0, -rows.shape[0] % LMHead.ROW_MULTIPLE))


@torch.compiler.disable  # a loop over chunks of rows: traced, it would compile again for every number of rows
def vocab_cross_entropy(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, targets: torch.Tensor,
                        chunk_elements: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy, accuracy) of the scores F.linear(h, weight, bias) (N, V) against `targets`
    (N,), scored a chunk of rows at a time (about `chunk_elements` scores: 4M on a CPU; 256M on a GPU,
    a pretraining batch's masked rows in one chunk, which measured fastest there), under autocast in
    its dtype.

    The whole (N, V) scores are the largest tensors of pretraining: written, cast to fp32, normalised,
    and their gradient allocated again, each a pass over memory, and on the CPU each a fresh allocation
    whose pages the kernel zeroes. Here a chunk's scores stay small and are used at once: its loss,
    argmax and gradient (softmax minus one-hot) are taken together, and the gradients of h, weight and
    bias are summed in the forward pass; backward only scales them (the loss is a scalar)."""
    device = h.device.type
    chunk_elements = chunk_elements or (1 << 22 if device == "cpu" else 1 << 28)
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
    if torch.is_grad_enabled() and any(t.requires_grad for t in (h, weight, bias)):
        return _VocabCrossEntropy.apply(h, weight, bias, targets, dtype, chunk_elements)
    return _vocab_chunks(h, weight, bias, targets, dtype, chunk_elements, with_grads=False)[:2]


class _VocabCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, bias, targets, dtype, chunk_elements):
        loss, accuracy, *grads = _vocab_chunks(h, weight, bias, targets, dtype, chunk_elements, with_grads=True)
        ctx.save_for_backward(*grads)
        ctx.mark_non_differentiable(accuracy)
        return loss, accuracy

    @staticmethod
    def backward(ctx, grad_loss, _):
        grad_h, grad_weight, grad_bias = (g * grad_loss.to(g.dtype) for g in ctx.saved_tensors)
        return grad_h, grad_weight, grad_bias, None, None, None


def _vocab_chunks(h, weight, bias, targets, dtype, chunk_elements, with_grads):
    """vocab_cross_entropy's pass: (loss, accuracy) and, `with_grads`, the gradients of the mean loss
    with respect to h, weight and bias, in their own dtypes."""
    n, V = h.shape[0], weight.shape[0]
    step = max(LMHead.ROW_MULTIPLE, chunk_elements // V // LMHead.ROW_MULTIPLE * LMHead.ROW_MULTIPLE)
    with torch.autocast(h.device.type, enabled=False):
        hd, w, b = h.to(dtype), weight.to(dtype), bias.to(dtype)
        loss_sum = torch.zeros((), dtype=torch.float32, device=h.device)
        right = torch.zeros((), dtype=torch.int64, device=h.device)
        if with_grads:
            grad_h = torch.empty((n, h.shape[1]), dtype=torch.float32, device=h.device)
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device)
            grad_b = torch.zeros(V, dtype=torch.float32, device=h.device)
        for start in range(0, n, step):
            rows = hd[start : start + step]  # (k, C)
            k = rows.shape[0]
            rows = pad_rows(rows)  # (k', C): few matmul shapes, as LMHead's
            t = targets[start : start + step]  # (k,)
            scores = F.linear(rows, w, b).float()  # (k', V), the padding's rows last
            right += (scores[:k].max(-1).indices == t).sum()  # max: argmax's first maximum, in a quarter of its time
            logp = scores.log_softmax(-1)  # (k', V)
            del scores
            loss_sum -= logp[:k].gather(1, t[:, None]).sum()
            if not with_grads:
                continue
            g = logp.exp_()  # (k', V): softmax
            g[k:] = 0.0  # the padding's rows add nothing
            g[torch.arange(k, device=h.device), t] -= 1.0
            g = g.to(dtype)
            grad_h[start : start + k] = (g @ w)[:k].float()  # (k, C)
            grad_w += (g.t() @ rows).float()  # (V, C)
            grad_b += g.sum(0, dtype=torch.float32)
    loss, accuracy = loss_sum / n, right.float() / n
    if not with_grads:
        return loss, accuracy
    return loss, accuracy, (grad_h / n).to(h.dtype), (grad_w / n).to(weight.dtype), (grad_b / n).to(bias.dtype)


class MaskedLM(nn.Module):
    """The encoder with a masked-language-model head, for pretraining: predict each masked token's
    original id from its final state (BERT's objective). The head runs on the masked positions only:
    the (N, V) logits over the whole vocabulary are most of the objective's cost, and the other
    positions have no target."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, max_length: int):
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg, vocab_size, max_length)
        self.lm_head = LMHead(cfg.d_model, vocab_size)
        init_weights(self, cfg.n_layers)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(..., C) states -> (..., V) token scores."""
        return self.lm_head(h, self.encoder.tok_emb.weight)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, picked: torch.Tensor, targets: torch.Tensor,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the loss, {"accuracy"}) of the predictions at `picked`, (N,) flat indices into the (B, T)
        batch, whose original ids are `targets` (N,); `positions` (B, T) as Encoder.forward's."""
        h = self.encoder(ids, mask, positions)  # (B, T, C)
        loss, accuracy = self.lm_head.loss(h.flatten(0, 1)[picked], self.encoder.tok_emb.weight, targets)
        return loss, {"accuracy": accuracy}

    def param_groups(self, weight_decay: float, layer_lr_decay: float = 1.0) -> list[dict]:
        return layer_groups(list(self.named_parameters()), self.cfg.n_layers, weight_decay, layer_lr_decay)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


class Electra(nn.Module):
    """ELECTRA's replaced-token detection (Clark et al. 2020), for pretraining. A small generator,
    trained as a masked LM, fills the masked positions with tokens sampled from its predictions;
    the encoder (the discriminator, what fine-tuning starts from) then tells at every real token
    whether it is the original. Its loss reads every token, not only the masked 15%.

    The generator is `generator_layers` blocks over the encoder's own embeddings (ELECTRA ties
    them), with a masked-LM head tied to the token embedding. The objective is the generator's
    masked-LM loss plus `detection_weight` times the detection loss; no gradient flows through
    the sampling."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, max_length: int, generator_layers: int,
                 detection_weight: float):
        super().__init__()
        self.cfg, self.detection_weight = cfg, detection_weight
        self.encoder = Encoder(cfg, vocab_size, max_length)  # the discriminator
        self.generator = nn.ModuleList(Block(cfg) for _ in range(generator_layers))
        self.generator_norm = nn.LayerNorm(cfg.d_model) if cfg.norm == "pre" else nn.Identity()
        self.lm_head = LMHead(cfg.d_model, vocab_size)
        self.detector = nn.Linear(cfg.d_model, 1)
        init_weights(self, cfg.n_layers)

    per_token_stats = ("accuracy", "detection_loss")  # means over the real tokens; the others over the masked ones

    def objective_of(self, stats: dict[str, float]) -> float:
        """The objective of pooled figures (each a mean over what it is a mean of, as forward's are)."""
        return stats["generator_loss"] + self.detection_weight * stats["detection_loss"]

    def generate(self, ids: torch.Tensor, mask: torch.Tensor, picked: torch.Tensor,
                 positions: torch.Tensor | None = None) -> torch.Tensor:
        """The generator's (N, V) token scores at `picked`."""
        x = self.encoder.embed(ids, positions)  # (B, T, C)
        rope = self.encoder.rotary(x, positions)
        for block in self.generator:
            x = block(x, mask, rope)
        return self.lm_head(self.generator_norm(x).flatten(0, 1)[picked], self.encoder.tok_emb.weight)  # (N, V)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, picked: torch.Tensor, targets: torch.Tensor,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the objective, its parts: "accuracy" of the detection over the real tokens, and the
        generator's and the detector's own losses); the arguments as MaskedLM's."""
        logits = self.generate(ids, mask, picked, positions)  # (N, V)
        generator_loss = F.cross_entropy(logits.float(), targets)
        with torch.no_grad():
            sampled = torch.multinomial(logits.float().softmax(-1), 1).squeeze(1)  # (N,)
        corrupted = ids.clone()
        corrupted.view(-1)[picked] = sampled
        replaced = torch.zeros_like(mask)  # (B, T): a sample equal to the original counts as original
        replaced.view(-1)[picked] = sampled != targets
        scores = self.detector(self.encoder(corrupted, mask, positions)).squeeze(-1)  # (B, T)
        scores, replaced = scores[mask], replaced[mask]  # (M,) each: the real tokens
        detection_loss = F.binary_cross_entropy_with_logits(scores.float(), replaced.float())
        stats = {"accuracy": ((scores.detach() > 0) == replaced).float().mean(),
                 "generator_loss": generator_loss.detach(), "detection_loss": detection_loss.detach(),
                 "generator_accuracy": (logits.detach().argmax(-1) == targets).float().mean()}
        return generator_loss + self.detection_weight * detection_loss, stats

    def param_groups(self, weight_decay: float, layer_lr_decay: float = 1.0) -> list[dict]:
        return layer_groups(list(self.named_parameters()), self.cfg.n_layers, weight_decay, layer_lr_decay)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


class SkipGram(nn.Module):
    """Word vectors by skip-gram with negative sampling (word2vec; Mikolov et al. 2013), for pretraining
    the token embedding alone: each word's vector learns to tell the words near it from words drawn
    at random. With no attention and no scores over the whole vocabulary, it reads unlabelled text
    far faster than a masked LM does.

    The rest of the encoder is frozen at its initialisation and saved with it, so `tfm train
    --init-from` starts from the trained embedding with the other weights as from scratch. Scores
    are dot products divided by `TEMPERATURE`, which sets the scale the trained vectors settle at
    for the classifier's other weights, initialised at normal(0, 0.02)."""

    TEMPERATURE = 0.1

    def __init__(self, cfg: ModelConfig, vocab_size: int, max_length: int):
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg, vocab_size, max_length)
        self.context = nn.Embedding(vocab_size, cfg.d_model)  # each word's vector as a context of others
        init_weights(self, cfg.n_layers)
        nn.init.zeros_(self.context.weight)  # as word2vec: no pair scores anything before the words do
        self.encoder.requires_grad_(False)
        self.encoder.tok_emb.weight.requires_grad_(True)

    def forward(self, centers: torch.Tensor, contexts: torch.Tensor, negatives: torch.Tensor
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the loss, {"accuracy"}) of telling each of the (N,) `centers`' context word (N,) from its
        (N, K) `negatives`: per pair, the logistic losses of its K + 1 decisions summed, and their
        accuracy. Rows are gathered with index_select, whose backward is one index_add (an
        embedding's sorts the indices first: slower for the N x (K + 1) rows here)."""
        n, k = len(centers), negatives.shape[1]
        u = self.encoder.tok_emb.weight.index_select(0, centers)  # (N, C)
        words = torch.cat([contexts[:, None], negatives], dim=1).view(-1)  # (N * (K + 1),)
        v = self.context.weight.index_select(0, words).view(n, k + 1, self.cfg.d_model)  # (N, K + 1, C)
        scores = (u[:, None, :] * v).sum(-1).float() / self.TEMPERATURE  # (N, K + 1)
        sign = torch.full_like(scores, -1.0)
        sign[:, 0] = 1.0  # the context is to score above 0, the negatives below
        loss = F.softplus(-sign * scores).sum() / max(n, 1)  # a batch may have no pairs: its loss is then 0
        right = torch.count_nonzero(sign * scores.detach() > 0) / max(n * (k + 1), 1)
        return loss, {"accuracy": right}

    def param_groups(self, weight_decay: float, layer_lr_decay: float = 1.0) -> list[dict]:
        return layer_groups(list(self.named_parameters()), self.cfg.n_layers, weight_decay, layer_lr_decay)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def init_weights(model: nn.Module, n_layers: int) -> None:
    """Normal(0, 0.02) weights and zero biases, GPT-2 style: the projections that write into the
    residual stream shrink with depth."""
    def init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    model.apply(init)  # children before their parents: the order of the random draws
    for name, p in model.named_parameters():
        if name.endswith(("attn.proj.weight", "ff.2.weight", "ff.down.weight")):
            nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layers))


def layer_groups(named: list[tuple[str, nn.Parameter]], n_layers: int, weight_decay: float,
                 layer_lr_decay: float) -> list[dict]:
    """`decay_groups` per depth, each with the learning-rate multiple `lr_scale` = layer_lr_decay ** (its
    distance from the top): the heads and final norm learn at the full rate, block i at
    layer_lr_decay ** (n_layers - i), the embeddings at layer_lr_decay ** (n_layers + 1). This is
    fine-tuning's layer-wise (discriminative) learning rates, as ULMFiT and ELECTRA use them: the
    lower layers hold the most general features, which a few labelled examples should move least.
    At 1.0 it is `decay_groups` itself."""
    if layer_lr_decay == 1.0:
        return decay_groups([p for _, p in named], weight_decay)
    by_depth: dict[int, list[nn.Parameter]] = {}
    for name, p in named:
        block = re.match(r"encoder\.blocks\.(\d+)\.", name)
        embedding = name.startswith(("encoder.tok_emb.", "encoder.pos_emb."))
        depth = 0 if embedding else int(block.group(1)) + 1 if block else n_layers + 1
        by_depth.setdefault(depth, []).append(p)
    return [{**group, "lr_scale": layer_lr_decay ** (n_layers + 1 - depth)}
            for depth in sorted(by_depth) for group in decay_groups(by_depth[depth], weight_decay)
            if group["params"]]


def decay_groups(params: list[nn.Parameter], weight_decay: float) -> list[dict]:
    """Weight decay on matrices (linear and embedding weights) only, not on biases or norms."""
    params = [p for p in params if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
