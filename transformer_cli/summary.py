"""`tfm inspect`: the model layer by layer for one review, with each layer's input and output shapes
named in the model's symbols (B, T, C, H, Dh), its parameter count and its FLOPs per token.

torchinfo records each module's shapes and parameters. Added here: rows for the tensors inside attention
(the per-head q, k, v and the T x T weights, which are no module's outputs), and the FLOPs. FLOPs count
matrix products only, 2 per multiply-add: the Linear layers, and attention's q k^T and weights x v.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from transformer_cli.config import Config
from transformer_cli.data import CLS_ID, DEFAULT_LABELS, SPECIAL_TOKENS, encode_texts, text_normalizer
from transformer_cli.model import CTransformer, SelfAttention

SAMPLE_TEXT = (
    "I went in expecting very little, and this film surprised me. The two leads are wonderful together, "
    "the script is sharp and often funny, and the last twenty minutes are as tense as anything I have seen "
    "this year. It drags a little in the middle, but I would gladly watch it again."
)


@dataclass
class Row:
    """One line of the summary: a module, or a tensor inside attention, at `depth` in the tree (0: the model)."""

    name: str  # the module's dotted path; a tensor inside attention: its module's path + ".heads" etc.
    kind: str  # the module's class, or what the tensor is
    depth: int
    input: list[int] | None
    output: list[int] | None
    input_symbols: str | None
    output_symbols: str | None
    params: int | None  # of the module and its children; None for a tensor inside attention
    flops_per_token: float


@dataclass
class Summary:
    dims: dict[str, int]  # B, T, C, H, Dh, L
    rows: list[Row]
    total_params: int
    flops_per_token: float

    def to_dict(self, depth: int | None = None) -> dict:
        return {"dims": self.dims, "layers": [asdict(r) for r in self.shown(depth)],
                "total": {"params": self.total_params, "flops_per_token": self.flops_per_token}}

    def shown(self, depth: int | None) -> list[Row]:
        return [r for r in self.rows if depth is None or r.depth <= depth]


# --------------------------------------------------------------------------- the model and its input


def model_from_dir(path: str | Path):
    """(model in eval mode on the CPU, tokenizer, DataConfig) of a `tfm train` output directory."""
    from transformer_cli.evaluate import load_model_dir

    model, cfg, tokenizer, _, _ = load_model_dir(path, "cpu")
    return model, tokenizer, cfg.data


def model_from_config(cfg: Config) -> CTransformer:
    """An untrained classifier at a recipe's sizes (vocabulary: data.vocab_size), in eval mode."""
    return CTransformer(cfg.model, cfg.data.vocab_size, cfg.data.max_length, len(DEFAULT_LABELS)).eval()


def sample_ids(text: str, model: CTransformer, tokenizer=None, data_cfg=None) -> torch.Tensor:
    """(1, T) ids of `text` as the model reads it: [CLS] + its subword ids, truncated as in training. Without
    a tokenizer (an untrained recipe), each word and punctuation mark of the normalized text is one token, with
    stand-in ids: the shapes depend only on how many there are."""
    max_length = model.encoder.max_length
    if tokenizer is not None:
        ids, _ = encode_texts(tokenizer, [text], max_length, data_cfg.truncation)
        return torch.from_numpy(ids.astype(np.int64))[None]
    from tokenizers.pre_tokenizers import BertPreTokenizer

    text = text_normalizer().normalize_str(text)
    n = len(BertPreTokenizer().pre_tokenize_str(text)[: max_length - 1])
    first, vocab = len(SPECIAL_TOKENS), model.encoder.tok_emb.num_embeddings
    stand_in = [first + i % max(1, vocab - first) for i in range(n)]
    return torch.tensor([[CLS_ID, *stand_in]], dtype=torch.int64)


# --------------------------------------------------------------------------- the summary


