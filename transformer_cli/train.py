"""Training, top to bottom: the schedule, the step, the loop, the run's setup, and `tfm train` itself.

One `train_step` takes an optimizer step over a step's micro-batches; `train_steps` is a generator
that yields one `StepResult` per step, and `fit` is its caller: it logs, validates, checkpoints and
stops. What is learnt is a `Task`: the classifier here (`Classification`), the masked-LM in
`pretrain.py`; both run through this same loop. Everything device-, precision- and rank-specific
goes through one `Runtime`. Output directory: model.safetensors (best by validation), config.json,
tokenizer.json, metrics.json, TensorBoard events, and checkpoints/ for exact resume.
"""

from __future__ import annotations

import contextlib
import gc
import math
import random
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from transformer_cli import calibration, tb_pictures
from transformer_cli import checkpoint as ckpt
from transformer_cli.config import FORMAT_VERSION, Config, TrainConfig, with_legacy_values
from transformer_cli.data import BucketSampler, Encoded, collate, prepare_eval_data, prepare_train_data
from transformer_cli.errors import TfmError, UsageError
from transformer_cli.evaluate import all_logits, evaluate_scaled
from transformer_cli.fileio import (
    atomic_write_bytes,
    atomic_write_text,
    check_output_path,
    read_json,
    remove_stale_temp_files,
    write_json,
)
from transformer_cli.model import CTransformer
from transformer_cli.optim import clip_grad_norm_, make_optimizer
from transformer_cli.runtime import Runtime, make_runtime, shutdown

# Settings that may differ on resume without changing the trajectory of training.
RESUME_FREE = {*(f"train.{k}" for k in ("output_dir", "log_every", "eval_batch_size", "test_at_end", "checkpoint_every",
                                        "keep_checkpoints", "device", "num_threads", "max_bad_steps", "compile",
                                        "calibrate")),
               "data.cache_dir", "pretrain.shard_texts"}  # where the caches are, and how the corpus is read into them


class Interrupted(TfmError):
    """Training stopped by a signal after writing a checkpoint; exit code 128 + signal number."""

    def __init__(self, signum: int, where: Path):
        super().__init__(f"stopped by {signal.Signals(signum).name}; checkpoint at '{where}', continue with --resume")
        self.exit_code = 128 + signum


class Aborted(TfmError):
    """A second Ctrl-C: training stops at once, without writing a checkpoint; exit code 130."""

    exit_code = 130

    def __init__(self, out: Path):
        if ckpt.checkpoint_dirs(out):
            then = f"--resume continues from the last complete one in '{out / ckpt.CKPT_DIR}'"
        else:
            then = "there was none yet, so run the same command again (without --resume)"
        super().__init__(f"interrupted twice: stopped at once without a new checkpoint; {then}")


# --------------------------------------------------------------------------- schedule


def lr_at(step: int, total_steps: int, tc: TrainConfig) -> float:
    """Linear warmup to `tc.lr`, then linear/cosine decay to `lr * min_lr_ratio` (or constant)."""
    warmup = tc.warmup_steps if tc.warmup_steps is not None else int(tc.warmup_ratio * total_steps)
    if step < warmup:
        return tc.lr * (step + 1) / warmup
    if tc.schedule == "constant" or total_steps <= warmup:
        return tc.lr
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    if tc.schedule == "cosine":
        progress = 0.5 * (1.0 - math.cos(math.pi * progress))
    return tc.lr * (1.0 - (1.0 - tc.min_lr_ratio) * progress)


# --------------------------------------------------------------------------- logging


class Logger:
    """TensorBoard scalars and hparams; writes on the main rank only."""

    def __init__(self, out: Path, rt: Runtime, purge_step: int | None = None):
        self.writer = None
        if rt.is_main:
            from torch.utils.tensorboard import SummaryWriter

            _wait_to_sort_after_earlier_event_files(out)
            self.writer = SummaryWriter(str(out), purge_step=purge_step)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is not None:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)

    def hparams(self, hparams: dict, metrics: dict[str, float], step: int) -> None:
        if self.writer is None:
            return
        from torch.utils.tensorboard.summary import hparams as hp_summary

        clean = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in hparams.items()}
        for summary in hp_summary(clean, metrics):
            self.writer.file_writer.add_summary(summary, step)
        self.scalars(step, metrics)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _wait_to_sort_after_earlier_event_files(out: Path) -> None:
    """TensorBoard reads a folder's event files in name order, and a name starts with the second it
    was created in, then the process id. A resume within the same second as the run before it could
    sort first and show the resumed steps before the earlier ones: wait for the next second. (A
    file from further ahead, another machine's clock, is not waited for.)"""
    seconds = [int(m.group(1)) for p in out.glob("events.out.tfevents.*")
               if (m := re.match(r"events\.out\.tfevents\.(\d+)\.", p.name))]
    if seconds and 0 < (delay := max(seconds) + 1 - time.time()) <= 1:
        time.sleep(delay)


# --------------------------------------------------------------------------- state


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    epoch: int = 0  # current epoch
    batch_in_epoch: int = 0  # optimizer steps done within the current epoch
    best_score: float = -math.inf  # the task's validation score (higher is better) of the saved model
    best_step: int = -1
    best_val: dict = field(default_factory=dict)
    evals_since_best: int = 0  # validation passes since the score last improved (train.patience counts them)
    bad_steps_in_row: int = 0
    bad_steps_total: int = 0
    train_time_sec: float = 0.0
    samples_seen: int = 0
    tokens_seen: int = 0
    # Running sums of the logged statistics since the last log, so that a resume stopped between
    # two logs logs the same means as the run it continues.
    stats_since_log: dict = field(default_factory=dict)
    steps_since_log: int = 0

    @classmethod
    def from_json(cls, d: dict) -> TrainState:
        d = dict(d)
        if "best_val_accuracy" in d:  # checkpoints of runs from before tasks had scores
            d["best_score"] = d.pop("best_val_accuracy")
        if "loss_since_log" in d:
            d["stats_since_log"] = {"loss": d.pop("loss_since_log")}
        return cls(**d)


