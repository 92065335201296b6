"""How faithful `tfm predict --explain` is on IMDB: hide each review's top 10% most-attributed tokens
(as padding), and separately as many random ones, and compare the mean drops of the predicted
label's probability. A ratio of 3 or more says the attributions point at what the model reads.

Reviews: a seeded random sample of the test split (a final report; nothing is chosen on it).

    OMP_NUM_THREADS=1 python scripts/faithfulness.py -c runs/tfm --data ../shared/data/imdb -n 300
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

from transformer_cli.errors import TfmError


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--checkpoint", default="runs/tfm", help="output directory of `tfm train`")
    ap.add_argument("--data", default=None, help="dataset (default: the run's data.source)")
    ap.add_argument("-n", type=int, default=300, help="test reviews to measure on")
    ap.add_argument("--fraction", type=float, default=0.1, help="share of each review's tokens to hide")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.n < 1 or not 0 < args.fraction <= 1:
        ap.error("-n must be at least 1 and --fraction in (0, 1]")

    from transformer_cli.calibration import saved_temperature
    from transformer_cli.data import load_splits
    from transformer_cli.evaluate import load_model_dir
    from transformer_cli.explain import faithfulness, integrated_gradients, review_ids

    t0 = time.perf_counter()
    model, cfg, tokenizer, _, _ = load_model_dir(args.checkpoint)
    temperature = saved_temperature(args.checkpoint)  # the probabilities `tfm predict --explain` shows
    if args.data:
        cfg = cfg.replace(data={"source": args.data})
    test = load_splits(cfg.data, ("test",))[0]["test"]
    pick = np.random.default_rng(args.seed).choice(len(test), size=min(args.n, len(test)), replace=False)
    reviews = []
    for ids in review_ids(tokenizer, [test.texts[i] for i in pick], cfg.data):
        with torch.no_grad():
            target = int(model(ids[None], torch.ones(1, len(ids), dtype=torch.bool)).argmax())
        attr, _ = integrated_gradients(model, ids, target, temperature=temperature)
        reviews.append((ids, target, attr[1:]))
    out = faithfulness(model, reviews, args.fraction, seed=args.seed, temperature=temperature)
    out.update({"checkpoint": str(args.checkpoint), "temperature": temperature,
                "torch_threads": torch.get_num_threads(),
                "mean_tokens": float(np.mean([len(r[0]) for r in reviews])), "seconds": time.perf_counter() - t0})
    print(f"{out['reviews']} test reviews ({out['mean_tokens']:.0f} tokens on average): hiding the top "
          f"{args.fraction:.0%} attributed tokens lowers the label's probability by {out['top_drop']:.4f}, "
          f"as many random tokens by {out['random_drop']:.4f}: "
          + (f"ratio {out['ratio']:.1f}x " if out["ratio"] is not None else "no ratio (random hiding did not lower it) ")
          + f"({out['seconds']:.0f} s, {out['torch_threads']} thread(s))")
    print(json.dumps(out))


if __name__ == "__main__":
    try:
        main()
    except TfmError as e:
        print(f"faithfulness: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
