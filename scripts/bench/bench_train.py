"""Training-step speed of our CTransformer against a naive reference and torch.nn.TransformerEncoder.

What it measures
    One process times full training steps (forward, backward, gradient clipping at 1.0, optimizer
    step, loss.item()) of these variants on the SAME batches, all with the same sizes (default: the
    reference notebook's emb 128, 8 heads, depth 3, ff 4x, vocab 50k, T=256, batch 32); (b) and
    (c) in fp32, (a) in `tfm train`'s default precision here (train.precision = "auto": bf16
    autocast on a CPU with native bf16, with attention in fp32; else fp32), printed per row:

      (a)  ours: transformer_cli.model.CTransformer with the default model config, stepped by
           transformer_cli.train.train_step, the step of `tfm train`'s loop, on a run that
           transformer_cli.train.build_run sets up (fused AdamW over model.param_groups, the model's
           loss, gradient clipping, the finiteness check; fused SDPA attention with the padding
           mask). Its layout is configs/wide-and-deep.toml's transformer, which the figures in
           docs/performance.md were measured on: pre-norm, GELU, mean pooling, word dropout 0.7, no
           weight average. Its encoder runs only the tokens word dropout keeps (model.compact: about
           0.4 of the columns), so it does fewer FLOPs than (b), which computes every column
      (b)  naive reference, written here as Peter Bloem's `former` CTransformer is: separate Q/K/V
           linears, heads folded into the batch dimension, torch.bmm, q and k each scaled by
           emb^(1/4), explicit softmax, post-norm blocks with a 4x ReLU feed-forward, max pooling,
           log_softmax + nll_loss, torch.optim.Adam with its CPU default (for-loop) implementation.
           As in the notebook it has no padding mask: padded batches go in as they are.
      (c)  torch.nn.TransformerEncoder (batch_first, post-norm, ReLU, src_key_padding_mask) with the
           same embeddings, masked max pooling and a linear head; Adam.
    By default: (a), (b), (c), and a_fp32 on a CPU with native bf16. Others (--variants):
    (a) with suffixes, each changing one thing, e.g. a_ngrams_lazy:
      _explicit  model.attention = "explicit" (written-out softmax(QK^T)V instead of SDPA)
      _bf16      bf16 autocast (the default only on a CPU with native bf16: AVX-512 BF16 or AMX; on
                 others bf16 is emulated, slower than fp32, and `tfm train` refuses it)
      _fp32      fp32, autocast off (the default on CPUs without native bf16)
      _ngrams    plus the n-gram path of configs/wide-and-deep.toml ((a) itself has none, like (b))
      _lazy      model.lazy_embeddings = true: sparse gradients, tables updated in the used rows only
      _foreach   AdamW's foreach implementation instead of the fused kernel
      _compile   the model under torch.compile (inductor; `train.compile = true`). Its first steps
                 compile (again when a new batch shape makes the graph dynamic): the JSON rows keep
                 every variant's first-step seconds, printed for this one; use --warmup >= 2
      _hN        N attention heads instead of --heads (e.g. a_ngrams_h4: the default model with 4
                 heads of size 16 instead of 2 of size 32); (b) and (c) keep --heads

    Every variant gets the same dropout (--dropout: on the embeddings, after attention and after the
    feed-forward layer, none on the attention weights) and the same init seed. Steps are interleaved
    (batch i is run by every variant before batch i+1), so contention from other jobs that comes
    and goes hits all variants alike; the first --warmup batches are untimed.

Modes
    synthetic  fixed-length batches (B x --seq-len) of random token ids, no padding
    imdb       the first batches of epoch 0 exactly as `tfm train` draws them from --data
               (prepare_train_data -> BucketSampler -> collate): length-bucketed, padded, with
               the padding mask; the tokenizer (--vocab) is trained on the first run and cached

How to read the table
    ms/step     median wall time of a timed step (min ms: the least disturbed one)
    samples/s   timed samples / total timed seconds; tokens/s counts real (non-pad) tokens
    T run       the mean width of the batches the variant's encoder ran: the batch's T, or for (a)
                what word dropout leaves
    vs (b)      samples/s over the naive reference's in the same mode (same batches): the speedup
    GFLOP/s     analytic FLOPs of the variant's steps (3 x forward; forward = 2 x matmul weights x
                tokens + 4 B T^2 d per layer for attention, see _bench_common.forward_flops) / time,
                over the (B, T) its encoder ran: the batch's, or for (a) after word dropout the
                narrower one `compact` leaves (about 0.4 T at token_dropout 0.7)
    % peak      GFLOP/s over the peak: a square torch.mm in the row's precision (fp32, or bf16 for
                bf16 rows) with the same threads, timed once per batch between the variants'
                steps (so under the same contention), median. It bounds the ratios of variants that
                do (b)'s FLOPs (every column of the batch computed): none can beat (b) by more
                than that precision's peak / GFLOP/s of (b), printed as "ceiling".
    target      the issue's targets: (a) >= 5x (b) on synthetic T=256 (below 3x is not done), and
                (a) samples/s on real bucketed batches >= on synthetic ones.

Profiles (--profile a,b)
    After timing, each listed variant runs the timed batches once more under torch.profiler
    (untimed). Printed: the share of the ops' self CPU time taken by attention kernels (SDPA, or
    bmm and softmax), the linear layers' matmuls (mm, addmm), casts and copies, the optimizer (its
    fused kernel; the for-loop Adam of (b) and (c) runs elementwise ops, counted as the rest) and
    the rest, then the ops that took the most. An op's time is wall time in the thread that called
    it; its intra-op threads are not counted again. The profiler adds overhead, so read shares.

Examples
    python scripts/bench/bench_train.py --json bench_train.json           # the full run, both modes
    python scripts/bench/bench_train.py --mode synthetic --steps 2 --warmup 1
    python scripts/bench/bench_train.py --mode synthetic --variants a,b --steps 10 --profile a,b
    python scripts/bench/bench_train.py --mode imdb --max-train-samples 400 --steps 2 --warmup 1
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import _bench_common as bc
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

VARIANTS = {
    "a": "(a) ours",
    "b": "(b) naive former-style",
    "c": "(c) nn.TransformerEncoder",
}
SUFFIXES = {"explicit": "explicit attention", "bf16": "bf16 autocast", "fp32": "fp32", "ngrams": "+ n-gram path",
            "lazy": "lazy embeddings", "foreach": "foreach AdamW", "compile": "torch.compile"}


def heads_of(mod: str) -> int | None:
    """'h4' -> 4; None for any other suffix."""
    return int(mod[1:]) if mod[:1] == "h" and mod[1:].isdigit() and int(mod[1:]) > 0 else None


def variant_name(key: str) -> str | None:
    """'a_ngrams_lazy' -> '(a) ours + n-gram path, lazy embeddings'; None if the key is unknown."""
    if key in VARIANTS:
        return VARIANTS[key]
    base, *mods = key.split("_")
    known = all(m in SUFFIXES or heads_of(m) for m in mods) and sum(heads_of(m) is not None for m in mods) <= 1
    if base != "a" or not mods or not known or len(set(mods)) < len(mods) or {"bf16", "fp32"} <= set(mods):
        return None

    def name(m: str) -> str:
        if n := heads_of(m):
            return f", {n} head{'s' * (n > 1)}"
        return f" {SUFFIXES[m]}" if m == "ngrams" else f", {SUFFIXES[m]}"

    return "(a) ours" + "".join(name(m) for m in mods)


def parse_args(argv=None) -> argparse.Namespace:
    from transformer_cli.runtime import cpu_has_fast_bf16

    default_variants = "a,b,c" + (",a_fp32" if cpu_has_fast_bf16() else "")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["synthetic", "imdb", "both"], default="both")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--ff-mult", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256, help="T of synthetic batches; max_length in imdb mode")
    p.add_argument("--vocab", type=int, default=50_000, help="vocabulary size (imdb: the tokenizer's target size)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--dropout", type=float, default=0.1, help="dropout of every variant")
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant and mode")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant before timing")
    p.add_argument("--variants", default=default_variants,
                   help=f"comma-separated: {','.join(VARIANTS)}, or a with suffixes _{', _'.join(SUFFIXES)}, _hN")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--data", default=bc.DEFAULT_DATA, help="dataset for --mode imdb")
    p.add_argument("--max-train-samples", type=int, default=None, help="imdb mode: use this many training reviews")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--profile", default="", metavar="KEYS",
                   help="comma-separated variants (e.g. a,b) to profile after timing: where their step time went")
    p.add_argument("--json", default=None, metavar="PATH", help="write all results as JSON")
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    args.profile = [v.strip() for v in args.profile.split(",") if v.strip()]
    if missing := [v for v in args.profile if v not in args.variants]:
        p.error(f"--profile {missing}: not among --variants {args.variants}")
    if unknown := [v for v in args.variants if variant_name(v) is None]:
        p.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)} or a_ plus suffixes {list(SUFFIXES)}, hN")
    heads = {args.heads} | {h for v in args.variants for m in v.split("_")[1:] if (h := heads_of(m))}
    if any(args.d_model % h for h in heads):
        p.error(f"--d-model {args.d_model} must be divisible by every head count, {sorted(heads)}")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


# --------------------------------------------------------------------------- reference models


class NaiveSelfAttention(nn.Module):
    """former's SelfAttention: separate Q/K/V, heads folded into the batch, bmm, no mask."""

    def __init__(self, emb: int, heads: int):
        super().__init__()
        self.heads = heads
        self.tokeys = nn.Linear(emb, emb, bias=False)
        self.toqueries = nn.Linear(emb, emb, bias=False)
        self.tovalues = nn.Linear(emb, emb, bias=False)
        self.unifyheads = nn.Linear(emb, emb)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, e = x.size()
        h, s = self.heads, e // self.heads
        keys = self.tokeys(x).view(b, t, h, s).transpose(1, 2).contiguous().view(b * h, t, s)
        queries = self.toqueries(x).view(b, t, h, s).transpose(1, 2).contiguous().view(b * h, t, s)
        values = self.tovalues(x).view(b, t, h, s).transpose(1, 2).contiguous().view(b * h, t, s)
        queries = queries / (e ** (1 / 4))
        keys = keys / (e ** (1 / 4))
        dot = F.softmax(torch.bmm(queries, keys.transpose(1, 2)), dim=2)  # (b*h, t, t)
        out = torch.bmm(dot, values).view(b, h, t, s)
        return self.unifyheads(out.transpose(1, 2).contiguous().view(b, t, s * h))