class Ema:
    """Exponential moving average of the weights, warm-started: decay_t = min(decay, (1 + t) / (10 + t))."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        self.params = list(model.parameters())
        self.shadow = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self, step: int) -> None:
        d = min(self.decay, (1 + step) / (10 + step))
        for s, p in zip(self.shadow, self.params):
            s.lerp_(p, 1.0 - d)

    @contextlib.contextmanager
    def swapped_in(self):
        """The model holds the averaged weights inside the block, its own weights again after it."""
        with torch.no_grad():
            own = [p.detach().clone() for p in self.params]
            for p, s in zip(self.params, self.shadow):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, o in zip(self.params, own):
                    p.copy_(o)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _rng_state(device: torch.device) -> tuple[dict, dict]:
    json_part = {"python": _jsonable(random.getstate())}
    np_state = np.random.get_state()
    json_part["numpy"] = [np_state[0], np_state[1].tolist(), *np_state[2:]]
    tensors = {"torch": torch.get_rng_state()}
    if device.type == "cuda":  # the run's GPU alone: a resume may see fewer GPUs, or others
        tensors["cuda"] = torch.cuda.get_rng_state(device)
    if torch.backends.mps.is_available():  # dropout on an Apple GPU draws from its own generator
        tensors["mps"] = torch.mps.get_rng_state()
    return json_part, tensors


def _jsonable(x):
    return [_jsonable(v) for v in x] if isinstance(x, (tuple, list)) else x


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, list) else x


def _set_rng_state(json_part: dict, tensors: dict, device: torch.device) -> None:
    random.setstate(_tuplify(json_part["python"]))
    n = json_part["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), *n[2:]))
    torch.set_rng_state(tensors["torch"])
    cuda = tensors.get("cuda")
    if isinstance(cuda, (list, tuple)):  # older checkpoints hold every visible GPU's state
        cuda = cuda[device.index or 0] if device.type == "cuda" and (device.index or 0) < len(cuda) else None
    if cuda is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda, device)
    if "mps" in tensors and torch.backends.mps.is_available():
        torch.mps.set_rng_state(tensors["mps"])


# --------------------------------------------------------------------------- tasks


@dataclass
class Batch:
    tensors: tuple  # what the task's loss reads, on the device
    units: int  # what the loss is a mean over: examples, or predicted tokens
    samples: int  # examples
    tokens: int  # real tokens


class Task(Protocol):
    """What a run learns: its batches, its loss, and how it is validated."""

    prefix: str  # TensorBoard tags: PREFIX/loss, PREFIX/lr, ...
    select_metric: str  # the validation metric whose score selects the saved model
    lengths: np.ndarray  # (N,) tokens of each training example, for the bucketed sampler
    num_train: int
    num_val: int

    def batch(self, rt: Runtime, idx: np.ndarray) -> Batch: ...

    def loss(self, engine: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the objective to minimise, the statistics to log), each a mean over the batch's units."""
        ...

    def evaluate(self, run: Run) -> tuple[dict, dict[str, float], float]:
        """(validation metrics, their TensorBoard scalars, the score that selects the saved model: its
        `select_metric`, see selection_score)."""
        ...


def selection_score(metrics: dict, metric: str) -> float:
    """The score, higher is better, that validation `metrics` get by `metric`: the loss negated."""
    return -metrics["loss"] if metric == "loss" else metrics[metric]


