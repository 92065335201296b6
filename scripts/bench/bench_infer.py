"""Inference speed: `tfm evaluate` throughput over a split, and `tfm predict` / `tfm --help` cold start.

What it measures
    (i)  For each model (--checkpoint DIR and/or --untrained-config TOML, each repeatable), the path
         `tfm evaluate` takes (transformer_cli.evaluate.evaluate_checkpoint), stage by stage, in
         this process, in the precision `tfm evaluate` picks (--precision; default: fp32 for a run
         trained in fp32, else "auto": bf16 on a CPU with native bf16), with torch's default threads
         unless --threads:
           import datasets   once per process (tfm evaluate pays it after loading the model)
           data prep         prepare_eval_data: load the split, fingerprint it, read the encoded
                             split from the cache. Timed twice: the first call encodes if the cache
                             has no entry yet (shown); the second, cached one is what is counted.
           model             evaluate_model over the split, median of --repeats passes after one
                             untimed forward of the largest batch; reviews/s, real tokens/s, and
                             the achieved GFLOP/s (analytic count over the padded batches) as a
                             share of a torch.mm peak in the same precision timed between the passes
           end to end        reviews / (import datasets + cached data prep + model), i.e. what
                             `tfm evaluate` gives after the model is loaded; checked against the
                             issue's 1000 reviews/s, with the GFLOP/s that rate would need
         --compare-tokens-per-thread 0,2048,4096,8192 also times evaluate_model on a seeded subset
         (--compare-samples reviews) with each CPU batch budget (transformer_cli.evaluate.
         CPU_TOKENS_PER_THREAD; 0 = no token budget, plain batches of batch_size reviews as before),
         interleaved over --compare-rounds rounds, as speed ratios to the shipped default.
         --compare-precision adds the other of fp32 and bf16 to that comparison (bf16 on a CPU with
         native bf16 only), with its accuracy and loss beside the default's.
         --compare-workers adds CPU_WORKERS = 1 to that comparison: one worker whose torch threads
         share each operation, against the default's workers, each running whole batches on its
         share of the threads (on 2 cores: 2 workers of one thread).
         --compare-attention adds the model with transformer_cli.kernels off (its attention in
         F.scaled_dot_product_attention, as before the kernel) to that comparison, in bf16 only (the
         kernel runs only there) and where the kernel is available.
         --compile also times evaluate_model over the split with the model under torch.compile
         (inductor, dynamic shapes, weights frozen as constants): the first pass, which compiles,
         and the median of --repeats more, against the eager passes above; and how far its logits
         are from eager's. `tfm evaluate` itself runs eager.
         --profile runs evaluate_model once more on the --compare-samples subset under torch.profiler
         (untimed) and prints the share of the ops' self CPU time (all workers' threads) taken by
         attention kernels, the linear layers' matmuls, casts and copies, and the rest, with the
         ops that took the most (_bench_common.profile_ops, as bench_train.py --profile).
    (ii) Cold start of fresh subprocesses (the first model), median of --runs, interleaved, after one
         untimed round (so that files are in the page cache): python -c pass, python -c "import
         torch", tfm --help, tfm predict -c MODEL TEXT; checked against the targets tfm --help <= 0.5 s
         and predict <= import torch + 0.5 s. tfm runs as `python -m transformer_cli` in the
         repository with it first on PYTHONPATH: the checkout being benchmarked, not the copy an
         installed `tfm` script may import. With --long-review-mb N (default 50; 0 = off) also
         tfm predict -c MODEL --file LONG, LONG one review of N MB (seeded words, `<br` and `/>`),
         as a ratio to predict TEXT; and the peak RSS (VmHWM) of both predicts, from one more run each.

Models
    --checkpoint OUT          a `tfm train` output directory (e.g. runs/tfm: the default recipe's sizes)
    --untrained-config TOML   a randomly initialised model of that recipe's sizes (e.g.
                              configs/seed.toml), with a tokenizer trained on --data by our own
                              pipeline (cached), in a temporary model directory; the same code
                              paths run. Its accuracy is meaningless (~0.5); its speed is not.

Examples
    python scripts/bench/bench_infer.py --checkpoint runs/tfm --untrained-config configs/seed.toml --json infer.json
    python scripts/bench/bench_infer.py -c runs/tfm --max-samples 300 --runs 2 --compare-tokens-per-thread 0,4096
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import _bench_common as bc
import numpy as np

TARGET_REVIEWS_PER_SEC = 1000


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", "-c", type=Path, action="append", default=[], help="output directory of `tfm train`")
    p.add_argument("--untrained-config", type=Path, action="append", default=[], metavar="TOML",
                   help="benchmark a randomly initialised model of this recipe's sizes")
    p.add_argument("--data", default=bc.DEFAULT_DATA, help="dataset to evaluate on (and to train tokenizers on)")
    p.add_argument("--split", default="test")
    p.add_argument("--max-samples", type=int, default=None, help="evaluate a seeded subset of this size")
    p.add_argument("--max-train-samples", type=int, default=None,
                   help="--untrained-config: train the tokenizer on this many reviews (quick runs)")
    p.add_argument("--batch-size", type=int, default=None, help="default: the model's train.eval_batch_size")
    p.add_argument("--repeats", type=int, default=1, help="timed evaluate_model passes over the split (median)")
    p.add_argument("--compare-tokens-per-thread", default=None, metavar="N,N,...",
                   help="also compare these CPU batch budgets (0 = none) on a subset, interleaved")
    p.add_argument("--compare-workers", action="store_true",
                   help="also compare CPU evaluation with one worker of all threads (CPU_WORKERS = 1), interleaved")
    p.add_argument("--compare-precision", action="store_true",
                   help="also compare evaluation in the other of fp32 and bf16, interleaved")
    p.add_argument("--compare-attention", action="store_true",
                   help="also time the model with transformer_cli.kernels off (F.scaled_dot_product_attention)")
    p.add_argument("--precision", default=None, help="auto, fp32 or bf16 (default: what tfm evaluate picks)")
    p.add_argument("--compare-samples", type=int, default=1000)
    p.add_argument("--compare-rounds", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="also time evaluate_model under torch.compile")
    p.add_argument("--profile", action="store_true",
                   help="also profile evaluate_model on --compare-samples reviews: where its time went")
    p.add_argument("--threads", type=int, default=None, help="torch threads in this process")
    p.add_argument("--runs", type=int, default=5, help="timed runs of each cold-start command (median)")
    p.add_argument("--text", default="A wonderful film: the acting was superb and I loved every minute of it.")
    p.add_argument("--long-review-mb", type=float, default=50.0, help="size of the one long review predicted (0 = skip)")
    p.add_argument("--skip-throughput", action="store_true", help="only measure cold start (ii)")
    p.add_argument("--skip-cold-start", action="store_true", help="only measure throughput (i)")
    p.add_argument("--json", default=None, metavar="PATH", help="write all results as JSON")
    args = p.parse_args(argv)
    if not args.checkpoint and not args.untrained_config:
        p.error("pass at least one --checkpoint DIR or --untrained-config TOML")
    if args.repeats < 1 or args.runs < 1 or args.compare_rounds < 1:
        p.error("--repeats, --runs and --compare-rounds must be at least 1")
    budgets = [v.strip() for v in (args.compare_tokens_per_thread or "").split(",") if v.strip()]
    if not all(v.isdigit() for v in budgets):  # checked before the measurements, not after them
        p.error(f"--compare-tokens-per-thread {args.compare_tokens_per_thread!r}: give whole numbers of tokens, 0 or "
                "more, separated by commas (e.g. 0,4096)")
    args.token_budgets = [int(v) for v in budgets]
    return args


def untrained_model_dir(config_path: Path, args, where: Path) -> Path:
    """Write config.json, tokenizer.json and random weights as `tfm train` would."""
    import torch

    from transformer_cli import checkpoint as ckpt
    from transformer_cli.config import load_config
    from transformer_cli.data import prepare_train_data
    from transformer_cli.fileio import atomic_write_bytes
    from transformer_cli.model import CTransformer

    overrides = {"data.source": args.data}
    if args.max_train_samples:
        # a small validation sample (it is not used), large enough to hold every class, as training requires
        overrides.update({"data.max_train_samples": args.max_train_samples, "data.max_eval_samples": 64})
    cfg = load_config(config_path, overrides)
    t0 = bc.now()
    prepared = prepare_train_data(cfg.data, cfg.train.seed)  # trains (or loads) the tokenizer
    vocab = prepared.tokenizer.get_vocab_size()
    torch.manual_seed(cfg.train.seed)
    model = CTransformer(cfg.model, vocab, cfg.data.max_length, len(prepared.labels))
    ckpt.save_model_files(where, cfg.to_dict(), prepared.tokenizer.to_str(), prepared.labels, vocab)
    atomic_write_bytes(where / ckpt.MODEL_FILE, ckpt.state_bytes(model))
    print(f"random {config_path} model in {where}: tokenizer ({vocab} entries) ready in {bc.now() - t0:.1f} s")
    return where


# --------------------------------------------------------------------------- (i) throughput


def throughput(model_dir: Path, args, import_datasets_sec: float) -> dict:
    import torch

    from transformer_cli import evaluate as ev
    from transformer_cli.data import batch_width, collate, prepare_eval_data
    from transformer_cli.fileio import cache_dir

    t0 = bc.now()
    rt, model, cfg, tokenizer, labels, _ = ev.load_for_inference(model_dir, "cpu", args.precision)  # as tfm evaluate
    load_sec = bc.now() - t0
    cfg = cfg.replace(data={"source": args.data})
    entries = set(cache_dir(cfg.data.cache_dir).glob("encoded-*.npz"))
    t0 = bc.now()
    enc = prepare_eval_data(cfg.data, tokenizer, args.split, args.max_samples, cfg.train.seed)
    first_prep_sec = bc.now() - t0
    encoded = bool(set(cache_dir(cfg.data.cache_dir).glob("encoded-*.npz")) - entries)
    t0 = bc.now()
    enc = prepare_eval_data(cfg.data, tokenizer, args.split, args.max_samples, cfg.train.seed)
    prep_sec = bc.now() - t0

    m, n, batch_size = cfg.model, len(enc), args.batch_size or cfg.train.eval_batch_size
    batches = ev.batches_for(model, enc, batch_size, rt)
    widths = [batch_width(enc, i) for i in batches]  # as collate pads them
    flops = sum(bc.forward_flops(m.d_model, m.n_layers, m.ff_mult, len(i), w) for i, w in zip(batches, widths))
    padded = sum(len(i) * w for i, w in zip(batches, widths))
    real_tokens = int(enc.lengths.sum())
    largest = max(batches, key=lambda i: len(i) * enc.lengths[i].max())
    with torch.inference_mode(), rt.autocast():  # untimed warm-up on the largest batch (oneDNN, allocator)
        model(*rt.tensors(*collate(enc, largest))[:2])
    peak, times = bc.MatmulPeak(dtype=rt.amp_dtype), []  # in the precision the matmuls run in
    for _ in range(args.repeats):
        t0 = bc.now()
        metrics = ev.evaluate_model(model, enc, rt, batch_size, len(labels))
        times.append(bc.now() - t0)
        peak.sample(3)
    model_sec = statistics.median(times)
    # What a fresh `tfm evaluate` pays for its data: the first call if that was a cache hit (it also
    # opens the dataset); after encoding, the in-process cache hit is the nearest figure.
    e2e_prep_sec = prep_sec if encoded else first_prep_sec
    e2e_sec = import_datasets_sec + e2e_prep_sec + model_sec
    e2e_gflops = flops / e2e_sec / 1e9
    rows = [
        {"stage": "import datasets (once per process)", "sec": import_datasets_sec},
        {"stage": "data prep, first call (" + ("encoded the split" if encoded else "cache hit") + ")",
         "sec": first_prep_sec, "reviews_per_sec": n / first_prep_sec},
        {"stage": "data prep, cached", "sec": prep_sec, "reviews_per_sec": n / prep_sec},
        {"stage": f"model: evaluate_model (median of {args.repeats})", "sec": model_sec, "reviews_per_sec": n / model_sec,
         "tokens_per_sec": real_tokens / model_sec, "gflops": flops / model_sec / 1e9,
         "pct_peak": 100 * flops / model_sec / 1e9 / peak.gflops},
        {"stage": "end to end after load: import + prep from the cache + model", "sec": e2e_sec,
         "reviews_per_sec": n / e2e_sec,
         "tokens_per_sec": real_tokens / e2e_sec, "gflops": e2e_gflops, "pct_peak": 100 * e2e_gflops / peak.gflops},
    ]
    params = sum(p.numel() for p in model.parameters())
    print(f"-- (i) evaluate {model_dir}: d={m.d_model}, {m.n_heads} heads, {m.n_layers} layers, {m.norm}-norm, "
          f"{m.pooling} pooling, {params:,} params; {n} {args.split} reviews, {real_tokens:,} real tokens, "
          f"{len(batches)} batches (<= {batch_size} reviews, <= {ev.cpu_batch_tokens()} padded tokens), "
          f"{100 * (1 - real_tokens / padded):.1f}% padding, {describe_setting()}, {rt.precision}; "
          f"load {load_sec:.2f} s")
    bc.print_table(rows, [("stage", "stage"), ("sec", "seconds"), ("reviews_per_sec", "reviews/s"),
                          ("tokens_per_sec", "tokens/s"), ("gflops", "GFLOP/s"), ("pct_peak", "% peak")],
                   digits={"sec": 2, "gflops": 1})
    need = TARGET_REVIEWS_PER_SEC * flops / n / 1e9
    print(f"   peak: {peak.describe()}, between the passes; accuracy {metrics['accuracy']:.4f} (a sanity check only)")
    print(f"   {TARGET_REVIEWS_PER_SEC} reviews/s would take {need:.0f} GFLOP/s = {need / peak.gflops:.1f}x that peak")
    check = bc.check(f"reviews/s end to end after load, {model_dir}", n / e2e_sec, TARGET_REVIEWS_PER_SEC)
    result = {"model_dir": str(model_dir), "reviews": n, "batches": len(batches), "batch_size": batch_size,
              "real_tokens": real_tokens, "padded_tokens": padded, "flops": flops, "params": params,
              "precision": rt.precision, "load_sec": load_sec, "model_sec_all": times, "matmul_peak": peak.as_dict(),
              "accuracy": metrics["accuracy"], "rows": rows, "target": check}
    if args.compare_tokens_per_thread or args.compare_workers or args.compare_precision or args.compare_attention:
        result["compare"] = compare_settings(model, enc, rt, batch_size, len(labels), args)
    if args.compile:
        result["compile"] = compare_compile(model, enc, rt, batch_size, len(labels), args)
    if args.profile:
        part = compare_subset(enc, args)
        result["profile"] = bc.profile_ops(lambda: ev.evaluate_model(model, part, rt, batch_size, len(labels)),
                                           f"profile evaluate_model, {len(part)} reviews", per=len(part), unit="review")
    print()
    return result


def compare_subset(enc, args):
    """The seeded --compare-samples reviews that comparisons and the profile run on."""
    from transformer_cli.data import sample_indices

    return enc.subset(sample_indices(np.arange(len(enc)), args.compare_samples, seed=0))


def compare_settings(model, enc, rt, batch_size: int, num_labels: int, args) -> list[dict]:
    """evaluate_model on a seeded subset under each setting of transformer_cli.evaluate's CPU batching
    (the shipped default first), interleaved over --compare-rounds rounds."""
    import torch

    from transformer_cli import evaluate as ev
    from transformer_cli import kernels
    from transformer_cli.runtime import cpu_has_fast_bf16

    changes = [{}]
    for v in args.token_budgets:
        if v != ev.CPU_TOKENS_PER_THREAD:
            changes.append({"CPU_TOKENS_PER_THREAD": v})
    if args.compare_workers and ev.CPU_WORKERS != 1:
        changes.append({"CPU_WORKERS": 1})
    if args.compare_precision and (rt.amp_dtype is not None or cpu_has_fast_bf16()):
        changes.append({"precision": "fp32" if rt.amp_dtype is not None else "bf16"})
    if args.compare_attention and rt.amp_dtype is torch.bfloat16 and kernels.available():
        changes.append({"cpu_kernels": False})
    labels, runtimes = [], []
    for change in changes:
        run_rt = with_precision(rt, change.get("precision"))
        runtimes.append(run_rt)
        with evaluate_setting(change):
            labels.append(("default: " if not change else "") + f"{describe_setting()}, {run_rt.precision}")
    part = compare_subset(enc, args)
    times: list[list[float]] = [[] for _ in changes]
    results: list[dict] = [{} for _ in changes]
    for _ in range(args.compare_rounds):
        for change, run_rt, ts, result in zip(changes, runtimes, times, results):
            with evaluate_setting(change):
                t0 = bc.now()
                result.update(ev.evaluate_model(model, part, run_rt, batch_size, num_labels))
                ts.append(bc.now() - t0)
    rows = [{"setting": label, "median_sec": statistics.median(ts),
             "reviews_per_sec": len(part) / statistics.median(ts),
             "vs_default": statistics.median(d / t for d, t in zip(times[0], ts)),
             "accuracy": result["accuracy"], "loss": result["loss"]}
            for label, ts, result in zip(labels, times, results)]
    print(f"   CPU batching, {len(part)} reviews, {args.compare_rounds} interleaved rounds:")
    bc.print_table(rows, [("setting", "setting"), ("median_sec", "seconds"), ("reviews_per_sec", "reviews/s"),
                          ("vs_default", "speed / default's"), ("accuracy", "accuracy"), ("loss", "loss")],
                   digits={"median_sec": 2, "vs_default": 2, "accuracy": 4, "loss": 6})
    return rows


def with_precision(rt, precision: str | None):
    """`rt` in another precision (None: as it is)."""
    import dataclasses

    from transformer_cli.runtime import resolve_precision

    return rt if precision is None else dataclasses.replace(rt, amp_dtype=resolve_precision(precision, rt.device))


@contextlib.contextmanager
def evaluate_setting(change: dict):
    """transformer_cli.evaluate's module settings changed inside, restored after ("precision" is
    the runtime's, not a module setting; "cpu_kernels" is transformer_cli.kernels.enabled)."""
    from transformer_cli import evaluate as ev
    from transformer_cli import kernels

    targets = {name: (kernels, "enabled") if name == "cpu_kernels" else (ev, name) for name in change
               if name != "precision"}  # setting -> (module, attribute)
    before = {name: getattr(*target) for name, target in targets.items()}
    for name, (module, attr) in targets.items():
        setattr(module, attr, change[name])
    try:
        yield
    finally:
        for name, (module, attr) in targets.items():
            setattr(module, attr, before[name])


