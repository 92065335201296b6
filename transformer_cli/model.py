"""The CTransformer classifier, from scratch: attention -> block -> encoder -> classifier.

Shapes: B batch, T tokens, C = d_model, H heads, Dh = C // H head size, V vocabulary, K classes.
`mask` is a (B, T) bool tensor, True at real tokens; every sequence has at least one (its [CLS]).
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from transformer_cli.config import ModelConfig
from transformer_cli.tokens import PAD_ID, round_width

Rotary = tuple[torch.Tensor, torch.Tensor]  # rope's (cos, sin), each (B or 1, 1, T, Dh/2): see `rotary`


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)  # fused Q, K, V projections
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout
        self.fused = True  # F.scaled_dot_product_attention; False: explicit_attention, the reference path

    def forward(self, x: torch.Tensor, mask: torch.Tensor, rope: Rotary | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.heads(x, rope)  # (B, H, T, Dh) each
        key_mask = mask[:, None, None, :]  # (B, 1, 1, T): padding keys get no attention
        attend = fused_attention if self.fused else explicit_attention
        y = attend(q, k, v, key_mask).transpose(1, 2).reshape(B, T, C)  # (B, T, C): heads merged
        return F.dropout(self.proj(y), self.dropout, self.training)

    def heads(self, x: torch.Tensor, rope: Rotary | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, T, C) states -> q, k, v, each (B, H, T, Dh), with q and k rotated by `rope` where given."""
        B, T, C = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.n_heads, C // self.n_heads)  # (B, T, 3, H, Dh)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, T, Dh) each
        if rope is not None:
            q, k = rotate(q, rope), rotate(k, rope)
        return q, k, v


def rotary(positions: torch.Tensor, head_dim: int) -> Rotary:
    """Rotary position embedding (Su et al. 2021, RoFormer): the angles by which `rotate` turns each pair
    of a head's dimensions (i, i + Dh/2) at each position, at frequencies 10000^(-2i/Dh). q.k then
    depends on the two tokens' distance, not on where they stand. `positions`: (T,) or (B, T)."""
    inv_freq = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)
    angles = positions.float()[..., None] * inv_freq  # (T, Dh/2) or (B, T, Dh/2)
    angles = angles[None, None] if angles.dim() == 2 else angles[:, None]  # (B or 1, 1, T, Dh/2)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, rope: Rotary) -> torch.Tensor:
    """(B, H, T, Dh) queries or keys, each pair (i, i + Dh/2) turned by its position's angle."""
    cos, sin = (t.to(x.dtype) for t in rope)
    x1, x2 = x.chunk(2, dim=-1)  # (B, H, T, Dh/2) each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
    """F.scaled_dot_product_attention; on the CPU in fp32 even under bf16 autocast, where its bf16
    kernel is slower than its fp32 one (docs/results.md)."""
    if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=key_mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(Dh)) v with padding keys masked out: the reference for the fused path, and
    the path whose weights `tfm inspect` and the attention maps read."""
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))  # (B, H, T, T)
    att = att.masked_fill(~key_mask, float("-inf")).softmax(dim=-1)
    return att @ v  # (B, H, T, Dh)


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

    def forward(self, x: torch.Tensor, mask: torch.Tensor, rope: Rotary | None = None) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.attn(self.norm1(x), mask, rope)
            return x + F.dropout(self.ff(self.norm2(x)), self.dropout, self.training)
        x = self.norm1(x + self.attn(x, mask, rope))
        return self.norm2(x + F.dropout(self.ff(x), self.dropout, self.training))


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
    """Gated feed-forward layer (Shazeer 2020): down(GELU(x W) * x V), as Cramming BERT (Geiping & Goldstein
    2022) pretrains with it. W and V are two layers, not one of twice the width cut in halves, whose strided
    halves cost more on a CPU."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(d_model, hidden)
        self.value = nn.Linear(d_model, hidden)
        self.down = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.gate(x)) * self.value(x))  # (..., hidden) -> (..., C)