class Classification:
    """Supervised training of the classifier: cross-entropy on the labels."""

    prefix = "train"

    def __init__(self, train: Encoded, val: Encoded, labels: list[str], label_smoothing: float, eval_batch_size: int,
                 select_metric: str = "accuracy", tokenizer=None, adversarial_eps: float = 0.0,
                 virtual_adversarial_eps: float = 0.0, val_texts: list[str] | None = None):
        self.train, self.val, self.labels = train, val, labels
        self.val_texts = val_texts  # val's reviews, to show where one was cut (TensorBoard pictures)
        self.tokenizer = tokenizer  # the run's, to show validation reviews as text (TensorBoard pictures)
        self.label_smoothing, self.adversarial_eps = label_smoothing, adversarial_eps
        self.virtual_adversarial_eps = virtual_adversarial_eps
        self.eval_batch_size = eval_batch_size
        self.select_metric = select_metric
        self.lengths, self.num_train, self.num_val = train.lengths, len(train), len(val)
        self.val_logits: torch.Tensor | None = None  # of the last validation pass, for pictures and calibration

    def batch(self, rt: Runtime, idx: np.ndarray) -> Batch:
        ids, mask, y = rt.tensors(*collate(self.train, idx))
        return Batch((ids, mask, y), len(idx), len(idx), int(self.lengths[idx].sum()))

    def loss(self, engine, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ids, mask, y = batch.tensors
        logits, objective = engine(ids, mask, y, self.label_smoothing, self.adversarial_eps,
                                   self.virtual_adversarial_eps)
        # Logged as train/loss: the model's cross-entropy, the quantity val/loss measures (the
        # objective may add label smoothing, the n-gram path's own loss and the adversarial losses).
        return objective, {"loss": F.cross_entropy(logits.detach().float(), y)}

    def evaluate(self, run: Run) -> tuple[dict, dict[str, float], float]:
        m, self.val_logits = evaluate_scaled(run.model, self.val, run.rt, self.eval_batch_size, len(self.labels),
                                             self.labels)
        tags = {"val/loss": m["loss"], "val/accuracy": m["accuracy"], "val/macro_f1": m["macro_f1"], "val/ece": m["ece"]}
        return m, tags, selection_score(m, self.select_metric)


# --------------------------------------------------------------------------- the step


@dataclass
class Run:
    cfg: Config
    rt: Runtime
    out: Path
    model: torch.nn.Module  # the raw module: what is saved
    engine: torch.nn.Module  # what runs forward: the model, maybe compiled and/or DDP-wrapped
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    task: Task
    state: TrainState
    ema: Ema | None = None


@dataclass
class StepResult:
    stats: dict[str, float]  # the task's figures: means over the step's units (per-token ones: real tokens), all ranks
    grad_norm: float
    finite: bool  # False: the step was skipped (non-finite loss or gradient)
    overflowed: bool  # fp16: the gradient scaler skipped the step (its gradients overflowed) and lowers its scale
    stopping: bool  # a stop was asked for on some rank
    samples: int  # examples in the step, all ranks
    tokens: int
    lr: float = 0.0
    epoch: int = 0  # the epoch the step belongs to
    last: bool = False  # the last step of its epoch or of the run


def train_step(run: Run, batches: list[Batch], stop_requested: Callable[[], bool] = lambda: False) -> StepResult:
    """One optimizer step over micro-batches: accumulate gradients, clip, check that the loss and the
    gradients are finite (a step that is not is skipped), step the optimizer and the weight average.

    Each micro-batch weighs by its share of the step's units, so a step's loss is the mean over
    them whatever the sizes of its micro-batches. Under DDP the ranks agree on skipping and stopping
    in the same collective that averages the logged statistics.
    """
    rt, engine, scaler = run.rt, run.engine, run.scaler
    units = sum(b.units for b in batches)
    samples, tokens = sum(b.samples for b in batches), sum(b.tokens for b in batches)
    per_token = getattr(run.model, "per_token_stats", ())  # ELECTRA's detection figures: means over real tokens
    objective_sum: torch.Tensor | float = 0.0
    stat_sums: dict[str, torch.Tensor | float] = {}  # each figure times what it is a mean over, summed
    for j, batch in enumerate(batches):
        sync = engine.no_sync() if rt.distributed and j < len(batches) - 1 else contextlib.nullcontext()
        share = batch.units / units
        with sync, rt.autocast():
            objective, stats = run.task.loss(engine, batch)
            objective = objective * share
        scaler.scale(objective).backward()
        objective_sum = objective_sum + objective.detach()
        for name, value in stats.items():
            stat_sums[name] = stat_sums.get(name, 0.0) + value * (batch.tokens if name in per_token else batch.units)
    names = list(stat_sums)
    objective_value, *sums = torch.stack([torch.as_tensor(objective_sum), *map(torch.as_tensor, stat_sums.values())]
                                         ).tolist()  # one device sync
    scaler.unscale_(run.optimizer)
    params = [p for p in run.model.parameters() if p.requires_grad]  # the norm sums in this order
    grad_clip = run.cfg.train.grad_clip
    grad_norm = clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf")).item()
    finite = math.isfinite(objective_value) and (math.isfinite(grad_norm) or scaler.is_enabled())
    overflowed = scaler.is_enabled() and not math.isfinite(grad_norm)
    stopping = stop_requested()  # asked during this step: it still ends, and is saved, before the stop
    if rt.distributed:  # every rank must take the same decisions, or the next collective hangs
        bad, stops, samples, tokens, units, *sums = rt.all_sum([float(not finite), float(stopping), samples, tokens,
                                                                units, *sums])
        finite, stopping, samples, tokens = bad == 0, stops > 0, int(samples), int(tokens)
    values = [total / (tokens if name in per_token else units) for name, total in zip(names, sums)]
    if finite and not overflowed:
        scaler.step(run.optimizer)
        if run.ema is not None:
            run.ema.update(run.state.step)
    scaler.update()  # after an overflow: a lower scale (unscale_ recorded it)
    run.optimizer.zero_grad(set_to_none=True)
    return StepResult(dict(zip(names, values)), grad_norm, finite, overflowed, stopping, samples, tokens)


# --------------------------------------------------------------------------- the loop


def step_groups(batches: list[np.ndarray], accum: int) -> list[list[np.ndarray]]:
    return [batches[i : i + accum] for i in range(0, len(batches), accum)]


def make_sampler(run: Run) -> BucketSampler:
    tc, rt = run.cfg.train, run.rt
    micro = tc.batch_size // (tc.grad_accum_steps * rt.world_size)
    return BucketSampler(run.task.lengths, micro * rt.world_size, tc.seed, rt.world_size, rt.rank)


def total_steps(run: Run, sampler: BucketSampler) -> int:
    per_epoch = len(step_groups(sampler.batches(0), run.cfg.train.grad_accum_steps))
    total = per_epoch * run.cfg.train.epochs
    return min(total, run.cfg.train.max_steps) if run.cfg.train.max_steps else total


def train_steps(run: Run, total: int, stop: _StopFlag) -> Iterator[StepResult]:
    """Optimizer steps from where the run's state stands to `total`, one result each; the state is
    advanced before each is yielded (the epoch after the last step of an epoch)."""
    tc, st = run.cfg.train, run.state
    sampler = make_sampler(run)
    run.engine.train()
    while st.step < total and st.epoch < tc.epochs and not out_of_patience(tc, st):
        groups = step_groups(sampler.batches(st.epoch), tc.grad_accum_steps)
        if st.batch_in_epoch >= len(groups):  # resumed (--force) with fewer steps an epoch than it had done
            st.epoch, st.batch_in_epoch = st.epoch + 1, 0
            continue
        while st.batch_in_epoch < len(groups) and st.step < total and not out_of_patience(tc, st):
            lr = lr_at(st.step, total, tc)
            for g in run.optimizer.param_groups:
                g["lr"] = lr * g.get("lr_scale", 1.0)
            batches = [run.task.batch(run.rt, idx) for idx in groups[st.batch_in_epoch]]
            result = train_step(run, batches, lambda: stop.signum is not None)
            result.lr, result.epoch = lr, st.epoch
            st.step += 1
            st.batch_in_epoch += 1
            st.samples_seen += result.samples
            st.tokens_seen += result.tokens
            if result.overflowed:  # counted, never "in a row": the scaler finds its scale so
                st.bad_steps_total += 1
            elif result.finite:
                st.bad_steps_in_row = 0
                for name, value in result.stats.items():
                    st.stats_since_log[name] = st.stats_since_log.get(name, 0.0) + value
                st.steps_since_log += 1
            else:
                st.bad_steps_in_row += 1
                st.bad_steps_total += 1
            epoch_done = st.batch_in_epoch == len(groups)
            result.last = epoch_done or st.step >= total
            if epoch_done:
                st.epoch += 1
                st.batch_in_epoch = 0
            yield result
            if epoch_done:
                break  # the next epoch's batches


def out_of_patience(tc: TrainConfig, st: TrainState) -> bool:
    """Whether `train.patience` validation passes in a row brought no better score: training stops."""
    return tc.patience > 0 and st.evals_since_best >= tc.patience


def stop_reason(tc: TrainConfig, st: TrainState, total: int) -> str:
    """Why a run that ended (after `total` steps at most) stopped: "patience" (early), "max_steps" or "epochs"."""
    if out_of_patience(tc, st) and st.step < total:
        return "patience"
    return "max_steps" if tc.max_steps is not None and st.step >= tc.max_steps else "epochs"


def fit(run: Run, logger: Logger, progress: bool = True) -> None:
    """Train to the end: log every `log_every` steps, validate and checkpoint every so many steps and
    at each epoch's end and the run's, stop early when `train.patience` validation passes bring no
    better score (after a checkpoint, so that a resumed run stops there too), and stop cleanly on
    SIGINT/SIGTERM."""
    tc, rt, st, task = run.cfg.train, run.rt, run.state, run.task
    total = total_steps(run, make_sampler(run))
    if total == 0:
        raise TfmError(f"{task.num_train} training examples make no full batch of {tc.batch_size}; lower --batch-size")
    micro = tc.batch_size // (tc.grad_accum_steps * rt.world_size)
    _say(f"training {task.num_train} examples ({task.num_val} validation) for {total} steps; batch {tc.batch_size} "
         f"= {micro} x {rt.world_size} process(es) x {tc.grad_accum_steps} accumulation; {rt.device}, {rt.precision}",
         progress and rt.is_main)
    bar = None
    if progress and rt.is_main:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, initial=st.step, desc=task.prefix, unit="step", dynamic_ncols=True)
    window = {"samples": 0, "tokens": 0, "t0": time.perf_counter()}  # throughput of the steps alone
    t_start = time.perf_counter() - st.train_time_sec
    with _StopFlag(run.out) as stop, contextlib.closing(bar) if bar is not None else contextlib.nullcontext():
        for result in train_steps(run, total, stop):
            window["samples"] += result.samples
            window["tokens"] += result.tokens
            if bar is not None:
                bar.update(1)
            if not result.finite or result.overflowed:
                logger.scalars(st.step, {f"{task.prefix}/bad_steps": st.bad_steps_total})
                if st.bad_steps_in_row >= tc.max_bad_steps:
                    raise TfmError(
                        f"training diverged: {st.bad_steps_in_row} steps in a row had a non-finite loss or gradient "
                        f"(at step {st.step}); lower --lr or raise train.grad_clip"
                    )
            if st.step % tc.log_every == 0 or st.step == total:
                _log_train(window, result, logger, bar, run)
            stopping = result.stopping
            if result.last:  # validated and saved once, at the end of each epoch and of the run
                with _untimed(window):
                    validate(run, logger)
                    st.train_time_sec = time.perf_counter() - t_start
                    # A stop during the last validation still gets the checkpoint first. The ranks
                    # agree before it, so that its barrier stays the epoch's last collective.
                    stopping = stopping or stop.signum is not None
                    if rt.distributed:
                        stopping = rt.all_sum([float(stopping)])[0] > 0
                    where = save_checkpoint(run)
            else:
                if tc.eval_every and st.step % tc.eval_every == 0:
                    with _untimed(window):
                        validate(run, logger)
                st.train_time_sec = time.perf_counter() - t_start
                if tc.checkpoint_every and st.step % tc.checkpoint_every == 0 or stopping or out_of_patience(tc, st):
                    with _untimed(window):
                        where = save_checkpoint(run)
            if stopping:
                raise Interrupted(stop.signum or signal.SIGTERM, where or run.out)
            if out_of_patience(tc, st) and st.step < total:
                metric = run.task.select_metric
                _say(f"stopped early at step {st.step}: {st.evals_since_best} validation passes without a better "
                     f"val {metric} (train.patience = {tc.patience}); best at step {st.best_step}",
                     progress and rt.is_main)
    # metrics.json's time includes the last checkpoint too (each checkpoint holds the time before it)
    st.train_time_sec = time.perf_counter() - t_start


