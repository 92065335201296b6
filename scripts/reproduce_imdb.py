"""Train and evaluate the shipped IMDB recipes with the exact `tfm` commands, then print a results table.

For each recipe and seed it runs

    tfm train [--config configs/RECIPE.toml] --data DATA -o OUT/RECIPE-sSEED --seed SEED [--epochs 1 for seed]
    tfm evaluate -c OUT/RECIPE-sSEED --data DATA --split test --json

Recipe "default" is the built-in defaults (no --config); "wide-and-deep" and "seed" are files in
configs/. "pretrained" is the pipeline: once, `tfm pretrain --config configs/pretrain.toml --data
DATA -o OUT/pretrain` (its time is the row "pretrain encoder"), then for each seed `tfm train --config
configs/finetune.toml --init-from OUT/pretrain`. "scratch" is its ablation: the same fine-tuning
with the same encoder sizes from random init (the sizes of configs/pretrain.toml as overrides).
"self-trained" goes on from "pretrained": each seed's fine-tuned model labels the dataset's
`unsupervised` split (`tfm pseudo-label -c OUT/pretrained-sSEED -o OUT/pseudo-pretrained-sSEED.jsonl`),
and a student fine-tunes the same encoder on train and those labels (`tfm train --config
configs/self-train.toml --init-from OUT/pretrain data.pseudo_labels=OUT/pseudo-pretrained-sSEED.jsonl`).
"word-vectors" is the default recipe from word vectors: once, `tfm pretrain --config
configs/word-vectors.toml --data DATA -o OUT/word-vectors` (the row "word-vectors encoder"), then
for each seed `tfm train --init-from OUT/word-vectors`.
"taught" is the default recipe taught by the "wide-and-deep" run of its seed: that run labels the
`unsupervised` split (OUT/pseudo-wide-and-deep-sSEED.jsonl), and the transformer alone trains on
train and all of those labels (`tfm train data.pseudo_labels=OUT/pseudo-wide-and-deep-sSEED.jsonl`).
`--pair gpu` takes configs/pretrain-gpu.toml and finetune-gpu.toml instead of the CPU pair for
"pretrained" and "scratch"; `--pair long` takes configs/pretrain-long.toml (sized for a CPU given
hours) and finetune-long.toml; `--pair 2h` configs/pretrain-2h.toml (the same encoder with rotary
positions and gated feed-forward layers, 2,750 steps) and finetune-2h.toml (finetune-long.toml's,
reading 1,024 tokens), the whole pipeline sized for about 2 hours on 2 Xeon cores with AMX. `--pretrain-steps N` ends the pair's pretraining after N steps (`tfm pretrain --max-steps N`,
its learning rate decaying over them): `--pair long --pretrain-steps 3300` is the long recipe cut
to 2 hours.

The test split is evaluated once per finished run, after training (selection inside training uses
the validation split only). A run whose folder already holds metrics.json and test.json is not
repeated, so the script can be stopped and started again; an interrupted training is resumed. The
command that trained a run is kept in its folder as command.txt, and the table shows that one. If a
`tfm` step fails, the script stops with one line that names it and exits with its exit code.

    python scripts/reproduce_imdb.py --data ../shared/data/imdb                  # everything
    python scripts/reproduce_imdb.py --data ../shared/data/imdb --recipes pretrained scratch --seeds 1337 1 2
    python scripts/reproduce_imdb.py ... --recipes pretrained scratch --pair gpu  # on a GPU
    python scripts/reproduce_imdb.py ... --results-dir docs/results               # keep the JSON
    python scripts/reproduce_imdb.py ... --seeds 1 -- train.num_threads=1       # more tfm arguments after --

Training times are what `tfm train` measured (metrics.json: train_time_sec), so they are only
comparable when nothing else ran on the machine.
"""

from __future__ import annotations

import argparse
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

