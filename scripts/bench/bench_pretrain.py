"""Pretraining speed: `tfm pretrain`'s step against a straightforward masked-LM step, in one process.

What it measures
    Both variants start from the same weights and train on the same masked batches (BERT masking,
    the recipe's mask_prob), steps interleaved so that contention from other jobs hits both alike:

      tfm        transformer_cli.train.train_step on a run built as `tfm pretrain` builds it
                 (transformer_cli.pretrain: MaskedLM, whose head scores the masked positions only,
                 a chunk at a time; fused AdamW over the model's parameter groups; gradient
                 clipping; the run's precision)
      straight   written here, as a masked-LM step is usually written (e.g. BertForMaskedLM): the
                 same modules score every position over the whole vocabulary, cross-entropy with
                 ignore_index=-100 on the unmasked ones, torch.optim.AdamW (foreach), clipping; fp32
                 on a CPU, and under the run's autocast on a GPU (as GPU training is written)
      straight_amp  on a CPU where the run computes in bf16: the straightforward step under the same
                 autocast, so that the precision's share of the speed-up stands apart from the rest
      electra    tfm's step with pretrain.objective = "electra" (replaced-token detection: a generator
                 of pretrain.generator_layers blocks, then the encoder scores every real token), so
                 that the two objectives compare per CPU-second
      skipgram   tfm's step with pretrain.objective = "skipgram" (word2vec's word vectors: the token
                 embedding alone) on as many batches of whole texts from the same corpus, drawn by
                 the same sampler; its FLOPs are its dot products (no matmuls)
    and with rotary positions (model.pos_emb = "rope"):
      rope_fp32  tfm's step with q and k turned in fp32 (cast up, rotated, cast back), as rotary
                 embeddings are often written, where tfm turns them in the projections' own dtype
      learned    tfm's step with learned positions instead (model.pos_emb = "learned"): what the
                 rotation costs a step

    The first batch's loss of each straightforward step (and of rope_fp32) must equal tfm's (same
    weights, same batch) within a tolerance of the precision (1e-3 relative in fp32, 3e-2 in
    bf16/fp16), or the script exits 1. tokens/s counts real tokens (padding excluded). GFLOP/s is
    each variant's own matmul FLOPs
    (3 x forward: the encoder's linear layers and attention, the head's transform and vocabulary
    projection over the positions it scores) over its time; % peak divides that by the fp32
    torch.mm rate sampled between the steps of the same run, and, where the run computes in bf16 or
    fp16, % amp peak by the rate of torch.mm in that precision (the ceiling of its matmuls).
    With --device cuda every time is taken after the GPU has finished the step's work.

Data
    imdb       batches of `tfm pretrain`'s corpus (--data, --config), drawn as its sampler draws them
    synthetic  random ids with lengths spread over up to max_length (no dataset needed)

    python scripts/bench/bench_pretrain.py --config configs/pretrain.toml --data ../shared/data/imdb
    python scripts/bench/bench_pretrain.py --config configs/pretrain-gpu.toml --data ../shared/data/imdb --device cuda
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile

import _bench_common as bc
import numpy as np
import torch
import torch.nn.functional as F

from transformer_cli import model as model_module
from transformer_cli.config import PretrainConfig, load_config, parse_overrides
from transformer_cli.data import CLS_ID, BucketSampler, Encoded
from transformer_cli.model import MaskedLM, rotate_qk
from transformer_cli.pretrain import (
    NEGATIVES,
    Corpus,
    MaskedLanguageModelling,
    SkipGramTask,
    prepare_corpus,
    pretraining_model,
)
from transformer_cli.runtime import make_runtime
from transformer_cli.train import build_run, seed_everything, train_step


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(bc.REPO / "configs" / "pretrain.toml"),
                   help="the pretraining recipe (default: the checkout's configs/pretrain.toml)")
    p.add_argument("--data", default=bc.DEFAULT_DATA, help="dataset for --mode imdb")
    p.add_argument("--mode", choices=["imdb", "synthetic"], default="imdb")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant before timing")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--device", default="cpu", help="where the steps run: cpu (default), cuda or cuda:N")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("overrides", nargs="*", help="config overrides SECTION.FIELD=VALUE, e.g. model.n_layers=2")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


def synthetic_corpus(cfg, n: int) -> Corpus:
    rng = np.random.default_rng(0)
    lengths = rng.integers(cfg.data.max_length // 4, cfg.data.max_length + 1, n)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = rng.integers(5, cfg.data.vocab_size, int(offsets[-1])).astype(np.int32)
    ids[offsets[:-1]] = CLS_ID
    return Corpus(None, Encoded(ids, offsets, np.zeros(n, dtype=np.int64)), np.arange(n - 1), np.array([n - 1]))


def encoder_flops(cfg, batch) -> float:
    """Matmul FLOPs of one forward pass of the encoder over a padded (B, T) batch."""
    B, T = batch.tensors[0].shape
    return bc.forward_flops(cfg.model.d_model, cfg.model.n_layers, cfg.model.ff_mult, B, T, num_classes=0)


def head_flops(cfg, positions: int, vocab: int) -> float:
    C = cfg.model.d_model
    return 2.0 * positions * (C * C + C * vocab)


def rotate_qk_fp32(qkv: torch.Tensor, n_heads: int, rope) -> torch.Tensor:
    """The rotation in fp32 whatever qkv's dtype: cast up, turned, cast back."""
    return rotate_qk(qkv.float(), n_heads, rope).to(qkv.dtype)


