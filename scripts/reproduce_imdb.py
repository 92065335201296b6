"""Train and test the shipped IMDB recipes with the `tfm` commands a user runs, then print a results table.

Each recipe trains once per seed, into OUT/NAME-sSEED, with `tfm train ... --seed SEED --test`:

    default       tfm train                                (the built-in recipe)
    seed          tfm train --config configs/seed.toml --epochs 1   (the reference notebook's recipe, one epoch)
    pretrained    tfm train --config configs/PAIR-finetune.toml --init-from OUT/PAIR-pretrain
    scratch       the same fine-tuning from random weights, with the encoder's sizes as overrides
    self-trained  tfm train --config configs/self-train.toml --init-from OUT/cpu-pretrain
                  data.pseudo_labels=OUT/pseudo-sSEED.jsonl   (the CPU pair only)

PAIR is --pair, cpu (2 cores, at most 2 hours a seed) or gpu. Each seed pretrains its own encoder first, by
`tfm pretrain --config configs/PAIR-pretrain.toml -o OUT/PAIR-pretrain-sSEED --seed SEED`, so that one seed's
pipeline is its pretraining and fine-tuning, run one after the other. For self-trained, the pretrained run of
the same seed labels the dataset's `unsupervised` split first
(`tfm pseudo-label -c OUT/cpu-pretrained-sSEED -o OUT/pseudo-sSEED.jsonl`).

A run whose folder holds metrics.json is not repeated, and an interrupted one resumes, so the script can
be stopped and started again. The command that made a run and its wall time, with every attempt's time
added, are kept in its folder (step.json) and shown in the table. If a `tfm` step fails, the script names it
and exits with its exit code. --pipeline-json writes each seed's pretrained pipeline (test accuracy, wall
time of its two steps from raw data to the test figure, CPU, date, commands) into one JSON file, keeping the
runs of other seeds that the file holds.

    python scripts/reproduce_imdb.py --data path/to/imdb
    python scripts/reproduce_imdb.py --data path/to/imdb --recipes pretrained scratch --seeds 1337 1 2
    python scripts/reproduce_imdb.py --data path/to/imdb --recipes pretrained --pair gpu
    python scripts/reproduce_imdb.py --data path/to/imdb --recipes pretrained scratch --seeds 1337 1 2 \\
        --pipeline-json docs/results/cpu-pipeline.json
    python scripts/reproduce_imdb.py --data path/to/imdb --seeds 1 -- train.eval_every=500   # overrides after --

Training times are what `tfm train` measured (metrics.json), comparable only when nothing else ran.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from transformer_cli.config import CLASSIFIER_ONLY, CLASSIFIER_ONLY_IN_RECIPES, ENCODER_FIELDS

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
TFM = [sys.executable, "-m", "transformer_cli"]
RECIPES = ("default", "seed", "pretrained", "scratch", "self-trained")
PAIRS = ("cpu", "gpu")
STEP_FILE = "step.json"


def run_name(recipe: str, seed: int, pair: str) -> str:
    """The folder under --out of a recipe's run of `seed`."""
    if recipe in ("pretrained", "scratch"):
        return f"{pair}-{recipe}-s{seed}"
    return f"{recipe}-s{seed}"


def encoder_dir(out: Path, pair: str, seed: int) -> Path:
    return out / f"{pair}-pretrain-s{seed}"


def recipe_args(recipe: str, seed: int, out: Path, pair: str) -> list[str]:
    """The `tfm train` arguments that make a recipe."""
    finetune = CONFIGS / f"{pair}-finetune.toml"
    if recipe == "default":
        return []
    if recipe == "seed":
        return ["--config", str(CONFIGS / "seed.toml"), "--epochs", "1"]
    if recipe == "pretrained":
        return ["--config", str(finetune), "--init-from", str(encoder_dir(out, pair, seed))]
    if recipe == "self-trained":
        labels = json.dumps(str(out / f"pseudo-s{seed}.jsonl"))
        return ["--config", str(CONFIGS / "self-train.toml"), "--init-from", str(encoder_dir(out, "cpu", seed)),
                f"data.pseudo_labels={labels}"]
    if recipe == "scratch":  # the encoder's sizes, but for those the fine-tuning sets itself (data.max_length)
        files = CONFIGS / f"{pair}-pretrain.toml", finetune
        sizes, own = (tomllib.loads(p.read_text(encoding="utf-8")) for p in files)
        return ["--config", str(finetune), *[f"{section}.{key}={json.dumps(sizes[section][key])}"
                                             for section, keys in ENCODER_FIELDS.items() for key in keys
                                             if key in sizes.get(section, {}) and key not in own.get(section, {})]]
    raise ValueError(f"unknown recipe {recipe!r}")


