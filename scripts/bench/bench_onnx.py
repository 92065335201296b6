"""Inference paths on the CPU: torch eager (`tfm evaluate`'s path) against onnxruntime on the `tfm export` file.

For each model (--checkpoint DIR and/or --untrained-config TOML, each repeatable; e.g. the default
recipe's runs/tfm and configs/seed.toml), on the same --texts reviews of --data, encoded once and cut
into the batches `tfm evaluate` runs (evaluate.batches_for: sorted by length, eval_batch_size
reviews, the CPU token budget):
  eager   evaluate.batched_logits: the model in the precision `tfm evaluate` picks, its CPU workers
  onnx    the exported graph in onnxruntime, one runner used by as many workers with as many
          intra-op threads each (evaluate.cpu_workers)
interleaved over --repeats rounds (median reviews/s), with the largest logit difference between the two.

The hand-written bf16 attention kernel (transformer_cli/kernels.py) runs only on CPUs with AVX-512
BF16; the script says whether this one has it, and where it does, times every eager path against
onnxruntime: fp32, bf16 with the kernel, and bf16 with torch's attention (the kernel off), the first
of them the baseline of the ratios. Model time only: tokenization is the same for all.

    python scripts/bench/bench_onnx.py -c runs/tfm --untrained-config configs/seed.toml --json onnx.json
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _bench_common as bc
import numpy as np


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", "-c", type=Path, action="append", default=[], help="output directory of `tfm train`")
    p.add_argument("--untrained-config", type=Path, action="append", default=[], metavar="TOML",
                   help="a randomly initialised model of this recipe's sizes (tokenizer trained on --data)")
    p.add_argument("--data", default=bc.DEFAULT_DATA)
    p.add_argument("--split", default="test")
    p.add_argument("--texts", type=int, default=2000, help="reviews drawn (seeded) from the split")
    p.add_argument("--max-train-samples", type=int, default=None,
                   help="--untrained-config: train the tokenizer on this many reviews (quick runs)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    if not args.checkpoint and not args.untrained_config:
        p.error("pass at least one --checkpoint DIR or --untrained-config TOML")
    if args.repeats < 1 or args.texts < 1:
        p.error("--repeats and --texts must be at least 1")
    return args


def kernel_status() -> tuple[bool, str]:
    from transformer_cli import kernels

    reason = kernels.unavailable_reason()
    if reason is None:
        return True, "available (AVX-512 BF16): eager bf16 runs its attention in the kernel"
    return False, f"unavailable: {reason}; eager bf16 and the kernel are not measured here"


def sample_texts(model_dir: Path, args) -> list[str]:
    from transformer_cli.data import load_splits
    from transformer_cli.evaluate import load_model_dir

    cfg = load_model_dir(model_dir).cfg
    raw, _ = load_splits(cfg.replace(data={"source": args.data}).data, (args.split,))
    texts = raw[args.split].texts
    return random.Random(args.seed).sample(texts, min(args.texts, len(texts)))


def onnx_logits(clf, enc, batches) -> np.ndarray:
    """Logits of every batch from the exported graph, run by evaluate.cpu_workers() workers."""
    from transformer_cli.data import collate
    from transformer_cli.evaluate import cpu_workers

    def run(idx):
        ids, mask, _ = collate(enc, idx)
        return clf.logits(ids, mask)

    out = np.zeros((len(enc), len(clf.labels)), dtype=np.float32)
    with ThreadPoolExecutor(cpu_workers()[0]) as pool:
        for idx, logits in zip(batches, pool.map(run, batches)):
            out[idx] = logits
    return out


def bench_model(name: str, model_dir: Path, args, tmp: Path, with_bf16: bool) -> dict:
    import torch

    from transformer_cli import evaluate as ev
    from transformer_cli import kernels
    from transformer_cli.data import Encoded, encode_texts
    from transformer_cli.export import OnnxClassifier, export_onnx
    from transformer_cli.runtime import resolve_precision

    rt, model, cfg, tokenizer, labels, temperature = ev.load_for_inference(model_dir, "cpu", None)
    texts = sample_texts(model_dir, args)
    d = cfg.data
    ids, offsets = encode_texts(tokenizer, texts, d.max_length, d.truncation, d.head_fraction)
    enc = Encoded(ids, offsets, np.zeros(len(texts), dtype=np.int64))
    batches = ev.batches_for(model, enc, cfg.train.eval_batch_size, rt)
    t0 = bc.now()
    exported = export_onnx(model_dir, tmp / "model.onnx")
    export_sec = bc.now() - t0
    clf = OnnxClassifier(exported["onnx"], threads=ev.cpu_workers()[1])

    def eager(run_rt, kernel: bool = kernels.enabled):
        """evaluate's logits in `run_rt`'s precision, with the bf16 attention kernel on or off."""
        def run():
            before, kernels.enabled = kernels.enabled, kernel
            try:
                return ev.batched_logits(model, enc, batches, run_rt, len(labels)).numpy() / temperature
            finally:
                kernels.enabled = before
        return run

    paths = {f"eager {rt.precision}": eager(rt)}
    if with_bf16:  # every eager path: fp32, bf16 with the kernel, bf16 with torch's attention
        rt_fp32, rt_bf16 = ev.make_runtime("cpu", "fp32"), ev.make_runtime("cpu", "fp32")
        rt_bf16.amp_dtype = resolve_precision("bf16", rt_bf16.device)
        paths = {"eager fp32": eager(rt_fp32), "eager bf16 (kernel)": eager(rt_bf16),
                 "eager bf16, kernel off": eager(rt_bf16, kernel=False)}
    paths["onnxruntime fp32"] = lambda: onnx_logits(clf, enc, batches)
    for run in paths.values():  # warm-up: allocator, oneDNN primitives, onnxruntime's arenas
        run()
    times = {path: [] for path in paths}
    logits = {}
    for _ in range(args.repeats):
        for path, run in paths.items():
            t0 = bc.now()
            logits[path] = run()
            times[path].append(bc.now() - t0)
    base = next(iter(paths))
    rows = [{"model": name, "path": path,
             "reviews_per_sec": len(texts) / statistics.median(t),
             "ratio": statistics.median(times[base]) / statistics.median(t),
             "max_abs_logit_diff": float(np.abs(logits[path] - logits[base]).max())}
            for path, t in times.items()]
    print(f"\n{name}: d_model {cfg.model.d_model}, {cfg.model.n_layers} layers, {cfg.model.n_heads} heads, "
          f"max_length {d.max_length}; {len(texts)} reviews in {len(batches)} batches; mean "
          f"{enc.lengths.mean():.0f} tokens; torch threads {torch.get_num_threads()}, workers x threads "
          f"{ev.cpu_workers()}; export took {export_sec:.1f} s ({exported['bytes'] / 1e6:.1f} MB)")
    bc.print_table(rows, [("path", "path"), ("reviews_per_sec", "reviews/s"), ("ratio", "x eager"),
                          ("max_abs_logit_diff", "max |logit diff|")], digits={"ratio": 2, "max_abs_logit_diff": 7})
    return {"model": name, "reviews": len(texts), "batches": len(batches),
            "mean_tokens": float(enc.lengths.mean()), "export_sec": export_sec, "rows": rows,
            "sec_all": times}


def main(argv=None) -> None:
    from bench_infer import untrained_model_dir

    args = parse_args(argv)
    info = bc.hardware_info()
    bc.print_header("inference paths: torch eager vs onnxruntime", info)
    has_kernel, kernel_line = kernel_status()
    print(f"bf16 attention kernel (transformer_cli.kernels): {kernel_line}")
    results = {"hardware": info, "kernel": kernel_line, "args": {k: str(v) for k, v in vars(args).items()},
               "models": []}
    tmp = Path(tempfile.mkdtemp(prefix="tfm-bench-onnx-"))
    try:
        models = [(str(d), d) for d in args.checkpoint]
        for i, config in enumerate(args.untrained_config):
            models.append((f"random {config}", untrained_model_dir(config, args, tmp / f"model{i}")))
        for i, (name, d) in enumerate(models):
            (tmp / f"export{i}").mkdir()
            results["models"].append(bench_model(name, d, args, tmp / f"export{i}", has_kernel))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    bc.write_json(args.json, results)


if __name__ == "__main__":
    bc.run_script(main)
