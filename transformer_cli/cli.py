"""`tfm`: thin Typer commands. Each parses options and calls a plain function; the app's group is the
one place where errors become one line on stderr and an exit code (1 runtime, 2 usage). torch is
imported only inside commands."""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from typer.core import TyperGroup

from transformer_cli import __version__
from transformer_cli.config import (
    TrainConfig,
    check_command_overrides,
    load_config,
    parse_overrides,
    read_toml,
    run_settings,
)
from transformer_cli.console import evaluation_report, imbalance_warning, read_inputs, snippet
from transformer_cli.errors import TfmError, UsageError
from transformer_cli.fileio import check_output_path


class _Terminated(BaseException):
    """SIGTERM, raised where the command is, so that its clean-ups run (a file being written is not left
    half done); training and `tfm serve` handle the signal themselves while they run."""


def _terminate(signum, frame) -> NoReturn:
    raise _Terminated


class _Tfm(TyperGroup):
    """The `tfm` command group, whose `main` is the CLI's one error boundary."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, **extra: Any) -> NoReturn:
        """Parse the command line and run the command. Whatever either raises becomes one `tfm: error: ...`
        line on stderr and the exit code; click's own usage errors too, instead of its boxed message. A
        shell's completion request (env _TFM_COMPLETE, set by the script `--install-completion` installs)
        is answered first, as typer's own `main` would."""
        prog_name = prog_name or "tfm"
        for command in [self, *self.commands.values()]:  # a flag takes no value: the help shows none, not <bool>
            help_option = command.get_help_option(command.context_class(command))
            for param in [*command.params, *([help_option] if help_option is not None else [])]:
                if getattr(param, "is_flag", False) and param.metavar is None:
                    param.metavar = ""
        self._main_shell_completion(extra, prog_name, extra.pop("complete_var", None))  # exits if it was one
        try:
            previous = signal.signal(signal.SIGTERM, _terminate)
        except ValueError:  # not the main thread (an embedding program's worker): leave signals alone
            previous = None
        try:
            self._run(args, prog_name, extra)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def _run(self, args: Sequence[str] | None, prog_name: str, extra: dict[str, Any]) -> NoReturn:
        click_exception, usage_error, no_args = _click_errors()
        try:
            with self.make_context(prog_name, sys.argv[1:] if args is None else list(args), **extra) as ctx:
                self.invoke(ctx)
        except typer.Exit as e:  # --help, --version
            sys.exit(e.exit_code)
        except no_args as e:  # `tfm` alone: the help (typer prints it with rich itself), exit code 2
            if e.format_message():
                e.show()
            sys.exit(e.exit_code)
        except usage_error as e:
            see = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
            _exit_with_error(e.format_message() + see, e.exit_code)
        except click_exception as e:
            _exit_with_error(e.format_message(), e.exit_code)
        except TfmError as e:
            _exit_with_error(str(e), e.exit_code)
        except (KeyboardInterrupt, typer.Abort):
            _exit_with_error("interrupted", 130)
        except _Terminated:
            _exit_with_error("terminated", 128 + signal.SIGTERM)
        except OSError as e:
            if e.errno == errno.EPIPE:  # the reader of the output (`tfm predict ... | head`) has gone
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
                sys.exit(1)
            where = f" '{e.filename}'" if e.filename else ""
            _exit_with_error(f"{e.strerror or e}{where}", 1)
        except Exception as e:  # a bug: still one line, with the traceback on request
            if os.environ.get("TFM_DEBUG"):
                raise
            if _out_of_memory(e):
                _exit_with_error("out of memory; lower --batch-size, data.max_length or the model's sizes", 1)
            _exit_with_error(f"unexpected {type(e).__name__}: {e} (set TFM_DEBUG=1 to see the traceback)", 1)
        sys.exit(0)


def _click_errors() -> tuple[type[Exception], type[Exception], type[Exception]]:
    """(ClickException, UsageError, NoArgsIsHelpError) of the click that typer runs on (typer >= 0.29
    vendors its own copy, so `import click` would not catch them)."""
    by_name = {c.__name__: c for c in typer.BadParameter.__mro__}
    click_exception, usage_error = by_name["ClickException"], by_name["UsageError"]
    no_args = next((c for c in usage_error.__subclasses__() if c.__name__ == "NoArgsIsHelpError"), ())
    return click_exception, usage_error, no_args