def summarize(model: CTransformer, ids: torch.Tensor) -> Summary:
    """Every module's shapes, parameters and FLOPs per token (its own and its children's) for one forward pass
    over `ids` (B, T): a row each, children in the order the pass first called them. A module it did not call
    (the learned position embedding, whose table is sliced) comes after its elder sibling, without shapes
    unless its children were called (a ModuleList): then what went into the first and came out of the last."""
    import torchinfo

    mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        stats = torchinfo.summary(model, input_data=[ids, mask], depth=1000, device=ids.device, mode="eval", verbose=0)
    names = {id(m): name for name, m in model.named_modules()}
    calls: dict[str, object] = {}  # module name -> torchinfo's record of its first call (a ModuleList's too)
    order: dict[str, int] = {}  # module name -> the place of that call
    for i, layer in enumerate(stats.summary_list):
        calls.setdefault(names[id(layer.module)], layer)
        order.setdefault(names[id(layer.module)], i)
    B, T = ids.shape
    C, H = model.cfg.d_model, model.cfg.n_heads
    dims = {"B": B, "T": T, "C": C, "H": H, "Dh": C // H, "L": model.head.out_features}
    rows: list[Row] = []

    def add(name: str, module: nn.Module, depth: int) -> None:
        call = calls.get(name)
        shape_in, shape_out = (_shape(call.input_size), _shape(call.output_size)) if call else (None, None)
        tokens_in = not isinstance(module, nn.Linear)  # a (B, x) input: ids, unless it feeds a Linear
        row = Row(name, type(module).__name__, depth, shape_in, shape_out,
                  _symbols(shape_in, dims, model.cfg.ff_mult, tokens_in), _symbols(shape_out, dims, model.cfg.ff_mult),
                  sum(p.numel() for p in module.parameters()), _linear_flops(module, shape_out) / (B * T))
        start = len(rows)
        rows.append(row)
        parent = name.rpartition(".")[0]
        if name.endswith(".qkv") and isinstance(model.get_submodule(parent), SelfAttention) and shape_out:
            rows.extend(_attention_rows(parent, depth, shape_out, H, B * T))
        children, key = [], -1
        for child, m in module.named_children():
            child = f"{name}.{child}" if name else child
            key = order.get(child, key)  # never called: after its elder sibling
            children.append((key, child, m))
        for _, child, m in sorted(children, key=lambda c: c[0]):
            add(child, m, depth + 1)
        below = [r for r in rows[start + 1 :] if r.depth == depth + 1]
        row.flops_per_token += sum(r.flops_per_token for r in below)
        ran = [r for r in below if r.input and r.output]
        if row.input is None and row.output is None and ran:
            row.input, row.input_symbols = ran[0].input, ran[0].input_symbols
            row.output, row.output_symbols = ran[-1].output, ran[-1].output_symbols

    add("", model, 0)
    return Summary(dims, rows, model.num_params(), rows[0].flops_per_token)


def _attention_rows(name: str, depth: int, qkv: list[int], H: int, tokens: int) -> list[Row]:
    """The tensors inside one attention layer, between its qkv (B, T, 3C) and proj Linears."""
    B, T, C = qkv[0], qkv[1], qkv[2] // 3
    q, weights = [B, H, T, C // H], [B, H, T, T]
    matmul = 2 * B * H * T * T * (C // H) / tokens  # B H T T Dh multiply-adds, each of the two
    return [
        Row(f"{name}.heads", "q, k, v split into heads", depth, qkv, q, "(B, T, 3C)", "(B, H, T, Dh)", None, 0.0),
        Row(f"{name}.weights", "softmax(q k^T / sqrt(Dh))", depth, q, weights, "(B, H, T, Dh)", "(B, H, T, T)", None,
            matmul),
        Row(f"{name}.mix", "weights x v", depth, weights, q, "(B, H, T, T)", "(B, H, T, Dh)", None, matmul),
    ]


def _linear_flops(module: nn.Module, out: list[int] | None) -> float:
    if not isinstance(module, nn.Linear) or not out:
        return 0.0
    return 2.0 * module.in_features * int(np.prod(out))  # rows x in x out multiply-adds


def _shape(size) -> list[int] | None:
    """torchinfo's recorded size as a list of ints, or None where a module had no tensor in or out."""
    if isinstance(size, (list, tuple, torch.Size)) and size and all(isinstance(d, int) for d in size):
        return [int(d) for d in size]
    return None


def _symbols(shape: list[int] | None, dims: dict[str, int], ff_mult: int, tokens: bool = False) -> str | None:
    """E.g. [1, 57, 128] -> "(B, T, C)"; a size that is no symbol stays a number."""
    if shape is None:
        return None
    B, T, C = {"B": dims["B"]}, {"T": dims["T"]}, dims["C"]
    features = {"C": C, "3C": 3 * C, f"{ff_mult}C": ff_mult * C, "L": dims["L"]}
    wanted = {1: [B], 2: [B, T if tokens else features], 3: [B, T, features]}.get(len(shape), [{}] * len(shape))
    out = [next((sym for sym, v in cands.items() if v == n), str(n)) for n, cands in zip(shape, wanted)]
    return "(" + ", ".join(out) + ")"


# --------------------------------------------------------------------------- the text report


def format_summary(s: Summary, depth: int | None = None) -> str:
    """The summary as an aligned table, one line per row down to `depth`, then the totals."""
    d = s.dims
    lines = [f"B = {_count(d['B'], 'review')}, T = {_count(d['T'], 'token')}, C = {d['C']}, "
             + f"H = {_count(d['H'], 'head')}, Dh = {d['Dh']}, L = {_count(d['L'], 'label')}"]
    table = [("layer", "input", "output", "params", "FLOPs/token")]
    for r in s.shown(depth):
        label = "  " * r.depth + (f"{r.name.rsplit('.', 1)[-1]}: {r.kind}" if r.name else r.kind)
        table.append((label, _shape_text(r.input_symbols, r.input), _shape_text(r.output_symbols, r.output),
                      "" if r.params is None else f"{r.params:,}", _flops_text(r.flops_per_token)))
    widths = [max(len(row[i]) for row in table) for i in range(5)]
    for row in table:
        lines.append("  ".join([row[0].ljust(widths[0]), *(c.ljust(w) for c, w in zip(row[1:3], widths[1:3])),
                                *(c.rjust(w) for c, w in zip(row[3:], widths[3:]))]).rstrip())
    lines.append(f"total: {s.total_params:,} parameters, {_flops_text(s.flops_per_token)} FLOPs per token "
                 f"at T = {d['T']} (matrix products)")
    return "\n".join(lines)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _shape_text(symbols: str | None, shape: list[int] | None) -> str:
    if shape is None:
        return "-"
    numbers = "(" + ", ".join(map(str, shape)) + ")"
    return numbers if symbols == numbers else f"{symbols} = {numbers}"


def _flops_text(flops: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if flops >= scale:
            return f"{flops / scale:.2f} {unit}"
    return f"{flops:.0f}"