from transformer_cli.checkpoint import MODEL_FILE
from transformer_cli.config import CLASSIFIER_ONLY, CLASSIFIER_ONLY_IN_RECIPES, ENCODER_FIELDS, OBJECTIVE_NAMES
from transformer_cli.fileio import atomic_write_text

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ("default", "pretrained", "self-trained", "scratch", "word-vectors", "wide-and-deep", "taught", "seed")
# A student recipe's teacher: the run of the student's seed that labels the unlabelled reviews for it.
TEACHERS = {"self-trained": "pretrained", "taught": "wide-and-deep"}
# The protocol for the reference notebook's recipe: one epoch, reported next to its 57.7%.
RECIPE_ARGS = {"seed": ["--epochs", "1"]}
# The pretraining and fine-tuning recipes of "pretrained" and "scratch", by machine.
PAIRS = {"cpu": ("pretrain.toml", "finetune.toml"), "gpu": ("pretrain-gpu.toml", "finetune-gpu.toml"),
         "long": ("pretrain-long.toml", "finetune-long.toml"),  # long: the CPU-sized encoder, pretrained for hours
         "2h": ("pretrain-2h.toml", "finetune-2h.toml")}  # 2h: the same, rotary and gated, 2 CPU hours in all
# The folder under --out of the encoder a recipe fine-tunes (`tfm pretrain`'s output).
ENCODERS = {"pretrained": "pretrain", "self-trained": "pretrain", "word-vectors": "word-vectors"}
# The command that trained a run, kept in its folder so that a skipped run shows its own, not this one's.
COMMAND_FILE = "command.txt"


class StepFailed(Exception):
    """A `tfm` command exited with an error (it said why on stderr)."""

    def __init__(self, cmd: list[str], code: int):
        super().__init__(cmd, code)
        self.cmd, self.code = cmd, code


def run(cmd: list[str], stdout=None) -> None:
    print("$", shlex.join(cmd), flush=True)
    code = subprocess.run(cmd, check=False, stdout=stdout).returncode
    if code != 0:
        raise StepFailed(cmd, code)


TFM = [sys.executable, "-m", "transformer_cli"]


def pseudo_labels(recipe: str, seed: int, out_root: Path) -> Path:
    """The labels that the teacher of student `recipe` gave the unlabelled reviews."""
    return out_root / f"pseudo-{TEACHERS[recipe]}-s{seed}.jsonl"


def config_args(recipe: str, seed: int, out_root: Path, pair: str = "cpu") -> list[str]:
    """The `tfm train` arguments that make a recipe."""
    pretrain_toml, finetune_toml = (ROOT / "configs" / name for name in PAIRS[pair])
    if recipe == "default":
        return []
    if recipe == "pretrained":
        return ["--config", str(finetune_toml), "--init-from", str(out_root / ENCODERS[recipe])]
    if recipe == "self-trained":
        return ["--config", str(ROOT / "configs" / "self-train.toml"), "--init-from", str(out_root / ENCODERS[recipe]),
                f"data.pseudo_labels={json.dumps(str(pseudo_labels(recipe, seed, out_root)))}"]
    if recipe == "taught":
        return [f"data.pseudo_labels={json.dumps(str(pseudo_labels(recipe, seed, out_root)))}"]
    if recipe == "word-vectors":
        return ["--init-from", str(out_root / ENCODERS[recipe])]
    if recipe == "scratch":  # the encoder's sizes and tokenizer settings, as `pretrained` reads them
        sizes, own = (tomllib.loads(path.read_text(encoding="utf-8")) for path in (pretrain_toml, finetune_toml))
        # A field the fine-tuning sets itself is one the encoder leaves to it (data.max_length over rotary positions).
        overrides = [f"{section}.{key}={json.dumps(sizes[section][key])}" for section, keys in ENCODER_FIELDS.items()
                     for key in keys if key in sizes.get(section, {}) and key not in own.get(section, {})]
        return ["--config", str(finetune_toml), *overrides]
    return ["--config", str(ROOT / "configs" / f"{recipe}.toml"), *RECIPE_ARGS.get(recipe, [])]


