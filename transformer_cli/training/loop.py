"""The training loop, shared by `tfm train` and `tfm pretrain`: the schedule, the step, the loop, validation
and checkpoints.

One `train_step` takes an optimizer step over a step's micro-batches; `train_steps` is a generator that yields
one `StepResult` per step, and `fit` is its caller: it logs, validates, checkpoints and stops. What is learnt
is a `Task`: the classifier (classify.py) or the masked LM (pretrain.py). Everything device-, precision- and
rank-specific goes through one `Runtime`.
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from transformer_cli import checkpoint as ckpt
from transformer_cli.config import Config, TrainConfig
from transformer_cli.data import BucketSampler
from transformer_cli.errors import TfmError
from transformer_cli.fileio import atomic_write_bytes
from transformer_cli.runtime import Runtime
from transformer_cli.training.state import (  # noqa: F401  (re-exported: the loop's names)
    Ema,
    Logger,
    TrainState,
    _rng_state,
    _set_rng_state,
    seed_everything,
)

KEEP_CHECKPOINTS = 2  # the latest resumable checkpoints kept
MAX_BAD_STEPS = 10  # consecutive non-finite steps before training stops


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


clock = time.perf_counter  # the loop's clock, which train.time_budget reads (a test may replace it)


def lr_at(step: int, total_steps: int, tc: TrainConfig, elapsed: float = 0.0) -> float:
    """Linear warmup to `tc.lr`, then linear/cosine decay to 0 (or constant). With train.time_budget the run's
    progress is the share of the budget spent (`elapsed` seconds) or of the steps done, whichever is further,
    and warmup_ratio is a share of the budget, as Cramming (Geiping & Goldstein 2022) schedules by time."""
    if tc.time_budget is not None and tc.warmup_steps is None:
        done = min(1.0, max((step + 1) / total_steps, elapsed / tc.budget_sec))
        if done < tc.warmup_ratio:
            return tc.lr * done / tc.warmup_ratio
        return _decayed(tc, (done - tc.warmup_ratio) / (1.0 - tc.warmup_ratio))
    warmup = tc.warmup_steps if tc.warmup_steps is not None else int(tc.warmup_ratio * total_steps)
    if step < warmup:
        return tc.lr * (step + 1) / warmup
    if total_steps <= warmup:
        return tc.lr
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    if tc.time_budget is not None:
        progress = max(progress, min(1.0, elapsed / tc.budget_sec))
    return _decayed(tc, progress)


def _decayed(tc: TrainConfig, progress: float) -> float:
    """The rate after warmup at `progress` (0 to 1) through the decay."""
    if tc.schedule == "constant":
        return tc.lr
    if tc.schedule == "cosine":
        progress = 0.5 * (1.0 - math.cos(math.pi * progress))
    return tc.lr * (1.0 - progress)


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
    val_tokens: int  # real tokens of the validation examples

    def batch(self, rt: Runtime, idx: np.ndarray, epoch: int) -> Batch:
        """The training examples `idx` of an epoch, on the device."""
        ...

    def loss(self, engine: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the objective to minimise, the statistics to log), each a mean over the batch's units."""
        ...

    def evaluate(self, run: Run) -> tuple[dict, dict[str, float], float]:
        """(validation metrics, their TensorBoard scalars, the score that selects the saved model: its
        `select_metric`, see selection_score)."""
        ...

    def log_pictures(self, writer, step: int, metrics: dict, data_cfg) -> None:
        """TensorBoard pictures of the validation pass that gave `metrics`."""
        ...


def selection_score(metrics: dict, metric: str) -> float:
    """The score, higher is better, that validation `metrics` get by `metric`: the loss negated."""
    return -metrics["loss"] if metric == "loss" else metrics[metric]



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
    # Called on every rank after each validation pass (and the checkpoint that follows it, if one is due; not
    # when a signal stops the run there) with the step and the validation metrics, e.g. by `tfm tune` to report
    # to its trial; an exception it raises ends the run there, its best model so far saved.
    on_validation: Callable[[int, dict], None] | None = None


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
            stat_sums[name] = stat_sums.get(name, 0.0) + value * batch.units
    names = list(stat_sums)
    objective_value, *sums = torch.stack([torch.as_tensor(objective_sum), *map(torch.as_tensor, stat_sums.values())]
                                         ).tolist()  # one device sync
    scaler.unscale_(run.optimizer)
    params = [p for p in run.model.parameters() if p.requires_grad]  # the norm sums in this order
    grad_clip = run.cfg.train.grad_clip
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf")).item()
    finite = math.isfinite(objective_value) and (math.isfinite(grad_norm) or scaler.is_enabled())
    overflowed = scaler.is_enabled() and not math.isfinite(grad_norm)
    stopping = stop_requested()  # asked during this step: it still ends, and is saved, before the stop
    if rt.distributed:  # every rank must take the same decisions, or the next collective hangs
        bad, stops, samples, tokens, units, *sums = rt.all_sum([float(not finite), float(stopping), samples, tokens,
                                                                units, *sums])
        finite, stopping, samples, tokens = bad == 0, stops > 0, int(samples), int(tokens)
    values = [total / units for total in sums]
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


