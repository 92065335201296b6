"""Storage of a run: its weights, the model directory's files, and resumable training checkpoints.

Files are written atomically (fileio), so a reader sees the old file or the new one, never half of
one. A training checkpoint is a folder `checkpoints/step-NNNNNNNN/` that counts only once its
`COMPLETE` marker exists. Nothing here unpickles: weights are safetensors, metadata JSON,
optimizer state `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load, load_file, save

from transformer_cli.config import FORMAT_VERSION, PRETRAINED_KIND
from transformer_cli.errors import TfmError, UsageError, first_line
from transformer_cli.fileio import (
    atomic_write_bytes,
    atomic_write_text,
    fsync_dir,
    read_json,
    write_json,
)

MODEL_FILE, CONFIG_FILE = "model.safetensors", "config.json"
TOKENIZER_FILE, METRICS_FILE = "tokenizer.json", "metrics.json"
CKPT_DIR, COMPLETE = "checkpoints", "COMPLETE"
BEST_FILE = "best.safetensors"  # in a checkpoint: the output's model (the best so far) when it was written

_STEP_DIR = re.compile(r"^step-(\d{8})$")


# --------------------------------------------------------------------------- weights


def state_bytes(model) -> bytes:
    return save({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()})


def load_weights(model, path: Path, prefix: str = "") -> None:
    """Load safetensors weights into `model`, refusing any name or shape mismatch. With `prefix`, the
    file's tensors named PREFIX... (e.g. "encoder.": a pretrained encoder) load into `model` alone."""
    model.load_state_dict(checked_weights(path, model.state_dict(), prefix))


def checked_weights(path: Path, expected: dict[str, torch.Tensor], prefix: str = "",
                    data: bytes | None = None) -> dict[str, torch.Tensor]:
    """The tensors of safetensors file `path` (those named PREFIX..., the prefix removed), refused in one
    line unless they have exactly the names and shapes of the state dict `expected`. `data`: the file's
    bytes, read already by a caller that copies them, so that what it copies is what was checked."""
    try:
        found = load_file(str(path)) if data is None else load(data)
        tensors = {k.removeprefix(prefix): v for k, v in found.items() if k.startswith(prefix)}
    except FileNotFoundError:
        raise TfmError(f"weights file '{path}' is missing") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise TfmError(f"weights file '{path}' is damaged or not safetensors ({e})") from None
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise TfmError(
            f"weights in '{path}' do not match the config (missing {missing[:3]}, unexpected {unexpected[:3]}); "
            "the checkpoint comes from another model or version"
        )
    for name, t in tensors.items():
        if t.shape != expected[name].shape:
            raise TfmError(
                f"weights in '{path}' do not match the config: {name} has shape {tuple(t.shape)}, "
                f"config gives {tuple(expected[name].shape)}"
            )
    return tensors


# --------------------------------------------------------------------------- the model directory


def model_files(cfg_dict: dict, tokenizer_json: str, vocab_size: int, **meta) -> dict[str, str]:
    """{name: text} of config.json and tokenizer.json: everything besides the weights that loading a
    model needs. `meta` adds fields to config.json (a classifier's `labels`, say)."""
    config = {"format_version": FORMAT_VERSION, **meta, "vocab_size": vocab_size, **cfg_dict}
    return {CONFIG_FILE: json.dumps(config, indent=2) + "\n", TOKENIZER_FILE: tokenizer_json}


def read_tokenizer(path: Path):
    """The `tokenizers.Tokenizer` saved in `path` (a tokenizer.json), refused in one line if unreadable."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 (tokenizers raises a bare Exception for a damaged file)
        why = f"tokenizer '{path}' is unreadable ({e}); write it again with the command that made it"
        raise TfmError(why) from None


def refuse_pretrained_encoder(folder: Path, meta: object = None, then: str = "") -> None:
    """Where a classifier's directory is expected: refuse, in one line, the output of `tfm pretrain` (its
    config.json's "kind"). `meta`: that config.json if already read, else it is read here if there."""
    if meta is None:
        path = Path(folder) / CONFIG_FILE
        meta = read_json(path, "config") if path.is_file() else None
    if isinstance(meta, dict) and meta.get("kind") == PRETRAINED_KIND:
        raise UsageError(f"'{folder}' holds a pretrained encoder written by `tfm pretrain`, not a classifier; "
                         f"fine-tune a classifier from it with `tfm train --init-from {folder}`{then}")


def save_model_files(out: Path, cfg_dict: dict, tokenizer_json: str, labels: list[str], vocab_size: int) -> None:
    """config.json and tokenizer.json of a classifier."""
    for name, text in model_files(cfg_dict, tokenizer_json, vocab_size, labels=labels).items():
        atomic_write_text(out / name, text)


# --------------------------------------------------------------------------- training checkpoints


def checkpoint_dirs(out: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(out) / CKPT_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / COMPLETE).is_file()]
    return sorted(found, key=lambda p: p.name)


def save_checkpoint(out: Path, step: int, model, train_state: dict, tensors_state: dict, keep: int,
                    best: Path | None = None) -> Path:
    """Write checkpoints/step-N atomically (temp folder, fsync, marker, rename), with the file `best`
    (the best model so far) as BEST_FILE; remove checkpoints of later steps (a run resumed from an
    earlier one has left their trajectory), then prune to `keep`."""
    root = Path(out) / CKPT_DIR
    final = root / f"step-{step:08d}"
    tmp = root / f".step-{step:08d}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        atomic_write_bytes(tmp / MODEL_FILE, state_bytes(model))
        buf = io.BytesIO()
        torch.save(tensors_state, buf)
        atomic_write_bytes(tmp / "state.pt", buf.getvalue())
        if best is not None and Path(best).is_file():
            try:  # a hard link: the model file is replaced, never rewritten in place, so the link keeps it
                os.link(best, tmp / BEST_FILE)
            except OSError:
                atomic_write_bytes(tmp / BEST_FILE, Path(best).read_bytes())
        write_json(tmp / "trainer.json", train_state)
        atomic_write_text(tmp / COMPLETE, f"{step}\n")
        # Later steps belong to a run this one left (it resumed from an earlier checkpoint): they go before
        # this one appears, so that a kill in between resumes from this run's own checkpoints.
        for later in [p for p in checkpoint_dirs(out) if p.name > final.name]:
            _remove(later)
        if final.exists():
            _remove(final)
        os.replace(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in checkpoint_dirs(out)[:-keep]:
        _remove(old)
    for stale in root.glob(".step-*"):  # temp and half-removed folders of killed runs
        shutil.rmtree(stale, ignore_errors=True)
    return final


def _remove(folder: Path) -> None:
    """Rename out of the step-N namespace first (atomic), so a kill never leaves half a checkpoint."""
    doomed = folder.with_name(f".{folder.name}.old-{os.getpid()}")
    os.replace(folder, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def load_checkpoint(path: Path) -> tuple[dict, dict]:
    """(trainer.json, tensor state) of a complete checkpoint; the weights are read separately."""
    path = Path(path)
    if not (path / COMPLETE).is_file():
        raise TfmError(f"'{path}' is not a complete checkpoint (no {COMPLETE} marker); pick another one")
    train_state = read_json(path / "trainer.json", "checkpoint state")
    try:
        tensors_state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError, ValueError) as e:
        raise TfmError(f"refusing to load '{path / 'state.pt'}': {first_line(e)}") from None
    return train_state, tensors_state