class NaiveBlock(nn.Module):
    """former's TransformerBlock: post-norm attention and ReLU feed-forward, dropout after each."""

    def __init__(self, emb: int, heads: int, ff_mult: int, dropout: float):
        super().__init__()
        self.attention = NaiveSelfAttention(emb, heads)
        self.norm1, self.norm2 = nn.LayerNorm(emb), nn.LayerNorm(emb)
        self.ff = nn.Sequential(nn.Linear(emb, ff_mult * emb), nn.ReLU(), nn.Linear(ff_mult * emb, emb))
        self.do = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.do(self.norm1(self.attention(x) + x))
        return self.do(self.norm2(self.ff(x) + x))


class NaiveCTransformer(nn.Module):
    """former's CTransformer with max pooling; returns log-probabilities. Ignores the mask."""

    def __init__(self, emb, heads, depth, seq_length, num_tokens, num_classes, ff_mult, dropout):
        super().__init__()
        self.token_embedding = nn.Embedding(num_tokens, emb)
        self.pos_embedding = nn.Embedding(seq_length, emb)
        self.tblocks = nn.Sequential(*(NaiveBlock(emb, heads, ff_mult, dropout) for _ in range(depth)))
        self.toprobs = nn.Linear(emb, num_classes)
        self.do = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        tokens = self.token_embedding(ids)
        b, t, e = tokens.size()
        positions = self.pos_embedding(torch.arange(t))[None, :, :].expand(b, t, e)
        x = self.tblocks(self.do(tokens + positions))
        return F.log_softmax(self.toprobs(x.max(dim=1)[0]), dim=1)


