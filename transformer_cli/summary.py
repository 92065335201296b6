"""`tfm inspect`: the model layer by layer for one review, with each layer's input and output shapes
named in the model's symbols (B, T, C, H, Dh), its parameter count and its FLOPs per token.

torchinfo walks the module tree and records each module's shapes and parameters. What it cannot
give is done here: the tensors inside attention (the per-head q, k, v and the T x T weights live
inside SelfAttention.forward, not as module outputs; a TorchFunctionMode observes the call to the
attention function), the FLOPs of attention's two matmuls (functional calls: torchinfo counts no
FLOPs outside modules, and torch's FlopCounterMode none in the CPU's fused attention kernel), and
naming each dimension by its symbol. FLOPs count matrix products only, 2 per multiply-add (the
Linear layers, and attention's q k^T and weights x v); elementwise work (norms, GELU, softmax) and
embedding lookups are left out, as is usual.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from transformer_cli.config import Config
from transformer_cli.data import CLS_ID, DEFAULT_LABELS, SPECIAL_TOKENS, encode_texts, text_normalizer
from transformer_cli.errors import TfmError
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
    """(1, T) ids of `text` as the model reads it: [CLS] + its subword ids, truncated as in training.
    Without a tokenizer (an untrained recipe has none yet) each word and punctuation mark left by the
    normalization a trained one applies (text_normalizer: `<br />` tags removed) is one token, with
    stand-in ids: the shapes depend only on how many there are."""
    max_length = model.encoder.max_length
    if tokenizer is not None:
        ids, _ = encode_texts(tokenizer, [text], max_length, data_cfg.truncation, data_cfg.head_fraction)
        return torch.from_numpy(ids.astype(np.int64))[None]
    from tokenizers.pre_tokenizers import BertPreTokenizer

    text = text_normalizer().normalize_str(text)
    n = len(BertPreTokenizer().pre_tokenize_str(text)[: max_length - 1])
    first, vocab = len(SPECIAL_TOKENS), model.encoder.tok_emb.num_embeddings
    stand_in = [first + i % max(1, vocab - first) for i in range(n)]
    return torch.tensor([[CLS_ID, *stand_in]], dtype=torch.int64)


# --------------------------------------------------------------------------- the summary


def summarize(model: CTransformer, ids: torch.Tensor) -> Summary:
    """Every module's shapes, parameters and FLOPs per token for one forward pass over `ids` (B, T)."""
    import torchinfo

    mask = torch.ones_like(ids, dtype=torch.bool)
    names = {id(m): name for name, m in model.named_modules()}
    with _AttentionObserver(model) as seen, torch.no_grad():
        stats = torchinfo.summary(model, input_data=[ids, mask], depth=1000, device=ids.device, mode="eval", verbose=0)
    B, T = ids.shape
    C, H = model.cfg.d_model, model.cfg.n_heads
    dims = {"B": B, "T": T, "C": C, "H": H, "Dh": C // H, "L": model.head.out_features}
    rows: list[Row] = []
    for layer in stats.summary_list:
        name = names.get(id(layer.module), layer.var_name)
        shape_in, shape_out = _shape(layer.input_size), _shape(layer.output_size)
        tokens_in = not isinstance(layer.module, nn.Linear)  # a (B, x) input: ids, unless it feeds a Linear
        rows.append(Row(name, layer.class_name, layer.depth, shape_in, shape_out,
                        _symbols(shape_in, dims, model.cfg.ff_mult, tokens_in),
                        _symbols(shape_out, dims, model.cfg.ff_mult), layer.num_params,
                        _linear_flops(layer.module, shape_out) / (B * T)))
        if name.endswith(".qkv") and name.removesuffix(".qkv") in seen:
            rows += _attention_rows(name.removesuffix(".qkv"), layer.depth, shape_out, *seen[name.removesuffix(".qkv")],
                                    B * T)
    rows = _with_unrun_modules(model, rows)
    _add_children_flops(rows)
    if stats.total_params != model.num_params():
        raise TfmError(f"torchinfo counted {stats.total_params} parameters but the model has {model.num_params()}")
    return Summary(dims, rows, model.num_params(), rows[0].flops_per_token)


class _AttentionObserver(TorchFunctionMode):
    """Records {attention module's name: (q shape, k shape)} of each SelfAttention's first call to
    the attention function: F.scaled_dot_product_attention, or the explicit path's q @ k^T."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.modules = [(name, m) for name, m in model.named_modules() if isinstance(m, SelfAttention)]
        self.current: str | None = None
        self.seen: dict[str, tuple[list[int], list[int]]] = {}
        self.hooks: list = []

    def __enter__(self):
        for name, m in self.modules:
            self.hooks.append(m.register_forward_pre_hook(lambda *_, n=name: setattr(self, "current", n)))
            self.hooks.append(m.register_forward_hook(lambda *_: setattr(self, "current", None)))
        super().__enter__()
        return self.seen

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = self.current
        if name is not None and name not in self.seen:
            if func is F.scaled_dot_product_attention:
                self.seen[name] = (list(args[0].shape), list(args[1].shape))
            elif getattr(func, "__name__", "") in ("matmul", "__matmul__") and args[0].dim() == 4:  # q @ k^T
                self.seen[name] = (list(args[0].shape), [*args[1].shape[:-2], args[1].shape[-1], args[1].shape[-2]])
        return func(*args, **(kwargs or {}))


def _attention_rows(name: str, depth: int, qkv: list[int], q: list[int], k: list[int], tokens: int) -> list[Row]:
    """The tensors inside one attention layer, between its qkv and proj Linears."""
    weights = [*q[:-1], k[-2]]  # (B, H, T, T)
    matmul = 2 * int(np.prod(q[:-1])) * k[-2] * q[-1] / tokens  # B H T T Dh multiply-adds, each of the two
    return [
        Row(f"{name}.heads", "q, k, v split into heads", depth, qkv, q, "(B, T, 3C)", "(B, H, T, Dh)", None, 0.0),
        Row(f"{name}.weights", "softmax(q k^T / sqrt(Dh))", depth, q, weights, "(B, H, T, Dh)", "(B, H, T, T)", None,
            matmul),
        Row(f"{name}.mix", "weights x v", depth, weights, q, "(B, H, T, T)", "(B, H, T, Dh)", None, matmul),
    ]


def _with_unrun_modules(model: nn.Module, rows: list[Row]) -> list[Row]:
    """`rows` with a row for each module that the forward pass read without calling it (torchinfo
    records calls only: the learned position embedding, whose table is sliced), after its elder
    siblings, so that the rows' parameters add up to their parent's; and a module that was not called
    but whose children were shows
    what went in (its first child's input) and came out (its last child's output)."""
    rows = list(rows)
    shown = {r.name for r in rows}

    def subtree_end(i: int) -> int:  # the index after row i and the rows below it
        j = i + 1
        while j < len(rows) and rows[j].depth > rows[i].depth:
            j += 1
        return j

    previous: dict[str, str] = {}  # the module registered before each one under the same parent
    for name, module in model.named_modules():
        parent = name.rpartition(".")[0]
        if name and name not in shown:
            up = next(i for i, r in enumerate(rows) if r.name == parent)
            elder = next((i for i, r in enumerate(rows) if r.name == previous.get(parent)), None)
            rows.insert(up + 1 if elder is None else subtree_end(elder),
                        Row(name, type(module).__name__, rows[up].depth + 1, None, None, None, None,
                            sum(p.numel() for p in module.parameters()), 0.0))
            shown.add(name)
        if name:
            previous[parent] = name
    for i in reversed(range(len(rows))):
        row, below = rows[i], rows[i + 1 : subtree_end(i)]
        ran = [r for r in below if r.depth == row.depth + 1 and r.input is not None and r.output is not None]
        if row.input is None and row.output is None and ran:
            row.input, row.input_symbols = ran[0].input, ran[0].input_symbols
            row.output, row.output_symbols = ran[-1].output, ran[-1].output_symbols
    return rows


def _linear_flops(module: nn.Module, out: list[int] | None) -> float:
    if not isinstance(module, nn.Linear) or not out:
        return 0.0
    return 2.0 * module.in_features * int(np.prod(out))  # rows x in x out multiply-adds


def _add_children_flops(rows: list[Row]) -> None:
    """Each row's FLOPs: its own plus those of the rows below it (the rows are in tree order)."""
    stack: list[Row] = []
    for row in [*rows, None]:
        while stack and (row is None or row.depth <= stack[-1].depth):
            done = stack.pop()
            if stack:
                stack[-1].flops_per_token += done.flops_per_token
        if row is not None:
            stack.append(row)


def _shape(size) -> list[int] | None:
    """torchinfo's recorded size as a list of ints, or None where a module had no tensor in or out."""
    if isinstance(size, (list, tuple, torch.Size)) and size and all(isinstance(d, int) for d in size):
        return [int(d) for d in size]
    return None


def _symbols(shape: list[int] | None, dims: dict[str, int], ff_mult: int, tokens: bool = False) -> str | None:
    """E.g. [1, 57, 128] -> "(B, T, C)"; a size that is no symbol stays a number."""
    if shape is None:
        return None
    C = dims["C"]
    features = {"C": C, "3C": 3 * C, f"{ff_mult}C": ff_mult * C, "L": dims["L"]}
    if len(shape) == 1:
        wanted = [{"B": dims["B"]}]
    elif len(shape) == 2:
        wanted = [{"B": dims["B"]}, {"T": dims["T"]} if tokens else features]
    elif len(shape) == 3:
        wanted = [{"B": dims["B"]}, {"T": dims["T"]}, features]
    else:
        wanted = [{}] * len(shape)
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
