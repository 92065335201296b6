"""A run's setup and end: its output folder, resume from a checkpoint, the optimizer, and metrics.json."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import math
import os
from pathlib import Path

import torch

from transformer_cli import checkpoint as ckpt
from transformer_cli.card import write_card
from transformer_cli.config import FORMAT_VERSION, Config, TrainConfig, saved_config
from transformer_cli.errors import TfmError, UsageError
from transformer_cli.fileio import (
    atomic_write_bytes,
    atomic_write_text,
    check_output_path,
    read_json,
    remove_stale_temp_files,
    write_json,
)
from transformer_cli.runtime import Runtime, hardware, shutdown
from transformer_cli.training.loop import (
    Ema,
    Logger,
    Run,
    Task,
    TrainState,
    _set_rng_state,
    fit,
    make_sampler,
    seed_everything,
    selection_score,
    stop_reason,
    total_steps,
)

RESUME_FREE = {f"train.{k}" for k in ("output_dir", "log_every", "eval_batch_size", "test_at_end", "checkpoint_every",
                                      "device")}


def make_optimizer(model: torch.nn.Module, tc: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the model's parameter groups (weight decay on matrices only; layer-wise rates). On CPU and
    CUDA it uses torch's fused kernel, one pass over each tensor instead of foreach's several."""
    fused = device.type in ("cpu", "cuda")
    return torch.optim.AdamW(model.param_groups(tc.weight_decay, tc.layer_lr_decay), lr=tc.lr, betas=(0.9, tc.beta2),
                             fused=fused, foreach=None if fused else True)


def run_config(folder: Path) -> dict | None:
    """The config.json of a tfm run in `folder` (this format, with its sections); None if there is none,
    it is unreadable, or it is another program's."""
    try:
        meta = read_json(folder / ckpt.CONFIG_FILE, "config")
    except (TfmError, OSError):
        return None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        return None
    return meta if isinstance(meta.get("train"), dict) else None


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
    check_output_path(out, "output directory", folder=True, hint="choose another --output-dir")
    if rt.is_main:
        lock_output_dir(out)
    check_output_dir(out, resume, pretraining)
    resume_dir = find_resume(out, resume)
    if resume_dir is not None:
        check_run_kind(resume_dir.parent.parent, pretraining)
    check_batch_size(tc, rt)
    seed_everything(tc.seed)
    return resume_dir


_locks: dict[Path, tuple[int, bool]] = {}  # output directory -> (its locked descriptor, whether this run made it)


def lock_output_dir(out: Path) -> None:
    """Hold an exclusive lock on the output directory until the run ends (release_output_dirs), made if need
    be: a second run into it, started at the same moment or later, is refused before it writes anything."""
    made = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot create output directory '{out}' ({e.strerror}); choose another --output-dir") \
            from None
    fd = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise TfmError(f"output directory '{out}' is in use by another tfm run; wait for it to end, or choose "
                       "another --output-dir") from None
    _locks[out] = (fd, made)


def release_output_dirs() -> None:
    """Release this process's output-directory locks; a directory made for a run that then wrote nothing goes."""
    for out, (fd, made) in list(_locks.items()):
        os.close(fd)
        if made:
            with contextlib.suppress(OSError):
                out.rmdir()  # only if empty
        del _locks[out]


def disk_full(e: OSError, run: Run | None) -> TfmError:
    """The one-line error of a full disk: which file, what is safe, and how to go on."""
    where = f" writing '{e.filename}'" if e.filename else ""
    found = ckpt.checkpoint_dirs(run.out) if run is not None else []
    if found:
        safe = f"the last complete checkpoint, '{found[-1]}', is intact: free some space, then run the same command " \
               "with --resume"
    else:
        safe = "no checkpoint was written yet: free some space, then run the same command again"
    return TfmError(f"no space left on device{where}; {safe}")


def check_batch_size(tc: TrainConfig, rt: Runtime) -> None:
    per_rank, rem = divmod(tc.batch_size, tc.grad_accum_steps * rt.world_size)
    if rem or per_rank == 0:
        raise UsageError(
            f"train.batch_size = {tc.batch_size} must be a multiple of grad_accum_steps x processes "
            f"= {tc.grad_accum_steps} x {rt.world_size}"
        )


def _check_resume_config(saved: dict, cfg: Config, world_size: int, saved_world: int, force: bool) -> list[str]:
    """The settings (SECTION.KEY) that differ from the checkpoint's; refused unless `force`."""
    now, saved = cfg.to_dict(), saved_config(saved, "the checkpoint")

    def matters(section: str, key: str) -> bool:
        return f"{section}.{key}" not in RESUME_FREE

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
    saved_decay = train_json["config"].get("train", {}).get("layer_lr_decay", 1.0)
    if (saved_decay == 1.0) != (cfg.train.layer_lr_decay == 1.0):  # at 1.0 the optimizer has no groups per layer
        raise UsageError(f"train.layer_lr_decay changed from {saved_decay!r} to {cfg.train.layer_lr_decay!r}, which "
                         "splits the optimizer into groups per layer or joins them, and the checkpoint's optimizer "
                         "state does not fit; --force accepts a change only between rates below 1: start a new run "
                         "(another --output-dir) for this")
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
    if "train.time_budget" in changed:  # another budget (--force): the run goes on until that one is spent
        state.out_of_time = False
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
            metrics = finish(run, logger)
            if rt.is_main:  # config.json says how long the run trained: a time budget decides it only at run time
                meta = read_json(run.out / ckpt.CONFIG_FILE, "config")
                write_json(run.out / ckpt.CONFIG_FILE, {**meta, "steps": run.state.step})
                write_card(run.out)
            return metrics
        finally:
            logger.close()
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        raise disk_full(e, run) from None
    finally:
        release_output_dirs()
        # The DDP wrapper holds the process group, and modules with hooks sit in reference cycles:
        # free them before the group is destroyed. Left to the interpreter's exit, a gloo rank
        # aborted there now and then ("terminate called without an active exception").
        run = None
        if rt.distributed:
            gc.collect()
        shutdown(rt)



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
        "hardware": hardware(),
        "world_size": run.rt.world_size,
        "num_params": sum(p.numel() for p in run.model.parameters()),
        "num_train": run.task.num_train,
        "num_val": run.task.num_val,
        "select_metric": run.task.select_metric,
        "stopped_early": reason == "patience",
        "stop_reason": reason,
        "val": st.best_val,
    }
