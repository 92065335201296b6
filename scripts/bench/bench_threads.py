"""Training speed alone and two runs at a time, under libgomp's spin count and under tfm's.

What it measures
    `tfm train` runs of --steps optimizer steps (the default recipe, or --config's), each a fresh
    process, under two settings of GOMP_SPINCOUNT, the rounds an OpenMP thread of torch spins
    waiting for work before it sleeps:
      libgomp   300000, libgomp's own default (set explicitly in the child's environment)
      tfm       what transformer_cli sets itself when neither OMP_WAIT_POLICY nor GOMP_SPINCOUNT is
                set (both are removed from the child's environment)
    For each setting: --rounds runs alone, then one pair of runs started together, as when two
    runs (or a run and a test suite) share the cores. The settings alternate, so that a drift in
    the machine's speed falls on both.

How to read it
    seconds      training time of a run (its metrics.json's train_time_sec): the median of the
                 runs alone; for the pair, the mean of its two runs
    the ratios   tfm / libgomp alone (what yielding sooner costs a run that has the cores to
                 itself) and in pairs; pair / alone for each setting (the slowdown from sharing)

Examples
    python scripts/bench/bench_threads.py --data ../shared/data/imdb --steps 100 --rounds 3
    python scripts/bench/bench_threads.py --config configs/tiny.toml --data DATA --steps 20 --json threads.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import _bench_common as bc

SETTINGS = {"libgomp": "300000", "tfm": None}  # None: the child's environment sets neither variable


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=bc.DEFAULT_DATA, help="dataset source, as `tfm train --data` takes it")
    p.add_argument("--config", type=Path, default=None, help="the recipe to train (default: tfm's defaults)")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps a run")
    p.add_argument("--rounds", type=int, default=3, help="runs alone per setting (the median is reported)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    args = p.parse_args(argv)
    if args.steps < 1 or args.rounds < 1:
        p.error("--steps and --rounds must be at least 1")
    if args.config is not None and not args.config.is_file():
        p.error(f"--config {args.config}: no such file")
    return args


def child_env(setting: str) -> dict:
    env = {k: v for k, v in bc.child_env().items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if SETTINGS[setting] is not None:
        env["GOMP_SPINCOUNT"] = SETTINGS[setting]
    return env


def start(args: argparse.Namespace, out: Path, setting: str) -> tuple[subprocess.Popen, Path]:
    config = ["--config", str(args.config)] if args.config else []  # relative paths: to the working folder
    cmd = [sys.executable, "-m", "transformer_cli", "train", *config, "--data", args.data, "-o", str(out), "--force",
           "--no-progress", "--max-steps", str(args.steps), f"train.eval_every={args.steps}",
           f"train.checkpoint_every={args.steps}"]
    proc = subprocess.Popen(cmd, env=child_env(setting), cwd=os.getcwd(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    return proc, out


def seconds(runs: list[tuple[subprocess.Popen, Path]]) -> list[float]:
    """Wait for `runs`; each one's training seconds. A failed run raises bc.child_failed's error."""
    out = []
    for proc, path in runs:
        _, err = proc.communicate()
        if proc.returncode != 0:
            raise bc.child_failed(proc.args, proc.returncode, err)
        out.append(json.loads((path / "metrics.json").read_text())["train_time_sec"])
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    info = bc.hardware_info()
    bc.print_header("training alone and two at a time, by OpenMP spin count", info)
    alone: dict[str, list[float]] = {s: [] for s in SETTINGS}
    pair: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="tfm-bench-threads-") as tmp:
        tmp = Path(tmp)
        seconds([start(args, tmp / "warm", "tfm")])  # the tokenizer and encodings into the cache, untimed
        for r in range(args.rounds):
            for s in SETTINGS:
                alone[s] += seconds([start(args, tmp / f"{s}-{r}", s)])
        for s in SETTINGS:
            pair[s] = seconds([start(args, tmp / f"{s}-pair-{i}", s) for i in range(2)])
    rows = []
    for s, count in SETTINGS.items():
        a, p = statistics.median(alone[s]), statistics.mean(pair[s])
        rows.append({"setting": s, "GOMP_SPINCOUNT": count or "(tfm's)", "alone_s": a, "pair_s": p,
                     "pair_over_alone": p / a})
    bc.print_table(rows, [("setting", "setting"), ("GOMP_SPINCOUNT", "GOMP_SPINCOUNT"), ("alone_s", "alone s"),
                          ("pair_s", "each of a pair s"), ("pair_over_alone", "pair / alone")],
                   {"pair_over_alone": 2})
    base, ours = rows
    ratios = {"alone_tfm_over_libgomp": ours["alone_s"] / base["alone_s"],
              "pair_tfm_over_libgomp": ours["pair_s"] / base["pair_s"]}
    print(f"\ntfm / libgomp: alone {ratios['alone_tfm_over_libgomp']:.3f}x the time, "
          f"two at a time {ratios['pair_tfm_over_libgomp']:.3f}x")
    bc.write_json(args.json, {"hardware": info, "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                              "runs_alone": alone, "runs_pair": pair, **ratios})
    return 0


if __name__ == "__main__":
    bc.run_script(main)