class TorchEncoderClassifier(nn.Module):
    """Token + learned position embeddings -> nn.TransformerEncoder -> masked max pooling -> linear."""

    def __init__(self, emb, heads, depth, seq_length, num_tokens, num_classes, ff_mult, dropout):
        super().__init__()
        self.tok = nn.Embedding(num_tokens, emb)
        self.pos = nn.Embedding(seq_length, emb)
        layer = nn.TransformerEncoderLayer(emb, heads, dim_feedforward=ff_mult * emb, dropout=dropout,
                                           activation="relu", batch_first=True, norm_first=False)
        # Dropout where (a) and (b) have it, after attention and after the feed-forward layer; not on
        # the attention weights (which would also send SDPA to its slower math kernel) nor inside
        # the feed-forward layer.
        layer.self_attn.dropout = 0.0
        layer.dropout = nn.Identity()
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Linear(emb, num_classes)
        self.drop = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(ids) + self.pos.weight[: ids.size(1)])
        h = self.encoder(x, src_key_padding_mask=~mask)  # True = padding
        return self.head(h.masked_fill(~mask.unsqueeze(-1), float("-inf")).amax(dim=1))


# --------------------------------------------------------------------------- variants


@dataclass
class Batch:
    ids: torch.Tensor  # (B, T) int64
    mask: torch.Tensor  # (B, T) bool, True at real tokens
    y: torch.Tensor  # (B,) int64