class Encoder(nn.Module):
    """Token + position embeddings and the stack of blocks: (B, T) ids -> (B, T, C) states. With
    `pos_emb = "rope"` positions enter inside attention instead (`rotary`), not as an embedding.
    Kept apart from the classifier so that the masked-LM head of pretraining can share it."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, max_length: int):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, cfg.d_model)
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
        T = ids.size(1)
        if positions is None and T > self.max_length:
            raise ValueError(f"sequence of {T} tokens is longer than max_length {self.max_length}")
        x = self.tok_emb(ids)  # (B, T, C)
        if not self.rope_dim:
            table = self.pos_emb.weight if self.pos_emb is not None else self.pos_table  # (max_length, C)
            # F.embedding, not table[positions]: its backward sums the rows' gradients in a fixed order
            x = x + (table[:T] if positions is None else F.embedding(positions, table))  # (B, T, C)
        x = F.dropout(x, self.dropout, self.training)
        rope = None
        if self.rope_dim:
            rope = rotary(torch.arange(T, device=ids.device) if positions is None else positions, self.rope_dim)
        for block in self.blocks:
            x = block(x, mask, rope)
        return self.norm(x)  # (B, T, C)


def sinusoidal_table(length: int, dim: int) -> torch.Tensor:
    pos = torch.arange(length, dtype=torch.float32)[:, None]  # (T, 1)
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq[: dim // 2])
    return table  # (T, C)


def pool(h: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """(B, T, C) states -> (B, C), ignoring padding positions."""
    if how == "first":
        return h[:, 0]
    m = mask.unsqueeze(-1)  # (B, T, 1)
    if how == "max":
        return h.masked_fill(~m, float("-inf")).amax(dim=1)
    return (h * m).sum(dim=1) / m.sum(dim=1).clamp(min=1).to(h.dtype)


def drop_tokens(mask: torch.Tensor, p: float) -> torch.Tensor:
    """Word dropout: hide each real token with probability p, as if it were padding. Position 0 ([CLS])
    always stays, so no sequence is left empty."""
    keep = torch.rand(mask.shape, device=mask.device) >= p  # (B, T)
    keep[:, 0] = True
    return mask & keep


def compact(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Move each row's real tokens to its front, in order, and cut the columns no row then needs.

    Returns (ids, mask, positions), each (B, W): W is the most real tokens in a row, rounded up as batch
    widths are (no wider than T); `positions` holds each token's column in the input. The encoder never
    reads a hidden token (it is no key and is not pooled), so after word dropout it gives the kept tokens
    the same states over fewer columns.
    """
    counts = mask.sum(dim=1)  # (B,)
    width = min(round_width(int(counts.max())), mask.size(1))
    positions = torch.sort((~mask).to(torch.uint8), dim=1, stable=True).indices[:, :width]  # (B, W): kept first
    kept = torch.arange(width, device=mask.device) < counts[:, None]  # (B, W)
    return ids.gather(1, positions).masked_fill(~kept, PAD_ID), kept, positions


class CTransformer(nn.Module):
    """The classifier: the encoder's states pooled over the sequence, then a linear head."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, max_length: int, num_labels: int = 2):
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg, vocab_size, max_length)
        self.head = nn.Linear(cfg.d_model, num_labels)
        init_weights(self, cfg.n_layers)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor | None = None,
                class_weights: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """(B, K) logits, or with `labels` (B,) the logits and the training loss; `class_weights` (K,) weigh
        each example's loss by its class (the mean is then over the weights, as F.cross_entropy's)."""
        positions = None
        if self.training and self.cfg.token_dropout > 0:
            mask = drop_tokens(mask, self.cfg.token_dropout)
            ids, mask, positions = compact(ids, mask)  # (B, W) each, W a little over (1 - token_dropout) T
        logits = self.head(pool(self.encoder(ids, mask, positions), mask, self.cfg.pooling))  # (B, K)
        if labels is None:
            return logits
        return logits, F.cross_entropy(logits.float(), labels, weight=class_weights)

    def param_groups(self, weight_decay: float, layer_lr_decay: float = 1.0) -> list[dict]:
        return layer_groups(list(self.named_parameters()), self.cfg.n_layers, weight_decay, layer_lr_decay)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


class LMHead(nn.Module):
    """The masked-LM output layer: a transform of the states, then scores against the token embedding (tied,
    as BERT's) plus a bias per token."""

    ROW_MULTIPLE = 64  # rows are padded to a multiple of this: on a CPU, each new matmul shape made oneDNN
    # cache another packed copy of the (V, C) embedding, and memory grew by gigabytes

    def __init__(self, d_model: int, vocab_size: int):
        super().__init__()
        self.transform = nn.Sequential(nn.Linear(d_model, d_model), nn.GELU(), nn.LayerNorm(d_model))
        self.bias = nn.Parameter(torch.zeros(vocab_size))

    def forward(self, h: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        """(N, C) states and the (V, C) token embedding -> (N, V) token scores."""
        n = h.size(0)
        h = F.pad(h, (0, 0, 0, -n % self.ROW_MULTIPLE))  # (N', C)
        return F.linear(self.transform(h), embedding, self.bias)[:n]  # (N, V)


class MaskedLM(nn.Module):
    """The encoder with a masked-language-model head, for pretraining: predict each masked token's original
    id from its final state (BERT's objective). The head runs on the masked positions only."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, max_length: int):
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg, vocab_size, max_length)
        self.lm_head = LMHead(cfg.d_model, vocab_size)
        init_weights(self, cfg.n_layers)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, picked: torch.Tensor, targets: torch.Tensor,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the loss, {"accuracy"}) of the predictions at `picked`, (N,) flat indices into the (B, T) batch,
        whose original ids are `targets` (N,); `positions` (B, T) as Encoder.forward's."""
        h = self.encoder(ids, mask, positions).flatten(0, 1)[picked]  # (N, C)
        scores = self.lm_head(h, self.encoder.tok_emb.weight).float()  # (N, V)
        accuracy = (scores.detach().argmax(-1) == targets).float().mean()
        return F.cross_entropy(scores, targets), {"accuracy": accuracy}

    def param_groups(self, weight_decay: float, layer_lr_decay: float = 1.0) -> list[dict]:
        return layer_groups(list(self.named_parameters()), self.cfg.n_layers, weight_decay, layer_lr_decay)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def init_weights(model: nn.Module, n_layers: int) -> None:
    """Normal(0, 0.02) weights and zero biases, GPT-2 style: the projections that write into the residual
    stream shrink with depth."""
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
    layer_lr_decay ** (n_layers - i), the embeddings at layer_lr_decay ** (n_layers + 1): fine-tuning's
    layer-wise learning rates (ULMFiT, ELECTRA), since lower layers hold the most general features.
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