class _StopFlag:
    """First SIGINT/SIGTERM: finish the step, checkpoint, exit. A second SIGINT aborts at once."""

    def __init__(self, out: Path):
        self.out = out
        self.signum: int | None = None
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def _handle(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise Aborted(self.out)
        self.signum = signum

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _say(message: str, show: bool) -> None:
    if show:
        print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _untimed(window: dict):
    """Validation and checkpoints inside the loop: left out of the logged throughput (they are in
    train_time_sec, the loop's wall time)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        window["t0"] += time.perf_counter() - t0


def _log_train(window: dict, result: StepResult, logger: Logger, bar, run: Run) -> None:
    st, prefix = run.state, run.task.prefix
    elapsed = time.perf_counter() - window["t0"]
    values = {f"{prefix}/lr": result.lr, f"{prefix}/grad_norm": result.grad_norm, f"{prefix}/epoch": result.epoch,
              f"{prefix}/batch_size": run.cfg.train.batch_size}
    if st.steps_since_log:
        values.update({f"{prefix}/{name}": total / st.steps_since_log for name, total in st.stats_since_log.items()})
    if elapsed > 0:
        values[f"{prefix}/samples_per_sec"] = window["samples"] / elapsed
        values[f"{prefix}/tokens_per_sec"] = window["tokens"] / elapsed
    logger.scalars(st.step, values)
    if bar is not None:
        bar.set_postfix(loss=f"{values.get(f'{prefix}/loss', float('nan')):.4f}", lr=f"{result.lr:.2e}",
                        sps=f"{values.get(f'{prefix}/samples_per_sec', 0):.0f}")
    st.stats_since_log, st.steps_since_log = {}, 0
    window.update(samples=0, tokens=0, t0=time.perf_counter())


def validate(run: Run, logger: Logger) -> dict:
    """Validation metrics; saves the weights (or their average) as the output's model when the task's
    score improves."""
    with run.ema.swapped_in() if run.ema is not None else contextlib.nullcontext():
        m, tags, score = run.task.evaluate(run)
        if isinstance(run.task, Classification) and logger.writer is not None:
            tb_pictures.log_validation(logger.writer, run.state.step, m, run.task.val_logits, run.task.val,
                                       run.task.labels, run.task.tokenizer, run.task.val_texts, run.cfg.data)
        st = run.state
        weights_finite = all(torch.isfinite(p).all() for p in run.model.parameters())
        if weights_finite and math.isfinite(m["loss"]) and score > st.best_score:
            st.best_score, st.best_step, st.best_val, st.evals_since_best = score, st.step, m, 0
            if run.rt.is_main:
                atomic_write_bytes(run.out / ckpt.MODEL_FILE, ckpt.state_bytes(run.model))
        else:
            st.evals_since_best += 1
        if run.cfg.train.patience:
            tags = {**tags, f"{run.task.prefix}/evals_since_best": st.evals_since_best}
        logger.scalars(st.step, tags)
    return m


def save_checkpoint(run: Run) -> Path | None:
    """All ranks gather their RNG states; rank 0 writes checkpoints/step-N."""
    json_rng, tensor_rng = _rng_state(run.rt.device)
    json_rngs, tensor_rngs = [json_rng], [tensor_rng]
    if run.rt.distributed:
        json_rngs = [None] * run.rt.world_size
        tensor_rngs = [None] * run.rt.world_size
        torch.distributed.all_gather_object(json_rngs, json_rng)
        torch.distributed.all_gather_object(tensor_rngs, tensor_rng)
    path = None
    if run.rt.is_main:
        train_json = {
            "state": asdict(run.state),
            "config": run.cfg.to_dict(),
            "world_size": run.rt.world_size,
            "rng": json_rngs,
        }
        tensors = {"optimizer": run.optimizer.state_dict(), "scaler": run.scaler.state_dict(), "rng": tensor_rngs}
        if run.ema is not None:
            tensors["ema"] = run.ema.shadow
        best = run.out / ckpt.MODEL_FILE if run.state.best_step >= 0 else None
        path = ckpt.save_checkpoint(run.out, run.state.step, run.model, train_json, tensors,
                                    run.cfg.train.keep_checkpoints, best)
    run.rt.barrier()
    return path


# --------------------------------------------------------------------------- setup


def run_config(folder: Path) -> dict | None:
    """The config.json of a tfm run in `folder` (this format, with its sections); None if there is none,
    it is unreadable, or it is another program's."""
    try:
        meta = read_json(folder / ckpt.CONFIG_FILE, "config")
    except (TfmError, OSError):
        return None
    ours = isinstance(meta, dict) and meta.get("format_version") == FORMAT_VERSION and isinstance(meta.get("train"), dict)
    return meta if ours else None


def check_run_kind(folder: Path, pretraining: bool) -> None:
    """A folder of the other command's runs is refused in one line: resuming it would fail on its weights."""
    meta = run_config(folder)
    if meta is None or (meta.get("kind") == ckpt.PRETRAINED_KIND) == pretraining:
        return
    if not pretraining:
        ckpt.refuse_pretrained_encoder(folder, meta, then=" and another --output-dir; `tfm pretrain --resume` "
                                       "continues the pretraining")
    raise UsageError(f"'{folder}' holds a classifier written by `tfm train`, not a pretraining run; pretrain into "
                     "another --output-dir (`tfm train --resume` continues the classifier's training)")


def check_output_dir(out: Path, resume: bool | str, pretraining: bool = False) -> None:
    check_output_path(out, "output directory", folder=True, hint="choose another --output-dir")
    check_run_kind(out, pretraining)
    if resume is True:
        return
    # Without a checkpoint or metrics.json, a tfm run's folder holds what it writes before its first
    # checkpoint (config.json, tokenizer.json, events, maybe a model from a validation): a run that died
    # then cannot be resumed, so it may be started again in the same folder, which replaces those files.
    # A model beside no config of a tfm run (another program's, a copied model) is never replaced.
    foreign_model = (out / ckpt.MODEL_FILE).exists() and run_config(out) is None
    if ckpt.checkpoint_dirs(out) or (out / ckpt.METRICS_FILE).exists() or foreign_model:
        if resume and Path(resume).resolve().parent == (out / ckpt.CKPT_DIR).resolve():
            return  # --resume-from one of this folder's own checkpoints
        if foreign_model and not ckpt.checkpoint_dirs(out):  # nothing --resume could continue
            raise UsageError(f"output directory '{out}' holds a {ckpt.MODEL_FILE} that is no tfm run's (its "
                             f"{ckpt.CONFIG_FILE} is missing or not tfm's); choose another --output-dir")
        raise UsageError(
            f"output directory '{out}' already holds a run; pass --resume to continue it or choose another --output-dir"
        )


def find_resume(out: Path, resume: bool | str) -> Path | None:
    if not resume:
        return None
    if isinstance(resume, str):
        path = Path(resume)
        if not path.is_dir():
            raise UsageError(f"--resume-from '{path}' is not a checkpoint directory")
        return path
    found = ckpt.checkpoint_dirs(out)
    if not found:
        raise UsageError(f"--resume: no complete checkpoint in '{out / ckpt.CKPT_DIR}'; start without --resume")
    return found[-1]


def begin(tc: TrainConfig, rt: Runtime, resume: bool | str, pretraining: bool = False) -> Path | None:
    """What every run does first: check its output folder and batch size, find the checkpoint to
    resume from (None: a fresh run), set torch's threads and seed every generator."""
    out = Path(tc.output_dir)
    check_output_dir(out, resume, pretraining)
    resume_dir = find_resume(out, resume)
    if resume_dir is not None:
        check_run_kind(resume_dir.parent.parent, pretraining)
    check_batch_size(tc, rt)
    if tc.num_threads:
        torch.set_num_threads(tc.num_threads)
    seed_everything(tc.seed)
    return resume_dir


def check_batch_size(tc: TrainConfig, rt: Runtime) -> None:
    per_rank, rem = divmod(tc.batch_size, tc.grad_accum_steps * rt.world_size)
    if rem or per_rank == 0:
        raise UsageError(
            f"train.batch_size = {tc.batch_size} must be a multiple of grad_accum_steps x processes "
            f"= {tc.grad_accum_steps} x {rt.world_size}"
        )


def _check_resume_config(saved: dict, cfg: Config, world_size: int, saved_world: int, force: bool) -> list[str]:
    """The settings (SECTION.KEY) that differ from the checkpoint's; refused unless `force`."""
    now, saved = cfg.to_dict(), with_legacy_values(saved)
    path_off = saved["model"].get("ngram_buckets") == now["model"]["ngram_buckets"] == 0

    def matters(section: str, key: str) -> bool:  # the n-gram path's settings mean nothing while it is off
        return f"{section}.{key}" not in RESUME_FREE and not (
            path_off and section == "model" and key.startswith("ngram_") and key != "ngram_buckets")

    changed = {f"{section}.{key}": (saved.get(section, {}).get(key), value)
               for section in now for key, value in now[section].items()
               if saved.get(section, {}).get(key, value) != value and matters(section, key)}
    diffs = [f"{k}: {before!r} -> {after!r}" for k, (before, after) in changed.items()]
    if saved_world != world_size:
        diffs.append(f"world size: {saved_world} -> {world_size}")
    if diffs and not force:
        raise UsageError(
            "the resumed run's settings differ from the checkpoint's (" + "; ".join(diffs[:4])
            + "); run the same command plus --resume, or add --force to accept the change"
        )
    return list(changed)


def on_every_rank(rt: Runtime, prepare):
    """`prepare()` on rank 0 first (it trains the tokenizer and fills the caches), then on the others,
    which read the caches."""
    if rt.is_main:
        result = prepare()
    rt.barrier()
    if not rt.is_main:
        result = prepare()
    return result


def build_run(cfg: Config, rt: Runtime, model: torch.nn.Module, task: Task, resume_dir: Path | None, force: bool,
              files: dict[str, str]) -> Run:
    """The optimizer, loss scaler and weight average for `model`, restored from `resume_dir` if given;
    writes `files` (name -> text: config.json, tokenizer.json) into the output directory."""
    tc = cfg.train
    out = Path(tc.output_dir)
    model = model.to(rt.device)
    torch.manual_seed(tc.seed + rt.rank)  # dropout streams differ per rank; init is identical
    optimizer = make_optimizer(model, tc, rt.device)
    scaler = rt.grad_scaler()
    ema = Ema(model, tc.ema_decay) if tc.ema_decay > 0 else None
    state = TrainState()
    if resume_dir is not None:
        state = _restore(resume_dir, cfg, rt, model, optimizer, scaler, ema, force, task.select_metric)
    if rt.is_main:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"cannot create output directory '{out}' ({e.strerror}); choose another --output-dir")
        remove_stale_temp_files(out)  # checkpoints/.step-* leftovers go with the next checkpoint
        if resume_dir is None:  # a run that died before its first checkpoint left these; they are not this run's
            (out / ckpt.MODEL_FILE).unlink(missing_ok=True)
            for events in out.glob("events.out.tfevents.*"):
                events.unlink()
        elif state.best_step < 0:  # nothing validated yet: a model here is a later (or another) run's
            (out / ckpt.MODEL_FILE).unlink(missing_ok=True)
        elif (resume_dir / ckpt.BEST_FILE).is_file():
            # the best model as of the checkpoint, not whatever a later (or another) run saved since; a damaged
            # copy is refused before it replaces the output's model
            best = resume_dir / ckpt.BEST_FILE
            try:
                data = best.read_bytes()
            except OSError as e:
                raise TfmError(f"the checkpoint's best model '{best}' is unreadable ({e.strerror}); pick another "
                               "checkpoint with --resume-from") from None
            ckpt.checked_weights(best, model.state_dict(), data=data)
            atomic_write_bytes(out / ckpt.MODEL_FILE, data)
        for name, text in files.items():
            atomic_write_text(out / name, text)
    engine: torch.nn.Module = model
    if tc.compile:
        engine = torch.compile(engine)
    if rt.distributed:
        from torch.nn.parallel import DistributedDataParallel

        engine = DistributedDataParallel(engine, device_ids=[rt.device.index] if rt.device.type == "cuda" else None)
    return Run(cfg, rt, out, model, engine, optimizer, scaler, task, state, ema)