@dataclass
class Variant:
    key: str
    step: Callable[[Batch], float]  # one training step; returns the loss
    params: int
    heads: int  # attention heads of the model it steps
    precision: str = "fp32"
    times: list[float] = field(default_factory=list)
    shapes: list[tuple[int, int]] = field(default_factory=list)  # each step's (B, T) into the encoder
    first_sec: float = 0.0  # the first step's seconds (untimed): compilation, allocator warm-up
    note: str = ""


def ours(key: str, args, vocab: int) -> Variant:
    """A step as `tfm train` takes it: train_step on a run set up by build_run (one process, no accumulation)."""
    import tempfile

    from transformer_cli.config import Config, load_config
    from transformer_cli.data import Encoded
    from transformer_cli.model import CTransformer
    from transformer_cli.optim import LazyAdamW
    from transformer_cli.runtime import Runtime, resolve_precision
    from transformer_cli.train import Batch as StepBatch
    from transformer_cli.train import Classification, build_run, train_step

    mods = set(key.split("_")[1:])
    heads = next((h for m in mods if (h := heads_of(m))), args.heads)
    recipe = load_config(bc.REPO / "configs" / "wide-and-deep.toml")
    mc = replace(recipe.model, d_model=args.d_model, n_heads=heads, n_layers=args.layers, ff_mult=args.ff_mult,
                 dropout=args.dropout, attention="explicit" if "explicit" in mods else "auto",
                 ngram_buckets=recipe.model.ngram_buckets if "ngrams" in mods else 0,
                 lazy_embeddings="lazy" in mods)
    out = tempfile.TemporaryDirectory(prefix="bench-train-")  # build_run's output folder; nothing is written
    cfg = Config(model=mc, train=replace(recipe.train, output_dir=out.name, compile="compile" in mods))
    cpu = torch.device("cpu")
    precision = "bf16" if "bf16" in mods else "fp32" if "fp32" in mods else "auto"  # auto: as tfm train
    rt = Runtime(cpu, resolve_precision(precision, cpu))
    model = CTransformer(mc, vocab, args.seq_len)
    empty = Encoded(np.zeros(0, np.int32), np.zeros(1, np.int64), np.zeros(0, np.int64))
    task = Classification(empty, empty, ["neg", "pos"], cfg.train.label_smoothing, cfg.train.eval_batch_size)
    run = build_run(cfg, rt, model, task, None, False, {})
    if "foreach" in mods:  # the run's optimizer without the fused kernel
        tc = cfg.train
        cls = LazyAdamW if mc.lazy_embeddings else torch.optim.AdamW
        run.optimizer = cls(model.param_groups(tc.weight_decay), lr=tc.lr, betas=(tc.beta1, tc.beta2), foreach=True)
    shapes: list[tuple[int, int]] = []
    model.encoder.blocks[0].register_forward_pre_hook(lambda _, args: shapes.append(tuple(args[0].shape[:2])))  # (B, W)

    def step(b: Batch, keep=out) -> float:  # keep: the output folder lives as long as the step
        return train_step(run, [StepBatch((b.ids, b.mask, b.y), len(b.y), len(b.y), int(b.mask.sum()))]).stats["loss"]

    return Variant(key, step, model.num_params(), model.encoder.blocks[0].attn.n_heads, rt.precision, shapes=shapes)