def train_steps(run: Run, total: int, stop: _StopFlag, elapsed: Callable[[], float] = lambda: 0.0,
                time_up: Callable[[], bool] = lambda: False) -> Iterator[StepResult]:
    """Optimizer steps from where the run's state stands to `total`, one result each; the state is
    advanced before each is yielded (the epoch after the last step of an epoch). `elapsed()`: the run's
    training seconds so far; `time_up()`: whether its time budget is spent, which makes a step the last."""
    tc, st, rt = run.cfg.train, run.state, run.rt
    sampler = make_sampler(run)
    run.engine.train()
    while st.step < total and st.epoch < tc.epochs and not out_of_patience(tc, st) and not st.out_of_time:
        groups = step_groups(sampler.batches(st.epoch), tc.grad_accum_steps)
        if st.batch_in_epoch >= len(groups):  # resumed (--force) with fewer steps an epoch than it had done
            st.epoch, st.batch_in_epoch = st.epoch + 1, 0
            continue
        while st.batch_in_epoch < len(groups) and st.step < total and not out_of_patience(tc, st):
            lr = lr_at(st.step, total, tc, elapsed())
            for g in run.optimizer.param_groups:
                g["lr"] = lr * g.get("lr_scale", 1.0)
            batches = [run.task.batch(run.rt, idx, st.epoch) for idx in groups[st.batch_in_epoch]]
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
            if tc.time_budget is not None:  # the ranks agree, on the slowest one's clock
                st.out_of_time = rt.all_sum([float(time_up())])[0] > 0 if rt.distributed else time_up()
            result.last = epoch_done or st.step >= total or st.out_of_time
            if epoch_done:
                st.epoch += 1
                st.batch_in_epoch = 0
            yield result
            if epoch_done or st.out_of_time:
                break  # the next epoch's batches, or the end


def out_of_patience(tc: TrainConfig, st: TrainState) -> bool:
    """Whether `train.patience` validation passes in a row brought no better score: training stops."""
    return tc.patience > 0 and st.evals_since_best >= tc.patience


def stop_reason(tc: TrainConfig, st: TrainState, total: int) -> str:
    """Why a run that ended (after `total` steps at most) stopped: "patience" (early), "time_budget", "max_steps"
    or "epochs"."""
    if out_of_patience(tc, st) and st.step < total:
        return "patience"
    if st.out_of_time:
        return "time_budget"
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
    if st.step:
        _say(f"resuming from step {st.step} of {total}", rt.is_main)
    steps = f"{total} steps" if tc.time_budget is None else f"{tc.time_budget} (at most {total} steps)"
    _say(f"training {task.num_train} examples ({task.num_val} validation) for {steps}; batch {tc.batch_size} "
         f"= {micro} x {rt.world_size} process(es) x {tc.grad_accum_steps} accumulation; {rt.device}, {rt.precision}",
         progress and rt.is_main)
    bar = None
    if progress and rt.is_main:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, initial=st.step, desc=task.prefix, unit="step", dynamic_ncols=True)
    window = {"samples": 0, "tokens": 0, "t0": time.perf_counter()}  # throughput of the steps alone
    t_start = clock() - st.train_time_sec
    ending = {"sec": 0.0}  # what the last validation pass (and its checkpoint) took: the run's end costs as much

    def elapsed() -> float:
        return clock() - t_start

    def time_up() -> bool:
        cost = ending["sec"]
        if not cost and st.tokens_seen:  # no validation yet: its forward passes, at a third of a training step's cost
            cost = task.val_tokens / (3 * st.tokens_seen / max(elapsed(), 1e-9))
        return elapsed() + cost >= tc.budget_sec

    with _StopFlag(run.out) as stop, contextlib.closing(bar) if bar is not None else contextlib.nullcontext():
        for result in train_steps(run, total, stop, elapsed, time_up):
            window["samples"] += result.samples
            window["tokens"] += result.tokens
            if bar is not None:
                bar.update(1)
            if not result.finite or result.overflowed:
                logger.scalars(st.step, {f"{task.prefix}/bad_steps": st.bad_steps_total})
                if st.bad_steps_in_row >= MAX_BAD_STEPS:
                    raise TfmError(
                        f"training diverged: {st.bad_steps_in_row} steps in a row had a non-finite loss or gradient "
                        f"(at step {st.step}); lower --lr or raise train.grad_clip"
                    )
            if st.step % tc.log_every == 0 or st.step == total:
                _log_train(window, result, logger, bar, run)
            stopping, validated = result.stopping, None
            if result.last:  # validated and saved once, at the end of each epoch and of the run
                with _untimed(window):
                    t0 = clock()
                    validated = validate(run, logger)
                    st.train_time_sec = elapsed()
                    # A stop during the last validation still gets the checkpoint first. The ranks
                    # agree before it, so that its barrier stays the epoch's last collective.
                    stopping = stopping or stop.signum is not None
                    if rt.distributed:
                        stopping = rt.all_sum([float(stopping)])[0] > 0
                    where = save_checkpoint(run)
                    ending["sec"] = clock() - t0
            else:
                if tc.eval_every and st.step % tc.eval_every == 0:
                    with _untimed(window):
                        t0 = clock()
                        validated = validate(run, logger)
                        ending["sec"] = clock() - t0
                st.train_time_sec = elapsed()
                if tc.checkpoint_every and st.step % tc.checkpoint_every == 0 or stopping or out_of_patience(tc, st):
                    with _untimed(window):
                        where = save_checkpoint(run)
            if stopping:
                raise Interrupted(stop.signum or signal.SIGTERM, where or run.out)
            if validated is not None and run.on_validation is not None:
                run.on_validation(st.step, validated)
            if out_of_patience(tc, st) and st.step < total:
                metric = run.task.select_metric
                _say(f"stopped early at step {st.step}: {st.evals_since_best} validation passes without a better "
                     f"val {metric} (train.patience = {tc.patience}); best at step {st.best_step}",
                     progress and rt.is_main)
    # metrics.json's time includes the last checkpoint too (each checkpoint holds the time before it)
    st.train_time_sec = elapsed()


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
        if logger.writer is not None:
            run.task.log_pictures(logger.writer, run.state.step, m, run.cfg.data)
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
                                    KEEP_CHECKPOINTS, best)
    run.rt.barrier()
    return path