def _restore(path: Path, cfg: Config, rt: Runtime, model, optimizer, scaler, ema: Ema | None,
             force: bool, select_metric: str) -> TrainState:
    train_json, tensors = ckpt.load_checkpoint(path)
    if not isinstance(train_json, dict) or not {"config", "state", "rng"} <= set(train_json):
        raise TfmError(f"checkpoint state '{path / 'trainer.json'}' is not a tfm checkpoint's (no config, state and "
                       "rng); pick another checkpoint with --resume-from")
    changed = _check_resume_config(train_json["config"], cfg, rt.world_size, train_json.get("world_size", 1), force)
    try:
        ckpt.load_weights(model, path / ckpt.MODEL_FILE)
    except TfmError:
        shaped = [k for k in changed if k.startswith(("model.", "data.", "pretrain."))]
        if not shaped:
            raise
        raise UsageError(f"{', '.join(shaped[:4])} changed, and the checkpoint's weights do not fit the model they "
                         "make; --force accepts only changes that keep the weights' shapes: start a new run (another "
                         "--output-dir) for these") from None
    try:
        # The optimizer's state comes from the checkpoint; its settings (weight decay, betas, each
        # group's lr_scale) stay this run's, which differ from the checkpoint's only under --force.
        settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        optimizer.load_state_dict(tensors["optimizer"])
        _check_optimizer_state(optimizer)
        for group, own in zip(optimizer.param_groups, settings, strict=True):
            group.update(own)
        if tensors["scaler"]:  # empty where the saved run had no scaler (fp32, bf16) and --force turned fp16 on
            scaler.load_state_dict(tensors["scaler"])
        if ema is not None:  # a run that had no average (ema_decay turned on by --force) starts one here
            for s, saved in zip(ema.shadow, tensors.get("ema", ema.params), strict=True):
                s.copy_(saved)
        rng = tensors["rng"][rt.rank] if rt.rank < len(tensors["rng"]) else tensors["rng"][0]
        _set_rng_state(train_json["rng"][min(rt.rank, len(train_json["rng"]) - 1)], rng, rt.device)
    except (KeyError, ValueError, RuntimeError, IndexError) as e:
        raise TfmError(f"checkpoint '{path}' does not fit this model/optimizer ({e})") from None
    state = TrainState.from_json(train_json["state"])
    if any(k.startswith("model.") or k == "train.init_from" for k in changed):
        # The best model so far is another model than config.json will describe: the next validation picks anew.
        state.best_score, state.best_step, state.best_val, state.evals_since_best = -math.inf, -1, {}, 0
    elif state.best_val and selection_score(state.best_val, select_metric) != state.best_score:
        # Another selection metric (train.select_metric changed under --force): the best pass by it is unknown, so
        # the saved pass's score by it is the bar, and patience counts anew.
        state.best_score, state.evals_since_best = selection_score(state.best_val, select_metric), 0
    return state