def steps(recipes: list[str], seeds: list[int], pair: str, data: str, out: Path, extra: list[str]) -> list[tuple]:
    """The (folder or file it makes, command) of every `tfm` step, in order, each once."""
    train_extra = [e for e in extra if not e.startswith("pretrain.")]  # `tfm train` refuses those
    refused = {*CLASSIFIER_ONLY, *CLASSIFIER_ONLY_IN_RECIPES}  # by `tfm pretrain`
    pretrain_extra = [e for e in extra if e.split("=", 1)[0] not in refused]
    planned: dict[Path, list[str]] = {}

    def train(recipe: str, seed: int) -> Path:
        folder = out / run_name(recipe, seed, pair if recipe != "self-trained" else "cpu")
        planned.setdefault(folder, [*TFM, "train", *recipe_args(recipe, seed, out, pair), "--data", data,
                                    "-o", str(folder), "--seed", str(seed), "--test", *train_extra])
        return folder

    for recipe in recipes:
        for seed in seeds:
            if recipe in ("pretrained", "self-trained"):
                encoder = encoder_dir(out, pair, seed)
                planned.setdefault(encoder, [*TFM, "pretrain", "--config", str(CONFIGS / f"{pair}-pretrain.toml"),
                                             "--data", data, "-o", str(encoder), "--seed", str(seed), *pretrain_extra])
            if recipe == "self-trained":
                teacher, labels = train("pretrained", seed), out / f"pseudo-s{seed}.jsonl"
                planned.setdefault(labels, [*TFM, "pseudo-label", "-c", str(teacher), "--data", data,
                                            "-o", str(labels), "--force"])
            train(recipe, seed)
    return list(planned.items())


class StepFailed(Exception):
    def __init__(self, cmd: list[str], code: int):
        super().__init__(cmd, code)
        self.cmd, self.code = cmd, code


def shown(cmd: list[str]) -> str:
    """The `tfm` command line, with the recipes' paths as the project names them (configs/NAME.toml)."""
    return shlex.join(["tfm", *(a.replace(f"{CONFIGS}/", "configs/") for a in cmd[len(TFM):])])


def step_record(target: Path) -> dict:
    """A folder's step.json: the command that made it and its wall time, every attempt's added."""
    file = target / STEP_FILE
    return json.loads(file.read_text()) if file.exists() else {"wall_time_sec": 0.0}


def run_step(target: Path, cmd: list[str]) -> None:
    """Run one step unless its output is there: a file, or a folder with metrics.json (then resume it if it
    stopped half-way); keep a folder's command and wall time in its step.json."""
    done = target.exists() if target.suffix == ".jsonl" else (target / "metrics.json").exists()
    if done:
        kept = step_record(target).get("command")
        if kept is not None and kept != shown(cmd):
            print(f"reproduce_imdb: warning: {target} was trained by another command, kept: `{kept}`"
                  " (remove the folder to train it with this one)", file=sys.stderr)
        return
    resume = ["--resume"] if any((target / "checkpoints").glob("step-*")) else []
    print("$", shown(cmd + resume), flush=True)
    start = time.monotonic()
    try:
        code = subprocess.run(cmd + resume, check=False).returncode
    finally:
        if target.suffix != ".jsonl" and target.is_dir():
            record = step_record(target)
            record.update(command=shown(cmd), date=datetime.date.today().isoformat(),
                          wall_time_sec=record["wall_time_sec"] + time.monotonic() - start)
            (target / STEP_FILE).write_text(json.dumps(record, indent=2) + "\n")
    if code != 0:
        raise StepFailed(cmd, code)


def rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 1)