def describe_setting() -> str:
    from transformer_cli import evaluate as ev
    from transformer_cli import kernels

    workers, per_worker = ev.cpu_workers()
    tokens = ev.CPU_TOKENS_PER_THREAD
    batches = "batches of batch_size reviews" if tokens == 0 else f"<= {tokens} tokens/thread"
    kernel_off = ", bf16 attention kernel off" if not kernels.enabled else ""
    return f"{batches}, {workers} worker(s) of {per_worker} thread(s){kernel_off}"


def compare_compile(model, enc, rt, batch_size: int, num_labels: int, args) -> dict:
    import torch
    import torch._inductor.config as inductor_config

    from transformer_cli import evaluate as ev

    batches = ev.batches_for(model, enc, batch_size, rt)
    model.eval()
    inductor_config.freezing = True  # weights as constants: lets inductor fold them into oneDNN kernels
    compiled = torch.compile(model, dynamic=True)
    t0 = bc.now()
    logits = ev.batched_logits(compiled, enc, batches, rt, num_labels)
    first = bc.now() - t0
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    outputs: dict[str, torch.Tensor] = {}
    for _ in range(args.repeats):  # interleaved, so contention hits both alike
        for name, engine in (("eager", model), ("compiled", compiled)):
            t0 = bc.now()
            outputs[name] = ev.batched_logits(engine, enc, batches, rt, num_labels)
            times[name].append(bc.now() - t0)
    eager = outputs["eager"]
    eager_sec, compiled_sec = statistics.median(times["eager"]), statistics.median(times["compiled"])
    result = {"first_pass_sec": first, "eager_sec": eager_sec, "compiled_sec": compiled_sec,
              "reviews_per_sec": len(enc) / compiled_sec, "vs_eager": eager_sec / compiled_sec,
              "max_abs_logit_diff": float((logits - eager).abs().max()),
              "same_label": float((logits.argmax(-1) == eager.argmax(-1)).double().mean())}
    print(f"   torch.compile (dynamic, frozen weights), model forward only, median of {args.repeats}: "
          f"{compiled_sec:.2f} s against eager's {eager_sec:.2f} s ({result['vs_eager']:.2f}x, "
          f"{result['reviews_per_sec']:,.0f} reviews/s) after a first pass of {first:.1f} s (compiling); "
          f"logits within {result['max_abs_logit_diff']:.1e} of eager's, same label on {result['same_label']:.2%}")
    return result