def _check_optimizer_state(optimizer) -> None:
    """load_state_dict pairs the saved state with the parameters by position and checks only the
    groups' sizes: state saved for another order of parameters (another version of the model) must
    fail here, as one line, not inside the optimizer's kernel."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            for name, t in optimizer.state.get(p, {}).items():
                if torch.is_tensor(t) and t.dim() > 0 and t.shape != p.shape:
                    raise ValueError(f"optimizer state '{name}' of shape {tuple(t.shape)} for a parameter of "
                                     f"shape {tuple(p.shape)}")


def load_encoder(encoder: torch.nn.Module, model_dir: Path) -> None:
    """The encoder weights of a `tfm pretrain` (or `tfm train`) output directory into `encoder`: the
    `encoder.*` tensors of its model.safetensors, name for name and shape for shape, all finite."""
    path = Path(model_dir) / ckpt.MODEL_FILE
    ckpt.load_weights(encoder, path, prefix="encoder.")
    if not all(t.isfinite().all() for t in encoder.state_dict().values() if t.is_floating_point()):
        raise TfmError(f"the encoder in '{path}' has NaN or inf weights; pretrain again")


def load_tokenizer(out: Path):
    """The tokenizer of the run in `out`; None if it has none (a checkpoint folder copied alone)."""
    path = out / ckpt.TOKENIZER_FILE
    return ckpt.read_tokenizer(path) if path.is_file() else None


def load_labels(out: Path) -> list[str] | None:
    """The class names in the config.json of the run in `out`; None if it has none."""
    path = out / ckpt.CONFIG_FILE
    meta = read_json(path, "config") if path.is_file() else None
    labels = meta.get("labels") if isinstance(meta, dict) else None
    return labels if isinstance(labels, list) else None


def setup(cfg: Config, rt: Runtime, resume: bool | str = False, force: bool = False) -> Run:
    """The classifier's run: output folder checked, data prepared, model built (from a pretrained
    encoder with `train.init_from`), optimizer ready, restored on resume."""
    tc = cfg.train
    resume_dir = begin(tc, rt, resume)
    # A resumed run keeps the tokenizer its weights were trained with, even if --force changed what
    # would train another; a fine-tuned one reads its pretrained encoder's.
    tokenizer = trained_labels = None
    if resume_dir is not None:
        tokenizer = load_tokenizer(resume_dir.parent.parent)
        trained_labels = load_labels(resume_dir.parent.parent)
    if tokenizer is None and tc.init_from:  # also a resumed run whose folder lost its copy
        tokenizer = load_tokenizer(Path(tc.init_from))
    needed = ("test",) if tc.test_at_end else ()  # refused now rather than after training
    data = on_every_rank(rt, lambda: prepare_train_data(cfg.data, tc.seed, tokenizer, needed))
    if trained_labels is not None and data.labels != trained_labels:  # the head's rows are those classes
        raise UsageError(f"the resumed run was trained on the classes ({', '.join(trained_labels)}), but its data "
                         f"now has ({', '.join(data.labels)}); resume on the data it was trained with, or start a "
                         "new run in another --output-dir")

    # The run's config says what it validated on ("" = a part held out of train), whatever the dataset
    # gains later: resume compares it, and `tfm evaluate --split validation` reads it.
    cfg = cfg.replace(data={"val_split": data.val_split})
    vocab_size = data.tokenizer.get_vocab_size()
    model = CTransformer(cfg.model, vocab_size, cfg.data.max_length, len(data.labels))
    if tc.init_from and resume_dir is None:
        load_encoder(model.encoder, Path(tc.init_from))
    task = Classification(data.train, data.val, data.labels, tc.label_smoothing, tc.eval_batch_size,
                          tc.select_metric or "accuracy", data.tokenizer, tc.adversarial_eps,
                          tc.virtual_adversarial_eps, data.val_texts)
    files = ckpt.model_files(cfg.to_dict(), data.tokenizer.to_str(), vocab_size, labels=data.labels)
    return build_run(cfg, rt, model, task, resume_dir, force, files)


# --------------------------------------------------------------------------- the command


def run_to_end(rt: Runtime, make_run, finish, resume: bool | str, progress: bool) -> dict:
    """Set up a run, fit it, finish it (its metrics) and shut the runtime down, whatever happens."""
    run = None
    try:
        run = make_run()
        logger = Logger(run.out, rt, purge_step=run.state.step + 1 if resume else None)
        try:
            start, finished = run.state.step, (run.out / ckpt.METRICS_FILE).is_file()
            fit(run, logger, progress)
            if resume and finished and run.state.step == start:  # a finished run, resumed: nothing new to log,
                logger.close()  # and its end-of-run figures and pictures are in its events already
                logger.writer = None
            return finish(run, logger)
        finally:
            logger.close()
    finally:
        # The DDP wrapper holds the process group, and modules with hooks sit in reference cycles:
        # free them before the group is destroyed. Left to the interpreter's exit, a gloo rank
        # aborted there now and then ("terminate called without an active exception").
        run = None
        if rt.distributed:
            gc.collect()
        shutdown(rt)


def train(cfg: Config, resume: bool | str = False, force: bool = False, progress: bool = True) -> dict:
    """Run `tfm train`: returns the metrics that are also written to metrics.json."""
    rt = make_runtime(cfg.train.device, cfg.train.precision)
    return run_to_end(rt, lambda: setup(cfg, rt, resume, force), finish, resume, progress)


def run_metrics(run: Run) -> dict:
    """What every run's metrics.json holds: steps, time, throughput, hardware, size, best validation."""
    st = run.state
    if st.best_step < 0:
        raise TfmError("training diverged: no validation pass had finite weights and loss, so no model was saved; "
                       "lower --lr and train into a new --output-dir")
    seconds = st.train_time_sec
    reason = stop_reason(run.cfg.train, st, total_steps(run, make_sampler(run)))
    return {
        "best_step": st.best_step,
        "steps": st.step,
        "epochs": st.epoch,
        "train_time_sec": seconds,
        "samples_per_sec": st.samples_seen / seconds if seconds > 0 else 0.0,
        "tokens_per_sec": st.tokens_seen / seconds if seconds > 0 else 0.0,
        "bad_steps": st.bad_steps_total,
        "precision": run.rt.precision,
        "device": str(run.rt.device),
        "world_size": run.rt.world_size,
        "num_params": sum(p.numel() for p in run.model.parameters()),
        "select_metric": run.task.select_metric,
        "stopped_early": reason == "patience",
        "stop_reason": reason,
        "val": st.best_val,
    }