@contextlib.contextmanager
def fp32_rotation():
    """tfm's model with rotate_qk_fp32 in place of its own rotation, for the with block."""
    model_module.rotate_qk = rotate_qk_fp32
    try:
        yield
    finally:
        model_module.rotate_qk = rotate_qk


def main(argv=None) -> int:
    args = parse_args(argv)
    bc.set_threads(args.threads)
    info = bc.hardware_info()
    bc.print_header("bench_pretrain: tfm pretrain's step against a straightforward masked-LM step", info)
    values = {"data.source": args.data, **parse_overrides(args.overrides)}
    cfg = load_config(args.config, values)
    rt = make_runtime(args.device, cfg.train.precision)
    on_gpu = rt.device.type == "cuda"
    n_batches = args.warmup + args.steps
    corpus = prepare_corpus(cfg) if args.mode == "imdb" else synthetic_corpus(cfg, cfg.train.batch_size * n_batches + 1)
    vocab = corpus.tokenizer.get_vocab_size() if corpus.tokenizer is not None else cfg.data.vocab_size
    task = MaskedLanguageModelling(corpus, cfg.pretrain, vocab)
    sampler = BucketSampler(task.lengths, cfg.train.batch_size, cfg.train.seed)
    seed_everything(cfg.train.seed)
    batches = [task.batch(rt, idx) for idx in sampler.batches(0)[:n_batches]]

    torch.manual_seed(cfg.train.seed)
    model = MaskedLM(cfg.model, vocab, cfg.data.max_length)
    amp_cpu = rt.amp_dtype is not None and not on_gpu  # then also the straightforward step in that precision
    electra_cfg = cfg.replace(pretrain={"objective": "electra"})
    electra = pretraining_model(electra_cfg, vocab)
    others = ("mask_prob", "window", "generator_layers", "detection_weight")  # the other objectives': at their defaults
    skipgram_cfg = cfg.replace(pretrain={"objective": "skipgram", **{f: getattr(PretrainConfig(), f) for f in others}})
    skipgram, skipgram_task = pretraining_model(skipgram_cfg, vocab), SkipGramTask(corpus, vocab)
    skipgram_sampler = BucketSampler(skipgram_task.lengths, cfg.train.batch_size, cfg.train.seed)
    skipgram_batches = [skipgram_task.batch(rt, idx) for idx in skipgram_sampler.batches(0)[:n_batches]]
    rope = cfg.model.pos_emb == "rope"
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as out2, \
            tempfile.TemporaryDirectory() as out3, tempfile.TemporaryDirectory() as out4, \
            tempfile.TemporaryDirectory() as out5:
        initial = {k: v.detach().clone() for k, v in model.state_dict().items()}  # before any step changes it
        run = build_run(cfg.replace(train={"output_dir": out}), rt, model, task, None, False, {})
        if rope:
            fp32_model = MaskedLM(cfg.model, vocab, cfg.data.max_length)
            fp32_model.load_state_dict(initial)
            fp32_run = build_run(cfg.replace(train={"output_dir": out4}), rt, fp32_model, task, None, False, {})
            learned_cfg = cfg.replace(model={"pos_emb": "learned"}, train={"output_dir": out5})
            torch.manual_seed(cfg.train.seed)
            learned_run = build_run(learned_cfg, rt, MaskedLM(learned_cfg.model, vocab, cfg.data.max_length), task,
                                    None, False, {})
        electra_run = build_run(electra_cfg.replace(train={"output_dir": out2}), rt, electra, task, None, False, {})
        skipgram_run = build_run(skipgram_cfg.replace(train={"output_dir": out3}), rt, skipgram, skipgram_task, None,
                                 False, {})

        def straightforward(amp: bool):
            """The straightforward step on its own copy of the model's initial weights."""
            straight = MaskedLM(cfg.model, vocab, cfg.data.max_length).to(rt.device)
            straight.load_state_dict(initial)
            optimizer = torch.optim.AdamW(straight.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay,
                                          foreach=True)

            def step(batch) -> float:
                masked, mask, picked, targets, *positions = batch.tensors  # positions with pretrain.window
                labels = torch.full((masked.numel(),), -100, dtype=torch.long, device=masked.device)
                labels[picked] = targets
                with rt.autocast() if amp else contextlib.nullcontext():
                    logits = straight.logits(straight.encoder(masked, mask, *positions))  # (B, T, V): every position
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), labels, ignore_index=-100)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(straight.parameters(), cfg.train.grad_clip)
                optimizer.step()
                return loss.item()

            return step

        variants = {"tfm": lambda b: train_step(run, [b]).stats["loss"], "straight": straightforward(on_gpu)}
        if amp_cpu:
            variants["straight_amp"] = straightforward(True)
        variants["electra"] = lambda b: train_step(electra_run, [b])
        variants["skipgram"] = lambda i: train_step(skipgram_run, [skipgram_batches[i]])
        if rope:
            def rope_fp32(b) -> float:
                with fp32_rotation():
                    return train_step(fp32_run, [b]).stats["loss"]

            variants["rope_fp32"] = rope_fp32
            variants["learned"] = lambda b: train_step(learned_run, [b])
        first_loss: dict[str, float] = {}
        times = {name: [] for name in variants}
        max_n = 8192 if on_gpu else 2048  # a GPU reaches its peak only on large products
        peaks = {"fp32": bc.MatmulPeak(max_n, device=rt.device)}
        if rt.amp_dtype is not None:  # the ceiling of the matmuls autocast runs
            peaks[rt.precision] = bc.MatmulPeak(max_n, dtype=rt.amp_dtype, device=rt.device)
        for i, batch in enumerate(batches):
            for name, step in variants.items():
                bc.synchronize(rt.device)
                t0 = bc.now()
                loss = step(i if name == "skipgram" else batch)
                bc.synchronize(rt.device)
                if i == 0 and name not in ("electra", "skipgram", "learned"):  # the same weights and batch
                    first_loss[name] = float(loss)
                if i >= args.warmup:
                    times[name].append(bc.now() - t0)
            for peak in peaks.values():
                peak.sample()

    timed, skipgram_timed = batches[args.warmup:], skipgram_batches[args.warmup:]
    tokens = {name: sum(b.tokens for b in timed) for name in times}
    tokens["skipgram"] = sum(b.tokens for b in skipgram_timed)
    every_position = sum(3 * (encoder_flops(cfg, b) + head_flops(cfg, b.tensors[0].numel(), vocab)) for b in timed)
    flops = {
        "tfm": sum(3 * (encoder_flops(cfg, b) + head_flops(cfg, b.units, vocab)) for b in timed),
        "straight": every_position, "straight_amp": every_position,  # the same step, in fp32 and under autocast
        "electra": sum(3 * (encoder_flops(cfg, b) * (1 + cfg.pretrain.generator_layers / cfg.model.n_layers)
                            + head_flops(cfg, b.units, vocab)) for b in timed),
        "skipgram": sum(3 * 2 * b.units * (NEGATIVES + 1) * cfg.model.d_model for b in skipgram_timed),
    }
    flops["rope_fp32"] = flops["learned"] = flops["tfm"]
    rows = []
    for name, ts in times.items():
        seconds = sum(ts)
        gflops = flops[name] / seconds / 1e9
        row = {"variant": name, "ms_step": 1000 * statistics.median(ts), "tokens_per_sec": tokens[name] / seconds,
               "gflops": gflops, "pct_peak": 100 * gflops / peaks["fp32"].gflops,
               "ms_steps": [round(1000 * t, 3) for t in ts]}  # tokens/s divides by their sum, ms/step is their median
        if rt.amp_dtype is not None:  # for the rows under autocast: a fp32 step has no such ceiling
            row["pct_amp_peak"] = None if name == "straight" and not on_gpu else 100 * gflops / peaks[rt.precision].gflops
        rows.append(row)
    speedup = rows[0]["tokens_per_sec"] / rows[1]["tokens_per_sec"]
    for row in rows:
        row["vs_straight"] = row["tokens_per_sec"] / rows[1]["tokens_per_sec"]
    m = cfg.model
    print(f"model    d{m.d_model}, {m.n_heads} heads, {m.n_layers} layers, ff {m.ff_mult}x; vocab {vocab}; "
          f"batch {cfg.train.batch_size}, max_length {cfg.data.max_length}, mask_prob {cfg.pretrain.mask_prob}; "
          f"{args.mode} batches, {args.steps} timed steps after {args.warmup}; {rt.precision} on {rt.device}")
    for peak in peaks.values():
        print(f"peak     {peak.describe()}")
    print()
    columns = [("variant", "variant"), ("ms_step", "ms/step"), ("tokens_per_sec", "tokens/s"),
               ("vs_straight", "vs straight"), ("gflops", "GFLOP/s"), ("pct_peak", "% peak")]
    if rt.amp_dtype is not None:
        columns.append(("pct_amp_peak", f"% {rt.precision} peak"))
    bc.print_table(rows, columns, {"ms_step": 0, "tokens_per_sec": 0, "vs_straight": 2, "gflops": 1, "pct_peak": 1,
                                   "pct_amp_peak": 1})
    result = bc.check("tfm pretrain's tokens/s over the straightforward step's", speedup, 2.0, "x")
    tolerance = 1e-3 if rt.amp_dtype is None else 3e-2
    agree = {name: abs(loss - first_loss["tfm"]) / abs(first_loss["tfm"]) for name, loss in first_loss.items()}
    print("first batch's loss: " + ", ".join(f"{name} {loss:.5f}" for name, loss in first_loss.items())
          + f"; largest relative difference to tfm's {max(agree.values()):.2e} (tolerance {tolerance:g})")
    if on_gpu:
        info["gpu"] = torch.cuda.get_device_name(rt.device)
    amp_peak = {"amp_peak": peaks[rt.precision].as_dict()} if rt.amp_dtype is not None else {}
    bc.write_json(args.json, {"hardware": info, "config": cfg.to_dict(), "mode": args.mode, "device": str(rt.device),
                              "precision": rt.precision, "peak": peaks["fp32"].as_dict(), **amp_peak,
                              "rows": rows, "target": result, "first_loss": first_loss,
                              "loss_tolerance": tolerance})
    if max(agree.values()) > tolerance:
        print("the straightforward step's loss differs from tfm's: they do not compute the same objective",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    bc.run_script(main)