def adam_reference(key: str, model: nn.Module, loss_fn: Callable, heads: int) -> Variant:
    """(b) and (c): the plain loop of the notebook: zero_grad, loss, backward, clip 1.0, Adam step."""
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)  # CPU default: the for-loop implementation
    shapes: list[tuple[int, int]] = []

    def step(b: Batch) -> float:
        shapes.append(tuple(b.ids.shape))
        opt.zero_grad()
        loss = loss_fn(model(b.ids, b.mask), b.y)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    return Variant(key, step, sum(p.numel() for p in model.parameters()), heads, shapes=shapes)


def build_variants(args, vocab: int) -> list[Variant]:
    sizes = (args.d_model, args.heads, args.layers, args.seq_len, vocab, 2, args.ff_mult, args.dropout)
    out = []
    for key in args.variants:
        torch.manual_seed(args.seed)  # the same init stream for every variant
        if key == "b":
            out.append(adam_reference(key, NaiveCTransformer(*sizes), F.nll_loss, args.heads))
        elif key == "c":
            out.append(adam_reference(key, TorchEncoderClassifier(*sizes), F.cross_entropy, args.heads))
        else:
            out.append(ours(key, args, vocab))
    return out


# --------------------------------------------------------------------------- batches


def synthetic_batches(args, n: int) -> tuple[list[Batch], int, str]:
    g = torch.Generator().manual_seed(args.seed)
    batches = []
    for _ in range(n):
        ids = torch.randint(5, args.vocab, (args.batch_size, args.seq_len), generator=g)
        ids[:, 0] = 2  # [CLS], as our pipeline starts every review with it
        mask = torch.ones(args.batch_size, args.seq_len, dtype=torch.bool)
        batches.append(Batch(ids, mask, torch.randint(0, 2, (args.batch_size,), generator=g)))
    return batches, args.vocab, f"T={args.seq_len} fixed, no padding"


def imdb_batches(args, n: int) -> tuple[list[Batch], int, str]:
    """The first n batches of epoch 0, as fit() draws them (cycled if there are fewer)."""
    from transformer_cli.config import DataConfig
    from transformer_cli.data import BucketSampler, collate, prepare_train_data

    cfg = DataConfig(source=args.data, vocab_size=args.vocab, max_length=args.seq_len,  # validation unused: small,
                     max_train_samples=args.max_train_samples, max_eval_samples=64)  # with every class in it
    t0 = bc.now()
    data = prepare_train_data(cfg, args.seed)
    prep = bc.now() - t0
    order = BucketSampler(data.train.lengths, args.batch_size, args.seed).batches(0)
    batches = [Batch(*(torch.from_numpy(a) for a in collate(data.train, order[i % len(order)]))) for i in range(n)]
    timed = batches[args.warmup:]
    padded = sum(b.ids.numel() for b in timed)
    info = (f"{len(data.train)} train reviews (data prep {prep:.1f} s); timed batches: T mean "
            f"{statistics.fmean(b.ids.size(1) for b in timed):.0f} (max {args.seq_len}), "
            f"{100 * (1 - sum(int(b.mask.sum()) for b in timed) / padded):.1f}% padding")
    return batches, data.tokenizer.get_vocab_size(), info


# --------------------------------------------------------------------------- running