def _exit_with_error(message: str, code: int) -> NoReturn:
    """`tfm: error: ...` on one line, whatever the message holds, and exit with `code`."""
    typer.echo("tfm: error: " + " ".join(line.strip() for line in message.splitlines() if line.strip()), err=True)
    sys.exit(code)


def _out_of_memory(e: Exception) -> bool:
    """Python's MemoryError, torch's OutOfMemoryError (CUDA), or a CPU tensor allocation that failed."""
    return isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e))


app = typer.Typer(
    cls=_Tfm,
    help="Train, evaluate and run a from-scratch transformer sentiment classifier on IMDB reviews.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"tfm {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    pass


Ckpt = Annotated[Path, typer.Option("--checkpoint", "-c", help="Output directory of `tfm train`.")]
Device = Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N or mps.")]
InputFile = Annotated[str | None, typer.Option("--file", "-f",
                                               help="Read one review per line from PATH ('-' = stdin).")]
InferPrecision = Annotated[str | None, typer.Option(
    help="auto, fp32, bf16 or fp16; default: fp32 for a run trained in fp32, else auto.", show_default=False)]
IgSteps = Annotated[int | None, typer.Option(
    "--ig-steps", min=1, show_default=False,
    help="Nodes of the integrated-gradients integral (default 3). Each adds about 2.6 predictions' time; more "
    "bring the attributions' sum closer to the change of the label's probability.")]


# Options of the two training commands, `tfm train` and `tfm pretrain`.
Overrides = Annotated[list[str] | None, typer.Argument(
    help="Config overrides SECTION.FIELD=VALUE (TOML values), e.g. model.n_layers=4 train.lr=3e-4.",
    show_default=False)]
ConfigFile = Annotated[Path | None, typer.Option(
    "--config", help="TOML recipe (see configs/); default: the built-in defaults.", show_default=False)]
Data = Annotated[str | None, typer.Option(
    "--data", help="Hub id, Hub-layout folder, aclImdb folder/tarball, or CSV/JSONL/Parquet file(s) (and .txt for "
    "pretrain); default: env TFM_DATA, else the config's.", show_default=False)]
OutputDir = Annotated[str | None, typer.Option(  # str: click would make "" (an unset $OUT) the current folder
    "--output-dir", "-o", help="Where the model, metrics and TensorBoard events go.", show_default=False)]
Epochs = Annotated[int | None, typer.Option("--epochs", help="Passes over the training texts.", show_default=False)]
MaxSteps = Annotated[int | None, typer.Option("--max-steps", help="Stop after this many optimizer steps.",
                                              show_default=False)]
BatchSize = Annotated[int | None, typer.Option("--batch-size", help="Examples per optimizer step (all processes).",
                                               show_default=False)]
Lr = Annotated[float | None, typer.Option("--lr", help="Peak learning rate.", show_default=False)]
Seed = Annotated[int | None, typer.Option("--seed", help="Seed for the split, init, dropout and batching.",
                                          show_default=False)]
TrainDevice = Annotated[str | None, typer.Option("--device", help="auto, cpu, cuda, cuda:N or mps.",
                                                 show_default=False)]
Precision = Annotated[str | None, typer.Option("--precision", help="auto, fp32, bf16 or fp16.", show_default=False)]
MaxTrainSamples = Annotated[int | None, typer.Option("--max-train-samples", help="Train on this many examples.",
                                                     show_default=False)]
Resume = Annotated[bool, typer.Option("--resume", help="Continue from the latest complete checkpoint in the output "
                                      "directory.")]
ResumeFrom = Annotated[Path | None, typer.Option("--resume-from", help="Continue from this checkpoint folder.",
                                                 show_default=False)]
Force = Annotated[bool, typer.Option("--force", help="On resume, accept settings that differ from the checkpoint's.")]
Progress = Annotated[bool, typer.Option("--progress/--no-progress", help="Show the progress bar.")]


PRETRAIN_OUTPUT_DIR = "runs/pretrain"


def _training_config(command: str, config: Path | None, overrides: list[str] | None, options: dict[str, Any],
                     resume: bool, resume_from: Path | None):
    """The run's Config: the file, then `TFM_DATA`, then the overrides, then the options that were given.
    Resumed without --config, the run's own config.json stands for the file (and TFM_DATA): the run
    directory knows how it was started. An override that `command` would not use is refused."""
    values = parse_overrides(overrides or [])
    check_command_overrides(command, values)
    values.update({k: v for k, v in options.items() if v is not None})
    default_out = PRETRAIN_OUTPUT_DIR if command == "pretrain" else TrainConfig.output_dir
    base = None
    if (resume or resume_from) and config is None:
        out = resume_from.parent.parent if resume_from else Path(values.get("train.output_dir", default_out))
        base = run_settings(out)
        if base is not None:
            values.setdefault("train.output_dir", str(out))
    if base is None and os.environ.get("TFM_DATA") and "data.source" not in values:  # below --data, data.source=
        values["data.source"] = os.environ["TFM_DATA"]
    if "train.output_dir" not in values and "output_dir" not in (read_toml(config) if config else {}).get("train", {}):
        values["train.output_dir"] = default_out  # `tfm pretrain`'s default folder is not `tfm train`'s
    return load_config(config, values, base)


def _common_options(data, output_dir, epochs, max_steps, batch_size, lr, seed, device, precision,
                    max_train_samples) -> dict[str, Any]:
    return {
        "data.source": data, "train.output_dir": output_dir,
        "train.epochs": epochs, "train.max_steps": max_steps, "train.batch_size": batch_size, "train.lr": lr,
        "train.seed": seed, "train.device": device, "train.precision": precision,
        "data.max_train_samples": max_train_samples,
    }


@app.command(context_settings={"allow_extra_args": False})
def train(
    overrides: Overrides = None, config: ConfigFile = None, data: Data = None, output_dir: OutputDir = None,
    epochs: Epochs = None, max_steps: MaxSteps = None, batch_size: BatchSize = None, lr: Lr = None, seed: Seed = None,
    device: TrainDevice = None, precision: Precision = None, max_train_samples: MaxTrainSamples = None,
    max_eval_samples: Annotated[int | None, typer.Option(help="Validate/test on at most this many examples.",
                                                         show_default=False)] = None,
    init_from: Annotated[Path | None, typer.Option(
        help="Start from the encoder and tokenizer of a `tfm pretrain` output directory.", show_default=False)] = None,
    test: Annotated[bool, typer.Option("--test", help="Evaluate the best model on the test split at the end.")] = False,
    resume: Resume = False, resume_from: ResumeFrom = None, force: Force = False, progress: Progress = True,
) -> None:
    """Train a classifier and write OUTPUT_DIR (model.safetensors, config.json, tokenizer.json, metrics.json,
    events)."""
    options = _common_options(data, output_dir, epochs, max_steps, batch_size, lr, seed, device, precision,
                              max_train_samples)
    options.update({"data.max_eval_samples": max_eval_samples, "train.test_at_end": True if test else None,
                    "train.init_from": None if init_from is None else str(init_from)})
    cfg = _training_config("train", config, overrides, options, resume, resume_from)
    from transformer_cli.training.classify import train as run_train  # imports torch

    metrics = run_train(cfg, resume=str(resume_from) if resume_from else resume, force=force, progress=progress)
    if os.environ.get("RANK", "0") != "0":  # under torchrun only rank 0 reports
        return
    val, metric = metrics.get("val", {}), metrics["select_metric"]
    line = f"done: best val {metric} {val.get(metric, float('nan')):.4f} at step {metrics['best_step']}"
    if metric != "accuracy":
        line += f" (accuracy {val.get('accuracy', float('nan')):.4f})"
    if metrics["stopped_early"]:
        line += f", stopped early at step {metrics['steps']}"
    if "test" in metrics:
        line += f", test accuracy {metrics['test']['accuracy']:.4f}"
    cal = metrics["calibration"]
    if cal["temperature"] == cal["fitted_temperature"]:
        line += f"; temperature {cal['temperature']:.3f} (val ECE {cal['ece_before']:.4f} -> {cal['ece_after']:.4f})"
    else:
        line += (f"; no temperature (val ECE {cal['ece_before']:.4f}: the fitted {cal['fitted_temperature']:.3f} "
                 "would raise it)")
    typer.echo(line + f" ({metrics['train_time_sec']:.0f} s of training)")
    warning = imbalance_warning(val, cfg.train.class_weights, cfg.train.select_metric)
    if warning:
        typer.echo(f"tfm: warning: {warning}", err=True)


@app.command(context_settings={"allow_extra_args": False})
def pretrain(
    overrides: Overrides = None, config: ConfigFile = None, data: Data = None, output_dir: OutputDir = None,
    epochs: Epochs = None, max_steps: MaxSteps = None, batch_size: BatchSize = None, lr: Lr = None, seed: Seed = None,
    device: TrainDevice = None, precision: Precision = None, max_train_samples: MaxTrainSamples = None,
    resume: Resume = False, resume_from: ResumeFrom = None, force: Force = False, progress: Progress = True,
) -> None:
    """Pretrain the encoder as a masked language model on unlabelled text and write OUTPUT_DIR
    (default runs/pretrain): model.safetensors, config.json, tokenizer.json, metrics.json, events.
    `tfm train --init-from` reads it."""
    options = _common_options(data, output_dir, epochs, max_steps, batch_size, lr, seed, device, precision,
                              max_train_samples)
    cfg = _training_config("pretrain", config, overrides, options, resume, resume_from)
    from transformer_cli.training.pretrain import pretrain as run_pretrain  # imports torch

    metrics = run_pretrain(cfg, resume=str(resume_from) if resume_from else resume, force=force, progress=progress)
    if os.environ.get("RANK", "0") != "0":
        return
    val, metric = metrics["val"], metrics["select_metric"]
    other = "accuracy" if metric == "loss" else "loss"
    typer.echo(f"done: best held-out masked-LM {metric} {val[metric]:.4f} ({other} {val[other]:.4f}) at step "
               f"{metrics['best_step']} ({metrics['train_time_sec']:.0f} s of training)")


@app.command(context_settings={"allow_extra_args": False})
def tune(
    space: Annotated[Path, typer.Option(
        "--space", help='TOML search space: a table per config field, e.g. ["train.lr"], with low and high (and log '
        "or step) or choices.", show_default=False)],
    trials: Annotated[int, typer.Option("--trials", min=1, help="Trials to run to the end or prune, counted over "
                                        "every process of the study.", show_default=False)],
    output_dir: Annotated[str, typer.Option(
        "--output-dir", "-o", help="The study's folder: study.db, trials/NNNN (each a `tfm train` run), best.toml.",
        show_default=False)],
    overrides: Overrides = None, config: ConfigFile = None, data: Data = None,
    timeout: Annotated[str | None, typer.Option(help='Start no trial after this long ("90m", "2h").',
                                                show_default=False)] = None,
    storage: Annotated[str | None, typer.Option(
        help="Optuna storage URL (sqlite:///FILE, postgresql://..., mysql://...) that processes share; default: "
        "sqlite in the study's folder.", show_default=False)] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the study (after a crash, or with more "
                                         "--trials), or join it from another process.")] = False,
) -> None:
    """Search hyperparameters: train trials chosen by Optuna, prune poor ones early, write the best settings as
    OUTPUT_DIR/best.toml."""
    cfg = _training_config("train", config, overrides, {"data.source": data}, False, None)
    from transformer_cli.tune import tune as run_tune  # imports torch

    r = run_tune(cfg, space, trials, output_dir, timeout, storage, resume)
    typer.echo(r.table)
    if r.best_dir is None:
        typer.echo("no trial finished yet; `tfm tune ... --resume` continues the study")
        return
    typer.echo(f"best: trial {r.best_number}, val {r.metric} {r.best_value:.4f}: {r.best_dir} (a `tfm train` run: "
               f"tfm predict -c {r.best_dir}); its settings: {r.best_file}")


@app.command("data", context_settings={"allow_extra_args": False})
def data_(
    overrides: Overrides = None, config: ConfigFile = None, data: Data = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")] = False,
    report: Annotated[Path | None, typer.Option(
        help="Also write a histogram of each split's token lengths here, as PNG.", show_default=False)] = None,
) -> None:
    """Report on the data `tfm train` would read, before training: each split's examples, classes, lengths in
    words and tokens, repeated texts within and across splits, conflicting labels, and warnings."""
    cfg = _training_config("train", config, overrides, {"data.source": data}, False, None)
    from transformer_cli.data.report import data_report, report_text

    r = data_report(cfg, report)
    if as_json:
        typer.echo(json.dumps(r))
        return
    typer.echo(report_text(r))
    for warning in r["warnings"]:
        typer.echo(f"tfm: warning: {warning}", err=True)


@app.command()
def predict(
    texts: Annotated[list[str] | None, typer.Argument(help="Reviews to classify.", show_default=False)] = None,
    checkpoint: Ckpt = Path("runs/tfm"),
    file: InputFile = None,
    as_json: Annotated[bool, typer.Option(
        "--json", help="One JSON object per input line: label, score, probabilities.")] = False,
    device: Device = "auto",
    batch_size: Annotated[int, typer.Option(min=1, help="Reviews per forward pass.")] = 64,
    precision: InferPrecision = None,
    explain: Annotated[bool, typer.Option(
        "--explain", help="Also each token's contribution to the predicted label (integrated gradients, in fp32; "
        "slower): the review coloured, or 'tokens', 'attributions' and 'spans' (their characters in the "
        "review) with --json.")] = False,
    ig_steps: IgSteps = None,
) -> None:
    """Print the predicted label and its probability for each review, in input order."""
    if ig_steps is not None and not explain:
        raise UsageError("--ig-steps sets how --explain integrates; add --explain")
    inputs = read_inputs(texts or [], file)
    from transformer_cli.evaluate import predict_texts  # imports torch

    results = predict_texts(checkpoint, inputs, device, batch_size, precision)
    explained = _explanations(checkpoint, inputs, results, device, ig_steps) if explain else [None] * len(inputs)
    for text, r, e in zip(inputs, results, explained):
        if as_json:
            typer.echo(json.dumps(r if e is None else {**r, "tokens": e.tokens, "attributions": e.attributions,
                                                       "spans": e.spans}))
        else:
            typer.echo(f"{r['label']}\t{r['score']:.4f}\t{snippet(text)}")
            if e is not None:
                from rich.console import Console

                from transformer_cli.explain import rich_text

                Console(highlight=False).print(rich_text(e))


def _explanations(checkpoint: Path, inputs: list[str], results: list[dict], device: str, steps: int | None) -> list:
    from transformer_cli.explain import explain_texts

    return explain_texts(checkpoint, inputs, results, device, steps)


@app.command()
def evaluate(
    checkpoint: Ckpt = Path("runs/tfm"),
    data: Annotated[str | None, typer.Option(
        help="Dataset to evaluate on; default: the one the model was trained on.", show_default=False)] = None,
    split: Annotated[str, typer.Option(
        help="Split to evaluate; 'validation' is what the run validated on.")] = "test",
    max_samples: Annotated[int | None, typer.Option(
        min=1, help="Evaluate a seeded random subset of this size.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the metrics as one JSON object.")] = False,
    device: Device = "auto",
    batch_size: Annotated[int | None, typer.Option(min=1, help="Reviews per forward pass.")] = None,
    precision: InferPrecision = None,
    report: Annotated[Path | None, typer.Option(
        help="Write plots (confusion matrix, reliability, PR curves, accuracy by length) and report.html here.",
        show_default=False)] = None,
    text_column: Annotated[str | None, typer.Option(
        help="The data's column of texts; default: the run's data.text_column.", show_default=False)] = None,
    label_column: Annotated[str | None, typer.Option(
        help="The data's column of labels; default: the run's data.label_column.", show_default=False)] = None,
) -> None:
    """Accuracy, macro-F1, loss, calibration error (ECE), each class's precision, recall and F1, and the
    confusion matrix of a trained model on a split."""
    if report is not None:
        from transformer_cli.report import check_report_dir

        check_report_dir(report)  # before the evaluation's minutes
    from transformer_cli.evaluate import evaluate_checkpoint  # imports torch

    m = evaluate_checkpoint(checkpoint, data, split, max_samples, device, batch_size, precision, report, text_column,
                            label_column)
    if as_json:
        typer.echo(json.dumps(m))
        return
    typer.echo(evaluation_report(m))
    if report is not None:
        typer.echo(f"report: {report / 'report.html'}")


@app.command("pseudo-label")
def pseudo_label(
    checkpoints: Annotated[list[Path], typer.Option(
        "--checkpoint", "-c", metavar="DIR",
        help="Output directory of `tfm train`: a teacher. Repeat it to average several.")],
    output: Annotated[Path, typer.Option("--output", "-o", metavar="FILE",
                                         help="The .jsonl file to write (text, label, score).")],
    data: Annotated[str | None, typer.Option(
        help="Dataset whose split to label; default: the one the first teacher was trained on.",
        show_default=False)] = None,
    split: Annotated[str, typer.Option(help="Split to label (its labels, if any, are not read).")] = "unsupervised",
    max_samples: Annotated[int | None, typer.Option(min=1, help="Label a seeded random subset of this size.",
                                                    show_default=False)] = None,
    device: Device = "auto",
    batch_size: Annotated[int, typer.Option(min=1, help="Reviews per forward pass.")] = 64,
    precision: InferPrecision = None,
    force: Annotated[bool, typer.Option("--force", help="Replace FILE if it exists (never a file of the data "
                                        "being labelled).")] = False,
) -> None:
    """Label unlabelled reviews with trained models, for self-training: `tfm train data.pseudo_labels=FILE`."""
    if output.suffix.lower() != ".jsonl":
        raise UsageError(f"--output '{output}': name a .jsonl file")
    from transformer_cli.pseudo import pseudo_label as run_pseudo_label  # imports torch

    r = run_pseudo_label(checkpoints, output, data, split, max_samples, device, batch_size, precision, force)
    counts = ", ".join(f"{n} {name}" for name, n in r["per_class"].items())
    typer.echo(f"wrote {output}: {r['reviews']} reviews ({counts}), median score {r['median_score']:.3f} "
               f"({r['seconds']:.0f} s)")


@app.command("export")
def export_(
    checkpoint: Ckpt = Path("runs/tfm"),
    output: Annotated[Path, typer.Option("--output", "-o", help="The .onnx file to write; NAME.tokenizer.json "
                                         "goes beside it.")] = Path("model.onnx"),
) -> None:
    """Write the model as an ONNX graph (token ids and padding mask -> logits), checked against the model."""
    from transformer_cli.export import export_onnx  # imports torch

    r = export_onnx(checkpoint, output)
    typer.echo(f"wrote {r['onnx']} ({r['bytes'] / 1e6:.1f} MB) and {r['tokenizer']}; logits match the model "
               f"within {r['max_abs_logit_diff']:.1g}")


@app.command()
def serve(
    checkpoint: Ckpt = Path("runs/tfm"),
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0: every interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port (0: a free one, printed).")] = 8000,
    max_batch_size: Annotated[int, typer.Option(min=1, help="Texts in one model call, gathered over concurrent "
                                                "requests.")] = 64,
    max_wait_ms: Annotated[float, typer.Option(min=0, help="How long a request waits for others to share its "
                                               "model call; no longer once every open connection's request "
                                               "is in.")] = 2.0,
    max_texts: Annotated[int, typer.Option(min=1, help="Texts in one request.")] = 64,
    max_body_bytes: Annotated[int, typer.Option(min=1, help="Size of one request's body.")] = 1_000_000,
    batch_size: Annotated[int, typer.Option(min=1, help="Reviews per forward pass.")] = 64,
    drain_timeout: Annotated[float, typer.Option(help="Seconds SIGTERM waits for requests in flight (a stalled "
                                                 "upload, say) before it closes their connections.")] = 30.0,
    workers: Annotated[int, typer.Option(min=1, help="Server processes (uvicorn's workers), each loading the model "
                                         "and batching the requests it accepts; above 1 needs a --port other "
                                         "than 0.")] = 1,
    device: Device = "auto",
    precision: InferPrecision = None,
) -> None:
    """Serve the model over HTTP: POST /predict {"texts": [...]}, GET /health, GET /metadata (docs/serving.md)."""
    from transformer_cli.serve import Limits
    from transformer_cli.serve import serve as run_server  # imports torch

    limits = Limits(max_batch_size, max_wait_ms, max_texts, max_body_bytes, batch_size, drain_timeout)
    run_server(checkpoint, host, port, limits, device, precision, workers,
               on_ready=lambda url: typer.echo(f"tfm: serving {checkpoint} on {url}; stop with Ctrl-C or SIGTERM",
                                               err=True))


@app.command(name="explain")
def explain_reviews(
    texts: Annotated[list[str] | None, typer.Argument(help="Reviews to explain.", show_default=False)] = None,
    checkpoint: Ckpt = Path("runs/tfm"),
    file: InputFile = None,
    html: Annotated[Path, typer.Option("--html", help="Write the page here (one self-contained HTML file).")] = ...,
    device: Device = "auto",
    ig_steps: IgSteps = None,
) -> None:
    """Write an HTML page of each review's label, probability and tokens coloured by their contribution to it."""
    from transformer_cli import checkpoint as ckpt  # imports torch, as the explanation does next

    model_files = [checkpoint / name
                   for name in (ckpt.MODEL_FILE, ckpt.CONFIG_FILE, ckpt.TOKENIZER_FILE, ckpt.METRICS_FILE)]
    check_output_path(html, "--html", hint="pass a file name for the page",  # before the explanations' minutes
                      inputs=[*([file] if file not in (None, "-") else []), *model_files])
    inputs = read_inputs(texts or [], file)
    from transformer_cli.evaluate import predict_texts

    results = predict_texts(checkpoint, inputs, device)
    explained = _explanations(checkpoint, inputs, results, device, ig_steps)
    from transformer_cli.explain import write_html

    write_html(html, list(zip(results, explained)))
    typer.echo(f"wrote {html} ({len(inputs)} review{'s' if len(inputs) != 1 else ''})")


@app.command(name="inspect", context_settings={"allow_extra_args": False})
def inspect_model(
    overrides: Overrides = None,
    checkpoint: Annotated[Path | None, typer.Option("--checkpoint", "-c", help="Output directory of `tfm train`.",
                                                    show_default=False)] = None,
    config: Annotated[Path | None, typer.Option("--config", help="TOML recipe: an untrained model at its sizes.",
                                                show_default=False)] = None,
    text: Annotated[str | None, typer.Option(help="Review to run through the model; default: a sample review.",
                                             show_default=False)] = None,
    depth: Annotated[int | None, typer.Option(min=0, help="Show the tree down to this depth (0: the model alone); "
                                              "default: all of it.", show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object: dims, layers, total.")] = False,
) -> None:
    """The model layer by layer for one review: input and output shapes (B, T, C, H, Dh), parameters, FLOPs per
    token."""
    if (checkpoint is None) == (config is None and not overrides):
        raise UsageError("pass -c DIR (a trained model) or --config FILE [SECTION.FIELD=VALUE ...] (a recipe's "
                         "sizes), one of the two")
    if text is not None and not text.strip():
        raise UsageError("--text is empty; pass a review, or leave --text out for the sample review")
    from transformer_cli import summary  # imports torch

    try:
        import torchinfo  # noqa: F401
    except ImportError:
        raise TfmError("tfm inspect needs 'pip install transformer-cli[inspect]'") from None
    if checkpoint is not None:
        model, tokenizer, data_cfg = summary.model_from_dir(checkpoint)
    else:
        cfg = load_config(config, parse_overrides(overrides or []))
        model, tokenizer, data_cfg = summary.model_from_config(cfg), None, cfg.data
    s = summary.summarize(model, summary.sample_ids(text or summary.SAMPLE_TEXT, model, tokenizer, data_cfg))
    typer.echo(json.dumps(s.to_dict(depth)) if as_json else summary.format_summary(s, depth))


def main() -> None:
    app(prog_name="tfm")


if __name__ == "__main__":
    main()
