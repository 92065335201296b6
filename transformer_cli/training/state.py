"""What a run carries from step to step and across a resume: its state, the weight average, the random
generators' states, and its TensorBoard logger."""

from __future__ import annotations

import contextlib
import math
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from transformer_cli.runtime import Runtime

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
    out_of_time: bool = False  # train.time_budget ended the run

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