def trained(cmd: list[str], out: Path, inputs: tuple[Path, ...] = ()) -> None:
    """Run a `tfm train` or `tfm pretrain` command into `out` unless it finished there (then say so
    where another command trained it, or where one of its `inputs`, an encoder or labels, was written
    after it: its figures are not this pipeline's); resume it if it stopped; keep the command in the folder."""
    command, command_txt = shlex.join(["tfm", *cmd[len(TFM):]]), out / COMMAND_FILE
    if (out / "metrics.json").exists():
        if command_txt.exists() and command_txt.read_text().strip() != command:
            print(f"reproduce_imdb: warning: {out} was trained by another command, kept: "
                  f"`{command_txt.read_text().strip()}` (remove the folder to train it with this one)",
                  file=sys.stderr)
        finished = (out / "metrics.json").stat().st_mtime
        for newer in (f for f in inputs if f.exists() and f.stat().st_mtime > finished):
            print(f"reproduce_imdb: warning: {out} was trained before {newer} was written again, kept "
                  "(remove the folder to train it on the new one)", file=sys.stderr)
        return
    resume = ["--resume"] if (out / "checkpoints").is_dir() and any((out / "checkpoints").glob("step-*")) else []
    run(cmd + resume)
    atomic_write_text(command_txt, command + "\n")


def pretrained_encoder(folder: str, data: str, out_root: Path, extra: list[str], pair: str = "cpu",
                       steps: int | None = None) -> dict:
    """Pretrain the encoder of ENCODERS' `folder` (unless done), with its recipe (the pair's for
    "pretrain", cut to `steps` if given); its figures."""
    out = out_root / folder
    recipe = "word-vectors.toml" if folder == "word-vectors" else PAIRS[pair][0]
    extra = [e for e in extra if e.split("=", 1)[0] not in {*CLASSIFIER_ONLY, *CLASSIFIER_ONLY_IN_RECIPES}]  # refused
    if steps is not None and folder == "pretrain":
        extra = ["--max-steps", str(steps), *extra]
    trained([*TFM, "pretrain", "--config", str(ROOT / "configs" / recipe), "--data", data, "-o", str(out), *extra], out)
    metrics = json.loads((out / "metrics.json").read_text())
    objective = json.loads((out / "config.json").read_text())["pretrain"]["objective"]
    return {"name": f"{folder} encoder", "objective": OBJECTIVE_NAMES[objective],
            "minutes": metrics["train_time_sec"] / 60, "tokens_per_sec": metrics["tokens_per_sec"],
            "val": metrics["val"], "command": (out / COMMAND_FILE).read_text().strip()}


def teacher_labels(recipe: str, seed: int, data: str, out_root: Path, extra: list[str], pair: str = "cpu") -> None:
    """The teacher of student `recipe`, its run of `seed` with the same `pair` (trained if need be),
    labels the unlabelled reviews, once."""
    teacher = one(TEACHERS[recipe], seed, data, out_root, extra, pair)["out"]
    labels = pseudo_labels(recipe, seed, out_root)
    # Written whole or not at all; labelled again when the teacher was trained again since.
    if not labels.exists() or (teacher / MODEL_FILE).stat().st_mtime > labels.stat().st_mtime:
        run([*TFM, "pseudo-label", "-c", str(teacher), "--data", data, "-o", str(labels), "--force"])


