"""Training as plain functions: setup -> fit -> evaluate -> save.

`train(cfg)` is what `tfm train` calls. Everything device-, precision- and rank-specific goes through
one `Runtime`; the learning rate is a pure function of the step; TensorBoard is written in one place
(`Logger`). Output directory: model.safetensors (best by validation accuracy), config.json,
tokenizer.json, metrics.json, TensorBoard events, and checkpoints/ for exact resume.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import random
import re
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from transformer_cli import checkpoint as ckpt
from transformer_cli.config import Config, TrainConfig, with_legacy_values
from transformer_cli.data import BucketSampler, Encoded, collate, prepare_train_data
from transformer_cli.errors import TfmError, UsageError
from transformer_cli.evaluate import evaluate_model
from transformer_cli.model import CTransformer
from transformer_cli.optim import clip_grad_norm_, make_optimizer
from transformer_cli.runtime import Runtime, make_runtime, shutdown

# Settings that may differ on resume without changing the trajectory of training.
RESUME_FREE = {"output_dir", "log_every", "eval_batch_size", "test_at_end", "checkpoint_every",
               "keep_checkpoints", "device", "num_threads", "max_bad_steps", "compile"}


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
    best_val_accuracy: float = -1.0
    best_step: int = -1
    best_val: dict = field(default_factory=dict)
    bad_steps_in_row: int = 0
    bad_steps_total: int = 0
    train_time_sec: float = 0.0
    samples_seen: int = 0
    loss_since_log: float = 0.0  # train/loss's running sum since the last log, so that a resume
    steps_since_log: int = 0  # stopped between two logs logs the same mean as the run it continues


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


@dataclass
class Run:
    cfg: Config
    rt: Runtime
    out: Path
    model: CTransformer  # the raw module: what is saved
    engine: torch.nn.Module  # what runs forward: the model, maybe compiled and/or DDP-wrapped
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    train: Encoded
    val: Encoded
    labels: list[str]
    state: TrainState
    ema: Ema | None = None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _rng_state() -> tuple[dict, dict]:
    json_part = {"python": _jsonable(random.getstate())}
    np_state = np.random.get_state()
    json_part["numpy"] = [np_state[0], np_state[1].tolist(), *np_state[2:]]
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state_all()
    return json_part, tensors


def _jsonable(x):
    return [_jsonable(v) for v in x] if isinstance(x, (tuple, list)) else x


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, list) else x


def _set_rng_state(json_part: dict, tensors: dict) -> None:
    random.setstate(_tuplify(json_part["python"]))
    n = json_part["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), *n[2:]))
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(tensors["cuda"])


# --------------------------------------------------------------------------- setup


def _check_output_dir(out: Path, resume: bool | str) -> None:
    if out.exists() and not out.is_dir():
        raise UsageError(f"output directory '{out}' is a file; choose another --output-dir")
    existing = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"output directory '{out}' cannot be written ('{existing}' is not writable); "
                         "choose another --output-dir")
    if resume is True:
        return
    # config.json + tokenizer.json alone are what a run writes before its first checkpoint or model:
    # a run that died then has nothing to lose, so it may be started again in the same folder.
    if ckpt.checkpoint_dirs(out) or (out / ckpt.MODEL_FILE).exists() or (out / ckpt.METRICS_FILE).exists():
        if resume and Path(resume).resolve().parent == (out / ckpt.CKPT_DIR).resolve():
            return  # --resume-from one of this folder's own checkpoints
        raise UsageError(
            f"output directory '{out}' already holds a run; pass --resume to continue it or choose another --output-dir"
        )


def _find_resume(out: Path, resume: bool | str) -> Path | None:
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


def _check_resume_config(saved: dict, cfg: Config, world_size: int, saved_world: int, force: bool) -> None:
    now, saved = cfg.to_dict(), with_legacy_values(saved)
    path_off = saved["model"].get("ngram_buckets") == now["model"]["ngram_buckets"] == 0

    def matters(section: str, key: str) -> bool:  # the n-gram path's settings mean nothing while it is off
        return not (section == "train" and key in RESUME_FREE) and not (
            path_off and section == "model" and key.startswith("ngram_") and key != "ngram_buckets")

    diffs = [
        f"{section}.{key}: {saved[section].get(key)!r} -> {value!r}"
        for section in ("model", "data", "train")
        for key, value in now[section].items()
        if saved[section].get(key) != value and matters(section, key)
    ]
    if saved_world != world_size:
        diffs.append(f"world size: {saved_world} -> {world_size}")
    if diffs and not force:
        raise UsageError(
            "the resumed run's settings differ from the checkpoint's (" + "; ".join(diffs[:4])
            + "); run the same command plus --resume, or add --force to accept the change"
        )


def setup(cfg: Config, rt: Runtime, resume: bool | str = False, force: bool = False) -> Run:
    tc = cfg.train
    out = Path(tc.output_dir)
    _check_output_dir(out, resume)
    resume_dir = _find_resume(out, resume)
    per_rank, rem = divmod(tc.batch_size, tc.grad_accum_steps * rt.world_size)
    if rem or per_rank == 0:
        raise UsageError(
            f"train.batch_size = {tc.batch_size} must be a multiple of grad_accum_steps x processes "
            f"= {tc.grad_accum_steps} x {rt.world_size}"
        )
    if tc.num_threads:
        torch.set_num_threads(tc.num_threads)
    seed_everything(tc.seed)

    # Rank 0 trains the tokenizer and fills the cache; the others then read it. A resumed run keeps
    # the tokenizer its weights were trained with, even if --force changed what would train another.
    tokenizer = _load_tokenizer(resume_dir.parent.parent) if resume_dir is not None else None
    needed = ("test",) if tc.test_at_end else ()  # refused now rather than after training
    if rt.is_main:
        data = prepare_train_data(cfg.data, tc.seed, tokenizer, needed)
    rt.barrier()
    if not rt.is_main:
        data = prepare_train_data(cfg.data, tc.seed, tokenizer, needed)

    # The run's config says what it validated on ("" = a part held out of train), whatever the dataset
    # gains later: resume compares it, and `tfm evaluate --split validation` reads it.
    cfg = cfg.replace(data={"val_split": data.val_split})
    vocab_size = data.tokenizer.get_vocab_size()
    model = CTransformer(cfg.model, vocab_size, cfg.data.max_length, len(data.labels)).to(rt.device)
    torch.manual_seed(tc.seed + rt.rank)  # dropout streams differ per rank; init is identical
    optimizer = make_optimizer(model, tc, rt.device)
    scaler = rt.grad_scaler()
    ema = Ema(model, tc.ema_decay) if tc.ema_decay > 0 else None
    state = TrainState()
    if resume_dir is not None:
        state = _restore(resume_dir, cfg, rt, model, optimizer, scaler, ema, force)
    if rt.is_main:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"cannot create output directory '{out}' ({e.strerror}); choose another --output-dir")
        ckpt.remove_stale_temp_files(out)  # checkpoints/.step-* leftovers go with the next checkpoint
        ckpt.save_model_files(out, cfg.to_dict(), data.tokenizer.to_str(), data.labels, vocab_size)
    engine: torch.nn.Module = model
    if tc.compile:
        engine = torch.compile(engine)
    if rt.distributed:
        from torch.nn.parallel import DistributedDataParallel

        engine = DistributedDataParallel(engine, device_ids=[rt.device.index] if rt.device.type == "cuda" else None)
    return Run(cfg, rt, out, model, engine, optimizer, scaler, data.train, data.val, data.labels, state, ema)


def _restore(path: Path, cfg: Config, rt: Runtime, model, optimizer, scaler, ema: Ema | None,
             force: bool) -> TrainState:
    train_json, tensors = ckpt.load_checkpoint(path)
    _check_resume_config(train_json["config"], cfg, rt.world_size, train_json.get("world_size", 1), force)
    ckpt.load_weights(model, path / ckpt.MODEL_FILE)
    try:
        # The optimizer's state comes from the checkpoint; its settings (weight decay, betas, each
        # group's lr_scale) stay this run's, which differ from the checkpoint's only under --force.
        settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        optimizer.load_state_dict(tensors["optimizer"])
        for group, own in zip(optimizer.param_groups, settings, strict=True):
            group.update(own)
        scaler.load_state_dict(tensors["scaler"])
        if ema is not None:  # a run that had no average (ema_decay turned on by --force) starts one here
            for s, saved in zip(ema.shadow, tensors.get("ema", ema.params), strict=True):
                s.copy_(saved)
        rng = tensors["rng"][rt.rank] if rt.rank < len(tensors["rng"]) else tensors["rng"][0]
        _set_rng_state(train_json["rng"][min(rt.rank, len(train_json["rng"]) - 1)], rng)
    except (KeyError, ValueError, RuntimeError, IndexError) as e:
        raise TfmError(f"checkpoint '{path}' does not fit this model/optimizer ({e})") from None
    return TrainState(**train_json["state"])


def save_checkpoint(run: Run) -> Path | None:
    """All ranks gather their RNG states; rank 0 writes checkpoints/step-N."""
    json_rng, tensor_rng = _rng_state()
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
        path = ckpt.save_checkpoint(run.out, run.state.step, run.model, train_json, tensors, run.cfg.train.keep_checkpoints)
    run.rt.barrier()
    return path


# --------------------------------------------------------------------------- fit


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


def step_groups(batches: list[np.ndarray], accum: int) -> list[list[np.ndarray]]:
    return [batches[i : i + accum] for i in range(0, len(batches), accum)]


def total_steps(run: Run, sampler: BucketSampler) -> int:
    per_epoch = len(step_groups(sampler.batches(0), run.cfg.train.grad_accum_steps))
    total = per_epoch * run.cfg.train.epochs
    return min(total, run.cfg.train.max_steps) if run.cfg.train.max_steps else total


def fit(run: Run, logger: Logger, progress: bool = True) -> None:
    tc, rt, st = run.cfg.train, run.rt, run.state
    micro = tc.batch_size // (tc.grad_accum_steps * rt.world_size)
    sampler = BucketSampler(run.train.lengths, micro * rt.world_size, tc.seed, True, rt.world_size, rt.rank)
    total = total_steps(run, sampler)
    if total == 0:
        raise TfmError(f"{len(run.train)} training examples make no full batch of {tc.batch_size}; lower --batch-size")
    bar = None
    if rt.is_main:
        _say(f"training {len(run.train)} reviews ({len(run.val)} validation) for {total} steps; batch {tc.batch_size} = "
             f"{micro} x {rt.world_size} process(es) x {tc.grad_accum_steps} accumulation; {rt.device}, {rt.precision}",
             progress)
    if progress and rt.is_main:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, initial=st.step, desc="train", unit="step", dynamic_ncols=True)
    params = [p for p in run.model.parameters() if p.requires_grad]
    window = {"samples": 0, "t0": time.perf_counter()}  # train/samples_per_sec, this process's steps only
    run.engine.train()
    t_start = time.perf_counter() - st.train_time_sec
    stopping = False
    with _StopFlag(run.out) as stop, contextlib.closing(bar) if bar is not None else contextlib.nullcontext():
        while st.step < total and st.epoch < tc.epochs:
            groups = step_groups(sampler.batches(st.epoch), tc.grad_accum_steps)
            while st.batch_in_epoch < len(groups) and st.step < total:
                group = groups[st.batch_in_epoch]
                lr = lr_at(st.step, total, tc)
                for g in run.optimizer.param_groups:
                    g["lr"] = lr * g.get("lr_scale", 1.0)
                loss_sum, objective_sum, n_samples = 0.0, 0.0, 0  # tensors after the first micro-batch
                in_step = sum(len(idx) for idx in group)
                for j, idx in enumerate(group):
                    ids, mask, y = rt.tensors(*collate(run.train, idx))
                    sync = run.engine.no_sync() if rt.distributed and j < len(group) - 1 else contextlib.nullcontext()
                    share = len(idx) / in_step  # the step's loss is the mean over its examples, whatever the
                    with sync, rt.autocast():  # sizes of its micro-batches (the epoch's last one may be short)
                        logits, objective = run.engine(ids, mask, y, tc.label_smoothing)
                        objective = objective * share
                    run.scaler.scale(objective).backward()
                    objective_sum = objective_sum + objective.detach()
                    # Logged as train/loss: the model's cross-entropy, the quantity val/loss measures.
                    loss_sum = loss_sum + F.cross_entropy(logits.detach().float(), y) * share
                    n_samples += len(idx) * rt.world_size
                objective_sum, loss_sum = torch.stack([objective_sum, loss_sum]).tolist()  # one device sync
                run.scaler.unscale_(run.optimizer)
                grad_norm = clip_grad_norm_(params, tc.grad_clip if tc.grad_clip > 0 else float("inf")).item()
                finite = math.isfinite(objective_sum) and (math.isfinite(grad_norm) or run.scaler.is_enabled())
                stopping = stop.signum is not None
                if rt.distributed:  # every rank must take the same decisions, or the next collective hangs
                    bad, stops, loss_sum = rt.all_sum([float(not finite), float(stopping), loss_sum])
                    finite, stopping, loss_sum = bad == 0, stops > 0, loss_sum / rt.world_size
                if finite:
                    run.scaler.step(run.optimizer)
                    if run.ema is not None:
                        run.ema.update(st.step)
                    st.bad_steps_in_row = 0
                else:
                    st.bad_steps_in_row += 1
                    st.bad_steps_total += 1
                run.scaler.update()
                run.optimizer.zero_grad(set_to_none=True)
                st.step += 1
                st.batch_in_epoch += 1
                if not finite:
                    logger.scalars(st.step, {"train/bad_steps": st.bad_steps_total})
                    if st.bad_steps_in_row >= tc.max_bad_steps:
                        raise TfmError(
                            f"training diverged: {st.bad_steps_in_row} steps in a row had a non-finite loss or gradient "
                            f"(at step {st.step}); lower --lr or raise train.grad_clip"
                        )
                else:
                    st.loss_since_log += loss_sum
                    st.steps_since_log += 1
                window["samples"] += n_samples
                st.samples_seen += n_samples
                if bar is not None:
                    bar.update(1)
                if st.step % tc.log_every == 0 or st.step == total:
                    _log_train(window, st, lr, grad_norm, logger, bar, run)
                # The last step of an epoch or of the run is validated and saved after this loop, once.
                last = st.batch_in_epoch == len(groups) or st.step >= total
                if tc.eval_every and st.step % tc.eval_every == 0 and not last:
                    with _untimed(window):
                        validate(run, logger)
                st.train_time_sec = time.perf_counter() - t_start
                if tc.checkpoint_every and st.step % tc.checkpoint_every == 0 and not last:
                    with _untimed(window):
                        save_checkpoint(run)
                if stopping and not last:
                    where = save_checkpoint(run)
                    raise Interrupted(stop.signum or signal.SIGTERM, where or run.out)
            if st.batch_in_epoch == len(groups):
                st.epoch += 1
                st.batch_in_epoch = 0
            with _untimed(window):
                validate(run, logger)
                st.train_time_sec = time.perf_counter() - t_start
                # A stop on the last step of an epoch or run, or during its validation, still gets
                # the validation and checkpoint first. The ranks agree before the checkpoint, so
                # that its barrier stays the epoch's last collective.
                stopping = stopping or stop.signum is not None
                if rt.distributed:
                    stopping = rt.all_sum([float(stopping)])[0] > 0
                where = save_checkpoint(run)
            if stopping:
                raise Interrupted(stop.signum or signal.SIGTERM, where or run.out)


def _say(message: str, progress: bool) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _untimed(window: dict):
    """Validation and checkpoints inside the loop: left out of train/samples_per_sec (they are in
    train_time_sec, the loop's wall time)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        window["t0"] += time.perf_counter() - t0


def _log_train(window: dict, st: TrainState, lr: float, grad_norm: float, logger: Logger, bar, run: Run) -> None:
    elapsed = time.perf_counter() - window["t0"]
    values = {"train/lr": lr, "train/grad_norm": grad_norm, "train/epoch": st.epoch,
              "train/batch_size": run.cfg.train.batch_size}
    if st.steps_since_log:
        values["train/loss"] = st.loss_since_log / st.steps_since_log
    if elapsed > 0:
        values["train/samples_per_sec"] = window["samples"] / elapsed
    logger.scalars(st.step, values)
    if bar is not None:
        bar.set_postfix(loss=f"{values.get('train/loss', float('nan')):.4f}", lr=f"{lr:.2e}",
                        sps=f"{values.get('train/samples_per_sec', 0):.0f}")
    st.loss_since_log, st.steps_since_log = 0.0, 0
    window.update(samples=0, t0=time.perf_counter())


def validate(run: Run, logger: Logger) -> dict:
    """Validation metrics; saves the weights (or their average) as the output's model when accuracy improves."""
    with run.ema.swapped_in() if run.ema is not None else contextlib.nullcontext():
        m = evaluate_model(run.model, run.val, run.rt, run.cfg.train.eval_batch_size, len(run.labels))
        logger.scalars(run.state.step, {"val/loss": m["loss"], "val/accuracy": m["accuracy"], "val/f1": m["f1"]})
        st = run.state
        weights_finite = all(torch.isfinite(p).all() for p in run.model.parameters())
        if weights_finite and math.isfinite(m["loss"]) and m["accuracy"] > st.best_val_accuracy:
            st.best_val_accuracy, st.best_step, st.best_val = m["accuracy"], st.step, m
            if run.rt.is_main:
                ckpt.atomic_write_bytes(run.out / ckpt.MODEL_FILE, ckpt.state_bytes(run.model))
    return m


# --------------------------------------------------------------------------- the command


def train(cfg: Config, resume: bool | str = False, force: bool = False, progress: bool = True) -> dict:
    """Run `tfm train`: returns the metrics that are also written to metrics.json."""
    rt = make_runtime(cfg.train.device, cfg.train.precision)
    try:
        run = setup(cfg, rt, resume, force)
        logger = Logger(run.out, rt, purge_step=run.state.step + 1 if resume else None)
        try:
            fit(run, logger, progress)
            metrics = finish(run, logger)
        finally:
            logger.close()
        return metrics
    finally:
        # The DDP wrapper holds the process group, and modules with hooks sit in reference cycles:
        # free them before the group is destroyed. Left to the interpreter's exit, a gloo rank
        # aborted there now and then ("terminate called without an active exception", no Python
        # frame left): 2 of 35 two-process runs without this collection, none of 45 with it.
        run = None
        if rt.distributed:
            gc.collect()
        shutdown(rt)


def finish(run: Run, logger: Logger) -> dict:
    st, tc = run.state, run.cfg.train
    if st.best_step < 0:
        raise TfmError("training diverged: no validation pass had finite weights and loss, so no model was saved; "
                       "lower --lr and train into a new --output-dir")
    metrics = {
        "best_step": st.best_step,
        "steps": st.step,
        "epochs": st.epoch,
        "train_time_sec": st.train_time_sec,
        "samples_per_sec": st.samples_seen / st.train_time_sec if st.train_time_sec > 0 else 0.0,
        "bad_steps": st.bad_steps_total,
        "precision": run.rt.precision,
        "device": str(run.rt.device),
        "world_size": run.rt.world_size,
        "num_params": run.model.num_params(),
        "val": st.best_val,
    }
    if tc.test_at_end:
        from transformer_cli.data import prepare_eval_data

        tokenizer = _load_tokenizer(run.out)
        ckpt.load_weights(run.model, run.out / ckpt.MODEL_FILE)
        test = prepare_eval_data(run.cfg.data, tokenizer, "test", run.cfg.data.max_eval_samples)
        metrics["test"] = evaluate_model(run.model, test, run.rt, tc.eval_batch_size, len(run.labels))
        logger.scalars(st.step, {"test/accuracy": metrics["test"]["accuracy"], "test/loss": metrics["test"]["loss"]})
    hp = {f"{s}.{k}": v for s, sec in run.cfg.to_dict().items() for k, v in sec.items() if v is not None}
    final = {"hparam/val_accuracy": st.best_val.get("accuracy", 0.0), "hparam/val_loss": st.best_val.get("loss", 0.0)}
    if "test" in metrics:
        final["hparam/test_accuracy"] = metrics["test"]["accuracy"]
    logger.hparams(hp, final, st.step)
    if run.rt.is_main:
        ckpt.write_json(run.out / ckpt.METRICS_FILE, metrics)
    return metrics


def _load_tokenizer(out: Path):
    """The tokenizer of the run in `out`; None if it has none (a checkpoint folder copied alone)."""
    from tokenizers import Tokenizer

    path = out / ckpt.TOKENIZER_FILE
    return Tokenizer.from_file(str(path)) if path.is_file() else None
