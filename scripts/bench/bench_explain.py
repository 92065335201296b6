"""Explanation time against a plain prediction, for one review at configs/seed.toml's sizes.

A plain prediction is one forward pass of the review (inference mode); an explanation is what
`tfm predict --explain` adds per review: integrated gradients (transformer_cli.explain) at the
default of IG_STEPS Gauss-Legendre nodes, or --steps. The model is randomly initialised (the time
does not depend on the weights) and the review is max_length tokens long. Both are timed in the
same run, alternating; the ratio of medians is the figure (target: at most 10x).

    OMP_NUM_THREADS=1 python scripts/bench/bench_explain.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _bench_common import REPO, check, hardware_info, now, print_header, run_script, set_threads, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--steps", type=int, default=None, help="integration nodes (default: IG_STEPS)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    if args.repeats < 1 or (args.steps is not None and args.steps < 1):
        ap.error("--repeats and --steps must be at least 1")
    set_threads(args.threads)
    info = hardware_info()
    print_header("explanation vs plain prediction, one review, configs/seed.toml sizes", info)

    from transformer_cli.config import load_config
    from transformer_cli.explain import IG_STEPS, integrated_gradients
    from transformer_cli.summary import model_from_config

    torch.manual_seed(0)
    cfg = load_config(REPO / "configs" / "seed.toml")
    model = model_from_config(cfg)
    T = cfg.data.max_length
    ids = torch.randint(5, cfg.data.vocab_size, (T,))
    mask = torch.ones(1, T, dtype=torch.bool)

    def predict() -> int:
        with torch.inference_mode():
            return int(model(ids[None], mask).argmax())

    target = predict()
    steps = args.steps or IG_STEPS
    for _ in range(3):  # warm-up
        predict()
        integrated_gradients(model, ids, target, steps)
    plain, explained = [], []
    for _ in range(args.repeats):
        t0 = now()
        predict()
        plain.append(now() - t0)
        t0 = now()
        integrated_gradients(model, ids, target, steps)
        explained.append(now() - t0)
    p, e = statistics.median(plain), statistics.median(explained)
    print(f"review of T = {T} tokens, {steps} nodes; median of {args.repeats}")
    print(f"plain prediction  {p * 1e3:8.2f} ms")
    print(f"explanation       {e * 1e3:8.2f} ms")
    result = check("explanation / plain prediction", e / p, 10.0, "x", higher_is_better=False)
    write_json(args.json, {"hardware": info, "tokens": T, "steps": steps, "plain_ms": p * 1e3, "explain_ms": e * 1e3,
                           "ratio": e / p, "check": result})


if __name__ == "__main__":
    run_script(main)