def one(recipe: str, seed: int, data: str, out_root: Path, extra: list[str], pair: str = "cpu") -> dict:
    out = out_root / f"{recipe}-s{seed}"
    if recipe in TEACHERS:
        teacher_labels(recipe, seed, data, out_root, extra, pair)
    extra = [e for e in extra if not e.startswith("pretrain.")]  # for the encoder; `tfm train` refuses them
    train_cmd = [*TFM, "train", *config_args(recipe, seed, out_root, pair), "--data", data, "-o", str(out), "--seed",
                 str(seed), *extra]
    test_json, command_txt = out / "test.json", out / COMMAND_FILE
    inputs = ((out_root / ENCODERS[recipe] / MODEL_FILE,) if recipe in ENCODERS else ()) + (
        (pseudo_labels(recipe, seed, out_root),) if recipe in TEACHERS else ())
    trained(train_cmd, out, inputs)
    if not test_json.exists():
        tmp = test_json.with_suffix(".json.tmp")
        try:
            with open(tmp, "w") as f:
                run([*TFM, "evaluate", "-c", str(out), "--data", data, "--split", "test", "--json"], stdout=f)
                os.fsync(f.fileno())  # on disk before the rename, or a crash may leave an empty test.json
        except BaseException:
            tmp.unlink(missing_ok=True)  # no partial test JSON left behind
            raise
        tmp.replace(test_json)
    metrics = json.loads((out / "metrics.json").read_text())
    test = json.loads(test_json.read_text())
    return {
        "recipe": recipe, "seed": seed, "out": out,
        "val": metrics["val"]["accuracy"], "test": test["accuracy"],
        "train_min": metrics["train_time_sec"] / 60, "samples_per_sec": metrics.get("samples_per_sec", 0.0),
        "eval_per_sec": test.get("examples_per_sec", 0.0),
        "command": command_txt.read_text().strip() if command_txt.exists() else "(not recorded: trained before)",
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="stanfordnlp/imdb", help="dataset for tfm (Hub id or local copy)")
    ap.add_argument("--out", type=Path, default=Path("runs/repro"), help="folder for the runs")
    ap.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES))
    ap.add_argument("--seeds", nargs="+", type=int, default=[1337], help="one run per recipe and seed")
    ap.add_argument("--pair", choices=sorted(PAIRS), default="cpu",
                    help="the pretraining and fine-tuning recipes of 'pretrained' and 'scratch'")
    ap.add_argument("--pretrain-steps", type=int, metavar="N",
                    help="end the pair's pretraining after N steps (tfm pretrain --max-steps N)")
    ap.add_argument("--results-dir", type=Path, help="copy each run's test JSON here as RECIPE-sSEED.json")
    ap.add_argument("extra", nargs="*", help="more tfm arguments, e.g. train.epochs=1 (pretrain.* ones go to tfm pretrain only)")
    args = ap.parse_args()
    if args.pretrain_steps is not None and args.pretrain_steps < 1:
        ap.error(f"--pretrain-steps {args.pretrain_steps}: must be 1 or more")
    if args.pair != "cpu" and "self-trained" in args.recipes:
        ap.error(f"--pair {args.pair}: 'self-trained' is for the cpu pair only (configs/self-train.toml fine-tunes "
                 "configs/pretrain.toml's encoder)")

    t0 = time.time()
    folders = dict.fromkeys(ENCODERS[r] for r in args.recipes if r in ENCODERS)  # each once, in order
    try:
        encoders = [pretrained_encoder(f, args.data, args.out, args.extra, args.pair, args.pretrain_steps)
                    for f in folders]
        rows = [one(r, s, args.data, args.out, args.extra, args.pair) for r in args.recipes for s in args.seeds]
    except StepFailed as e:
        code = e.code if e.code > 0 else 128 - e.code  # killed by signal N: 128 + N, as a shell reports it
        print(f"reproduce_imdb: error: `{shlex.join(['tfm', *e.cmd[len(TFM):]])}` failed with exit code {code}; "
              f"the finished runs in {args.out} are kept: run this script again to go on", file=sys.stderr)
        return code
    except KeyboardInterrupt:  # the tfm step was told too, and keeps what it had done
        print(f"reproduce_imdb: interrupted; the finished runs in {args.out} are kept and an unfinished "
              "training resumes: run this script again to go on", file=sys.stderr)
        return 130
    if args.results_dir:
        args.results_dir.mkdir(parents=True, exist_ok=True)
        for row in rows:
            shutil.copyfile(row["out"] / "test.json", args.results_dir / f"{row['recipe']}-s{row['seed']}.json")

    print(f"\n{os.cpu_count()} CPUs, {(time.time() - t0) / 60:.1f} min in all\n")
    print("| recipe | seed | val acc | test acc | train time | train samples/s | eval reviews/s | command |")
    print("|---|---|---|---|---|---|---|---|")
    for e in encoders:
        print(f"| {e['name']} | - | held-out {e['objective']} accuracy {e['val']['accuracy']:.2%} (loss "
              f"{e['val']['loss']:.3f}) | - | {e['minutes']:.1f} min | {e['tokens_per_sec']:.0f} "
              f"tokens/s | - | `{e['command']}` |")
    for r in rows:
        print(f"| {r['recipe']} | {r['seed']} | {r['val']:.2%} | {r['test']:.2%} | {r['train_min']:.1f} min | "
              f"{r['samples_per_sec']:.0f} | {r['eval_per_sec']:.0f} | `{r['command']}` |")
    for recipe in args.recipes:
        tests = [r["test"] for r in rows if r["recipe"] == recipe]
        if len(tests) > 1:
            print(f"\n{recipe}: test accuracy {statistics.mean(tests):.2%} ± {statistics.stdev(tests):.2%} "
                  f"(mean ± sample std over {len(tests)} seeds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
