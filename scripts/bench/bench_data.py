"""Data preparation time: tokenizer training + encoding of IMDB, with an empty cache and cached.

What it measures
    The preparation `tfm train --test` does before and after training, through transformer_cli's
    own functions: prepare_train_data (load the train split, hold out the stratified validation
    split, train the tokenizer on the training part, encode train and validation) and
    prepare_eval_data (load and encode the test split) -- the 50k labelled reviews in all.

    Each run is a fresh `python` process (so interpreter start-up and imports count, as they do
    for `tfm`), started by this script with TFM_CACHE pointing at a new temporary directory:
      cold     the cache directory is empty: the tokenizer is trained and every split encoded
      cached   the same directory again: tokenizer and encoded splits are read from the cache
    (--cached-runs > 1 repeats the cached run and reports the median.)

How to read it
    wall         seconds from starting the process to its exit (what a user waits); checked against
                 the issue's targets: cold <= 30 s, cached <= 3 s
    in-process   the child's own breakdown: imports of transformer_cli + numpy, dataset loading
                 (load_splits, incl. `datasets` import and Arrow -> Python), tokenizer training,
                 encoding (encode_texts), and the rest (fingerprints, split, cache files)
    peak MB      peak resident memory of the child (VmHWM)
    The Hugging Face datasets cache (Arrow files made from the parquet on first load) is left as it
    is unless --fresh-hf-cache, which gives both runs a new, empty one (the cold run then includes
    the parquet -> Arrow conversion).

Examples
    python scripts/bench/bench_data.py                                   # full IMDB, default data config
    python scripts/bench/bench_data.py --config configs/seed.toml        # data section of a recipe
    python scripts/bench/bench_data.py --max-samples 500 --json data.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import shutil
import sys
import tempfile
from pathlib import Path

import _bench_common as bc


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=bc.DEFAULT_DATA, help="dataset source (Hub-layout folder, aclImdb, ...)")
    p.add_argument("--config", type=Path, default=None,
                   help="take the [data] section (vocab size, tokenizer, max_length, ...) of this TOML recipe")
    p.add_argument("--max-samples", type=int, default=None,
                   help="limit train, validation and test to this many reviews each (quick runs)")
    p.add_argument("--cached-runs", type=int, default=1, help="cached runs (median reported)")
    p.add_argument("--fresh-hf-cache", action="store_true",
                   help="also use an empty Hugging Face datasets cache (cold run includes parquet -> Arrow)")
    p.add_argument("--keep-cache", action="store_true", help="do not delete the temporary cache directory")
    p.add_argument("--json", default=None, metavar="PATH", help="write all results as JSON")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.cached_runs < 1 or args.cached_runs % 2 == 0:
        p.error("--cached-runs must be an odd number (1, 3, ...): the median is one of the runs, shown whole")
    return args


# --------------------------------------------------------------------------- child


def child(args) -> None:
    """One preparation in this process; prints one JSON line with the breakdown."""
    t_start = bc.now()
    import numpy  # noqa: F401  (counted with the package imports)

    from transformer_cli import data
    from transformer_cli.config import load_config

    imports_sec = bc.now() - t_start
    spent = {"load_splits": 0.0, "train_tokenizer": 0.0, "encode_texts": 0.0}
    calls = {name: 0 for name in spent}

    def timed(name, fn):  # wrap a module function so its calls from inside the pipeline are timed
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            t0 = bc.now()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += bc.now() - t0
                calls[name] += 1
        return wrapper

    for name in spent:
        setattr(data, name, timed(name, getattr(data, name)))

    overrides = {"data.source": args.data}
    if args.max_samples:
        overrides.update({"data.max_train_samples": args.max_samples, "data.max_eval_samples": args.max_samples})
    cfg = load_config(args.config, overrides)
    t0 = bc.now()
    prepared = data.prepare_train_data(cfg.data, cfg.train.seed, needed=("test",))  # as `tfm train --test`
    train_sec = bc.now() - t0
    t0 = bc.now()
    test = data.prepare_eval_data(cfg.data, prepared.tokenizer, "test", cfg.data.max_eval_samples)
    test_sec = bc.now() - t0
    total = bc.now() - t_start
    splits = {"train": prepared.train, "val": prepared.val, "test": test}
    print(json.dumps({
        "in_process_sec": total,
        "imports_sec": imports_sec,
        "prepare_train_data_sec": train_sec,
        "prepare_eval_data_sec": test_sec,
        "load_sec": spent["load_splits"],
        "tokenizer_train_sec": spent["train_tokenizer"],
        "encode_sec": spent["encode_texts"],
        "other_sec": train_sec + test_sec - sum(spent.values()),
        "tokenizer_trained": calls["train_tokenizer"] > 0,
        "splits_encoded": calls["encode_texts"],
        "reviews": {k: len(v) for k, v in splits.items()},
        "tokens": {k: int(v.ids.size) for k, v in splits.items()},
        "vocab": prepared.tokenizer.get_vocab_size(),
        "data_config": dataclasses.asdict(cfg.data),
        "peak_mb": bc.peak_rss_mb(),
    }))


# --------------------------------------------------------------------------- parent


def run_child(args, env: dict) -> dict:
    cmd = [sys.executable, __file__, "--child", "--data", args.data]
    if args.config:
        cmd += ["--config", str(args.config)]
    if args.max_samples:
        cmd += ["--max-samples", str(args.max_samples)]
    wall, proc = bc.run_timed(cmd, env=env, cwd=Path.cwd())  # --data and --config as the user gave them
    out = bc.last_json_line(proc.stdout)
    out["wall_sec"] = wall
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        child(args)
        return
    info = bc.hardware_info()
    bc.print_header("bench_data: tokenizer training + encoding, empty cache vs cached", info)
    tmp = Path(tempfile.mkdtemp(prefix="tfm-bench-data-"))
    extra = {"TFM_CACHE": str(tmp / "tfm")}
    if args.fresh_hf_cache:
        extra["HF_DATASETS_CACHE"] = str(tmp / "hf")
    env = bc.child_env(extra)
    try:
        print(f"cache: {tmp / 'tfm'} (new, empty)" + ("; HF datasets cache: new, empty" if args.fresh_hf_cache else ""))
        cold = run_child(args, env)
        cached_runs = [run_child(args, env) for _ in range(args.cached_runs)]
    finally:
        if args.keep_cache:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    cached = sorted(cached_runs, key=lambda r: r["wall_sec"])[len(cached_runs) // 2]  # the median run
    for name, r in (("cold (empty cache)", cold), (f"cached (median of {len(cached_runs)})", cached)):
        r["run"] = name
    n = cold["reviews"]
    print(f"\n{n['train']} train + {n['val']} validation + {n['test']} test reviews; "
          f"{sum(cold['tokens'].values()):,} tokens after truncation; vocab {cold['vocab']}; "
          f"tokenizer {cold['data_config']['tokenizer']}, max_length {cold['data_config']['max_length']}")
    rows = [cold, cached]
    bc.print_table(rows, [("run", "run"), ("wall_sec", "wall s"), ("in_process_sec", "in-process s"),
                          ("imports_sec", "imports"), ("load_sec", "load"), ("tokenizer_train_sec", "tok. train"),
                          ("encode_sec", "encode"), ("other_sec", "other"), ("peak_mb", "peak MB")],
                   digits={k: 2 for k in ("wall_sec", "in_process_sec", "imports_sec", "load_sec",
                                          "tokenizer_train_sec", "encode_sec", "other_sec")} | {"peak_mb": 0})
    if cached["tokenizer_trained"] or cached["splits_encoded"]:
        print("   warning: the cached run trained or encoded again -- the cache was not used")
    line = f"   cold - cached = {cold['wall_sec'] - cached['wall_sec']:.2f} s"
    if cold["encode_sec"] > 0:
        line += f"; cold encoding {sum(n.values()) / cold['encode_sec']:.0f} reviews/s"
    print(line)
    checks = [bc.check("cold (empty cache) wall", cold["wall_sec"], 30, " s", higher_is_better=False),
              bc.check("cached wall", cached["wall_sec"], 3, " s", higher_is_better=False)]
    bc.write_json(args.json, {"hardware": info, "args": {k: str(v) for k, v in vars(args).items()},
                              "cold": cold, "cached": cached, "cached_all": cached_runs, "targets": checks})


if __name__ == "__main__":
    bc.run_script(main)