def run_mode(mode: str, args) -> dict:
    n = args.warmup + args.steps
    batches, vocab, shape = (synthetic_batches if mode == "synthetic" else imdb_batches)(args, n)
    variants = build_variants(args, vocab)
    peak = bc.MatmulPeak()
    peaks = {"fp32": peak}
    if any(v.precision == "bf16" for v in variants):
        peaks["bf16"] = bc.MatmulPeak(dtype=torch.bfloat16)  # the ceiling of bf16 variants' matmuls
    for i, b in enumerate(batches):
        if i >= args.warmup:
            for p in peaks.values():
                p.sample()
        for v in variants:
            t0 = bc.now()
            loss = v.step(b)
            dt = bc.now() - t0
            if i >= args.warmup:
                v.times.append(dt)
            if i == 0:
                v.first_sec = dt
            if not math.isfinite(loss) and not v.note:
                v.note = f"non-finite loss at step {i}"

    timed = batches[args.warmup:]
    samples = sum(b.ids.size(0) for b in timed)
    tokens = sum(int(b.mask.sum()) for b in timed)

    def step_flops(shapes: list[tuple[int, int]]) -> float:
        return sum(3 * bc.forward_flops(args.d_model, args.layers, args.ff_mult, *shape) for shape in shapes)

    flops = step_flops([tuple(b.ids.shape) for b in timed])  # every column of every batch
    rows = []
    for v in variants:
        total = sum(v.times)
        ran = v.shapes[args.warmup:n]  # the timed steps' (B, T) into the encoder
        done = step_flops(ran)
        rows.append({"key": v.key, "variant": variant_name(v.key), "precision": v.precision, "params": v.params,
                     "heads": v.heads,
                     "ms_median": 1e3 * statistics.median(v.times), "ms_min": 1e3 * min(v.times),
                     "samples_per_sec": samples / total, "tokens_per_sec": tokens / total,
                     "width": statistics.fmean(w for _, w in ran),
                     "flops": done, "gflops": done / total / 1e9,
                     "pct_peak": 100 * done / total / 1e9 / peaks[v.precision].gflops,
                     "first_step_sec": v.first_sec, "note": v.note})
    ref = next((r for r in rows if r["key"] == "b"), None)
    for r in rows:
        r["vs_b"] = r["samples_per_sec"] / ref["samples_per_sec"] if ref else None

    print(f"-- {mode}: B={args.batch_size}, {shape}; d={args.d_model}, {args.heads} heads, {args.layers} layers, "
          f"ff {args.ff_mult}x, vocab {vocab}; {args.steps} timed steps after {args.warmup} warm-up")
    bc.print_table(rows, [("variant", "variant"), ("precision", "precision"), ("ms_median", "ms/step"), ("ms_min", "min ms"),
                          ("samples_per_sec", "samples/s"), ("tokens_per_sec", "tokens/s"), ("vs_b", "vs (b)"),
                          ("width", "T run"), ("gflops", "GFLOP/s"), ("pct_peak", "% peak")],
                   digits={"vs_b": 2, "gflops": 2, "width": 0})
    for r in rows:
        if r["note"]:
            print(f"   note {r['variant']}: {r['note']}")
        if "compile" in r["key"].split("_"):
            print(f"   {r['variant']}: first step {r['first_step_sec']:.1f} s, compilation included")
    for name, p in peaks.items():
        print(f"   peak: {p.describe()}, between the steps (% peak of {name} rows)")
    if ref:
        for name, p in peaks.items():
            print(f"   ceiling: {name} peak / (b)'s GFLOP/s = {p.gflops / ref['gflops']:.2f}x (b): no {name} variant "
                  "computing every column of the batches, as (b) does, can be faster than that")
    for v in variants:
        if v.key in args.profile:
            next(r for r in rows if r["key"] == v.key)["profile"] = profile(v, timed)
    print()
    return {"shape": shape, "timed_samples": samples, "timed_real_tokens": tokens, "flops": flops,
            "matmul_peak": peak.as_dict(), "matmul_peaks": {k: p.as_dict() for k, p in peaks.items()}, "rows": rows}


def profile(v: Variant, batches: list[Batch]) -> dict:
    """One more pass of `v` over the timed batches under torch.profiler (untimed)."""

    def run() -> None:
        for b in batches:
            v.step(b)

    return bc.profile_ops(run, f"profile {variant_name(v.key)}", per=len(batches), unit="step")


def main(argv=None) -> None:
    args = parse_args(argv)
    bc.set_threads(args.threads)
    info = bc.hardware_info()
    bc.print_header("bench_train: training-step throughput", info)
    modes = ["synthetic", "imdb"] if args.mode == "both" else [args.mode]
    results = {"hardware": info, "args": vars(args), "modes": {mode: run_mode(mode, args) for mode in modes}}

    def sps(mode: str, key: str) -> float | None:
        rows = results["modes"].get(mode, {}).get("rows", [])
        return next((r["samples_per_sec"] for r in rows if r["key"] == key), None)

    checks = []
    if sps("synthetic", "a") and sps("synthetic", "b"):
        checks.append(bc.check(f"(a) / (b) samples/s, synthetic T={args.seq_len}",
                               sps("synthetic", "a") / sps("synthetic", "b"), 5.0, "x"))
    if sps("synthetic", "a") and sps("imdb", "a"):
        checks.append(bc.check("(a) samples/s, imdb bucketed / synthetic", sps("imdb", "a") / sps("synthetic", "a"), 1.0, "x"))
    results["targets"] = checks
    bc.write_json(args.json, results)


if __name__ == "__main__":
    bc.run_script(main)