# --------------------------------------------------------------------------- (ii) cold start


# `tfm` run by a Python that prints its peak resident memory last, on stderr; it imports
# transformer_cli from the checkout on PYTHONPATH (bc.child_env), as the timed commands do.
WITH_PEAK_RSS = ("import atexit, sys; sys.path[0] = {scripts!r}; import _bench_common as bc; "
                 "atexit.register(lambda: print(f'VmHWM_MB={{bc.peak_rss_mb()}}', file=sys.stderr)); "
                 "from transformer_cli.cli import main; main()")


def long_review(path: Path, megabytes: float) -> Path:
    """One review of `megabytes` MB on one line: seeded words, punctuation and pieces of <br /> tags."""
    import random

    rng = random.Random(0)
    words = ("the film was great but its plot , honestly , dragged <br /><br /> and the acting felt wooden ! "  # noqa: SIM905
             "I loved the music though .").split()
    n = int(megabytes * 1e6)
    path.write_text(" ".join(rng.choice(words) for _ in range(n // 4))[:n] + "\n", encoding="utf-8")
    return path


def cold_start(model_dir: Path, args, tmp: Path) -> dict:
    # tfm as `python -m transformer_cli`, with this checkout on PYTHONPATH (bc.child_env), in the
    # repository: the code being benchmarked, not whatever copy an installed `tfm` script imports
    py = sys.executable
    tfm = [py, "-m", "transformer_cli"]
    model_dir = model_dir.resolve()  # the commands run in the repository, not in the user's folder
    predict = ["predict", "-c", str(model_dir), args.text]
    commands = {
        "python -c pass": [py, "-c", "pass"],
        "python -c 'import torch'": [py, "-c", "import torch"],
        "tfm --help": [*tfm, "--help"],
        "tfm predict -c MODEL TEXT": [*tfm, *predict],
    }
    if args.long_review_mb > 0:
        long = long_review(tmp / "long-review.txt", args.long_review_mb)
        long_predict = ["predict", "-c", str(model_dir), "--file", str(long)]
        commands[f"tfm predict -c MODEL --file LONG ({args.long_review_mb:g} MB)"] = [*tfm, *long_predict]
    times: dict[str, list[float]] = {name: [] for name in commands}
    printed = {}
    for r in range(args.runs + 1):  # round 0 is the untimed warm-up
        for name, cmd in commands.items():
            wall, proc = bc.run_timed(cmd)
            printed[name] = proc.stdout.strip()[:100]
            if r:
                times[name].append(wall)
    rows = [{"command": k, "median_sec": statistics.median(v), "min_sec": min(v), "max_sec": max(v)} for k, v in times.items()]
    med = {r["command"]: r["median_sec"] for r in rows}
    peaks = {"tfm predict -c MODEL TEXT": predict} | ({rows[-1]["command"]: long_predict} if args.long_review_mb > 0 else {})
    for row in rows:
        if row["command"] in peaks:
            _, proc = bc.run_timed([py, "-c", WITH_PEAK_RSS.format(scripts=str(Path(__file__).parent)),
                                    *peaks[row["command"]]])
            row["peak_rss_mb"] = float(proc.stderr.strip().splitlines()[-1].removeprefix("VmHWM_MB="))
            row["vs_predict_text"] = row["median_sec"] / med["tfm predict -c MODEL TEXT"]
    print(f"-- (ii) cold start: fresh processes, median of {args.runs} runs after one untimed round; model {model_dir}")
    bc.print_table(rows, [("command", "command"), ("median_sec", "median s"), ("min_sec", "min s"), ("max_sec", "max s"),
                          ("vs_predict_text", "x predict TEXT"), ("peak_rss_mb", "peak RSS MB")],
                   digits={"median_sec": 3, "min_sec": 3, "max_sec": 3, "vs_predict_text": 2, "peak_rss_mb": 0})
    for name in peaks:
        print(f"   {name} printed: {printed[name]}")
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        print("   note: PYTHONDONTWRITEBYTECODE is set, so transformer_cli's modules are compiled on every start")
    over = med["tfm predict -c MODEL TEXT"] - med["python -c 'import torch'"]
    checks = [bc.check("tfm --help", med["tfm --help"], 0.5, " s", higher_is_better=False),
              bc.check("tfm predict - import torch", over, 0.5, " s", higher_is_better=False)]
    print()
    return {"rows": rows, "printed": printed, "predict_minus_import_torch_sec": over, "targets": checks}


def main(argv=None) -> None:
    args = parse_args(argv)
    bc.set_threads(args.threads)
    info = bc.hardware_info()
    bc.print_header("bench_infer: evaluate throughput and predict cold start", info)
    t0 = bc.now()
    import datasets  # noqa: F401  (timed: `tfm evaluate` imports it after loading the model)

    import_datasets_sec = bc.now() - t0
    results: dict = {"hardware": info, "args": {k: str(v) for k, v in vars(args).items()}, "throughput": []}
    tmp = Path(tempfile.mkdtemp(prefix="tfm-bench-infer-"))
    try:
        dirs = list(args.checkpoint)
        for i, config in enumerate(args.untrained_config):
            dirs.append(untrained_model_dir(config, args, tmp / f"model{i}"))
        print()
        if not args.skip_throughput:
            results["throughput"] = [throughput(d, args, import_datasets_sec) for d in dirs]
        if not args.skip_cold_start:
            results["cold_start"] = cold_start(dirs[0], args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    bc.write_json(args.json, results)


if __name__ == "__main__":
    bc.run_script(main)
