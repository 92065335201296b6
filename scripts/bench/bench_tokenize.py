"""Encoding speed: transformer_cli's subword_ids (ASCII texts in Python, with a cache of each word's
pieces) against the tokenizers library's fast batch alone, on the same reviews, in one process.

What it measures
    A trained model's tokenizer (`-c RUN`) encodes `--texts` reviews of a split, without truncation:
      library   Tokenizer.encode_batch_fast (Rust; it spreads a batch over the CPU's threads)
      tfm       data.subword_ids, which encode_texts calls: ASCII texts through AsciiWordPiece,
                the others through the library's batch
    each in calls of 32 reviews (as `tfm serve` encodes a batch of requests) and in one call of all
    (as data preparation and `tfm evaluate` encode a split). The rounds alternate between the two,
    and each tfm round starts with an empty word cache (a fresh process's first pass over the data).
    Reported per way and call size: the best round's reviews/s, and CPU milliseconds a review
    (user + system, all threads), which depends less than the rate on the cores' other work.

    Every round's ids are compared with the library's: the script exits 1 on any difference.

Example
    python scripts/bench/bench_tokenize.py -c runs/tfm --data ../shared/data/imdb --rounds 3
"""

from __future__ import annotations

import argparse
import sys
import time

import _bench_common as bc


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", "-c", required=True, help="output directory of `tfm train` (its tokenizer)")
    p.add_argument("--data", default=bc.DEFAULT_DATA, help="dataset the reviews come from")
    p.add_argument("--split", default="test")
    p.add_argument("--texts", type=int, default=5000, help="reviews drawn from the split")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None, metavar="PATH", help="write all results as JSON")
    args = p.parse_args(argv)
    if args.texts < 32 or args.rounds < 1:
        p.error("--texts must be 32 or more and --rounds 1 or more")
    return args


def timed(encode, calls: list[list[str]]) -> tuple[float, float, list]:
    """(seconds, CPU seconds, ids) of encoding each call in turn."""
    t0, c0 = time.perf_counter(), time.process_time()
    ids = [row for call in calls for row in encode(call)]
    return time.perf_counter() - t0, time.process_time() - c0, ids


def main(argv=None) -> int:
    args = parse_args(argv)
    import numpy as np

    from transformer_cli import data
    from transformer_cli.evaluate import load_model_dir

    info = bc.hardware_info()
    bc.print_header("bench_tokenize: subword_ids against the tokenizers library's batch", info)
    run = load_model_dir(args.checkpoint)
    tokenizer = run.tokenizer
    tokenizer.encode_special_tokens = True  # as encode_texts sets it
    raw, _ = data.load_splits(run.cfg.replace(data={"source": args.data}).data, (args.split,))
    split = raw[args.split].texts
    rng = np.random.default_rng(0)
    texts = [split[i] for i in rng.choice(len(split), min(args.texts, len(split)), replace=False)]
    fast = data.AsciiWordPiece.of(tokenizer)
    print(f"{len(texts)} reviews of {args.data} [{args.split}], {np.mean([t.isascii() for t in texts]):.1%} ASCII; "
          f"tokenizer {args.checkpoint}: {'AsciiWordPiece applies' if fast else 'AsciiWordPiece does not apply'}\n")

    def library(call):
        return [e.ids for e in tokenizer.encode_batch_fast(call, add_special_tokens=False)]

    def tfm(call):
        return data.subword_ids(tokenizer, call)

    sizes = {"calls of 32": [texts[i:i + 32] for i in range(0, len(texts), 32)], "one call": [texts]}
    rounds = {(way, size): [] for size in sizes for way in ("library", "tfm")}
    differences = 0
    for _ in range(args.rounds):
        for size, calls in sizes.items():
            _, _, expected = timed(library, calls)  # untimed: the reference ids, and the library warmed
            for way, encode in (("library", library), ("tfm", tfm)):
                if fast is not None:
                    fast.cache.clear()
                sec, cpu, ids = timed(encode, calls)
                differences += sum(a != b for a, b in zip(ids, expected))
                rounds[way, size].append({"reviews_per_sec": len(texts) / sec, "cpu_ms_per_review": 1000 * cpu / len(texts)})

    rows = []
    for (way, size), runs in rounds.items():
        best = max(runs, key=lambda r: r["reviews_per_sec"])
        lib = max(rounds["library", size], key=lambda r: r["reviews_per_sec"])
        rows.append({"way": way, "calls": size, **best, "cpu_ratio": lib["cpu_ms_per_review"] / best["cpu_ms_per_review"],
                     "rates": " ".join(f"{r['reviews_per_sec']:,.0f}" for r in runs)})
    bc.print_table(rows, [("way", "way"), ("calls", "calls"), ("reviews_per_sec", "reviews/s (best)"),
                          ("cpu_ms_per_review", "CPU ms/review"), ("cpu_ratio", "library CPU / this"),
                          ("rates", "reviews/s by round")],
                   digits={"reviews_per_sec": 0, "cpu_ms_per_review": 3, "cpu_ratio": 2})
    print(f"\nids: {'identical to the library' if not differences else f'{differences} reviews DIFFER'}")
    bc.write_json(args.json, {"hardware": info, "args": vars(args), "rows": rows, "differences": differences})
    return 1 if differences else 0


if __name__ == "__main__":
    sys.path.insert(0, str(bc.REPO))
    bc.run_script(main)