def pipeline_runs(out: Path, pair: str, seeds: list[int], earlier: dict | None = None) -> dict:
    """Each seed's pretrained pipeline, its encoder then its fine-tuning: test accuracy, the two steps' wall
    time (and each step's wall time, training time, steps and why it stopped), the CPU as the fine-tuning's
    metrics.json names it, the date and the commands. The runs of other seeds in `earlier` (a file this wrote
    before, perhaps on another machine) are kept."""
    runs = {r["seed"]: r for r in (earlier or {}).get("runs", [])}
    for seed in seeds:
        folders = encoder_dir(out, pair, seed), out / run_name("pretrained", seed, pair)
        records = [step_record(f) for f in folders]
        both = [json.loads((f / "metrics.json").read_text()) for f in folders]
        metrics = both[1]
        stages = {f"{stage}_{key}": value for stage, record, m in zip(("pretrain", "finetune"), records, both)
                  for key, value in (("wall_sec", rounded(record["wall_time_sec"])),
                                     ("train_sec", rounded(m.get("train_time_sec"))), ("steps", m.get("steps")),
                                     ("stop", m.get("stop_reason")))}
        runs[seed] = {"seed": seed, "test_accuracy": metrics["test"]["accuracy"],
                      "val_accuracy": metrics["val"]["accuracy"],
                      "wall_time_sec": round(sum(r["wall_time_sec"] for r in records), 1),
                      "cpu": metrics.get("hardware", ""), "cores": os.cpu_count(), "date": records[1].get("date"),
                      "stages": stages, "commands": [r.get("command") for r in records]}
    ordered = sorted(runs.values(), key=lambda r: r["seed"])
    return {"cpu": "; ".join(dict.fromkeys(r["cpu"] for r in ordered)), "runs": ordered}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="stanfordnlp/imdb", help="the dataset (Hub id or local copy)")
    ap.add_argument("--out", type=Path, default=Path("runs"), help="folder for the runs")
    ap.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES))
    ap.add_argument("--seeds", nargs="+", type=int, default=[1337], help="one run per recipe and seed")
    ap.add_argument("--pair", choices=PAIRS, default="cpu", help="the encoder and fine-tuning of pretrained, scratch")
    ap.add_argument("--results-dir", type=Path, help="copy each run's metrics.json here as NAME-sSEED.json")
    ap.add_argument("--pipeline-json", type=Path, help="write each seed's pretrained pipeline here")
    ap.add_argument("extra", nargs="*", help="config overrides for every step, e.g. train.eval_every=500")
    args = ap.parse_args()
    if args.pipeline_json and "pretrained" not in args.recipes:
        ap.error("--pipeline-json: the pipeline is the pretrained recipe; add it to --recipes")
    if args.pair != "cpu" and "self-trained" in args.recipes:
        ap.error(f"--pair {args.pair}: self-trained is for the cpu pair only (configs/self-train.toml fine-tunes "
                 "configs/cpu-pretrain.toml's encoder)")

    plan = steps(args.recipes, args.seeds, args.pair, args.data, args.out, args.extra)
    try:
        for target, cmd in plan:
            run_step(target, cmd)
    except StepFailed as e:
        code = e.code if e.code > 0 else 128 - e.code  # killed by signal N: 128 + N, as a shell reports it
        print(f"reproduce_imdb: error: `{shown(e.cmd)}` failed with exit code {code}; the finished runs in "
              f"{args.out} are kept: run this script again to go on", file=sys.stderr)
        return code
    except KeyboardInterrupt:
        print(f"reproduce_imdb: interrupted; the finished runs in {args.out} are kept and an unfinished one "
              "resumes: run this script again to go on", file=sys.stderr)
        return 130

    runs = [t for t, cmd in plan if cmd[len(TFM)] == "train"]
    print(f"\n{os.cpu_count()} CPUs\n")
    print("| run | val acc | test acc | wall time | train samples/s | test reviews/s | command |")
    print("|---|---|---|---|---|---|---|")
    for target, cmd in plan:
        if cmd[len(TFM)] == "pretrain":
            m = json.loads((target / "metrics.json").read_text())
            print(f"| {target.name} (encoder) | held-out masked-LM accuracy {m['val']['accuracy']:.2%} | - | "
                  f"{step_record(target)['wall_time_sec'] / 60:.1f} min | {m['tokens_per_sec']:.0f} tokens/s | - | "
                  f"`{shown(cmd)}` |")
    for folder in runs:
        m = json.loads((folder / "metrics.json").read_text())
        print(f"| {folder.name} | {m['val']['accuracy']:.2%} | {m['test']['accuracy']:.2%} | "
              f"{step_record(folder)['wall_time_sec'] / 60:.1f} min | {m['samples_per_sec']:.0f} | "
              f"{m['test']['examples_per_sec']:.0f} | "
              f"`{step_record(folder).get('command')}` |")
        if args.results_dir:
            args.results_dir.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(folder / "metrics.json", args.results_dir / f"{folder.name}.json")
    for recipe in args.recipes:
        folders = [args.out / run_name(recipe, s, args.pair) for s in args.seeds]
        tests = [json.loads((f / "metrics.json").read_text())["test"]["accuracy"] for f in folders]
        if len(tests) > 1:
            print(f"\n{recipe}: test accuracy {statistics.mean(tests):.2%} ± {statistics.stdev(tests):.2%} "
                  f"(mean ± sample std over {len(tests)} seeds)")
    if args.pipeline_json:
        earlier = json.loads(args.pipeline_json.read_text()) if args.pipeline_json.exists() else None
        args.pipeline_json.parent.mkdir(parents=True, exist_ok=True)
        pipeline = pipeline_runs(args.out, args.pair, args.seeds, earlier)
        args.pipeline_json.write_text(json.dumps(pipeline, indent=2) + "\n")
        print(f"wrote {args.pipeline_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