def finish(run: Run, logger: Logger) -> dict:
    st, tc, task = run.state, run.cfg.train, run.task
    metrics = run_metrics(run)
    ckpt.load_weights(run.model, run.out / ckpt.MODEL_FILE)  # the best model, which what follows is of
    temperature = 1.0
    if tc.calibrate:
        metrics["calibration"] = calibrate(run, logger)
        temperature = metrics["calibration"]["temperature"]
    if tc.test_at_end:
        test = prepare_eval_data(run.cfg.data, task.tokenizer, "test", run.cfg.data.max_eval_samples,
                                 label_names=task.labels)
        metrics["test"], _ = evaluate_scaled(run.model, test, run.rt, tc.eval_batch_size, len(task.labels), task.labels,
                                             temperature)
        logger.scalars(st.step, {"test/accuracy": metrics["test"]["accuracy"], "test/loss": metrics["test"]["loss"]})
    hp = {f"{s}.{k}": v for s, sec in run.cfg.to_dict().items() for k, v in sec.items() if v is not None}
    final = {"hparam/val_accuracy": st.best_val.get("accuracy", 0.0), "hparam/val_loss": st.best_val.get("loss", 0.0)}
    if "test" in metrics:
        final["hparam/test_accuracy"] = metrics["test"]["accuracy"]
    logger.hparams(hp, final, st.step)
    tb_pictures.log_attention(logger.writer, st.step, run.model, task.val, task.labels, task.tokenizer,
                              temperature)
    if run.rt.is_main:
        write_json(run.out / ckpt.METRICS_FILE, metrics)
    return metrics


def calibrate(run: Run, logger: Logger) -> dict:
    """The best model's temperature, fitted on the validation split (calibration.py), stored in
    config.json and logged. The last validation pass's logits are the best model's when it was the
    best; otherwise (e.g. a resumed run) they are computed again."""
    st, task = run.state, run.task
    logits = task.val_logits
    if logits is None or st.best_step != st.step:
        logits = all_logits(run.model, task.val, run.rt, run.cfg.train.eval_batch_size, len(task.labels))
    cal = calibration.calibrate(logits, task.val.labels)
    logger.scalars(st.step, {f"calibration/{k}": cal[k] for k in ("temperature", "ece_before", "ece_after")})
    if run.rt.is_main:
        calibration.save_calibration(run.out, cal)
    return cal
